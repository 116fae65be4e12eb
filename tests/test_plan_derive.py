"""Derived request streams: the affine model, its checks, and plans identical to
capturing every batch size.

Expected values: hand-computed sizes for the synthetic streams; for the built-in workloads the
reference is a real capture on the meta device at the same batch size, compared event by event.
"""

from __future__ import annotations

import pytest

from oomtune.alloc.stream import AllocationStream
from oomtune.plan import predictor as P
from oomtune.plan.derive import AffineStreamModel
from oomtune.workload_spec import WorkloadSpec

WORKLOADS = {
    "mlp": {"name": "mlp", "in_features": 64, "hidden": 128, "layers": 2, "num_classes": 10,
            "optimizer": "sgd"},
    "resnet": {"name": "resnet", "depth": 18, "image_size": 32, "num_classes": 10, "optimizer": "sgd"},
    "transformer": {"name": "transformer", "layers": 1, "d_model": 64, "heads": 2, "seq_len": 32,
                    "vocab_size": 256, "dropout": 0.0, "optimizer": "adamw"},
}


def _stream(b: int, *, weight: int = 4096, act_per_sample: int = 3 * 1000, extra: int = 0) -> AllocationStream:
    """weight (fixed), activation (b * act_per_sample + 512), free activation, grad (fixed)."""
    s = AllocationStream()
    s.append_alloc(1, weight)
    s.append_alloc(2, b * act_per_sample + 512 + extra)
    s.append_free(2)
    s.append_alloc(3, weight)
    return s


def _first_difference(a: AllocationStream, b: AllocationStream) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"event {i}: derived {x}, captured {y}"
    return f"lengths {len(a)} vs {len(b)}"


# -- the model on hand-made streams -----------------------------------------------------------------
def test_fit_and_derive_by_hand():
    model = AffineStreamModel.fit({b: _stream(b) for b in (2, 8, 32)})
    assert model is not None and (model.low, model.high) == (2, 32)
    d = model.derive(5)
    # activation: 5 * 3000 + 512 = 15512 bytes; its free carries the same size
    assert list(d) == [("alloc", 1, 4096, 0), ("alloc", 2, 15512, 0), ("free", 2, 15512, 0),
                       ("alloc", 3, 4096, 0)]
    assert d == _stream(5) and d.live_keys == [1, 3] and d.peak_live_bytes() == 4096 + 15512


def test_derive_refuses_outside_the_captured_range():
    model = AffineStreamModel.fit({b: _stream(b) for b in (2, 8, 32)})
    assert model.covers(2) and model.covers(32) and not model.covers(1) and not model.covers(33)
    with pytest.raises(ValueError, match="outside the captured range"):
        model.derive(64)


def test_no_fit_with_two_captures():
    assert AffineStreamModel.fit({2: _stream(2), 32: _stream(32)}) is None


def test_no_fit_when_the_middle_capture_is_off_the_line():
    # sizes at 2 and 32 define the line; at 8 the activation is 1 byte larger than the line says
    assert AffineStreamModel.fit({2: _stream(2), 8: _stream(8, extra=1), 32: _stream(32)}) is None


def test_no_fit_for_a_fractional_slope():
    # activation sizes 1000 at b=1 and 1001 at b=3: slope 1/2 byte per sample is not an integer
    s = {b: AllocationStream([("alloc", 1, size)]) for b, size in ((1, 1000), (2, 1000), (3, 1001))}
    assert AffineStreamModel.fit(s) is None


def test_no_fit_when_the_events_differ():
    other = _stream(8)
    other.append_free(1)  # one more event at batch 8
    assert AffineStreamModel.fit({2: _stream(2), 8: other, 32: _stream(32)}) is None
    swapped = AllocationStream([("alloc", 1, 4096), ("alloc", 2, 8 * 3000 + 512), ("free", 1),
                                ("alloc", 3, 4096)])  # frees the weight instead of the activation
    assert AffineStreamModel.fit({2: _stream(2), 8: swapped, 32: _stream(32)}) is None


def test_fit_polynomial_by_hand():
    from oomtune.plan.derive import fit_polynomial

    assert fit_polynomial((1, 2, 3, 4), (3, 5, 7, 9)) == (1, (1, 2), 1)             # 2b + 1
    assert fit_polynomial((1, 2, 3, 4), (1, 4, 9, 16)) == (2, (0, 0, 1), 1)         # b^2
    assert fit_polynomial((2, 4, 6), (1, 3, 6)) == (2, (0, 2, 1), 8)                # (b^2 + 2b) / 8
    assert fit_polynomial((5, 9), (7, 7)) == (0, (7,), 1)


def test_a_quadratic_request_needs_five_captures_and_derives_exactly():
    from oomtune.plan.derive import PolynomialStreamModel

    def quad(b):   # a [b, b] float32 similarity matrix: 4 * b * b bytes
        return AllocationStream([("alloc", 1, 4096), ("alloc", 2, 4 * b * b), ("free", 2)])

    model, why, degree = PolynomialStreamModel.fit_or_why({b: quad(b) for b in (2, 5, 9, 16)})
    assert model is None and degree == 2 and "needs 5 to be fitted, checked and verified" in why
    model = PolynomialStreamModel.fit({b: quad(b) for b in (2, 5, 9, 12, 16)})
    assert model.degree == 2
    assert model.derive(7) == quad(7)            # 196 bytes
    assert list(model.derive(7))[1] == ("alloc", 2, 196, 0)


def test_a_derived_size_that_is_not_whole_is_not_derived():
    from oomtune.plan.derive import PolynomialStreamModel

    # b * b / 2 bytes at even batch sizes: a polynomial of degree 2, but 4.5 bytes at batch 3
    streams = {b: AllocationStream([("alloc", 1, b * b // 2)]) for b in (2, 4, 6, 8, 10)}
    model = PolynomialStreamModel.fit(streams)
    assert model is not None and model.derive(4) == streams[4]
    assert model.derive(3) is None


# -- the built-in workloads: derived == captured, event by event --------------------------------------
@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_derived_streams_equal_real_captures_for_builtin_workloads(name):
    cfg = WORKLOADS[name]
    model = AffineStreamModel.fit({b: P.capture_training_stream(cfg, b)[0] for b in (2, 9, 33)})
    assert model is not None, f"{name}: request sizes not affine in the batch size"
    for b in (3, 16, 24):
        captured, _ = P.capture_training_stream(cfg, b)
        derived = model.derive(b)
        assert derived == captured, f"{name} batch {b}: {_first_difference(derived, captured)}"
        assert derived.live_keys == captured.live_keys


# -- the predictor: anchors, spot check, fallback -----------------------------------------------------
GEOMETRY = {"total_memory_bytes": 1 << 30, "memory_fraction": 1.0}


def _fake_capture(monkeypatch, make):
    calls = []

    def capture(model_cfg, batch_size, **kwargs):
        calls.append(batch_size)
        return make(batch_size), None

    monkeypatch.setattr(P, "capture_training_stream", capture)
    return calls


def test_predictor_captures_anchors_and_one_verification_then_derives(monkeypatch):
    calls = _fake_capture(monkeypatch, _stream)
    pred = P.Predictor(WorkloadSpec.from_dict({"name": "fake"}), GEOMETRY)
    pred.prepare([8, 16, 32, 64, 128])
    # the smallest two, the median and the largest; affine needs 1 + 2 + 1 = 4 captures: no more
    assert sorted(calls) == [8, 16, 32, 128]
    for b in (16, 64, 100, 17):
        assert pred.stream(b) == _stream(b)
    assert sorted(calls) == [8, 16, 32, 128]          # 64, 100, 17 derived
    assert pred.derived_batches == [64, 100, 17]
    assert pred.captures == 4 and pred.derivation_note is None
    pred.stream(256)                                  # outside the captured range: captured
    assert calls[-1] == 256 and pred.captures == 5


def test_predictor_derives_a_quadratic_term_after_one_more_capture(monkeypatch):
    # a [b, b] request (b * b * 4 bytes) besides the affine ones: degree 2 needs 2 + 2 + 1 = 5 captures
    calls = _fake_capture(monkeypatch, lambda b: _stream(b, extra=4 * b * b))
    pred = P.Predictor(WorkloadSpec.from_dict({"name": "fake"}), GEOMETRY)
    pred.prepare([8, 16, 32, 64, 128])
    # the first round, then the one requested size left inside the range: 64
    assert sorted(calls[:4]) == [8, 16, 32, 128] and calls[4:] == [64]
    for b in (9, 24, 100):
        assert pred.stream(b) == _stream(b, extra=4 * b * b)
    assert len(calls) == 5 and pred.derived_batches == [b for b in (9, 24, 100) if b not in calls]


def test_predictor_captures_a_batch_size_that_makes_other_requests_alone(monkeypatch):
    # at batch 1 the step skips a copy (a size-1 dimension keeps a tensor contiguous): one alloc/free fewer
    def make(b):
        s = _stream(b)
        if b > 1:
            s.append_alloc(4, 64 * b)
            s.append_free(4)
        return s

    calls = _fake_capture(monkeypatch, make)
    pred = P.Predictor(WorkloadSpec.from_dict({"name": "fake"}), GEOMETRY)
    pred.prepare([1, 2, 4, 8, 16, 32, 64])
    assert pred.stream(1) == make(1) and pred.stream(3) == make(3) and pred.stream(50) == make(50)
    # 1, 2, 8, 64 first; the regime 2..64 then has 3 captures and needs a 4th: 32 (farthest from 2, 8, 64)
    assert sorted(calls) == [1, 2, 8, 32, 64]
    assert pred.derived_batches == [3, 50]
    assert pred.derivation_note == ("the step makes other requests at batch 1 than at 2: batch sizes between "
                                    "them are captured")


def test_predictor_without_a_polynomial_fit_captures_everything_and_says_why(monkeypatch):
    calls = _fake_capture(monkeypatch, lambda b: _stream(b, extra=b * b * b))  # cubic term
    pred = P.Predictor(WorkloadSpec.from_dict({"name": "fake"}), GEOMETRY)
    pred.prepare([8, 16, 32, 64, 128])
    for b in (20, 64):
        assert pred.stream(b) == _stream(b, extra=b * b * b)
    assert 20 in calls and 64 in calls and pred.derived_batches == []
    assert "are not a polynomial of degree <= 2 in the batch size" in pred.derivation_note
    assert pred.derivation_note.startswith("batch 8..128 not derived (request #1's sizes (")


def test_a_capture_that_differs_from_its_derivation_turns_derivation_off(monkeypatch):
    from oomtune.plan.derive import StreamDeriver

    d = StreamDeriver()
    for b in (8, 16, 32, 128):
        assert d.add(b, _stream(b))
    assert d.derive(64) == _stream(64)
    assert not d.add(64, _stream(64, extra=1))         # one byte more than the line says
    assert d.derive(100) is None and "differs from its capture" in d.notes()[0]


def test_predictor_derive_false_captures_every_batch(monkeypatch):
    calls = _fake_capture(monkeypatch, _stream)
    pred = P.Predictor(WorkloadSpec.from_dict({"name": "fake"}), GEOMETRY, derive=False)
    pred.prepare([8, 16, 32, 64])
    for b in (8, 16, 32, 64):
        pred.stream(b)
    assert calls == [8, 16, 32, 64] and pred.derived_batches == []


# -- a whole plan: identical with and without derivation ----------------------------------------------
def test_plan_with_derived_streams_equals_plan_capturing_every_batch(monkeypatch):
    from oomtune.plan.feasibility import build_plan, grid_batches

    for key in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(key, raising=False)
    cfg = WORKLOADS["resnet"]
    settings = [{}, {"expandable_segments": True}, {"max_split_size_mb": 20, "roundup_power2_divisions": 4}]
    geometry = {"total_memory_bytes": 172 << 20, "memory_fraction": 1.0}  # 160 MiB at 32, 186 at 64
    grid = grid_batches(4, 64)
    maps = {}
    for derive in (True, False):
        pred = P.Predictor(WorkloadSpec.from_dict(cfg), geometry, derive=derive)
        fmap = build_plan(pred, settings, grid, workload=cfg, device={"kind": "cpu"})
        maps[derive] = (fmap, pred)
    with_d, without = maps[True][0].to_dict(), maps[False][0].to_dict()
    assert with_d["configurations"] == without["configurations"]
    assert maps[True][1].derived_batches, "nothing was derived: the test does not exercise derivation"
    assert maps[True][0].captures < maps[False][0].captures
    assert {c["max_batch_size"] for c in with_d["configurations"]} - set(grid), "no bisection happened"


def test_transformer_plan_from_batch_1_with_derived_streams_equals_capturing_every_batch(monkeypatch):
    """The built-in transformer's step makes other requests at batch 1 (captured alone);
    2..64 are derived from polynomial fits; the map equals the one that captures every batch size."""
    from oomtune.plan.feasibility import build_plan, grid_batches

    for key in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(key, raising=False)
    cfg = {"name": "transformer", "layers": 2, "d_model": 64, "heads": 4, "seq_len": 96, "vocab_size": 512,
           "dropout": 0.0, "optimizer": "adamw", "precision": "bf16"}
    settings = [{}, {"expandable_segments": True}, {"max_split_size_mb": 20}]
    geometry = {"total_memory_bytes": 90 << 20, "memory_fraction": 1.0}   # 76 MiB at 48, 100 at 64 (fused SDPA)
    grid = grid_batches(1, 64)
    maps = {}
    for derive in (True, False):
        pred = P.Predictor(WorkloadSpec.from_dict(cfg), geometry, steps=4, derive=derive)
        maps[derive] = (build_plan(pred, settings, grid, workload=cfg, device={"kind": "cpu"}).to_dict(), pred)
    assert maps[True][0]["configurations"] == maps[False][0]["configurations"]
    pred = maps[True][1]
    assert pred.derived_batches and pred.captures <= 6 < maps[False][1].captures
    assert "other requests at batch 1 than at 2" in pred.derivation_note
    assert {c["max_batch_size"] for c in maps[True][0]["configurations"]} - set(grid), "no bisection happened"


# -- garbage_collection_threshold: replays shared only where the threshold provably never acts ----------
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_gc_threshold_predictions_equal_fresh_replays(monkeypatch, fraction):
    from oomtune.alloc.settings import AllocatorSettings
    from oomtune.alloc.stream import replay_stream

    for key in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(key, raising=False)
    cfg = WORKLOADS["resnet"]
    geometry = {"total_memory_bytes": 340 << 20, "memory_fraction": fraction}
    pred = P.Predictor(WorkloadSpec.from_dict(cfg), geometry)
    shared = 0
    for b in (4, 32, 64, 128):
        for conf in ("", "garbage_collection_threshold:0.6", "garbage_collection_threshold:0.95"):
            got = pred.predict_detail(b, conf)
            stream = pred.stream(b)
            bounded = replay_stream(stream, conf, **geometry)
            peaks = bounded if not bounded.oom else replay_stream(
                stream, conf, total_memory_bytes=max(P.unbounded_capacity_bytes(stream), 340 << 20))
            assert (got.fits, got.num_alloc_retries, got.peak_reserved_bytes, got.peak_allocated_bytes,
                    got.fragmentation) == (not bounded.oom, bounded.num_alloc_retries,
                                           peaks.peak_reserved_bytes, peaks.peak_allocated_bytes,
                                           peaks.fragmentation), (b, conf)
            key = AllocatorSettings.parse(conf).render()
            shared += conf != "" and pred._replays[(b, key)][0] is pred._replays[(b, "")][0]
    # 170 MiB at 0.5 x 340 MiB: batch 4 (152 MiB) peaks below 0.95 x 170 MiB, so it is shared
    assert shared >= 1


# -- steps 3.. repeat step 2 (repeat_steady_step) ---------------------------------------------------------
def test_repeat_steady_step_by_hand():
    from oomtune.plan.derive import repeat_steady_step

    s = AllocationStream()
    s.append_alloc(1, 4096)        # step 1: the parameter (stays)
    s.append_alloc(2, 512)         # step 2: an activation, freed inside the step
    s.append_free(2)
    out = repeat_steady_step(s, 1, 2)
    # step 2's keys {2} shifted past every key in use: shift = max key 2 + 1 - min step key 2 = 1
    assert list(out) == [("alloc", 1, 4096, 0), ("alloc", 2, 512, 0), ("free", 2, 512, 0),
                         ("alloc", 3, 512, 0), ("free", 3, 512, 0), ("alloc", 4, 512, 0), ("free", 4, 512, 0)]
    assert list(s) == [("alloc", 1, 4096, 0), ("alloc", 2, 512, 0), ("free", 2, 512, 0)]   # not modified
    assert repeat_steady_step(s, 1, 0) is s


def test_repeat_steady_step_refuses_a_step_that_is_not_self_contained():
    from oomtune.plan.derive import repeat_steady_step

    frees_earlier = AllocationStream([("alloc", 1, 4096), ("alloc", 2, 512), ("free", 1)])
    assert repeat_steady_step(frees_earlier, 1, 2) is None     # step 2 frees step 1's allocation
    leaves_live = AllocationStream([("alloc", 1, 4096), ("alloc", 2, 512)])
    assert repeat_steady_step(leaves_live, 1, 2) is None       # step 2's allocation outlives it


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_four_steps_from_two_captured_equal_four_captured(name, monkeypatch):
    """The reference: capturing all 4 steps on meta (repetition switched off)."""
    import oomtune.plan.derive as D

    repeated, _ = P.capture_training_stream(WORKLOADS[name], 8, steps=4)
    monkeypatch.setattr(D, "repeat_steady_step", lambda stream, start, times: None)
    captured, _ = P.capture_training_stream(WORKLOADS[name], 8, steps=4)
    assert len(repeated) == len(captured)
    assert repeated.actions == captured.actions
    assert repeated.sizes == captured.sizes
    assert repeated.streams == captured.streams
    # the same pairing of frees with allocations (keys may be numbered differently)
    def pairing(s):
        at = {}
        out = []
        for i, (a, k) in enumerate(zip(s.actions, s.keys)):
            if a == 0:
                at[k] = i
            else:
                out.append(at.pop(k))
        return out
    assert pairing(repeated) == pairing(captured)
