"""The search: frontier probes, the sampler's trials, honest confirmation of the winner.

One way through: config -> :class:`Search` (parent only; owns the study) -> a trial process per
candidate (:mod:`oomtune.trial.runner`) -> TrialResult -> told to Optuna -> best.yaml.

1. Frontier first (:mod:`oomtune.search.frontier`): before any device trial, every allocator
   configuration's predicted frontier (largest batch within budget x (1 - headroom), computed as
   ``oomtune plan`` does); then rounds of probes: the default allocator at its frontier (the
   baseline, role ``baseline``) and the configurations with the highest predicted frontiers at and
   near theirs (role ``frontier``), each result calibrating that configuration's prediction.
2. The sampler (Optuna, TPE by default) for what the simulator cannot rank: throughput among
   feasible candidates, data-loader settings (objective ``throughput`` only). Memory failures are
   COMPLETE trials with a violated constraint (``Trial.set_constraint``); errors are FAIL.
   Candidates a smaller batch already showed infeasible under the same settings, or that the
   calibrated prediction puts over the limit by more than ``prune_margin``, are recorded without
   launching.
3. Confirmation (:mod:`oomtune.search.confirmation`), as the objective decides
   (:mod:`oomtune.search.objectives`): ``batch``: the largest feasible batch (ties: lower peak
   reserved, fewer keys) re-run in a clean process for ``confirm_steps``; ``throughput``: the top
   candidates and the baseline measured ``repeats`` times each, a gain claimed only beyond the
   measured spread. The answer is always a configuration that ran (field case C6) and passed its
   confirmation (C7).

What differs by objective is asked of the search's :class:`oomtune.search.objectives.Objective`;
this module never compares an objective's name. The smoke test of meta trials
(:mod:`oomtune.search.smoke`), the recordings of a target that records its streams
(:mod:`oomtune.search.recordings`) and the summary (:mod:`oomtune.search.summary`) are modules of
their own.

Every batch of trials goes through :meth:`Search._run_batch` (one trial per candidate, results in
order), the sampler's trials through :meth:`Search.run_search`: both run on the workers of an
:class:`oomtune.search.workers.Executor` (``search.workers`` threads here, plus every other process
on the same storage and study), which claim the study's WAITING trials.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable

from oomtune.interrupts import raise_if_pending
from oomtune.outcome import Outcome
from oomtune.search import recordings as REC
from oomtune.search import smoke as SMOKE
from oomtune.search.claims import ATTR_STOPPED_SEARCH
from oomtune.search.confirmation import ATTR_DEVICE, ATTR_REPEAT, ConfirmContext, confirm_runs
from oomtune.search.faults import RepeatedFault, SetupFault, disk_full_text
from oomtune.search.frontier import ConfigFrontier, FrontierPlanner, predicted_frontiers
from oomtune.search.objectives import Objective, objective_for
from oomtune.search.options import SearchOptions
from oomtune.search.summary import SearchSummary, confirmation_failure, hang_note, steps_ran_on, study_counts
from oomtune.search.tell_records import record_path, write_record
from oomtune.search.trial_sets import PROBE_ROLES, config_key, contradicted, default_hang
from oomtune.search.trial_writes import one_transaction, set_trial_attrs
from oomtune.search.workers import Executor, TrialErrored
from oomtune.space import Candidate, SearchSpace
from oomtune.study import records as R
from oomtune.trial.record import (MEMORY_SOURCE_SIMULATED, TORCH_THREADS_ENV, MemoryReadings, RetriedAfter,
                                  TrialResult, TrialSpec)
from oomtune.units import format_bytes

# SearchSummary, study_counts, hang_note, SetupFault, RepeatedFault, ATTR_REPEAT, ATTR_DEVICE and
# PROBE_ROLES live in the modules named above; they are importable from here as before.
__all__ = ["Search", "SearchOptions", "SearchSummary", "SetupFault", "RepeatedFault", "study_counts", "hang_note",
           "PROBE_ROLES", "ATTR_REPEAT", "ATTR_DEVICE"]

_TrialErrored = TrialErrored  # raised inside the objective so Optuna records an error/crash trial as FAIL


class Search:
    """Drive one study. ``runner`` runs a TrialSpec in a fresh process and returns a TrialResult;
    ``confirm_runner`` must use a clean process (spawn). ``predict`` maps a Candidate to a calibrated
    predicted peak reserved in bytes (or None) for pruning; ``predictor`` (a
    :class:`oomtune.plan.predictor.Predictor`) gives the frontiers; ``on_trial`` is called after
    every trial and ``say`` with one-line messages.

    Trials run through an :class:`oomtune.search.workers.Executor` with one worker thread per entry
    of ``slots`` (the device each worker's trials run on; default one worker on ``options.device``);
    other processes on the same storage and study share the work (see that module)."""

    def __init__(self, study: Any, space: SearchSpace, options: SearchOptions, *, runner: Any,
                 confirm_runner: Any, workdir: Path, predict: Callable[[Candidate], int | None] | None = None,
                 predictor: Any = None, prune_margin: float | None = 0.10,
                 on_trial: Callable[[Any, str], None] | None = None, say: Callable[[str], None] | None = None,
                 slots: Sequence[str] | None = None, poll_s: float = 0.5,
                 recording: Callable[[dict[int, Any], int, Callable[[int], bool]], Any] | None = None):
        self.space, self.opt = space, options
        self.runner, self.confirm_runner, self.workdir = runner, confirm_runner, workdir
        self.predict, self.predictor, self.prune_margin = predict, predictor, prune_margin
        # (recordings, steps, the batch sizes they stand for) -> a predictor over them (target=cmd)
        self.recording = recording
        self.recording_note: str | None = None
        self.on_trial = on_trial or (lambda trial, role: None)
        self.say = say or (lambda text: None)
        self.limit = R.MemoryLimit(options.budget_bytes, options.search.headroom)
        self.verdict: Any = None  # oomtune.diagnose.Verdict of the ranked trials (after confirm())
        self.planner: FrontierPlanner | None = None
        self.gain: dict[str, Any] | None = None
        self._confirms: dict[Candidate, int] = {}  # candidate -> trial number it confirms
        self._local = threading.local()  # the device of the worker thread running a trial
        self._batch_low: int | None = None
        self._contradicted_numbers: set[int] = set()  # trials a passing re-run contradicted (not believed)
        self.timeout_ended = False   # search.timeout ended the sampler's phase (run_search)
        self.executor = Executor(study, list(slots or [options.device]), self._work_on, on_trial=self.on_trial,
                                 say=self.say, poll_s=poll_s, interrupt=self._kill_trials)

    @property
    def study(self) -> Any:
        """The study, as the calling worker thread's own Study object (its own storage cache, so
        that workers do not wait for each other's reads: :meth:`Executor.study_here`)."""
        return self.executor.study_here()

    @property
    def objective(self) -> Objective:
        """The objective of ``options.objective`` (:func:`oomtune.search.objectives.objective_for`):
        everything that differs by objective is asked of it."""
        return objective_for(self.opt.objective)

    # ---------------------------------------------------------------- running candidates
    def _spec(self, cand: Candidate, *, steps: int | None = None, confirm: bool = False,
              trials: Sequence[Any] | None = None, window_s: float = 0.0) -> TrialSpec:
        """The trial of ``cand``. Under a shape distribution every trial is soaked (its answer must
        survive ``soak_steps`` of the data's shapes); a confirmation is always soaked and runs its
        live steps at the distribution's worst shape. ``trials``: the study's trials, when just read."""
        smaller_ok = any(
            R.result_of(t) is not None and R.outcome_of(t) is Outcome.OK
            and t.params.get("batch_size", 0) < cand.batch_size
            for t in (self.study.get_trials(deepcopy=False) if trials is None else trials)
        )
        steps = steps or self.opt.trial.measure_steps
        # trial.timeout is for a search trial; a confirmation runs more steps and gets as much more time.
        t = self.opt.trial
        scale = max(1.0, (t.warmup_steps + steps) / (t.warmup_steps + t.measure_steps))
        timeout_s = self.opt.trial.timeout * scale + window_s
        return TrialSpec(
            workload=cand.apply(self.opt.workload), batch_size=cand.batch_size, alloc_conf=cand.alloc_conf,
            device=getattr(self._local, "device", None) or self.opt.device, budget_bytes=self.opt.budget_bytes,
            warmup_steps=self.opt.trial.warmup_steps, measure_steps=steps,
            timeout_s=timeout_s, smaller_batch_succeeded=smaller_ok, measure_seconds=window_s,
            device_memory_bytes=self.opt.device_memory_bytes,
            soak_steps=self.opt.trial.soak_steps if (confirm or self.opt.variable_shapes) else 0,
            shapes="worst" if confirm and self.opt.variable_shapes else "data",
            # a search trial stops once above the limit; a confirmation runs every step (its record is the answer's)
            limit_bytes=None if confirm else self.limit.limit_bytes,
            execute="meta" if self.opt.execute == "meta" else "cpu",
            memory_fraction=self.opt.search.memory_fraction != "off",
            ranks=self.opt.trial.gpus,
        )

    def _known_infeasible(self, cand: Candidate, predicted: int | None,
                          trials: Sequence[Any] | None = None) -> TrialResult | None:
        """A result that makes ``cand`` infeasible without running it: a smaller batch already ran out
        of memory under the same settings, or ``predicted`` (peak reserved, bytes) is over the limit by
        more than the prune margin."""
        trials = self.study.get_trials(deepcopy=False) if trials is None else trials
        disbelieved = contradicted(trials)
        for t in trials:
            res = R.result_of(t)
            if res is None or t.user_attrs.get(R.ATTR_ROLE) == "confirm" or t.number in disbelieved:
                continue
            same = all(t.params.get(k) == v for k, v in cand.optuna_params().items() if k != "batch_size")
            if same and res.outcome.is_memory and t.params.get("batch_size", 0) <= cand.batch_size:
                why = (f"batch {t.params['batch_size']} already ran out of device memory under the same "
                       f"allocator settings (trial {t.number})")
                return self._not_launched(cand, why)
        hang = default_hang(trials)
        if hang is not None and cand.batch_size >= int(hang.params["batch_size"]):
            why = (f"the default allocator's trial at batch {hang.params['batch_size']} ran past trial.timeout "
                   f"(trial {hang.number}): a hang is not an allocator's doing, so it is not waited for again")
            return self._not_launched(cand, why)
        if self.prune_margin is None:
            return None
        if predicted is not None and predicted > self.limit.limit_bytes * (1 + self.prune_margin):
            why = (f"the virtual GPU predicts a peak reserved of {format_bytes(predicted)}, over the limit "
                   f"{format_bytes(self.limit.limit_bytes)} by more than {self.prune_margin:.0%}")
            return self._not_launched(cand, why)
        return None

    def _not_launched(self, cand: Candidate, why: str) -> TrialResult:
        return TrialResult(outcome=Outcome.PREDICTED_INFEASIBLE,
                           memory=MemoryReadings(source=MEMORY_SOURCE_SIMULATED), batch_size=cand.batch_size,
                           alloc_conf=cand.alloc_conf, message=why)

    def _reusable(self, cand: Candidate, trials: Sequence[Any] | None = None) -> Any | None:
        """An earlier launched trial of exactly this candidate (TPE may suggest a point twice); not a
        recording, which ran without the budget (:meth:`_from_recording` says when one counts)."""
        for t in (self.study.get_trials(deepcopy=False) if trials is None else trials):
            if (R.result_of(t) is not None and t.user_attrs.get(R.ATTR_ROLE) not in ("confirm", "record")
                    and R.ATTR_REUSED not in t.user_attrs and ATTR_STOPPED_SEARCH not in t.user_attrs
                    and R.outcome_of(t) is not Outcome.PREDICTED_INFEASIBLE
                    and t.params == cand.optuna_params()):
                return t
        return None

    def _from_recording(self, cand: Candidate) -> Any | None:
        """A finished recording whose result is this candidate's own, so that the probe is not
        launched again (:func:`oomtune.search.recordings.from_recording`); None when there is none."""
        return REC.from_recording(self.study, self.space, self.recording, self.limit,
                                  objective_for(self.opt.objective), cand)

    def _describe(self, trial: Any, cand: Candidate, role: str) -> int | None:
        """Store what the trial is (role, allocator string, prediction, confirmed trial) before it
        runs; returns the calibrated predicted peak reserved (bytes) or None."""
        attrs: dict[str, Any] = {R.ATTR_CONF: cand.alloc_conf}
        if trial.user_attrs.get(R.ATTR_ROLE) != role:  # set at enqueue / by the Executor's ask
            attrs[R.ATTR_ROLE] = role
        predicted = self.predict(cand) if self.predict is not None else None
        if predicted is not None:
            attrs[R.ATTR_PREDICTED] = int(predicted)
        if role == "confirm":
            attrs[R.ATTR_CONFIRMS] = trial.user_attrs.get(R.ATTR_CONFIRMS, self._confirms.get(cand))
        set_trial_attrs(trial, attrs)
        return predicted

    def running_role(self) -> str | None:
        """The role of the trial the calling worker thread is running (for the progress bar)."""
        return getattr(self._local, "role", None)

    def _evaluate(self, trial: Any, cand: Candidate, role: str, predicted: int | None) -> float:
        self._local.role = role
        if role == "record":   # a recording, not a candidate: on an unbounded virtual GPU (the requests
            # do not depend on the allocator or the budget), so that it completes whatever the budget
            import dataclasses

            spec = dataclasses.replace(self._spec(cand), budget_bytes=None, limit_bytes=None)
            result = self.runner.run(spec, workdir=self.workdir / f"trial-{trial.number:04d}", **self._trial_env())
            return self._tell(trial, result)
        if role == "confirm":
            # an objective that measures time times its confirmation runs over a window of seconds, not steps
            window = self.opt.window_s if self.objective.measures_time else 0.0
            spec = self._spec(cand, steps=self.opt.trial.confirm_steps, confirm=True, window_s=window)
            result = self._launch(self.confirm_runner, spec, self.workdir / f"trial-{trial.number:04d}")
            return self._tell(trial, result, confirm=True)
        # one read for the three checks below: the worker's read made right before it created this
        # trial (a sampler trial), else a new one
        trials = self.executor.last_read()
        if trials is None:
            trials = self.study.get_trials(deepcopy=False)
        known = self._known_infeasible(cand, predicted, trials) if role == "search" else None
        earlier = self._reusable(cand, trials) if role == "search" and known is None else None
        recorded = self._from_recording(cand) if known is None and earlier is None else None
        extra: dict[str, Any] = {}
        if known is not None:
            result = known
        elif earlier is not None:
            result = R.result_of(earlier)
            extra[R.ATTR_REUSED] = earlier.number
        elif recorded is not None:
            result = R.result_of(recorded)
            extra[R.ATTR_FROM_RECORDING] = recorded.number
        else:
            result = self._launch(self.runner, self._spec(cand, trials=trials), self.workdir / f"trial-{trial.number:04d}")
        return self._tell(trial, result, extra)

    def _launch(self, runner: Any, spec: TrialSpec, workdir: Path) -> TrialResult:
        """Run ``spec`` on ``runner``; a ``crash`` (a signal without a record: a native crash, or a
        kill from outside such as ``kill -9`` or a preemption, told from the OOM killer by
        :mod:`oomtune.trial.oomkill`) is run once more, and the second result stands (one
        stray kill must not decide a point). ``retried_after`` keeps the first."""
        result = runner.run(spec, workdir=workdir, **self._trial_env())
        if result.outcome is not Outcome.CRASH or self.executor.interrupted.is_set():
            return result
        self.say(f"batch {spec.batch_size} {spec.alloc_conf or '(default)'}: {result.message}; running it once more")
        again = runner.run(spec, workdir=workdir.with_name(workdir.name + "-retry"), **self._trial_env())
        return dataclasses.replace(again, retried_after=RetriedAfter(outcome=result.outcome, message=result.message,
                                                         returncode=result.process.returncode))

    def _tell(self, trial: Any, result: TrialResult, extra: dict[str, Any] | None = None, *,
              confirm: bool = False) -> float:
        """Store ``result`` on the running Optuna trial and return its objective value (throughput in
        samples/s, 0.0 unless ok); raises :class:`_TrialErrored` for an error or crash (Optuna: FAIL).
        A trial killed because this process was interrupted is not a result: KeyboardInterrupt.
        ``confirm``: the trial is a clean-process confirmation (:meth:`_repeated_fault`).

        The outcome is written to the trial's record in the run directory first
        (:mod:`oomtune.search.tell_records`), then to the storage (retried while its connection is
        lost: :mod:`oomtune.study.reconnect`); a record that cannot be written (full disk) is said
        in one line and the storage is told all the same.

        Raises:
            DiskFullError: the trial process failed because the disk is full (not a result: the
                trial stays without one, and the same command runs it again).
            StorageUnavailableError: the storage stayed unreachable (the record keeps the result).
        """
        from optuna.exceptions import UpdateFinishedTrialError
        from optuna.trial import TrialState

        from oomtune.exceptions import DiskFullError

        raise_if_pending()   # a trial killed by a stop signal is not a result, even where its raise was dropped
        if self.executor.interrupted.is_set():
            raise KeyboardInterrupt
        outcome = result.outcome
        if outcome.is_fault and disk_full_text(result):
            raise DiskFullError(f"disk full: trial {trial.number} could not write its files "
                                f"({self.workdir / f'trial-{trial.number:04d}'}): free space on its file system")
        # the record, its outcome, the peak readable in optuna-dashboard and (unless a fault) the
        # memory constraint: one storage round trip
        stop = self._repeated_fault(trial, result, confirm=confirm) if outcome.is_fault else None
        user_attrs = {R.ATTR_RESULT: result.to_dict(), R.ATTR_OUTCOME: result.outcome.value,
                      R.ATTR_PEAK_RESERVED: R.peak_reserved_label(result), **(extra or {}),
                      **({ATTR_STOPPED_SEARCH: True} if stop is not None else {})}
        constraints = {} if outcome.is_fault else {"memory": R.violation(result, self.limit)}
        value = self.objective.value(result)
        try:
            write_record(self.workdir, trial.study.study_name, trial,
                         state=TrialState.FAIL if outcome.is_fault else TrialState.COMPLETE,
                         value=value, user_attrs=user_attrs, constraints=constraints)
        except (DiskFullError, OSError) as exc:
            self.say(f"[trial {trial.number}] note: its record could not be written ({exc}); telling the storage only")
        try:
            set_trial_attrs(trial, user_attrs, constraints)
        except UpdateFinishedTrialError:
            # finished meanwhile: told from its record by another process, or failed by another
            # worker after its heartbeat stopped during an outage longer than the grace period
            if R.ATTR_RESULT not in trial.study._storage.get_trial(trial._trial_id).user_attrs:
                self.say(f"[trial {trial.number}] its result came after another worker had failed it (no heartbeat "
                         f"while the storage was unreachable); kept in {record_path(self.workdir, trial.number)}, "
                         "and the candidate runs again")
        if stop is not None:
            self.executor.stop(stop)   # after this trial is told and shown
        if outcome.is_fault:
            raise _TrialErrored(result.message or outcome.value)
        return float(value or 0.0)

    def _repeated_fault(self, trial: Any, result: TrialResult, *, confirm: bool = False) -> "RepeatedFault | None":
        """The :class:`RepeatedFault` that stops the search after this trial when it failed in a way
        every configuration would repeat (:func:`oomtune.classify._repeats.repeats_everywhere`: exit
        status 2, an import or compile error; or a command that never reported), and either no trial
        of the study has succeeded (a failure after a success depends on the batch or the settings)
        or the trial is a confirmation (``confirm``): every confirmation runs the same steps
        (``trial.confirm_steps``, where the probes ran ``trial.measure_steps``), so a usage error of
        one (e.g. an integration's "training ended after 4 optimizer step(s), before the 11 the trial
        needs") is every other candidate's too, and the next candidate's confirmation would only
        repeat it. None otherwise."""
        from oomtune.classify._repeats import repeats_everywhere

        if result.outcome is not Outcome.ERROR:
            return None
        no_report = result.script.no_report
        if not no_report and not repeats_everywhere(returncode=result.process.returncode, message=result.message):
            return None
        if not confirm and any(R.outcome_of(t) is Outcome.OK for t in self.study.get_trials(deepcopy=False)):
            return None
        where = self.workdir / f"trial-{trial.number:04d}"
        advice = f"; {result.advice}" if no_report and result.advice else ""
        what = f"batch {result.batch_size}, {result.alloc_conf or 'default allocator'}"
        if confirm:
            t = self.opt.trial
            return RepeatedFault(
                f"trial {trial.number} (the clean-process confirmation at {what}) failed in a way every "
                f"confirmation would repeat, so the search stops: {result.message}{advice} (its output: "
                f"{where}/stderr.txt; a confirmation runs trial.warmup_steps={t.warmup_steps} + "
                f"trial.confirm_steps={t.confirm_steps} steps, the probes ran {t.warmup_steps} + "
                f"trial.measure_steps={t.measure_steps}); fix it and run the same command again")
        return (RepeatedFault(
            f"trial {trial.number} ({what}) failed in a "
            f"way every allocator configuration would repeat, so the search stops: {result.message}{advice} (its "
            f"output: {where}/stderr.txt); fix it and run the same command again"))

    def _run_batch(self, cands: list[Candidate], role: str,
                   extra_attrs: Sequence[dict[str, Any]] | None = None) -> list[Any]:
        """Run independent candidates (one round), one trial each, and return their FrozenTrials in
        the order given: the only place trials of a round are launched. They run at once on the
        workers (:class:`oomtune.search.workers.Executor`; other processes' workers included); a
        candidate the study already ran in the same role is not run again. ``role`` ``frontier``
        stores the default allocator's probes as ``baseline``; ``confirm`` runs in a clean process
        for ``confirm_steps`` (repeats of one candidate are told apart by :data:`ATTR_REPEAT`)."""
        items, seen = [], Counter()
        for i, cand in enumerate(cands):
            default = cand.alloc_conf == "" and not cand.activation_checkpointing
            this_role = "baseline" if role == "frontier" and default else role
            attrs: dict[str, Any] = dict(extra_attrs[i]) if extra_attrs is not None else {}
            if role == "confirm":
                confirms = self._confirms.get(cand)
                prior = sum(1 for t in self._finished("confirm") if t.user_attrs.get(R.ATTR_CONFIRMS) == confirms)
                attrs.update({R.ATTR_CONFIRMS: confirms, ATTR_REPEAT: prior + seen[cand]})
                seen[cand] += 1
            items.append((cand.optuna_params(), this_role, attrs))
        return self.executor.run_batch(items)

    def _work_on(self, trial: Any, slot: str) -> float:
        """Run one claimed trial (of any role; it may come from another process's round) on the
        worker's device ``slot``: the Executor's evaluate function."""
        self._local.device = trial.user_attrs.get(ATTR_DEVICE) or slot   # a pinned trial runs on its device
        role = trial.user_attrs.get(R.ATTR_ROLE, "search")
        with one_transaction(trial):  # one storage round trip: the candidate's parameters and what it is
            cand = self.space.suggest(trial, batch_low=self._batch_low if role == "search" else None)
            if role == "record" and self.space.global_batch is not None:   # two micro-batches (_record_streams)
                import dataclasses

                cand = dataclasses.replace(cand, grad_accum=2)
            predicted = self._describe(trial, cand, role) if role != "record" else None
            if role == "record":
                set_trial_attrs(trial, {R.ATTR_CONF: cand.alloc_conf})
        return self._evaluate(trial, cand, role, predicted)

    def _trial_env(self) -> dict[str, Any]:
        """``env=`` for the runner: torch's thread count when several CPU trials share the cores."""
        n = self.opt.torch_threads
        return {} if n is None else {"env": {TORCH_THREADS_ENV: str(n)}}

    def _kill_trials(self) -> None:
        for runner in (self.runner, self.confirm_runner):
            runner.kill_all()

    def _finished(self, *roles: str) -> list[Any]:
        from optuna.trial import TrialState

        # Trials with a stored result; one interrupted by Ctrl-C/SIGTERM is FAIL without a result
        # and does not count, so a resumed search runs it again.
        done = (TrialState.COMPLETE, TrialState.FAIL)
        return [t for t in self.study.get_trials(deepcopy=False, states=done)
                if t.user_attrs.get(R.ATTR_ROLE) in roles and R.ATTR_RESULT in t.user_attrs]

    # ---------------------------------------------------------------- 0. the smoke test of meta trials
    def start_smoke_test(self) -> None:
        """Run :meth:`smoke_test` on a thread of its own, beside the frontier rounds (its real CPU step
        can take long for a large model; the meta trials need little CPU); :meth:`finish_smoke_test`
        waits for it."""
        self._smoke = SMOKE.Background(self.smoke_test)

    def finish_smoke_test(self) -> str | None:
        """Wait for :meth:`start_smoke_test`'s run; its line (None: nothing to say).

        Raises:
            SetupFault: the smoke test failed (as :meth:`smoke_test`).
        """
        smoke = getattr(self, "_smoke", None)
        if smoke is None:
            return None
        self._smoke = None
        return smoke.finish()

    def smoke_test(self) -> str | None:
        """With trials on the meta device, one real CPU step of the workload at the smallest batch
        with the default allocator, once per study (:func:`oomtune.search.smoke.smoke_test`).
        Returns one line to print (None when there is nothing to say: not meta).

        Raises:
            SetupFault: the step fails (an error, a crash, a timeout).
        """
        return SMOKE.smoke_test(self.executor.study_here(), self.space, self.opt, peak=self._peak,
                                run=self._run_smoke)

    def _run_smoke(self, spec: TrialSpec) -> TrialResult:
        self._local.role = "smoke"
        result = self.runner.run(spec, workdir=self.workdir / "smoke", **self._trial_env())
        self._local.role = None
        return result

    # ---------------------------------------------------------------- 1. frontier first
    def _peak(self, batch: int, params: dict[str, Any]) -> tuple[int, bool] | None:
        from oomtune.plan.predictor import simulable

        cand = self.space.candidate(batch, params)
        settings = cand.settings
        if self.predictor is None or not simulable(settings):
            return None
        variant = {} if cand.activation_checkpointing is None else {"checkpointing": cand.activation_checkpointing}
        if hasattr(self.predictor, "can_predict") and not self.predictor.can_predict(batch, **variant):
            return None
        pred = self.predictor.predict_detail(batch, settings, **variant)
        return int(pred.peak_reserved_bytes), bool(pred.fits)

    def anchor_batches(self) -> list[int]:
        """The batch sizes that may be recorded first (:func:`oomtune.search.recordings.anchor_batches`)."""
        return REC.anchor_batches(self.space)

    def _record_streams(self) -> Any | None:
        """Trials that record their step's allocation stream (``target=cmd``): the default allocator
        at the anchor batch sizes, and a predictor of their recordings (``recording``); None, with
        ``recording_note`` saying why, when they do not determine the others
        (:func:`oomtune.search.recordings.record_streams`)."""
        predictor, self.recording_note = REC.record_streams(
            self.space, steps=self.opt.trial.warmup_steps + self.opt.trial.measure_steps, device=self.opt.device,
            run_batch=self._run_batch, recording=self.recording)
        return predictor

    def plan_frontiers(self) -> FrontierPlanner:
        """Every configuration's predicted frontier (simulated), before any device trial. For a target
        whose trials record their allocation streams (``recording``), the default allocator's trials
        at three small batch sizes come first and the predictions replay their recordings."""
        low, high = self.space.batch_low, self.space.batch_high
        choices = self.space.batch_choices()
        if self.predictor is None and self.recording is not None:
            self.predictor = self._record_streams()
        if self.predictor is not None:
            configs = predicted_frontiers(self.predictor, self.space.all_configs(), low, high,
                                          self.limit.limit_bytes, choices=choices)
        elif self.opt.probe_unpredicted:
            from oomtune.alloc.settings import AllocatorSettings

            configs = [ConfigFrontier(dict(m), AllocatorSettings.from_mapping(
                {k: v for k, v in m.items() if v is not None and k != "activation_checkpointing"}).render(), None)
                for m in self.space.all_configs()]
        else:
            default = self.space.default(1).config
            configs = [ConfigFrontier(default, "", None)]
        for c in configs:  # data-loader defaults travel with each probe
            c.params.update({f"data.{k}": v for k, v in self.space.default(1).data})
        return FrontierPlanner(configs, low, high, self.limit.limit_bytes, peak=self._peak if self.predictor else None,
                               max_configs=self.opt.search.frontier_configs, precision=self.opt.baseline_precision,
                               boundary_all=self.objective.probes_every_frontier, choices=choices,
                               probe_unpredicted=self.predictor is None and self.opt.probe_unpredicted)

    def _learn(self, planner: FrontierPlanner, trial: Any, *, probe: bool) -> None:
        """Record one finished trial into its configuration's frontier (calibration included)."""
        res = R.result_of(trial)
        if res is not None and trial.number in self._contradicted_numbers:
            return   # a re-run of the same candidate passed: this result is not believed
        c = (planner.find(trial.user_attrs.get(R.ATTR_CONF, ""), trial.params.get("activation_checkpointing"))
             if res is not None else None)
        if c is not None and c.is_default and res.outcome is Outcome.TIMEOUT:
            batch = int(trial.params["batch_size"])
            planner.hung_at = batch if planner.hung_at is None else min(planner.hung_at, batch)
        if c is None or res.outcome.is_fault or R.ATTR_REUSED in trial.user_attrs \
                or res.outcome is Outcome.PREDICTED_INFEASIBLE or c.alloc_conf != res.alloc_conf:
            return
        batch = int(trial.params["batch_size"])
        raw = self._peak(batch, c.params)
        ratio = floor = None
        used = R.used_bytes(res)
        if raw is not None and raw[0] > 0:
            if res.outcome is Outcome.OK and used and res.stopped_over_limit is not None:
                floor = used / raw[0]  # stopped early: its full peak is at least this
            elif res.outcome is Outcome.OK and used:
                ratio = used / raw[0]
            elif res.outcome.is_memory:
                floor = self.opt.budget_bytes / raw[0]  # it needed more than the whole budget
        if probe:
            c.probes += 1
        c.record(batch, R.is_feasible_ok(trial), ratio=ratio, floor=floor, peak_bytes=res.memory.peak_reserved_bytes)

    def run_frontier(self) -> Any | None:
        """The frontier rounds (see the module docstring). Returns the baseline trial: the default
        allocator at its largest measured feasible batch (None when ``search.baseline=false`` or
        nothing fit).

        Raises:
            SetupFault: the default allocator fails at the smallest batch with a non-memory error.
        """
        planner = self.planner = self.planner or self.plan_frontiers()
        self._contradicted_numbers = contradicted(self.study.get_trials(deepcopy=False))
        self._relearn(planner)   # a resumed study: what is known already
        # One worker and the batch objective: one probe at a time, the planner deciding again after
        # each (a configuration whose calibrated frontier cannot beat the leader's measured batch is
        # then never launched); several workers, or throughput (every frontier counts), run rounds.
        one_by_one = len(self.executor.slots) == 1 and not planner.boundary_all
        while True:
            round_ = planner.next_round()
            if not round_:
                if not self.recheck_contradictions():
                    break
                # a re-run contradicted an infeasible result: learn every trial again without it
                planner = self.planner = self.plan_frontiers()
                self._relearn(planner)
                continue
            if one_by_one:
                round_ = round_[:1]
            cands = [self.space.candidate(batch, c.params) for c, batch in round_]
            for (c, batch), trial in zip(round_, self._run_batch(cands, "frontier")):
                REC.learn_recording(self.predictor, planner, trial, self.space, self.say)
                self._learn(planner, trial, probe=True)
                c.force_next = None
                res = R.result_of(trial)
                if res is None or not res.outcome.is_fault:
                    continue
                if c.is_default and batch <= planner.bottom:
                    raise SetupFault(f"the workload fails at batch {batch} with the default allocator "
                                     f"({res.outcome}): {res.message}")
                if c.is_default and c.ok_max is None:
                    c.probes += 1
                    c.force_next = planner.bottom  # an error, not memory: does the smallest batch run?
                else:
                    c.selected = False  # an error, not a memory answer: stop probing this configuration
            self._recalibrate(planner)
        return self.baseline_trial()

    def _relearn(self, planner: FrontierPlanner) -> None:
        """Learn every finished probe trial into ``planner`` (a fresh one: after a resume, or after a
        re-run contradicted an earlier result)."""
        default = planner.default
        if not self.opt.search.baseline and default is not None:
            default.selected = False
        for t in self._finished(*PROBE_ROLES):
            self._learn(planner, t, probe=t.user_attrs.get(R.ATTR_ROLE) != "search")
        self._recalibrate(planner)

    def recheck_contradictions(self) -> bool:
        """Contradictions are checked, not believed: for one configuration (the same
        allocator and data-loader settings), an infeasible result at a batch below one measured
        feasible is run once more (role ``frontier``, ``recheck_of`` the trial's number; the baseline's
        role for the default allocator). When the re-run passes, the first result is disregarded
        from then on (:func:`_contradicted`). Each result is re-run at most once, a re-run never.
        Returns whether a re-run passed (the caller then learns the study again)."""
        from optuna.trial import TrialState

        trials = self.study.get_trials(deepcopy=False)
        rechecked = {t.user_attrs.get(R.ATTR_RECHECK_OF) for t in trials if R.ATTR_RECHECK_OF in t.user_attrs}
        best_ok: dict[tuple, int] = {}
        for t in trials:
            if t.user_attrs.get(R.ATTR_ROLE) in PROBE_ROLES and R.is_feasible_ok(t) and R.ATTR_REUSED not in t.user_attrs:
                key = config_key(t)
                best_ok[key] = max(best_ok.get(key, 0), int(t.params["batch_size"]))
        todo = []
        for t in trials:
            res = R.result_of(t)
            if (res is None or t.user_attrs.get(R.ATTR_ROLE) not in PROBE_ROLES or R.is_feasible_ok(t)
                    or t.state is not TrialState.COMPLETE or res.outcome is Outcome.PREDICTED_INFEASIBLE
                    or R.ATTR_REUSED in t.user_attrs or R.ATTR_RECHECK_OF in t.user_attrs or t.number in rechecked):
                continue
            if int(t.params["batch_size"]) < best_ok.get(config_key(t), 0):
                todo.append(t)
        if not todo:
            return False
        for t in todo:
            self.say(f"trial {t.number}: batch {t.params['batch_size']} {t.user_attrs.get(R.ATTR_CONF) or '(default)'} "
                     f"was {t.user_attrs.get(R.ATTR_OUTCOME)}, but batch {best_ok[config_key(t)]} of the same "
                     "configuration passed: running it once more")
        runs = self._run_batch([self._candidate_of(t) for t in todo], "frontier",
                               [{R.ATTR_RECHECK_OF: t.number} for t in todo])
        self._contradicted_numbers = contradicted(self.study.get_trials(deepcopy=False))
        return any(R.is_feasible_ok(r) for r in runs)

    def _recalibrate(self, planner: FrontierPlanner) -> None:
        ratios = sorted(r for c in planner.configs for r in c.ratios)
        if ratios:
            planner.device_ratio = ratios[len(ratios) // 2]

    def baseline_trial(self) -> Any | None:
        """The default allocator's largest feasible measured batch (role baseline)."""
        ok = [t for t in self._finished("baseline") if R.is_feasible_ok(t)]
        return max(ok, key=lambda t: (t.params["batch_size"], -t.number)) if ok else None

    # ---------------------------------------------------------------- 2. the sampler
    def run_search(self, baseline: Any | None = None) -> None:
        """The sampler's trials, up to ``n_trials`` in total (finished ones count: resume); none when
        the objective does not use the sampler (batch: the frontier probes decide).

        With a baseline at batch B, the sampler's batch range starts at max(low, B // 4): throughput
        rarely peaks far below the largest batch that fits, and the range stays wide enough to
        find one that does."""
        if not self.objective.uses_sampler:
            return
        if self.opt.search.n_trials - len(self._finished("search")) <= 0:
            return
        self._batch_low = baseline.params["batch_size"] // 4 if baseline is not None else None
        self.timeout_ended = self.executor.run_sampler(self.opt.search.n_trials, "search", self.opt.search.timeout)

    def timeout_note(self) -> str | None:
        """One line when ``search.timeout`` ended the sampler's phase before ``search.n_trials``: how
        many sampler trials ran, and the allocator configurations no trial ran (so that a missing
        gain is not read as the others having lost); None otherwise."""
        if not self.timeout_ended:
            return None
        trials = self.study.get_trials(deepcopy=False)
        tried = {t.user_attrs.get(R.ATTR_CONF) or "" for t in trials
                 if t.user_attrs.get(R.ATTR_ROLE) in PROBE_ROLES and R.result_of(t) is not None
                 and R.outcome_of(t) is not Outcome.PREDICTED_INFEASIBLE
                 and R.ATTR_REUSED not in t.user_attrs}
        from oomtune.alloc.settings import AllocatorSettings
        from oomtune.display import short_conf

        every = list(dict.fromkeys(AllocatorSettings.from_mapping({k: v for k, v in m.items() if v is not None}).render()
                                   for m in self.space.all_settings()))
        untried = [c for c in every if c not in tried]
        ran = len(self._finished("search"))
        text = (f"search.timeout={self.opt.search.timeout:g} s ended the search after {ran} of {self.opt.search.n_trials} "
                "sampler trials")
        if not untried:
            return text + f"; every one of the {len(every)} allocator configurations ran at least one trial"
        shown = ", ".join(short_conf(c) for c in untried[:8]) + (", ..." if len(untried) > 8 else "")
        return (text + f": {len(untried)} of {len(every)} allocator configurations were never tried ({shown}); "
                "raise search.timeout or run the same command again to resume")

    # ---------------------------------------------------------------- 3. ranking and confirmation
    def _candidates(self, trials: Sequence[Any] | None = None) -> list[Any]:
        return [t for t in (self.study.get_trials(deepcopy=False) if trials is None else trials)
                if t.user_attrs.get(R.ATTR_ROLE) in PROBE_ROLES and R.is_feasible_ok(t)
                and R.ATTR_REUSED not in t.user_attrs]

    def _ranked(self) -> list[Any]:
        """Feasible trials that ran, best first under the objective
        (:meth:`oomtune.search.objectives.Objective.rank`), after the input-bound diagnosis of them
        (field case C11: :func:`oomtune.diagnose.input_bound_verdict`, kept for the summary)."""
        from oomtune.diagnose import input_bound_verdict

        trials = self._candidates()
        self.verdict = input_bound_verdict([R.result_of(t) for t in trials], data_cfg=self.opt.workload.data)
        return self.objective.rank(trials, is_default=self._is_default, min_gain=self.opt.search.min_gain,
                                   input_bound=bool(self.verdict.input_bound))

    def leader(self) -> Any | None:
        """The leader so far under the final ranking rule (the progress line's "best"); in a worker
        reporting a trial, from the worker's read of the study made after that trial finished
        (:meth:`Executor.last_read`)."""
        trials = self._candidates(self.executor.last_read())
        return self.objective.leader(trials, is_default=self._is_default, min_gain=self.opt.search.min_gain)

    def _is_default(self, t: Any) -> bool:
        defaults = {k: v for k, v in self.space.default(1).optuna_params().items() if k != "batch_size"}
        return all(t.params.get(k) == v for k, v in defaults.items())

    def _candidate_of(self, trial: Any) -> Candidate:
        params = {k: v for k, v in trial.params.items() if k != "batch_size"}
        return self.space.candidate(trial.params["batch_size"], params)

    def candidate_of(self, trial: Any) -> Candidate:
        """The search Candidate a trial ran (its batch size, settings, accumulation, checkpointing)."""
        return self._candidate_of(trial)

    def _confirm_runs(self, trials: list[Any], times: int, *, interleave: bool = False) -> dict[int, list[Any]]:
        """Clean-process runs of each trial's candidate, ``times`` each (finished ones count: resume),
        interleaved on the first worker's device when asked (:func:`oomtune.search.confirmation.
        confirm_runs`). Returns trial number -> its confirmation trials."""
        done: dict[int, list[Any]] = {}
        for t in self._finished("confirm"):
            done.setdefault(t.user_attrs.get(R.ATTR_CONFIRMS), []).append(t)
        return confirm_runs(trials, times, interleave=interleave, done=done, candidate_of=self._candidate_of,
                            confirms=self._confirms, run_batch=self._run_batch, pin_device=self.executor.slots[0])

    def confirm(self, max_candidates: int = 3) -> tuple[Any | None, TrialResult | None, bool]:
        """Confirm the winner in a clean process as the objective does
        (:meth:`oomtune.search.objectives.Objective.confirm`; see the module docstring).

        Returns (winner trial, confirmation result or the trial's own, confirmed?). First waits for
        every worker's probe and search trials (other processes' included), so that every process
        ranks the same trials."""
        self.executor.drain(PROBE_ROLES)
        if self.recheck_contradictions():   # e.g. a sampler trial passed above a baseline failure
            self.planner = self.plan_frontiers()   # learned afresh, without the contradicted result
            self.run_frontier()
        ranked = self._ranked()
        if not ranked:
            return None, None, False
        if not self.opt.search.confirm:
            return ranked[0], R.result_of(ranked[0]), False
        ctx = ConfirmContext(runs=self._confirm_runs, baseline=self.baseline_trial, is_default=self._is_default,
                             repeats=self.opt.search.repeats, finalists=self.opt.search.finalists,
                             min_gain=self.opt.search.min_gain)
        done = self.objective.confirm(ctx, ranked, max_candidates)
        if done.gain is not None:
            self.gain = done.gain
        return done.winner, done.result, done.confirmed

    def summary(self, best: Any | None, best_result: TrialResult | None, confirmed: bool,
                baseline: Any | None) -> SearchSummary:
        """Counts over the whole study (every session of a resumed one): outcomes (``ok_over_limit``:
        ran but exceeded the limit; ``interrupted``: killed by Ctrl-C/SIGTERM), trial processes
        launched, and launches saved by prediction or by reusing an identical earlier trial; without
        an answer, why when only the confirmations failed (``confirm_failed``)."""
        trials = self.study.get_trials(deepcopy=False)
        outcomes, launched, saved = study_counts(trials)
        top = best is not None and best.params["batch_size"] >= self.space.top_batch
        return SearchSummary(best, best_result, confirmed, baseline, outcomes, launched, saved, self.verdict,
                             objective=self.opt.objective, objective_reason=self.opt.objective_reason,
                             gain=self.gain, frontiers=list(self.planner.configs) if self.planner else [],
                             at_top_of_range=top,
                             execute=steps_ran_on(trials, self.opt.execute),
                             configs_known=self.planner.predicted_or_tried() if self.planner else (0, 0),
                             global_batch=self.space.global_batch,
                             notes=[self.recording_note] if self.recording_note else [],
                             causes=[n for n in (hang_note(trials, self.opt.trial.timeout),) if n],
                             timeout_note=self.timeout_note(),
                             confirm_failed=None if best is not None else confirmation_failure(
                                 trials, confirm_steps=self.opt.trial.confirm_steps))
