"""``storage=grpc://HOST:PORT``: searches through Optuna's gRPC storage proxy (``oomtune
storage-proxy``, started here) in front of a throwaway PostgreSQL server (tests/pg_server.py; skipped
when it cannot start, except under CI).

The target is tests/data/sleep_trial.py: each trial sleeps, "runs out of memory" above batch 48 and
reports throughput = batch, so the answer is known by hand: batch 48 under the default allocator,
after the default allocator's probes 8, 16, 32, 64, 48, 56, 52 (doubling from
search.batch_size.low=8 to the first failure, then bisecting 32..64 to search.baseline_precision:
tests/test_workers_pg.py finds the same probes on PostgreSQL directly).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from pg_server import assert_killed_trial_retried
from pg_server import launched_trials as _launched
from pg_server import sleep_search_overrides
from pg_server import start_sleep_search as _start


pytest.importorskip("grpc")
pytest.importorskip("google.protobuf")
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
PROBES = [8, 16, 32, 48, 52, 56, 64]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proxy:
    """``oomtune storage-proxy`` in a process of its own, on 127.0.0.1:``port``."""

    def __init__(self, db_url: str, port: int, log: Path):
        self.db_url, self.port, self.log = db_url, port, log
        self.proc: subprocess.Popen | None = None
        self.starts = 0   # "serving" lines seen in the log (one per start)

    @property
    def url(self) -> str:
        return f"grpc://127.0.0.1:{self.port}"

    def start(self) -> "Proxy":
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "oomtune", "storage-proxy", "--storage", self.db_url,
                                          "--host", "127.0.0.1", "--port", str(self.port)], cwd=REPO, env=ENV,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:   # its line says it listens
            if self.log.read_text().count("oomtune storage-proxy: serving") > self.starts:
                self.starts += 1
                return self
            assert self.proc.poll() is None, self.log.read_text()
            time.sleep(0.1)
        raise AssertionError("the proxy never said it was serving: " + self.log.read_text())

    def stop(self) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=60)


@pytest.fixture
def proxy(pg, tmp_path):
    db = pg.create_database()
    p = Proxy(db, _free_port(), tmp_path / "proxy.log").start()
    yield p
    if p.proc is not None and p.proc.poll() is None:
        p.stop()


def _overrides(url: str, study: str, run_dir: Path, *extra: str, grace_period_s: int = 5) -> list[str]:
    return sleep_search_overrides(url, study, run_dir, *extra, grace_period_s=grace_period_s)


def _study(db_url: str, name: str):
    """The study read from PostgreSQL itself, not through the proxy."""
    import optuna

    return optuna.load_study(study_name=name, storage=db_url)


def _check_told_once(study, trial_dirs: list[Path]) -> None:
    """Every trial finished; each trial that ran has one directory and one tell.json over all
    workers, holding what the study holds."""
    from oomtune.search.workers import ATTR_DUPLICATE_OF
    from oomtune.study import records as R

    trials = study.get_trials(deepcopy=False)
    assert not [t.number for t in trials if t.state.name in ("RUNNING", "WAITING")]
    dirs: dict[int, list[Path]] = {}
    for d in trial_dirs:
        dirs.setdefault(int(d.name.split("-")[1]), []).append(d)
    assert {n: ds for n, ds in dirs.items() if len(ds) > 1} == {}
    for t in trials:
        if (ATTR_DUPLICATE_OF in t.user_attrs or R.ATTR_RESULT not in t.user_attrs or R.ATTR_REUSED in t.user_attrs
                or R.ATTR_FROM_RECORDING in t.user_attrs):
            continue
        (d,) = dirs[t.number]
        record = json.loads((d / "tell.json").read_text())
        assert (record["number"], record["state"], record["value"]) == (t.number, t.state.name, t.value)


def _best(run_dir: Path) -> tuple[int, str]:
    from oomtune.best import load_best

    best = load_best(run_dir / "best.yaml").best
    return best.batch_size, best.alloc_conf


RESTART_GRACE_S, RESTART_OUTAGE_S = 15, 16


def test_a_search_of_two_local_jobs_through_the_proxy_survives_its_restart(proxy, tmp_path):
    # One search of two local worker jobs through the proxy, which is stopped mid-search and started
    # again on the same port: what any search through the proxy must leave (one answer, every trial
    # told once, each probe once, heartbeats through the proxy, the lock study not listed), and what
    # the restart must not take (nothing finished lost, no live trial taken for a dead one).
    run_dir = tmp_path / "run"
    # The outage (RESTART_OUTAGE_S) outlasts the grace period: a live trial's heartbeat stays unchanged
    # through it, so only the stale count restarting after an outage (oomtune.study.grpc_proxy) keeps
    # it from being failed. After the restart each worker's next heartbeat must get through within the
    # grace period, before another worker's stale check: 15 s, which a loaded machine's heartbeat
    # thread does not miss (5 s was missed).
    proc = _start(_overrides(proxy.url, "restart", run_dir, "launcher=local", "search.workers=2",
                             grace_period_s=RESTART_GRACE_S), tmp_path / "p", sleep_s=1.5)
    deadline = time.monotonic() + 300
    before: dict[int, dict] = {}
    seen = None   # the study, opened once and then read again at each look
    while time.monotonic() < deadline and len(before) < 3:
        time.sleep(0.5)
        try:
            seen = seen or _study(proxy.db_url, "restart")
        except KeyError:   # the study is not created yet
            continue
        before = {t.number: t.user_attrs["result"] for t in seen.trials if "result" in t.user_attrs}
    assert len(before) >= 3, (tmp_path / "p.err").read_text()[-2000:]
    assert proxy.stop() == 143                                                 # SIGTERM: a clean stop
    time.sleep(RESTART_OUTAGE_S)                                               # the workers retry meanwhile
    proxy.start()                                                              # the same port: they reconnect
    assert proc.wait(timeout=900) == 0, (tmp_path / "p.err").read_text()[-3000:]

    assert _best(run_dir) == (48, "")                                          # by hand: module docstring
    assert [(d / "best.yaml").read_text() for d in sorted((run_dir / "workers").glob("worker-*"))] == \
        [(run_dir / "best.yaml").read_text()] * 2                              # one answer (one writer)
    study = _study(proxy.db_url, "restart")
    trials = {t.number: t for t in study.trials}
    assert all(trials[n].user_attrs["result"] == r for n, r in before.items())   # nothing finished was lost
    _check_told_once(study, list((run_dir / "workers").glob("worker-*/trials/trial-*")))
    assert sorted(t.params["batch_size"] for t in _launched(study, "baseline")) == PROBES
    # no live trial was taken for a dead one: the outage stopped every heartbeat, not a worker
    assert not [t.number for t in study.trials if "failed_trial" in t.system_attrs]
    logs = "".join(p.read_text() for p in (run_dir / "workers").glob("*_log.out"))
    assert "storage connection lost while trying to" in logs and "UNAVAILABLE" in logs and "Traceback" not in logs
    # every running trial beat through the proxy (the proxy itself has no heartbeat call)
    from oomtune.study.grpc_proxy import HEARTBEAT_ATTR

    ran = [t for t in study.trials if any((run_dir / "workers").glob(f"worker-*/trials/trial-{t.number:04d}"))]
    assert ran and all(HEARTBEAT_ATTR in t.system_attrs for t in ran)
    # the answer's lock study is not listed as a study
    shown = subprocess.run([sys.executable, "-m", "oomtune", "show", "--storage", proxy.url, "--study", "nope"],
                           cwd=REPO, env=ENV, capture_output=True, text=True)
    assert shown.returncode == 2 and "(studies there: restart)" in shown.stderr


def test_a_worker_killed_mid_trial_is_failed_and_retried_through_the_proxy(proxy, tmp_path):
    # three in-process searches on one study through the proxy; worker 0 is killed (SIGKILL, with its
    # trial process) mid-trial: its trial has to be failed by the others' view of its heartbeat, which
    # only oomtune's client writes through the proxy, and run again (RetryHeartbeatStaleTrialCallback)
    dirs = [tmp_path / f"w{i}" for i in range(3)]
    # worker 0's trials sleep 600 s (beyond trial.timeout, which the kill comes long before): a trial of
    # its seen running is still mid-trial when the kill lands, however long a loaded machine takes
    # between the look and the kill; the other workers' trials, the retry among them, sleep 3 s
    procs = [_start(_overrides(proxy.url, "kill", d), tmp_path / f"w{i}", sleep_s=600.0 if i == 0 else 3.0)
             for i, d in enumerate(dirs)]
    victim, killed_trial, finished_before, study = procs[0], None, set(), None
    deadline = time.monotonic() + 300
    while killed_trial is None and time.monotonic() < deadline:
        time.sleep(0.2)
        if study is None:   # opened once, then read again at each look (a storage costs an engine and a connection)
            try:
                study = _study(proxy.db_url, "kill")
            except KeyError:
                continue
        # worker 0's trials started (stdout.txt is created at the launch), not ended: mid-trial (600 s)
        running = {int(p.name.split("-")[1]) for p in (dirs[0] / "trials").glob("trial-*")
                   if (p / "stdout.txt").exists() and not (p / "result.json").exists()}
        trials = study.get_trials(deepcopy=False)
        mid = [t for t in trials if t.number in running and t.state.name == "RUNNING"]
        if mid:
            finished_before = {u.number for u in trials if "result" in u.user_attrs and u.state.is_finished()}
            os.killpg(victim.pid, signal.SIGKILL)
            killed_trial = mid[0].number
    assert killed_trial is not None, "worker 0 never ran a trial"
    victim.wait(timeout=30)
    for p, i in zip(procs[1:], (1, 2)):
        assert p.wait(timeout=900) == 0, (tmp_path / f"w{i}.err").read_text()[-3000:]

    study = _study(proxy.db_url, "kill")
    trials = {t.number: t for t in study.get_trials(deepcopy=False)}
    assert_killed_trial_retried(trials, killed_trial, finished_before)
    assert _best(dirs[1]) == _best(dirs[2]) == (48, "")
    retried = "".join((tmp_path / f"w{i}.err").read_text() for i in (1, 2))
    assert f"retrying trial {killed_trial} (its worker stopped: heartbeat expired)" in retried


def test_record_once_through_the_proxy_has_exactly_one_winner(proxy):
    import optuna

    from oomtune.study.storage import make_storage, record_once

    optuna.create_study(storage=proxy.db_url, study_name="rec")
    got, barrier = [], threading.Barrier(8)

    def write(i):
        study = optuna.load_study(study_name="rec", storage=make_storage(proxy.url))
        barrier.wait()
        got.append(record_once(study, "oomtune:best", {"writer": i}))

    threads = [threading.Thread(target=write, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 8 and all(g == got[0] for g in got)
    stored = _study(proxy.db_url, "rec")
    assert stored._storage.get_study_system_attrs(stored._study_id)["oomtune:best"] == got[0]
    import optuna

    names = [s.study_name for s in optuna.get_all_study_summaries(proxy.db_url)]
    assert sorted(names) == ["oomtune-lock:rec:oomtune:best", "rec"]          # the lock: one study, once


def test_proxy_refusals_are_one_line(proxy, tmp_path):
    def run(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "oomtune", *argv], cwd=REPO, env=ENV, capture_output=True,
                              text=True, timeout=timeout)

    def one_line(r: subprocess.CompletedProcess, start: str) -> None:
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith(start), r.stderr

    one_line(run("storage-proxy", "--storage", proxy.url), "oomtune: error: --storage grpc://127.0.0.1:")
    one_line(run("storage-proxy", "--storage", f"journal:{tmp_path}/j.log"),
             "oomtune: error: --storage journal:")
    r = run("storage-proxy", "--storage", proxy.db_url, "--host", "127.0.0.1", "--port", str(proxy.port))
    one_line(r, f"oomtune: error: oomtune storage-proxy: cannot listen on 127.0.0.1:{proxy.port}")
    one_line(run("show", "--storage", "grpc://127.0.0.1", "--study", "x"),
             "oomtune: error: storage=grpc://127.0.0.1: a gRPC storage proxy is named grpc://HOST:PORT")
    started = time.monotonic()
    r = run("show", "--storage", f"grpc://127.0.0.1:{_free_port()}", "--study", "x")
    one_line(r, "oomtune: error: cannot open storage 'grpc://127.0.0.1:")
    assert "no storage proxy answered" in r.stderr and "oomtune storage-proxy --storage" in r.stderr
    assert time.monotonic() - started < 60
