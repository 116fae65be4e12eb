"""New segments for the simulator: ``alloc_block`` with its retries, and the out-of-memory error.

A mixin of :class:`oomtune.alloc.sim.CachingAllocatorSim`: the part of ``DeviceCachingAllocator::malloc``
(c10/cuda/CUDACachingAllocator.cpp) after ``get_free_block`` failed (``garbage_collect_cached_blocks``,
``alloc_block``, ``release_available_cached_blocks`` + ``alloc_block``, ``release_cached_blocks`` +
``alloc_block``, then the OOM), and the simulated address space segments are placed in.
"""

from __future__ import annotations

from bisect import insort

from oomtune.alloc._blocks import SIZE_SHIFT, STREAM_SHIFT, Block, Pool, get_allocation_size
from oomtune.alloc._stats import inc
from oomtune.alloc.oom_message import SimulatedOutOfMemoryError, build_oom_message
from oomtune.exceptions import ConfigError

__all__ = ["SegmentMixin", "ADDRESS_BASE"]

ADDRESS_BASE = 0x7F0000000000      # first simulated segment address
_ALIGN = 2 << 20                   # segments start on 2 MiB boundaries


class SegmentMixin:
    """``alloc_block`` and the retry chain of ``malloc`` after a failed ``get_free_block``."""

    def _device_free(self) -> int:
        """Free device memory in bytes (capacity - non-allocator memory - reserved)."""
        return self._total - self._non_alloc - self._total_alloc

    def _reserve_address(self, size: int, align: int = _ALIGN) -> int:
        """The next free simulated address range of ``size`` bytes aligned to ``align`` bytes."""
        addr = -(-self._next_addr // align) * align
        self._next_addr = -(-(addr + size) // _ALIGN) * _ALIGN
        if self._next_addr >= 1 << SIZE_SHIFT:
            raise ConfigError("the virtual GPU ran out of simulated address space")
        return addr

    def _insert_free(self, block: Block) -> None:
        """``insert_into_blocks``: add a free mapped block to its pool, stamping its gc age base."""
        pool = self._small if block.small else self._large
        addr = block.addr
        insort(pool.keys, (block.stream << STREAM_SHIFT) | (block.size << SIZE_SHIFT) | addr)
        self._free[addr] = block
        block.gc_base = pool.gc_calls

    def _alloc_slow(self, size: int, stream: int, pool: Pool, small: bool, orig: int, index: int) -> Block:
        """The part of ``malloc`` after a failed get_free_block: gc, alloc_block and its retries."""
        alloc_size = get_allocation_size(size, self._large_seg)
        if self._gc_on:
            self._garbage_collect(index)
        args = (size, alloc_size, stream, pool, small)
        block = (self._alloc_block(*args, False, index)
                 or (self._release_available(size, stream, pool, index) and self._alloc_block(*args, False, index))
                 or (self._release_cached(index) and self._alloc_block(*args, True, index)))
        if not block:
            raise self._oom(alloc_size, orig)
        return block

    def _alloc_block(self, size: int, alloc_size: int, stream: int, pool: Pool, small: bool,
                     retry: bool, index: int) -> Block | None:
        """``alloc_block``: a new segment of ``alloc_size`` bytes (or mapped expandable pages)."""
        if retry:
            self.num_alloc_retries += 1
        if self._allowed is not None and self._total_alloc + alloc_size > self._allowed:
            return None
        if self._expandable:
            return self._try_allocate_expandable(stream, pool, size, index)
        if alloc_size > self._device_free():
            return None
        block = Block(self._reserve_address(alloc_size), alloc_size, stream, small)
        self._total_alloc += alloc_size
        for lst in (self._st[0], self._st[2 - small]):   # segment (3), reserved_bytes (15)
            c = lst[3] + 1
            lst[3] = c
            if c > lst[4]:
                lst[4] = c
            c = lst[15] + alloc_size
            lst[15] = c
            if c > lst[16]:
                lst[16] = c
        if alloc_size >= self._max_split:
            inc(self._over_segs, 0, 1)
        self.num_device_alloc += 1
        if self._record:
            self.segment_events.append({"action": "segment_alloc", "addr": block.addr,
                                        "size": alloc_size, "stream": stream, "index": index})
        return block

    def _oom(self, alloc_size: int, orig: int) -> SimulatedOutOfMemoryError:
        """Count the OOM and build the exception with the native message (after the retries)."""
        self.num_ooms += 1
        return self._oom_error(alloc_size, orig, self._device_free(), self.allocated_bytes, self._total_alloc)

    def _oom_error(self, alloc_size: int, orig: int, free: int, allocated: int,
                   reserved: int) -> SimulatedOutOfMemoryError:
        """The OOM exception for a segment of ``alloc_size`` bytes (request of ``orig`` bytes) when
        the device had ``free`` bytes free and ``allocated`` / ``reserved`` bytes in use."""
        msg = build_oom_message(alloc_size_bytes=alloc_size, device_index=self.device_index,
                                total_bytes=self._total, free_bytes=free, allocated_bytes=allocated,
                                reserved_bytes=reserved, allowed_bytes=self._allowed,
                                process_bytes=self._non_alloc + reserved)
        return SimulatedOutOfMemoryError(
            msg, requested_bytes=alloc_size, request_size_bytes=orig, allocated_bytes=allocated,
            reserved_bytes=reserved, free_bytes=free, total_bytes=self._total,
            allowed_bytes=self._allowed, device_index=self.device_index)
