"""The compiled replay core (oomtune.alloc._fastcore) gives exactly the pure-Python simulator's results.

Both paths run ``replay_stream`` on the same streams and settings (``OOMTUNE_PURE_PYTHON=1`` selects
the Python simulator); the whole ``ReplayResult`` (peaks, every ``memory_stats`` counter, the OOM
index and message, events replayed) must be equal. Streams: the request streams of every shared
real trace (../shared/traces, and the copies in tests/data) under their recorded settings and the
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
TRACES = sorted({p.name: p for d in (REPO.parent / "shared" / "traces", REPO / "tests" / "data")
                 if d.is_dir() for p in d.glob("*.pickle")}.values())

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
