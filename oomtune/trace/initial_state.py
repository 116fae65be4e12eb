"""The allocator state before a snapshot's trace, and putting it into the virtual GPU.

Two steps (the first two of :mod:`oomtune.trace.replay`):

1. :func:`rebuild_initial_state`: what the allocator held before the trace's first entry. Recording
   starts in the middle of a program (``_record_memory_history`` is called late, or its ring buffer of
   ``max_entries`` dropped the oldest entries), so the final ``segments`` include segments and live
   blocks the trace never created. As in the memory viewer (torch/utils/viz/MemoryViz.js, which
   ``torch.cuda._memory_viz.trace_plot`` embeds), the starting state is the final state with the
   trace undone: segments are walked backwards through segment_alloc (did not exist before) and
   segment_free (did); blocks freed during the trace without a preceding alloc, and blocks live at the
   end that the trace never allocated, were live before it.
2. :func:`seed_initial_state`: puts that state into a ``CachingAllocatorSim`` through its public
   ``malloc``/``free`` only (a synthetic prefix). Each starting segment is created by one request,
   then carved in address order into its live blocks and gaps while every other segment stays fully
   allocated (so best fit has exactly one candidate), then the gaps are freed and merge. Every
   returned address is checked against segment base + offset, so a layout the settings cannot
   reproduce is reported (``initial_state_exact=False``), never silently assumed.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from typing import Any

from oomtune.exceptions import SnapshotError

__all__ = ["InitialBlock", "InitialSegment", "InitialState", "device_trace", "rebuild_initial_state",
           "seed_initial_state"]

_MiB = 1 << 20
_SMALL_SIZE = _MiB  # kSmallSize: requests up to 1 MiB use the small pool
_SMALL_BUFFER = 2 * _MiB  # kSmallBuffer: size of a small-pool segment


@dataclass(frozen=True)
class InitialBlock:
    """A block live before the trace: ``offset_bytes`` into its segment, ``size_bytes`` (block size,
    a multiple of 512), ``recorded_addr`` (the device address the trace uses for it)."""

    offset_bytes: int
    size_bytes: int
    recorded_addr: int


@dataclass(frozen=True)
class InitialSegment:
    """A segment that existed before the trace. ``pool`` is ``"small"`` or ``"large"``."""

    address: int
    total_size_bytes: int
    stream: int
    pool: str
    is_expandable: bool = False
    live_blocks: tuple[InitialBlock, ...] = ()


@dataclass(frozen=True)
class InitialState:
    """The allocator's state before the first trace entry (see :func:`rebuild_initial_state`).

    ``unplaced_blocks``: recorded addresses of blocks the trace frees without allocating them that lie
    in no starting segment (an inconsistent or merged trace); replay ignores their frees.
    """

    segments: tuple[InitialSegment, ...]
    unplaced_blocks: tuple[int, ...] = ()

    @property
    def reserved_bytes(self) -> int:
        """Bytes reserved (sum of segment sizes) before the trace."""
        return sum(s.total_size_bytes for s in self.segments)

    @property
    def live_bytes(self) -> int:
        """Bytes of blocks live before the trace (block sizes)."""
        return sum(b.size_bytes for s in self.segments for b in s.live_blocks)


def device_trace(snapshot: dict[str, Any], device: int = 0) -> tuple[list[dict], list[dict]]:
    """The trace entries and final segments of one device.

    Raises:
        SnapshotError: the snapshot has neither a trace nor segments for ``device``.
    """
    traces = snapshot["device_traces"]
    segments = [s for s in snapshot["segments"] if s.get("device", 0) == device]
    if device < 0 or (device >= len(traces) and not segments):
        raise SnapshotError(
            f"the snapshot has no trace for device {device} (it holds {len(traces)} device trace(s))"
        )
    trace = traces[device] if device < len(traces) else []
    return trace, segments


def _block_addresses(seg: dict[str, Any]) -> list[tuple[int, dict]]:
    """(address, block) of a final segment's blocks; old snapshots lack block addresses (in order)."""
    out, addr = [], seg["address"]
    for block in seg["blocks"]:
        out.append((block.get("address", addr), block))
        addr = block.get("address", addr) + block["size"]
    return out


def _starting_segments(trace: list[dict], final: list[dict]) -> dict[int, dict]:
    """Final segments with the trace's segment events undone (walked backwards).

    A segment freed during the trace is absent from the final list; its pool is inferred from its
    size: small-pool segments are exactly kSmallBuffer (2 MiB), large-pool ones are >= 10 MiB
    (``DeviceCachingAllocator::get_allocation_size``). Expandable segments are handled as mapped
    address ranges (:func:`_undo_mappings`).
    """
    segs = {s["address"]: {"size": s["total_size"], "stream": s.get("stream", 0),
                           "pool": s.get("segment_type", "large"), "expandable": False}
            for s in final if not s.get("is_expandable", False)}
    ranges = [(s["address"], s["address"] + s["total_size"], s.get("segment_type", "large"),
               s.get("stream", 0)) for s in final if s.get("is_expandable", False)]
    mapping_events = []
    for e in reversed(trace):
        if e["action"] == "segment_alloc":
            segs.pop(e["addr"], None)
        elif e["action"] == "segment_free":
            pool = "small" if e["size"] <= _SMALL_BUFFER else "large"
            segs[e["addr"]] = {"size": e["size"], "stream": e.get("stream", 0), "pool": pool,
                               "expandable": False}
        elif e["action"] in ("segment_map", "segment_unmap"):
            mapping_events.append(e)
    for start, end, pool, stream in _undo_mappings(ranges, mapping_events):
        segs[start] = {"size": end - start, "stream": stream, "pool": pool, "expandable": True}
    return {a: s for a, s in segs.items() if s["size"] > 0}


def _undo_mappings(ranges: list[tuple[int, int, str, int]], events: list[dict]) -> list[tuple[int, int, str, int]]:
    """Mapped ranges ``(start, end, pool, stream)`` of expandable segments before the trace.

    ``ranges``: the final snapshot's expandable segments (torch lists one per contiguous mapped
    range, ``DeviceCachingAllocator::snapshot``); ``events``: the trace's segment_map/segment_unmap
    entries, latest first. Undoing a map removes its range (it may split a mapped range in two:
    the map filled a hole); undoing an unmap adds its range back, merging with its neighbours (an
    unmap in the middle of a mapped range, as ``release_cached_blocks`` -> ``unmap_block`` makes when
    it returns the free pages between live blocks). A re-added range that touches no known range
    takes its pool from its size: whole 2 MiB pages that are not 20 MiB multiples are small-pool.
    """
    spans = sorted(ranges)
    for e in events:
        lo, hi = e["addr"], e["addr"] + e["size"]
        if e["action"] == "segment_map":
            cut = []
            for a, b, pool, stream in spans:
                if b <= lo or a >= hi:
                    cut.append((a, b, pool, stream))
                    continue
                if a < lo:
                    cut.append((a, lo, pool, stream))
                if b > hi:
                    cut.append((hi, b, pool, stream))
            spans = cut
        else:
            touching = [s for s in spans if s[1] >= lo and s[0] <= hi]
            if touching:
                pool, stream = touching[0][2], touching[0][3]
            else:
                pool = "small" if e["size"] % (20 << 20) else "large"
                stream = e.get("stream", 0)
            a = min([lo] + [s[0] for s in touching])
            b = max([hi] + [s[1] for s in touching])
            spans = sorted([s for s in spans if s not in touching] + [(a, b, pool, stream)])
    return spans


def _pre_trace_blocks(trace: list[dict], final: list[dict]) -> dict[int, int]:
    """Recorded address -> block size of blocks live before the first trace entry."""
    live: set[int] = set()
    pending: set[int] = set()  # pre-trace blocks whose free was requested, not yet completed
    before: dict[int, int] = {}
    for e in trace:
        action, addr = e["action"], e.get("addr")
        if action == "alloc":
            live.add(addr)
        elif action in ("free_requested", "free_completed") and addr not in live:
            if addr not in pending and addr not in before:
                # The trace records the requested size; the block held it rounded up to 512 B
                # (round_size in c10/cuda/CUDACachingAllocator.cpp under default settings).
                before[addr] = max(512, -(-e["size"] // 512) * 512)
            if action == "free_requested":
                pending.add(addr)
            else:
                pending.discard(addr)
        elif action == "free_completed":
            live.discard(addr)
    for seg in final:
        for addr, block in _block_addresses(seg):
            if block["state"].startswith("active") and addr not in live:
                before[addr] = block["size"]  # exact block size from the final snapshot
    return before


def rebuild_initial_state(snapshot: dict[str, Any], device: int = 0) -> InitialState:
    """Segments and live blocks that existed before the first trace entry of ``device``.

    Args:
        snapshot: a validated snapshot (:func:`oomtune.trace.snapshot.load_snapshot`).
        device: the CUDA device index whose trace is used.

    Returns:
        The :class:`InitialState`, segments in address order, blocks in address order.

    Raises:
        SnapshotError: no trace/segments for ``device``.
    """
    trace, final = device_trace(snapshot, device)
    segs = _starting_segments(trace, final)
    blocks = _pre_trace_blocks(trace, final)
    starts = sorted(segs)
    placed: dict[int, list[InitialBlock]] = {a: [] for a in starts}
    unplaced = []
    find = _segment_finder(starts, segs)
    for addr in sorted(blocks):
        seg_addr = find(addr)
        size = blocks[addr]
        ok = seg_addr is not None and addr + size <= seg_addr + segs[seg_addr]["size"]
        prev = placed[seg_addr][-1] if ok and placed[seg_addr] else None
        if ok and prev is not None and seg_addr + prev.offset_bytes + prev.size_bytes > addr:
            ok = False  # overlaps the previous block: an estimated size was too large
        if not ok:
            unplaced.append(addr)
            continue
        placed[seg_addr].append(InitialBlock(addr - seg_addr, size, addr))
    for a in starts:
        if segs[a]["pool"] == "large" and not segs[a]["expandable"]:
            placed[a] = _with_unsplit_tails(placed[a], segs[a]["size"])
    segments = tuple(
        InitialSegment(a, segs[a]["size"], segs[a]["stream"], segs[a]["pool"], segs[a]["expandable"],
                       tuple(placed[a]))
        for a in starts
    )
    return InitialState(segments, tuple(unplaced))


def _segment_finder(starts: list[int], segs: dict[int, dict]) -> Any:
    """A function: address -> start of the lowest-addressed segment holding it, or None.

    Segments of one device do not overlap, so a binary search over the sorted ``starts`` finds the
    only candidate (O(log n) per block instead of a scan of every segment, which made rebuilding
    the state of a trace with thousands of segments quadratic); an inconsistent snapshot whose
    segments overlap falls back to the scan, which returns the lowest start.
    """
    ends = [a + segs[a]["size"] for a in starts]
    if all(ends[k] <= starts[k + 1] for k in range(len(starts) - 1)):
        def find(addr: int) -> int | None:
            k = bisect_right(starts, addr) - 1
            return starts[k] if k >= 0 and addr < ends[k] else None
        return find
    return lambda addr: next((a for a, e in zip(starts, ends) if a <= addr < e), None)


def _with_unsplit_tails(blocks: list[InitialBlock], segment_size: int) -> list[InitialBlock]:
    """Give each live block of a large-pool segment the free gap after it when that gap is at most
    1 MiB: the block's unsplit tail.

    ``should_split`` (c10/cuda/CUDACachingAllocator.cpp) splits a large-pool block only when the
    remainder is larger than kSmallSize (1 MiB), so every block of a large-pool segment, free or
    allocated, is larger than 1 MiB: a gap of at most 1 MiB after a block cannot be a free block of
    its own, and is the tail the block kept. The trace gives a pre-trace block's requested size
    only (its free entry), so the rebuilt size lacks that tail until it is added here.
    """
    out = []
    for k, b in enumerate(blocks):
        end = blocks[k + 1].offset_bytes if k + 1 < len(blocks) else segment_size
        gap = end - b.offset_bytes - b.size_bytes
        out.append(InitialBlock(b.offset_bytes, b.size_bytes + gap, b.recorded_addr)
                   if 0 < gap <= _SMALL_SIZE else b)
    return out


def _pieces(seg: InitialSegment) -> list[tuple[int, int, int | None]]:
    """(offset, size, recorded_addr or None for a gap) covering the segment in address order.

    Small-pool gaps are cut into pieces of at most kSmallSize so each request stays in the small pool.
    """
    out, offset = [], 0
    ends = [(b.offset_bytes, b.size_bytes, b.recorded_addr) for b in seg.live_blocks]
    for start, size, rec in ends + [(seg.total_size_bytes, 0, None)]:
        gap = start - offset
        while gap > 0:
            step = min(gap, _SMALL_SIZE) if seg.pool == "small" else gap
            out.append((offset, step, None))
            offset, gap = offset + step, gap - step
        if size:
            out.append((start, size, rec))
            offset = start + size
    return out


def seed_initial_state(sim: Any, state: InitialState) -> tuple[dict[int, int], bool]:
    """Reproduce ``state`` in a fresh simulator through ``malloc``/``free`` (a synthetic prefix).

    A large-pool segment is created by ``malloc(total_size)`` (>= 10 MiB requests get a segment of
    exactly their 2 MiB-rounded size, ``get_allocation_size``) and freed; a small-pool one by its first
    piece (a request <= 1 MiB gets a kSmallBuffer segment). The pieces are then requested in address
    order: with every other segment fully allocated, best fit (``get_free_block``) can only pick the
    one free block of this segment, and splitting it leaves the rest at the next offset. Gaps are freed
    at the end; adjacent free pieces merge (``free_block`` -> ``try_merge_blocks``). Under
    expandable settings a segment's pages are mapped by its first request; that carve is exact for
    one mapped range per pool and stream with no free gap of at most 1 MiB in the large pool (such a
    request would go to the small pool). A segment of the other kind than the settings make (e.g.
    replaying a default-settings trace under ``expandable_segments:True``) is carved as the
    settings' kind and reported as not exact.

    Returns:
        (recorded address -> simulator address of each live block, exact): ``exact`` is False when a
        returned address was not segment base + offset (settings such as max_split_size_mb or
        roundup_power2_divisions can prevent the layout) or a segment had to be skipped.

    Raises:
        SimulatedOutOfMemoryError: the budget cannot hold the starting state.
    """
    addr_map: dict[int, int] = {}
    gaps: list[int] = []
    exact = True
    expandable = bool(getattr(sim, "expandable_segments", False))
    by_kind: dict[tuple[str, int], int] = {}
    for seg in state.segments:
        if seg.is_expandable:
            by_kind[(seg.pool, seg.stream)] = by_kind.get((seg.pool, seg.stream), 0) + 1
    for seg in state.segments:
        if seg.is_expandable != expandable:
            exact = False  # a segment of the other kind than the settings make: carved as this kind
        elif seg.is_expandable and (by_kind[(seg.pool, seg.stream)] > 1 or seg.pool == "large" and any(
                0 < size <= _SMALL_SIZE for _, size, rec in _pieces(seg) if rec is None)):
            exact = False  # several mapped ranges (holes between) or a free gap <= 1 MiB: not carvable
        base = None
        if seg.pool == "large":
            base = sim.malloc(seg.total_size_bytes, stream=seg.stream)
            sim.free(base)
        for offset, size, rec in _pieces(seg):
            got = sim.malloc(size, stream=seg.stream)
            base = got - offset if base is None else base
            exact = exact and got == base + offset
            if rec is None:
                gaps.append(got)
            else:
                addr_map[rec] = got
    for addr in gaps:
        sim.free(addr)
    return addr_map, exact and not state.unplaced_blocks
