"""A capture runs the target GPU's kernels: dropout, RMS norm, optimizers, autocast on
cpu/meta, checkpoint recomputation, the CPU fallback, the HF decoders and the built-in transformer.

Expected sizes are computed by hand from torch's source, cited per test.
"""

from __future__ import annotations

import math
from pathlib import Path
import warnings

import pytest
import torch
import torch.nn.functional as F

from oomtune.capture.cuda_kernels import emulate_cuda
from oomtune.capture.recorder import HostMemoryError, StorageRecorder, StreamSink, capture_stream

BF16 = torch.bfloat16


def _live_after(fn, inputs, device="meta"):
    sink = StreamSink()
    rec = StorageRecorder(sink, device=device)
    rec.register_existing(inputs)
    start = sink.live_bytes
    keep = []
    with rec:
        keep.append(fn())
    return sink.live_bytes - start, keep


# -- dropout ------------------------------------------------------------------------------------------
def test_dropout_keeps_a_one_byte_mask_as_cuda():
    """aten::dropout on CUDA calls native_dropout (is_fused_kernel_acceptable): output (4,000 bytes
    for 1,000 fp32) and a bool mask (1,000), the mask saved. Meta's composite (_dropout_impl) makes an
    fp32 noise tensor and multiplies: output 4,000 + noise 4,000 saved."""
    x = torch.empty(1000, device="meta", requires_grad=True)
    with emulate_cuda("a100"):
        cuda, keep = _live_after(lambda: F.dropout(x, 0.1, training=True), [x])
    assert cuda == 4000 + 1000
    assert keep[0].grad_fn.name() == "NativeDropoutBackward0"
    meta, _ = _live_after(lambda: F.dropout(x, 0.1, training=True), [x])
    assert meta == 4000 + 4000
    with emulate_cuda("a100"):   # p = 0 and eval take the composite, which returns the input itself
        assert _live_after(lambda: F.dropout(x, 0.0, training=True), [x])[0] == 0
        assert _live_after(lambda: F.dropout(x, 0.1, training=False), [x])[0] == 0


def test_dropout_on_the_cpu_trains():
    torch.manual_seed(0)
    x = torch.ones(10000, requires_grad=True)
    with emulate_cuda("a100"):
        y = F.dropout(x, 0.5, training=True)
        (g,) = torch.autograd.grad(y.sum(), x)
    kept = y != 0
    assert 0.4 < kept.float().mean().item() < 0.6
    assert torch.equal(y[kept], torch.full_like(y[kept], 2.0)) and torch.equal(g, y.detach())


# -- RMS norm -----------------------------------------------------------------------------------------
def test_rms_norm_runs_the_fused_kernel_and_saves_input_and_fp32_rstd():
    """On CUDA rms_norm calls _fused_rms_norm (layer_norm.cpp rms_norm_symint), whose derivative
    saves input, weight and rstd: new storages are the bf16 output (4 x 8 x 2 = 64) and the fp32 rstd
    (4 x 1 x 4 = 16). On meta/CPU the composite decomposes and saves fp32 copies: the input upcast
    (128), rsqrt (16), x * rstd (128, saved by the weight mul) and the bf16 output (64)."""
    x = torch.empty(4, 8, dtype=BF16, device="meta", requires_grad=True)
    w = torch.empty(8, dtype=BF16, device="meta", requires_grad=True)
    with emulate_cuda("a100"):
        cuda, keep = _live_after(lambda: F.rms_norm(x, [8], w, 1e-6), [x, w])
    assert keep[0].grad_fn.name() == "FusedRmsNormBackward0"
    assert cuda == 64 + 16
    meta, _ = _live_after(lambda: F.rms_norm(x, [8], w, 1e-6), [x, w])
    assert meta == 128 + 16 + 128 + 64


def test_rms_norm_on_the_cpu_matches_the_composite():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 16, requires_grad=True)
    w = torch.randn(16, requires_grad=True)
    ref = F.rms_norm(x, [16], w, 1e-6)
    gref = torch.autograd.grad(ref.square().sum(), (x, w))
    with emulate_cuda("a100"):
        out = F.rms_norm(x, [16], w, 1e-6)
        got = torch.autograd.grad(out.square().sum(), (x, w))
    assert out.grad_fn.name() == "FusedRmsNormBackward0"
    assert torch.allclose(out, ref, atol=1e-5)
    assert all(torch.allclose(a, b, atol=1e-4) for a, b in zip(got, gref))


# -- optimizers ---------------------------------------------------------------------------------------
def _adamw_step_extra(emulate: bool) -> tuple[int, list[str]]:
    """Peak bytes above the state before AdamW's second step, params of 1,000 and 3,000 fp32."""
    params = [torch.empty(1000, device="meta", requires_grad=True), torch.empty(3000, device="meta", requires_grad=True)]
    opt = torch.optim.AdamW(params)
    for p in params:
        p.grad = torch.empty_like(p)
    opt.step()   # creates exp_avg and exp_avg_sq
    sink = StreamSink()
    rec = StorageRecorder(sink, device="meta")
    rec.register_existing(params + [p.grad for p in params] + [t for s in opt.state.values() for t in s.values()])
    base = sink.live_bytes
    notes = []
    import contextlib

    with (emulate_cuda("a100") if emulate else contextlib.nullcontext()) as n, rec:
        opt.step()
    if n is not None:
        notes = sorted(n.optimizers)
    return sink.peak_live_bytes - base, notes


def test_adamw_takes_the_foreach_step_as_on_cuda():
    """_default_to_fused_or_foreach picks foreach for CUDA parameters: _multi_tensor_adam keeps
    exp_avg_sq_sqrt = _foreach_sqrt(exp_avg_sqs) for all parameters at once: 4,000 + 12,000 bytes.
    The per-tensor loop (meta's default, _single_tensor_adam) makes denom = exp_avg_sq.sqrt() /
    bc2_sqrt per parameter: for the second parameter its sqrt and quotient (2 x 12,000) while the
    first parameter's denom (4,000) is still bound to the loop variable."""
    foreach, notes = _adamw_step_extra(emulate=True)
    assert foreach == 4000 + 12000 and notes == ["adam: foreach"]
    loop, _ = _adamw_step_extra(emulate=False)
    assert loop == 4000 + 2 * 12000


def test_fused_adamw_constructs_and_steps_on_meta():
    """fused=True is checked at construction (_device_dtype_check_for_fused): meta is accepted while
    emulating; the fused step updates in place (no temporaries) and keeps ``step`` on the device."""
    p = torch.empty(1000, device="meta", requires_grad=True)
    with emulate_cuda("a100"):
        opt = torch.optim.AdamW([p], fused=True)
        p.grad = torch.empty_like(p)
        opt.step()
        assert opt.state[p]["step"].device.type == "meta"
        sink = StreamSink()
        rec = StorageRecorder(sink, device="meta")
        rec.register_existing([p, p.grad, *opt.state[p].values()])
        base = sink.live_bytes
        with rec:
            opt.step()
    assert sink.peak_live_bytes == base


# -- autocast on cpu / meta, and checkpointing -----------------------------------------------------------
def test_cpu_and_meta_autocast_follow_cudas_policy_and_the_record_says_so():
    """exp is an fp32 op on CUDA (AT_FORALL_FP32), not on the CPU; mm is lower precision on both."""
    x = torch.empty(4, 4, device="meta")
    with emulate_cuda("a100") as notes:
        with torch.autocast("cpu", dtype=BF16):
            y = torch.mm(x, x)
            assert y.dtype == BF16 and y.exp().dtype == torch.float32
            assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == BF16
        with torch.autocast(device_type="meta", enabled=False):   # raised "unsupported scalarType" before
            assert torch.mm(x, x).dtype == torch.float32
        with torch.autocast(device_type="meta"):                   # no dtype: CUDA's default, fp16
            assert torch.mm(x, x).dtype == torch.float16
    assert notes.translations() == ["torch.autocast('cpu', bfloat16), torch.autocast('meta', float16) ran under "
                                    "CUDA's autocast policy (the capture stands for a CUDA run)"]
    with torch.autocast("cpu", dtype=BF16):    # outside a capture: the CPU's own policy again
        assert torch.mm(torch.ones(2, 2), torch.ones(2, 2)).exp().dtype == BF16


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_recomputes_under_the_emulated_policy(reentrant):
    """torch.utils.checkpoint saves the autocast state (_get_autocast_kwargs reads
    torch.is_autocast_enabled / get_autocast_dtype) and recomputes under it: the emulation reports
    its region there, so the recomputation casts as the forward did (non-reentrant: the saved
    tensors' metadata must match, else CheckpointError)."""
    from torch.utils.checkpoint import checkpoint

    lin = torch.nn.Linear(16, 16, device="meta")
    x = torch.empty(4, 16, device="meta", requires_grad=True)

    def block(t):
        return lin(t).exp()

    with emulate_cuda("a100"):
        with torch.autocast("cpu", dtype=BF16):
            y = checkpoint(block, x, use_reentrant=reentrant)
        sink = StreamSink()
        with StorageRecorder(sink, device="meta"):
            y.sum().backward()
    # the recomputed linear ran in bf16: its output, 4 x 16 x 2 = 128 bytes, and the bf16 weight
    # copy 16 x 16 x 2 = 512 are among the backward's allocations
    sizes = [s for a, _, s, _ in sink.events if a == "alloc"]
    assert 128 in sizes and 512 in sizes


# -- the CPU fallback ------------------------------------------------------------------------------------
def test_cpu_capture_stops_at_its_host_limit():
    x = torch.ones(1000)

    def step():
        return [x * 2 for _ in range(10)]   # 10 x 4,000 live

    with pytest.raises(HostMemoryError, match="over its limit of"):
        capture_stream(step, device="cpu", host_limit_bytes=30_000)
    assert capture_stream(step, device="cpu", host_limit_bytes=50_000) is not None


def test_fallback_is_said_at_once_and_refused_over_host_memory(tmp_path, monkeypatch, capsys):
    """A python entry whose step reads a value (no meta data): captured on the CPU, said on stderr
    when it happens; with too little host memory the capture is refused in one line."""
    from oomtune.exceptions import HostMemoryRefused
    from oomtune.plan import predictor

    entry = Path(__file__).parent / "data" / "entry_reads_a_value.py"
    cfg = {"target": {"name": "python", "entry": f"{entry}:make_workload"}}
    stream, reason = predictor.capture_training_stream(cfg, 8, steps=1)
    assert "captured on cpu" in reason
    assert "oomtune: note: batch 8: meta kernel missing or data-dependent" in capsys.readouterr().err
    monkeypatch.setattr(predictor, "cpu_capture_limit_bytes", lambda: 10_000)
    with pytest.raises(HostMemoryRefused, match="batch 8: .*captured on cpu.*over its limit of 9.77 KiB"):
        predictor.capture_training_stream(cfg, 8, steps=1)


# -- the built-in transformer: what attention keeps, by hand -------------------------------------------------
def _live_after_forward(cfg: dict, batch: int, emulate: bool) -> int:
    from oomtune.workloads import build_workload

    wl = build_workload({**cfg, "data": {"source": "synthetic"}}, batch, "meta")
    x, y = next(wl.batches())

    def forward():
        out = wl.model(x)
        return F.cross_entropy(out.flatten(0, -2), y.flatten())

    sink = StreamSink()
    rec = StorageRecorder(sink, device="meta")
    rec.register_existing(wl.tensors_before_step())
    start = sink.live_bytes
    import contextlib

    keep = []
    with (emulate_cuda("a100") if emulate else contextlib.nullcontext()), rec:
        keep.append(forward())
    return sink.live_bytes - start


def test_builtin_transformer_attention_memory_by_hand():
    """The built-in transformer (DecoderLM: nn.TransformerEncoderLayer, causal, need_weights=False)
    calls SDPA with is_causal=True and no mask (F.multi_head_attention_forward), fp32. On meta that is
    the math path, which keeps per layer the scaled query (B, H, T, D), the scaled key transposed
    (B, H, D, T) and the softmax (B, H, T, T), all fp32 (its output is not saved: MHA's
    permute(...).contiguous() copy replaces it). On an A100 it is memory-efficient attention (fp32),
    whose backward node saves its output (B, T, H, D), a logsumexp (B, H, ceil(T/32)*32) fp32 and two
    8-byte philox tensors. Everything else in the forward is the same, so the difference of live
    bytes after the forward is, per layer, 2*BHTD*4 + BHTT*4 - (BHTD*4 + BH*ceil32(T)*4 + 16).
    B=3, H=2, T=40, D=16, 2 layers: 2*(15,360 + 38,400 - 1,536 - 16) = 104,416."""
    cfg = {"name": "transformer", "layers": 2, "d_model": 32, "heads": 2, "seq_len": 40, "vocab_size": 64,
           "dropout": 0.0, "optimizer": "adamw", "precision": "fp32"}
    b, h, t, d = 3, 2, 40, 16
    per_layer = b * h * t * d * 4 + b * h * t * t * 4 - b * h * math.ceil(t / 32) * 32 * 4 - 16
    assert _live_after_forward(cfg, b, emulate=False) - _live_after_forward(cfg, b, emulate=True) == 2 * per_layer


def test_builtin_transformer_bf16_peak_drops_by_the_attention_scores():
    """Predicted peak (requested bytes, one training step, bf16 autocast): on meta the math path keeps
    B x H x T x T fp32 per layer (softmax, plus the fp32 upcasts of the math path); on an A100 flash
    keeps O(T). With T = 256, B = 4, H = 4, 4 layers, the softmax alone is 4*4*256*256*4 = 4 MiB per
    layer; the A100 capture's peak is lower by at least the 4 layers' softmaxes (16 MiB)."""
    from oomtune.plan.predictor import capture_training_stream
    from oomtune.alloc.stream import replay_stream

    cfg = {"name": "transformer", "layers": 4, "d_model": 128, "heads": 4, "seq_len": 256, "vocab_size": 512,
           "dropout": 0.0, "optimizer": "adamw", "precision": "bf16", "gpu": "a100"}
    cuda, _ = capture_training_stream(cfg, 4, steps=2, blas_workspaces=False)   # the kernels' own, as below
    meta_peak = _meta_math_peak(cfg, 4)
    assert meta_peak - _peak_requested(cuda) >= 4 * (4 * 4 * 256 * 256 * 4)


def _peak_requested(stream) -> int:
    live = peak = 0
    for action, size in zip(stream.actions, stream.sizes):
        live += size if action == 0 else -size
        peak = max(peak, live)
    return peak


def _meta_math_peak(cfg: dict, batch: int) -> int:
    from oomtune.workloads import build_workload

    wl = build_workload({**cfg, "data": {"source": "synthetic"}}, batch, "meta")
    batches = wl.batches()
    stream = capture_stream(lambda: wl.step(next(batches)), existing=wl.tensors_before_step(), device="meta",
                            cuda_autocast=False, calls=2)
    return _peak_requested(stream)
