"""Objective ``throughput``: samples/s among the candidates within the memory limit.

The frontier probes find every configuration's largest feasible batch; the sampler (TPE by default)
then searches throughput among feasible candidates and data-loader settings. Ranked by the measured
samples/s, with two rules: allocator settings must earn their place (a non-default configuration
that beats the best default one by less than ``min_gain`` ranks below it), and an input-bound
workload (field case C11) prefers the smallest batch within 5% of the best. A gain is claimed only
beyond the measured noise: the top ``finalists`` and the baseline are each measured ``repeats``
times in clean processes, interleaved on one device, and a candidate beats the baseline only when
its slowest repeat is faster than the baseline's fastest and its mean beats the baseline's by more
than ``min_gain`` (:func:`oomtune.search.ranking.beats`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from oomtune.search.confirmation import ConfirmContext, Confirmed, same_allocator
from oomtune.search.objectives.base import Objective
from oomtune.search.objectives.batch import confirm_once
from oomtune.search.ranking import Repeats, beats, best_repeats
from oomtune.study import records as R

__all__ = ["ThroughputObjective", "prefer_default", "INPUT_BOUND_WITHIN"]

#: Input-bound: candidates within this fraction of the best throughput count as equally fast.
INPUT_BOUND_WITHIN = 0.05


def _speed(trial: Any) -> float:
    """The samples/s Optuna holds for a trial (0.0 without a value)."""
    return trial.value or 0.0


class ThroughputObjective(Objective):
    """The fastest feasible candidate, claimed over the baseline only beyond the noise (see the
    module docstring)."""

    name = "throughput"
    uses_sampler = True
    probes_every_frontier = True
    measures_time = True

    def rank(self, trials: Sequence[Any], *, is_default: Callable[[Any], bool], min_gain: float,
             input_bound: bool = False) -> list[Any]:
        """Highest samples/s first (ties: the earlier trial), the best default-allocator trial first
        unless beaten by ``min_gain`` (:func:`prefer_default`); when ``input_bound``, the trials within
        :data:`INPUT_BOUND_WITHIN` of the best come first, smallest batch first."""
        ranked = prefer_default(sorted(trials, key=lambda t: (-_speed(t), t.number)), is_default, min_gain)
        if input_bound and ranked:
            near = [t for t in ranked if _speed(t) >= (1 - INPUT_BOUND_WITHIN) * _speed(ranked[0])]
            near.sort(key=lambda t: (t.params["batch_size"], -_speed(t)))
            ranked = near + [t for t in ranked if t not in near]
        return ranked

    def confirm(self, ctx: ConfirmContext, ranked: list[Any], max_candidates: int) -> Confirmed:
        """Top ``finalists`` and the baseline, ``repeats`` clean runs each; the winner must beat the
        baseline beyond the measured spread, else the baseline is the answer. With fewer than two
        repeats no spread is measured: confirmed as the batch objective confirms (one clean run of
        the first that passes, :func:`oomtune.search.objectives.batch.confirm_once`)."""
        if ctx.repeats < 2:   # the schema asks repeats >= 3 (a gain needs 3 per side)
            return confirm_once(ctx, ranked, max_candidates)
        base = ctx.baseline() or next((t for t in ranked if ctx.is_default(t)), None)
        finalists = ranked[:ctx.finalists]
        if base is not None and base not in finalists:
            finalists.append(base)
        if base is not None:   # the baseline first: every rotation starts from it once
            finalists = [base] + [t for t in finalists if t is not base]
        runs = ctx.runs(finalists, ctx.repeats, interleave=True)
        reps = {t.number: Repeats(t, [float(R.result_of(r).throughput.samples_per_s or 0.0)
                                      for r in runs[t.number] if R.is_feasible_ok(r)],
                                  failed=not all(R.is_feasible_ok(r) for r in runs[t.number]))
                for t in finalists}
        best = best_repeats(list(reps.values()))
        if best is None:
            return Confirmed(None, None, False)
        base_rep = reps.get(base.number) if base is not None else None
        top, claimed = best, False
        same = base_rep is not None and same_allocator(best.trial, base_rep.trial)
        if base_rep is not None and not base_rep.failed and best is not base_rep and not same:
            claimed = beats(best, base_rep, ctx.min_gain)
            if not claimed:
                best = base_rep  # not beyond the noise: the default allocator stays
        gain = None
        if base_rep is not None and base_rep.values:
            gain = {"objective": self.name, "throughput_ratio": best.mean / base_rep.mean,
                    "claimed": claimed, "winner": best.to_dict(), "baseline": base_rep.to_dict(),
                    "candidate": top.to_dict(),  # the fastest survivor, claimed or not
                    "from": f"means of {ctx.repeats} clean-process runs each"}
            if same and best is not base_rep:
                gain["same_configuration"] = True   # the default allocator at another batch
        winner_runs = [r for r in runs[best.trial.number] if R.is_feasible_ok(r)]
        return Confirmed(best.trial, R.result_of(winner_runs[-1]), True, gain)

    def gain_line(self, gain: dict[str, Any], *, summary: Any, best: Any, baseline: Any,
                  memory_source: str) -> str:
        w, b = gain.get("candidate") or gain["winner"], gain["baseline"]
        noise = (f"{w['mean']:.1f} [{min(w['throughputs']):.1f}-{max(w['throughputs']):.1f}] vs "
                 f"{b['mean']:.1f} [{min(b['throughputs']):.1f}-{max(b['throughputs']):.1f}] samples/s, "
                 f"{len(w['throughputs'])} clean runs each")
        if gain.get("claimed"):
            return (f"vs the default allocator at its largest batch ({baseline.batch_size}): "
                    f"{gain['throughput_ratio']:.2f}x throughput ({noise})")
        return f"the default allocator won: no allocator setting beat it beyond the measured noise ({noise})"


def prefer_default(ranked: list[Any], is_default: Callable[[Any], bool], min_gain: float) -> list[Any]:
    """Allocator settings must earn their place: when the best candidate with non-default settings
    (``ranked``: fastest first) beats the best default-allocator candidate by less than ``min_gain``
    (2% by default: within the noise of a few measured steps), the default one ranks first."""
    best_default = next((t for t in ranked if is_default(t)), None)
    if not ranked or best_default is None or is_default(ranked[0]):
        return ranked
    if _speed(ranked[0]) < _speed(best_default) * (1 + min_gain):
        return [best_default] + [t for t in ranked if t is not best_default]
    return ranked
