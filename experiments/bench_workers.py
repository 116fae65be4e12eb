"""Many trials at once on PostgreSQL: scaling with workers, coordination overhead, a killed worker.

    python experiments/bench_workers.py [--sleep 2] [--trials 16] [--workers 1,2,4,8] [--repeats 2] [--out FILE]

Starts a throwaway PostgreSQL server (tests/pg_server.py: the OS package's initdb/pg_ctl on
127.0.0.1), then:

1. Scaling. For each N in --workers, one ``oomtune search`` with ``search.workers=N`` on a fresh
   database runs --trials sampler trials (no baseline, no confirmation) of a ``target=cmd`` trial
   that sleeps --sleep seconds and reports (tests/data/sleep_trial.py), so the CPU is not the
   limit. Reported: wall time of the trial phase (first trial's start to last trial's end, from the
   study's own timestamps) and of the whole command (start-up and the final report included);
   speed-up = trial phase with 1 worker / trial phase with N workers, and its fraction of linear
   (speed-up / N); coordination overhead per trial: the database's own count of transactions
   (``pg_stat_database``: every Optuna storage call is one, setup of the study included, divided by
   the trials) and the time a trial spends in the study beyond its process's own wall time (claim,
   parameters, attributes, tell).
2. Variants at the largest N, in one run, alternating (--repeats each): the workers as built
   (claiming at once up to the core count, in turns above it); the workers of a process claiming
   and asking at once whatever their number (``claims_at_once`` = ``claims_row_locked``); taking
   turns for claims and asks (``claims_at_once`` False, what SQLite does); all workers on one shared Study object (``Executor.own_studies`` False: Optuna's
   per-Study cache holds its lock during database reads). Same trial phase and overhead figures.
3. Faults. Three ``oomtune search`` processes (one worker each) share a study with
   ``search.heartbeat_interval=1 search.grace_period=2``; when worker 0 runs a trial its process
   group is killed (SIGKILL). Reported: finished trials lost (target 0), seconds from the kill to
   the retried trial's start (heartbeat expiry + claim) and to its end, and whether the survivors
   wrote the same best.yaml.
4. SQLite, the default storage, under several writers (threads of one search, and 3 processes x 2
   workers on one file): exit codes, trials with results, trials run by two processes, candidates
   (parameters) launched twice, and "database is locked" errors.

Memory figures do not enter here; all trials run on this machine's CPU ("device=cpu").
"""

from __future__ import annotations

import argparse
import collections
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

# Variants of the workers, set in the search process before it starts (no product option exists).
VARIANTS = {
    "as built": "",
    "claiming at once": "import oomtune.search.workers as W, oomtune.search.claims as C; "
                        "W.claims_at_once = lambda study, n: C.claims_row_locked(study)",
    "taking turns": "import oomtune.search.workers as W; W.claims_at_once = lambda study, n: False",
    "one shared Study": "import oomtune.search.workers as W; W.Executor.own_studies = False",
}


def _search(url: str, study: str, run_dir: Path, sleep_s: float, *extra: str, patch: str = "") -> subprocess.Popen:
    env = {**os.environ, "OOMTUNE_TEST_SLEEP_S": str(sleep_s), "OOMTUNE_TEST_MAX_BATCH": "100000",
           "PYTHONPATH": str(REPO)}
    run_dir.mkdir(parents=True, exist_ok=True)
    args = ["search", "target=cmd", f"target.command='{sys.executable} {SCRIPT} {{batch_size}}'", "device=cpu",
            "search.batch_size.low=8", "search.batch_size.high=64", "trial.timeout=300",
            "search.objective=throughput",  # the sampler phase runs (auto is batch on the virtual GPU)
            f"storage={url}", f"study_name={study}", f"hydra.run.dir={run_dir}", *extra]
    start = ["-m", "oomtune"] if not patch else \
        ["-c", f"{patch}; import sys; from oomtune.cli import main; raise SystemExit(main(sys.argv[1:]))"]
    log = open(run_dir / "search.log", "wb")
    return subprocess.Popen([sys.executable, *start, *args], cwd=REPO, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)


def _trials(url: str, study: str) -> list:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    return optuna.load_study(study_name=study, storage=url).get_trials(deepcopy=False)


def _transactions(pg, url: str) -> int:
    """Transactions committed or rolled back in the database of ``url`` so far (the server's count;
    a backend reports its counts when it exits, so this waits until the count stops changing)."""
    import psycopg2

    name = url.rsplit("/", 1)[1]
    last = None
    for _ in range(50):
        conn = psycopg2.connect(host="127.0.0.1", port=pg.port, user="oomtune", dbname="postgres")
        with conn.cursor() as cur:
            cur.execute("SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = %s", (name,))
            count = int(cur.fetchone()[0])
        conn.close()
        if count == last:
            return count
        last = count
        time.sleep(0.2)
    return last


def one_run(pg, n: int, n_trials: int, sleep_s: float, run_dir: Path, patch: str = "") -> dict:
    url = pg.create_database()
    started = time.perf_counter()
    proc = _search(url, "scale", run_dir, sleep_s, f"search.workers={n}", f"search.n_trials={n_trials}",
                   "search.baseline=false", "search.confirm=false", "search.sampler=random", patch=patch)
    rc = proc.wait()
    command_s = time.perf_counter() - started
    if rc != 0:
        raise SystemExit(f"search with {n} workers failed: {(run_dir / 'search.log').read_text()[-2000:]}")
    transactions = _transactions(pg, url)
    trials = [t for t in _trials(url, "scale") if "result" in t.user_attrs]
    first = min(t.datetime_start for t in trials)
    last = max(t.datetime_complete for t in trials)
    in_study = [(t.datetime_complete - t.datetime_start).total_seconds() for t in trials]
    process = [float(t.user_attrs["result"].get("wall_s") or 0.0) for t in trials]
    return {"workers": n, "trials": len(trials), "phase_s": (last - first).total_seconds(),
            "command_s": command_s, "transactions_per_trial": transactions / len(trials),
            "beyond_process_ms": 1000 * sum(a - b for a, b in zip(in_study, process)) / len(trials)}


def scaling(pg, workers: list[int], n_trials: int, sleep_s: float, root: Path) -> list[dict]:
    rows = [one_run(pg, n, n_trials, sleep_s, root / f"scale-{n}") for n in workers]
    base = rows[0]["phase_s"]
    for r in rows:
        r["speedup"] = base / r["phase_s"]
        r["of_linear"] = r["speedup"] / r["workers"]
    return rows


def variants(pg, n: int, n_trials: int, sleep_s: float, repeats: int, base_phase_s: float, root: Path) -> dict:
    """Each variant ``repeats`` times at ``n`` workers, alternating, so that load from elsewhere on
    the machine falls on all of them alike."""
    out: dict[str, list[dict]] = collections.defaultdict(list)
    for i in range(repeats):
        for name, patch in VARIANTS.items():
            r = one_run(pg, n, n_trials, sleep_s, root / f"variant-{len(out[name])}-{name.replace(' ', '_')}-{i}", patch)
            r["of_linear"] = base_phase_s / r["phase_s"] / n
            out[name].append(r)
    return out


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
    for d, p in zip(dirs[1:], procs[1:]):
        if p.wait() != 0:   # its log's end says why (the run directory is temporary)
            tail = (d / "search.log").read_text(errors="replace").splitlines()[-15:]
            raise SystemExit(f"a surviving worker failed (exit {p.returncode}); the end of its log:\n"
                             + "\n".join(tail))
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


def _launched_twice(trials: list, dirs: list[Path]) -> tuple[int, int]:
    """(trials whose process ran in two search processes, candidates launched by two trials)."""
    runs = collections.Counter(p.name for d in dirs for p in (d / "trials").glob("trial-*"))
    launched = [t for t in trials if "result" in t.user_attrs and "reused_from" not in t.user_attrs]
    params = collections.Counter(json.dumps(t.params, sort_keys=True) for t in launched)
    return sum(1 for n in runs.values() if n > 1), sum(n - 1 for n in params.values() if n > 1)


def sqlite_check(n_workers: int, n_trials: int, sleep_s: float, root: Path) -> dict:
    """SQLite (the default storage) under several writers: one search with ``search.workers=N``
    threads, then 3 processes x 2 workers on one SQLite file."""
    out = {}
    run_dir = root / "sqlite-threads"
    url = f"sqlite:///{run_dir / 'study.db'}"
    run_dir.mkdir(parents=True)
    rc = _search(url, "sq", run_dir, sleep_s, f"search.workers={n_workers}", f"search.n_trials={n_trials}",
                 "search.baseline=false", "search.confirm=false", "search.sampler=random").wait()
    trials = _trials(url, "sq")
    out["threads"] = (rc, len([t for t in trials if "result" in t.user_attrs]), *_launched_twice(trials, [run_dir]))
    shared = root / "sqlite-shared.db"
    url = f"sqlite:///{shared}"
    dirs = [root / f"sqlite-proc{i}" for i in range(3)]
    procs = [_search(url, "sqp", d, sleep_s, "search.workers=2", f"search.n_trials={n_trials}",
                     "search.baseline=false", "search.confirm=false", "search.sampler=random") for d in dirs]
    rcs = [p.wait() for p in procs]
    locked = sum("database is locked" in (d / "search.log").read_text(errors="replace") for d in dirs)
    trials = _trials(url, "sqp")
    out["processes"] = (rcs, len([t for t in trials if "result" in t.user_attrs]), *_launched_twice(trials, dirs), locked)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sleep", type=float, default=2.0, help="seconds each trial sleeps")
    ap.add_argument("--trials", type=int, default=16)
    ap.add_argument("--workers", default="1,2,4,8")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each variant at the largest N (0: none)")
    ap.add_argument("--out", default=str(REPO / "experiments" / "results" / "bench_workers.txt"))
    args = ap.parse_args()
    from pg_server import PgServer

    sys.path.insert(0, str(REPO / "experiments"))
    from _provenance import header, write_results
    head = header().splitlines()   # at the start: refuses a dirty tree, reads the load
    workers = [int(w) for w in args.workers.split(",")]
    pg = PgServer().start()
    try:
        with tempfile.TemporaryDirectory(prefix="oomtune-bench-workers-") as tmp:
            rows = scaling(pg, workers, args.trials, args.sleep, Path(tmp))
            var = variants(pg, max(workers), args.trials, args.sleep, args.repeats, rows[0]["phase_s"], Path(tmp))
            f = fault(pg, args.sleep, Path(tmp))
            sq = sqlite_check(max(workers), args.trials, args.sleep, Path(tmp))
    finally:
        pg.stop()
    load_after = os.getloadavg()
    lines = [*head,
             f"# load average (1 min) after: {load_after[0]:.2f}; trials run on the CPU (device=cpu), each sleeps {args.sleep:g} s "
             "and reports; storage: PostgreSQL (throwaway server on 127.0.0.1, fsync off)", "",
             f"scaling: {args.trials} sampler trials, one `oomtune search` with search.workers=N; speed-up = "
             "trial phase at 1 worker / at N (trial phase: first trial's start to last trial's end)",
             "workers  trials  trial phase s  command s  speed-up  of linear  transactions/trial  "
             "in-study beyond process ms/trial"]
    for r in rows:
        lines.append(f"{r['workers']:>7}  {r['trials']:>6}  {r['phase_s']:>13.2f}  {r['command_s']:>9.2f}  "
                     f"{r['speedup']:>8.2f}  {r['of_linear']:>9.2f}  {r['transactions_per_trial']:>18.1f}  "
                     f"{r['beyond_process_ms']:>32.1f}")
    if var:
        lines += ["", f"variants at {max(workers)} workers, alternating in this run ({args.repeats} runs each; "
                  "of linear against the 1-worker phase above):",
                  "variant            trial phase s (runs)     of linear (runs)    transactions/trial  "
                  "beyond process ms/trial"]
        for name, runs in var.items():
            phases = " ".join(f"{r['phase_s']:.2f}" for r in runs)
            linear = " ".join(f"{r['of_linear']:.2f}" for r in runs)
            lines.append(f"{name:<18} {phases:<24} {linear:<19} "
                         f"{sum(r['transactions_per_trial'] for r in runs) / len(runs):>18.1f}  "
                         f"{sum(r['beyond_process_ms'] for r in runs) / len(runs):>23.1f}")
    th, pr = sq["threads"], sq["processes"]
    lines += ["", "fault: 3 `oomtune search` processes, heartbeat_interval=1 s, grace_period=2 s; worker 0 "
              "SIGKILLed (process group) mid-trial",
              f"killed trial {f['killed_trial']}, retried as trial {f['retried_as']}; finished trials before "
              f"the kill: {f['finished_before_kill']}, lost: {f['lost']}",
              f"kill -> retry starts: {f['kill_to_retry_start_s']:.1f} s; kill -> retry finished: "
              f"{f['kill_to_retry_end_s']:.1f} s; survivors wrote the same best.yaml: {f['same_best_yaml']}",
              "", "SQLite (default storage) under several writers, same trials:",
              f"one search, search.workers={max(workers)} threads: exit {th[0]}, {th[1]} trials with results, "
              f"{th[2]} trials run twice, {th[3]} candidates launched twice",
              f"3 processes x 2 workers on one SQLite file: exits {pr[0]}, {pr[1]} trials with results, "
              f"{pr[2]} trials run by two processes, {pr[3]} candidates launched twice, "
              f"'database is locked' in {pr[4]} logs"]
    write_results(args.out, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
