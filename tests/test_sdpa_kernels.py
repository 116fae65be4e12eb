"""Scaled dot-product attention captured as CUDA runs it.

Expected backends come from the rules of aten/src/ATen/native/transformers/cuda/sdp_utils.cpp (the
function named in each case); expected sizes from the CUDA kernels and torch's meta kernels
(torch/_meta_registrations.py), computed by hand in each test's comments.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from oomtune.capture import sdpa
from oomtune.capture.cuda_kernels import emulate_cuda
from oomtune.capture.gpu_target import parse_gpu
from oomtune.capture.recorder import StorageRecorder, StreamSink, capture_stream
from oomtune.exceptions import ConfigError

A100, H100, T4, A10 = (parse_gpu(g) for g in ("a100", "h100", "t4", "a10"))
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def _qkv(b=2, h=4, t=128, d=64, dtype=BF16, hk=None, device="meta", grad=True):
    q = torch.empty(b, h, t, d, dtype=dtype, device=device, requires_grad=grad)
    k = torch.empty(b, hk or h, t, d, dtype=dtype, device=device, requires_grad=grad)
    v = torch.empty(b, hk or h, t, d, dtype=dtype, device=device, requires_grad=grad)
    return q, k, v


def _params(q, k, v, mask=None, dropout=0.0, causal=False, gqa=False, grad=True):
    return sdpa.SdpaParams(q, k, v, mask, dropout, causal, gqa, grad)


SW = sdpa._Switches(flash=True, efficient=True, math=True, cudnn=True, order=tuple(sdpa._DEFAULT_ORDER),
                    deterministic=False, deterministic_warn_only=False)


def _choose(gpu, params, *, switches=SW, cudnn=None, cuda=(13, 0)):
    return sdpa.BACKEND_NAMES[sdpa.select_backend(params, gpu, switches=switches, cudnn=cudnn, cuda=cuda)]


@pytest.mark.parametrize("gpu, dtype, mask, expected", [
    (A100, BF16, None, "flash"),        # can_use_flash_attention: sm80, bf16, no mask
    (A100, FP16, None, "flash"),
    (A100, FP32, None, "efficient"),    # check_dtypes_flash_attention: fp32 refused; mem-efficient takes fp32
    (A100, BF16, "bool", "efficient"),  # check_for_attn_mask: flash takes no mask
    (A100, BF16, "float", "efficient"),
    (T4, FP16, None, "efficient"),      # check_flash_attention_hardware_support: sm75 < sm80
    (T4, BF16, None, "math"),           # mem-efficient below sm80: fp16 and fp32 only
    (T4, FP32, "float", "efficient"),
])
def test_backend_by_dtype_mask_and_architecture(gpu, dtype, mask, expected):
    q, k, v = _qkv(dtype=dtype)
    m = None if mask is None else (torch.empty(128, 128, dtype=torch.bool, device="meta") if mask == "bool"
                                   else torch.empty(128, 128, dtype=dtype, device="meta"))
    assert _choose(gpu, _params(q, k, v, m)) == expected


def test_cudnn_first_on_hopper_with_a_recent_cudnn():
    """check_prefer_cudnn_attention: cuDNN > 9.15 on sm90/sm10x puts cuDNN first; with CUDA < 13 only
    minor 0 or 3; without cuDNN in the build it is never chosen."""
    q, k, v = _qkv()
    assert _choose(H100, _params(q, k, v, causal=True), cudnn=92400) == "cudnn"
    assert _choose(H100, _params(q, k, v, causal=True), cudnn=91500) == "flash"      # not > 9.15
    assert _choose(H100, _params(q, k, v, causal=True), cudnn=None) == "flash"       # CPU wheel: no cuDNN
    assert _choose(A100, _params(q, k, v, causal=True), cudnn=92400) == "flash"      # sm80: default order
    assert _choose(parse_gpu("sm89"), _params(q, k, v), cudnn=92400) == "flash"
    assert _choose(parse_gpu("sm90"), _params(q, k, v), cudnn=92400, cuda=(12, 8)) == "cudnn"
    assert _choose(parse_gpu("sm120"), _params(q, k, v), cudnn=92400, cuda=(12, 8)) == "flash"


def test_head_size_and_sequence_rules():
    # check_head_dim_size_flash: <= 256; above, mem-efficient (no upper bound on CUDA)
    assert _choose(A100, _params(*_qkv(d=256))) == "flash"
    assert _choose(A100, _params(*_qkv(d=264))) == "efficient"
    # check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120: training with d in (192, 224]
    assert _choose(A10, _params(*_qkv(d=200))) == "efficient"
    assert _choose(A10, _params(*_qkv(d=200), grad=False)) == "flash"
    assert _choose(A100, _params(*_qkv(d=200))) == "flash"
    # check_flash_causal_non_square_seqlens
    q = torch.empty(2, 4, 64, 64, dtype=BF16, device="meta")
    _, k, v = _qkv()
    assert _choose(A100, _params(q, k, v, causal=True)) == "efficient"
    assert _choose(A100, _params(q, k, v, causal=False)) == "flash"
    # check_head_dim_size_mem_efficient: fp16 on sm80 needs a multiple of 8 (minimum_gemm_alignment)
    assert _choose(A100, _params(*_qkv(d=20, dtype=FP16))) == "flash"        # flash pads to 24
    assert _choose(T4, _params(*_qkv(d=20, dtype=FP16))) == "math"
    assert _choose(T4, _params(*_qkv(d=20, dtype=FP32))) == "efficient"      # sm75 fp32: no tensor cores, 1


def test_grouped_query_and_runtime_switches():
    q, k, v = _qkv(hk=2)
    assert _choose(A100, _params(q, k, v, gqa=True)) == "flash"
    assert _choose(A100, _params(q, k, v, gqa=False)) == "math"   # unequal heads without enable_gqa
    off = sdpa._Switches(**{**SW.__dict__, "flash": False})
    assert _choose(A100, _params(*_qkv()), switches=off) == "efficient"
    det = sdpa._Switches(**{**SW.__dict__, "deterministic": True})
    assert _choose(H100, _params(*_qkv()), switches=det, cudnn=92400) == "flash"   # check_cudnn_deterministic
    only_math = sdpa._Switches(**{**SW.__dict__, "flash": False, "efficient": False, "cudnn": False})
    assert _choose(A100, _params(*_qkv()), switches=only_math) == "math"
    none = sdpa._Switches(**{**SW.__dict__, "flash": False, "efficient": False, "cudnn": False, "math": False})
    with pytest.raises(RuntimeError, match="No available kernel"):
        _choose(A100, _params(*_qkv()), switches=none)


def test_runtime_switch_is_read_from_torch():
    """``sdpa_kernel`` / ``enable_flash_sdp`` are honoured as a CUDA run honours them."""
    q, k, v = _qkv()
    with emulate_cuda("a100") as notes, torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]):
        F.scaled_dot_product_attention(q, k, v)
    assert dict(notes.sdpa) == {"math": 1}


# -- what each kernel keeps -----------------------------------------------------------------------------
def _live_after(fn, inputs):
    """(new bytes live after ``fn()`` returned and its result is kept, alloc sizes) on meta under A100
    kernels unless given."""
    sink = StreamSink()
    rec = StorageRecorder(sink, device="meta")
    rec.register_existing(inputs)
    start = sink.live_bytes
    keep = []
    with rec:
        keep.append(fn())
    return sink.live_bytes - start, [e[2] for e in sink.events[len(inputs):] if e[0] == "alloc"], keep


B, H, T, D = 2, 4, 128, 64


@pytest.mark.parametrize("dtype, size", [(BF16, 2), (FP16, 2)])
def test_flash_keeps_output_and_fp32_logsumexp(dtype, size):
    """_scaled_dot_product_flash_attention returns output (B, H, T, D), logsumexp (B, H, T) fp32,
    rng_state (2,) uint64 and an unused () uint64 (flash_api.cpp mha_fwd, "BC breaking change to flash
    seed/offset"); its backward node saves q, k, v (inputs), output, logsumexp, rng_state, unused.
    out 2*4*128*64*2 = 131,072; lse 2*4*128*4 = 4,096; rng 16; unused 8."""
    q, k, v = _qkv(dtype=dtype)
    with emulate_cuda("a100") as notes:
        live, allocs, keep = _live_after(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), [q, k, v])
    assert dict(notes.sdpa) == {"flash": 1}
    assert keep[0].grad_fn.name() == "ScaledDotProductFlashAttentionBackward0"
    assert allocs == [B * H * T * D * size, B * H * T * 4, 16, 8]
    assert live == B * H * T * D * size + B * H * T * 4 + 16 + 8


def test_math_keeps_scores_sized_softmax():
    """Without the emulation (meta: always math), _scaled_dot_product_attention_math in fp32 keeps for
    backward the scaled query (B, H, T, D), the scaled key transposed (B, H, D, T), the softmax
    (B, H, T, T) and returns the output (B, H, T, D), all fp32: 3 x 262,144 + 524,288 bytes. The
    scores (B, H, T, T) and the causal mask (T, T) are freed before it returns."""
    q, k, v = _qkv(dtype=FP32)
    live, allocs, _ = _live_after(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), [q, k, v])
    bhtd, bhtt = B * H * T * D * 4, B * H * T * T * 4
    assert live == 3 * bhtd + bhtt
    assert allocs.count(bhtt) == 3   # scores (bmm), scores + mask, softmax


@pytest.mark.parametrize("mask", [None, "bool", "float"])
def test_efficient_keeps_output_logsumexp_and_the_additive_mask(mask):
    """fp32 on A100: _scaled_dot_product_efficient_attention. Output (B, T, H, D) fp32 (transposed
    back), logsumexp (B, H, ceil(T/32)*32) fp32, philox seed and offset () int64 (empty on the device
    without dropout, attention.cu); with a mask, the additive fp32 mask it saves: a bool mask is
    converted first (convert_boolean_attn_mask: where(~mask, -inf, 0)), and a mask whose rows are
    not 8-aligned is padded (preprocess_mask -> pad_bias<8>: 100 columns -> 104, then sliced).
    T = 100: out 2*100*4*64*4 = 204,800; lse 2*4*128*4 = 4,096; seed + offset 16; mask 100*104*4."""
    t = 100
    q, k, v = _qkv(t=t, dtype=FP32)
    m = None
    if mask == "bool":
        m = torch.empty(t, t, dtype=torch.bool, device="meta")
    elif mask == "float":
        m = torch.empty(t, t, dtype=FP32, device="meta")
    inputs = [q, k, v] + ([m] if m is not None else [])
    with emulate_cuda("a100") as notes:
        live, allocs, keep = _live_after(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=m), inputs)
    assert dict(notes.sdpa) == {"efficient": 1}
    expected = B * t * H * D * 4 + B * H * 128 * 4 + 16
    if mask is not None:
        expected += t * 104 * 4   # the padded mask (a bool one's conversion, 40,000, and ~mask are freed)
    assert live == expected
    assert keep[0].shape == (B, H, t, D) and keep[0].stride() == (t * H * D, D, H * D, 1)


def test_cudnn_keeps_output_and_logsumexp_column():
    """_scaled_dot_product_cudnn_attention: output like q (B, H, T, D), logsumexp (B, H, T, 1) fp32,
    seed and offset () int64: 131,072 + 4,096 + 16."""
    q, k, v = _qkv()
    with emulate_cuda("h100") as notes:
        if sdpa.cudnn_version() is None or sdpa.cudnn_version() <= 91500:
            pytest.skip("this torch build has no cuDNN > 9.15: H100 picks flash")
        live, allocs, _ = _live_after(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), [q, k, v])
    assert dict(notes.sdpa) == {"cudnn": 1}
    assert live == B * H * T * D * 2 + B * H * T * 4 + 16


def test_flash_pads_the_head_dim_to_8_and_saves_the_padded_inputs():
    """attention.cpp pads q, k, v to a multiple of 8 for flash (pad_last_dim<8>) and slices the output:
    D = 20 -> 24. Saved: the three padded inputs 3 * 2*4*128*24*2, the padded output, logsumexp,
    rng_state and unused."""
    q, k, v = _qkv(d=20, dtype=FP16)
    with emulate_cuda("a100"):
        live, _, keep = _live_after(lambda: F.scaled_dot_product_attention(q, k, v), [q, k, v])
    padded = B * H * T * 24 * 2
    assert live == 4 * padded + B * H * T * 4 + 16 + 8
    assert keep[0].shape == (B, H, T, 20)


def test_dropout_in_flash_keeps_no_mask_but_math_keeps_a_byte_mask():
    """Flash regenerates its dropout mask from the saved rng_state (philox): nothing more is kept. The
    math path on a CUDA GPU calls at::dropout, i.e. the fused native_dropout with a bool mask of
    (B, H, T, T): 131,072 bytes, where meta's own composite keeps an fp32 noise tensor (524,288)."""
    q, k, v = _qkv()
    with emulate_cuda("a100"):
        flash, _, _ = _live_after(lambda: F.scaled_dot_product_attention(q, k, v, dropout_p=0.1), [q, k, v])
    assert flash == B * H * T * D * 2 + B * H * T * 4 + 16 + 8
    q32, k32, v32 = _qkv(dtype=FP32, d=64)
    with emulate_cuda("a100"), torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]):
        cuda_math, allocs, _ = _live_after(lambda: F.scaled_dot_product_attention(q32, k32, v32, dropout_p=0.1),
                                           [q32, k32, v32])
    meta_math, _, _ = _live_after(lambda: F.scaled_dot_product_attention(q32, k32, v32, dropout_p=0.1),
                                  [q32, k32, v32])
    bhtt = B * H * T * T
    assert B * H * T * T * 1 in allocs                                   # the bool mask
    assert meta_math - cuda_math == bhtt * 4 - bhtt * 1                   # fp32 noise vs bool mask


# -- workspaces inside the CUDA kernels ------------------------------------------------------------------
def test_flash_backward_workspaces():
    """mha_bwd (flash_api.cpp): softmax_d (B, H, round128(T)) fp32 and dq_accum (B, round128(T), H,
    round32(D)) fp32; _flash_attention_backward copies a non-contiguous grad_out (and out) in the
    (B, T, H, D) layout; GQA adds dk_expanded and dv_expanded (B, T_k, H, D). Here T = 100 -> 128,
    D = 64; q contiguous (B, H, T, D), so out.transpose(1, 2) is not contiguous: copied."""
    t = 100
    q, k, v = _qkv(t=t, hk=2)
    out = torch.empty_like(q)
    go = torch.empty(B, t, H, D, dtype=BF16, device="meta").transpose(1, 2)   # contiguous in (B, T, H, D)
    lse = torch.empty(B, H, t, device="meta")
    with emulate_cuda("a100"):
        sizes = sdpa.transient_requests(torch.ops.aten._scaled_dot_product_flash_attention_backward.default,
                                        (go, q, k, v, out, lse, None, None, t, t, 0.0, True, None, None), {})
    bthd = B * t * H * D * 2
    assert sizes == [bthd, B * H * 128 * 4, B * 128 * H * 64 * 4, B * t * H * D * 2, B * t * H * D * 2]


def test_workspaces_are_recorded_after_the_backward_op_and_freed():
    q, k, v = _qkv()
    with emulate_cuda("a100"):
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        g = torch.empty_like(o)
        sink = StreamSink()
        with StorageRecorder(sink, device="meta"):
            torch.autograd.grad(o, (q, k, v), g)
    events = [(a, s) for a, _, s, _ in sink.events]
    accum = B * 128 * H * 64 * 4
    softmax_d = B * H * 128 * 4
    i = events.index(("alloc", accum))
    assert events[i - 1] == ("alloc", softmax_d)          # after dq, dk, dv
    assert events[i + 1:i + 3] == [("free", accum), ("free", softmax_d)]


def test_flash_split_kv_accumulators():
    """set_params_splitkv / num_splits_heuristic (flash_api.cpp): batch 1, 2 heads, 64 queries over
    4096 keys, head dim 64, 108 SMs: 2 blocks of work against 216 slots, 16 key blocks of 256 -> the
    smallest split count within 85% of the best efficiency. efficiency(s) = (2s/216)/ceil(2s/216) =
    s/108 for s <= 16 (eligible: ceil(16/s) changes at s = 1..8, 16): best at 16 (0.148), 85% of it is
    0.126 -> 16 splits."""
    assert sdpa.flash_split_count(1, 2, 64, 4096, 64, 108) == 16
    assert sdpa.flash_split_count(8, 32, 2048, 2048, 128, 108) == 1     # fills the GPU: one split
    assert sdpa.flash_split_count(1, 2, 64, 4096, 64, None) == 1        # SM count unknown


# -- the kernels on the CPU: real values, CUDA's tensors ------------------------------------------------
@pytest.mark.parametrize("gpu, dtype, kw, backend", [
    ("a100", BF16, {"is_causal": True}, "flash"),
    ("a100", FP32, {"is_causal": True}, "efficient"),
    ("a100", FP32, {"mask": True}, "efficient"),
    ("a100", BF16, {"is_causal": True, "dropout_p": 0.25}, "flash"),
    ("t4", FP32, {"gqa": True}, "efficient"),
])
def test_cpu_kernels_compute_attention_and_its_gradient(gpu, dtype, kw, backend):
    """The CPU trial trains for real: output and gradients equal torch's own attention (dropout: the
    same mask regenerated from the saved seed, so gradients match a recomputation with that mask)."""
    torch.manual_seed(0)
    hk = 2 if kw.get("gqa") else 4
    q = torch.randn(2, 4, 16, 64, dtype=dtype, requires_grad=True)
    k = torch.randn(2, hk, 16, 64, dtype=dtype, requires_grad=True)
    v = torch.randn(2, hk, 16, 64, dtype=dtype, requires_grad=True)
    extra = {"enable_gqa": True} if kw.get("gqa") else {}
    mask = torch.rand(16, 16) > 0.3 if kw.get("mask") else None
    args = dict(attn_mask=mask, is_causal=kw.get("is_causal", False), dropout_p=kw.get("dropout_p", 0.0), **extra)
    g = torch.randn(2, 4, 16, 64, dtype=dtype)
    with emulate_cuda(gpu) as notes:
        out = F.scaled_dot_product_attention(q, k, v, **args)
        seed = int(out.grad_fn._saved_rng_state[0].item()) if args["dropout_p"] else None
        grads = torch.autograd.grad(out, (q, k, v), g)
    assert dict(notes.sdpa) == {backend: 1}
    tol = 1e-4 if dtype == FP32 else 3e-2
    if args["dropout_p"] == 0.0:
        ref = F.scaled_dot_product_attention(q, k, v, **args)
        ref_grads = torch.autograd.grad(ref, (q, k, v), g)
        for a, b in zip((out, *grads), (ref, *ref_grads)):
            assert (a.float() - b.float()).abs().max().item() < tol
    else:   # dropped probabilities are exactly zero: compare with attention under the regenerated mask
        keep = torch.rand(2, 4, 16, 16, generator=torch.Generator().manual_seed(seed)) >= 0.25
        qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
        p = torch.softmax((qf @ kf.transpose(-2, -1) / 8).masked_fill(~torch.ones(16, 16, dtype=torch.bool).tril(),
                                                                       -math.inf), -1)
        ref = (p * keep / 0.75) @ vf
        ref_grads = torch.autograd.grad(ref, (qf, kf, vf), g.float())
        for a, b in zip((out, *grads), (ref, *ref_grads)):
            assert (a.float() - b.float()).abs().max().item() < tol


def test_cpu_flash_returns_cuda_shaped_tensors():
    """On the CPU the flash op returns what the CUDA kernel returns (the meta kernel's shapes): the
    CPU trial's virtual GPU sees output + fp32 logsumexp, not the CPU flash kernel's (B, T, H) one."""
    q, k, v = _qkv(device="cpu", grad=True, t=32)
    with emulate_cuda("a100"):
        sink = StreamSink()
        with StorageRecorder(sink, device="cpu"):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert [s for a, _, s, _ in sink.events if a == "alloc"] == [B * H * 32 * D * 2, B * H * 32 * 4, 16, 8]


# -- the target GPU ---------------------------------------------------------------------------------------
def test_gpu_names_and_capabilities():
    assert (A100.capability, A100.sm_count) == ((8, 0), 108)
    assert (H100.capability, T4.capability) == ((9, 0), (7, 5))
    assert parse_gpu("sm_86").capability == (8, 6) and parse_gpu("8.6").key == "sm86"
    assert parse_gpu("sm90:114").sm_count == 114
    assert parse_gpu("NVIDIA H100").key == "h100"
    assert parse_gpu(parse_gpu("sm89:58").key) == parse_gpu("sm89:58")
    with pytest.raises(ConfigError, match="model.gpu='x9000': unknown GPU"):
        parse_gpu("x9000")


def test_capture_stream_notes_name_the_target():
    q, k, v = _qkv()
    notes = []
    capture_stream(lambda: F.scaled_dot_product_attention(q, k, v).sum().backward(), existing=[q, k, v],
                   device="meta", gpu="t4", notes=notes)
    assert notes[0].lines() == ["scaled_dot_product_attention as on T4 (sm75): math x1"]
