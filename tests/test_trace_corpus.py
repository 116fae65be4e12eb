"""Every real GPU recording in tests/data replays exactly, by default.

The figures below were read from the traces themselves (not from any replay): per device, the
number of segment_alloc / segment_free / segment_map / segment_unmap / oom entries, the bytes of
each segment action, the peak reserved (final reserved minus the trace's net segment change, plus
the largest running total of the trace's segment changes) and the final reserved (sum of the final
snapshot's ``total_size`` for that device). They agree with tests/data/README.md where it
quotes them (783 and 782 segment_alloc, 430 / 884 / 742 segment_free, final 58,280 MiB, 12,074 MiB,
128 MiB). No flag is given to the replay: recorded settings, release rules and the device limit
are what it finds in the trace.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from oomtune.trace import load_snapshot, replay_snapshot

DATA = Path(__file__).resolve().parent / "data"
ACTIONS = ("segment_alloc", "segment_free", "segment_map", "segment_unmap", "oom")

# (file, device, counts of ACTIONS, bytes of the four segment actions, peak reserved, final reserved)
CORPUS = [
    ("cnn-small-default", 0, (7, 0, 0, 0, 0), (109051904, 0, 0, 0), 134217728, 134217728),
    ("lm-ctx128-fullstep", 0, (783, 0, 0, 0, 0), (47347400704, 0, 0, 0), 61111009280, 61111009280),
    ("lm-ctx128-fullstep-emptycache", 0, (782, 430, 0, 0, 0), (47313846272, 30918311936, 0, 0),
     61111009280, 61111009280),
    ("lm-ctx256-forward-emptycache-mid", 0, (390, 884, 0, 0, 0), (8868855808, 49385832448, 0, 0),
     63350767616, 22833790976),
    ("lm-2.7b-forward", 0, (178, 742, 0, 0, 0), (3980394496, 20931674112, 0, 0), 51849986048, 34898706432),
    ("lm-step-small", 0, (0, 0, 0, 0, 0), (0, 0, 0, 0), 4238344192, 4238344192),
    ("lm-medium-ctx512-training", 0, (1, 0, 0, 0, 0), (67108864, 0, 0, 0), 12660506624, 12660506624),
    ("gnn-dataparallel-expandable-oom", 0, (0, 0, 175, 0, 0), (0, 0, 8541700096, 0), 8541700096, 8541700096),
    ("gnn-dataparallel-expandable-oom", 1, (0, 0, 40, 6, 1), (0, 0, 88166367232, 3963617280),
     84202749952, 84202749952),
    ("gnn-dataparallel-expandable-oom", 2, (0, 0, 78, 0, 0), (0, 0, 21883781120, 0), 21883781120, 21883781120),
]

_SNAPSHOTS: dict[str, dict] = {}


def _snapshot(name: str) -> dict:
    if name not in _SNAPSHOTS:
        _SNAPSHOTS[name] = load_snapshot(DATA / f"{name}.pickle")
    return _SNAPSHOTS[name]


@pytest.mark.parametrize("name, device, counts, sizes, peak, final", CORPUS,
                         ids=[f"{c[0]}-dev{c[1]}" for c in CORPUS])
def test_real_trace_replays_exactly_by_default(name, device, counts, sizes, peak, final):
    r = replay_snapshot(_snapshot(name), device=device)
    sim = r.simulated_segment_events
    assert r.divergence is None, r.divergence          # every event: action, size, request, in order
    assert sim == r.recorded_segment_events
    n = Counter(a for a, _, _ in sim)
    assert tuple(n[a] for a in ACTIONS) == counts
    b = Counter()
    for a, size, _ in sim:
        b[a] += size
    assert tuple(b[a] for a in ACTIONS[:4]) == sizes
    assert r.peak_reserved_bytes == r.recorded_peak_reserved_bytes == peak
    assert r.simulated_final_reserved_bytes == r.recorded_final_reserved_bytes == final
    assert r.oom_at is None and r.initial_state_exact and r.exact


def test_every_shipped_trace_is_in_the_corpus():
    assert sorted(p.stem for p in DATA.glob("*.pickle")) == sorted({c[0] for c in CORPUS})


# Releases with their stack frames removed (as in snapshots recorded without context): the other
# rules must reach the same verdicts. Expected rule per trace, from its structure: the 430 frees of
# lm-ctx128-fullstep-emptycache are followed by a segment_alloc, but reserved before them (41.6 GiB)
# plus the 20 MiB needed stays below the 56.9 GiB peak the device held: the program's. The
# forward-pass traces' releases are followed by a request: the program's. gnn device 1's unmaps
# precede a 4.94 GiB map; reserved before them plus that map exceeds the 78.4 GiB peak: the allocator's.
FRAMELESS = [
    ("lm-ctx128-fullstep-emptycache", 0, True, "device limit"),
    ("lm-2.7b-forward", 0, True, "request stream"),
    ("lm-ctx256-forward-emptycache-mid", 0, True, "request stream"),
    ("gnn-dataparallel-expandable-oom", 1, False, "device limit"),
]


@pytest.mark.parametrize("name, device, explicit, rule", FRAMELESS, ids=[f"{c[0]}-dev{c[1]}" for c in FRAMELESS])
def test_real_trace_without_frames_still_replays_exactly(name, device, explicit, rule):
    import copy

    snap = copy.deepcopy(_snapshot(name))
    for trace in snap["device_traces"]:
        for e in trace:
            e.pop("frames", None)
    r = replay_snapshot(snap, device=device)
    assert [(g["explicit"], g["rule"]) for g in r.releases] == [(explicit, rule)]
    assert r.exact, r.divergence
