"""The search space: batch size and candidate values for each allocator key, as Optuna parameters.

Parameter names are the allocator keys exactly as torch spells them (``max_split_size_mb``,
``expandable_segments``, ...) plus ``batch_size`` and, when ``search.data`` names candidates,
``data.num_workers``/``data.pin_memory``/``data.prefetch_factor`` (the workload's loader). The torch default of every key is always a
candidate, so the default allocator (the baseline) is a point of the space.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from oomtune.alloc.settings import AllocatorSettings
from oomtune.exceptions import AllocatorConfigError, ConfigError

__all__ = ["Candidate", "SearchSpace", "DEFAULTS", "LOADER_KEYS"]

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


@dataclass(frozen=True)
class Candidate:
    """A point of the space: ``batch_size`` (samples/step) and the allocator settings."""

    batch_size: int
    params: tuple[tuple[str, Any], ...]  # allocator key -> value, sorted, None = unset
    data: tuple[tuple[str, Any], ...] = ()  # data-loader key (num_workers, ...) -> value, sorted

    @property
    def settings(self) -> AllocatorSettings:
        return AllocatorSettings.from_mapping({k: v for k, v in self.params if v is not None})

    @property
    def alloc_conf(self) -> str:
        """The exact PYTORCH_CUDA_ALLOC_CONF string ("" for torch's defaults)."""
        return self.settings.render()

    def optuna_params(self) -> dict[str, Any]:
        """Optuna parameter names: ``batch_size``, the allocator keys, ``data.<loader key>``."""
        return {"batch_size": self.batch_size, **dict(self.params),
                **{f"data.{k}": v for k, v in self.data}}

    def apply_data(self, workload: Mapping[str, Any]) -> dict[str, Any]:
        """A copy of the workload config with this candidate's data-loader settings."""
        out = dict(workload)
        if self.data:
            out["data"] = {**(workload.get("data") or {}), **dict(self.data)}
        return out


class SearchSpace:
    """Batch size in [low, high] (log-uniform integer) x a categorical choice per allocator key.

    Raises:
        ConfigError: bad batch range or an empty choice list.
        AllocatorConfigError: a candidate value torch would reject (checked before any trial runs).
    """

    def __init__(self, batch_low: int, batch_high: int, choices: Mapping[str, Sequence[Any]],
                 data_choices: Mapping[str, Sequence[Any]] | None = None):
        if not (isinstance(batch_low, int) and isinstance(batch_high, int)) or not 1 <= batch_low <= batch_high:
            raise ConfigError(
                f"search.batch_size must satisfy 1 <= low <= high, got low={batch_low!r} high={batch_high!r}"
            )
        self.batch_low, self.batch_high = batch_low, batch_high
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
    def from_config(cls, search_cfg: Any) -> "SearchSpace":
        """From the composed ``search`` config group (``batch_size.low/high``, ``space``, ``data``).

        Raises:
            ConfigError: a bad batch range, an unknown data-loader key or an empty choice list.
            AllocatorConfigError: a search.space value the allocator does not accept.
        """
        from oomtune.config import to_container

        bs = to_container(search_cfg.batch_size)
        return cls(int(bs["low"]), int(bs["high"]), to_container(search_cfg.space) or {},
                   to_container(search_cfg.get("data")) or {})

    def suggest(self, trial: Any, *, batch_low: int | None = None) -> Candidate:
        """Ask an Optuna trial for a candidate (``trial.suggest_int``/``suggest_categorical``);
        ``batch_low`` narrows the batch range's lower end for this trial."""
        low = self.batch_low if batch_low is None else max(self.batch_low, min(batch_low, self.batch_high))
        batch = trial.suggest_int("batch_size", low, self.batch_high, log=True)
        params = {key: trial.suggest_categorical(key, values) for key, values in self.choices.items()}
        params.update({f"data.{key}": trial.suggest_categorical(f"data.{key}", values)
                       for key, values in self.data_choices.items()})
        return self.candidate(batch, params)

    def candidate(self, batch_size: int, params: Mapping[str, Any] | None = None) -> Candidate:
        """The candidate at ``batch_size`` with the given keys (others at torch's default).

        Raises:
            AllocatorConfigError: the combination is invalid for torch.
        """
        params = dict(params or {})
        params.pop("batch_size", None)
        data = {k[len("data."):]: params.pop(k) for k in list(params) if k.startswith("data.")}
        merged = {key: DEFAULTS.get(key) for key in self.choices}
        merged.update(params)
        cand = Candidate(int(batch_size), tuple(sorted(merged.items())), tuple(sorted(data.items())))
        cand.alloc_conf  # validates the combination
        return cand

    def default(self, batch_size: int) -> Candidate:
        """torch's default allocator at ``batch_size`` (the baseline), with the first candidate of
        each searched data-loader setting."""
        return self.candidate(batch_size, {f"data.{k}": v[0] for k, v in self.data_choices.items()})

    def drop_garbage_collection(self) -> list[Any]:
        """Leave ``garbage_collection_threshold`` unset in every candidate (``search.memory_fraction=off``:
        torch applies the threshold only under a memory fraction < 1, so without one it is inert and
        a configuration relying on it would not hold, issue 23 item 1). Returns the values dropped
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
