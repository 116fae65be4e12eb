"""cuBLAS workspaces: caching-allocator requests a CUDA step makes below the Python dispatch level.

Since torch 2.1 the cuBLAS workspace is taken from the caching allocator: ``getCurrentCUDABlasHandle``
(aten/src/ATen/cuda/CublasHandlePool.cpp) calls ``getNewWorkspace()`` =
``CUDACachingAllocator::get()->allocate(getChosenWorkspaceSize())`` the first time a (handle,
stream) pair is used, and keeps it in ``cublas_handle_stream_to_workspace`` for the life of the
process. Handles come from a ``DeviceThreadHandlePool``: one per thread, so the autograd engine's
device thread (which runs the backward of CUDA ops) gets its own workspace, distinct from the one of
the thread running the forward. A meta or CPU capture makes neither request; this module adds them.

Size (``parseChosenWorkspaceSize``): ``CUBLAS_WORKSPACE_CONFIG=":SIZE:COUNT[:SIZE:COUNT...]"`` gives
``sum(SIZE KiB x COUNT)``; unset, the default is ``:4096:2:16:8`` = 8 MiB + 128 KiB, or 32 MiB
(``4096 * 8 * 1024``) on Hopper (compute capability 9.0; torch >= 2.8 also on 10.x and 12.x). The
recordings show both: lm-ctx128-fullstep (H100 class, torch 2.6) allocates two 33,554,432-byte
blocks from ``at::cuda::getNewWorkspace()``, one at the first forward matmul and one at the first
backward matmul; lm-medium-ctx512-training holds two 8,519,680-byte blocks from before recording.
cuBLASLt workspaces (``CUBLASLT_WORKSPACE_SIZE``) are not modelled: no recording shows one.
"""

from __future__ import annotations

import os
import re
import threading
from typing import Any

import torch

__all__ = ["BLAS_OPS", "DEFAULT_WORKSPACE_BYTES", "HOPPER_WORKSPACE_BYTES", "BlasWorkspaces",
           "cublas_workspace_bytes", "cuda_run_workspaces"]

#: ``4096 * 1024 * 2 + 16 * 1024 * 8``: the default ``:4096:2:16:8``.
DEFAULT_WORKSPACE_BYTES = 4096 * 1024 * 2 + 16 * 1024 * 8
#: ``4096 * 8 * 1024``: the default on compute capability 9.x (and 10.x/12.x in newer torch).
HOPPER_WORKSPACE_BYTES = 4096 * 8 * 1024

#: ATen ops whose CUDA kernels call cuBLAS (gemm/gemv/dot through at::cuda::blas), by packet name.
BLAS_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "addr", "dot", "vdot",
                      "_addmm_activation", "_scaled_mm", "_int_mm"})

_PAIR = re.compile(r":([0-9]+):([0-9]+)")


def cublas_workspace_bytes(compute_capability: tuple[int, int] | None = None,
                           config: str | None = None) -> int:
    """The size of one cuBLAS workspace in bytes (``parseChosenWorkspaceSize``).

    Args:
        compute_capability: the target GPU's ``(major, minor)``; ``None`` (unknown) takes the larger
            default, 32 MiB (over-predicting by at most 24 MiB per workspace rather than under).
        config: ``CUBLAS_WORKSPACE_CONFIG``; ``None`` reads the environment variable. A value with no
            ``:SIZE:COUNT`` pair falls back to the default, as torch does (with a warning there).
    """
    if config is None:
        config = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if config:
        pairs = _PAIR.findall(config)
        if pairs:
            return sum(int(size) * 1024 * int(count) for size, count in pairs)
    if compute_capability is None or compute_capability[0] in (9, 10, 12):
        return HOPPER_WORKSPACE_BYTES
    return DEFAULT_WORKSPACE_BYTES


def handle_key() -> str:
    """Which cuBLAS handle the current op would use: ``"backward"`` inside the autograd engine
    (``torch._C._current_autograd_node()`` is set: on CUDA that work runs on the device thread),
    else ``"thread-<ident>"`` of the calling thread."""
    if torch._C._current_autograd_node() is not None:
        return "backward"
    return f"thread-{threading.get_ident()}"


class BlasWorkspaces:
    """Which cuBLAS workspaces exist, and the request the next BLAS op would add.

    Args:
        size_bytes: one workspace (:func:`cublas_workspace_bytes`).
        existing: handle keys whose workspace exists before the capture starts (e.g. ``("forward",
            "backward")`` for a steady-state step: both were created by an earlier step). The key
            ``"forward"`` stands for the thread that enters the capture.
    """

    def __init__(self, size_bytes: int, existing: tuple[str, ...] = ()) -> None:
        if size_bytes <= 0:
            raise ValueError(f"size_bytes must be > 0, got {size_bytes}")
        self.size_bytes = size_bytes
        self._forward = f"thread-{threading.get_ident()}"
        self._have = {self._forward if k == "forward" else k for k in existing}
        self.n_existing = len(self._have)

    def needs_workspace(self, func: Any) -> bool:
        """True once per handle: ``func`` (an OpOverload) is a BLAS op on a handle without one yet.
        Marks the handle as served."""
        if func.overloadpacket.__name__ not in BLAS_OPS:
            return False
        key = handle_key()
        if key in self._have:
            return False
        self._have.add(key)
        return True


def cuda_run_workspaces(gpu: Any = None, config: str | None = None) -> BlasWorkspaces | None:
    """The cuBLAS workspaces a CUDA training process on ``gpu`` takes from the caching allocator, for
    a capture or a virtual GPU standing for that process: the main thread's, counted as existing once
    what exists before the step is registered (a trial creates it before measuring; a training script
    at its first forward matmul, before that step's activations), and the autograd device thread's at
    the first backward BLAS op. One workspace is :func:`cublas_workspace_bytes` of ``gpu``'s compute
    capability (8 MiB + 128 KiB on an A100, 32 MiB on an H100).

    Args:
        gpu: a :class:`~oomtune.capture.gpu_target.GpuTarget`, a ``model.gpu`` value, or None (the
            default target, :data:`~oomtune.capture.gpu_target.DEFAULT_GPU`).
        config: ``CUBLAS_WORKSPACE_CONFIG``; None reads the environment variable.

    Returns:
        None where the workspace size is 0 (``CUBLAS_WORKSPACE_CONFIG=:0:0``): torch's
        ``getNewWorkspace`` then asks the allocator for 0 bytes, which allocates nothing
        (``NativeCachingAllocator::allocate`` mallocs only when ``size != 0``).

    Raises:
        ConfigError: ``gpu`` names no GPU (:func:`oomtune.capture.gpu_target.gpu_of`).
    """
    from oomtune.capture.gpu_target import GpuTarget, gpu_of

    target = gpu if isinstance(gpu, GpuTarget) else gpu_of(gpu)
    size = cublas_workspace_bytes(target.capability, config)
    return BlasWorkspaces(size, existing=("forward",)) if size > 0 else None
