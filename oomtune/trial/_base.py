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

Which implementation serves a trial is named by ``TrialSpec.workload.target_name``
(:data:`DEFAULT_TARGET` when a flat workload gives no target) and looked up in this module's
registry: each target module adds its instance with :func:`register_target` when imported, and the composition root (the
``oomtune`` package, :mod:`oomtune.__init__`) imports :mod:`oomtune.targets`, so the trial layer
never imports a target (the pattern of Optuna's ``storages/__init__.py``, which imports every
backend it offers). Code outside :mod:`oomtune.targets` asks the target what it can do (the
capability attributes and methods below: captured and predicted, the ``model`` group, the user's
code, ranks, files read, the soak, paths) and never compares its name.

Thread and process safety: a :class:`Target` holds no per-trial state; the runner may call
:meth:`Target.run` from several threads at once.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

from oomtune.exceptions import ConfigError
from oomtune.workload_spec import WorkloadSpec

__all__ = ["Target", "DEFAULT_TARGET", "register_target", "get_target", "find_target", "target_names",
           "target_for", "target_name", "worst_shape_workload", "worst_shape_spec"]

#: The target of a workload without a ``target`` group: a built-in workload of the ``model`` group.
DEFAULT_TARGET = "builtin"

#: name -> registered :class:`Target`, in registration order.
_REGISTRY: dict[str, "Target"] = {}


class Target:
    """What a trial trains. Subclasses set :attr:`name` and the capabilities below and implement
    :meth:`build_workload` (in-process) or :meth:`run` (own-process); the defaults describe a target
    that can do nothing beyond running its trials."""

    #: The ``target.name`` this implementation serves.
    name: str = ""
    #: True when the target's own program is the trial process (:meth:`run`).
    own_process: bool = False
    #: True when oomtune can capture the workload's step (on the meta device, else the CPU) and so
    #: predict it on the virtual GPU (search.prune=predicted, ``oomtune plan``, ``check --mode predict``).
    capturable: bool = False
    #: True when the ``model`` config group describes the workload (its keys enter the trial
    #: workload, the study name and best.yaml's ``workload.model``); False: only the target group does.
    uses_model_group: bool = False
    #: True when the workload is built by the user's code (its model, batches, step), not oomtune's.
    user_code: bool = False
    #: True when the target's own program starts the ranks of a trial of several GPUs (``torchrun``).
    starts_ranks: bool = False
    #: True when its trials record their allocation streams (:func:`oomtune.capture_hook`), from
    #: which the search predicts (:mod:`oomtune.plan.recorded`) what it cannot capture.
    records_streams: bool = False

    def distributed(self, workload: WorkloadSpec) -> bool:
        """Whether ``workload`` trains under a data-parallel strategy whose ranks the trial process
        starts (:mod:`oomtune.trial.ranks`), also with one rank. Default: False."""
        return False

    def reads_files(self, workload: WorkloadSpec) -> bool:
        """Whether the workload reads a data set from files (the meta device takes synthetic data
        only; captures of it are not cached). Default: False."""
        return False

    def can_soak(self, workload: WorkloadSpec) -> bool:
        """Whether the soak (:mod:`oomtune.trial.soak`) can capture this workload shape by shape: it
        has a shape distribution oomtune can set, and one process trains it. Default: False."""
        return False

    def for_capture(self, workload: WorkloadSpec) -> dict[str, Any]:
        """The flat workload mapping a capture builds (:meth:`build_workload` on meta or the CPU, read
        back with :meth:`WorkloadSpec.from_dict`); the workload's own flat form
        (:meth:`WorkloadSpec.to_dict`) by default."""
        return workload.to_dict()

    def resolve_paths(self, target_cfg: Mapping[str, Any], base: Path) -> dict[str, Any]:
        """A copy of the ``target`` group whose paths no longer depend on the working directory
        (relative ones taken from ``base``); a plain copy by default (nothing to resolve)."""
        return dict(target_cfg)

    def sources(self, target_cfg: Mapping[str, Any]) -> list[Path]:
        """The user's source files the target runs (a python entry's file, a command's script): their
        code, local imports, packages and the environment variables they name key the study name
        and the stream cache (:func:`oomtune.sources.fingerprint`). [] by default (oomtune's own
        code), and where no file is found (the target's checks say why)."""
        return []

    def validate(self, target_cfg: Mapping[str, Any]) -> None:
        """Check the ``target`` group without running anything.

        Raises:
            ConfigError: the first problem, in one line.
        """

    def inspect(self, target_cfg: Mapping[str, Any]) -> Any:
        """What the checks before any trial need from the user's code (for ``target=python``: the
        entry's parameter names), obtained by running it: called only in a process of its own
        (:func:`oomtune.plan.entry_check.check_user_code`). None by default (nothing to run).

        Raises:
            ConfigError: the code cannot be found or loaded. What the user's code raises propagates.
        """
        return None

    def warm(self) -> None:
        """Import oomtune's own modules that :meth:`inspect` needs (torch), in this process before it
        forks the inspecting one, so that the limit on that process times the user's code only.
        Nothing by default."""

    def inspected(self, target_cfg: Mapping[str, Any], facts: Any) -> None:
        """Keep :meth:`inspect`'s answer ``facts`` (made in another process) in this one."""

    def shapes(self, workload: WorkloadSpec) -> Any:
        """The workload's per-step shape distribution (:class:`oomtune.workloads.shapes.
        ShapeDistribution`); fixed (no key) by default.

        Raises:
            ConfigError: a malformed distribution.
        """
        from oomtune.workloads.shapes import ShapeDistribution

        return ShapeDistribution(None, "fixed", ())

    def at_shape(self, workload: WorkloadSpec, shape: Any) -> WorkloadSpec:
        """The spec of ``workload`` whose every step has ``shape`` (the soak's captures, a confirmation
        at the worst shape); ``workload`` itself by default (fixed shapes).

        Raises:
            ConfigError: as :meth:`shapes`; a shape above the distribution's largest.
        """
        return workload

    def worst_shape(self, workload: WorkloadSpec) -> Any:
        """The largest shape of :meth:`shapes` (what the search and plan predict at); None when fixed."""
        dist = self.shapes(workload)
        return None if dist.is_fixed else max(dist.support(), key=lambda v: -1 if v is None else v)

    def model_keys(self, model_cfg: Mapping[str, Any] | None) -> dict[str, Any] | None:
        """The ``model`` group's keys that describe this target's workload, without the target GPU
        (``gpu``, ``gpu_source``: :class:`oomtune.workload_spec.WorkloadSpec` holds it); None by
        default: the target group alone describes the workload (a python entry, a command).

        Raises:
            ConfigError: a model group the target needs but cannot read, in one line.
        """
        return None

    def workload_spec(self, target_cfg: Mapping[str, Any], model_cfg: Mapping[str, Any], *, gpus: int = 1,
                      base: Path | None = None) -> WorkloadSpec:
        """The :class:`oomtune.workload_spec.WorkloadSpec` of the config's ``target`` and ``model``
        groups, built once for ``oomtune search`` and ``oomtune plan``
        (:func:`oomtune.prepared.prepare`): the target group (its paths made absolute, relative to
        ``base``, when ``base`` is given: trials run in their own directories), the model keys
        (:meth:`model_keys`), the target GPU ``model.gpu`` (``auto`` by default; resolved later,
        once the device is known) and the ranks of ``trial.gpus`` (``gpus``). By default several
        ranks need a target whose program starts them (:attr:`starts_ranks`). Nothing is imported
        or run: the model and target are checked by the commands (:meth:`validate`,
        :func:`oomtune.workloads.validate_workload_config`).

        Raises:
            ConfigError: ``gpus`` > 1 for a target that cannot train several ranks, in one line.
        """
        if gpus > 1 and not self.starts_ranks:
            raise ConfigError(f"trial.gpus={gpus} with target={self.name}: several ranks per trial need "
                              "model.parallel=ddp|fsdp (built-in workloads) or target=cmd (a command that "
                              "starts its ranks, e.g. torchrun)")
        target = self.resolve_paths(target_cfg, base) if base is not None else dict(target_cfg)
        return WorkloadSpec(target=target, model=self.model_keys(model_cfg), gpu=str(model_cfg.get("gpu", "auto")),
                            ranks=gpus if gpus > 1 else None)

    def label(self, workload: WorkloadSpec) -> str:
        """What is trained, in a few words for headers (e.g. ``resnet``, ``python entry f.py:fn``)."""
        return self.name

    def check_training(self, workload: WorkloadSpec, *, accumulates: bool, checkpointing: bool) -> None:
        """Check, before any trial, that the search's training settings reach what the trial trains:
        ``accumulates`` (a global batch: micro-batches per optimizer step vary) and ``checkpointing``
        (activation checkpointing searched). Default: nothing to check.

        Raises:
            ConfigError: a setting the target cannot apply, in one line with the fix.
        """

    def build_workload(self, workload: WorkloadSpec, batch_size: int, device: Any) -> Any:
        """The :class:`oomtune.workloads.Workload` a trial process trains at ``batch_size`` on
        ``device`` (a ``torch.device`` or its string): ``workload`` as the trial process read it from
        its spec.json (:meth:`WorkloadSpec.from_dict`), or a capture's. Called inside the trial
        process (or a capture) only.

        Raises:
            ConfigError: an own-process target (it never runs inside oomtune's trial process), or
                what the builder raises for bad input.
        """
        raise ConfigError(f"target={self.name} runs as its own process, not inside a trial process")

    def run(self, spec: Any, *, workdir: Path, env: dict[str, str] | None = None, grace_s: float = 3.0,
            on_start: Callable[[int], None] | None = None, forks: Any = None) -> Any:
        """Run one trial of an own-process target and return its ``TrialResult``; never raises for
        a trial failure. ``on_start`` receives the process group id right after the start (so that
        a runner's ``kill_all`` reaches it). ``forks``: the runner's
        :class:`oomtune.trial.script_fork.ScriptServers` (None: the runner spawns every process).

        Raises:
            ConfigError, AllocatorConfigError: bad input (nothing launched).
        """
        raise NotImplementedError(f"target={self.name} runs inside oomtune's trial process")


def register_target(target: Target) -> Target:
    """Add ``target`` to the registry under ``target.name`` (a target module calls this when
    imported); returns it. Registering a name again replaces the entry (a reloaded module)."""
    if not target.name:
        raise ValueError("a Target needs a name to be registered")
    _REGISTRY[target.name] = target
    return target


def target_names() -> tuple[str, ...]:
    """The registered target names, in registration order."""
    return tuple(_REGISTRY)


def find_target(name: Any) -> Target | None:
    """The registered :class:`Target` called ``name``; None for an unknown name (unchecked input)."""
    return _REGISTRY.get(name) if isinstance(name, str) else None


def get_target(name: Any) -> Target:
    """The registered :class:`Target` called ``name``.

    Raises:
        ConfigError: an unknown name (one line listing the registered ones).
    """
    target = find_target(name)
    if target is None:
        raise ConfigError(f"target={name!r}: choose one of {', '.join(_REGISTRY)}")
    return target


def target_name(workload: Mapping[str, Any]) -> str:
    """``workload["target"]["name"]``; :data:`DEFAULT_TARGET` when absent (unchecked)."""
    target = workload.get("target")
    return str(target.get("name", DEFAULT_TARGET)) if isinstance(target, Mapping) else DEFAULT_TARGET


def target_for(workload: WorkloadSpec) -> Target:
    """The registered :class:`Target` serving ``workload`` (``workload.target_name``; see the module
    docstring).

    Raises:
        ConfigError: an unknown target name.
    """
    return get_target(workload.target_name)


def worst_shape_workload(workload: Mapping[str, Any]) -> Any:
    """:func:`worst_shape_spec` of a flat workload (the form a trial's spec.json carries, read with
    :meth:`WorkloadSpec.from_dict`): its flat form at the largest shape, or ``workload`` itself (the
    same object) when its shapes are fixed.

    Raises:
        ConfigError: as :func:`worst_shape_spec`; a workload :meth:`WorkloadSpec.from_dict` refuses.
    """
    spec = WorkloadSpec.from_dict(workload)
    worst = worst_shape_spec(spec)
    return workload if worst is spec else worst.to_dict()


def worst_shape_spec(workload: WorkloadSpec) -> WorkloadSpec:
    """``workload`` at its shape distribution's largest shape (:meth:`Target.worst_shape`; for a
    built-in workload :func:`oomtune.workloads.shapes.worst_shapes`): what the search's frontier and
    ``oomtune plan`` predict at (the same code for both). ``workload`` itself (the same object) when
    its shapes are fixed. The distribution and its shapes are the target's (:meth:`Target.shapes` /
    :meth:`Target.at_shape`: a python entry may declare one; a command's are not known).

    Raises:
        ConfigError: as :func:`oomtune.workloads.shapes.shape_distribution`.
    """
    target = target_for(workload)   # the distribution and its shapes are the target's (Target.shapes)
    if target.shapes(workload).is_fixed:
        return workload
    return target.at_shape(workload, target.worst_shape(workload))
