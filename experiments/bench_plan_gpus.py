"""Wall time of ``oomtune plan`` across cards against a single-card plan (all simulated, on the CPU).

Each plan runs as its own ``python -m oomtune plan`` process with an empty stream cache (every
capture made afresh), on the built-in transformer in fp16 over batch 8..512 and the default search
space (24 allocator configurations):

* ``model.gpu=a100 budget=40536MiB``: today's single-card plan (the virtual GPU, no catalogue);
* ``gpu=[a100-40gb]``: one catalogue card;
* ``gpu=[a100-40gb,a100-80gb]``: two cards of one kernel family (one capture set, two replays);
* ``gpu=[l4,a100-40gb,h100-80gb]``: three families (three capture sets).

The goal set for the multi-card plan: at most 1.5x the single-card plan's wall time where the cards
share their kernels; cards of other kernels need their own captures (the figure says what that costs).

    python experiments/bench_plan_gpus.py [--repeat N]

Writes experiments/results/bench_plan_gpus.txt (provenance header first: commit the tree before).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _provenance import REPO, header, write_results  # noqa: E402

BASE = ["model=transformer", "model.precision=fp16", "search.batch_size.high=512"]
CASES = [
    ("single card, model.gpu=a100 (virtual GPU)", ["model.gpu=a100", "budget=40536MiB"]),
    ("gpu=[a100-40gb]", ["gpu=[a100-40gb]"]),
    ("gpu=[a100-40gb,a100-80gb] (one family)", ["gpu=[a100-40gb,a100-80gb]"]),
    ("gpu=[l4,a100-40gb,h100-80gb] (three families)", ["gpu=[l4,a100-40gb,h100-80gb]"]),
]


def run_once(extra: list[str]) -> float:
    """Seconds of one cold plan process (its own empty stream cache)."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "OOMTUNE_CACHE_DIR": str(Path(tmp) / "cache"), "PYTHONPATH": str(REPO)}
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "oomtune", "plan", "--out", str(Path(tmp) / "plan.yaml"), *BASE, *extra],
                       check=True, env=env, cwd=tmp, stdout=subprocess.DEVNULL)
        return time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=1, help="runs per case (the median is reported)")
    args = p.parse_args()
    head = header()
    lines = [f"# plan: {' '.join(BASE)}; cold stream cache per run; wall seconds of the whole process (median of "
             f"{args.repeat}); all figures simulated (virtual GPU)"]
    base = None
    for label, extra in CASES:
        runs = sorted(run_once(extra) for _ in range(args.repeat))
        med = runs[len(runs) // 2]
        base = med if base is None else base
        lines.append(f"{label:50s} {med:7.2f} s  {med / base:4.2f}x the single-card plan")
    text = head + "\n".join(lines)
    print(text)
    write_results(REPO / "experiments" / "results" / "bench_plan_gpus.txt", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
