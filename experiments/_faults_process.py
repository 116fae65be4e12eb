"""Process, output and snapshot faults for experiments/faults.py.

Each scenario gets an empty scratch directory and returns ``{"fault", "done", "outcome",
"trials_lost", "seconds"}``:

- kill -9 of the search while a ``target=cmd`` trial runs (its command has a grandchild that called
  ``setsid()``): no trial process may be left, and the same command must resume the study;
- kill -9 of a trial's command: what the search records for it (reported as it is: its
  classification is :mod:`oomtune.trial.oomkill`'s), and no process left;
- kill -9 of one rank of a 2-process ``target=cmd`` trial whose launcher, like a careless one, exits
  without stopping the other rank: the other rank must not outlive the trial;
- a trial writing 100 MB to stderr, three times: the run directory's size and the parent's peak RSS
  growth (the issue measured 305 MB and +180 MB per trial);
- the shared-frames snapshot (a 1.4 MB pickle whose 40,000 trace entries share one 100,000-frame list
  through the pickle memo): seconds for ``oomtune simulate``.

Processes are recognised by a token unique to the run in their command lines (``/proc``), so the
check does not depend on oomtune's own bookkeeping. Linux only (``/proc``).
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OOMTUNE_CACHE_DIR": "off"}

# A target=cmd trial: starts a grandchild that leaves the session (setsid) and sleeps; waits while the
# HOLD file exists; writes "<its pid> <grandchild pid>" to PIDS; then "trains" like
# tests/data/sleep_trial.py (OOM above batch 48, throughput = batch).
TRIAL = textwrap.dedent('''
    import os, subprocess, sys, time
    batch, token, pids, hold = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    grand = subprocess.Popen([sys.executable, "-c", "import os, time; os.setsid(); time.sleep(900)  # " + token])
    with open(pids + ".tmp", "w") as f:
        f.write(f"{os.getpid()} {grand.pid}")
    os.replace(pids + ".tmp", pids)
    while os.path.exists(hold):
        time.sleep(0.05)
    time.sleep(0.3)
    if batch > 48:
        sys.stderr.write("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 64.00 MiB. GPU 0 has a "
                         "total capacity of 15.77 GiB of which 12.00 MiB is free. Of the allocated memory 15.20 GiB "
                         "is allocated by PyTorch, and 300.00 MiB is reserved by PyTorch but unallocated.\\n")
        sys.exit(1)
    import oomtune
    oomtune.report(samples=batch, seconds=1.0)
''')


def _with_token(token: str) -> list[int]:
    """Live (not zombie) processes whose command line holds ``token``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if token.encode() in cmdline and state not in ("Z", "X"):
            found.append(int(entry))
    return found


def _cleanup(token: str) -> None:
    for pid in _with_token(token):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _search(scratch: Path, token: str, study: str) -> list[str]:
    script = scratch / "trial.py"
    script.write_text(TRIAL)
    command = f"{sys.executable} {script} {{batch_size}} {token} {scratch / 'pids'} {scratch / 'hold'}"
    return [sys.executable, "-m", "oomtune", "search", "target=cmd", f"target.command='{command}'", "device=cpu",
            "search.batch_size.low=8", "search.batch_size.high=64", "search.n_trials=3",
            "search.objective=throughput", "search.repeats=1", "search.finalists=1", "trial.timeout=300",
            f"study_name={study}", f"hydra.run.dir={scratch / 'run'}"]


def _wait_for(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _finished(run_dir: Path) -> set[int]:
    """Trials whose command finished and whose record was written (trials/trial-NNNN/result.json)."""
    return {int(p.parent.name.split("-")[1]) for p in (run_dir / "trials").glob("trial-*/result.json")}


def _study(run_dir: Path, name: str) -> list[Any]:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    return optuna.load_study(study_name=name, storage=f"sqlite:///{run_dir / 'study.db'}").get_trials(deepcopy=False)


def kill_search(scratch: Path) -> dict[str, Any]:
    token = f"oomtune-fault-{uuid.uuid4().hex}"
    args = _search(scratch, token, "killed")
    run_dir, pids, hold = scratch / "run", scratch / "pids", scratch / "hold"
    started = time.monotonic()
    try:
        with open(scratch / "search1.log", "wb") as log:
            proc = subprocess.Popen(args, cwd=scratch, env=ENV, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        _wait_for(lambda: len(_finished(run_dir)) >= 2 or proc.poll() is not None, 600, "two finished trials")
        hold.write_text("")                      # the next trial holds: the search is killed while it runs
        pids.unlink(missing_ok=True)
        _wait_for(lambda: pids.exists() or proc.poll() is not None, 300, "a running trial")
        before = _finished(run_dir)
        running = list(map(int, pids.read_text().split()))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        time.sleep(2.0)
        left = _with_token(token) + [p for p in running if Path(f"/proc/{p}").exists()]
        hold.unlink()
        with open(scratch / "search2.log", "wb") as log:
            rerun = subprocess.run(args, cwd=scratch, env=ENV, stdout=log, stderr=subprocess.STDOUT, timeout=900)
        text = (scratch / "search2.log").read_text(errors="replace")
        stored = {t.number for t in _study(run_dir, "killed") if "result" in t.user_attrs}
        lost = len(before - stored)
        resumed = next((line for line in text.splitlines() if line.startswith("resuming:")), "no resume line")
        return {"fault": "kill -9 of the search (target=cmd trial with a setsid grandchild running)",
                "done": "SIGKILL to `oomtune search` after 2 finished trials, while the 3rd ran; 2 s later "
                        "the processes carrying the run's token were counted; then the same command again",
                "outcome": f"{len(left)} trial process(es) left after 2 s; rerun exit {rerun.returncode}, {resumed}",
                "trials_lost": lost, "seconds": time.monotonic() - started}
    finally:
        _cleanup(token)


def kill_trial(scratch: Path) -> dict[str, Any]:
    token = f"oomtune-fault-{uuid.uuid4().hex}"
    args = _search(scratch, token, "trial-killed")
    run_dir, pids, hold = scratch / "run", scratch / "pids", scratch / "hold"
    started = time.monotonic()
    try:
        hold.write_text("")
        with open(scratch / "search.log", "wb") as log:
            proc = subprocess.Popen(args, cwd=scratch, env=ENV, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        _wait_for(lambda: pids.exists() or proc.poll() is not None, 600, "the first trial")
        main, grand = map(int, pids.read_text().split())
        os.kill(main, signal.SIGKILL)
        time.sleep(1.0)
        hold.unlink()
        rc = proc.wait(900)
        trials = _study(run_dir, "trial-killed")
        first = min(trials, key=lambda t: t.number)
        res = first.user_attrs.get("result") or {}
        left = _with_token(token)
        lost = len(_finished(run_dir) - {t.number for t in trials if "result" in t.user_attrs})
        # a crash is run once more before it counts (oomtune.search.driver): the first attempt is kept
        from oomtune.trial.record import TrialResult

        first_try = TrialResult.from_dict(res).retried_after if res else None
        retry = (f" after one retry (the killed attempt: {first_try.outcome.value}: {first_try.message})"
                 if first_try else f" ({res.get('message')})")
        return {"fault": "kill -9 of a trial's command (target=cmd)",
                "done": "SIGKILL to the first trial's command while it ran (no traceback written)",
                "outcome": f"trial {first.number} recorded as {res.get('outcome')}{retry}; the "
                           f"search went on, exit {rc}; {len(left)} trial process(es) left",
                "trials_lost": lost, "seconds": time.monotonic() - started}
    finally:
        _cleanup(token)


# A 2-rank launcher that, when a rank dies, reports it and exits without stopping the other rank.
RANKS = textwrap.dedent('''
    import os, subprocess, sys, time
    token, pids = sys.argv[1], sys.argv[2]
    ranks = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(900)  # rank %d %s" % (r, token)])
             for r in range(2)]
    with open(pids + ".tmp", "w") as f:
        f.write(" ".join(str(p.pid) for p in ranks))
    os.replace(pids + ".tmp", pids)
    while True:
        for r, p in enumerate(ranks):
            if p.poll() is not None:
                sys.stderr.write(f"rank {r} (pid {p.pid}) exited with {p.returncode}; stopping\\n")
                sys.exit(1)
        time.sleep(0.05)
''')


def kill_rank(scratch: Path) -> dict[str, Any]:
    sys.path.insert(0, str(REPO))
    from oomtune.targets.cmd import run_cmd_trial
    from oomtune.trial.record import TrialSpec

    token = f"oomtune-fault-{uuid.uuid4().hex}"
    script, pids = scratch / "ranks.py", scratch / "pids"
    script.write_text(RANKS)
    spec = TrialSpec(workload={"name": "mlp", "target": {"name": "cmd", "cwd": None,
                                                         "command": f"{sys.executable} {script} {token} {pids}"}},
                     batch_size=8, timeout_s=300)
    started = time.monotonic()
    results: list[Any] = []
    try:
        worker = threading.Thread(target=lambda: results.append(run_cmd_trial(spec, workdir=scratch / "trial")))
        worker.start()
        _wait_for(pids.exists, 120, "the ranks")
        rank0, rank1 = map(int, pids.read_text().split())
        os.kill(rank0, signal.SIGKILL)
        worker.join(300)
        time.sleep(1.0)
        res = results[0]
        left = _with_token(token)
        return {"fault": "kill -9 of one rank of a 2-process target=cmd trial",
                "done": "SIGKILL to rank 0; the launcher exits 1 without stopping rank 1 (a careless launcher)",
                "outcome": f"trial recorded as {res.outcome} ({res.message}); rank 1 "
                           f"{'still running' if rank1 in left else 'ended with the trial'}; "
                           f"{len(left)} process(es) left",
                "trials_lost": 0, "seconds": time.monotonic() - started}
    finally:
        _cleanup(token)


NOISY = textwrap.dedent('''
    import sys
    line = ("x" * 1023 + "\\n").encode()
    for _ in range(100 * 1024):
        sys.stderr.buffer.write(line)
    sys.stderr.flush()
    import oomtune
    oomtune.report(samples=8, seconds=1.0)
''')

# Three trials in a fresh interpreter: its peak RSS (VmHWM) before and after, in kB.
PARENT = textwrap.dedent('''
    import json, sys
    from pathlib import Path
    from oomtune.targets.cmd import run_cmd_trial
    from oomtune.trial.record import TrialSpec

    def hwm():
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])

    script, run = sys.argv[1], Path(sys.argv[2])
    before = hwm()
    outcomes = []
    for n in range(3):
        spec = TrialSpec(workload={"name": "mlp", "target": {"name": "cmd", "command": f"{sys.executable} {script}",
                                                             "cwd": None}}, batch_size=8, timeout_s=300)
        outcomes.append(run_cmd_trial(spec, workdir=run / f"trial-{n:04d}").outcome)
    print(json.dumps({"before_kb": before, "after_kb": hwm(), "outcomes": outcomes}))
''')


def stderr_100mb(scratch: Path) -> dict[str, Any]:
    import json

    script = scratch / "noisy.py"
    script.write_text(NOISY)
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-c", PARENT, str(script), str(scratch / "run")], env=ENV,
                         capture_output=True, text=True, timeout=900)
    seconds = time.monotonic() - started
    if out.returncode != 0:
        raise RuntimeError(out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}")
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    size = sum(p.stat().st_size for p in (scratch / "run").rglob("*") if p.is_file())
    growth_mb = (figures["after_kb"] - figures["before_kb"]) / 1024
    return {"fault": "a trial writing 100 MB to stderr, 3 trials (target=cmd)",
            "done": "3 trials of a command writing 100 MiB of lines to stderr, run by run_cmd_trial in a fresh "
                    "interpreter (its peak RSS, VmHWM, read before and after)",
            "outcome": f"outcomes {', '.join(figures['outcomes'])}; run directory {size / 2**20:.1f} MiB; parent "
                       f"peak RSS +{growth_mb:.1f} MiB over the 3 trials",
            "trials_lost": 0, "seconds": seconds}


def shared_frames_snapshot(scratch: Path) -> dict[str, Any]:
    frame = {"name": "f", "filename": "x.py", "line": 1}
    frames = [frame] * 100_000
    trace = []
    for k in range(20_000):
        addr = (1 << 30) + k * (2 << 20)
        trace.append({"action": "segment_alloc", "addr": addr, "size": 2 << 20, "stream": 0, "frames": frames})
        trace.append({"action": "segment_free", "addr": addr, "size": 2 << 20, "stream": 0, "frames": frames})
    path = scratch / "shared-frames.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [trace]}, protocol=4))
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "oomtune", "simulate", str(path), "--json"], env=ENV,
                         capture_output=True, text=True, timeout=900)
    seconds = time.monotonic() - started
    return {"fault": "snapshot whose 40,000 trace entries share one 100,000-frame list (pickle memo)",
            "done": f"`oomtune simulate` of the {path.stat().st_size / 1e6:.1f} MB pickle",
            "outcome": f"exit {out.returncode} in {seconds:.2f} s" + (
                f": {out.stderr.strip().splitlines()[-1]}" if out.returncode and out.stderr.strip() else ""),
            "trials_lost": "-", "seconds": seconds}


SCENARIOS = [
    ("kill -9 of the search", kill_search),
    ("kill -9 of a trial", kill_trial),
    ("kill -9 of a rank", kill_rank),
    ("100 MB stderr", stderr_100mb),
    ("shared-frames snapshot", shared_frames_snapshot),
]
