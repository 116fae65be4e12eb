"""Selecting the compiled replay core (``oomtune.alloc._fastcore``) or the pure-Python simulator.

The C++ core (built by ``pip install`` from _fastcore.pyx / _fastcore.hpp when a compiler and Cython
are there) replays a whole :class:`~oomtune.alloc.stream.AllocationStream` (:func:`replay_compiled`,
for ``replay_stream``) and serves :class:`~oomtune.alloc.sim.CachingAllocatorSim`'s public API call
by call (:func:`make_simulator`), with the same results as the Python simulator
(tests/test_alloc_compiled.py). It covers every
setting the simulator models and every stream; it declines (and the Python simulator runs) only for
a negative size, settings beyond 2**62 bytes other than "unlimited", or the simulated address space
running out, where the Python simulator raises its own error. Set ``OOMTUNE_PURE_PYTHON=1`` to use
the pure-Python simulator anyway (tests, benchmarks).
"""

from __future__ import annotations

import os
from typing import Any

try:
    from oomtune.alloc import _fastcore
except ImportError:   # not built: the pure-Python simulator does everything
    _fastcore = None

__all__ = ["available", "enabled", "replay_compiled", "make_simulator", "trace_replay", "is_compiled"]


def available() -> bool:
    """True when the compiled core was built and imports."""
    return _fastcore is not None


def enabled() -> bool:
    """True when replays use the compiled core: built, and ``OOMTUNE_PURE_PYTHON`` is not ``1``."""
    return _fastcore is not None and os.environ.get("OOMTUNE_PURE_PYTHON") != "1"


def replay_compiled(stream: Any, sim: Any, stop_on_oom: bool) -> dict[str, Any] | None:
    """Replay ``stream`` with the compiled core on the settings of the fresh simulator ``sim``.

    ``sim`` (a :class:`~oomtune.alloc.sim.CachingAllocatorSim` nothing has run on) supplies the
    validated settings and receives the final statistics, so that ``sim.memory_stats()`` is what
    the Python replay would leave. Returns None when the core is disabled or declines (see the
    module docstring), else the dict of ``_fastcore.replay_arrays`` (``events``, ``oom_index``,
    ``oom``: ``(alloc_size, request_size, free, allocated, reserved)`` bytes at the first OOM).
    """
    if not enabled():
        return None
    out = _fastcore.replay_arrays(stream.actions, stream.keys, stream.sizes, stream.streams, _cfg(sim),
                                  bool(stop_on_oom))
    if out is None:
        return None
    sim._st = out["stats"]
    sim._over_allocs, sim._over_segs = out["over_allocs"], out["over_segs"]
    for name, value in out["counters"].items():
        setattr(sim, name, value)
    sim._total_alloc = out["total_alloc"]
    return out


def _cfg(sim: Any) -> dict[str, Any]:
    """The settings of a Python simulator as the compiled core takes them."""
    return {"max_split": sim._max_split, "non_split": sim._max_non_split, "large_segment": sim._large_seg,
            "total": sim._total, "non_alloc": sim._non_alloc, "allowed": sim._allowed,
            "gc": float(sim._gc_threshold), "gc_on": sim._gc_on, "expandable": sim._expandable,
            "divs": sim._divs}


def make_simulator(settings: Any = None, **kwargs: Any) -> Any:
    """A virtual GPU with :class:`~oomtune.alloc.sim.CachingAllocatorSim`'s public API: the
    compiled one (``_fastcore.FastSim``) when :func:`enabled`, else a ``CachingAllocatorSim``.

    Takes ``CachingAllocatorSim``'s arguments and raises its errors. Both give the same results
    (malloc/free addresses, ``segment_events``, ``memory_stats``, ``memory_snapshot``, OOM errors;
    tests/test_alloc_compiled.py). Callers that reach into the Python simulator's internals must
    construct ``CachingAllocatorSim`` themselves.
    """
    from oomtune.alloc.sim import CachingAllocatorSim

    ref = CachingAllocatorSim(settings, **kwargs)
    if not enabled():
        return ref
    try:
        return _fastcore.FastSim(ref, _cfg(ref), bool(kwargs.get("record_segment_events", False)))
    except ValueError:   # a setting beyond the core's range: the Python simulator
        return ref


def is_compiled(sim: Any) -> bool:
    """True when ``sim`` is the compiled simulator (``_fastcore.FastSim``)."""
    return _fastcore is not None and isinstance(sim, _fastcore.FastSim)


def trace_replay(trace: list[dict], final: list[dict]) -> Any:
    """The compiled analysis of one device's trace (``_fastcore.TraceReplay``: starting state,
    recorded reserved walk, release runs, recorded segment events, and the replay on a FastSim),
    or None when the core is disabled or declines the trace (a value it does not take: a missing
    or non-int address, size or stream, a value outside [0, 2**56), an unknown segment_type); the
    caller then runs the Python path of :mod:`oomtune.trace`, which raises its own errors."""
    if not enabled():
        return None
    try:
        return _fastcore.TraceReplay(trace, final)
    except (ValueError, LookupError, TypeError, AttributeError, OverflowError):
        return None
