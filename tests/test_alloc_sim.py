"""Unit tests of the virtual GPU (CachingAllocatorSim). Every expected value is worked out by hand
from the rules of DeviceCachingAllocator (c10/cuda/CUDACachingAllocator.cpp), shown in comments."""

from __future__ import annotations

import pickle

import pytest
import torch

from oomtune.alloc._blocks import division_index, get_allocation_size, round_size, roundup_power2_next_division
from oomtune.alloc.oom_message import SIMULATED_PREFIX, format_size
from oomtune.alloc.settings import AllocatorSettings
from oomtune.alloc.sim import ADDRESS_BASE, CachingAllocatorSim, SimulatedOutOfMemoryError
from oomtune.exceptions import AllocatorConfigError, ConfigError

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def sim(settings=None, total=8 * GiB, **kw) -> CachingAllocatorSim:
    return CachingAllocatorSim(settings, total_memory_bytes=total, record_segment_events=True, **kw)


def divs(**by_index: int) -> tuple[int, ...]:
    d = [0] * 16
    for k, v in by_index.items():
        d[int(k[1:])] = v
    return tuple(d)


# -- rounding -------------------------------------------------------------------------------------
@pytest.mark.parametrize("n, expected", [(1, 512), (511, 512), (512, 512), (513, 1024), (1024, 1024),
                                         (1025, 1536), (MiB + 1, MiB + 512)])
def test_round_size_512_steps(n, expected):
    assert round_size(n) == expected


def test_next_division_examples_from_source_comment():
    assert roundup_power2_next_division(1200, 4) == 1280          # 1024, 1280, 1536, 1792
    assert roundup_power2_next_division(4096, 4) == 4096          # powers of two are kept
    assert roundup_power2_next_division(1200, 4096) == 2048       # step 1024 >> 12 == 0 -> 2 * 1024
    assert roundup_power2_next_division(1280, 4) == 1280          # already on a step


@pytest.mark.parametrize("n, expected", [(512, 0), (2 * MiB - 1, 0), (2 * MiB, 1), (300 * MiB, 8),
                                         (64 * GiB, 15), (1 << 40, 15)])
def test_division_index(n, expected):
    assert division_index(n) == expected                          # clamp(floor(log2 n) - 20, 0, 15)


def test_round_size_with_divisions():
    d = divs(i0=8, i8=4)
    assert round_size(1000, d) == 1024             # 1000 <= 512 * 8: plain 512 rounding
    # 100000: floor pow2 65536, step 65536 / 8 = 8192 -> 98304 + 8192
    assert round_size(100_000, d) == 106_496
    # 300 MiB: index 8, d=4: steps 256, 320, 384, 448 MiB -> 320 MiB
    assert round_size(300 * MiB, d) == 320 * MiB
    assert round_size(100_000, divs(i0=1)) == 100_352              # d = 1: option off


def test_divisions_setting_changes_block_size():
    s = sim(AllocatorSettings(roundup_power2_divisions=divs(i8=4)))
    s.malloc(300 * MiB)
    # rounded 320 MiB -> segment 320 MiB (multiple of 2 MiB), allocated whole
    assert s.allocated_bytes == 320 * MiB and s.reserved_bytes == 320 * MiB


# -- pools and segment sizes ----------------------------------------------------------------------
def test_segment_sizes():
    assert get_allocation_size(512) == 2 * MiB
    assert get_allocation_size(MiB) == 2 * MiB
    assert get_allocation_size(MiB + 512) == 20 * MiB
    assert get_allocation_size(10 * MiB - 512) == 20 * MiB
    assert get_allocation_size(10 * MiB) == 10 * MiB               # not < kMinLargeAlloc
    assert get_allocation_size(11 * MiB) == 12 * MiB
    assert get_allocation_size(5 * MiB, 32 * MiB) == 32 * MiB      # large_segment_size


def test_100_byte_request_reserves_small_2mib_segment():
    s = sim()
    s.malloc(100)
    st = s.memory_stats()
    assert s.reserved_bytes == 2 * MiB and s.allocated_bytes == 512
    assert st["segment.small_pool.current"] == 1 and st["segment.large_pool.current"] == 0
    assert st["requested_bytes.all.current"] == 100


def test_one_mib_is_small_one_mib_plus_one_is_large():
    s = sim()
    s.malloc(MiB)
    assert s.reserved_bytes == 2 * MiB
    s.malloc(MiB + 1)                                               # rounds to 1 MiB + 512: large pool
    st = s.memory_stats()
    assert st["reserved_bytes.large_pool.current"] == 20 * MiB
    assert st["allocated_bytes.large_pool.current"] == MiB + 512


def test_5mib_request_reserves_20mib_segment_and_splits():
    s = sim()
    a = s.malloc(5 * MiB)
    st = s.memory_stats()
    assert a == ADDRESS_BASE and s.reserved_bytes == 20 * MiB and s.allocated_bytes == 5 * MiB
    assert st["inactive_split.large_pool.current"] == 1
    assert st["inactive_split_bytes.all.current"] == 15 * MiB


def test_11_5mib_request_is_not_split():
    s = sim()
    s.malloc(11 * MiB + 512 * KiB)
    # segment 12 MiB; remainder 0.5 MiB <= 1 MiB (kSmallSize): handed out whole
    assert s.reserved_bytes == 12 * MiB and s.allocated_bytes == 12 * MiB
    assert s.memory_stats()["inactive_split.all.current"] == 0


def test_large_segment_size_setting():
    s = sim(AllocatorSettings(large_segment_size_bytes=32 * MiB, max_non_split_rounding_bytes=32 * MiB))
    s.malloc(5 * MiB)
    assert s.reserved_bytes == 32 * MiB


# -- best fit, split, merge -----------------------------------------------------------------------
def test_split_and_merge():
    s = sim()
    a = s.malloc(5 * MiB)
    b = s.malloc(5 * MiB)                     # best fit: the 15 MiB remainder, split again
    assert b == a + 5 * MiB and s.reserved_bytes == 20 * MiB
    s.free(a)                                 # neighbours: none before, b allocated after
    st = s.memory_stats()
    assert st["inactive_split.all.current"] == 2 and st["inactive_split_bytes.all.current"] == 15 * MiB
    s.free(b)                                 # merges with a (before) and the 10 MiB rest (after)
    st = s.memory_stats()
    assert st["inactive_split.all.current"] == 0 and st["inactive_split_bytes.all.current"] == 0
    (seg,) = s.memory_snapshot()
    assert seg["total_size"] == 20 * MiB and len(seg["blocks"]) == 1
    assert seg["blocks"][0]["state"] == "inactive" and seg["blocks"][0]["address"] == a


def test_best_fit_smallest_then_lowest_address():
    s = sim()
    x, y = s.malloc(14 * MiB), s.malloc(12 * MiB)
    s.free(x), s.free(y)
    assert s.malloc(11 * MiB) == y            # 12 MiB block is the smallest that fits
    s2 = sim()
    p, q = s2.malloc(12 * MiB), s2.malloc(12 * MiB)
    s2.free(q), s2.free(p)
    assert p < q and s2.malloc(12 * MiB) == p  # equal sizes: lowest address


def test_blocks_are_per_stream():
    s = sim()
    a = s.malloc(12 * MiB, stream=1)
    s.free(a)
    b = s.malloc(12 * MiB, stream=0)
    assert b != a and s.reserved_bytes == 24 * MiB


# -- oversize rules -------------------------------------------------------------------------------
def test_max_split_size_oversize_rules():
    s = sim(AllocatorSettings(max_split_size_bytes=100 * MiB))
    big = s.malloc(200 * MiB)
    st = s.memory_stats()
    assert st["oversize_segments.current"] == 1 and st["oversize_allocations.current"] == 1
    assert st["max_split_size"] == 100 * MiB
    s.free(big)
    s.malloc(50 * MiB)                        # < max_split may not take the 200 MiB block
    assert s.reserved_bytes == 250 * MiB
    c = s.malloc(190 * MiB)                   # 200 < 190 + 20: taken whole, not split
    assert c == big and s.allocated_bytes == 250 * MiB
    s.free(c)
    s.malloc(150 * MiB)                       # 200 >= 150 + 20: refused, new segment
    assert s.reserved_bytes == 400 * MiB


def test_max_non_split_rounding():
    s = sim(AllocatorSettings(max_split_size_bytes=100 * MiB, max_non_split_rounding_bytes=60 * MiB))
    big = s.malloc(200 * MiB)
    s.free(big)
    assert s.malloc(150 * MiB) == big         # 200 < 150 + 60
    assert s.reserved_bytes == 200 * MiB and s.allocated_bytes == 200 * MiB


def test_release_available_cached_blocks_frees_largest_oversize_first():
    s = sim(AllocatorSettings(max_split_size_bytes=100 * MiB), total=500 * MiB)
    a, b = s.malloc(200 * MiB), s.malloc(150 * MiB)
    s.free(a), s.free(b)
    s.malloc(300 * MiB)   # no cached fit; cudaMalloc 300 > 150 free; release 200 then 150 (>= 300)
    frees = [(e["action"], e["size"]) for e in s.segment_events if e["action"] == "segment_free"]
    assert frees == [("segment_free", 200 * MiB), ("segment_free", 150 * MiB)]
    st = s.memory_stats()
    assert s.reserved_bytes == 300 * MiB and st["num_alloc_retries"] == 0
    assert st["num_sync_all_streams"] == 0


# -- retry chain, fraction, OOM -------------------------------------------------------------------
def test_release_cached_blocks_counts_a_retry():
    s = sim(total=100 * MiB)
    s.free(s.malloc(40 * MiB))
    s.malloc(80 * MiB)             # 80 > 60 free -> release_cached_blocks frees the 40 -> retry ok
    st = s.memory_stats()
    assert st["num_alloc_retries"] == 1 and st["num_sync_all_streams"] == 1 and st["num_ooms"] == 0
    assert s.reserved_bytes == 80 * MiB and st["num_device_free"] == 1


def test_memory_fraction_limit():
    s = sim(total=1000 * MiB, memory_fraction=0.5)   # allowed 500 MiB
    s.malloc(400 * MiB)
    s.malloc(100 * MiB)                               # 400 + 100 == 500: not above the limit
    with pytest.raises(SimulatedOutOfMemoryError) as ei:
        s.malloc(2 * MiB + 512 * KiB)                 # rounds to 2.5 MiB, segment 20 MiB
    e = ei.value
    assert e.allowed_bytes == 500 * MiB and e.requested_bytes == 20 * MiB
    assert e.free_bytes == 500 * MiB and e.reserved_bytes == 500 * MiB
    assert "500.00 MiB allowed; " in str(e)
    st = s.memory_stats()
    assert st["num_ooms"] == 1 and st["num_alloc_retries"] == 1


def test_oom_message_numbers():
    s = sim(total=GiB, non_allocator_bytes=100 * MiB)
    s.malloc(600 * MiB)
    with pytest.raises(SimulatedOutOfMemoryError) as ei:
        s.malloc(400 * MiB)        # free 1024 - 100 - 600 = 324 MiB < 400
    e = ei.value
    assert str(e) == (
        SIMULATED_PREFIX + "CUDA out of memory. Tried to allocate 400.00 MiB. GPU 0 has a total capacity "
        "of 1024.00 MiB of which 324.00 MiB is free. Including non-PyTorch memory, this process has "
        "700.00 MiB memory in use. Of the allocated memory 600.00 MiB is allocated by PyTorch, and 0 bytes "
        "is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for "
        "Memory Management  (https://docs.pytorch.org/docs/stable/notes/cuda.html"
        "#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)")
    assert (e.requested_bytes, e.request_size_bytes, e.allocated_bytes, e.reserved_bytes) == \
        (400 * MiB, 400 * MiB, 600 * MiB, 600 * MiB)
    assert (e.free_bytes, e.total_bytes, e.allowed_bytes, e.device_index) == (324 * MiB, GiB, None, 0)


def test_oom_error_is_a_torch_oom_and_pickles():
    s = sim(total=64 * MiB, device_index=3)
    with pytest.raises(torch.OutOfMemoryError) as ei:
        s.malloc(100 * MiB)
    assert isinstance(ei.value, RuntimeError) and "GPU 3 has" in str(ei.value)
    back = pickle.loads(pickle.dumps(ei.value))
    assert type(back) is type(ei.value) and isinstance(back, SimulatedOutOfMemoryError)
    assert isinstance(back, torch.OutOfMemoryError) and back.requested_bytes == 100 * MiB
    assert str(back) == str(ei.value) and back.gpu_index == 3


@pytest.mark.parametrize("n, text", [(0, "0 bytes"), (1024, "1024 bytes"), (1025, "1.00 KiB"),
                                     (MiB, "1024.00 KiB"), (MiB + 1, "1.00 MiB"), (GiB, "1024.00 MiB"),
                                     (GiB + 1, "1.00 GiB"), (int(2.51 * GiB), "2.51 GiB")])
def test_format_size(n, text):
    assert format_size(n) == text


# -- field case C8 (pytorch/pytorch#35901) ---------------------------------------------------------
C8_TOTAL = int(23.65 * GiB)
C8_BIG = int(10.84 * GiB)              # segment: 10.84 GiB = 11100.16 MiB -> 11102 MiB
C8_SEG = 11102 * MiB
C8_FREE = int(10.26 * GiB)             # device free after the big segment: as in the report
C8_SMALL = 17_000_000                  # "16-18 MB": rounds to 17,000,448 B (33204 x 512)


def c8(settings):
    s = sim(settings, total=C8_TOTAL, non_allocator_bytes=C8_TOTAL - C8_SEG - C8_FREE)
    s.free(s.malloc(C8_BIG))
    live = [s.malloc(C8_SMALL) for _ in range(30)]
    return s, live


def test_c8_default_settings_oom_by_fragmentation():
    s, _ = c8(None)
    # all 30 small tensors were carved from the cached 11102 MiB block: 11102 MiB - 30 x 17,000,448 B
    # = 10615.6 MiB cached < 10.84 GiB <= 10.26 GiB free + 10.37 GiB cached; the split segment
    # cannot be released, so cudaMalloc(11102 MiB) fails twice.
    assert s.reserved_bytes == C8_SEG
    with pytest.raises(SimulatedOutOfMemoryError) as ei:
        s.malloc(C8_BIG)
    msg = str(ei.value)
    assert "Tried to allocate 10.84 GiB" in msg and "of which 10.26 GiB is free" in msg
    assert "Of the allocated memory 486.39 MiB is allocated by PyTorch" in msg   # 30 x 17,000,448 B
    assert "and 10.37 GiB is reserved by PyTorch but unallocated" in msg
    st = s.memory_stats()
    assert st["num_alloc_retries"] == 1 and st["num_ooms"] == 1


def test_c8_max_split_size_succeeds():
    s, _ = c8(AllocatorSettings.parse("max_split_size_mb:1024"))
    s.malloc(C8_BIG)   # small tensors got their own 18 MiB segments; the oversize block is reused
    assert s.reserved_bytes == C8_SEG + 30 * 18 * MiB
    assert s.allocated_bytes == C8_SEG + 30 * 17_000_448
    assert s.memory_stats()["num_alloc_retries"] == 0


def test_c8_expandable_segments_succeeds():
    s, _ = c8(AllocatorSettings.parse("expandable_segments:True"))
    s.malloc(C8_BIG)
    # first request mapped ceil(11100.16 / 20) = 556 pages of 20 MiB; the second one extends the free
    # 10633.6 MiB run at the end by 24 pages (466.6 MiB needed) -> 580 pages
    assert s.reserved_bytes == 580 * 20 * MiB
    maps = [e["size"] for e in s.segment_events if e["action"] == "segment_map"]
    assert maps == [556 * 20 * MiB, 24 * 20 * MiB]
    st = s.memory_stats()
    assert st["segment.all.current"] == 0 and st["num_device_alloc"] == 2   # maps are not segments
    (seg,) = s.memory_snapshot()
    assert seg["is_expandable"] and seg["total_size"] == 580 * 20 * MiB


# -- garbage collection ---------------------------------------------------------------------------
def gc_scenario(threshold: float, fraction: float) -> CachingAllocatorSim:
    settings = AllocatorSettings(garbage_collection_threshold=threshold) if threshold else None
    s = sim(settings, total=1000 * MiB, memory_fraction=fraction)
    a = s.malloc(100 * MiB)     # large-pool get_free_block call 1
    b = s.malloc(120 * MiB)     # call 2
    s.free(a)                   # A cached at count 2
    c = s.malloc(130 * MiB)     # call 3
    s.free(b), s.free(c)        # B, C cached at count 3
    s.malloc(150 * MiB)         # call 4; reserved 350 <= threshold: no gc; reserved 500
    s.malloc(200 * MiB)         # call 5; 500 > 400 -> target 100; ages A 3, B 2, C 2, mean 7/3
    return s


def test_garbage_collection_frees_oldest_blocks():
    s = gc_scenario(0.5, 0.8)   # allowed 800 MiB, gc threshold 400 MiB
    frees = [e for e in s.segment_events if e["action"] == "segment_free"]
    assert [(e["addr"], e["size"]) for e in frees] == [(ADDRESS_BASE, 100 * MiB)]  # only A (age 3)
    assert s.reserved_bytes == 600 * MiB and s.memory_stats()["num_alloc_retries"] == 0


def test_garbage_collection_needs_a_memory_fraction():
    assert gc_scenario(0.5, 1.0).reserved_bytes == 700 * MiB   # no fraction set: no gc
    assert gc_scenario(0.0, 0.8).reserved_bytes == 700 * MiB   # no threshold: no gc


# -- empty_cache and expandable segments -----------------------------------------------------------
def test_empty_cache_releases_only_whole_free_segments():
    s = sim()
    a, b, c = s.malloc(5 * MiB), s.malloc(16 * MiB), s.malloc(100)   # 16 > 15 MiB left: own segment
    s.free(b), s.free(c)
    s.empty_cache()
    assert s.reserved_bytes == 20 * MiB        # a's split 20 MiB segment stays
    frees = [e["size"] for e in s.segment_events if e["action"] == "segment_free"]
    assert frees == [16 * MiB, 2 * MiB]        # large pool first, then small
    s.free(a)
    s.empty_cache()
    assert s.reserved_bytes == 0 and s.memory_stats()["num_sync_all_streams"] == 2


def test_expandable_maps_pages_and_empty_cache_unmaps_whole_free_pages():
    s = sim(AllocatorSettings(expandable_segments=True))
    a = s.malloc(30 * MiB)                     # maps 2 pages; split: 10 MiB free after a
    b = s.malloc(30 * MiB)                     # 10 MiB free + 1 new page -> exactly 30 MiB
    assert b == a + 30 * MiB and s.reserved_bytes == 60 * MiB and s.allocated_bytes == 60 * MiB
    s.free(a)
    s.empty_cache()                            # free [0, 30) MiB holds one whole page: [0, 20)
    assert s.reserved_bytes == 40 * MiB
    assert [(e["action"], e["addr"] - a, e["size"]) for e in s.segment_events] == [
        ("segment_map", 0, 40 * MiB), ("segment_map", 40 * MiB, 20 * MiB), ("segment_unmap", 0, 20 * MiB)]
    s.free(b)
    s.empty_cache()
    assert s.reserved_bytes == 0


def test_expandable_small_pool_page_is_2mib():
    s = sim(AllocatorSettings(expandable_segments=True))
    s.malloc(100)
    assert s.reserved_bytes == 2 * MiB


# -- API details ----------------------------------------------------------------------------------
def test_stats_keys_match_torch_layout():
    st = sim().memory_stats()
    for name in ("allocation", "segment", "active", "inactive_split", "allocated_bytes", "reserved_bytes",
                 "active_bytes", "inactive_split_bytes", "requested_bytes"):
        for pool in ("all", "large_pool", "small_pool"):
            for field in ("current", "peak", "allocated", "freed"):
                assert f"{name}.{pool}.{field}" in st
    for key in ("oversize_allocations.peak", "oversize_segments.freed", "num_alloc_retries", "num_ooms",
                "num_sync_all_streams", "num_device_alloc", "num_device_free"):
        assert key in st
    assert st["max_split_size"] == -1


def test_peaks_and_reset():
    s = sim()
    a = s.malloc(12 * MiB)
    s.free(a)
    st = s.memory_stats()
    assert st["allocated_bytes.all.peak"] == 12 * MiB and st["allocated_bytes.all.current"] == 0
    assert st["allocated_bytes.all.allocated"] == 12 * MiB and st["allocated_bytes.all.freed"] == 12 * MiB
    s.reset_peak_memory_stats()
    assert s.memory_stats()["allocated_bytes.all.peak"] == 0
    assert s.memory_stats()["reserved_bytes.all.peak"] == 12 * MiB   # still reserved (cached)


def test_bad_inputs():
    with pytest.raises(ConfigError):
        CachingAllocatorSim(total_memory_bytes=0)
    with pytest.raises(ConfigError):
        CachingAllocatorSim(total_memory_bytes=GiB, non_allocator_bytes=2 * GiB)
    with pytest.raises(ConfigError):
        CachingAllocatorSim(total_memory_bytes=GiB, memory_fraction=1.5)
    with pytest.raises(AllocatorConfigError):
        CachingAllocatorSim("backend:cudaMallocAsync", total_memory_bytes=GiB)
    s = sim()
    with pytest.raises(ConfigError):
        s.free(12345)
    with pytest.raises(ConfigError):
        s.malloc(-1)


def test_settings_string_is_parsed():
    s = CachingAllocatorSim("max_split_size_mb:100", total_memory_bytes=GiB)
    assert s.memory_stats()["max_split_size"] == 100 * MiB


# -- allocation streams ---------------------------------------------------------------------------
from oomtune.alloc.stream import AllocationStream, replay_stream  # noqa: E402


def test_replay_stream_peaks_and_fragmentation():
    stream = AllocationStream([("alloc", 1, 5 * MiB, 0), ("alloc", 2, 5 * MiB, 0), ("free", 1, 5 * MiB, 0),
                               ("free", 2, 5 * MiB, 0)])
    r = replay_stream(stream, None, total_memory_bytes=GiB)
    # both 5 MiB blocks come from one 20 MiB segment
    assert (r.peak_allocated_bytes, r.peak_reserved_bytes, r.peak_active_bytes) == (10 * MiB, 20 * MiB, 10 * MiB)
    assert r.fragmentation == 0.5 and not r.oom and r.events_replayed == 4 and r.oom_event_index is None
    assert r.memory_stats["allocated_bytes.all.current"] == 0


def test_replay_stream_oom_stop_and_continue():
    events = [("alloc", 1, 40 * MiB, 0), ("alloc", 2, 40 * MiB, 0), ("free", 2), ("alloc", 3, 10 * MiB, 0)]
    stop = replay_stream(AllocationStream(events), None, total_memory_bytes=64 * MiB)
    assert stop.oom and stop.oom_event_index == 1 and stop.events_replayed == 2 and stop.num_ooms == 1
    assert stop.oom_message.startswith(SIMULATED_PREFIX + "CUDA out of memory. Tried to allocate 40.00 MiB")
    go_on = replay_stream(AllocationStream(events), None, total_memory_bytes=64 * MiB, stop_on_oom=False)
    assert go_on.oom and go_on.oom_event_index == 1 and go_on.events_replayed == 4
    assert go_on.peak_allocated_bytes == 50 * MiB   # 40 MiB + 10 MiB (segment 10 MiB)


@pytest.mark.parametrize("name", ["s.bin", "s.jsonl"])
def test_stream_save_load_round_trip(tmp_path, name):
    stream = AllocationStream([("alloc", 7, 123, 0), ("alloc", 8, 5 * MiB, 1), ("free", 7), ("free", 8, 0, 1)])
    stream.save(tmp_path / name)
    back = AllocationStream.load(tmp_path / name)
    assert back == stream and list(back)[2] == ("free", 7, 123, 0) and back.n_allocs == 2
    assert back.peak_live_bytes() == 123 + 5 * MiB


def test_stream_rejects_bad_events_and_files(tmp_path):
    with pytest.raises(ConfigError):
        AllocationStream([("free", 1)])
    with pytest.raises(ConfigError):
        AllocationStream([("alloc", 1, 10, 0), ("alloc", 1, 10, 0)])
    with pytest.raises(ConfigError):
        AllocationStream([("realloc", 1, 10, 0)])
    path = tmp_path / "s.bin"
    AllocationStream([("alloc", 1, 10, 0)]).save(path)
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(ConfigError):
        AllocationStream.load(path)
    (tmp_path / "x.bin").write_bytes(b"not a stream")
    with pytest.raises(ConfigError):
        AllocationStream.load(tmp_path / "x.bin")
    with pytest.raises(ConfigError):
        AllocationStream.load(tmp_path / "missing.bin")


def test_would_reuse_cached_is_get_free_block_without_change():
    s = sim()
    a = s.malloc(5 * MiB)                    # 20 MiB segment: a at [0, 5), free [5, 20)
    before = (s.memory_stats(), list(s._large.keys))
    assert s.would_reuse_cached(15 * MiB)    # the 15 MiB free remainder fits
    assert not s.would_reuse_cached(15 * MiB + 1)   # rounds to 15 MiB + 512 > 15 MiB
    assert not s.would_reuse_cached(100)     # small pool: no cached small block
    assert not s.would_reuse_cached(5 * MiB, stream=1)   # blocks are per stream
    assert (s.memory_stats(), list(s._large.keys)) == before
    s.free(a)
    assert s.would_reuse_cached(20 * MiB) and not s.would_reuse_cached(0)
