"""Frontier-first probes: where device trials go before the sampler runs.

Before any device trial, every allocator configuration's *predicted frontier* is computed: the
largest batch whose virtual-GPU replay fits within ``budget x (1 - headroom)``, exactly as ``oomtune
plan`` computes it (:func:`oomtune.plan.feasibility.frontier_row`, shared code). Configurations whose
predictions are identical (same frontier, same predicted peaks there) are *twins*: only the one with
the fewest non-default keys is probed. The probes then go, in rounds of independent candidates:

1. the default allocator at its predicted frontier (the baseline) and the ``max_configs``
   configurations with the highest predicted frontiers above it, each at its predicted frontier;
2. each result calibrates that configuration's prediction (measured / predicted peak reserved; an
   out-of-memory result without a full reading bounds the ratio from below), and the next probe of a
   configuration is its *calibrated* frontier between its largest measured success and its smallest
   measured failure; a success at the calibrated frontier is followed by the batch just above it
   (the boundary) for the baseline and for the configuration that leads;
3. a configuration stops when its boundary is exact (failure = success + 1), when it cannot beat
   the leader any more (its calibrated frontier is below the leader's measured batch), or after
   ``max_probes`` probes.

Without a prediction (``target=cmd``, ``search.prune=off``, ``backend:cudaMallocAsync``) the
baseline is found by doubling then bisection to ``precision`` (Lightning's binsearch scaling).

This module holds no Optuna or process code: :class:`FrontierPlanner` says which candidates a round
holds and learns from results; :class:`oomtune.search.driver.Search` runs them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ConfigFrontier", "FrontierPlanner", "predicted_frontiers"]

#: Returns the raw (uncalibrated) predicted peak reserved of (batch, params) in bytes, and whether the
#: replay under the trial's limit completes; None when the configuration cannot be predicted.
PeakFn = Callable[[int, dict], "tuple[int, bool] | None"]


@dataclass
class ConfigFrontier:
    """One allocator configuration's predicted and measured frontier (batch sizes; bytes).

    ``params`` are the allocator keys as the search space spells them (None = unset); ``predicted``
    the predicted frontier (None: no prediction, or not even the smallest batch fits);
    ``ok_max`` the largest batch measured feasible; ``bad_min`` the smallest batch above it measured
    infeasible; ``ratios`` measured / predicted peak reserved of this configuration's trials;
    ``ratio_floor`` a lower bound of that ratio from out-of-memory results; ``twins`` the
    alloc_conf strings predicted identical (not probed)."""

    params: dict[str, Any]
    alloc_conf: str
    predicted: int | None
    predicted_peak_bytes: int | None = None
    ok_max: int | None = None
    ok_peak_bytes: int | None = None
    bad_min: int | None = None
    ratios: list[float] = field(default_factory=list)
    ratio_floor: float = 0.0
    probes: int = 0
    twins: list[str] = field(default_factory=list)
    selected: bool = False
    force_next: int | None = None  # probe this batch next (the smallest, after an error above it)

    @property
    def is_default(self) -> bool:
        """torch's default allocator (every key unset or at torch's default)."""
        return self.alloc_conf == ""

    @property
    def n_keys(self) -> int:
        return 0 if not self.alloc_conf else self.alloc_conf.count(",") + 1

    def calibration(self, fallback: float = 1.0) -> float:
        """measured / predicted peak: the median of this configuration's ratios, else ``fallback``
        (the study's median on this device), raised to the out-of-memory floor."""
        if self.ratios:
            r = sorted(self.ratios)
            mid = len(r) // 2
            value = r[mid] if len(r) % 2 else (r[mid - 1] + r[mid]) / 2
        else:
            value = fallback
        return max(value, self.ratio_floor)

    @property
    def exact(self) -> bool:
        """The measured boundary is known to one batch."""
        return self.ok_max is not None and self.bad_min is not None and self.bad_min <= self.ok_max + 1

    def measured_text(self) -> str:
        """``352`` (exact), ``>=456`` (no failure above), ``<8`` (nothing fit), ``352..360``, ``-``."""
        if self.ok_max is None:
            return "-" if self.bad_min is None else f"<{self.bad_min}"
        if self.bad_min is None:
            return f">={self.ok_max}"
        return str(self.ok_max) if self.exact else f"{self.ok_max}..{self.bad_min - 1}"

    def record(self, batch: int, feasible: bool, *, ratio: float | None = None,
               floor: float | None = None, peak_bytes: int | None = None) -> None:
        """Learn from one measured trial of this configuration at ``batch``."""
        if ratio is not None and ratio > 0:
            self.ratios.append(ratio)
        if floor is not None:
            self.ratio_floor = max(self.ratio_floor, floor)
        if feasible:
            if self.ok_max is None or batch > self.ok_max:
                self.ok_max, self.ok_peak_bytes = batch, peak_bytes
            if self.bad_min is not None and self.bad_min <= batch:
                self.bad_min = None  # not monotone here: forget the lower failure
        elif self.bad_min is None or batch < self.bad_min:
            if self.ok_max is None or batch > self.ok_max:
                self.bad_min = batch

    def to_dict(self) -> dict[str, Any]:
        """For best.yaml: ``{alloc_conf, predicted_max_batch, measured_max_batch, measured_fail_batch,
        calibration, probed, twins}``."""
        return {"alloc_conf": self.alloc_conf, "predicted_max_batch": self.predicted,
                "measured_max_batch": self.ok_max, "measured_fail_batch": self.bad_min,
                "calibration": round(self.calibration(), 4) if (self.ratios or self.ratio_floor) else None,
                "probed": self.probes > 0, "twins": list(self.twins)}


def predicted_frontiers(predictor: Any, settings_list: Sequence[dict[str, Any]], low: int, high: int,
                        limit_bytes: int) -> list[ConfigFrontier]:
    """Every configuration's predicted frontier (shared with ``oomtune plan``:
    :func:`oomtune.plan.feasibility.frontier_row` over :func:`~oomtune.plan.feasibility.grid_batches`).

    Configurations the virtual GPU cannot simulate get ``predicted=None``. Twins (identical predicted
    frontier and peaks there) are folded into the one with the fewest keys set (``twins``).

    Raises:
        ConfigError: a bad workload (capture fails). AllocatorConfigError: an invalid combination.
    """
    from oomtune.alloc.settings import AllocatorSettings
    from oomtune.plan.feasibility import frontier_row, grid_batches, split_simulable, twin_key

    grid = grid_batches(low, high)
    if hasattr(predictor, "prepare"):   # the captures that let the grid's other streams be derived, at once
        predictor.prepare(grid)
    out: list[ConfigFrontier] = []
    groups: dict[tuple, ConfigFrontier] = {}
    for mapping in settings_list:
        conf = AllocatorSettings.from_mapping({k: v for k, v in mapping.items() if v is not None}).render()
        kept, _ = split_simulable([mapping])
        if not kept:
            out.append(ConfigFrontier(dict(mapping), conf, None))
            continue
        row = frontier_row(predictor, mapping, grid, limit_bytes)
        at = row.at_max
        cf = ConfigFrontier(dict(mapping), conf, row.max_batch_size,
                            None if at is None else at.peak_reserved_bytes)
        key = twin_key(row)   # the rule oomtune plan folds its rows by
        rep = groups.get(key)
        if rep is None:
            groups[key] = cf
            out.append(cf)
        elif (cf.n_keys, len(conf)) < (rep.n_keys, len(rep.alloc_conf)):
            cf.twins = rep.twins + [rep.alloc_conf]
            rep.twins = []
            out[out.index(rep)] = cf
            groups[key] = cf
        else:
            rep.twins.append(conf)
    return out


class FrontierPlanner:
    """Which candidates each frontier round holds, and what the results teach.

    Args:
        configs: from :func:`predicted_frontiers` (or one default row without prediction).
        low / high: the searched batch range.
        limit_bytes: budget x (1 - headroom).
        peak: :data:`PeakFn` (raw prediction of any batch; captures new batch sizes as needed), or None.
        max_configs: non-default configurations probed besides the baseline.
        max_probes: probes per configuration.
        precision: without predictions, bisect until (fail - ok) <= precision x ok.
        boundary_all: probe the batch above every configuration's frontier, not only the baseline's
            and the leader's (the throughput objective needs each frontier).
    """

    def __init__(self, configs: list[ConfigFrontier], low: int, high: int, limit_bytes: int, *,
                 peak: PeakFn | None, max_configs: int = 2, max_probes: int = 6, precision: float = 0.1,
                 boundary_all: bool = False):
        self.configs, self.low, self.high, self.limit = configs, low, high, limit_bytes
        self.peak, self.max_probes, self.precision, self.boundary_all = peak, max_probes, precision, boundary_all
        self.device_ratio = 1.0  # the study's median measured/predicted, for unmeasured configurations
        default = self.default
        if default is not None:
            default.selected = True
        floor = default.predicted if default is not None and default.predicted is not None else 0
        ranked = sorted((c for c in configs if not c.is_default and c.predicted is not None and c.predicted > floor),
                        key=lambda c: (-c.predicted, c.predicted_peak_bytes or 0, c.n_keys))
        # Distinct predicted frontiers first (a tie adds little: its peak already ranked it), then the rest.
        distinct = [c for i, c in enumerate(ranked) if all(c.predicted != d.predicted for d in ranked[:i])]
        for c in (distinct + [c for c in ranked if c not in distinct])[:max_configs]:
            c.selected = True

    @property
    def default(self) -> ConfigFrontier | None:
        return next((c for c in self.configs if c.is_default), None)

    def find(self, alloc_conf: str) -> ConfigFrontier | None:
        """The probed configuration with this alloc_conf (twins map to their representative)."""
        for c in self.configs:
            if c.alloc_conf == alloc_conf or alloc_conf in c.twins:
                return c
        return None

    def leader(self) -> ConfigFrontier | None:
        """The configuration with the largest measured feasible batch (ties: lower measured peak, then
        fewer keys)."""
        measured = [c for c in self.configs if c.ok_max is not None]
        if not measured:
            return None
        return min(measured, key=lambda c: (-c.ok_max, c.ok_peak_bytes or 0, c.n_keys))

    # ---------------------------------------------------------------- the next probe
    def _fits(self, c: ConfigFrontier, batch: int) -> bool | None:
        got = self.peak(batch, c.params) if self.peak is not None else None
        if got is None:
            return None
        raw, completes = got
        scale = c.calibration(self.device_ratio)
        return math.ceil(raw * scale) <= self.limit and (completes or scale < 1.0)

    def calibrated_frontier(self, c: ConfigFrontier) -> int | None:
        """Largest batch strictly between the measured bounds that fits by the calibrated prediction
        (None: none, or no prediction)."""
        from oomtune.plan.feasibility import grid_batches, largest_fitting

        lo = c.ok_max if c.ok_max is not None else self.low - 1
        hi = c.bad_min if c.bad_min is not None else self.high + 1
        if hi - lo <= 1 or self.peak is None or c.predicted is None and not c.ratios:
            return None
        if self._fits(c, lo + 1) is None:
            return None
        # plan's grid inside the bounds (memory need not be monotone in the batch: the same grid
        # gives the same answer as `oomtune plan` before any measurement)
        grid = sorted({lo + 1, hi - 1, *(b for b in grid_batches(self.low, self.high) if lo < b < hi)})
        return largest_fitting(lambda b: bool(self._fits(c, b)), grid)

    def _wants_boundary(self, c: ConfigFrontier) -> bool:
        if c.is_default or self.boundary_all:
            return True
        lead = self.leader()
        return lead is None or lead is c

    def next_probe(self, c: ConfigFrontier) -> int | None:
        """The next batch to try for ``c``, or None when it is done."""
        predicted = c.predicted is not None or bool(c.ratios)
        if not c.selected or c.exact or (predicted and c.probes >= self.max_probes):
            return None
        if c.force_next is not None:
            return c.force_next
        lo = c.ok_max if c.ok_max is not None else self.low - 1
        hi = c.bad_min if c.bad_min is not None else self.high + 1
        if hi - lo <= 1:
            return None
        target = self.calibrated_frontier(c)
        lead = self.leader()
        if not c.is_default and lead is not None and lead is not c:
            potential = target if target is not None else (hi - 1 if c.ok_max is None else c.ok_max)
            if potential <= lead.ok_max:
                return None  # cannot beat the leader's measured batch
        if not predicted:  # no prediction: doubling, then bisection (it ends by ``precision``)
            if c.ok_max is None:
                return self.low if c.bad_min is None else (None if c.bad_min <= self.low else max(self.low, c.bad_min // 2))
            if c.bad_min is None:
                return None if c.ok_max >= self.high else min(self.high, c.ok_max * 2)
            if c.bad_min - c.ok_max <= max(1, int(c.ok_max * self.precision)):
                return None
            return (c.ok_max + c.bad_min) // 2
        if target is not None:
            return target
        # The calibrated prediction has nothing left between the bounds.
        if c.ok_max is not None:
            return c.ok_max + 1 if self._wants_boundary(c) else None
        return max(lo + 1, min(hi - 1, int(hi * 0.9)))  # failed below the prediction: step down 10%

    def next_round(self) -> list[tuple[ConfigFrontier, int]]:
        """(configuration, batch) pairs to run now, default first; empty when the frontier phase is done."""
        out = []
        for c in sorted(self.configs, key=lambda c: (not c.is_default, -(c.predicted or 0))):
            batch = self.next_probe(c)
            if batch is not None:
                out.append((c, batch))
        return out
