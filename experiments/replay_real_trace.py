"""Replay the real GPU trace (tests/data/cnn-small-default.pickle, from shared/traces/) under several allocator
settings and compare with what the device recorded.

Run: ``python experiments/replay_real_trace.py`` (about a second on one CPU core). Writes
experiments/results/replay_real_trace.txt and prints the same text.

Ground truth (the trace's README, recorded under default settings): 7 segment_alloc events of
20, 2, 2, 20, 20, 20, 20 MiB; 128 MiB reserved at the end; 3 segments (24 MiB) before recording.
Only the default-settings row can be checked against the device; the others are predictions.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from oomtune.trace import load_snapshot, rebuild_initial_state, replay_snapshot
from oomtune.units import MiB, format_bytes

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _provenance import header, write_results  # noqa: E402  (the first lines of every results file)

TRACE = Path(__file__).resolve().parents[1] / "tests" / "data" / "cnn-small-default.pickle"
OUT = Path(__file__).resolve().parent / "results" / "replay_real_trace.txt"
CONFS = ["", "expandable_segments:True", "max_split_size_mb:20", "max_split_size_mb:64",
         "roundup_power2_divisions:4", "garbage_collection_threshold:0.6"]
BUDGETS = [None, 160 * MiB, 112 * MiB]


def _row(conf: str, budget: int | None, r) -> str:
    diff = r.peak_reserved_bytes - r.recorded_peak_reserved_bytes
    oom = f"yes@{r.oom_at['event_index']}" if r.oom else "no"
    return (f"{conf or '(defaults)':34} {format_bytes(budget) if budget else '1 TiB':>10} "
            f"{r.events_replayed:>6} {r.replay_seconds * 1000:>8.1f} "
            f"{format_bytes(r.peak_allocated_bytes):>11} {format_bytes(r.peak_reserved_bytes):>11} "
            f"{format_bytes(r.recorded_peak_reserved_bytes):>11} {format_bytes(diff):>11} "
            f"{len(r.simulated_segment_allocs):>3}/{len(r.recorded_segment_allocs):<3} "
            f"{r.simulated_segment_frees:>4} {str(r.first_divergence):>5} {r.num_alloc_retries:>3} {oom:>8} "
            f"{'yes' if r.initial_state_exact else 'no':>5}")


def main() -> int:
    head = header().splitlines()   # at the start: refuses a dirty tree, reads the load
    t0 = time.perf_counter()
    snap = load_snapshot(TRACE)
    load_s = time.perf_counter() - t0
    state = rebuild_initial_state(snap)
    lines = [
        *head,
        "# figures: simulated (virtual GPU) vs recorded on device (the trace)",
        f"trace: {TRACE.relative_to(TRACE.parents[2])} ({len(snap['device_traces'][0]):,} entries), loaded (restricted unpickler + "
        f"validation) in {load_s * 1000:.1f} ms",
        f"starting state rebuilt: {len(state.segments)} segments "
        f"({', '.join(f'{s.total_size_bytes // MiB} MiB {s.pool}' for s in state.segments)}), "
        f"{format_bytes(state.reserved_bytes)} reserved, {format_bytes(state.live_bytes)} live in "
        f"{sum(len(s.live_blocks) for s in state.segments)} blocks",
        "",
        f"{'settings':34} {'budget':>10} {'events':>6} {'ms':>8} {'peak alloc':>11} {'peak resv':>11} "
        f"{'rec resv':>11} {'diff':>11} {'seg a s/r':>7} {'segf':>4} {'div':>5} {'rty':>3} {'oom':>8} "
        f"{'exact':>5}",
    ]
    default = None
    for budget in BUDGETS:
        for conf in CONFS:
            r = replay_snapshot(snap, conf, total_memory_bytes=budget)
            default = default or r
            lines.append(_row(conf, budget, r))
    lines += [
        "",
        "columns: events = alloc + free_completed replayed; ms = replay time (starting-state rebuild "
        "included); peak alloc/resv = simulated; rec resv = recorded on device (starting reserved + "
        "segment events, running max); seg a s/r = simulated/recorded segment allocs; segf = "
        "simulated segment releases; div = first divergence index (None = identical sizes at the same "
        "requests); rty = num_alloc_retries (simulated); exact = starting state reproduced exactly.",
        f"default settings, recorded segment allocs (MiB): {[s // MiB for s in default.recorded_segment_allocs]}",
        f"default settings, simulated segment allocs (MiB): {[s // MiB for s in default.simulated_segment_allocs]}",
        f"default settings, segment events recorded {default.recorded_segment_events} vs simulated "
        f"{default.simulated_segment_events}",
        f"final reserved: recorded on device {format_bytes(default.recorded_final_reserved_bytes)}, "
        f"simulated {format_bytes(default.simulated_final_reserved_bytes)}; recorded release runs "
        f"{len(default.releases)}",
    ]
    text = "\n".join(lines) + "\n"
    write_results(OUT, text)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
