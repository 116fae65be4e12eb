"""Storage calls outlast a lost connection, whatever exception carries it, and a
finished trial's outcome is kept in its run directory until the storage is told
(oomtune/study/reconnect.py, oomtune/search/tell_records.py).

The exception chains are built as the libraries build them: Optuna's ``_create_scoped_session``
re-raises any SQLAlchemy error of a session as ``StorageInternalError(...) from e``, and SQLAlchemy
wraps the driver's error as ``OperationalError(statement, params, orig)``. The storage here is a
SQLite file whose calls are made to fail as a dropped server connection fails them; the same paths
against a real PostgreSQL server that is stopped and started again: tests/test_storage_outage_pg.py.
"""

from __future__ import annotations

import sqlite3

import optuna
import pytest
from optuna.exceptions import StorageInternalError
from optuna.storages import RDBStorage
from optuna.trial import TrialState
from sqlalchemy.exc import IntegrityError, OperationalError

from oomtune.exceptions import DiskFullError, StorageUnavailableError
from oomtune.study import reconnect
from oomtune.study.reconnect import is_connection_error, retrying
from oomtune.study.storage import make_storage

optuna.logging.set_verbosity(optuna.logging.ERROR)


def _lost(text: str = "server closed the connection unexpectedly") -> StorageInternalError:
    """What Optuna raises when the server went away mid-session (the chain it builds)."""
    try:
        try:
            raise OperationalError("SELECT 1", {}, Exception(text))
        except OperationalError as e:
            raise StorageInternalError("An exception is raised during the commit.") from e
    except StorageInternalError as exc:
        return exc


@pytest.fixture(autouse=True)
def fast_retries(monkeypatch):
    monkeypatch.setenv(reconnect.RETRY_ENV, "0,0,0")
    sleeps = []
    monkeypatch.setattr(reconnect.time, "sleep", sleeps.append)
    reconnect._gave_up.clear()
    yield sleeps
    reconnect._gave_up.clear()


def _study(tmp_path, lines=None, name="s"):
    storage = make_storage(f"sqlite:///{tmp_path / 'study.db'}", say=None if lines is None else lines.append)
    return optuna.create_study(storage=storage, study_name=name, direction="maximize")


def test_connection_errors_are_recognised_through_optunas_wrapper():
    assert is_connection_error(_lost())                                   # StorageInternalError from ...
    assert is_connection_error(OperationalError("x", {}, Exception("connection refused")))
    assert is_connection_error(ConnectionResetError(104, "Connection reset by peer"))
    psycopg = pytest.importorskip("psycopg")
    assert is_connection_error(psycopg.OperationalError("connection failed: Connection refused"))
    # not a lost connection: a constraint, a bug, a permanent SQLite error
    assert not is_connection_error(IntegrityError("INSERT", {}, Exception("UNIQUE constraint failed")))
    assert not is_connection_error(ValueError("a bug"))
    no_table = OperationalError("SELECT", {}, sqlite3.OperationalError("no such table: trials"))
    assert not is_connection_error(no_table)


def test_a_full_sqlite_disk_is_disk_full_at_once_not_retried(fast_retries):
    full = OperationalError("INSERT", {}, sqlite3.OperationalError("database or disk is full"))
    with pytest.raises(DiskFullError, match="no space left for the storage while trying to store"):
        retrying(lambda: (_ for _ in ()).throw(full), "store a trial's result")
    assert fast_retries == []


def test_every_storage_call_of_optuna_is_retried_with_one_line_each(tmp_path, monkeypatch):
    lines: list[str] = []
    study = _study(tmp_path, lines)
    study.enqueue_trial({"x": 1})
    failures = {"_get_trials": 2, "set_trial_state_values": 1, "set_trial_user_attr": 1}
    for name in failures:
        original = getattr(RDBStorage, name)

        def flaky(self, *args, _name=name, _original=original, **kwargs):
            if failures[_name] > 0:
                failures[_name] -= 1
                raise _lost()
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(RDBStorage, name, flaky)
    trial = study.ask()                        # claims the WAITING trial: reads, then sets RUNNING
    trial.set_user_attr("k", "v")
    study.tell(trial, 1.0)
    assert failures == dict.fromkeys(failures, 0)
    (t,) = study.get_trials()
    assert t.state is TrialState.COMPLETE and t.user_attrs["k"] == "v" and t.value == 1.0
    assert len(lines) == 4 and all("\n" not in line and "storage connection lost while trying to" in line
                                   and "server closed the connection unexpectedly" in line for line in lines)
    assert sum("read trials" in line for line in lines) == 2


def test_a_state_change_whose_commit_succeeded_before_the_connection_dropped_is_not_an_error(tmp_path, monkeypatch):
    study = _study(tmp_path)
    trial = study.ask()
    original = RDBStorage.set_trial_state_values
    calls = []

    def commit_then_lose(self, *args, **kwargs):
        calls.append(1)
        result = original(self, *args, **kwargs)
        if len(calls) == 1:
            raise _lost()                      # committed; the acknowledgement was lost
        return result

    monkeypatch.setattr(RDBStorage, "set_trial_state_values", commit_then_lose)
    study.tell(trial, 2.0)                     # the retry finds it COMPLETE: success, not UpdateFinishedTrialError
    assert len(calls) == 2 and study.get_trials()[0].state is TrialState.COMPLETE


def test_a_failed_heartbeat_is_one_line_and_the_next_one_is_recorded(tmp_path, monkeypatch):
    lines: list[str] = []
    study = _study(tmp_path, lines)
    trial = study.ask()
    original = RDBStorage.record_heartbeat
    monkeypatch.setattr(RDBStorage, "record_heartbeat", lambda self, trial_id: (_ for _ in ()).throw(_lost()))
    study._storage.record_heartbeat(trial._trial_id)     # no exception: the heartbeat thread lives on
    assert len(lines) == 1 and "recording a heartbeat" in lines[0] and "next try in 10 s" in lines[0]
    monkeypatch.setattr(RDBStorage, "record_heartbeat", original)
    study._storage.record_heartbeat(trial._trial_id)
    assert len(lines) == 1


def test_nested_retry_loops_retry_once_not_multiplied(tmp_path, monkeypatch):
    lines: list[str] = []
    study = _study(tmp_path, lines)
    original, failures = RDBStorage._get_trials, [3]

    def flaky(self, *args, **kwargs):
        if failures[0]:
            failures[0] -= 1
            raise _lost()
        return original(self, *args, **kwargs)

    monkeypatch.setattr(RDBStorage, "_get_trials", flaky)
    outer: list[str] = []
    assert retrying(lambda: study.get_trials(), "read trials (outer)", say=outer.append) == []
    assert len(outer) == 3 and lines == []     # the outer loop retried; the storage's called straight through


def test_after_the_last_retry_calls_try_once_without_waiting_until_one_succeeds(tmp_path, fast_retries):
    down = lambda: (_ for _ in ()).throw(_lost())  # noqa: E731
    with pytest.raises(StorageUnavailableError, match=r"storage unreachable for 0 s \(3 retries\)"):
        retrying(down, "read trials")
    assert len(fast_retries) == 3
    with pytest.raises(StorageUnavailableError, match=r"\(0 retries\)"):
        retrying(down, "tell")                 # unwinding: no second wait
    assert len(fast_retries) == 3
    assert retrying(lambda: "back", "read trials") == "back"
    with pytest.raises(StorageUnavailableError, match=r"\(3 retries\)"):
        retrying(down, "read trials")          # a success reset it: the whole schedule again
    assert len(fast_retries) == 6


def test_the_retry_schedule_comes_from_the_environment_or_is_refused_in_one_line(monkeypatch):
    from oomtune.exceptions import ConfigError

    monkeypatch.setenv(reconnect.RETRY_ENV, "1, 2.5,4")
    assert reconnect.retry_schedule() == (1.0, 2.5, 4.0)
    monkeypatch.delenv(reconnect.RETRY_ENV)
    assert reconnect.retry_schedule() == (1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0)
    assert sum(reconnect.retry_schedule()) == 121.0            # "about 2 minutes" (README)
    monkeypatch.setenv(reconnect.RETRY_ENV, "1,-2")
    with pytest.raises(ConfigError, match="OOMTUNE_STORAGE_RETRY_S"):
        reconnect.retry_schedule()


def test_batched_writes_are_retried_and_a_lost_acknowledgement_does_not_insert_twice(tmp_path, monkeypatch):
    from oomtune.search import trial_writes as W

    lines: list[str] = []
    study = _study(tmp_path, lines)
    trial = study.ask()
    original, calls = W._write, []

    def commit_then_lose(*args, **kwargs):
        calls.append(kwargs.get("skip_stored"))
        original(*args, **kwargs)
        if len(calls) == 1:
            raise _lost()

    monkeypatch.setattr(W, "_write", commit_then_lose)
    with W.one_transaction(trial):
        trial.suggest_int("batch_size", 8, 512)
        trial.suggest_categorical("expandable_segments", [False, True])
        W.set_trial_attrs(trial, {"role": "search"})
    W.set_trial_attrs(trial, {"result": {"outcome": "ok"}}, {"memory": -0.5})
    assert calls[:2] == [False, True]          # the retry skipped the parameters already stored
    assert len(lines) == 1 and "store a trial's parameters" in lines[0]
    (t,) = study.get_trials()
    assert set(t.params) == {"batch_size", "expandable_segments"}
    assert t.user_attrs == {"role": "search", "result": {"outcome": "ok"}} and t.constraints == {"memory": -0.5}


def test_a_recorded_outcome_is_told_when_the_storage_is_back_and_only_to_its_running_trial(tmp_path):
    from oomtune.search.tell_records import record_path, replay, write_record

    study = _study(tmp_path, name="rec")
    workdir = tmp_path / "trials"
    running, finished, other = study.ask(), study.ask(), study.ask()
    study.tell(finished, 5.0)
    for trial in (running, finished):
        write_record(workdir, "rec", trial, state="COMPLETE", value=42.0,
                     user_attrs={"result": {"outcome": "ok", "throughput": 42.0}, "outcome": "ok"},
                     constraints={"memory": -0.25})
    write_record(workdir, "another-study", other, state="COMPLETE", value=1.0, user_attrs={}, constraints={})
    stale = record_path(workdir, 7)                        # a number the study has not (yet) reached
    stale.parent.mkdir(parents=True)
    stale.write_text(record_path(workdir, running.number).read_text())
    lines: list[str] = []
    assert replay(study, workdir, lines.append) == [running.number]
    trials = {t.number: t for t in study.get_trials()}
    told = trials[running.number]
    assert told.state is TrialState.COMPLETE and told.value == 42.0
    assert told.user_attrs["result"]["throughput"] == 42.0 and told.constraints == {"memory": -0.25}
    assert trials[finished.number].value == 5.0 and "result" not in trials[finished.number].user_attrs
    assert trials[other.number].state is TrialState.RUNNING   # another study's record: not this trial's
    assert len(lines) == 1 and f": {running.number}" in lines[0]
    assert replay(study, workdir, lines.append) == []       # told once


def test_an_executor_leaves_its_trial_running_when_the_storage_stays_unreachable(tmp_path):
    from oomtune.search.workers import Executor

    study = _study(tmp_path)

    def evaluate(trial, slot):
        raise StorageUnavailableError("storage unreachable for 121 s")

    with pytest.raises(StorageUnavailableError):
        Executor(study, ["cpu"], evaluate).run_batch([({"x": 1}, "baseline", {})])
    (t,) = study.get_trials()
    assert t.state is TrialState.RUNNING        # not told FAIL: its record is told by the next run


def test_a_trial_failed_without_its_recorded_result_is_restored_once_unless_its_candidate_ran_again(tmp_path):
    # Telling the storage failed after tell.json was written (a full disk): the worker told FAIL.
    from oomtune.search.claims import ATTR_KEY
    from oomtune.search.tell_records import replay, write_record

    study = _study(tmp_path, name="rec")
    workdir = tmp_path / "trials"
    lost, rerun, again = study.ask(), study.ask(), study.ask()
    for trial, key in ((lost, "k-lost"), (rerun, "k-rerun")):
        trial.suggest_int("batch_size", 8, 512)
        trial.set_user_attr(ATTR_KEY, key)
        trial.set_user_attr("role", "baseline")
        write_record(workdir, "rec", trial, state="COMPLETE", value=42.0,
                     user_attrs={"result": {"outcome": "ok"}, "outcome": "ok"}, constraints={"memory": -0.25})
        study.tell(trial, state=TrialState.FAIL)
    # the second candidate ran again meanwhile: its re-run holds the result
    again.suggest_int("batch_size", 8, 512)
    again.set_user_attr(ATTR_KEY, "k-rerun")
    again.set_user_attr("result", {"outcome": "ok"})
    study.tell(again, 7.0)
    lines: list[str] = []
    assert replay(study, workdir, lines.append) == [lost.number]
    restored = study.get_trials()[-1]
    assert restored.number == 3 and restored.state is TrialState.COMPLETE and restored.value == 42.0
    assert restored.params == study.get_trials()[lost.number].params and restored.constraints == {"memory": -0.25}
    assert restored.user_attrs == {ATTR_KEY: "k-lost", "role": "baseline", "result": {"outcome": "ok"},
                                   "outcome": "ok", "told_from_record": lost.number}
    assert len(lines) == 1 and lines[0].startswith(f"restored the result of trial {lost.number} from ")
    assert replay(study, workdir, lines.append) == [] and len(study.get_trials()) == 4   # once
