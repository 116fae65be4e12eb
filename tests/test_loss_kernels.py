"""The losses a capture runs as CUDA does: the outputs they keep and the buffers their kernels
allocate inside the call (aten/src/ATen/native/Loss.cpp, LossNLL.cpp; derivatives.yaml).

Logits (16, 10) fp32: 160 elements, 640 bytes; targets (16,) int64 (128 bytes) or (16, 10) fp32.
A recorded transient (a buffer a CUDA kernel frees before returning) shows as a request after the
op's outputs, released at once (StorageRecorder.add_transients).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from oomtune.capture.cuda_kernels import emulate_cuda
from oomtune.capture.recorder import StorageRecorder, StreamSink

LOGITS = 16 * 10 * 4


def _tensor(shape, device, dtype=torch.float32, grad=False):
    if device == "cpu":
        t = torch.randn(shape, dtype=dtype) if dtype.is_floating_point else torch.zeros(shape, dtype=dtype)
    else:
        t = torch.empty(shape, dtype=dtype, device=device)
    return t.requires_grad_(grad)


def _record(fn, existing, device, emulate=True):
    """(requested sizes, bytes still alive after ``fn`` beyond ``existing``, peak above them, result)."""
    sink = StreamSink()
    rec = StorageRecorder(sink, device=device)
    rec.register_existing(existing)
    start, n = sink.live_bytes, len(sink.events)
    sink.peak_live_bytes = start
    import contextlib

    with emulate_cuda("a100") if emulate else contextlib.nullcontext(), rec:
        out = fn()
    return ([s for a, _, s, _ in sink.events[n:] if a == "alloc"], sink.live_bytes - start,
            sink.peak_live_bytes - start, out)


def _step(loss_fn, existing, x, device):
    """Forward then backward in one recording (the saved tensors are the forward's own storages):
    (forward's requested sizes, bytes alive after it, backward's requested sizes). The incoming
    gradient, a 0-dim 4-byte tensor, exists before."""
    sink = StreamSink()
    rec = StorageRecorder(sink, device=device)
    g = _tensor((), device)
    rec.register_existing([*existing, g])
    start, n = sink.live_bytes, len(sink.events)
    with emulate_cuda("a100"), rec:
        y = loss_fn()
        m, live = len(sink.events), sink.live_bytes - start
        torch.autograd.grad(y, x, g)
    sizes = [[s for a, _, s, _ in part if a == "alloc"] for part in (sink.events[n:m], sink.events[m:])]
    return sizes[0], live, sizes[1]


@pytest.mark.parametrize("device", ["meta", "cpu"])
@pytest.mark.parametrize("loss", [F.mse_loss, F.smooth_l1_loss])
def test_mse_and_smooth_l1_keep_an_input_sized_storage_and_a_temporary(loss, device):
    """TORCH_META_FUNC(mse_loss) / (smooth_l1_loss) (Loss.cpp, shared by the CPU and CUDA kernels)
    allocates the output at the input's size (build_borrowing_binary_op) and only resizes its shape
    to 0-dim: the scalar loss holds 640 bytes while alive. TORCH_IMPL_FUNC(mse_loss_out) then fills
    a second input-sized ``loss`` (640) and reduces it into the output: one transient. Backward:
    mse_loss_backward's zeros_like(input), 640. torch's meta kernel made a 4-byte scalar."""
    x, t = _tensor((16, 10), device, grad=True), _tensor((16, 10), device)
    sizes, live, peak, y = _record(lambda: loss(x, t), [x, t], device)
    assert y.shape == () and sizes == [LOGITS, LOGITS] and live == LOGITS and peak == 2 * LOGITS
    g = torch.ones_like(y)
    assert _record(lambda: torch.autograd.grad(y, x, g), [x, t, y, g], device)[0] == [LOGITS]
    assert _record(lambda: loss(x, t, reduction="none"), [x, t], device)[0] == [LOGITS]   # no temporary
    if device == "meta":   # the old capture: torch's meta kernel, 4 bytes and no temporary
        assert _record(lambda: loss(x, t), [x, t], device, emulate=False)[:2] == ([4], 4)


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_bce_with_logits_allocates_log_sigmoid_and_one_minus_target(device):
    """binary_cross_entropy_with_logits (Loss.cpp, CompositeExplicitAutograd) on CUDA:
    log_sigmoid(input) (640; CUDA's log_sigmoid_forward buffer is empty) and 1 - target (640), then
    the mean (4 bytes) while both live: peak 4 + 1,280 inside the call, 4 kept. With pos_weight (10
    fp32, 40 bytes): pos_weight - 1 (40) and log_weight (640) live with log_sigmoid, and are freed
    before 1 - target: peak 4 + 640 + 40 + 640."""
    x, t = _tensor((16, 10), device, grad=True), _tensor((16, 10), device)
    sizes, live, peak, _ = _record(lambda: F.binary_cross_entropy_with_logits(x, t), [x, t], device)
    assert sizes == [4, LOGITS, LOGITS] and live == 4 and peak == 4 + 2 * LOGITS
    pw = _tensor((10,), device)
    sizes, live, peak, _ = _record(lambda: F.binary_cross_entropy_with_logits(x, t, pos_weight=pw),
                                   [x, t, pw], device)
    assert sizes == [4, LOGITS, 40, LOGITS] and live == 4 and peak == 4 + LOGITS + 40 + LOGITS
    assert _record(lambda: F.binary_cross_entropy_with_logits(x, t), [x, t], device, emulate=False)[:3] == \
        ([4], 4, 4)   # the old capture: the output only


@pytest.mark.parametrize("device", ["meta", "cpu"])
@pytest.mark.parametrize("kwargs, class_sized_backward", [
    ({}, 2), ({"ignore_index": 3}, 2), ({"label_smoothing": 0.1}, 3)])
def test_cross_entropy_keeps_the_log_softmax(kwargs, class_sized_backward, device):
    """cross_entropy (CompositeImplicitAutograd on every device: log_softmax, then nll_loss_nd; with
    label smoothing also -log_probs.sum(1)) keeps one class-sized tensor, the log_softmax output
    (640; derivatives.yaml: _log_softmax saves result, nll_loss_forward saves self). Backward:
    nll_loss_backward's grad_input (zeros, 640) and _log_softmax_backward_data's (640); with label
    smoothing the engine adds the two gradients of the log-probabilities first (640 more). No CUDA
    kernel here keeps more than its outputs, so the capture needs no change: this pins it."""
    x, t = _tensor((16, 10), device, grad=True), _tensor((16,), device, torch.int64)
    fwd, live, bwd = _step(lambda: F.cross_entropy(x, t, **kwargs), [x, t], x, device)
    assert fwd.count(LOGITS) == 1 and all(s < 128 for s in fwd if s != LOGITS)
    assert LOGITS <= live < LOGITS + 128
    assert bwd.count(LOGITS) == class_sized_backward and all(s < 128 for s in bwd if s != LOGITS)


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_nll_loss_keeps_its_output_and_total_weight(device):
    """nll_loss_forward (LossNLL.cpp, CUDA nll_loss_forward_out_cuda_template): output and
    total_weight, 0-dim fp32 each (4 + 4). Backward: grad_input, zeros of the input (640)."""
    x, t = _tensor((16, 10), device, grad=True), _tensor((16,), device, torch.int64)
    assert _step(lambda: F.nll_loss(x, t), [x, t], x, device) == ([4, 4], 8, [LOGITS])


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_bce_keeps_an_input_sized_storage(device):
    """binary_cross_entropy_cuda (cuda/Loss.cu): loss = empty_like(input) (640); with reduction mean
    the reduced 0-dim loss_reduced (4 bytes, a transient) is copied back after
    loss.resize_as_(loss_reduced), which keeps the 640-byte storage. The CPU kernel does the same;
    torch's meta kernel made a 4-byte scalar. Backward: binary_cross_entropy_backward_cuda's
    empty_like(input), 640."""
    x = torch.rand(16, 10).requires_grad_() if device == "cpu" else _tensor((16, 10), device, grad=True)
    t = torch.rand(16, 10) if device == "cpu" else _tensor((16, 10), device)
    sizes, live, peak, y = _record(lambda: F.binary_cross_entropy(x, t), [x, t], device)
    assert y.shape == () and sizes == [LOGITS, 4] and live == LOGITS and peak == LOGITS + 4
    g = torch.ones_like(y)
    assert _record(lambda: torch.autograd.grad(y, x, g), [x, t, y, g], device)[0] == [LOGITS]
    if device == "meta":
        assert _record(lambda: F.binary_cross_entropy(x, t), [x, t], device, emulate=False)[:2] == ([4], 4)


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_huber_loss_reduces_an_input_sized_temporary(device):
    """huber_loss (Loss.cpp, CPU and CUDA): loss = empty_like(input) (640) filled, then
    apply_loss_reduction makes the 0-dim output (4); the loss is freed on return. Recorded: the
    output, then the 640-byte transient; with reduction none the loss is the output itself."""
    x, t = _tensor((16, 10), device, grad=True), _tensor((16, 10), device)
    sizes, live, peak, _ = _record(lambda: F.huber_loss(x, t), [x, t], device)
    assert sizes == [4, LOGITS] and live == 4 and peak == 4 + LOGITS
    assert _record(lambda: F.huber_loss(x, t, reduction="none"), [x, t], device)[0] == [LOGITS]
