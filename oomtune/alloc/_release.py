"""Returning cached memory to the simulated device: release, garbage collection, empty_cache.

A mixin of :class:`oomtune.alloc.sim.CachingAllocatorSim`; every method reproduces the
``DeviceCachingAllocator`` method of the same name in c10/cuda/CUDACachingAllocator.cpp.
"""

from __future__ import annotations

from bisect import bisect_left

from oomtune.alloc._blocks import ADDR_MASK, FIELD_MASK, SIZE_MAX, SIZE_SHIFT, STREAM_SHIFT, Block, Pool
from oomtune.alloc._stats import RESERVED_BYTES, SEGMENT, dec

__all__ = ["ReleaseMixin"]

assert (SEGMENT, RESERVED_BYTES) == (3, 15)   # the literal stat offsets used below



class ReleaseMixin:
    """``release_block``, ``release_available_cached_blocks``, ``release_cached_blocks``,
    ``release_blocks`` and ``garbage_collect_cached_blocks``."""

    def _remove_free(self, block: Block) -> None:
        """Take a free mapped block out of its pool's sorted key list and the address map."""
        keys = (self._small if block.small else self._large).keys
        addr = block.addr
        del keys[bisect_left(keys, (block.stream << STREAM_SHIFT) | (block.size << SIZE_SHIFT) | addr)]
        del self._free[addr]

    def _release_block(self, block: Block, index: int) -> None:
        """``release_block``: cudaFree a whole free segment (never an expandable one)."""
        self._remove_free(block)
        size = block.size
        self._total_alloc -= size
        st = self._st
        for lst in (st[0], st[2 - block.small]):   # segment (3), reserved_bytes (15): current, freed
            lst[3] -= 1
            lst[5] += 1
            lst[15] -= size
            lst[17] += size
        if size >= self._max_split:
            dec(self._over_segs, 0, 1)
        self.num_device_free += 1
        if self._record:
            self.segment_events.append({"action": "segment_free", "addr": block.addr, "size": size,
                                        "stream": block.stream, "index": index})

    def _release_available(self, size: int, stream: int, pool: Pool, index: int) -> bool:
        """``release_available_cached_blocks``: with max_split_size set, free one cached block of at
        least max(size, max_split_size), or oversize blocks from the largest down until that much.

        Deviation (documented): blocks of expandable segments are never released here; torch's
        ``release_block`` asserts on them (pytorch/pytorch#123548), so the simulator stops instead.
        """
        ms = self._max_split
        if ms == SIZE_MAX:
            return False
        target = size if size >= ms else ms
        keys = pool.keys
        i = bisect_left(keys, (stream << STREAM_SHIFT) | (target << SIZE_SHIFT))
        if i < len(keys) and keys[i] >> STREAM_SHIFT == stream:
            block = self._free[keys[i] & ADDR_MASK]
            if block.es is not None:
                return False
            self._release_block(block, index)
            return True
        if i == 0:
            return False
        released, j = 0, i - 1
        while released < target:
            k = keys[j]
            if (k >> SIZE_SHIFT) & FIELD_MASK < ms or k >> STREAM_SHIFT != stream:
                break
            block = self._free[k & ADDR_MASK]
            if block.es is not None:
                break
            released += block.size
            self._release_block(block, index)   # deletes keys[j]; indices below j are unchanged
            if j == 0:
                break
            j -= 1
        return released >= target

    def _release_cached(self, index: int) -> bool:
        """``release_cached_blocks``: synchronize (counted) and free every whole cached segment."""
        self.num_sync_all_streams += 1
        self._release_blocks(self._large, index)
        self._release_blocks(self._small, index)
        return True

    def _release_blocks(self, pool: Pool, index: int) -> None:
        """``release_blocks``: cudaFree non-split blocks in (stream, size, address) order, then unmap
        the whole free pages of expandable blocks and drop expandable segments left empty."""
        to_unmap = []
        for k in list(pool.keys):
            block = self._free[k & ADDR_MASK]
            if block.es is not None:
                to_unmap.append(block)
            elif block.prev is None and block.next is None:
                self._release_block(block, index)
        for block in to_unmap:
            self._unmap_block(block, index)
            if block.prev is None and block.next is None and not block.mapped:
                self._release_expandable_segment(block)

    def _garbage_collect(self, index: int) -> None:
        """``garbage_collect_cached_blocks``: when reserved memory exceeds threshold x allowed
        maximum, free whole large-pool cached blocks whose age (get_free_block calls since they
        were cached) is at least the average age, repeating until enough is reclaimed.

        Blocks of expandable segments are skipped (newer torch: ``!block->expandable_segment_``).
        """
        threshold = int(self._gc_threshold * self._allowed)
        if self._total_alloc <= threshold:
            return
        target = self._total_alloc - threshold
        large, free = self._large, self._free
        calls = large.gc_calls
        total_age = count = 0
        for k in large.keys:
            b = free[k & ADDR_MASK]
            if b.prev is None and b.next is None and b.es is None:
                total_age += calls - b.gc_base
                count += 1
        reclaimed, freed_any = 0, True
        while reclaimed < target and freed_any and count > 0:
            age_threshold = total_age / count
            freed_any = False
            for k in list(large.keys):
                b = free.get(k & ADDR_MASK)
                if b is None or b.prev is not None or b.next is not None or b.es is not None:
                    continue
                age = calls - b.gc_base
                if age >= age_threshold:
                    freed_any = True
                    reclaimed += b.size
                    total_age -= age
                    count -= 1
                    self._release_block(b, index)
