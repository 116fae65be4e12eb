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

Without a prediction (``search.prune=off``, ``backend:cudaMallocAsync``, a command that records no
allocation stream) the baseline is found by doubling then bisection to ``precision`` (Lightning's
binsearch scaling); with ``probe_unpredicted``, every other configuration is then tried from the
baseline's largest batch upward (the smallest batch that would beat it first), so that "no allocator
setting helps" is only said of configurations that ran.

A configuration is an allocator setting and, when searched, ``activation_checkpointing``. With a
fixed global batch only its micro-batches are batch sizes (``choices``): probes, bisections and
boundaries move along them.

This module holds no Optuna or process code: :class:`FrontierPlanner` says which candidates a round
holds and learns from results; :class:`oomtune.search.driver.Search` runs them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ConfigFrontier", "FrontierPlanner", "predicted_frontiers", "CHECKPOINTING_KEY"]

#: The configuration key that is a training setting, not an allocator key (oomtune.space).
CHECKPOINTING_KEY = "activation_checkpointing"

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
    choices: list[int] | None = field(default=None, repr=False)  # allowed batch sizes (None: every integer)
    covered: bool = False   # predicted at every allowed batch size (recordings may cover only some)

    @property
    def checkpointing(self) -> bool | None:
        """``activation_checkpointing`` of this configuration (None: not searched)."""
        return self.params.get(CHECKPOINTING_KEY)

    @property
    def is_default(self) -> bool:
        """torch's default allocator (every key unset or at torch's default), without activation
        checkpointing."""
        return self.alloc_conf == "" and not self.checkpointing

    @property
    def n_keys(self) -> int:
        """Allocator keys set, plus one for activation checkpointing on."""
        return (0 if not self.alloc_conf else self.alloc_conf.count(",") + 1) + (1 if self.checkpointing else 0)

    @property
    def label(self) -> str:
        """The alloc_conf string (``""``: default), with ``+activation_checkpointing`` when on."""
        return self.alloc_conf + ((" +" if self.alloc_conf else "+") + CHECKPOINTING_KEY if self.checkpointing else "")

    def next_above(self, batch: int) -> int | None:
        """The smallest allowed batch above ``batch`` (None: none)."""
        if self.choices is None:
            return batch + 1
        return next((b for b in self.choices if b > batch), None)

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
        """The measured boundary is known to one batch (to one allowed batch with ``choices``)."""
        if self.ok_max is None or self.bad_min is None:
            return False
        above = self.next_above(self.ok_max)
        return above is None or self.bad_min <= above

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
        calibration, probed, twins}`` (and ``activation_checkpointing`` when searched)."""
        out = {"alloc_conf": self.alloc_conf, "predicted_max_batch": self.predicted,
               "measured_max_batch": self.ok_max, "measured_fail_batch": self.bad_min,
               "calibration": round(self.calibration(), 4) if (self.ratios or self.ratio_floor) else None,
               "probed": self.probes > 0, "twins": list(self.twins)}
        if self.checkpointing is not None:
            out[CHECKPOINTING_KEY] = self.checkpointing
        return out


def predicted_frontiers(predictor: Any, settings_list: Sequence[dict[str, Any]], low: int, high: int,
                        limit_bytes: int, *, choices: Sequence[int] | None = None) -> list[ConfigFrontier]:
    """Every configuration's predicted frontier (shared with ``oomtune plan``:
    :func:`oomtune.plan.feasibility.frontier_row` over :func:`~oomtune.plan.feasibility.grid_batches`,
    or over ``choices``, the allowed batch sizes of a global batch).

    Configurations the virtual GPU cannot simulate get ``predicted=None``. Twins (identical predicted
    frontier and peaks there, same activation checkpointing) are folded into the one with the fewest
    keys set (``twins``).

    Raises:
        ConfigError: a bad workload (capture fails). AllocatorConfigError: an invalid combination.
    """
    from oomtune.alloc.settings import AllocatorSettings
    from oomtune.plan.feasibility import frontier_row, grid_batches, split_simulable, twin_key

    grid = list(choices) if choices is not None else grid_batches(low, high)
    if hasattr(predictor, "prepare"):   # the captures that let the grid's other streams be derived, at once
        predictor.prepare(grid, limit_bytes=limit_bytes)   # none past the first batch over the limit
    out: list[ConfigFrontier] = []
    groups: dict[tuple, ConfigFrontier] = {}
    for mapping in settings_list:
        conf = AllocatorSettings.from_mapping({k: v for k, v in mapping.items()
                                               if v is not None and k != CHECKPOINTING_KEY}).render()
        kept, _ = split_simulable([mapping])
        if not kept:
            out.append(ConfigFrontier(dict(mapping), conf, None))
            continue
        ckpt = {"checkpointing": mapping[CHECKPOINTING_KEY]} if mapping.get(CHECKPOINTING_KEY) is not None else {}
        over = getattr(predictor, "known_over_limit", lambda b, **kw: False)
        needed = [b for b in grid if not over(b, **ckpt)]   # above a batch known over the limit: cannot fit
        known = [b for b in needed if predictor.can_predict(b, **ckpt)] if hasattr(predictor, "can_predict") else grid
        if not known:
            out.append(ConfigFrontier(dict(mapping), conf, None))
            continue
        row = frontier_row(predictor, mapping, known, limit_bytes, dense=choices is None and known == needed)
        at = row.at_max
        cf = ConfigFrontier(dict(mapping), conf, row.max_batch_size,
                            None if at is None else at.peak_reserved_bytes, covered=known == needed)
        key = (twin_key(row), mapping.get(CHECKPOINTING_KEY))   # the rule oomtune plan folds its rows by
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
        configs: from :func:`predicted_frontiers` (or rows without prediction).
        low / high: the searched batch range.
        limit_bytes: budget x (1 - headroom).
        peak: :data:`PeakFn` (raw prediction of any batch; captures new batch sizes as needed), or None.
        max_configs: non-default configurations probed besides the baseline.
        max_probes: probes per configuration while predictions steer them (none without).
        precision: without predictions, bisect until (fail - ok) <= precision x ok.
        boundary_all: probe the batch above every configuration's frontier, not only the baseline's
            and the leader's (the throughput objective needs each frontier).
        choices: the allowed batch sizes, ascending (a global batch's micro-batches); None: every
            integer in ``[low, high]``.
        probe_unpredicted: without predictions, try every configuration (not only the default
            allocator): once the baseline's largest batch is known, each other configuration from the
            smallest batch above it upward.
    """

    def __init__(self, configs: list[ConfigFrontier], low: int, high: int, limit_bytes: int, *,
                 peak: PeakFn | None, max_configs: int = 2, max_probes: int = 6, precision: float = 0.1,
                 boundary_all: bool = False, choices: Sequence[int] | None = None,
                 probe_unpredicted: bool = False):
        self.configs, self.low, self.high, self.limit = configs, low, high, limit_bytes
        self.peak, self.max_probes, self.precision, self.boundary_all = peak, max_probes, precision, boundary_all
        self.choices = sorted(choices) if choices is not None else None
        self.probe_unpredicted = probe_unpredicted
        self.device_ratio = 1.0  # the study's median measured/predicted, for unmeasured configurations
        # the smallest batch at which the default allocator's trial ran past trial.timeout: a hang is
        # not an allocator's doing, so no other configuration is probed at it or above
        self.hung_at: int | None = None
        for c in configs:
            c.choices = self.choices
        default = self.default
        if default is not None:
            default.selected = True
        if probe_unpredicted:
            for c in configs:
                c.selected = True
            return
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

    @property
    def top(self) -> int:
        """The largest allowed batch."""
        return self.choices[-1] if self.choices else self.high

    @property
    def bottom(self) -> int:
        """The smallest allowed batch."""
        return self.choices[0] if self.choices else self.low

    def find(self, alloc_conf: str, checkpointing: bool | None = None) -> ConfigFrontier | None:
        """The probed configuration with this alloc_conf (twins map to their representative) and
        activation checkpointing (None: not searched)."""
        for c in self.configs:
            if (c.alloc_conf == alloc_conf or alloc_conf in c.twins) and c.checkpointing == checkpointing:
                return c
        return None

    def leader(self) -> ConfigFrontier | None:
        """The configuration with the largest measured feasible batch (ties: lower measured peak, then
        fewer keys)."""
        measured = [c for c in self.configs if c.ok_max is not None]
        if not measured:
            return None
        return min(measured, key=lambda c: (-c.ok_max, c.ok_peak_bytes or 0, c.n_keys))

    def drop_predictions(self) -> None:
        """Stop using predictions (a recording contradicted them): every configuration is probed by
        trials from here on, from what its trials measured (:meth:`_unpredicted_probe`)."""
        self.peak = None
        self.probe_unpredicted = True
        for c in self.configs:
            c.predicted = c.predicted_peak_bytes = None
            c.ratios, c.ratio_floor, c.covered = [], 0.0, False
            c.selected = True

    def predicted_or_tried(self) -> tuple[int, int]:
        """(configurations whose frontier is known: predicted at every allowed batch size, or measured
        by a probe; all configurations, folded twins included)."""
        total = sum(1 + len(c.twins) for c in self.configs)
        known = sum(1 + len(c.twins) for c in self.configs if c.covered or c.probes > 0)
        return known, total

    # ---------------------------------------------------------------- allowed batch sizes
    def _between(self, lo: int, hi: int) -> list[int] | None:
        """Allowed batches strictly between ``lo`` and ``hi`` (None with every integer allowed)."""
        if self.choices is None:
            return None
        return [b for b in self.choices if lo < b < hi]

    def _has_between(self, lo: int, hi: int) -> bool:
        inside = self._between(lo, hi)
        return hi - lo > 1 if inside is None else bool(inside)

    def _at_most(self, b: int, lo: int, hi: int) -> int | None:
        """The largest allowed batch <= ``b`` strictly between ``lo`` and ``hi`` (else the smallest
        one between them); None when none is."""
        inside = self._between(lo, hi)
        if inside is None:
            return max(lo + 1, min(hi - 1, b)) if hi - lo > 1 else None
        if not inside:
            return None
        below = [x for x in inside if x <= b]
        return below[-1] if below else inside[0]

    def _at_least(self, b: int, lo: int, hi: int) -> int | None:
        """The smallest allowed batch >= ``b`` strictly between ``lo`` and ``hi`` (else the largest);
        None when none is."""
        inside = self._between(lo, hi)
        if inside is None:
            return max(lo + 1, min(hi - 1, b)) if hi - lo > 1 else None
        if not inside:
            return None
        above = [x for x in inside if x >= b]
        return above[0] if above else inside[-1]

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
        if not self._has_between(lo, hi) or self.peak is None or c.predicted is None and not c.ratios:
            return None
        inside = self._between(lo, hi)
        if self._fits(c, lo + 1 if inside is None else inside[0]) is None:
            return None
        if inside is not None:
            return largest_fitting(lambda b: bool(self._fits(c, b)), inside, dense=False)
        # plan's grid inside the bounds (memory need not be monotone in the batch: the same grid
        # gives the same answer as `oomtune plan` before any measurement)
        grid = sorted({lo + 1, hi - 1, *(b for b in grid_batches(self.low, self.high) if lo < b < hi)})
        return largest_fitting(lambda b: bool(self._fits(c, b)), grid)

    def _wants_boundary(self, c: ConfigFrontier) -> bool:
        if c.is_default or self.boundary_all:
            return True
        lead = self.leader()
        return lead is None or lead is c

    def _unpredicted_probe(self, c: ConfigFrontier, lo: int, hi: int) -> int | None:
        """Without a prediction: doubling from the smallest batch (the default allocator) or from the
        smallest batch above the baseline's largest (other configurations), then bisection until
        ``precision``."""
        if not c.is_default:
            base = self.default
            if base is None or not (base.exact or (base.ok_max is not None and base.ok_max >= self.top)
                                    or not base.selected or (base.ok_max is None and base.bad_min is not None
                                                             and base.bad_min <= self.bottom)):
                return None   # the baseline's largest batch first: the others start above it
            floor = base.ok_max if base.ok_max is not None else self.low - 1
            if c.ok_max is None and c.bad_min is None:
                return self._at_least(floor + 1, max(lo, floor), hi)   # the smallest batch that beats it
            if c.ok_max is None:
                return None   # failed where it would have beaten the baseline: it does not help
        if c.ok_max is None:
            if c.bad_min is None:
                return self.bottom
            return None if c.bad_min <= self.bottom else self._at_most(c.bad_min // 2, lo, hi)
        if c.bad_min is None:
            return None if c.ok_max >= self.top else self._at_least(c.ok_max * 2, lo, hi)
        inside = self._between(c.ok_max, c.bad_min)
        if inside is not None:
            return inside[len(inside) // 2] if inside else None
        if c.bad_min - c.ok_max <= max(1, int(c.ok_max * self.precision)):
            return None
        return (c.ok_max + c.bad_min) // 2

    def next_probe(self, c: ConfigFrontier) -> int | None:
        """The next batch to try for ``c``, or None when it is done. ``max_probes`` bounds the probes
        of a configuration only while predictions steer them: once they are dropped
        (:meth:`drop_predictions`), the bisection goes on to ``precision`` whatever was probed before
        (the recordings counted as probes, and a probe at a recorded batch is still calibrated)."""
        predicted = self.peak is not None and (c.predicted is not None or bool(c.ratios))
        if not c.selected or c.exact or (predicted and c.probes >= self.max_probes):
            return None
        if c.force_next is not None:
            return c.force_next
        lo = c.ok_max if c.ok_max is not None else self.low - 1
        hi = c.bad_min if c.bad_min is not None else self.high + 1
        if not self._has_between(lo, hi):
            return None
        if not predicted or self.peak is None:
            return self._unpredicted_probe(c, lo, hi)
        target = self.calibrated_frontier(c)
        lead = self.leader()
        if not c.is_default and lead is not None and lead is not c:
            potential = target if target is not None else (hi - 1 if c.ok_max is None else c.ok_max)
            if potential <= lead.ok_max:
                return None  # cannot beat the leader's measured batch
        if target is not None:
            return target
        # The calibrated prediction has nothing left between the bounds.
        if c.ok_max is not None:
            return self._at_least(c.ok_max + 1, lo, hi) if self._wants_boundary(c) else None
        return self._at_most(int(hi * 0.9), lo, hi)  # failed below the prediction: step down 10%

    def next_round(self) -> list[tuple[ConfigFrontier, int]]:
        """(configuration, batch) pairs to run now, default first; empty when the frontier phase is done.
        Once the default allocator has timed out at a batch (:attr:`hung_at`), no other configuration
        is probed at that batch or above: the wait would repeat once per configuration."""
        out = []
        for c in sorted(self.configs, key=lambda c: (not c.is_default, -(c.predicted or 0), c.n_keys)):
            batch = self.next_probe(c)
            if batch is not None and not (not c.is_default and self.hung_at is not None and batch >= self.hung_at):
                out.append((c, batch))
        return out
