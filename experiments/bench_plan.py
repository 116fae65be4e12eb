"""Benchmark ``oomtune plan``: ResNet-50 at 224x224, batch 8..1024, the 24 allocator configurations
of the default search space, 16 GiB budget on the virtual GPU (CPU only).

Usage: ``python experiments/bench_plan.py [--out experiments/results/bench_plan.txt]``

Times the whole plan (capture on meta per batch size, replays, bisection) in this process, after
importing torch, and writes the figures and the feasibility summary to the results file. Target:
<= 20 s on a 2-core machine.
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import tempfile
import time
from pathlib import Path

OVERRIDES = ["model=resnet", "model.depth=50", "model.image_size=224", "model.num_classes=1000",
             "budget=16GiB", "device=cpu", "virtual_device_memory=80GiB",
             "search.batch_size.low=8", "search.batch_size.high=1024"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "bench_plan.txt")
    args = parser.parse_args()

    import torch
    from rich.console import Console

    from oomtune.commands.plan import plan

    buf = io.StringIO()
    console = Console(file=buf, width=240, color_system=None)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        fmap = plan([*OVERRIDES, f"hydra.run.dir={tmp}/run"], out=Path(tmp) / "plan.yaml", console=console)
        wall = time.perf_counter() - t0
    lines = [
        "bench_plan: oomtune plan, ResNet-50 224x224, batch 8..1024, 16 GiB budget (virtual GPU), "
        f"{len(fmap.rows)} allocator configurations",
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"torch threads {torch.get_num_threads()}",
        f"overrides: {' '.join(OVERRIDES)}",
        f"wall (plan(), after importing torch): {wall:.2f} s  (target <= 20 s: {'met' if wall <= 20 else 'MISSED'})",
        f"capture: {fmap.capture_s:.2f} s for {fmap.captures} batch sizes "
        f"({fmap.capture_s / max(fmap.captures, 1):.3f} s each)",
        f"replay:  {fmap.replay_s:.2f} s for {fmap.replays} replays "
        f"({fmap.replay_s / max(fmap.replays, 1) * 1000:.1f} ms each)",
        f"grid: {fmap.batch_sizes}",
        "largest fitting batch per configuration (simulated):",
    ]
    for r in fmap.rows:
        at = "-" if r.at_max is None else f"{r.at_max.peak_reserved_bytes / 2**30:.2f} GiB reserved"
        lines.append(f"  {r.max_batch_size!s:>5}  {at:>18}  {r.alloc_conf or '(default)'}")
    lines += [f"note: {x}" for x in fmap.fallback]
    lines += ["", "table as printed:", buf.getvalue()]
    text = "\n".join(lines)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
