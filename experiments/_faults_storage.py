"""Storage and disk faults for experiments/faults.py.

- PostgreSQL outage of 7 s and of 15 s mid-search: a throwaway server (tests/pg_server.py), reached
  with the README's URL form ``postgresql://oomtune@127.0.0.1:PORT/DB``, is stopped with ``pg_ctl
  stop -m fast`` while a trial runs and started again on the same port and data directory. The
  search must go on (exit 0) with every trial COMPLETE and its result in the study.
- An outage longer than the retries: the retry schedule is shortened to 1 + 1 s
  (``OOMTUNE_STORAGE_RETRY_S``; the default, about 2 minutes, would make the row take minutes) so
  that the storage is still down when the trial ends; the search must stop in one line, and the same
  command, once the server is back, must tell the study the result recorded in the run directory.
- Disk full: ``oomtune search`` of the MLP on a 1 MiB tmpfs (room for the study and best.yaml, not
  the ~5 MB report); it must stop in one line leaving no temporary file; after the file system is
  made larger (``mount -o remount,size=64m``) the same command must finish without re-running a
  trial. Needs permission to mount (root); otherwise the row says so.
- Disk full while telling the storage: the study (``storage=sqlite:///...``) on a 4 MiB tmpfs, the
  run directory elsewhere; the trial's command fills the tmpfs before it reports, so the trial's
  record (``trials/trial-0000/tell.json``) is written and the storage's write of the result is not.
  The search must stop in one line; once the space is freed the same command must restore the
  result from tell.json without running the trial again (the command counts its launches).
- A zero-byte study.db through ``oomtune show`` (by run directory and by ``--storage``): refused
  in one line, exit 2, the file left at 0 bytes and no journal created.

The trials of the PostgreSQL rows are tests/data/sleep_trial.py (``target=cmd``: sleeps, "runs out
of memory" above batch 48, throughput = batch), so the answer is known: batch 48, default allocator.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "data" / "sleep_trial.py"
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def _pg():
    sys.path.insert(0, str(REPO / "tests"))
    from pg_server import PgServer

    return PgServer().start()


def _search_args(url: str, run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "oomtune", "search", "target=cmd",
            f"target.command='{sys.executable} {SCRIPT} {{batch_size}}'", "device=cpu",
            "search.batch_size.low=8", "search.batch_size.high=64", "search.n_trials=3",
            "search.objective=throughput", "search.repeats=1", "search.finalists=1", "trial.timeout=120",
            f"storage={url}", "study_name=faults", f"hydra.run.dir={run_dir}"]


def _wait_mid_trial(run_dir: Path, finished: int, timeout_s: float = 300) -> int:
    """The number of a trial whose process started less than 1 s ago, once ``finished`` trials
    have recorded their outcome (trials/trial-NNNN/tell.json)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        dirs = sorted((run_dir / "trials").glob("trial-*"))
        done = sum(1 for d in dirs if (d / "tell.json").exists())
        for d in dirs:
            out = d / "stdout.txt"
            if done >= finished and out.exists() and not (d / "tell.json").exists() \
                    and time.time() - out.stat().st_mtime < 1.0:
                return int(d.name.split("-")[1])
        time.sleep(0.05)
    raise RuntimeError(f"no trial started after {finished} had finished")


def _lost(url: str, run_dir: Path) -> tuple[int, list[Any]]:
    """(trials that recorded an outcome in ``run_dir`` but whose result is not the study's, the
    study's trials)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    trials = {t.number: t for t in optuna.load_study(study_name="faults", storage=url).get_trials(deepcopy=False)}
    lost = 0
    for path in (run_dir / "trials").glob("trial-*/tell.json"):
        record = json.loads(path.read_text())
        stored = trials.get(int(record["number"]))
        if stored is None or stored.user_attrs.get("result") != record["user_attrs"].get("result"):
            lost += 1
    return lost, list(trials.values())


def _states(trials: list[Any]) -> str:
    counts: dict[str, int] = {}
    for t in trials:
        key = t.state.name + ("" if "result" in t.user_attrs else " without result")
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))


def _best(run_dir: Path) -> str:
    sys.path.insert(0, str(REPO))
    from oomtune.best import load_best

    best = load_best(run_dir / "best.yaml").best
    return f"batch {best.batch_size}, {best.alloc_conf or 'default allocator'}"


def pg_outage(outage_s: float):
    def scenario(scratch: Path) -> dict[str, Any]:
        pg = _pg()
        try:
            url = pg.create_database()
            run_dir = scratch / "run"
            log = scratch / "search.log"
            started = time.monotonic()
            proc = subprocess.Popen(_search_args(url, run_dir), cwd=scratch, stdout=open(log, "wb"),
                                    stderr=subprocess.STDOUT, env={**ENV, "OOMTUNE_TEST_SLEEP_S": "1.5"})
            mid = _wait_mid_trial(run_dir, finished=3)
            pg.stop_server()
            time.sleep(outage_s)
            pg.start_server()
            back = time.time()
            rc = proc.wait(timeout=900)
            seconds = time.monotonic() - started
            text = log.read_text(errors="replace")
            lost, trials = _lost(url, run_dir)
            retries = sum(1 for line in text.splitlines()
                          if line.startswith("storage connection lost while trying to"))
            beats = sum(1 for line in text.splitlines() if line.startswith("storage connection lost while recording"))
            after = [t.datetime_complete.timestamp() - back for t in trials
                     if t.datetime_complete is not None and t.datetime_complete.timestamp() >= back]
            text = text.replace(str(run_dir), "RUN_DIR")
            outcome = (f"exit {rc}; {retries} retry lines and {beats} heartbeat lines, "
                       f"{text.count('Traceback')} tracebacks; study: {_states(trials)}; "
                       + (f"first trial told {min(after):.1f} s after the server was back; " if after else "")
                       + (f"best.yaml: {_best(run_dir)}" if rc == 0 else f"last line: {text.strip().splitlines()[-1]}"))
            return {"fault": f"PostgreSQL outage {outage_s:g} s mid-search",
                    "done": f"`pg_ctl stop -m fast` while trial {mid} ran (3 finished), `pg_ctl start` on the same "
                            f"port {outage_s:g} s later; storage=postgresql://oomtune@127.0.0.1:PORT/DB",
                    "outcome": outcome, "trials_lost": lost, "seconds": seconds}
        finally:
            pg.stop()

    return scenario


def pg_outage_past_retries(scratch: Path) -> dict[str, Any]:
    pg = _pg()
    try:
        url = pg.create_database()
        run_dir = scratch / "run"
        log = scratch / "search.log"
        started = time.monotonic()
        proc = subprocess.Popen(_search_args(url, run_dir), cwd=scratch, stdout=open(log, "wb"),
                                stderr=subprocess.STDOUT,
                                env={**ENV, "OOMTUNE_TEST_SLEEP_S": "3", "OOMTUNE_STORAGE_RETRY_S": "1,1"})
        mid = _wait_mid_trial(run_dir, finished=2)
        pg.stop_server()
        try:
            rc = proc.wait(timeout=300)
        finally:
            pg.start_server()
        last = log.read_text(errors="replace").strip().splitlines()[-1].replace(str(run_dir), "RUN_DIR")
        _, trials = _lost(url, run_dir)
        stranded = next(t for t in trials if t.number == mid)
        before = f"{stranded.state.name}{'' if 'result' in stranded.user_attrs else ' without result'}"
        again = subprocess.run(_search_args(url, run_dir), cwd=scratch, capture_output=True, text=True, timeout=900,
                               env={**ENV, "OOMTUNE_TEST_SLEEP_S": "0.2"})
        told = next((line for line in (again.stdout + again.stderr).splitlines() if line.startswith("told the storage")),
                    "no 'told' line")
        seconds = time.monotonic() - started
        lost, trials = _lost(url, run_dir)
        return {"fault": "PostgreSQL outage longer than the retries",
                "done": f"retries shortened to 1 + 1 s (OOMTUNE_STORAGE_RETRY_S=1,1); `pg_ctl stop -m fast` while "
                        f"trial {mid} ran, started again once the search had stopped; then the same command",
                "outcome": f"exit {rc}, last line: {last}; trial {mid} left {before} (its record in trials/); "
                           f"rerun exit {again.returncode}: {told.replace(str(run_dir), 'RUN_DIR')}; "
                           f"study: {_states(trials)}",
                "trials_lost": lost, "seconds": seconds}
    finally:
        pg.stop()


def disk_full(scratch: Path) -> dict[str, Any]:
    import optuna

    disk = scratch / "disk"
    disk.mkdir()
    args = [sys.executable, "-m", "oomtune", "search", "model=mlp", "device=cpu", "budget=256MiB",
            "search.objective=throughput", "search.n_trials=2", "search.baseline=false", "search.confirm=false",
            "search.prune=off", "trial.soak_steps=0", f"hydra.run.dir={disk / 'run'}"]
    fault = "disk full in the run directory"
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        return {"fault": fault, "done": "a 1 MiB tmpfs as the run directory's file system",
                "outcome": f"not run: mount is not permitted here ({mounted.stderr.strip()[:120]})",
                "trials_lost": "-", "seconds": 0.0}
    try:
        started = time.monotonic()
        first = subprocess.run(args, cwd=scratch, capture_output=True, text=True, timeout=900, env=ENV)
        last = first.stderr.strip().splitlines()[-1] if first.stderr.strip() else ""
        tmp = [p.name for p in disk.rglob("*.tmp")]
        ran = sorted(int(p.parent.name.split("-")[1]) for p in (disk / "run" / "trials").glob("trial-*/result.json"))
        subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
        second = subprocess.run(args, cwd=scratch, capture_output=True, text=True, timeout=900, env=ENV)
        seconds = time.monotonic() - started
        run_json = json.loads((disk / "run" / "run.json").read_text())
        optuna.logging.set_verbosity(optuna.logging.ERROR)
        storage = optuna.storages.RDBStorage(f"sqlite:///{disk / 'run' / 'study.db'}")
        trials = optuna.load_study(study_name=run_json["study_name"], storage=storage).get_trials(deepcopy=False)
        storage.engine.dispose()   # the file system is unmounted below
        with_result = {t.number for t in trials if "result" in t.user_attrs}
        lost = len([n for n in ran if n not in with_result])
        resumed = next((line for line in second.stderr.splitlines() if line.startswith("resuming")), "no resume line")
        last = last.replace(str(disk / "run"), "RUN_DIR")
        return {"fault": fault,
                "done": "`oomtune search model=mlp` (2 trials) with the run directory on a 1 MiB tmpfs (room for "
                        "the study and best.yaml, not the ~5 MB report.html); then the file system enlarged to 64 "
                        "MiB and the same command",
                "outcome": f"exit {first.returncode}, {first.stderr.count('Traceback')} tracebacks, last line: {last}; "
                           f"temporary files left: {len(tmp)}; rerun exit {second.returncode} ({resumed}; "
                           f"{len(trials)} trials in the study, {len(ran)} had run before)",
                "trials_lost": lost, "seconds": seconds}
    finally:
        subprocess.run(["umount", str(disk)], check=False)


# A target=cmd trial that, on its first launch only, fills the file system of DISK (writes FILLER
# until ENOSPC) and then reports like tests/data/sleep_trial.py (throughput = batch). Every launch
# appends a line to LAUNCHES.
FILLING = """
import os, sys
batch, filler, marker, launches = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
with open(launches, "a") as f:
    f.write(f"{batch}\\n")
if not os.path.exists(marker):
    open(marker, "w").close()
    with open(filler, "wb", buffering=0) as f:
        for chunk in (1 << 16, 1 << 12, 1):
            try:
                while True:
                    f.write(b"x" * chunk)
            except OSError:
                pass
import oomtune
oomtune.report(samples=batch, seconds=1.0)
"""


def disk_full_telling(scratch: Path) -> dict[str, Any]:
    import optuna

    disk, run = scratch / "disk", scratch / "run"
    disk.mkdir()
    script = scratch / "fill.py"
    script.write_text(FILLING)
    filler, launches = disk / "filler", scratch / "launches"
    command = f"{sys.executable} {script} {{batch_size}} {filler} {scratch / 'filled'} {launches}"
    args = [sys.executable, "-m", "oomtune", "search", "target=cmd", f"target.command='{command}'", "device=cpu",
            "search.batch_size.low=8", "search.batch_size.high=64", "search.n_trials=1", "search.baseline=false",
            "search.confirm=false", "search.objective=throughput", "search.repeats=1", "search.finalists=1",
            "trial.timeout=120", f"storage=sqlite:///{disk / 'study.db'}", "study_name=full",
            f"hydra.run.dir={run}"]
    fault = "disk full while telling the storage"
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        return {"fault": fault, "done": "a 4 MiB tmpfs holding the study",
                "outcome": f"not run: mount is not permitted here ({mounted.stderr.strip()[:120]})",
                "trials_lost": "-", "seconds": 0.0}
    try:
        started = time.monotonic()
        first = subprocess.run(args, cwd=scratch, capture_output=True, text=True, timeout=900, env=ENV)
        err = first.stderr.strip().splitlines()
        last = (err[-1] if err else "").replace(str(disk), "DISK").replace(str(run), "RUN_DIR")
        records = {int(json.loads(p.read_text())["number"]): json.loads(p.read_text())
                   for p in (run / "trials").glob("trial-*/tell.json")}
        ran = len(launches.read_text().split()) if launches.exists() else 0
        optuna.logging.set_verbosity(optuna.logging.ERROR)
        url = f"sqlite:///{disk / 'study.db'}"
        storage = optuna.storages.RDBStorage(url)
        before = _states(optuna.load_study(study_name="full", storage=storage).get_trials(deepcopy=False))
        storage.engine.dispose()
        filler.unlink()                                   # the space is freed
        second = subprocess.run(args, cwd=scratch, capture_output=True, text=True, timeout=900, env=ENV)
        seconds = time.monotonic() - started
        (scratch / "search1.log").write_text(first.stdout + first.stderr)
        (scratch / "search2.log").write_text(second.stdout + second.stderr)
        batches = launches.read_text().split()
        again = ", ".join(batches[ran:]) or "none"
        restored = next((line for line in second.stderr.splitlines() if "restored the result" in line
                         or line.startswith("told the storage")), "no 'restored' line")
        storage = optuna.storages.RDBStorage(url)
        trials = optuna.load_study(study_name="full", storage=storage).get_trials(deepcopy=False)
        storage.engine.dispose()   # the file system is unmounted below
        results = [t.user_attrs.get("result") for t in trials]
        lost = sum(1 for r in records.values() if r["state"] == "COMPLETE" and r["user_attrs"].get("result")
                   not in results)
        told = ", ".join(f"trial {n} {r['state']} at batch {r['user_attrs']['result'].get('batch_size', '?')}"
                         for n, r in sorted(records.items())) or "none"
        shown = "; ".join(f"trial {t.number} {t.state.name} batch {t.params.get('batch_size')}"
                          + (f" {t.user_attrs.get('role')}" if t.user_attrs.get('role') else "")
                          + (f" (from trial {t.user_attrs['told_from_record']}'s record)"
                             if "told_from_record" in t.user_attrs else "") for t in trials)
        return {"fault": fault,
                "done": "`oomtune search target=cmd` (1 trial) with storage=sqlite:/// on a 4 MiB tmpfs and the run "
                        "directory elsewhere; the trial's command fills the tmpfs before it reports; then the filler "
                        "deleted and the same command",
                "outcome": f"exit {first.returncode}, {first.stderr.count('Traceback')} tracebacks, last line: {last}; "
                           f"records in trials/: {told}; storage: {before}; rerun exit {second.returncode} "
                           f"({restored.replace(str(run), 'RUN_DIR')}); batches the command ran in the rerun: {again}; "
                           f"study: {shown}",
                "trials_lost": lost, "seconds": seconds}
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def zero_byte_study_db(scratch: Path) -> dict[str, Any]:
    db = scratch / "study.db"
    db.write_bytes(b"")
    (scratch / "run.json").write_text(json.dumps({"storage": "sqlite:///study.db", "study_name": "s",
                                                  "storage_file": "study.db"}))
    started = time.monotonic()
    parts = []
    for args in (["show", str(scratch)], ["show", "--storage", f"sqlite:///{db}", "--study", "s"]):
        out = subprocess.run([sys.executable, "-m", "oomtune", *args], cwd=scratch, capture_output=True, text=True,
                             timeout=300, env=ENV)
        lines = out.stderr.strip().splitlines()
        shown = " ".join(a if a != str(scratch) else "RUN_DIR" for a in args).replace(str(db), "RUN_DIR/study.db")
        parts.append(f"`oomtune {shown}`: exit {out.returncode}, {len(lines)} stderr line(s)"
                     + (f" ({lines[0].replace(str(db), 'RUN_DIR/study.db')})" if lines else "")
                     + f", study.db {db.stat().st_size} bytes after")
    files = sorted(p.name for p in scratch.iterdir())
    return {"fault": "zero-byte study.db",
            "done": "`oomtune show` of a run directory whose study.db is empty, by the directory and by "
                    "`--storage sqlite:///`",
            "outcome": "; ".join(parts) + f"; files in the directory: {', '.join(files)}",
            "trials_lost": "-", "seconds": time.monotonic() - started}


SCENARIOS = [
    ("PostgreSQL outage 7 s mid-search", pg_outage(7)),
    ("PostgreSQL outage 15 s mid-search", pg_outage(15)),
    ("PostgreSQL outage longer than the retries", pg_outage_past_retries),
    ("disk full in the run directory", disk_full),
    ("disk full while telling the storage", disk_full_telling),
    ("zero-byte study.db", zero_byte_study_db),
]
