"""RMS norm as CUDA runs it: the fused kernel, which saves the input and an fp32 rstd.

``F.rms_norm`` / ``nn.RMSNorm`` call ``aten::rms_norm``, which calls ``_fused_rms_norm`` for
contiguous real inputs whose weight has the input's dtype (``rms_norm_symint``,
aten/src/ATen/native/layer_norm.cpp). ``_fused_rms_norm`` has a CUDA kernel and a derivative
(``_fused_rms_norm: input, weight: _fused_rms_norm_backward(grad, input, normalized_shape, result1,
weight, grad_input_mask)`` in tools/autograd/derivatives.yaml), so on CUDA autograd saves the input,
the weight and ``rstd`` (the input's leading shape, 1 per normalized dimension, fp32 for
half/bfloat16/float inputs). It has no CPU or Meta kernel: there its CompositeImplicitAutograd
kernel (``rms_norm_composite``) runs instead, and autograd saves the fp32 upcast of the input and
the fp32 product, two full-size fp32 tensors. While a capture emulates a GPU, :func:`install`
registers Meta and CPU kernels for ``_fused_rms_norm`` (and a CPU kernel for its backward, whose
Meta kernel torch has), so the dispatcher uses the derivative there too, as on CUDA.

Not modelled: the CUDA backward's partial weight-gradient buffers (fp32, one row per thread block).
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["install"]


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _dims(input: torch.Tensor, normalized_shape: list[int]) -> list[int]:  # noqa: A002
    return list(range(input.dim() - len(normalized_shape), input.dim()))


def _meta_fused(input, normalized_shape, weight=None, eps=None):  # noqa: A002, ANN001, ANN201
    stat = list(input.shape[: input.dim() - len(normalized_shape)]) + [1] * len(normalized_shape)
    return (torch.empty(input.shape, dtype=input.dtype, device=input.device),
            torch.empty(stat, dtype=_acc(input.dtype), device=input.device))


def _cpu_fused(input, normalized_shape, weight=None, eps=None):  # noqa: A002, ANN001, ANN201
    x = input.to(_acc(input.dtype))
    e = eps if eps is not None else torch.finfo(input.dtype).eps
    rstd = torch.rsqrt(x.pow(2).mean(_dims(input, normalized_shape), keepdim=True) + e)
    y = x * rstd
    if weight is not None:
        y = y * weight
    out = torch.empty(input.shape, dtype=input.dtype)
    out.copy_(y)
    return out, rstd.contiguous()


def _cpu_fused_backward(grad_out, input, normalized_shape, rstd, weight, output_mask):  # noqa: A002, ANN001, ANN201
    dims = _dims(input, normalized_shape)
    x = input.to(rstd.dtype)
    g = grad_out.to(rstd.dtype)
    xhat = x * rstd
    gw = g * weight if weight is not None else g
    n = math.prod(normalized_shape)
    grad_input = None
    if output_mask[0]:
        dx = rstd * (gw - xhat * (gw * xhat).sum(dims, keepdim=True) / n)
        grad_input = torch.empty(input.shape, dtype=input.dtype)
        grad_input.copy_(dx)
    grad_weight = None
    if output_mask[1] and weight is not None:
        lead = list(range(input.dim() - len(normalized_shape)))
        grad_weight = torch.empty(weight.shape, dtype=weight.dtype)
        grad_weight.copy_((g * xhat).sum(lead) if lead else g * xhat)
    return grad_input, grad_weight


def install(lib: Any) -> None:
    """Register the kernels the installed torch lacks on ``lib`` (an ``aten`` IMPL library)."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    if not has("aten::_fused_rms_norm", "Meta"):
        # Library.impl refuses Meta kernels for ops with a CompositeImplicitAutograd kernel (torch's
        # own policy: let them decompose); the decomposition is exactly what CUDA does not run, so
        # register through the C++ library handle, which the Library's destruction also removes.
        lib.m.impl("_fused_rms_norm", "Meta", _meta_fused, False)
    if not has("aten::_fused_rms_norm", "CPU"):
        lib.impl("_fused_rms_norm", _cpu_fused, "CPU")
    if not has("aten::_fused_rms_norm_backward", "CPU"):
        lib.impl("_fused_rms_norm_backward", _cpu_fused_backward, "CPU")
