"""One rank of DDP on the meta device, under torch's fake process group (a plan's capture).

``DistributedDataParallel`` reads the *values* of tensors it exchanges at two points, which a meta
tensor does not have (``Tensor.item()`` and a copy to the host raise on meta). Both are checks and
agreements between ranks whose outcome one rank of the fake group knows without reading anything:

- its constructor verifies that every rank holds the same parameters
  (``_verify_param_shape_across_processes`` -> ``verify_params_across_processes`` in
  torch/csrc/distributed/c10d/reducer.cpp): it all-gathers the parameter count and ``.item()``s
  each rank's, broadcasts the parameters' sizes and strides and copies them back to the host.
  :func:`verify_on_meta` makes the same requests on the parameters' device and the same
  collectives, without the reads (every rank of the fake group is this one: they agree).
- at the first forward after the first backward, ``Reducer::rebuild_buckets`` (reducer.cpp)
  calls ``sync_bucket_indices``: rank 0's bucket indices and sizes, written into host tensors,
  copied to the device, broadcast from rank 0, copied back into the same host tensors. Rank 0 of
  the fake group is the source, so the host tensors already hold what the copy back would write:
  :class:`HostKeepsItsValues` (active only inside ``DistributedDataParallel._pre_forward``, where
  DDP rebuilds its buckets) leaves a host tensor as it is instead of copying a meta tensor into it.

Everything that allocates runs as torch runs it (the buckets of ``Reducer::initialize_buckets``,
the flat buffers of ``_broadcast_coalesced``, the gradient copies into the buckets): the stream
recorded on meta is what a GPU rank allocates on its device: the CPU capture's, event for event, less
the host tensors a CPU rank's recording counts as its device's (tests/test_meta_rank.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = ["on_meta_under_fake_group", "verify_on_meta", "HostKeepsItsValues", "meta_ddp"]


def on_meta_under_fake_group(module: Any) -> bool:
    """Whether ``module``'s parameters are on meta and the default process group is the fake one
    (:func:`oomtune.workloads.parallel.fake_process_group`): the case this module handles."""
    import torch.distributed as dist

    first = next(iter(module.parameters()), None)
    return first is not None and first.is_meta and dist.is_initialized() and dist.get_backend() == "fake"


def verify_on_meta(process_group: Any, tensors: list[Any], logger: Any = None) -> None:
    """``torch.distributed.utils._verify_param_shape_across_processes`` for parameters on meta under
    the fake group: the device storages ``verify_params_across_processes`` (torch/csrc/distributed/
    c10d/reducer.cpp) creates on a GPU rank, in the same order, on ``tensors``' device, and the same
    collectives: the parameter count (one int64, ``at::tensor`` on the parameters' device),
    ``world_size`` all-gather outputs like it, the sizes and strides sent by broadcast (``2 x
    sum(dim)`` int64, ``metadata_dev``); released as the C++ function's locals are (the broadcast
    tensor, the gather outputs in order, the count). Its host tensors (``metadata`` and ``control``,
    the copy read back) stay on the host on a GPU rank, so not here: a CPU rank's virtual GPU counts
    them, its known difference (docs/plan-and-simulate.md). The values are never read: every rank of
    the fake group is this one. ``logger`` is accepted and unused (DDP's logger hears of a mismatch,
    which cannot happen)."""
    import torch
    import torch.distributed as dist

    device = tensors[0].device
    count = torch.empty(1, dtype=torch.long, device=device)
    gathered = [torch.empty_like(count) for _ in range(process_group.size())]
    dist.all_gather(gathered, count, group=process_group)
    metadata_dev = torch.empty(sum(2 * t.dim() for t in tensors), dtype=torch.long, device=device)
    dist.broadcast(metadata_dev, 0, group=process_group)
    del metadata_dev
    while gathered:          # a list's own release goes from the last item; C++'s vector from the first
        del gathered[0]
    del count


def _host_keeps_mode() -> Any:
    from torch.utils._python_dispatch import TorchDispatchMode

    import torch

    copy = torch.ops.aten.copy_.default

    class _HostKeepsItsValues(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            if (func is copy and isinstance(args[0], torch.Tensor) and args[0].device.type == "cpu"
                    and isinstance(args[1], torch.Tensor) and args[1].is_meta):
                return args[0]
            return func(*args, **(kwargs or {}))

    return _HostKeepsItsValues


class HostKeepsItsValues:
    """Within the block, ``host_tensor.copy_(meta_tensor)`` leaves the host tensor as it is (no
    data to copy; allocates nothing, as the copy itself does not); every other op runs unchanged.
    A dispatch mode (``TorchDispatchMode``) above any recorder's, so the recorder sees the rest."""

    def __init__(self) -> None:
        self._mode = _host_keeps_mode()()

    def __enter__(self) -> "HostKeepsItsValues":
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)


@contextlib.contextmanager
def _verify_replaced() -> Iterator[None]:
    import torch.nn.parallel.distributed as ddp_module

    original = ddp_module._verify_param_shape_across_processes
    ddp_module._verify_param_shape_across_processes = verify_on_meta
    try:
        yield
    finally:
        ddp_module._verify_param_shape_across_processes = original


def meta_ddp(module: Any, **kwargs: Any) -> Any:
    """``DistributedDataParallel(module, **kwargs)`` for ``module`` on meta under the fake group
    (:func:`on_meta_under_fake_group`): constructed with :func:`verify_on_meta` in place of the
    parameter verification, and its ``_pre_forward`` (where ``Reducer::rebuild_buckets`` syncs the
    bucket indices) run under :class:`HostKeepsItsValues`. See the module docstring."""
    from torch.nn.parallel import DistributedDataParallel

    with _verify_replaced():
        ddp = DistributedDataParallel(module, **kwargs)
    pre_forward = ddp._pre_forward

    def _pre_forward(*args: Any, **kw: Any) -> Any:
        with HostKeepsItsValues():
            return pre_forward(*args, **kw)

    ddp._pre_forward = _pre_forward
    return ddp
