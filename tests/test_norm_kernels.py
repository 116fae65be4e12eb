"""The normalisations a capture runs as CUDA does: outputs, saved statistics, backward outputs.

Input (2, 4, 8, 8) fp32 (N = 512 elements, 2,048 bytes), 4 channels; expected bytes from torch's
CUDA kernels (aten/src/ATen/native/cuda/Normalization.cu, layer_norm_kernel.cu,
group_norm_kernel.cu, cudnn/BatchNorm.cpp; aten/src/ATen/native/layer_norm.cpp) and
tools/autograd/derivatives.yaml. Each test runs forward and backward in one recording so the saved
tensors are the forward's own storages; the incoming gradient exists before.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from kernel_step import step  # noqa: E402

X_BYTES = 2 * 4 * 8 * 8 * 4


def _x(device):
    return (torch.randn(2, 4, 8, 8) if device == "cpu" else torch.empty(2, 4, 8, 8, device=device)).requires_grad_()


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_batch_norm_training_keeps_output_and_two_fp32_statistics(device):
    """Training: CUDA's cudnn_batch_norm (or batch_norm_cuda) returns the output (2,048) and
    save_mean / save_var (or save_invstd), C = 4 fp32 each (16 + 16), all kept (derivatives.yaml
    saves result1, result2). Backward: grad_input (2,048), grad_weight and grad_bias (16 + 16). The
    cuDNN reserve space is 0 bytes in torch's own cudnn_batch_norm meta kernel (not modelled)."""
    bn = nn.BatchNorm2d(4, device=device)
    assert step(bn, _x(device), device, (2, 4, 8, 8)) == ([X_BYTES, 16, 16], X_BYTES + 32, [X_BYTES, 16, 16])


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_layer_norm_keeps_fp32_mean_and_rstd_per_row(device):
    """LayerNorm(8) over the last dimension: M = 2 x 4 x 8 = 64 rows. layer_norm_cuda: output
    (2,048), mean and rstd of shape (2, 4, 8, 1) in the accumulation type (64 x 4 = 256 each), all
    saved. Backward (layer_norm_backward_cuda): grad_input (2,048), grad_weight and grad_bias (8 x 4
    = 32 each)."""
    ln = nn.LayerNorm(8, device=device)
    assert step(ln, _x(device), device, (2, 4, 8, 8)) == ([X_BYTES, 256, 256], X_BYTES + 512, [X_BYTES, 32, 32])


@pytest.mark.parametrize("device", ["meta", "cpu"])
@pytest.mark.parametrize("affine", [True, False])
def test_group_norm_keeps_mean_and_rstd_per_group_and_its_backward_makes_scratch(affine, device):
    """GroupNorm(2 groups, 4 channels): native_group_norm returns the output (2,048) and mean, rstd
    of shape (N, G) = (2, 2) fp32 (16 each), saved. Backward: grad_input (2,048), grad_weight and
    grad_bias (4 x 4 = 16 each) with affine; then the CUDA kernel's scratch
    (group_norm_kernel.cu, GroupNormBackwardKernelImplInternal), freed inside: ds, db (N, C) fp32
    (32 each), c2, c3 (N, G) (16 each) and, with a weight, c1 = rstd x gamma (N, C) (32). Before,
    the capture recorded no scratch."""
    gn = nn.GroupNorm(2, 4, affine=affine, device=device)
    grads = [X_BYTES, 16, 16] if affine else [X_BYTES]
    scratch = [32, 32, 16, 16] + ([32] if affine else [])
    assert step(gn, _x(device), device, (2, 4, 8, 8)) == ([X_BYTES, 16, 16], X_BYTES + 32, grads + scratch)


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_instance_norm_is_batch_norm_over_batch_times_channels(device):
    """instance_norm (Normalization.cpp, CompositeImplicitAutograd on every device): weight and bias
    repeated B = 2 times (8 x 4 = 32 each), the input viewed as (1, 8, 8, 8), batch_norm: output
    (2,048) and 8 fp32 statistics twice (32 + 32). Kept: all but the repeated bias (batch norm's
    derivative saves the weight, not the bias). Backward: grad_input (2,048), the repeated weight's
    and bias's gradients (32 + 32), summed back to 4 channels (16 + 16)."""
    inorm = nn.InstanceNorm2d(4, affine=True, device=device)
    assert step(inorm, _x(device), device, (2, 4, 8, 8)) == (
        [32, 32, X_BYTES, 32, 32], 32 + X_BYTES + 32 + 32, [X_BYTES, 32, 32, 16, 16])


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_rms_norm_keeps_the_output_and_fp32_rstd(device):
    """RMSNorm(8): _fused_rms_norm (oomtune/capture/rms_norm.py) returns the output (2,048) and
    rstd (2, 4, 8, 1) fp32 (256), saved with the input. Backward (_fused_rms_norm_backward):
    grad_input (2,048) and grad_weight (32)."""
    rms = nn.RMSNorm(8, device=device)
    assert step(rms, _x(device), device, (2, 4, 8, 8)) == ([X_BYTES, 256], X_BYTES + 256, [X_BYTES, 32])
