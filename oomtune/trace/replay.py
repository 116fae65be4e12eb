"""Replaying a real GPU memory snapshot through the virtual GPU, and comparing segment events.

Steps:

1. :func:`rebuild_initial_state`: what the allocator held before the trace's first entry (recording
   starts mid-program, so the final segments hold segments and blocks the trace never created): the
   final state with the trace undone, as in the memory viewer.
2. Settings: the snapshot's recorded ``allocator_settings`` unless others are given
   (:mod:`oomtune.trace.recorded`); device capacity: the limit the trace implies when it shows the
   device running short (:mod:`oomtune.trace.releases`), unless a budget is given.
3. :func:`seed_initial_state`: puts the starting state into a ``CachingAllocatorSim`` through
   ``malloc``/``free`` only; a layout the settings cannot reproduce is reported
   (``initial_state_exact=False``).
4. Replay: ``alloc`` -> ``malloc(size, stream)``; ``free_completed`` -> ``free`` (with several
   streams the block returns to the pool when its events complete, ``process_events``, which
   ``free_completed`` marks); ``oom`` -> the same request, which must fail again; a release the
   program made (``empty_cache``, see :func:`oomtune.trace.releases.classify_releases`) ->
   ``empty_cache()``. Releases of the allocator itself are left to the simulator.
5. Every recorded segment_alloc/free/map/unmap and oom is compared with the simulator's, in order,
   size and position (:mod:`oomtune.trace.compare`); the first difference of any kind is reported.

When the compiled core is built, steps 1, 3 and 4 and the per-entry work of 2 and 5 run in C++
(``oomtune.alloc._fastcore.TraceReplay``, oomtune/alloc/_fasttrace.pxi) on the compiled simulator;
the Python functions named above stay the reference, and tests/test_trace_compiled.py checks that
both give the same :class:`SnapshotReplay` on every shared trace, truncated traces and synthetic
snapshots. A trace the core does not take (a value beyond its range) runs in Python.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from oomtune.trace.compare import (SEGMENT_ACTIONS, divergence_detail, first_divergence,
                                   recorded_events)
from oomtune.trace.initial_state import (InitialBlock, InitialSegment, InitialState, device_trace,
                                         rebuild_initial_state, seed_initial_state)
from oomtune.trace.releases import (DeviceLimit, Release, classify_runs, limit_from, oom_points,
                                    recorded_reserved_walk, release_runs)

__all__ = [
    "InitialBlock", "InitialSegment", "InitialState", "SnapshotReplay", "DEFAULT_TOTAL_MEMORY_BYTES",
    "RECORDED", "rebuild_initial_state", "seed_initial_state", "replay_snapshot", "device_trace",
    "first_divergence", "default_device",
]

#: Capacity of the virtual GPU when no budget is given and the trace implies no limit (1 TiB).
DEFAULT_TOTAL_MEMORY_BYTES = 1 << 40
#: ``settings`` value of :func:`replay_snapshot` meaning "the settings the snapshot records".
RECORDED = "<recorded>"
_GROW = ("segment_alloc", "segment_map")
_SHRINK = ("segment_free", "segment_unmap")


@dataclass
class SnapshotReplay:
    """Result of :func:`replay_snapshot`. Sizes in bytes, time in seconds.

    ``recorded_segment_events`` / ``simulated_segment_events``: ``[action, size, position]`` of every
    segment_alloc/free/map/unmap and oom (:mod:`oomtune.trace.compare`); ``first_divergence``: the
    first index where they differ (None: identical), ``divergence``: that index with both events.
    ``recorded_segment_allocs`` / ``simulated_segment_allocs``: sizes of segment_alloc/segment_map
    events, for display. ``oom_at``: the first simulated OOM that the device did not have
    (``{"event_index", "requested_bytes", "phase"}``, phase ``"initial_state"`` or ``"replay"``),
    else None. ``releases``: one dict per run of recorded releases (``trace_index``, ``count``,
    ``explicit``, ``rule``). ``device_limit``: what the trace implies about the device
    (``low_bytes``, ``high_bytes``, ``used_bytes``, ``sources``) or None. ``budget_source``:
    ``"given"``, ``"inferred from the trace"`` or ``"default"``; ``settings_source``: ``"recorded"``,
    ``"given"`` or ``"torch defaults (none recorded)"``. ``fragmentation`` = 1 - peak_active /
    peak_reserved.
    """

    peak_allocated_bytes: int
    peak_reserved_bytes: int
    peak_active_bytes: int
    fragmentation: float | None
    num_alloc_retries: int
    oom: bool
    oom_at: dict[str, Any] | None
    events_replayed: int
    recorded_segment_events: list[list[Any]]
    simulated_segment_events: list[list[Any]]
    recorded_segment_allocs: list[int]
    simulated_segment_allocs: list[int]
    recorded_segment_frees: int
    simulated_segment_frees: int
    recorded_ooms: int
    simulated_ooms: int
    recorded_peak_reserved_bytes: int
    recorded_final_reserved_bytes: int
    simulated_final_reserved_bytes: int
    first_divergence: int | None
    divergence: dict[str, Any] | None
    releases: list[dict[str, Any]]
    replay_seconds: float
    initial_reserved_bytes: int
    initial_live_bytes: int
    initial_state_exact: bool
    settings: str
    settings_source: str
    total_memory_bytes: int
    budget_source: str
    device_limit: dict[str, Any] | None
    device: int
    devices_with_data: list[int]
    recorded_allocator_settings: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        """Every segment event, the peak and the final reserved total as recorded, no extra OOM, on a
        device that holds data (a device with neither trace entries nor segments compares nothing:
        never exact)."""
        return (self.device in self.devices_with_data
                and self.first_divergence is None and self.oom_at is None
                and self.peak_reserved_bytes == self.recorded_peak_reserved_bytes
                and self.simulated_final_reserved_bytes == self.recorded_final_reserved_bytes)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field, plus ``exact``."""
        return dict(dataclasses.asdict(self), exact=self.exact)


def default_device(snapshot: dict[str, Any]) -> int:
    """The device replayed when none is named: the lowest index with trace entries, else the lowest
    with segments, else 0."""
    from oomtune.trace.snapshot import devices_with_data

    traced = [d for d, t in enumerate(snapshot["device_traces"]) if t]
    if traced:
        return traced[0]
    held = devices_with_data(snapshot)
    return held[0] if held else 0


def _make_sim(settings: Any, total_memory_bytes: int, device: int, memory_fraction: float | None) -> Any:
    from oomtune.alloc import make_simulator   # the compiled virtual GPU when built (same results)

    sim = make_simulator(settings, total_memory_bytes=total_memory_bytes, device_index=device,
                         record_segment_events=True)
    if memory_fraction is not None:
        sim.set_per_process_memory_fraction(memory_fraction)
    return sim


def _render(settings: Any) -> str:
    if settings is None:
        return ""
    render = getattr(settings, "render", None)
    return render() if callable(render) else str(settings)


class _Analysis:
    """What the replay needs from the trace before running it: the starting state's reserved and
    live bytes, the recorded peak, the runs of releases, the oom entries' limits, the recorded
    segment events. Computed by the compiled core when it is enabled and takes the trace
    (``oomtune.alloc._compiled.trace_replay``, same results), else by the Python functions of
    :mod:`oomtune.trace.initial_state` / :mod:`oomtune.trace.releases` / :mod:`oomtune.trace.compare`.
    """

    def __init__(self, snapshot: dict[str, Any], device: int, trace: list[dict], final: list[dict]) -> None:
        from oomtune.alloc._compiled import trace_replay

        self.snapshot, self.device, self.trace = snapshot, device, trace
        self.fast = trace_replay(trace, final)
        self._state: InitialState | None = None
        if self.fast is None:
            state = self.state
            self.reserved_bytes, self.live_bytes = state.reserved_bytes, state.live_bytes
            before, self.peak = recorded_reserved_walk(trace, self.reserved_bytes)
            self.runs, self.oom_points = release_runs(trace, before), oom_points(trace, before)
        else:
            fast = self.fast
            self.reserved_bytes, self.live_bytes, self.peak = fast.reserved_bytes, fast.live_bytes, fast.peak
            self.runs, self.oom_points = fast.release_runs(), fast.oom_points()

    @property
    def state(self) -> InitialState:
        """The starting state as :func:`rebuild_initial_state` gives it (computed when first asked)."""
        if self._state is None:
            self._state = rebuild_initial_state(self.snapshot, self.device)
        return self._state

    def tally(self, events: list[list[Any]]) -> tuple[list[int], int, int]:
        """:func:`_tally` (in the compiled core when it analysed the trace)."""
        return self.fast.tally(events) if self.fast is not None else _tally(events)

    def recorded_events(self) -> list[list[Any]]:
        """:func:`oomtune.trace.compare.recorded_events` of the trace, each event a list."""
        if self.fast is not None:
            return self.fast.recorded_events()
        return [list(e) for e in recorded_events(self.trace)]


class _Run:
    """Mutable replay state: the simulator, the address map and the simulated events so far."""

    def __init__(self, sim: Any, addr_map: dict[int, int]) -> None:
        self.sim, self.addr_map = sim, addr_map
        self.seen = len(sim.segment_events)  # events of the synthetic prefix are not compared
        self.events: list[list[Any]] = []   # [action, size, position]
        self.replayed = 0
        self.by_cache: set[int] = set()   # releases found to be the program's by the cached-block rule

    def collect(self, position: int) -> None:
        """Attribute the simulator's new segment events to request ``position``."""
        new = self.sim.segment_events
        if len(new) > self.seen:
            self.events.extend([ev["action"], ev["size"], position] for ev in new[self.seen:])
            self.seen = len(new)


def _replay_events(run: _Run, trace: list[dict], explicit_starts: set[int],
                   check_cache: dict[int, tuple[int, int]] | None = None) -> dict[str, Any] | None:
    """Feed the trace to the simulator; returns oom_at (an OOM the device did not have) or None.

    ``check_cache``: trace index of a release given to the allocator by the device-limit rule ->
    the next request ``(size, stream)``; if a cached block of the simulator would serve it, the
    release is replayed as ``empty_cache()`` and its index is added to ``run.by_cache``.
    """
    from oomtune.alloc.sim import SimulatedOutOfMemoryError

    sim, addr_map = run.sim, run.addr_map
    check_cache = check_cache or {}
    malloc, free, seg_events = sim.malloc, sim.free, sim.segment_events
    pos = replayed = 0
    try:
        for i, e in enumerate(trace):
            act = e["action"]
            if act == "alloc":
                try:
                    addr_map[e["addr"]] = malloc(e["size"], e.get("stream", 0))
                except SimulatedOutOfMemoryError:
                    run.collect(pos)
                    run.events.append(["oom", e["size"], pos])
                    return {"event_index": i, "requested_bytes": e["size"], "phase": "replay"}
                replayed += 1
                if len(seg_events) > run.seen:   # run.collect(pos), inlined: most requests make none
                    run.collect(pos)
                pos += 1
            elif act == "free_completed":
                addr = addr_map.pop(e["addr"], None)
                if addr is not None:  # None: a block placed nowhere in the starting state
                    free(addr)
                    replayed += 1
                pos += 1
            elif act == "oom":
                try:
                    addr = malloc(e["size"], e.get("stream", 0))
                except SimulatedOutOfMemoryError:
                    run.collect(pos)
                    run.events.append(["oom", e["size"], pos])
                else:  # the simulator found room where the device did not: a divergence, shown as such
                    run.collect(pos)
                    free(addr)
                replayed += 1
                pos += 1
            elif i in explicit_starts or (i in check_cache and sim.would_reuse_cached(*check_cache[i])):
                if i not in explicit_starts:
                    run.by_cache.add(i)
                sim.empty_cache()
                run.collect(pos)
    finally:
        run.replayed += replayed
    return None


def replay_snapshot(
    snapshot: dict[str, Any],
    settings: Any = RECORDED,
    *,
    total_memory_bytes: int | None = None,
    device: int | None = None,
    releases: str = "auto",
    memory_fraction: float | None = None,
) -> SnapshotReplay:
    """Replay one device's trace through a ``CachingAllocatorSim`` and compare segment events.

    Args:
        snapshot: a validated snapshot (:func:`oomtune.trace.snapshot.load_snapshot`).
        settings: :data:`RECORDED` (default: the snapshot's ``allocator_settings``, torch's defaults
            when it records none), or ``AllocatorSettings`` / a PYTORCH_CUDA_ALLOC_CONF string /
            None (torch defaults) to replay under other settings.
        total_memory_bytes: the virtual GPU's capacity; None: the limit the trace implies
            (:func:`oomtune.trace.releases.infer_device_limit`) when it shows one, else 1 TiB.
        device: which device's trace; None: :func:`default_device`.
        releases: ``"auto"`` (the program's releases, told apart from the allocator's by
            :func:`oomtune.trace.releases.classify_releases`, become ``empty_cache()``), ``"all"``
            (every recorded release does), ``"none"`` (none does).
        memory_fraction: as ``torch.cuda.set_per_process_memory_fraction`` in the recorded program
            (a limit of round(fraction x capacity); garbage_collection_threshold acts only under
            one). None: not set.

    Returns:
        A :class:`SnapshotReplay`; peaks cover the starting state and the trace (the synthetic prefix
        that rebuilds the starting state is excluded with ``reset_peak_memory_stats``).

    Raises:
        SnapshotError: no trace for ``device``. ConfigError: ``releases`` is not one of the three.
        AllocatorConfigError: a malformed settings string.
    """
    from oomtune.alloc.settings import AllocatorSettings
    from oomtune.exceptions import ConfigError
    from oomtune.trace.recorded import recorded_settings
    from oomtune.trace.snapshot import devices_with_data

    if releases not in ("auto", "all", "none"):
        raise ConfigError(f"invalid releases={releases!r}: expected 'auto', 'all' or 'none'")
    notes: list[str] = []
    device = default_device(snapshot) if device is None else device
    trace, final = device_trace(snapshot, device)
    facts = _Analysis(snapshot, device, trace, final)
    if isinstance(settings, str) and settings == RECORDED:
        settings, note = recorded_settings(snapshot)
        settings_source = "recorded" if snapshot.get("allocator_settings") and note is None else \
            "torch defaults (none recorded)"
        if note:
            notes.append(note)
    else:
        settings_source = "given"
        if isinstance(settings, str):
            settings = AllocatorSettings.parse(settings)
    groups = classify_runs(trace, facts.runs, facts.peak)
    while True:  # at most twice: again when the cached-block rule changed what bounds the limit
        limit = limit_from(facts.peak, groups, facts.oom_points)
        if total_memory_bytes is not None:
            total, budget_source = total_memory_bytes, "given"
        elif limit is not None:
            total, budget_source = limit.used_bytes, "inferred from the trace"
        else:
            total, budget_source = DEFAULT_TOTAL_MEMORY_BYTES, "default"
        started = time.perf_counter()
        run, oom_at, exact, retries0 = _run_replay(settings, total, device, memory_fraction, facts, trace,
                                                   groups, releases)
        if not run.by_cache:
            break
        groups = [dataclasses.replace(g, explicit=True, rule="cached block") if g.first in run.by_cache else g
                  for g in groups]
        if total_memory_bytes is not None or limit_from(facts.peak, groups, facts.oom_points) == limit:
            break
    seconds = time.perf_counter() - started
    held = devices_with_data(snapshot)
    if device not in held:
        notes.append(f"device {device} holds no trace entries or segments; devices with data: "
                     f"{', '.join(map(str, held)) or 'none'} (--device)")
    if not exact:
        notes.append("the starting state could not be reproduced exactly under these settings"
                      + ("" if settings_source != "given" or not snapshot.get("allocator_settings")
                         else " (the trace was recorded under its own allocator_settings)")
                      + ": the replay is approximate")
    return _result(run, facts, final, oom_at, retries0, seconds, exact, settings, settings_source,
                   snapshot, groups, limit, total, budget_source, device, held, notes)


def _run_replay(settings: Any, total: int, device: int, memory_fraction: float | None, facts: _Analysis,
                trace: list[dict], groups: list[Release], releases: str) -> tuple[_Run, Any, bool, int]:
    """Seed a fresh simulator with the starting state and replay ``trace``: (run, oom_at, exact,
    retries0); on the compiled simulator the whole loop runs in the core (``TraceReplay.replay``)."""
    from oomtune.alloc._compiled import is_compiled
    from oomtune.alloc.sim import SimulatedOutOfMemoryError

    sim = _make_sim(settings, total, device, memory_fraction)
    explicit = {g.first for g in groups if releases == "all" or (releases == "auto" and g.explicit)}
    check_cache = {g.first: g.request for g in groups if releases == "auto" and not g.explicit
                   and g.rule == "device limit" and g.request is not None}
    if facts.fast is not None and is_compiled(sim):
        events, oom_at, replayed, by_cache, exact, retries0 = facts.fast.replay(sim, explicit, check_cache)
        run = _Run(sim, {})
        run.events, run.replayed, run.by_cache = events, replayed, set(by_cache)
        return run, oom_at, exact, retries0
    oom_at = None
    try:
        addr_map, exact = seed_initial_state(sim, facts.state)
    except SimulatedOutOfMemoryError as exc:
        addr_map, exact = {}, False
        oom_at = {"event_index": None, "requested_bytes": getattr(exc, "requested_bytes", None),
                  "phase": "initial_state"}
    retries0 = sim.memory_stats().get("num_alloc_retries", 0)
    sim.reset_peak_memory_stats()
    run = _Run(sim, addr_map)
    if oom_at is None:
        oom_at = _replay_events(run, trace, explicit, check_cache)
    return run, oom_at, exact, retries0


def _release_dicts(groups: list[Release]) -> list[dict[str, Any]]:
    return [{"trace_index": g.first, "count": g.last - g.first + 1, "explicit": g.explicit, "rule": g.rule}
            for g in groups]


def _limit_dict(limit: DeviceLimit | None) -> dict[str, Any] | None:
    if limit is None:
        return None
    return {"low_bytes": limit.low_bytes, "high_bytes": limit.high_bytes, "used_bytes": limit.used_bytes,
            "sources": list(limit.sources)}


def _tally(events: list[list[Any]]) -> tuple[list[int], int, int]:
    """Of ``[action, size, position]`` segment events: the sizes of segment_alloc/segment_map, the
    number of segment_free/segment_unmap, the number of oom (one pass)."""
    grown, shrunk, ooms = [], 0, 0
    for action, size, _ in events:
        if action in _GROW:
            grown.append(size)
        elif action == "oom":
            ooms += 1
        else:
            shrunk += 1
    return grown, shrunk, ooms


def _result(run: _Run, facts: _Analysis, final, oom_at, retries0, seconds, exact, settings, settings_source,
            snapshot, groups, limit, total, budget_source, device, devices, notes) -> SnapshotReplay:
    stats = run.sim.memory_stats()
    recorded, simulated = facts.recorded_events(), run.events   # lists [action, size, position]
    rec_grown, rec_shrunk, rec_ooms = facts.tally(recorded)
    sim_grown, sim_shrunk, sim_ooms = facts.tally(simulated)
    same = recorded == simulated
    peak_reserved = stats["reserved_bytes.all.peak"]
    peak_active = stats["active_bytes.all.peak"]
    return SnapshotReplay(
        peak_allocated_bytes=stats["allocated_bytes.all.peak"],
        peak_reserved_bytes=peak_reserved,
        peak_active_bytes=peak_active,
        fragmentation=(1 - peak_active / peak_reserved) if peak_reserved else None,
        num_alloc_retries=stats.get("num_alloc_retries", 0) - retries0,
        oom=oom_at is not None,
        oom_at=oom_at,
        events_replayed=run.replayed,
        recorded_segment_events=recorded,
        simulated_segment_events=simulated,
        recorded_segment_allocs=rec_grown,
        simulated_segment_allocs=sim_grown,
        recorded_segment_frees=rec_shrunk,
        simulated_segment_frees=sim_shrunk,
        recorded_ooms=rec_ooms,
        simulated_ooms=sim_ooms,
        recorded_peak_reserved_bytes=facts.peak,
        recorded_final_reserved_bytes=sum(s["total_size"] for s in final),
        simulated_final_reserved_bytes=stats["reserved_bytes.all.current"],
        first_divergence=None if same else first_divergence(recorded, simulated),
        divergence=None if same else divergence_detail(recorded, simulated),
        releases=_release_dicts(groups),
        replay_seconds=seconds,
        initial_reserved_bytes=facts.reserved_bytes,
        initial_live_bytes=facts.live_bytes,
        initial_state_exact=exact,
        settings=_render(settings),
        settings_source=settings_source,
        total_memory_bytes=total,
        budget_source=budget_source,
        device_limit=_limit_dict(limit),
        device=device,
        devices_with_data=devices,
        recorded_allocator_settings=snapshot.get("allocator_settings"),
        notes=notes,
    )


assert set(SEGMENT_ACTIONS) == set(_GROW) | set(_SHRINK)
