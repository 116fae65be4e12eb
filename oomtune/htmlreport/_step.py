"""The winner's step as a memory snapshot: synthesised on the virtual GPU in the format of
``torch.cuda.memory._dump_snapshot()`` (the pickle PyTorch's memory_viz page,
https://pytorch.org/memory_viz, opens), and read back as the series the report draws.

Format (torch/cuda/memory.py ``_snapshot``; entries as c10/cuda/CUDACachingAllocator.h TraceEntry)::

    {"segments": [...],                 # the state at the end (CachingAllocatorSim.memory_snapshot())
     "device_traces": [[{"action", "addr", "size", "stream", "time_us", "frames"}, ...]],
     "allocator_settings": {...},     # torch's layout (oomtune.trace.recorded.snapshot_settings)
     "oomtune": {"memory_source": "simulated", "alloc_conf": "..."}}   # ignored by memory_viz

Trace entries in the order the native allocator records them: ``segment_alloc``/``segment_map`` (and
``segment_free``/``segment_unmap`` of a release) inside the malloc call that caused them, before its
``alloc``; a free writes ``free_requested`` then ``free_completed`` (no cross-stream uses are modelled,
so nothing is deferred). ``alloc``/``free_*`` sizes are requested sizes (torch records ``orig_size``
and ``block->requested_size``); segment sizes are the bytes reserved. ``time_us`` is the event's
ordinal (the virtual GPU has no clock); ``frames`` are empty.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

__all__ = ["synthesise_snapshot", "write_step_snapshot", "step_series"]

_SEGMENT_UP = ("segment_alloc", "segment_map")
_SEGMENT_DOWN = ("segment_free", "segment_unmap")


def synthesise_snapshot(stream: Any, alloc_conf: str, *, total_memory_bytes: int,
                        memory_fraction: float = 1.0) -> dict[str, Any]:
    """Replay ``stream`` (an :class:`oomtune.alloc.stream.AllocationStream`) on a fresh virtual GPU
    under ``alloc_conf`` and return the snapshot dict described in the module docstring.

    Args:
        stream: the request stream (keys, requested sizes in bytes, streams).
        alloc_conf: a PYTORCH_CUDA_ALLOC_CONF string ("" for torch's defaults).
        total_memory_bytes / memory_fraction: the trial's virtual GPU (``sim_geometry``).

    Raises:
        SimulatedOutOfMemoryError: the stream does not fit (the winner always ran, so it fits).
        AllocatorConfigError: a malformed ``alloc_conf``.
    """
    from oomtune.alloc._compiled import make_simulator
    from oomtune.trace.recorded import snapshot_settings

    sim = make_simulator(alloc_conf or None, total_memory_bytes=int(total_memory_bytes),
                         memory_fraction=float(memory_fraction), record_segment_events=True)
    trace: list[dict[str, Any]] = []
    addr_of: dict[int, tuple[int, int]] = {}
    seen = 0  # segment events already copied into the trace

    def entry(action: str, addr: int, size: int, stream_id: int) -> None:
        trace.append({"action": action, "addr": int(addr), "size": int(size), "stream": int(stream_id),
                      "time_us": len(trace), "frames": []})

    def segments_so_far() -> None:
        nonlocal seen
        for e in sim.segment_events[seen:]:
            entry(str(e["action"]), int(e["addr"]), int(e["size"]), int(e["stream"]))
        seen = len(sim.segment_events)

    from oomtune.alloc.stream import grant_first, grant_probe

    for action, key, sizes, st in stream.grouped():
        if action in ("alloc", "try", "probe"):
            # a conditional request (a cuDNN workspace): the size the allocator granted, if any
            addr, size = ((sim.malloc(sizes[0], st), sizes[0]) if action == "alloc" else
                          grant_first(sim, sizes, st) if action == "try" else grant_probe(sim, sizes, st))
            segments_so_far()
            if not addr and action != "alloc":
                continue
            addr_of[key] = (addr, size)
            entry("alloc", addr, size, st)
        elif action == "empty_cache":
            sim.empty_cache()
            segments_so_far()
        else:
            found = addr_of.pop(key, None)
            if found is None:
                continue
            sim.free(found[0])
            segments_so_far()
            entry("free_requested", found[0], found[1], st)
            entry("free_completed", found[0], found[1], st)
    return {"segments": sim.memory_snapshot(), "device_traces": [trace],
            "allocator_settings": snapshot_settings(alloc_conf),
            "oomtune": {"memory_source": "simulated", "alloc_conf": alloc_conf}}


def write_step_snapshot(path: str | Path, snapshot: dict[str, Any]) -> Path:
    """Pickle ``snapshot`` as ``torch.cuda.memory._dump_snapshot`` does (``pickle.dump``; plain
    containers only, so oomtune's restricted unpickler reads it back). Written atomically
    (:func:`oomtune.files.write_atomic`; DiskFullError when the disk is full)."""
    from oomtune.files import write_atomic

    return write_atomic(path, pickle.dumps(snapshot))


def step_series(snapshot: dict[str, Any], *, device: int = 0, max_points: int = 1500) -> dict[str, Any]:
    """Allocated and reserved bytes after each allocation event of one device's trace, and the segments
    at the moment of peak allocated.

    Allocated rises by ``alloc`` and falls by ``free_completed`` sizes (requested bytes); reserved by
    ``segment_alloc``/``segment_map`` and ``segment_free``/``segment_unmap``. Segments that existed
    before the trace began (a device snapshot recorded mid-run) are not known from the trace and are
    not counted; ``start_reserved_bytes`` says how much the final state holds beyond the trace.

    Returns:
        ``{"x": [event index], "allocated": [bytes], "reserved": [bytes], "events": n,
        "peak_allocated_bytes", "peak_reserved_bytes", "peak_index", "at_peak": [{"address",
        "size", "allocated", "largest_free"}] (segments by address, bytes; an expandable segment's
        contiguous mapped pages are one segment), "start_reserved_bytes"}``;
        the series keep at most ``max_points`` points (each bucket's maximum, so peaks survive).
    """
    traces = snapshot.get("device_traces") or []
    trace = traces[device] if device < len(traces) else []
    final_reserved = sum(int(s.get("total_size", 0)) for s in snapshot.get("segments", [])
                         if int(s.get("device", device)) == device)
    allocated = reserved = 0
    xs: list[int] = []
    alloc_series: list[int] = []
    resv_series: list[int] = []
    peak_alloc = peak_resv = 0
    peak_index = 0
    for i, e in enumerate(trace):
        a, size = e.get("action"), int(e.get("size") or 0)
        if a == "alloc":
            allocated += size
        elif a == "free_completed":
            allocated -= size
        elif a in _SEGMENT_UP:
            reserved += size
        elif a in _SEGMENT_DOWN:
            reserved -= size
        else:
            continue
        if allocated > peak_alloc:
            peak_alloc, peak_index = allocated, i
        peak_resv = max(peak_resv, reserved)
        xs.append(i)
        alloc_series.append(allocated)
        resv_series.append(reserved)
    xs, alloc_series, resv_series = _decimate(xs, alloc_series, resv_series, max_points)
    return {"x": xs, "allocated": alloc_series, "reserved": resv_series, "events": len(trace),
            "peak_allocated_bytes": peak_alloc, "peak_reserved_bytes": peak_resv, "peak_index": peak_index,
            "at_peak": _segments_at(trace, peak_index), "start_reserved_bytes": max(0, final_reserved - reserved)}


def _decimate(xs: list[int], a: list[int], r: list[int], n: int) -> tuple[list[int], list[int], list[int]]:
    """At most ``n`` points: per bucket, the point where allocated is largest (reserved: its max)."""
    if len(xs) <= n:
        return xs, a, r
    step = -(-len(xs) // n)
    ox, oa, orr = [], [], []
    for lo in range(0, len(xs), step):
        hi = min(lo + step, len(xs))
        j = max(range(lo, hi), key=a.__getitem__)
        ox.append(xs[j])
        oa.append(a[j])
        orr.append(max(r[lo:hi]))
    return ox, oa, orr


def _segments_at(trace: list[dict[str, Any]], index: int) -> list[dict[str, int]]:
    """Segments known from the trace after event ``index``: address, size, allocated bytes (requested
    sizes, as memory_viz counts them) and the largest free gap (bytes).

    A ``segment_alloc`` is one segment until its ``segment_free``. An expandable segment grows by
    ``segment_map`` of pages at its end and shrinks by ``segment_unmap`` (c10/cuda/
    CUDACachingAllocator.cpp ``ExpandableSegment``), and one block may span pages mapped at different
    times, so contiguous mapped ranges are one segment: each segment then holds its blocks whole and
    its allocated bytes never exceed its size (counting each mapped range as a
    segment drew a "20 MiB" segment holding 41 MiB)."""
    import bisect

    whole: dict[int, int] = {}
    mapped: list[list[int]] = []   # sorted, disjoint, non-touching [start, end) ranges
    blocks: dict[int, int] = {}
    for e in trace[: index + 1]:
        a, addr, size = e.get("action"), int(e.get("addr") or 0), int(e.get("size") or 0)
        if a == "segment_alloc":
            whole[addr] = size
        elif a == "segment_free":
            whole.pop(addr, None)
        elif a == "segment_map":
            mapped = _add_range(mapped, addr, addr + size)
        elif a == "segment_unmap":
            mapped = _remove_range(mapped, addr, addr + size)
        elif a == "alloc":
            blocks[addr] = size
        elif a == "free_completed":
            blocks.pop(addr, None)
    spans = sorted([(base, size) for base, size in whole.items()] + [(lo, hi - lo) for lo, hi in mapped])
    out = []
    live = sorted(blocks.items())
    for base, length in spans:
        end = base + length
        j = bisect.bisect_left(live, (base, -1))
        used, cursor, gap = 0, base, 0
        while j < len(live) and live[j][0] < end:
            addr, size = live[j]
            gap = max(gap, addr - cursor)
            cursor = max(cursor, addr + _rounded(size))
            used += size
            j += 1
        gap = max(gap, end - cursor)
        out.append({"address": base, "size": length, "allocated": used, "largest_free": max(0, gap)})
    return out


def _add_range(ranges: list[list[int]], lo: int, hi: int) -> list[list[int]]:
    """``ranges`` (sorted, disjoint) with ``[lo, hi)`` added, touching or overlapping ranges merged."""
    out: list[list[int]] = []
    for r in ranges:
        if r[1] < lo or r[0] > hi:
            out.append(r)
        else:
            lo, hi = min(lo, r[0]), max(hi, r[1])
    out.append([lo, hi])
    return sorted(out)


def _remove_range(ranges: list[list[int]], lo: int, hi: int) -> list[list[int]]:
    """``ranges`` with ``[lo, hi)`` taken out (a range may split in two)."""
    out: list[list[int]] = []
    for a, b in ranges:
        if b <= lo or a >= hi:
            out.append([a, b])
            continue
        if a < lo:
            out.append([a, lo])
        if b > hi:
            out.append([hi, b])
    return out


def _rounded(size: int) -> int:
    """The block size the allocator carves for a request (multiple of 512 bytes; round_size)."""
    return max(512, (size + 511) & -512)
