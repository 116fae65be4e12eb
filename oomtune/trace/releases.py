"""Who released a trace's segments, and what the trace says about the device's memory limit.

A run of consecutive ``segment_free`` / ``segment_unmap`` entries is one release: either the
program's ``torch.cuda.empty_cache()`` (``NativeCachingAllocator::emptyCache`` ->
``release_cached_blocks``) or the allocator's own release-and-retry inside ``malloc``
(``release_available_cached_blocks`` / ``release_cached_blocks`` after ``alloc_block`` failed,
c10/cuda/CUDACachingAllocator.cpp). The replay must call ``empty_cache`` for the first kind and must
leave the second to the simulator, which repeats it only on a device of the right size. Rules, in
order (the one that decided is reported):

1. ``frames``: the entries' stack frames name ``emptyCache`` / ``empty_cache`` (explicit) or
   ``DeviceCachingAllocator::malloc`` (the allocator's own release).
2. ``request stream``: no segment_alloc/segment_map/oom follows before the next request entry, so
   no allocation needed it: explicit.
3. ``device limit``: a new segment follows. The allocator releases only when
   ``reserved + needed > limit``; the limit is at least the largest reserved total the device ever
   held (it held it), so a release with ``reserved + needed <= peak reserved`` cannot be the
   allocator's: explicit; otherwise the allocator's.
4. ``cached block``: applied during the replay (:mod:`oomtune.trace.replay`) to a release rule 3
   gave to the allocator: the allocator releases only after ``get_free_block`` failed, so if a
   cached block of the simulator would serve the next request, the release was the program's.

The device limit (bytes of reserved memory the device could hold, :func:`infer_device_limit`): at
least the peak reserved total; below ``reserved + needed`` at every release of the allocator; and
exactly ``reserved + device_free`` at an ``oom`` entry (``device_free`` is ``cudaMemGetInfo``'s free
memory when the allocator gave up).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Release", "DeviceLimit", "classify_releases", "classify_runs", "infer_device_limit", "limit_from",
           "oom_points", "recorded_reserved_walk", "release_runs"]

_GROW = ("segment_alloc", "segment_map")
_SHRINK = ("segment_free", "segment_unmap")
_REQUESTS = ("alloc", "free_requested", "free_completed")


@dataclass(frozen=True)
class Release:
    """One run of recorded segment releases: trace indices ``first..last`` (inclusive).

    ``explicit``: the program's empty_cache (True) or the allocator's release-and-retry (False);
    ``rule``: ``"frames"``, ``"request stream"``, ``"device limit"`` or ``"cached block"`` (module docstring);
    ``reserved_before_bytes``: recorded reserved total just before it; ``needed_bytes``: size of the
    segment_alloc/segment_map that follows before the next request (0 if none); ``request``:
    ``(size_bytes, stream)`` of the next ``alloc`` entry, the request those segments served (None if
    there is none).
    """

    first: int
    last: int
    explicit: bool
    rule: str
    reserved_before_bytes: int
    needed_bytes: int
    request: tuple[int, int] | None = None


@dataclass(frozen=True)
class DeviceLimit:
    """What a trace says about the device's limit on reserved memory, in bytes.

    ``low_bytes`` <= limit <= ``high_bytes`` (``high_bytes`` None: no upper bound); ``used_bytes``:
    the value a replay uses (the ``oom`` entry's exact figure when there is one, else ``low_bytes``);
    ``sources``: what bounded it, for display.
    """

    low_bytes: int
    high_bytes: int | None
    used_bytes: int
    sources: tuple[str, ...]


def recorded_reserved_walk(trace: list[dict], initial_reserved: int) -> tuple[list[int], int]:
    """Reserved bytes before each trace entry (recorded segment events applied), and the peak."""
    reserved, peak, before = initial_reserved, initial_reserved, []
    for e in trace:
        before.append(reserved)
        act = e["action"]
        if act in _GROW:
            reserved += e["size"]
            peak = max(peak, reserved)
        elif act in _SHRINK:
            reserved -= e["size"]
    return before, peak


#: Frames lists read by :func:`_frames_verdict` (a counter for tests: each distinct list once).
FRAMES_READ = {"lists": 0}


def _frames_verdict(entries: list[dict], cache: dict[int, bool | None] | None = None) -> bool | None:
    """True: empty_cache in the frames; False: the allocator's malloc; None: frames say nothing.

    ``cache``: verdicts by ``id(frames)``: a frames list shared by many entries (one object through
    the pickle's memo) is read once (work bounded by the file's size); the caller keeps the lists alive."""
    for e in entries:
        frames = e.get("frames")
        if not frames:
            continue
        key = id(frames)
        if cache is not None and key in cache:
            verdict = cache[key]
        else:
            FRAMES_READ["lists"] += 1
            verdict = _list_verdict(frames)
            if cache is not None:
                cache[key] = verdict
        if verdict is not None:
            return verdict
    return None


def _list_verdict(frames: list) -> bool | None:
    names = [f.get("name", "") for f in frames if isinstance(f, dict)]
    if any("emptyCache" in n or n == "empty_cache" for n in names):
        return True
    if any("DeviceCachingAllocator::malloc" in n or "garbage_collect" in n for n in names):
        return False
    return None


def release_runs(trace: list[dict], before: list[int]) -> list[tuple[int, int, int, int, bool, tuple[int, int] | None]]:
    """Every run of consecutive segment releases in ``trace``, before classification.

    ``before``: reserved bytes before each entry (:func:`recorded_reserved_walk`). One tuple per run:
    ``(first, last, reserved_before_bytes, needed_bytes, followed, request)``: ``followed`` is True
    when a segment_alloc/segment_map/oom comes before the next request entry (``needed_bytes`` its
    size, else 0); ``request``: ``(size_bytes, stream)`` of the next ``alloc`` entry, or None. The
    compiled core computes the same tuples (``_fastcore.TraceReplay.release_runs``).
    """
    out = []
    i, n = 0, len(trace)
    next_alloc: tuple[int, int] | None = None
    alloc_at = -1   # index of the next alloc entry after the last run (n: none); each entry scanned once
    while i < n:
        if trace[i]["action"] not in _SHRINK:
            i += 1
            continue
        j = i
        while j + 1 < n and trace[j + 1]["action"] in _SHRINK:
            j += 1
        needed, followed = 0, False
        for k in range(j + 1, n):
            later = trace[k]
            act = later["action"]
            if act in _GROW or act == "oom":
                needed, followed = later["size"], True
                break
            if act in _REQUESTS:
                break
        if alloc_at <= j:
            alloc_at, next_alloc = j + 1, None
            while alloc_at < n and trace[alloc_at]["action"] != "alloc":
                alloc_at += 1
            if alloc_at < n:
                next_alloc = (trace[alloc_at]["size"], trace[alloc_at].get("stream", 0))
        out.append((i, j, before[i], needed, followed, next_alloc))
        i = j + 1
    return out


def classify_runs(trace: list[dict], runs: list[tuple], peak: int) -> list[Release]:
    """:class:`Release` of each run from :func:`release_runs` (rules 1-3 of the module docstring);
    ``peak``: the recorded peak reserved bytes."""
    out = []
    cache: dict[int, bool | None] = {}
    for i, j, reserved_before, needed, followed, request in runs:
        verdict = _frames_verdict(trace[i:j + 1], cache)
        if verdict is not None:
            explicit, rule = verdict, "frames"
        elif not followed:
            explicit, rule = True, "request stream"
        else:
            explicit, rule = reserved_before + needed <= peak, "device limit"
        out.append(Release(i, j, explicit, rule, reserved_before, needed, request))
    return out


def classify_releases(trace: list[dict], initial_reserved: int,
                      walk: tuple[list[int], int] | None = None) -> list[Release]:
    """Every run of consecutive segment releases in ``trace``, classified (module docstring).

    Args:
        trace: one device's trace entries.
        initial_reserved: reserved bytes before the first entry (the rebuilt starting state).
        walk: :func:`recorded_reserved_walk`'s result when the caller has it (else computed).
    """
    before, peak = walk or recorded_reserved_walk(trace, initial_reserved)
    return classify_runs(trace, release_runs(trace, before), peak)


def oom_points(trace: list[dict], before: list[int]) -> list[int]:
    """``reserved + device_free`` (bytes) at each ``oom`` entry that records an int ``device_free``."""
    return [before[i] + e["device_free"] for i, e in enumerate(trace)
            if e["action"] == "oom" and isinstance(e.get("device_free"), int)]


def infer_device_limit(trace: list[dict], initial_reserved: int, releases: list[Release],
                       walk: tuple[list[int], int] | None = None) -> DeviceLimit | None:
    """The device limit the trace implies, or None when it implies none (no allocator release, no
    ``oom`` entry: the device never ran short, so any capacity above the peak replays the same).
    ``walk``: :func:`recorded_reserved_walk`'s result when the caller has it (else computed).
    """
    before, peak = walk or recorded_reserved_walk(trace, initial_reserved)
    return limit_from(peak, releases, oom_points(trace, before))


def limit_from(peak: int, releases: list[Release], points: list[int]) -> DeviceLimit | None:
    """:func:`infer_device_limit` from its parts: the recorded ``peak`` reserved bytes, the classified
    ``releases`` and the :func:`oom_points`."""
    high: int | None = None
    sources = ["at least the peak reserved (the device held it)"]
    for r in releases:
        if not r.explicit and r.needed_bytes:
            bound = r.reserved_before_bytes + r.needed_bytes - 1
            if high is None or bound < high:
                high = bound
    if high is not None:
        sources.append("below reserved + needed at the allocator's releases")
    exact = min(points) if points else None
    if exact is not None:
        sources.append("reserved + device_free at the oom entry")
    if high is None and exact is None:
        return None
    low = peak
    if exact is not None and exact >= low and (high is None or exact <= high):
        used = exact
    else:
        used = low
    return DeviceLimit(low, high if exact is None else min(high or exact, exact), used, tuple(sources))
