"""Several `oomtune search` workers (a SLURM array, workers started by hand) opening one new storage
and study at the same moment: no worker may fail or refuse the study.

Two races, each reproduced by injecting the interleaving (worker B run to completion at a chosen
point of worker A's open), not by timing:

- Optuna's RDBStorage creates its schema on first use (SQLAlchemy ``create_all``: check which tables
  and PostgreSQL enum types exist, then CREATE them; optuna/storages/_rdb/storage.py,
  ``RDBStorage.__init__``), so a second opener that checked before the first committed issues a
  CREATE that fails ("type studydirection already exists", ``UniqueViolation`` on pg_type, "table
  studies already exists"). Here B opens the whole storage just before A's first CREATE statement.
- a worker claims the study for its workload and budget; when that claim took two writes
  (``Study.set_user_attr`` commits one key per transaction: ``RDBStorage.set_study_user_attr``),
  a worker loading the study between them found the workload without the budget and refused it as
  "created for another workload or budget". Here B starts at every point between two of A's storage
  transactions in turn (after each connection A returns to its pool, after each journal append).

Storages: SQLite, a journal file and PostgreSQL (tests/pg_server.py; skipped where no server can
start, a failure under CI).
"""

from __future__ import annotations

import itertools
import threading
import time
import warnings

import pytest

WORKLOAD = {"name": "mlp", "target": {"name": "builtin"}, "gpu": "a100", "gpu_source": "default"}
BUDGET = 16 << 30


@pytest.fixture(params=["sqlite", "journal", "postgresql"])
def url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'study.db'}"
    if request.param == "journal":
        return f"journal:{tmp_path / 'study.log'}"
    return request.getfixturevalue("pg").create_database()


def _start_worker(url: str, name: str, budget: int = BUDGET):
    """What `oomtune search` does with the storage before its first trial (oomtune/search/run.py,
    ``_run``): open or create the study, name its metric, claim it for the workload and budget."""
    import optuna

    from oomtune.search.run import _check_resume
    from oomtune.study import records as R
    from oomtune.study.storage import again_on_conflict, open_study

    study = open_study(url, name, optuna.samplers.RandomSampler(seed=0))
    with warnings.catch_warnings():  # ExperimentalWarning, as in run.py
        warnings.simplefilter("ignore")
        again_on_conflict(lambda: study.set_metric_names([R.METRIC_NAME]))
    again_on_conflict(lambda: _check_resume(study, WORKLOAD, budget))
    return study


class _Interleave:
    """Starts ``other()`` once, at the ``at``-th point between two storage transactions of the first
    storage opened after it is made (worker A), and holds A there until ``other`` has finished or
    waits (sleeps) for something only A can write; counts those points. :meth:`result` joins it."""

    def __init__(self, monkeypatch, at: int, other) -> None:
        self.at, self.other, self.points, self.done = at, other, 0, False
        self._monkeypatch, self._thread, self._result = monkeypatch, None, None
        from oomtune.study import storage as S

        make = S.make_storage
        hooked = []

        def make_storage(url, **kwargs):
            storage = make(url, **kwargs)
            if not hooked:                     # worker A's storage; B's own opens pass through
                hooked.append(storage)
                self._hook(storage)
            return storage

        monkeypatch.setattr(S, "make_storage", make_storage)

    def _point(self, *args) -> None:
        if self.done:
            return
        self.points += 1
        if self.points != self.at:
            return
        self.done = True
        ran_or_waits = threading.Event()

        def run() -> None:
            try:
                self._result = self.other()
            except Exception as exc:  # noqa: BLE001 - recorded, asserted by the test
                self._result = exc
            finally:
                ran_or_waits.set()

        thread = threading.Thread(target=run)
        real_sleep = time.sleep

        def sleep(seconds: float) -> None:   # B polls for a value A has still to write: let A go on
            if threading.current_thread() is thread:
                ran_or_waits.set()
            real_sleep(seconds)

        self._monkeypatch.setattr(time, "sleep", sleep)
        self._thread = thread
        thread.start()
        ran_or_waits.wait()

    def result(self) -> object:
        self._thread.join()
        return self._result

    def _hook(self, storage) -> None:
        engine = getattr(storage, "engine", None)
        if engine is not None:                # RDB: A's connection is back in its pool, committed
            from sqlalchemy import event

            event.listen(engine.pool, "checkin", self._point)
            return
        backend = storage._backend             # a journal: after each of A's appends to the file
        append = backend.append_logs

        def append_logs(logs):
            append(logs)
            self._point()

        backend.append_logs = append_logs


@pytest.mark.parametrize("budget_b", [BUDGET, BUDGET // 2], ids=["same", "other_budget"])
def test_a_worker_starting_at_any_point_of_anothers_claim_gets_a_consistent_answer(url, monkeypatch, budget_b):
    from oomtune.exceptions import ConfigError

    rounds = 0
    for at in itertools.count(1):
        name = f"s{at}"
        with monkeypatch.context() as m:
            inter = _Interleave(m, at, lambda: _start_worker(url, name, budget_b))
            try:
                a = _start_worker(url, name)
            except ConfigError as exc:
                a = exc
            b = inter.result() if inter.done else None
        if not inter.done:                     # A's start has fewer points: every one was tried
            break
        rounds += 1
        if budget_b == BUDGET:                 # the same workload and budget: both join the study
            assert not isinstance(b, Exception), f"worker B started at point {at} of A's start: {b!r}"
            assert not isinstance(a, Exception), f"worker A, B started at its point {at}: {a!r}"
        else:                                  # another budget: exactly one of the two owns the study
            refused = [w for w in (a, b) if isinstance(w, ConfigError)]
            assert len(refused) == 1, f"B started at point {at} of A's start: A={a!r} B={b!r}"
            assert "created for another workload or budget" in str(refused[0])
            owner_budget = budget_b if refused[0] is a else BUDGET   # the one that was not refused
            other_budget = BUDGET if owner_budget == budget_b else budget_b
            _start_worker(url, name, owner_budget)                      # a later worker agrees with it
            with pytest.raises(ConfigError, match="created for another workload or budget"):
                _start_worker(url, name, other_budget)
        assert not isinstance(b, Exception) or isinstance(b, ConfigError), repr(b)
        assert at < 200, "A's start never ended its list of points"
    assert rounds >= 3   # open, create, claim: B was started before, inside and after A's claim


def test_a_study_claimed_by_an_earlier_oomtune_is_compared_with_its_attributes():
    """Studies created before the one-record claim hold ``workload`` and ``budget_bytes`` user
    attributes: the same workload resumes them, another budget is refused, and nothing is added."""
    import optuna

    from oomtune.exceptions import ConfigError
    from oomtune.search.run import STUDY_IDENTITY_ATTR, _check_resume

    study = optuna.create_study()
    study.set_user_attr("workload", WORKLOAD)
    study.set_user_attr("budget_bytes", BUDGET)
    _check_resume(study, WORKLOAD, BUDGET)
    with pytest.raises(ConfigError, match="created for another workload or budget"):
        _check_resume(study, WORKLOAD, BUDGET // 2)
    assert STUDY_IDENTITY_ATTR not in study._storage.get_study_system_attrs(study._study_id)


def _first_create_runs(other):
    """Runs ``other()`` (to completion) just before the first CREATE statement any engine of this
    process executes, i.e. after worker A's ``create_all`` decided which tables and types to create;
    returns a function that removes the hook and gives ``other``'s result."""
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    state = {"done": False, "result": None}

    def before(conn, cursor, statement, parameters, context, executemany):
        if state["done"] or not statement.lstrip().upper().startswith("CREATE"):
            return
        state["done"] = True
        try:
            state["result"] = other()
        except Exception as exc:  # noqa: BLE001 - recorded, asserted by the test
            state["result"] = exc

    event.listen(Engine, "before_cursor_execute", before)

    def finish():
        event.remove(Engine, "before_cursor_execute", before)
        assert state["done"], "no CREATE statement ran: the storage was not new"
        return state["result"]

    return finish


@pytest.fixture(params=["sqlite", "postgresql"])
def new_rdb_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'new.db'}"
    return request.getfixturevalue("pg").create_database()


def test_two_workers_creating_a_new_databases_schema_at_once_both_open_it(new_rdb_url):
    import optuna

    from oomtune.study.storage import make_storage

    finish = _first_create_runs(lambda: _start_worker(new_rdb_url, "s"))
    try:
        a = optuna.load_study(study_name="s", storage=make_storage(new_rdb_url))   # worker A: oomtune's open
    finally:
        b = finish()
    assert not isinstance(b, Exception), repr(b)
    assert a.study_name == b.study_name == "s"


def test_a_tests_own_connection_opens_a_database_workers_are_creating(pg):
    # tests/test_workers_pg.py reads the study while three workers open the same new database
    from pg_server import shared_study

    url = pg.create_database()
    finish = _first_create_runs(lambda: _start_worker(url, "kill"))
    try:
        study = shared_study(url, "kill")
    finally:
        worker = finish()
    assert not isinstance(worker, Exception), repr(worker)
    assert study.study_name == "kill"


def test_record_once_on_a_journal_has_one_value_when_another_process_writes_between_its_read_and_write(tmp_path):
    # Two processes sharing a journal file (two JournalStorage objects on one file): B records its
    # value after A found none and before A's first append to the file. Both must return one value.
    import optuna

    from oomtune.study.storage import make_storage, record_once

    url = f"journal:{tmp_path / 'j.log'}"
    optuna.create_study(storage=make_storage(url), study_name="rec")
    a = optuna.load_study(study_name="rec", storage=make_storage(url))
    b = optuna.load_study(study_name="rec", storage=make_storage(url))
    backend = a._storage._backend
    append, got_b = backend.append_logs, []

    def append_logs(logs):
        if not got_b:
            got_b.append(record_once(b, "oomtune:best", {"writer": "b"}))
        append(logs)

    backend.append_logs = append_logs
    got_a = record_once(a, "oomtune:best", {"writer": "a"})
    assert got_b == [{"writer": "b"}]          # B ran first, on a study without the record
    assert got_a == got_b[0]                   # A adopted B's record instead of writing its own
    c = optuna.load_study(study_name="rec", storage=make_storage(url))
    assert c._storage.get_study_system_attrs(c._study_id)["oomtune:best"] == {"writer": "b"}
