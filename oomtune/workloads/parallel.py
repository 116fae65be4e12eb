"""Data parallelism for the built-in workloads: ``model.parallel=none|ddp|fsdp``.

Each rank (one process per GPU, or on the CPU one per virtual GPU) trains ``batch_size`` samples
per step; ranks are started by the trial (:mod:`oomtune.trial.ranks`), which initialises the
process group before the workload is built. What each mode does to a rank's memory, in the order
the program allocates it (so that a virtual GPU attached before the first step sees all of it):

- ``ddp``: ``torch.nn.parallel.DistributedDataParallel``. Its gradient buckets (``Reducer``'s flat
  tensors, 25 MiB each after a first bucket of ``dist._DEFAULT_FIRST_BUCKET_BYTES``; full copies of
  the gradients, ``gradient_as_bucket_view=False``) and the flattened buffers of the initial
  parameter broadcast are allocated inside ``DistributedDataParallel(...)``: the model is wrapped
  lazily, at the start of the first step (:func:`wrap_lazily`), so a virtual GPU or capture attached
  before the first step records them, and the buckets DDP rebuilds after the first iteration
  (``_rebuild_buckets``, in gradient-ready order) too.
- ``fsdp``: FSDP2 (``torch.distributed.fsdp.fully_shard``) on every block (transformer layers,
  ResNet residual blocks, MLP linear layers) and on the root, the model built on the meta device,
  sharded, then materialised on the rank's device (``to_empty`` + each module's
  ``reset_parameters``): a rank never holds the full model, only its shard of the parameters, and
  later the shards of the gradients and the optimizer states; the all-gather outputs (unsharded
  parameters of one block, plus the flat all-gather buffer) and reduce-scatter buffers come and go
  during the step as FSDP2 allocates them (``_fsdp_collectives.foreach_all_gather`` /
  ``foreach_reduce``). On CUDA, FSDP2 allocates the all-gather buffer in its all-gather copy-in
  stream and the reduce-scatter output in its reduce-scatter stream (``FSDPCommContext``); the
  caching allocator keeps a pool per stream. On the CPU, ``torch.cpu.stream`` contexts carry the
  same streams (device-agnostic code), and the virtual GPU gives each its own stream
  (:mod:`oomtune.capture.streams`), so the per-stream pools are modelled as on CUDA.

Without a process group (``oomtune plan``, the search's predictions) the stream of one rank is
captured in one process with torch's fake process group (:func:`fake_process_group`:
``FakeProcessGroup``, world size N, rank 0; collectives do nothing, every allocation the
strategy makes is the same); all ranks hold the same amount, FSDP2 pads every shard to the same
size. A rank is captured on the meta device: under DDP with its two reads of exchanged values
answered for the fake group's one rank (:mod:`oomtune.workloads._meta_rank`), under FSDP2 on a mesh
on meta (:mod:`oomtune.workloads._meta_fsdp`, within :func:`meta_rank_scope`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from oomtune.exceptions import ConfigError

__all__ = ["PARALLEL_MODES", "parallel_mode", "world_size", "with_ranks", "is_distributed",
           "meta_rank_scope", "require_process_group",
           "fsdp_model", "wrap_lazily", "fake_process_group", "strategy_notes"]

#: ``model.parallel`` values.
PARALLEL_MODES = ("none", "ddp", "fsdp")


def parallel_mode(cfg: Mapping[str, Any]) -> str:
    """``cfg["parallel"]`` (``none`` when absent).

    Raises:
        ConfigError: a value other than none, ddp, fsdp.
    """
    value = cfg.get("parallel", "none")
    if value is None:
        return "none"
    if not isinstance(value, str) or value not in PARALLEL_MODES:
        raise ConfigError(f"model.parallel={value!r}: choose one of {', '.join(PARALLEL_MODES)}")
    return value


def world_size(cfg: Mapping[str, Any]) -> int:
    """The ranks a workload trains on: ``cfg["ranks"]`` (set from ``trial.gpus``), 1 when absent.

    Raises:
        ConfigError: not an integer >= 1.
    """
    value = cfg.get("ranks", 1)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"trial.gpus={value!r}: expected an integer >= 1")
    return value


def with_ranks(workload: dict[str, Any], gpus: int) -> dict[str, Any]:
    """A built-in workload with its rank count: ``ranks`` (``trial.gpus``) and ``parallel`` kept when
    it is distributed, both dropped when not (so a single-process workload reads as before).

    Raises:
        ConfigError: several GPUs per trial without a parallel strategy.
    """
    mode = parallel_mode(workload)
    out = {k: v for k, v in workload.items() if k not in ("parallel", "ranks")}
    if mode == "none":
        if gpus > 1:
            raise ConfigError(f"trial.gpus={gpus} runs one rank per GPU: give model.parallel=ddp or fsdp (a "
                              "built-in workload trains several ranks only under DDP or FSDP)")
        return out
    return {**out, "parallel": mode, "ranks": gpus}


def is_distributed(cfg: Mapping[str, Any]) -> bool:
    """Whether the workload trains under a data-parallel strategy (``model.parallel`` not none)."""
    return parallel_mode(cfg) != "none"


@contextlib.contextmanager
def meta_rank_scope(cfg: Mapping[str, Any]) -> Iterator[None]:
    """Within the block, a rank of ``cfg``'s mode can be built and trained on meta: for ``fsdp``,
    :func:`oomtune.workloads._meta_fsdp.fsdp_on_meta` (FSDP2 consults its mesh's device module at
    every step, so the block spans the whole capture); nothing for the other modes.

    Raises:
        ConfigError: an unknown ``parallel`` value (:func:`parallel_mode`).
    """
    if parallel_mode(cfg) != "fsdp":
        yield
        return
    from oomtune.workloads._meta_fsdp import fsdp_on_meta

    with fsdp_on_meta():
        yield


def require_process_group(mode: str) -> Any:
    """``torch.distributed`` with its default process group, which ``mode`` needs.

    Raises:
        ConfigError: no process group initialised (the workload was built outside a rank).
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError(f"model.parallel={mode} needs a process group: run it through `oomtune search` or "
                          "`oomtune plan` (trial.gpus=N ranks), which start one per rank")
    return dist


def _shard_units(module: Any) -> list[Any]:
    """The submodules FSDP2 shards separately (each its own all-gather/reduce-scatter group): the
    transformer's layers, ResNet's residual blocks, the MLP's linear layers."""
    from torch import nn

    if hasattr(module, "blocks") and hasattr(module.blocks, "layers"):          # DecoderLM
        return list(module.blocks.layers)
    stages = [getattr(module, f"layer{i}", None) for i in range(1, 5)]           # torchvision ResNet
    if all(isinstance(s, nn.Sequential) for s in stages):
        return [block for stage in stages for block in stage]
    return [m for m in module.modules() if isinstance(m, nn.Linear)]             # MLP


def _reset(module: Any) -> None:
    """Initialise every parameter and buffer of a materialised module again (``to_empty`` leaves
    them uninitialised): each submodule's ``reset_parameters`` (``_reset_parameters`` for
    ``nn.MultiheadAttention``), as their constructors do; BatchNorm's also resets its running stats."""
    import torch

    with torch.no_grad():
        for m in module.modules():
            reset = getattr(m, "reset_parameters", None) or getattr(m, "_reset_parameters", None)
            if callable(reset):
                reset()


def fsdp_model(module: Any, device: Any) -> Any:
    """``module``, built on the meta device, sharded by FSDP2 over the default process group: every
    shard unit and then the root get ``fully_shard``, and the shards are materialised on ``device``
    and initialised (FSDP2's meta-device initialisation, as its documentation recommends: no rank
    ever holds the full model). Returns the same module, its parameters now DTensors. On
    ``device`` meta (a plan's capture under the fake group, within :func:`meta_rank_scope`) the mesh
    is on meta (:func:`oomtune.workloads._meta_fsdp.meta_mesh`); otherwise FSDP2's default mesh.

    Raises:
        ConfigError: no process group (:func:`require_process_group`).
        RuntimeError: ``device`` meta outside :func:`meta_rank_scope`.
    """
    from torch.distributed.fsdp import fully_shard

    dist = require_process_group("fsdp")
    mesh = None      # FSDP2's default: the accelerator's (cuda on a GPU rank, cpu on a CPU rank)
    if _device_type(device) == "meta":
        # a plan's capture of one rank on meta under the fake group (workloads/_meta_fsdp.py)
        from oomtune.workloads._meta_fsdp import meta_mesh

        mesh = meta_mesh(dist.get_world_size())
    for unit in _shard_units(module):
        fully_shard(unit, mesh=mesh)
    fully_shard(module, mesh=mesh)
    module.to_empty(device=device)
    _reset(module)
    return module


def _device_type(device: Any) -> str:
    import torch

    return torch.device(device).type


def wrap_lazily(workload: Any) -> None:
    """Make ``workload`` wrap its model in ``DistributedDataParallel`` at the start of its first step
    (see the module docstring: DDP allocates its buckets when it is constructed). The optimizer
    keeps working: DDP trains the module's own parameters.

    Raises:
        ConfigError: no process group (:func:`require_process_group`).
    """
    require_process_group("ddp")
    workload.pending_wrap = _wrap_ddp


def _wrap_ddp(module: Any, device: Any) -> Any:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from oomtune.workloads._meta_rank import meta_ddp, on_meta_under_fake_group

    ids = [device] if getattr(device, "type", None) == "cuda" else None
    if on_meta_under_fake_group(module):   # a plan's capture of one rank on meta (workloads/_meta_rank.py)
        ddp = meta_ddp(module, device_ids=ids)
    else:
        ddp = DistributedDataParallel(module, device_ids=ids)
    if dist.get_backend() == "fake":
        # The fake group's all-reduce future holds no tensor, which DDP's built-in hook needs
        # (c10d/comm.cpp parseHookResult). Its hook divides the bucket in place and all-reduces it in
        # place (AllReduceCommHook): returning the bucket itself allocates the same (nothing).
        ddp.register_comm_hook(None, _bucket_in_place)
    return ddp


def _bucket_in_place(state, bucket):  # noqa: ANN001, ANN201 - DDP checks these annotations: none given
    """A DDP communication hook for the fake process group: the bucket, reduced in place (a no-op
    without peers), as a completed future."""
    import torch

    future: Any = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


@contextlib.contextmanager
def fake_process_group(world: int, rank: int = 0) -> Iterator[None]:
    """Within the block, the default process group is torch's fake one (``FakeProcessGroup`` with
    ``FakeStore``, world size ``world``, this process rank ``rank``): one process runs what rank
    ``rank`` runs, collectives return at once without data (registered by
    ``torch.testing._internal.distributed.fake_pg``). Nothing happens if a process group exists.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def strategy_notes(mode: str, backend: str | None) -> dict[str, Any]:
    """What a rank's record says about how its memory was obtained under ``mode`` with the process
    group ``backend`` (``gloo``, ``nccl``, ``fake``): what is the program's own, what is modelled
    where the backend differs from NCCL on a GPU, and what is left out."""
    if mode == "none":
        return {}
    notes: dict[str, Any] = {"parallel": mode, "backend": backend}
    if backend == "nccl":
        notes["memory"] = "measured on the device"
        return notes
    common = ("NCCL's own communication buffers (cudaMalloc'd by NCCL, outside the caching allocator) are "
              "not simulated; on a GPU they count as memory outside the allocator")
    if mode == "ddp":
        notes["memory"] = ("the program's own: DDP's gradient buckets and broadcast buffers are allocated in "
                           "DistributedDataParallel(...), recorded since the model is wrapped at the first step; "
                           "all-reduce works in place on the buckets, as with NCCL")
    else:
        notes["memory"] = ("the program's own: sharded parameters, gradients and optimizer states, FSDP2's "
                           "all-gather and reduce-scatter buffers; modelled where "
                           f"{backend} on the CPU differs from NCCL on a GPU: the all-gather buffer in the "
                           "all-gather copy-in stream and the reduce-scatter output in the reduce-scatter stream "
                           "(per-stream pools of the caching allocator, FSDPCommContext in "
                           "torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py)")
    notes["not_modelled"] = common
    return notes
