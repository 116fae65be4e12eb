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

Requests whose size is decided when they are made (cuDNN convolution workspaces,
:mod:`oomtune.capture.cudnn_conv`; the actions' names in ``.jsonl`` files in brackets):

* ``try`` (code 2): one alternative of a conditional request. Consecutive ``try`` events with the
  same key are the alternatives, in order: the replay allocates the first one the allocator grants
  and skips the rest; an alternative it refuses takes the allocator's whole OOM path (cached blocks
  released, ``num_ooms`` counted) and the stream goes on, as torch's ``try_configs`` catches the
  ``OutOfMemoryError`` of a cuDNN plan's workspace and tries the next plan
  (aten/src/ATen/native/cudnn/Conv_v8.cpp). When none is granted the key holds nothing and its
  ``free`` does nothing.
* ``probe`` (code 3): cuDNN's workspace probe (``generate_and_filter_plans``, Conv_v8.cpp).
  Consecutive ``probe`` events with one key carry the candidate plans' workspace sizes; at the
  first, the replay takes the largest size not above the allocator's ``cacheInfo`` (free device
  memory, or the largest free cached block if larger:
  :meth:`~oomtune.alloc.sim.CachingAllocatorSim.cache_info`), then requests it, halving it after
  each refusal until one is granted or it reaches 0.
* ``empty_cache`` (code 4): ``emptyCache`` (cuDNN's benchmark releases the cache after its
  search); key and size are ignored.

A free's size is its request's first alternative (a ``probe``: the largest candidate). Streams with
these events replay on the Python simulator (the compiled core replays plain streams only).
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

__all__ = ["AllocationStream", "ReplayResult", "replay_stream", "MAGIC", "ALLOC", "FREE", "TRY", "PROBE",
           "EMPTY_CACHE", "REQUESTS", "grant_first", "grant_probe", "cache_info_bytes"]

MAGIC = b"OOMTUNE-STREAM\x01\n"
_FORMAT = "oomtune-allocation-stream"
ALLOC, FREE, TRY, PROBE, EMPTY_CACHE = 0, 1, 2, 3, 4
_ACTIONS = {"alloc": ALLOC, "free": FREE, "try": TRY, "probe": PROBE, "empty_cache": EMPTY_CACHE}
_NAMES = ("alloc", "free", "try", "probe", "empty_cache")
#: The actions that request memory (a ``free`` releases what their key holds).
REQUESTS = (ALLOC, TRY, PROBE)


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
            raise ConfigError(f"unknown stream action {action!r}: expected one of {', '.join(_ACTIONS)}")
        if code == ALLOC:
            self.append_alloc(key, size_bytes, stream)
        elif code == FREE:
            self.append_free(key, stream)
        elif code == EMPTY_CACHE:
            self.append_empty_cache(stream)
        else:
            self._append_alternative(code, key, size_bytes, stream)

    def append_try(self, key: int, sizes: Iterable[int], stream: int = 0) -> None:
        """Append a conditional request under ``key``: the first of ``sizes`` (bytes, in order) that
        the allocator grants (see the module docstring). Raises ConfigError: no sizes, a negative
        size, a live key."""
        self._append_group(TRY, key, sizes, stream)

    def append_probe(self, key: int, sizes: Iterable[int], stream: int = 0) -> None:
        """Append cuDNN's workspace probe under ``key`` over the candidate plans' workspace
        ``sizes`` (bytes; see the module docstring). Raises ConfigError as :meth:`append_try`."""
        self._append_group(PROBE, key, sizes, stream)

    def append_empty_cache(self, stream: int = 0) -> None:
        """Append an ``emptyCache`` (every cached whole segment released)."""
        self.actions.append(EMPTY_CACHE)
        self.keys.append(0)
        self.sizes.append(0)
        self.streams.append(stream)

    def _append_group(self, code: int, key: int, sizes: Iterable[int], stream: int) -> None:
        sizes = list(sizes)
        if not sizes:
            raise ConfigError(f"stream event {len(self.actions)}: a conditional request of key {key} without sizes")
        if key in self._live:
            raise ConfigError(f"stream event {len(self.actions)}: request of key {key} which is still live")
        for size in sizes:
            self._append_alternative(code, key, size, stream)

    def _append_alternative(self, code: int, key: int, size_bytes: int, stream: int) -> None:
        """One ``try``/``probe`` event: the first of a group makes ``key`` live; the next ones must
        follow it directly (same action and key)."""
        n = len(self.actions)
        follows = n > 0 and self.actions[n - 1] == code and self.keys[n - 1] == key and key in self._live
        if key in self._live and not follows:
            raise ConfigError(f"stream event {n}: request of key {key} which is still live")
        if size_bytes < 0 or stream < 0:
            raise ConfigError(f"stream event {n}: negative size or stream ({size_bytes}, {stream})")
        if not follows:
            self._live[key] = size_bytes
        elif code == PROBE:
            self._live[key] = max(self._live[key], size_bytes)
        self.actions.append(code)
        self.keys.append(key)
        self.sizes.append(size_bytes)
        self.streams.append(stream)

    def grouped(self) -> Iterator[tuple[str, int, list[int], int]]:
        """The events with each conditional request's alternatives gathered:
        ``(action, key, sizes_bytes, stream)``, ``sizes_bytes`` one size for ``alloc``/``free``
        (0 for ``empty_cache``), the group's sizes in order for ``try``/``probe``."""
        acts, keys, sizes, streams = self.actions, self.keys, self.sizes, self.streams
        n, i = len(acts), 0
        while i < n:
            a, k = acts[i], keys[i]
            j = i + 1
            if a in (TRY, PROBE):
                while j < n and acts[j] == a and keys[j] == k:
                    j += 1
            yield _NAMES[a], k, list(sizes[i:j]), streams[i]
            i = j

    @property
    def conditional(self) -> bool:
        """Whether the stream holds ``try``/``probe``/``empty_cache`` events (replayed by the
        Python simulator)."""
        return any(a > FREE for a in self.actions)

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
        """Number of alloc events (a conditional request counts once)."""
        n, prev = 0, None
        for a, k in zip(self.actions, self.keys):
            if a == ALLOC or (a in (TRY, PROBE) and prev != (a, k)):
                n += 1
            prev = (a, k)
        return n

    @property
    def live_keys(self) -> list[int]:
        """Keys allocated and not freed by the end of the stream."""
        return list(self._live)

    def peak_live_bytes(self) -> int:
        """Peak of the sum of live requested sizes in bytes (before any allocator rounding)."""
        live = peak = 0
        first: dict[int, int] = {}   # a conditional request counts as its first alternative (a probe: its largest)
        for a, k, s in zip(self.actions, self.keys, self.sizes):
            if a == ALLOC:
                live += s
            elif a == FREE:
                live -= s
            elif a in (TRY, PROBE):
                if k in first:
                    if a == PROBE and s > first[k]:
                        live += s - first[k]
                        first[k] = s
                    continue
                first[k] = s
                live += s
            if a == FREE:
                first.pop(k, None)
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
            elif a == EMPTY_CACHE:
                out.append_empty_cache(st)
            elif a in (TRY, PROBE):
                out._append_alternative(a, k, s, st)
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
    if stream.conditional:   # requests decided at replay time: the Python simulator
        oom_index, oom_message, n = _replay_conditional(stream, sim, stop_on_oom)
        return _result(sim, oom_index, oom_message, n)
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


def grant_first(sim: Any, sizes: list[int], stream: int = 0) -> tuple[int | None, int]:
    """``(address, size)`` of the first of ``sizes`` (bytes) ``sim`` grants, trying them in order;
    ``(None, 0)`` when it refuses them all (each refusal is a full simulated OOM: ``num_ooms`` counted, cached blocks
    released, as torch's allocator does before it raises). A size of 0 is granted without a request
    (address 0). torch: ``try_configs`` / ``try_plans``, aten/src/ATen/native/cudnn/Conv_v8.cpp."""
    for size in sizes:
        try:
            return sim.malloc(size, stream), size
        except SimulatedOutOfMemoryError:
            continue
    return None, 0


def grant_probe(sim: Any, sizes: list[int], stream: int = 0) -> tuple[int | None, int]:
    """cuDNN's workspace probe on ``sim`` (``generate_and_filter_plans``,
    aten/src/ATen/native/cudnn/Conv_v8.cpp): the largest of the plans' workspace ``sizes`` (bytes)
    not above ``cacheInfo`` (:func:`cache_info_bytes`), requested and halved after each refusal
    (``max_workspace_size /= 2``) until granted or 0. Returns ``(address, size)``; the address is
    0 (nothing allocated) for size 0."""
    bound = cache_info_bytes(sim)
    size = max((s for s in sizes if s <= bound), default=0)
    while size:
        try:
            return sim.malloc(size, stream), size
        except SimulatedOutOfMemoryError:
            size //= 2
    return 0, 0


def cache_info_bytes(sim: Any) -> int:
    """``CUDACachingAllocator::cacheInfo`` of ``sim`` in bytes: its ``cache_info()``
    (:meth:`CachingAllocatorSim.cache_info`), or for a simulator without one (the compiled one) the
    same from its free device memory and the inactive blocks of its ``memory_snapshot()``."""
    if hasattr(sim, "cache_info"):
        return sim.cache_info()
    largest = sim.device_free_bytes
    for seg in sim.memory_snapshot():
        for block in seg["blocks"]:
            if block["state"] == "inactive" and block["size"] > largest:
                largest = block["size"]
    return largest


def _replay_conditional(stream: AllocationStream, sim: CachingAllocatorSim,
                        stop_on_oom: bool) -> tuple[int | None, str | None, int]:
    """Replay a stream with ``try``/``probe``/``empty_cache`` events on ``sim`` (see the module
    docstring). Returns (index of the first OOM or None, its message, events fed)."""
    addr_of: dict[int, int] = {}
    acts, keys, sizes, streams = stream.actions, stream.keys, stream.sizes, stream.streams
    oom_index: int | None = None
    oom_message: str | None = None
    n = len(acts)
    i = fed = 0
    while i < n:
        a, k, st = acts[i], keys[i], streams[i]
        if a in (TRY, PROBE):
            j = i + 1
            while j < n and acts[j] == a and keys[j] == k:
                j += 1
            group = list(sizes[i:j])
            addr, _ = grant_first(sim, group, st) if a == TRY else grant_probe(sim, group, st)
            if addr:
                addr_of[k] = addr
            fed += j - i
            i = j
            continue
        fed += 1
        if a == FREE:
            addr = addr_of.pop(k, None)
            if addr is not None:
                sim.free(addr)
        elif a == EMPTY_CACHE:
            sim.empty_cache()
        else:
            try:
                addr_of[k] = sim.malloc(sizes[i], st)
            except SimulatedOutOfMemoryError as exc:
                if oom_index is None:
                    oom_index, oom_message = i, str(exc)
                if stop_on_oom:
                    return oom_index, oom_message, fed
        i += 1
    return oom_index, oom_message, fed


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
