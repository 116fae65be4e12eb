"""Spreading ``oomtune plan``'s work over the CPU cores with forked processes (issue 13, item 3).

The plan's work splits into independent pieces: the anchor captures of the affine model (one per
batch size) and the replays of each allocator configuration (:func:`oomtune.plan.feasibility.
build_plan`). :func:`fork_map` runs such pieces in worker processes forked from the caller (POSIX
``fork``: the workers inherit the imported torch, the captured streams and the predictor's caches
copy-on-write, so nothing is imported twice and only the results travel back, pickled), and returns
the results in the order of the inputs. Each piece runs the same code as in one process, so the
results are the same: only where they are computed changes.

Off Linux (:func:`default_workers`), with one worker or one piece, everything runs in the calling
process.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

__all__ = ["default_workers", "fork_imap", "fork_map", "MAX_WORKERS"]

#: Worker processes at most, whatever the core count (each holds a copy-on-write image of the plan).
MAX_WORKERS = 8

_JOB: tuple[Callable[[Any], Any], Sequence[Any]] | None = None   # what forked workers run (inherited)


def default_workers() -> int:
    """Worker processes for the plan: the CPU cores this process may run on
    (``os.sched_getaffinity``), at most :data:`MAX_WORKERS`; 1 off Linux (macOS has ``fork`` but
    its system libraries are not safe to use in a forked child of a process with threads, hence
    Python's ``spawn`` default there)."""
    import sys

    if not sys.platform.startswith("linux"):
        return 1
    return max(1, min(len(os.sched_getaffinity(0)), MAX_WORKERS))


def _run(index: int) -> Any:
    assert _JOB is not None
    fn, items = _JOB
    return fn(items[index])


def fork_imap(fn: Callable[[Any], Any], items: Sequence[Any], workers: int) -> Iterator[Any]:
    """``fn(item)`` for each of ``items``, yielded in the order of ``items``, computed by up to
    ``workers`` forked processes (each takes the next item when it is done with one).

    ``fn`` and ``items`` reach the workers by inheritance (no pickling, so a closure is fine); each
    result must pickle. With ``workers <= 1``, a single item, or no ``fork`` start method, ``fn``
    runs here, lazily. An exception raised by ``fn`` is raised here (pickled back from the worker).
    """
    global _JOB
    import multiprocessing

    items = list(items)
    workers = min(int(workers), len(items))
    if workers <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        yield from (fn(x) for x in items)
        return
    if _JOB is not None:   # nested use (a worker forking again): run here
        yield from (fn(x) for x in items)
        return
    _JOB = (fn, items)
    try:
        pool = multiprocessing.get_context("fork").Pool(workers)
    finally:
        _JOB = None   # the workers have their copy; the caller's is not needed after the fork
    try:
        yield from pool.imap(_run, range(len(items)), chunksize=1)
    finally:
        pool.terminate()
        pool.join()


def fork_map(fn: Callable[[Any], Any], items: Sequence[Any], workers: int) -> list[Any]:
    """The list of :func:`fork_imap`'s results."""
    return list(fork_imap(fn, items, workers))
