"""Allocation request streams (alloc/free events) and their replay through the virtual GPU.

An :class:`AllocationStream` is what a training step asks of the caching allocator, in order: each
``alloc`` has a key (unique while live), a size in bytes and a CUDA stream number; each ``free``
names the key of a live allocation. Streams come from ``oomtune.capture`` (meta-device recording)
or from real GPU traces, are replayed with :func:`replay_stream` (``oomtune simulate``, plan,
capture), and are saved as compact files for CI fixtures.

File formats (chosen by :meth:`AllocationStream.save` from the suffix):

* ``.jsonl``: a header line ``{"format": "oomtune-allocation-stream", "version": 1}`` then one
  ``["alloc", key, size_bytes, stream]`` / ``["free", key, size_bytes, stream]`` array per line.
* anything else: binary, ``MAGIC`` + little-endian uint64 count + the four columns (actions as
  int8, keys, sizes and streams as little-endian int64), written with the ``array`` module.
"""

from __future__ import annotations

import json
import sys
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from oomtune.alloc._compiled import replay_compiled
from oomtune.alloc.oom_message import SimulatedOutOfMemoryError
from oomtune.alloc.sim import CachingAllocatorSim
from oomtune.exceptions import ConfigError

__all__ = ["AllocationStream", "ReplayResult", "replay_stream", "MAGIC"]

MAGIC = b"OOMTUNE-STREAM\x01\n"
_FORMAT = "oomtune-allocation-stream"
ALLOC, FREE = 0, 1
_ACTIONS = {"alloc": ALLOC, "free": FREE}
_NAMES = ("alloc", "free")


class AllocationStream:
    """An ordered list of ``(action, key, size_bytes, stream)`` events held in parallel arrays.

    ``action`` is ``"alloc"`` or ``"free"``; a free's ``size_bytes`` is filled in from its alloc
    (the value given with a free is ignored). Keys are ints, unique among live allocations.

    Args:
        events: optional iterable of ``(action, key, size_bytes, stream)`` tuples (a free may be
            ``(action, key)``).

    Attributes:
        captured_on: the device a capture ran the step on (``meta`` or ``cpu``: the capture's
            result, :func:`oomtune.plan.predictor.capture_training_stream`); None for a stream that
            is not a capture (built, derived, recorded). Not an event: equality ignores it.

    Raises:
        ConfigError: an unknown action, a negative size, an alloc of a live key, a free of a key
            that is not live.
    """

    def __init__(self, events: Iterable[tuple] | None = None) -> None:
        self.actions = array("b")
        self.keys = array("q")
        self.sizes = array("q")
        self.streams = array("q")
        self._live: dict[int, int] = {}
        self.captured_on: str | None = None
        for ev in events or ():
            self.append(*ev)

    def append(self, action: str, key: int, size_bytes: int = 0, stream: int = 0) -> None:
        """Append one event (see the class docstring for the rules and errors)."""
        code = _ACTIONS.get(action)
        if code is None:
            raise ConfigError(f"unknown stream action {action!r}: expected 'alloc' or 'free'")
        if code == ALLOC:
            self.append_alloc(key, size_bytes, stream)
        else:
            self.append_free(key, stream)

    def append_alloc(self, key: int, size_bytes: int, stream: int = 0) -> None:
        """Append an allocation of ``size_bytes`` under ``key`` on CUDA ``stream``."""
        if key in self._live:
            raise ConfigError(f"stream event {len(self.actions)}: alloc of key {key} which is still live")
        if size_bytes < 0 or stream < 0:
            raise ConfigError(f"stream event {len(self.actions)}: negative size or stream "
                              f"({size_bytes}, {stream})")
        self._live[key] = size_bytes
        self.actions.append(ALLOC)
        self.keys.append(key)
        self.sizes.append(size_bytes)
        self.streams.append(stream)

    def append_free(self, key: int, stream: int = 0) -> None:
        """Append the release of live allocation ``key``."""
        size = self._live.pop(key, None)
        if size is None:
            raise ConfigError(f"stream event {len(self.actions)}: free of key {key} which is not live")
        self.actions.append(FREE)
        self.keys.append(key)
        self.sizes.append(size)
        self.streams.append(stream)

    def __len__(self) -> int:
        return len(self.actions)

    def __iter__(self) -> Iterator[tuple[str, int, int, int]]:
        for a, k, s, st in zip(self.actions, self.keys, self.sizes, self.streams):
            yield _NAMES[a], k, s, st

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AllocationStream) and all(
            getattr(self, n) == getattr(other, n) for n in ("actions", "keys", "sizes", "streams"))

    @property
    def n_allocs(self) -> int:
        """Number of alloc events."""
        return len(self.actions) - sum(self.actions)

    @property
    def live_keys(self) -> list[int]:
        """Keys allocated and not freed by the end of the stream."""
        return list(self._live)

    def peak_live_bytes(self) -> int:
        """Peak of the sum of live requested sizes in bytes (before any allocator rounding)."""
        live = peak = 0
        for a, s in zip(self.actions, self.sizes):
            live += -s if a else s
            peak = max(peak, live)
        return peak

    # -- files -----------------------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        """Write the stream to ``path`` (``.jsonl`` text or binary, see the module docstring)."""
        path = Path(path)
        if path.suffix == ".jsonl":
            with path.open("w", encoding="utf-8") as f:
                f.write(json.dumps({"format": _FORMAT, "version": 1}) + "\n")
                for ev in self:
                    f.write(json.dumps(list(ev)) + "\n")
            return
        cols = [array("q", c) for c in (self.keys, self.sizes, self.streams)]
        if sys.byteorder == "big":
            for c in cols:
                c.byteswap()
        with path.open("wb") as f:
            f.write(MAGIC)
            f.write(len(self).to_bytes(8, "little"))
            f.write(self.actions.tobytes())
            for c in cols:
                f.write(c.tobytes())

    @classmethod
    def load(cls, path: str | Path) -> AllocationStream:
        """Read a stream written by :meth:`save`.

        Raises:
            ConfigError: the file is missing, truncated, not a stream file, or holds invalid events.
        """
        path = Path(path)
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise ConfigError(f"cannot read allocation stream {str(path)!r}: {exc.strerror}") from None
        if path.suffix == ".jsonl":
            return cls._from_jsonl(data, path)
        if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 8:
            raise ConfigError(f"{str(path)!r} is not an oomtune allocation stream file")
        n = int.from_bytes(data[len(MAGIC):len(MAGIC) + 8], "little")
        body = memoryview(data)[len(MAGIC) + 8:]
        if len(body) != 25 * n:
            raise ConfigError(f"allocation stream {str(path)!r} is truncated or corrupt")
        actions = array("b")
        actions.frombytes(body[:n])
        cols = []
        for j in range(3):
            c = array("q")
            c.frombytes(body[n + 8 * n * j:n + 8 * n * (j + 1)])
            if sys.byteorder == "big":
                c.byteswap()
            cols.append(c)
        out = cls()
        for a, k, s, st in zip(actions, *cols):
            if a == ALLOC:
                out.append_alloc(k, s, st)
            elif a == FREE:
                out.append_free(k, st)
            else:
                raise ConfigError(f"allocation stream {str(path)!r} holds an unknown action code {a}")
        return out

    @classmethod
    def _from_jsonl(cls, data: bytes, path: Path) -> AllocationStream:
        lines = data.decode("utf-8", errors="replace").splitlines()
        try:
            header = json.loads(lines[0]) if lines else None
            if not isinstance(header, dict) or header.get("format") != _FORMAT:
                raise ValueError("missing header")
            out = cls()
            for line in lines[1:]:
                if line.strip():
                    action, key, size, stream = json.loads(line)
                    out.append(action, int(key), int(size), int(stream))
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"{str(path)!r} is not a valid oomtune allocation stream ({exc})") from None
        except RecursionError:   # a line nested thousands of levels deep: json recurses once per level
            raise ConfigError(f"{str(path)!r} is not a valid oomtune allocation stream (a line is nested too "
                              "deeply)") from None
        return out


@dataclass
class ReplayResult:
    """What replaying a stream on the virtual GPU gave. Sizes in bytes (simulated, not device).

    ``fragmentation`` is 1 - peak_active / peak_reserved (GMLake's definition), None when nothing
    was reserved. ``oom_event_index`` is the index in the stream of the first alloc that raised
    the simulated OOM (None without OOM); ``events_replayed`` counts the events fed to the
    simulator, that one included.
    """

    peak_allocated_bytes: int
    peak_reserved_bytes: int
    peak_active_bytes: int
    peak_requested_bytes: int
    fragmentation: float | None
    num_alloc_retries: int
    num_ooms: int
    oom: bool
    oom_event_index: int | None
    oom_message: str | None
    events_replayed: int
    memory_stats: dict[str, int] = field(repr=False, default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of the fields."""
        return asdict(self)


def replay_stream(stream: AllocationStream, settings: Any = None, *, total_memory_bytes: int,
                  non_allocator_bytes: int = 0, memory_fraction: float = 1.0,
                  stop_on_oom: bool = True) -> ReplayResult:
    """Feed ``stream`` to a fresh :class:`CachingAllocatorSim` and report peaks and OOMs.

    Args:
        stream: the requests.
        settings: ``AllocatorSettings``, a PYTORCH_CUDA_ALLOC_CONF string, or None (torch defaults).
        total_memory_bytes / non_allocator_bytes / memory_fraction: the simulated device, as for
            :class:`CachingAllocatorSim`.
        stop_on_oom: stop at the first simulated OOM; otherwise skip the failed allocation (and
            later its free) and go on.

    Raises:
        ConfigError / AllocatorConfigError: bad device figures or settings.
    """
    # A CachingAllocatorSim, not make_simulator's FastSim: replay_compiled reads this simulator's
    # settings and writes its statistics (private attributes), and the fallback replays on it.
    sim = CachingAllocatorSim(settings, total_memory_bytes=total_memory_bytes,
                              non_allocator_bytes=non_allocator_bytes, memory_fraction=memory_fraction)
    fast = replay_compiled(stream, sim, stop_on_oom)   # the C++ core when built (same results)
    if fast is not None:
        oom_index, n = fast["oom_index"], fast["events"]
        oom_message = None if fast["oom"] is None else str(sim._oom_error(*fast["oom"]))
        return _result(sim, oom_index, oom_message, n)
    malloc, free = sim.malloc, sim.free
    addr_of: dict[int, int] = {}
    pop = addr_of.pop
    oom_index: int | None = None
    oom_message: str | None = None
    events = zip(stream.actions, stream.keys, stream.sizes, stream.streams)
    done = 0   # events fed before the current pass over ``events``
    n = 0      # events fed in the current pass
    while True:  # one pass per simulated OOM that does not stop the replay
        try:
            for n, (a, k, s, st) in enumerate(events, 1):   # the hot loop: one call per event
                if a:
                    addr = pop(k, None)
                    if addr is not None:
                        free(addr)
                else:
                    addr_of[k] = malloc(s, st)
        except SimulatedOutOfMemoryError as exc:
            if oom_index is None:
                oom_index, oom_message = done + n - 1, str(exc)
            done += n
            n = 0
            if stop_on_oom:
                break
            continue
        break
    return _result(sim, oom_index, oom_message, n + done)


def _result(sim: CachingAllocatorSim, oom_index: int | None, oom_message: str | None, n: int) -> ReplayResult:
    """The :class:`ReplayResult` of a finished replay on ``sim`` (``n`` events fed)."""
    stats = sim.memory_stats()
    peak_reserved, peak_active = stats["reserved_bytes.all.peak"], stats["active_bytes.all.peak"]
    return ReplayResult(
        peak_allocated_bytes=stats["allocated_bytes.all.peak"], peak_reserved_bytes=peak_reserved,
        peak_active_bytes=peak_active, peak_requested_bytes=stats["requested_bytes.all.peak"],
        fragmentation=(1.0 - peak_active / peak_reserved) if peak_reserved else None,
        num_alloc_retries=stats["num_alloc_retries"], num_ooms=stats["num_ooms"],
        oom=oom_index is not None, oom_event_index=oom_index, oom_message=oom_message,
        events_replayed=n, memory_stats=stats)
