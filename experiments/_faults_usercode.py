"""User-code and user-file faults for experiments/faults.py.

Each scenario gets an empty scratch directory, runs the real command line in a subprocess and
returns ``{"fault", "done", "outcome", "trials_lost", "seconds"}`` from what it observed (exit
status, stdout/stderr, the run directory, the study):

- a ``target=python`` entry whose ``make_workload`` raises, one that hangs (``trial.timeout=10``)
  and one that calls ``os._exit(3)`` (the fixtures of tests/data/isolation/): the prediction's
  capture runs in a forked process (oomtune/plan/isolation.py), so each must be one error line,
  exit 2, before any trial (no ``trials/`` directory), and the hanging one must leave no process;
- a ``target=cmd`` script writing a malformed result record (``"samples": "lots"`` from batch 16
  up, the line format of oomtune/script_api.py's ``report`` written by hand): those trials are
  ``bad_record`` and the search completes (oomtune/targets/cmd.py);
- a ``target=cmd`` command that hangs at every batch under ``trial.timeout=5`` and the default
  allocator search space: waited for once, not once per configuration (the field report: 24 trials,
  131 s);
- a best.yaml nested 100,000 levels deep through ``oomtune env`` and ``oomtune check``: one line,
  exit 2 (the depth limit of oomtune/safeload.py).

Linux only (``/proc``, to count the processes left).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
ISOLATION = REPO / "tests" / "data" / "isolation"
PY = shlex.quote(sys.executable)


def _env(scratch: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OOMTUNE_CACHE_DIR": str(scratch / "cache"), **extra}


def _oomtune(args: list[str], scratch: Path, timeout: float = 900, **env: str) -> tuple[subprocess.CompletedProcess,
                                                                                       float]:
    """``python -m oomtune ARGS`` in ``scratch``: (the finished process, its wall time in s)."""
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "oomtune", *args], cwd=scratch, env=_env(scratch, **env),
                          capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - started


def _lines(proc: subprocess.CompletedProcess) -> str:
    """How the process ended on stderr: its ``oomtune: error:`` lines (how many, and the first), or
    its last line; and the number of tracebacks."""
    errors = [line for line in proc.stderr.splitlines() if line.startswith("oomtune:")]
    text = (f"{len(errors)} error line(s): {errors[0]}" if errors
            else f"last line: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else '(none)'}")
    return f"{text}; {(proc.stdout + proc.stderr).count('Traceback')} tracebacks"


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _study(run: Path) -> list[Any]:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    name = json.loads((run / "run.json").read_text())["study_name"]
    return optuna.load_study(study_name=name, storage=f"sqlite:///{run / 'study.db'}").get_trials(deepcopy=False)


# ------------------------------------------------------------------ target=python entries
SEARCH_PY = ["search", "target=python", "budget=256MiB", "search.batch_size.low=2", "search.batch_size.high=8"]


def python_entry(fixture: str, fault: str, extra: list[str] | None = None):
    def scenario(scratch: Path) -> dict[str, Any]:
        run, pidfile = scratch / "run", scratch / "pids"
        args = [*SEARCH_PY, f"target.entry={ISOLATION / fixture}:make_workload", *(extra or []),
                f"hydra.run.dir={run}"]
        proc, seconds = _oomtune(args, scratch, OOMTUNE_TEST_PIDFILE=str(pidfile))
        left = ""
        if pidfile.exists():   # entry_hangs.py writes its pid and its child's
            pids = [int(p) for p in pidfile.read_text().split()]
            time.sleep(2.0)
            alive = [p for p in pids if _alive(p)]
            for pid in alive:
                os.kill(pid, signal.SIGKILL)
            left = f"; {len(alive)} of its {len(pids)} processes left 2 s after exit"
        trials = sorted(p.name for p in (run / "trials").glob("trial-*")) if (run / "trials").exists() else []
        return {"fault": fault,
                "done": f"`oomtune search target=python target.entry=tests/data/isolation/{fixture}:make_workload` "
                        + " ".join(extra or []),
                "outcome": f"exit {proc.returncode}; {_lines(proc).replace(str(ISOLATION), 'tests/data/isolation')}; "
                           f"{len(trials)} trial directories{left}",
                "trials_lost": "-", "seconds": seconds}

    return scenario


# ------------------------------------------------------------------ target=cmd scripts
# two allocator configurations (the default and max_split_size_mb:64), as tests/test_search_faults_e2e.py
TWO_CONFIGS = ["search.space.expandable_segments=[false]", "search.space.max_split_size_mb=[null,64]",
               "search.space.roundup_power2_divisions=[null]", "search.space.garbage_collection_threshold=[null]"]
CMD = ["search", "target=cmd", "device=cpu", "budget=64MiB", "search.batch_size.low=4", "search.batch_size.high=32",
       "trial.measure_steps=1"]

# Writes the results channel by hand (the line format of oomtune/script_api.py's report), with
# "samples": "lots" from batch 16 up: a user's script that bypasses oomtune.report.
MALFORMED = textwrap.dedent('''
    import json, os, sys, time
    b = int(sys.argv[1])
    mib = 1 << 20
    line = {"event": "report", "time": time.time(), "samples": "lots" if b >= 16 else b * 4, "seconds": 0.5,
            "memory": {"source": "simulated", "stats": {"reserved_bytes.all.peak": b * mib,
                       "allocated_bytes.all.peak": b * mib, "active_bytes.all.peak": b * mib}}}
    with open(os.environ["OOMTUNE_RESULT_FILE"], "a") as f:
        f.write(json.dumps(line) + "\\n")
''')


def malformed_record(scratch: Path) -> dict[str, Any]:
    script, run = scratch / "train.py", scratch / "run"
    script.write_text(MALFORMED)
    args = [*CMD, *TWO_CONFIGS, f"target.command='{PY} {shlex.quote(str(script))} {{batch_size}}'",
            "trial.timeout=30", f"hydra.run.dir={run}"]
    proc, seconds = _oomtune(args, scratch)
    trials = _study(run)
    bad = [t for t in trials if t.user_attrs.get("outcome") == "bad_record"]
    unfinished = [t for t in trials if not t.user_attrs.get("outcome")]
    stored = {t.number: t.user_attrs.get("result") for t in trials}
    records = [json.loads(p.read_text()) for p in (run / "trials").glob("trial-*/tell.json")]
    lost = sum(1 for r in records if stored.get(int(r["number"])) != r["user_attrs"].get("result"))
    message = bad[0].user_attrs["result"]["message"].split("\n")[0].split(': {"event"')[0] if bad else ""
    best = "best.yaml written" if (run / "best.yaml").is_file() else "no best.yaml"
    return {"fault": "target=cmd script writing a malformed result record",
            "done": 'a script writing its report line by hand with `"samples": "lots"` from batch 16 up; 2 allocator '
                    "configurations, batch 4-32",
            "outcome": f"exit {proc.returncode}, {(proc.stdout + proc.stderr).count('Traceback')} tracebacks; "
                       f"{len(trials)} trials, {len(bad)} bad_record (batches "
                       f"{', '.join(str(t.params['batch_size']) for t in bad)}: {message}), {len(unfinished)} without "
                       f"an outcome; {best}",
            "trials_lost": lost, "seconds": seconds}


def command_hangs(scratch: Path) -> dict[str, Any]:
    script, run = scratch / "hang.py", scratch / "run"
    script.write_text("import time\ntime.sleep(600)\n")
    args = [*CMD, f"target.command='{PY} {shlex.quote(str(script))} {{batch_size}}'", "trial.timeout=5",
            f"hydra.run.dir={run}"]
    proc, seconds = _oomtune(args, scratch)
    trials = _study(run)
    outcomes: dict[str, int] = {}
    for t in trials:
        key = t.user_attrs.get("outcome") or "none"
        outcomes[key] = outcomes.get(key, 0) + 1
    said = " ".join((proc.stdout + proc.stderr).split())
    at = said.find("the command hung")
    hung = said[at:said.find("above", at) + len("above")] if at >= 0 else "no 'the command hung' line"
    return {"fault": "target=cmd command that hangs at every batch",
            "done": "a command sleeping 600 s, `trial.timeout=5`, the default allocator search space, batch 4-32 "
                    "(the field report: 24 trials, 131 s)",
            "outcome": f"exit {proc.returncode} after {seconds:.1f} s; {len(trials)} trial(s) "
                       f"({', '.join(f'{n} {k}' for k, n in sorted(outcomes.items()))}); {hung}",
            "trials_lost": "-", "seconds": seconds}


# ------------------------------------------------------------------ best.yaml nested 100,000 levels
def deep_best_yaml(scratch: Path) -> dict[str, Any]:
    path = scratch / "best.yaml"
    levels = 100_000
    path.write_text("[" * levels + "]" * levels + "\n")
    started = time.monotonic()
    parts = []
    for command in ("env", "check"):
        proc, took = _oomtune([command, str(path)], scratch, timeout=300)
        parts.append(f"`{command}` exit {proc.returncode} in {took:.1f} s, "
                     f"{len(proc.stderr.strip().splitlines())} stderr line(s): "
                     f"{_lines(proc).replace(str(scratch), 'SCRATCH')}")
    return {"fault": "best.yaml nested 100,000 levels deep",
            "done": f"`oomtune env` and `oomtune check` of a {path.stat().st_size / 1e3:.0f} kB best.yaml of "
                    f"{levels:,} nested lists",
            "outcome": "; ".join(parts), "trials_lost": "-", "seconds": time.monotonic() - started}


SCENARIOS = [
    ("target=python entry that raises", python_entry("entry_raises.py", "target=python entry that raises")),
    ("target=python entry that hangs", python_entry("entry_hangs.py", "target=python entry that hangs",
                                                    ["trial.timeout=10"])),
    ("target=python entry that calls os._exit(3)", python_entry("entry_exits.py",
                                                                "target=python entry that calls os._exit(3)")),
    ("target=cmd malformed record", malformed_record),
    ("target=cmd command that hangs", command_hangs),
    ("best.yaml nested 100,000 levels", deep_best_yaml),
]
