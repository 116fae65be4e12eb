"""Splitting blocks on allocation and merging them on free, with the inactive_split stats.

A mixin of :class:`oomtune.alloc.sim.CachingAllocatorSim`: the splitting part of
``alloc_found_block`` (after ``should_split`` decided) and the rest of ``free_block`` with
``try_merge_blocks`` for blocks of split segments, in c10/cuda/CUDACachingAllocator.cpp. Expandable
blocks merge in :mod:`oomtune.alloc._expandable`. Stat offsets are the literals of the simulator's
hot path (see :mod:`oomtune.alloc._stats`): 9 inactive_split, 21 inactive_split_bytes; +1 peak, +2 freed.
"""

from __future__ import annotations

from bisect import bisect_left, insort

from oomtune.alloc._blocks import SIZE_SHIFT, STREAM_SHIFT, Block

__all__ = ["SplitMixin"]

assert (STREAM_SHIFT, SIZE_SHIFT) == (112, 56)   # the packed key's shifts, literals below


class SplitMixin:
    """``free_block`` / ``try_merge_blocks`` (merging) and the inactive_split stats of
    ``alloc_found_block`` (the split itself is inlined in ``CachingAllocatorSim.malloc``).

    ``la`` / ``lt`` below are the stat lists of the aggregate type and of the block's pool."""

    def _free_split(self, block: Block, prev: Block | None, nxt: Block | None, la: list[int],
                    lt: list[int]) -> None:
        """The rest of ``free_block`` for a block that shares its segment: merge with free
        neighbours (``try_merge_blocks``), cache it, and update the inactive_split stats."""
        if block.es is not None:
            self._free_expandable(block, prev, nxt)
            return
        pool = self._small if block.small else self._large
        keys, free = pool.keys, self._free
        net_n = net_b = 0
        if prev is not None and not prev.allocated:
            psize = prev.size
            del keys[bisect_left(keys, (prev.stream << 112) | (psize << 56) | prev.addr)]
            del free[prev.addr]
            block.addr = prev.addr
            block.prev = pp = prev.prev
            if pp is not None:
                pp.next = block
            block.size += psize
            net_n = -1
            net_b = -psize
        if nxt is not None and not nxt.allocated:
            nsize = nxt.size
            del keys[bisect_left(keys, (nxt.stream << 112) | (nsize << 56) | nxt.addr)]
            del free[nxt.addr]
            block.next = nn = nxt.next
            if nn is not None:
                nn.prev = block
            block.size += nsize
            net_n -= 1
            net_b -= nsize
        size = block.size
        addr = block.addr
        insort(keys, (block.stream << 112) | (size << 56) | addr)
        free[addr] = block
        block.gc_base = pool.gc_calls
        if block.prev is not None or block.next is not None:
            net_n += 1
            net_b += size
        for lst in (la, lt):   # inactive_split (9), inactive_split_bytes (21)
            if net_n > 0:
                c = lst[9] + net_n
                lst[9] = c
                if c > lst[10]:
                    lst[10] = c
            elif net_n < 0:
                lst[9] += net_n
                lst[11] -= net_n
            if net_b > 0:
                c = lst[21] + net_b
                lst[21] = c
                if c > lst[22]:
                    lst[22] = c
            elif net_b < 0:
                lst[21] += net_b
                lst[23] -= net_b

    def _new_inactive(self, lt: list[int], remaining: int) -> None:
        """A whole segment was split: one new inactive split block of ``remaining`` bytes."""
        for lst in (self._st[0], lt):
            c = lst[21] + remaining
            lst[21] = c
            if c > lst[22]:
                lst[22] = c
            c = lst[9] + 1
            lst[9] = c
            if c > lst[10]:
                lst[10] = c

    def _shrink_inactive(self, lt: list[int], size: int) -> None:
        """An inactive split block was split again: inactive_split_bytes shrinks by ``size``."""
        for lst in (self._st[0], lt):
            lst[21] -= size
            lst[23] += size

    def _activate_inactive(self, lt: list[int], size: int) -> None:
        """An inactive split block of ``size`` bytes was taken whole: it becomes active."""
        for lst in (self._st[0], lt):
            lst[21] -= size
            lst[23] += size
            lst[9] -= 1
            lst[11] += 1
