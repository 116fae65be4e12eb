"""Distributed trials without processes: launcher summaries (real texts), the merge of rank records,
a cmd target's per-rank report lines, GPU packing and visibility, DTensor and CPU-stream capture.

Expected values are hand-computed from the figures given, or come from the real launcher texts in
tests/data/launchers (README there: how they were produced).
"""

from __future__ import annotations

import dataclasses

import logging
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from oomtune.classify import classify_failure
from oomtune.classify._launcher import is_peer_teardown, parse_launcher_summary, rank_sections
from oomtune.exceptions import ConfigError
from oomtune.outcome import Outcome
from oomtune.trial.rank_records import global_throughput, merge_ranks
from oomtune.trial.record import MemoryReadings, Throughput, TrialResult, TrialSpec

DATA = Path(__file__).parent / "data" / "launchers"
MiB = 2**20


def _text(name: str) -> str:
    return (DATA / name).read_text()


# ------------------------------------------------------------------ launcher summaries
def test_torchrun_child_failed_error_with_sigkill_is_the_rank_kill():
    text = _text("torchrun_sigkill_rank1.stderr")
    summary = parse_launcher_summary(text)
    assert summary.launcher == "torchrun"
    assert (summary.root.rank, summary.root.local_rank, summary.root.exitcode, summary.root.pid) == (1, 1, -9, 32204)
    assert summary.root.signal == 9
    assert [(f.rank, f.exitcode) for f in summary.others] == [(0, -15)]   # terminated by torchrun
    cls = classify_failure(returncode=1, stderr=text)   # torchrun itself exits 1
    assert cls.rank == 1
    assert "rank 1" in cls.message and "SIGKILL" in cls.message
    # the rank's signal decides, not torchrun's exit status 1 (which alone reads as a generic error)
    assert cls.outcome is Outcome.CRASH   # a SIGKILL without OOM-killer evidence (none is given here)
    assert cls.outcome is classify_failure(returncode=-9, stderr="").outcome


def test_torchrun_summary_with_a_rank_traceback_classifies_that_rank():
    text = _text("torchrun_oom_rank1.stderr")
    cls = classify_failure(returncode=1, stderr=text)
    assert cls.rank == 1
    assert cls.outcome.is_memory
    assert cls.oom is not None and cls.oom.requested_bytes == 2 * 1024**3   # "Tried to allocate 2.00 GiB"
    assert rank_sections(text)[1].startswith("Traceback (most recent call last):")


def test_gloo_errors_of_the_surviving_rank_are_teardown():
    for name in ("torchrun_sigkill_rank1.stderr", "torchrun_oom_rank1.stderr"):
        rank0 = rank_sections(_text(name))[0]
        assert is_peer_teardown(rank0), rank0
    assert not is_peer_teardown("RuntimeError: mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)")
    assert not is_peer_teardown("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.")


def test_torchrun_agent_line_alone_names_the_local_rank():
    # the summary cut off: only the agent's log line (its format in torch/distributed/elastic/
    # multiprocessing/api.py, as in the stored text) is left
    line = next(l for l in _text("torchrun_sigkill_rank1.stderr").splitlines() if "failed (exitcode" in l)
    summary = parse_launcher_summary(line)
    assert (summary.root.rank, summary.root.local_rank, summary.root.exitcode) == (None, 1, -9)


def test_deepspeed_summary_gives_the_return_code_not_a_rank():
    # DeepSpeed's logger format (deepspeed/utils/logging.py LoggerFactory) and launch.py's
    # sigkill_handler messages; its printed command is the last started rank's, not the failed one's
    fmt = logging.Formatter("[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:%(funcName)s] %(message)s")

    def record(level: int, msg: str) -> str:
        rec = logging.LogRecord("DeepSpeed", level, "/x/deepspeed/launcher/launch.py", 321, msg, None, None,
                                func="sigkill_handler")
        return fmt.format(rec)

    cmd = ["/usr/bin/python3", "-u", "train.py", "--local_rank=1", "--deepspeed"]
    text = "\n".join([record(logging.INFO, "Killing subprocess 4101"), record(logging.INFO, "Killing subprocess 4102"),
                      record(logging.ERROR, f"{cmd} exits with return code = -9")])
    summary = parse_launcher_summary(text)
    assert summary.launcher == "deepspeed"
    assert summary.root.rank is None and summary.root.exitcode == -9
    cls = classify_failure(returncode=247, stderr=text)
    assert cls.rank is None and "SIGKILL" in cls.message and "a rank" in cls.message


def test_accelerate_single_process_launcher_called_process_error():
    # accelerate's simple_launcher raises subprocess.CalledProcessError(returncode, cmd): CPython's text
    killed = str(subprocess.CalledProcessError(-9, ["python", "train.py"]))
    failed = str(subprocess.CalledProcessError(3, ["python", "train.py"]))
    assert parse_launcher_summary(f"subprocess.CalledProcessError: {killed}").root.exitcode == -9
    assert parse_launcher_summary(f"subprocess.CalledProcessError: {failed}").root.exitcode == 3


def test_no_summary_in_ordinary_stderr():
    assert parse_launcher_summary("Traceback (most recent call last):\nValueError: x") is None
    assert classify_failure(returncode=1, stderr="ValueError: x").rank is None


# ------------------------------------------------------------------ merging rank records
SPEC = TrialSpec(workload={"name": "mlp"}, batch_size=50, ranks=2)


def _ok(thr: float, step: float, reserved: int, allocated: int) -> TrialResult:
    return TrialResult(outcome="ok", batch_size=50, throughput=Throughput(samples_per_s=thr, step_time_s=step, steps=3),
                       memory=MemoryReadings(peak_reserved_bytes=reserved, peak_allocated_bytes=allocated,
                                             peak_active_bytes=allocated))


def test_global_throughput_counts_every_sample_once():
    # two ranks, 100 samples each, at once: 200 samples in the slowest rank's 2.5 s
    assert global_throughput([(100, 2.0), (100, 2.5)]) == pytest.approx(80.0)
    assert global_throughput([]) is None


def test_merge_ok_ranks_worst_rank_memory_and_global_throughput():
    # rank 0: 50 samples/step in 0.5 s (100/s); rank 1: 50 samples/step in 0.625 s (80/s)
    merged = merge_ranks(SPEC, [_ok(100.0, 0.5, 20 * MiB, 15 * MiB), _ok(80.0, 0.625, 22 * MiB, 16 * MiB)])
    assert merged.outcome == "ok"
    assert merged.throughput.samples_per_s == pytest.approx(100 / 0.625)   # 160/s: (50 + 50) / 0.625
    assert merged.throughput.step_time_s == pytest.approx(0.625)
    assert (merged.memory.peak_reserved_bytes, merged.memory.peak_allocated_bytes) == (22 * MiB, 16 * MiB)
    assert merged.worst_rank == 1
    assert [r.peak_reserved_bytes for r in merged.ranks] == [20 * MiB, 22 * MiB]
    assert merged.distributed.world_size == 2


def test_merge_oom_on_rank_1_names_it_and_ignores_the_teardown_of_rank_0():
    rank0 = TrialResult(outcome="error", memory=MemoryReadings(peak_reserved_bytes=6 * MiB),
                        message="RuntimeError: [../gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:5")
    rank1 = TrialResult(outcome="oom", memory=MemoryReadings(peak_reserved_bytes=100 * MiB),
                        message="out of memory (simulated): ...")
    merged = merge_ranks(SPEC, [rank0, rank1])
    assert merged.outcome == "oom"
    assert merged.failed_rank == 1 and merged.message.startswith("rank 1 of 2: ")
    assert [r.teardown for r in merged.ranks] == [True, False]
    assert merged.throughput.samples_per_s is None


def test_merge_rank_killed_without_record_is_the_cause_not_the_terminated_ones():
    # rank 1 SIGKILLed first (the launcher's error_index), rank 0 then terminated by the launcher
    merged = merge_ranks(SPEC, [None, None], exitcodes=[-15, -9], root_rank=1)
    assert merged.failed_rank == 1
    assert "SIGKILL" in merged.message
    assert [r.teardown for r in merged.ranks] == [True, False]
    assert [r.exitcode for r in merged.ranks] == [-15, -9]


def test_a_rank_sigkilled_by_the_oom_killer_is_host_oom_only_with_evidence():
    from oomtune.trial.rank_records import rank_oom_kill

    def merged():
        m = merge_ranks(SPEC, [None, None], exitcodes=[-15, -9], root_rank=1)
        return dataclasses.replace(m, distributed=dataclasses.replace(m.distributed, rank_pids=(4100, 4101)))

    # no evidence of the OOM killer: a SIGKILL from outside is a crash, and it stays one
    plain = merged()
    assert plain.outcome is Outcome.CRASH
    asked: list = []
    plain = rank_oom_kill(plain, lambda pids: asked.append(list(pids)) or None)
    assert plain.outcome is Outcome.CRASH and asked == [[4101]]   # the killed rank's pid only
    # the kernel log names rank 1's pid: the host's OOM killer
    killed = rank_oom_kill(merged(), lambda pids: "kernel log: Out of memory: Killed process 4101 (python)")
    assert killed.outcome is Outcome.HOST_OOM
    assert killed.message.startswith("rank 1 of 2: killed by SIGKILL") and "Killed process 4101" in killed.message
    # a rank that failed otherwise is left alone
    oom = merge_ranks(SPEC, [TrialResult(outcome="ok"), TrialResult(outcome="oom_fragmentation", message="x")])
    oom = dataclasses.replace(oom, distributed=dataclasses.replace(oom.distributed, rank_pids=(1, 2)))
    oom = rank_oom_kill(oom, lambda pids: "anything")
    assert oom.outcome == "oom_fragmentation"


def test_torchrun_summary_gives_the_sigkilled_rank_pid_to_look_up():
    from oomtune.targets.cmd import _sigkilled_rank_pid

    # the root cause of a real torchrun run: "exitcode  : -9 (pid: 32204)  (SIGKILL)"
    assert _sigkilled_rank_pid((DATA / "torchrun_sigkill_rank1.stderr").read_text()) == 32204
    # a rank that exited 1 (its own out-of-memory traceback) is not a kill
    assert _sigkilled_rank_pid((DATA / "torchrun_oom_rank1.stderr").read_text()) is None
    assert _sigkilled_rank_pid("Traceback (most recent call last):\nValueError: x\n") is None


def test_merge_memory_outcome_wins_over_an_earlier_crash():
    crash = TrialResult(outcome="crash", message="killed by SIGSEGV")
    oom = TrialResult(outcome="oom_fragmentation", message="fragmentation ...")
    merged = merge_ranks(TrialSpec(workload={}, batch_size=1, ranks=3), [TrialResult(outcome="ok"), crash, oom],
                         root_rank=1)
    assert merged.outcome == "oom_fragmentation" and merged.failed_rank == 2


# ------------------------------------------------------------------ a cmd target's rank lines
def test_cmd_channel_every_rank_reports_samples_once():
    from oomtune.targets.cmd import result_from_channel

    spec = TrialSpec(workload={"target": {"name": "cmd", "command": "x"}}, batch_size=8, ranks=2)
    mem = lambda peak: {"source": "simulated", "stats": {"reserved_bytes.all.peak": peak,  # noqa: E731
                                                         "allocated_bytes.all.peak": peak // 2}}
    events = [{"event": "report", "rank": 0, "samples": 100, "seconds": 2.0, "steps": 4, "memory": mem(30 * MiB)},
              {"event": "report", "rank": 1, "samples": 100, "seconds": 2.5, "steps": 4, "memory": mem(40 * MiB)}]
    res = result_from_channel(spec, events, returncode=0, stderr="", timed_out=False)
    assert res.outcome == "ok"
    assert res.throughput.samples_per_s == pytest.approx(200 / 2.5)     # not 200 / 4.5 (seconds summed over ranks)
    assert res.throughput.step_time_s == pytest.approx(2.5 / 4)       # the slowest rank's
    assert res.memory.peak_reserved_bytes == 40 * MiB and res.worst_rank == 1
    assert [r.peak_reserved_bytes for r in res.ranks] == [30 * MiB, 40 * MiB]
    # one process's lines (no rank): as before, sum(samples) / sum(seconds)
    single = [{"event": "report", "samples": 100, "seconds": 2.0}, {"event": "report", "samples": 50, "seconds": 2.0}]
    alone = result_from_channel(spec, single, returncode=0, stderr="", timed_out=False)
    assert alone.throughput.samples_per_s == pytest.approx(37.5)


def test_cmd_channel_oom_line_names_its_rank():
    from oomtune.targets.cmd import result_from_channel

    spec = TrialSpec(workload={"target": {"name": "cmd", "command": "x"}}, batch_size=8, ranks=2)
    msg = ("[virtual GPU, simulated] CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity "
           "of 80.00 GiB of which 0 bytes is free. Of the allocated memory 90.00 MiB is allocated by PyTorch, "
           "and 2.00 MiB is reserved by PyTorch but unallocated.")
    events = [{"event": "oom", "rank": 1, "time": 5.0, "message": msg, "requested_bytes": 20 * MiB}]
    res = result_from_channel(spec, events, returncode=1, stderr="", timed_out=False)
    assert res.outcome.is_memory
    assert res.failed_rank == 1 and res.message.startswith("rank 1: ")


def test_script_api_lines_carry_the_rank(tmp_path, monkeypatch):
    import json

    import oomtune

    channel = tmp_path / "results.jsonl"
    monkeypatch.setenv("OOMTUNE_RESULT_FILE", str(channel))
    monkeypatch.setenv("RANK", "3")
    oomtune.report(samples=10, seconds=1.0)
    assert json.loads(channel.read_text())["rank"] == 3


# ------------------------------------------------------------------ GPUs per trial
def test_worker_slots_pack_gpus_per_trial():
    from oomtune.search.run import worker_slots

    gpu = SimpleNamespace(simulated=False, spec="cuda:0")
    assert worker_slots("cuda", gpu, 3, 2, visible=4) == ["cuda:0,1", "cuda:2,3"]   # 3 x 2 > 4: two workers
    assert worker_slots("cuda", gpu, 1, 3, visible=8) == ["cuda:0,1,2"]
    assert worker_slots("cuda", gpu, 4, 1, visible=2) == ["cuda:0", "cuda:1"]
    with pytest.raises(ConfigError, match="trial.gpus=3 but only 2"):
        worker_slots("cuda", gpu, 1, 3, visible=2)
    with pytest.raises(ConfigError, match="names one GPU"):
        worker_slots("cuda:1", gpu, 1, 2, visible=4)
    cpu = SimpleNamespace(simulated=True, spec="cpu")
    assert worker_slots("cpu", cpu, 2, 4) == ["cpu", "cpu"]


class _FakeNvml:
    NVMLError = RuntimeError
    uuids = ["GPU-aaaa", "GPU-bbbb", "GPU-cccc", "GPU-dddd"]

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetCount(self):
        return 4

    def nvmlDeviceGetHandleByIndex(self, i):
        if not 0 <= i < 4:
            raise RuntimeError("Invalid Argument")
        return ("h", i)

    def nvmlDeviceGetUUID(self, h):
        return self.uuids[h[1]]


@pytest.fixture()
def fake_nvml(monkeypatch):
    from oomtune.gpu import nvml

    nvml._reset()
    monkeypatch.setattr(nvml, "_import_pynvml", lambda: _FakeNvml())
    yield
    nvml._reset()


def test_multi_gpu_trial_sees_its_gpus_by_uuid(fake_nvml, monkeypatch):
    from oomtune.trial.runner import child_environment, validate_spec

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1,2")
    spec = TrialSpec(workload={"name": "mlp"}, batch_size=1, device="cuda:1,2", ranks=2)
    validate_spec(spec)
    assert child_environment(spec)["CUDA_VISIBLE_DEVICES"] == "GPU-bbbb,GPU-cccc"   # visible 1, 2 = NVML 1, 2
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    one = TrialSpec(workload={"name": "mlp"}, batch_size=1, device="cuda:3")
    assert child_environment(one)["CUDA_VISIBLE_DEVICES"] == "GPU-dddd"


def test_gpu_list_must_match_the_rank_count():
    from oomtune.trial.runner import validate_spec

    with pytest.raises(ConfigError, match="names 2 GPU"):
        validate_spec(TrialSpec(workload={"name": "mlp"}, batch_size=1, device="cuda:0,1", ranks=1))
    with pytest.raises(ConfigError):
        validate_spec(TrialSpec(workload={"name": "mlp"}, batch_size=1, device="cuda:0,0", ranks=2))


def test_multi_sampler_takes_the_worst_gpu(monkeypatch):
    from oomtune.gpu import nvml

    class Fixed:
        def __init__(self, device, **kw):
            self.device = device

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        @property
        def result(self):
            return {0: nvml.SamplerResult(3 * MiB, "process", 50.0, 4),
                    1: nvml.SamplerResult(7 * MiB, "process", 70.0, 4)}[self.device]

    monkeypatch.setattr(nvml, "MemorySampler", Fixed)
    with nvml.MultiSampler([0, 1], pid=1) as sampler:
        pass
    assert sampler.result == nvml.SamplerResult(7 * MiB, "process", 60.0, 8)
    assert [r.peak_used_bytes for r in sampler.results] == [3 * MiB, 7 * MiB]


def test_apply_best_refuses_another_world_size(tmp_path):
    from oomtune.best import BestConfig, Choice, RankCountError, apply_best, write_best

    path = tmp_path / "best.yaml"
    write_best(BestConfig(schema_version=1, created="x", workload={"model": {"name": "mlp"}, "ranks": 2,
                                                                   "target": {"name": "builtin"}},
                          device={"kind": "cpu"}, versions={}, best=Choice(batch_size=8, alloc_conf="")), path)
    env: dict[str, str] = {"WORLD_SIZE": "4"}
    with pytest.raises(RankCountError, match="tuned for 2 rank"):
        apply_best(path, environ=env)
    env = {"WORLD_SIZE": "2"}
    assert apply_best(path, environ=env).best.batch_size == 8


def test_check_run_needs_a_gpu_per_rank(tmp_path, monkeypatch):
    import torch

    from oomtune import regression
    from oomtune.best import BestConfig, Choice

    best = BestConfig(schema_version=1, created="x", workload={"model": {"name": "mlp"}, "ranks": 2,
                                                               "target": {"name": "builtin"}},
                      device={"kind": "cuda", "budget_bytes": 1024 * MiB, "total_memory_bytes": 80 * 1024 * MiB},
                      versions={}, best=Choice(batch_size=8, alloc_conf="", metrics={"memory_source": "device"}))
    monkeypatch.setattr(regression, "_run_device", lambda best, device: device or "cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)

    class NoRun:
        def run(self, *a, **k):
            raise AssertionError("a trial started")

    # tuned for 2 ranks, one GPU visible: refused before any trial, naming both counts
    with pytest.raises(ConfigError, match="tuned for 2 ranks, one GPU each .* but 1 GPU"):
        regression.check_run(best, runner=NoRun())
    with pytest.raises(ConfigError, match="--device cuda:1 names one GPU"):
        regression.check_run(best, device="cuda:1", runner=NoRun())


# ------------------------------------------------------------------ capture: DTensor shards, CPU streams, resize_
def test_dtensor_counts_its_local_shard_not_the_global_size():
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from oomtune.capture.recorder import StorageRecorder, StreamSink
    from oomtune.workloads.parallel import fake_process_group

    with fake_process_group(2):
        mesh = init_device_mesh("cpu", (2,))
        sink = StreamSink()
        with StorageRecorder(sink, device="cpu"):
            local = torch.zeros(512, 256)                      # rank 0's half of a 1024 x 256 fp32 tensor
            d = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
            e = torch.zeros_like(d)                            # an optimizer state of a sharded parameter
        assert tuple(d.shape) == (1024, 256) and d.untyped_storage().nbytes() == 1024 * 256 * 4   # the wrapper
        assert isinstance(e, DTensor)
    assert sink.alloc_sizes == [512 * 256 * 4, 512 * 256 * 4]   # 512 KiB each: the local shards


def test_cpu_streams_get_their_own_pools_on_the_virtual_gpu():
    import torch

    from oomtune.alloc.settings import AllocatorSettings
    from oomtune.alloc.sim import CachingAllocatorSim
    from oomtune.capture.recorder import StorageRecorder, StreamSink
    from oomtune.capture.virtual_gpu import VirtualGPU

    sink = StreamSink()
    side = torch.cpu.Stream()
    with StorageRecorder(sink, device="cpu"):
        a = torch.zeros(1000)
        with torch.cpu.stream(side):
            b = torch.zeros(2000)
        del b
        c = torch.zeros(2000)
    assert sink.events == [("alloc", 1, 4000, 0), ("alloc", 2, 8000, 1), ("free", 2, 8000, 1), ("alloc", 3, 8000, 0)]
    # the caching allocator keeps blocks per stream: the 8000-byte block freed on the side stream is
    # not reused for stream 0, so two 2 MiB small-pool segments (kSmallBuffer) are reserved, not one
    sim = CachingAllocatorSim(AllocatorSettings.parse(""), total_memory_bytes=1 << 30)
    with VirtualGPU(sim, device="cpu"):
        a = torch.zeros(1000)
        with torch.cpu.stream(side):
            b = torch.zeros(2000)
        del b
        c = torch.zeros(2000)
    assert sim.memory_stats()["reserved_bytes.all.peak"] == 2 * 2 * MiB
    del a, c


def test_storage_resize_is_a_release_and_a_request():
    import torch

    from oomtune.capture.recorder import StorageRecorder, StreamSink

    sink = StreamSink()
    original = torch.UntypedStorage.resize_
    with StorageRecorder(sink, device="cpu"):
        st = torch.empty(1000).untyped_storage()   # 4000 bytes
        st.resize_(0)                              # FSDP2's free_storage
        st.resize_(4000)                           # FSDP2's alloc_storage
        st.resize_(8000)                           # grows: the new block, then the old one released
    assert sink.events == [("alloc", 1, 4000, 0), ("free", 1, 4000, 0), ("alloc", 2, 4000, 0),
                           ("alloc", 3, 8000, 0), ("free", 2, 4000, 0)]
    assert torch.UntypedStorage.resize_ is original   # the hook is gone with the recorder


# ------------------------------------------------------------------ where the ranks' steps run
def test_distributed_trials_run_their_steps_on_the_cpu_not_meta():
    from oomtune.search.objectives import objective_for
    from oomtune.trial.execute import resolve_execute
    from oomtune.workload_spec import WorkloadSpec

    ddp = WorkloadSpec(target={"name": "builtin"}, model={"name": "transformer", "parallel": "ddp"}, ranks=2)
    # gloo moves real tensors between the ranks: auto takes the CPU, and says why
    mode, why = resolve_execute("auto", simulated=True, objective=objective_for("batch"), workload=ddp)
    assert mode == "cpu" and "model.parallel=ddp" in why
    fsdp = WorkloadSpec(target={"name": "builtin"}, model={"name": "transformer", "parallel": "fsdp"}, ranks=2)
    with pytest.raises(ConfigError, match="trial.execute=meta cannot run model.parallel=fsdp"):
        resolve_execute("meta", simulated=True, objective=objective_for("batch"), workload=fsdp)
    # one process without data parallelism keeps the meta default
    assert resolve_execute("auto", simulated=True, objective=objective_for("batch"),
                           workload=WorkloadSpec(target={"name": "builtin"}, model={"name": "transformer"}))[0] == "meta"


def test_the_search_counts_every_rank_against_the_host_memory(tmp_path, capsys, monkeypatch):
    from oomtune.cli import main
    from oomtune.trial import execute

    # 1 worker x 2 ranks, each with its own 6 GiB virtual GPU: 12 GiB of host memory > 10 GiB available
    monkeypatch.setattr(execute, "host_available_bytes", lambda meminfo="/proc/meminfo": 10 * 1024 * MiB)
    run_dir = tmp_path / "run"
    code = main(["search", "model=mlp", "model.parallel=ddp", "trial.gpus=2", "budget=6GiB", "device=cpu",
                 f"hydra.run.dir={run_dir}"])
    assert code == 2
    assert "2 trials at once x budget 6.00 GiB" in " ".join(capsys.readouterr().err.split())
    assert not (run_dir / "trials").exists()
