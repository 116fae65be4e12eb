"""The GPU path on a CPU, through the code it fixes: fake NVML, patched torch
totals, a forced bad fork; and the same checks on a device (``cuda`` marks, skipped without one).

Figures: an A100-80GB as the issue gives it, NVML total 81920 MiB against torch's ``total_memory``
79.15 GiB (what ``set_per_process_memory_fraction`` multiplies, ``cudaDeviceProp::totalGlobalMem``)."""

from __future__ import annotations

import io
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from oomtune.exceptions import DeviceError
from oomtune.gpu import nvml
from oomtune.study.records import used_bytes
from oomtune.trial.budget import memory_fraction_for_budget
from oomtune.trial.record import BudgetReadings, MemoryReadings, ResultDraft, TrialResult, TrialSpec
from oomtune.units import GiB, MiB

NVML_TOTAL = 81920 * MiB
TORCH_TOTAL = int(79.15 * GiB)


class FakeNvml:
    """Two GPUs in NVML's (PCI bus) order: an A100 at bus 0x19 and an H100 at bus 0x3b. CUDA's
    default order is fastest first, so torch's device 0 is the H100, NVML's index 1."""

    NVMLError = RuntimeError

    def __init__(self):
        self.devices = [("NVIDIA A100-SXM4-80GB", "GPU-aaaa1111-2222-3333-4444-555555555555", "00000000:19:00.0"),
                        ("NVIDIA H100 80GB HBM3", "GPU-bbbb1111-2222-3333-4444-555555555555", "00000000:3B:00.0")]

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetCount(self):
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, i):
        if not 0 <= i < len(self.devices):
            raise RuntimeError("Invalid Argument")
        return ("h", i)

    def nvmlDeviceGetName(self, h):
        return self.devices[h[1]][0]

    def nvmlDeviceGetUUID(self, h):
        return self.devices[h[1]][1]

    def nvmlDeviceGetPciInfo(self, h):
        return SimpleNamespace(busId=self.devices[h[1]][2])

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(total=NVML_TOTAL, used=0, free=NVML_TOTAL)

    def nvmlSystemGetDriverVersion(self):
        return "560.35.03"

    def nvmlSystemGetCudaDriverVersion(self):
        return 12060


def _props(uuid="bbbb1111-2222-3333-4444-555555555555", bus=0x3B, total=TORCH_TOTAL, name="NVIDIA H100 80GB HBM3"):
    return SimpleNamespace(uuid=uuid, pci_domain_id=0, pci_bus_id=bus, pci_device_id=0, total_memory=total, name=name)


@pytest.fixture
def fake_nvml(monkeypatch):
    nvml._reset()
    fake = FakeNvml()
    monkeypatch.setattr(nvml, "_import_pynvml", lambda: fake)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    yield fake
    nvml._reset()


@pytest.fixture
def fake_torch_cuda(monkeypatch):
    import torch

    props = {0: _props(), 1: _props("aaaa1111-2222-3333-4444-555555555555", 0x19, name="NVIDIA A100-SXM4-80GB")}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props[int(i)])
    return props


# ---------------------------------------------------------------- the budget against torch's total
def test_the_device_total_is_torchs_and_a_099_budget_fits_the_trials_fraction(fake_nvml, fake_torch_cuda):
    from oomtune.device import resolve_budget, resolve_device

    dev = resolve_device("cuda:0")
    assert dev.total_memory_bytes == TORCH_TOTAL                    # not NVML's 81920 MiB
    assert (dev.name, dev.uuid, dev.pci_bus_id) == ("NVIDIA H100 80GB HBM3", FakeNvml().devices[1][1], "00000000:3B:00.0")
    budget = resolve_budget("0.99", dev)
    assert budget == int(0.99 * TORCH_TOTAL)
    # the child's fraction (budget - non-allocator) / torch total: below 1, no error
    assert 0 < memory_fraction_for_budget(budget, TORCH_TOTAL, 500 * MiB) < 0.99
    # with NVML's total, 0.99 of it is above torch's total: every CUDA trial was an error
    with pytest.raises(DeviceError, match="exceeds the device"):
        memory_fraction_for_budget(int(0.99 * NVML_TOTAL), TORCH_TOTAL, 500 * MiB)
    assert resolve_budget("1.0", dev) == TORCH_TOTAL


# ---------------------------------------------------------------- CUDA_VISIBLE_DEVICES -> NVML by UUID
def test_cuda_device_maps_to_nvml_by_uuid_not_by_index(fake_nvml, monkeypatch):
    # CUDA_VISIBLE_DEVICES=0 is CUDA's device 0 (the H100, fastest first); NVML's index 0 is the A100.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert nvml.physical_index_for(0) == 0                           # the old rule: the wrong card
    assert nvml.physical_index_of_torch_device(_props(), 0) == (1, "uuid")
    no_uuid = SimpleNamespace(**{**vars(_props()), "uuid": None})
    assert nvml.physical_index_of_torch_device(no_uuid, 0) == (1, "pci_bus_id")
    unknown = _props(uuid="cccc0000-0000-0000-0000-000000000000", bus=0x99)
    assert nvml.physical_index_of_torch_device(unknown, 0) == (None, "none")   # NVML does not see it: no guess


def test_the_trials_device_record_is_the_card_it_ran_on(fake_nvml):
    from oomtune.trial.child import _cuda_device_info

    rec = ResultDraft(TrialResult(outcome="ok"))
    info, physical = _cuda_device_info(nvml, _props(), rec)
    result = rec.result
    assert physical == 1 and info.name == "NVIDIA H100 80GB HBM3" and info.pci_bus_id == "00000000:3B:00.0"
    assert result.budget.nvml_match == "uuid"


def test_uuid_spellings_compare_equal():
    assert nvml.normal_uuid("GPU-BBBB1111-2222") == nvml.normal_uuid("bbbb1111-2222") == "bbbb1111-2222"
    raw = SimpleNamespace(bytes=bytes(range(16)))
    assert nvml.normal_uuid(raw) == "00010203-0405-0607-0809-0a0b0c0d0e0f"


# ---------------------------------------------------------------- the peak: the larger reading
@pytest.mark.parametrize("nvml_peak, reserved, outside, expected", [
    (900 * MiB, 950 * MiB, 50 * MiB, 1000 * MiB),   # the 20 ms sampler missed the peak: the allocator's counts
    (1100 * MiB, 950 * MiB, 50 * MiB, 1100 * MiB),  # memory the allocator does not see: NVML's counts
    (None, 950 * MiB, 50 * MiB, 1000 * MiB),
    (700 * MiB, None, None, 700 * MiB),             # a command without the capture hook: NVML only
    (None, None, None, None),
])
def test_used_bytes_is_the_larger_of_nvml_and_the_allocators_exact_peak(nvml_peak, reserved, outside, expected):
    res = TrialResult(outcome="ok", memory=MemoryReadings(source="device", device_peak_bytes=nvml_peak,
                                                          peak_reserved_bytes=reserved, non_allocator_bytes=outside))
    assert used_bytes(res) == expected


# ---------------------------------------------------------------- non-allocator memory after warm-up
def test_memory_outside_the_allocator_is_measured_again_after_warm_up(monkeypatch):
    import torch

    from oomtune.trial import child

    readings = iter([(TORCH_TOTAL - 700 * MiB, TORCH_TOTAL)])   # free, total after warm-up: 700 MiB used
    applied = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev: next(readings))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda dev: 200 * MiB)   # 500 MiB outside the allocator
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, dev: applied.append(f))
    spec = TrialSpec(workload={}, batch_size=8, device="cuda:0", budget_bytes=16 * GiB)
    rec = ResultDraft(TrialResult(outcome="ok", memory=MemoryReadings(non_allocator_bytes=300 * MiB),
                                  budget=BudgetReadings(memory_fraction=(16 * GiB - 300 * MiB) / TORCH_TOTAL)))
    child.remeasure_outside_allocator(spec, rec, "cuda:0", TORCH_TOTAL)
    result = rec.result
    assert result.memory.non_allocator_bytes == 500 * MiB
    assert result.budget.non_allocator_bytes_after_warmup == 500 * MiB
    assert applied == [(16 * GiB - 500 * MiB) / TORCH_TOTAL] == [result.budget.memory_fraction]


def test_the_remeasure_runs_after_the_warm_up_step_outside_the_timing():
    from oomtune.trial import child

    class Steps:
        def run_steps(self, n, sync=True):
            from oomtune.workloads.loop import StepTimings

            return StepTimings(samples_per_step=8, step_s=[0.01], data_wait_s=[0.0])

    seen = []
    spec = TrialSpec(workload={}, batch_size=8, warmup_steps=2, measure_steps=3)
    rec = ResultDraft(TrialResult(outcome="ok"))
    child._timed_steps(spec, Steps(), rec, on_step=seen.append)
    result = rec.result
    assert seen == [1, 2, 3, 4, 5] and result.throughput.steps == 5


def test_a_time_window_extends_the_measured_steps():
    from oomtune.trial import child

    class Steps:
        def run_steps(self, n, sync=True):
            from oomtune.workloads.loop import StepTimings

            return StepTimings(samples_per_step=8, step_s=[0.5], data_wait_s=[0.0])   # 0.5 s a step (faked)

    spec = TrialSpec(workload={}, batch_size=8, warmup_steps=1, measure_steps=2, measure_seconds=2.0)
    rec = ResultDraft(TrialResult(outcome="ok"))
    child._timed_steps(spec, Steps(), rec)
    result = rec.result
    assert result.throughput.steps == 1 + 4              # 4 measured steps of 0.5 s fill the 2 s window
    assert result.throughput.samples_per_s == pytest.approx(16.0)   # 8 samples / 0.5 s


# ---------------------------------------------------------------- the fork server and a bad fork
def test_libcuda_in_the_maps_is_detected(tmp_path):
    from oomtune.trial.forkserver import libcuda_loaded

    maps = tmp_path / "maps"
    maps.write_text("7f00-7f10 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    assert not libcuda_loaded(str(maps))
    maps.write_text(maps.read_text() + "7f20-7f30 r-xp 0 08:01 2 /usr/lib/x86_64-linux-gnu/libcuda.so.560.35.03\n")
    assert libcuda_loaded(str(maps)) and not libcuda_loaded(str(tmp_path / "absent"))


def test_the_fork_server_refuses_to_fork_once_libcuda_is_loaded(monkeypatch):
    from oomtune.trial import forkserver

    monkeypatch.setattr(forkserver, "libcuda_loaded", lambda *a: True)
    monkeypatch.setattr(os, "fork", lambda: pytest.fail("forked although libcuda is loaded"))
    out = io.StringIO()
    forkserver._launch({"id": 7, "argv": [], "cwd": ".", "stdout": os.devnull, "stderr": os.devnull, "env": {}},
                       {}, out, [])
    reply = json.loads(out.getvalue())
    assert reply["id"] == 7 and "libcuda.so" in reply["error"]


@pytest.mark.slow
def test_a_bad_fork_is_run_again_by_spawn(tmp_path):
    from oomtune.trial.child import TEST_HOOK_ENV
    from oomtune.trial.runner import TrialRunner

    mlp = {"name": "mlp", "in_features": 64, "hidden": 128, "layers": 1, "num_classes": 10, "optimizer": "sgd",
           "lr": 0.1, "precision": "fp32", "data": {"source": "synthetic"}}
    spec = TrialSpec(workload=mlp, batch_size=4, device="cpu", budget_bytes=64 * MiB, warmup_steps=1,
                     measure_steps=1, timeout_s=120)
    with TrialRunner(launcher="fork") as runner:
        assert runner.start_fork_server()
        r = runner.run(spec, workdir=tmp_path / "a", env={TEST_HOOK_ENV: "bad_fork"})
        assert r.outcome == "ok" and r.process.launcher == "spawn"
        assert "Cannot re-initialize CUDA in forked subprocess" in r.process.bad_fork.message
        again = runner.run(spec, workdir=tmp_path / "b")          # the server is not used again
        assert again.process.launcher == "spawn" and "could not use CUDA" in again.process.launcher_fallback


# ---------------------------------------------------------------- on a device
cuda = pytest.mark.cuda


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


@cuda
@pytest.mark.skipif(not _cuda_available(), reason="needs a CUDA device")
def test_on_a_device_the_budget_is_torchs_total_and_the_parent_holds_no_context():
    import torch

    from oomtune.device import resolve_budget, resolve_device

    nvml._reset()
    dev = resolve_device("cuda:0")
    assert dev.total_memory_bytes == torch.cuda.get_device_properties(0).total_memory
    assert resolve_budget("0.99", dev) <= dev.total_memory_bytes
    physical, how = nvml.physical_index_of_torch_device(torch.cuda.get_device_properties(0), 0)
    assert how in ("uuid", "pci_bus_id") and nvml.normal_uuid(nvml.device_identity(physical).uuid) == \
        nvml.normal_uuid(torch.cuda.get_device_properties(0).uuid)
    used = nvml.process_used_bytes({os.getpid()}, physical)
    assert not used                                  # no CUDA context of this process on the device


@cuda
@pytest.mark.skipif(not _cuda_available(), reason="needs a CUDA device")
def test_on_a_device_a_099_budget_trial_runs_and_remeasures(tmp_path):
    from oomtune.trial.runner import TrialRunner

    mlp = {"name": "mlp", "in_features": 256, "hidden": 512, "layers": 2, "num_classes": 10, "optimizer": "sgd",
           "lr": 0.1, "precision": "fp32", "data": {"source": "synthetic"}}
    import torch

    total = torch.cuda.get_device_properties(0).total_memory
    spec = TrialSpec(workload=mlp, batch_size=64, device="cuda:0", budget_bytes=int(0.99 * total), warmup_steps=2,
                     measure_steps=2, timeout_s=240)
    r = TrialRunner(launcher="spawn").run(spec, workdir=tmp_path)
    assert r.outcome == "ok", r.message
    assert r.budget.nvml_match in ("uuid", "pci_bus_id")
    assert r.budget.non_allocator_bytes_after_warmup is not None
    assert r.memory.non_allocator_bytes >= r.budget.non_allocator_bytes_at_start
    assert 0 < r.budget.memory_fraction < 0.99 and r.device.total_memory_bytes == total
