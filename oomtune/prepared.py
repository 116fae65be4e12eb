"""One prepared run: the config composed and validated once into a typed, frozen record that the
commands read instead of the config (:class:`PreparedRun`, built by :func:`prepare`).

``oomtune search`` (:mod:`oomtune.search.run`) and ``oomtune plan`` (:mod:`oomtune.plan.run`) start
from the same Hydra overrides: :func:`compose_checked` composes them (with the ``OOMTUNE_*``
environment overrides) and checks every typed key once (:func:`oomtune.schema.validate`: bad values
exit before torch is imported), and :func:`prepare` resolves what both need -- the config as the
schema's objects, the device, the budget in bytes, the search space, the workload
(:class:`oomtune.workload_spec.WorkloadSpec`, built by its target) and that
:class:`oomtune.trial._base.Target`. Below both commands (it imports neither), above the config.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from oomtune.device import TargetDevice
    from oomtune.schema import RootConf
    from oomtune.space import SearchSpace
    from oomtune.trial._base import Target
    from oomtune.workload_spec import WorkloadSpec

__all__ = ["PreparedRun", "compose_checked", "prepare", "workload_spec_of"]


@dataclass(frozen=True)
class PreparedRun:
    """A run's config, composed and validated once.

    Attributes:
        overrides: the Hydra overrides given (without the environment's).
        conf: the composed config as the schema's objects (:func:`oomtune.schema.typed`; saved as
            the run's config.yaml): what the commands read of ``search.*``, ``trial.*``, ``storage``.
        workload: the :class:`oomtune.workload_spec.WorkloadSpec` (its target GPU resolved).
        target: the :class:`oomtune.trial._base.Target` serving ``workload``: what it can do.
        device: the resolved :class:`oomtune.device.TargetDevice` (the virtual GPU on the CPU).
        budget_bytes: the memory budget in bytes (:func:`oomtune.device.resolve_budget`); None when
            the caller checks ``budget=`` against other devices (``prepare(device_budget=False)``: a
            multi-card plan, each card's own memory, :func:`oomtune.plan.cards.card_budgets`).
        space: the :class:`oomtune.space.SearchSpace` of ``search.space`` and ``search.batch_size``.
        run_dir: the run directory (``hydra.run.dir``).
    """

    overrides: tuple[str, ...]
    conf: RootConf
    workload: WorkloadSpec
    target: Target
    device: TargetDevice
    budget_bytes: int | None
    space: SearchSpace
    run_dir: Path


def compose_checked(overrides: Sequence[str]) -> Any:
    """The config of ``overrides`` plus the environment's (:func:`oomtune.config.env_overrides`),
    every typed key checked (:func:`oomtune.schema.validate`), before torch is imported.

    Raises:
        ConfigError: a bad override or value, in one line; a bad ``OOMTUNE_CUDNN_WORKSPACE``
            (:func:`oomtune.capture.cudnn_rule.env_rule`).
    """
    from oomtune import config as C
    from oomtune.capture.cudnn_rule import env_rule
    from oomtune.schema import validate

    cfg = C.compose(list(overrides) + C.env_overrides())
    validate(cfg)   # also budget= and device= syntax: bad values exit before torch is imported
    env_rule()      # the captures' cuDNN workspace rule, read in every capture: refused here, once
    return cfg


def workload_spec_of(conf: RootConf, *, resolve_paths: bool) -> WorkloadSpec:
    """The workload of a config, built by its target (:meth:`oomtune.trial._base.Target.
    workload_spec`) from the ``target`` and ``model`` groups and ``trial.gpus``; ``resolve_paths``:
    the user's paths made absolute from the current directory (the search: trials run in their own
    directories), else kept as given (the plan: its stream cache's keys). Nothing is imported or run.

    Raises:
        ConfigError: an unknown target name, several GPUs per trial the target cannot train.
    """
    import os

    from oomtune.trial._base import get_target

    target = conf.target if isinstance(conf.target, dict) else {"name": "builtin"}
    model = conf.model if isinstance(conf.model, dict) else {}
    return get_target(target.get("name", "builtin")).workload_spec(
        target, model, gpus=conf.trial.gpus, base=Path(os.getcwd()) if resolve_paths else None)


def prepare(overrides: Sequence[str], *, resolve_paths: bool, cfg: Any = None, space: SearchSpace | None = None,
            space_last: bool = False,
            checked: Callable[[RootConf, WorkloadSpec, SearchSpace | None], None] | None = None,
            device_budget: bool = True) -> PreparedRun:
    """Compose and validate once (:func:`compose_checked`, unless ``cfg`` is given), then resolve
    in this order: the search space (no torch; ``space`` when already made), the workload
    (:func:`workload_spec_of`), ``checked(conf, workload, space)`` (the command's checks that need
    the workload; ``space`` None with ``space_last``), the device and the budget (``device_budget``
    False: ``budget=`` is not a budget of this device, whose check would refuse a budget above the
    virtual GPU that fits the cards a multi-card plan checks it against instead; ``budget_bytes``
    is then None), and the target GPU (``model.gpu``; auto: the device, or the default on the CPU:
    :func:`oomtune.capture.gpu_target.resolve_gpu_key`); with ``space_last`` the search space last (the
    order in which ``oomtune plan`` reports bad input).

    Raises:
        ConfigError / AllocatorConfigError / DeviceError: bad input, before anything runs or is
            written.
    """
    from oomtune import config as C
    from oomtune.capture.gpu_target import resolve_gpu_key
    from oomtune.device import resolve_budget, resolve_device
    from oomtune.schema import typed
    from oomtune.space import SearchSpace
    from oomtune.trial._base import get_target

    cfg = compose_checked(overrides) if cfg is None else cfg
    conf = typed(cfg)
    if space is None and not space_last:   # allocator values: no torch needed either
        space = SearchSpace.from_config(conf.search, world_size=conf.trial.gpus)
    work = workload_spec_of(conf, resolve_paths=resolve_paths)
    if checked is not None:
        checked(conf, work, space)
    device = resolve_device(conf.device, virtual_device_memory=conf.virtual_device_memory)
    budget_bytes = resolve_budget(conf.budget, device) if device_budget else None
    work = resolve_gpu_key(work, device)
    if space is None:
        space = SearchSpace.from_config(conf.search, world_size=conf.trial.gpus)
    return PreparedRun(overrides=tuple(overrides), conf=conf, workload=work, target=get_target(work.target_name),
                       device=device, budget_bytes=budget_bytes, space=space, run_dir=C.run_dir_of(cfg))
