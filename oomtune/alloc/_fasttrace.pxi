# Included by _fastcore.pyx: the compiled path of oomtune.trace.replay.replay_snapshot.
#
# TraceReplay holds one device's trace as typed columns and computes, in C++ containers, what the
# Python modules of oomtune/trace compute from the list of dicts: the starting state
# (initial_state.rebuild_initial_state: _starting_segments, _undo_mappings, _pre_trace_blocks, the
# placement and _with_unsplit_tails), the recorded reserved walk and the runs of releases
# (releases.recorded_reserved_walk / release_runs / oom_points), the recorded segment events
# (compare.recorded_events), and the replay itself on a FastSim (initial_state.seed_initial_state
# and replay._replay_events). Each method names the Python function it mirrors; the Python code
# stays the reference and tests/test_trace_compiled.py checks that both give identical results.
# A trace with a value the core does not take (a missing or non-int address, size or stream, a
# value outside [0, 2**56), a segment_type other than "small"/"large") makes the constructor raise
# _Declined, and the caller runs the Python path.

from cpython.dict cimport PyDict_GetItemWithError
from cpython.object cimport PyObject
from libcpp.unordered_set cimport unordered_set
from libcpp.map cimport map as cppmap
from libcpp.utility cimport pair

cdef extern from *:
    """
    #include <algorithm>
    #include <tuple>
    #include <vector>
    namespace oomtrace {
    struct Span { int64_t a, b; int small; int64_t stream; };
    inline void sort_spans(std::vector<Span>& v) {   // sorted() of (start, end, pool, stream)
        std::sort(v.begin(), v.end(), [](const Span& x, const Span& y) {
            return std::tie(x.a, x.b, x.small, x.stream) < std::tie(y.a, y.b, y.small, y.stream);
        });
    }
    struct SegInfo { int64_t size, stream; int small, expandable; };
    }
    """
    cdef cppclass Span "oomtrace::Span":
        int64_t a, b, stream
        int small
    cdef cppclass SegInfo "oomtrace::SegInfo":
        int64_t size, stream
        int small, expandable
    void sort_spans "oomtrace::sort_spans"(vector[Span]&)


class _Declined(ValueError):
    """The trace holds a value the compiled core does not take: run the Python path."""


# trace entry actions as small ints (codes 0-2 are the request entries of compare.REQUEST_ACTIONS
# with oom; 4-7 the segment actions in the order of _SEGMENT_ACTIONS, 8 anything else)
cdef enum:
    A_ALLOC = 0
    A_FREE_REQ = 1
    A_FREE_DONE = 2
    A_OOM = 3
    A_SEG_ALLOC = 4
    A_SEG_FREE = 5
    A_SEG_MAP = 6
    A_SEG_UNMAP = 7
    A_OTHER = 8

_ACTION_CODES = {"alloc": A_ALLOC, "free_requested": A_FREE_REQ, "free_completed": A_FREE_DONE,
                 "oom": A_OOM, "segment_alloc": A_SEG_ALLOC, "segment_free": A_SEG_FREE,
                 "segment_map": A_SEG_MAP, "segment_unmap": A_SEG_UNMAP}
_EVENT_NAMES = ("alloc", "free_requested", "free_completed", "oom", "segment_alloc", "segment_free",
                "segment_map", "segment_unmap")
cdef int64_t _VMAX = 1LL << 56
cdef int64_t _MiB = 1 << 20


cdef extern from "Python.h":
    bint PyLong_Check(PyObject* o)


cdef inline int64_t _pval(PyObject* v) except -1:
    """_val of a borrowed reference (NULL: the key is missing, a KeyError on the Python path)."""
    cdef long long x
    if v == NULL:
        raise _Declined("missing")
    if not PyLong_Check(v):
        raise _Declined("not an int")
    x = <object>v   # Cython's conversion (digit fast paths); OverflowError beyond int64
    if x < 0 or x >= _VMAX:
        raise _Declined("out of range")
    return x


cdef inline int64_t _pval_or0(PyObject* v) except -1:
    """_pval, with a missing key read as 0 (``e.get("stream", 0)``)."""
    return 0 if v == NULL else _pval(v)


cdef inline int64_t _val(object v) except -1:
    """A trace value as int64 in [0, 2**56); _Declined for anything else (a bool is taken as an
    int, as Python's arithmetic does); OverflowError beyond int64 (the checks of _pval)."""
    return _pval(<PyObject*>v)


cdef tuple _own_keys(object sample, tuple names):
    """``names`` as the ``sample`` dict's own key objects where it has them: an unpickled snapshot
    holds one string object per key (pickle's memo), so lookups with those match by identity
    instead of comparing characters. Any dict still finds its keys by value."""
    if type(sample) is not dict:
        return names
    out = list(names)
    cdef Py_ssize_t j
    for key in <dict>sample:
        for j in range(len(names)):
            if type(key) is str and key == names[j]:
                out[j] = key
    return tuple(out)


cdef inline PyObject* _get(object d, object key) except? NULL:
    """``d[key]`` as a borrowed reference, NULL when missing; _Declined when ``d`` is not a dict."""
    if type(d) is not dict:
        raise _Declined("not a dict")
    return PyDict_GetItemWithError(d, key)


cdef class _Codes:
    """Values -> small ints, remembered by object identity: an unpickled trace holds one string
    object per action name or block state (pickle's memo), so nearly every entry is found without
    hashing; a value first seen is classified by ``classify`` and remembered while it lives.
    ``classify`` raising (a value of the wrong type) declines the trace."""

    cdef PyObject* objs[16]
    cdef int codes[16]
    cdef int n
    cdef list keep   # the remembered values, kept alive while the cache holds their addresses
    cdef object classify

    def __cinit__(self, classify):
        self.n = 0
        self.keep = []
        self.classify = classify

    cdef inline int code(self, PyObject* value) except -1:
        cdef int k, c
        if value == NULL:
            raise _Declined("missing")
        for k in range(self.n):
            if self.objs[k] == value:
                return self.codes[k]
        c = self.classify(<object>value)
        if self.n < 16:
            self.keep.append(<object>value)
            self.objs[self.n], self.codes[self.n] = value, c
            self.n += 1
        return c


def _action_code(action):
    return _ACTION_CODES.get(action, A_OTHER)   # TypeError (declined) when unhashable


def _is_active(state):
    return 1 if state.startswith("active") else 0   # AttributeError / TypeError (declined): not a str


cdef inline int _pool_small(object name) except -1:
    if name == "small":
        return 1
    if name == "large":
        return 0
    raise _Declined("segment_type")


cdef class TraceReplay:
    """One device's trace and final segments, analysed in C++ (see the comment at the top of
    _fasttrace.pxi). Sizes and addresses in bytes.

    ``reserved_bytes`` / ``live_bytes``: :class:`~oomtune.trace.initial_state.InitialState`'s
    properties of the rebuilt starting state; ``unplaced``: its ``unplaced_blocks``; ``peak``: the
    recorded peak reserved bytes (``recorded_reserved_walk``'s second value).

    Raises:
        _Declined: a value outside the core's range (the caller runs the Python path).
    """

    cdef vector[signed char] act
    cdef vector[int64_t] addr, size, stream, dfree
    cdef vector[signed char] has_df
    cdef vector[int64_t] before
    cdef vector[int64_t] seg_addr, seg_size, seg_stream
    cdef vector[int] seg_small, seg_exp
    cdef vector[vector[int64_t]] seg_blocks   # per segment: offset, size, recorded address, ...
    cdef readonly int64_t reserved_bytes, live_bytes, peak
    cdef readonly tuple unplaced
    cdef list _trace

    def __init__(self, list trace, list final):
        self._trace = trace
        self._columns(trace)
        self._starting_state(final)
        self._walk()

    cdef _columns(self, list trace):
        """One pass over the entries: action code, addr, size, stream, device_free (the values read
        through borrowed references: no reference counting or KeyError per field)."""
        cdef Py_ssize_t n = len(trace), i
        cdef object e
        cdef PyObject* df
        cdef int code
        cdef _Codes codes = _Codes(_action_code)
        k_action, k_addr, k_size, k_stream, k_df = _own_keys(
            trace[0] if n else None, ("action", "addr", "size", "stream", "device_free"))
        self.act.resize(n)
        self.addr.resize(n)
        self.size.resize(n)
        self.stream.resize(n)
        self.dfree.resize(n)
        self.has_df.resize(n)
        for i in range(n):
            e = trace[i]
            code = codes.code(_get(e, k_action))
            self.act[i] = code
            self.addr[i] = self.size[i] = self.stream[i] = self.dfree[i] = 0
            self.has_df[i] = 0
            if code == A_OTHER:
                continue
            if code == A_FREE_REQ or code == A_FREE_DONE:   # size read only where needed (_pre_trace)
                self.addr[i] = _pval(PyDict_GetItemWithError(e, k_addr))
                continue
            self.size[i] = _pval(PyDict_GetItemWithError(e, k_size))
            self.stream[i] = _pval_or0(PyDict_GetItemWithError(e, k_stream))
            if code == A_OOM:
                df = PyDict_GetItemWithError(e, k_df)
                if df != NULL and PyLong_Check(df):
                    self.dfree[i], self.has_df[i] = _pval(df), 1
            else:
                self.addr[i] = _pval(PyDict_GetItemWithError(e, k_addr))

    cdef _starting_state(self, list final):
        """initial_state._starting_segments + _undo_mappings + _pre_trace_blocks + placement."""
        cdef cppmap[int64_t, SegInfo] segs
        cdef SegInfo info
        cdef vector[Span] spans
        cdef Span sp
        cdef Py_ssize_t n = self.act.size(), i
        cdef int64_t a, lo, hi, size
        cdef dict s, block
        cdef PyObject* v
        cdef PyObject* pool
        k_exp, k_addr, k_total, k_type, k_stream, k_blocks = _own_keys(
            final[0] if final else None,
            ("is_expandable", "address", "total_size", "segment_type", "stream", "blocks"))
        for s in final:
            v = _get(s, k_exp)
            pool = _get(s, k_type)
            if v != NULL and <object>v:
                sp.a = _pval(_get(s, k_addr))
                sp.b = sp.a + _pval(_get(s, k_total))
                sp.small = _pool_small("large" if pool == NULL else <object>pool)
                sp.stream = _pval_or0(_get(s, k_stream))
                spans.push_back(sp)
            else:
                info.size, info.stream = _pval(_get(s, k_total)), _pval_or0(_get(s, k_stream))
                info.small, info.expandable = _pool_small("large" if pool == NULL else <object>pool), 0
                segs[_pval(_get(s, k_addr))] = info
        sort_spans(spans)
        for i in range(n - 1, -1, -1):   # the trace walked backwards
            if self.act[i] == A_SEG_ALLOC:
                segs.erase(self.addr[i])
            elif self.act[i] == A_SEG_FREE:
                info.size, info.stream = self.size[i], self.stream[i]
                info.small, info.expandable = self.size[i] <= 2 * _MiB, 0
                segs[self.addr[i]] = info
            elif self.act[i] == A_SEG_MAP or self.act[i] == A_SEG_UNMAP:
                _undo_mapping(spans, self.act[i] == A_SEG_MAP, self.addr[i], self.size[i], self.stream[i])
        for sp in spans:
            info.size, info.stream, info.small, info.expandable = sp.b - sp.a, sp.stream, sp.small, 1
            segs[sp.a] = info
        # _pre_trace_blocks
        cdef AddrMap[char] live, pending   # sets: the value is unused
        cdef char dropped
        cdef cppmap[int64_t, int64_t] blocks
        cdef int code
        live.reserve(n // 2 + 1)   # no rebuilds on the way
        for i in range(n):
            code = self.act[i]
            a = self.addr[i]
            if code == A_ALLOC:
                live.set(a, 1)
            elif (code == A_FREE_REQ or code == A_FREE_DONE) and live.find(a) == NULL:
                if pending.find(a) == NULL and not blocks.count(a):
                    size = _val(self._trace[i]["size"])
                    blocks[a] = max(<int64_t>512, (size + 511) // 512 * 512)
                if code == A_FREE_REQ:
                    pending.set(a, 1)
                else:
                    pending.pop(a, dropped)
            elif code == A_FREE_DONE:
                live.pop(a, dropped)
        cdef _Codes active = _Codes(_is_active)
        sample = None
        for s in final:
            if type(s) is dict and (<dict>s).get("blocks"):
                sample = (<dict>s)["blocks"][0]
                break
        kb_addr, kb_state, kb_size = _own_keys(sample, ("address", "state", "size"))
        for s in final:   # _block_addresses: old snapshots lack block addresses (in order)
            a = _pval(_get(s, k_addr))
            v = _get(s, k_blocks)
            if v == NULL:
                raise _Declined("no blocks")
            for block in <object>v:
                v = _get(block, kb_addr)
                if v != NULL:
                    a = _pval(v)
                size = _pval(_get(block, kb_size))
                if active.code(_get(block, kb_state)) and live.find(a) == NULL:
                    blocks[a] = size
                a += size
        self._place(segs, blocks)

    cdef _place(self, cppmap[int64_t, SegInfo]& segs, cppmap[int64_t, int64_t]& blocks):
        """rebuild_initial_state's placement of blocks in segments, and _with_unsplit_tails."""
        cdef vector[int64_t] starts, ends
        cdef pair[int64_t, SegInfo] kv
        cdef pair[int64_t, int64_t] bv
        cdef Py_ssize_t k, m, lo, hi, mid, found
        cdef int64_t addr, size, gap, end
        cdef bint disjoint = True, ok
        unplaced = []
        for kv in segs:
            if kv.second.size > 0:
                self.seg_addr.push_back(kv.first)
                self.seg_size.push_back(kv.second.size)
                self.seg_stream.push_back(kv.second.stream)
                self.seg_small.push_back(kv.second.small)
                self.seg_exp.push_back(kv.second.expandable)
        m = self.seg_addr.size()
        self.seg_blocks.resize(m)
        self.reserved_bytes = 0
        for k in range(m):
            self.reserved_bytes += self.seg_size[k]
            if k + 1 < m and self.seg_addr[k] + self.seg_size[k] > self.seg_addr[k + 1]:
                disjoint = False
        for bv in blocks:
            addr, size = bv.first, bv.second
            found = -1
            if disjoint:   # _segment_finder: bisect_right over the starts
                lo, hi = 0, m
                while lo < hi:
                    mid = (lo + hi) // 2
                    if addr < self.seg_addr[mid]:
                        hi = mid
                    else:
                        lo = mid + 1
                if lo > 0 and addr < self.seg_addr[lo - 1] + self.seg_size[lo - 1]:
                    found = lo - 1
            else:          # overlapping segments: the lowest start that holds the address
                for k in range(m):
                    if self.seg_addr[k] <= addr < self.seg_addr[k] + self.seg_size[k]:
                        found = k
                        break
            ok = found >= 0 and addr + size <= self.seg_addr[found] + self.seg_size[found]
            if ok and self.seg_blocks[found].size():
                k = self.seg_blocks[found].size() - 3
                if self.seg_addr[found] + self.seg_blocks[found][k] + self.seg_blocks[found][k + 1] > addr:
                    ok = False
            if not ok:
                unplaced.append(addr)
                continue
            self.seg_blocks[found].push_back(addr - self.seg_addr[found])
            self.seg_blocks[found].push_back(size)
            self.seg_blocks[found].push_back(addr)
        self.unplaced = tuple(unplaced)
        self.live_bytes = 0
        for k in range(m):
            if not self.seg_small[k] and not self.seg_exp[k]:   # _with_unsplit_tails
                for lo in range(0, self.seg_blocks[k].size(), 3):
                    end = self.seg_blocks[k][lo + 3] if lo + 3 < <Py_ssize_t>self.seg_blocks[k].size() \
                        else self.seg_size[k]
                    gap = end - self.seg_blocks[k][lo] - self.seg_blocks[k][lo + 1]
                    if 0 < gap <= _MiB:
                        self.seg_blocks[k][lo + 1] += gap
            for lo in range(0, self.seg_blocks[k].size(), 3):
                self.live_bytes += self.seg_blocks[k][lo + 1]

    cdef _walk(self):
        """releases.recorded_reserved_walk: reserved bytes before each entry, and the peak."""
        cdef Py_ssize_t n = self.act.size(), i
        cdef int64_t reserved = self.reserved_bytes
        cdef int code
        self.peak = reserved
        self.before.resize(n)
        for i in range(n):
            self.before[i] = reserved
            code = self.act[i]
            if code == A_SEG_ALLOC or code == A_SEG_MAP:
                reserved += self.size[i]
                if reserved > self.peak:
                    self.peak = reserved
            elif code == A_SEG_FREE or code == A_SEG_UNMAP:
                reserved -= self.size[i]

    def state_tuples(self):
        """The starting state as ``((address, total_size, stream, pool, is_expandable, ((offset,
        size, recorded_addr), ...)), ...)`` and the unplaced addresses (for the identity tests)."""
        cdef Py_ssize_t k, j
        segs = []
        for k in range(self.seg_addr.size()):
            blocks = tuple((self.seg_blocks[k][j], self.seg_blocks[k][j + 1], self.seg_blocks[k][j + 2])
                           for j in range(0, self.seg_blocks[k].size(), 3))
            segs.append((self.seg_addr[k], self.seg_size[k], self.seg_stream[k],
                         "small" if self.seg_small[k] else "large", bool(self.seg_exp[k]), blocks))
        return tuple(segs), self.unplaced

    def release_runs(self):
        """releases.release_runs: ``(first, last, reserved_before, needed, followed, request)``."""
        cdef Py_ssize_t n = self.act.size(), i = 0, j, k, alloc_at = -1
        cdef int code
        cdef int64_t needed
        cdef bint followed
        out = []
        request = None
        while i < n:
            if not (self.act[i] == A_SEG_FREE or self.act[i] == A_SEG_UNMAP):
                i += 1
                continue
            j = i
            while j + 1 < n and (self.act[j + 1] == A_SEG_FREE or self.act[j + 1] == A_SEG_UNMAP):
                j += 1
            needed, followed = 0, False
            for k in range(j + 1, n):
                code = self.act[k]
                if code == A_SEG_ALLOC or code == A_SEG_MAP or code == A_OOM:
                    needed, followed = self.size[k], True
                    break
                if code == A_ALLOC or code == A_FREE_REQ or code == A_FREE_DONE:
                    break
            if alloc_at <= j:
                alloc_at, request = j + 1, None
                while alloc_at < n and self.act[alloc_at] != A_ALLOC:
                    alloc_at += 1
                if alloc_at < n:
                    request = (self.size[alloc_at], self.stream[alloc_at])
            out.append((i, j, self.before[i], needed, followed, request))
            i = j + 1
        return out

    def oom_points(self):
        """releases.oom_points: reserved + device_free at each oom entry that records it."""
        cdef Py_ssize_t i
        return [self.before[i] + self.dfree[i] for i in range(self.act.size())
                if self.act[i] == A_OOM and self.has_df[i]]

    def recorded_events(self):
        """compare.recorded_events: ``(action, size, position)`` of segment events and oom entries."""
        cdef Py_ssize_t i, pos = 0
        cdef int code
        out = []
        for i in range(self.act.size()):
            code = self.act[i]
            if A_SEG_ALLOC <= code <= A_SEG_UNMAP:
                out.append([_EVENT_NAMES[code], self.size[i], pos])
            elif code <= A_OOM and code != A_FREE_REQ:
                if code == A_OOM:
                    out.append(["oom", self.size[i], pos])
                pos += 1
        return out

    def tally(self, list events):
        """replay._tally: of ``[action, size, position]`` segment events, the sizes of
        segment_alloc/segment_map, the number of segment_free/segment_unmap, the number of oom."""
        cdef list grown = []
        cdef Py_ssize_t shrunk = 0, ooms = 0
        cdef list ev
        for ev in events:
            action = ev[0]
            if action == "segment_alloc" or action == "segment_map":
                grown.append(ev[1])
            elif action == "oom":
                ooms += 1
            else:
                shrunk += 1
        return grown, shrunk, ooms

    def replay(self, FastSim sim, explicit, check_cache):
        """initial_state.seed_initial_state, then replay._replay_events, on a fresh ``sim``.

        Args:
            sim: a FastSim nothing has run on, made with ``record_segment_events=True``.
            explicit: trace indices where the replay calls ``empty_cache()``.
            check_cache: trace index -> ``(size, stream)``: ``empty_cache()`` there when a cached
                block would serve that request (the cached-block rule).

        Returns:
            ``(events, oom_at, replayed, by_cache, exact, retries0)`` as replay._run_replay's
            ``_Run`` holds them: the simulated ``(action, size, position)`` events after the
            starting state, the first OOM the device did not have (dict) or None, the number of
            requests replayed, the indices the cached-block rule decided, whether the starting
            state was reproduced exactly, and num_alloc_retries after seeding.

        Raises:
            ConfigError: as FastSim.free / malloc.
        """
        cdef Core* core = sim.core
        cdef AddrMap[int64_t] amap
        cdef unordered_set[int64_t] expl
        cdef Py_ssize_t n = self.act.size(), i, pos = 0, replayed = 0
        cdef int code
        cdef int64_t got, retries0
        cdef bint exact
        from oomtune.alloc.sim import SimulatedOutOfMemoryError

        for x in explicit:
            expl.insert(x)
        amap.reserve(self.act.size() // 2 + self.seg_addr.size() * 2)   # no rehashing on the way
        core.active.reserve(self.act.size() // 2 + self.seg_addr.size() * 2)
        oom_at, events, by_cache = None, [], []
        try:
            exact = self._seed(sim, amap)
        except SimulatedOutOfMemoryError as exc:
            amap.clear()
            exact = False
            oom_at = {"event_index": None, "requested_bytes": getattr(exc, "requested_bytes", None),
                      "phase": "initial_state"}
        core.events.clear()
        sim.segment_events.clear()
        retries0 = core.num_alloc_retries
        core.reset_peaks()
        if oom_at is not None:
            return events, oom_at, 0, by_cache, exact, retries0
        for i in range(n):
            code = self.act[i]
            if code == A_ALLOC:
                got = _malloc(sim, self.size[i], self.stream[i])
                if got == -2:
                    _collect(core, events, pos)
                    events.append(["oom", self.size[i], pos])
                    return (events, {"event_index": i, "requested_bytes": self.size[i], "phase": "replay"},
                            replayed, by_cache, exact, retries0)
                amap.set(self.addr[i], got)
                replayed += 1
                if core.events.size():
                    _collect(core, events, pos)
                pos += 1
            elif code == A_FREE_DONE:
                if amap.pop(self.addr[i], got):
                    _free(sim, got)
                    replayed += 1
                pos += 1
            elif code == A_OOM:
                got = _malloc(sim, self.size[i], self.stream[i])
                _collect(core, events, pos)
                if got == -2:
                    events.append(["oom", self.size[i], pos])
                else:   # the simulator found room where the device did not: a divergence
                    _free(sim, got)
                replayed += 1
                pos += 1
            elif expl.count(i) or (check_cache and _reuses(core, check_cache.get(i))):
                if not expl.count(i):
                    by_cache.append(i)
                core.empty_cache()
                _collect(core, events, pos)
        return events, None, replayed, by_cache, exact, retries0

    cdef bint _seed(self, FastSim sim, AddrMap[int64_t]& amap) except -1:
        """initial_state.seed_initial_state (see there); True when the layout is exact."""
        cdef Py_ssize_t k, j, m = self.seg_addr.size()
        cdef bint exact = True, expandable = sim.core.expandable, has_base
        cdef int64_t base = 0, got, offset, size, rec, start, gap, step
        cdef vector[int64_t] gaps
        cdef vector[int64_t] pieces   # offset, size, recorded address (-1: a gap)
        cdef cppmap[pair[int, int64_t], int] by_kind
        cdef pair[int, int64_t] kind
        for k in range(m):
            if self.seg_exp[k]:
                kind.first, kind.second = self.seg_small[k], self.seg_stream[k]
                by_kind[kind] += 1
        for k in range(m):
            _pieces(pieces, self.seg_blocks[k], self.seg_size[k], self.seg_small[k])
            if self.seg_exp[k] != expandable:
                exact = False
            elif self.seg_exp[k]:
                kind.first, kind.second = self.seg_small[k], self.seg_stream[k]
                if by_kind[kind] > 1:
                    exact = False
                elif not self.seg_small[k]:
                    for j in range(0, pieces.size(), 3):
                        if pieces[j + 2] < 0 and 0 < pieces[j + 1] <= _MiB:
                            exact = False
                            break
            has_base = False
            if not self.seg_small[k]:
                base = _malloc(sim, self.seg_size[k], self.seg_stream[k])
                if base == -2:
                    _raise_oom(sim)
                has_base = True
                _free(sim, base)
            for j in range(0, pieces.size(), 3):
                offset, size, rec = pieces[j], pieces[j + 1], pieces[j + 2]
                got = _malloc(sim, size, self.seg_stream[k])
                if got == -2:
                    _raise_oom(sim)
                if not has_base:
                    base, has_base = got - offset, True
                exact = exact and got == base + offset
                if rec < 0:
                    gaps.push_back(got)
                else:
                    amap.set(rec, got)
        for got in gaps:
            _free(sim, got)
        return exact and not self.unplaced


cdef void _pieces(vector[int64_t]& out, vector[int64_t]& blocks, int64_t total, int small):
    """initial_state._pieces: (offset, size, recorded address or -1 for a gap) covering a segment."""
    cdef int64_t offset = 0, start, size, rec, gap, step
    cdef Py_ssize_t j, nb = blocks.size()
    out.clear()
    j = 0
    while j <= nb:
        if j < nb:
            start, size, rec = blocks[j], blocks[j + 1], blocks[j + 2]
        else:
            start, size, rec = total, 0, -1
        gap = start - offset
        while gap > 0:
            step = min(gap, _MiB) if small else gap
            out.push_back(offset)
            out.push_back(step)
            out.push_back(-1)
            offset, gap = offset + step, gap - step
        if size:
            out.push_back(start)
            out.push_back(size)
            out.push_back(rec)
            offset = start + size
        j += 3


cdef void _undo_mapping(vector[Span]& spans, bint is_map, int64_t lo, int64_t size, int64_t stream):
    """One step of initial_state._undo_mappings (the trace walked backwards)."""
    cdef int64_t hi = lo + size, a, b
    cdef vector[Span] out
    cdef Span s, t
    cdef bint touched = False
    if is_map:   # undo a map: remove [lo, hi) from the mapped ranges
        for s in spans:
            if s.b <= lo or s.a >= hi:
                out.push_back(s)
                continue
            if s.a < lo:
                t = s
                t.b = lo
                out.push_back(t)
            if s.b > hi:
                t = s
                t.a = hi
                out.push_back(t)
        spans.swap(out)
        return
    a, b = lo, hi   # undo an unmap: add [lo, hi) back, merged with the ranges it touches
    for s in spans:
        if s.b >= lo and s.a <= hi:
            if not touched:
                t.small, t.stream, touched = s.small, s.stream, True
            a, b = min(a, s.a), max(b, s.b)
        else:
            out.push_back(s)
    if not touched:
        t.small, t.stream = (size % (20 << 20)) != 0, stream
    t.a, t.b = a, b
    out.push_back(t)
    sort_spans(out)
    spans.swap(out)


cdef int64_t _malloc(FastSim sim, int64_t size, int64_t stream) except -3:
    """FastSim.malloc on the core: the address (0 for 0 bytes), or -2 on a simulated OOM (the error
    is then built by _raise_oom when the caller raises it); ConfigError as FastSim.malloc."""
    cdef int32_t bid = sim.core.api_malloc(size, stream)
    if bid >= 0:
        return sim.core.blocks[bid].addr
    if bid == -1:
        return 0
    if bid == -2:
        return -2
    if bid == -3:
        raise ConfigError(f"cannot allocate a negative size ({size} bytes)")
    raise ConfigError("the virtual GPU ran out of simulated address space")


cdef int _free(FastSim sim, int64_t addr) except -1:
    if sim.core.api_free(addr) < 0:
        raise ConfigError(f"free of an address that is not allocated on the virtual GPU: {addr!r}")
    return 0


cdef int _raise_oom(FastSim sim) except -1:
    o = sim.core.last_oom
    raise sim._ref._oom_error(o[0], o[1], o[2], o[3], o[4])


cdef int _collect(Core* core, list events, Py_ssize_t pos) except -1:
    """replay._Run.collect: the core's new segment events as (action, size, position)."""
    cdef size_t k
    for k in range(core.events.size()):
        events.append([_SEGMENT_ACTIONS[core.events[k].action], core.events[k].size, pos])
    core.events.clear()
    return 0


cdef bint _reuses(Core* core, object request) except -1:
    """The cached-block rule's test: ``sim.would_reuse_cached(*request)``; False for None."""
    if request is None:
        return False
    return core.would_reuse_cached(request[0], request[1])

