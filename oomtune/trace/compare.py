"""Segment events of a trace and of a replay, in one comparable form, and their first difference.

An event is ``(action, size_bytes, position)``: ``action`` one of segment_alloc, segment_free,
segment_map, segment_unmap, oom; ``position`` the number of request entries (``alloc``,
``free_completed``, ``oom``) before it in the trace, which is the request the event served (the
allocator records segment events inside ``malloc``, before the ``alloc`` entry of the request
that needed them) or, for an ``empty_cache`` between requests, the next request's number.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SEGMENT_ACTIONS", "REQUEST_ACTIONS", "recorded_events", "first_divergence", "divergence_detail"]

SEGMENT_ACTIONS = ("segment_alloc", "segment_free", "segment_map", "segment_unmap")
REQUEST_ACTIONS = ("alloc", "free_completed", "oom")

Event = tuple[str, int, int]


def recorded_events(trace: list[dict]) -> list[Event]:
    """The trace's segment events and oom entries as ``(action, size_bytes, position)``, in order."""
    out: list[Event] = []
    pos = 0
    for e in trace:
        act = e["action"]
        if act in SEGMENT_ACTIONS:
            out.append((act, e["size"], pos))
        elif act in REQUEST_ACTIONS:
            if act == "oom":
                out.append(("oom", e["size"], pos))
            pos += 1
    return out


def first_divergence(recorded: list[Any], simulated: list[Any]) -> int | None:
    """First index where two event lists differ (action, size or position), or where the shorter
    one ends; None when they are equal."""
    for k, (r, s) in enumerate(zip(recorded, simulated)):
        if tuple(r) != tuple(s):
            return k
    return None if len(recorded) == len(simulated) else min(len(recorded), len(simulated))


def divergence_detail(recorded: list[Event], simulated: list[Event]) -> dict[str, Any] | None:
    """``{"index", "recorded", "simulated"}`` at :func:`first_divergence` (an event as a list, or
    None past the end of that side), or None when the lists agree."""
    k = first_divergence(recorded, simulated)
    if k is None:
        return None
    return {"index": k,
            "recorded": list(recorded[k]) if k < len(recorded) else None,
            "simulated": list(simulated[k]) if k < len(simulated) else None}
