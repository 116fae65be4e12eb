"""Splitting blocks on allocation and merging them on free, with the inactive_split stats.

A mixin of :class:`oomtune.alloc.sim.CachingAllocatorSim`: the splitting part of
``alloc_found_block`` (after ``should_split`` decided) and the rest of ``free_block`` with
``try_merge_blocks`` for blocks of split segments, in c10/cuda/CUDACachingAllocator.cpp. Expandable
blocks merge in :mod:`oomtune.alloc._expandable`. Stat offsets are the literals of the simulator's
hot path (see :mod:`oomtune.alloc._stats`): 9 inactive_split, 21 inactive_split_bytes; +1 peak, +2 freed.
"""

from __future__ import annotations

from bisect import bisect_left, insort

from oomtune.alloc._blocks import SIZE_SHIFT, STREAM_SHIFT, Block, Pool

__all__ = ["SplitMixin"]


class SplitMixin:
    """``alloc_found_block`` (splitting) and ``free_block`` / ``try_merge_blocks`` (merging)."""

    def _free_split(self, block: Block, prev: Block | None, nxt: Block | None) -> None:
        """The rest of ``free_block`` for a block that shares its segment: merge with free
        neighbours (``try_merge_blocks``), cache it, and update the inactive_split stats."""
        if block.es is not None:
            self._free_expandable(block, prev, nxt)
            return
        pool = self._small if block.small else self._large
        keys, free = pool.keys, self._free
        net_n = net_b = 0
        if prev is not None and not prev.allocated:
            del keys[bisect_left(keys, (prev.stream << STREAM_SHIFT) | (prev.size << SIZE_SHIFT) | prev.addr)]
            del free[prev.addr]
            block.addr = prev.addr
            block.prev = pp = prev.prev
            if pp is not None:
                pp.next = block
            block.size += prev.size
            net_n -= 1
            net_b -= prev.size
        if nxt is not None and not nxt.allocated:
            del keys[bisect_left(keys, (nxt.stream << STREAM_SHIFT) | (nxt.size << SIZE_SHIFT) | nxt.addr)]
            del free[nxt.addr]
            block.next = nn = nxt.next
            if nn is not None:
                nn.prev = block
            block.size += nxt.size
            net_n -= 1
            net_b -= nxt.size
        size = block.size
        insort(keys, (block.stream << STREAM_SHIFT) | (size << SIZE_SHIFT) | block.addr)
        free[block.addr] = block
        block.gc_base = pool.gc_calls
        if block.prev is not None or block.next is not None:
            net_n += 1
            net_b += size
        pa, pt = self._hot
        # Unrolled on purpose (same steps for offsets 9 and 21): a loop over the two offsets made a
        # malloc/free replay ~9% slower (150k events, measured when this mixin was split out).
        for lst in (pa, pt[block.small]):   # inactive_split (9), inactive_split_bytes (21)
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


    def _split(self, block: Block, size: int, remaining: int, split: bool, pool: Pool) -> None:
        """The splitting part of ``alloc_found_block``: cut ``remaining`` bytes off into a new free
        block when ``split``, and keep inactive_split(_bytes) right for blocks of split segments."""
        pa, pt = self._hot
        lists = (pa, pt[block.small])
        was_split = block.prev is not None or block.next is not None
        if split:
            rest = Block(block.addr + size, remaining, block.stream, block.small)
            rest.requested, rest.es = block.requested, block.es
            nxt = block.next
            rest.prev, rest.next = block, nxt
            if nxt is not None:
                nxt.prev = rest
            block.next = rest
            block.size = size
            insort(pool.keys, (rest.stream << STREAM_SHIFT) | (remaining << SIZE_SHIFT) | rest.addr)
            self._free[rest.addr] = rest
            rest.gc_base = pool.gc_calls
            if block.es is None:
                for lst in lists:
                    if was_split:              # an inactive split block shrinks by size
                        lst[21] -= size
                        lst[23] += size
                    else:                      # a new inactive split block of remaining bytes
                        c = lst[21] + remaining
                        lst[21] = c
                        if c > lst[22]:
                            lst[22] = c
                        c = lst[9] + 1
                        lst[9] = c
                        if c > lst[10]:
                            lst[10] = c
        elif block.es is None:                 # an inactive split block becomes active
            size = block.size
            for lst in lists:
                lst[21] -= size
                lst[23] += size
                lst[9] -= 1
                lst[11] += 1
