"""Workers sharing a study (oomtune.search.workers) and the storage helpers they rely on.

The Executor is driven here with a fake evaluate function on SQLite studies; the searches of
several processes on a real PostgreSQL server are in test_workers_pg.py.
"""

from __future__ import annotations

import threading
import time

import optuna
import pytest

from oomtune.study import records as R
from oomtune.study.storage import make_storage, record_once, retrying
from oomtune.search.workers import ATTR_DUPLICATE_OF, ATTR_KEY, Executor, TrialErrored, trial_key

optuna.logging.set_verbosity(optuna.logging.ERROR)


def _study(tmp_path, name="s", grace_period_s=300):
    # Heartbeats every second (the Executor's path with a heartbeat storage), but by default a grace period
    # no loaded machine reaches: with a short one, a heartbeat thread that waited a second or two for a
    # core lets another worker fail a live trial as stale. A test about stale trials passes a short one.
    storage = make_storage(f"sqlite:///{tmp_path / 'study.db'}", heartbeat_interval_s=1,
                           grace_period_s=grace_period_s)
    return optuna.create_study(storage=storage, study_name=name, direction="maximize", load_if_exists=True)


class _Recorder:
    """evaluate(trial, slot): suggests x, stores a result, counts concurrent calls."""

    def __init__(self, sleep_s=0.0, fail_x=None, together=0):
        self.calls, self.slots, self.live, self.max_live = [], [], 0, 0
        self.sleep_s, self.fail_x = sleep_s, fail_x
        self.lock = threading.Lock()
        # together=N: each call waits until N calls are running at once (threading.Barrier; broken,
        # and the call fails, when they are not all running within 60 s)
        self.barrier = threading.Barrier(together, timeout=60) if together else None

    def __call__(self, trial, slot):
        x = trial.suggest_int("x", 0, 100)
        with self.lock:
            self.calls.append(x)
            self.slots.append(slot)
            self.live += 1
            self.max_live = max(self.max_live, self.live)
        try:
            if self.barrier is not None:
                self.barrier.wait()
            time.sleep(self.sleep_s)
            trial.set_user_attr(R.ATTR_RESULT, {"x": x})
            if x == self.fail_x:
                raise TrialErrored("boom")
            return float(x)
        finally:
            with self.lock:
                self.live -= 1


def test_run_batch_returns_one_trial_per_candidate_in_order_and_runs_them_at_once(tmp_path):
    study = _study(tmp_path)
    # each evaluation waits (a barrier) until all 3 run at once: run one after another, the first
    # one's barrier breaks and its trial fails; no reliance on sleeps overlapping on a loaded machine
    ev = _Recorder(together=3)
    ex = Executor(study, ["cpu"] * 3, ev, poll_s=0.05)
    out = ex.run_batch([({"x": x}, "baseline", {}) for x in (5, 7, 9)])
    assert [t.params["x"] for t in out] == [5, 7, 9]
    assert [t.value for t in out] == [5.0, 7.0, 9.0]
    assert sorted(ev.calls) == [5, 7, 9]
    assert ev.max_live == 3 and not ev.barrier.broken


def test_a_candidate_already_run_is_not_run_again(tmp_path):
    study = _study(tmp_path)
    ev = _Recorder()
    ex = Executor(study, ["cpu"], ev, poll_s=0.05)
    first = ex.run_batch([({"x": 3}, "baseline", {})])[0]
    again = ex.run_batch([({"x": 3}, "baseline", {}), ({"x": 4}, "baseline", {})])
    assert ev.calls == [3, 4]                   # x=3 ran once
    assert again[0].number == first.number      # the same trial is returned
    confirm = ex.run_batch([({"x": 3}, "confirm", {"c": 1})])[0]   # another role: a new trial
    assert ev.calls == [3, 4, 3] and confirm.number != first.number


def test_a_round_ends_when_its_trials_end_not_at_the_next_look_at_the_study(tmp_path):
    # poll_s is how often a worker looks at the study for other processes' trials; a round whose
    # trials all ran here must not wait for it. With poll_s = 1 hour, rounds of one and of two workers
    # end once their trials did (each round waited up to poll_s before: every probe of a frontier).
    for slots in (["cpu"], ["cpu"] * 2):
        study = _study(tmp_path, name=f"s{len(slots)}")
        ex = Executor(study, slots, _Recorder(), poll_s=3600.0)
        rounds: list = []
        t = threading.Thread(target=lambda: rounds.extend(
            ex.run_batch([({"x": x}, "baseline", {})])[0].value for x in (1, 2, 3)), daemon=True)
        t.start()
        t.join(timeout=120)
        assert not t.is_alive(), f"{len(slots)} worker(s): a round waited for the next look at the study"
        assert rounds == [1.0, 2.0, 3.0]


def test_a_candidate_enqueued_twice_by_two_processes_runs_once(tmp_path):
    # Two processes computed the same round and both enqueued it before either claimed it: the
    # lower-numbered trial runs, the other is finished as a duplicate without running.
    study = _study(tmp_path)
    key = trial_key("baseline", {"x": 11})
    for _ in range(2):
        study.enqueue_trial({"x": 11}, user_attrs={R.ATTR_ROLE: "baseline", ATTR_KEY: key})
    ev = _Recorder()
    out = Executor(study, ["cpu", "cpu"], ev, poll_s=0.05).run_batch([({"x": 11}, "baseline", {})])
    assert ev.calls == [11]
    trials = study.get_trials(deepcopy=False)
    assert out[0].number == 0 and trials[0].state.name == "COMPLETE"
    assert trials[1].state.name == "FAIL" and trials[1].user_attrs[ATTR_DUPLICATE_OF] == 0


def test_failed_candidates_keep_their_result_and_are_not_retried(tmp_path):
    study = _study(tmp_path)
    ev = _Recorder(fail_x=2)
    out = Executor(study, ["cpu"], ev, poll_s=0.05).run_batch([({"x": 2}, "search", {})])
    assert out[0].state.name == "FAIL" and out[0].user_attrs[R.ATTR_RESULT] == {"x": 2}
    assert ev.calls == [2]


def test_a_trial_left_running_by_a_dead_worker_is_retried_by_another(tmp_path):
    # A worker claimed trial 0 and died (no heartbeat after the first): after the grace period any
    # worker fails it, Optuna's retry callback enqueues a copy, and the copy runs.
    study = _study(tmp_path, grace_period_s=2)
    key = trial_key("baseline", {"x": 8})
    study.enqueue_trial({"x": 8}, user_attrs={R.ATTR_ROLE: "baseline", ATTR_KEY: key})
    dead = study._pop_waiting_trial_id()
    study._storage.record_heartbeat(dead)
    lines = []
    ev = _Recorder()
    out = Executor(study, ["cpu"], ev, poll_s=0.1, say=lines.append).run_batch([({"x": 8}, "baseline", {})])
    assert ev.calls == [8]
    assert study.get_trials(deepcopy=False)[0].state.name == "FAIL"
    retried = out[0]
    assert retried.number != 0 and retried.system_attrs["failed_trial"] == 0
    assert any("retrying trial 0" in line for line in lines)


def test_sampler_trials_stop_at_n_trials_with_several_workers(tmp_path):
    study = _study(tmp_path)
    ev = _Recorder(sleep_s=0.05)
    Executor(study, ["cpu"] * 3, ev, poll_s=0.05).run_sampler(7, "search")
    done = [t for t in study.get_trials(deepcopy=False) if t.user_attrs.get(R.ATTR_ROLE) == "search"]
    assert len(done) == 7 and all(t.state.name == "COMPLETE" for t in done)


def test_each_worker_uses_its_slot(tmp_path):
    study = _study(tmp_path)
    ev = _Recorder(sleep_s=0.2)
    Executor(study, ["cuda:0", "cuda:1"], ev, poll_s=0.05).run_batch(
        [({"x": x}, "baseline", {}) for x in range(4)])
    assert set(ev.slots) <= {"cuda:0", "cuda:1"} and len(ev.slots) == 4


def test_record_once_keeps_the_first_value(tmp_path):
    study = _study(tmp_path)
    assert record_once(study, "oomtune:best", {"batch": 1}) == {"batch": 1}
    assert record_once(study, "oomtune:best", {"batch": 2}) == {"batch": 1}
    other = optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path / 'study.db'}")
    assert record_once(other, "oomtune:best", {"batch": 3}) == {"batch": 1}


def test_record_once_from_many_threads_has_one_winner(tmp_path):
    study = _study(tmp_path)
    got = []

    def write(i):
        s = optuna.load_study(study_name="s", storage=make_storage(f"sqlite:///{tmp_path / 'study.db'}"))
        got.append(record_once(s, "k", {"writer": i}))

    threads = [threading.Thread(target=write, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 6 and all(g == got[0] for g in got)


def test_retrying_says_so_and_retries_only_connection_errors():
    from sqlalchemy.exc import OperationalError

    calls, lines = [], []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise OperationalError("SELECT 1", {}, Exception("server closed the connection unexpectedly"))
        return "ok"

    assert retrying(flaky, "read trials", say=lines.append, delays_s=(0.0, 0.0, 0.0)) == "ok"
    assert len(calls) == 3 and len(lines) == 2
    assert "storage connection lost while trying to read trials: " in lines[0] and "retry 1 of 3" in lines[0]
    with pytest.raises(ValueError):
        retrying(lambda: (_ for _ in ()).throw(ValueError("a bug")), "x", delays_s=(0.0,))
    # after the last retry: one error that no outer retry loop retries again, the last one its cause
    from oomtune.exceptions import StorageUnavailableError

    with pytest.raises(StorageUnavailableError, match="storage unreachable .* while trying to x: down") as info:
        retrying(lambda: flaky() if False else (_ for _ in ()).throw(
            OperationalError("x", {}, Exception("down"))), "x", delays_s=(0.0,))
    assert isinstance(info.value.__cause__, OperationalError)


def test_oomtune_best_prints_the_recorded_answer_or_says_there_is_none(tmp_path, capsys):
    import yaml

    from oomtune.cli import main
    from oomtune.search.outputs import BEST_ATTR

    study = _study(tmp_path, name="b")
    url = f"sqlite:///{tmp_path / 'study.db'}"
    assert main(["best", "--storage", url, "--study", "b"]) == 1
    assert "no recorded answer yet" in capsys.readouterr().err
    record_once(study, BEST_ATTR, {"schema_version": 1, "best": {"batch_size": 48, "alloc_conf": ""}})
    assert main(["best", "--storage", url, "--study", "b"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["best"]["batch_size"] == 48
    assert main(["best", "--storage", url, "--study", "b", "-o", str(tmp_path / "best.yaml")]) == 0
    assert yaml.safe_load((tmp_path / "best.yaml").read_text())["best"] == {"batch_size": 48, "alloc_conf": ""}


def test_worker_slots_one_trial_per_gpu(monkeypatch):
    import torch

    from oomtune.device import TargetDevice
    from oomtune.search.run import worker_slots

    cpu = TargetDevice("cpu", "cpu", None, "virtual GPU (CPU)", 1 << 30, True)
    assert worker_slots("cpu", cpu, 3) == ["cpu", "cpu", "cpu"]
    gpu = TargetDevice("cuda:0", "cuda", 0, "GPU", 1 << 34, False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert worker_slots("cuda", gpu, 8) == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]   # capped at 4 GPUs
    assert worker_slots("auto", gpu, 2) == ["cuda:0", "cuda:1"]
    assert worker_slots("cuda:2", TargetDevice("cuda:2", "cuda", 2, "GPU", 1 << 34, False), 4) == ["cuda:2"]
    assert worker_slots("cuda", gpu, 1) == ["cuda:0"]


def test_workers_starting_at_once_on_a_new_database_all_open_it(tmp_path):
    # Optuna creates the schema on first use; concurrent first opens used to fail with
    # "UNIQUE constraint failed: alembic_version.version_num" in all but one worker.
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys; from oomtune.study.storage import open_study; from oomtune.search.samplers import make_sampler; "
            "open_study(sys.argv[1], 'x', make_sampler('random', 0)); print('opened')")
    url = f"sqlite:///{tmp_path / 'new.db'}"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    procs = [subprocess.Popen([sys.executable, "-c", code, url], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for _ in range(4)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0, 0], [err[-500:] for _, err in outs]
    assert all(out.strip() == "opened" for out, _ in outs)


_CLAIMER = """
import json, sys, time
import optuna
from oomtune.study.storage import make_storage
optuna.logging.set_verbosity(optuna.logging.ERROR)
url, start_at = sys.argv[1], float(sys.argv[2])
study = optuna.load_study(study_name="race", storage=make_storage(url))
while time.time() < start_at:
    time.sleep(0.001)
claimed = []
while True:
    trial_id = study._pop_waiting_trial_id()   # what every worker's claim calls
    if trial_id is None:
        break
    claimed.append(trial_id)
print(json.dumps(claimed))
"""


def test_sqlite_claims_are_atomic_across_processes(tmp_path):
    # 4 processes claim (WAITING -> RUNNING) the 40 WAITING trials of one SQLite file at once: each
    # trial must be claimed exactly once. Before every SQLite transaction began with BEGIN
    # IMMEDIATE (storage._begin_immediate), claims read the state outside the write's transaction
    # and 4 processes made 71-81 claims of 60 trials (3 runs), so candidates ran twice.
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    url = f"sqlite:///{tmp_path / 'race.db'}"
    study = optuna.create_study(storage=make_storage(url), study_name="race")
    for x in range(40):
        study.enqueue_trial({"x": x}, skip_if_exists=False)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    start_at = time.time() + 4.0   # after every process has imported optuna and opened the study
    procs = [subprocess.Popen([sys.executable, "-c", _CLAIMER, url, str(start_at)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(4)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0, 0], [err[-500:] for _, err in outs]
    claims = [trial_id for out, _ in outs for trial_id in json.loads(out)]
    assert sorted(claims) == sorted(t._trial_id for t in study.get_trials())   # each one, once


def test_seeded_sampler_draws_depend_on_the_trial_not_the_process(tmp_path):
    # Two processes sharing a study each build the sampler from the same search.seed. Their trials
    # must get distinct candidates (a plain RandomSampler(seed=0) in each drew the same sequence:
    # the same candidate launched twice), and a trial's draw must not depend on which process
    # asked, so one process reproduces a run with the same seed.
    from oomtune.search.samplers import make_sampler

    shared = _study(tmp_path, "shared")
    a = optuna.load_study(study_name="shared", storage=shared._storage, sampler=make_sampler("random", 0))
    b = optuna.load_study(study_name="shared", storage=shared._storage, sampler=make_sampler("random", 0))
    drawn = {}
    for study in (a, b, b, a):   # trial numbers 0..3, asked alternately by the two "processes"
        trial = study.ask()
        drawn[trial.number] = trial.suggest_int("x", 0, 10**9)
        study.tell(trial, 1.0)
    assert len(set(drawn.values())) == 4

    alone = optuna.create_study(sampler=make_sampler("random", 0))   # one process, same seed
    again = {}
    for _ in range(4):
        trial = alone.ask()
        again[trial.number] = trial.suggest_int("x", 0, 10**9)
        alone.tell(trial, 1.0)
    assert again == drawn

    plain = [optuna.samplers.RandomSampler(seed=0) for _ in range(2)]   # the old samplers: the same draw
    first = [optuna.create_study(sampler=s).ask().suggest_int("x", 0, 10**9) for s in plain]
    assert first[0] == first[1]


def test_a_duplicate_failed_meanwhile_by_another_worker_is_left_as_it_is(tmp_path):
    # A worker claimed the second copy of a candidate, then lost the storage for longer than the grace
    # period before its heartbeat started: another worker failed the claimed trial as stale. Back, the
    # worker finds it a duplicate of the copy that has a result; marking it must not raise Optuna's
    # UpdateFinishedTrialError (it ended a worker job of a search through a restarted gRPC proxy).
    import optuna
    from optuna.trial import TrialState

    study = _study(tmp_path)
    key = trial_key("baseline", {"x": 5})
    ex = Executor(study, ["cpu"], _Recorder(), poll_s=0.05)
    first = ex.run_batch([({"x": 5}, "baseline", {})])[0]
    study.enqueue_trial({"x": 5}, user_attrs={R.ATTR_ROLE: "baseline", ATTR_KEY: key})
    copy = optuna.Trial(study, study._pop_waiting_trial_id())
    study._storage.set_trial_state_values(copy._trial_id, state=TrialState.FAIL)   # the stale trial reaped
    assert ex._run_claimed(copy, "cpu") is None
    trials = study.get_trials(deepcopy=False)
    assert trials[first.number].state == TrialState.COMPLETE and trials[copy.number].state == TrialState.FAIL
    assert ATTR_DUPLICATE_OF not in trials[copy.number].user_attrs


def test_a_claimed_trial_beats_before_its_first_check(tmp_path, monkeypatch):
    # Field case (a suite run, a search through a gRPC proxy restarted mid-search): a worker claimed a
    # trial, then its duplicate check waited out the outage with growing retry delays (up to 30 s)
    # before the heartbeat started, and a worker that reconnected first failed the live trial as
    # stale. The heartbeat must run from the claim on, before any other storage call of the trial.
    import sqlite3

    study = _study(tmp_path)
    beats_seen = []

    def duplicate_of(self, trial):
        deadline, rows = time.monotonic() + 60, 0   # the heartbeat thread may wait seconds for a core
        with sqlite3.connect(tmp_path / "study.db") as db:
            while not rows and time.monotonic() < deadline:
                rows = db.execute("SELECT count(*) FROM trial_heartbeats WHERE trial_id = ?",
                                  (trial._trial_id,)).fetchone()[0]
                time.sleep(0.05)
        beats_seen.append(rows)
        return None

    monkeypatch.setattr(Executor, "_duplicate_of", duplicate_of)
    out = Executor(study, ["cpu"], _Recorder(), poll_s=0.05).run_batch([({"x": 5}, "baseline", {})])
    assert beats_seen == [1] and out[0].state.name == "COMPLETE"
