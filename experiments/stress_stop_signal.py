"""Stop signals at random moments of a search's worker loop: does the run stop, and what is left behind?

A search stopped by SIGTERM or Ctrl-C must end promptly and leave nothing that keeps the process
alive or the study locked. This drives the worker loop a search runs its trials in
(:class:`oomtune.search.workers.Executor` on an SQLite study with Optuna's heartbeat, as
``oomtune search`` makes it) with a trial body of a few milliseconds, so most of the time goes into
storage calls and heartbeat threads, and sends the process SIGTERM after a random delay (uniform,
0 to 0.4 s) under :func:`oomtune.interrupts.stopping_on`, as the search does. Per round it records:

* stopped: the loop raised ``Interrupted`` (else it ran on: the signal was lost);
* latency: seconds from the signal to the raise;
* heartbeat threads of Optuna still alive 1 s after the raise (not daemons: the interpreter would
  wait for them at exit for ever);
* locked: another connection cannot take SQLite's write lock at once (``BEGIN IMMEDIATE`` with no
  busy timeout) after the raise.

Usage: ``python experiments/stress_stop_signal.py [--rounds N] [--seed S] [--against REV]``; writes
experiments/results/stress_stop_signal.txt. ``--against REV`` runs the same rounds (same seed) with
the oomtune of git revision REV too (a temporary worktree put first on ``PYTHONPATH``) and reports it
beside this commit's.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # experiments/_provenance.py
from _provenance import header, write_results  # noqa: E402  (command + commit lines of every results file)

import optuna  # noqa: E402

from oomtune import interrupts  # noqa: E402
from oomtune.exceptions import Interrupted  # noqa: E402
from oomtune.search.workers import Executor  # noqa: E402
from oomtune.study import records as R  # noqa: E402
from oomtune.study.storage import make_storage  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "stress_stop_signal.txt"


def _heartbeats() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.endswith("(_record_heartbeat)") and t.is_alive()]


def one_round(path: Path, rng: random.Random) -> dict:
    """One study, one signal; the round's record (see the module docstring)."""
    storage = make_storage(f"sqlite:///{path}", heartbeat_interval_s=1, grace_period_s=2)
    study = optuna.create_study(storage=storage, direction="maximize")
    pause = rng.random() * 0.005

    def evaluate(trial, slot):
        trial.suggest_int("x", 0, 10**9)
        trial.set_user_attr(R.ATTR_RESULT, {"x": 1})
        time.sleep(pause)
        return 1.0

    before = set(_heartbeats())
    sent: list[float] = []
    delay = rng.uniform(0.0, 0.4)

    def send() -> None:
        sent.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGTERM)

    timer = threading.Timer(delay, send)
    stopped, latency = False, None
    with interrupts.stopping_on((signal.SIGTERM,)):
        try:
            timer.start()   # inside: a delay near 0 sends the signal before start() returns
            Executor(study, ["cpu"], evaluate, poll_s=0.01).run_sampler(200, "search")
        except Interrupted:
            stopped, latency = True, time.monotonic() - sent[0]
        timer.join()
        try:
            interrupts.raise_if_pending()   # a signal that came after the last trial: not this round's
        except Interrupted:
            pass
    time.sleep(1.0)
    left = [t for t in _heartbeats() if t not in before]
    conn = sqlite3.connect(path, timeout=0, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("ROLLBACK")
        locked = False
    except sqlite3.OperationalError:
        locked = True
    finally:
        conn.close()
    trials = len(study.get_trials(deepcopy=False)) if not locked else None
    return {"stopped": stopped, "latency": latency, "threads_left": len(left), "locked": locked,
            "delay": delay, "trials": trials}


def _against(args: argparse.Namespace) -> str:
    """This script's summary lines, run with the oomtune of ``args.against`` (a temporary worktree)."""
    repo = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", str(tree), args.against],
                       check=True, capture_output=True)
        try:
            env = {**os.environ, "PYTHONPATH": str(tree), "OOMTUNE_ALLOW_DIRTY": "1"}
            subprocess.run([sys.executable, __file__, "--rounds", str(args.rounds), "--seed", str(args.seed),
                            "--out", str(Path(tmp) / "out.txt")], env=env, check=True, stdout=subprocess.DEVNULL)
            return (Path(tmp) / "out.txt").read_text()
        finally:
            subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(tree)], capture_output=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--against", help="a git revision whose oomtune runs the same rounds (reported beside)")
    args = ap.parse_args()
    head = header()
    before = _against(args) if args.against else None
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    rng = random.Random(args.seed)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            rows.append(one_round(Path(tmp) / f"s{i}.db", rng))
            print(i, rows[-1], flush=True)
    stopped = [r for r in rows if r["stopped"]]
    latencies = sorted(r["latency"] for r in stopped)
    lines = [head.rstrip("\n"),
             f"# oomtune from: {Path(interrupts.__file__).resolve().parents[1]}",
             f"rounds: {len(rows)} (seed {args.seed}; signal after 0-0.4 s, trial body 0-5 ms, SQLite storage "
             "with Optuna's heartbeat every 1 s)",
             f"stopped by the signal: {len(stopped)} of {len(rows)}",
             f"ran on (signal lost): {len(rows) - len(stopped)}",
             f"rounds leaving a heartbeat thread alive: {sum(1 for r in rows if r['threads_left'])}",
             f"rounds leaving the study write-locked: {sum(1 for r in rows if r['locked'])}"]
    if latencies:
        lines.append(f"signal -> raise: median {statistics.median(latencies) * 1000:.1f} ms, "
                     f"max {latencies[-1] * 1000:.1f} ms")
    if before is not None:
        lines += ["", f"the same rounds with oomtune at {args.against}:",
                  *before.split("# oomtune from:", 1)[1].split("\n")[1:]]
    text = "\n".join(lines)
    write_results(args.out, text)
    print(text)
    sys.stdout.flush()
    os._exit(0)   # threads a lost signal left behind (the measured defect) must not keep this process


if __name__ == "__main__":
    raise SystemExit(main())
