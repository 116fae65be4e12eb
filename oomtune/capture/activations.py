"""Activations as CUDA runs them: every backward one fused kernel that makes only ``grad_input``.

The audit (docs/kernel_audit.md) ran every activation torch.nn offers on meta and CPU tensors and
compared what the capture records with CUDA's kernels (aten/src/ATen/native/Activation.cpp,
aten/src/ATen/native/cuda/Activation*.cu) and ``tools/autograd/derivatives.yaml``. One differs:
``mish_backward``. Its CPU and CUDA kernels (``mish_backward`` in Activation.cpp) build one
``TensorIterator::binary_op(grad_input, grad_output, input)``: one new tensor of the input's size.
It has no Meta kernel, so on meta the dispatcher falls back to its CompositeImplicitAutograd kernel
(``math_mish_backward``), which computes ``softplus``, ``tanh``, ``sigmoid`` and six sums and
products: nine input-sized tensors where CUDA makes one (GPUMemNet's Mish CNNs were predicted up
to 60% over on an A100). ``mish``'s derivative (``self: GradMode::is_enabled() ?
infinitely_differentiable_mish_backward(grad, self) : mish_backward(grad, self)``) saves the input
only, on every device; the composite path stays for double backward, as on CUDA.

While a capture emulates a GPU, :func:`install` registers a Meta kernel for ``mish_backward`` that
returns what the CUDA kernel returns (the CPU kernel already does). Every other activation (GELU
with both approximations, SiLU, softplus, hardswish, hardsigmoid, ELU/SELU/CELU, LeakyReLU, PReLU,
tanh, sigmoid, ReLU) has Meta kernels that allocate what CUDA's do: tests/test_activation_kernels.py
pins each one's bytes.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["install"]


def _meta_mish_backward(grad_output: torch.Tensor, input: torch.Tensor) -> torch.Tensor:  # noqa: A002
    """``grad_input`` of ``TensorIterator::binary_op(grad_input, grad_output, input)``: the broadcast
    shape, the promoted dtype, the input's layout where the shapes agree (bytes: numel x itemsize)."""
    dtype = torch.result_type(grad_output, input)
    if grad_output.shape == input.shape:
        return torch.empty_like(input, dtype=dtype)
    shape = torch.broadcast_shapes(grad_output.shape, input.shape)
    return torch.empty(shape, dtype=dtype, device=input.device)


def install(lib: Any) -> None:
    """Register the Meta kernel of ``mish_backward`` on ``lib`` (an ``aten`` IMPL library) if the
    installed torch lacks one."""
    if not torch._C._dispatch_has_kernel_for_dispatch_key("aten::mish_backward", "Meta"):
        # Library.impl refuses Meta kernels for ops with a CompositeImplicitAutograd kernel; register
        # through the C++ handle, which the Library's destruction also removes (as rms_norm does).
        lib.m.impl("mish_backward", "Meta", _meta_mish_backward, False)
