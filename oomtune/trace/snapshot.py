"""Loading real GPU memory snapshots safely, and checking their structure.

A snapshot is what ``torch.cuda.memory._snapshot()`` returns and what
``torch.cuda.memory._dump_snapshot(path)`` pickles (``pickle.dump(_snapshot(), f)`` in
torch/cuda/memory.py)::

    {"segments": [{"device", "address", "total_size", "stream", "segment_type", "blocks": [
                      {"address"?, "size", "requested_size"?, "state", "frames"?}, ...], ...}, ...],
     "device_traces": [[{"action", "addr", "size", "stream", "time_us"?, "frames"?}, ...], ...],
     "allocator_settings": {...}?}

Sizes and addresses are bytes. A pickle from outside can run code when it is loaded (``__reduce__``
returning ``os.system``), and ``oomtune simulate`` is handed such files by users, so
:func:`load_snapshot` uses an unpickler whose ``find_class`` refuses every global: plain containers
(dict, list, tuple), str, bytes, int, float, bool and None are built by pickle opcodes that never
look up a global. The shipped real trace (tests/data/cnn-small-default.pickle, inspected with
pickletools) holds no GLOBAL/STACK_GLOBAL/REDUCE opcode at all, so nothing needs admitting; torch
writes ``segment_pool_id`` as a tuple, also a plain opcode (TUPLE2).
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

from oomtune.exceptions import SnapshotError

__all__ = ["load_snapshot", "loads_snapshot", "validate_snapshot", "devices_with_data", "TRACE_ACTIONS"]

#: Trace actions written by torch's allocator (TraceEntry::Action in
#: c10/cuda/CUDACachingAllocator.h); other action strings are kept but ignored by replay.
TRACE_ACTIONS = frozenset({
    "alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
    "segment_map", "segment_unmap", "oom", "snapshot",
})


class _RefusingUnpickler(pickle.Unpickler):
    """An unpickler that builds only plain containers, strings and numbers.

    Every global lookup (GLOBAL, STACK_GLOBAL, EXT1/2/4 opcodes) goes through ``find_class`` and is
    refused before anything is called; persistent ids are refused too.
    """

    def __init__(self, file: io.BufferedIOBase, source: str) -> None:
        super().__init__(file)
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        raise SnapshotError(
            f"refusing to load {self._source}: the pickle references {module}.{name}, and a memory "
            "snapshot holds only plain containers, strings and numbers (nothing was executed)"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise SnapshotError(
            f"refusing to load {self._source}: the pickle uses a persistent id, which a memory "
            "snapshot never does (nothing was executed)"
        )


def load_snapshot(path: str | Path) -> dict[str, Any]:
    """Load and validate a memory snapshot pickle written by ``torch.cuda.memory._dump_snapshot``.

    Args:
        path: the pickle file.

    Returns:
        The snapshot dict (``segments``, ``device_traces``, optional ``allocator_settings``), checked
        by :func:`validate_snapshot`.

    Raises:
        SnapshotError: the file is missing, empty, truncated, not a pickle, references any global
            (refused unexecuted), or is not a snapshot.
    """
    p = Path(path)
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        raise SnapshotError(f"snapshot file {p} does not exist") from None
    except IsADirectoryError:
        raise SnapshotError(f"snapshot path {p} is a directory, not a pickle file") from None
    except OSError as exc:
        raise SnapshotError(f"cannot read snapshot file {p}: {exc.strerror or exc}") from None
    return loads_snapshot(data, source=str(p))


def loads_snapshot(data: bytes, *, source: str = "<bytes>") -> dict[str, Any]:
    """Like :func:`load_snapshot`, from bytes already in memory (``source`` names them in errors)."""
    if not data:
        raise SnapshotError(f"{source} is empty: expected a pickle from torch.cuda.memory._dump_snapshot")
    try:
        obj = _RefusingUnpickler(io.BytesIO(data), source).load()
    except SnapshotError:
        raise
    except EOFError:
        raise SnapshotError(f"{source} is truncated: the pickle ends before its STOP opcode") from None
    except RecursionError:
        raise SnapshotError(f"{source} is not a memory snapshot: nesting too deep") from None
    except Exception as exc:  # UnpicklingError, ValueError, KeyError, IndexError, ...: all malformed
        raise SnapshotError(
            f"{source} is not a valid pickle ({type(exc).__name__}: {exc}); expected the output of "
            "torch.cuda.memory._dump_snapshot"
        ) from None
    validate_snapshot(obj, source=source)
    return obj


def _fail(source: str, where: str, problem: str) -> SnapshotError:
    return SnapshotError(f"{source} is not a valid memory snapshot: {where} {problem}")


def _check_int(source: str, where: str, entry: dict, key: str, *, required: bool = True) -> None:
    value = entry.get(key)
    if value is None and not required:
        return
    if type(value) is not int:  # bool is an int subclass and is refused too
        raise _fail(source, where, f"has {key}={value!r}, expected an integer")
    if value < 0 and key != "time_us":
        raise _fail(source, where, f"has {key}={value}, expected >= 0")


def _check_segment(source: str, i: int, seg: Any) -> None:
    where = f"segments[{i}]"
    if not isinstance(seg, dict):
        raise _fail(source, where, f"is a {type(seg).__name__}, expected a dict")
    for key in ("address", "total_size"):
        _check_int(source, where, seg, key)
    for key in ("device", "stream"):
        _check_int(source, where, seg, key, required=False)
    if not isinstance(seg.get("segment_type", "large"), str):
        raise _fail(source, where, "has a non-string segment_type")
    blocks = seg.get("blocks")
    if not isinstance(blocks, list):
        raise _fail(source, where, "has no 'blocks' list")
    total = 0
    for j, block in enumerate(blocks):
        bwhere = f"{where}.blocks[{j}]"
        if not isinstance(block, dict):
            raise _fail(source, bwhere, f"is a {type(block).__name__}, expected a dict")
        _check_int(source, bwhere, block, "size")
        _check_int(source, bwhere, block, "address", required=False)
        _check_int(source, bwhere, block, "requested_size", required=False)
        if not isinstance(block.get("state"), str):
            raise _fail(source, bwhere, "has no string 'state'")
        total += block["size"]
    if blocks and total != seg["total_size"]:
        raise _fail(source, where, f"has blocks summing to {total} bytes, not total_size {seg['total_size']}")


def _check_trace(source: str, d: int, trace: Any) -> None:
    if not isinstance(trace, list):
        raise _fail(source, f"device_traces[{d}]", f"is a {type(trace).__name__}, expected a list")
    # Fast pass over well-formed entries (the same checks as _check_entry, without building the
    # message's location); the first entry it doubts goes through _check_entry for the verdict.
    for i, entry in enumerate(trace):
        if type(entry) is dict:
            get = entry.get
            addr, size, stream, time_us = get("addr"), get("size"), get("stream"), get("time_us")
            if (type(get("action")) is str and type(addr) is int and addr >= 0 and type(size) is int
                    and size >= 0 and (stream is None or (type(stream) is int and stream >= 0))
                    and (time_us is None or type(time_us) is int)):
                continue
        _check_entry(source, d, i, entry)


def _check_entry(source: str, d: int, i: int, entry: Any) -> None:
    where = f"device_traces[{d}][{i}]"
    if not isinstance(entry, dict):
        raise _fail(source, where, f"is a {type(entry).__name__}, expected a dict")
    if not isinstance(entry.get("action"), str):
        raise _fail(source, where, "has no string 'action'")
    if entry["action"] == "oom":
        # An out-of-memory entry carries the device's free memory instead of an address
        # (torch/csrc/cuda/memory_snapshot.cpp writes ``device_free`` for TraceEntry::OOM).
        _check_int(source, where, entry, "size")
        _check_int(source, where, entry, "device_free", required="addr" not in entry)
        _check_int(source, where, entry, "addr", required=False)
        _check_int(source, where, entry, "stream", required=False)
        _check_int(source, where, entry, "time_us", required=False)
        return
    for key in ("addr", "size"):
        _check_int(source, where, entry, key)
    _check_int(source, where, entry, "stream", required=False)
    _check_int(source, where, entry, "time_us", required=False)


def validate_snapshot(obj: Any, *, source: str = "<snapshot>") -> None:
    """Check that ``obj`` has the structure of ``torch.cuda.memory._snapshot()``'s result.

    Checked: a dict with a ``segments`` list of dicts (int address/total_size >= 0, a ``blocks`` list
    whose sizes sum to total_size, string block states) and a ``device_traces`` list of lists of dicts
    (string action, int addr/size >= 0, int stream/time_us when present; an ``oom`` entry has an int
    ``device_free`` in place of ``addr``, as a snapshot dumped after an out-of-memory error holds).
    Frames are not inspected.

    Raises:
        SnapshotError: naming the first offending entry.
    """
    if not isinstance(obj, dict):
        raise SnapshotError(
            f"{source} is not a memory snapshot: it holds a {type(obj).__name__}, expected a dict with "
            "'segments' and 'device_traces' (torch.cuda.memory._snapshot())"
        )
    missing = [k for k in ("segments", "device_traces") if k not in obj]
    if missing:
        raise SnapshotError(
            f"{source} is not a memory snapshot: the dict lacks {' and '.join(repr(k) for k in missing)}"
            " (expected the output of torch.cuda.memory._snapshot())"
        )
    if not isinstance(obj["segments"], list):
        raise _fail(source, "'segments'", "is not a list")
    if not isinstance(obj["device_traces"], list):
        raise _fail(source, "'device_traces'", "is not a list")
    for i, seg in enumerate(obj["segments"]):
        _check_segment(source, i, seg)
    for d, trace in enumerate(obj["device_traces"]):
        _check_trace(source, d, trace)
    settings = obj.get("allocator_settings")
    if settings is not None and not isinstance(settings, dict):
        raise _fail(source, "'allocator_settings'", "is not a dict")


def devices_with_data(snapshot: dict[str, Any]) -> list[int]:
    """Device indices that hold trace entries or segments in a validated snapshot, ascending.

    A snapshot of a multi-GPU process has one trace per visible device (``device_traces[i]`` is
    device ``i``) and segments tagged with ``device``; devices the program never used have neither.
    """
    devices = {d for d, trace in enumerate(snapshot["device_traces"]) if trace}
    devices |= {s.get("device", 0) for s in snapshot["segments"]}
    return sorted(devices)
