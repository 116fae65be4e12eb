"""Benchmark: wall time of ``oomtune --help`` and ``oomtune simulate TRACE``.

Each command runs as a fresh process (``python -m oomtune ...``, bytecode cached by an untimed
warm-up run) for the new code (this checkout) and the old code (``--old REF``, default: main before
the startup speed changes), alternating old and new ``--repeat`` times; reports the median and the minimum wall time
of each and the ratio old/new of the medians. Simulate runs on every ``*.pickle`` in ``--traces``.
Targets (2 cores): --help <= 0.3 s; simulate on the largest shared trace <= 0.5 s.

Run: python experiments/bench_startup.py [--old REF] [--repeat 7] [--traces tests/data]
     [--out experiments/results/bench_startup.txt]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _baseline import DEFAULT_OLD, ROOT, TRACES, child_env, header, old_tree, trace_files  # noqa: E402
from _provenance import write_results  # noqa: E402


EXIT: dict[str, set[int]] = {"old": set(), "new": set()}


def wall(cmd: list[str], env: dict[str, str], name: str = "") -> float:
    t0 = time.perf_counter()
    # cwd = the tree itself: ``python -m`` puts the working directory first on sys.path
    rc = subprocess.run(cmd, env=env, cwd=env["PYTHONPATH"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
    if name:
        EXIT[name].add(rc)
    return time.perf_counter() - t0


def compare(args: list[str], envs: dict[str, dict[str, str]], repeat: int) -> dict[str, list[float]]:
    cmd = [sys.executable, "-m", "oomtune", *args]
    for env in envs.values():
        wall(cmd, env)  # warm-up: writes bytecode caches, fills the page cache
    times: dict[str, list[float]] = {k: [] for k in envs}
    for k in EXIT:
        EXIT[k] = set()
    for _ in range(repeat):
        for name, env in envs.items():
            times[name].append(wall(cmd, env, name))
    return times


def row(label: str, t: dict[str, list[float]]) -> str:
    med_old, med_new = statistics.median(t["old"]), statistics.median(t["new"])
    codes = "".join(f" [{k} exit {sorted(v)}]" for k, v in EXIT.items() if v - {0})
    return (f"{label:<48} new {med_new:6.3f} s (min {min(t['new']):6.3f})   old {med_old:6.3f} s "
            f"(min {min(t['old']):6.3f})   old/new {med_old / med_new:5.1f}x{codes}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", default=DEFAULT_OLD, help="git ref of the code to compare with")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--traces", type=Path, default=TRACES)
    ap.add_argument("--out", type=Path, default=ROOT / "experiments" / "results" / "bench_startup.txt")
    args = ap.parse_args()
    out = header("bench_startup.py", sys.argv[1:], args.old)
    out += ["# wall time of a fresh process, median of --repeat runs (min in parentheses), old and new "
            "alternating; CPU only, simulate replays on the virtual GPU (simulated)", ""]
    envs = {"old": child_env(old_tree(args.old)), "new": child_env(ROOT)}
    t: dict[str, list[float]] = {k: [] for k in envs}
    for k in EXIT:
        EXIT[k] = set()
    for _ in range(args.repeat):
        for name, env in envs.items():
            t[name].append(wall([sys.executable, "-c", "pass"], env))
    out.append(row("python -c pass (interpreter start, for scale)", t))
    out.append(row("oomtune --help (target <= 0.3 s)", compare(["--help"], envs, args.repeat)))
    traces = sorted(trace_files(args.traces, "bench_startup"), key=lambda p: p.stat().st_size)
    for trace in traces:
        trace = trace.resolve()
        label = f"simulate {trace.name} ({trace.stat().st_size / 2**20:.1f} MiB)"
        out.append(row(label, compare(["simulate", str(trace)], envs, args.repeat)))
        print(out[-1], flush=True)
    if traces:
        out.append(f"target: simulate on the largest trace ({traces[-1].name}) <= 0.5 s")
    text = "\n".join(out) + "\n"
    write_results(args.out, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
