"""Tests of oomtune.gpu.nvml: the graceful path without a driver (this machine), and the readings,
index mapping and sampler peak logic against a fake ``pynvml`` with hand-made values."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from oomtune.exceptions import DeviceError
from oomtune.gpu import nvml
from oomtune.trial.record import DeviceInfo

GiB = 2**30


@pytest.fixture(autouse=True)
def _fresh_nvml():
    nvml._reset()
    yield
    nvml._reset()


class FakeNVMLError(Exception):
    pass


class FakeNvml:
    """A stand-in for the pynvml module: two devices, scripted per-call values (the last one repeats)."""

    NVMLError = FakeNVMLError

    def __init__(self, *, process_used=None, device_used=None, util=None, processes_supported=True):
        self.uuids = ["GPU-aaaa1111-0000", "GPU-bbbb2222-0000"]
        self.process_used = list(process_used or [0])
        self.device_used = list(device_used or [0])
        self.util = list(util or [0])
        self.processes_supported = processes_supported
        self.calls = {"procs": 0, "mem": 0, "util": 0}
        self.init_count = self.shutdown_count = 0

    def _next(self, key, values):
        i = self.calls[key]
        self.calls[key] += 1
        return values[min(i, len(values) - 1)]

    def nvmlInit(self):
        self.init_count += 1

    def nvmlShutdown(self):
        self.shutdown_count += 1

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        if not 0 <= i < 2:
            raise FakeNVMLError("Invalid Argument")
        return ("handle", i)

    def nvmlDeviceGetUUID(self, h):
        return self.uuids[h[1]]

    def nvmlDeviceGetName(self, h):
        return b"NVIDIA H200"  # older bindings return bytes

    def nvmlDeviceGetPciInfo(self, h):
        return SimpleNamespace(busId=f"00000000:1{h[1]}:00.0")

    def nvmlDeviceGetMemoryInfo(self, h):
        used = self._next("mem", self.device_used)
        return SimpleNamespace(total=141 * GiB, used=used, free=141 * GiB - used)

    def nvmlSystemGetDriverVersion(self):
        return "560.35.03"

    def nvmlSystemGetCudaDriverVersion(self):
        return 12060

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        if not self.processes_supported:
            raise FakeNVMLError("Not Supported")
        mine = self._next("procs", self.process_used)
        return [SimpleNamespace(pid=os.getpid(), usedGpuMemory=mine),
                SimpleNamespace(pid=2**22 + 12345, usedGpuMemory=50 * GiB)]  # someone else's process

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=self._next("util", self.util), memory=0)


def _install(monkeypatch, fake):
    monkeypatch.setattr(nvml, "_import_pynvml", lambda: fake)
    return fake


# ------------------------------------------------------------------ no driver: everything None/False
def _no_driver(monkeypatch):
    def _missing():
        raise ImportError("No module named 'pynvml'")
    monkeypatch.setattr(nvml, "_import_pynvml", _missing)


@pytest.mark.parametrize("setup", ["real", "import_error"])
def test_graceful_without_nvml(monkeypatch, setup):
    if setup == "import_error":
        _no_driver(monkeypatch)
    elif nvml.nvml_available():  # pragma: no cover - a machine with a driver
        pytest.skip("NVML is present here; the graceful path is covered by the import_error case")
    assert nvml.nvml_available() is False
    assert nvml.device_count() == 0
    assert nvml.device_identity(0) is None
    assert nvml.process_used_bytes({os.getpid()}, 0) is None
    assert nvml.memory_info(0) is None
    assert nvml.utilization_percent(0) is None
    assert nvml.query("nvmlDeviceGetCount", default="d") == "d"
    with nvml.MemorySampler(0) as sampler:
        time.sleep(0.05)
    assert sampler.result == nvml.SamplerResult(None, None, None, 0)


def test_init_failure_is_library_missing(monkeypatch):
    fake = FakeNvml()

    def broken_init():
        raise FakeNVMLError("Driver Not Loaded")
    fake.nvmlInit = broken_init
    _install(monkeypatch, fake)
    assert nvml.nvml_available() is False
    assert nvml.device_identity(0) is None


# ------------------------------------------------------------------ with a (fake) driver
def test_lazy_init_once_and_shutdown(monkeypatch):
    fake = _install(monkeypatch, FakeNvml())
    assert fake.init_count == 0  # nothing until the first query
    assert nvml.device_count() == 2
    assert nvml.device_count() == 2
    assert fake.init_count == 1
    nvml._reset()
    assert fake.shutdown_count == 1


def test_device_identity(monkeypatch):
    _install(monkeypatch, FakeNvml())
    assert nvml.device_identity(1, torch_index=0) == DeviceInfo(
        kind="cuda", name="NVIDIA H200", index=0, uuid="GPU-bbbb2222-0000", pci_bus_id="00000000:11:00.0",
        total_memory_bytes=141 * GiB, driver_version="560.35.03", cuda_version="12.6")
    assert nvml.device_identity(7) is None  # no such device: None, not an exception


def test_unsupported_metric_is_one_missing_reading(monkeypatch):
    _install(monkeypatch, FakeNvml(processes_supported=False, device_used=[3 * GiB]))
    assert nvml.nvml_available() is True
    assert nvml.process_used_bytes({os.getpid()}, 0) is None
    assert nvml.memory_info(0) == nvml.MemoryReading(141 * GiB, 3 * GiB, 138 * GiB)


def test_process_used_bytes_sums_only_the_given_pids(monkeypatch):
    _install(monkeypatch, FakeNvml(process_used=[5 * GiB]))
    assert nvml.process_used_bytes({os.getpid()}, 0) == 5 * GiB
    assert nvml.process_used_bytes({1}, 0) == 0  # listed processes, none of them ours


@pytest.mark.parametrize("visible, torch_index, expected", [
    (None, 1, 1), ("1,0", 0, 1), ("1,0", 1, 0), ("GPU-bbbb2222-0000", 0, 1), ("GPU-aaaa", 0, 0),
])
def test_physical_index_for(monkeypatch, visible, torch_index, expected):
    _install(monkeypatch, FakeNvml())
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert nvml.physical_index_for(torch_index) == expected


@pytest.mark.parametrize("visible, torch_index", [("1", 1), ("GPU-cccc", 0), ("0,-1,1", 1), ("", 0)])
def test_physical_index_for_errors(monkeypatch, visible, torch_index):
    _install(monkeypatch, FakeNvml())
    with pytest.raises(DeviceError):
        nvml.physical_index_for(torch_index, visible)


def test_uuid_mapping_needs_nvml(monkeypatch):
    _no_driver(monkeypatch)
    assert nvml.physical_index_for(0, "3") == 3  # integer entries need no NVML
    with pytest.raises(DeviceError):
        nvml.physical_index_for(0, "GPU-aaaa1111-0000")


# ------------------------------------------------------------------ process tree and sampler
def test_process_tree_includes_children_and_grandchildren():
    child = subprocess.Popen([sys.executable, "-c",
                              "import subprocess,sys,time; p=subprocess.Popen([sys.executable,'-c','import time; time.sleep(30)']);"
                              "print(p.pid, flush=True); time.sleep(30)"], stdout=subprocess.PIPE, text=True)
    try:
        grandchild = int(child.stdout.readline())
        tree = nvml.process_tree(os.getpid())
        assert {os.getpid(), child.pid, grandchild} <= tree
        assert nvml.process_tree(child.pid) >= {child.pid, grandchild}
        assert os.getpid() not in nvml.process_tree(child.pid)
    finally:
        os.kill(grandchild, 9)
        child.kill()
        child.wait()


def test_peak_tracker_by_hand():
    peaks = nvml._Peaks()
    for proc, dev, util in [(1 * GiB, 10 * GiB, 10), (4 * GiB, 12 * GiB, 30), (2 * GiB, 11 * GiB, None)]:
        peaks.add(proc, dev, util)
    assert peaks.result() == nvml.SamplerResult(4 * GiB, "process", 20.0, 3)


def test_peak_tracker_falls_back_to_device_wide():
    peaks = nvml._Peaks()
    peaks.add(None, 7 * GiB, None)
    peaks.add(0, 9 * GiB, None)  # per-process listed nothing of ours: not a reading of 0
    assert peaks.result() == nvml.SamplerResult(9 * GiB, "device", None, 2)


def _wait_for(fake, key, n, timeout=60.0):
    """Wait until the sampler thread made ``n`` calls of ``key``: a deadline generous for a loaded machine,
    where the thread may wait seconds for a core, and an assertion at it (what follows needs them)."""
    deadline = time.monotonic() + timeout
    while fake.calls[key] < n and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fake.calls[key] >= n, f"the sampler made {fake.calls[key]} {key} calls in {timeout:g} s, not {n}"


def test_sampler_thread_peak_per_process(monkeypatch):
    fake = _install(monkeypatch, FakeNvml(process_used=[1 * GiB, 6 * GiB, 2 * GiB], device_used=[70 * GiB],
                                          util=[40]))
    with nvml.MemorySampler(0, interval_s=0.005) as sampler:
        _wait_for(fake, "procs", 4)
    result = sampler.result
    assert result.peak_used_bytes == 6 * GiB  # not the other process's 50 GiB, not device-wide 70 GiB
    assert result.peak_source == "process"
    assert result.mean_utilization_percent == 40.0
    assert result.samples >= 4


def test_sampler_thread_device_fallback(monkeypatch):
    fake = _install(monkeypatch, FakeNvml(processes_supported=False, device_used=[3 * GiB, 8 * GiB, 5 * GiB]))
    with nvml.MemorySampler(0, interval_s=0.005) as sampler:
        _wait_for(fake, "mem", 4)
    assert (sampler.result.peak_used_bytes, sampler.result.peak_source) == (8 * GiB, "device")


# -- device=auto without importing torch (oomtune.device.cuda_surely_absent) ----------------------------


class _InitFails:
    """A pynvml whose nvmlInit raises the named NVMLError subclass (pynvml names them so)."""

    def __init__(self, name):
        self.error = type(name, (Exception,), {})

    def nvmlInit(self):
        raise self.error("nvmlInit failed")


class _NoGpu(FakeNvml):
    def nvmlDeviceGetCount(self):
        return 0


@pytest.mark.parametrize("torch_version, fake, absent", [
    ("2.14.1+cpu", FakeNvml(), True),                      # a CPU-only build never has CUDA
    ("2.14.1+cu130", _InitFails("NVMLError_LibraryNotFound"), True),   # no driver installed
    ("2.14.1+cu130", _InitFails("NVMLError_DriverNotLoaded"), True),   # driver not loaded
    ("2.14.1+cu130", _NoGpu(), True),                      # NVML works and counts no GPU
    ("2.14.1+cu130", FakeNvml(), False),                   # GPUs: torch decides
    ("2.14.1+cu130", _InitFails("NVMLError_Unknown"), False),   # unknown NVML failure: torch decides
    ("2.14.1+rocm6.2", _InitFails("NVMLError_LibraryNotFound"), False),   # AMD GPUs: NVML cannot tell
    ("2.14.1", _InitFails("NVMLError_LibraryNotFound"), True),  # PyPI's plain CUDA build, no driver
])
def test_cuda_surely_absent_decides_only_what_is_certain(torch_version, fake, absent, monkeypatch):
    from importlib import metadata

    from oomtune import device

    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda d: torch_version if d == "torch" else real(d))
    monkeypatch.setattr(nvml, "_import_pynvml", lambda: fake)
    assert device.cuda_surely_absent() is absent


def test_device_auto_and_cpu_resolve_without_importing_torch_where_no_driver_is_installed():
    code = ("import sys\nfrom oomtune.device import resolve_device, cuda_surely_absent\n"
            "assert resolve_device('cpu', virtual_device_memory='8GiB').kind == 'cpu'\n"
            "after_cpu = 'torch' in sys.modules\nabsent = cuda_surely_absent()\n"
            "kind = resolve_device('auto').kind\n"
            "print(after_cpu, absent, kind, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    after_cpu, absent, kind, after_auto = out.stdout.split()
    assert after_cpu == "False"   # device=cpu never needs torch
    if absent == "True":          # no driver here (CI): auto is the virtual GPU, still without torch
        assert (kind, after_auto) == ("cpu", "False")
    else:                         # a driver: torch decided
        assert after_auto == "True"
