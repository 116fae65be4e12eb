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
    (``DeviceCachingAllocator::get_allocation_size``).
    """
    segs = {s["address"]: {"size": s["total_size"], "stream": s.get("stream", 0),
                           "pool": s.get("segment_type", "large"),
                           "expandable": bool(s.get("is_expandable", False))} for s in final}
    for e in reversed(trace):
        if e["action"] == "segment_alloc":
            segs.pop(e["addr"], None)
        elif e["action"] == "segment_free":
            pool = "small" if e["size"] <= _SMALL_BUFFER else "large"
            segs[e["addr"]] = {"size": e["size"], "stream": e.get("stream", 0), "pool": pool,
                               "expandable": False}
        elif e["action"] in ("segment_map", "segment_unmap"):
            _undo_mapping(segs, e)
    return {a: s for a, s in segs.items() if s["size"] > 0}


def _undo_mapping(segs: dict[int, dict], e: dict) -> None:
    """Undo one expandable-segment page mapping (walking backwards): a segment_map grew the
    expandable segment holding ``addr`` by ``size`` (so it was that much smaller before); a
    segment_unmap shrank the one ending at ``addr`` (so it was larger). Expandable segments grow at
    their end (ExpandableSegment::map in c10/cuda/CUDACachingAllocator.cpp maps the pages a request
    needs after the mapped range), which is what this models."""
    addr, size = e["addr"], e["size"]
    owner = next((a for a, s in segs.items() if s["expandable"] and a <= addr <= a + s["size"]), None)
    if e["action"] == "segment_map":
        if owner is not None:
            segs[owner]["size"] -= size
        return
    if owner is not None:
        segs[owner]["size"] += size
    else:
        pool = "small" if size <= _SMALL_BUFFER else "large"
        segs[addr] = {"size": size, "stream": e.get("stream", 0), "pool": pool, "expandable": True}


def _pre_trace_blocks(trace: list[dict], final: list[dict]) -> dict[int, int]:
    """Recorded address -> block size of blocks live before the first trace entry."""
    live: set[int] = set()
    pending: set[int] = set()  # pre-trace blocks whose free was requested, not yet completed
    before: dict[int, int] = {}
    for e in trace:
        action, addr = e["action"], e["addr"]
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
    for addr in sorted(blocks):
        seg_addr = next((a for a in starts if a <= addr < a + segs[a]["size"]), None)
        size = blocks[addr]
        ok = seg_addr is not None and addr + size <= seg_addr + segs[seg_addr]["size"]
        prev = placed[seg_addr][-1] if ok and placed[seg_addr] else None
        if ok and prev is not None and seg_addr + prev.offset_bytes + prev.size_bytes > addr:
            ok = False  # overlaps the previous block: an estimated size was too large
        if not ok:
            unplaced.append(addr)
            continue
        placed[seg_addr].append(InitialBlock(addr - seg_addr, size, addr))
    segments = tuple(
        InitialSegment(a, segs[a]["size"], segs[a]["stream"], segs[a]["pool"], segs[a]["expandable"],
                       tuple(placed[a]))
        for a in starts
    )
    return InitialState(segments, tuple(unplaced))


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
    at the end; adjacent free pieces merge (``free_block`` -> ``try_merge_blocks``).

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
    for seg in state.segments:
        if seg.is_expandable:
            exact = False  # expandable segments grow by mapping pages; carved as plain requests
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
