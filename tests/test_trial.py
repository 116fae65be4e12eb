"""The trial process (oomtune.trial.child) in-process, and the budget math (oomtune.trial.budget).

Expected values come from field case C9 (hand arithmetic shown) and from the workload's own
definition (parameter counts of the tiny MLP), never from running the code under test.
"""

from __future__ import annotations

import pytest

from oomtune.exceptions import DeviceError
from oomtune.trial import child
from oomtune.trial.budget import (
    allowed_allocator_bytes,
    device_peak_bound_bytes,
    memory_fraction_for_budget,
    non_allocator_bytes,
)
from oomtune.trial.record import ResultDraft, StoppedOverLimit, TrialResult, TrialSpec
from oomtune.units import MiB

# ------------------------------------------------------------------ budget math, field case C9
# A 10,989 MB card (nvidia-smi's "MB" are MiB); fraction 0.5 allows 5,494.5 MiB, yet nvidia-smi showed
# 6,509 MiB for the process: 6,509 - 5,494.5 = 1,014.5 MiB outside the allocator (~1 GB context).
C9_TOTAL = 10_989 * MiB
C9_NON_ALLOC = 6_509 * MiB - (10_989 * MiB) // 2   # 1,014.5 MiB = 1,063,780,352 bytes
C9_BUDGET = (10_989 * MiB) // 2                    # the budget the user meant: 5,494.5 MiB


def test_c9_fraction_half_allows_half_the_card():
    # floor(0.5 * 10,989 MiB) = 5,494.5 MiB = 5,761,400,832 bytes.
    assert allowed_allocator_bytes(0.5, C9_TOTAL) == 5_761_400_832


def test_c9_naive_fraction_overshoots_to_the_observed_6509_mib():
    # 5,494.5 MiB + 1,014.5 MiB = 6,509 MiB: what nvidia-smi showed in the field.
    assert device_peak_bound_bytes(0.5, C9_TOTAL, C9_NON_ALLOC) == 6_509 * MiB


def test_c9_corrected_fraction_keeps_the_device_peak_within_the_budget():
    f = memory_fraction_for_budget(C9_BUDGET, C9_TOTAL, C9_NON_ALLOC)
    # (5,494.5 - 1,014.5) / 10,989 = 4,480 / 10,989
    assert f == pytest.approx(4_480 / 10_989, rel=1e-12)
    assert device_peak_bound_bytes(f, C9_TOTAL, C9_NON_ALLOC) <= C9_BUDGET
    # and nothing is wasted beyond float rounding (one byte)
    assert C9_BUDGET - device_peak_bound_bytes(f, C9_TOTAL, C9_NON_ALLOC) <= 1


def test_non_allocator_is_total_minus_free_minus_reserved():
    # 10,989 MiB card, 4,480 MiB free, 5,494 MiB reserved -> 1,015 MiB outside the allocator.
    assert non_allocator_bytes(C9_TOTAL, 4_480 * MiB, 5_494 * MiB) == 1_015 * MiB
    assert non_allocator_bytes(100, 60, 50) == 0          # clamped: never negative
    with pytest.raises(ValueError):
        non_allocator_bytes(100, 120, 0)


def test_budget_above_the_device_or_below_the_context_is_a_device_error():
    with pytest.raises(DeviceError, match="exceeds"):
        memory_fraction_for_budget(C9_TOTAL + 1, C9_TOTAL, C9_NON_ALLOC)
    with pytest.raises(DeviceError, match="outside the caching allocator"):
        memory_fraction_for_budget(C9_NON_ALLOC, C9_TOTAL, C9_NON_ALLOC)


def test_whole_device_budget_still_subtracts_the_context():
    f = memory_fraction_for_budget(C9_TOTAL, C9_TOTAL, C9_NON_ALLOC)
    assert f == pytest.approx((10_989 - 1_014.5) / 10_989, rel=1e-12)


# ------------------------------------------------------------------ the trial process, in-process
# Tiny MLP: 64 -> 32 -> 10 (one hidden layer). Parameters: 64*32 + 32 + 32*10 + 10 = 2,410 floats
# = 9,640 bytes; every one of the 4 parameter tensors is a separate block of at least 512 bytes.
MLP = {"name": "mlp", "in_features": 64, "hidden": 32, "layers": 1, "num_classes": 10}



@pytest.fixture()
def clean_alloc_env(monkeypatch):
    for name in child.ALLOC_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv(child.TEST_HOOK_ENV, raising=False)


def _spec(**kw) -> TrialSpec:
    base = dict(workload=MLP, batch_size=4, device="cpu", budget_bytes=64 * MiB,
                warmup_steps=1, measure_steps=2, timeout_s=60)
    base.update(kw)
    return TrialSpec(**base)


def test_cpu_trial_is_ok_and_measured(clean_alloc_env):
    r = child.run_child(_spec())
    assert r.outcome == "ok", r.message
    assert r.memory.source == "simulated"
    assert r.throughput.samples_per_s is not None and r.throughput.samples_per_s > 0
    assert r.throughput.step_time_s is not None and r.throughput.step_time_s > 0
    assert r.throughput.steps == 3
    # parameters alone are 9,640 bytes in 4 tensors, each rounded to >= 512 B
    assert r.memory.peak_allocated_bytes is not None and r.memory.peak_allocated_bytes >= 9_640
    assert r.memory.peak_reserved_bytes >= r.memory.peak_allocated_bytes > 0
    assert 0.0 <= r.memory.fragmentation <= 1.0
    assert r.memory.num_ooms == 0
    assert r.startup_s is not None and r.startup_s >= 0
    assert 0.0 <= r.throughput.data_wait_fraction <= 1.0
    assert r.device is not None and r.device.kind == "cpu"


def test_cpu_trial_with_tiny_budget_ooms_inside_the_step(clean_alloc_env):
    # 1 MiB: the parameters (9,640 B, small pool: one 2 MiB segment) cannot even be placed.
    # Without device_memory_bytes the virtual GPU is the budget's size, fraction 1.0 (no "allowed"
    # figure in the message). The first parameter (64 x 32 fp32 = 8,192 B, small pool) asks the device
    # for a 2 MiB kSmallBuffer segment with 1 MiB free and nothing reserved: reserved - allocated = 0,
    # so not fragmentation; no fraction, so not the fraction cap: a plain "oom".
    r = child.run_child(_spec(budget_bytes=1 * MiB))
    assert r.outcome == "oom", r.message
    assert r.memory.source == "simulated"
    assert r.memory.num_ooms is not None and r.memory.num_ooms >= 1
    assert r.memory.oom_requested_bytes is not None and r.memory.oom_requested_bytes > 0
    assert r.throughput.samples_per_s is None          # never measured: None, not 0
    assert r.advice


@pytest.mark.usefixtures("no_cublas_workspaces")   # a hand-sized device of a few MiB
def test_oom_mid_training_raised_inside_a_step(clean_alloc_env):
    # Budget of 2 MiB (the virtual GPU's size, fraction 1.0). Before the step: the parameters
    # (256x64 + 256 + 10x256 + 10 floats: 65,536 + 1,024 + 10,240 + 512 B after rounding) and the static
    # batch (x: 2048 x 64 fp32 = 524,288 B; y: 2048 int64 = 16,384 B), all <= 1 MiB, fill 617,984 B of
    # one 2 MiB small-pool segment, which is the whole device. The step's first large request, the
    # hidden activation 2048 x 256 fp32 = 2 MiB (> kSmallSize 1 MiB), asks for a 20 MiB kLargeBuffer
    # segment with 0 B free: the OOM comes from the step. "Tried to allocate 20.00 MiB" is a request of
    # at most 10 MiB - 512 B, more than the 1.41 MiB reserved but unallocated: not fragmentation; no
    # fraction: a plain "oom".
    r = child.run_child(_spec(budget_bytes=2 * MiB, workload={**MLP, "hidden": 256}, batch_size=2048))
    assert r.outcome == "oom", r.message
    assert r.process.first_step_at is not None   # the step had started


def test_env_mismatch_is_an_error_before_anything_runs(clean_alloc_env, monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    r = child.run_child(_spec(alloc_conf="max_split_size_mb:128"))
    assert r.outcome == "error"
    assert r.message.startswith("allocator settings did not take effect")


def test_value_error_is_classified_error_with_traceback(clean_alloc_env, monkeypatch):
    monkeypatch.setenv(child.TEST_HOOK_ENV, "raise:ValueError")
    r = child.run_child(_spec())
    assert r.outcome == "error"
    assert "ValueError" in r.message
    assert r.traceback_tail and "raised by the test hook" in r.traceback_tail


def test_smaller_batch_succeeded_reaches_the_classifier(clean_alloc_env, monkeypatch):
    # Field case C1: the cuDNN-algorithm failure after smaller batches succeeded is a limit.
    import oomtune.trial.child as mod

    def boom(*a, **k):
        raise RuntimeError("Unable to find a valid cuDNN algorithm to run convolution")

    monkeypatch.setattr(mod, "_run_cpu", boom)
    assert mod.run_child(_spec(batch_size=256, smaller_batch_succeeded=True)).outcome == "limit"
    assert mod.run_child(_spec(batch_size=1)).outcome == "error"


def test_main_writes_a_record_and_exits_zero_even_for_oom(clean_alloc_env, tmp_path):
    spec_path, out = tmp_path / "spec.json", tmp_path / "result.json"
    spec_path.write_text(_spec(budget_bytes=1 * MiB).to_json())
    assert child.main([str(spec_path), str(out)]) == 0
    r = TrialResult.read(out)
    assert r.outcome == "oom", r.message   # as test_cpu_trial_with_tiny_budget_ooms_inside_the_step


def test_unreadable_spec_exits_2_with_an_error_record(tmp_path):
    spec_path, out = tmp_path / "spec.json", tmp_path / "result.json"
    spec_path.write_text("{not json")
    assert child.main([str(spec_path), str(out)]) == 2
    assert TrialResult.read(out).outcome == "error"


def test_verify_effective_reports_a_mismatch():
    r = ResultDraft(TrialResult(outcome="error"))
    snap = {"PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": 2**64 - 1, "expandable_segments": False,
            "backend": "native"}
    with pytest.raises(child.SettingsMismatchError, match="did not take effect: expected .*torch reports"):
        child._verify_effective(_spec(alloc_conf="expandable_segments:True"), r, snap)
    snap_ok = dict(snap, PYTORCH_CUDA_ALLOC_CONF="max_split_size_mb:128", max_split_size=128 * MiB)
    child._verify_effective(_spec(alloc_conf="max_split_size_mb:128"), r, snap_ok)   # no raise
    # torch/csrc/cuda/Module.cpp reports int64_t(SIZE_MAX) = -1 for the default (unlimited)
    child._verify_effective(_spec(alloc_conf=""), r, dict(snap, max_split_size=-1))  # no raise
    with pytest.raises(child.SettingsMismatchError, match="max_split_size"):
        child._verify_effective(_spec(alloc_conf="max_split_size_mb:128"), r,
                                dict(snap, PYTORCH_CUDA_ALLOC_CONF="max_split_size_mb:128", max_split_size=-1))
    # divisions: {"1": d0, "2": d1, ..., "32768": d15}; roundup_power2_divisions:4 sets all 16 to 4
    divs = {str(1 << i): 4 for i in range(16)}
    child._verify_effective(_spec(alloc_conf="roundup_power2_divisions:4"), r,
                            dict(snap, PYTORCH_CUDA_ALLOC_CONF="roundup_power2_divisions:4",
                                 roundup_power2_divisions=divs))
    with pytest.raises(child.SettingsMismatchError, match="roundup_power2_divisions"):
        child._verify_effective(_spec(alloc_conf="roundup_power2_divisions:4"), r,
                                dict(snap, PYTORCH_CUDA_ALLOC_CONF="roundup_power2_divisions:4",
                                     roundup_power2_divisions={str(1 << i): 0 for i in range(16)}))


# ------------------------------------------------------------------ stop once above the limit
def test_trial_stops_after_the_first_step_above_the_limit(clean_alloc_env):
    # Every block of the tiny MLP is < 1 MiB, so the small pool holds it in 2 MiB segments
    # (kSmallBuffer): after step 1 peak reserved is >= 2 MiB, above a 1 MiB limit. The peak can
    # only grow, so the remaining steps are not run (and no soak).
    r = child.run_child(_spec(warmup_steps=1, measure_steps=3, limit_bytes=1 * MiB, soak_steps=10))
    assert r.outcome == "ok", r.message
    assert r.throughput.steps == 1
    stop = r.stopped_over_limit
    assert stop.step == 1 and stop.limit_bytes == 1 * MiB
    assert stop.used_bytes >= 2 * MiB and r.memory.peak_reserved_bytes >= stop.used_bytes
    assert r.throughput.samples_per_s is None              # stopped in the warm-up: no measured step
    assert r.soak is None             # above the limit: not soaked


def test_trial_stopped_in_the_measured_steps_times_what_ran(clean_alloc_env):
    r = child.run_child(_spec(warmup_steps=0, measure_steps=3, limit_bytes=1 * MiB))
    assert r.throughput.steps == 1 and r.stopped_over_limit.step == 1
    assert r.throughput.samples_per_s is not None and r.throughput.samples_per_s > 0   # one measured step


def test_trial_within_the_limit_runs_every_step(clean_alloc_env):
    # 64 MiB is far above the 2 MiB small segment (and a 20 MiB large one, were one needed)
    r = child.run_child(_spec(warmup_steps=1, measure_steps=3, limit_bytes=64 * MiB))
    assert r.outcome == "ok" and r.throughput.steps == 4
    assert r.stopped_over_limit is None


def test_a_stopped_trial_violates_the_memory_constraint():
    from oomtune.study.records import MemoryLimit, violation
    from oomtune.trial.record import MemoryReadings, TrialResult

    limit = MemoryLimit(10 * MiB, 0.0)
    # a reading of 12 MiB at the stop, whatever the record's other figures say: (12 - 10) / 10
    res = TrialResult(outcome="ok", memory=MemoryReadings(peak_reserved_bytes=None),
                      stopped_over_limit=StoppedOverLimit(step=1, used_bytes=12 * MiB, limit_bytes=10 * MiB))
    assert violation(res, limit) == pytest.approx(0.2)
