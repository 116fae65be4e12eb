"""The plan's replays spread over processes: which configurations go together,
and how a forked child's work comes back into the parent's :class:`~oomtune.plan.predictor.Predictor`.

:func:`rows_forked` runs :func:`oomtune.plan.feasibility.frontier_row` for groups of configurations
in this process and forked children (:func:`oomtune.plan.parallel.fork_map`). A child starts from a
copy of the predictor at the fork; what it adds (predictions, replays, streams derived or captured,
counters) travels back as a *delta* and is merged, so the parent ends up holding what one process
would hold.

:func:`rows_forked` asks the predictor itself for that (``fork_mark()``, ``fork_delta(since)``,
``fork_merge(gained)``): a :class:`~oomtune.plan.predictor.Predictor` answers with :func:`mark`,
:func:`delta` and :func:`merge` of its own state; a
:class:`~oomtune.plan.variants.PredictorVariants` with theirs for each of its members (one
predictor per workload variant, whose predictions of one batch size differ).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["replay_groups", "rows_forked", "mark", "delta", "merge", "NOTHING"]

_SECONDS = ("capture_seconds", "derive_seconds", "replay_seconds")


def replay_groups(mappings: Sequence[dict[str, Any]]) -> list[list[int]]:
    """Indexes of ``mappings`` grouped by everything but ``garbage_collection_threshold``, in order of
    first appearance: a configuration with a threshold reuses the replays of the same one without it
    (:meth:`oomtune.plan.predictor.Predictor._replay`), so a group is computed in one process."""
    groups: dict[tuple, list[int]] = {}
    for i, mapping in enumerate(mappings):
        key = tuple(sorted((k, repr(v)) for k, v in mapping.items() if k != "garbage_collection_threshold"))
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def mark(predictor: Any) -> tuple:
    """What ``predictor`` holds now, for :func:`delta`."""
    return (set(predictor._cache), set(predictor._streams), set(predictor.derived_batches), predictor.replays,
            set(predictor.cached_batches), *(getattr(predictor, name) for name in _SECONDS))


#: :func:`mark` of a predictor that holds nothing (one made after the mark was taken).
NOTHING: tuple = (set(), set(), set(), 0, set(), *(0.0 for _ in _SECONDS))


def delta(predictor: Any, since: tuple | None) -> dict[str, Any]:
    """What ``predictor`` gained since ``since`` (:func:`mark`; None: everything it holds, as for a
    predictor made after the mark), picklable, for :func:`merge`: predictions and replays, streams
    captured or derived, counters and seconds (the seconds under the names of ``_SECONDS``)."""
    cache, streams, derived, replays, cached, *seconds = NOTHING if since is None else since
    out = {"cache": {k: v for k, v in predictor._cache.items() if k not in cache},
           "replayed": {k: v for k, v in predictor._replays.items() if k not in cache},
           "streams": {b: s for b, s in predictor._streams.items() if b not in streams},
           "captured": [b for b in predictor._captured if b not in streams],
           "reasons": {b: predictor._capture_reasons[b] for b in predictor._captured if b not in streams},
           "derived": [b for b in predictor.derived_batches if b not in derived],
           "cached": [b for b in predictor.cached_batches if b not in cached],
           "fallback": set(predictor.fallback_reasons), "replays": predictor.replays - replays}
    out.update({name: getattr(predictor, name) - s for name, s in zip(_SECONDS, seconds)})
    return out


def merge(predictor: Any, gained: dict[str, Any]) -> None:
    """Take a child's :func:`delta` into ``predictor`` (the caller accounts for the seconds). A
    batch size that two processes both derived or captured counts once."""
    predictor._cache.update(gained["cache"])
    predictor._replays.update(gained["replayed"])
    for b, s in gained["streams"].items():
        predictor._streams.setdefault(b, s)
    for b in gained["captured"]:
        if b not in predictor._captured:
            predictor._keep_capture(b, gained["streams"][b], gained["reasons"][b])
    predictor.derived_batches.extend(b for b in gained["derived"] if b not in predictor.derived_batches)
    predictor.cached_batches.extend(b for b in gained["cached"] if b not in predictor.cached_batches)
    predictor.fallback_reasons |= gained["fallback"]
    predictor.replays += gained["replays"]


def rows_forked(predictor: Any, kept: Sequence[dict[str, Any]], grid: Sequence[int], limit_bytes: int | None,
                on_row: Callable[[Any], None] | None, frontier_row: Callable[..., Any]) -> list[Any]:
    """``frontier_row(predictor, mapping, grid, limit_bytes)`` of every mapping, the groups of
    :func:`replay_groups` spread over ``predictor.workers`` processes (this one and forked children);
    each group runs the same calls as in one process. The children's work is merged into
    ``predictor`` through its ``fork_mark`` / ``fork_delta`` / ``fork_merge`` (a Predictor's or a
    PredictorVariants'; each delta carries the seconds of ``_SECONDS``, and the seconds must be
    settable); the phase's wall time is split over capture / derive / replay seconds in
    proportion to the seconds spent in each. ``on_row`` is called in the order of ``kept``."""
    from oomtune.plan.parallel import fork_map

    groups = replay_groups(kept)

    def work(group: list[int]) -> tuple[int, list[Any], dict[str, Any]]:
        before = predictor.fork_mark()
        rows = [frontier_row(predictor, kept[i], grid, limit_bytes) for i in group]
        return os.getpid(), rows, predictor.fork_delta(before)

    done: dict[int, Any] = {}
    shown = 0

    def arrived(index: int, result: tuple[int, list[Any], dict[str, Any]]) -> None:
        nonlocal shown
        done.update(zip(groups[index], result[1]))
        while shown in done:   # progress in the order of the configurations
            if on_row is not None:
                on_row(done[shown])
            shown += 1

    before = [getattr(predictor, name) for name in _SECONDS]
    t0 = time.perf_counter()
    results = fork_map(work, groups, predictor.workers, on_result=arrived)
    wall = time.perf_counter() - t0
    spent = [0.0] * len(_SECONDS)
    for pid, _, gained in results:
        if pid != os.getpid():   # a child's work (this process's own is in predictor already)
            predictor.fork_merge(gained)
        spent = [x + gained[name] for x, name in zip(spent, _SECONDS)]
    if sum(spent) > 0:
        for name, b, x in zip(_SECONDS, before, spent):
            setattr(predictor, name, b + wall * x / sum(spent))
    return [done[i] for i in range(len(kept))]
