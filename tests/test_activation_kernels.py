"""The activations a capture runs as CUDA does: what each forward keeps, what each backward allocates.

CUDA runs every activation's forward and backward as one TensorIterator kernel
(aten/src/ATen/native/Activation.cpp, aten/src/ATen/native/cuda/Activation*.cu): the forward makes
the output, the backward makes only ``grad_input``. What autograd saves comes from
tools/autograd/derivatives.yaml (the input ``self`` for mish, gelu, silu, softplus, hardswish,
hardsigmoid, elu/selu/celu, leaky_relu, prelu; the ``result`` for tanh, sigmoid, relu): a tensor the
step already holds, so nothing new. Input (2, 4, 8, 8) fp32: N = 512 elements, 2,048 bytes.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from oomtune.capture.cuda_kernels import emulate_cuda
from oomtune.capture.recorder import StorageRecorder, StreamSink

N_BYTES = 2 * 4 * 8 * 8 * 4

ACTIVATIONS = {
    "mish": nn.Mish, "gelu": nn.GELU, "gelu_tanh": lambda: nn.GELU(approximate="tanh"), "silu": nn.SiLU,
    "softplus": nn.Softplus, "hardswish": nn.Hardswish, "hardsigmoid": nn.Hardsigmoid, "elu": nn.ELU,
    "selu": nn.SELU, "celu": nn.CELU, "leaky_relu": nn.LeakyReLU, "tanh": nn.Tanh, "sigmoid": nn.Sigmoid,
    "relu": nn.ReLU,
}


def _record(fn, existing, device):
    """(sizes of the storages ``fn`` creates, bytes of those still alive after it, its result)."""
    sink = StreamSink()
    rec = StorageRecorder(sink, device=device)
    rec.register_existing(existing)
    start, n = sink.live_bytes, len(sink.events)
    with rec:
        out = fn()
    return [s for a, _, s, _ in sink.events[n:] if a == "alloc"], sink.live_bytes - start, out


def _forward_backward(module, device):
    x = torch.randn(2, 4, 8, 8, device=device, requires_grad=True) if device == "cpu" else \
        torch.empty(2, 4, 8, 8, device=device, requires_grad=True)
    params = list(module.parameters())
    with emulate_cuda("a100"):
        fwd, live, y = _record(lambda: module(x), [x, *params], device)
        g = torch.ones_like(y)
        bwd, _, _ = _record(lambda: torch.autograd.grad(y, [x, *params], g), [x, *params, y, g], device)
    return fwd, live, bwd, y


@pytest.mark.parametrize("device", ["meta", "cpu"])
@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_activation_keeps_its_output_and_its_backward_makes_one_grad_input(name, device):
    """Forward: one new storage, the output (N x 4 bytes), and nothing else alive (the saved tensor
    is the input or the output). Backward: exactly one request, grad_input (N x 4), as CUDA's fused
    backward kernel (for Mish, ``mish_backward`` in Activation.cpp: one
    ``TensorIterator::binary_op``; meta's decomposition made nine input-sized tensors)."""
    fwd, live, bwd, _ = _forward_backward(ACTIVATIONS[name](), device)
    assert fwd == [N_BYTES] and live == N_BYTES
    assert bwd == [N_BYTES]


def test_mish_backward_on_meta_was_the_decomposition():
    """Without the emulation meta runs ``math_mish_backward`` (Activation.cpp, CompositeImplicitAutograd):
    softplus, tanh, sigmoid, input * sigmoid, t * t, 1 - t*t, their product, t + product and
    grad * sum: nine input-sized requests where CUDA makes one. This is the difference the emulation
    removes (GPUMemNet's Mish rows: 32.4 -> 16.1 GiB with a fused stand-in)."""
    x = torch.empty(2, 4, 8, 8, device="meta", requires_grad=True)
    y = nn.Mish()(x)
    g = torch.empty_like(y)
    bwd, _, _ = _record(lambda: torch.autograd.grad(y, x, g, retain_graph=True), [x, y, g], "meta")
    assert bwd == [N_BYTES] * 9
    with emulate_cuda("a100"):
        assert _record(lambda: torch.autograd.grad(y, x, g, retain_graph=True), [x, y, g], "meta")[0] == [N_BYTES]
    assert _record(lambda: torch.autograd.grad(y, x, g, retain_graph=True), [x, y, g], "meta")[0] == bwd   # removed on exit


#: What derivatives.yaml saves for each activation's backward: the input ``self`` or the ``result``.
SAVED = {"tanh": "result", "sigmoid": "result", "relu": "result"}


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_activation_saves_what_derivatives_yaml_names(name):
    """derivatives.yaml: tanh, sigmoid and relu save ``result`` (the output itself); every other
    activation here saves ``self`` (selu through elu's entry, celu its own). Either is a tensor the
    step holds anyway: the forward keeps no new storage besides its output."""
    x = torch.randn(2, 4, 8, 8, requires_grad=True)
    with emulate_cuda("a100"):
        y = ACTIVATIONS[name]()(x)
    which = SAVED.get(name, "self")
    saved = getattr(y.grad_fn, f"_saved_{which}")
    assert saved.data_ptr() == (y if which == "result" else x).data_ptr() and saved.shape == x.shape


def test_mish_backward_in_bfloat16_makes_a_bfloat16_grad_input():
    """A bf16 Mish (e.g. after a conv under autocast): CUDA's ``mish_backward`` output has the
    promoted dtype of (grad, input), bf16: N x 2 = 1,024 bytes."""
    x = torch.empty(2, 4, 8, 8, device="meta", dtype=torch.bfloat16, requires_grad=True)
    y = nn.Mish()(x)
    g = torch.empty_like(y)
    with emulate_cuda("a100"):
        sizes, _, (gx,) = _record(lambda: torch.autograd.grad(y, x, g), [x, y, g], "meta")
    assert sizes == [N_BYTES // 2] and gx.dtype == torch.bfloat16


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_prelu_backward_makes_an_input_sized_weight_gradient(device):
    """``_prelu_kernel_backward`` (Activation.cpp) is one TensorIterator with two outputs of the
    broadcast (input) shape: grad_input and grad_weight, N x 4 each; autograd then sums grad_weight
    to the weight's shape (4 channels x 4 bytes = 16). Forward: the output only."""
    fwd, live, bwd, _ = _forward_backward(nn.PReLU(4, device=device), device)
    assert fwd == [N_BYTES] and live == N_BYTES
    assert bwd == [N_BYTES, N_BYTES, 16]


def test_mish_gradient_on_the_cpu_is_unchanged():
    torch.manual_seed(0)
    x = torch.randn(64, requires_grad=True)
    ref = torch.autograd.grad(nn.functional.mish(x).sum(), x)[0]
    with emulate_cuda("a100"):
        got = torch.autograd.grad(nn.functional.mish(x).sum(), x)[0]
    assert torch.allclose(got, ref)
