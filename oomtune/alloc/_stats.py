"""Statistics layout of the simulator, after ``DeviceStats`` in c10/core/CachingDeviceAllocator.h.

The stats live in three flat lists of ints, one per type (0 = all / AGGREGATE, 1 = small_pool,
2 = large_pool, as ``StatType``) for speed: stat ``s`` starts at index ``3 * s`` and holds
``current, peak, freed`` (so ``allocation`` is at 0, ``allocated_bytes`` at 12, ``requested_bytes``
at 24; the simulator's hot path uses these literal offsets). ``allocated`` is not stored:
``increase_stat`` adds the same amount to ``current`` and ``allocated`` and ``decrease_stat``
subtracts from ``current`` what it adds to ``freed``, so ``allocated == current + freed`` (the simulator has no ``resetAccumulatedStats``).
The simulator never records cross-stream uses (``recordStream``), so a block is active exactly when
it is allocated: ``active`` and ``active_bytes`` mirror ``allocation`` and ``allocated_bytes``.
"""

from __future__ import annotations

__all__ = ["STAT_NAMES", "TYPE_NAMES", "NSTAT", "new_stats", "inc", "dec", "flatten_stats",
           "reset_peaks", "ALLOCATION", "SEGMENT", "INACTIVE_SPLIT", "ALLOCATED_BYTES",
           "RESERVED_BYTES", "INACTIVE_SPLIT_BYTES", "REQUESTED_BYTES"]

STAT_NAMES = ("allocation", "segment", "active", "inactive_split", "allocated_bytes",
              "reserved_bytes", "active_bytes", "inactive_split_bytes", "requested_bytes")
TYPE_NAMES = ("all", "small_pool", "large_pool")
NSTAT = len(STAT_NAMES)
# offsets of ``current`` in a type's list
ALLOCATION, SEGMENT, ACTIVE, INACTIVE_SPLIT, ALLOCATED_BYTES, RESERVED_BYTES, ACTIVE_BYTES, \
    INACTIVE_SPLIT_BYTES, REQUESTED_BYTES = range(0, 3 * NSTAT, 3)
_MIRRORED = {ACTIVE: ALLOCATION, ACTIVE_BYTES: ALLOCATED_BYTES}


def new_stats() -> list[list[int]]:
    """Zeroed stats: 3 types x (9 stats x [current, peak, freed])."""
    return [[0] * (3 * NSTAT) for _ in range(3)]


def inc(st: list[int], i: int, amount: int) -> None:
    """``increase_stat`` on the stat whose ``current`` is at ``st[i]``."""
    c = st[i] + amount
    st[i] = c
    if c > st[i + 1]:
        st[i + 1] = c


def dec(st: list[int], i: int, amount: int) -> None:
    """``decrease_stat`` on the stat whose ``current`` is at ``st[i]``."""
    st[i] -= amount
    st[i + 2] += amount


def reset_peaks(st: list[list[int]]) -> None:
    """``resetPeakStats``: every peak becomes the current value."""
    for lst in st:
        for i in range(0, len(lst), 3):
            lst[i + 1] = lst[i]


def _fields(st: list[int], i: int) -> tuple[int, int, int, int]:
    cur, peak, freed = st[i], st[i + 1], st[i + 2]
    return cur, peak, cur + freed, freed


def flatten_stats(st: list[list[int]], oversize_allocs: list[int], oversize_segs: list[int],
                  counters: dict[str, int]) -> dict[str, int]:
    """The flat ``torch.cuda.memory_stats()`` dict (keys sorted, as torch returns them).

    ``oversize_*`` are ``[current, peak, freed]`` lists; ``counters`` holds num_alloc_retries,
    num_ooms, num_sync_all_streams, num_device_alloc, num_device_free and max_split_size.
    """
    out: dict[str, int] = dict(counters)
    for s, name in enumerate(STAT_NAMES):
        src = _MIRRORED.get(3 * s, 3 * s)
        for t, tname in enumerate(TYPE_NAMES):
            cur, peak, alloc, freed = _fields(st[t], src)
            prefix = f"{name}.{tname}."
            out[prefix + "current"] = cur
            out[prefix + "peak"] = peak
            out[prefix + "allocated"] = alloc
            out[prefix + "freed"] = freed
    for name, lst in (("oversize_allocations", oversize_allocs), ("oversize_segments", oversize_segs)):
        cur, peak, alloc, freed = _fields(lst, 0)
        out.update({f"{name}.current": cur, f"{name}.peak": peak, f"{name}.allocated": alloc,
                    f"{name}.freed": freed})
    return dict(sorted(out.items()))
