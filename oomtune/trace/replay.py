"""Replaying a real GPU memory snapshot through the virtual GPU, and comparing segment events.

Three steps:

1. :func:`rebuild_initial_state`: what the allocator held before the trace's first entry (recording
   starts mid-program, so the final segments hold segments and blocks the trace never created): the
   final state with the trace undone, as in the memory viewer.
2. :func:`seed_initial_state`: puts that state into a ``CachingAllocatorSim`` through ``malloc``/``free``
   only; a layout the settings cannot reproduce is reported (``initial_state_exact=False``).
3. :func:`replay_snapshot`: ``alloc`` -> ``malloc(size, stream)``; ``free_completed`` -> ``free``.
   ``free_requested`` is when the program dropped the tensor; with several streams the allocator keeps
   the block until the recorded CUDA events complete (``DeviceCachingAllocator::free`` ->
   ``insert_events``; the block returns to the pool in ``process_events``), and ``free_completed`` marks
   that moment, so it is the one that changes memory. With one stream the two are adjacent.

Steps 1 and 2 live in :mod:`oomtune.trace.initial_state` (the details are there); their names are
re-exported here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from oomtune.trace.initial_state import (
    InitialBlock,
    InitialSegment,
    InitialState,
    device_trace,
    rebuild_initial_state,
    seed_initial_state,
)

__all__ = [
    "InitialBlock", "InitialSegment", "InitialState", "SnapshotReplay", "DEFAULT_TOTAL_MEMORY_BYTES",
    "rebuild_initial_state", "seed_initial_state", "replay_snapshot", "device_trace",
    "unexplained_release_indices", "first_divergence",
]

#: Capacity of the virtual GPU when no budget is given (1 TiB): nothing runs out unless asked.
DEFAULT_TOTAL_MEMORY_BYTES = 1 << 40
_GROW = ("segment_alloc", "segment_map")
_SHRINK = ("segment_free", "segment_unmap")
_REQUESTS = ("alloc", "free_requested", "free_completed")


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


def _make_sim(settings: Any, total_memory_bytes: int, device: int,
              memory_fraction: float | None = None) -> Any:
    from oomtune.alloc.settings import AllocatorSettings
    from oomtune.alloc.sim import CachingAllocatorSim

    if isinstance(settings, str):
        settings = AllocatorSettings.parse(settings)
    sim = CachingAllocatorSim(settings, total_memory_bytes=total_memory_bytes, device_index=device,
                              record_segment_events=True)
    if memory_fraction is not None:
        sim.set_per_process_memory_fraction(memory_fraction)
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
    memory_fraction: float | None = None,
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
        memory_fraction: as ``torch.cuda.set_per_process_memory_fraction`` in the recorded program:
            caps reserved memory at ``fraction x total_memory_bytes`` and enables
            garbage_collection_threshold, which acts only under a fraction (DeviceCachingAllocator::
            garbage_collect_cached_blocks). None: not set.

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
    sim, settings = _make_sim(settings, total, device, memory_fraction)
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
