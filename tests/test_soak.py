"""Shape distributions and the virtual-GPU soak.

Expected figures are hand calculations (the hand-checkable soak below, the token-file documents)
or a live virtual-GPU trial of the same steps; the variable-length case asserts qualitative facts.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from oomtune.alloc.sim import CachingAllocatorSim
from oomtune.alloc.stream import AllocationStream
from oomtune.capture import VirtualGPU
from oomtune.exceptions import ConfigError
from oomtune.trial.soak import SoakStreams, replay_soak, soak
from oomtune.trial.child import run_child
from oomtune.trial.record import TrialSpec
from oomtune.workloads import build_workload
from oomtune.workloads.shapes import at_shape, shape_distribution, worst_shapes

MiB = 1 << 20

SMALL_LM = {"name": "transformer", "layers": 2, "d_model": 64, "heads": 2, "vocab_size": 512, "dropout": 0.0,
            "optimizer": "adamw", "lr": 3e-4, "precision": "fp32", "seq_len": {"low": 16, "high": 128},
            "data": {"source": "synthetic"}}
MULTI_SCALE = {"name": "resnet", "depth": 18, "image_size": [32, 48, 64], "num_classes": 10,
               "optimizer": "sgd", "lr": 0.1, "precision": "fp32", "data": {"source": "synthetic"}}


# ------------------------------------------------------------------------------- distributions
def test_uniform_range_is_seeded_padded_and_bounded():
    cfg = {"name": "transformer", "seq_len": {"low": 10, "high": 100, "pad_multiple": 8, "seed": 3}}
    dist = shape_distribution(cfg)
    seq = dist.sequence(4, 300)
    assert seq == shape_distribution(cfg).sequence(4, 300)           # same run after run
    assert seq != shape_distribution({**cfg, "seq_len": {**cfg["seq_len"], "seed": 4}}).sequence(4, 300)
    assert all(v % 8 == 0 and 16 <= v <= 104 for v in seq)          # 10 rounds up to 16, 100 to 104
    assert dist.max_shape == 104 and worst_shapes(cfg) == [104]
    assert len(set(seq)) > 5


def test_token_file_documents_padded_per_batch(tmp_path):
    # EOS = 0. Documents (each ending with, and counting, its EOS): [5 6 0] [7 0] [1 2 3 4 0] [0] [9 9]
    path = tmp_path / "train.bin"
    np.array([5, 6, 0, 7, 0, 1, 2, 3, 4, 0, 0, 9, 9], dtype="<u2").tofile(path)
    cfg = {"name": "transformer",
           "seq_len": {"tokens": str(path), "eos_token": 0, "max": 4, "pad_multiple": 1, "seed": 0}}
    dist = shape_distribution(cfg)
    assert dist.lengths.tolist() == [3, 2, 4, 1, 2]                  # 5 truncated to max=4
    order = np.random.default_rng(0).permutation(5)                 # the documented order
    lengths = np.array([3, 2, 4, 1, 2])
    expected = [int(lengths[order[0:2]].max()), int(lengths[order[2:4]].max())]
    assert dist.sequence(2, 2) == expected                          # batch maxima: dynamic padding
    assert worst_shapes(cfg) == [4]


def test_token_file_path_is_made_absolute_for_trials(tmp_path):
    from oomtune.targets import resolve_workload

    cfg = {"name": "transformer", "seq_len": {"tokens": "data/train.bin", "eos_token": 0, "max": 8}}
    out = resolve_workload(cfg, cwd=tmp_path)
    assert out["seq_len"]["tokens"] == str((tmp_path / "data/train.bin").resolve())
    assert cfg["seq_len"]["tokens"] == "data/train.bin"   # the input is not changed


def test_multi_scale_images_and_bad_spellings():
    dist = shape_distribution(MULTI_SCALE)
    seq = dist.sequence(8, 200)
    assert set(seq) == {32, 48, 64} and dist.max_shape == 64
    assert worst_shapes(MULTI_SCALE, 2) == [64, 48]
    assert shape_distribution({"name": "resnet", "image_size": 64}).is_fixed
    for bad in ({"low": 64}, {"low": 9, "high": 8}, {"low": 8, "high": 9, "typo": 1}, [64, 128]):
        with pytest.raises(ConfigError, match="model.seq_len"):
            shape_distribution({"name": "transformer", "seq_len": bad})
    with pytest.raises(ConfigError, match="model.image_size"):
        shape_distribution({"name": "resnet", "image_size": [64, 4]})


def test_variable_shapes_need_synthetic_data(tmp_path):
    path = tmp_path / "t.bin"
    np.zeros(64, dtype="<u2").tofile(path)
    cfg = {**SMALL_LM, "data": {"source": "tokens", "path": str(path)}}
    with pytest.raises(ConfigError, match="synthetic"):
        build_workload(cfg, 2, "cpu")


def test_worst_shape_workload_keeps_the_parameters():
    worst = at_shape(SMALL_LM, worst_shapes(SMALL_LM)[0])
    assert shape_distribution(worst).is_fixed
    a, b = build_workload(SMALL_LM, 2, "meta"), build_workload(worst, 2, "meta")
    assert [p.shape for p in a.model.parameters()] == [p.shape for p in b.model.parameters()]


# ------------------------------------------------------------------------------- the soak
def _live_per_step(cfg, batch, steps):
    """(allocated, reserved, peak allocated, peak reserved) after each step of a live virtual-GPU
    run on the CPU, as a CPU trial runs it (register what exists, then the workload's batches; the
    default GPU's cuBLAS workspaces)."""
    sim = CachingAllocatorSim("", total_memory_bytes=1 << 40)
    wl = build_workload(cfg, batch, "cpu")
    out = []
    with VirtualGPU(sim, device="cpu", blas_workspaces="default") as vgpu:
        vgpu.register(wl.tensors_before_step())
        for _ in range(steps):
            wl.run_steps(1)
            st = sim.memory_stats()
            out.append((st["allocated_bytes.all.current"], st["reserved_bytes.all.current"],
                        st["allocated_bytes.all.peak"], st["reserved_bytes.all.peak"]))
    return out


@pytest.mark.parametrize("cfg, batch", [(SMALL_LM, 8), (MULTI_SCALE, 4)])
def test_soak_first_steps_equal_a_live_virtual_gpu_run(cfg, batch):
    live = _live_per_step(cfg, batch, 6)
    res = soak(cfg, batch, "", device_memory_bytes=1 << 40, steps=6, capture_device="cpu", record_steps=True)
    assert res.passed and res.steps_run == 6
    assert res.per_step == live
    # What persists between steps (parameters, optimizer state) is allocated once: after step 1
    # the allocated bytes return to the same figure after every step.
    assert len({a for a, _, _, _ in live[1:]}) == 1


def _stream(*events):
    return AllocationStream(list(events))


def test_hand_checkable_fragmentation_soak():
    """Default settings, a 60 MiB device; all requests > 10 MiB (segments of exactly their size).
    Step 1: A, B 24 MiB each (two segments, reserved 48), freed; P1 12 MiB takes the head of A
    (best fit, lowest address; split, 12 MiB free behind it), a temporary Y fills that 12, P2 takes
    the head of B (12 free behind it), Y is freed. P1, P2 persist: allocated 24, reserved 48, two
    free 12 MiB pieces. "small" steps (10 MiB) fit in a piece. The "big" step (20 MiB) fits in no
    piece, cudaMalloc would need 48 + 20 > 60, no segment is wholly free to release: out of memory
    at step 5 with reserved - allocated = 24 MiB >= the 20 MiB request (fragmentation)."""
    first = _stream(("alloc", 1, 24 * MiB), ("alloc", 2, 24 * MiB), ("free", 1), ("free", 2),
                    ("alloc", 3, 12 * MiB), ("alloc", 4, 12 * MiB), ("alloc", 5, 12 * MiB), ("free", 4))
    small = _stream(("alloc", 1, 10 * MiB), ("free", 1))
    big = _stream(("alloc", 1, 20 * MiB), ("free", 1))
    streams = SoakStreams(batch_size=1, shapes=["small", "small", "small", "small", "big", "small"],
                          first=first, steady={"small": small, "big": big}, fixed=False, shape_key="shape")
    res = replay_soak(streams, "", device_memory_bytes=60 * MiB)
    assert not res.passed and res.steps_run == 4 and res.failed_step == 5 and res.shape_at_failure == "big"
    assert (res.reserved_bytes, res.allocated_bytes, res.requested_bytes) == (48 * MiB, 24 * MiB, 20 * MiB)
    assert res.fragmentation_failure
    assert "soak step 5/6 (shape=big)" in res.message and "fragmentation" in res.message
    # With 68 MiB the big step gets its own 20 MiB segment and everything passes.
    ok = replay_soak(streams, "", device_memory_bytes=68 * MiB)
    assert ok.passed and ok.steps_run == 6 and ok.peak_reserved_bytes == 68 * MiB


def test_fixed_shapes_stop_early_once_a_step_repeats_itself():
    cfg = {**MULTI_SCALE, "image_size": 32}
    res = soak(cfg, 2, "", device_memory_bytes=1 << 40, steps=2000, capture_device="meta")
    assert res.passed and res.steps_run == 2000 and res.distinct_shapes == 1
    assert res.converged_at is not None and res.converged_at < 10


# A variable-length case (found by experiments/find_soak_case.py --capture meta): the built-in
# transformer, small; padded lengths 64..512 in buckets of 64; batch 4; a 76 MiB device (the capture
# runs an A100's kernels: memory-efficient attention for fp32; with meta's math attention it was 100 MiB).
VARIABLE_LM = {"name": "transformer", "layers": 2, "d_model": 64, "heads": 2, "vocab_size": 2048,
               "dropout": 0.0, "optimizer": "adamw", "lr": 3e-4, "precision": "fp32",
               "seq_len": {"low": 64, "high": 512, "pad_multiple": 64, "seed": 0}}


@pytest.mark.usefixtures("no_cublas_workspaces")   # a hand-sized device of a few MiB
def test_default_fails_the_soak_after_the_measured_steps_and_expandable_survives():
    from oomtune.trial.soak import capture_soak

    streams = capture_soak(VARIABLE_LM, 4, 2000, capture_device="meta")
    default = replay_soak(streams, "", device_memory_bytes=76 * MiB)
    assert not default.passed
    assert default.failed_step > 4                      # the trial's 4 live steps pass
    assert default.cached_unused_bytes >= default.requested_bytes   # fragmentation
    assert f"soak step {default.failed_step}/2000" in default.message
    expandable = replay_soak(streams, "expandable_segments:True", device_memory_bytes=76 * MiB)
    assert expandable.passed and expandable.steps_run == 2000
    assert expandable.peak_reserved_bytes <= 76 * MiB


def test_skipping_repeated_steps_changes_nothing(monkeypatch):
    """The soak skips a step that would repeat one exactly (same start state and shape, which
    returned to its start state); a full replay of every step gives the same figures step by step."""
    import oomtune.trial.soak as soak_module
    from oomtune.trial.soak import capture_soak

    streams = capture_soak(VARIABLE_LM, 4, 300, capture_device="meta")
    for conf, capacity in (("", 1 << 40), ("", 80 * MiB), ("expandable_segments:True", 76 * MiB)):
        fast = replay_soak(streams, conf, device_memory_bytes=capacity, record_steps=True)
        with monkeypatch.context() as m:
            m.setattr(soak_module, "_memo_allowed", lambda sim: False)
            full = replay_soak(streams, conf, device_memory_bytes=capacity, record_steps=True)
        assert full.steps_skipped == 0
        assert fast.per_step == full.per_step
        assert (fast.passed, fast.failed_step, fast.reserved_bytes, fast.allocated_bytes, fast.peak_reserved_bytes) \
            == (full.passed, full.failed_step, full.reserved_bytes, full.allocated_bytes, full.peak_reserved_bytes)
    assert replay_soak(streams, "", device_memory_bytes=1 << 40).steps_skipped > 200   # it does skip


def test_rounded_sizes_are_derived_and_a_rounding_the_anchors_hide_is_caught():
    """Sizes linear in the length rounded up to a block (the fused attention kernels' logsumexp and
    workspaces) are derived exactly; when the anchors and the first check are all multiples
    of the block (128 here) a quadratic would fit them, so the length with the fewest factors of two
    is captured as well and rules it out."""
    from oomtune.alloc.stream import AllocationStream
    from oomtune.trial._soak_derive import derive_shape_streams

    def stream(t: int) -> AllocationStream:
        s = AllocationStream()
        s.append_alloc(1, 4 * t * t + 8 * t, 0)               # quadratic
        s.append_alloc(2, 4 * 2 * (-(-t // 128) * 128), 0)    # logsumexp-like, block 128
        s.append_free(1, 0)
        s.append_free(2, 0)
        return s

    shapes = [128, 256, 384, 512, 640, 768, 896, 1024, 1152, 136]   # 136: the one odd length
    got, made = derive_shape_streams(shapes, stream)
    assert made == 5 and all(got[t] == stream(t) for t in shapes)
    even = [128 * k for k in range(1, 10)]
    got, made = derive_shape_streams(even, stream)
    assert made == 4 and all(got[t] == stream(t) for t in even)


def test_derived_shape_streams_equal_captured_ones():
    """Three captures (plus a check) derive the other lengths' streams of the transformer exactly;
    ResNet's convolution sizes are not polynomial in the image size, so every size is captured."""
    from oomtune.trial.soak import capture_soak

    derived = capture_soak(SMALL_LM, 4, 100, capture_device="meta")
    captured = capture_soak(SMALL_LM, 4, 100, capture_device="meta", derive=False)
    assert len(derived.steady) >= 10 and derived.captured_shapes == 4
    assert captured.captured_shapes == len(captured.steady)
    assert derived.steady == captured.steady and derived.first == captured.first
    multi = {**MULTI_SCALE, "image_size": [32, 40, 48, 56, 64, 72]}
    resnet = capture_soak(multi, 2, 60, capture_device="meta")
    assert resnet.captured_shapes == len(resnet.steady) == 6


# ------------------------------------------------------------------------------- in the trial
def _clear_alloc_env(monkeypatch):
    for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(k, raising=False)


@pytest.mark.usefixtures("no_cublas_workspaces")   # a hand-sized device of a few MiB
def test_trial_records_a_passing_soak(monkeypatch):
    _clear_alloc_env(monkeypatch)
    res = run_child(TrialSpec(workload=SMALL_LM, batch_size=4, device="cpu", budget_bytes=1 << 30,
                              warmup_steps=1, measure_steps=1, soak_steps=50))
    assert res.outcome == "ok", res.message
    assert res.soak.passed and res.soak.steps_run == 50 and res.soak.failed_step is None
    assert res.soak.peak_reserved_bytes >= res.memory.peak_reserved_bytes   # the soak includes the live steps


@pytest.mark.usefixtures("no_cublas_workspaces")   # a hand-sized device of a few MiB
def test_trial_worst_shapes_run_the_largest_shape(monkeypatch):
    _clear_alloc_env(monkeypatch)
    spec = dict(workload=SMALL_LM, batch_size=4, device="cpu", budget_bytes=1 << 30, warmup_steps=1,
                measure_steps=1)
    data, worst = run_child(TrialSpec(**spec)), run_child(TrialSpec(**spec, shapes="worst"))
    assert data.outcome == worst.outcome == "ok"
    # seq_len 128 (the largest) every step needs at least what the data order's steps needed
    assert worst.memory.peak_allocated_bytes >= data.memory.peak_allocated_bytes
    assert worst.memory.peak_allocated_bytes == max(x[2] for x in _live_per_step(at_shape(SMALL_LM, 128), 4, 2))


@pytest.mark.usefixtures("no_cublas_workspaces")   # a hand-sized device of a few MiB
@pytest.mark.skipif(os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), reason="needs torch's default allocator settings")
def test_trial_fails_on_the_soak_with_step_and_reason(monkeypatch):
    _clear_alloc_env(monkeypatch)
    res = run_child(TrialSpec(workload=VARIABLE_LM, batch_size=4, device="cpu", budget_bytes=CPU_CASE_BUDGET,
                              warmup_steps=1, measure_steps=3, soak_steps=2000))
    # The case was chosen as a fragmentation failure (experiments/find_soak_case.py; its scan,
    # experiments/results/find_soak_case_cpu.txt, records reserved - allocated 19.6 MiB >= the 14.0 MiB
    # request at 76 MiB, and expandable_segments surviving the same soak): the soak's class is
    # "oom_fragmentation" exactly when reserved - allocated >= the failing request (soak_verdict).
    assert res.outcome == "oom_fragmentation", res.message
    assert res.soak.passed is False and res.soak.failed_step > 4
    assert res.throughput.samples_per_s is not None    # the live steps ran and were measured
    assert f"soak step {res.soak.failed_step}/2000" in res.message
    assert res.soak.reserved_bytes - res.soak.allocated_bytes >= res.memory.oom_requested_bytes > 0


# With CPU capture (a CPU trial soaks the kernels it ran) the same model at batch 4 fails its soak
# on a 76 MiB virtual GPU (experiments/results/find_soak_case.txt records the scan).
CPU_CASE_BUDGET = 76 * MiB


# ------------------------------------------------------------------------------- compiled core
def test_soak_runs_on_the_compiled_core_with_the_python_simulators_results(monkeypatch):
    """The soak's virtual GPU is ``make_simulator``'s: the compiled core when built. Every
    figure of the soak (per step, at the failure, the OOM message) is the pure-Python simulator's:
    a passing and a failing (fragmentation) case, expandable segments, a memory fraction with
    garbage collection, max_split_size, and the trial's own virtual GPU (``budgeted_sim``)."""
    import dataclasses

    from oomtune.alloc import _compiled
    from oomtune.capture.virtual_gpu import budgeted_sim
    from oomtune.trial.soak import capture_soak

    if not _compiled.available():
        pytest.skip("the compiled core oomtune.alloc._fastcore is not built")
    streams = capture_soak(VARIABLE_LM, 4, 300, capture_device="meta")
    cases = [("", {"device_memory_bytes": 1 << 40}), ("", {"device_memory_bytes": 76 * MiB}),
             ("expandable_segments:True", {"device_memory_bytes": 76 * MiB}),
             ("garbage_collection_threshold:0.6", {"device_memory_bytes": 400 * MiB, "memory_fraction": 0.25}),
             ("max_split_size_mb:20", {"device_memory_bytes": 110 * MiB, "non_allocator_bytes": 5 * MiB}),
             ("", {"new_sim": lambda: budgeted_sim("", 76 * MiB, 1 << 30)})]
    failed = 0
    for conf, kw in cases:
        got = {}
        for pure in ("1", "0"):
            monkeypatch.setenv("OOMTUNE_PURE_PYTHON", pure)
            kind = type(kw["new_sim"]() if "new_sim" in kw else _compiled.make_simulator(
                conf, total_memory_bytes=kw["device_memory_bytes"])).__name__
            assert kind == ("CachingAllocatorSim" if pure == "1" else "FastSim")
            d = dataclasses.asdict(replay_soak(streams, conf, record_steps=True, **kw))
            d.pop("replay_s")
            got[pure] = d
        assert got["0"] == got["1"], conf
        failed += not got["0"]["passed"]
    assert failed >= 2   # the 76 MiB default cases run out of memory (see the test above)
