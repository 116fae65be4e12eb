"""What a trial trains: the ``target`` config group.

- ``builtin``: a built-in workload from the ``model`` group (:func:`oomtune.workloads.build_workload`).
- ``python``: the user's ``make_workload`` function (:mod:`oomtune.targets.python_entry`), run by the
  same trial process as the built-in workloads.
- ``cmd``: any training command (:mod:`oomtune.targets.cmd`), results reported with
  :func:`oomtune.report`.

``TrialSpec.workload`` holds the ``model`` group's keys plus ``workload["target"]`` (this group);
an absent target means ``builtin``. The trial process calls :func:`build_trial_workload`; the runner
sends ``cmd`` trials to :func:`run_cmd_trial` instead of a trial process. Submodules are imported
lazily: importing this package does not import torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from oomtune.exceptions import ConfigError

__all__ = ["TARGET_NAMES", "target_config", "target_name", "validate_target", "build_trial_workload",
           "run_cmd_trial"]

TARGET_NAMES = ("builtin", "python", "cmd")


def target_config(workload: Mapping[str, Any]) -> dict[str, Any]:
    """``workload["target"]`` as a dict; ``{"name": "builtin"}`` when absent."""
    target = workload.get("target")
    return dict(target) if isinstance(target, Mapping) else {"name": "builtin"}


def target_name(workload: Mapping[str, Any]) -> str:
    """``"builtin"``, ``"python"`` or ``"cmd"`` (unchecked; see :func:`validate_target`)."""
    return str(target_config(workload).get("name", "builtin"))


def validate_target(target: Mapping[str, Any]) -> None:
    """Check the ``target`` group without running anything: a known name, a command for ``cmd``
    (parsable, cwd exists), an importable entry function for ``python``.

    Raises:
        ConfigError: the first problem, in one line.
    """
    name = target.get("name", "builtin")
    if name not in TARGET_NAMES:
        raise ConfigError(f"target={name!r}: choose one of {', '.join(TARGET_NAMES)}")
    if name == "cmd":
        from oomtune.targets.cmd import resolve_cwd, build_command

        build_command(dict(target), 1)
        resolve_cwd(dict(target))
    elif name == "python":
        from oomtune.targets.python_entry import load_entry

        load_entry(target.get("entry"))  # type: ignore[arg-type]


def build_trial_workload(workload: Mapping[str, Any], batch_size: int, device: Any) -> Any:
    """The :class:`oomtune.workloads.Workload` a trial process trains: the built-in one for
    ``builtin``, the user's (:func:`oomtune.targets.python_entry.build_user_workload`) for ``python``.

    Raises:
        ConfigError: a ``cmd`` target (it never runs inside a trial process), an unknown target, or
            what the builders raise.
    """
    target = target_config(workload)
    name = target.get("name", "builtin")
    if name == "python":
        from oomtune.targets.python_entry import build_user_workload

        return build_user_workload(target, batch_size, device)
    if name == "builtin":
        from oomtune.workloads import build_workload

        return build_workload(workload, batch_size, device)
    if name == "cmd":
        raise ConfigError("target=cmd runs as its own command (oomtune.targets.cmd.run_cmd_trial), "
                          "not inside a trial process")
    raise ConfigError(f"target={name!r}: choose one of {', '.join(TARGET_NAMES)}")


def __getattr__(name: str) -> Any:
    if name == "run_cmd_trial":
        from oomtune.targets.cmd import run_cmd_trial

        return run_cmd_trial
    raise AttributeError(f"module 'oomtune.targets' has no attribute {name!r}")
