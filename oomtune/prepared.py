"""One prepared run: the config composed and validated once into a typed, frozen record that the
commands read instead of the config (:class:`PreparedRun`, built by :func:`prepare`).

``oomtune search`` (:mod:`oomtune.search.run`) and ``oomtune plan`` (:mod:`oomtune.plan.run`) start
from the same Hydra overrides: :func:`compose_checked` composes them (with the ``OOMTUNE_*``
environment overrides) and checks every typed key once (:func:`oomtune.schema.validate`: bad values
exit before torch is imported), and :func:`prepare` resolves what both need -- the device, the budget
in bytes, the search space, the workload and its :class:`oomtune.trial._base.Target` -- each command
giving the recipe of its workload (the search resolves paths for trials that run elsewhere; the plan
keeps its stream cache's keys). Below both commands (it imports neither), above the config.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["PreparedRun", "compose_checked", "prepare"]


@dataclass(frozen=True)
class PreparedRun:
    """A run's config, composed and validated once.

    Attributes:
        overrides: the Hydra overrides given (without the environment's).
        cfg: the composed config (an OmegaConf DictConfig; saved as config.yaml, and the keys no
            field below covers: ``search.workers``, ``trial.*``, ``storage``).
        workload: the trial workload mapping (``model`` keys for a built-in workload, ``target``,
            the target GPU ``gpu``; :func:`oomtune.search.run.workload_of`).
        target: the :class:`oomtune.trial._base.Target` serving ``workload``: what it can do.
        device: the resolved :class:`oomtune.device.TargetDevice` (the virtual GPU on the CPU).
        budget_bytes: the memory budget in bytes (:func:`oomtune.device.resolve_budget`); None when
            the caller checks ``budget=`` against other devices (``prepare(device_budget=False)``: a
            multi-card plan, each card's own memory, :func:`oomtune.plan.cards.card_budgets`).
        space: the :class:`oomtune.space.SearchSpace` of ``search.space`` and ``search.batch_size``.
        run_dir: the run directory (``hydra.run.dir``).
    """

    overrides: tuple[str, ...]
    cfg: Any
    workload: Mapping[str, Any]
    target: Any
    device: Any
    budget_bytes: int | None
    space: Any
    run_dir: Path


def _ranks(cfg: Any) -> int:
    """``trial.gpus``: the ranks of every trial, over which ``search.global_batch`` is split."""
    trial = cfg.get("trial")
    return int(trial.get("gpus", 1) or 1) if trial is not None else 1


def compose_checked(overrides: Sequence[str]) -> Any:
    """The config of ``overrides`` plus the environment's (:func:`oomtune.config.env_overrides`),
    every typed key checked (:func:`oomtune.schema.validate`), before torch is imported.

    Raises:
        ConfigError: a bad override or value, in one line.
    """
    from oomtune import config as C
    from oomtune.schema import validate

    cfg = C.compose(list(overrides) + C.env_overrides())
    validate(cfg)   # also budget= and device= syntax: bad values exit before torch is imported
    return cfg


def prepare(overrides: Sequence[str], *, workload: Callable[[Any], dict[str, Any]],
            cfg: Any = None, space: Any = None, space_last: bool = False,
            checked: Callable[[Any, dict[str, Any], Any], None] | None = None,
            device_budget: bool = True) -> PreparedRun:
    """Compose and validate once (:func:`compose_checked`, unless ``cfg`` is given), then resolve
    in this order: the search space (no torch; ``space`` when already made), the workload
    (``workload(cfg)``, the command's recipe: it validates the model and target), ``checked(cfg,
    workload, space)`` (the command's checks that need the workload; ``space`` None with
    ``space_last``), the device and the budget (``device_budget`` False: ``budget=`` is not a budget
    of this device, whose check would refuse a budget above the virtual GPU that fits the cards a
    multi-card plan checks it against instead; ``budget_bytes`` is then None), and the target GPU (``model.gpu``; auto: the
    device, or the default on the CPU: :func:`oomtune.capture.gpu_target.resolve_gpu_key`); with
    ``space_last`` the search space last (the order in which ``oomtune plan`` reports bad input).

    Raises:
        ConfigError / AllocatorConfigError / DeviceError: bad input, before anything runs or is
            written.
    """
    from oomtune import config as C
    from oomtune.capture.gpu_target import resolve_gpu_key
    from oomtune.device import resolve_budget, resolve_device
    from oomtune.space import SearchSpace
    from oomtune.trial._base import target_for

    cfg = compose_checked(overrides) if cfg is None else cfg
    if space is None and not space_last:
        space = SearchSpace.from_config(cfg.search, world_size=_ranks(cfg))   # allocator values: no torch needed either
    work = workload(cfg)
    if checked is not None:
        checked(cfg, work, space)
    device = resolve_device(cfg.device, virtual_device_memory=cfg.virtual_device_memory)
    budget_bytes = resolve_budget(cfg.budget, device) if device_budget else None
    work = resolve_gpu_key(work, device)
    if space is None:
        space = SearchSpace.from_config(cfg.search, world_size=_ranks(cfg))
    return PreparedRun(overrides=tuple(overrides), cfg=cfg, workload=work, target=target_for(work), device=device,
                       budget_bytes=budget_bytes, space=space, run_dir=C.run_dir_of(cfg))
