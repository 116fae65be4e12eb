"""Starting-state rebuild, replay and segment-event comparison (oomtune.trace.replay).

Expected values: the real trace's README (hand-given ground truth) and hand calculation with the
rules of c10/cuda/CUDACachingAllocator.cpp (round to 512 B; <= 1 MiB -> small pool, 2 MiB segment;
1-10 MiB -> 20 MiB segment; large-pool split when the remainder is > 1 MiB).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from oomtune.exceptions import SnapshotError
from oomtune.trace.releases import classify_releases
from oomtune.trace.replay import (
    first_divergence,
    rebuild_initial_state,
)
from oomtune.trace.snapshot import load_snapshot

MiB = 1 << 20
REAL = Path(__file__).resolve().parent / "data" / "cnn-small-default.pickle"
S0, L0, L1 = 0x7F0000000000, 0x7F0001000000, 0x7F0003000000


def ev(action, addr, size):
    return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": 0, "frames": []}


def seg(addr, size, pool, blocks):
    return {"device": 0, "address": addr, "total_size": size, "stream": 0, "segment_type": pool,
            "is_expandable": False, "frames": [],
            "blocks": [{"size": s, "requested_size": s, "state": st, "frames": []} for s, st in blocks]}


def free(addr, size):
    return [ev("free_requested", addr, size), ev("free_completed", addr, size)]


def pre_existing_snapshot():
    """L0 (20 MiB) existed with a 3 MiB block live at offset 0; the trace frees it, then allocates 4 MiB
    (reusing L0: no segment_alloc)."""
    trace = [*free(L0, 3 * MiB), ev("alloc", L0, 4 * MiB)]
    return {"segments": [seg(L0, 20 * MiB, "large", [(4 * MiB, "active_allocated"), (16 * MiB, "inactive")])],
            "device_traces": [trace]}


def test_rebuild_from_free_without_alloc():
    state = rebuild_initial_state(pre_existing_snapshot())
    assert [(s.address, s.total_size_bytes, s.pool) for s in state.segments] == [(L0, 20 * MiB, "large")]
    assert [(b.offset_bytes, b.size_bytes) for b in state.segments[0].live_blocks] == [(0, 3 * MiB)]
    assert state.reserved_bytes == 20 * MiB and state.live_bytes == 3 * MiB


def test_rebuild_removes_segments_the_trace_created_and_restores_freed_ones():
    # Final: only L1 (created in the trace). L0 was released during the trace (segment_free).
    trace = [ev("segment_free", L0, 20 * MiB), ev("segment_alloc", L1, 20 * MiB), ev("alloc", L1, 12 * MiB)]
    snap = {"segments": [seg(L1, 20 * MiB, "large", [(12 * MiB, "active_allocated"), (8 * MiB, "inactive")])],
            "device_traces": [trace]}
    state = rebuild_initial_state(snap)
    assert [(s.address, s.total_size_bytes, s.pool, s.live_blocks) for s in state.segments] == [
        (L0, 20 * MiB, "large", ())]


def test_rebuild_real_trace_matches_readme():
    state = rebuild_initial_state(load_snapshot(REAL))
    # README: three segments existed before recording (2 MiB small, 2 MiB small, 20 MiB large).
    assert sorted((s.total_size_bytes, s.pool) for s in state.segments) == [
        (2 * MiB, "small"), (2 * MiB, "small"), (20 * MiB, "large")]
    assert state.reserved_bytes == 24 * MiB
    assert state.unplaced_blocks == ()


def test_rebuild_places_each_pre_trace_block_in_the_segment_that_holds_its_address():
    # Three starting segments (S0 2 MiB small, L0 and L1 20 MiB large), blocks freed in the trace
    # without an alloc: inside S0, at L0's first byte, inside L1, in the gap after L0 and below S0.
    S0_SMALL = S0 + 4 * MiB
    trace = [*free(S0_SMALL + 512, 512), *free(L0, 3 * MiB), *free(L1 + 4 * MiB, 2 * MiB),
             *free(L0 + 20 * MiB, 512), *free(S0_SMALL - 512, 512)]
    snap = {"segments": [seg(S0_SMALL, 2 * MiB, "small", [(2 * MiB, "inactive")]),
                         seg(L0, 20 * MiB, "large", [(20 * MiB, "inactive")]),
                         seg(L1, 20 * MiB, "large", [(20 * MiB, "inactive")])],
            "device_traces": [trace]}
    state = rebuild_initial_state(snap)
    assert [(s.address, [(b.offset_bytes, b.size_bytes) for b in s.live_blocks]) for s in state.segments] == [
        (S0_SMALL, [(512, 512)]), (L0, [(0, 3 * MiB)]), (L1, [(4 * MiB, 2 * MiB)])]
    assert state.unplaced_blocks == (S0_SMALL - 512, L0 + 20 * MiB)


def test_rebuild_overlapping_segments_place_a_block_in_the_lowest():
    # An inconsistent snapshot: the trace frees a 20 MiB segment at L0 + 2 MiB that overlaps the final
    # L0. A block at L0 + 4 MiB lies in both; it goes to the lower one (L0), as a scan in address order.
    trace = [ev("segment_free", L0 + 2 * MiB, 20 * MiB), *free(L0 + 4 * MiB, 2 * MiB)]
    snap = {"segments": [seg(L0, 20 * MiB, "large", [(20 * MiB, "inactive")])], "device_traces": [trace]}
    state = rebuild_initial_state(snap)
    assert [(s.address, [(b.offset_bytes, b.size_bytes) for b in s.live_blocks]) for s in state.segments] == [
        (L0, [(4 * MiB, 2 * MiB)]), (L0 + 2 * MiB, [])]


def test_no_trace_for_device():
    with pytest.raises(SnapshotError, match="no trace for device 3"):
        rebuild_initial_state({"segments": [], "device_traces": [[]]}, device=3)


def test_release_classified_by_request_stream_without_frames():
    trace = [
        ev("alloc", L1, 12 * MiB),
        ev("segment_free", L0, 20 * MiB),   # 1: followed by segment_alloc: the device limit decides
        ev("segment_alloc", L1, 20 * MiB),
        ev("alloc", L1, 12 * MiB),
        *free(L1, 12 * MiB),
        ev("segment_free", L1, 20 * MiB),   # 6: the program's empty_cache(): next is a request
        ev("alloc", S0, 100),
    ]
    # Starting reserved 20 MiB (L0). Recorded reserved: 20 -> 0 (release) -> 20 -> 0; peak 20 MiB.
    # Release 1: reserved 20 + needed 20 = 40 > peak 20: consistent with a full device: allocator.
    got = [(r.first, r.explicit, r.rule) for r in classify_releases(trace, 20 * MiB)]
    assert got == [(1, False, "device limit"), (6, True, "request stream")]


def test_first_divergence():
    assert first_divergence([(2, 1), (20, 2)], [(2, 1), (20, 2)]) is None
    assert first_divergence([(2, 1), (20, 2)], [(2, 1), (20, 3)]) == 1
    assert first_divergence([(2, 1), (20, 2)], [(2, 1)]) == 1
    assert first_divergence([], [(2, 1)]) == 0
    assert first_divergence([("segment_free", 2, 1)], [("segment_free", 20, 1)]) == 0


def test_replay_pre_existing_block():
    from oomtune.trace.replay import replay_snapshot

    r = replay_snapshot(pre_existing_snapshot())
    assert r.initial_state_exact
    assert r.recorded_segment_allocs == [] and r.simulated_segment_allocs == []
    assert r.first_divergence is None
    assert r.peak_reserved_bytes == 20 * MiB  # the starting segment only
    assert r.peak_allocated_bytes == 4 * MiB  # 3 MiB before, freed; then 4 MiB
    assert r.simulated_final_reserved_bytes == r.recorded_final_reserved_bytes == 20 * MiB
    assert r.events_replayed == 2


def test_real_trace_default_settings_matches_device():
    from oomtune.trace.replay import replay_snapshot

    r = replay_snapshot(load_snapshot(REAL))
    readme_sizes = [20 * MiB, 2 * MiB, 2 * MiB, 20 * MiB, 20 * MiB, 20 * MiB, 20 * MiB]
    assert r.recorded_segment_allocs == readme_sizes
    assert r.simulated_segment_allocs == readme_sizes
    assert r.simulated_segment_events == r.recorded_segment_events
    assert r.first_divergence is None
    assert r.simulated_final_reserved_bytes == 128 * MiB
    assert r.recorded_final_reserved_bytes == 128 * MiB
    assert r.initial_state_exact
    assert r.releases == [] and r.oom is False
    # README: 1,935 alloc + 1,926 free_completed entries, all replayed.
    assert r.events_replayed == 1935 + 1926


def empty_cache_snapshot():
    """The program frees its 5 MiB block and calls torch.cuda.empty_cache() (L0 is released; S0 still
    holds a block), then frees the small block and allocates 5 MiB again, which needs a new 20 MiB
    segment on the device (1 MiB < 5 MiB < 10 MiB -> large_segment_size)."""
    trace = [
        ev("segment_alloc", S0, 2 * MiB), ev("alloc", S0, 100),
        ev("segment_alloc", L0, 20 * MiB), ev("alloc", L0, 5 * MiB), *free(L0, 5 * MiB),
        ev("segment_free", L0, 20 * MiB),  # empty_cache(): the next entry is a request
        *free(S0, 100),
        ev("segment_alloc", L1, 20 * MiB), ev("alloc", L1, 5 * MiB),
    ]
    final = [seg(S0, 2 * MiB, "small", [(2 * MiB, "inactive")]),
             seg(L1, 20 * MiB, "large", [(5 * MiB, "active_allocated"), (15 * MiB, "inactive")])]
    return {"segments": final, "device_traces": [trace]}


def test_program_release_replayed_as_empty_cache_by_default():
    from oomtune.trace.replay import replay_snapshot

    snap = empty_cache_snapshot()
    r = replay_snapshot(snap)
    assert r.releases == [{"trace_index": 6, "count": 1, "explicit": True, "rule": "request stream"}]
    # Requests: alloc#0 (S0), alloc#1 (L0), free#2 (L0); empty_cache before request #3; free#3 (S0),
    # alloc#4 (L1) needs a new 20 MiB segment.
    assert r.recorded_segment_events == r.simulated_segment_events == [
        ["segment_alloc", 2 * MiB, 0], ["segment_alloc", 20 * MiB, 1], ["segment_free", 20 * MiB, 3],
        ["segment_alloc", 20 * MiB, 4]]
    assert r.first_divergence is None and r.exact
    assert r.recorded_peak_reserved_bytes == r.peak_reserved_bytes == 22 * MiB

    ignored = replay_snapshot(snap, releases="none")
    assert ignored.simulated_segment_allocs == [2 * MiB, 20 * MiB]  # the cached 20 MiB is reused
    assert ignored.divergence == {"index": 2, "recorded": ["segment_free", 20 * MiB, 3],
                                  "simulated": None}
    assert ignored.simulated_final_reserved_bytes == ignored.recorded_final_reserved_bytes == 22 * MiB


def test_budget_too_small_for_starting_state():
    from oomtune.trace.replay import replay_snapshot

    r = replay_snapshot(pre_existing_snapshot(), total_memory_bytes=10 * MiB)  # < the 20 MiB segment
    assert r.oom and r.oom_at["phase"] == "initial_state" and r.oom_at["event_index"] is None
    assert r.events_replayed == 0


def test_rebuild_undoes_expandable_segment_mappings():
    # Final: one expandable segment at L1 with 40 MiB mapped. The trace mapped 20 MiB, then 20 MiB more
    # at its end: before recording nothing was mapped. A map before the trace (10 MiB) that the trace
    # then extends by 20 MiB leaves 10 MiB at the start.
    def expandable(size, blocks):
        s = seg(L1, size, "large", blocks)
        s["is_expandable"] = True
        return s

    trace = [ev("segment_map", L1, 20 * MiB), ev("alloc", L1, 30 * MiB),
             ev("segment_map", L1 + 20 * MiB, 20 * MiB)]
    snap = {"segments": [expandable(40 * MiB, [(30 * MiB, "active_allocated"), (10 * MiB, "inactive")])],
            "device_traces": [trace]}
    assert rebuild_initial_state(snap).reserved_bytes == 0
    grown = {"segments": [expandable(30 * MiB, [(30 * MiB, "inactive")])],
             "device_traces": [[ev("segment_map", L1 + 10 * MiB, 20 * MiB)]]}
    state = rebuild_initial_state(grown)
    assert [(s.address, s.total_size_bytes) for s in state.segments] == [(L1, 10 * MiB)]
