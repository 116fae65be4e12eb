"""Input-bound diagnosis: the training loop waits for data, so a bigger batch buys nothing.

Field case C11: a CNN at batch 64 with 4 loader workers and ~50 ms of CPU decode per image shows ~5%
GPU utilisation, and its throughput stays flat as the batch grows (the loader delivers at most
``workers / decode_time`` = 4 / 0.05 s = 80 images/s whatever the batch). The right answer is
"input-bound" with loader advice, never "use a bigger batch".

Evidence, per trial (:func:`is_input_bound`): the data-wait fraction (time blocked in
``next(batches)`` over step time, :class:`oomtune.workloads.StepTimings`) and, on a GPU, the mean
NVML utilisation. Across a study (:func:`input_bound_verdict`): that evidence in most successful
trials *and* throughput that does not grow by more than ``flat_tolerance`` from the smallest batch
to any larger one.

How the search uses it: after the trials, ``v = input_bound_verdict(results, data_cfg=...)``; when
``v.input_bound`` the recommended batch is :func:`smallest_batch_near_best` (the smallest batch
within 5% of the best throughput, never a bigger one) and ``v.reason`` / ``v.advice`` are printed.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from oomtune.outcome import Outcome
from oomtune.trial.record import TrialResult

__all__ = ["WAIT_THRESHOLD", "LOW_UTILIZATION_PERCENT", "FLAT_TOLERANCE", "Verdict", "is_input_bound",
           "throughput_growth", "input_bound_verdict", "smallest_batch_near_best", "loader_advice"]

#: Data-wait fraction at or above which a step is input-bound (half the step spent waiting).
WAIT_THRESHOLD = 0.5
#: Mean GPU utilisation (percent) below which a moderate data wait (>= half the threshold) counts.
LOW_UTILIZATION_PERCENT = 30.0
#: Throughput growth from the smallest batch still counted as flat (10%).
FLAT_TOLERANCE = 0.10


@dataclass(frozen=True)
class Verdict:
    """The study-level diagnosis.

    Attributes:
        input_bound: True when the workload is limited by its input pipeline.
        reason: one line with the figures behind the verdict.
        advice: one line of loader advice when input-bound, else None.
        evidence: ``median_data_wait_fraction`` (None without readings),
            ``mean_gpu_utilization`` (percent, None without NVML), ``throughput_by_batch``
            ({batch size: best samples/s}), ``growth`` (largest / smallest-batch throughput, None
            with fewer than two batch sizes).
    """

    input_bound: bool
    reason: str
    advice: str | None = None
    evidence: dict[str, Any] = field(default_factory=dict)


def _ok(result: TrialResult) -> bool:
    return result.outcome is Outcome.OK


def is_input_bound(result: TrialResult, *, threshold: float = WAIT_THRESHOLD,
                   low_utilization_percent: float = LOW_UTILIZATION_PERCENT) -> bool:
    """True when a successful trial spent most of its steps waiting for data.

    Input-bound when ``data_wait_fraction >= threshold``, or, with an NVML reading, when
    ``gpu_utilization < low_utilization_percent`` and ``data_wait_fraction >= threshold / 2`` (the
    idle GPU corroborates a moderate wait). False for failed trials and when the data-wait fraction
    was not measured (unknown is not evidence).
    """
    wait = result.throughput.data_wait_fraction
    if not _ok(result) or wait is None:
        return False
    if wait >= threshold:
        return True
    util = result.throughput.gpu_utilization
    return util is not None and util < low_utilization_percent and wait >= threshold / 2


def _by_batch(results: Iterable[TrialResult]) -> dict[int, float]:
    """{batch size: best throughput} over successful trials with a throughput, sorted by batch."""
    best: dict[int, float] = {}
    for r in results:
        if _ok(r) and r.throughput.samples_per_s is not None and r.batch_size is not None:
            best[r.batch_size] = max(best.get(r.batch_size, 0.0), r.throughput.samples_per_s)
    return dict(sorted(best.items()))


def throughput_growth(results: Iterable[TrialResult]) -> float | None:
    """Best throughput at any larger batch over the throughput at the smallest batch (1.0 = flat,
    2.0 = doubled); None with fewer than two batch sizes or a zero throughput at the smallest."""
    by_batch = _by_batch(results)
    if len(by_batch) < 2:
        return None
    sizes = list(by_batch)
    base = by_batch[sizes[0]]
    return None if base <= 0 else max(by_batch[b] for b in sizes[1:]) / base


def loader_advice(data_cfg: Mapping[str, Any] | None = None) -> str:
    """One line of input-pipeline advice, naming the current loader settings when known."""
    data = dict(data_cfg or {})
    workers = data.get("num_workers")
    cores = os.cpu_count()
    now = ""
    if workers is not None:
        now = f" (now {workers}; {cores} CPU cores)" if cores else f" (now {workers})"
    return (f"input-bound: a bigger batch will not help. Speed up the input pipeline: raise "
            f"data.num_workers{now}, set pin_memory=true and prefetch_factor=4, cache decoded samples "
            f"or decode on the GPU; then tune the batch again")


def input_bound_verdict(results: Iterable[TrialResult], *, threshold: float = WAIT_THRESHOLD,
                        flat_tolerance: float = FLAT_TOLERANCE,
                        data_cfg: Mapping[str, Any] | None = None) -> Verdict:
    """Decide whether a study's workload is input-bound.

    Rules, over successful trials with a throughput:

    - at least half of those with a data-wait reading are :func:`is_input_bound`, and throughput is
      flat (growth <= 1 + ``flat_tolerance``) or there is only one batch size: input-bound;
    - the same wait evidence but throughput still growing with the batch: not input-bound (a
      bigger batch does help);
    - no data-wait readings (a ``cmd`` target that did not report them): input-bound only when
      throughput is flat and the mean GPU utilisation is below ``LOW_UTILIZATION_PERCENT``;
      flat throughput alone is not evidence (a saturated GPU is flat too).

    Args:
        results: the study's trial records (failed ones are ignored).
        threshold: data-wait fraction for :func:`is_input_bound`.
        flat_tolerance: relative throughput growth still counted as flat.
        data_cfg: the workload's ``data`` mapping, to name its loader settings in the advice.
    """
    ok = [r for r in results if _ok(r) and r.throughput.samples_per_s is not None]
    if not ok:
        return Verdict(False, "no successful trial with a throughput to judge")
    by_batch, growth = _by_batch(ok), throughput_growth(ok)
    waits = [r.throughput.data_wait_fraction for r in ok if r.throughput.data_wait_fraction is not None]
    utils = [r.throughput.gpu_utilization for r in ok if r.throughput.gpu_utilization is not None]
    evidence = {"median_data_wait_fraction": statistics.median(waits) if waits else None,
                "mean_gpu_utilization": statistics.fmean(utils) if utils else None,
                "throughput_by_batch": by_batch, "growth": growth}
    flat = None if growth is None else growth <= 1.0 + flat_tolerance
    sizes = f"batch {min(by_batch)} to {max(by_batch)}"
    if waits:
        bound = sum(is_input_bound(r, threshold=threshold) for r in ok if r.throughput.data_wait_fraction is not None)
        wait_txt = f"data wait {evidence['median_data_wait_fraction']:.0%} of step time (median)"
        if 2 * bound < len(waits):
            return Verdict(False, f"{wait_txt}: not input-bound", None, evidence)
        if flat is False:
            return Verdict(False, f"{wait_txt}, but throughput grows {growth:.2f}x from {sizes}: "
                                  "a bigger batch still helps", None, evidence)
        flat_txt = "" if flat is None else f"; throughput flat ({growth:.2f}x) from {sizes}"
        return Verdict(True, f"{wait_txt}{flat_txt}: input-bound", loader_advice(data_cfg), evidence)
    if flat and utils and evidence["mean_gpu_utilization"] < LOW_UTILIZATION_PERCENT:
        return Verdict(True, f"throughput flat ({growth:.2f}x) from {sizes} at "
                             f"{evidence['mean_gpu_utilization']:.0f}% GPU utilisation: input-bound",
                       loader_advice(data_cfg), evidence)
    return Verdict(False, "no data-wait readings and no low GPU utilisation with flat throughput: "
                          "not judged input-bound", None, evidence)


def smallest_batch_near_best(results: Iterable[TrialResult], *, within: float = 0.05) -> TrialResult | None:
    """The successful trial with the smallest batch whose throughput is within ``within`` (5%) of
    the best one (ties: the higher throughput); None when no trial succeeded with a throughput.
    For an input-bound workload this is the batch to recommend: larger ones only cost memory."""
    ok = [r for r in results if _ok(r) and r.throughput.samples_per_s is not None and r.batch_size is not None]
    if not ok:
        return None
    best = max(r.throughput.samples_per_s for r in ok)  # type: ignore[type-var]
    near = [r for r in ok if r.throughput.samples_per_s >= (1.0 - within) * best]  # type: ignore[operator]
    return min(near, key=lambda r: (r.batch_size, -r.throughput.samples_per_s))  # type: ignore[operator]
