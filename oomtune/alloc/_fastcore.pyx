# distutils: language = c++
# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""The compiled replay core of the virtual GPU (optional C++ extension, built by ``pip install``).

:func:`replay_arrays` replays an allocation stream's columns through ``oomcore::Core``
(_fastcore.hpp), a C++ port of :class:`oomtune.alloc.sim.CachingAllocatorSim`'s malloc/free with
every allocator setting the simulator models (max_split_size, max_non_split_rounding,
roundup_power2_divisions, garbage_collection_threshold, per-process memory fraction,
expandable_segments, large_segment_size) and any number of CUDA streams. Only
:func:`oomtune.alloc._compiled.replay_compiled` calls it; the Python simulator stays the reference
(tests/test_alloc_compiled.py checks that both give identical results).
"""

from libc.stdint cimport int32_t, int64_t
from libcpp cimport bool as cbool
from libcpp.vector cimport vector

cdef extern from "_fastcore.hpp" namespace "oomcore":
    cdef int64_t UNLIMITED
    cdef cppclass AddrMap[V]:
        AddrMap() except +
        size_t size()
        void clear() except +
        void reserve(size_t n) except +
        V* find(int64_t k)
        void set(int64_t k, V v) except +
        cbool pop(int64_t k, V& out)
    cdef int DECLINED
    cdef struct Block:
        int64_t addr, size, requested, stream
        int32_t prev, next, es
        cbool small, allocated, mapped
    cdef struct SegEvent:
        int action
        int64_t addr, size, stream, index
    cdef cppclass Core:
        Core() except +
        int64_t max_split, non_split, large_seg, total, non_alloc, allowed
        double gc_threshold
        cbool gc_on, expandable, has_divs
        int64_t over_allocs[3]
        int64_t over_segs[3]
        int64_t num_alloc_retries, num_ooms, num_sync_all_streams, num_device_alloc, num_device_free
        int64_t total_alloc
        int status
        int64_t oom_alloc_size, oom_orig, oom_free, oom_allocated, oom_reserved
        int64_t last_oom[5]
        int64_t calls
        cbool record
        vector[SegEvent] events
        vector[Block] blocks
        AddrMap[int32_t] active
        int64_t stat(int t, int i)
        void set_div(int i, int64_t v)
        int32_t api_malloc(int64_t size_bytes, int64_t stream) except +
        int api_free(int64_t addr) except +
        cbool would_reuse_cached(int64_t size_bytes, int64_t stream) except +
        void empty_cache() except +
        void reset_peaks()
        vector[int32_t] live_blocks() except +
        int64_t device_free()
        int64_t replay(const signed char* actions, const long long* keys, const long long* sizes,
                       const long long* streams, int64_t n, cbool stop_on_oom,
                       int64_t* oom_index) except + nogil

_SIZE_MAX = (1 << 64) - 1
_LIMIT = 1 << 62   # larger settings (other than SIZE_MAX) are left to the Python simulator


def replay_arrays(const signed char[::1] actions, const long long[::1] keys,
                  const long long[::1] sizes, const long long[::1] streams, dict cfg,
                  bint stop_on_oom):
    """Replay the four columns of an ``AllocationStream`` on a fresh simulated device.

    Args:
        actions / keys / sizes / streams: the stream's arrays (int8 0 alloc / 1 free; int64 keys,
            sizes in bytes, CUDA stream numbers), all of one length.
        cfg: the simulator's settings: ``max_split`` (bytes, ``SIZE_MAX`` = unlimited),
            ``non_split``, ``large_segment``, ``total``, ``non_alloc`` (bytes), ``allowed`` (bytes
            or None), ``gc`` (threshold), ``gc_on`` (bool), ``expandable`` (bool), ``divs`` (16
            ints or None).
        stop_on_oom: stop at the first simulated OOM (else skip the failed allocation and go on).

    Returns:
        None when the core declines (a setting out of its range, a negative size, the simulated
        address space exhausted: the caller replays in Python), else a dict: ``events`` fed,
        ``oom_index`` (first OOM's event index or None), ``oom`` (``(alloc_size, request_size,
        free, allocated, reserved)`` bytes at the first OOM, or None), ``stats`` (3 lists of 27 ints,
        the layout of oomtune.alloc._stats), ``over_allocs`` / ``over_segs`` ([current, peak,
        freed]), ``counters`` (num_alloc_retries, num_ooms, num_sync_all_streams,
        num_device_alloc, num_device_free) and ``total_alloc`` (reserved bytes at the end).
    """
    cdef Core core
    cdef int64_t n = actions.shape[0], fed, oom_index = -1
    cdef int i, t
    if keys.shape[0] != n or sizes.shape[0] != n or streams.shape[0] != n:
        raise ValueError("stream columns differ in length")
    if not _configure(&core, cfg):
        return None
    if n:
        with nogil:
            fed = core.replay(&actions[0], &keys[0], &sizes[0], &streams[0], n, stop_on_oom, &oom_index)
    else:
        fed = 0
    if core.status == DECLINED:
        return None
    return {
        "events": fed,
        "oom_index": None if oom_index < 0 else oom_index,
        "oom": None if oom_index < 0 else (core.oom_alloc_size, core.oom_orig, core.oom_free,
                                           core.oom_allocated, core.oom_reserved),
        "stats": [[core.stat(t, i) for i in range(27)] for t in range(3)],
        "over_allocs": [core.over_allocs[0], core.over_allocs[1], core.over_allocs[2]],
        "over_segs": [core.over_segs[0], core.over_segs[1], core.over_segs[2]],
        "counters": _counters(&core),
        "total_alloc": core.total_alloc,
    }


cdef dict _counters(Core* core):
    return {"num_alloc_retries": core.num_alloc_retries, "num_ooms": core.num_ooms,
            "num_sync_all_streams": core.num_sync_all_streams,
            "num_device_alloc": core.num_device_alloc, "num_device_free": core.num_device_free}


cdef bint _configure(Core* core, dict cfg) except -1:
    """Copy the settings dict (see :func:`replay_arrays`) into ``core``; False when out of range."""
    cdef int i
    max_split = cfg["max_split"]
    if max_split == _SIZE_MAX:
        core.max_split = UNLIMITED
    elif 0 <= max_split < _LIMIT:
        core.max_split = max_split
    else:
        return False
    for name in ("non_split", "large_segment", "total", "non_alloc"):
        if not 0 <= cfg[name] < _LIMIT:
            return False
    core.non_split, core.large_seg = cfg["non_split"], cfg["large_segment"]
    core.total, core.non_alloc = cfg["total"], cfg["non_alloc"]
    allowed = cfg["allowed"]
    if allowed is not None and not 0 <= allowed < _LIMIT:
        return False
    core.allowed = -1 if allowed is None else allowed
    core.gc_threshold = cfg["gc"]
    core.gc_on, core.expandable = cfg["gc_on"], cfg["expandable"]
    divs = cfg["divs"]
    if divs is not None:
        if len(divs) != 16 or not all(0 <= d < _LIMIT for d in divs):
            return False
        core.has_divs = True
        for i in range(16):
            core.set_div(i, divs[i])
    return True


from oomtune.alloc._blocks import SIZE_MAX as _PY_SIZE_MAX, Block as _PyBlock
from oomtune.alloc._snapshot import build_snapshot
from oomtune.alloc._stats import flatten_stats
from oomtune.exceptions import ConfigError

_SEGMENT_ACTIONS = ("segment_alloc", "segment_free", "segment_map", "segment_unmap")


cdef class FastSim:
    """:class:`oomtune.alloc.sim.CachingAllocatorSim`'s public API on the C++ core (same results).

    Made by :func:`oomtune.alloc._compiled.make_simulator` from a fresh Python simulator ``ref``
    (which validated the settings and keeps them: the fraction, the OOM message's figures) and its
    settings dict ``cfg`` (see :func:`replay_arrays`); raises ValueError when a setting is out of the
    core's range (the caller then keeps ``ref``). Methods, properties, ``segment_events`` and the
    errors raised are those of ``CachingAllocatorSim`` (sizes in bytes).
    """

    cdef Core* core
    cdef object _ref
    cdef readonly list segment_events
    cdef readonly object settings, device_index

    def __cinit__(self):
        self.core = new Core()

    def __dealloc__(self):
        del self.core

    def __init__(self, ref, dict cfg, bint record_segment_events):
        if not _configure(self.core, cfg):
            raise ValueError("an allocator setting is out of the compiled core's range")
        self.core.record = record_segment_events
        self._ref = ref
        self.settings, self.device_index = ref.settings, ref.device_index
        self.segment_events = []

    cdef _take_events(self):
        cdef size_t i
        cdef SegEvent ev
        for i in range(self.core.events.size()):
            ev = self.core.events[i]
            self.segment_events.append({"action": _SEGMENT_ACTIONS[ev.action], "addr": ev.addr,
                                        "size": ev.size, "stream": ev.stream, "index": ev.index})
        self.core.events.clear()

    def malloc(self, size_bytes, stream=0):
        """Allocate ``size_bytes`` on ``stream``; the block address (0 for 0 bytes). Raises
        SimulatedOutOfMemoryError, or ConfigError for a negative size."""
        cdef int32_t bid = self.core.api_malloc(size_bytes, stream)
        if self.core.events.size():
            self._take_events()
        if bid >= 0:
            return self.core.blocks[bid].addr
        if bid == -1:
            return 0
        if bid == -2:
            o = self.core.last_oom
            raise self._ref._oom_error(o[0], o[1], o[2], o[3], o[4])
        if bid == -3:
            raise ConfigError(f"cannot allocate a negative size ({size_bytes} bytes)")
        raise ConfigError("the virtual GPU ran out of simulated address space")

    def free(self, addr):
        """Free the block at ``addr`` (0 does nothing). Raises ConfigError for an unknown address."""
        if self.core.api_free(addr) < 0:
            raise ConfigError(f"free of an address that is not allocated on the virtual GPU: {addr!r}")

    def would_reuse_cached(self, size_bytes, stream=0):
        """True when ``malloc(size_bytes, stream)`` now would be served by a cached block."""
        return self.core.would_reuse_cached(size_bytes, stream)

    def empty_cache(self):
        """Release every cached whole segment and unmap free expandable pages (``emptyCache``)."""
        self.core.empty_cache()
        if self.core.events.size():
            self._take_events()

    def set_per_process_memory_fraction(self, fraction):
        """As ``CachingAllocatorSim.set_per_process_memory_fraction`` (raises ConfigError)."""
        self._ref.set_per_process_memory_fraction(fraction)
        allowed = self._ref._allowed
        self.core.allowed = -1 if allowed is None else allowed
        self.core.gc_on = self._ref._gc_on

    def memory_stats(self):
        """The flat ``torch.cuda.memory_stats()`` dict."""
        cdef int t, i
        ms = self._ref._max_split
        counters = _counters(self.core)
        counters["max_split_size"] = -1 if ms == _PY_SIZE_MAX else ms
        st = [[self.core.stat(t, i) for i in range(27)] for t in range(3)]
        return flatten_stats(st, [self.core.over_allocs[i] for i in range(3)],
                             [self.core.over_segs[i] for i in range(3)], counters)

    def memory_snapshot(self):
        """Segments and blocks in ``torch.cuda.memory_snapshot()`` form, sorted by address."""
        cdef vector[int32_t] ids = self.core.live_blocks()
        cdef Block b
        objs = {}
        for bid in ids:
            b = self.core.blocks[bid]
            o = _PyBlock(b.addr, b.size, b.stream, b.small, requested=b.requested,
                         es=True if b.es >= 0 else None)
            o.allocated, o.mapped = b.allocated, b.mapped
            objs[bid] = o
        for bid, o in objs.items():
            b = self.core.blocks[bid]
            o.prev = objs.get(b.prev) if b.prev >= 0 else None
            o.next = objs.get(b.next) if b.next >= 0 else None
        return build_snapshot([o for o in objs.values() if o.mapped], self.device_index)

    def reset_peak_memory_stats(self):
        """Set every peak to its current value (``resetPeakStats``)."""
        self.core.reset_peaks()

    @property
    def allocated_bytes(self):
        return self.core.stat(0, 12)

    @property
    def reserved_bytes(self):
        return self.core.total_alloc

    @property
    def device_free_bytes(self):
        return self.core.device_free()

    @property
    def total_memory_bytes(self):
        return self._ref._total

    @property
    def expandable_segments(self):
        return self._ref._expandable

    @property
    def allowed_bytes(self):
        return self._ref._allowed

    @property
    def num_alloc_retries(self):
        return self.core.num_alloc_retries

    @property
    def num_ooms(self):
        return self.core.num_ooms

    @property
    def num_sync_all_streams(self):
        return self.core.num_sync_all_streams

    @property
    def num_device_alloc(self):
        return self.core.num_device_alloc

    @property
    def num_device_free(self):
        return self.core.num_device_free


include "_fasttrace.pxi"
