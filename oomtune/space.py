"""The search space: batch size and candidate values for each allocator key, as Optuna parameters.

Parameter names are the allocator keys exactly as torch spells them (``max_split_size_mb``,
``expandable_segments``, ...) plus ``batch_size`` and, when ``search.data`` names candidates,
``data.num_workers``/``data.pin_memory``/``data.prefetch_factor`` (the workload's loader), and
``activation_checkpointing`` when ``search.space.activation_checkpointing`` lists it. The torch
default of every key is always a candidate, so the default allocator (the baseline) is a point of
the space.

A fixed global batch (``search.global_batch=N``): the global batch decides convergence, so it stays
N and ``batch_size`` is the micro-batch: only the micro-batches ``b`` in the batch range that divide
``N / world_size`` are candidates, each with ``grad_accum = N / (b x world_size)`` micro-batches per
optimizer step (:meth:`SearchSpace.batch_choices`, :attr:`Candidate.grad_accum`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import dataclasses
from dataclasses import dataclass
from typing import Any

from oomtune.alloc.settings import AllocatorSettings
from oomtune.exceptions import AllocatorConfigError, ConfigError
from oomtune.workload_spec import WorkloadSpec

__all__ = ["Candidate", "SearchSpace", "check_batch_range", "DEFAULTS", "LOADER_KEYS", "CHECKPOINTING_KEY", "micro_batches"]

#: The ``search.space`` key that searches activation checkpointing (not an allocator key).
CHECKPOINTING_KEY = "activation_checkpointing"

#: Data-loader settings that ``search.data`` may search (keys of the workload's ``data`` group).
LOADER_KEYS = frozenset({"num_workers", "pin_memory", "prefetch_factor"})

#: torch's default per key, in the form the space uses (None: key not set).
DEFAULTS: dict[str, Any] = {
    "backend": "native",
    "expandable_segments": False,
    "max_split_size_mb": None,
    "roundup_power2_divisions": None,
    "garbage_collection_threshold": None,
    "max_non_split_rounding_mb": None,
}


def micro_batches(global_batch: int, world_size: int, low: int, high: int) -> list[int]:
    """The micro-batches in ``[low, high]`` that keep the global batch: divisors ``b`` of
    ``global_batch / world_size``, ascending (each trains ``global_batch / (b x world_size)``
    micro-batches per optimizer step on every rank).

    Raises:
        ConfigError: a global batch or world size that is not an integer >= 1, a global batch that
            the world size does not divide, or no divisor in the range (the message names the
            nearest valid micro-batches outside it).
    """
    for name, v in (("search.global_batch", global_batch), ("world size", world_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{name}={v!r}: expected an integer >= 1")
    if global_batch % world_size:
        lower, upper = global_batch - global_batch % world_size, global_batch - global_batch % world_size + world_size
        raise ConfigError(f"search.global_batch={global_batch} is not divisible by the world size {world_size} "
                          f"(trial.gpus: every rank trains the same micro-batch): give a multiple of {world_size}, "
                          + (f"e.g. search.global_batch={lower} or {upper}" if lower else f"e.g. search.global_batch={upper}"))
    per_rank = global_batch // world_size
    small = [b for b in range(1, int(per_rank ** 0.5) + 1) if per_rank % b == 0]
    divisors = sorted(set(small) | {per_rank // b for b in small})
    inside = [b for b in divisors if low <= b <= high]
    if not inside:
        below = [b for b in divisors if b < low]
        above = [b for b in divisors if b > high]
        near = ", ".join(f"{b} (search.batch_size.{side}={b})" for b, side in
                         ((below[-1] if below else None, "low"), (above[0] if above else None, "high")) if b is not None)
        raise ConfigError(f"search.global_batch={global_batch}: no micro-batch in search.batch_size [{low}, {high}] "
                          f"divides {per_rank}" + (f" (global batch / world size {world_size})" if world_size > 1 else "")
                          + f"; nearest valid micro-batches: {near}")
    return inside


@dataclass(frozen=True)
class Candidate:
    """A point of the space: ``batch_size`` (samples per micro-batch; per optimizer step without a
    global batch), the allocator settings, and how the step trains: ``grad_accum`` micro-batches per
    optimizer step (1 without ``search.global_batch``) and ``activation_checkpointing`` (None: not
    searched, the workload's own)."""

    batch_size: int
    params: tuple[tuple[str, Any], ...]  # allocator key -> value, sorted, None = unset
    data: tuple[tuple[str, Any], ...] = ()  # data-loader key (num_workers, ...) -> value, sorted
    grad_accum: int = 1
    activation_checkpointing: bool | None = None

    @property
    def settings(self) -> AllocatorSettings:
        return AllocatorSettings.from_mapping({k: v for k, v in self.params if v is not None})

    @property
    def alloc_conf(self) -> str:
        """The exact PYTORCH_CUDA_ALLOC_CONF string ("" for torch's defaults)."""
        return self.settings.render()

    def optuna_params(self) -> dict[str, Any]:
        """Optuna parameter names: ``batch_size``, the allocator keys, ``data.<loader key>``,
        ``activation_checkpointing`` (when searched)."""
        out = {"batch_size": self.batch_size, **dict(self.params), **{f"data.{k}": v for k, v in self.data}}
        if self.activation_checkpointing is not None:
            out[CHECKPOINTING_KEY] = self.activation_checkpointing
        return out

    @property
    def config(self) -> dict[str, Any]:
        """The configuration without the batch: allocator keys and, when searched,
        ``activation_checkpointing`` (what one frontier row stands for)."""
        out = dict(self.params)
        if self.activation_checkpointing is not None:
            out[CHECKPOINTING_KEY] = self.activation_checkpointing
        return out

    def apply(self, workload: WorkloadSpec) -> WorkloadSpec:
        """``workload`` with this candidate's data-loader settings (merged into the model group's
        ``data``), ``grad_accum`` (in ``training`` when > 1, removed from it otherwise) and
        ``activation_checkpointing`` (in ``training`` when searched): what its trial trains. A new
        spec (:func:`dataclasses.replace`); ``workload`` is unchanged.

        Raises:
            ConfigError: a loader value JSON cannot carry (:class:`oomtune.workload_spec.WorkloadSpec`).
        """
        model = workload.model
        if self.data:
            model = {**(model or {}), "data": {**(workload.data or {}), **dict(self.data)}}
        training = dict(workload.training)
        if self.grad_accum > 1:
            training["grad_accum"] = self.grad_accum
        else:
            training.pop("grad_accum", None)
        if self.activation_checkpointing is not None:
            training[CHECKPOINTING_KEY] = self.activation_checkpointing
        return dataclasses.replace(workload, model=model, training=training)

    apply_data = apply


def check_batch_range(low: Any, high: Any) -> None:
    """Refuse a batch range ``search.batch_size.low..high`` that holds no batch size, in one line with the fix.

    Raises:
        ConfigError: ``low`` or ``high`` not an integer (a bool is not one), or ``1 <= low <= high`` violated.
    """
    ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (low, high))
    if ints and 1 <= low <= high:
        return
    fix = ("give whole numbers, e.g. search.batch_size.low=8 search.batch_size.high=512" if not ints else
           "set search.batch_size.low=1 or more" if low < 1 else
           f"set search.batch_size.high={low} or more (or a smaller search.batch_size.low)")
    raise ConfigError(f"search.batch_size must satisfy 1 <= low <= high, got low={low!r} high={high!r}: {fix}")


class SearchSpace:
    """Batch size in [low, high] (log-uniform integer; with a global batch, a categorical choice of
    the micro-batches that divide it) x a categorical choice per allocator key (and per searched
    training setting: ``activation_checkpointing``).

    Args:
        batch_low / batch_high: the batch range; with ``global_batch`` the smallest and the largest
            micro-batch in the configured range that divide it (every batch run is a valid one).
        choices: allocator key -> candidate values; ``activation_checkpointing`` -> [false, true]
            is taken out as a training setting.
        data_choices: data-loader key -> candidate values.
        global_batch: ``search.global_batch`` (None: the batch is free).
        world_size: data-parallel ranks per trial (each trains one micro-batch per micro-step).

    Raises:
        ConfigError: bad batch range, an empty choice list, a global batch without a divisor in the
            range, activation_checkpointing values that are not booleans.
        AllocatorConfigError: a candidate value torch would reject (checked before any trial runs).
    """

    def __init__(self, batch_low: int, batch_high: int, choices: Mapping[str, Sequence[Any]],
                 data_choices: Mapping[str, Sequence[Any]] | None = None, *, global_batch: int | None = None,
                 world_size: int = 1):
        check_batch_range(batch_low, batch_high)
        self.global_batch, self.world_size = global_batch, world_size
        self._micro = None if global_batch is None else micro_batches(global_batch, world_size, batch_low, batch_high)
        if self._micro is not None:
            # the range's ends become the smallest and largest valid micro-batches: whatever runs at
            # "the smallest batch" (the smoke test's CPU step, the anchors, the frontier's floor) must
            # divide the global batch (global_batch=100 with batch_size.low=8: 10, not 8)
            batch_low, batch_high = self._micro[0], self._micro[-1]
        self.batch_low, self.batch_high = batch_low, batch_high
        choices = dict(choices)
        self.checkpointing: list[bool] | None = None
        if CHECKPOINTING_KEY in choices:
            values = choices.pop(CHECKPOINTING_KEY)
            values = list(values) if isinstance(values, (list, tuple)) else [values]
            if not values or any(not isinstance(v, bool) for v in values):
                raise ConfigError(f"search.space.{CHECKPOINTING_KEY}={values!r}: expected a list of true/false, "
                                  "e.g. [false,true]")
            self.checkpointing = list(dict.fromkeys(values))
        self.choices: dict[str, list[Any]] = {}
        for key, values in choices.items():
            values = list(values) if isinstance(values, (list, tuple)) else [values]
            if not values:
                raise ConfigError(f"search.space.{key} is empty: give at least one value")
            default = DEFAULTS.get(key)
            if default not in values and key in DEFAULTS:
                values.insert(0, default)
            for value in values:
                if value is None:
                    continue
                try:
                    AllocatorSettings.from_mapping({key: value})
                except AllocatorConfigError as exc:
                    raise AllocatorConfigError(f"search.space.{key}: {exc}") from None
            self.choices[key] = values
        self.data_choices: dict[str, list[Any]] = {}
        for key, values in (data_choices or {}).items():
            if values is None:
                continue  # not searched
            values = list(values) if isinstance(values, (list, tuple)) else [values]
            if key not in LOADER_KEYS:
                raise ConfigError(f"search.data.{key}: not a data-loader setting; choose from "
                                  f"{', '.join(sorted(LOADER_KEYS))}")
            if not values:
                raise ConfigError(f"search.data.{key} is empty: give at least one value")
            self.data_choices[key] = values

    @classmethod
    def from_config(cls, search_cfg: Any, *, world_size: int = 1) -> "SearchSpace":
        """From the ``search`` config group (:class:`oomtune.schema.SearchConf`, or the composed node:
        ``batch_size.low/high``, ``space``, ``data``, ``global_batch``, read as attributes);
        ``world_size``: the ranks of every trial (``trial.gpus``), over which ``search.global_batch``
        is split (it counts samples per optimizer step over all ranks).

        Raises:
            ConfigError: a bad batch range, an unknown data-loader key, an empty choice list, or a
                global batch the world size does not divide (before any trial runs).
            AllocatorConfigError: a search.space value the allocator does not accept.
        """
        from oomtune.config import to_container

        bs = search_cfg.batch_size
        global_batch = getattr(search_cfg, "global_batch", None)
        return cls(int(bs.low), int(bs.high), to_container(search_cfg.space) or {},
                   to_container(getattr(search_cfg, "data", None)) or {},
                   global_batch=None if global_batch is None else global_batch, world_size=int(world_size))

    def batch_choices(self) -> list[int] | None:
        """The allowed batch sizes when only some are (a global batch: the micro-batches that divide
        it, ascending); None when every integer in ``[batch_low, batch_high]`` is allowed."""
        return None if self._micro is None else list(self._micro)

    @property
    def top_batch(self) -> int:
        """The largest allowed batch (the range's top, or the largest valid micro-batch)."""
        return self.batch_high if self._micro is None else self._micro[-1]

    def grad_accum_for(self, batch_size: int) -> int:
        """Micro-batches per optimizer step at ``batch_size``: ``global_batch / (batch_size x
        world_size)``; 1 without a global batch.

        Raises:
            ConfigError: ``batch_size`` does not divide the global batch per rank.
        """
        if self.global_batch is None:
            return 1
        per_rank = self.global_batch // self.world_size
        if per_rank % batch_size:
            raise ConfigError(f"micro-batch {batch_size} does not divide search.global_batch={self.global_batch}"
                              + (f" / world size {self.world_size}" if self.world_size > 1 else ""))
        return per_rank // batch_size

    def suggest(self, trial: Any, *, batch_low: int | None = None) -> Candidate:
        """Ask an Optuna trial for a candidate (``trial.suggest_int``/``suggest_categorical``);
        ``batch_low`` narrows the batch range's lower end for this trial (not with a global batch,
        whose micro-batches are one categorical choice: Optuna requires the same choices in every
        trial)."""
        if self._micro is not None:
            batch = trial.suggest_categorical("batch_size", list(self._micro))
        else:
            low = self.batch_low if batch_low is None else max(self.batch_low, min(batch_low, self.batch_high))
            batch = trial.suggest_int("batch_size", low, self.batch_high, log=True)
        params = {key: trial.suggest_categorical(key, values) for key, values in self.choices.items()}
        params.update({f"data.{key}": trial.suggest_categorical(f"data.{key}", values)
                       for key, values in self.data_choices.items()})
        if self.checkpointing is not None:
            params[CHECKPOINTING_KEY] = trial.suggest_categorical(CHECKPOINTING_KEY, list(self.checkpointing))
        return self.candidate(batch, params)

    def candidate(self, batch_size: int, params: Mapping[str, Any] | None = None) -> Candidate:
        """The candidate at ``batch_size`` with the given keys (others at torch's default).

        Raises:
            AllocatorConfigError: the combination is invalid for torch.
        """
        params = dict(params or {})
        params.pop("batch_size", None)
        data = {k[len("data."):]: params.pop(k) for k in list(params) if k.startswith("data.")}
        ckpt = params.pop(CHECKPOINTING_KEY, None)
        if self.checkpointing is not None and ckpt is None:
            ckpt = self.checkpointing[0]
        merged = {key: DEFAULTS.get(key) for key in self.choices}
        merged.update(params)
        cand = Candidate(int(batch_size), tuple(sorted(merged.items())), tuple(sorted(data.items())),
                         grad_accum=self.grad_accum_for(int(batch_size)),
                         activation_checkpointing=None if self.checkpointing is None else bool(ckpt))
        cand.alloc_conf  # validates the combination
        return cand

    def default(self, batch_size: int) -> Candidate:
        """torch's default allocator at ``batch_size`` (the baseline), with the first candidate of
        each searched data-loader setting (and of activation_checkpointing, when searched)."""
        return self.candidate(batch_size, {f"data.{k}": v[0] for k, v in self.data_choices.items()})

    def drop_garbage_collection(self) -> list[Any]:
        """Leave ``garbage_collection_threshold`` unset in every candidate (``search.memory_fraction=off``:
        torch applies the threshold only under a memory fraction < 1, so without one it is inert and
        a configuration relying on it would not hold). Returns the values dropped
        (torch's default, unset, is always a candidate, so something is left)."""
        values = self.choices.get("garbage_collection_threshold")
        if not values:
            return []
        dropped = [v for v in values if v is not None]
        self.choices["garbage_collection_threshold"] = [None]
        return dropped

    def all_settings(self) -> list[dict[str, Any]]:
        """Every allocator combination of the space (the grid the planner predicts over)."""
        import itertools

        keys = list(self.choices)
        combos = itertools.product(*(self.choices[k] for k in keys))
        return [dict(zip(keys, values)) for values in combos]

    def all_configs(self) -> list[dict[str, Any]]:
        """Every configuration the frontier is predicted for: each allocator combination
        (:meth:`all_settings`) x each searched ``activation_checkpointing`` value (the key is absent
        when it is not searched)."""
        settings = self.all_settings()
        if self.checkpointing is None:
            return settings
        return [{**m, CHECKPOINTING_KEY: c} for c in self.checkpointing for m in settings]
