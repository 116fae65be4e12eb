"""Building blocks of the caching-allocator simulator: constants, blocks, pools, size rules.

Everything here reproduces ``DeviceCachingAllocator`` in c10/cuda/CUDACachingAllocator.cpp and the
constants of c10/core/AllocatorConfig.h (torch 2.14: kMinBlockSize 512 B, kSmallSize 1 MiB,
kSmallBuffer 2 MiB, kMinLargeAlloc 10 MiB, kRoundLarge 2 MiB; the 1-10 MiB segment size is
``AcceleratorAllocatorConfig::large_segment_size()``, 20 MiB by default, which replaced the constant
kLargeBuffer in ``get_allocation_size``).

Free blocks of a pool are kept in one sorted Python list of packed integer keys
``stream << 112 | size << 56 | addr``: integer order is exactly ``BlockComparatorSize`` (stream,
then size, then address), so ``bisect_left`` with ``size`` and address 0 is the C++
``pool.blocks.lower_bound(&search_key)``. Addresses and sizes must stay below 2**56 (64 PiB).
"""

from __future__ import annotations

__all__ = [
    "K_MIN_BLOCK_SIZE", "K_SMALL_SIZE", "K_SMALL_BUFFER", "K_LARGE_BUFFER", "K_MIN_LARGE_ALLOC",
    "K_ROUND_LARGE", "SIZE_MAX", "STREAM_SHIFT", "SIZE_SHIFT", "ADDR_MASK", "FIELD_MASK",
    "Block", "Pool", "ExpandableSegment", "round_size", "roundup_power2_next_division",
    "get_allocation_size", "division_index",
]

K_MIN_BLOCK_SIZE = 512            # all sizes are rounded to at least 512 bytes
K_SMALL_SIZE = 1 << 20            # largest "small" allocation is 1 MiB
K_SMALL_BUFFER = 2 << 20          # "small" allocations are packed in 2 MiB segments
K_LARGE_BUFFER = 20 << 20         # kLargeBuffer: 20 MiB, the default of large_segment_size
K_MIN_LARGE_ALLOC = 10 << 20      # requests between 1 and 10 MiB get a large_segment_size segment
K_ROUND_LARGE = 2 << 20           # larger requests round their segment up to 2 MiB
SIZE_MAX = (1 << 64) - 1          # std::numeric_limits<size_t>::max(): "unlimited" max_split_size

SIZE_SHIFT = 56
STREAM_SHIFT = 112
FIELD_MASK = (1 << 56) - 1
ADDR_MASK = FIELD_MASK


class ExpandableSegment:
    """One reserved virtual address range mapped in pages on demand (``ExpandableSegment``).

    ``page`` (bytes) is 2 MiB for the small pool and ``large_segment_size`` (20 MiB by default) for
    the large pool (the constructor's ``segment_size`` from ``find_expandable_block`` in torch
    2.14.1: ``pool->is_small ? kSmallBuffer : large_segment_size()``). The range holds
    ``ceil(1.125 * total_memory / page)`` pages.
    """

    __slots__ = ("base", "page", "num_pages", "mapped", "stream", "small")

    def __init__(self, base: int, page: int, num_pages: int, stream: int, small: bool) -> None:
        self.base, self.page, self.num_pages = base, page, num_pages
        self.mapped = bytearray(num_pages)   # 1 where a physical page is mapped
        self.stream, self.small = stream, small

    @property
    def size(self) -> int:
        """Size of the reserved address range in bytes."""
        return self.num_pages * self.page


class Block:
    """One block of device memory (``struct Block``): a slice of a segment, free or allocated.

    ``prev``/``next`` link the blocks of one segment in address order (None at the ends);
    ``requested`` is the size asked for by the last allocation (kept after free, as in C++);
    ``gc_base`` is the pool's get_free_block call count when the block entered the free set;
    ``es`` is the owning :class:`ExpandableSegment` or None; ``mapped`` is False only for the
    unmapped address space of an expandable segment. The constructor takes ``addr``, ``size``
    (bytes), ``stream`` and ``small`` (pool), and optionally ``prev``, ``next``, ``requested``,
    ``es`` and ``gc_base`` (so a split in the simulator's hot path sets every field in one call);
    a new block is free (not allocated) and mapped.
    """

    __slots__ = ("addr", "size", "requested", "stream", "small", "allocated", "prev", "next",
                 "mapped", "es", "gc_base")

    def __init__(self, addr: int, size: int, stream: int, small: bool, prev: Block | None = None,
                 next: Block | None = None, requested: int = 0, es: ExpandableSegment | None = None,
                 gc_base: int = 0) -> None:
        self.addr = addr
        self.size = size
        self.requested = requested
        self.stream = stream
        self.small = small
        self.allocated = False
        self.prev = prev
        self.next = next
        self.mapped = True
        self.es = es
        self.gc_base = gc_base

    def key(self) -> int:
        """The packed free-set key ``stream << 112 | size << 56 | addr``."""
        return (self.stream << STREAM_SHIFT) | (self.size << SIZE_SHIFT) | self.addr

    def is_split(self) -> bool:
        """True if the block shares its segment with others (``Block::is_split``)."""
        return self.prev is not None or self.next is not None

    def __repr__(self) -> str:
        state = "allocated" if self.allocated else ("free" if self.mapped else "unmapped")
        return f"Block({self.addr:#x}, {self.size}, {state}, stream={self.stream})"


class Pool:
    """A ``BlockPool``: the free (cached) blocks of the small or the large pool, all streams.

    ``keys`` is the sorted list of packed keys of free mapped blocks (``blocks`` in C++);
    ``unmapped`` the sorted list of ``stream << 112 | addr`` keys of unmapped expandable ranges
    (``unmapped``, ordered by ``BlockComparatorAddress``); ``gc_calls`` is
    ``get_free_blocks_call_count``.
    """

    __slots__ = ("small", "keys", "unmapped", "gc_calls")

    def __init__(self, small: bool) -> None:
        self.small = small
        self.keys: list[int] = []
        self.unmapped: list[int] = []
        self.gc_calls = 0


def division_index(size: int) -> int:
    """Index into roundup_power2_divisions for ``size`` bytes: clamp(floor(log2 size) - 20, 0, 15).

    Source: ``AcceleratorAllocatorConfig::roundup_power2_divisions(size_t)`` (intervals start at
    1 MiB and end at 64 GiB; smaller sizes use index 0, larger ones index 15).
    """
    i = size.bit_length() - 1 - 20
    return 0 if i < 0 else (15 if i > 15 else i)


def roundup_power2_next_division(size: int, divisions: int) -> int:
    """Round ``size`` up to the next of ``divisions`` equal steps between powers of two.

    Source: ``DeviceCachingAllocator::roundup_power2_next_division``: powers of two are unchanged;
    e.g. (1200, 4) -> 1280 (steps 1024, 1280, 1536, 1792); a step that would be 0 bytes gives the
    next power of two.
    """
    if size & (size - 1) == 0:
        return size
    power2_floor = 1 << (size.bit_length() - 1)
    step = power2_floor >> (divisions.bit_length() - 1)   # >> floor(log2(divisions))
    if step == 0:
        return power2_floor << 1
    floor = size & ~(step - 1)
    return size if floor == size else floor + step


def round_size(size: int, divisions: tuple[int, ...] | None = None) -> int:
    """The block size in bytes a request of ``size`` bytes gets (``DeviceCachingAllocator::round_size``).

    Below 512 B -> 512; otherwise, with ``d = divisions[division_index(size)]``, ``d > 1`` and
    ``size > 512 * d`` -> :func:`roundup_power2_next_division`; else the next multiple of 512.
    ``divisions`` None or all zero means the option is off.
    """
    if size < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    if divisions:
        d = divisions[division_index(size)]
        if d > 1 and size > K_MIN_BLOCK_SIZE * d:
            return roundup_power2_next_division(size, d)
    return (size + K_MIN_BLOCK_SIZE - 1) & -K_MIN_BLOCK_SIZE


def get_allocation_size(size: int, large_segment_bytes: int = K_LARGE_BUFFER) -> int:
    """Size in bytes of the segment cudaMalloc'd for a rounded request of ``size`` bytes.

    Source: ``DeviceCachingAllocator::get_allocation_size``: <= 1 MiB -> 2 MiB; < 10 MiB ->
    ``large_segment_size`` (20 MiB default); else the next multiple of 2 MiB.
    """
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return large_segment_bytes
    return (size + K_ROUND_LARGE - 1) & -K_ROUND_LARGE
