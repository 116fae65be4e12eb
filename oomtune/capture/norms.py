"""Normalisations as CUDA runs them: the scratch tensors of group norm's backward.

The audit (docs/kernel_audit.md) found the outputs and saved statistics of batch, layer, group,
instance and RMS norm the same on meta, CPU and CUDA (RMS norm's fused kernel:
:mod:`oomtune.capture.rms_norm`). One CUDA kernel allocates more inside the call:
``native_group_norm_backward`` (aten/src/ATen/native/cuda/group_norm_kernel.cu,
``GroupNormBackwardKernelImplInternal``) makes ``ds`` and ``db``, (N, C) each in the accumulation
type (fp32 for half/bfloat16 inputs, else the input's dtype); when grad_input is asked for (and
H x W > 1) also ``c2`` and ``c3``, (N, G), and with a weight ``c1``, the (N, G, D) = (N, C) product
``rstd * gamma``. All are freed when the kernel returns; :func:`transient_requests` adds them, on
meta and CPU alike (the CPU kernel's own buffers are not recorded). For H x W = 1 only ``ds`` and
``db`` are modelled (``GroupNorm1dBackward``'s own temporaries are not).

Not modelled: the CUDA layer norm backward's partial gamma/beta buffers, batch norm's cuDNN
reserve space and workspace (docs/kernel_audit.md).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["transient_requests"]

_aten = torch.ops.aten


def _acc_itemsize(dtype: torch.dtype) -> int:
    return 4 if dtype in (torch.float16, torch.bfloat16) else dtype.itemsize


def _group_norm_backward(args: tuple, kwargs: dict) -> list[int]:
    names = ("grad_out", "input", "mean", "rstd", "weight", "N", "C", "HxW", "group", "output_mask")
    got = dict(zip(names, args)) | kwargs
    n, c, hxw, g = (int(got[k]) for k in ("N", "C", "HxW", "group"))
    if n == 0:
        return []
    acc = _acc_itemsize(got["input"].dtype)
    sizes = [n * c * acc, n * c * acc]                         # ds, db
    if hxw > 1 and got["output_mask"][0]:
        sizes += [n * g * acc, n * g * acc]                    # c2, c3
        if got.get("weight") is not None:
            sizes.append(n * c * acc)                          # c1 = rstd (N, G, 1) * gamma (1, G, D)
    return sizes


_TRANSIENTS = {_aten.native_group_norm_backward.default: _group_norm_backward}


def transient_requests(func: Any, args: tuple, kwargs: dict) -> list[int]:
    """Bytes of each scratch tensor the CUDA kernel of ``func`` allocates and frees inside the call
    (see the module docstring), in allocation order; [] for other ops."""
    fn = _TRANSIENTS.get(func)
    return [] if fn is None else [s for s in fn(args, kwargs) if s > 0]
