"""The recorder's memo of slow meta kernels (issue 13): the same stream as running every kernel.

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
    assert list(rec._memo) and len(rec._memo) == 1                        # one signature, run once


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


def test_an_output_aliasing_an_input_is_not_memoized():
    x = torch.empty(2, 3, device="meta")
    assert R._output_spec(x, (x,), {}) is R._NO_MEMO
    assert R._output_spec((torch.empty(2, 3, device="meta"), None), (x,), {}) is not R._NO_MEMO


@pytest.mark.parametrize("name", sorted(WORKLOADS))
@pytest.mark.parametrize("steps", [1, 3])
def test_captured_stream_equals_the_capture_without_memo(name, steps, monkeypatch):
    cfg = WORKLOADS[name]
    got, _ = P.capture_training_stream(cfg, 6, steps=steps)
    monkeypatch.setitem(R.StorageRecorder.__init__.__kwdefaults__, "memo", False)
    want, _ = P.capture_training_stream(cfg, 6, steps=steps)
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
