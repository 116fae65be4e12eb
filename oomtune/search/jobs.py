"""``launcher=local|slurm``: the search's workers as ``search.workers`` jobs submitted through
submitit (a SLURM job array, or subprocesses of this machine through submitit's ``LocalExecutor``).

Each job (:func:`run_worker`) is an ordinary in-process search (:func:`oomtune.search.run.search_here`:
the same :class:`oomtune.search.driver.Search` and :class:`oomtune.search.workers.Executor` worker
loop) with the parent's storage and study name, one trial at a time (or ``gpus_per_job /
trial.gpus`` on GPUs), in its own run directory ``<run dir>/workers/worker-<i>``. The jobs share
the work as several ``oomtune search`` processes on one study do (docs/scale-out.md): rounds are
enqueued and claimed, the sampler's trials asked for by whichever worker is free, and the first job
to finish records best.yaml's content in the study. This process (:func:`launch`) submits the
jobs, prints a line per finished trial as the in-process search does (reading the study), and when
every job has ended writes the run directory's best.yaml (the study's recorded answer), trials.json,
the final table and the report from a job's summary. Ctrl-C or SIGTERM cancels the jobs
(``scancel``; a local job's process gets SIGINT), whose running trials are told FAIL and run again
by the same command.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from oomtune.exceptions import ConfigError, OomtuneError, ResumableError, WorkerJobsFailed
from oomtune.search.launchers import JobLauncher
from oomtune.workload_spec import JsonObject, WorkloadSpec

__all__ = ["JobReport", "run_worker", "launch", "answer_of", "study_summary", "JOBS_FILE", "WORKERS_DIR", "worker_dir"]

#: The run directory's folder of the worker jobs' own run directories (and, by default, submitit's
#: folder: the jobs' pickles and logs).
WORKERS_DIR = "workers"
#: What the parent records about its jobs (ids, logs, how each ended), in :data:`WORKERS_DIR`.
JOBS_FILE = "jobs.json"
#: Seconds between forced looks at the jobs' states (SLURM: one sacct call for all of them).
FORCE_CHECK_S = 60.0


def worker_dir(run_dir: Path, index: int) -> Path:
    """Worker job ``index``'s run directory: ``<run dir>/workers/worker-<index>`` (its trials'
    directories, workers.json, its own copy of best.yaml)."""
    return Path(run_dir) / WORKERS_DIR / f"worker-{index}"


@dataclass
class JobReport:
    """What one worker job hands back (pickled by submitit into its result file).

    Attributes:
        index: the job's index (0 .. search.workers - 1).
        exit_code: what ``oomtune search`` would have exited with: 0 finished, 1 stopped by its
            surroundings or nothing fitted, 2 bad input, 128 + signal when interrupted.
        line: the one line it would have printed when it did not finish (None when it did).
        host: the machine it ran on.
        run_dir: its own run directory.
        summary: its :class:`oomtune.search.driver.SearchSummary` (None when it stopped before one).
        device / budget_bytes / workload: its resolved device (a SLURM node's own), budget in bytes and
            workload (:meth:`oomtune.workload_spec.WorkloadSpec.to_dict`), which best.yaml records.
    """

    index: int
    exit_code: int
    line: str | None = None
    host: str = ""
    run_dir: str = ""
    summary: Any = None
    device: Any = None
    budget_bytes: int | None = None
    workload: JsonObject | None = None


def run_worker(overrides: Sequence[str], index: int, env: dict[str, str] | None = None) -> JobReport:
    """A worker job's entry point (what submitit runs): ``env`` set first (``CUDA_VISIBLE_DEVICES``
    of a local job's GPUs, ``OOMTUNE_TORCH_THREADS`` when local jobs share the CPU), then the search
    of ``overrides`` (:func:`oomtune.search.launchers.job_overrides`: ``launcher=inprocess``, the
    parent's storage and study) in this process, its outputs in its own run directory, printed to
    the job's log. Never raises for what ``oomtune search`` reports in one line: that line and its
    exit status are returned instead (bad input 2, a resumable stop or nothing fitted 1, a signal
    128 + its number)."""
    os.environ.pop("OOMTUNE_OVERRIDES", None)   # folded into ``overrides`` by the parent
    for key, value in (env or {}).items():
        os.environ[key] = value
    from oomtune.cli import _resumable
    from oomtune.search.driver import SetupFault
    from oomtune import interrupts
    from oomtune.display import output_console
    from oomtune.search.run import prepare_search, search_here, write_search_outputs

    # A cancelled job (scancel, the parent's Ctrl-C) or one at its time limit gets SIGTERM: it stops
    # as ``oomtune search`` does (its running trial told FAIL, its trial processes ended), from the
    # start; submitit's own handler ignores SIGTERM (``JobEnvironment._handle_signals``: "bypass").
    # SIGINT acts again where it was inherited ignored (a parent started in the background).
    signal.signal(signal.SIGTERM, interrupts.handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)

    import optuna

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    host = socket.gethostname()
    console = output_console(stderr=True)
    out = output_console(stderr=False)
    console.print(f"oomtune worker job {index} on {host} (pid {os.getpid()}): oomtune search {' '.join(overrides)}",
                  highlight=False, markup=False, soft_wrap=True)
    report = JobReport(index=index, exit_code=0, host=host)
    try:
        p = prepare_search(overrides)
        report.run_dir, report.device, report.budget_bytes = str(p.run.run_dir), p.run.device, p.run.budget_bytes
        report.workload = p.run.workload.to_dict()
        searched = search_here(p, overrides, console=console)
        report.summary = searched.summary
        write_search_outputs(searched, out=out, html=False)   # the parent writes the run's report.html
    except OomtuneError as exc:
        report.exit_code, report.line = 2, f"oomtune: error: {exc}"
    except SetupFault as exc:
        report.exit_code, report.line = 1, f"oomtune: {exc}"
    except ResumableError as exc:
        report.exit_code, report.line = 1, f"oomtune: {_resumable(str(exc))}"
    except KeyboardInterrupt as exc:
        signum = int(getattr(exc, "signum", signal.SIGINT))
        report.exit_code, report.line = 128 + signum, f"oomtune: stopped by {signal.Signals(signum).name}"
    if report.line:
        console.print(report.line, highlight=False, markup=False, soft_wrap=True)
    return report


# ---------------------------------------------------------------------------- the parent


@dataclass
class _Plan:
    """What the parent resolved before submitting."""

    cfg: Any
    overrides: list[str]
    run_dir: Path
    url: str
    study_name: str
    space: Any
    simulated: bool
    objective: str
    folder: Path
    launcher: JobLauncher
    n_jobs: int
    per_job: int
    envs: list[dict[str, str]] = field(default_factory=list)


def _light_checks(cfg: Any) -> Any:
    """For ``launcher=slurm``: what this machine can check without resolving the jobs' device (a
    login node has none of the nodes' GPUs): the search space and the workload's model and target.
    Returns the search space.

    Raises:
        ConfigError / AllocatorConfigError: bad input, before anything is submitted.
    """
    from oomtune.schema import typed
    from oomtune.search.run import search_workload
    from oomtune.space import SearchSpace

    conf = typed(cfg)
    space = SearchSpace.from_config(conf.search, world_size=conf.trial.gpus)
    if conf.search.memory_fraction == "off":
        space.drop_garbage_collection()
    search_workload(conf)
    return space


def _visible_gpus() -> list[str]:
    """This machine's visible GPUs as ``CUDA_VISIBLE_DEVICES`` entries: this process's variable when
    set, else ``0 .. torch.cuda.device_count() - 1``."""
    text = os.environ.get("CUDA_VISIBLE_DEVICES")
    if text is not None:
        return [part.strip() for part in text.split(",") if part.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def _plan(overrides: Sequence[str], cfg: Any, prepared: Any) -> _Plan:
    from oomtune import config as C
    from oomtune.search import launchers as L
    from oomtune.search.ranking import resolve_objective
    from oomtune.study.storage import storage_url

    launcher = L.job_launcher(cfg)
    n_jobs = int(cfg.search.workers)
    if prepared is not None:
        run_dir, space, simulated = prepared.run.run_dir, prepared.run.space, bool(prepared.run.device.simulated)
        objective = prepared.options.objective
    else:
        space = _light_checks(cfg)
        run_dir, simulated = C.run_dir_of(cfg), str(cfg.device) == "cpu"
        objective = resolve_objective(str(cfg.search.objective), simulated=simulated)[0]
    url = storage_url(cfg.storage, run_dir)
    per_job = L.workers_per_job(cfg, simulated=simulated)
    every = list(overrides) + C.env_overrides()   # a job must not read OOMTUNE_OVERRIDES again
    plan = _Plan(cfg=cfg, overrides=every, run_dir=run_dir, url=url, study_name=str(cfg.study_name), space=space,
                 simulated=simulated, objective=objective, folder=L.jobs_folder(cfg, run_dir), launcher=launcher,
                 n_jobs=n_jobs, per_job=per_job)
    plan.envs = launcher.job_envs(cfg, n_jobs, simulated=simulated, visible_gpus=_visible_gpus)
    return plan


def _submit(plan: _Plan) -> list[Any]:
    """Submit the jobs; returns submitit's Job objects, index order.

    Raises:
        ConfigError: the scheduler refused the submission (sbatch's message: an unknown partition or
            account), in one line.
    """
    import contextlib
    import io

    import submitit

    from oomtune.search import launchers as L

    plan.folder.mkdir(parents=True, exist_ok=True)
    args = [L.job_overrides(plan.overrides, storage=plan.url, study_name=plan.study_name,
                            run_dir=worker_dir(plan.run_dir, i).resolve(), workers=plan.per_job)
            for i in range(plan.n_jobs)]
    try:
        # submitit prints sbatch's stderr itself before raising it (CommandFunction): said once, below
        with contextlib.redirect_stderr(io.StringIO()):
            return plan.launcher.submit(submitit, plan.folder, plan.cfg, run_worker, args, plan.envs)
    except Exception as exc:  # noqa: BLE001 - sbatch's refusal (submitit's FailedJobError holds its stderr)
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        why = lines[-1] if lines else type(exc).__name__
        raise ConfigError(f"launcher={plan.launcher.name}: the worker jobs could not be submitted: "
                          f"{why[:300]}") from None


def _log_of(job: Any) -> Path:
    """A job's log (stdout and stderr together: ``stderr_to_stdout``)."""
    return Path(job.paths.stdout)


def _state(job: Any) -> str:
    try:
        return str(job.state).lower()
    except Exception:  # noqa: BLE001 - a scheduler query failed: say so, keep waiting
        return "unknown"


class _Follower:
    """The parent's view of the search while the jobs run: a progress line per trial that finished
    (:class:`oomtune.display.SearchProgress`, the in-process search's lines), the running trials on
    the live bar, and one line whenever the jobs' states change (``worker jobs: 2 pending, 6 running``)."""

    def __init__(self, study: Any, progress: Any, run_dir: Path, jobs: Sequence[Any], say: Callable[[str], None]):
        from oomtune.study.storage import retrying

        self.study, self.progress, self.run_dir, self.jobs, self.say = study, progress, run_dir, jobs, say
        self._retrying = retrying
        trials = retrying(lambda: study.get_trials(deepcopy=False), "read trials", say=say)
        self.seen = {t.number for t in trials if t.state.is_finished()}
        self.running: dict[int, Path] = {}   # trial number -> its key on the live bar
        self.states: str | None = None
        self._forced = time.monotonic()      # the last forced look at the jobs' states

    def _workdir(self, number: int) -> Path | None:
        found = sorted((self.run_dir / WORKERS_DIR).glob(f"worker-*/trials/trial-{number:04d}"))
        return found[0] if found else None

    def poll(self) -> None:
        """One look at the study and the jobs."""
        from optuna.trial import TrialState

        from oomtune.study import records as R
        from oomtune.search.workers import ATTR_DUPLICATE_OF

        trials = self._retrying(lambda: self.study.get_trials(deepcopy=False), "read trials", say=self.say)
        finished = [t for t in trials if t.state.is_finished() and t.number not in self.seen]
        for t in sorted(finished, key=lambda t: (t.datetime_complete or 0, t.number) if t.datetime_complete
                        else (0, t.number)):
            self.seen.add(t.number)
            key = self.running.pop(t.number, None)
            if key is not None:
                self.progress.finished(key)
            if ATTR_DUPLICATE_OF in t.user_attrs or R.ATTR_ROLE not in t.user_attrs and not t.params:
                continue   # a copy finished without running, or a trial that never started
            self.progress(t, t.user_attrs.get(R.ATTR_ROLE, "search"))
        for t in trials:
            if t.state is TrialState.RUNNING and t.number not in self.running and "batch_size" in t.params:
                # the bar's key: the trial's directory in its job's run directory (its progress record)
                key = self._workdir(t.number) or self.run_dir / WORKERS_DIR / f"trial-{t.number:04d}"
                self.running[t.number] = key
                self.progress.running(int(t.params["batch_size"]), t.user_attrs.get(R.ATTR_CONF) or "",
                                      role=t.user_attrs.get(R.ATTR_ROLE, "search"), workdir=key)
        counts: dict[str, int] = {}
        for job in self.jobs:
            state = _state(job)
            counts[state] = counts.get(state, 0) + 1
        states = ", ".join(f"{n} {state}" for state, n in sorted(counts.items()))
        if states != self.states:
            self.states = states
            self.say(f"worker jobs: {states}")

    def done(self) -> bool:
        """Whether every job has ended: its result file is there, or the scheduler says so. submitit
        asks SLURM (sacct) at growing intervals, up to every 10 minutes (``SlurmInfoWatcher``); a
        job that ended without a result (killed, its node lost) is asked about at least every
        :data:`FORCE_CHECK_S` seconds here."""
        force = time.monotonic() - self._forced >= FORCE_CHECK_S
        if force:
            self._forced = time.monotonic()
        return all(job.done(force_check=force) for job in self.jobs)


def _report_of(job: Any, index: int) -> JobReport:
    """The job's :class:`JobReport`, or one made from how it ended when it returned none (killed,
    out of time, its process crashed: submitit's ``UncompletedJobError`` / ``FailedJobError``)."""
    try:
        report = job.result()
    except Exception as exc:  # noqa: BLE001 - submitit's errors carry the job's traceback text
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        why = lines[-1] if lines else type(exc).__name__
        return JobReport(index=index, exit_code=1, line=f"the job ended without a result ({_state(job)}): {why[:200]}")
    return report if isinstance(report, JobReport) else JobReport(index=index, exit_code=1, line="no report")


def _cancel(jobs: Sequence[Any], launcher: JobLauncher, say: Callable[[str], None], wait_s: float = 30.0) -> None:
    """Cancel every job that has not ended (:meth:`oomtune.search.launchers.JobLauncher.cancel`) and
    wait up to ``wait_s`` for them to end; each job's search then tells its running trial FAIL and
    ends its trial processes (:func:`run_worker`)."""
    for job in jobs:
        try:
            if job.done():
                continue
            launcher.cancel(job)
        except (OSError, ValueError):   # a local job that ended meanwhile
            continue
        except Exception as exc:  # noqa: BLE001 - scancel failed: cancel the others all the same
            say(f"could not cancel job {job.job_id}: {exc}")
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and not all(_quiet_done(job) for job in jobs):
        time.sleep(0.2)


def _quiet_done(job: Any) -> bool:
    try:
        return bool(job.done())
    except Exception:  # noqa: BLE001
        return True


def _copy_artifacts(src: Path, dst: Path) -> None:
    """The report's predicted frontier and winner's step (frontier.yaml, winner_step.pickle), as the
    job that wrote them computed them for the study's answer, copied into the run directory."""
    import shutil

    from oomtune.htmlreport import FRONTIER_FILE, STEP_FILE

    for name in (FRONTIER_FILE, STEP_FILE):
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)


def _write_jobs_file(plan: _Plan, jobs: Sequence[Any], reports: Sequence[JobReport]) -> None:
    from oomtune.files import write_atomic

    rows = [{"index": r.index, "job_id": str(job.job_id), "log": str(_log_of(job)), "run_dir": r.run_dir,
             "host": r.host, "exit_code": r.exit_code, "line": r.line} for job, r in zip(jobs, reports)]
    (plan.run_dir / WORKERS_DIR).mkdir(parents=True, exist_ok=True)
    write_atomic(plan.run_dir / WORKERS_DIR / JOBS_FILE,
                 json.dumps({"launcher": plan.launcher.name, "jobs": rows}, indent=1))


def answer_of(reports: Sequence[JobReport], url: str, logs: Sequence[Path] = ()) -> JobReport:
    """The job report the run's outputs are written from: the last job (by index) that finished,
    else the last that reached a summary (nothing fitted: the outputs say why).

    Raises:
        ConfigError: no job reached a summary and every job refused its input (exit status 2: a
            SLURM node's device or budget; the first job's line, once).
        WorkerJobsFailed: no job reached a summary otherwise (killed, out of time, the storage
            away); one line naming the first job's line and log.
    """
    answered = [r for r in reports if r.summary is not None]
    if answered:
        return next((r for r in reversed(answered) if r.exit_code == 0), answered[-1])
    if reports and all(r.exit_code == 2 and r.line for r in reports):
        raise ConfigError(str(reports[0].line).removeprefix("oomtune: error: "))
    first = next((r for r in reports if r.line), None)
    log = f", log {logs[first.index]}" if first is not None and first.index < len(logs) else ""
    raise WorkerJobsFailed(f"none of the {len(reports)} worker jobs reached an answer"
                           + (f" (worker job {first.index}: {first.line}{log})" if first else "")
                           + f"; finished trials are kept in {url}")


def study_summary(summary: Any, trials: Sequence[Any], *, confirm_steps: int) -> Any:
    """The answering job's :class:`oomtune.search.summary.SearchSummary` with what is read from the
    whole study's records after every job ended (``trials``): the counts
    (:func:`oomtune.search.summary.study_counts`), where the trials' steps ran
    (:func:`oomtune.search.summary.steps_ran_on`: the records' ``execution.where``, not the requested
    ``trial.execute``; the job's own value only when no record says) and, without an answer, whether
    only the confirmations failed (:func:`oomtune.search.summary.confirmation_failure`;
    ``confirm_steps``: ``trial.confirm_steps``)."""
    from oomtune.search.summary import confirmation_failure, steps_ran_on, study_counts

    outcomes, launched, saved = study_counts(trials)
    return dataclasses.replace(
        summary, outcomes=outcomes, launches=launched, launches_saved=saved,
        execute=steps_ran_on(trials, summary.execute),
        confirm_failed=None if summary.best is not None else confirmation_failure(trials, confirm_steps=confirm_steps))


def launch(overrides: Sequence[str], cfg: Any, prepared: Any, *, console: Any, out: Any,
           poll_s: float | None = None) -> Path:
    """``oomtune search ... launcher=local|slurm``: submit ``search.workers`` worker jobs, follow
    them, write the outputs; returns the path of best.yaml.

    Args:
        cfg: the composed, checked config (:func:`oomtune.search.run.compose_search`).
        prepared: the prepared search for ``launcher=local`` (the jobs run on this machine: every
            check, the device's included, ran here first); None for ``launcher=slurm`` (the jobs'
            device is their nodes': :func:`_light_checks` only).
        poll_s: seconds between looks at the study and the jobs (default 1 local, 5 SLURM).

    Raises:
        ConfigError: bad input found here or by every job (one line, exit 2), or a refused submission.
        SetupFault: no answer: no configuration ran within the budget, or every confirmation failed.
        WorkerJobsFailed: every job ended without an answer (the study keeps what they finished).
        KeyboardInterrupt: Ctrl-C / SIGTERM: the jobs are cancelled first.
    """
    from oomtune import config as C
    from oomtune.display import SearchProgress
    from oomtune.runfile import write_run_file
    from oomtune.schema import typed
    from oomtune.search.outputs import write_outputs
    from oomtune import interrupts
    from oomtune.search.run import _resume_line, _say
    from oomtune.search.tell_records import replay
    from oomtune.study import records as R
    from oomtune.study.storage import again_on_conflict, open_study

    plan = _plan(overrides, cfg, prepared)
    say = lambda line: _say(console, line)  # noqa: E731

    def replay_all(study: Any) -> None:   # records of trials told while the storage was away, any job's
        for trials_dir in sorted((plan.run_dir / WORKERS_DIR).glob("worker-*/trials")):
            replay(study, trials_dir, say)

    study = open_study(plan.url, plan.study_name, None, heartbeat_interval_s=int(cfg.search.heartbeat_interval),
                       grace_period_s=int(cfg.search.grace_period), say=say, before_stale=replay_all)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again_on_conflict(lambda: study.set_metric_names([R.METRIC_NAME]))
    C.save_config(typed(cfg), plan.run_dir, overrides)
    write_run_file(plan.run_dir, plan.url, plan.study_name)
    say(f"oomtune search: study {plan.study_name!r} in {plan.url}")
    resumed = _resume_line(study)
    if resumed:
        say(resumed)
    at_once = "1 trial" if plan.per_job == 1 else f"{plan.per_job} trials"
    where = plan.launcher.where(cfg)
    say(f"launcher={plan.launcher.name}: {plan.n_jobs} worker job{'s' if plan.n_jobs != 1 else ''} on {where}, "
        f"{at_once} "
        f"at a time each, sharing the study; their run directories: {plan.run_dir / WORKERS_DIR}/worker-N")
    stop_signals = contextlib.ExitStack()
    stop_signals.enter_context(interrupts.stopping_on((signal.SIGTERM,)))
    jobs: list[Any] = []
    from oomtune.search.objectives import sampler_trials

    progress = SearchProgress(console, sampler_trials(plan.objective, int(cfg.search.n_trials)), study=study)
    try:
        from oomtune.search.run import _rendered

        progress.legend(simulated=plan.simulated, confs=_rendered(plan.space),
                        execute=prepared.options.execute if prepared is not None else "cpu",
                        own_process=prepared is not None and prepared.run.target.own_process)
        jobs = _submit(plan)
        shown = jobs if len(jobs) <= 8 else jobs[:2]
        for i, job in enumerate(shown):
            say(f"worker job {i}: {plan.launcher.job_word} {job.job_id}, log {_log_of(job)}")
        if len(shown) < len(jobs):
            say(f"... worker jobs 2 to {len(jobs) - 1}: logs beside these ({plan.folder}/<job id>_0_log.out; all "
                f"listed in {plan.run_dir / WORKERS_DIR / JOBS_FILE} at the end)")
        follower = _Follower(study, progress, plan.run_dir, jobs, say)
        interval = poll_s if poll_s is not None else plan.launcher.poll_s
        while True:
            ended = follower.done()
            follower.poll()
            if ended:
                break
            time.sleep(interval)
            interrupts.raise_if_pending()   # a stop signal whose raise CPython dropped (oomtune.interrupts)
    except KeyboardInterrupt:
        progress.close()
        if jobs:
            say(f"interrupted: cancelling {len(jobs)} worker job{'s' if len(jobs) != 1 else ''} ...")
            _cancel(jobs, plan.launcher, say)
        say(f"interrupted: finished trials are saved in {plan.url}; run the same command to resume")
        raise
    finally:
        progress.close()
        stop_signals.close()
    reports = [_report_of(job, i) for i, job in enumerate(jobs)]
    _write_jobs_file(plan, jobs, reports)
    rep = answer_of(reports, plan.url, [_log_of(job) for job in jobs])
    for job, r in zip(jobs, reports):
        if r.line:
            say(f"note: worker job {r.index} ({job.job_id}{', ' + r.host if r.host else ''}) ended early: {r.line}; "
                f"its log: {_log_of(job)}")
    summary = study_summary(rep.summary, study.get_trials(deepcopy=False), confirm_steps=int(cfg.trial.confirm_steps))
    from oomtune.htmlreport import write_report

    try:
        return write_outputs(typed(cfg), plan.run_dir, study, summary, rep.device, int(rep.budget_bytes), plan.url,
                             out, space=plan.space, workload=WorkloadSpec.from_dict(rep.workload))
    finally:   # also when nothing fitted: the report shows why, trial by trial
        if rep.run_dir:
            _copy_artifacts(Path(rep.run_dir), plan.run_dir)
        write_report(plan.run_dir, lambda text: _say(out, text))
