"""Soak speed: steps per second of the virtual-GPU soak for the built-in transformer.

Usage: python experiments/bench_soak.py [--steps 2000] [--batch 16] [--out experiments/results/bench_soak.txt]

The built-in transformer (conf/model/transformer.yaml: 4 layers, d_model 256, 4 heads, vocab 8192,
AdamW) with ``seq_len`` a uniform range 64..512, padded to multiples of 64 (8 distinct shapes) and of
8 (57 shapes). Per case: capture time (meta device; with many lengths three plus a check are captured
and the others derived), replay time of
``--steps`` steps under the default allocator and ``expandable_segments:True`` on an 80 GiB virtual
GPU with an 8 GiB budget (memory fraction 0.1), with the soak's skipping of repeated steps and without it
(every step replayed: the events/s of the simulator itself). All memory is simulated; times are
wall seconds on this machine (say whether it was loaded). The soak runs on the compiled core when it is built
(``OOMTUNE_PURE_PYTHON=1``: the pure-Python simulator); the header says which.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import oomtune.trial.soak as soak_module
from oomtune.alloc import _compiled
from oomtune.trial.soak import capture_soak, replay_soak

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _provenance import header, write_results  # noqa: E402  (the first lines of every results file)

GiB = 1 << 30
TRANSFORMER = {"name": "transformer", "layers": 4, "d_model": 256, "heads": 4, "vocab_size": 8192,
               "dropout": 0.0, "optimizer": "adamw", "lr": 3e-4, "precision": "fp32",
               "data": {"source": "synthetic"}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--out", default="experiments/results/bench_soak.txt")
    args = ap.parse_args()
    lines = [*header().splitlines(),
             "# memory: simulated (virtual GPU: 80 GiB device, 8 GiB budget as memory fraction 0.1)",
             "# simulator: " + ("compiled core (oomtune.alloc._fastcore.FastSim)" if _compiled.enabled() else
                                "pure Python (CachingAllocatorSim: OOMTUNE_PURE_PYTHON=1 or the core not built)"),
             ""]
    fraction = 8 * GiB / (80 * GiB)
    original = soak_module._memo_allowed
    # Warm-up (not timed): the first capture in a process pays torch's one-time costs.
    capture_soak({**TRANSFORMER, "seq_len": 64}, 2, 2)
    for pad in (64, 8):
        cfg = {**TRANSFORMER, "seq_len": {"low": 64, "high": 512, "pad_multiple": pad, "seed": 0}}
        streams = capture_soak(cfg, args.batch, args.steps)
        events = sum(len(streams.steady[s]) for s in streams.shapes[1:]) + len(streams.first)
        lines.append(f"seq_len uniform 64..512 pad {pad}, batch {args.batch}: {len(streams.steady)} distinct shapes "
                     f"({streams.captured_shapes} captured, the rest derived), capture {streams.capture_s:.2f} s, "
                     f"{events} events in {args.steps} steps")
        for conf in ("", "expandable_segments:True"):
            for memo in (True, False):
                soak_module._memo_allowed = original if memo else (lambda sim: False)
                t0 = time.perf_counter()
                res = replay_soak(streams, conf, device_memory_bytes=80 * GiB, memory_fraction=fraction)
                dt = time.perf_counter() - t0
                soak_module._memo_allowed = original
                how = "skip repeats" if memo else "replay every step"
                replayed = res.steps_run - res.steps_skipped
                lines.append(
                    f"  {conf or '(default)':26s} {how:17s}: {'passed' if res.passed else 'failed at ' + str(res.failed_step)}"
                    f" {res.steps_run} steps ({replayed} replayed) in {dt:.2f} s = {res.steps_run / dt:,.0f} steps/s;"
                    f" with capture {res.steps_run / (dt + streams.capture_s):,.0f} steps/s;"
                    f" peak reserved {res.peak_reserved_bytes / (1 << 20):.0f} MiB (simulated)")
                print(lines[-1], flush=True)
    write_results(Path(args.out), "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
