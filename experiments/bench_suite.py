"""Benchmark: how long the README's test command takes on this machine, and where the time goes.

Runs ``python -m pytest -q -n WORKERS --dist worksteal`` (the README's test command; ``auto`` is
tests/conftest.py's worker count) from the repository root, once per ``--workers`` value, with the
environment ``.ci/run`` gives it (``OOMTUNE_REQUIRE_COMPILED=1``). For each run it records the wall
time, how busy the machine's CPUs were (``/proc/stat``: every process on the machine, the tests' own
children included, so run it on an otherwise idle machine), the CPU seconds spent, pytest's summary
line, and the slowest test files and tests (pytest's JUnit XML durations: call time on one worker).

The target: the test command within 12 minutes on the 2-core development machine. That machine's
speed moves from day to day (a VM on shared hosts: the same code took 1293 CPU-s one evening and 1795
CPU-s another), so each run is also measured against the machine itself: ``import torch`` in a fresh
interpreter (the README's yardstick, :data:`YARDSTICK`), three times before the run and three after;
the run's wall time is given in those units too. The goal was set on days when ``import torch`` took
2.27 and 2.77 s there (experiments/results/readme_main_command.log at e83cac0 and 3d9ffa4, in git's
history): 12 minutes is about :data:`GOAL_IMPORTS` of them.

``--durations PATH`` also writes the seconds of each test file (summed over its tests, from the first
run) as JSON: tests/data/suite_durations.json is such a file, which tests/conftest.py reads to start the
longest files first.

Run: python experiments/bench_suite.py [--workers auto [2 ...]] [--slowest 15]
     [--out experiments/results/bench_suite.txt] [--durations tests/data/suite_durations.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _provenance import REPO, header, write_results  # noqa: E402


#: The yardstick: one fresh interpreter importing torch (wall seconds; what the suite's processes do most).
YARDSTICK = "import torch"
#: 12 minutes in yardsticks on the days the goal was set: 720 s / 2.5 s (import torch took 2.27 and 2.77 s).
GOAL_IMPORTS = 288


def import_torch_s() -> float:
    """Wall seconds of ``python -c "import torch"`` in a fresh process."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", YARDSTICK], check=True)
    return time.perf_counter() - t0


def cpu_ticks() -> tuple[int, int]:
    """(busy, idle) jiffies of all CPUs since boot (``/proc/stat``'s first line)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return user + nice + system + irq + softirq + steal, idle + iowait


def run_suite(workers: str, slowest: int, durations: Path | None = None) -> str:
    """Run the test command with ``-n workers``; the lines describing the run. ``durations``: write
    the seconds of each test file there (JSON, ``{"tests/test_x.py": seconds}``, longest first)."""
    with tempfile.TemporaryDirectory(prefix="oomtune-bench-suite-") as tmp:
        junit = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-n", workers, "--dist", "worksteal",
               "-p", "no:cacheprovider", f"--junitxml={junit}", f"--basetemp={Path(tmp) / 'base'}"]
        env = {**os.environ, "OOMTUNE_REQUIRE_COMPILED": "1"}
        before = [import_torch_s() for _ in range(3)]
        busy0, idle0 = cpu_ticks()
        t0 = time.monotonic()
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        wall = time.monotonic() - t0
        busy1, idle1 = cpu_ticks()
        after = [import_torch_s() for _ in range(3)]
        yard = statistics.median(before + after)
        hz = os.sysconf("SC_CLK_TCK")
        busy, idle = busy1 - busy0, idle1 - idle0
        summary = next((line.strip("= ") for line in reversed(done.stdout.splitlines())
                        if re.search(r"\b(passed|failed|error)", line)), "(no summary line)")
        lines = [f"## -n {workers}: exit {done.returncode}, {summary}",
                 f"wall {wall:.0f} s ({wall / 60:.1f} min), CPUs {100 * busy / max(busy + idle, 1):.0f}% busy, "
                 f"{busy / hz:.0f} CPU-s ({os.cpu_count()} CPUs)",
                 f"machine: `{YARDSTICK}` {yard:.2f} s (median; before {', '.join(f'{x:.2f}' for x in before)}, "
                 f"after {', '.join(f'{x:.2f}' for x in after)}); the run took {wall / yard:.0f}x it "
                 f"(the goal: {GOAL_IMPORTS}x, 12 minutes at 2.5 s)"]
        if junit.exists():
            files: dict[str, float] = collections.Counter()
            tests = []
            for case in ET.parse(junit).iter("testcase"):
                seconds = float(case.get("time") or 0)
                files[case.get("classname", "?")] += seconds
                tests.append((seconds, f"{case.get('classname')}::{case.get('name')}"))
            if durations is not None:
                by_path = {name.replace(".", "/") + ".py": round(sec, 1) for name, sec in files.most_common()}
                durations.write_text(json.dumps(by_path, indent=0) + "\n")
            total = sum(files.values())
            lines.append(f"test time summed over workers: {total:.0f} s")
            lines.append(f"slowest files (s, summed):")
            lines += [f"  {s:7.1f}  {name}" for name, s in files.most_common(slowest)]
            lines.append(f"slowest tests (s):")
            lines += [f"  {s:7.1f}  {name}" for s, name in sorted(tests, reverse=True)[:slowest]]
        if done.returncode != 0:
            lines.append("failures (pytest's short summary):")
            lines += [f"  {line}" for line in done.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
        return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", nargs="+", default=["auto"], help="pytest-xdist -n values, one run each")
    parser.add_argument("--slowest", type=int, default=15, help="how many slowest files and tests to list")
    parser.add_argument("--out", default=str(REPO / "experiments" / "results" / "bench_suite.txt"))
    parser.add_argument("--durations", type=Path, help="write each test file's seconds (JSON) here")
    args = parser.parse_args()
    text = header() + "\n"
    for i, workers in enumerate(args.workers):
        part = run_suite(workers, args.slowest, args.durations if i == 0 else None)
        print(part, flush=True)
        text += part + "\n"
    write_results(args.out, text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
