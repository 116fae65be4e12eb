"""Many trials at once: worker threads that share the work of one study through Optuna's storage.

Work is divided through the study itself, as Optuna's distributed optimisation does: a round of
candidates is *enqueued* (``Study.enqueue_trial``: WAITING trials) and any worker, in this process
or in another process or machine pointed at the same storage, *claims* one by moving it from
WAITING to RUNNING (``Study._pop_waiting_trial_id``: a row-locked state change on PostgreSQL, so
exactly one claimer wins; on SQLite every transaction takes the database's write lock at its
start, :func:`oomtune.study.storage.make_storage`). The sampler's own trials are asked for by
whichever worker is free (:func:`ask_new`: Optuna's ``Study.ask``, the new trial created with its
role). The worker threads of one process claim and ask at once where the storage row-locks the
claim (PostgreSQL, MySQL) and they are no more than the CPU cores; on SQLite, which runs one
writer at a time anyway, and above the core count, they take turns (:func:`claims_at_once`).
Between two trials a worker reads the study once; each worker thread has its own Study object (:meth:`Executor.study_here`), so workers do not wait for each other's
reads inside Optuna's per-Study cache.

No candidate runs twice: every enqueued candidate carries a key (role + parameters + extra
attributes, :data:`ATTR_KEY`). A round first looks for a trial with its key (one that has a result,
or is still WAITING/RUNNING) and reuses it; when two processes enqueue the same candidate at once,
the trial with the lower number runs and the other is finished as FAIL with
:data:`ATTR_DUPLICATE_OF` (no trial process launched); so is a copy claimed after another copy
already has a result. The baseline's probes are therefore not
repeated by a second process that computes the same probe.

Faults: each running trial has Optuna's heartbeat (RDB storages); a worker killed mid-trial leaves
a RUNNING trial that :func:`optuna.storages.fail_stale_trials` (called by every worker while it
claims work) fails after the grace period, and the storage's retry callback re-enqueues it for the
next free worker (:func:`oomtune.study.storage.make_storage`). A candidate left without a result
and without a live trial (e.g. its worker was interrupted) is enqueued again, up to
:data:`MAX_ATTEMPTS` times. Storage calls that fail on a dropped connection are retried with
backoff (:mod:`oomtune.study.reconnect`); when the storage stays unreachable, a trial that has
finished stays RUNNING with its outcome in its run-directory record
(:mod:`oomtune.search.tell_records`) instead of being told FAIL.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any, Callable, Sequence

from oomtune.study import records as R
from oomtune.search.claims import (ATTR_DUPLICATE_OF, ATTR_KEY, ask_new, claims_at_once, count_sampler,
                                   has_result, is_live, trial_key)
from oomtune.exceptions import StorageUnavailableError
from oomtune.interrupts import deferred, raise_if_pending
from oomtune.study.storage import retrying

__all__ = ["Executor", "TrialErrored", "ATTR_KEY", "ATTR_DUPLICATE_OF", "MAX_ATTEMPTS", "trial_key"]

MAX_ATTEMPTS = 3                         # enqueues of one candidate left without a result


@contextlib.contextmanager
def _heartbeat(trial: Any) -> Iterator[None]:
    """Optuna's heartbeat thread for ``trial`` (``optuna.storages._heartbeat.get_heartbeat_thread``,
    as ``Study.optimize`` runs it) around the block, its start and stop safe from a stop signal.

    Optuna's thread is not a daemon, and its ``__enter__`` waits for the thread to start: a
    SIGTERM raised there (field case: a suite run, 2026-12-06) skipped ``__exit__``, the thread
    beat on, and the interpreter waited for it for ever after the search had said "terminated".
    The start and the stop run within :func:`oomtune.interrupts.deferred`; a signal received
    during the start is raised inside the ``try``, so the thread is stopped.
    """
    from optuna.storages._heartbeat import get_heartbeat_thread

    beat, started = None, False
    try:
        with deferred():
            beat = get_heartbeat_thread(trial._trial_id, trial.study._storage)
            beat.start()
            started = True
        yield
    finally:
        if started:
            with deferred():
                beat.join()


class TrialErrored(Exception):
    """Raised by an evaluate function so that the trial is told FAIL (an error or crash outcome)."""


_DONE = object()  # a worker's next_trial: the phase is over


class Executor:
    """Runs the trials of one study on ``len(slots)`` worker threads of this process.

    Args:
        study: the Optuna study (shared by every worker, here and elsewhere).
        slots: one entry per worker thread, handed to ``evaluate`` (the device spec the worker's
            trials run on, e.g. ``"cuda:1"``; ``"cpu"`` for the virtual GPU).
        evaluate: ``evaluate(trial, slot) -> float`` runs one claimed trial (its role in
            ``trial.user_attrs[ATTR_ROLE]``, absent for a sampler trial) and returns the objective
            value; raises :class:`TrialErrored` for a FAIL outcome.
        on_trial: called with each FrozenTrial this process finished, and its role.
        say: prints one line (storage retries, retried trials).
        poll_s: seconds between looks at the study while waiting for other workers.
        interrupt: called once when the main thread is interrupted (Ctrl-C) while worker threads
            run, before waiting for them (e.g. ``TrialRunner.kill_all``); :attr:`interrupted` is set
            first, so an evaluate function can tell a killed trial from a result.
    """

    #: one Study object per worker thread (:meth:`study_here`); experiments/bench_workers.py turns
    #: it off to measure the workers sharing one
    own_studies = True

    def __init__(self, study: Any, slots: Sequence[str], evaluate: Callable[[Any, str], float], *,
                 on_trial: Callable[[Any, str], None] | None = None, say: Callable[[str], None] | None = None,
                 poll_s: float = 0.5, interrupt: Callable[[], None] | None = None) -> None:
        if not slots:
            raise ValueError("an Executor needs at least one slot")
        self.study, self.slots, self.evaluate = study, list(slots), evaluate
        self.on_trial = on_trial or (lambda trial, role: None)
        self.say = say or (lambda line: None)
        self.poll_s = poll_s
        self.interrupt = interrupt or (lambda: None)
        self.interrupted = threading.Event()
        self._lock = threading.Lock()     # counting of the sampler's trials within this process
        self._changed = threading.Condition(self._lock)  # an ask or a trial of this process ended
        self._generation = 0              # ... counted here, so that a waiting worker wakes at once
        self._reserved = 0                # sampler trials being asked for now (this process)
        self._tls = threading.local()     # per worker thread: its study object, its last read
        self._studies = [study]           # every study object of this process's workers
        self._slot_studies: dict[int, Any] = {}  # worker index -> its study object (study_here)
        # claims (WAITING -> RUNNING, also inside Optuna's ask) one at a time within this process,
        # except where the storage row-locks them and there are no more workers than cores
        self._claim_lock = contextlib.nullcontext() if claims_at_once(study, len(slots)) else threading.Lock()
        self._asked: set[int] = set()     # numbers of the sampler trials this process asked for
        self._last_stale_check = 0.0
        self._error: BaseException | None = None
        self._stop: BaseException | None = None   # stop(): raised once the workers have stopped
        self.stats = {"storage_calls": 0, "storage_s": 0.0, "claimed": 0, "duplicates": 0}

    def stop(self, error: BaseException) -> None:
        """Stop the search after the trials running now: each worker finishes (and reports) the trial
        it runs and takes no other; the phase that runs them (:meth:`run_batch`, :meth:`run_sampler`,
        :meth:`drain`) then raises ``error`` (the first one given). Called by an evaluate function,
        e.g. for a failure that every configuration would repeat."""
        with self._lock:
            self._stop = self._stop or error

    # ------------------------------------------------------------------ storage helpers
    def study_here(self) -> Any:
        """The study object of the calling worker thread, else the shared one.

        Optuna wraps an RDB storage in one cache per Study object (``_CachedStorage``) whose lock is
        held during its database round trips (reading the unfinished trials, setting a parameter),
        so worker threads sharing one Study wait for each other's queries. Each worker thread of a
        process with several slots therefore works on its own Study object: the same study (name,
        storage engine and connection pool, sampler), its own cache and lock. Measured with 8
        workers on PostgreSQL (experiments/bench_workers.py): see the "one Study per worker" row."""
        return getattr(self._tls, "study", None) or self.study

    def last_read(self) -> list[Any] | None:
        """The study's trials as this worker thread read them last, when it looked for its next
        sampler trial: inside ``evaluate``, right before the trial was created or claimed; inside
        ``on_trial``, after the reported trial had finished. None where no such read was made (a
        round's trials, claimed without a read of the whole study). Lets ``evaluate`` and
        ``on_trial`` skip reads of their own."""
        return getattr(self._tls, "trials", None)

    def _own_study(self) -> Any:
        """A Study object for this worker thread (see :meth:`study_here`); the shared one for a
        single worker or a storage without Optuna's per-Study cache (journal, in-memory)."""
        import optuna
        from optuna.storages._cached_storage import _CachedStorage

        storage = self.study._storage
        if len(self.slots) == 1 or not isinstance(storage, _CachedStorage) or not self.own_studies:
            return self.study
        own = self._call("open the study", lambda: optuna.Study(
            study_name=self.study.study_name, storage=storage._backend, sampler=self.study.sampler,
            pruner=self.study.pruner))
        with self._lock:
            self._studies.append(own)
        return own

    def _slot_study(self, index: int) -> Any:
        """Worker ``index``'s Study object, made on first use and kept for the later phases."""
        with self._lock:
            study = self._slot_studies.get(index)
        if study is None:
            study = self._own_study()
            with self._lock:
                self._slot_studies[index] = study
        return study

    def _notify(self) -> None:
        """Wake this process's waiting workers: an ask or a trial ended."""
        with self._changed:
            self._generation += 1
            self._changed.notify_all()

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        started = time.perf_counter()
        try:
            return retrying(fn, what, say=self.say)
        finally:  # best-effort counters (workers.json)
            self.stats["storage_calls"] += 1
            self.stats["storage_s"] += time.perf_counter() - started

    def _trials(self) -> list[Any]:
        study = self.study_here()
        return self._call("read trials", lambda: study.get_trials(deepcopy=False))

    def _fail_stale(self) -> None:
        """Fail RUNNING trials whose heartbeat stopped (their retry is enqueued by the storage's
        callback); at most once per second per process."""
        now = time.monotonic()
        if now - self._last_stale_check < 1.0:
            return
        self._last_stale_check = now
        import warnings

        import optuna

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            study = self.study_here()
            self._call("fail stale trials", lambda: optuna.storages.fail_stale_trials(study))

    # ------------------------------------------------------------------ claiming and running
    def _claim(self) -> Any | None:
        """A WAITING trial of the study, now RUNNING and ours; None when none is waiting."""
        import optuna

        self._fail_stale()
        study = self.study_here()
        self._tls.trials = None
        with self._claim_lock:
            trial_id = self._call("claim a trial", study._pop_waiting_trial_id)
        return None if trial_id is None else optuna.Trial(study, trial_id)

    def _next_sampler_trial(self, n_trials: int, role: str, stopped: Callable[[], bool]) -> Any:
        """The next trial of the sampler phase: a WAITING trial (claimed), else a new trial from the
        sampler while the study holds fewer than ``n_trials`` of ``role``; None when there is
        nothing to do now; :data:`_DONE` when the phase is over (``n_trials`` reached and nothing
        WAITING). One read of the study per call.

        The process's lock covers only counting: a trial this process is asking for (or asked for
        after the read) counts although the read does not show it, so this process's workers never
        overshoot ``n_trials``; the storage calls (claim, create, sample) run outside it, several at
        once (Optuna's RDB storage and samplers allow concurrent ``ask``, as
        ``Study.optimize(n_jobs=N)`` does). A read can show a trial another worker of this process
        is still asking for while that ask is also counted as reserved: the caller then waits for
        that ask to end (:meth:`_work`), not for a poll interval."""
        import optuna
        from optuna.trial import TrialState

        self._fail_stale()
        study = self.study_here()
        self._tls.trials = None
        trials = self._tls.trials = self._trials()
        if any(t.state is TrialState.WAITING for t in trials):
            with self._claim_lock:
                trial_id = self._call("claim a trial", study._pop_waiting_trial_id)
            if trial_id is not None:
                return optuna.Trial(study, trial_id)
        with self._lock:
            present = {t.number for t in trials}
            counted = count_sampler(trials, role) + self._reserved + sum(1 for n in self._asked if n not in present)
            if counted >= n_trials or stopped():
                finished = count_sampler(trials, role) >= n_trials or stopped()
                return _DONE if finished and not any(t.state is TrialState.WAITING for t in trials) else None
            self._reserved += 1
        trial = None
        try:
            with self._claim_lock:
                trial = self._call("ask the sampler", lambda: ask_new(study, role))
        finally:
            with self._changed:
                self._reserved -= 1
                if trial is not None:
                    self._asked.add(trial.number)
                self._generation += 1
                self._changed.notify_all()
        return trial

    def _duplicate_of(self, trial: Any) -> int | None:
        key = trial.user_attrs.get(ATTR_KEY)
        if key is None:
            return None
        for t in self._trials():  # another copy has a result, or is live and older: it runs, not us
            if (t.number != trial.number and t.user_attrs.get(ATTR_KEY) == key
                    and ATTR_DUPLICATE_OF not in t.user_attrs
                    and (has_result(t) or (is_live(t) and t.number < trial.number))):
                return t.number
        return None

    def _run_claimed(self, trial: Any, slot: str) -> tuple[Any, str] | None:
        """Run one claimed trial with a heartbeat and tell Optuna its outcome; returns what to
        report (``on_trial``'s arguments), None for a duplicate finished without running."""
        from optuna.trial import TrialState

        self.stats["claimed"] += 1
        state, value = TrialState.FAIL, None
        # The trial beats from its claim on, before the checks below: their storage calls wait out
        # an outage with growing delays (up to 30 s, reconnect.STORAGE_RETRY_S), and a trial without
        # beats while this worker waits would be taken for a dead one by a worker that reconnected
        # first (field case: a suite run, a proxy restarted mid-search, a live trial retried). The
        # heartbeat thread tries every interval, whatever the main thread waits for.
        try:
            with _heartbeat(trial):
                original = self._duplicate_of(trial)
                if original is not None:
                    self._finish_duplicate(trial, original)
                    return None
                # the retry marker is set when the trial is enqueued: optuna.Trial read it when it was made
                cached = getattr(trial, "_cached_frozen_trial", None)
                system_attrs = cached.system_attrs if cached is not None else self._call(
                    "read a trial", lambda: trial.study._storage.get_trial(trial._trial_id).system_attrs)
                if "failed_trial" in system_attrs:
                    self.say(f"[trial {trial.number}] retrying trial {system_attrs['failed_trial']} "
                             "(its worker stopped: heartbeat expired)")
                try:
                    value = self.evaluate(trial, slot)
                    state = TrialState.COMPLETE
                except TrialErrored:
                    pass
        except StorageUnavailableError:
            # the storage stayed unreachable: the trial stays RUNNING, its outcome in its record
            # (oomtune.search.tell_records), told by the next run before its heartbeat counts as stale
            self._notify()
            raise
        except KeyboardInterrupt:
            raise   # a stop: _work fails the claimed trial, the one place for every stop after a claim
        except BaseException:
            self._fail_unfinished(trial)   # a full disk, a bug
            raise
        frozen = self._call("tell", lambda: trial.study.tell(trial, value, state=state, skip_if_finished=True))
        self._notify()
        return frozen, frozen.user_attrs.get(R.ATTR_ROLE, "search")

    def _finish_duplicate(self, trial: Any, original: int) -> None:
        """A claimed ``trial`` that repeats trial ``original``: marked (:data:`ATTR_DUPLICATE_OF`)
        and told FAIL without running."""
        from optuna.exceptions import UpdateFinishedTrialError
        from optuna.trial import TrialState

        self.stats["duplicates"] += 1
        try:
            self._call("mark a duplicate", lambda: trial.set_user_attr(ATTR_DUPLICATE_OF, original))
        except UpdateFinishedTrialError:
            # failed meanwhile by another worker (its heartbeat judged stale): nothing is left to mark
            pass
        self._call("tell", lambda: trial.study.tell(trial, state=TrialState.FAIL, skip_if_finished=True))
        self._notify()

    def _fail_unfinished(self, trial: Any) -> None:
        """Ctrl-C, SIGTERM, a full disk, a bug: the claimed ``trial`` is FAIL without a result
        ("interrupted"; a finished trial is left as it is), in one attempt (no retries while the
        user waits; an unreachable storage fails it later by its stopped heartbeat)."""
        from optuna.trial import TrialState

        with contextlib.suppress(Exception):
            retrying(lambda: trial.study.tell(trial, None, state=TrialState.FAIL, skip_if_finished=True),
                     "tell", say=None, delays_s=())
        self._notify()

    def _work(self, index: int, next_trial: Callable[[], Any | None], done: Callable[[], bool]) -> None:
        slot, study = self.slots[index], self._slot_study(index)
        self._tls.study, self._tls.trials = study, None
        # This loop is an optimize loop in Optuna's sense: samplers may call Study.stop() from
        # after_trial (GridSampler, grid exhausted), which Optuna allows only inside one.
        local = study._thread_local
        was, local.in_optimize_loop = local.in_optimize_loop, True
        # A finished trial is reported (on_trial) after the worker has taken its next one: the
        # read of the study made for that (last_read) then already holds the finished trial, so
        # the report (e.g. the progress line's leader) needs no read of its own.
        report = None
        try:
            while self._error is None and self._stop is None and not done():
                raise_if_pending()   # a stop signal whose raise was dropped (oomtune.interrupts)
                with self._changed:
                    generation = self._generation
                trial = None
                try:
                    # a stop signal during the claim is raised once the claimed trial is known, so
                    # that it is failed below instead of left RUNNING without a heartbeat
                    with deferred():
                        trial = next_trial()
                    if report is not None:
                        report, finished = None, report
                        self.on_trial(*finished)
                    if trial is _DONE:
                        break
                    if trial is None:  # nothing to do now: until this process's next ask or trial ends
                        with self._changed:
                            self._changed.wait_for(lambda: self._generation != generation, self.poll_s)
                        continue
                    report = self._run_claimed(trial, slot)
                except KeyboardInterrupt:
                    if trial is not None and trial is not _DONE:
                        self._fail_unfinished(trial)   # claimed, then stopped before its outcome was told
                    raise
        finally:
            local.in_optimize_loop = was
            self._tls.trials = None
            try:
                if report is not None:
                    self.on_trial(*report)
            finally:
                self._tls.study = None

    def _run_workers(self, next_trial: Callable[[], Any | None], done: Callable[[], bool]) -> None:
        """Every slot works until ``done()``; the first exception of any worker is re-raised here
        after the others stop (a KeyboardInterrupt in the main thread stops them too)."""
        if self._stop is not None:
            raise self._stop
        if len(self.slots) == 1:
            self._work(0, next_trial, done)
            if self._stop is not None:
                raise self._stop
            return
        self._error = None
        for index in range(len(self.slots)):  # every worker's Study object ready before any starts
            self._slot_study(index)

        def body(index: int) -> None:
            try:
                self._work(index, next_trial, done)
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread
                self._error = self._error or exc

        threads = [threading.Thread(target=body, args=(i,), name=f"oomtune-worker-{i}", daemon=True)
                   for i in range(len(self.slots))]
        for t in threads:
            t.start()
        try:
            for t in threads:
                while t.is_alive():
                    t.join(0.2)
                    raise_if_pending()
        except BaseException as exc:
            self._error = self._error or exc
            self.interrupted.set()
            self.interrupt()
            for t in threads:
                t.join()
            raise
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        if self._stop is not None:
            raise self._stop

    # ------------------------------------------------------------------ public API
    def run_batch(self, items: Sequence[tuple[dict[str, Any], str, dict[str, Any]]]) -> list[Any]:
        """Run a round of independent candidates; returns one FrozenTrial per item, in order.

        Args:
            items: ``(params, role, extra user attrs)`` per candidate; ``params`` are Optuna
                parameters (``Candidate.optuna_params()``).

        Returns:
            per item, the trial holding its result (reused when the study already had one), or
            the last failed attempt after :data:`MAX_ATTEMPTS` attempts without a result.
        """
        from optuna.trial import TrialState

        keys = [trial_key(role, params, attrs) for params, role, attrs in items]
        wanted = set(keys)
        attempts = dict.fromkeys(keys, 0)

        def resolve() -> tuple[dict[str, Any], bool]:
            """(key -> trial with its result, whether a WAITING trial of a resolved key is left: a
            copy enqueued twice, e.g. by a retry and a re-enqueue, which a worker must finish as a
            duplicate so that none is left behind)."""
            found: dict[str, Any] = {}
            trials = self._trials()
            for (params, role, attrs), key in zip(items, keys):
                mine = [t for t in trials if t.user_attrs.get(ATTR_KEY) == key
                        and ATTR_DUPLICATE_OF not in t.user_attrs]
                done = [t for t in mine if has_result(t)]
                if done:
                    found[key] = min(done, key=lambda t: t.number)
                elif not any(is_live(t) for t in mine):
                    if attempts[key] >= MAX_ATTEMPTS and mine:
                        found[key] = max(mine, key=lambda t: t.number)
                        continue
                    attempts[key] += 1
                    user_attrs = {R.ATTR_ROLE: role, ATTR_KEY: key, **attrs}
                    study = self.study_here()
                    self._call("enqueue", lambda: study.enqueue_trial(params, user_attrs=user_attrs))
            leftover = any(t.state is TrialState.WAITING and t.user_attrs.get(ATTR_KEY) in found for t in trials)
            return found, leftover

        # The study is read again when a trial of this process ended since the last read (its result
        # may complete the round: waiting poll_s for it cost every round up to half a second), else
        # at most every poll_s / 2 (other processes' trials, whose ends this process is not told of).
        state: dict[str, Any] = {"at": time.monotonic(), "generation": self._generation}
        state["found"], state["leftover"] = resolve()

        def done() -> bool:
            with self._lock:
                if (len(state["found"]) < len(wanted) or state["leftover"]) \
                        and (self._generation != state["generation"]
                             or time.monotonic() - state["at"] >= self.poll_s / 2):
                    state["generation"] = self._generation
                    (state["found"], state["leftover"]), state["at"] = resolve(), time.monotonic()
                return len(state["found"]) >= len(wanted) and not state["leftover"]

        self._run_workers(self._claim, done)
        return [state["found"][k] for k in keys]

    def run_sampler(self, n_trials: int, role: str = "search", timeout_s: float | None = None) -> bool:
        """Sampler trials until the study holds ``n_trials`` of ``role`` (finished with a result,
        or running), counting every process's; WAITING trials of any role are run first. Returns
        whether ``timeout_s`` (seconds from this call: ``search.timeout``) ended the phase before
        ``n_trials`` were reached.

        With several processes the count is read before each ask, so the study may end with up
        to (processes - 1) more trials than ``n_trials``; within a process it never overshoots."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for study in self._studies:  # set by Study.stop() (e.g. GridSampler: grid exhausted)
            study._stop_flag = False
        self._asked.clear()

        def stopped() -> bool:
            return (any(study._stop_flag for study in self._studies)
                    or (deadline is not None and time.monotonic() >= deadline))

        # the phase's end is decided by _next_sampler_trial from its own read of the study
        self._run_workers(lambda: self._next_sampler_trial(n_trials, role, stopped), stopped)
        return (deadline is not None and time.monotonic() >= deadline
                and count_sampler(self._trials(), role) < n_trials)

    def drain(self, roles: Sequence[str] = ("baseline", "search")) -> None:
        """Work until no trial of ``roles`` is WAITING or RUNNING anywhere (every process's
        trials have finished), so that every process ranks the same finished trials."""

        def done() -> bool:
            return not any(is_live(t) and t.user_attrs.get(R.ATTR_ROLE, "search") in roles for t in self._trials())

        self._run_workers(self._claim, done)
