"""Benchmark: how fast the virtual GPU (CachingAllocatorSim) replays allocation streams.

Measures replayed events per second (one core; process CPU time and wall clock) for
  (a) a ResNet-50 training step at batch 32 (224x224, SGD with momentum), captured on the meta
      device with oomtune.capture (falls back to a synthetic stream when capture is unavailable),
      under default, expandable_segments and max_split_size_mb:256 settings;
  (b) a synthetic 1,000,000-event stream (seeded; sizes log-uniform 512 B .. 256 MiB, ~600 live);
and prints a cProfile breakdown of (b) (top functions by own time).
Writes everything to experiments/results/bench_replay.txt.

Run: python experiments/bench_replay.py [--events 1000000] [--out PATH]
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import os
import platform
import pstats
import random
import sys
import time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))  # experiments/_provenance.py
from _provenance import header  # noqa: E402  (command + commit lines of every results file)

from oomtune.alloc.stream import AllocationStream, replay_stream

GiB = 1 << 30
TOTAL = 80 * GiB


def capture_resnet50(batch: int = 32) -> tuple[AllocationStream, str]:
    """One training step of torchvision's resnet50 on the meta device, as a request stream."""
    try:
        import torch
        import torchvision

        from oomtune.capture.recorder import capture_stream
    except ImportError as exc:  # pragma: no cover - depends on the checkout
        return synthetic(2800, seed=50, live_target=160), f"synthetic (capture unavailable: {exc})"
    model = torchvision.models.resnet50().to("meta")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.empty(batch, 3, 224, 224, device="meta")
    y = torch.zeros(batch, dtype=torch.long, device="meta")

    def step() -> None:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    existing = [*model.parameters(), *model.buffers(), x, y]
    stream = capture_stream(step, existing=existing, device="meta")
    return stream, f"captured on meta (oomtune.capture), batch {batch}"


def synthetic(n_events: int, seed: int = 0, live_target: int = 600) -> AllocationStream:
    """A seeded random stream: sizes log-uniform in [512 B, 256 MiB], live set around live_target."""
    rng = random.Random(seed)
    stream, live, key = AllocationStream(), [], 0
    while len(stream) < n_events:
        if live and (len(live) > live_target or rng.random() < 0.5 * len(live) / live_target):
            stream.append_free(live.pop(rng.randrange(len(live))))
        else:
            key += 1
            stream.append_alloc(key, int(2 ** rng.uniform(9, 28)), 0)
            live.append(key)
    return stream


def rate(stream: AllocationStream, settings: str | None, repeat: int) -> tuple[float, float, object]:
    """Best-of-``repeat`` events/s for a full replay of ``stream``: by CPU time of this process
    (robust on a shared machine) and by wall clock."""
    best_cpu = best_wall = float("inf")
    result = None
    for _ in range(repeat):
        c0, w0 = time.process_time(), time.perf_counter()
        result = replay_stream(stream, settings, total_memory_bytes=TOTAL)
        best_cpu = min(best_cpu, time.process_time() - c0)
        best_wall = min(best_wall, time.perf_counter() - w0)
    return len(stream) / best_cpu, len(stream) / best_wall, result


def profile(stream: AllocationStream, top: int = 14) -> str:
    prof = cProfile.Profile()
    prof.enable()
    replay_stream(stream, None, total_memory_bytes=TOTAL)
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    lines = [ln for ln in buf.getvalue().splitlines() if ln.strip()]
    return "\n".join(lines[:top + 8])


def machine() -> str:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"date {datetime.datetime.now().isoformat(timespec='seconds')}; nproc {os.cpu_count()}; "
            f"cpu {cpu}; python {platform.python_version()} ({platform.python_implementation()}); "
            f"{platform.platform()}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_replay.txt"))
    args = ap.parse_args()
    out = ["# bench_replay: CachingAllocatorSim replay speed (one core; best of N; events/s by process "
           "CPU time, wall clock in parentheses; the machine is shared)",
           f"# {machine()}", ""]
    t0 = time.perf_counter()
    resnet, how = capture_resnet50()
    out.append(f"(a) ResNet-50 training step, batch 32: {len(resnet)} events, {how} "
               f"({time.perf_counter() - t0:.1f} s to capture); peak live requested "
               f"{resnet.peak_live_bytes() / GiB:.2f} GiB")
    for settings in (None, "expandable_segments:True", "max_split_size_mb:256"):
        ev, wall, r = rate(resnet, settings, repeat=20)
        out.append(f"    settings {settings or 'default':<26} {ev:>10,.0f} events/s cpu ({wall:>9,.0f} wall)  "
                   f"peak allocated "
                   f"{r.peak_allocated_bytes / GiB:.3f} GiB, peak reserved {r.peak_reserved_bytes / GiB:.3f} GiB")
    t0 = time.perf_counter()
    big = synthetic(args.events)
    out.append(f"(b) synthetic stream: {len(big):,} events (built in {time.perf_counter() - t0:.1f} s)")
    for settings in (None, "expandable_segments:True"):
        ev, wall, r = rate(big, settings, repeat=2)
        out.append(f"    settings {settings or 'default':<26} {ev:>10,.0f} events/s cpu ({wall:>9,.0f} wall)  "
                   f"peak reserved "
                   f"{r.peak_reserved_bytes / GiB:.2f} GiB, fragmentation {r.fragmentation:.3f}")
    out += ["", "(c) cProfile of (b), default settings, 200k events (profiler overhead inflates times):",
            profile(synthetic(200_000, seed=1))]
    text = "\n".join(out) + "\n"
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(header() + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
