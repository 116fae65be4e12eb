"""The virtual GPU: a simulator of PyTorch's native CUDA caching allocator.

:class:`CachingAllocatorSim` reproduces ``DeviceCachingAllocator`` (c10/cuda/CUDACachingAllocator.cpp,
torch 2.14) for one device: size rounding (``round_size`` with roundup_power2_divisions), small
(<= 1 MiB) and large pools, segment sizes (``get_allocation_size``), best fit by (stream, size,
address) with the oversize rules, splitting (``should_split``), merging on free, the malloc retry
chain (get_free_block -> garbage_collect_cached_blocks -> alloc_block ->
release_available_cached_blocks + alloc_block -> release_cached_blocks + alloc_block -> OOM), the
per-process memory fraction, garbage_collection_threshold, expandable segments and empty_cache.
Not modelled: cross-stream uses (``recordStream``/events: blocks are free as soon as freed), CUDA
graph private pools, IPC, and free-memory callbacks.

The simulated device has ``total_memory_bytes``; ``non_allocator_bytes`` (CUDA context, other
libraries) are taken before the allocator gets any, so ``cudaMalloc`` succeeds while
``size <= total - non_allocator - reserved``.

Where the reference notes and the source differ, the source wins (torch 2.14.1, checked against the
shipped libc10_cuda.so): ``setMemoryFraction`` sets a limit only for a fraction < 1, of
``round(fraction x total)`` bytes (``std::round``; 1.0 clears it, so no limit, no garbage collection
and no "allowed" text in the OOM message); a request of 0 bytes never reaches the allocator
(``NativeCachingAllocator::allocate`` calls malloc only when ``size != 0``): :meth:`malloc` returns
address 0 and :meth:`free` of 0 does nothing; torch >= 2.9 sizes 1-10 MiB segments with
``large_segment_size``; expandable large-pool pages are ``large_segment_size`` too
(``find_expandable_block``: ``pool->is_small ? kSmallBuffer : large_segment_size()``; 20 MiB by
default), and the fraction check for expandable memory uses the segment size (``alloc_size``)
although whole pages are mapped, so reserved memory can pass the limit by less than a page, as in
torch. Deviations: garbage collection and release_available_cached_blocks skip expandable blocks
(newer torch / pytorch#123548); the opt-in ``per_process_memory_fraction`` +
``throw_on_cudamalloc_oom`` keys of recent torch are not modelled.

Speed: free blocks live in sorted lists of packed integer keys (bisect), blocks in dicts by address,
stats in flat int lists updated inline; :meth:`malloc` splits and :meth:`free` caches whole segments
inline (no helper call on the common path). This class is the reference implementation: the
optional compiled core (_fastcore.pyx / _fastcore.hpp, a C++ port selected by _compiled.py) runs
``replay_stream`` and :func:`oomtune.alloc.make_simulator`'s simulator with the same results
(tests/test_alloc_compiled.py). Replay rates on one core are measured by
experiments/bench_replay.py (experiments/results/bench_replay.txt).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from typing import Any

from oomtune.alloc import _stats
from oomtune.alloc._blocks import (ADDR_MASK, FIELD_MASK, SIZE_MAX, SIZE_SHIFT, STREAM_SHIFT, Block,
                                   Pool, round_size)
from oomtune.alloc._config import read_settings
from oomtune.alloc._expandable import ExpandableMixin
from oomtune.alloc._release import ReleaseMixin
from oomtune.alloc._segments import ADDRESS_BASE, SegmentMixin
from oomtune.alloc._snapshot import build_snapshot
from oomtune.alloc._split import SplitMixin
from oomtune.alloc.oom_message import SimulatedOutOfMemoryError
from oomtune.exceptions import ConfigError

__all__ = ["CachingAllocatorSim", "SimulatedOutOfMemoryError", "ADDRESS_BASE"]

inc, dec = _stats.inc, _stats.dec
# Stat offsets in a type's list (see _stats): the hot paths below use them as literals:
# 0 allocation, 3 segment, 9 inactive_split, 12 allocated_bytes, 15 reserved_bytes,
# 21 inactive_split_bytes, 24 requested_bytes; +1 peak, +2 freed.
assert (_stats.ALLOCATION, _stats.INACTIVE_SPLIT, _stats.ALLOCATED_BYTES, _stats.INACTIVE_SPLIT_BYTES,
        _stats.REQUESTED_BYTES) == (0, 9, 12, 21, 24)
assert (STREAM_SHIFT, SIZE_SHIFT) == (112, 56)   # the key shifts, literals in the hot paths too


def _round_half_away(x: float) -> int:
    """``std::round`` of a non-negative double as the compiled torch does it: trunc(x + 0.5 - ulp)
    below 2**52 (where every double is already an integer)."""
    return int(x + 0.49999999999999994) if x < 4503599627370496.0 else int(x)


class CachingAllocatorSim(SegmentMixin, SplitMixin, ReleaseMixin, ExpandableMixin):
    """A simulated CUDA device with PyTorch's native caching allocator (``DeviceCachingAllocator``).

    Args:
        settings: ``AllocatorSettings``, a PYTORCH_CUDA_ALLOC_CONF string, or None (torch defaults).
        total_memory_bytes: the device capacity in bytes (``cudaMemGetInfo`` total).
        non_allocator_bytes: device memory outside the allocator (CUDA context etc.), in bytes.
        memory_fraction: passed to :meth:`set_per_process_memory_fraction` unless 1.0 (default);
            1.0 means no limit and no garbage collection, as in torch.
        device_index: the GPU index shown in messages and snapshots.
        record_segment_events: keep ``segment_events``: dicts ``{"action": "segment_alloc" |
            "segment_free" | "segment_map" | "segment_unmap", "addr", "size", "stream", "index"}``
            in order; ``index`` is the 0-based number of the malloc/free call that caused the event
            (for :meth:`empty_cache`, the number of malloc/free calls made before it).

    Raises:
        ConfigError: a non-positive capacity, negative or too large non-allocator memory, a bad
            fraction. AllocatorConfigError: a malformed settings string or a non-native backend.
    """

    def __init__(self, settings: Any = None, *, total_memory_bytes: int, non_allocator_bytes: int = 0,
                 memory_fraction: float = 1.0, device_index: int = 0,
                 record_segment_events: bool = False) -> None:
        if isinstance(total_memory_bytes, bool) or not isinstance(total_memory_bytes, int) \
                or total_memory_bytes <= 0:
            raise ConfigError(f"total_memory_bytes must be a positive int, got {total_memory_bytes!r}")
        if not isinstance(non_allocator_bytes, int) or not 0 <= non_allocator_bytes <= total_memory_bytes:
            raise ConfigError(f"non_allocator_bytes must be an int in [0, total_memory_bytes], "
                              f"got {non_allocator_bytes!r}")
        cfg = read_settings(settings)
        self.settings = settings
        self._max_split, self._max_non_split = cfg["max_split"], cfg["non_split"]
        self._gc_threshold, self._divs = cfg["gc"], cfg["divs"]
        self._expandable, self._large_seg = cfg["expandable"], cfg["large_segment"]
        self._total, self._non_alloc, self.device_index = total_memory_bytes, non_allocator_bytes, device_index
        self._small, self._large = Pool(True), Pool(False)
        self._free: dict[int, Block] = {}       # addr -> free mapped block (in a pool's key list)
        self._active: dict[int, Block] = {}     # addr -> allocated block
        self._unmapped: dict[int, Block] = {}   # addr -> unmapped expandable range
        self._es_list: list = []
        self._total_alloc = 0                   # total_allocated_memory == reserved_bytes.all.current
        self._allowed: int | None = None        # allowed_memory_maximum when a fraction was set
        self._gc_on = False
        self._st = _stats.new_stats()          # [all, small_pool, large_pool] stat lists
        self._over_allocs, self._over_segs = [0, 0, 0], [0, 0, 0]
        self.num_alloc_retries = self.num_ooms = self.num_sync_all_streams = 0
        self.num_device_alloc = self.num_device_free = 0
        self._calls = 0
        self._record = bool(record_segment_events)
        self.segment_events: list[dict[str, int | str]] = []
        self._next_addr = ADDRESS_BASE
        if memory_fraction != 1.0:
            self.set_per_process_memory_fraction(memory_fraction)

    # -- public API ------------------------------------------------------------------------------
    def malloc(self, size_bytes: int, stream: int = 0) -> int:
        """Allocate ``size_bytes`` on ``stream``; returns the block address (``DeviceCachingAllocator::malloc``).

        A request of 0 bytes returns address 0 and changes nothing (no stats, no call counted): in
        torch it never reaches the allocator (``NativeCachingAllocator::allocate`` returns a null
        pointer for ``size == 0``).

        Raises:
            SimulatedOutOfMemoryError: the whole retry chain failed (``num_ooms`` is incremented).
            ConfigError: a negative size.
        """
        if size_bytes < 512:
            if size_bytes <= 0:
                if size_bytes == 0:
                    return 0
                raise ConfigError(f"cannot allocate a negative size ({size_bytes} bytes)")
            size = 512
        elif self._divs is None:
            size = (size_bytes + 511) & -512
        else:
            size = round_size(size_bytes, self._divs)
        index = self._calls
        self._calls = index + 1
        if size <= 1048576:
            small, pool, lt = True, self._small, self._st[1]
        else:
            small, pool, lt = False, self._large, self._st[2]
        if self._gc_on:
            pool.gc_calls += 1
        keys = pool.keys
        block = None
        i = bisect_left(keys, (stream << 112) | (size << 56))       # get_free_block
        try:
            k = keys[i]
        except IndexError:
            k = (stream + 1) << 112                                      # no candidate
        if k >> 112 == stream:
            if self._expandable:
                i, k = self._pick_expandable(keys, i, stream)
            ms = self._max_split
            if ms == SIZE_MAX or ((k >> 56) & FIELD_MASK < ms if size < ms
                                  else (k >> 56) & FIELD_MASK < size + self._max_non_split):
                del keys[i]
                block = self._free.pop(k & ADDR_MASK)
        if block is None:
            block = self._alloc_slow(size, stream, pool, small, size_bytes, index)
        bsize = block.size
        remaining = bsize - size                                           # should_split
        if small or self._expandable:
            split = remaining >= 512
        else:
            split = remaining > 1048576 and size < self._max_split
        if split:
            block.size = bsize = size
            addr = block.addr
            raddr = addr + size
            nxt = block.next
            rest = Block(raddr, remaining, stream, small, block, nxt, block.requested, block.es, pool.gc_calls)
            if nxt is not None:
                nxt.prev = rest
            block.next = rest
            insort(keys, (stream << 112) | (remaining << 56) | raddr)
            self._free[raddr] = rest
            if block.es is None:
                if nxt is not None or block.prev is not None:  # was split: an inactive block shrinks
                    self._shrink_inactive(lt, size)
                else:                                            # a new inactive split block
                    self._new_inactive(lt, remaining)
        else:
            addr = block.addr
            if (block.prev is not None or block.next is not None) and block.es is None:
                self._activate_inactive(lt, bsize)                # an inactive split block becomes active
        block.allocated = True                                             # alloc_found_block
        block.requested = size_bytes
        self._active[addr] = block
        la = self._st[0]   # allocation (0), allocated_bytes (12), requested_bytes (24): all, then pool
        c = la[0] + 1
        la[0] = c
        if c > la[1]:
            la[1] = c
        c = la[12] + bsize
        la[12] = c
        if c > la[13]:
            la[13] = c
        c = la[24] + size_bytes
        la[24] = c
        if c > la[25]:
            la[25] = c
        c = lt[0] + 1
        lt[0] = c
        if c > lt[1]:
            lt[1] = c
        c = lt[12] + bsize
        lt[12] = c
        if c > lt[13]:
            lt[13] = c
        c = lt[24] + size_bytes
        lt[24] = c
        if c > lt[25]:
            lt[25] = c
        if bsize >= self._max_split:
            inc(self._over_allocs, 0, 1)
        return addr

    def free(self, addr: int) -> None:
        """Free the block at ``addr`` (``DeviceCachingAllocator::free`` + ``free_block``).

        ``addr`` 0 (what :meth:`malloc` returns for 0 bytes) does nothing, as torch's ``free`` of a
        null pointer.

        Raises:
            ConfigError: ``addr`` is not an allocated block of this simulator.
        """
        block = self._active.pop(addr, None)
        if block is None:
            if addr == 0:
                return
            raise ConfigError(f"free of an address that is not allocated on the virtual GPU: {addr!r}")
        self._calls += 1
        block.allocated = False
        size, req = block.size, block.requested
        small = block.small
        la, lt = self._st[0], self._st[2 - small]
        la[0] -= 1                    # allocation, allocated_bytes, requested_bytes: current, freed
        la[2] += 1
        la[12] -= size
        la[14] += size
        la[24] -= req
        la[26] += req
        lt[0] -= 1
        lt[2] += 1
        lt[12] -= size
        lt[14] += size
        lt[24] -= req
        lt[26] += req
        if size >= self._max_split:
            dec(self._over_allocs, 0, 1)
        prev, nxt = block.prev, block.next
        if prev is None and nxt is None:          # a whole segment: nothing to merge or count
            pool = self._small if small else self._large
            insort(pool.keys, (block.stream << 112) | (size << 56) | addr)
            self._free[addr] = block
            block.gc_base = pool.gc_calls
        else:
            self._free_split(block, prev, nxt, la, lt)

    def would_reuse_cached(self, size_bytes: int, stream: int = 0) -> bool:
        """True when a ``malloc(size_bytes, stream)`` now would be served by a cached free block
        (``get_free_block`` succeeds), so the allocator would release nothing for it. Changes nothing.

        Used by the trace replay to tell a program's ``empty_cache()`` from the allocator's
        release-and-retry, which happens only after ``get_free_block`` failed.
        """
        if size_bytes <= 0:
            return False
        size = round_size(size_bytes, self._divs)
        keys = (self._small if size <= 1048576 else self._large).keys
        i = bisect_left(keys, (stream << STREAM_SHIFT) | (size << SIZE_SHIFT))
        if i >= len(keys) or keys[i] >> STREAM_SHIFT != stream:
            return False
        k = keys[i]
        if self._expandable:
            i, k = self._pick_expandable(keys, i, stream)
        bsize, ms = (k >> SIZE_SHIFT) & FIELD_MASK, self._max_split
        return (bsize < ms) if size < ms else (bsize < size + self._max_non_split)

    def empty_cache(self) -> None:
        """Release every cached whole segment and unmap free expandable pages (``emptyCache``)."""
        self._release_cached(self._calls)

    def set_per_process_memory_fraction(self, fraction: float) -> None:
        """Limit reserved memory to ``round(fraction * total_memory_bytes)`` bytes (``setMemoryFraction``).

        As ``DeviceCachingAllocator::setMemoryFraction`` in torch 2.14.1: a fraction < 1 sets the
        limit (``std::round`` of the product in double precision) and lets
        garbage_collection_threshold act; 1.0 clears any limit (``allowed_memory_maximum`` empty), so
        nothing is capped, nothing is garbage-collected and the OOM message has no "allowed" text.

        Raises:
            ConfigError: unless 0 <= fraction <= 1.
        """
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 <= fraction <= 1.0:
            raise ConfigError(f"invalid memory fraction {fraction!r}: allowed range is 0~1")
        if fraction < 1.0:
            self._allowed = _round_half_away(fraction * float(self._total))
            self._gc_on = self._gc_threshold > 0.0
        else:
            self._allowed = None
            self._gc_on = False

    def memory_stats(self) -> dict[str, int]:
        """The flat ``torch.cuda.memory_stats()`` dict (e.g. ``"allocated_bytes.all.peak"``)."""
        ms = self._max_split
        counters = {"num_alloc_retries": self.num_alloc_retries, "num_ooms": self.num_ooms,
                    "num_sync_all_streams": self.num_sync_all_streams,
                    "num_device_alloc": self.num_device_alloc, "num_device_free": self.num_device_free,
                    "max_split_size": -1 if ms == SIZE_MAX else ms}
        return _stats.flatten_stats(self._st, self._over_allocs, self._over_segs, counters)

    def memory_snapshot(self) -> list[dict[str, Any]]:
        """Segments and blocks in ``torch.cuda.memory_snapshot()`` form, sorted by address."""
        return build_snapshot(list(self._free.values()) + list(self._active.values()), self.device_index)

    def reset_peak_memory_stats(self) -> None:
        """Set every peak to its current value (``resetPeakStats``)."""
        _stats.reset_peaks(self._st)
        self._over_allocs[1], self._over_segs[1] = self._over_allocs[0], self._over_segs[0]

    @property
    def allocated_bytes(self) -> int:
        """Bytes in allocated blocks now (``allocated_bytes.all.current``)."""
        return self._st[0][12]

    @property
    def reserved_bytes(self) -> int:
        """Bytes held from the device now (``reserved_bytes.all.current``)."""
        return self._total_alloc

    @property
    def device_free_bytes(self) -> int:
        """Free device memory as ``cudaMemGetInfo`` would report it."""
        return self._device_free()

    def cache_info(self) -> int:
        """The largest block a request could get without growing the reserve, as
        ``CUDACachingAllocator::cacheInfo`` reports it (c10/cuda/CUDACachingAllocator.cpp,
        ``DeviceCachingAllocator::cacheInfo``): starting from free device memory
        (``cudaMemGetInfo``: capacity less non-allocator memory less reserved, the per-process
        fraction not applied, as cudaMemGetInfo does not know it), raised to the largest free
        cached block of the small and large pools (``cache_info_aux``). Bytes. cuDNN's
        convolutions bound their workspace probe by it (``get_available_workspace``,
        aten/src/ATen/native/cudnn/Conv_v8.cpp)."""
        largest = self._device_free()
        for block in self._free.values():
            if block.size > largest:
                largest = block.size
        return largest

    @property
    def total_memory_bytes(self) -> int:
        """The simulated device capacity in bytes."""
        return self._total

    @property
    def expandable_segments(self) -> bool:
        """True when new memory comes from expandable segments (``expandable_segments:True``)."""
        return self._expandable

    @property
    def allowed_bytes(self) -> int | None:
        """``allowed_memory_maximum`` in bytes, or None when no fraction was set."""
        return self._allowed
