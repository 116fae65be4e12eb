"""The compiled replay core (oomtune.alloc._fastcore) gives exactly the pure-Python simulator's results.

Both paths run ``replay_stream`` on the same streams and settings (``OOMTUNE_PURE_PYTHON=1`` selects
the Python simulator); the whole ``ReplayResult`` (peaks, every ``memory_stats`` counter, the OOM
index and message, events replayed) must be equal. Streams: the request streams of every
real trace in tests/data under their recorded settings and the
combinations below, and seeded synthetic streams that run out of memory, garbage-collect, release
cached blocks and use several CUDA streams. Without the extension the tests skip, except under CI
(``OOMTUNE_REQUIRE_COMPILED=1``, set by .ci/run), where a missing build is a failure.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from oomtune.alloc import _compiled
from oomtune.alloc.stream import AllocationStream, replay_stream

REPO = Path(__file__).resolve().parents[1]
#: The real GPU recordings in tests/data (copies of the project's shared traces, tests/data/README.md).
TRACES = sorted((REPO / "tests" / "data").glob("*.pickle"))

if not _compiled.available():
    if os.environ.get("OOMTUNE_REQUIRE_COMPILED") == "1":
        raise RuntimeError("OOMTUNE_REQUIRE_COMPILED=1 but oomtune.alloc._fastcore was not built "
                           "(pip install -e . needs Cython and a C++ compiler)")
    pytest.skip("the compiled replay core oomtune.alloc._fastcore is not built (pip install -e . with "
                "Cython and a C++ compiler builds it); the pure-Python simulator is in use",
                allow_module_level=True)

#: Every allocator setting the simulator models, alone and combined (PYTORCH_CUDA_ALLOC_CONF).
SETTINGS = [
    None,
    "expandable_segments:True",
    "max_split_size_mb:200",
    "max_split_size_mb:64,max_non_split_rounding_mb:40",
    "roundup_power2_divisions:4",
    "roundup_power2_divisions:[256:1,512:2,1024:4,>:8],max_split_size_mb:100",
    "garbage_collection_threshold:0.6",
    "garbage_collection_threshold:0.6,max_split_size_mb:64",
    "expandable_segments:True,garbage_collection_threshold:0.7",
    "expandable_segments:True,max_split_size_mb:128,roundup_power2_divisions:2",
    "expandable_segments:True,large_segment_size_mb:64",
]


def both(stream: AllocationStream, settings, monkeypatch, **kw) -> tuple[dict, dict]:
    """(pure-Python result, compiled result) of ``replay_stream`` as dicts."""
    monkeypatch.setenv("OOMTUNE_PURE_PYTHON", "1")
    pure = replay_stream(stream, settings, **kw).to_dict()
    monkeypatch.delenv("OOMTUNE_PURE_PYTHON")
    assert _compiled.enabled()
    return pure, replay_stream(stream, settings, **kw).to_dict()


def synthetic(n_events: int, seed: int, n_streams: int = 1, live_target: int = 600) -> AllocationStream:
    """Seeded requests: sizes log-uniform 512 B .. 256 MiB, 1% of 0 bytes, on ``n_streams`` streams."""
    rng = random.Random(seed)
    stream, live, key = AllocationStream(), [], 0
    while len(stream) < n_events:
        if live and (len(live) > live_target or rng.random() < 0.5 * len(live) / live_target):
            stream.append_free(live.pop(rng.randrange(len(live))))
        else:
            key += 1
            size = 0 if rng.random() < 0.01 else int(2 ** rng.uniform(9, 28))
            stream.append_alloc(key, size, rng.randrange(n_streams))
            live.append(key)
    return stream


def trace_stream(path: Path) -> tuple[AllocationStream, object]:
    """A real trace's requests as a stream (alloc / free_completed of device 0's entries, keyed by
    address; frees of blocks allocated before the trace dropped) and its recorded settings."""
    from oomtune.trace import load_snapshot
    from oomtune.trace.initial_state import device_trace
    from oomtune.trace.recorded import recorded_settings
    from oomtune.trace.replay import default_device

    snap = load_snapshot(path)
    trace, _ = device_trace(snap, default_device(snap))
    stream, live = AllocationStream(), set()
    for e in trace:
        if e["action"] == "alloc" and e["addr"] not in live:
            stream.append_alloc(e["addr"], e["size"], e.get("stream", 0))
            live.add(e["addr"])
        elif e["action"] == "free_completed" and e["addr"] in live:
            stream.append_free(e["addr"], e.get("stream", 0))
            live.discard(e["addr"])
    return stream, recorded_settings(snap)[0]


@pytest.mark.parametrize("path", TRACES, ids=lambda p: p.name)
def test_every_shared_trace_identical(path, monkeypatch):
    stream, recorded = trace_stream(path)
    assert len(stream) > 1000
    peak = stream.peak_live_bytes()
    for settings in [recorded, *SETTINGS]:
        # roomy, tight (OOMs, retries, releases) and a memory fraction with garbage collection
        for kw in ({"total_memory_bytes": 1 << 40}, {"total_memory_bytes": peak, "stop_on_oom": False},
                   {"total_memory_bytes": 2 * peak, "memory_fraction": 0.6, "non_allocator_bytes": 1 << 20}):
            pure, fast = both(stream, settings, monkeypatch, **kw)
            assert fast == pure, (path.name, settings, kw)


@pytest.mark.parametrize("settings", SETTINGS)
def test_synthetic_streams_identical_with_ooms(settings, monkeypatch):
    ooms = retries = 0
    for seed, n_streams in ((0, 1), (1, 3)):
        stream = synthetic(6000, seed, n_streams)
        for kw in ({"total_memory_bytes": 80 << 30},
                   {"total_memory_bytes": 6 << 30, "stop_on_oom": False},
                   {"total_memory_bytes": 6 << 30},
                   {"total_memory_bytes": 12 << 30, "memory_fraction": 0.6, "stop_on_oom": False},
                   {"total_memory_bytes": 16 << 30, "memory_fraction": 0.7, "non_allocator_bytes": 1 << 30,
                    "stop_on_oom": False}):
            pure, fast = both(stream, settings, monkeypatch, **kw)
            assert fast == pure, (settings, seed, kw)
            ooms += pure["num_ooms"]
            retries += pure["num_alloc_retries"]
    assert ooms > 10 and retries > 10   # the slow paths ran, not only the cached-block path


def test_oom_message_and_index_identical(monkeypatch):
    stream = AllocationStream([("alloc", 1, 3 << 30), ("alloc", 2, 100 << 20), ("free", 1),
                               ("alloc", 3, 5 << 30), ("alloc", 4, 512)])
    pure, fast = both(stream, None, monkeypatch, total_memory_bytes=4 << 30)
    assert fast == pure
    # 5 GiB cannot fit on a 4 GiB device even after releasing the cached 3 GiB segment
    assert pure["oom_event_index"] == 3 and pure["events_replayed"] == 4
    assert "Tried to allocate 5.00 GiB" in pure["oom_message"]


def test_declines_what_it_does_not_cover(monkeypatch):
    """A stream the Python simulator rejects mid-replay (a negative size, built around the checks of
    ``append``) is left to it, so the same ConfigError comes out."""
    from oomtune.exceptions import ConfigError

    stream = AllocationStream([("alloc", 1, 1024)])
    stream.sizes[0] = -5
    with pytest.raises(ConfigError, match="negative size"):
        replay_stream(stream, None, total_memory_bytes=1 << 30)


def test_empty_stream(monkeypatch):
    pure, fast = both(AllocationStream(), None, monkeypatch, total_memory_bytes=1 << 30)
    assert fast == pure and pure["events_replayed"] == 0


# -- the per-call API (make_simulator -> _fastcore.FastSim) -------------------------------------------

def _outcome(fn, *args):
    """(result, None) or (None, (exception type, message, its figures)) of one simulator call."""
    try:
        return fn(*args), None
    except Exception as exc:   # noqa: BLE001 - compared, not handled
        figures = {k: v for k, v in vars(exc).items() if not k.startswith("_")}
        return None, (type(exc).__name__, str(exc), figures)


@pytest.mark.parametrize("settings", SETTINGS)
def test_per_call_api_identical(settings, monkeypatch):
    """Random malloc / free / empty_cache / would_reuse_cached / fraction / peak resets on the Python
    simulator and on FastSim: every return value, error, segment event, stats dict and snapshot."""
    from oomtune.alloc._compiled import make_simulator
    from oomtune.alloc.sim import CachingAllocatorSim

    monkeypatch.delenv("OOMTUNE_PURE_PYTHON", raising=False)
    kw = {"total_memory_bytes": 6 << 30, "non_allocator_bytes": 300 << 20, "device_index": 1,
          "record_segment_events": True}
    for seed in range(3):
        rng = random.Random(seed)
        py, fast = CachingAllocatorSim(settings, **kw), make_simulator(settings, **kw)
        assert type(fast).__name__ == "FastSim"
        live: list[int] = []
        ooms = 0
        for step in range(3000):
            r = rng.random()
            if r < 0.5 or not live:
                size = rng.choice([0, rng.randrange(1, 4096), int(2 ** rng.uniform(9, 31))])
                args = (size, rng.randrange(2))
                out = _outcome(py.malloc, *args)
                assert _outcome(fast.malloc, *args) == out, (step, args)
                if out[1] is None:
                    live.append(out[0])
                else:
                    ooms += 1
            elif r < 0.93:
                addr = live.pop(rng.randrange(len(live)))
                assert _outcome(fast.free, addr) == _outcome(py.free, addr)
            elif r < 0.95:
                args = (int(2 ** rng.uniform(9, 30)), rng.randrange(2))
                assert fast.would_reuse_cached(*args) == py.would_reuse_cached(*args)
            elif r < 0.96:
                fast.empty_cache()
                py.empty_cache()
            elif r < 0.97:
                frac = rng.choice([0.5, 0.8, 1.0, 1.5])
                assert _outcome(fast.set_per_process_memory_fraction, frac) == \
                    _outcome(py.set_per_process_memory_fraction, frac)
            elif r < 0.98:
                fast.reset_peak_memory_stats()
                py.reset_peak_memory_stats()
            else:
                assert fast.memory_snapshot() == py.memory_snapshot()
            assert fast.segment_events == py.segment_events
        assert fast.memory_stats() == py.memory_stats()
        assert fast.memory_snapshot() == py.memory_snapshot()
        for name in ("allocated_bytes", "reserved_bytes", "device_free_bytes", "total_memory_bytes",
                     "expandable_segments", "allowed_bytes", "num_ooms", "num_alloc_retries",
                     "num_sync_all_streams", "num_device_alloc", "num_device_free"):
            assert getattr(fast, name) == getattr(py, name), name
        assert ooms > 0 and py.num_device_free > 0
    for bad in (-1, 12345):   # a negative size; a free of an unknown address: the same ConfigError
        fn = "malloc" if bad < 0 else "free"
        assert _outcome(getattr(fast, fn), bad) == _outcome(getattr(py, fn), bad)


@pytest.mark.parametrize("path", TRACES, ids=lambda p: p.name)
def test_replay_snapshot_identical(path, monkeypatch):
    """``oomtune simulate``'s replay (trace.replay_snapshot) gives the same result on both paths."""
    from oomtune.trace import load_snapshot, replay_snapshot

    snap = load_snapshot(path)
    results = []
    for pure in ("1", "0"):
        monkeypatch.setenv("OOMTUNE_PURE_PYTHON", pure)
        for kw in ({}, {"settings": "expandable_segments:True"}, {"settings": "max_split_size_mb:64",
                                                                   "memory_fraction": 0.9}):
            d = replay_snapshot(snap, **kw).to_dict()
            d.pop("replay_seconds")
            results.append(d)
    assert results[:3] == results[3:]


@pytest.mark.parametrize("settings", [None, "expandable_segments:True", "max_split_size_mb:64",
                                      "garbage_collection_threshold:0.6"])
def test_report_step_snapshot_identical(settings, monkeypatch):
    """The report's winner step (htmlreport._step.synthesise_snapshot: per-call malloc/free with
    segment events, then memory_snapshot) is the same on FastSim and on the Python simulator."""
    from oomtune.htmlreport._step import synthesise_snapshot

    stream = synthetic(3000, seed=7, n_streams=2, live_target=40)
    out = []
    for pure in ("1", "0"):
        monkeypatch.setenv("OOMTUNE_PURE_PYTHON", pure)
        out.append(synthesise_snapshot(stream, settings or "", total_memory_bytes=80 << 30, memory_fraction=0.5))
    assert out[0] == out[1]
    assert any(e["action"] == ("segment_map" if settings and "expandable" in settings else "segment_alloc")
               for e in out[1]["device_traces"][0])
