"""The allocator settings a snapshot was recorded under (its ``allocator_settings`` entry).

``torch.cuda.memory._snapshot()`` (torch/csrc/cuda/Module.cpp, ``THCPModule_memorySnapshot``) adds
the settings in force when the snapshot was taken: ``max_split_size`` (bytes; -1 = unlimited,
SIZE_MAX read as int64), ``garbage_collection_threshold``, ``expandable_segments``,
``roundup_power2_divisions`` (a dict from the interval start in MiB, "1" ... "32768", to the
division count), ``PYTORCH_CUDA_ALLOC_CONF`` (the text), and pinned-memory keys the device
allocator never reads. Newer torch versions may add ``max_non_split_rounding_size`` /
``large_segment_size`` (bytes); they are read when present. These are the default replay settings
of :func:`oomtune.trace.replay_snapshot`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from oomtune.exceptions import AllocatorConfigError

__all__ = ["recorded_settings", "snapshot_settings"]

_INTERVAL_STARTS_MIB = tuple(1 << i for i in range(16))   # 1, 2, 4, ... 32768: division_index order


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def recorded_settings(snapshot: dict[str, Any]) -> tuple[Any, str | None]:
    """The snapshot's recorded settings as an ``AllocatorSettings``, and a note when not usable.

    Returns:
        ``(settings, note)``: ``(None, None)`` when the snapshot records none (torch's defaults are
        then the honest guess, as for snapshots from torch versions before the entry existed);
        ``(None, note)`` when the recorded values cannot be represented (the note says which).

    Raises:
        Nothing: a malformed entry gives a note, never an error (the snapshot was already validated).
    """
    from oomtune.alloc.settings import AllocatorSettings

    rec = snapshot.get("allocator_settings")
    if not rec:
        return None, None
    fields: dict[str, Any] = {}
    max_split = _int(rec.get("max_split_size"))
    if max_split is not None and max_split >= 0:
        fields["max_split_size_bytes"] = max_split
    gc = rec.get("garbage_collection_threshold")
    if isinstance(gc, (int, float)) and not isinstance(gc, bool) and gc > 0:
        fields["garbage_collection_threshold"] = float(gc)
    if isinstance(rec.get("expandable_segments"), bool):
        fields["expandable_segments"] = rec["expandable_segments"]
    divs = rec.get("roundup_power2_divisions")
    if isinstance(divs, dict):
        try:
            fields["roundup_power2_divisions"] = tuple(int(divs.get(str(k), 0) or 0) for k in _INTERVAL_STARTS_MIB)
        except (TypeError, ValueError, OverflowError):   # "abc", [4], NaN, infinity: not a count
            bad = {k: v for k, v in divs.items() if type(v) is not int}
            return None, (f"the recorded allocator_settings cannot be used (roundup_power2_divisions holds "
                          f"{bad!r}, expected whole numbers); replayed under torch's defaults")
    for key, name in (("max_non_split_rounding_size", "max_non_split_rounding_bytes"),
                      ("large_segment_size", "large_segment_size_bytes")):
        value = _int(rec.get(key))
        if value is not None and value > 0:
            fields[name] = value
    try:
        return dataclasses.replace(AllocatorSettings(), **fields), None
    except (AllocatorConfigError, TypeError, ValueError) as exc:
        return None, f"the recorded allocator_settings cannot be used ({exc}); replayed under torch's defaults"


def snapshot_settings(alloc_conf: str) -> dict[str, Any]:
    """The inverse of :func:`recorded_settings`: the ``allocator_settings`` entry a snapshot taken
    under ``alloc_conf`` carries, in the layout ``THCPModule_memorySnapshot`` writes (see the module
    docstring; ``max_split_size`` -1 when unlimited), so that a snapshot oomtune writes (the
    winner's step) replays under its own settings by default.

    Raises:
        AllocatorConfigError: a malformed ``alloc_conf``.
    """
    from oomtune.alloc.settings import AllocatorSettings

    st = AllocatorSettings.parse(alloc_conf)
    return {
        "PYTORCH_CUDA_ALLOC_CONF": alloc_conf,
        "max_split_size": -1 if st.max_split_size_bytes is None else int(st.max_split_size_bytes),
        "garbage_collection_threshold": float(st.garbage_collection_threshold or 0.0),
        "expandable_segments": bool(st.expandable_segments),
        "roundup_power2_divisions": {str(mib): int(d) for mib, d in
                                     zip(_INTERVAL_STARTS_MIB, st.roundup_power2_divisions)},
    }
