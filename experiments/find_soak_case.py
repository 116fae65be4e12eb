"""Search the built-in transformer's parameter space for a soak case: the default allocator passes
the trial's 4 measured steps (warm-up + 3) but runs out of memory later in the soak, while
``expandable_segments:True`` survives the whole soak.

Usage: python experiments/find_soak_case.py [--steps 2000] [--capture cpu|meta] [--out PATH]

For each model shape, seq_len range and batch it captures the soak's streams once, then scans the
budget (a memory fraction of an 80 GiB virtual GPU, as a CPU trial applies it) in 2 MiB steps between the expandable
configuration's unbounded peak reserved and the default's, replaying both configurations. Every
figure is simulated (virtual GPU). Writes the cases found (and, without one, the closest: the
default failing latest) to the results file.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

from oomtune.alloc.settings import AllocatorSettings
from oomtune.capture.virtual_gpu import budgeted_sim
from oomtune.trial.soak import capture_soak, replay_soak

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _provenance import header, write_results  # noqa: E402  (the first lines of every results file)

MiB = 1 << 20
DEVICE_BYTES = 80 << 30   # virtual_device_memory's default: the budget is a memory fraction of it


def run(streams, conf: str, budget_bytes: int):
    """The soak on the virtual GPU a CPU trial uses (budgeted_sim: 80 GiB, budget as fraction)."""
    settings = AllocatorSettings.parse(conf)
    return replay_soak(streams, new_sim=lambda: budgeted_sim(settings, budget_bytes, DEVICE_BYTES))
MEASURED = 4   # warm-up + measured steps of a default trial (trial.warmup_steps=1, measure_steps=3)


def model(layers: int, d_model: int, vocab: int, low: int, high: int, pad: int) -> dict:
    return {"name": "transformer", "layers": layers, "d_model": d_model, "heads": 2,
            "seq_len": {"low": low, "high": high, "pad_multiple": pad, "seed": 0}, "vocab_size": vocab,
            "dropout": 0.0, "optimizer": "adamw", "lr": 3e-4, "precision": "fp32",
            "data": {"source": "synthetic"}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--capture", default="cpu", choices=("cpu", "meta"))
    ap.add_argument("--out", default=None, help="results file (default: experiments/results/find_soak_case.txt "
                    "for --capture meta, find_soak_case_cpu.txt for --capture cpu)")
    args = ap.parse_args()
    if args.out is None:
        args.out = f"experiments/results/find_soak_case{'' if args.capture == 'meta' else '_cpu'}.txt"
    lines = [*header().splitlines(), "# all figures simulated (virtual GPU of a CPU trial: 80 GiB device, the budget as memory fraction)",
             f"# measured steps: {MEASURED} (trial.warmup_steps 1 + trial.measure_steps 3)", ""]
    found, closest = [], None
    # The built-in transformer's defaults (conf/model/transformer.yaml: 4 layers, d_model 256, vocab
    # 8192) and smaller ones; padded lengths bucketed to multiples of 64 (few distinct shapes).
    grid = itertools.product([(2, 64, 2048), (2, 128, 8192)], [(64, 512)], [4, 8])
    for (layers, d, vocab), (low, high), batch in grid:
        cfg = model(layers, d, vocab, low, high, 64)
        t0 = time.perf_counter()
        streams = capture_soak(cfg, batch, args.steps, capture_device=args.capture)
        free_default = replay_soak(streams, "", device_memory_bytes=DEVICE_BYTES)
        free_exp = replay_soak(streams, "expandable_segments:True", device_memory_bytes=DEVICE_BYTES)
        lo = (free_exp.peak_reserved_bytes // (2 * MiB)) * 2 * MiB
        hi = free_default.peak_reserved_bytes
        tag = f"layers={layers} d_model={d} vocab={vocab} seq_len=[{low},{high}]/64 batch={batch}"
        print(f"{tag}: unbounded peak reserved default {free_default.peak_reserved_bytes / MiB:.0f} MiB, "
              f"expandable {free_exp.peak_reserved_bytes / MiB:.0f} MiB ({time.perf_counter() - t0:.1f} s)",
              flush=True)
        for cap in range(lo, hi, 2 * MiB):
            dflt = run(streams, "", cap)
            if dflt.passed or dflt.failed_step <= MEASURED:
                continue
            exp = run(streams, "expandable_segments:True", cap)
            row = (f"{tag} budget={cap // MiB}MiB: default fails at step {dflt.failed_step} "
                   f"({dflt.shape_key}={dflt.shape_at_failure}, reserved-allocated "
                   f"{dflt.cached_unused_bytes / MiB:.1f} MiB, request {dflt.requested_bytes / MiB:.1f} MiB); "
                   f"expandable {'passes' if exp.passed else f'fails at step {exp.failed_step}'}")
            print("  " + row, flush=True)
            if exp.passed:
                found.append(row)
            elif closest is None or dflt.failed_step > closest[0]:
                closest = (dflt.failed_step, row)
    lines += ["cases found (default passes the measured steps, fails the soak; expandable survives):"]
    lines += [f"  {r}" for r in found] or ["  none"]
    if not found and closest is not None:
        lines += ["closest:", f"  {closest[1]}"]
    write_results(Path(args.out), "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
