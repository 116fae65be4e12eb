"""The contract between the trial protocol and what a trial trains: a *target*.

The trial protocol (:mod:`oomtune.trial.runner`, :mod:`oomtune.trial.child`) knows this module
only; the targets (:mod:`oomtune.targets`: ``builtin``, ``python``, ``cmd``) implement it and
import the trial layer, never the other way round (the pattern of Optuna's
``storages/_base.py``: one contract, one module per backend).

A target is one of two kinds:

- **in-process** (``own_process = False``): oomtune's trial process (:mod:`oomtune.trial.child`)
  builds the workload with :meth:`Target.build_workload` and runs the steps itself (built-in
  workloads, the user's ``make_workload``);
- **own-process** (``own_process = True``): the target's program *is* the trial process and
  :meth:`Target.run` launches it and returns its record (``target=cmd``).

Which implementation serves a trial is named by ``TrialSpec.workload["target"]["name"]``
(``builtin`` when absent) and looked up, at run time, through ``get_target(name)`` of the package
:data:`TARGETS_PACKAGE`; a new target is one module there plus its name in that package's table.

Thread and process safety: a :class:`Target` holds no per-trial state; the runner may call
:meth:`Target.run` from several threads at once.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

from oomtune.exceptions import ConfigError

__all__ = ["Target", "TARGETS_PACKAGE", "target_for", "target_name"]

#: The package whose ``get_target(name) -> Target`` resolves target names (imported by name, so
#: the trial layer has no import-time dependency on the targets).
TARGETS_PACKAGE = "oomtune.targets"


class Target:
    """What a trial trains. Subclasses set :attr:`name` and :attr:`own_process` and implement
    :meth:`build_workload` (in-process) or :meth:`run` (own-process)."""

    #: The ``target.name`` this implementation serves.
    name: str = ""
    #: True when the target's own program is the trial process (:meth:`run`).
    own_process: bool = False

    def distributed(self, workload: Mapping[str, Any]) -> bool:
        """Whether ``workload`` trains under a data-parallel strategy whose ranks the trial process
        starts (:mod:`oomtune.trial.ranks`), also with one rank. Default: False."""
        return False

    def validate(self, target_cfg: Mapping[str, Any]) -> None:
        """Check the ``target`` group without running anything.

        Raises:
            ConfigError: the first problem, in one line.
        """

    def shapes(self, workload: Mapping[str, Any]) -> Any:
        """The workload's per-step shape distribution (:class:`oomtune.workloads.shapes.
        ShapeDistribution`); fixed (no key) by default.

        Raises:
            ConfigError: a malformed distribution.
        """
        from oomtune.workloads.shapes import ShapeDistribution

        return ShapeDistribution(None, "fixed", ())

    def at_shape(self, workload: Mapping[str, Any], shape: Any) -> dict[str, Any]:
        """A copy of ``workload`` whose every step has ``shape`` (the soak's captures, a confirmation
        at the worst shape); the workload itself by default (fixed shapes)."""
        return dict(workload)

    def label(self, workload: Mapping[str, Any]) -> str:
        """What is trained, in a few words for headers (e.g. ``resnet``, ``python entry f.py:fn``)."""
        return self.name

    def check_training(self, workload: Mapping[str, Any], *, accumulates: bool, checkpointing: bool) -> None:
        """Check, before any trial, that the search's training settings reach what the trial trains:
        ``accumulates`` (a global batch: micro-batches per optimizer step vary) and ``checkpointing``
        (activation checkpointing searched). Default: nothing to check.

        Raises:
            ConfigError: a setting the target cannot apply, in one line with the fix.
        """

    def build_workload(self, workload: Mapping[str, Any], batch_size: int, device: Any) -> Any:
        """The :class:`oomtune.workloads.Workload` a trial process trains at ``batch_size`` on
        ``device`` (a ``torch.device`` or its string). Called inside the trial process only.

        Raises:
            ConfigError: an own-process target (it never runs inside oomtune's trial process), or
                what the builder raises for bad input.
        """
        raise ConfigError(f"target={self.name} runs as its own process, not inside a trial process")

    def run(self, spec: Any, *, workdir: Path, env: dict[str, str] | None = None, grace_s: float = 3.0,
            on_start: Callable[[int], None] | None = None) -> Any:
        """Run one trial of an own-process target and return its ``TrialResult``; never raises for
        a trial failure. ``on_start`` receives the process group id right after the start (so that
        a runner's ``kill_all`` reaches it).

        Raises:
            ConfigError, AllocatorConfigError: bad input (nothing launched).
        """
        raise NotImplementedError(f"target={self.name} runs inside oomtune's trial process")


def target_name(workload: Mapping[str, Any]) -> str:
    """``workload["target"]["name"]``; ``"builtin"`` when absent (unchecked)."""
    target = workload.get("target")
    return str(target.get("name", "builtin")) if isinstance(target, Mapping) else "builtin"


def target_for(workload: Mapping[str, Any]) -> Target:
    """The :class:`Target` serving ``workload`` (see the module docstring).

    Raises:
        ConfigError: an unknown target name.
    """
    return importlib.import_module(TARGETS_PACKAGE).get_target(target_name(workload))
