"""``target=python``: the user's ``make_workload`` function (:mod:`oomtune.targets.python_entry`,
which imports torch: this module, registered when :mod:`oomtune.targets` is imported, does not)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from oomtune.targets._entry_form import known_parameters, remember_parameters, split_entry
from oomtune.trial._base import Target, register_target
from oomtune.workload_spec import WorkloadSpec

__all__ = ["PythonTarget", "TARGET", "split_entry", "known_parameters"]

class PythonTarget(Target):
    """``target=python``: the user's ``make_workload`` function, trained inside oomtune's trial
    process (:func:`oomtune.targets.python_entry.build_user_workload`); captured like a built-in
    workload (meta device, else the CPU) under ``with torch.device(device)``."""

    name = "python"
    own_process = False
    capturable = True
    user_code = True

    def sources(self, target_cfg: Mapping[str, Any]) -> list[Path]:
        """The entry's file: ``path/to/file.py`` of ``path/to/file.py:fn`` (relative to the current
        directory), or the file of ``pkg.mod`` for ``pkg.mod:fn`` (:func:`_module_file`: found
        without importing the module or its parent packages); [] when there is none."""
        from oomtune.targets import is_file_entry

        entry = target_cfg.get("entry")
        if not isinstance(entry, str) or ":" not in entry:
            return []
        where = entry.rpartition(":")[0].strip()
        if is_file_entry(where):
            path = Path(where).expanduser().absolute()
            return [path] if path.is_file() else []
        origin = _module_file(where)
        return [] if origin is None else [origin]

    def validate(self, target_cfg: Mapping[str, Any]) -> None:
        """The entry's form only (:func:`split_entry`): importing its module runs the user's code,
        which the search and plan do in a process of their own (:meth:`inspect`,
        :func:`oomtune.plan.entry_check.check_user_code`); a function passed directly is accepted."""
        entry = target_cfg.get("entry")
        if not callable(entry) or isinstance(entry, str):
            split_entry(entry)

    def inspect(self, target_cfg: Mapping[str, Any]) -> frozenset[str] | None:
        """Import the entry (:func:`oomtune.targets.python_entry.load_entry`: this runs the user's
        module, so the caller runs it in a process of its own) and return its function's parameter
        names (None: no signature, a builtin).

        Raises:
            ConfigError: a module or file that cannot be found or imported, a missing or
                non-callable attribute (:func:`~oomtune.targets.python_entry.load_entry`). What the
                module raises while it runs propagates unchanged.
        """
        import inspect

        from oomtune.targets.python_entry import load_entry

        fn = load_entry(target_cfg.get("entry"))  # type: ignore[arg-type]
        try:
            return frozenset(inspect.signature(fn).parameters)
        except (TypeError, ValueError):  # builtins / C functions without a signature
            return None

    def warm(self) -> None:
        """Import :mod:`oomtune.targets.python_entry` (and torch with it): oomtune's code, not the
        user's."""
        import oomtune.targets.python_entry  # noqa: F401

    def inspected(self, target_cfg: Mapping[str, Any], facts: Any) -> None:
        """Keep what :meth:`inspect` found (in another process) for this process's checks
        (:func:`known_parameters`: does the function take ``activation_checkpointing``)."""
        entry = target_cfg.get("entry")
        if isinstance(entry, str):
            remember_parameters(entry, facts)

    def resolve_paths(self, target_cfg: Mapping[str, Any], base: Path) -> dict[str, Any]:
        """A file entry (``path/to/file.py:function``) made absolute; module entries unchanged."""
        from oomtune.targets import _absolute, is_file_entry

        out = dict(target_cfg)
        if isinstance(out.get("entry"), str):
            where, sep, func = out["entry"].rpartition(":")
            if sep and is_file_entry(where.strip()):
                out["entry"] = f"{_absolute(where.strip(), base)}:{func}"
        return out

    def shapes(self, workload: WorkloadSpec) -> Any:
        """The distribution the entry declares in its ``target`` group
        (:func:`oomtune.workloads.shapes.entry_shape_distribution`)."""
        from oomtune.workloads.shapes import entry_shape_distribution

        return entry_shape_distribution(workload.target)

    def can_soak(self, workload: WorkloadSpec) -> bool:
        """The entry declares a shape distribution (``target.seq_len`` / ``target.image_size``)."""
        return self.shapes(workload).key is not None

    def at_shape(self, workload: WorkloadSpec, shape: Any) -> WorkloadSpec:
        """The ``target`` group with its declared shape key set to ``shape``; ``workload`` itself
        when it declares none (or ``shape`` is None)."""
        from dataclasses import replace

        dist = self.shapes(workload)
        if shape is None or dist.key is None:
            return workload
        return replace(workload, target={**workload.target, dist.key: shape})

    def label(self, workload: WorkloadSpec) -> str:
        return f"python entry {workload.target.get('entry')}"

    def check_training(self, workload: WorkloadSpec, *, accumulates: bool, checkpointing: bool) -> None:
        """Activation checkpointing needs an ``activation_checkpointing`` parameter of the entry."""
        from oomtune.targets.python_entry import check_checkpointing_argument

        check_checkpointing_argument(workload.target, checkpointing)

    def build_workload(self, workload: WorkloadSpec, batch_size: int, device: Any) -> Any:
        """The user's ``make_workload`` with the training settings of ``workload.training``
        (``grad_accum``; ``activation_checkpointing`` passed only when set)."""
        return build_entry_workload(workload.target, workload.training, batch_size, device)


def build_entry_workload(target_cfg: Mapping[str, Any], training: Mapping[str, Any], batch_size: int,
                         device: Any) -> Any:
    """The user's ``make_workload`` named by ``target_cfg["entry"]`` (a ``file.py:function`` string, or
    the function itself as :func:`oomtune.predict` passes it: not JSON, so not in a
    :class:`~oomtune.workload_spec.WorkloadSpec`) at ``batch_size`` on ``device``, with the training
    settings of ``training`` (``grad_accum``; ``activation_checkpointing`` passed only when set).

    Raises:
        ConfigError: as :func:`oomtune.targets.python_entry.build_user_workload`.
    """
    from oomtune.targets.python_entry import build_user_workload
    from oomtune.workloads.training import checkpointing_of, grad_accum_of

    ckpt = checkpointing_of(training) if "activation_checkpointing" in training else None
    return build_user_workload(target_cfg, batch_size, device,
                               grad_accum=grad_accum_of(training), activation_checkpointing=ckpt)


TARGET = register_target(PythonTarget())


def _module_file(dotted: str) -> Path | None:
    """The ``.py`` file of the module ``dotted`` (``pkg.mod``), found as the import system would find
    it but without executing anything: ``importlib.util.find_spec`` imports the parent packages (their
    ``__init__`` runs: user code), so each level is looked up by the finders themselves, the top one in
    ``sys.meta_path`` (which holds editable installs' finders), each sub-level in its parent's
    ``submodule_search_locations``. None when a level is not found or the module is not a ``.py`` file.
    """
    import importlib.machinery
    import sys

    parts = dotted.split(".")
    if not all(p.isidentifier() for p in parts):
        return None
    spec = None
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        try:
            spec = find(parts[0], None)
        except Exception:   # noqa: BLE001 - a third-party finder's failure means "not found here"
            spec = None
        if spec is not None:
            break
    for depth in range(1, len(parts)):
        locations = None if spec is None else spec.submodule_search_locations
        if not locations:
            return None
        spec = importlib.machinery.PathFinder.find_spec(".".join(parts[:depth + 1]), list(locations))
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    return Path(spec.origin)
