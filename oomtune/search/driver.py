"""The search: baseline probes, the Optuna loop, confirmation of the winner.

One way through: config -> :class:`Search` (parent only; owns the study) -> a trial process per
candidate (:mod:`oomtune.trial.runner`) -> TrialResult -> told to Optuna -> best.yaml.

- Baseline: torch's default allocator at the largest batch that fits, found by doubling then
  bisection (Lightning's binsearch scaling), each probe a real trial.
- Search: Optuna (TPE by default) over batch size x allocator keys; memory failures and other
  infeasible outcomes are COMPLETE trials with a violated constraint (``Trial.set_constraint``), not
  FAIL, so the sampler learns where the budget ends. Errors and crashes are FAIL.
- Candidates a smaller batch already showed infeasible under the same settings (memory grows with the
  batch) or that the virtual GPU predicts far over the budget are recorded without launching.
- The answer is always a configuration that ran (field case C6), confirmed in a clean process for
  more steps (C7); if confirmation fails, the next best is confirmed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from oomtune.outcome import Outcome
from oomtune.search import records as R
from oomtune.search.space import Candidate, SearchSpace
from oomtune.trial.record import TrialResult, TrialSpec
from oomtune.units import format_bytes

__all__ = ["Search", "SearchOptions", "SearchSummary", "SetupFault"]


class SetupFault(RuntimeError):
    """The workload fails even at the smallest batch with the default allocator: not a tuning result."""


class _TrialErrored(Exception):
    """Raised inside the objective so Optuna records an error/crash trial as FAIL."""


@dataclass
class SearchOptions:
    """Everything :class:`Search` needs, resolved (bytes, seconds)."""

    workload: dict[str, Any]
    device: str
    budget_bytes: int
    headroom: float = 0.05
    n_trials: int = 12
    timeout_s: float | None = None
    baseline: bool = True
    confirm: bool = True
    warmup_steps: int = 1
    measure_steps: int = 3
    confirm_steps: int = 10
    trial_timeout_s: float = 300.0
    baseline_precision: float = 0.1   # bisect until (fail - ok) <= precision * ok
    min_gain: float = 0.02            # a non-default setting must beat the default allocator by this


@dataclass
class SearchSummary:
    """What the search found; numbers of Optuna trials refer to the study."""

    best: Any | None                     # FrozenTrial of the winner (its measurement)
    best_result: TrialResult | None      # the confirmation's result when confirmed, else the trial's
    confirmed: bool
    baseline: Any | None                 # FrozenTrial of the baseline
    outcomes: dict[str, int] = field(default_factory=dict)
    launches: int = 0
    launches_saved: int = 0
    verdict: Any = None                  # oomtune.diagnose.Verdict (input-bound diagnosis)


class Search:
    """Drive one study. ``runner`` runs a TrialSpec in a fresh process and returns a TrialResult;
    ``confirm_runner`` must use a clean process (spawn). ``predict`` maps a Candidate to a predicted
    peak reserved in bytes (or None) for pruning; ``on_trial`` is called after every trial."""

    def __init__(self, study: Any, space: SearchSpace, options: SearchOptions, *, runner: Any,
                 confirm_runner: Any, workdir: Path, predict: Callable[[Candidate], int | None] | None = None,
                 prune_margin: float | None = 0.10, on_trial: Callable[[Any, str], None] | None = None):
        self.study, self.space, self.opt = study, space, options
        self.runner, self.confirm_runner, self.workdir = runner, confirm_runner, workdir
        self.predict, self.prune_margin = predict, prune_margin
        self.on_trial = on_trial or (lambda trial, role: None)
        self.limit = R.MemoryLimit(options.budget_bytes, options.headroom)
        self.verdict: Any = None  # oomtune.diagnose.Verdict of the ranked trials (after confirm())

    # ---------------------------------------------------------------- running one candidate
    def _spec(self, cand: Candidate, *, steps: int | None = None) -> TrialSpec:
        smaller_ok = any(
            R.result_of(t) is not None and t.user_attrs.get(R.ATTR_OUTCOME) == "ok"
            and t.params.get("batch_size", 0) < cand.batch_size
            for t in self.study.get_trials(deepcopy=False)
        )
        return TrialSpec(
            workload=cand.apply_data(self.opt.workload), batch_size=cand.batch_size, alloc_conf=cand.alloc_conf,
            device=self.opt.device, budget_bytes=self.opt.budget_bytes,
            warmup_steps=self.opt.warmup_steps, measure_steps=steps or self.opt.measure_steps,
            timeout_s=self.opt.trial_timeout_s, smaller_batch_succeeded=smaller_ok,
        )

    def _known_infeasible(self, cand: Candidate, predicted: int | None) -> TrialResult | None:
        """A result that makes ``cand`` infeasible without running it: a smaller batch already ran out
        of memory under the same settings, or ``predicted`` (peak reserved, bytes) is over the limit by
        more than the prune margin."""
        for t in self.study.get_trials(deepcopy=False):
            res = R.result_of(t)
            if res is None or t.user_attrs.get(R.ATTR_ROLE) == "confirm":
                continue
            same = all(t.params.get(k) == v for k, v in cand.optuna_params().items() if k != "batch_size")
            if same and res.outcome_enum.is_memory and t.params.get("batch_size", 0) <= cand.batch_size:
                why = (f"batch {t.params['batch_size']} already ran out of device memory under the same "
                       f"allocator settings (trial {t.number})")
                return self._not_launched(cand, why)
        if self.prune_margin is None:
            return None
        if predicted is not None and predicted > self.limit.limit_bytes * (1 + self.prune_margin):
            why = (f"the virtual GPU predicts a peak reserved of {format_bytes(predicted)}, over the limit "
                   f"{format_bytes(self.limit.limit_bytes)} by more than {self.prune_margin:.0%}")
            return self._not_launched(cand, why)
        return None

    def _not_launched(self, cand: Candidate, why: str) -> TrialResult:
        return TrialResult(outcome=Outcome.PREDICTED_INFEASIBLE.value, memory_source="simulated",
                           batch_size=cand.batch_size, alloc_conf=cand.alloc_conf, message=why)

    def _reusable(self, cand: Candidate) -> Any | None:
        """An earlier launched trial of exactly this candidate (TPE may suggest a point twice)."""
        for t in self.study.get_trials(deepcopy=False):
            if (R.result_of(t) is not None and t.user_attrs.get(R.ATTR_ROLE) != "confirm"
                    and R.ATTR_REUSED not in t.user_attrs
                    and t.user_attrs.get(R.ATTR_OUTCOME) != Outcome.PREDICTED_INFEASIBLE.value
                    and t.params == cand.optuna_params()):
                return t
        return None

    def _evaluate(self, trial: Any, cand: Candidate, role: str) -> float:
        trial.set_user_attr(R.ATTR_ROLE, role)
        trial.set_user_attr(R.ATTR_CONF, cand.alloc_conf)
        predicted = self.predict(cand) if self.predict is not None else None
        if predicted is not None:
            trial.set_user_attr(R.ATTR_PREDICTED, int(predicted))
        known = self._known_infeasible(cand, predicted) if role == "search" else None
        earlier = self._reusable(cand) if role == "search" and known is None else None
        if known is not None:
            result = known
        elif earlier is not None:
            result = R.result_of(earlier)
            trial.set_user_attr(R.ATTR_REUSED, earlier.number)
        else:
            result = self.runner.run(self._spec(cand), workdir=self.workdir / f"trial-{trial.number:04d}")
        return self._tell(trial, result)

    def _tell(self, trial: Any, result: TrialResult) -> float:
        """Store ``result`` on the running Optuna trial and return its objective value (throughput in
        samples/s, 0.0 unless ok); raises :class:`_TrialErrored` for an error or crash (Optuna: FAIL)."""
        trial.set_user_attr(R.ATTR_RESULT, result.to_dict())
        trial.set_user_attr(R.ATTR_OUTCOME, result.outcome)
        outcome = result.outcome_enum
        if outcome.is_fault:
            raise _TrialErrored(result.message or outcome.value)
        trial.set_constraint("memory", R.violation(result, self.limit))
        return float(result.throughput or 0.0) if outcome is Outcome.OK else 0.0

    def _run_one(self, cand: Candidate, role: str) -> Any:
        """Run ``cand`` as the next trial of the study; returns the FrozenTrial."""
        self.study.enqueue_trial(cand.optuna_params(), skip_if_exists=False)
        numbers: list[int] = []

        def objective(trial: Any) -> float:
            numbers.append(trial.number)
            return self._evaluate(trial, self.space.suggest(trial), role)

        self.study.optimize(objective, n_trials=1, catch=(_TrialErrored,), gc_after_trial=False)
        frozen = self.study.get_trials(deepcopy=False)[numbers[0]] if numbers else None
        if frozen is not None:
            self.on_trial(frozen, role)
        return frozen

    # ---------------------------------------------------------------- phases
    def _finished(self, role: str) -> list[Any]:
        import optuna

        # Trials with a stored result; one interrupted by Ctrl-C/SIGTERM is FAIL without a result
        # and does not count, so a resumed search runs it again.
        done = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL)
        return [t for t in self.study.get_trials(deepcopy=False, states=done)
                if t.user_attrs.get(R.ATTR_ROLE) == role and R.ATTR_RESULT in t.user_attrs]

    def run_baseline(self) -> Any | None:
        """Largest batch that fits under torch's default allocator (doubling, then bisection).

        With a prediction, the first probe is the predicted largest batch and the second the one
        above it: when both agree with the prediction the boundary is found in two trials.

        Raises:
            SetupFault: the smallest batch fails with an error that is not a memory outcome.
        """
        if not self.opt.baseline:
            return None
        tried: dict[int, Any] = {t.params["batch_size"]: t for t in self._finished("baseline")}
        low, high = self.space.batch_low, self.space.batch_high
        batch, predicted_max = low, None
        if self.predict is not None:
            predicted_max = self._predicted_max_default()
            if predicted_max is not None:
                batch = max(low, min(high, predicted_max))
        while True:
            ok = [b for b, t in tried.items() if R.is_feasible_ok(t)]
            bad = [b for b, t in tried.items() if not R.is_feasible_ok(t)]
            ok_max = max(ok) if ok else None
            bad_min = min((b for b in bad if ok_max is None or b > ok_max), default=None)
            nxt = self._next_probe(ok_max, bad_min, low, high)
            if nxt is None:
                break
            if not tried:
                nxt = batch
            elif ok_max == predicted_max and bad_min is None and nxt > ok_max:
                nxt = ok_max + 1  # the prediction held: test the boundary it names, then stop
            trial = self._run_one(self.space.default(nxt), "baseline")
            tried[nxt] = trial
            res = R.result_of(trial)
            if nxt == low and res is not None and res.outcome_enum.is_fault:
                raise SetupFault(f"the workload fails at batch {low} with the default allocator "
                                 f"({res.outcome}): {res.message}")
        ok = [t for t in tried.values() if R.is_feasible_ok(t)]
        return max(ok, key=lambda t: t.params["batch_size"]) if ok else None

    def _next_probe(self, ok_max: int | None, bad_min: int | None, low: int, high: int) -> int | None:
        if ok_max is None and bad_min is None:
            return low
        if ok_max is None:
            return None if bad_min <= low else max(low, bad_min // 2)
        if bad_min is None:
            return None if ok_max >= high else min(high, ok_max * 2)
        if bad_min - ok_max <= max(1, int(ok_max * self.opt.baseline_precision)):
            return None
        return (ok_max + bad_min) // 2

    def _predicted_max_default(self) -> int | None:
        lo, hi, best = self.space.batch_low, self.space.batch_high, None
        while lo <= hi:  # memory is monotone in the batch size: bisect on the prediction
            mid = (lo + hi) // 2
            predicted = self.predict(self.space.default(mid))
            if predicted is None:
                return None
            if predicted <= self.limit.limit_bytes:
                best, lo = mid, mid + 1
            else:
                hi = mid - 1
        return best

    def run_search(self, baseline: Any | None = None) -> None:
        """The sampler's trials, up to ``n_trials`` in total (finished ones count: resume).

        With a baseline at batch B, the sampler's batch range starts at max(low, B // 4): throughput
        rarely peaks far below the largest batch that fits, and the range stays wide enough to
        find one that does."""
        remaining = self.opt.n_trials - len(self._finished("search"))
        if remaining <= 0:
            return
        low = baseline.params["batch_size"] // 4 if baseline is not None else None

        def objective(trial: Any) -> float:
            return self._evaluate(trial, self.space.suggest(trial, batch_low=low), "search")

        def callback(study: Any, frozen: Any) -> None:
            self.on_trial(frozen, "search")

        self.study.optimize(objective, n_trials=remaining, timeout=self.opt.timeout_s,
                            catch=(_TrialErrored,), callbacks=[callback], gc_after_trial=False)

    def _ranked(self) -> list[Any]:
        """Feasible trials that ran, best first: highest throughput; but when the workload is
        input-bound (field case C11) the smallest batch within 5% of the best throughput comes first,
        since a bigger batch buys nothing while the GPU waits for data."""
        from oomtune.diagnose import input_bound_verdict

        trials = [t for t in self.study.get_trials(deepcopy=False)
                  if t.user_attrs.get(R.ATTR_ROLE) in ("baseline", "search") and R.is_feasible_ok(t)
                  and R.ATTR_REUSED not in t.user_attrs]
        ranked = sorted(trials, key=lambda t: (-(t.value or 0.0), t.number))
        self.verdict = input_bound_verdict([R.result_of(t) for t in trials],
                                           data_cfg=self.opt.workload.get("data"))
        ranked = self._prefer_default(ranked)
        if self.verdict.input_bound and ranked:
            near = [t for t in ranked if (t.value or 0.0) >= 0.95 * (ranked[0].value or 0.0)]
            near.sort(key=lambda t: (t.params["batch_size"], -(t.value or 0.0)))
            ranked = near + [t for t in ranked if t not in near]
        return ranked

    def _prefer_default(self, ranked: list[Any]) -> list[Any]:
        """Allocator settings must earn their place: when the best candidate with non-default settings
        beats the best default-allocator candidate by less than ``min_gain`` (2%: within the noise of
        a few measured steps), the default one ranks first."""
        defaults = {k: v for k, v in self.space.default(1).optuna_params().items() if k != "batch_size"}

        def is_default(t: Any) -> bool:
            return all(t.params.get(k) == v for k, v in defaults.items())

        best_default = next((t for t in ranked if is_default(t)), None)
        if not ranked or best_default is None or is_default(ranked[0]):
            return ranked
        if (ranked[0].value or 0.0) < (best_default.value or 0.0) * (1 + self.opt.min_gain):
            return [best_default] + [t for t in ranked if t is not best_default]
        return ranked

    def confirm(self, max_candidates: int = 3) -> tuple[Any | None, TrialResult | None, bool]:
        """Re-run the best candidates in a clean process for ``confirm_steps``; first that passes wins.

        Returns (winner trial, confirmation result or the trial's own, confirmed?)."""
        ranked = self._ranked()
        if not ranked:
            return None, None, False
        if not self.opt.confirm:
            return ranked[0], R.result_of(ranked[0]), False
        done = {t.user_attrs.get(R.ATTR_CONFIRMS): t for t in self._finished("confirm")}
        for cand_trial in ranked[:max_candidates]:
            conf = done.get(cand_trial.number)
            if conf is None:
                conf = self._confirm_one(cand_trial)
            if R.is_feasible_ok(conf):
                return cand_trial, R.result_of(conf), True
        return None, None, False

    def _confirm_one(self, cand_trial: Any) -> Any:
        params = {k: v for k, v in cand_trial.params.items() if k != "batch_size"}
        cand = self.space.candidate(cand_trial.params["batch_size"], params)
        self.study.enqueue_trial(cand.optuna_params(), user_attrs={R.ATTR_CONFIRMS: cand_trial.number})
        numbers: list[int] = []

        def objective(trial: Any) -> float:
            numbers.append(trial.number)
            trial.set_user_attr(R.ATTR_ROLE, "confirm")
            trial.set_user_attr(R.ATTR_CONF, cand.alloc_conf)
            self.space.suggest(trial)
            spec = self._spec(cand, steps=self.opt.confirm_steps)
            result = self.confirm_runner.run(spec, workdir=self.workdir / f"trial-{trial.number:04d}")
            return self._tell(trial, result)

        self.study.optimize(objective, n_trials=1, catch=(_TrialErrored,), gc_after_trial=False)
        frozen = self.study.get_trials(deepcopy=False)[numbers[0]]
        self.on_trial(frozen, "confirm")
        return frozen

    def summary(self, best: Any | None, best_result: TrialResult | None, confirmed: bool,
                baseline: Any | None) -> SearchSummary:
        """Counts over the whole study (every session of a resumed one): outcomes (``ok_over_limit``:
        ran but exceeded the limit; ``interrupted``: killed by Ctrl-C/SIGTERM), trial processes
        launched, and launches saved by prediction or by reusing an identical earlier trial."""
        outcomes: dict[str, int] = {}
        saved = launched = 0
        for t in self.study.get_trials(deepcopy=False):
            key = t.user_attrs.get(R.ATTR_OUTCOME)
            if key is None:
                if t.state.name == "FAIL" and R.ATTR_ROLE in t.user_attrs:
                    outcomes["interrupted"] = outcomes.get("interrupted", 0) + 1
                    launched += 1
                continue
            if key == Outcome.OK.value and t.state.name == "COMPLETE" and not R.is_feasible_ok(t):
                key = "ok_over_limit"  # ran, but its peak exceeded budget x (1 - headroom)
            outcomes[key] = outcomes.get(key, 0) + 1
            if key == Outcome.PREDICTED_INFEASIBLE.value or R.ATTR_REUSED in t.user_attrs:
                saved += 1
            else:
                launched += 1
        return SearchSummary(best, best_result, confirmed, baseline, outcomes, launched, saved,
                             self.verdict)
