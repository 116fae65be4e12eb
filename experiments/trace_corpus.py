"""Corpus score of the real-trace replay, and its speed on the largest trace.

Run: ``python experiments/trace_corpus.py [--old REF] [--repeat N]`` (about a minute on one core).
Writes experiments/results/trace_corpus.txt and prints the same text.

1. Score: every trace in tests/data (copied from shared/traces), replayed as ``oomtune simulate
   TRACE --json`` does with no flags, for every device that holds data. A trace counts as exact when
   every device replays every segment event (action, size, request), the peak and the final
   reserved total exactly and no OOM the device did not have. The same is asked of the code at
   ``--old`` (default 48cfeb3, main before the real-trace fidelity fixes; it replays only device 0 and refuses some
   files), through its own ``oomtune simulate --json`` in a subprocess.
2. Speed on the largest trace (most entries): replay speed in events/s (alloc + free_completed +
   oom requests replayed, over the replay time that ``replay_snapshot`` reports: starting-state
   rebuild included, loading excluded), median of ``--repeat`` runs in this process; and the wall time
   of ``oomtune simulate TRACE`` as a user runs it (new process, text output), median of
   ``--repeat`` runs, old and new alternating so that machine load cancels in the ratio.
All figures are from the virtual GPU (simulated) on this machine's CPU; the traces were recorded on
real GPUs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _baseline import ROOT, child_env, header, old_tree  # noqa: E402
from _provenance import write_results  # noqa: E402

DATA = ROOT / "tests" / "data"
OUT = ROOT / "experiments" / "results" / "trace_corpus.txt"


def _new_results(path: Path) -> list[tuple[int, object]]:
    from oomtune.trace import devices_with_data, load_snapshot, replay_snapshot

    snap = load_snapshot(path)
    return [(d, replay_snapshot(snap, device=d)) for d in devices_with_data(snap)]


def _old_result(tree: Path, path: Path) -> tuple[bool, str]:
    proc = subprocess.run([sys.executable, "-m", "oomtune", "simulate", str(path), "--json"],
                          capture_output=True, text=True, env=child_env(tree), cwd=tree, timeout=600)
    if proc.returncode != 0:
        return False, "refused: " + (proc.stderr.strip().splitlines() or ["?"])[-1][:100]
    r = json.loads(proc.stdout)
    oom = r.get("simulated_oom", r.get("oom"))   # --json keys before / after the simulated_ prefix
    peak = r.get("simulated_peak_reserved_bytes", r.get("peak_reserved_bytes"))
    exact = (r["first_divergence"] is None and not oom
             and peak == r["recorded_peak_reserved_bytes"]
             and r["simulated_final_reserved_bytes"] == r["recorded_final_reserved_bytes"])
    why = "exact" if exact else (
        f"segment allocs {len(r['simulated_segment_allocs'])}/{len(r['recorded_segment_allocs'])}, final "
        f"{(r['simulated_final_reserved_bytes'] - r['recorded_final_reserved_bytes']) / (1 << 20):+.0f} MiB")
    return exact, why


def _wall(tree: Path, path: Path) -> float:
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "oomtune", "simulate", str(path)], capture_output=True,
                   env=child_env(tree), cwd=tree, timeout=600, check=True)  # cwd: -m puts it first
    return time.perf_counter() - t


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", default="48cfeb3", help="git ref of the code to compare with")
    ap.add_argument("--repeat", type=int, default=5, help="runs per speed figure (median)")
    args = ap.parse_args(argv)
    lines = header("trace_corpus.py", argv, args.old)   # at the start: refuses a dirty tree, reads the load
    old = old_tree(args.old)
    lines += ["", "## corpus score (default replay, no flags; simulated vs recorded on device)", ""]
    lines.append(f"{'trace':36} {'dev':>3} {'entries':>7} {'events':>9} {'exact':>5}  "
                 f"{'old (' + args.old + ')':40}")
    exact_files = old_exact_files = 0
    traces = sorted(DATA.glob("*.pickle"))
    sizes = {}
    for path in traces:
        results = _new_results(path)
        old_ok, old_why = _old_result(old, path)
        old_exact_files += old_ok
        file_ok = all(r.exact for _, r in results)
        exact_files += file_ok
        from oomtune.trace import load_snapshot

        snap = load_snapshot(path)
        sizes[path] = sum(len(t) for t in snap["device_traces"])
        for k, (d, r) in enumerate(results):
            entries = len(snap["device_traces"][d]) if d < len(snap["device_traces"]) else 0
            why = "yes" if r.exact else "NO"
            lines.append(f"{path.stem if k == 0 else '':36} {d:>3} {entries:>7} "
                         f"{len(r.simulated_segment_events):>4}/{len(r.recorded_segment_events):<4} {why:>5}  "
                         f"{(old_why if k == 0 else ''):40}"
                         + ("" if r.exact else f"  first difference {r.divergence}"))
    lines += ["", f"score: {exact_files}/{len(traces)} traces exact by default (old {args.old}: "
              f"{old_exact_files}/{len(traces)}); events = simulated/recorded segment events "
              "(segment_alloc/free/map/unmap and oom)", ""]

    largest = max(traces, key=lambda p: sizes[p])
    from oomtune.trace import load_snapshot, replay_snapshot

    snap = load_snapshot(largest)
    speeds, requests = [], 0
    for _ in range(args.repeat):
        r = replay_snapshot(snap)
        requests = r.events_replayed
        speeds.append(r.events_replayed / r.replay_seconds)
    new_wall, old_wall = [], []
    for _ in range(args.repeat):
        new_wall.append(_wall(ROOT, largest))
        old_wall.append(_wall(old, largest))
    nw, ow = statistics.median(new_wall), statistics.median(old_wall)
    lines += [
        f"## speed on the largest trace: {largest.stem} ({sizes[largest]:,} entries, {requests:,} requests "
        "replayed)",
        "",
        f"replay speed (simulated, one core, starting-state rebuild included): median "
        f"{statistics.median(speeds):,.0f} events/s over {args.repeat} runs (min {min(speeds):,.0f}, "
        f"max {max(speeds):,.0f})",
        f"wall time of `oomtune simulate {largest.relative_to(ROOT)}` (new process, text output): median "
        f"{nw:.2f} s (new) vs {ow:.2f} s (old {args.old}), ratio {nw / ow:.2f}; runs new "
        f"{', '.join(f'{x:.2f}' for x in new_wall)}; old {', '.join(f'{x:.2f}' for x in old_wall)}",
        "(most of the old wall time is `import torch`, which `oomtune simulate` no longer does; "
        "the replay itself is a fraction of a second either way. Wall times swing with the machine's load "
        "(the header's load line; the spread is the runs listed), the events are exact regardless.)",
    ]
    text = "\n".join(lines) + "\n"
    write_results(OUT, text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
