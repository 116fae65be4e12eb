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

Work bounded by the file's size. A pickle's memo lets one object appear many times
for 2 bytes a reference: every trace entry can hold the same 100,000-frame list, and a 1.4 MB file
then asked for 10^10 frame checks. Containers that torch itself shares, or that a memo may share
harmlessly (``frames`` lists and frame dicts), are checked once, by identity (:class:`_Seen`), so
the checks visit each distinct object once: at most a few per byte of the file. Containers that a
snapshot never shares and whose sharing would multiply the replay's work (one segment dict twice in
``segments``, one ``blocks`` list in two segments, one trace list for two devices) are refused. The
file's size is checked before anything is read (:data:`DEFAULT_MAX_BYTES`, ``max_bytes``), and the
file is unpickled as a stream: a file that is not a pickle fails at its first opcode.
"""

from __future__ import annotations

import io
import math
import pickle
from pathlib import Path
from typing import Any

from oomtune.exceptions import SnapshotError

__all__ = ["load_snapshot", "loads_snapshot", "validate_snapshot", "devices_with_data", "TRACE_ACTIONS",
           "DEFAULT_MAX_BYTES", "CHECK_COUNTS"]

#: The largest snapshot file :func:`load_snapshot` reads unless told otherwise (bytes; ``oomtune
#: simulate --max-size``): 1 GiB. Unpickled, a snapshot takes about 5-10 times its file size in memory
#: (measured on the shared traces: 5.2x and 9.8x), so this is about 5-10 GiB.
DEFAULT_MAX_BYTES = 1 << 30
#: Counters of the checks :func:`validate_snapshot` made (``frames`` lists walked, frame dicts
#: checked, identity-cache hits), for tests and benchmarks: a bound that is structural, not timed.
CHECK_COUNTS = {"frames_lists": 0, "frames": 0, "cache_hits": 0}

#: Exclusive upper bound of every integer in a snapshot: torch/csrc/cuda/memory_snapshot.cpp writes
#: addresses, sizes and streams as int64_t (``(int64_t)te.size_``, ``int64_t(te.stream_)``).
INT64_END = 1 << 63
#: kSmallBuffer (c10/cuda/CUDACachingAllocator.cpp): the size of every non-expandable small-pool segment.
_SMALL_BUFFER = 2 << 20
#: Actions whose ``frames`` the replay reads (releases.classify_runs looks for empty_cache there).
_RELEASE_ACTIONS = frozenset({"segment_free", "segment_unmap"})
#: Nesting depth allowed inside ``allocator_settings`` (torch writes one level of dict inside it,
#: ``roundup_power2_divisions``); deeper data cannot be settings and would not print as JSON.
_SETTINGS_DEPTH = 3

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


def load_snapshot(path: str | Path, *, max_bytes: int | None = DEFAULT_MAX_BYTES) -> dict[str, Any]:
    """Load and validate a memory snapshot pickle written by ``torch.cuda.memory._dump_snapshot``.

    The file's size is checked before it is read; it is then unpickled from the file as a stream
    (never held whole in memory as bytes as well; garbage fails at its first opcode).

    Args:
        path: the pickle file.
        max_bytes: the largest file read (:data:`DEFAULT_MAX_BYTES`, 1 GiB); None: no limit.

    Returns:
        The snapshot dict (``segments``, ``device_traces``, optional ``allocator_settings``), checked
        by :func:`validate_snapshot`.

    Raises:
        SnapshotError: the file is missing, a device (/dev/zero), larger than ``max_bytes`` (the
            message says how to raise the limit), empty, truncated, too large for memory, not a
            pickle, references any global (refused unexecuted), or is not a snapshot.
    """
    import stat as _stat

    from oomtune.units import format_bytes

    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise SnapshotError(f"snapshot file {p} does not exist") from None
    except OSError as exc:
        raise SnapshotError(f"cannot read snapshot file {p}: {exc.strerror or exc}") from None
    if _stat.S_ISDIR(st.st_mode):
        raise SnapshotError(f"snapshot path {p} is a directory, not a pickle file")
    if _stat.S_ISCHR(st.st_mode) or _stat.S_ISBLK(st.st_mode):   # /dev/zero: never ends
        raise SnapshotError(f"snapshot path {p} is a device, not a pickle file")
    if not _stat.S_ISREG(st.st_mode):   # a pipe or socket: its size cannot be checked first
        raise SnapshotError(f"snapshot path {p} is not a regular file (a pipe?): save the snapshot to a file")
    if max_bytes is not None and st.st_size > max_bytes:
        raise SnapshotError(
            f"snapshot file {p} is {format_bytes(st.st_size)}, above the {format_bytes(max_bytes)} read by "
            f"default (unpickled, a snapshot takes 5-10x its size in memory): add --max-size "
            f"{_round_up_gib(st.st_size)}GiB to read it")
    try:
        with p.open("rb") as f:
            if not f.read(1):
                raise SnapshotError(f"{p} is empty: expected a pickle from torch.cuda.memory._dump_snapshot")
            f.seek(0)
            obj = _unpickle(f, str(p))   # streamed: a file that is not a pickle fails at its first opcode
    except MemoryError:
        raise SnapshotError(f"snapshot file {p} does not fit in this machine's memory once unpickled") from None
    except OSError as exc:
        raise SnapshotError(f"cannot read snapshot file {p}: {exc.strerror or exc}") from None
    validate_snapshot(obj, source=str(p))
    return obj


def _round_up_gib(size: int) -> int:
    return -(-size // (1 << 30))


def loads_snapshot(data: bytes, *, source: str = "<bytes>") -> dict[str, Any]:
    """Like :func:`load_snapshot`, from bytes already in memory (``source`` names them in errors)."""
    if not data:
        raise SnapshotError(f"{source} is empty: expected a pickle from torch.cuda.memory._dump_snapshot")
    obj = _unpickle(io.BytesIO(data), source)
    validate_snapshot(obj, source=source)
    return obj


def _unpickle(file: Any, source: str) -> Any:
    """The object in the pickle ``file`` (restricted unpickler), or SnapshotError naming what is wrong."""
    try:
        obj = _RefusingUnpickler(file, source).load()
    except SnapshotError:
        raise
    except EOFError:
        raise SnapshotError(f"{source} is truncated: the pickle ends before its STOP opcode") from None
    except RecursionError:
        raise SnapshotError(f"{source} is not a memory snapshot: nesting too deep") from None
    except MemoryError:
        raise SnapshotError(f"{source} does not fit in this machine's memory once unpickled") from None
    except Exception as exc:  # UnpicklingError, ValueError, KeyError, IndexError, ...: all malformed
        raise SnapshotError(
            f"{source} is not a valid pickle ({type(exc).__name__}: {exc}); expected the output of "
            "torch.cuda.memory._dump_snapshot"
        ) from None
    return obj


class _Seen:
    """Identity caches of one validation: containers already checked (``frames`` lists, frame
    dicts) and containers that must not appear twice (segment dicts, ``blocks`` lists). Holds ids
    of objects the snapshot keeps alive, so an id is never reused while it is in use."""

    def __init__(self) -> None:
        self.frames_ok: set[int] = set()
        self.frame_ok: set[int] = set()
        self.segments: dict[int, int] = {}
        self.blocks: dict[int, int] = {}


def _fail(source: str, where: str, problem: str) -> SnapshotError:
    return SnapshotError(f"{source} is not a valid memory snapshot: {where} {problem}")


def _check_int(source: str, where: str, entry: dict, key: str, *, required: bool = True,
               none_ok: bool = False) -> None:
    """``entry[key]`` is an int in [0, 2**63) (``time_us`` may be negative). ``required=False``: the
    key may be absent; ``none_ok``: it may also hold None (an ``oom`` entry's ``addr``, ``time_us``,
    ``requested_size``, which replay never reads). A None where replay reads the value (a stream,
    a device, a block address) is refused: replay would take it for a stream or an address."""
    if key not in entry and not required:
        return
    value = entry.get(key)
    if value is None and none_ok:
        return
    if type(value) is not int:  # bool is an int subclass and is refused too
        raise _fail(source, where, f"has {key}={value!r}, expected an integer")
    if value < 0 and key != "time_us":
        raise _fail(source, where, f"has {key}={value}, expected >= 0")
    if not -INT64_END <= value < INT64_END:
        raise _fail(source, where, f"has {key}={value}, beyond the 64-bit integers torch writes (expected < 2**63)")


def _check_segment(source: str, i: int, seg: Any, seen: _Seen) -> None:
    where = f"segments[{i}]"
    if not isinstance(seg, dict):
        raise _fail(source, where, f"is a {type(seg).__name__}, expected a dict")
    first = seen.segments.setdefault(id(seg), i)
    if first != i:   # torch builds one dict per segment; a memo reference would replay it twice
        raise _fail(source, where, f"is the same dict object as segments[{first}] (a snapshot lists each "
                    "segment once)")
    for key in ("address", "total_size"):
        _check_int(source, where, seg, key)
    for key in ("device", "stream"):
        _check_int(source, where, seg, key, required=False)
    if not isinstance(seg.get("segment_type", "large"), str):
        raise _fail(source, where, "has a non-string segment_type")
    if seg.get("segment_type", "large") not in ("small", "large"):
        # memory_snapshot.cpp writes segment.is_large ? "large" : "small"
        raise _fail(source, where, f"has segment_type={seg['segment_type']!r}, expected 'small' or 'large'")
    if seg.get("segment_type") == "small" and not seg.get("is_expandable", False) and seg["total_size"] != _SMALL_BUFFER:
        # get_allocation_size: every small-pool cudaMalloc is kSmallBuffer; replay rebuilds a small
        # segment 1 MiB request at a time, so a huge one (2**50 B: 2**30 requests) never ends.
        raise _fail(source, where, f"is a small-pool segment of {seg['total_size']} bytes, expected "
                    f"{_SMALL_BUFFER} (torch's small-pool segments are 2 MiB unless expandable)")
    blocks = seg.get("blocks")
    if not isinstance(blocks, list):
        raise _fail(source, where, "has no 'blocks' list")
    owner = seen.blocks.setdefault(id(blocks), i)
    if owner != i:   # one list per segment in torch; shared, every segment would walk all its blocks
        raise _fail(source, where, f"shares its blocks list with segments[{owner}] (a snapshot has one per "
                    "segment)")
    total = 0
    for j, block in enumerate(blocks):
        bwhere = f"{where}.blocks[{j}]"
        if not isinstance(block, dict):
            raise _fail(source, bwhere, f"is a {type(block).__name__}, expected a dict")
        _check_int(source, bwhere, block, "size")
        _check_int(source, bwhere, block, "address", required=False)
        _check_int(source, bwhere, block, "requested_size", required=False, none_ok=True)
        if not isinstance(block.get("state"), str):
            raise _fail(source, bwhere, "has no string 'state'")
        total += block["size"]
    if blocks and total != seg["total_size"]:
        raise _fail(source, where, f"has blocks summing to {total} bytes, not total_size {seg['total_size']}")


def _check_trace(source: str, d: int, trace: Any, seen: _Seen) -> None:
    if not isinstance(trace, list):
        raise _fail(source, f"device_traces[{d}]", f"is a {type(trace).__name__}, expected a list")
    # Fast pass over well-formed entries (the same checks as _check_entry, without building the
    # message's location); the first entry it doubts goes through _check_entry for the verdict.
    end = INT64_END
    releases = _RELEASE_ACTIONS
    for i, entry in enumerate(trace):
        if type(entry) is dict:
            get = entry.get
            action, addr, size, stream, time_us = get("action"), get("addr"), get("size"), get("stream"), get("time_us")
            if (type(action) is str and type(addr) is int and 0 <= addr < end and type(size) is int
                    and 0 <= size < end and (type(stream) is int and 0 <= stream < end or "stream" not in entry)
                    and (time_us is None or type(time_us) is int and -end <= time_us < end)
                    and (action not in releases or get("frames") is None)):
                continue
        _check_entry(source, d, i, entry, seen)


def _check_entry(source: str, d: int, i: int, entry: Any, seen: _Seen) -> None:
    where = f"device_traces[{d}][{i}]"
    if not isinstance(entry, dict):
        raise _fail(source, where, f"is a {type(entry).__name__}, expected a dict")
    if not isinstance(entry.get("action"), str):
        raise _fail(source, where, "has no string 'action'")
    if entry["action"] == "oom":
        # An out-of-memory entry carries the device's free memory instead of an address
        # (torch/csrc/cuda/memory_snapshot.cpp writes ``device_free`` for TraceEntry::OOM).
        _check_int(source, where, entry, "size")
        _check_int(source, where, entry, "device_free", required="addr" not in entry, none_ok="addr" in entry)
        _check_int(source, where, entry, "addr", required=False, none_ok=True)
        _check_int(source, where, entry, "stream", required=False)
        _check_int(source, where, entry, "time_us", required=False, none_ok=True)
        return
    for key in ("addr", "size"):
        _check_int(source, where, entry, key)
    _check_int(source, where, entry, "stream", required=False)
    _check_int(source, where, entry, "time_us", required=False, none_ok=True)
    if entry["action"] in _RELEASE_ACTIONS:
        _check_frames(source, where, entry.get("frames"), seen)


def _check_frames(source: str, where: str, frames: Any, seen: _Seen) -> None:
    """A release's ``frames`` (read to tell an empty_cache from the allocator's own release): None,
    or a list of frame dicts whose ``name`` is a string, as torch's ivalue_symbolize writes them.
    A list or frame dict already checked (the same object, through the pickle's memo) is not
    checked again (:class:`_Seen`)."""
    if frames is None:
        return
    if not isinstance(frames, list):
        raise _fail(source, where, f"has frames of type {type(frames).__name__}, expected a list of frame dicts")
    if id(frames) in seen.frames_ok:
        CHECK_COUNTS["cache_hits"] += 1
        return
    CHECK_COUNTS["frames_lists"] += 1
    frame_ok = seen.frame_ok
    for k, frame in enumerate(frames):
        if id(frame) in frame_ok:
            continue
        CHECK_COUNTS["frames"] += 1
        if not isinstance(frame, dict):
            raise _fail(source, where, f"has frames[{k}] of type {type(frame).__name__}, expected a dict")
        if not isinstance(frame.get("name", ""), str):
            raise _fail(source, where, f"has frames[{k}] with name={frame['name']!r}, expected a string")
        frame_ok.add(id(frame))
    seen.frames_ok.add(id(frames))


def _check_plain(source: str, where: str, value: Any, depth: int) -> None:
    """``value`` is plain data that prints as JSON (``--json`` shows ``allocator_settings``): None,
    bool, int, finite float, str, or a list or dict (string keys) of such, at most ``depth`` levels
    deep (a set, bytes or a tuple key would stop ``json.dumps``; a cycle or deep nesting would
    exhaust its recursion)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise _fail(source, where, f"holds {value}, expected a finite number (torch writes no NaN or infinity)")
    if value is None or isinstance(value, (bool, int, float, str)):
        return
    if depth > 0 and isinstance(value, list):
        for k, item in enumerate(value):
            _check_plain(source, f"{where}[{k}]", item, depth - 1)
        return
    if depth > 0 and isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise _fail(source, where, f"has the key {key!r}, expected string keys")
            _check_plain(source, f"{where}[{key!r}]", item, depth - 1)
        return
    if isinstance(value, (list, dict)):
        raise _fail(source, where, "nests deeper than allocator settings do (a cycle, or not settings at all)")
    raise _fail(source, where, f"holds a value of type {type(value).__name__}, expected numbers, strings, "
                "or lists and dicts of them")


def validate_snapshot(obj: Any, *, source: str = "<snapshot>") -> None:
    """Check that ``obj`` has the structure of ``torch.cuda.memory._snapshot()``'s result.

    Checked: a dict with a ``segments`` list of dicts (int address/total_size >= 0, int device/stream
    when present, segment_type "small" or "large", a small one of 2 MiB unless expandable, a
    ``blocks`` list whose sizes sum to total_size,
    string block states, int block addresses when present) and a ``device_traces`` list of lists of
    dicts (string action, int addr/size >= 0, int stream/time_us when present; an ``oom`` entry has an
    int ``device_free`` in place of ``addr``, as a snapshot dumped after an out-of-memory error holds).
    Each non-empty device trace is its own list. Every integer is below 2**63 (torch writes int64_t); a stream, device or block address, when its
    key is there, is an int, not None. ``frames`` are inspected only on segment_free/segment_unmap
    entries, the only ones replay reads (a list of dicts with string names);
    ``allocator_settings``, when present, is a dict of plain data (printed by ``--json``).
    Each distinct ``frames`` list and frame dict is checked once, whatever number of entries share
    it; a segment dict listed twice, or a ``blocks`` list shared by two segments, is refused (the
    module docstring: work bounded by the file's size).

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
    memo = _Seen()
    for i, seg in enumerate(obj["segments"]):
        _check_segment(source, i, seg, memo)
    first_at: dict[int, int] = {}   # id of a non-empty trace list -> its first device
    for d, trace in enumerate(obj["device_traces"]):
        if isinstance(trace, list) and trace:
            # torch builds one list per device; a pickle can make one list the trace of every
            # device (a 2-byte memo reference each), which would multiply the work of every pass
            seen = first_at.setdefault(id(trace), d)
            if seen != d:
                raise _fail(source, f"device_traces[{d}]", f"is the same list object as device_traces[{seen}] "
                            "(a snapshot holds one trace per device)")
        _check_trace(source, d, trace, memo)
    settings = obj.get("allocator_settings")
    if settings is not None and not isinstance(settings, dict):
        raise _fail(source, "'allocator_settings'", "is not a dict")
    if settings is not None:
        _check_plain(source, "'allocator_settings'", settings, _SETTINGS_DEPTH)


def devices_with_data(snapshot: dict[str, Any]) -> list[int]:
    """Device indices that hold trace entries or segments in a validated snapshot, ascending.

    A snapshot of a multi-GPU process has one trace per visible device (``device_traces[i]`` is
    device ``i``) and segments tagged with ``device``; devices the program never used have neither.
    """
    devices = {d for d, trace in enumerate(snapshot["device_traces"]) if trace}
    devices |= {s.get("device", 0) for s in snapshot["segments"]}
    return sorted(devices)
