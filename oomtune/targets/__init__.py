"""What a trial trains: the ``target`` config group.

- ``builtin``: a built-in workload from the ``model`` group (:func:`oomtune.workloads.build_workload`).
- ``python``: the user's ``make_workload`` function (:mod:`oomtune.targets.python_entry`), run by the
  same trial process as the built-in workloads.
- ``cmd``: any training command (:mod:`oomtune.targets.cmd`), results reported with
  :func:`oomtune.report`.

``TrialSpec.workload`` (a :class:`oomtune.workload_spec.WorkloadSpec`) holds the ``model`` group's
keys and ``target`` (this group); an absent target means ``builtin``. Each target is one module
whose ``TARGET`` implements the trial protocol's contract (:class:`oomtune.trial._base.Target`) and
is registered there when the module is imported (:func:`oomtune.trial._base.register_target`);
importing this package registers all three (the ``oomtune`` package does, as the composition
root). The trial process builds in-process targets' workloads, the runner hands own-process targets
(``cmd``) their trial. This package imports the trial layer, never the reverse. The registering
modules are light (the heavy ones, :mod:`~oomtune.targets.python_entry` and
:mod:`~oomtune.targets.cmd`, are imported when used): importing this package does not import torch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from oomtune.trial._base import Target, target_names
from oomtune.workload_spec import WorkloadSpec
from oomtune.trial._base import get_target as _get_target
from oomtune.trial._base import target_name as _base_target_name
# each registers its TARGET (oomtune.trial._base.register_target): the order is TARGET_NAMES'
from oomtune.targets import builtin as _builtin, python_target as _python, cmd_target as _cmd  # noqa: E402,F401

__all__ = ["TARGET_NAMES", "target_config", "target_name", "validate_target", "resolve_target",
           "resolve_workload", "build_trial_workload", "run_cmd_trial", "get_target"]

#: The registered target names (``builtin``, ``python``, ``cmd``).
TARGET_NAMES = target_names()


def target_config(workload: Mapping[str, Any]) -> dict[str, Any]:
    """``workload["target"]`` as a dict; ``{"name": "builtin"}`` when absent."""
    target = workload.get("target")
    return dict(target) if isinstance(target, Mapping) else {"name": "builtin"}


def target_name(workload: Mapping[str, Any]) -> str:
    """``"builtin"``, ``"python"`` or ``"cmd"`` (unchecked; see :func:`validate_target`)."""
    return _base_target_name(workload)


def get_target(name: str) -> Target:
    """The registered :class:`oomtune.trial._base.Target` implementing ``target=name``.

    Raises:
        ConfigError: an unknown name.
    """
    return _get_target(name)


def validate_target(target: Mapping[str, Any]) -> None:
    """Check the ``target`` group without running anything: a known name; for ``cmd`` a non-empty
    command whose only placeholder is ``{batch_size}``, whose program exists (on ``PATH``, or as an
    executable file relative to ``target.cwd``; not checked for commands run through ``/bin/sh``)
    and whose cwd exists; for ``python`` an importable entry function (a relative file path is
    taken from the current directory, as :func:`resolve_target` does).

    Raises:
        ConfigError: the first problem, in one line.
    """
    get_target(target.get("name", "builtin")).validate(target)


def resolve_target(target_cfg: Mapping[str, Any], *, cwd: Path | None = None) -> dict[str, Any]:
    """A copy of the ``target`` group whose paths no longer depend on the working directory, for
    trials that run elsewhere (each trial process runs in its own trial directory).

    - ``python`` with a file entry (``path/to/file.py:function``): the file made absolute, relative
      to ``cwd``; module entries (``pkg.mod:function``) are unchanged.
    - ``cmd``: ``cwd`` made absolute, relative to ``cwd``; unset means ``cwd`` itself (the directory
      :func:`oomtune.targets.cmd.run_cmd_trial` inherits today when ``target.cwd`` is null), so
      relative paths in the command keep meaning what they mean on the user's command line.
    - ``builtin`` and unknown names: a plain copy.

    Nothing is checked here (see :func:`validate_target`); the result validates the same way.

    Args:
        target_cfg: the ``target`` group as a mapping.
        cwd: the directory relative paths are taken from; default ``os.getcwd()``.
    """
    from oomtune.trial._base import find_target

    base = Path(cwd) if cwd is not None else Path(os.getcwd())
    target = find_target(target_cfg.get("name", "builtin"))
    return target.resolve_paths(target_cfg, base) if target is not None else dict(target_cfg)


def is_file_entry(where: str) -> bool:
    """Whether the part of a python entry before ``:function`` names a file (ends with ``.py`` or
    holds a path separator) rather than a module."""
    return where.endswith(".py") or "/" in where or "\\" in where


def resolve_workload(workload: Mapping[str, Any], *, cwd: Path | None = None) -> dict[str, Any]:
    """A copy of a trial workload (``model`` keys + ``target``) with every user path made absolute:
    the target (:func:`resolve_target`), ``data.path`` and ``seq_len.tokens`` of a built-in workload,
    relative to ``cwd`` (default ``os.getcwd()``)."""
    out = dict(workload)
    if isinstance(workload.get("target"), Mapping):
        out["target"] = resolve_target(workload["target"], cwd=cwd)
    data = workload.get("data")
    if isinstance(data, Mapping) and isinstance(data.get("path"), str) and data["path"]:
        base = Path(cwd) if cwd is not None else Path(os.getcwd())
        out["data"] = {**data, "path": _absolute(data["path"], base)}
    seq_len = workload.get("seq_len")   # a token file's document lengths (oomtune.workloads.shapes)
    if isinstance(seq_len, Mapping) and isinstance(seq_len.get("tokens"), str) and seq_len["tokens"]:
        base = Path(cwd) if cwd is not None else Path(os.getcwd())
        out["seq_len"] = {**seq_len, "tokens": _absolute(seq_len["tokens"], base)}
    return out


def _absolute(path: str, base: Path) -> str:
    """``path`` (``~`` expanded) as an absolute, normalised path; relative ones taken from ``base``."""
    p = Path(path).expanduser()
    return str((p if p.is_absolute() else base / p).resolve())


def build_trial_workload(workload: WorkloadSpec, batch_size: int, device: Any) -> Any:
    """The :class:`oomtune.workloads.Workload` a trial process trains: the built-in one for
    ``builtin``, the user's (:func:`oomtune.targets.python_entry.build_user_workload`) for ``python``.

    Raises:
        ConfigError: a ``cmd`` target (it never runs inside a trial process), an unknown target, or
            what the builders raise.
    """
    return get_target(workload.target_name).build_workload(workload, batch_size, device)


def __getattr__(name: str) -> Any:
    if name == "run_cmd_trial":
        from oomtune.targets.cmd import run_cmd_trial

        return run_cmd_trial
    raise AttributeError(f"module 'oomtune.targets' has no attribute {name!r}")
