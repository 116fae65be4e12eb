"""A stop signal stops the search even where CPython drops the signal handler's raise.

Field case (a suite run of tests/test_search_e2e.py's interrupted-search test, 2026-12-05):
``oomtune search`` got SIGTERM while the garbage collector ran SQLAlchemy's weakref callback
``_collection_gced``; the handler's ``Interrupted`` was printed as "Exception ignored in ...", and the
search ran on to its end and exited 0 instead of 143. CPython does this for any exception
raised while a ``__del__`` method or a weakref callback runs (``PyErr_WriteUnraisable``). Here the
signal arrives inside a ``__del__`` by construction, so the drop happens every time.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import optuna
import pytest

from oomtune import interrupts
from oomtune.exceptions import Interrupted
from oomtune.search.driver import Search, SearchOptions
from oomtune.schema import SearchConf, TrialConf
from oomtune.search.workers import Executor
from oomtune.space import SearchSpace
from oomtune.study import records as R
from oomtune.trial.record import MemoryReadings, Throughput, TrialResult
from oomtune.units import MiB
from oomtune.workload_spec import WorkloadSpec

optuna.logging.set_verbosity(optuna.logging.ERROR)


class _SignalsWhenCollected:
    """Sends ``signum`` to this process from its ``__del__`` and runs on there long enough for
    CPython to call the handler before ``__del__`` returns (the handler runs at the next check of
    the eval loop, which a loop's backward jump makes)."""

    def __init__(self, signum: int) -> None:
        self.signum = signum

    def __del__(self) -> None:
        os.kill(os.getpid(), self.signum)
        for _ in range(100_000):
            pass


def _signal_dropped(signum: int = signal.SIGTERM) -> None:
    _SignalsWhenCollected(signum)   # collected at once (reference count 0): __del__ runs here


@pytest.fixture
def unraisable(monkeypatch):
    """The exceptions CPython reports as "Exception ignored in ..." (sys.unraisablehook), kept."""
    seen: list[BaseException] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.exc_value))
    return seen


def test_a_raise_dropped_in_del_stays_pending_and_is_raised_again(unraisable):
    stopped = []
    with interrupts.stopping_on((signal.SIGTERM,), stoppers=(lambda: stopped.append(1),)):
        _signal_dropped()
        # CPython dropped the raise (the point of the module): this line runs
        assert len(unraisable) == 1 and isinstance(unraisable[0], Interrupted)
        assert interrupts.pending() == signal.SIGTERM
        assert stopped == [1]   # the stoppers ran in the handler, before the raise was dropped
        with pytest.raises(Interrupted) as info:
            interrupts.raise_if_pending()
        assert info.value.signum == signal.SIGTERM and isinstance(info.value, KeyboardInterrupt)
    # the block is left: the signal is forgotten, the handler and the stoppers are as before
    assert interrupts.pending() is None
    assert signal.getsignal(signal.SIGTERM) is not interrupts.handler
    interrupts.raise_if_pending()


def test_sigint_is_taken_over_only_from_pythons_own_handler(monkeypatch):
    monkeypatch.setattr(signal, "getsignal", lambda s: signal.SIG_IGN if s == signal.SIGINT else signal.SIG_DFL)
    installed = []
    monkeypatch.setattr(signal, "signal", lambda s, h: installed.append(s) or signal.SIG_DFL)
    with interrupts.stopping_on((signal.SIGTERM, signal.SIGINT)):
        pass
    # a process started in the background inherits SIGINT ignored, and it stays ignored
    assert installed == [signal.SIGTERM, signal.SIGTERM]   # installed, then restored


def _study(tmp_path):
    return optuna.create_study(storage=f"sqlite:///{tmp_path / 'study.db'}", direction="maximize")


class _Evaluate:
    """evaluate(trial, slot) of an Executor: records the trial's number and a result; the first call
    receives a stop signal whose raise is dropped when ``drop_in_first`` is set."""

    def __init__(self, *, drop_in_first: bool = False) -> None:
        self.calls: list[int] = []
        self.drop_in_first = drop_in_first

    def __call__(self, trial, slot):
        self.calls.append(trial.number)
        trial.suggest_int("x", 0, 100)
        trial.set_user_attr(R.ATTR_RESULT, {"x": 1})
        if self.drop_in_first and len(self.calls) == 1:
            _signal_dropped()
        return 1.0


def test_the_workers_stop_before_the_next_trial_when_the_raise_was_dropped(tmp_path, unraisable):
    evaluate = _Evaluate(drop_in_first=True)
    with interrupts.stopping_on((signal.SIGTERM,)):
        with pytest.raises(Interrupted):
            Executor(_study(tmp_path), ["cpu"], evaluate, poll_s=0.05).run_sampler(5, "search")
    assert len(unraisable) == 1
    assert evaluate.calls == [0]   # before: the dropped raise let all 5 run


def test_two_worker_threads_stop_when_the_main_threads_raise_was_dropped(tmp_path, unraisable):
    evaluate = _Evaluate()
    ex = Executor(_study(tmp_path), ["cpu", "cpu"], evaluate, poll_s=0.05)
    with interrupts.stopping_on((signal.SIGTERM,)):
        _signal_dropped()   # received before the workers start: the main thread's wait raises it
        with pytest.raises(Interrupted):
            ex.run_sampler(50, "search")
    assert evaluate.calls == []   # each worker checks before its first trial (before: all 50 ran)


class _RunnerSignalledMidTrial:
    """A trial runner whose first trial is interrupted by a stop signal whose raise is dropped: the
    stopper (its kill_all) marks the trial killed, as TrialRunner's does, and the trial comes back
    as a fault without a result of its own."""

    def __init__(self):
        self.calls, self.killed = [], 0

    def run(self, spec, *, workdir):
        self.calls.append(spec.batch_size)
        if len(self.calls) == 1:
            _signal_dropped()
            return TrialResult(outcome="error", batch_size=spec.batch_size, alloc_conf=spec.alloc_conf,
                               message="killed (SIGHUP)")
        peak = spec.batch_size * MiB
        return TrialResult(outcome="ok", batch_size=spec.batch_size, alloc_conf=spec.alloc_conf,
                           throughput=Throughput(samples_per_s=float(spec.batch_size)),
                           memory=MemoryReadings(source="simulated", peak_reserved_bytes=peak,
                                                 peak_allocated_bytes=peak))

    def kill_all(self):
        self.killed += 1
        return 0

    def close(self):
        pass


def test_a_trial_killed_by_a_dropped_stop_signal_is_not_told_as_its_result(tmp_path, unraisable):
    study = optuna.create_study(direction="maximize", storage=f"sqlite:///{tmp_path / 's.db'}")
    opts = SearchOptions(workload=WorkloadSpec(target={"name": "builtin"}, model={"name": "fake"}, gpu=None),
                         device="cpu", budget_bytes=1000 * MiB, search=SearchConf(headroom=0.05, n_trials=0),
                         trial=TrialConf(confirm_steps=10, soak_steps=0))
    runner = _RunnerSignalledMidTrial()
    search = Search(study, SearchSpace(8, 256, {"expandable_segments": [False, True]}), opts,
                    runner=runner, confirm_runner=runner, workdir=tmp_path)
    with interrupts.stopping_on((signal.SIGTERM,), stoppers=(runner.kill_all,)):
        with pytest.raises(Interrupted):
            search.run_frontier()
    assert runner.calls == [8] and runner.killed == 1
    # the killed trial is not an "error" of the configuration: it has no result and no outcome
    trials = study.get_trials(deepcopy=False)
    assert len(trials) == 1 and R.ATTR_RESULT not in trials[0].user_attrs
    assert trials[0].state != optuna.trial.TrialState.COMPLETE


class _SignalledHeartbeat:
    """Optuna's heartbeat thread whose ``start`` receives a stop signal once the thread runs (the
    field case: SIGTERM while ``HeartbeatThread.start`` waited for its thread); keeps the thread."""

    made: list = []

    def __init__(self, trial_id, storage):
        from optuna.storages._heartbeat import HeartbeatThread

        self.beat = HeartbeatThread(trial_id, storage)
        _SignalledHeartbeat.made.append(self)

    def start(self):
        self.beat.start()
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(100_000):   # the handler runs here, inside start (the eval loop's next check)
            pass

    def join(self):
        self.beat.join()

    def __enter__(self):
        self.start()

    def __exit__(self, *exc):
        self.join()


def test_a_stop_signal_while_the_heartbeat_starts_stops_its_thread(tmp_path, monkeypatch):
    # Field case (a CI run, 2026-12-06): a search stopped by SIGTERM said "terminated" and never
    # exited: the signal's raise came out of the heartbeat's __enter__, so its __exit__ never ran and
    # Optuna's thread (not a daemon) beat on; the interpreter waits for such threads at exit.
    from oomtune.study.storage import make_storage

    monkeypatch.setattr("optuna.storages._heartbeat.get_heartbeat_thread", _SignalledHeartbeat)
    _SignalledHeartbeat.made = []
    storage = make_storage(f"sqlite:///{tmp_path / 'study.db'}", heartbeat_interval_s=1, grace_period_s=2)
    study = optuna.create_study(storage=storage, direction="maximize")
    evaluate = _Evaluate()
    with interrupts.stopping_on((signal.SIGTERM,)):
        with pytest.raises(Interrupted):
            Executor(study, ["cpu"], evaluate, poll_s=0.05).run_sampler(3, "search")
    assert len(_SignalledHeartbeat.made) == 1
    thread = _SignalledHeartbeat.made[0].beat._thread
    assert thread is not None and not thread.is_alive()   # stopped and joined before the raise left
    assert evaluate.calls == []   # the trial's body never ran: the signal came first


def test_a_stopped_command_exits_even_where_a_thread_that_is_not_a_daemon_runs_on(tmp_path):
    # The whole kind of the heartbeat case: whatever thread a library leaves behind, a run stopped by
    # a signal ends (143) instead of the interpreter waiting for the thread at exit for ever.
    script = ("import threading, time\n"
              "import oomtune.cli as cli\n"
              "threading.Thread(target=time.sleep, args=(3600,), name='left-behind').start()\n"
              "cli.main = lambda argv=None: 143   # a search stopped by SIGTERM returns this\n"
              "cli.console_main()\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 143
    assert "left-behind" in done.stderr and "exiting without waiting" in done.stderr


def test_a_stop_signal_inside_a_storage_transaction_is_raised_after_its_commit(tmp_path):
    # A raise between SQLite's BEGIN IMMEDIATE and the commit could leave the write lock taken, and the
    # search's next storage call then waits out the busy timeout (60 s) in C, where no handler runs.
    import sqlite3

    from sqlalchemy import event

    from oomtune.study.storage import make_storage

    path = tmp_path / "study.db"
    storage = make_storage(f"sqlite:///{path}")
    study_id = storage.create_new_study([optuna.study.StudyDirection.MAXIMIZE], "s")
    sent = []

    def signal_once(conn):
        if not sent:
            sent.append(1)
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(100_000):   # the handler runs here, inside the transaction
                pass

    event.listen(storage.engine, "begin", signal_once)
    with interrupts.stopping_on((signal.SIGTERM,)):
        with pytest.raises(Interrupted):
            storage.set_study_user_attr(study_id, "answer", 42)
    assert sent == [1]
    # the call ran to its commit before the raise, and no lock is left: another connection writes at once
    other = sqlite3.connect(path, timeout=0, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    other.execute("ROLLBACK")
    other.close()
    assert storage.get_study_user_attrs(study_id) == {"answer": 42}




def test_a_stop_signal_during_the_claim_fails_the_claimed_trial(tmp_path, monkeypatch):
    # Found by a new user: after SIGTERM the trial being claimed stayed RUNNING without a heartbeat,
    # `oomtune show` listed it as running, and the resume said "heartbeat expired" as after a crash.
    import oomtune.search.workers as workers

    real = workers.ask_new

    def ask_then_signal(study, role):
        trial = real(study, role)   # the trial exists now: RUNNING in the storage
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(100_000):   # the handler runs here, before the claim returns
            pass
        return trial

    monkeypatch.setattr(workers, "ask_new", ask_then_signal)
    study = _study(tmp_path)
    evaluate = _Evaluate()
    with interrupts.stopping_on((signal.SIGTERM,)):
        with pytest.raises(Interrupted):
            Executor(study, ["cpu"], evaluate, poll_s=0.05).run_sampler(3, "search")
    trials = study.get_trials(deepcopy=False)
    assert evaluate.calls == [] and len(trials) == 1
    assert trials[0].state == optuna.trial.TrialState.FAIL   # failed as interrupted, not left RUNNING


@pytest.mark.parametrize("workers", [1, 2])
def test_the_frontier_captures_stop_at_the_next_item_when_the_raise_was_dropped(workers, unraisable, tmp_path):
    # A SIGTERM during the frontier predictions landed in a weakref callback of a capture (dropped), and
    # the search ran every remaining capture before it stopped
    import time

    from oomtune.plan import parallel

    done, here, taken = [], os.getpid(), tmp_path / "this-process-took-an-item"

    def capture(x):
        done.append(x)   # a forked child appends to its own copy
        if os.getpid() == here and len(done) == 1:
            taken.touch()
            _signal_dropped()   # during this process's first item, whichever it took
        elif os.getpid() != here:   # a child waits until this process has an item (else, under load,
            deadline = time.monotonic() + 60   # it could take all six before this process takes one)
            while not taken.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
        return x

    with interrupts.stopping_on((signal.SIGTERM,)):
        with pytest.raises(Interrupted):
            parallel.fork_map(capture, list(range(6)), workers=workers)
    assert len(unraisable) == 1
    assert len(done) == 1   # this process took no item after the signal


def test_the_frontier_raises_a_dropped_stop_when_the_children_took_every_item_left(unraisable, tmp_path):
    # A CI run (2 cores, loaded): while this process ran its first item, the forked child took every
    # item left; the check for a pending stop came after taking an item, so none was taken here, no
    # check ran, and fork_map returned as if no signal had come. Forced here: this process's item
    # waits until the child has computed the last item.
    import time

    from oomtune.plan import parallel

    done, here = [], os.getpid()
    taken, last = tmp_path / "this-process-took-an-item", tmp_path / "the-child-computed-the-last-item"

    def capture(x):
        done.append(x)
        if os.getpid() == here:
            taken.touch()
            deadline = time.monotonic() + 60
            while not last.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            _signal_dropped()
        else:
            deadline = time.monotonic() + 60
            while not taken.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            if x == 5:
                last.touch()
        return x

    with interrupts.stopping_on((signal.SIGTERM,)):
        with pytest.raises(Interrupted):
            parallel.fork_map(capture, list(range(6)), workers=2)
    assert last.exists()   # the race was forced: the child had computed item 5 when the signal came
    assert len(unraisable) == 1 and len(done) == 1


def _sleep_spec(tmp_path, timeout_s: float):
    """A target=cmd trial whose command would sleep 300 s and then leave a file behind."""
    from oomtune.trial.record import TrialSpec

    done = tmp_path / "slept"
    command = f"{sys.executable} -c 'import sys, time; time.sleep(300); open(sys.argv[1], \"w\")' {done} --bs {{batch_size}}"
    spec = TrialSpec(workload={"name": "mlp", "target": {"name": "cmd", "command": command, "cwd": None}},
                     batch_size=4, timeout_s=timeout_s)
    return spec, done


def test_no_trial_starts_after_a_stop_signal_whose_raise_was_dropped(tmp_path, unraisable):
    # Field case (a suite run's Ctrl-C test did not stop within 60 s): the signal's raise was dropped
    # while one trial ran; the handler killed that trial, and the search went on to its next trial, a
    # command sleeping 300 s. The runner is a safe point: it raises the pending signal, launching nothing.
    from oomtune.trial.runner import TrialRunner

    spec, _ = _sleep_spec(tmp_path, timeout_s=280)
    runner = TrialRunner(launcher="spawn")
    with interrupts.stopping_on((signal.SIGTERM,), stoppers=(runner.kill_all,)):
        _signal_dropped()
        with pytest.raises(Interrupted):
            runner.run(spec, workdir=tmp_path / "trial")
    runner.close()
    assert not (tmp_path / "trial").exists()   # nothing was launched


def test_a_trial_being_started_when_the_stop_signal_comes_is_killed_when_registered(tmp_path, unraisable,
                                                                                     monkeypatch):
    # The signal's stoppers (kill_all) run in the handler; a trial process being started at that
    # moment is not registered yet: it is killed when it is, not left to run to its timeout.
    from oomtune.outcome import Outcome
    from oomtune.targets import cmd
    from oomtune.trial.runner import TrialRunner

    spec, slept = _sleep_spec(tmp_path, timeout_s=240)
    checked = cmd._check_startable

    def signal_during_the_start(*args, **kwargs):   # after run()'s check, before the process exists
        checked(*args, **kwargs)
        _signal_dropped()

    monkeypatch.setattr(cmd, "_check_startable", signal_during_the_start)
    runner = TrialRunner(launcher="spawn")
    with interrupts.stopping_on((signal.SIGTERM,), stoppers=(runner.kill_all,)):
        result = runner.run(spec, workdir=tmp_path / "trial")
        assert interrupts.pending() == signal.SIGTERM
    runner.close()
    # killed, not left to its 240 s timeout, and recorded as interrupted (it says nothing of the batch)
    assert result.outcome is Outcome.ERROR and result.message.startswith("interrupted:") and not slept.exists(), result


@pytest.mark.parametrize("dropped", [False, True], ids=["raised", "dropped"])
def test_a_stop_while_the_outputs_are_written_stops_the_search_with_its_resume_line(tmp_path, monkeypatch, capsys,
                                                                                   unraisable, dropped):
    # Found by a new user: Ctrl-C or SIGTERM in the second after the last trial, while best.yaml and
    # the report were written, found Python's own handlers back: SIGTERM ended the process without a
    # line, and a Ctrl-C whose raise CPython dropped (in a weakref callback) let the search exit 0.
    import types

    from oomtune.search import entry as search_entry

    monkeypatch.setattr(search_entry, "search_here",
                        lambda p, overrides, console: types.SimpleNamespace(url="sqlite:///study.db"))

    def write_outputs(searched, *, out):
        if dropped:
            _signal_dropped(signal.SIGINT)
        else:
            os.kill(os.getpid(), signal.SIGINT)   # its handler runs at the next check of the eval loop
            for _ in range(100_000):
                pass
        return tmp_path / "best.yaml"

    monkeypatch.setattr(search_entry, "write_search_outputs", write_outputs)
    with pytest.raises(KeyboardInterrupt) as info:
        search_entry.search(["model=mlp", "device=cpu", "budget=64MiB", f"hydra.run.dir={tmp_path / 'run'}"])
    assert isinstance(info.value, Interrupted) and info.value.signum == signal.SIGINT
    assert "interrupted: finished trials are saved in sqlite:///study.db; run the same command to resume" \
        in capsys.readouterr().err
    assert len(unraisable) == int(dropped)
