"""Four behaviours of torch 2.14.1's caching allocator that the virtual GPU once got wrong.

Each expected value is derived by hand from the source function named in the test. Where the
project's reference notes (shared/reference/allocator-spec.md) and the source differ, the source
wins; torch 2.14.1 was checked against its shipped libc10_cuda.so where the public source text varies
between versions (said in the test).
"""

from __future__ import annotations

import pytest

from oomtune.alloc.settings import AllocatorSettings
from oomtune.alloc.sim import ADDRESS_BASE, CachingAllocatorSim, SimulatedOutOfMemoryError

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def sim(settings=None, total=8 * GiB, **kw) -> CachingAllocatorSim:
    return CachingAllocatorSim(settings, total_memory_bytes=total, record_segment_events=True, **kw)


# -- 1. set_per_process_memory_fraction(1.0) sets no limit ------------------------------------------
def test_fraction_one_sets_no_limit_and_no_allowed_text():
    """``DeviceCachingAllocator::setMemoryFraction``: ``allowed_memory_maximum = std::nullopt; if
    (fraction < 1.0) allowed_memory_maximum = ...``: 1.0 leaves no limit, so ``alloc_block`` never
    refuses for the fraction and the OOM message (``allowed_memory_maximum.has_value()`` guards the
    "allowed" text) says nothing of it. (The reference notes agree: "limit exists only when
    fraction < 1"; the simulator's old docstring said the opposite.)"""
    s = sim(total=100 * MiB)
    s.set_per_process_memory_fraction(1.0)
    assert s.allowed_bytes is None
    s.malloc(90 * MiB)                        # 90 MiB: fits the 100 MiB device, no limit to pass
    with pytest.raises(SimulatedOutOfMemoryError) as ei:
        s.malloc(20 * MiB)                    # 20 > 10 MiB free on the device
    assert ei.value.allowed_bytes is None and "allowed" not in str(ei.value)


def test_fraction_one_clears_an_earlier_limit():
    """``setMemoryFraction`` first resets ``allowed_memory_maximum`` to empty, then sets it only for
    a fraction < 1: a later 1.0 removes the earlier 0.5 limit."""
    s = sim(total=100 * MiB)
    s.set_per_process_memory_fraction(0.5)
    assert s.allowed_bytes == 50 * MiB
    s.set_per_process_memory_fraction(1.0)
    assert s.allowed_bytes is None
    s.malloc(80 * MiB)                        # above the old 50 MiB limit: fine now


def test_fraction_one_does_not_arm_garbage_collection():
    """``get_free_block`` counts gc ages and ``malloc`` calls ``garbage_collect_cached_blocks`` only
    when a fraction limit is set (``set_fraction``); with 1.0 there is none. Hand calculation on a
    1000 MiB device, threshold 0.5: A 100 MiB, B 120 MiB cached; C 150 MiB and D 200 MiB new:
    reserved 100 + 120 + 150 + 200 = 570 MiB, nothing released. (Under 0.8 instead, the limit is
    800 MiB and gc at 400 MiB would release A: see test_alloc_sim.test_garbage_collection_*.)"""
    s = sim(AllocatorSettings(garbage_collection_threshold=0.5), total=1000 * MiB)
    s.set_per_process_memory_fraction(1.0)
    a, b = s.malloc(100 * MiB), s.malloc(120 * MiB)
    s.free(a), s.free(b)
    s.malloc(150 * MiB), s.malloc(200 * MiB)
    assert s.reserved_bytes == 570 * MiB
    assert not [e for e in s.segment_events if e["action"] == "segment_free"]


# -- 2. the limit is round(fraction x total) --------------------------------------------------------
def test_limit_is_rounded_not_truncated():
    """torch 2.14.1's ``DeviceCachingAllocator::setMemoryFraction`` computes
    ``std::round(fraction * totalGlobalMem)`` (its libc10_cuda.so adds 0.49999999999999994 and
    truncates: the inlined std::round; older public source text reads ``static_cast<size_t>(...)``,
    a truncation, and the installed version wins). Total
    1,000,000,001 bytes and fraction 0.5: product 500,000,000.5 -> 500,000,001 (truncation: 500,000,000)."""
    s = sim(total=1_000_000_001)
    s.set_per_process_memory_fraction(0.5)
    assert s.allowed_bytes == 500_000_001
    s2 = sim(total=3 * MiB)
    s2.set_per_process_memory_fraction(0.3)   # 0.3 * 3145728 = 943718.39999... -> 943718
    assert s2.allowed_bytes == 943_718


def test_rounded_limit_admits_a_segment_ending_exactly_on_it():
    """``alloc_block`` refuses when ``total_allocated_memory + size > allowed_memory_maximum``. A
    fraction whose product is 2 MiB - 0.4 bytes rounds to exactly 2 MiB, so a 2 MiB small segment
    fits; truncation (2 MiB - 1) would refuse it and raise OOM."""
    total = 1 << 30
    fraction = (2 * MiB - 0.4) / total
    s = sim(total=total)
    s.set_per_process_memory_fraction(fraction)
    assert s.allowed_bytes == 2 * MiB
    s.malloc(100)                             # small pool: a 2 MiB segment == the limit
    assert s.reserved_bytes == 2 * MiB


# -- 3. expandable large-pool pages are large_segment_size -----------------------------------------
def test_expandable_large_page_is_large_segment_size():
    """``find_expandable_block`` (torch 2.14.1): ``segment_size = pool->is_small ? kSmallBuffer :
    AcceleratorAllocatorConfig::large_segment_size()`` is the page of a new ExpandableSegment;
    ``map_block`` maps whole pages. With large_segment_size_mb:32, a 30 MiB request maps one 32 MiB
    page; a second 30 MiB request uses the free 2 MiB and maps one more page (28 MiB needed): 64 MiB.
    (The reference notes say 20 MiB pages: true only at the default, where both are 20 MiB.)"""
    s = sim(AllocatorSettings(expandable_segments=True, large_segment_size_bytes=32 * MiB,
                              max_non_split_rounding_bytes=32 * MiB))
    a = s.malloc(30 * MiB)
    b = s.malloc(30 * MiB)
    assert b == a + 30 * MiB
    maps = [(e["action"], e["addr"] - a, e["size"]) for e in s.segment_events]
    assert maps == [("segment_map", 0, 32 * MiB), ("segment_map", 32 * MiB, 32 * MiB)]
    assert s.reserved_bytes == 64 * MiB


def test_expandable_large_page_default_is_20mib():
    """Default large_segment_size is 20 MiB (AcceleratorAllocatorConfig: ``large_segment_size_ =
    kLargeBuffer``): a 30 MiB request maps ceil(30 / 20) = 2 pages, 40 MiB."""
    s = sim(AllocatorSettings(expandable_segments=True))
    s.malloc(30 * MiB)
    assert [e["size"] for e in s.segment_events] == [40 * MiB]


def test_expandable_empty_cache_unmaps_whole_large_segment_size_pages():
    """``release_blocks`` -> ``unmap_block`` -> ``ExpandableSegment::unmap`` unmaps only whole pages
    inside a free block. Pages of 32 MiB: a (30 MiB) at [0, 30), b (30 MiB) at [30, 60) in pages
    [0, 32) and [32, 64). Freeing a leaves [0, 30) free, holding no whole 32 MiB page: nothing is
    unmapped (with 20 MiB pages [0, 20) would be)."""
    s = sim(AllocatorSettings(expandable_segments=True, large_segment_size_bytes=32 * MiB,
                              max_non_split_rounding_bytes=32 * MiB))
    a = s.malloc(30 * MiB)
    s.malloc(30 * MiB)
    s.free(a)
    s.empty_cache()
    assert s.reserved_bytes == 64 * MiB
    assert not [e for e in s.segment_events if e["action"] == "segment_unmap"]


# -- 4. a zero-byte request never reaches the allocator --------------------------------------------
def test_zero_byte_request_never_reaches_the_allocator():
    """``NativeCachingAllocator::allocate`` calls ``malloc`` only ``if (size != 0)`` and returns a
    null data pointer otherwise; ``free`` of a null pointer returns at once. So 0 bytes: address 0,
    no segment, no allocation counted, no stat moves (the old simulator rounded it to 512 bytes
    and opened a 2 MiB small segment)."""
    s = sim()
    before = s.memory_stats()
    assert s.malloc(0) == 0
    assert s.memory_stats() == before and s.reserved_bytes == 0 and s.segment_events == []
    s.free(0)
    assert s.memory_stats() == before


def test_zero_byte_request_does_not_shift_segment_event_indices():
    """``index`` of a segment event counts malloc/free calls the allocator saw: a 0-byte request is
    not one of them, so the 100-byte request after it is call 0 and its 2 MiB segment says index 0."""
    s = sim()
    s.malloc(0)
    addr = s.malloc(100)
    assert addr == ADDRESS_BASE
    assert [(e["action"], e["size"], e["index"]) for e in s.segment_events] == [("segment_alloc", 2 * MiB, 0)]
