"""The typed trial record (oomtune.trial.record.TrialResult): the Outcome enum, the nested sections
(memory, throughput, soak, and the typed sections that replaced the free ``extra`` mapping), the
checks made on construction, immutability, and reading records written before the sections existed
(the flat form kept in Optuna storages, tell.json and trial directories) or with an ``extra`` mapping."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import optuna
import pytest

from oomtune.outcome import Outcome
from oomtune.trial.record import (AllocatorSeen, BudgetReadings, DeviceInfo, DistributedInfo, EnvVar, ExecutionInfo,
                                  GpuKernelsTarget, KernelCount, KernelsRan, MemoryReadings, OomDetails, ProcessSeen,
                                  RankPeak, RetriedAfter, ScriptReports, SoakReadings, StoppedOverLimit, Throughput,
                                  TrialProcess, TrialResult)

DATA = Path(__file__).resolve().parent / "data" / "records"
MiB = 1 << 20


# ----------------------------------------------------------------------------- the outcome
def test_the_outcome_is_the_enum_whether_given_as_enum_or_as_its_string():
    assert TrialResult(outcome="oom").outcome is Outcome.OOM
    assert TrialResult(outcome=Outcome.OOM).outcome is Outcome.OOM
    res = dataclasses.replace(TrialResult(outcome=Outcome.ERROR), outcome="ok")   # a replace() is converted too
    assert res.outcome is Outcome.OK
    # messages and tables print the stored value, as they did when the field was a string
    assert f"{res.outcome}" == str(res.outcome) == "ok" and f"[{Outcome.HOST_OOM:>9}]" == "[ host_oom]"


@pytest.mark.parametrize("make", [
    lambda: TrialResult(outcome="out_of_memory"),
    lambda: dataclasses.replace(TrialResult(outcome="ok"), outcome="OK"),     # values are case-sensitive
    lambda: TrialResult.from_dict({"outcome": "finished"}),
])
def test_an_unknown_outcome_raises_naming_the_allowed_values(make):
    with pytest.raises(ValueError) as err:
        make()
    text = str(err.value)
    assert "unknown trial outcome" in text and "\n" not in text
    for value in ("ok", "oom", "oom_fragmentation", "fraction_cap", "host_oom", "predicted_infeasible"):
        assert value in text


# ----------------------------------------------------------------------------- checks on construction
@pytest.mark.parametrize("make, field", [
    (lambda: MemoryReadings(source="gpu"), "memory.source"),
    (lambda: MemoryReadings(peak_reserved_bytes=-1), "memory.peak_reserved_bytes"),
    (lambda: MemoryReadings(peak_allocated_bytes=1.5), "memory.peak_allocated_bytes"),
    (lambda: MemoryReadings(peak_active_bytes=True), "memory.peak_active_bytes"),
    (lambda: MemoryReadings(device_peak_bytes=-MiB), "memory.device_peak_bytes"),
    (lambda: MemoryReadings(non_allocator_bytes="300 MiB"), "memory.non_allocator_bytes"),
    (lambda: MemoryReadings(oom_requested_bytes=-2), "memory.oom_requested_bytes"),
    (lambda: MemoryReadings(num_alloc_retries=-1), "memory.num_alloc_retries"),
    (lambda: MemoryReadings(num_ooms=0.5), "memory.num_ooms"),
    (lambda: MemoryReadings(fragmentation=1.25), "memory.fragmentation"),
    (lambda: MemoryReadings(fragmentation=-0.01), "memory.fragmentation"),
    (lambda: MemoryReadings(fragmentation=float("nan")), "memory.fragmentation"),
    (lambda: Throughput(samples_per_s=-3.0), "throughput.samples_per_s"),
    (lambda: Throughput(step_time_s=-0.1), "throughput.step_time_s"),
    (lambda: Throughput(data_wait_fraction=1.5), "throughput.data_wait_fraction"),
    (lambda: Throughput(gpu_utilization=101.0), "throughput.gpu_utilization"),
    (lambda: Throughput(steps=-1), "throughput.steps"),
    (lambda: SoakReadings(passed="yes"), "soak.passed"),
    (lambda: SoakReadings(passed=True, failed_step=3), "soak.failed_step"),
    (lambda: SoakReadings(passed=False, steps_run=2), "soak.failed_step"),
    (lambda: SoakReadings(passed=False, failed_step=0), "soak.failed_step"),
    (lambda: SoakReadings(passed=True, steps_run=-5), "soak.steps_run"),
    (lambda: SoakReadings(passed=True, reserved_bytes=-1), "soak.reserved_bytes"),
    (lambda: SoakReadings(passed=True, allocated_bytes=2.0), "soak.allocated_bytes"),
    (lambda: SoakReadings(passed=True, peak_reserved_bytes=-1), "soak.peak_reserved_bytes"),
    (lambda: SoakReadings(passed=True, seconds=-1.0), "soak.seconds"),
    (lambda: TrialResult(outcome="ok", batch_size=0), "trial.batch_size"),
    (lambda: TrialResult(outcome="ok", wall_s=-1.0), "trial.wall_s"),
    (lambda: TrialResult(outcome="ok", startup_s=-0.5), "trial.startup_s"),
    (lambda: TrialResult(outcome="ok", memory={"peak_reserved_bytes": 1}), "memory"),
    (lambda: TrialResult(outcome="ok", throughput=812.5), "throughput"),
    (lambda: TrialResult(outcome="ok", soak=True), "soak"),
    (lambda: TrialResult(outcome="ok", process={"pid": 1}), "trial.process"),
    (lambda: TrialResult(outcome="ok", stopped_over_limit={"step": 1}), "trial.stopped_over_limit"),
    (lambda: TrialResult(outcome="ok", alloc_conf=None), "trial.alloc_conf"),
    (lambda: TrialResult(outcome="ok", message=3), "trial.message"),
    (lambda: TrialProcess(pid="4242"), "process.pid"),
    (lambda: TrialProcess(hung_after_record=1), "process.hung_after_record"),
    (lambda: TrialProcess(command=["python", "train.py"]), "process.command"),       # a tuple, not a list
    (lambda: TrialProcess(survivors=({"pid": 1},)), "process.survivors"),
    (lambda: TrialProcess(torch_threads=0), "process.torch_threads"),
    (lambda: ExecutionInfo(where="gpu"), "execution.where"),
    (lambda: ExecutionInfo(meta_step_s=-0.1), "execution.meta_step_s"),
    (lambda: BudgetReadings(memory_fraction=1.5), "budget.memory_fraction"),
    (lambda: BudgetReadings(memory_fraction=0), "budget.memory_fraction"),
    (lambda: BudgetReadings(non_allocator_bytes_at_start=-1), "budget.non_allocator_bytes_at_start"),
    (lambda: BudgetReadings(device_peaks=(1.5,)), "budget.device_peaks"),
    (lambda: AllocatorSeen(environment=(("A", "b"),)), "allocator.environment"),
    (lambda: DistributedInfo(world_size=0), "distributed.world_size"),
    (lambda: DistributedInfo(rank_pids=(1, "2")), "distributed.rank_pids"),
    (lambda: ScriptReports(reported=("[1, 2]",)), "script.reported"),
    (lambda: ScriptReports(memory_unknown=None), "script.memory_unknown"),
    (lambda: StoppedOverLimit(step=0, used_bytes=1, limit_bytes=1), "stopped_over_limit.step"),
    (lambda: StoppedOverLimit(step=1, used_bytes=-1, limit_bytes=1), "stopped_over_limit.used_bytes"),
    (lambda: OomDetails(requested_bytes="64 MiB"), "oom.requested_bytes"),
    (lambda: RetriedAfter(outcome="crash", returncode="-9"), "retried_after.returncode"),
    (lambda: SoakReadings(passed=True, distinct_shapes=-1), "soak.distinct_shapes"),
    (lambda: TrialResult(outcome="ok", ranks=[RankPeak(rank=0)]), "ranks"),
    (lambda: TrialResult(outcome="ok", worst_rank=-1), "trial.worst_rank"),
    (lambda: TrialResult(outcome="oom", failed_rank="1"), "trial.failed_rank"),
    (lambda: RankPeak(rank=-1), "ranks.rank"),
    (lambda: RankPeak(rank=None), "ranks.rank"),
    (lambda: RankPeak(rank=0, peak_reserved_bytes=-1), "ranks.peak_reserved_bytes"),
    (lambda: RankPeak(rank=0, peak_allocated_bytes=0.5), "ranks.peak_allocated_bytes"),
    (lambda: RankPeak(rank=0, device_peak_bytes=-1), "ranks.device_peak_bytes"),
    (lambda: RankPeak(rank=0, samples_per_s=-1.0), "ranks.samples_per_s"),
    (lambda: RankPeak(rank=0, step_time_s=-1.0), "ranks.step_time_s"),
    (lambda: RankPeak(rank=0, teardown=None), "ranks.teardown"),
    # a replace() constructs again, so a section cannot be changed into a bad state either
    (lambda: dataclasses.replace(MemoryReadings(), peak_reserved_bytes=-1), "memory.peak_reserved_bytes"),
    (lambda: dataclasses.replace(TrialResult(outcome="ok"), batch_size="8"), "trial.batch_size"),
    # and a stored record is checked as it is read
    (lambda: TrialResult.from_dict({"outcome": "ok", "peak_reserved_bytes": -1}), "memory.peak_reserved_bytes"),
    (lambda: TrialResult.from_dict({"outcome": "ok", "process": {"pid": "4242"}}), "process.pid"),
    (lambda: TrialResult.from_dict({"outcome": "ok", "budget": {"memory_fraction": "0.5"}}), "budget.memory_fraction"),
])
def test_each_check_refuses_a_bad_value_in_one_line_naming_the_field(make, field):
    with pytest.raises(ValueError) as err:
        make()
    text = str(err.value)
    assert text.startswith(field + " ") and "\n" not in text


def test_the_bounds_themselves_are_accepted():
    MemoryReadings(source="device", peak_reserved_bytes=0, fragmentation=0.0, num_ooms=0)
    MemoryReadings(fragmentation=1.0)
    Throughput(samples_per_s=0.0, step_time_s=0.0, data_wait_fraction=1.0, gpu_utilization=100.0, steps=0)
    SoakReadings(passed=False, failed_step=1, steps_run=0)
    TrialResult(outcome="ok", batch_size=1, wall_s=0.0, startup_s=0.0)


def test_sections_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        MemoryReadings().peak_reserved_bytes = 1          # type: ignore[misc]


@pytest.mark.parametrize("mutate", [
    lambda r: setattr(r, "outcome", Outcome.OK),
    lambda r: setattr(r, "batch_size", 16),
    lambda r: setattr(r, "memory", MemoryReadings()),
    lambda r: setattr(r.process, "pid", 1),
    lambda r: setattr(r.budget, "memory_fraction", 0.5),
    lambda r: setattr(r.execution, "where", "cpu"),
    lambda r: setattr(r.distributed, "world_size", 2),
    lambda r: setattr(r.script, "no_report", True),
    lambda r: setattr(r.stopped_over_limit, "step", 3),
])
def test_the_record_and_every_section_refuse_assignment(mutate):
    res = TrialResult(outcome="oom", batch_size=8, stopped_over_limit=StoppedOverLimit(step=2, used_bytes=3, limit_bytes=2))
    with pytest.raises(dataclasses.FrozenInstanceError):
        mutate(res)
    assert res.outcome is Outcome.OOM and res.batch_size == 8 and res.process.pid is None


@pytest.mark.parametrize("data, key", [
    ({"outcome": "ok", "extra_figures": 1, "memory": {}}, "extra_figures"),
    ({"outcome": "ok", "memory": {"peak_reserved": 1}}, "peak_reserved"),
    ({"outcome": "ok", "memory": {}, "process": {"pid": 1, "pgid": 1}}, "pgid"),
    ({"outcome": "ok", "memory": {}, "execution": {"kernels": {"gpu": {"arch": "sm80"}}}}, "arch"),
])
def test_a_current_record_with_an_unknown_key_is_refused_naming_it(data, key):
    with pytest.raises(ValueError) as err:
        TrialResult.from_dict(data)
    text = str(err.value)
    assert f"unknown key(s) {key}" in text and "\n" not in text


def test_memory_stats_fill_the_peaks_and_fragmentation():
    # torch.cuda.memory_stats() keys; fragmentation = 1 - peak active / peak reserved = 1 - 15/20
    stats = {"allocated_bytes.all.peak": 10 * MiB, "reserved_bytes.all.peak": 20 * MiB,
             "active_bytes.all.peak": 15 * MiB, "num_alloc_retries": 1, "num_ooms": 0}
    res = TrialResult(outcome="ok", memory=MemoryReadings(source="device", non_allocator_bytes=300 * MiB))
    res = res.fill_memory_stats(stats)
    assert res.memory == MemoryReadings(source="device", peak_allocated_bytes=10 * MiB,
                                        peak_reserved_bytes=20 * MiB, peak_active_bytes=15 * MiB,
                                        fragmentation=0.25, num_alloc_retries=1, num_ooms=0,
                                        non_allocator_bytes=300 * MiB)
    res = res.fill_memory_stats({})            # nothing reserved: no fragmentation, readings not taken
    assert res.memory.peak_reserved_bytes is None and res.memory.fragmentation is None


# ----------------------------------------------------------------------------- the nested form
def _full() -> TrialResult:
    return TrialResult(
        outcome=Outcome.OOM_FRAGMENTATION, batch_size=64, alloc_conf="max_split_size_mb:128",
        memory=MemoryReadings(source="device", peak_allocated_bytes=900 * MiB, peak_reserved_bytes=1000 * MiB,
                              peak_active_bytes=950 * MiB, fragmentation=0.05, num_alloc_retries=2, num_ooms=1,
                              device_peak_bytes=1100 * MiB, non_allocator_bytes=100 * MiB,
                              oom_requested_bytes=64 * MiB),
        throughput=Throughput(samples_per_s=None, step_time_s=None, data_wait_fraction=0.0, gpu_utilization=97.0,
                              steps=2),
        soak=SoakReadings(passed=False, steps_run=8, failed_step=9, shape=128, reserved_bytes=1000 * MiB,
                          allocated_bytes=900 * MiB, peak_reserved_bytes=1000 * MiB, message="out of memory",
                          seconds=2.0),
        settings_effective={"max_split_size": 128 * MiB}, message="rank 1 of 2: out of memory",
        advice="set expandable_segments:True", wall_s=12.0, startup_s=4.0,
        device=DeviceInfo(kind="cuda", name="NVIDIA H100 80GB HBM3", index=0, uuid="GPU-1"),
        ranks=(RankPeak(rank=0, outcome="ok", peak_reserved_bytes=800 * MiB, samples_per_s=None, teardown=True),
               RankPeak(rank=1, outcome=Outcome.OOM_FRAGMENTATION, peak_reserved_bytes=1000 * MiB, exitcode=1,
                        message="out of memory", device_uuid="GPU-1")),
        worst_rank=1, failed_rank=1,
        process=TrialProcess(pid=4242, returncode=0, launcher="spawn", launcher_fallback="no fork server",
                             torch_threads=2, command=("python", "train.py"), first_step_at=1700000000.25,
                             launch_to_first_step_s=1.5, survivors=(ProcessSeen(pid=77, command="sleep 60"),)),
        execution=ExecutionInfo(where="meta", fallback=None, meta_step_s=0.01, kernels=KernelsRan(
            gpu=GpuKernelsTarget(name="A100", compute_capability="8.0", sm_count=108, key="a100", source="catalogue"),
            sdpa=(KernelCount("flash", 4),), optimizers=("adam: foreach",))),
        budget=BudgetReadings(memory_fraction=0.5, non_allocator_bytes_at_start=300 * MiB, device_peaks=(None, 5)),
        allocator=AllocatorSeen(torch_alloc_conf="max_split_size_mb:128",
                                environment=(EnvVar("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128"),
                                             EnvVar("CUDA_VISIBLE_DEVICES", None))),
        distributed=DistributedInfo(world_size=2, backend="nccl", rank_pids=(11, 12)),
        script=ScriptReports(reports=2, reported=(ScriptReports.encode({"micro_batch": 4, "grad_accum": 2}),),
                             reporting_ranks=(0, 1), grad_accum=2),
        stopped_over_limit=StoppedOverLimit(step=2, used_bytes=1100 * MiB, limit_bytes=1000 * MiB),
        oom=OomDetails(requested_bytes=64 * MiB, source_format="current", backend="CUDA"),
        retried_after=RetriedAfter(outcome="crash", message="killed by SIGKILL", returncode=-9))


def test_a_json_record_reads_and_writes_back_identically():
    """JSON -> TrialResult -> JSON is the identity on the current form (every section filled)."""
    data = json.loads(_full().to_json())
    assert json.loads(TrialResult.from_dict(data).to_json()) == data
    assert data["process"]["command"] == ["python", "train.py"] and data["budget"]["device_peaks"] == [None, 5]
    assert data["execution"]["kernels"]["sdpa"] == [{"name": "flash", "count": 4}]
    assert data["allocator"]["environment"][1] == {"name": "CUDA_VISIBLE_DEVICES", "value": None}
    assert "extra" not in data


def test_the_nested_form_round_trips(tmp_path):
    res = _full()
    data = json.loads(res.to_json())
    assert data["outcome"] == "oom_fragmentation" and type(res.to_dict()["outcome"]) is str
    assert data["memory"]["peak_reserved_bytes"] == 1000 * MiB and data["memory"]["source"] == "device"
    assert data["throughput"]["gpu_utilization"] == 97.0 and data["soak"]["failed_step"] == 9
    assert data["ranks"][1]["outcome"] == "oom_fragmentation" and data["worst_rank"] == data["failed_rank"] == 1
    assert not {"peak_reserved_bytes", "memory_source", "soak_passed", "steps"} & set(data)   # no flat keys
    assert TrialResult.from_dict(data) == res
    res.write(tmp_path / "result.json")
    assert TrialResult.read(tmp_path / "result.json") == res
    bare = TrialResult(outcome="error", message="boom")
    assert TrialResult.from_dict(json.loads(bare.to_json())) == bare
    assert json.loads(bare.to_json())["soak"] is None


# ----------------------------------------------------------------------------- the flat form
# tests/data/records/*.json: records as TrialResult.to_json wrote them before the sections (oomtune at
# commit 6312ef6, every field present, flat); the expected objects are written out by hand below.
def test_an_old_flat_ok_record_loads_into_the_sections():
    res = TrialResult.read(DATA / "result-flat-ok.json")
    assert res == TrialResult(
        outcome=Outcome.OK, batch_size=16, alloc_conf="expandable_segments:True",
        memory=MemoryReadings(source="simulated", peak_allocated_bytes=10485760, peak_reserved_bytes=20971520,
                              peak_active_bytes=15728640, fragmentation=0.25, num_alloc_retries=0, num_ooms=0),
        throughput=Throughput(samples_per_s=812.5, step_time_s=0.0197, data_wait_fraction=0.125, steps=4),
        soak=SoakReadings(passed=True, steps_run=50, reserved_bytes=23068672, allocated_bytes=12582912,
                          peak_reserved_bytes=25165824, seconds=0.5, distinct_shapes=3),
        settings_effective={"expandable_segments": True}, wall_s=3.5, startup_s=1.25,
        device=DeviceInfo(kind="cpu", name="virtual GPU", total_memory_bytes=85899345920),
        # its extra mapping, each key in its section (the soak's shape count in the soak section)
        process=TrialProcess(pid=4242), execution=ExecutionInfo(where="cpu"), budget=BudgetReadings(memory_fraction=0.5))
    assert res.soak.distinct_shapes == 3


def test_an_old_flat_failed_record_with_a_failed_soak_and_ranks_loads_into_the_sections():
    # the ranks lived in extra["ranks"] (samples/s under "throughput"), worst_rank / failed_rank too
    res = TrialResult.read(DATA / "result-flat-oom.json")
    assert res == TrialResult(
        outcome=Outcome.OOM_FRAGMENTATION, batch_size=64, alloc_conf="",
        memory=MemoryReadings(source="device", peak_allocated_bytes=943718400, peak_reserved_bytes=1048576000,
                              peak_active_bytes=996147200, fragmentation=0.05, num_alloc_retries=2, num_ooms=1,
                              device_peak_bytes=1153433600, non_allocator_bytes=104857600,
                              oom_requested_bytes=67108864),
        throughput=Throughput(gpu_utilization=97.0, steps=2),
        soak=SoakReadings(passed=False, steps_run=8, failed_step=9, shape=128, reserved_bytes=1048576000,
                          allocated_bytes=943718400, peak_reserved_bytes=1048576000,
                          message="out of memory at soak step 9/2000 (seq_len 128)", seconds=2.0),
        message="passed the 4 live steps, then out of memory at soak step 9/2000 (seq_len 128)",
        advice="set expandable_segments:True", wall_s=12.0, startup_s=4.0,
        ranks=(RankPeak(rank=0, outcome=Outcome.OK, peak_reserved_bytes=838860800, peak_allocated_bytes=734003200,
                        device_peak_bytes=943718400),
               RankPeak(rank=1, outcome=Outcome.OOM_FRAGMENTATION, peak_reserved_bytes=1048576000,
                        peak_allocated_bytes=943718400, device_peak_bytes=1153433600, message="out of memory")),
        worst_rank=1, failed_rank=1, distributed=DistributedInfo(world_size=2))
    # written again it is the nested form, and reads back to the same record
    assert TrialResult.from_dict(json.loads(res.to_json())) == res


def test_a_minimal_flat_record_and_unknown_keys():
    # the smallest records older code wrote (an error before any reading), plus a top-level key that
    # is no field: it was kept in extra, and goes to its section like extra's keys; one no producer
    # wrote is dropped; no soak_passed: no soak section
    res = TrialResult.from_dict({"outcome": "error", "message": "unreadable trial spec: x", "memory_source": None,
                                 "soak_passed": None, "soak_steps_run": None, "returncode": 2, "note": "x"})
    assert res == TrialResult(outcome=Outcome.ERROR, message="unreadable trial spec: x",
                              process=TrialProcess(returncode=2))
    assert res.memory == MemoryReadings(source="simulated") and res.soak is None


# tests/data/records/result-nested-extra.json: a record as TrialResult.to_json wrote it at commit e0a7dc9
# (nested sections plus the free ``extra`` mapping, with a key of each producer, the transient
# ``meta_unsupported`` and a key no producer wrote); the expected object is written out by hand below.
def test_an_old_nested_record_with_extra_reads_each_key_into_its_section():
    res = TrialResult.read(DATA / "result-nested-extra.json")
    assert res == TrialResult(
        outcome=Outcome.OK, batch_size=8, alloc_conf="expandable_segments:True",
        memory=MemoryReadings(source="simulated", peak_reserved_bytes=20971520),
        throughput=Throughput(samples_per_s=100.0, steps=4),
        soak=SoakReadings(passed=False, steps_run=8, failed_step=9, shape=128, message="out of memory at soak step 9",
                          distinct_shapes=3, fragmentation_failure=True),
        wall_s=3.5,
        process=TrialProcess(pid=4242, returncode=0, launcher="fork", torch_threads=2, first_step_at=1700000000.5,
                             launch_to_first_step_s=0.75, survivors=(ProcessSeen(pid=77, command="sleep 60"),)),
        execution=ExecutionInfo(where="meta", meta_step_s=0.01, kernels=KernelsRan(
            gpu=GpuKernelsTarget(name="A100", compute_capability="8.0", sm_count=108, key="a100", source="catalogue"),
            sdpa=(KernelCount("flash", 4),), optimizers=("adam: foreach",))),
        budget=BudgetReadings(memory_fraction=0.5),
        allocator=AllocatorSeen(torch_alloc_conf="expandable_segments:True", environment=(
            EnvVar("CUDA_VISIBLE_DEVICES", None), EnvVar("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"))),
        distributed=DistributedInfo(world_size=2, backend="gloo", parallel="ddp", memory_note="the program's own",
                                    not_modelled="NCCL buffers", rank_pids=(11, 12)),
        script=ScriptReports(reports=1, reported=('{"framework": "lightning", "micro_batch": 4}',), grad_accum=2),
        stopped_over_limit=StoppedOverLimit(step=2, used_bytes=12582912, limit_bytes=10485760),
        retried_after=RetriedAfter(outcome=Outcome.CRASH, message="killed by SIGKILL", returncode=-9))
    assert res.script.reported_values() == [{"framework": "lightning", "micro_batch": 4}]
    # written again it is the current form (no extra), and reads back to the same record
    again = json.loads(res.to_json())
    assert "extra" not in again and TrialResult.from_dict(again) == res


def test_a_nested_record_with_sections_left_out_reads_them_as_not_taken():
    res = TrialResult.from_dict({"outcome": "ok", "batch_size": 8, "throughput": {"samples_per_s": 10.0}})
    assert res == TrialResult(outcome="ok", batch_size=8, throughput=Throughput(samples_per_s=10.0))


def test_a_study_holding_old_flat_records_is_read_by_the_search_and_the_report():
    """A search resumed from a study stored before the sections: its trials' results (user_attrs)
    are flat; the driver's readers, the table and the HTML report read them."""
    from oomtune import display
    from oomtune.htmlreport._data import trial_records
    from oomtune.study import records as R

    flat = json.loads((DATA / "result-flat-ok.json").read_text())
    study = optuna.create_study(directions=["maximize"])
    study.add_trial(optuna.trial.create_trial(
        params={"batch_size": 16, "expandable_segments": True},
        distributions={"batch_size": optuna.distributions.IntDistribution(1, 64),
                       "expandable_segments": optuna.distributions.CategoricalDistribution([False, True])},
        value=812.5, user_attrs={R.ATTR_RESULT: flat, R.ATTR_OUTCOME: "ok", R.ATTR_ROLE: "search",
                                 R.ATTR_CONF: "expandable_segments:True"},
        system_attrs={"constraints": (-0.5,)}))
    (trial,) = study.get_trials()
    res = R.result_of(trial)
    assert res.outcome is Outcome.OK and res.memory.peak_reserved_bytes == 20 * MiB
    assert R.used_bytes(res) == 20 * MiB and R.is_feasible_ok(trial)
    assert R.violation(res, R.MemoryLimit(40 * MiB, 0.0)) == pytest.approx(-0.5)   # (20 - 40) / 40
    (row,) = display.trial_rows([trial])
    assert (row["outcome"], row["throughput"], row["peak_reserved_bytes"], row["memory_source"]) == \
        ("ok", 812.5, 20 * MiB, "simulated")
    assert (row["step_time_s"], row["fragmentation"], row["data_wait_fraction"]) == (0.0197, 0.25, 0.125)
    (rec,) = trial_records([trial])
    assert (rec["throughput"], rec["peak_reserved_bytes"], rec["peak_allocated_bytes"], rec["memory_source"]) == \
        (812.5, 20 * MiB, 10 * MiB, "simulated")


def test_a_study_holding_records_with_extra_resumes_with_each_key_in_its_section():
    """A study stored by the version that kept an ``extra`` mapping (user_attrs["result"] as
    tests/data/records/result-nested-extra.json): the search's readers find each former key in its
    section -- the stop above the limit (violation), the memory fraction (best.yaml's answer)."""
    from oomtune.search.outputs import answer_fraction
    from oomtune.study import records as R

    old = json.loads((DATA / "result-nested-extra.json").read_text())
    study = optuna.create_study(directions=["maximize"])
    study.add_trial(optuna.trial.create_trial(
        params={"batch_size": 8}, distributions={"batch_size": optuna.distributions.IntDistribution(1, 64)},
        value=100.0, user_attrs={R.ATTR_RESULT: old, R.ATTR_OUTCOME: "ok", R.ATTR_ROLE: "search",
                                 R.ATTR_CONF: "expandable_segments:True"}))
    (trial,) = study.get_trials()
    res = R.result_of(trial)
    assert res.stopped_over_limit == StoppedOverLimit(step=2, used_bytes=12 * MiB, limit_bytes=10 * MiB)
    # used: the larger of the peak reserved (20 MiB) and the reading at the stop (12 MiB): (20 - 16) / 16
    assert R.violation(res, R.MemoryLimit(16 * MiB, 0.0)) == pytest.approx(0.25)
    assert answer_fraction(res, "garbage_collection_threshold:0.6") == 0.5
    assert res.process.returncode == 0 and res.retried_after.outcome is Outcome.CRASH


def test_a_draft_keeps_the_last_valid_record_when_a_change_is_refused():
    from oomtune.trial.record import ResultDraft

    rec = ResultDraft(TrialResult(outcome="error"))
    rec.update("process", pid=4242)
    with pytest.raises(ValueError, match="^budget.memory_fraction "):
        rec.update("budget", memory_fraction=2.0)
    with pytest.raises(ValueError, match="^trial.wall_s "):
        rec.set(outcome="ok", wall_s=-1.0)
    assert rec.result == TrialResult(outcome="error", process=TrialProcess(pid=4242))


# ------------------------------------------------------------------ TrialSpec read from spec.json
@pytest.mark.parametrize("change, message", [
    ({"batch_size": "8"}, "trial spec: batch_size='8': expected int"),
    ({"batch_size": True}, "trial spec: batch_size=True: expected int"),
    ({"timeout_s": "300"}, "trial spec: timeout_s='300': expected int or float"),
    ({"budget_bytes": 1.5}, "trial spec: budget_bytes=1.5: expected int or null"),
    ({"memory_fraction": 1}, "trial spec: memory_fraction=1: expected bool"),
    ({"workload": ["mlp"]}, "trial spec: workload=['mlp']: expected dict"),
    ({"batch_sise": 8}, "trial spec: unknown field(s) batch_sise"),
    # the workload is read into its WorkloadSpec, whose own checks name the bad key
    ({"workload": {"target": {"command": "x"}}},
     "trial spec: workload: workload target must be a mapping with a 'name' string, got {'command': 'x'}"),
    ({"workload": {"target": {"name": "builtin"}, "ranks": 0}},
     "trial spec: workload: workload ranks must be an integer >= 1 or null, got 0"),
])
def test_a_spec_read_from_json_is_checked_field_by_field(change, message):
    import json

    from oomtune.trial.record import TrialSpec

    data = json.loads(TrialSpec(workload={"name": "mlp"}, batch_size=4).to_json())
    with pytest.raises(ValueError) as err:
        TrialSpec.from_json(json.dumps({**data, **change}))
    assert str(err.value) == message


def test_a_spec_round_trips_and_every_field_has_a_json_type():
    import dataclasses
    import json

    from oomtune.trial.record import TrialSpec
    from oomtune.workload_spec import WorkloadSpec

    spec = TrialSpec(workload={"name": "mlp", "data": {"source": "synthetic"}}, batch_size=4, budget_bytes=1 << 30,
                     timeout_s=30, ranks=2, device="cuda:0,1")
    assert TrialSpec.from_json(spec.to_json()) == spec
    # the workload is typed on both sides of spec.json: a WorkloadSpec in the process, its flat form in the file
    assert spec.workload == WorkloadSpec(target={"name": "builtin"}, model={"name": "mlp", "data": {"source": "synthetic"}},
                                         gpu=None)
    assert json.loads(spec.to_json())["workload"] == {"name": "mlp", "data": {"source": "synthetic"},
                                                      "target": {"name": "builtin"}}
    # every field can be read: a field added without its JSON type is refused when read
    full = json.loads(spec.to_json())
    assert set(full) == {f.name for f in dataclasses.fields(TrialSpec)}
    with pytest.raises(ValueError, match="missing field batch_size"):
        TrialSpec.from_json(json.dumps({"workload": {}}))
    with pytest.raises(ValueError, match="a trial spec is a JSON object, got list"):
        TrialSpec.from_json("[1, 2]")
