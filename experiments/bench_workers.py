"""Many trials at once on PostgreSQL: scaling with workers, coordination overhead, a killed worker.

    python experiments/bench_workers.py [--sleep 2] [--trials 16] [--workers 1,2,4,8] [--out FILE]

Starts a throwaway PostgreSQL server (tests/pg_server.py: the OS package's initdb/pg_ctl on
127.0.0.1), then:

1. Scaling. For each N in --workers, one ``oomtune search`` with ``search.workers=N`` on a fresh
   database runs --trials sampler trials (no baseline, no confirmation) of a ``target=cmd`` trial
   that sleeps --sleep seconds and reports (tests/data/sleep_trial.py), so the CPU is not the
   limit. Reported: wall time of the trial phase (first trial start to last trial end, from the
   study's own timestamps) and of the whole command; speed-up vs 1 worker and its fraction of
   linear (speed-up / N); coordination overhead per trial: storage round trips and milliseconds
   spent in them (the Executor's counters, workers.json), and the time a trial spends in the study
   beyond its process's own wall time (claim + tell + result storage).
2. Faults. Three ``oomtune search`` processes (one worker each) share a study with
   ``search.heartbeat_interval=1 search.grace_period=2``; when worker 0 runs a trial its process
   group is killed (SIGKILL). Reported: finished trials lost (target 0), seconds from the kill to
   the retried trial's start (heartbeat expiry + claim) and to its end, and whether the survivors
   wrote the same best.yaml.
3. SQLite, the default storage, under several writers (threads of one search, and 3 processes on
   one file): exit codes, trials with results and "database is locked" errors.

Memory figures do not enter here; all trials run on this machine's CPU ("device=cpu").
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
SCRIPT = REPO / "tests" / "data" / "sleep_trial.py"


def _search(url: str, study: str, run_dir: Path, sleep_s: float, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "OOMTUNE_TEST_SLEEP_S": str(sleep_s), "OOMTUNE_TEST_MAX_BATCH": "100000",
           "PYTHONPATH": str(REPO)}
    run_dir.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "oomtune", "search", "target=cmd",
            f"target.command='{sys.executable} {SCRIPT} {{batch_size}}'", "device=cpu",
            "search.batch_size.low=8", "search.batch_size.high=64", "trial.timeout=300",
            "search.objective=throughput",  # the sampler phase runs (auto is batch on the virtual GPU)
            f"storage={url}", f"study_name={study}", f"hydra.run.dir={run_dir}", *extra]
    log = open(run_dir / "search.log", "wb")
    return subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _trials(url: str, study: str) -> list:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    return optuna.load_study(study_name=study, storage=url).get_trials(deepcopy=False)


def scaling(pg, workers: list[int], n_trials: int, sleep_s: float, root: Path) -> list[dict]:
    rows = []
    for n in workers:
        url, run_dir = pg.create_database(), root / f"scale-{n}"
        started = time.perf_counter()
        proc = _search(url, "scale", run_dir, sleep_s, f"search.workers={n}", f"search.n_trials={n_trials}",
                       "search.baseline=false", "search.confirm=false", "search.sampler=random")
        rc = proc.wait()
        command_s = time.perf_counter() - started
        if rc != 0:
            raise SystemExit(f"search with {n} workers failed: {(run_dir / 'search.log').read_text()[-2000:]}")
        trials = [t for t in _trials(url, "scale") if "result" in t.user_attrs]
        first = min(t.datetime_start for t in trials)
        last = max(t.datetime_complete for t in trials)
        in_study = [(t.datetime_complete - t.datetime_start).total_seconds() for t in trials]
        process = [float(t.user_attrs["result"].get("wall_s") or 0.0) for t in trials]
        stats = json.loads((run_dir / "workers.json").read_text())
        rows.append({"workers": n, "trials": len(trials), "phase_s": (last - first).total_seconds(),
                     "command_s": command_s, "calls_per_trial": stats["storage_calls"] / len(trials),
                     "storage_ms_per_trial": 1000 * stats["storage_s"] / len(trials),
                     "beyond_process_ms": 1000 * sum(a - b for a, b in zip(in_study, process)) / len(trials)})
    base = rows[0]["phase_s"]
    for r in rows:
        r["speedup"] = base / r["phase_s"]
        r["of_linear"] = r["speedup"] / r["workers"]
    return rows


def fault(pg, sleep_s: float, root: Path) -> dict:
    url = pg.create_database()
    dirs = [root / f"fault-w{i}" for i in range(3)]
    extra = ("search.n_trials=6", "search.heartbeat_interval=1", "search.grace_period=2", "search.sampler=random")
    procs = [_search(url, "fault", d, sleep_s, *extra) for d in dirs]
    killed, killed_at, before = None, None, set()
    deadline = time.monotonic() + 600
    while killed is None and time.monotonic() < deadline:
        time.sleep(0.1)
        try:
            trials = _trials(url, "fault")
        except KeyError:
            continue
        mine = {int(p.name.split("-")[1]) for p in (dirs[0] / "trials").glob("trial-*")}
        running = [t for t in trials if t.number in mine and t.state.name == "RUNNING"]
        if running:
            before = {t.number for t in trials if t.state.is_finished() and "result" in t.user_attrs}
            os.killpg(procs[0].pid, signal.SIGKILL)
            killed, killed_at = running[0].number, time.time()
    procs[0].wait()
    for p in procs[1:]:
        if p.wait() != 0:
            raise SystemExit("a surviving worker failed")
    trials = {t.number: t for t in _trials(url, "fault")}
    retry = min((t for t in trials.values() if t.system_attrs.get("failed_trial") == killed),
                key=lambda t: t.number)
    texts = {(d / "best.yaml").read_text() for d in dirs[1:]}
    return {"killed_trial": killed, "retried_as": retry.number,
            "lost": len([n for n in before if "result" not in trials[n].user_attrs]),
            "finished_before_kill": len(before),
            "kill_to_retry_start_s": retry.datetime_start.timestamp() - killed_at,
            "kill_to_retry_end_s": retry.datetime_complete.timestamp() - killed_at,
            "same_best_yaml": len(texts) == 1}


def sqlite_check(n_workers: int, n_trials: int, sleep_s: float, root: Path) -> dict:
    """SQLite (the default storage) under several writers: one search with ``search.workers=N``
    threads, then 3 processes on one SQLite file; any "database is locked" fails a process."""
    out = {}
    run_dir = root / "sqlite-threads"
    url = f"sqlite:///{run_dir / 'study.db'}"
    run_dir.mkdir(parents=True)
    rc = _search(url, "sq", run_dir, sleep_s, f"search.workers={n_workers}", f"search.n_trials={n_trials}",
                 "search.baseline=false", "search.confirm=false", "search.sampler=random").wait()
    done = [t for t in _trials(url, "sq") if "result" in t.user_attrs]
    out["threads"] = (rc, len(done))
    shared = root / "sqlite-shared.db"
    url = f"sqlite:///{shared}"
    dirs = [root / f"sqlite-proc{i}" for i in range(3)]
    procs = [_search(url, "sqp", d, sleep_s, "search.workers=2", f"search.n_trials={n_trials}",
                     "search.baseline=false", "search.confirm=false", "search.sampler=random") for d in dirs]
    rcs = [p.wait() for p in procs]
    locked = sum("database is locked" in (d / "search.log").read_text(errors="replace") for d in dirs)
    done = [t for t in _trials(url, "sqp") if "result" in t.user_attrs]
    out["processes"] = (rcs, len(done), locked)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sleep", type=float, default=2.0, help="seconds each trial sleeps")
    ap.add_argument("--trials", type=int, default=16)
    ap.add_argument("--workers", default="1,2,4,8")
    ap.add_argument("--out", default=str(REPO / "experiments" / "results" / "bench_workers.txt"))
    args = ap.parse_args()
    from pg_server import PgServer

    sys.path.insert(0, str(REPO / "experiments"))
    from _provenance import header
    pg = PgServer().start()
    try:
        with tempfile.TemporaryDirectory(prefix="oomtune-bench-workers-") as tmp:
            rows = scaling(pg, [int(w) for w in args.workers.split(",")], args.trials, args.sleep, Path(tmp))
            f = fault(pg, args.sleep, Path(tmp))
            sq = sqlite_check(max(int(w) for w in args.workers.split(",")), args.trials, args.sleep, Path(tmp))
    finally:
        pg.stop()
    lines = [*header().splitlines(),
             f"# machine: {os.cpu_count()} CPUs; trials run on the CPU (device=cpu), each sleeps {args.sleep:g} s "
             "and reports; storage: PostgreSQL (throwaway server on 127.0.0.1, fsync off)", "",
             f"scaling: {args.trials} sampler trials, one `oomtune search` with search.workers=N",
             "workers  trials  trial phase s  command s  speed-up  of linear  storage calls/trial  "
             "storage ms/trial  in-study beyond process ms/trial"]
    for r in rows:
        lines.append(f"{r['workers']:>7}  {r['trials']:>6}  {r['phase_s']:>13.2f}  {r['command_s']:>9.2f}  "
                     f"{r['speedup']:>8.2f}  {r['of_linear']:>9.2f}  {r['calls_per_trial']:>19.1f}  "
                     f"{r['storage_ms_per_trial']:>16.1f}  {r['beyond_process_ms']:>31.1f}")
    lines += ["", "fault: 3 `oomtune search` processes, heartbeat_interval=1 s, grace_period=2 s; worker 0 "
              "SIGKILLed (process group) mid-trial",
              f"killed trial {f['killed_trial']}, retried as trial {f['retried_as']}; finished trials before "
              f"the kill: {f['finished_before_kill']}, lost: {f['lost']}",
              f"kill -> retry starts: {f['kill_to_retry_start_s']:.1f} s; kill -> retry finished: "
              f"{f['kill_to_retry_end_s']:.1f} s; survivors wrote the same best.yaml: {f['same_best_yaml']}",
              "", "SQLite (default storage) under several writers, same trials:",
              f"one search, search.workers={max(int(w) for w in args.workers.split(','))} threads: exit "
              f"{sq['threads'][0]}, {sq['threads'][1]} trials with results",
              f"3 processes x 2 workers on one SQLite file: exits {sq['processes'][0]}, "
              f"{sq['processes'][1]} trials with results, 'database is locked' in {sq['processes'][2]} logs"]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
