"""Pooling, upsampling, embedding and transposed convolution as CUDA runs them: what each forward
keeps and what each backward allocates.

Input (2, 4, 8, 8) fp32 (2,048 bytes); expected bytes from torch's CUDA kernels
(aten/src/ATen/native/cuda/DilatedMaxPool2d.cu, AveragePool2d.cu, AdaptiveAveragePooling.cu,
AdaptiveMaxPooling2d.cu, UpSampleNearest2d.cu, UpSampleBilinear2d.cu, Embedding.cu; the
CompositeImplicitAutograd adaptive_avg_pool2d in AdaptiveAveragePooling.cpp) and
tools/autograd/derivatives.yaml. Forward and backward run in one recording (``step``); the incoming
gradient exists before.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from oomtune.capture.cuda_kernels import emulate_cuda
from oomtune.capture.recorder import StorageRecorder, StreamSink

sys.path.insert(0, str(Path(__file__).parent))
from kernel_step import step  # noqa: E402

X_BYTES = 2 * 4 * 8 * 8 * 4

POOLED = 2 * 4 * 4 * 4 * 4      # (2, 4, 4, 4) fp32: 512
ADAPT3 = 2 * 4 * 3 * 3          # (2, 4, 3, 3): 72 elements


def _x(device):
    return (torch.randn(2, 4, 8, 8) if device == "cpu" else torch.empty(2, 4, 8, 8, device=device)).requires_grad_()


CASES = {
    # max_pool2d_with_indices: output (512) and int64 indices (128 x 8 = 1,024), both kept (the
    # backward takes result1); backward: grad_input, zeros of the input (2,048)
    "max_pool2d": (lambda d: nn.MaxPool2d(2), (2, 4, 4, 4), [POOLED, 1024], POOLED + 1024, [X_BYTES]),
    # avg_pool2d saves only the input: output (512); backward grad_input (2,048)
    "avg_pool2d": (lambda d: nn.AvgPool2d(2), (2, 4, 4, 4), [POOLED], POOLED, [X_BYTES]),
    # output size 1: mean over (H, W) with keepdim on every device (2 x 4 x 4 = 32); its backward
    # expands the gradient (a view) and divides: 2,048
    "adaptive_avg_pool2d_1": (lambda d: nn.AdaptiveAvgPool2d(1), (2, 4, 1, 1), [32], 32, [X_BYTES]),
    # _adaptive_avg_pool2d: output 72 x 4 = 288; backward grad_input 2,048
    "adaptive_avg_pool2d_3": (lambda d: nn.AdaptiveAvgPool2d(3), (2, 4, 3, 3), [ADAPT3 * 4], ADAPT3 * 4,
                              [X_BYTES]),
    # adaptive_max_pool2d: output (288) and int64 indices (576), kept; backward grad_input 2,048
    "adaptive_max_pool2d_3": (lambda d: nn.AdaptiveMaxPool2d(3), (2, 4, 3, 3), [ADAPT3 * 4, ADAPT3 * 8],
                              ADAPT3 * 12, [X_BYTES]),
    # upsample x2: output (2, 4, 16, 16) fp32 = 8,192, nothing else saved (the input's sizes only);
    # backward: grad_input of the input's size, 2,048
    "upsample_nearest2d": (lambda d: nn.Upsample(scale_factor=2), (2, 4, 16, 16), [4 * X_BYTES], 4 * X_BYTES,
                           [X_BYTES]),
    "upsample_bilinear2d": (lambda d: nn.Upsample(scale_factor=2, mode="bilinear"), (2, 4, 16, 16),
                            [4 * X_BYTES], 4 * X_BYTES, [X_BYTES]),
    # conv_transpose2d(4 -> 4, 3 x 3, stride 2): H' = (8 - 1) x 2 + 3 = 17, output 2 x 4 x 17 x 17 x 4
    # = 9,248; backward: grad_input 2,048, grad_weight 4 x 4 x 3 x 3 x 4 = 576, grad_bias 16 (cuDNN's
    # workspace is not modelled)
    "conv_transpose2d": (lambda d: nn.ConvTranspose2d(4, 4, 3, stride=2, device=d), (2, 4, 17, 17),
                         [9248], 9248, [X_BYTES, 576, 16]),
}


@pytest.mark.parametrize("device", ["meta", "cpu"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_layer_keeps_and_allocates_as_cuda(name, device):
    make, out_shape, fwd, live, bwd = CASES[name]
    assert step(make(device), _x(device), device, out_shape) == (fwd, live, bwd)


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_embedding_backward_makes_a_dense_weight_gradient(device):
    """Embedding(100, 8) on 16 int64 ids: output 16 x 8 x 4 = 512 (the saved ids exist before).
    embedding_dense_backward: grad_weight 100 x 8 x 4 = 3,200. Not modelled: the CUDA kernel's sort
    buffers and per-segment partial sums, freed before it returns (their size depends on the ids)."""
    emb = nn.Embedding(100, 8, device=device)
    ids = torch.zeros(16, dtype=torch.int64, device=device)
    g = torch.ones(16, 8, device=device)
    sink = StreamSink()
    rec = StorageRecorder(sink, device=device)
    rec.register_existing([emb.weight, ids, g])
    n = len(sink.events)
    with emulate_cuda("a100"), rec:
        y = emb(ids)
        m = len(sink.events)
        torch.autograd.grad(y, emb.weight, g)
    sizes = [[s for a, _, s, _ in part if a == "alloc"] for part in (sink.events[n:m], sink.events[m:])]
    assert sizes == [[512], [3200]]
