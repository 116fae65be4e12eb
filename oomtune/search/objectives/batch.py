"""Objective ``batch``: the largest batch that fits the budget.

Ranked by batch, ties broken by the lower peak reserved, then by fewer allocator keys set (torch's
defaults first), as batch-size finders rank (Lightning's ``BatchSizeFinder``, Accelerate's
``find_executable_batch_size``): :func:`oomtune.search.ranking.rank_by_batch`. The frontier
probes decide (no sampler trials); the winner is re-run once in a clean process for
``confirm_steps`` (the first of the top candidates that passes), and its batch is compared with the
baseline's frontier probe.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from oomtune.search.confirmation import ConfirmContext, Confirmed, ratio, same_allocator
from oomtune.search.objectives.base import Objective
from oomtune.search.ranking import rank_by_batch
from oomtune.study import records as R

__all__ = ["BatchObjective", "confirm_once"]


class BatchObjective(Objective):
    """The largest feasible batch (see the module docstring)."""

    name = "batch"
    uses_sampler = False
    probes_every_frontier = False
    measures_time = False

    def rank(self, trials: Sequence[Any], *, is_default: Callable[[Any], bool], min_gain: float,
             input_bound: bool = False) -> list[Any]:
        """Larger batch first, then lower peak reserved, fewer keys, earlier trial
        (:func:`oomtune.search.ranking.batch_rank_key`); throughput plays no part."""
        return rank_by_batch(trials)

    def confirm(self, ctx: ConfirmContext, ranked: list[Any], max_candidates: int) -> Confirmed:
        return confirm_once(ctx, ranked, max_candidates)

    def gain_line(self, gain: dict[str, Any], *, summary: Any, best: Any, baseline: Any,
                  memory_source: str) -> str:
        known, total = getattr(summary, "configs_known", (0, 0))
        if gain.get("claimed"):
            return (f"vs the default allocator at its largest batch ({baseline.batch_size}): "
                    f"{gain['batch_size_ratio']:.2f}x batch ({best.batch_size} vs {baseline.batch_size}) "
                    f"within the same budget ({memory_source} memory)")
        if summary.at_top_of_range and best.batch_size == baseline.batch_size:
            top = ("the whole global batch in one micro-batch" if best.global_batch is not None
                   else "the top of the searched range")
            return (f"the default allocator already fits batch {baseline.batch_size}, {top}: no allocator "
                    "setting can show a larger batch here")
        if not total:
            return f"the default allocator won: no allocator setting fits a batch above {baseline.batch_size}"
        if known < total:
            return (f"no allocator setting tried fits a batch above {baseline.batch_size}; {total - known} of "
                    f"{total} configurations were not predicted at every batch size nor tried, so a larger batch "
                    "with them is not ruled out")
        how = "predicted on the virtual GPU or tried" if known else "tried"
        return (f"the default allocator won: no allocator setting fits a batch above {baseline.batch_size} "
                f"(all {total} configurations {how})")


def confirm_once(ctx: ConfirmContext, ranked: list[Any], max_candidates: int) -> Confirmed:
    """The first of the top ``max_candidates`` whose one clean-process run passes (ran ok within the
    limit) wins, with the batch figures against the baseline (:func:`batch_gain`)."""
    for cand_trial in ranked[:max_candidates]:
        runs = ctx.runs([cand_trial], 1)[cand_trial.number]
        if runs and all(R.is_feasible_ok(r) for r in runs):
            return Confirmed(cand_trial, R.result_of(runs[-1]), True, batch_gain(cand_trial, runs, ctx.baseline()))
    return Confirmed(None, None, False)


def batch_gain(winner: Any, runs: list[Any], base: Any | None) -> dict[str, Any] | None:
    """The winner's clean-process confirmation (its last run) against the baseline's frontier probe:
    batch size ratio, peak reserved ratio, and whether a gain is claimed (a larger batch with another
    allocator configuration; never a gain of a configuration over itself). None without a baseline."""
    if base is None:
        return None
    res, base_res = R.result_of(runs[-1]), R.result_of(base)
    same = same_allocator(winner, base)
    gain = {"objective": BatchObjective.name,
            "batch_size_ratio": winner.params["batch_size"] / base.params["batch_size"],
            "peak_reserved_ratio": ratio(res.memory.peak_reserved_bytes, base_res.memory.peak_reserved_bytes),
            # never a gain of a configuration over itself
            "claimed": winner.params["batch_size"] > base.params["batch_size"] and not same,
            "from": "the winner's clean-process confirmation vs the baseline's frontier probe"}
    if same:
        gain["same_configuration"] = True
    return gain
