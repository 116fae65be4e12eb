"""A real GPU's memory history as an allocation stream.

A ``target=cmd`` trial on CUDA cannot be captured by oomtune, but torch records every request its
caching allocator serves when ``torch.cuda.memory._record_memory_history`` is on, and
``torch.cuda.memory._snapshot()`` returns them (the ``device_traces`` of the snapshot format,
see ``torch/cuda/memory.py`` and ``c10/cuda/CUDACachingAllocator.cpp``'s ``record_trace``). The
requests a program makes do not depend on the allocator's settings, so such a recording at one batch
size stands for that batch size under every configuration, as the virtual GPU's recordings do
(:mod:`oomtune.plan.recorded`).

:func:`stream_from_snapshot` turns one device's history into an
:class:`~oomtune.alloc.stream.AllocationStream`: first the blocks live before the recording started
(the parameters, the optimizer state: rebuilt from the final segments with the trace undone,
:func:`oomtune.trace.initial_state.rebuild_initial_state`), then every ``alloc`` and ``free_completed``
(the block returns to the pool when its events complete) in order. Segment events, ``free_requested``,
``oom`` and ``snapshot`` entries are the allocator's answers or markers, not the program's requests,
and are left out. CUDA streams are numbered in order of first use (their handles differ from run to
run; the order does not).

Sizes are the trace's (``size`` of an ``alloc`` entry; a block live before the recording counts with
its block size, a multiple of 512 bytes, as the allocator rounds requests anyway).
"""

from __future__ import annotations

from typing import Any

from oomtune.alloc.stream import AllocationStream
from oomtune.trace.initial_state import device_trace, rebuild_initial_state

__all__ = ["stream_from_snapshot"]


def stream_from_snapshot(snapshot: dict[str, Any], device: int = 0) -> AllocationStream:
    """The allocation requests of ``device`` in ``snapshot`` (a ``torch.cuda.memory._snapshot()``
    dict): the blocks live before its trace, then the trace's allocs and completed frees.

    Raises:
        SnapshotError: the snapshot holds nothing for ``device``.
        ConfigError: the trace allocates an address twice without freeing it (a trace that lost
            entries: ``max_entries`` too small).
    """
    trace, _ = device_trace(snapshot, device)
    state = rebuild_initial_state(snapshot, device)
    out = AllocationStream()
    key_of: dict[int, int] = {}
    ids: dict[int, int] = {}
    n = 0
    for seg in state.segments:
        for block in seg.live_blocks:
            key_of[block.recorded_addr] = n
            out.append_alloc(n, block.size_bytes, ids.setdefault(int(seg.stream), len(ids)))
            n += 1
    for entry in trace:
        action = entry.get("action")
        if action == "alloc":
            key_of[int(entry["addr"])] = n
            out.append_alloc(n, int(entry["size"]), ids.setdefault(int(entry.get("stream", 0)), len(ids)))
            n += 1
        elif action == "free_completed":
            key = key_of.pop(int(entry["addr"]), None)
            if key is not None:   # a block of a segment the rebuild could not place: nothing to free
                out.append_free(key, ids.setdefault(int(entry.get("stream", 0)), len(ids)))
    return out
