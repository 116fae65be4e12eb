"""The documented PostgreSQL route and a real server outage mid-search.

The server is tests/pg_server.py's throwaway cluster, reached with the README's URL form
``postgresql://oomtune@127.0.0.1:PORT/DB`` (no driver named: SQLAlchemy 2.1 loads psycopg 3, which the
``postgresql`` extra installs). An outage is the server stopped with ``pg_ctl stop -m fast`` (every
connection terminated, as in a restart or failover) and started again on the same port and data
directory. These tests skip when no server can start, except under CI.

The target is tests/data/sleep_trial.py (see tests/test_workers_pg.py): a trial sleeps, "runs out
of memory" above batch 48 and reports throughput = batch, so the answer is known by hand.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pg_server import held_trial, shared_study


pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tests" / "data" / "sleep_trial.py"


def _args(url: str, run_dir: Path, study: str) -> list[str]:
    return [sys.executable, "-m", "oomtune", "search", "target=cmd",
            f"target.command='{sys.executable} {SCRIPT} {{batch_size}}'", "device=cpu",
            "search.batch_size.low=8", "search.batch_size.high=64", "search.n_trials=3",
            "search.objective=throughput", "search.repeats=1", "search.finalists=1", "trial.timeout=120",
            "trial.launcher=spawn",   # no script server importing torch for a script that imports oomtune only
            f"storage={url}", f"study_name={study}", f"hydra.run.dir={run_dir}"]


def _start(url: str, run_dir: Path, study: str, *, sleep_s: float, **env: str) -> tuple[subprocess.Popen, Path]:
    log = run_dir.parent / f"{run_dir.name}.log"
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(_args(url, run_dir, study), cwd=run_dir.parent, stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(REPO), "OOMTUNE_TEST_SLEEP_S": str(sleep_s), **env})
    return proc, log


def _trials(url: str, study: str) -> list:
    return shared_study(url, study).get_trials(deepcopy=False)


def _wait_mid_trial(run_dir: Path, finished: int, timeout_s: float = 300) -> int:
    """Wait until ``finished`` trials have results on disk and another trial process has just started
    (its stdout.txt is younger than 1 s and it has no tell.json yet); returns that trial's number."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        dirs = sorted((run_dir / "trials").glob("trial-*"))
        done = [d for d in dirs if (d / "tell.json").exists()]
        for d in dirs:
            out = d / "stdout.txt"
            if (len(done) >= finished and out.exists() and not (d / "tell.json").exists()
                    and time.time() - out.stat().st_mtime < 1.0):
                return int(d.name.split("-")[1])
        time.sleep(0.05)
    raise AssertionError(f"no trial started after {finished} finished in {run_dir}")


def test_the_documented_url_opens_with_the_extras_driver_and_falls_back_to_psycopg2(pg, monkeypatch):
    import importlib.util

    import optuna

    from oomtune.study.storage import driver_url, make_storage

    url = pg.create_database()
    assert url.startswith("postgresql://oomtune@127.0.0.1:")      # the README's form, no +driver
    assert driver_url(url) == url
    storage = make_storage(url)
    assert storage.engine.dialect.driver == "psycopg"               # SQLAlchemy 2.1's default: psycopg 3
    optuna.create_study(storage=storage, study_name="documented")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "psycopg" else real(name, *a))
    pytest.importorskip("psycopg2")
    assert driver_url(url) == url.replace("postgresql://", "postgresql+psycopg2://")
    fallback = make_storage(url)                                    # only psycopg2 "installed": still opens
    assert fallback.engine.dialect.driver == "psycopg2"
    assert [s.study_name for s in optuna.get_all_study_summaries(fallback)] == ["documented"]


# The outages, in seconds, in the order one search meets them: 7 s ends as the third retry of the
# storage call is due (oomtune.study.reconnect.STORAGE_RETRY_S: 1 + 2 + 4 s), 15 s as the fourth
# (1 + 2 + 4 + 8 s).
OUTAGES_S = (7, 15)


def test_server_outages_mid_search_lose_no_trial(pg, tmp_path):
    # One search meets each outage of OUTAGES_S in turn, each while a trial runs (its result is stored
    # while the server is away); the next outage waits for a trial launched with the server back (one
    # trial at a time: after the stored result), so each outage's retry lines are in the log between
    # its start and the next one's.
    url = pg.create_database()
    run_dir = tmp_path / "run"
    proc, log = _start(url, run_dir, "outage", sleep_s=1.5)
    mids, marks, finished = [], [], 3
    for outage_s in OUTAGES_S:
        mid = _wait_mid_trial(run_dir, finished=finished)
        marks.append(log.stat().st_size)   # where this outage's lines start in the log
        pg.stop_server()
        stopped = time.monotonic()
        time.sleep(outage_s)
        pg.start_server()
        assert time.monotonic() - stopped >= outage_s
        mids.append(mid)
        # the next outage comes after one more trial, launched once this one's retries had ended
        finished = len(list((run_dir / "trials").glob("trial-*/tell.json"))) + 1
    rc = proc.wait(timeout=600)
    text = log.read_text(errors="replace")
    assert rc == 0, text[-4000:]
    assert "Traceback" not in text
    data = log.read_bytes()
    for outage_s, begin, end in zip(OUTAGES_S, marks, [*marks[1:], len(data)]):
        lines = data[begin:end].decode(errors="replace").splitlines()
        retries = [line for line in lines if line.startswith("storage connection lost while")]
        assert retries and all(" retry " in line or "heartbeat" in line for line in retries), (outage_s, lines)
    trials = _trials(url, "outage")
    assert all(t.state.name == "COMPLETE" and "result" in t.user_attrs for t in trials), \
        [(t.number, t.state.name) for t in trials]
    assert set(mids) <= {t.number for t in trials} and len(set(mids)) == len(OUTAGES_S)
    # none lost: every trial that ran here holds, in the study, exactly the outcome it recorded
    records = {int(p.parent.name.split("-")[1]): json.loads(p.read_text())
               for p in (run_dir / "trials").glob("trial-*/tell.json")}
    by_number = {t.number: t for t in trials}
    assert records and set(records) <= set(by_number)
    for number, record in records.items():
        assert by_number[number].user_attrs["result"] == record["user_attrs"]["result"]
    from oomtune.best import load_best

    best = load_best(run_dir / "best.yaml").best
    assert (best.batch_size, best.alloc_conf) == (48, "")


def _wait_held_trial(run_dir: Path, timeout_s: float = 300) -> int:
    """Wait until a trial process is held by tests/data/sleep_trial.py (its "holding" line in its
    stdout.txt, no tell.json yet); returns that trial's number."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for d in sorted((run_dir / "trials").glob("trial-*")):
            if held_trial(d):
                return int(d.name.split("-")[1])
        time.sleep(0.05)
    raise AssertionError(f"no trial held in {run_dir}")


def test_an_outage_longer_than_the_retries_stops_in_one_line_and_the_rerun_tells_the_recorded_result(pg, tmp_path):
    url = pg.create_database()
    run_dir = tmp_path / "run"
    # a short schedule (2 s) so that the outage outlasts it while the trial is still running: after two
    # trials have finished, the next one is held before its end (tests/data/sleep_trial.py's hold file)
    # until the server is down, so its result always meets the outage, however loaded the machine
    hold = tmp_path / "hold"
    proc, log = _start(url, run_dir, "long", sleep_s=3.0, OOMTUNE_STORAGE_RETRY_S="1,1",
                       OOMTUNE_TEST_HOLD_FILE=str(hold))
    deadline = time.monotonic() + 300
    while len(list((run_dir / "trials").glob("trial-*/tell.json"))) < 2:
        assert time.monotonic() < deadline, f"two trials never finished in {run_dir}"
        time.sleep(0.05)
    hold.touch()
    mid = _wait_held_trial(run_dir)
    pg.stop_server()
    hold.unlink()                                   # the held trial ends and reports, the server down
    try:
        rc = proc.wait(timeout=120)
    finally:
        pg.start_server()
    text = log.read_text(errors="replace")
    assert rc == 1, text[-4000:]
    last = text.rstrip().splitlines()[-1]
    assert last.startswith("oomtune: storage unreachable for 2 s (2 retries) while trying to store a trial's result")
    assert last.endswith("run the same command to resume") and "Traceback" not in text
    record = json.loads((run_dir / "trials" / f"trial-{mid:04d}" / "tell.json").read_text())
    stranded = {t.number: t for t in _trials(url, "long")}[mid]
    assert stranded.state.name == "RUNNING" and "result" not in stranded.user_attrs   # measured, not told

    out = subprocess.run(_args(url, run_dir, "long"), cwd=tmp_path, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(REPO), "OOMTUNE_TEST_SLEEP_S": "0.2"})
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert f"told the storage 1 trial whose result it could not take when it finished (unreachable or out of " \
           f"space), from their records in " \
           f"{run_dir / 'trials'}: {mid}" in out.stderr + out.stdout
    trials = {t.number: t for t in _trials(url, "long")}
    assert trials[mid].state.name == "COMPLETE" and trials[mid].user_attrs["result"] == record["user_attrs"]["result"]
    assert all(t.state.name == "COMPLETE" for t in trials.values())
