"""Dropout as CUDA runs it: the fused kernel, whose mask is one byte per element.

``aten::dropout`` (CompositeImplicitAutograd, aten/src/ATen/native/Dropout.cpp) calls
``native_dropout`` only when ``is_fused_kernel_acceptable``: the input is on CUDA (or XPU, lazy,
privateuse1), 0 < p < 1 and it has elements. ``native_dropout`` returns the output and a bool mask
(``native_dropout_cuda``: ``mask`` of ``kBool``), and autograd saves that mask
(``native_dropout: result1`` in tools/autograd/derivatives.yaml): 1 byte per element. On meta and
CPU the composite takes ``_dropout_impl``: ``noise = empty_like(input).bernoulli_(1 - p)`` in the
input's dtype, divided by 1 - p, and ``input * noise`` saves the noise: 2 or 4 bytes per element.
While a capture emulates a GPU, :func:`_dropout` (registered at AutogradMeta/AutogradCPU) takes the
CUDA branch; every other case runs the composite unchanged. ``dropout_`` (in place) and the feature
dropouts never use the fused kernel, on CUDA either, and are left alone.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["install"]

_aten = torch.ops.aten


def _dropout(input: torch.Tensor, p: float, train: bool) -> torch.Tensor:  # noqa: A002 - the schema's name
    """``aten::dropout`` with CUDA's ``is_fused_kernel_acceptable`` branch for meta/CPU tensors."""
    if train and 0.0 < p < 1.0 and input.numel() > 0:
        return _aten.native_dropout.default(input, p, train)[0]
    return _aten.dropout.default.decompose(input, p, train)


def install(lib: Any) -> None:
    """Register :func:`_dropout` at AutogradMeta and AutogradCPU on ``lib`` (an ``aten`` IMPL library)."""
    for key in ("AutogradMeta", "AutogradCPU"):
        lib.impl("dropout", _dropout, key)
