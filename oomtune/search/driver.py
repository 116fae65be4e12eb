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
3. Confirmation (:mod:`oomtune.search.ranking`): objective ``batch``: the largest feasible batch
   (ties: lower peak reserved, fewer keys) re-run in a clean process for ``confirm_steps``;
   objective ``throughput``: the top candidates and the baseline measured ``repeats`` times each,
   a gain claimed only beyond the measured spread. The answer is always a configuration that ran
   (field case C6) and passed its confirmation (C7).

Every batch of trials goes through :meth:`Search._run_batch` (one trial per candidate, results in
order), the sampler's trials through :meth:`Search.run_search`: both run on the workers of an
:class:`oomtune.search.workers.Executor` (``search.workers`` threads here, plus every other process
on the same storage and study), which claim the study's WAITING trials.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from oomtune.exceptions import OomtuneError
from oomtune.outcome import Outcome
from oomtune.search import ranking as K
from oomtune.study import records as R
from oomtune.search.frontier import ConfigFrontier, FrontierPlanner, predicted_frontiers
from oomtune.space import Candidate, SearchSpace
from oomtune.search.tell_records import record_path, write_record
from oomtune.search.trial_writes import one_transaction, set_trial_attrs
from oomtune.search.claims import ATTR_STOPPED_SEARCH
from oomtune.search.workers import ATTR_DUPLICATE_OF, Executor, TrialErrored
from oomtune.trial.record import MEMORY_SOURCE_SIMULATED, MemoryReadings, TrialResult, TrialSpec
from oomtune.units import format_bytes

__all__ = ["Search", "SearchOptions", "SearchSummary", "SetupFault", "RepeatedFault", "study_counts"]

#: Roles whose trials measure candidates (confirmations re-measure them).
PROBE_ROLES = ("baseline", "frontier", "search")


class SetupFault(RuntimeError):
    """The workload fails even at the smallest batch with the default allocator: not a tuning result."""


class RepeatedFault(OomtuneError):
    """A trial failed in a way that every allocator configuration and batch size would repeat (a
    usage error of its command, an import error, a command that never reports), before any trial
    succeeded: the search stops after that trial (exit status 2 on the command line, one line)."""


def _disk_full_text(result: TrialResult) -> bool:
    """A failed trial whose message or traceback says the disk is full (its process could not write
    its record or output: ENOSPC, "No space left on device", or oomtune's DiskFullError)."""
    text = " ".join(str(x) for x in (result.message, result.traceback_tail) if x)
    return "No space left on device" in text or "DiskFullError" in text or "Disk quota exceeded" in text


_TrialErrored = TrialErrored  # raised inside the objective so Optuna records an error/crash trial as FAIL

#: Batch sizes a target that records its streams may record before giving up on a model of them.
_MAX_ANCHORS = 5

#: For role=confirm: which repetition of the confirmation of one trial (0, 1, ...), so that
#: repeated clean-process runs of one candidate are distinct candidates for the workers.
ATTR_REPEAT = "repeat"
#: The device a trial must run on, whichever worker claims it (the throughput confirmation runs all
#: on one GPU, so that the baseline and the candidates are timed on the same card).
ATTR_DEVICE = "device"


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
    baseline_precision: float = 0.1   # without predictions, bisect until (fail - ok) <= precision * ok
    min_gain: float = 0.02            # a non-default setting must beat the default allocator by this
    objective: str = "throughput"     # resolved: "throughput" | "batch" (see oomtune.search.ranking)
    objective_reason: str = ""
    frontier_configs: int = 2         # non-default configurations probed at their frontier
    repeats: int = 3                  # clean-process measurements per finalist (throughput objective)
    window_s: float = 0.0             # throughput confirmation: measure each run for at least this long
    finalists: int = 2                # top candidates re-measured besides the baseline
    device_memory_bytes: int | None = None  # virtual GPU capacity (CPU trials)
    soak_steps: int = 0               # trial.soak_steps: the virtual-GPU soak (oomtune.trial.soak_check)
    variable_shapes: bool = False     # the workload has a shape distribution (oomtune.workloads.shapes)
    torch_threads: int | None = None  # per CPU trial (OOMTUNE_TORCH_THREADS) when workers share the CPU
    execute: str = "cpu"              # resolved trial.execute: meta | cpu (virtual GPU), device, command
    host_available_bytes: int | None = None   # /proc/meminfo MemAvailable (the smoke test's check)
    memory_fraction: str = "auto"     # search.memory_fraction: auto (budget as a fraction) | off (none)
    probe_unpredicted: bool = False   # without predictions, try every configuration (objective batch)
    ranks: int = 1                    # trial.gpus: ranks (processes, one per GPU) of every trial


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
    objective: str = "throughput"
    objective_reason: str = ""
    gain: dict[str, Any] | None = None   # confirmation figures against the baseline's
    frontiers: list[ConfigFrontier] = field(default_factory=list)
    at_top_of_range: bool = False
    notes: list[str] = field(default_factory=list)
    execute: str = "cpu"                 # where the virtual GPU's trials ran their steps: meta | cpu
    configs_known: tuple[int, int] = (0, 0)   # configurations predicted or tried, of all (oomtune.search.frontier)
    global_batch: int | None = None
    timeout_note: str | None = None       # search.timeout ended the search: what was left untried
    causes: list[str] = field(default_factory=list)   # why trials failed, said with the answer or its absence


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
        self.limit = R.MemoryLimit(options.budget_bytes, options.headroom)
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

    # ---------------------------------------------------------------- running candidates
    def _spec(self, cand: Candidate, *, steps: int | None = None, confirm: bool = False,
              trials: Sequence[Any] | None = None, window_s: float = 0.0) -> TrialSpec:
        """The trial of ``cand``. Under a shape distribution every trial is soaked (its answer must
        survive ``soak_steps`` of the data's shapes); a confirmation is always soaked and runs its
        live steps at the distribution's worst shape. ``trials``: the study's trials, when just read."""
        smaller_ok = any(
            R.result_of(t) is not None and t.user_attrs.get(R.ATTR_OUTCOME) == "ok"
            and t.params.get("batch_size", 0) < cand.batch_size
            for t in (self.study.get_trials(deepcopy=False) if trials is None else trials)
        )
        steps = steps or self.opt.measure_steps
        # trial.timeout is for a search trial; a confirmation runs more steps and gets as much more time.
        scale = max(1.0, (self.opt.warmup_steps + steps) / (self.opt.warmup_steps + self.opt.measure_steps))
        timeout_s = self.opt.trial_timeout_s * scale + window_s
        return TrialSpec(
            workload=cand.apply(self.opt.workload), batch_size=cand.batch_size, alloc_conf=cand.alloc_conf,
            device=getattr(self._local, "device", None) or self.opt.device, budget_bytes=self.opt.budget_bytes,
            warmup_steps=self.opt.warmup_steps, measure_steps=steps,
            timeout_s=timeout_s, smaller_batch_succeeded=smaller_ok, measure_seconds=window_s,
            device_memory_bytes=self.opt.device_memory_bytes,
            soak_steps=self.opt.soak_steps if (confirm or self.opt.variable_shapes) else 0,
            shapes="worst" if confirm and self.opt.variable_shapes else "data",
            # a search trial stops once above the limit; a confirmation runs every step (its record is the answer's)
            limit_bytes=None if confirm else self.limit.limit_bytes,
            execute="meta" if self.opt.execute == "meta" else "cpu",
            memory_fraction=self.opt.memory_fraction != "off",
            ranks=self.opt.ranks,
        )

    def _known_infeasible(self, cand: Candidate, predicted: int | None,
                          trials: Sequence[Any] | None = None) -> TrialResult | None:
        """A result that makes ``cand`` infeasible without running it: a smaller batch already ran out
        of memory under the same settings, or ``predicted`` (peak reserved, bytes) is over the limit by
        more than the prune margin."""
        trials = self.study.get_trials(deepcopy=False) if trials is None else trials
        contradicted = _contradicted(trials)
        for t in trials:
            res = R.result_of(t)
            if res is None or t.user_attrs.get(R.ATTR_ROLE) == "confirm" or t.number in contradicted:
                continue
            same = all(t.params.get(k) == v for k, v in cand.optuna_params().items() if k != "batch_size")
            if same and res.outcome.is_memory and t.params.get("batch_size", 0) <= cand.batch_size:
                why = (f"batch {t.params['batch_size']} already ran out of device memory under the same "
                       f"allocator settings (trial {t.number})")
                return self._not_launched(cand, why)
        hang = _default_hang(trials)
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
                    and t.user_attrs.get(R.ATTR_OUTCOME) != Outcome.PREDICTED_INFEASIBLE.value
                    and t.params == cand.optuna_params()):
                return t
        return None

    def _from_recording(self, cand: Candidate) -> Any | None:
        """A finished recording (role ``record``, :meth:`_record_streams`) whose result is this
        candidate's own, so that the probe is not launched again: the same parameters (batch,
        allocator settings, data-loader settings, activation checkpointing), the same step (the
        recording's two micro-batches; under the ``batch`` objective any accumulating step of two or
        more, whose requests repeat the second micro-batch's: :func:`oomtune.workloads.training.
        prediction_workload`), and a run that stayed within the limit. A recording runs on an
        unbounded virtual GPU (or without a memory fraction); one whose peak stayed within the
        limit never reached the memory fraction, so the caching allocator made the same calls as
        under the budget (CUDACachingAllocator.cpp, ``DeviceCachingAllocator::malloc``: the cap is
        consulted only when a segment is about to be allocated beyond it). None when there is none
        (always for a target whose trials record nothing)."""
        recorded_accum = 1 if self.space.global_batch is None else 2
        same_step = cand.grad_accum == recorded_accum or (
            self.opt.objective != "throughput" and cand.grad_accum >= 2 and recorded_accum >= 2)
        if not same_step or self.recording is None:   # only targets whose trials record run recordings
            return None
        # a read of its own: the worker's last read may predate the recordings' results
        for t in self.study.get_trials(deepcopy=False):
            if t.user_attrs.get(R.ATTR_ROLE) != "record" or t.params != cand.optuna_params():
                continue
            res = R.result_of(t)
            if (res is not None and res.outcome is Outcome.OK and res.alloc_conf == cand.alloc_conf
                    and R.used_bytes(res) is not None and R.violation(res, self.limit) <= 0):
                return t
        return None

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
            # the throughput objective times its confirmation runs over a window of seconds, not steps
            window = self.opt.window_s if self.opt.objective == "throughput" else 0.0
            spec = self._spec(cand, steps=self.opt.confirm_steps, confirm=True, window_s=window)
            result = self._launch(self.confirm_runner, spec, self.workdir / f"trial-{trial.number:04d}")
            return self._tell(trial, result)
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
        stray kill must not decide a point). ``extra["retried_after"]`` keeps the first."""
        result = runner.run(spec, workdir=workdir, **self._trial_env())
        if result.outcome is not Outcome.CRASH or self.executor.interrupted.is_set():
            return result
        self.say(f"batch {spec.batch_size} {spec.alloc_conf or '(default)'}: {result.message}; running it once more")
        again = runner.run(spec, workdir=workdir.with_name(workdir.name + "-retry"), **self._trial_env())
        again.extra["retried_after"] = {"outcome": result.outcome.value, "message": result.message,
                                        "returncode": result.extra.get("returncode")}
        return again

    def _tell(self, trial: Any, result: TrialResult, extra: dict[str, Any] | None = None) -> float:
        """Store ``result`` on the running Optuna trial and return its objective value (throughput in
        samples/s, 0.0 unless ok); raises :class:`_TrialErrored` for an error or crash (Optuna: FAIL).
        A trial killed because this process was interrupted is not a result: KeyboardInterrupt.

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

        from oomtune.exceptions import DiskFullError

        if self.executor.interrupted.is_set():
            raise KeyboardInterrupt
        outcome = result.outcome
        if outcome.is_fault and _disk_full_text(result):
            raise DiskFullError(f"disk full: trial {trial.number} could not write its files "
                                f"({self.workdir / f'trial-{trial.number:04d}'}): free space on its file system")
        # the record, its outcome, the peak readable in optuna-dashboard and (unless a fault) the
        # memory constraint: one storage round trip
        stop = self._repeated_fault(trial, result) if outcome.is_fault else None
        user_attrs = {R.ATTR_RESULT: result.to_dict(), R.ATTR_OUTCOME: result.outcome.value,
                      R.ATTR_PEAK_RESERVED: R.peak_reserved_label(result), **(extra or {}),
                      **({ATTR_STOPPED_SEARCH: True} if stop is not None else {})}
        constraints = {} if outcome.is_fault else {"memory": R.violation(result, self.limit)}
        value = (None if outcome.is_fault
                 else float(result.throughput.samples_per_s or 0.0) if outcome is Outcome.OK else 0.0)
        try:
            write_record(self.workdir, trial.study.study_name, trial, state="FAIL" if outcome.is_fault else "COMPLETE",
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

    def _repeated_fault(self, trial: Any, result: TrialResult) -> "RepeatedFault | None":
        """The :class:`RepeatedFault` that stops the search after this trial when it failed in a way
        every configuration would repeat (:func:`oomtune.classify._repeats.repeats_everywhere`, or a
        command that never reported) and no trial of the study has succeeded (a failure after a
        success depends on the batch or the settings); None otherwise."""
        from oomtune.classify._repeats import repeats_everywhere

        if result.outcome is not Outcome.ERROR:
            return None
        no_report = bool(result.extra.get("no_report"))
        if not no_report and not repeats_everywhere(returncode=result.extra.get("returncode"), message=result.message):
            return None
        if any(t.user_attrs.get(R.ATTR_OUTCOME) == Outcome.OK.value for t in self.study.get_trials(deepcopy=False)):
            return None
        where = self.workdir / f"trial-{trial.number:04d}"
        advice = f"; {result.advice}" if no_report and result.advice else ""
        return (RepeatedFault(
            f"trial {trial.number} (batch {result.batch_size}, {result.alloc_conf or 'default allocator'}) failed in a "
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
        return {} if n is None else {"env": {"OOMTUNE_TORCH_THREADS": str(n)}}

    def _kill_trials(self) -> None:
        for runner in (self.runner, self.confirm_runner):
            runner.kill_all()

    def _finished(self, *roles: str) -> list[Any]:
        import optuna

        # Trials with a stored result; one interrupted by Ctrl-C/SIGTERM is FAIL without a result
        # and does not count, so a resumed search runs it again.
        done = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL)
        return [t for t in self.study.get_trials(deepcopy=False, states=done)
                if t.user_attrs.get(R.ATTR_ROLE) in roles and R.ATTR_RESULT in t.user_attrs]

    # ---------------------------------------------------------------- 0. the smoke test of meta trials
    def start_smoke_test(self) -> None:
        """Run :meth:`smoke_test` on a thread of its own, beside the frontier rounds (its real CPU step
        can take long for a large model; the meta trials need little CPU); :meth:`finish_smoke_test`
        waits for it."""
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["line"] = self.smoke_test()
            except BaseException as exc:  # noqa: BLE001 - handed to finish_smoke_test
                box["error"] = exc

        self._smoke = (threading.Thread(target=run, name="oomtune-smoke-test", daemon=True), box)
        self._smoke[0].start()

    def finish_smoke_test(self) -> str | None:
        """Wait for :meth:`start_smoke_test`'s run; its line (None: nothing to say).

        Raises:
            SetupFault: the smoke test failed (as :meth:`smoke_test`).
        """
        smoke = getattr(self, "_smoke", None)
        if smoke is None:
            return None
        thread, box = smoke
        while thread.is_alive():
            thread.join(0.5)   # in slices: Ctrl-C still reaches this thread
        self._smoke = None
        if "error" in box:
            raise box["error"]
        return box.get("line")

    def smoke_test(self) -> str | None:
        """With trials on the meta device (``execute`` ``meta``), one real CPU step of the workload at
        the smallest batch with the default allocator, once per search (a study that passed it does
        not run it again): the meta device runs no arithmetic, so this is where the code itself
        runs. Returns one line to print (None when there is nothing to say: not meta).

        Skipped, and said so, when the virtual GPU predicts that the step's tensors exceed the host's
        available memory (``host_available_bytes``).

        Raises:
            SetupFault: the step fails (an error, a crash, a timeout; not a simulated out-of-memory,
                which the smoke test does not look at: it runs without a budget).
        """
        if self.opt.execute != "meta":
            return None
        study = self.executor.study_here()
        done = study.user_attrs.get("smoke_test")
        batch = self.space.batch_low
        if done:
            return f"smoke test: passed before (one real CPU step at batch {done.get('batch_size')}, in this study)"
        peak = self._peak(batch, self.space.default(batch).optuna_params())
        avail = self.opt.host_available_bytes
        if peak is not None and avail is not None and peak[0] > avail:
            return (f"smoke test skipped: one CPU step at batch {batch} needs about {format_bytes(peak[0])} "
                    f"(simulated), more than this host's available memory ({format_bytes(avail)})")
        cand = self.space.default(batch)
        spec = TrialSpec(workload=cand.apply_data(self.opt.workload), batch_size=batch, alloc_conf="",
                         device=self.opt.device, budget_bytes=None, warmup_steps=0, measure_steps=1,
                         timeout_s=self.opt.trial_timeout_s, device_memory_bytes=self.opt.device_memory_bytes,
                         execute="cpu")
        self._local.role = "smoke"
        result = self.runner.run(spec, workdir=self.workdir / "smoke", **self._trial_env())
        self._local.role = None
        if result.outcome is not Outcome.OK:
            raise SetupFault(f"the workload fails on the CPU at batch {batch} (the smoke test: one real step, "
                             f"default allocator): {result.outcome}: {result.message}")
        study.set_user_attr("smoke_test", {"batch_size": batch, "wall_s": result.wall_s})
        wall = f" in {result.wall_s:.1f} s" if result.wall_s is not None else ""
        return (f"smoke test: one real CPU step at batch {batch} (default allocator) ran{wall}; the trials run "
                "their steps on the meta device (memory simulated, throughput not measured)")

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
        """The batch sizes that may be recorded first (the default allocator): the smallest allowed
        ones (with a global batch, of those that accumulate), cheap to run; three are recorded, more
        (up to :data:`_MAX_ANCHORS`) only while the recordings do not determine a model (the smallest
        batch can run other code); the affine model derives the others from them."""
        from oomtune.plan.feasibility import grid_batches

        choices = self.space.batch_choices()
        if choices is None:
            return grid_batches(self.space.batch_low, self.space.batch_high)[:_MAX_ANCHORS]
        return [b for b in choices if self.space.grad_accum_for(b) > 1][:_MAX_ANCHORS]

    def _recorded_accum(self, batch: int) -> int:
        """Micro-batches per step of the recordings the predictor stands on (1 without a global
        batch; 2 with one: :meth:`_record_streams`); 0 for a batch they do not stand for."""
        if self.space.global_batch is None:
            return 1
        return 2 if self.space.grad_accum_for(batch) > 1 else 0

    def _recorded(self, trial: Any, accum: int) -> tuple[int, Any] | None:
        """(batch, stream) of a finished trial's recorded allocation stream when it ran ``accum``
        micro-batches per step; None when it recorded none (or ran another accumulation)."""
        from oomtune.exceptions import ConfigError
        from oomtune.plan.recorded import load_recording

        res = R.result_of(trial)
        path = None if res is None else (res.extra or {}).get("stream_file")
        if not path or res.outcome is not Outcome.OK:
            return None
        ran = int((res.extra or {}).get("grad_accum") or 1)
        if ran != accum:
            return None
        try:
            stream, _ = load_recording(path)
        except ConfigError:
            return None
        return int(trial.params["batch_size"]), stream

    def _record_streams(self) -> Any | None:
        """Trials that record their step's allocation stream (``target=cmd``): run the default
        allocator at the anchor batch sizes (:meth:`anchor_batches`) and make a predictor of their
        recordings (``recording``); None, with ``recording_note`` saying why, when fewer than three
        recorded or the recordings do not determine the others.

        Without a global batch the anchors are baseline probes (role ``baseline``). With one, they run
        two micro-batches per step whatever the global batch (role ``record``: not candidates), so that
        every recording has one structure and the model stands for every micro-batch that
        accumulates, as a capture does (:func:`oomtune.workloads.loop.prediction_workload`)."""
        anchors = self.anchor_batches()
        if len(anchors) < 3:
            self.recording_note = (f"only {len(anchors)} batch size{'' if len(anchors) == 1 else 's'} to record: the "
                                   "allocator configurations are probed by trials")
            return None
        accum = 1 if self.space.global_batch is None else 2
        # without a global batch the anchors are the default allocator's first baseline probes; with one,
        # and for the other activation checkpointing values, recordings (role record: not candidates)
        steps = self.opt.warmup_steps + self.opt.measure_steps
        members: dict[Any, Any] = {}
        recorded: list[int] = []
        for ckpt in (self.space.checkpointing or [None]):
            role = "frontier" if accum == 1 and not ckpt else "record"
            params = {} if ckpt is None else {"activation_checkpointing": ckpt}
            got: dict[int, Any] = {}
            predictor, failed, done = None, [], 0
            while done < len(anchors) and not failed:
                # the smallest anchor alone first: a command that fails (or hangs) at it is not run twice more
                batch_of = anchors[:1] if done == 0 else anchors[done:3] if done < 3 else anchors[done:done + 1]
                trials = self._run_batch([self.space.candidate(b, params) for b in batch_of], role)
                done += len(batch_of)
                for b, t in zip(batch_of, trials):
                    r = self._recorded(t, accum)
                    if r is not None:
                        got[r[0]] = r[1]
                    elif R.result_of(t) is None or R.result_of(t).outcome is not Outcome.OK:
                        failed.append(b)
                        res = R.result_of(t)
                        how = ("no result" if res is None else
                               f"{res.outcome}: {res.message}" if res.message else str(res.outcome))
                if failed or len(got) < done:   # a failure, or a run that recorded no stream
                    break
                if len(got) < 3:
                    continue
                predictor = self.recording(got, steps, lambda b: self._recorded_accum(b) == accum)
                if predictor.usable:
                    break
            what = "" if ckpt is None else f" (activation checkpointing {'on' if ckpt else 'off'})"
            if len(got) < 3 or predictor is None:
                why = (f"the default allocator's trial at batch {', '.join(map(str, failed))}{what} failed ({how})"
                       if failed else "the command recorded no allocation stream (call "
                       "oomtune.capture_hook() or use an integration, oomtune.integrations)")
                self.recording_note = f"no predictions: {why}; every allocator configuration is probed by trials"
                return None
            if not predictor.usable:
                self.recording_note = (f"no predictions{what}: {predictor.derivation_note}; every allocator "
                                       "configuration is probed by trials")
                return None
            members[ckpt] = predictor
            recorded += sorted(got)
        per_step = "" if accum == 1 else ", two micro-batches per step"
        self.recording_note = (f"recorded the allocation streams of batch {', '.join(map(str, recorded))} "
                               f"(default allocator{per_step}, "
                               + ("from the device's memory history" if str(self.opt.device).startswith("cuda")
                                  else "on the virtual GPU")
                               + (", with and without activation checkpointing" if len(members) > 1 else "")
                               + "); the other batch sizes are derived from them")
        if list(members) == [None]:
            return members[None]
        from oomtune.plan.recorded import RecordedVariants

        return RecordedVariants(members)

    def _learn_recording(self, planner: FrontierPlanner, trial: Any) -> None:
        """A probe's own recording checks the stream derived for its batch size; a difference stops
        the predictions (the remaining probes go by trials: :meth:`FrontierPlanner.drop_predictions`)."""
        if self.predictor is None or not hasattr(self.predictor, "add_recording") or planner.peak is None:
            return
        batch = int(trial.params["batch_size"])
        got = self._recorded(trial, self._recorded_accum(batch))
        if got is None:
            return
        ckpt = trial.params.get("activation_checkpointing")
        if not self.predictor.add_recording(*got, **({} if ckpt is None else {"checkpointing": ckpt})):
            self.say(f"note: {self.predictor.derivation_note}; from here on a configuration's frontier is "
                     "found by trials (none is needed where the answer already runs the batch range's top)")
            planner.drop_predictions()

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
                               max_configs=self.opt.frontier_configs, precision=self.opt.baseline_precision,
                               boundary_all=self.opt.objective == "throughput", choices=choices,
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
            if res.outcome is Outcome.OK and used and res.extra.get("stopped_over_limit"):
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
        self._contradicted_numbers = _contradicted(self.study.get_trials(deepcopy=False))
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
                self._learn_recording(planner, trial)
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
        if not self.opt.baseline and default is not None:
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
        trials = self.study.get_trials(deepcopy=False)
        rechecked = {t.user_attrs.get(R.ATTR_RECHECK_OF) for t in trials if R.ATTR_RECHECK_OF in t.user_attrs}
        best_ok: dict[tuple, int] = {}
        for t in trials:
            if t.user_attrs.get(R.ATTR_ROLE) in PROBE_ROLES and R.is_feasible_ok(t) and R.ATTR_REUSED not in t.user_attrs:
                key = _config_key(t)
                best_ok[key] = max(best_ok.get(key, 0), int(t.params["batch_size"]))
        todo = []
        for t in trials:
            res = R.result_of(t)
            if (res is None or t.user_attrs.get(R.ATTR_ROLE) not in PROBE_ROLES or R.is_feasible_ok(t)
                    or t.state.name != "COMPLETE" or res.outcome is Outcome.PREDICTED_INFEASIBLE
                    or R.ATTR_REUSED in t.user_attrs or R.ATTR_RECHECK_OF in t.user_attrs or t.number in rechecked):
                continue
            if int(t.params["batch_size"]) < best_ok.get(_config_key(t), 0):
                todo.append(t)
        if not todo:
            return False
        for t in todo:
            self.say(f"trial {t.number}: batch {t.params['batch_size']} {t.user_attrs.get(R.ATTR_CONF) or '(default)'} "
                     f"was {t.user_attrs.get(R.ATTR_OUTCOME)}, but batch {best_ok[_config_key(t)]} of the same "
                     "configuration passed: running it once more")
        runs = self._run_batch([self._candidate_of(t) for t in todo], "frontier",
                               [{R.ATTR_RECHECK_OF: t.number} for t in todo])
        self._contradicted_numbers = _contradicted(self.study.get_trials(deepcopy=False))
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
        """The sampler's trials, up to ``n_trials`` in total (finished ones count: resume); none for
        the batch objective, where the frontier probes decide.

        With a baseline at batch B, the sampler's batch range starts at max(low, B // 4): throughput
        rarely peaks far below the largest batch that fits, and the range stays wide enough to
        find one that does."""
        if self.opt.objective == "batch":
            return
        if self.opt.n_trials - len(self._finished("search")) <= 0:
            return
        self._batch_low = baseline.params["batch_size"] // 4 if baseline is not None else None
        self.timeout_ended = self.executor.run_sampler(self.opt.n_trials, "search", self.opt.timeout_s)

    def timeout_note(self) -> str | None:
        """One line when ``search.timeout`` ended the sampler's phase before ``search.n_trials``: how
        many sampler trials ran, and the allocator configurations no trial ran (so that a missing
        gain is not read as the others having lost); None otherwise."""
        if not self.timeout_ended:
            return None
        trials = self.study.get_trials(deepcopy=False)
        tried = {t.user_attrs.get(R.ATTR_CONF) or "" for t in trials
                 if t.user_attrs.get(R.ATTR_ROLE) in PROBE_ROLES and R.result_of(t) is not None
                 and t.user_attrs.get(R.ATTR_OUTCOME) != Outcome.PREDICTED_INFEASIBLE.value
                 and R.ATTR_REUSED not in t.user_attrs}
        from oomtune.alloc.settings import AllocatorSettings
        from oomtune.display import short_conf

        every = list(dict.fromkeys(AllocatorSettings.from_mapping({k: v for k, v in m.items() if v is not None}).render()
                                   for m in self.space.all_settings()))
        untried = [c for c in every if c not in tried]
        ran = len(self._finished("search"))
        text = (f"search.timeout={self.opt.timeout_s:g} s ended the search after {ran} of {self.opt.n_trials} "
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
        """Feasible trials that ran, best first under the objective. Throughput: highest first, but
        when the workload is input-bound (field case C11) the smallest batch within 5% of the best
        comes first (a bigger batch buys nothing while the GPU waits for data). Batch:
        :func:`oomtune.search.ranking.rank_by_batch`."""
        from oomtune.diagnose import input_bound_verdict

        trials = self._candidates()
        self.verdict = input_bound_verdict([R.result_of(t) for t in trials], data_cfg=self.opt.workload.get("data"))
        if self.opt.objective == "batch":
            return K.rank_by_batch(trials)
        ranked = self._prefer_default(sorted(trials, key=lambda t: (-(t.value or 0.0), t.number)))
        if self.verdict.input_bound and ranked:
            near = [t for t in ranked if (t.value or 0.0) >= 0.95 * (ranked[0].value or 0.0)]
            near.sort(key=lambda t: (t.params["batch_size"], -(t.value or 0.0)))
            ranked = near + [t for t in ranked if t not in near]
        return ranked

    def leader(self) -> Any | None:
        """The leader so far under the final ranking rule (the progress line's "best"); in a worker
        reporting a trial, from the worker's read of the study made after that trial finished
        (:meth:`Executor.last_read`)."""
        trials = self._candidates(self.executor.last_read())
        if not trials:
            return None
        if self.opt.objective == "batch":
            return K.rank_by_batch(trials)[0]
        return self._prefer_default(sorted(trials, key=lambda t: (-(t.value or 0.0), t.number)))[0]

    def _prefer_default(self, ranked: list[Any]) -> list[Any]:
        """Allocator settings must earn their place: when the best candidate with non-default settings
        beats the best default-allocator candidate by less than ``min_gain`` (2%: within the noise of
        a few measured steps), the default one ranks first."""
        best_default = next((t for t in ranked if self._is_default(t)), None)
        if not ranked or best_default is None or self._is_default(ranked[0]):
            return ranked
        if (ranked[0].value or 0.0) < (best_default.value or 0.0) * (1 + self.opt.min_gain):
            return [best_default] + [t for t in ranked if t is not best_default]
        return ranked

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
        """Clean-process runs of each trial's candidate, ``times`` each (finished ones count: resume).
        Returns trial number -> its confirmation trials.

        Without ``interleave``, launched as one round (any free workers). With it (the throughput
        objective), one run at a time in rotating order (A B C, B C A, C A B, ...) on one device
        (the first worker's, :data:`ATTR_DEVICE`), so that every candidate meets the same drift of
        the machine (clocks, temperature, other load) as the baseline and no two are timed on
        different GPUs."""
        done: dict[int, list[Any]] = {}
        for t in self._finished("confirm"):
            done.setdefault(t.user_attrs.get(R.ATTR_CONFIRMS), []).append(t)
        cands = {}
        for t in trials:
            cands[t.number] = self._candidate_of(t)
            self._confirms[cands[t.number]] = t.number
        if not interleave:
            todo = [cands[t.number] for t in trials for _ in range(max(0, times - len(done.get(t.number, []))))]
            for cand, frozen in zip(todo, self._run_batch(todo, "confirm")):
                done.setdefault(self._confirms[cand], []).append(frozen)
            return {t.number: done.get(t.number, []) for t in trials}
        pin = [{ATTR_DEVICE: self.executor.slots[0]}]
        order = [t.number for t in trials]
        for rep in range(times):
            k = rep % len(order)
            for number in order[k:] + order[:k]:
                if len(done.get(number, [])) > rep:
                    continue   # a resumed search: this repeat ran already
                if any(not R.is_feasible_ok(r) for r in done.get(number, [])):
                    continue   # it did not survive a repeat: it is out, and its other repeats would decide nothing
                frozen = self._run_batch([cands[number]], "confirm", pin)[0]
                done.setdefault(number, []).append(frozen)
        return {t.number: done.get(t.number, []) for t in trials}

    def confirm(self, max_candidates: int = 3) -> tuple[Any | None, TrialResult | None, bool]:
        """Confirm the winner in a clean process (see the module docstring); first that passes wins.

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
        if not self.opt.confirm:
            return ranked[0], R.result_of(ranked[0]), False
        if self.opt.objective == "throughput" and self.opt.repeats >= 2:
            return self._confirm_throughput(ranked)   # schema: repeats >= 3 (a gain needs 3 per side)
        for cand_trial in ranked[:max_candidates]:
            runs = self._confirm_runs([cand_trial], 1)[cand_trial.number]
            if runs and all(R.is_feasible_ok(r) for r in runs):
                self._batch_gain(cand_trial, runs)
                return cand_trial, R.result_of(runs[-1]), True
        return None, None, False

    def _batch_gain(self, winner: Any, runs: list[Any]) -> None:
        base = self.baseline_trial()
        if base is None:
            return
        res, base_res = R.result_of(runs[-1]), R.result_of(base)
        same = _same_allocator(winner, base)
        self.gain = {"objective": "batch", "batch_size_ratio": winner.params["batch_size"] / base.params["batch_size"],
                     "peak_reserved_ratio": _ratio(res.memory.peak_reserved_bytes, base_res.memory.peak_reserved_bytes),
                     # never a gain of a configuration over itself
                     "claimed": winner.params["batch_size"] > base.params["batch_size"] and not same,
                     "from": "the winner's clean-process confirmation vs the baseline's frontier probe"}
        if same:
            self.gain["same_configuration"] = True

    def _confirm_throughput(self, ranked: list[Any]) -> tuple[Any | None, TrialResult | None, bool]:
        """Top ``finalists`` and the baseline, ``repeats`` clean runs each; the winner must beat the
        baseline beyond the measured spread (:func:`oomtune.search.ranking.beats`), else the baseline
        is the answer."""
        base = self.baseline_trial() or next((t for t in ranked if self._is_default(t)), None)
        finalists = ranked[:self.opt.finalists]
        if base is not None and base not in finalists:
            finalists.append(base)
        if base is not None:   # the baseline first: every rotation starts from it once
            finalists = [base] + [t for t in finalists if t is not base]
        runs = self._confirm_runs(finalists, self.opt.repeats, interleave=True)
        reps = {t.number: K.Repeats(t, [float(R.result_of(r).throughput.samples_per_s or 0.0)
                                        for r in runs[t.number] if R.is_feasible_ok(r)],
                                    failed=not all(R.is_feasible_ok(r) for r in runs[t.number]))
                for t in finalists}
        best = K.best_repeats(list(reps.values()))
        if best is None:
            return None, None, False
        base_rep = reps.get(base.number) if base is not None else None
        top, claimed = best, False
        same = base_rep is not None and _same_allocator(best.trial, base_rep.trial)
        if base_rep is not None and not base_rep.failed and best is not base_rep and not same:
            claimed = K.beats(best, base_rep, self.opt.min_gain)
            if not claimed:
                best = base_rep  # not beyond the noise: the default allocator stays
        if base_rep is not None and base_rep.values:
            self.gain = {"objective": "throughput", "throughput_ratio": best.mean / base_rep.mean,
                         "claimed": claimed, "winner": best.to_dict(), "baseline": base_rep.to_dict(),
                         "candidate": top.to_dict(),  # the fastest survivor, claimed or not
                         "from": f"means of {self.opt.repeats} clean-process runs each"}
            if same and best is not base_rep:
                self.gain["same_configuration"] = True   # the default allocator at another batch
        winner_runs = [r for r in runs[best.trial.number] if R.is_feasible_ok(r)]
        return best.trial, R.result_of(winner_runs[-1]), True

    def summary(self, best: Any | None, best_result: TrialResult | None, confirmed: bool,
                baseline: Any | None) -> SearchSummary:
        """Counts over the whole study (every session of a resumed one): outcomes (``ok_over_limit``:
        ran but exceeded the limit; ``interrupted``: killed by Ctrl-C/SIGTERM), trial processes
        launched, and launches saved by prediction or by reusing an identical earlier trial."""
        outcomes, launched, saved = study_counts(self.study.get_trials(deepcopy=False))
        top = best is not None and best.params["batch_size"] >= self.space.top_batch
        return SearchSummary(best, best_result, confirmed, baseline, outcomes, launched, saved, self.verdict,
                             objective=self.opt.objective, objective_reason=self.opt.objective_reason,
                             gain=self.gain, frontiers=list(self.planner.configs) if self.planner else [],
                             at_top_of_range=top, execute=self.opt.execute,
                             configs_known=self.planner.predicted_or_tried() if self.planner else (0, 0),
                             global_batch=self.space.global_batch,
                             notes=[self.recording_note] if self.recording_note else [],
                             causes=[n for n in (hang_note(self.study.get_trials(deepcopy=False),
                                                           self.opt.trial_timeout_s),) if n],
                             timeout_note=self.timeout_note())


def study_counts(trials: Sequence[Any]) -> tuple[dict[str, int], int, int]:
    """``(outcomes, launched, saved)`` over a study's trials (every session and process of it):
    outcomes by name (``ok_over_limit``: ran but exceeded the limit; ``interrupted``: killed by
    Ctrl-C/SIGTERM, FAIL without a result), trial processes launched, and launches saved by
    prediction or by reusing an identical earlier trial. A trial restored from its run-directory
    record (:mod:`oomtune.search.tell_records`) counts its outcome once and its launch once (the
    original's)."""
    from oomtune.search.tell_records import ATTR_TOLD_FROM_RECORD

    outcomes: dict[str, int] = {}
    saved = launched = 0
    restored = {t.user_attrs[ATTR_TOLD_FROM_RECORD] for t in trials if ATTR_TOLD_FROM_RECORD in t.user_attrs}
    for t in trials:
        key = t.user_attrs.get(R.ATTR_OUTCOME)
        if key is None:
            if t.number in restored:
                launched += 1   # ran; its result is the restored trial's
                continue
            if t.state.name == "FAIL" and R.ATTR_ROLE in t.user_attrs and ATTR_DUPLICATE_OF not in t.user_attrs:
                outcomes["interrupted"] = outcomes.get("interrupted", 0) + 1
                launched += 1
            continue
        if key == Outcome.OK.value and t.state.name == "COMPLETE" and not R.is_feasible_ok(t):
            key = "ok_over_limit"  # ran, but its peak exceeded budget x (1 - headroom)
        outcomes[key] = outcomes.get(key, 0) + 1
        if ATTR_TOLD_FROM_RECORD in t.user_attrs:
            continue   # its launch is the original trial's (counted there)
        if key == Outcome.PREDICTED_INFEASIBLE.value or R.ATTR_REUSED in t.user_attrs \
                or R.ATTR_FROM_RECORDING in t.user_attrs:
            saved += 1
        else:
            launched += 1
    return outcomes, launched, saved


def _default_hang(trials: Sequence[Any]) -> Any | None:
    """The default allocator's (no allocator key, no activation checkpointing) probe or sampler trial
    that timed out at the smallest batch; None when none did."""
    hung = [t for t in trials if t.user_attrs.get(R.ATTR_OUTCOME) == Outcome.TIMEOUT.value
            and t.user_attrs.get(R.ATTR_ROLE) in PROBE_ROLES and not (t.user_attrs.get(R.ATTR_CONF) or "")
            and not t.params.get("activation_checkpointing") and "batch_size" in t.params]
    return min(hung, key=lambda t: (int(t.params["batch_size"]), t.number)) if hung else None


def hang_note(trials: Sequence[Any], timeout_s: float) -> str | None:
    """One line when the default allocator's trial hung (ran past ``trial.timeout``): the batch, the
    trial, and that no other configuration was run at it or above; None when none hung."""
    hang = _default_hang(trials)
    if hang is None:
        return None
    batch = hang.params["batch_size"]
    return (f"the command hung: the default allocator's trial at batch {batch} ran past trial.timeout={timeout_s:g} s "
            f"(trial {hang.number}); a hang is not an allocator's doing, so no other configuration was run at batch "
            f"{batch} or above (see its stderr.txt in the run's trials/ folder, or raise trial.timeout)")


def _ratio(value: int | None, base: int | None) -> float | None:
    """``value / base``; None when either is missing or zero."""
    return value / base if value and base else None


def _config_key(trial: Any) -> tuple:
    """A trial's configuration: its parameters except the batch size (allocator and data-loader
    settings, as the search space spells them)."""
    return tuple(sorted((k, repr(v)) for k, v in trial.params.items() if k != "batch_size"))


def _contradicted(trials: Sequence[Any]) -> set[int]:
    """Numbers of the trials a re-run contradicted: a trial ``recheck_of`` them passed within the
    limit (:meth:`Search.recheck_contradictions`)."""
    return {int(t.user_attrs[R.ATTR_RECHECK_OF]) for t in trials
            if R.ATTR_RECHECK_OF in t.user_attrs and R.is_feasible_ok(t)}


def _same_allocator(a: Any, b: Any) -> bool:
    """Whether two trials ran the same allocator configuration (the settings torch parses from their
    alloc_conf strings are equal, e.g. ``""`` and ``"expandable_segments:False"``)."""
    from oomtune.alloc.settings import AllocatorSettings

    try:
        return not AllocatorSettings.parse(a.user_attrs.get(R.ATTR_CONF) or "").differences(
            AllocatorSettings.parse(b.user_attrs.get(R.ATTR_CONF) or ""))
    except Exception:  # noqa: BLE001 - an unparsable stored string: compare the strings
        return (a.user_attrs.get(R.ATTR_CONF) or "") == (b.user_attrs.get(R.ATTR_CONF) or "")
