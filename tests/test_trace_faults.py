"""Real-trace replay faults the virtual GPU once had, each on a small hand-made snapshot in torch's format.

Expected values are worked out by hand from c10/cuda/CUDACachingAllocator.cpp (round to 512 B; a
large-pool block is split only when the remainder is > 1 MiB, ``should_split``; <= 1 MiB -> small
pool and a 2 MiB segment; ``release_cached_blocks`` frees whole cached segments in (stream, size,
address) order, large pool first; expandable large-pool pages are 20 MiB by default).
"""

from __future__ import annotations

import pickle

import pytest

from oomtune.exceptions import SnapshotError
from oomtune.trace import devices_with_data, loads_snapshot, replay_snapshot
from oomtune.trace.initial_state import rebuild_initial_state
from oomtune.trace.recorded import recorded_settings

MiB = 1 << 20
S0, L0, L1, L2 = 0x7F0000000000, 0x7F0001000000, 0x7F0003000000, 0x7F0006000000
EMPTY_CACHE_FRAMES = [{"name": "c10::cuda::CUDACachingAllocator::Native::NativeCachingAllocator::emptyCache()",
                       "filename": "", "line": 0},
                      {"name": "empty_cache", "filename": "torch/cuda/memory.py", "line": 218}]


def ev(action, addr, size, frames=()):
    return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": 0, "frames": list(frames)}


def free(addr, size):
    return [ev("free_requested", addr, size), ev("free_completed", addr, size)]


def seg(addr, size, pool, blocks, expandable=False, device=0):
    out, a = [], addr
    for s, st in blocks:
        out.append({"address": a, "size": s, "requested_size": s, "state": st, "frames": []})
        a += s
    return {"device": device, "address": addr, "total_size": size, "stream": 0, "segment_type": pool,
            "is_expandable": expandable, "frames": [], "blocks": out}


# -- an oom entry (snapshot dumped after an out-of-memory error) ----------------------------------
def test_snapshot_with_oom_entry_is_accepted():
    """torch/csrc/cuda/memory_snapshot.cpp writes ``device_free`` instead of ``addr`` for an OOM."""
    snap = {"segments": [], "device_traces": [[
        {"action": "oom", "device_free": 95682560, "size": 5308694528, "stream": 0, "time_us": 1}]]}
    assert loads_snapshot(pickle.dumps(snap)) == snap
    bad = {"segments": [], "device_traces": [[{"action": "oom", "size": 1, "stream": 0}]]}
    with pytest.raises(SnapshotError, match="device_free=None"):
        loads_snapshot(pickle.dumps(bad))


def test_oom_entry_replayed_as_a_failing_request_and_limit_inferred():
    """5 MiB -> a 20 MiB segment. A 30 MiB request on a device with 22 MiB reserved and 10 MiB free
    (device_free) fails: the
    limit is 22 + 10 = 32 MiB exactly; the replay repeats the OOM there and nothing else."""
    trace = [ev("segment_alloc", S0, 2 * MiB), ev("alloc", S0, 100),
             ev("segment_alloc", L0, 20 * MiB), ev("alloc", L0, 5 * MiB),
             {"action": "oom", "device_free": 10 * MiB, "size": 30 * MiB, "stream": 0, "time_us": 0}]
    snap = {"segments": [seg(S0, 2 * MiB, "small", [(512, "active_allocated"), (2 * MiB - 512, "inactive")]),
                         seg(L0, 20 * MiB, "large", [(5 * MiB, "active_allocated"), (15 * MiB, "inactive")])],
            "device_traces": [trace]}
    r = replay_snapshot(loads_snapshot(pickle.dumps(snap)))
    assert r.device_limit["used_bytes"] == 32 * MiB and r.device_limit["low_bytes"] == 22 * MiB
    assert r.recorded_segment_events == r.simulated_segment_events == [
        ["segment_alloc", 2 * MiB, 0], ["segment_alloc", 20 * MiB, 1], ["oom", 30 * MiB, 2]]
    assert r.exact and r.oom_at is None and r.simulated_ooms == r.recorded_ooms == 1


# -- recorded settings are the default replay settings --------------------------------------------
def test_recorded_settings_read():
    rec = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,max_split_size_mb:512",
           "max_split_size": 512 * MiB, "garbage_collection_threshold": 0.0, "expandable_segments": True,
           "roundup_power2_divisions": {str(1 << i): (4 if i == 2 else 0) for i in range(16)}}
    settings, note = recorded_settings({"allocator_settings": rec})
    assert note is None and settings.expandable_segments and settings.max_split_size_bytes == 512 * MiB
    assert settings.roundup_power2_divisions[2] == 4 and sum(settings.roundup_power2_divisions) == 4
    unlimited, _ = recorded_settings({"allocator_settings": dict(rec, max_split_size=-1)})
    assert unlimited.max_split_size_bytes is None        # -1: SIZE_MAX read as int64
    assert recorded_settings({}) == (None, None)


def expandable_snapshot():
    """expandable_segments:True recorded: a 30 MiB request maps two 20 MiB pages (40 MiB)."""
    trace = [ev("segment_map", L0, 40 * MiB), ev("alloc", L0, 30 * MiB)]
    return {"segments": [seg(L0, 40 * MiB, "large", [(30 * MiB, "active_allocated"), (10 * MiB, "inactive")],
                             expandable=True)],
            "device_traces": [trace],
            "allocator_settings": {"expandable_segments": True, "max_split_size": -1}}


def test_recorded_settings_used_by_default_and_conf_overrides():
    r = replay_snapshot(expandable_snapshot())
    assert r.settings_source == "recorded" and r.settings == "expandable_segments:True"
    assert r.simulated_segment_events == [["segment_map", 40 * MiB, 0]] and r.exact
    other = replay_snapshot(expandable_snapshot(), "")        # torch defaults: a 30 MiB cudaMalloc
    assert other.settings_source == "given"
    assert other.divergence == {"index": 0, "recorded": ["segment_map", 40 * MiB, 0],
                                "simulated": ["segment_alloc", 30 * MiB, 0]}


def test_starting_state_of_other_kind_is_reported_approximate():
    """The starting 20 MiB segment is a plain cudaMalloc one; under expandable settings it can only
    be carved as mapped pages: said, not hidden."""
    snap = {"segments": [seg(L0, 20 * MiB, "large", [(12 * MiB, "active_allocated"), (8 * MiB, "inactive")])],
            "device_traces": [[ev("alloc", L0 + 12 * MiB, 4 * MiB)]]}
    snap["segments"][0]["blocks"][1]["state"] = "active_allocated"
    snap["segments"][0]["blocks"][1]["size"] = 4 * MiB
    snap["segments"][0]["blocks"].append({"address": L0 + 16 * MiB, "size": 4 * MiB, "requested_size": 0,
                                          "state": "inactive", "frames": []})
    r = replay_snapshot(snap, "expandable_segments:True")
    assert not r.initial_state_exact
    assert any("could not be reproduced exactly" in n for n in r.notes)
    assert replay_snapshot(snap).initial_state_exact


# -- explicit empty_cache vs release-and-retry ----------------------------------------------------
def test_frames_decide_before_the_device_limit():
    """Frames naming empty_cache make the release the program's, although the next entry is a new
    segment (which without frames the device-limit rule would call the allocator's: reserved 20 +
    needed 20 > peak 20)."""
    trace = [ev("segment_alloc", L0, 20 * MiB), ev("alloc", L0, 5 * MiB), *free(L0, 5 * MiB),
             ev("segment_free", L0, 20 * MiB, EMPTY_CACHE_FRAMES),
             ev("segment_alloc", L1, 20 * MiB), ev("alloc", L1, 5 * MiB)]
    snap = {"segments": [seg(L1, 20 * MiB, "large", [(5 * MiB, "active_allocated"), (15 * MiB, "inactive")])],
            "device_traces": [trace]}
    r = replay_snapshot(snap)
    assert r.releases == [{"trace_index": 4, "count": 1, "explicit": True, "rule": "frames"}]
    assert r.device_limit is None and r.budget_source == "default" and r.exact
    for e in trace:
        e["frames"] = []
    r = replay_snapshot(snap)
    # Without frames: reserved 20 + needed 20 > peak 20 fits a full device (rule 3), but the free
    # cached 20 MiB segment would serve the 5 MiB request (get_free_block comes before any
    # release), so the release was the program's: the cached-block rule decides, and the device
    # limit that rule 3 suggested is dropped.
    assert r.releases == [{"trace_index": 4, "count": 1, "explicit": True, "rule": "cached block"}]
    assert r.device_limit is None and r.budget_source == "default" and r.exact


def test_all_segment_events_compared_free_order_included():
    """empty_cache (release_blocks) frees cached segments in size order: 20 MiB before 40 MiB. A
    recording that shows 40 first differs at the first free although every alloc agrees."""
    trace = [ev("segment_alloc", L0, 20 * MiB), ev("alloc", L0, 5 * MiB),
             ev("segment_alloc", L2, 40 * MiB), ev("alloc", L2, 40 * MiB),
             *free(L0, 5 * MiB), *free(L2, 40 * MiB),
             ev("segment_free", L2, 40 * MiB, EMPTY_CACHE_FRAMES),
             ev("segment_free", L0, 20 * MiB, EMPTY_CACHE_FRAMES)]
    r = replay_snapshot({"segments": [], "device_traces": [trace]})
    assert r.simulated_segment_allocs == r.recorded_segment_allocs == [20 * MiB, 40 * MiB]
    assert r.divergence == {"index": 2, "recorded": ["segment_free", 40 * MiB, 4],
                            "simulated": ["segment_free", 20 * MiB, 4]}
    assert not r.exact


# -- the starting state ---------------------------------------------------------------------------
def test_unsplit_tail_stays_in_its_block():
    """A 20 MiB large segment held, before recording, a block whose request was 19.5 MiB: the
    remainder 0.5 MiB <= 1 MiB was never split off (should_split), so the block is 20 MiB. Rebuilt
    from the trace's free entry alone it would be 19.5 MiB with a 0.5 MiB gap, which the old rebuild
    requested as its own (small-pool) piece: +2 MiB reserved."""
    trace = [*free(L0, 19 * MiB + MiB // 2), ev("alloc", L0, 15 * MiB)]
    snap = {"segments": [seg(L0, 20 * MiB, "large", [(15 * MiB, "active_allocated"), (5 * MiB, "inactive")])],
            "device_traces": [trace]}
    (s,) = rebuild_initial_state(snap).segments
    assert [(b.offset_bytes, b.size_bytes) for b in s.live_blocks] == [(0, 20 * MiB)]
    r = replay_snapshot(snap)
    assert r.simulated_final_reserved_bytes == r.recorded_final_reserved_bytes == 20 * MiB and r.exact


def test_mid_range_unmap_rebuilt():
    """Expandable segment at L0: the final snapshot lists two mapped ranges, [0, 20) and [40, 60) MiB,
    because the trace unmapped [20, 40) in the middle; before the trace [0, 60) was mapped."""
    trace = [*free(L0 + 20 * MiB, 20 * MiB), ev("segment_unmap", L0 + 20 * MiB, 20 * MiB)]
    snap = {"segments": [seg(L0, 20 * MiB, "large", [(20 * MiB, "active_allocated")], expandable=True),
                         seg(L0 + 40 * MiB, 20 * MiB, "large", [(20 * MiB, "active_allocated")], expandable=True)],
            "device_traces": [trace]}
    state = rebuild_initial_state(snap)
    assert [(s.address, s.total_size_bytes, s.is_expandable) for s in state.segments] == [(L0, 60 * MiB, True)]
    assert [(b.offset_bytes, b.size_bytes) for b in state.segments[0].live_blocks] == [
        (0, 20 * MiB), (20 * MiB, 20 * MiB), (40 * MiB, 20 * MiB)]


# -- several devices ------------------------------------------------------------------------------
def test_multi_device_default_is_a_device_with_events():
    trace = [ev("segment_alloc", S0, 2 * MiB), ev("alloc", S0, 100)]
    snap = {"segments": [seg(S0, 2 * MiB, "small", [(512, "active_allocated"), (2 * MiB - 512, "inactive")],
                             device=1)],
            "device_traces": [[], trace, []]}
    assert devices_with_data(snap) == [1]
    r = replay_snapshot(snap)
    assert r.device == 1 and r.devices_with_data == [1] and r.exact
    assert r.recorded_segment_events == [["segment_alloc", 2 * MiB, 0]]
    empty = replay_snapshot(snap, device=2)
    assert empty.recorded_segment_events == [] and empty.devices_with_data == [1]
    assert any("device 2 holds no trace entries or segments; devices with data: 1" in n for n in empty.notes)
    assert empty.exact is False   # nothing compared: never "exact"
