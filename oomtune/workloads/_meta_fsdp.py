"""One rank of FSDP2 on the meta device, under torch's fake process group (a plan's capture).

FSDP2 (``torch.distributed.fsdp.fully_shard``) places every tensor it makes on the device of its
mesh, and it stops a rank whose parameters are still on meta. Two places stand between a meta
capture and FSDP2 (torch/distributed/fsdp/_fully_shard/, torch/distributed/device_mesh.py); each is
got round for a mesh on meta only, within :func:`fsdp_on_meta`, and no allocation is added or left out:

- The device handle. FSDP2 asks the mesh's device type for its module (``_get_device_handle``,
  device_mesh.py: ``getattr(torch, device_type, None)``): ``current_device()`` gives the device its
  shards and buffers go to (``_get_device_from_mesh``, _fsdp_init.py), ``Stream``/``Event``/
  ``current_stream``/``stream`` order its copies (``FSDPCommContext.lazy_init``, _fsdp_param_group.py;
  ``foreach_all_gather`` and ``foreach_reduce``, _fsdp_collectives.py). ``torch`` has no ``meta``
  module, so within the block ``torch.meta`` is :data:`META_HANDLE`: ``current_device()`` is
  ``None`` (``torch.device("meta", None)`` is the meta tensors' own device, so every ``device=``
  FSDP2 passes puts the tensor on meta), the streams and events are ``torch.cpu``'s (objects only,
  no execution: torch/cpu/__init__.py), which the recorder numbers as it numbers a CPU rank's
  (:mod:`oomtune.capture.streams`): FSDP2's all-gather and reduce-scatter buffers land in the same
  per-stream pools as in a CPU capture.
- ``FSDPParamGroup._validate_no_meta_params`` (_fsdp_param_group.py, at the first forward's lazy
  init) raises for a parameter on meta: a check that the program materialised its model, which on
  meta it did (``to_empty(device=meta)`` made new storages, as ``to_empty(device=cuda)`` does on a
  GPU rank). Skipped for a group whose device is meta; any other group is checked as before.

One more meta check needs nothing: ``FSDPParam.reset_sharded_param`` (_fsdp_param.py, in the same lazy
init) returns at once for a local shard on meta, where a device rank re-saves the shard ``to_empty``
made as ``_sharded_param_data`` (the flat tensor its all-gather copies in), re-padding it only if it
is not of the padded size. Rank 0's shard always is (``_chunk_with_empty`` gives chunk 0 the padded
size, ``FSDPParam._init_sharded_param``), so a device rank allocates nothing there; on meta the flat
tensor stays the one ``fully_shard`` made before the step, of the same shape, and no recorded storage
depends on which of the two the all-gather reads (tests/test_meta_fsdp.py compares the streams).

FSDP2's parameters on a meta mesh are DTensors whose device is meta: the recorder memoizes only
plain meta tensors (:func:`oomtune.capture.recorder._key`), never such a wrapper.

Everything that allocates runs as torch runs it: the recorded stream is the CPU capture's, event for
event (tests/test_meta_fsdp.py).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

__all__ = ["META_HANDLE", "fsdp_on_meta", "meta_mesh", "active"]


def _handle() -> Any:
    import torch

    return types.SimpleNamespace(
        current_device=lambda: None,          # torch.device("meta", None) == a meta tensor's device
        Stream=torch.cpu.Stream, Event=torch.cpu.Event, current_stream=torch.cpu.current_stream,
        stream=torch.cpu.stream, synchronize=torch.cpu.synchronize,
        is_available=lambda: True, is_initialized=lambda: True, device_count=lambda: 1)


#: The device module FSDP2 gets for a mesh on meta within :func:`fsdp_on_meta` (see the module
#: docstring); built on first use.
META_HANDLE: Any = None
_DEPTH = 0


def active() -> bool:
    """Whether :func:`fsdp_on_meta` is in effect now."""
    return _DEPTH > 0


@contextlib.contextmanager
def fsdp_on_meta() -> Iterator[None]:
    """Within the block, FSDP2 works on a mesh whose device type is ``meta`` (:func:`meta_mesh`):
    ``torch.meta`` is :data:`META_HANDLE`, and a parameter group on meta skips the check that its
    parameters were materialised (the module docstring). Outside it, and for groups off meta, FSDP2
    is unchanged. Re-entrant.

    Raises:
        RuntimeError: ``torch.meta`` exists already and is not this module's (a torch that has a
            meta device module: this stand-in would hide it).
    """
    global META_HANDLE, _DEPTH
    import torch
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    if _DEPTH:
        _DEPTH += 1
        try:
            yield
        finally:
            _DEPTH -= 1
        return
    if getattr(torch, "meta", None) is not None:
        raise RuntimeError("torch.meta exists: FSDP2 on meta would hide it (oomtune/workloads/_meta_fsdp.py)")
    META_HANDLE = META_HANDLE or _handle()
    validate = FSDPParamGroup._validate_no_meta_params

    def _validate(group: Any) -> None:
        if group.device.type != "meta":
            validate(group)

    torch.meta = META_HANDLE
    FSDPParamGroup._validate_no_meta_params = _validate
    _DEPTH = 1
    try:
        yield
    finally:
        _DEPTH = 0
        FSDPParamGroup._validate_no_meta_params = validate
        del torch.meta


def meta_mesh(world: int) -> Any:
    """A one-dimensional ``DeviceMesh`` of ``world`` ranks on the meta device over the default
    process group (the fake one: ``DeviceMesh._setup_world_group_and_device`` sets no device for it),
    for ``fully_shard(..., mesh=...)`` within :func:`fsdp_on_meta`.

    Raises:
        RuntimeError: outside :func:`fsdp_on_meta` (FSDP2 would find no device module for meta).
    """
    from torch.distributed.device_mesh import init_device_mesh

    if not active():
        raise RuntimeError("a mesh on meta needs fsdp_on_meta() around the whole capture (oomtune/workloads/"
                           "_meta_fsdp.py)")
    return init_device_mesh("meta", (world,))
