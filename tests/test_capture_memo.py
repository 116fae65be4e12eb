"""The recorder's memo of slow meta kernels: the same stream as running every kernel.

Expected values: hand-computed storage sizes for batch norm on meta; for the built-in workloads the
reference is the capture with the memo off (every kernel run by torch), compared event by event.
"""

from __future__ import annotations

import pytest
import torch

from oomtune.capture import recorder as R
from oomtune.plan import predictor as P

WORKLOADS = {
    "mlp": {"name": "mlp", "in_features": 64, "hidden": 128, "layers": 2, "num_classes": 10, "optimizer": "sgd"},
    "resnet": {"name": "resnet", "depth": 18, "image_size": 32, "num_classes": 10, "optimizer": "sgd"},
    "resnet-adamw": {"name": "resnet", "depth": 50, "image_size": 64, "num_classes": 10, "optimizer": "adamw"},
    "transformer": {"name": "transformer", "layers": 1, "d_model": 64, "heads": 2, "seq_len": 32,
                    "vocab_size": 256, "dropout": 0.0, "optimizer": "adamw"},
    "transformer-bf16": {"name": "transformer", "layers": 2, "d_model": 64, "heads": 4, "seq_len": 48,
                         "vocab_size": 300, "dropout": 0.1, "optimizer": "adam", "precision": "bf16"},
    "mlp-fp16": {"name": "mlp", "in_features": 32, "hidden": 64, "layers": 3, "num_classes": 7,
                 "optimizer": "adamw", "precision": "fp16"},
}


def _sizes(stream) -> list[tuple[str, int]]:
    return [(a, s) for a, _, s, _ in stream]


def test_batch_norm_twice_by_hand():
    # [4, 3, 8, 8] float32 in training mode: output 4*3*8*8*4 = 3072 bytes, save_mean and save_invstd
    # 3 * 4 = 12 bytes each; the second call is rebuilt from the memo with the same sizes
    bn = torch.nn.BatchNorm2d(3, device="meta")
    x = torch.empty(4, 3, 8, 8, device="meta")
    sink = R.StreamSink()
    rec = R.StorageRecorder(sink, device="meta")
    rec.register_existing([*bn.parameters(), *bn.buffers(), x])
    before = len(sink.events)
    with rec:
        y1 = bn(x)
        y2 = bn(x)
    assert [e[2] for e in sink.events[before:] if e[0] == "alloc"] == [3072, 12, 12, 3072, 12, 12]
    assert y1.shape == y2.shape == (4, 3, 8, 8) and y1.stride() == y2.stride()
    assert y1.untyped_storage()._cdata != y2.untyped_storage()._cdata   # a new storage each time
    bn_keys = [k for k in rec._memo if k[0] is torch.ops.aten.native_batch_norm.default]
    assert len(bn_keys) == 1                                              # one signature, run once


def test_memo_keeps_channels_last_strides():
    bn = torch.nn.BatchNorm2d(3, device="meta")
    x = torch.empty(2, 3, 5, 5, device="meta").to(memory_format=torch.channels_last)
    with R.StorageRecorder(R.StreamSink(), device="meta"):
        first, second = bn(x), bn(x)
    assert first.stride() == second.stride() == x.stride()


def test_signature_is_none_off_meta():
    x = torch.zeros(2, 3)
    assert R._signature(torch.ops.aten.threshold_backward.default, (x, x, 0.0), {}) is None
    m = torch.empty(2, 3, device="meta")
    assert R._signature(torch.ops.aten.threshold_backward.default, (m, m, 0.0), {}) is not None


def test_signature_tells_true_from_one():
    m = torch.empty(2, 3, device="meta")
    add = torch.ops.aten.add.Tensor
    assert R._signature(add, (m, m), {"alpha": True}) != R._signature(add, (m, m), {"alpha": 1})


def test_an_output_viewing_an_input_is_not_memoized():
    x = torch.empty(2, 3, device="meta")
    assert R._output_spec(x.view(3, 2), [x]) is R._NO_MEMO          # a new tensor on x's storage
    assert R._output_spec((torch.empty(2, 3, device="meta"), None), [x]) is not R._NO_MEMO
    assert R._is_view(torch.ops.aten.view.default) and R._is_view(torch.ops.aten.split.Tensor)
    assert not R._is_view(torch.ops.aten.add_.Tensor) and not R._is_view(torch.ops.aten.add.Tensor)


def test_in_place_ops_are_rebuilt_as_their_input():
    # x.mul_(2) twice: the second call is not run; it returns x itself, and allocates nothing
    x = torch.empty(4, 5, device="meta")
    sink = R.StreamSink()
    rec = R.StorageRecorder(sink, device="meta")
    rec.register_existing([x])
    with rec:
        a = x.mul_(2.0)
        b = x.mul_(2.0)
    assert a is x and b is x
    assert [k[0]._schema.name for k in rec._memo] == ["aten::mul_"]     # one signature, run once
    assert [e[0] for e in sink.events] == ["alloc"]                      # only x, registered


def test_a_call_that_changes_its_argument_is_not_memoized():
    # resize_ grows x's storage: 2*3*4 = 24 bytes, then 4*5*4 = 80 bytes; the grown storage is a
    # new request followed by the release of the old one (the recorder's resize rule), both times
    x = torch.empty(2, 3, device="meta")
    before = R._state(x)
    x.resize_(4, 5)
    assert R._output_spec(x, [x], [before]) is R._NO_MEMO
    y = torch.empty(1, device="meta")
    sink = R.StreamSink()
    with R.StorageRecorder(sink, device="meta") as rec:
        rec.register_existing([y])
        y.resize_(10)
        y.resize_(20)
    assert [(a, s) for a, _, s, _ in sink.events] == [("alloc", 4), ("alloc", 40), ("free", 4),
                                                      ("alloc", 80), ("free", 40)]


def test_out_variants_return_their_out_tensor():
    x = torch.empty(3, 4, device="meta")
    out = torch.empty(4, device="meta")
    with R.StorageRecorder(R.StreamSink(), device="meta"):
        r1 = torch.sum(x, 0, out=out)
        r2 = torch.sum(x, 0, out=out)
    assert r1 is out and r2 is out


@pytest.mark.parametrize("name", sorted(WORKLOADS))
@pytest.mark.parametrize("steps", [1, 3])
def test_captured_stream_equals_the_capture_without_memo(name, steps, monkeypatch):
    cfg = WORKLOADS[name]
    got, _ = P.capture_training_stream(cfg, 6, steps=steps)
    # capture_stream passes its own memo= to the recorder: both defaults off
    monkeypatch.setitem(R.StorageRecorder.__init__.__kwdefaults__, "memo", False)
    monkeypatch.setitem(R.capture_stream.__kwdefaults__, "memo", False)
    calls = []
    real_call = R.StorageRecorder.__torch_dispatch__

    def spy(self, func, types, args=(), kwargs=None):
        calls.append(self._memo)
        return real_call(self, func, types, args, kwargs)

    monkeypatch.setattr(R.StorageRecorder, "__torch_dispatch__", spy)
    want, _ = P.capture_training_stream(cfg, 6, steps=steps)
    assert calls and all(m is None for m in calls)   # the reference really ran every kernel
    assert len(got) == len(want) and _sizes(got) == _sizes(want)
    assert got == want


def test_eval_mode_batch_norm_equals_the_capture_without_memo(monkeypatch):
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                                torch.nn.BatchNorm2d(4)).to("meta").eval()
    x = torch.empty(2, 3, 9, 9, device="meta")

    def capture(memo: bool):
        return R.capture_stream(lambda: model(x).sum(), existing=list(model.parameters()) + [x],
                                device="meta", calls=2, memo=memo)

    assert capture(True) == capture(False)
