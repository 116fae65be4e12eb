"""CPU demo benchmark: the README's main command, and pruning on vs off.

1. `oomtune search` on the embedded defaults (built-in ResNet-18, 64x64, synthetic data, 1 GiB
   virtual GPU), timed end to end in a fresh run directory. Target: <= 5 minutes on 2 cores.
2. The same search with `search.prune=predicted` and with `search.prune=off`, both with the seeded
   random sampler and no baseline phase (whose probes differ when it starts from the prediction),
   so that both studies ask for the same 16 candidates: compares launches, wall time and
   the best configuration. (With TPE the sequence depends on measured throughput, which is noisy on a
   shared CPU, so the two studies would diverge for reasons unrelated to pruning.)

Prints a table and writes experiments/results/bench_search_cpu.txt. Run: python experiments/bench_search_cpu.py
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

RESULTS = Path(__file__).resolve().parent / "results" / "bench_search_cpu.txt"


def run(args: list[str], run_dir: Path) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "oomtune", "search", *args, f"hydra.run.dir={run_dir}"],
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"search failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    best = yaml.safe_load((run_dir / "best.yaml").read_text())
    return {"wall_s": wall, "best": best, "stdout": proc.stdout, "stderr": proc.stderr}


def describe(res: dict) -> str:
    b = res["best"]["best"]
    st = res["best"]["study"]
    outcomes = ", ".join(f"{k} {v}" for k, v in sorted(st["outcomes"].items()))
    return (f"wall {res['wall_s']:.1f} s; launches {st['launches']} (saved {st['launches_saved']}); "
            f"trials {st['trials']} [{outcomes}]; best batch {b['batch_size']} "
            f"'{b['alloc_conf'] or '(default)'}' {b['metrics']['throughput']:.1f} samples/s, peak reserved "
            f"{b['metrics']['peak_reserved_bytes'] / 2**20:.1f} MiB ({b['metrics']['memory_source']})")


def main() -> None:
    lines = [f"# bench_search_cpu  {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
             f"# machine: {platform.processor() or platform.machine()}, nproc {os.cpu_count()}, "
             f"python {platform.python_version()}", ""]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        main_cmd = run([], tmp / "default")
        lines += ["## README main command: oomtune search (embedded defaults)", describe(main_cmd),
                  f"target <= 300 s: {'met' if main_cmd['wall_s'] <= 300 else 'NOT met'}", ""]
        common = ["search.sampler=random", "search.seed=0", "search.baseline=false", "search.n_trials=16"]
        on = run(common + ["search.prune=predicted"], tmp / "prune_on")
        off = run(common + ["search.prune=off"], tmp / "prune_off")
        key = lambda r: (r["best"]["best"]["batch_size"], r["best"]["best"]["alloc_conf"])  # noqa: E731
        lines += ["## pruning (random sampler, seed 0, same candidates asked in both studies)",
                  f"prune=predicted: {describe(on)}", f"prune=off:       {describe(off)}",
                  f"same best configuration: {key(on) == key(off)}",
                  f"launches saved by pruning: {off['best']['study']['launches'] - on['best']['study']['launches']}",
                  ""]
    text = "\n".join(lines)
    print(text)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(text + "\n")


if __name__ == "__main__":
    main()
