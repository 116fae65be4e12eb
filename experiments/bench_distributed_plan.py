"""The plan of a 2-rank DDP and a 2-rank FSDP2 search against the same plan with one rank (simulated:
the virtual GPU).

``oomtune plan model=transformer model.layers=4 model.d_model=512 budget=2GiB
search.batch_size.low=1 search.batch_size.high=64`` with ``trial.gpus=2 model.parallel=ddp``, with
``trial.gpus=2 model.parallel=fsdp`` and with one rank (``model.parallel=none``), each run ``--repeats`` times alternately in its own process with
the stream cache off (every capture made afresh), device=cpu. Reported: the wall time of each run
(process start to exit) and the plan's own capture seconds and captured / derived batch counts
(plan.yaml ``timing``). A DDP rank is captured on meta under torch's fake process group
(oomtune/workloads/_meta_rank.py), an FSDP2 rank too, on a mesh on meta (oomtune/workloads/
_meta_fsdp.py); before that, every such capture ran the step on the CPU, one batch size at a time,
without derivation (1209 s of captures for the frontier of the same DDP search).

Usage: ``python experiments/bench_distributed_plan.py [--repeats 2] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # experiments/_provenance.py
from _provenance import header, write_results  # noqa: E402

import yaml  # noqa: E402

COMMON = ["model=transformer", "model.layers=4", "model.d_model=512", "budget=2GiB", "search.batch_size.low=1",
          "search.batch_size.high=64", "device=cpu"]
CASES = {"1 rank": ["model.parallel=none"], "2 ranks DDP": ["trial.gpus=2", "model.parallel=ddp"],
         "2 ranks FSDP2": ["trial.gpus=2", "model.parallel=fsdp"]}


def _plan(extra: list[str], root: Path) -> dict:
    run_dir = Path(tempfile.mkdtemp(dir=root))
    env = {**os.environ, "OOMTUNE_CACHE_DIR": "off"}
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "oomtune", "plan", *COMMON, *extra, f"hydra.run.dir={run_dir}"],
                   check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    plan = yaml.safe_load((run_dir / "plan.yaml").read_text())
    return {"wall_s": wall, "timing": plan.get("timing", {})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "bench_distributed_plan.txt")
    args = ap.parse_args()
    lines = [header().rstrip("\n"), f"# oomtune plan {' '.join(COMMON)} (+ the case's overrides), stream cache off",
             "# figures: wall seconds of the whole `oomtune plan` process; simulated memory (virtual GPU)", ""]
    walls: dict[str, list[float]] = {k: [] for k in CASES}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for name, extra in CASES.items():
                got = _plan(extra, Path(tmp))
                walls[name].append(got["wall_s"])
                t = got["timing"]
                line = (f"{name:13s} run {i + 1}: wall {got['wall_s']:.1f} s; plan timing: "
                        + ", ".join(f"{k}={v}" for k, v in sorted(t.items()) if not isinstance(v, dict)))
                print(line, flush=True)
                lines.append(line)
    one = statistics.median(walls["1 rank"])
    lines.append("")
    for name in CASES:
        if name != "1 rank":
            two = statistics.median(walls[name])
            lines.append(f"median wall: 1 rank {one:.1f} s, {name} {two:.1f} s: ratio {two / one:.2f}x (goal <= 3x)")
            print(lines[-1])
    write_results(args.out, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
