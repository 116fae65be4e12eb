"""Real GPU memory snapshots (``torch.cuda.memory._snapshot()`` / ``_dump_snapshot`` pickles).

- :func:`load_snapshot`: restricted unpickling (no global is ever resolved) and structure checks.
- :func:`rebuild_initial_state`, :func:`replay_snapshot`: the allocator state before the trace,
  replay through the virtual GPU under the recorded settings (and the device limit the trace
  implies), and comparison of every recorded vs simulated segment event.

``replay`` imports the simulator lazily, so loading and validating need only :mod:`oomtune.exceptions`.
"""

from __future__ import annotations

from oomtune.trace.replay import (
    RECORDED,
    InitialState,
    SnapshotReplay,
    default_device,
    rebuild_initial_state,
    replay_snapshot,
)
from oomtune.trace.snapshot import devices_with_data, load_snapshot, loads_snapshot, validate_snapshot

__all__ = [
    "RECORDED",
    "InitialState",
    "SnapshotReplay",
    "default_device",
    "devices_with_data",
    "load_snapshot",
    "loads_snapshot",
    "rebuild_initial_state",
    "replay_snapshot",
    "validate_snapshot",
]
