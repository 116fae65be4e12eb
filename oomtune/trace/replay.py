"""Replaying a real GPU memory snapshot through the virtual GPU, and comparing segment events.

Three steps:

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
3. :func:`replay_snapshot`: ``alloc`` -> ``malloc(size, stream)``; ``free_completed`` -> ``free``.
   ``free_requested`` is when the program dropped the tensor; with several streams the allocator keeps
   the block until the recorded CUDA events complete (``DeviceCachingAllocator::free`` ->
   ``insert_events``; the block returns to the pool in ``process_events``), and ``free_completed`` marks
   that moment, so it is the one that changes memory. With one stream the two are adjacent.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from oomtune.exceptions import SnapshotError

__all__ = [
    "InitialBlock", "InitialSegment", "InitialState", "SnapshotReplay", "DEFAULT_TOTAL_MEMORY_BYTES",
    "rebuild_initial_state", "seed_initial_state", "replay_snapshot", "device_trace",
    "unexplained_release_indices", "first_divergence",
]

#: Capacity of the virtual GPU when no budget is given (1 TiB): nothing runs out unless asked.
DEFAULT_TOTAL_MEMORY_BYTES = 1 << 40
_MiB = 1 << 20
_SMALL_SIZE = _MiB  # kSmallSize: requests up to 1 MiB use the small pool
_SMALL_BUFFER = 2 * _MiB  # kSmallBuffer: size of a small-pool segment
_GROW = ("segment_alloc", "segment_map")
_SHRINK = ("segment_free", "segment_unmap")
_REQUESTS = ("alloc", "free_requested", "free_completed")


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


@dataclass
class SnapshotReplay:
    """Result of :func:`replay_snapshot`. Sizes in bytes, time in seconds.

    ``*_segment_allocs`` are segment_alloc/segment_map sizes in order, recorded on the device vs made
    by the simulator; ``*_segment_alloc_positions`` the ordinal of the ``alloc`` request each served.
    ``first_divergence``: first index into those lists where size or position differ (or the shorter
    list ends), ``None`` when they agree. ``oom_at``: ``{"event_index", "requested_bytes", "phase"}``
    (phase ``"initial_state"`` or ``"replay"``; event_index is the trace index, ``None`` in the
    initial-state phase) or ``None``. ``fragmentation`` = 1 - peak_active / peak_reserved.
    """

    peak_allocated_bytes: int
    peak_reserved_bytes: int
    peak_active_bytes: int
    fragmentation: float | None
    num_alloc_retries: int
    oom: bool
    oom_at: dict[str, Any] | None
    events_replayed: int
    recorded_segment_allocs: list[int]
    simulated_segment_allocs: list[int]
    recorded_segment_alloc_positions: list[int]
    simulated_segment_alloc_positions: list[int]
    recorded_segment_frees: int
    simulated_segment_frees: int
    recorded_peak_reserved_bytes: int
    recorded_final_reserved_bytes: int
    simulated_final_reserved_bytes: int
    first_divergence: int | None
    unexplained_releases: int
    replay_seconds: float
    initial_reserved_bytes: int
    initial_live_bytes: int
    initial_state_exact: bool
    applied_recorded_releases: bool
    settings: str
    recorded_allocator_settings: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field."""
        import dataclasses

        return dataclasses.asdict(self)


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
    return segs


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


def unexplained_release_indices(trace: list[dict]) -> list[int]:
    """Trace indices of segment_free/segment_unmap events with no cause in the request stream.

    Inside ``malloc`` the allocator releases cached segments only on its way to a new one
    (``release_available_cached_blocks``, ``garbage_collect_cached_blocks``, ``release_cached_blocks``
    are each followed by ``alloc_block``) or to an OOM, so an allocator-caused release is followed by a
    segment_alloc/segment_map or an oom entry before the next request entry. Any other release came
    from the program (``torch.cuda.empty_cache()``, ``torch.cuda.memory._set_allocator_settings``, ...).
    Limitation: a program's ``empty_cache()`` directly followed by an allocation that needs a new
    segment looks exactly like the allocator's own release-and-retry in the trace and is counted as
    explained.
    """
    out: list[int] = []
    for i, e in enumerate(trace):
        if e["action"] not in _SHRINK:
            continue
        caused = False
        for later in trace[i + 1:]:
            act = later["action"]
            if act in _GROW or act == "oom":
                caused = True
                break
            if act in _REQUESTS:
                break
        if not caused:
            out.append(i)
    return out


def first_divergence(recorded: list[tuple[int, int]], simulated: list[tuple[int, int]]) -> int | None:
    """First index where two (size, position) lists differ, or where the shorter ends; None if equal."""
    for k, (r, s) in enumerate(zip(recorded, simulated)):
        if r != s:
            return k
    return None if len(recorded) == len(simulated) else min(len(recorded), len(simulated))


def _recorded_segments(trace: list[dict], initial_reserved: int) -> tuple[list[tuple[int, int]], int, int]:
    """((size, alloc ordinal) of each recorded segment_alloc/map, segment frees, peak reserved)."""
    allocs, frees, reserved, peak, ordinal = [], 0, initial_reserved, initial_reserved, 0
    for e in trace:
        act = e["action"]
        if act == "alloc":
            ordinal += 1
        elif act in _GROW:
            allocs.append((e["size"], ordinal + 1))  # served the next alloc request (1-based)
            reserved += e["size"]
            peak = max(peak, reserved)
        elif act in _SHRINK:
            frees += 1
            reserved -= e["size"]
    return allocs, frees, peak


def _make_sim(settings: Any, total_memory_bytes: int, device: int) -> Any:
    from oomtune.alloc.settings import AllocatorSettings
    from oomtune.alloc.sim import CachingAllocatorSim

    if isinstance(settings, str):
        settings = AllocatorSettings.parse(settings)
    sim = CachingAllocatorSim(settings, total_memory_bytes=total_memory_bytes, device_index=device,
                              record_segment_events=True)
    return sim, settings


def _render(settings: Any) -> str:
    if settings is None:
        return ""
    render = getattr(settings, "render", None)
    return render() if callable(render) else str(settings)


class _Run:
    """Mutable replay state: the simulator, address map and simulated segment events seen so far."""

    def __init__(self, sim: Any, addr_map: dict[int, int]) -> None:
        self.sim, self.addr_map = sim, addr_map
        self.seen = len(sim.segment_events)  # events of the synthetic prefix are not compared
        self.allocs: list[tuple[int, int]] = []
        self.frees = 0
        self.events = 0

    def collect(self, ordinal: int) -> None:
        """Attribute new simulated segment events to alloc request ``ordinal`` (counted from 1)."""
        for ev in self.sim.segment_events[self.seen:]:
            if ev["action"] in _GROW:
                self.allocs.append((ev["size"], ordinal))
            elif ev["action"] in _SHRINK:
                self.frees += 1
        self.seen = len(self.sim.segment_events)


def _replay_events(run: _Run, trace: list[dict], releases: set[int]) -> dict[str, Any] | None:
    """Feed the trace to the simulator; returns oom_at or None."""
    from oomtune.alloc.sim import SimulatedOutOfMemoryError

    ordinal = 0
    for i, e in enumerate(trace):
        act = e["action"]
        if act == "alloc":
            ordinal += 1
            try:
                run.addr_map[e["addr"]] = run.sim.malloc(e["size"], stream=e.get("stream", 0))
            except SimulatedOutOfMemoryError:
                run.collect(ordinal)
                return {"event_index": i, "requested_bytes": e["size"], "phase": "replay"}
            run.events += 1
            run.collect(ordinal)
        elif act == "free_completed":
            addr = run.addr_map.pop(e["addr"], None)
            if addr is not None:  # None: a block placed nowhere in the starting state
                run.sim.free(addr)
                run.events += 1
        elif i in releases and (i - 1) not in releases:  # one empty_cache per run of releases
            run.sim.empty_cache()
            run.collect(ordinal + 1)
    return None


def replay_snapshot(
    snapshot: dict[str, Any],
    settings: Any = None,
    *,
    total_memory_bytes: int | None = None,
    device: int = 0,
    apply_recorded_releases: bool = False,
) -> SnapshotReplay:
    """Replay a snapshot's trace through a ``CachingAllocatorSim`` and compare segment events.

    Args:
        snapshot: a validated snapshot (:func:`oomtune.trace.snapshot.load_snapshot`).
        settings: ``AllocatorSettings``, a PYTORCH_CUDA_ALLOC_CONF string, or None (torch defaults).
        total_memory_bytes: the virtual GPU's capacity; None -> 1 TiB (nothing runs out).
        device: which device's trace to replay.
        apply_recorded_releases: at each unexplained recorded release (:func:`unexplained_release_indices`,
            e.g. the program's ``torch.cuda.empty_cache()``) call ``sim.empty_cache()`` (once per run of
            consecutive releases; the simulator has no release of one given segment, and empty_cache
            is what produces such runs on the device).

    Returns:
        A :class:`SnapshotReplay`; peaks cover the starting state and the trace (the synthetic prefix
        that rebuilds the starting state is excluded with ``reset_peak_memory_stats``).

    Raises:
        SnapshotError: no trace for ``device``.
        AllocatorConfigError: a malformed settings string.
    """
    from oomtune.alloc.sim import SimulatedOutOfMemoryError

    trace, final = device_trace(snapshot, device)
    state = rebuild_initial_state(snapshot, device)
    total = DEFAULT_TOTAL_MEMORY_BYTES if total_memory_bytes is None else total_memory_bytes
    sim, settings = _make_sim(settings, total, device)
    unexplained = unexplained_release_indices(trace)
    started = time.perf_counter()
    oom_at = None
    try:
        addr_map, exact = seed_initial_state(sim, state)
    except SimulatedOutOfMemoryError as exc:
        addr_map, exact = {}, False
        oom_at = {"event_index": None, "requested_bytes": getattr(exc, "requested_bytes", None),
                  "phase": "initial_state"}
    retries0 = sim.memory_stats().get("num_alloc_retries", 0)
    sim.reset_peak_memory_stats()
    run = _Run(sim, addr_map)
    if oom_at is None:
        oom_at = _replay_events(run, trace, set(unexplained) if apply_recorded_releases else set())
    seconds = time.perf_counter() - started
    return _result(run, trace, final, state, oom_at, unexplained, retries0, seconds, exact,
                   apply_recorded_releases, settings, snapshot.get("allocator_settings"))


def _result(run: _Run, trace, final, state, oom_at, unexplained, retries0, seconds, exact,
            applied, settings, recorded_settings) -> SnapshotReplay:
    stats = run.sim.memory_stats()
    rec_allocs, rec_frees, rec_peak = _recorded_segments(trace, state.reserved_bytes)
    peak_reserved = stats["reserved_bytes.all.peak"]
    peak_active = stats["active_bytes.all.peak"]
    notes = []
    if not exact:
        notes.append("the starting state could not be reproduced exactly under these settings")
    if unexplained and not applied:
        notes.append(f"{len(unexplained)} recorded release(s) have no cause in the request stream "
                     "(e.g. torch.cuda.empty_cache()); see --apply-recorded-releases")
    return SnapshotReplay(
        peak_allocated_bytes=stats["allocated_bytes.all.peak"],
        peak_reserved_bytes=peak_reserved,
        peak_active_bytes=peak_active,
        fragmentation=(1 - peak_active / peak_reserved) if peak_reserved else None,
        num_alloc_retries=stats.get("num_alloc_retries", 0) - retries0,
        oom=oom_at is not None,
        oom_at=oom_at,
        events_replayed=run.events,
        recorded_segment_allocs=[s for s, _ in rec_allocs],
        simulated_segment_allocs=[s for s, _ in run.allocs],
        recorded_segment_alloc_positions=[p for _, p in rec_allocs],
        simulated_segment_alloc_positions=[p for _, p in run.allocs],
        recorded_segment_frees=rec_frees,
        simulated_segment_frees=run.frees,
        recorded_peak_reserved_bytes=rec_peak,
        recorded_final_reserved_bytes=sum(s["total_size"] for s in final),
        simulated_final_reserved_bytes=stats["reserved_bytes.all.current"],
        first_divergence=first_divergence(rec_allocs, run.allocs),
        unexplained_releases=len(unexplained),
        replay_seconds=seconds,
        initial_reserved_bytes=state.reserved_bytes,
        initial_live_bytes=state.live_bytes,
        initial_state_exact=exact,
        applied_recorded_releases=applied,
        settings=_render(settings),
        recorded_allocator_settings=recorded_settings,
        notes=notes,
    )
