"""Several `oomtune search` processes sharing one study on a real PostgreSQL server.

The server is a throwaway cluster (tests/pg_server.py: the OS package's initdb/pg_ctl on 127.0.0.1,
run as the ``postgres`` user under root). These tests skip when it cannot start, except under CI.

The target is tests/data/sleep_trial.py: each trial sleeps, "runs out of memory" above batch 48,
and reports throughput = batch, so the right answer is known by hand: batch 48 under the default
allocator (no setting changes the throughput; the default wins ties, search.min_gain).
"""

from __future__ import annotations

import contextlib

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pg_server import assert_killed_trial_retried
from pg_server import shared_study, sleep_search_overrides


pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent


def _overrides(url: str, study: str, run_dir: Path, *extra: str) -> list[str]:
    return sleep_search_overrides(url, study, run_dir, *extra, grace_period_s=2)


def _start(url: str, study: str, run_dir: Path, *extra: str, sleep_s: float = 0.5) -> subprocess.Popen:
    env = {**os.environ, "OOMTUNE_TEST_SLEEP_S": str(sleep_s), "PYTHONPATH": str(REPO)}
    run_dir.mkdir(parents=True, exist_ok=True)
    log = open(run_dir.parent / f"{run_dir.name}.log", "wb")
    return subprocess.Popen([sys.executable, "-m", "oomtune", "search", *_overrides(url, study, run_dir, *extra)],
                            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _wait(procs: list[subprocess.Popen], run_dirs: list[Path]) -> None:
    for p, d in zip(procs, run_dirs):
        rc = p.wait(timeout=600)
        assert rc == 0, (d.parent / f"{d.name}.log").read_text()[-3000:]


def _study(url: str, name: str):
    return shared_study(url, name)   # read while the workers may be creating the database's tables


def _best(run_dir: Path) -> tuple[int, str]:
    from oomtune.best import load_best

    best = load_best(run_dir / "best.yaml").best
    return best.batch_size, best.alloc_conf


def _launched(study, role: str) -> list:
    """Trials of ``role`` that ran a trial process and hold its result."""
    return [t for t in study.get_trials(deepcopy=False) if t.user_attrs.get("role") == role
            and "result" in t.user_attrs and "reused_from" not in t.user_attrs
            and t.user_attrs.get("outcome") != "predicted_infeasible"]


def test_three_workers_find_the_single_workers_answer_and_never_repeat_a_probe(pg, tmp_path, monkeypatch,
                                                                               capsys):
    from oomtune.cli import main

    url = pg.create_database()
    # the single worker's reference search runs in this process (what `oomtune search` runs); the three
    # sharing a study are processes of their own, as they must be
    single = tmp_path / "single"
    # its trials sleep 0.1 s: one worker alone competes with nobody, and how long a trial takes decides
    # none of what is compared (the answer, the probes, the count of confirmations)
    monkeypatch.setenv("OOMTUNE_TEST_SLEEP_S", "0.1")
    assert main(["search", *_overrides(url, "one", single)]) == 0
    dirs = [tmp_path / f"w{i}" for i in range(3)]
    _wait([_start(url, "three", d) for d in dirs], dirs)

    assert _best(single) == (48, "")                       # by hand: see the module docstring
    assert all(_best(d) == (48, "") for d in dirs)
    texts = {(d / "best.yaml").read_text() for d in dirs}
    assert len(texts) == 1                                   # one answer, written identically by all
    capsys.readouterr()
    assert main(["best", "--storage", url, "--study", "three"]) == 0   # `oomtune best`, in this process
    assert capsys.readouterr().out == texts.pop()

    one, three = _study(url, "one"), _study(url, "three")
    probes_one = sorted(t.params["batch_size"] for t in _launched(one, "baseline"))
    probes_three = sorted(t.params["batch_size"] for t in _launched(three, "baseline"))
    assert probes_three == probes_one == [8, 16, 32, 48, 52, 56, 64]   # each probe launched once
    assert len(_launched(three, "confirm")) == len(_launched(one, "confirm"))  # finalists x repeats
    assert len(_launched(three, "search")) >= 4
    workdirs = [p for d in dirs for p in (d / "trials").glob("trial-*")]
    assert len({p.name for p in workdirs}) == len(workdirs)  # no trial ran in two workers


def test_a_worker_killed_mid_trial_loses_nothing(pg, tmp_path):
    url = pg.create_database()
    dirs = [tmp_path / f"w{i}" for i in range(3)]
    # worker 0's trials sleep 600 s (beyond trial.timeout, which the kill comes long before): a trial of
    # its seen running is still mid-trial when the kill lands, however long a loaded machine takes
    # between the look and the kill; the other workers' trials, the retry among them, sleep 3 s
    procs = [_start(url, "kill", d, sleep_s=600.0 if i == 0 else 3.0) for i, d in enumerate(dirs)]
    victim, killed_trial, finished_before, study = procs[0], None, set(), None
    deadline = time.monotonic() + 300
    while killed_trial is None and time.monotonic() < deadline:
        time.sleep(0.2)
        if study is None:   # opened once, then read again at each look (a storage costs an engine and a connection)
            try:
                study = _study(url, "kill")
            except KeyError:  # not created yet
                continue
        # worker 0's trial processes started (stdout.txt is created at the launch) and not ended (no
        # result.json): each sleeps 600 s, so the kill comes mid-trial, before any result can be stored
        running = {int(p.name.split("-")[1]) for p in (dirs[0] / "trials").glob("trial-*")
                   if (p / "stdout.txt").exists() and not (p / "result.json").exists()}
        trials = study.get_trials(deepcopy=False)
        mid = [t for t in trials if t.number in running and t.state.name == "RUNNING"]
        if mid:
            finished_before = {u.number for u in trials if "result" in u.user_attrs and u.state.is_finished()}
            os.killpg(victim.pid, signal.SIGKILL)            # the worker and its trial process
            killed_trial = mid[0].number
    assert killed_trial is not None, "worker 0 never ran a trial"
    victim.wait(timeout=30)
    _wait(procs[1:], dirs[1:])

    study = _study(url, "kill")
    trials = {t.number: t for t in study.get_trials(deepcopy=False)}
    assert_killed_trial_retried(trials, killed_trial, finished_before)
    assert _best(dirs[1]) == _best(dirs[2]) == (48, "")
    probes = sorted(t.params["batch_size"] for t in _launched(study, "baseline"))
    assert probes == [8, 16, 32, 48, 52, 56, 64]


def test_worker_threads_claim_and_ask_at_once_on_postgresql_and_run_each_trial_once(pg, monkeypatch):
    # On PostgreSQL the Executor's threads claim (WAITING -> RUNNING, a row read FOR UPDATE) and
    # ask the sampler at once, without a process-wide lock: still each enqueued candidate runs in
    # one thread only, and the sampler phase ends at exactly n_trials. (8 threads exceed this
    # machine's cores, where the Executor takes turns by default: claims_at_once is forced here.)
    import threading

    import optuna

    from oomtune.search import claims as C
    from oomtune.study import records as R
    from oomtune.search import workers as W
    from oomtune.study.storage import make_storage
    from oomtune.search.workers import Executor

    url = pg.create_database()
    # Heartbeats on (the Executor's path with a heartbeat storage), but a grace period no loaded
    # machine reaches: a trial failed as stale because its heartbeat thread waited 2 s for a core is
    # test_a_worker_killed_mid_trial_loses_nothing's subject, and here it would be miscounted as a lost claim.
    study = optuna.create_study(storage=make_storage(url, heartbeat_interval_s=1, grace_period_s=300),
                                study_name="threads", direction="maximize")
    assert C.claims_row_locked(study)
    monkeypatch.setattr(W, "claims_at_once", lambda study, n: C.claims_row_locked(study))
    ex0 = Executor(study, ["cpu"] * 8, lambda trial, slot: 0.0)
    assert isinstance(ex0._claim_lock, contextlib.nullcontext)  # the concurrent path is the one tested
    ran, lock = [], threading.Lock()

    def evaluate(trial, slot):
        x = trial.suggest_int("x", 0, 10**6)
        with lock:
            ran.append(trial.number)
        time.sleep(0.05)
        trial.set_user_attr(R.ATTR_RESULT, {"x": x})
        return float(x)

    ex = Executor(study, ["cpu"] * 8, evaluate, poll_s=0.05)
    out = ex.run_batch([({"x": x}, "baseline", {}) for x in range(16)])
    assert [t.params["x"] for t in out] == list(range(16))
    assert len(ran) == 16 and len(set(ran)) == 16        # no trial claimed by two threads
    ran.clear()
    ex.run_sampler(24, "search")
    search = [t for t in study.get_trials(deepcopy=False) if t.user_attrs.get(R.ATTR_ROLE) == "search"]
    assert len(search) == 24 and all(t.state.name == "COMPLETE" for t in search)
    assert sorted(ran) == sorted(t.number for t in search)  # each asked trial evaluated once


def test_record_once_on_postgresql_has_exactly_one_winner(pg):
    import threading

    import optuna

    from oomtune.study.storage import make_storage, record_once

    url = pg.create_database()
    optuna.create_study(storage=url, study_name="rec")
    got, barrier = [], threading.Barrier(8)

    def write(i):
        study = optuna.load_study(study_name="rec", storage=make_storage(url))
        barrier.wait()
        got.append(record_once(study, "oomtune:best", {"writer": i}))

    threads = [threading.Thread(target=write, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 8 and all(g == got[0] for g in got)


def test_worker_threads_take_turns_above_the_core_count(pg, monkeypatch, tmp_path):
    # claims_at_once: at once on a row-locking storage up to the CPU cores the process may use,
    # in turns above (and always on SQLite, which locks the whole file per transaction).
    import optuna

    from oomtune.search import claims as C
    from oomtune.study.storage import make_storage

    pg_study = optuna.create_study(storage=make_storage(pg.create_database()), study_name="cores")
    lite = optuna.create_study(storage=make_storage(f"sqlite:///{tmp_path}/cores.db"), study_name="cores")
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert C.claims_at_once(pg_study, 1) and C.claims_at_once(pg_study, 2)
    assert not C.claims_at_once(pg_study, 3) and not C.claims_at_once(pg_study, 8)
    assert not C.claims_at_once(lite, 1)
