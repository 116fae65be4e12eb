"""CUDA autocast policy on meta/CPU captures, and cuBLAS workspaces.

Expected sizes are hand-computed from shapes and dtypes; policies come from autocast_mode.h
(AT_FORALL_LOWER_PRECISION_FP / FP32 / FP32_SET_OPT_DTYPE) and the cache rule of ``cached_cast``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from oomtune.capture.blas_workspace import (
    DEFAULT_WORKSPACE_BYTES,
    HOPPER_WORKSPACE_BYTES,
    BlasWorkspaces,
    cublas_workspace_bytes,
)
from oomtune.capture.cuda_autocast import cuda_autocast, emulate_cuda_autocast, policy_of
from oomtune.capture.recorder import capture_stream

BF16 = torch.bfloat16


def _allocs(stream) -> list[int]:
    return [size for action, _, size, _ in stream if action == "alloc"]


def test_op_lists_follow_cuda_not_cpu():
    # exp, pow and sum are CUDA fp32 / fp32_set_opt_dtype ops; CPU autocast runs them in bf16
    for name in ("exp", "pow", "__pow__", "log", "layer_norm", "mse_loss", "cross_entropy"):
        assert policy_of(getattr(torch, name, None) or getattr(torch.Tensor, name, None)
                         or getattr(F, name)) == "fp32", name
    for fn in (torch.softmax, F.log_softmax, torch.sum, torch.cumsum, torch.linalg.vector_norm):
        assert policy_of(fn) == "fp32_set_opt_dtype"
    for fn in (torch.matmul, torch.Tensor.__matmul__, F.linear, torch.einsum, torch.bmm, torch.baddbmm,
               F.conv2d, F.scaled_dot_product_attention):
        assert policy_of(fn) == "lower"
    assert policy_of(torch.addcmul) == "promote" and policy_of(torch.relu) is None
    x = torch.randn(4, 4)
    with torch.autocast("cpu", dtype=BF16):
        cpu_exp = torch.mm(x, x).exp().dtype
    with cuda_autocast(BF16):
        y = torch.mm(x, x)
        assert y.dtype == BF16
        assert y.exp().dtype == torch.float32 and cpu_exp == BF16
        assert torch.softmax(y, -1).dtype == torch.float32 and y.sum().dtype == torch.float32
        assert (y + 1).dtype == BF16                                     # in no list: unchanged
        assert torch.addcmul(y, y, x).dtype == torch.float32             # promote: widest
        assert torch.mm(x.double(), x.double()).dtype == torch.float64   # double is never cast


def test_weight_casts_are_cached_within_a_region_and_saved_for_backward():
    """Two linears on the same weight: one bf16 copy of the weight (leaf, requires grad), two casts of
    the input (no grad: not cached). Sizes: x 8x16 -> bf16 256 B; W 32x16 -> bf16 1,024 B; out
    8x32 bf16 512 B."""
    w = torch.nn.Parameter(torch.empty(32, 16, device="meta"))
    x = torch.empty(8, 16, device="meta")

    def step() -> None:
        with cuda_autocast(BF16):
            a = F.linear(x, w)
            b = F.linear(x, w)
        assert a.dtype == b.dtype == BF16

    s = capture_stream(step, existing=[w, x], device="meta")
    assert _allocs(s) == [32 * 16 * 4, 8 * 16 * 4,      # registered: W fp32, x fp32
                          256, 1024, 512,               # x cast, W cast (cached), out
                          256, 512]                     # x cast again, out (W from the cache)


def test_cache_is_cleared_when_the_outermost_region_exits():
    w = torch.nn.Parameter(torch.empty(32, 16, device="meta"))
    x = torch.empty(8, 16, device="meta")

    def step() -> None:
        for _ in range(2):
            with cuda_autocast(BF16):
                with cuda_autocast(BF16):   # nested: the cache lives until the outer one exits
                    F.linear(x, w)
                F.linear(x, w)

    s = capture_stream(step, existing=[w, x], device="meta")
    # per outer region: x cast 256, W cast 1024, out 512, x cast 256, out 512
    assert _allocs(s)[2:] == [256, 1024, 512, 256, 512] * 2


def test_users_torch_autocast_cuda_is_emulated_without_a_gpu():
    lin = torch.nn.Linear(16, 16, device="meta")
    x = torch.empty(4, 16, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # torch would warn "CUDA is not available ... Disabling"
        with emulate_cuda_autocast():
            with torch.autocast("cuda", dtype=BF16):
                assert lin(x).dtype == BF16
                with torch.autocast("cuda", enabled=False):
                    assert lin(x).dtype == torch.float32
                assert lin(x).dtype == BF16
            with torch.autocast("cuda"):                  # CUDA's default dtype: fp16
                assert lin(x).dtype == torch.float16
            with torch.autocast("cpu", dtype=BF16):       # cpu too: CUDA's lists, exp in fp32
                y = torch.mm(torch.randn(2, 2), torch.randn(2, 2))
                assert y.dtype == BF16 and y.exp().dtype == torch.float32
        with emulate_cuda_autocast(map_devices=False):
            with torch.autocast("cpu", dtype=BF16):       # asked not to: the CPU's own lists
                assert torch.mm(torch.randn(2, 2), torch.randn(2, 2)).exp().dtype == BF16
    assert lin(x).dtype == torch.float32


def test_builtin_transformer_bf16_captures_bf16_activations():
    """precision=bf16 on meta keeps bf16 (was: fp32 fallback). In fp32 the attention's packed
    projection makes (T, B, 3, d) = 16 x 3 x 3 x 32 x 4 = 18,432-byte tensors; in bf16 there are none
    (q, k, v come out as 16 x 3 x 32 x 2 = 3,072 bytes each, which fp32 never requests)."""
    from oomtune.plan.predictor import capture_training_stream

    cfg = {"name": "transformer", "d_model": 32, "heads": 2, "layers": 1, "seq_len": 16,
           "vocab_size": 64, "dropout": 0.0, "optimizer": "adamw"}
    fp32, _ = capture_training_stream(cfg, 3, steps=1)
    bf16, reason = capture_training_stream({**cfg, "precision": "bf16"}, 3, steps=1)
    assert reason is None
    assert 18432 in _allocs(fp32) and 3072 not in _allocs(fp32)
    assert 18432 not in _allocs(bf16) and 3072 in _allocs(bf16)


@pytest.mark.parametrize("cc, config, expected", [
    ((9, 0), None, HOPPER_WORKSPACE_BYTES),        # 4096 * 8 * 1024 = 33,554,432
    ((8, 0), None, DEFAULT_WORKSPACE_BYTES),       # :4096:2:16:8 = 8,388,608 + 131,072
    (None, None, HOPPER_WORKSPACE_BYTES),          # unknown GPU: the larger default
    ((8, 6), ":4096:8", 4096 * 1024 * 8),
    ((9, 0), ":16:8", 16 * 1024 * 8),
    ((8, 0), ":4096:2:16:8", 8_519_680),
    ((8, 0), "garbage", DEFAULT_WORKSPACE_BYTES),  # torch warns and uses the default
])
def test_workspace_size(cc, config, expected):
    assert cublas_workspace_bytes(cc, config) == expected


def test_one_workspace_per_handle_forward_and_backward():
    """First matmul of the forward adds one workspace, the first of the backward (autograd engine)
    another; later matmuls add none. Workspaces stay live (never freed)."""
    w = torch.nn.Parameter(torch.empty(4, 4, device="meta"))
    x = torch.empty(2, 4, device="meta")

    def step() -> None:
        y = (x @ w) @ w
        y.sum().backward()

    size = 1 << 20
    s = capture_stream(step, existing=[w, x], device="meta", blas_workspaces=BlasWorkspaces(size))
    events = list(s)
    ws = [k for a, k, n, _ in events if a == "alloc" and n == size]
    assert len(ws) == 2
    assert not any(a == "free" and k in ws for a, k, _, _ in events)
    s2 = capture_stream(step, existing=[w, x], device="meta",
                        blas_workspaces=BlasWorkspaces(size, existing=("forward", "backward")))
    assert _allocs(s2).count(size) == 2 and _allocs(s2)[2:4] == [size, size]  # registered up front
