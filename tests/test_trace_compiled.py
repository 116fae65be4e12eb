"""The compiled path of ``replay_snapshot`` gives exactly the Python path's results.

``oomtune.alloc._fastcore.TraceReplay`` (oomtune/alloc/_fasttrace.pxi) mirrors the Python functions
of oomtune/trace: the starting state (``rebuild_initial_state``), the recorded reserved walk, the
release runs and oom points (``releases``), the recorded segment events (``compare``), and the seeding
and replay on the compiled simulator. The Python code is the reference: every result here is the
Python path's (``OOMTUNE_PURE_PYTHON=1``), never a value the compiled code produced. Inputs: every
real trace in tests/data under its recorded settings and the variants below, the same traces with their
oldest entries dropped (as a ring buffer of ``max_entries`` drops them, so the starting state holds
blocks the trace frees without allocating), and seeded synthetic snapshots recorded from the Python
simulator with several streams, empty_cache, out-of-memory entries and expandable segments.
Without the extension the tests skip, except under CI (``OOMTUNE_REQUIRE_COMPILED=1``).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from oomtune.alloc import _compiled
from oomtune.alloc.sim import CachingAllocatorSim, SimulatedOutOfMemoryError
from oomtune.trace import load_snapshot, rebuild_initial_state, replay_snapshot
from oomtune.trace.compare import recorded_events
from oomtune.trace.initial_state import device_trace
from oomtune.trace.releases import oom_points, recorded_reserved_walk, release_runs
from oomtune.trace.replay import default_device

REPO = Path(__file__).resolve().parents[1]
#: The real GPU recordings in tests/data (copies of the project's shared traces, tests/data/README.md).
TRACES = sorted((REPO / "tests" / "data").glob("*.pickle"))

if not _compiled.available():
    if os.environ.get("OOMTUNE_REQUIRE_COMPILED") == "1":
        raise RuntimeError("OOMTUNE_REQUIRE_COMPILED=1 but oomtune.alloc._fastcore was not built")
    pytest.skip("the compiled replay core oomtune.alloc._fastcore is not built", allow_module_level=True)

MiB = 1 << 20
VARIANTS = [
    {},
    {"settings": None},
    {"settings": "expandable_segments:True"},
    {"settings": "max_split_size_mb:64,roundup_power2_divisions:4"},
    {"releases": "all"},
    {"releases": "none"},
    {"total_memory_bytes": 2 << 30},
    {"settings": "garbage_collection_threshold:0.6", "memory_fraction": 0.5},
]
EMPTY_CACHE_FRAMES = [{"name": "c10::cuda::CUDACachingAllocator::Native::NativeCachingAllocator::emptyCache()",
                       "filename": "", "line": 0}]


def both(snapshot, monkeypatch, **kw):
    """replay_snapshot's result dict on the compiled path and on the Python path (or the errors)."""
    out = []
    for pure in ("0", "1"):
        monkeypatch.setenv("OOMTUNE_PURE_PYTHON", pure)
        try:
            d = replay_snapshot(snapshot, **kw).to_dict()
            d.pop("replay_seconds")
        except Exception as exc:  # noqa: BLE001 - both paths must raise the same error
            d = f"{type(exc).__name__}: {exc}"
        out.append(d)
    return out


def truncated(snapshot, keep):
    """The snapshot as if recording had started ``len - keep`` entries later on every device."""
    return dict(snapshot, device_traces=[t[len(t) - keep:] if keep < len(t) else t
                                         for t in snapshot["device_traces"]])


@pytest.fixture(scope="module")
def real():
    return {p.name: load_snapshot(p) for p in TRACES}


@pytest.mark.parametrize("path", TRACES, ids=lambda p: p.stem)
def test_real_trace_is_analysed_by_the_compiled_core(path, real):
    snap = real[path.name]
    trace, final = device_trace(snap, default_device(snap))
    assert _compiled.trace_replay(trace, final) is not None   # not declined: the test below is not vacuous


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
@pytest.mark.parametrize("path", TRACES, ids=lambda p: p.stem)
def test_real_trace_replay_identical(path, variant, real, monkeypatch):
    compiled, pure = both(real[path.name], monkeypatch, **variant)
    assert compiled == pure


@pytest.mark.parametrize("fraction", [0.3, 0.6, 0.9])
@pytest.mark.parametrize("path", TRACES, ids=lambda p: p.stem)
def test_truncated_real_trace_identical(path, fraction, real, monkeypatch):
    snap = real[path.name]
    keep = int(max(len(t) for t in snap["device_traces"]) * fraction)
    compiled, pure = both(truncated(snap, keep), monkeypatch)
    assert compiled == pure
    assert isinstance(pure, dict) and pure["events_replayed"] > 0


def analysis_python(snapshot, device):
    trace, _ = device_trace(snapshot, device)
    state = rebuild_initial_state(snapshot, device)
    before, peak = recorded_reserved_walk(trace, state.reserved_bytes)
    segs = tuple((s.address, s.total_size_bytes, s.stream, s.pool, s.is_expandable,
                  tuple((b.offset_bytes, b.size_bytes, b.recorded_addr) for b in s.live_blocks))
                 for s in state.segments)
    return ((segs, state.unplaced_blocks), state.reserved_bytes, state.live_bytes, peak,
            release_runs(trace, before), oom_points(trace, before), [list(e) for e in recorded_events(trace)])


def analysis_compiled(snapshot, device):
    fast = _compiled.trace_replay(*device_trace(snapshot, device))
    assert fast is not None
    return (fast.state_tuples(), fast.reserved_bytes, fast.live_bytes, fast.peak, fast.release_runs(),
            fast.oom_points(), fast.recorded_events())


@pytest.mark.parametrize("fraction", [1.0, 0.5])
@pytest.mark.parametrize("path", TRACES, ids=lambda p: p.stem)
def test_analysis_parts_identical(path, fraction, real):
    """Starting state, reserved walk peak, release runs, oom points, recorded events: part by part."""
    snap = real[path.name]
    snap = truncated(snap, int(max(len(t) for t in snap["device_traces"]) * fraction))
    device = default_device(snap)
    assert analysis_compiled(snap, device) == analysis_python(snap, device)


def synthetic(seed, settings):
    """A snapshot recorded from the Python simulator: random requests on two streams, frees,
    empty_cache (with its frames), out-of-memory entries with device_free; the oldest entries
    dropped so the starting state holds segments and blocks the trace never created."""
    rng = random.Random(seed)
    sim = CachingAllocatorSim(settings, total_memory_bytes=rng.choice([256, 512, 1024]) * MiB,
                              record_segment_events=True)
    trace, live, seen = [], [], 0

    def segment_entries(frames=()):
        nonlocal seen
        for e in sim.segment_events[seen:]:
            trace.append({"action": e["action"], "addr": e["addr"], "size": e["size"], "stream": e["stream"],
                          "frames": list(frames)})
        seen = len(sim.segment_events)

    for _ in range(rng.randint(200, 700)):
        r = rng.random()
        if r < 0.55 or not live:
            size = rng.choice([rng.randint(1, 4096), rng.randint(1, MiB), rng.randint(MiB, 60 * MiB)])
            stream = rng.choice([0, 0, 0, 7])
            try:
                addr = sim.malloc(size, stream)
            except SimulatedOutOfMemoryError:
                segment_entries()
                trace.append({"action": "oom", "size": size, "stream": stream,
                              "device_free": sim.device_free_bytes, "frames": []})
                continue
            segment_entries()
            trace.append({"action": "alloc", "addr": addr, "size": size, "stream": stream, "frames": []})
            live.append((addr, size, stream))
        elif r < 0.97:
            addr, size, stream = live.pop(rng.randrange(len(live)))
            trace.append({"action": "free_requested", "addr": addr, "size": size, "stream": stream})
            sim.free(addr)
            segment_entries()
            trace.append({"action": "free_completed", "addr": addr, "size": size, "stream": stream})
        else:
            sim.empty_cache()
            segment_entries(EMPTY_CACHE_FRAMES)
        if rng.random() < 0.01:
            trace.append({"action": "snapshot", "frames": []})
    keep = rng.randint(len(trace) // 3, len(trace))
    return {"segments": sim.memory_snapshot(), "device_traces": [trace[len(trace) - keep:]],
            "allocator_settings": None}


@pytest.mark.parametrize("settings", [None, "expandable_segments:True", "max_split_size_mb:20",
                                      "garbage_collection_threshold:0.7,roundup_power2_divisions:2"])
@pytest.mark.parametrize("seed", range(6))
def test_synthetic_snapshot_identical(seed, settings, monkeypatch):
    snap = synthetic(seed, settings)
    assert analysis_compiled(snap, 0) == analysis_python(snap, 0)
    for variant in ({}, {"settings": settings}, {"releases": "all"}, {"total_memory_bytes": 300 * MiB}):
        compiled, pure = both(snap, monkeypatch, **variant)
        assert compiled == pure


def test_values_out_of_the_core_range_run_the_python_path(monkeypatch):
    """An address beyond 2**56 or a non-int stream is declined (None), and the replay still runs,
    on the Python path, with its results."""
    trace = [{"action": "alloc", "addr": 1 << 60, "size": 3 * MiB, "stream": 0},
             {"action": "free_requested", "addr": 1 << 60, "size": 3 * MiB, "stream": 0},
             {"action": "free_completed", "addr": 1 << 60, "size": 3 * MiB, "stream": 0}]
    snap = {"segments": [], "device_traces": [trace]}
    assert _compiled.trace_replay(trace, []) is None
    assert _compiled.trace_replay([dict(trace[0], stream=None)], []) is None
    compiled, pure = both(snap, monkeypatch)
    assert compiled == pure and pure["events_replayed"] == 2


def test_overlapping_segments_and_unplaced_blocks_identical(monkeypatch):
    """An inconsistent snapshot (tests/test_trace_replay.py's overlapping case, plus a block freed at
    an address no segment holds and one too large for its segment): the scan fallback of the
    segment finder and the unplaced blocks, on both paths."""
    L0 = 0x7F0001000000

    def ev(action, addr, size):
        return {"action": action, "addr": addr, "size": size, "stream": 0, "frames": []}

    trace = [ev("segment_free", L0 + 2 * MiB, 20 * MiB),
             ev("free_requested", L0 + 4 * MiB, 2 * MiB), ev("free_completed", L0 + 4 * MiB, 2 * MiB),
             ev("free_requested", L0 + 64 * MiB, MiB), ev("free_completed", L0 + 64 * MiB, MiB),
             ev("free_requested", L0 + 19 * MiB, 5 * MiB), ev("free_completed", L0 + 19 * MiB, 5 * MiB),
             ev("alloc", L0 + 4 * MiB, 2 * MiB)]
    final = [{"device": 0, "address": L0, "total_size": 20 * MiB, "stream": 0, "segment_type": "large",
              "is_expandable": False, "frames": [],
              "blocks": [{"size": 20 * MiB, "requested_size": 0, "state": "inactive", "frames": []}]}]
    snap = {"segments": final, "device_traces": [trace]}
    python = analysis_python(snap, 0)
    assert python[0][1] == (L0 + 19 * MiB, L0 + 64 * MiB)   # by hand: outside L0+22 MiB / no segment
    assert analysis_compiled(snap, 0) == python
    compiled, pure = both(snap, monkeypatch)
    assert compiled == pure


def _fresh(value):
    """An equal string that is a new object (not the interned or memoised one)."""
    return "".join(list(value)) if isinstance(value, str) else value


def _fresh_copy(obj):
    """``obj`` with every dict key and string value a new object: the compiled core matches keys and
    actions by the identity of the first entry's objects first, and must fall back to equality."""
    if isinstance(obj, dict):
        return {_fresh(k): _fresh_copy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_fresh_copy(v) for v in obj]
    return _fresh(obj)


@pytest.mark.parametrize("path", TRACES[:3], ids=lambda p: p.stem)
def test_fresh_string_objects_give_the_same_analysis(path, real, monkeypatch):
    """Keys and action/state strings as distinct objects per entry (more than the 16 the identity
    cache remembers), and a first entry whose keys differ from the rest: same analysis and replay."""
    snap = real[path.name]
    device = default_device(snap)
    fresh = _fresh_copy({"segments": snap["segments"], "device_traces": snap["device_traces"],
                         "allocator_settings": snap.get("allocator_settings")})
    fresh["device_traces"][device].insert(0, {"action": "snapshot"})   # no addr/size/stream keys
    expected = analysis_python(fresh, device)
    assert analysis_compiled(fresh, device) == expected
    compiled, pure = both(fresh, monkeypatch)
    assert isinstance(pure, dict) and compiled == pure


@pytest.mark.parametrize("damage", [
    lambda s: s["device_traces"][0][0].pop("addr"),                            # an alloc without addr
    lambda s: s["device_traces"][0].__setitem__(0, ["alloc"]),                # an entry not a dict
    lambda s: s["segments"][0]["blocks"][0].__setitem__("state", 7),          # a state not a str
    lambda s: s["segments"][0]["blocks"].__setitem__(0, ("active_allocated",)),  # a block not a dict
    lambda s: s["segments"][0].pop("blocks"),                                 # a segment without blocks
], ids=["no-addr", "entry-not-dict", "state-not-str", "block-not-dict", "no-blocks"])
def test_malformed_values_are_declined_and_the_python_path_decides(damage, monkeypatch):
    """Values the validated loader would refuse, handed to replay_snapshot directly: the compiled
    core declines them (None) and the caller gets exactly what the Python path gives."""
    snap = synthetic(0, None)
    trace = snap["device_traces"][0]
    first_alloc = next(i for i, e in enumerate(trace) if e["action"] == "alloc")
    snap["device_traces"][0] = trace[first_alloc:]
    assert snap["segments"] and snap["segments"][0]["blocks"]
    damage(snap)
    assert _compiled.trace_replay(*device_trace(snap, 0)) is None
    compiled, pure = both(snap, monkeypatch)
    assert compiled == pure
