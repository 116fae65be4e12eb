"""Many worker processes on one study: PostgreSQL directly vs through the gRPC storage proxy.

    python experiments/bench_cluster.py [--processes 8] [--claims 240] [--jobs 4] [--trials 16] [--out FILE]

Starts a throwaway PostgreSQL server (tests/pg_server.py) and ``oomtune storage-proxy`` in front of
it (127.0.0.1), then measures each storage, alternating (direct, proxy, direct, proxy: --repeats):

1. Claims. --claims candidates are enqueued (WAITING trials), then --processes worker processes
   run oomtune's worker loop on them (:class:`oomtune.search.workers.Executor`, one worker each,
   with the storage's heartbeat; ``Executor.drain``: claim a WAITING trial, run it, tell it
   COMPLETE, until none is left), whose evaluation does nothing but store a result attribute: the
   coordination alone. (Not ``run_batch`` with the same round in every process: each process would
   enqueue its own copy of every candidate, the copies finished as duplicates.)
   Reported: claims per second over the round (candidates / seconds from the round's first trial
   start to its last completion, the study's own timestamps), candidates run twice (target 0), and
   the database's transactions per candidate (``pg_stat_database.xact_commit``; through the proxy,
   the proxy's own).
2. Trials. ``oomtune search ... launcher=local search.workers=--jobs`` (worker jobs through
   submitit's LocalExecutor) of a tiny MLP on the virtual GPU (``device=cpu``; objective throughput,
   so --trials sampler trials run besides the frontier probes and the confirmations). Reported:
   trials that ran per minute over the trial phase (first trial's start to last trial's end) and the
   whole command's wall time.

Memory figures do not enter; every trial runs on this machine's CPU (its throughput is the CPU's).
A machine of 2 cores shared with other work times the processes' scheduling as much as the storage.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "experiments"))
ENV = {**os.environ, "PYTHONPATH": str(REPO)}

# The claims worker: one process, one Executor worker, the round every process is given.
WORKER = r"""
import sys, time, optuna
from oomtune.study import records as R
from oomtune.study.storage import make_storage
from oomtune.search.workers import Executor
optuna.logging.set_verbosity(optuna.logging.ERROR)
url, name, n, start_at = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
study = optuna.load_study(study_name=name, storage=make_storage(url, heartbeat_interval_s=10, grace_period_s=60))
def evaluate(trial, slot):
    x = trial.suggest_int("x", 0, 10**6)   # the enqueued value (Optuna's fixed parameters)
    trial.set_user_attr(R.ATTR_RESULT, {"x": x})
    return float(x)
while time.time() < start_at:   # every process starts the round together
    time.sleep(0.01)
Executor(study, ["cpu"], evaluate, poll_s=0.05).drain(("baseline",))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _commits(server, database: str) -> int:
    from pg_server import _connect

    conn = _connect(host="127.0.0.1", port=server.port, user="oomtune", dbname="postgres")
    with conn.cursor() as cur:
        cur.execute("SELECT pg_stat_clear_snapshot()")
        cur.execute("SELECT xact_commit FROM pg_stat_database WHERE datname = %s", (database,))
        value = int(cur.fetchone()[0])
    conn.close()
    return value


def _claims(server, db_name: str, url: str, name: str, processes: int, n: int) -> dict:
    import optuna

    from oomtune.study.storage import make_storage

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    study = optuna.create_study(storage=make_storage(url), study_name=name, direction="maximize")
    for x in range(n):
        study.enqueue_trial({"x": x}, user_attrs={"role": "baseline"})
    time.sleep(1.0)   # pg_stat_database is reported by the server with a delay
    before = _commits(server, db_name)
    start_at = time.time() + 8.0   # the processes import optuna and open the study first
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, url, name, str(n), str(start_at)], cwd=REPO, env=ENV,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for _ in range(processes)]
    errors = [p.communicate(timeout=1800)[1].decode(errors="replace") for p in procs]
    codes = [p.returncode for p in procs]
    time.sleep(1.0)
    after = _commits(server, db_name)
    trials = [t for t in optuna.load_study(study_name=name, storage=make_storage(url)).trials
              if t.user_attrs.get("result") is not None]
    if not trials:
        raise SystemExit(f"no trial ran: {next((e for e in errors if e.strip()), '')[-2000:]}")
    params = [t.params["x"] for t in trials]
    first = min(t.datetime_start for t in trials)
    last = max(t.datetime_complete for t in trials)
    seconds = (last - first).total_seconds()
    return {"codes": codes, "error": next((e.strip().splitlines()[-1] for e in errors if e.strip()), ""),
            "claims_per_s": len(set(params)) / seconds if seconds else float("nan"), "seconds": seconds,
            "twice": len(params) - len(set(params)), "xact_per_claim": (after - before) / max(1, len(set(params)))}


def _trials(url: str, name: str, run_dir: Path, jobs: int, trials: int) -> dict:
    import optuna

    from oomtune.study.storage import make_storage

    started = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "oomtune", "search", "model=mlp", "model.in_features=256",
                        "model.hidden=256", "model.layers=2", "budget=64MiB", "device=cpu",
                        "search.objective=throughput", f"search.n_trials={trials}", "search.batch_size.low=8",
                        "search.batch_size.high=512", "trial.warmup_steps=1", "trial.measure_steps=2",
                        "trial.confirm_steps=2", "trial.soak_steps=0", "trial.timeout=300", f"storage={url}",
                        f"study_name={name}", f"hydra.run.dir={run_dir}", "launcher=local",
                        f"search.workers={jobs}"], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=3600)
    wall = time.monotonic() - started
    study = optuna.load_study(study_name=name, storage=make_storage(url))
    ran = [t for t in study.trials if t.user_attrs.get("result") is not None and t.datetime_complete is not None
           and "reused_from" not in t.user_attrs and t.user_attrs.get("outcome") != "predicted_infeasible"]
    seconds = (max(t.datetime_complete for t in ran) - min(t.datetime_start for t in ran)).total_seconds() if ran else 0
    return {"code": r.returncode, "error": r.stderr.strip().splitlines()[-1] if r.returncode else "",
            "ran": len(ran), "per_min": 60 * len(ran) / seconds if seconds else float("nan"), "wall": wall}


def main() -> int:
    from _provenance import header, write_results

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--processes", type=int, default=8, help="worker processes of the claims round")
    ap.add_argument("--claims", type=int, default=240, help="candidates of the claims round")
    ap.add_argument("--jobs", type=int, default=4, help="worker jobs of the search (launcher=local)")
    ap.add_argument("--trials", type=int, default=16, help="sampler trials of the search")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--skip-search", action="store_true", help="the claims rounds only")
    ap.add_argument("--out", default=str(REPO / "experiments" / "results" / "bench_cluster.txt"))
    args = ap.parse_args()
    lines = header().rstrip("\n").splitlines()
    from pg_server import PgServer

    server = PgServer().start()
    proxy = None
    try:
        db_url = server.create_database("bench")
        port = _free_port()
        log = open(Path(tempfile.mkdtemp(prefix="oomtune-proxy-")) / "proxy.log", "wb")
        proxy = subprocess.Popen([sys.executable, "-m", "oomtune", "storage-proxy", "--storage", db_url, "--host",
                                  "127.0.0.1", "--port", str(port)], cwd=REPO, env=ENV, stdout=log,
                                 stderr=subprocess.STDOUT)
        grpc_url = f"grpc://127.0.0.1:{port}"
        time.sleep(5)
        urls = {"direct": db_url, "proxy": grpc_url}
        lines.append(f"# PostgreSQL (throwaway, fsync off) and oomtune storage-proxy (32 threads) on 127.0.0.1; "
                     f"{os.cpu_count()} CPUs")
        lines.append("")
        lines.append(f"## claims: {args.processes} processes x 1 worker, one round of {args.claims} candidates "
                     "(evaluation stores a result, nothing else)")
        lines.append(f"{'storage':8} {'repeat':>6} {'claims/s':>9} {'seconds':>8} {'run twice':>9} "
                     f"{'xact/claim':>10}  exit codes")
        for rep in range(args.repeats):
            for kind, url in urls.items():
                got = _claims(server, "bench", url, f"claims-{kind}-{rep}", args.processes, args.claims)
                lines.append(f"{kind:8} {rep:>6} {got['claims_per_s']:>9.1f} {got['seconds']:>8.1f} "
                             f"{got['twice']:>9} {got['xact_per_claim']:>10.1f}  {got['codes']}"
                             + (f" ({got['error']})" if got["error"] else ""))
                print(lines[-1], flush=True)
        if not args.skip_search:
            lines.append("")
            lines.append(f"## trials: oomtune search launcher=local search.workers={args.jobs}, tiny MLP on the "
                         f"virtual GPU, search.n_trials={args.trials}")
            lines.append(f"{'storage':8} {'repeat':>6} {'ran':>4} {'trials/min':>10} {'wall s':>7}  exit")
            for rep in range(args.repeats):
                for kind, url in urls.items():
                    run_dir = Path(tempfile.mkdtemp(prefix="oomtune-bench-cluster-"))
                    got = _trials(url, f"trials-{kind}-{rep}", run_dir, args.jobs, args.trials)
                    lines.append(f"{kind:8} {rep:>6} {got['ran']:>4} {got['per_min']:>10.1f} {got['wall']:>7.1f}  "
                                 f"{got['code']}" + (f" ({got['error']})" if got["error"] else ""))
                    print(lines[-1], flush=True)
    finally:
        if proxy is not None:
            proxy.terminate()
            proxy.wait(timeout=60)
        server.stop()
    write_results(args.out, "\n".join(lines))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
