"""Property tests of the virtual GPU on random alloc/free streams (hypothesis).

Invariants of DeviceCachingAllocator that must hold after every call, whatever the settings:
blocks tile their segments without overlap, adjacent free blocks are merged, byte sums agree with
the statistics (allocated <= reserved == sum of segment sizes), peaks never fall and never lie below
the current value, and the device (and fraction) limits hold.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oomtune.alloc.settings import AllocatorSettings
from oomtune.alloc.sim import CachingAllocatorSim, SimulatedOutOfMemoryError
from oomtune.alloc.stream import AllocationStream, replay_stream

MiB = 1 << 20

CONFIGS = [
    None,
    AllocatorSettings(max_split_size_bytes=64 * MiB),
    AllocatorSettings(max_split_size_bytes=40 * MiB, max_non_split_rounding_bytes=60 * MiB),
    AllocatorSettings(expandable_segments=True),
    AllocatorSettings(roundup_power2_divisions=(4,) * 16),
    AllocatorSettings(garbage_collection_threshold=0.6),
    AllocatorSettings(garbage_collection_threshold=0.5, max_split_size_bytes=32 * MiB),
]

sizes = st.one_of(st.integers(1, 2 * MiB), st.integers(MiB, 12 * MiB), st.integers(10 * MiB, 160 * MiB))
ops = st.lists(st.one_of(
    st.tuples(st.just("alloc"), sizes, st.integers(0, 1)),
    st.tuples(st.just("free"), st.integers(0, 1 << 30)),
    st.tuples(st.just("empty")),
), min_size=1, max_size=60)

PEAK_KEYS = ("allocated_bytes.all", "reserved_bytes.all", "active_bytes.all", "segment.all",
             "allocation.all", "requested_bytes.all", "inactive_split_bytes.all")


def check_invariants(sim: CachingAllocatorSim, live: dict[int, int], expandable: bool,
                     prev_peaks: dict[str, int]) -> dict[str, int]:
    snap, stats = sim.memory_snapshot(), sim.memory_stats()
    reserved = stats["reserved_bytes.all.current"]
    assert reserved == sim.reserved_bytes == sum(s["total_size"] for s in snap)
    assert sim.allocated_bytes <= reserved
    assert reserved <= sim.total_memory_bytes
    assert sim.device_free_bytes >= 0
    if sim.allowed_bytes is not None and not expandable:   # expandable maps whole 20 MiB pages
        assert reserved <= sim.allowed_bytes
    end = -1
    allocated, inactive_split, inactive_split_n = {}, 0, 0
    for seg in snap:
        assert seg["address"] >= end                       # segments never overlap
        addr = seg["address"]
        prev_free = False
        for b in seg["blocks"]:
            assert b["address"] == addr and b["size"] > 0 and b["size"] % 512 == 0
            addr += b["size"]
            free = b["state"] == "inactive"
            assert not (free and prev_free)                 # free neighbours are always merged
            prev_free = free
            if not free:
                allocated[b["address"]] = b["requested_size"]
            elif len(seg["blocks"]) > 1:
                inactive_split += b["size"]
                inactive_split_n += 1
        assert addr - seg["address"] == seg["total_size"]   # blocks tile the segment
        end = addr
    assert allocated == live                                # exactly the live blocks, same requests
    assert stats["requested_bytes.all.current"] == sum(live.values())
    assert stats["allocation.all.current"] == len(live)
    assert stats["allocated_bytes.all.current"] == sum(s["allocated_size"] for s in snap)
    if not expandable:
        assert stats["segment.all.current"] == len(snap)
        assert stats["inactive_split_bytes.all.current"] == inactive_split
        assert stats["inactive_split.all.current"] == inactive_split_n
    peaks = {}
    for key in PEAK_KEYS:
        peaks[key] = stats[key + ".peak"]
        assert peaks[key] >= stats[key + ".current"]
        assert peaks[key] >= prev_peaks.get(key, 0)
        for pool in ("small_pool", "large_pool"):
            k = key.replace(".all", "." + pool)
            assert stats[k + ".current"] >= 0
    return peaks


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, config=st.sampled_from(CONFIGS), total_mib=st.integers(64, 1024),
       fraction=st.sampled_from([1.0, 0.9, 0.6]), context_mib=st.integers(0, 32))
def test_invariants_hold_on_random_streams(ops, config, total_mib, fraction, context_mib):
    sim = CachingAllocatorSim(config, total_memory_bytes=total_mib * MiB,
                              non_allocator_bytes=context_mib * MiB, memory_fraction=fraction)
    expandable = bool(config is not None and config.expandable_segments)
    live: dict[int, int] = {}
    order: list[int] = []
    peaks: dict[str, int] = {}
    for op in ops:
        if op[0] == "alloc":
            try:
                addr = sim.malloc(op[1], op[2])
            except SimulatedOutOfMemoryError as exc:
                assert exc.requested_bytes > 0 and exc.free_bytes == sim.device_free_bytes
                continue
            assert addr not in live
            live[addr] = op[1]
            order.append(addr)
        elif op[0] == "free" and order:
            addr = order.pop(op[1] % len(order))
            sim.free(addr)
            del live[addr]
        elif op[0] == "empty":
            sim.empty_cache()
        peaks = check_invariants(sim, live, expandable, peaks)
    for addr in order:
        sim.free(addr)
    sim.empty_cache()
    assert sim.reserved_bytes == 0 and sim.allocated_bytes == 0   # everything returns to the device


def to_stream(ops) -> AllocationStream:
    stream, live, key = AllocationStream(), [], 0
    for op in ops:
        if op[0] == "alloc":
            key += 1
            stream.append_alloc(key, op[1], op[2])
            live.append(key)
        elif op[0] == "free" and live:
            stream.append_free(live.pop(op[1] % len(live)))
    return stream


@settings(max_examples=150, deadline=None)
@given(ops=ops, total_mib=st.integers(32, 512), extra_mib=st.integers(1, 512))
def test_a_stream_that_fits_still_fits_with_more_memory(ops, total_mib, extra_mib):
    stream = to_stream(ops)
    small = replay_stream(stream, None, total_memory_bytes=total_mib * MiB)
    if small.oom:
        return
    big = replay_stream(stream, None, total_memory_bytes=(total_mib + extra_mib) * MiB)
    assert not big.oom
    assert big.peak_requested_bytes == small.peak_requested_bytes   # the same requests were served
    if small.num_alloc_retries == 0:                                 # no cache flush: identical run
        assert big.peak_allocated_bytes == small.peak_allocated_bytes   # same blocks handed out
        assert big.memory_stats == small.memory_stats


def test_a_cache_flush_changes_which_blocks_serve_later_requests():
    """With less memory, the release-and-retry of a large request frees a cached 20 MiB segment, so a
    later 11 MiB request gets a fresh 12 MiB segment whose 1 MiB remainder is not split off
    (CUDACachingAllocator.cpp ``shouldSplit``: a large block splits only when the remainder is
    > kSmallSize = 1 MiB): 12 MiB allocated. With more memory the cached 20 MiB block serves it and is
    split: 11 MiB (rounded to 512 B) allocated. Hand calculation; the example hypothesis found."""
    stream = AllocationStream()
    stream.append_alloc(1, 1048577, 0)         # rounds to 1 MiB + 512 B -> a 20 MiB segment
    stream.append_free(1)
    stream.append_alloc(2, 117440512, 1)       # 112 MiB on another stream
    stream.append_alloc(3, 11533825, 0)        # rounds to 11,534,336 B; segment rounds to 12 MiB
    small = replay_stream(stream, None, total_memory_bytes=125 * MiB)
    big = replay_stream(stream, None, total_memory_bytes=211 * MiB)
    assert not small.oom and not big.oom
    assert small.num_alloc_retries == 1 and big.num_alloc_retries == 0
    assert small.peak_allocated_bytes == 117440512 + 12 * MiB
    assert big.peak_allocated_bytes == 117440512 + 11534336
    assert small.peak_requested_bytes == big.peak_requested_bytes == 117440512 + 11533825
