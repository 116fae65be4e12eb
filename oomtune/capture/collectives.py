"""Collectives under a recording on the CPU: every release stays in the recording thread's order.

A CPU rank exchanges real tensors through ``gloo``, whose collectives run on its worker threads
(``ProcessGroupGloo::runLoop``): the worker holds the ``Work`` (and through it the tensors it was
given) until it comes round its loop, *after* it has marked the work complete. When the rank's own
thread drops the last of its references first (DDP's flat broadcast buffers of
``_broadcast_coalesced`` dropped right after their ``wait()``, the gradient buckets replaced by
``Reducer::rebuild_buckets`` after the first iteration, FSDP2's all-gather and reduce-scatter
buffers), the storage dies on the worker thread, whenever the scheduler lets it run: the virtual
GPU then saw the release at a point that changed from run to run (one 670,720-byte bucket freed
after, instead of before, the new one: a fourth 2 MiB segment, and another answer).

On CUDA the release is in program order: ``ProcessGroupNCCL`` keeps the tensors in the work's
``stashed_for_allocator_safety_`` and lets them go on the calling thread (``Work::wait`` /
``synchronize``), so the block is freed when the program drops its last reference. This module
gives the CPU the same order: :func:`run_collective` hands ``gloo`` non-owning aliases of the
tensors (the same memory, viewed through a ``ctypes`` buffer: the worker's references keep no
storage alive), waits for the work on the calling thread, and returns the caller's own tensors and
a completed ``Work`` whose future holds them. Every recorded storage then dies on the thread that
dropped it, at the same point in every run.

The collective is synchronous under a recording (the rank's computation no longer overlaps its
communication), which changes the CPU's step time, never the allocations: the same ops allocate
the same storages. Point-to-point ops (``send``, ``recv_``) are left alone: waiting on a send
before the peer's receive is posted could deadlock.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch
from torch.utils._pytree import tree_map

__all__ = ["COLLECTIVES", "is_collective", "run_collective"]

#: ``c10d`` ops (by schema name) that are run through :func:`run_collective`: every collective of
#: ``torch/csrc/distributed/c10d/Ops.cpp``; ``send``, ``recv_``, ``recv_any_source_`` (point to point),
#: ``check_for_nan`` and ``monitored_barrier_`` are not.
COLLECTIVES = frozenset({
    "_allgather_base_", "_reduce_scatter_base_", "allgather_", "allgather_coalesced_",
    "allgather_into_tensor_coalesced_", "allreduce_", "allreduce_coalesced_", "alltoall_", "alltoall_base_",
    "barrier", "broadcast_", "gather_", "gather_into_tensor_", "reduce_", "reduce_scatter_",
    "reduce_scatter_tensor_coalesced_", "scatter_",
})


def is_collective(func: Any) -> bool:
    """Whether ``func`` (an ``OpOverload``) is one of :data:`COLLECTIVES`."""
    return getattr(func, "namespace", None) == "c10d" and func._schema.name.split("::")[-1] in COLLECTIVES


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor over ``t``'s memory that does not own it (its storage wraps a ``ctypes`` buffer at
    the same address): dropping it frees nothing."""
    st = t.untyped_storage()
    buf = (ctypes.c_byte * st.nbytes()).from_address(st.data_ptr())
    base = torch.frombuffer(buf, dtype=torch.uint8)
    return torch.empty(0, dtype=t.dtype).set_(base.untyped_storage(), t.storage_offset(), t.size(), t.stride())


def _aliasable(x: Any) -> bool:
    return (isinstance(x, torch.Tensor) and x.device.type == "cpu" and type(x) is torch.Tensor
            and x.untyped_storage().nbytes() > 0)


def run_collective(func: Any, args: tuple, kwargs: dict) -> Any:
    """Run the collective ``func(*args, **kwargs)`` (called from a dispatch mode's handler, below
    the mode) with the aliasing and the wait of the module docstring. Tensors that are not on the
    CPU (``meta`` under torch's fake process group) or not plain tensors are passed as they are; a
    call without any CPU tensor runs unchanged.

    Returns what ``func`` returns, with every alias replaced by the caller's tensor and every
    ``Work`` by a completed one whose future's value is the caller's tensors: the ``Work``'s own
    value, or for a ``Work`` without a future (gloo's reduce-scatter) the tensors it was given. Its
    ``wait()`` does nothing more: gloo's reduce-scatter copies its result out of a buffer of its own
    when waited on, and that buffer (no CUDA reduce-scatter has one) is then never seen by the
    recording.

    Raises:
        What the collective raises (a peer gone, a timeout), from its ``wait()``.
    """
    from torch._C._distributed_c10d import Work, _create_work_from_future

    back: dict[int, torch.Tensor] = {}

    def sub(x: Any) -> Any:
        if not _aliasable(x):
            return x
        a = _alias(x)
        back[id(a)] = x
        return a

    with torch.utils._python_dispatch._disable_current_modes():
        a2, k2 = tree_map(sub, (args, kwargs))
    if not back:
        return func(*args, **kwargs)
    out = func(*a2, **k2)

    def unmap(x: Any) -> Any:
        return back.get(id(x), x) if isinstance(x, torch.Tensor) else x

    def settle(o: Any) -> Any:
        if not isinstance(o, torch.ScriptObject):
            return tree_map(unmap, o)
        work = Work.unbox(o)
        work.wait()
        try:
            value = tree_map(unmap, work.get_future().value())
        except RuntimeError:   # "Work::getFuture not implemented" (gloo's reduce-scatter): the tensors given
            value = list(back.values())
        future: Any = torch.futures.Future()
        future.set_result(value)
        return _create_work_from_future(future).boxed()

    return tuple(settle(o) for o in out) if isinstance(out, tuple) else settle(out)
