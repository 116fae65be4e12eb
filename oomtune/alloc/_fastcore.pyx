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

from libc.stdint cimport int64_t
from libcpp cimport bool as cbool

cdef extern from "_fastcore.hpp" namespace "oomcore":
    cdef int64_t UNLIMITED
    cdef int DECLINED
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
        int64_t stat(int t, int i)
        void set_div(int i, int64_t v)
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
    max_split = cfg["max_split"]
    if max_split == _SIZE_MAX:
        core.max_split = UNLIMITED
    elif 0 <= max_split < _LIMIT:
        core.max_split = max_split
    else:
        return None
    for name in ("non_split", "large_segment", "total", "non_alloc"):
        if not 0 <= cfg[name] < _LIMIT:
            return None
    core.non_split, core.large_seg = cfg["non_split"], cfg["large_segment"]
    core.total, core.non_alloc = cfg["total"], cfg["non_alloc"]
    allowed = cfg["allowed"]
    if allowed is not None and not 0 <= allowed < _LIMIT:
        return None
    core.allowed = -1 if allowed is None else allowed
    core.gc_threshold = cfg["gc"]
    core.gc_on, core.expandable = cfg["gc_on"], cfg["expandable"]
    divs = cfg["divs"]
    if divs is not None:
        if len(divs) != 16 or not all(0 <= d < _LIMIT for d in divs):
            return None
        core.has_divs = True
        for i in range(16):
            core.set_div(i, divs[i])
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
        "oom": None if core.num_ooms == 0 else (core.oom_alloc_size, core.oom_orig, core.oom_free,
                                                core.oom_allocated, core.oom_reserved),
        "stats": [[core.stat(t, i) for i in range(27)] for t in range(3)],
        "over_allocs": [core.over_allocs[0], core.over_allocs[1], core.over_allocs[2]],
        "over_segs": [core.over_segs[0], core.over_segs[1], core.over_segs[2]],
        "counters": {"num_alloc_retries": core.num_alloc_retries, "num_ooms": core.num_ooms,
                     "num_sync_all_streams": core.num_sync_all_streams,
                     "num_device_alloc": core.num_device_alloc, "num_device_free": core.num_device_free},
        "total_alloc": core.total_alloc,
    }
