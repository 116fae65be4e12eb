"""The search's objective and its honest ranking.

Objectives (``search.objective``):

- ``throughput``: samples/s among candidates within the memory limit.
- ``batch``: the largest feasible batch, ties broken by the lower peak reserved, then by fewer
  allocator keys set (torch's defaults first), as batch-size finders rank (Lightning's
  ``BatchSizeFinder``, Accelerate's ``find_executable_batch_size``).
- ``auto``: throughput on a GPU; batch on the virtual GPU, where memory is simulated (deterministic)
  and measured throughput is the CPU's, which says nothing about a GPU.

A throughput gain is claimed only beyond the measured noise: the top candidates and the baseline are
each measured again ``repeats`` times in clean processes, and a candidate beats the baseline only
when its slowest repeat is faster than the baseline's fastest AND its mean beats the baseline's
mean by more than ``min_gain``. The gain reported is those confirmation means, never a search trial.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from oomtune.study import records as R

__all__ = ["OBJECTIVES", "resolve_objective", "batch_rank_key", "rank_by_batch", "Repeats", "beats",
           "n_keys"]

OBJECTIVES = ("auto", "throughput", "batch")


def resolve_objective(setting: str, *, simulated: bool) -> tuple[str, str]:
    """(objective, why) for ``search.objective``; ``auto`` picks by device.

    Raises:
        ValueError: an unknown setting (the schema rejects it earlier with a one-line message).
    """
    if setting not in OBJECTIVES:
        raise ValueError(f"search.objective={setting!r}: expected one of {', '.join(OBJECTIVES)}")
    if setting != "auto":
        return setting, f"search.objective={setting}"
    if simulated:
        return "batch", ("auto on the virtual GPU: memory is simulated and deterministic, and the CPU's "
                         "throughput says nothing about a GPU's")
    return "throughput", "auto on a GPU: samples/s within the memory limit"


def n_keys(trial: Any) -> int:
    """Allocator keys set in a trial's configuration (0: torch's defaults), plus one for activation
    checkpointing on (a setting that costs recomputation must earn its place as a key does)."""
    conf = trial.user_attrs.get(R.ATTR_CONF) or ""
    return (0 if not conf else conf.count(",") + 1) + (1 if trial.params.get("activation_checkpointing") is True else 0)


def batch_rank_key(trial: Any) -> tuple:
    """Sort key of the batch objective: larger batch, then lower peak reserved, then fewer keys,
    then the earlier trial."""
    res = R.result_of(trial)
    reserved = res.memory.peak_reserved_bytes if res is not None else None
    peak = reserved if reserved is not None else float("inf")
    return (-int(trial.params["batch_size"]), peak, n_keys(trial), trial.number)


def rank_by_batch(trials: Iterable[Any]) -> list[Any]:
    """Feasible trials in the batch objective's order (:func:`batch_rank_key`)."""
    return sorted(trials, key=batch_rank_key)


@dataclass
class Repeats:
    """Throughput (samples/s) of one candidate's clean-process repeats; ``failed``: a repeat did not
    run ok within the limit (the candidate does not survive confirmation)."""

    trial: Any
    values: list[float]
    failed: bool = False

    @property
    def mean(self) -> float | None:
        return statistics.fmean(self.values) if self.values else None

    @property
    def low(self) -> float | None:
        return min(self.values) if self.values else None

    @property
    def high(self) -> float | None:
        return max(self.values) if self.values else None

    @property
    def spread(self) -> float | None:
        """(max - min) / mean of the repeats: the measured noise (None with fewer than two)."""
        if len(self.values) < 2 or not self.mean:
            return None
        return (self.high - self.low) / self.mean

    def to_dict(self) -> dict[str, Any]:
        return {"trial": self.trial.number, "throughputs": [round(v, 3) for v in self.values],
                "mean": self.mean, "spread": self.spread, "survived": not self.failed}


def beats(candidate: Repeats, baseline: Repeats, min_gain: float) -> bool:
    """Whether ``candidate`` is faster than ``baseline`` beyond the measured noise: its slowest repeat
    above the baseline's fastest, and its mean above the baseline's by more than ``min_gain``."""
    if candidate.failed or not candidate.values or not baseline.values:
        return False
    return candidate.low > baseline.high and candidate.mean > baseline.mean * (1.0 + min_gain)


def best_repeats(repeats: Sequence[Repeats]) -> Repeats | None:
    """The survivor with the highest mean throughput (None when none survived)."""
    alive = [r for r in repeats if not r.failed and r.values]
    return max(alive, key=lambda r: (r.mean, -r.trial.number)) if alive else None
