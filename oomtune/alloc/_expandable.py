"""Expandable segments (``expandable_segments:True``): virtual ranges mapped page by page.

A mixin of :class:`oomtune.alloc.sim.CachingAllocatorSim`, after ``find_expandable_block``,
``map_block``, ``try_allocate_expandable_block``, ``unmap_block`` and
``release_expandable_segment`` in c10/cuda/CUDACachingAllocator.cpp and ``ExpandableSegment::map``
/ ``unmap``. Pages are 2 MiB in the small pool and ``large_segment_size`` (20 MiB by default) in the
large pool (``find_expandable_block``: ``pool->is_small ? kSmallBuffer : large_segment_size()``, torch
2.14.1; the same 20 MiB as kLargeBuffer in versions without that setting); each
segment reserves ``ceil(1.125 * total / page)`` pages of address space. Mapping counts as a device
allocation (``num_device_alloc``, ``reserved_bytes``) but, as in torch, not as a new ``segment``.
A page is obtained only if the simulated device still has that much free memory (``cuMemCreate``
fails otherwise and the whole map call is undone).
"""

from __future__ import annotations

from bisect import bisect_left, insort

from oomtune.alloc._blocks import (ADDR_MASK, K_SMALL_BUFFER, STREAM_SHIFT, Block,
                                   ExpandableSegment, Pool)
from oomtune.alloc._stats import RESERVED_BYTES, dec, inc

__all__ = ["ExpandableMixin"]



def _splice(block: Block, before: Block | None, after: Block | None) -> None:
    """``Block::splice``: link ``block`` between ``before`` and ``after``."""
    if before is not None:
        before.next = block
    block.prev = before
    if after is not None:
        after.prev = block
    block.next = after


class ExpandableMixin:
    """Expandable-segment allocation for the simulator (see the module docstring)."""

    def _insert_unmapped(self, block: Block) -> None:
        pool = self._small if block.small else self._large
        insort(pool.unmapped, (block.stream << STREAM_SHIFT) | block.addr)
        self._unmapped[block.addr] = block

    def _remove_unmapped(self, block: Block) -> None:
        pool = self._small if block.small else self._large
        del pool.unmapped[bisect_left(pool.unmapped, (block.stream << STREAM_SHIFT) | block.addr)]
        del self._unmapped[block.addr]

    def _try_merge(self, dst: Block, src: Block | None) -> int:
        """``try_merge_blocks``: absorb neighbour ``src`` (same mapped state, not allocated) into
        ``dst``; returns the bytes absorbed (0 if not merged). ``dst`` must be in no sorted set."""
        if src is None or src.allocated or dst.mapped != src.mapped:
            return 0
        if src.mapped:
            self._remove_free(src)
        else:
            self._remove_unmapped(src)
        if dst.prev is src:
            dst.addr = src.addr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        return src.size

    def _find_expandable_block(self, stream: int, pool: Pool, size: int) -> Block:
        """``find_expandable_block``: the lowest-address free/unmapped run of ``stream`` with room
        for ``size`` bytes, else a new segment's whole unmapped range."""
        unmapped, i = pool.unmapped, bisect_left(pool.unmapped, stream << STREAM_SHIFT)
        while i < len(unmapped) and unmapped[i] >> STREAM_SHIFT == stream:
            c = self._unmapped[unmapped[i] & ADDR_MASK]
            if c.prev is not None and not c.prev.allocated:
                c = c.prev
            b, room = c, 0
            while room < size and b is not None and not b.allocated:
                room += b.size
                b = b.next
            if room >= size:
                return c
            i += 1
        page = K_SMALL_BUFFER if pool.small else self._large_seg
        total = self._total
        pages = -(-(total + total // 8) // page)
        es = ExpandableSegment(self._reserve_address(pages * page, page), page, pages, stream, pool.small)
        self._es_list.append(es)
        cand = Block(es.base, es.size, stream, pool.small)
        cand.mapped, cand.es = False, es
        self._insert_unmapped(cand)
        return cand

    def _map_block(self, to_map: Block, size: int, index: int) -> bool:
        """``map_block``: back the first ``size`` bytes of unmapped ``to_map`` with whole pages."""
        es = to_map.es
        page, off = es.page, to_map.addr - es.base
        begin, end = off // page, -(-(off + size) // page)
        mapped = (end - begin) * page
        if mapped == 0 or mapped > self._device_free():
            return False
        es.mapped[begin:end] = b"\x01" * (end - begin)
        self._remove_unmapped(to_map)
        to_map.mapped = True
        start = to_map.addr
        if mapped < to_map.size:
            rest = Block(start + mapped, to_map.size - mapped, to_map.stream, to_map.small)
            rest.mapped, rest.es = False, es
            _splice(rest, to_map, to_map.next)
            self._insert_unmapped(rest)
            to_map.size = mapped
        self._try_merge(to_map, to_map.prev)
        self._try_merge(to_map, to_map.next)
        self._insert_free(to_map)
        self._total_alloc += mapped
        inc(self._st[0], RESERVED_BYTES, mapped)
        inc(self._st[2 - to_map.small], RESERVED_BYTES, mapped)
        self.num_device_alloc += 1
        if self._record:
            self.segment_events.append({"action": "segment_map", "addr": start, "size": mapped,
                                        "stream": to_map.stream, "index": index})
        return True

    def _try_allocate_expandable(self, stream: int, pool: Pool, size: int, index: int) -> Block | None:
        """``try_allocate_expandable_block``: map pages until a free run of ``size`` bytes exists;
        returns that block, taken out of the free set, or None when the device is full."""
        cand = self._find_expandable_block(stream, pool, size)
        if not cand.mapped and not self._map_block(cand, min(cand.size, size), index):
            return None
        while cand.size < size:
            nxt = cand.next
            if not self._map_block(nxt, min(size - cand.size, nxt.size), index):
                return None
            cand = nxt
        self._remove_free(cand)
        return cand

    def _unmap_block(self, block: Block, index: int) -> None:
        """``unmap_block``: return the whole pages inside free mapped ``block`` to the device."""
        es = block.es
        page, off = es.page, block.addr - es.base
        begin, end = -(-off // page), (off + block.size) // page
        if begin >= end:
            return
        self._remove_free(block)
        start, length = es.base + begin * page, (end - begin) * page
        before = start - block.addr
        if before > 0:
            head = Block(block.addr, before, block.stream, block.small)
            head.es = es
            _splice(head, block.prev, block)
            self._insert_free(head)
        after = block.size - before - length
        if after > 0:
            tail = Block(start + length, after, block.stream, block.small)
            tail.es = es
            _splice(tail, block, block.next)
            self._insert_free(tail)
        block.addr, block.size, block.mapped = start, length, False
        es.mapped[begin:end] = bytes(end - begin)
        self._try_merge(block, block.prev)
        self._try_merge(block, block.next)
        self._insert_unmapped(block)
        self._total_alloc -= length
        dec(self._st[0], RESERVED_BYTES, length)
        dec(self._st[2 - block.small], RESERVED_BYTES, length)
        self.num_device_free += 1
        if self._record:
            self.segment_events.append({"action": "segment_unmap", "addr": start, "size": length,
                                        "stream": block.stream, "index": index})

    def _release_expandable_segment(self, block: Block) -> None:
        """``release_expandable_segment``: drop a segment whose whole range is unmapped."""
        self._remove_unmapped(block)
        self._es_list.remove(block.es)

    def _pick_expandable(self, keys: list[int], i: int, stream: int) -> tuple[int, int]:
        """get_free_block's expandable rule: among blocks of expandable segments, move on to the
        next block while its expandable size (size + following unmapped range) is smaller."""
        free, n = self._free, len(keys) - 1
        while i < n:
            k1 = keys[i + 1]
            if k1 >> STREAM_SHIFT != stream:
                break
            cur = free[keys[i] & ADDR_MASK]
            if cur.es is None:
                break
            nxt = free[k1 & ADDR_MASK]
            b = nxt.next             # expandable size: the block + the unmapped range after it
            grow_next = nxt.size + (b.size if b is not None and not b.mapped else 0)
            b = cur.next
            if grow_next >= cur.size + (b.size if b is not None and not b.mapped else 0):
                break
            i += 1
        return i, keys[i]

    def _free_expandable(self, block: Block, prev: Block | None, nxt: Block | None) -> None:
        """``free_block`` for a block of an expandable segment: merge with free mapped neighbours
        (inactive_split stats exclude expandable segments, as in torch)."""
        if prev is not None and not prev.allocated and prev.mapped:
            self._try_merge(block, prev)
        if nxt is not None and not nxt.allocated and nxt.mapped:
            self._try_merge(block, nxt)
        self._insert_free(block)
