"""NVML wrapper that degrades gracefully (after nvitop's ``nvitop/api/libnvml.py``).

Every NVML call goes through :func:`query`: NVML is initialised lazily under a lock on first use and
shut down at interpreter exit; a failed call returns a default (None). Two kinds of absence differ:

- the library is missing or will not initialise (no driver, CPU-only machine): :func:`nvml_available`
  is False and every reading is None;
- one metric is unsupported on this device (e.g. per-process memory under some containers, MIG):
  that one reading is None, the others work.

Readings are in bytes (memory) and percent (utilisation); never 0 for a reading that was not taken.
Nothing here creates a CUDA context.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from oomtune.exceptions import DeviceError
from oomtune.gpu.info import DeviceInfo

__all__ = [
    "query", "nvml_available", "no_driver", "device_count", "device_identity", "physical_index_for",
    "index_for_uuid", "index_for_pci_bus_id", "physical_index_of_torch_device", "normal_uuid", "torch_pci_bus_id",
    "process_tree", "process_used_bytes", "memory_info", "utilization_percent",
    "MemoryReading", "SamplerResult", "MemorySampler", "MultiSampler",
]

_LOCK = threading.RLock()
_STATE: dict[str, Any] = {"lib": None, "tried": False, "atexit": False, "error": None}


def _import_pynvml() -> ModuleType:
    """Import the NVML bindings (package ``nvidia-ml-py``); tests replace this function."""
    import pynvml

    return pynvml


def _init() -> ModuleType | None:
    """The initialised NVML module, or None when the library is missing or nvmlInit fails.
    Tried once per process (until :func:`_reset`)."""
    with _LOCK:
        if not _STATE["tried"]:
            _STATE["tried"] = True
            _STATE["error"] = None
            try:
                lib = _import_pynvml()
                lib.nvmlInit()
            except Exception as exc:  # ImportError, NVMLError_LibraryNotFound, NVMLError_DriverNotLoaded, ...
                lib = None
                _STATE["error"] = type(exc).__name__
            _STATE["lib"] = lib
            if lib is not None and not _STATE["atexit"]:
                atexit.register(_shutdown)
                _STATE["atexit"] = True
        return _STATE["lib"]


def _shutdown() -> None:
    with _LOCK:
        lib = _STATE["lib"]
        _STATE["lib"] = None
        if lib is not None:
            try:
                lib.nvmlShutdown()
            except Exception:
                pass


def _reset() -> None:
    """Shut NVML down and forget the result of the first initialisation (for tests)."""
    with _LOCK:
        _shutdown()
        _STATE["tried"] = False


def query(func: str, *args: Any, default: Any = None) -> Any:
    """Call ``pynvml.<func>(*args)``; on a missing library, missing function or NVMLError, return
    ``default``. Never raises."""
    lib = _init()
    fn = getattr(lib, func, None) if lib is not None else None
    if fn is None:
        return default
    try:
        return fn(*args)
    except Exception:  # NVMLError_NotSupported, NVMLError_NoPermission, GPU lost, ...
        return default


def nvml_available() -> bool:
    """True when the NVML library loaded and initialised (a driver is present)."""
    return _init() is not None


def no_driver() -> bool:
    """True when NVML's own answer is that no NVIDIA driver is installed or loaded: ``nvmlInit``
    raised ``NVMLError_LibraryNotFound`` (libnvidia-ml, which every NVIDIA driver installs beside
    libcuda, is absent) or ``NVMLError_DriverNotLoaded``. False when NVML works, when the bindings
    are not installed, or on any other failure (then nothing is known)."""
    _init()
    return _STATE["error"] in ("NVMLError_LibraryNotFound", "NVMLError_DriverNotLoaded")


def _text(value: Any) -> str | None:
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


def device_count() -> int:
    """Number of devices NVML sees (all physical GPUs, ignoring CUDA_VISIBLE_DEVICES); 0 without
    NVML (check :func:`nvml_available` to tell "no GPU" from "no NVML")."""
    return int(query("nvmlDeviceGetCount", default=0) or 0)


def _handle(index: int) -> Any:
    return query("nvmlDeviceGetHandleByIndex", index)


def device_identity(index: int, *, torch_index: int | None = None) -> DeviceInfo | None:
    """Identity of the physical device with NVML index ``index`` (field case C10).

    Args:
        index: NVML (physical) index; see :func:`physical_index_for`.
        torch_index: torch's visible index, stored as ``DeviceInfo.index``.

    Returns:
        DeviceInfo with name, UUID, PCI bus id, total memory (bytes), driver and CUDA driver versions;
        each unsupported field None. None when NVML is unavailable or the index does not exist.
    """
    handle = _handle(index)
    if handle is None:
        return None
    pci = query("nvmlDeviceGetPciInfo", handle)
    mem = query("nvmlDeviceGetMemoryInfo", handle)
    cuda = query("nvmlSystemGetCudaDriverVersion")  # e.g. 12040 -> "12.4"
    return DeviceInfo(
        kind="cuda",
        name=_text(query("nvmlDeviceGetName", handle)),
        index=torch_index,
        uuid=_text(query("nvmlDeviceGetUUID", handle)),
        pci_bus_id=_text(getattr(pci, "busId", None)),
        total_memory_bytes=None if mem is None else int(mem.total),
        driver_version=_text(query("nvmlSystemGetDriverVersion")),
        cuda_version=None if cuda is None else f"{int(cuda) // 1000}.{int(cuda) % 1000 // 10}",
    )


def physical_index_for(torch_index: int, visible_devices: str | None = None) -> int:
    """The NVML index of torch's device ``torch_index`` under CUDA_VISIBLE_DEVICES.

    Args:
        torch_index: torch's (visible) device index, >= 0.
        visible_devices: the CUDA_VISIBLE_DEVICES string; default: this process's environment.
            Entries are indices or ``GPU-`` UUIDs (unique prefixes allowed, as in CUDA); parsing stops
            at the first empty entry. Integer entries are taken as NVML (PCI-order) indices, which is
            exact with CUDA_DEVICE_ORDER=PCI_BUS_ID or identical GPUs (CUDA's default order is
            fastest-first).

    Raises:
        DeviceError: the index is negative or not visible, or a UUID entry matches no NVML device
            (including when NVML is unavailable).
    """
    if torch_index < 0:
        raise DeviceError(f"device index {torch_index} is negative")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible_devices is None else visible_devices
    if visible is None:
        return torch_index
    entries = []
    for entry in visible.split(","):
        if not entry.strip() or entry.strip().startswith("-"):  # CUDA stops at an empty or negative entry
            break
        entries.append(entry.strip())
    if torch_index >= len(entries):
        raise DeviceError(f"device {torch_index} is not visible under CUDA_VISIBLE_DEVICES={visible!r}")
    entry = entries[torch_index]
    if entry.isdigit():
        return int(entry)
    for i in range(device_count()):
        uuid = _text(query("nvmlDeviceGetUUID", _handle(i)))
        if uuid is not None and uuid.startswith(entry):
            return i
    raise DeviceError(f"CUDA_VISIBLE_DEVICES entry {entry!r} matches no device NVML can see")


def normal_uuid(value: Any) -> str | None:
    """A GPU UUID in one spelling, for comparing NVML's (``"GPU-58389994-c5c0-..."``) with torch's
    (``str(get_device_properties(i).uuid)``, ``"58389994-c5c0-..."``; or a ``_CUuuid`` whose
    ``bytes`` are the 16 raw bytes): lower-case hex with dashes, the ``GPU-``/``MIG-`` prefix dropped.
    None for None or an empty value."""
    if value is None:
        return None
    raw = getattr(value, "bytes", None)
    text = _text(value) or ""
    if isinstance(raw, (bytes, bytearray)) and len(raw) == 16 and "-" not in text:
        import uuid as _uuid

        text = str(_uuid.UUID(bytes=bytes(raw)))
    text = text.strip().lower()
    for prefix in ("gpu-", "mig-"):
        if text.startswith(prefix):
            text = text[len(prefix):]
    return text or None


def index_for_uuid(uuid: Any) -> int | None:
    """The NVML index of the device with this UUID (:func:`normal_uuid` on both sides), None when no
    device NVML sees has it (or NVML is unavailable)."""
    want = normal_uuid(uuid)
    if want is None:
        return None
    for i in range(device_count()):
        if normal_uuid(query("nvmlDeviceGetUUID", _handle(i))) == want:
            return i
    return None


def _pci_key(bus_id: Any) -> tuple[int, int, int] | None:
    """(domain, bus, device) of a PCI bus id such as ``"00000000:19:00.0"`` or ``"0000:19:00.0"``."""
    text = _text(bus_id)
    if not text:
        return None
    try:
        domain, bus, rest = text.strip().split(":")
        return int(domain, 16), int(bus, 16), int(rest.split(".")[0], 16)
    except ValueError:
        return None


def torch_pci_bus_id(props: Any) -> str | None:
    """The PCI bus id of a torch ``_CudaDeviceProperties`` (``pci_domain_id``, ``pci_bus_id``,
    ``pci_device_id``) in NVML's spelling ``"00000000:19:00.0"``; None when torch does not give it."""
    try:
        return f"{int(props.pci_domain_id):08X}:{int(props.pci_bus_id):02X}:{int(props.pci_device_id):02X}.0"
    except (AttributeError, TypeError, ValueError):
        return None


def index_for_pci_bus_id(bus_id: Any) -> int | None:
    """The NVML index of the device at this PCI bus id (domain, bus and device compared as numbers),
    None when no device NVML sees is there."""
    want = _pci_key(bus_id)
    if want is None:
        return None
    for i in range(device_count()):
        pci = query("nvmlDeviceGetPciInfo", _handle(i))
        if _pci_key(getattr(pci, "busId", None)) == want:
            return i
    return None


def physical_index_of_torch_device(props: Any, torch_index: int = 0,
                                   visible_devices: str | None = None) -> tuple[int | None, str]:
    """The NVML index of the CUDA device whose torch properties are ``props``, and how it was found.

    ``CUDA_VISIBLE_DEVICES`` integers are CUDA's enumeration order (``CUDA_DEVICE_ORDER``, fastest
    first by default), while NVML indexes devices by PCI bus: on a host with mixed GPUs the N-th CUDA
    device is not NVML's N-th. So the device is matched by its UUID
    (``props.uuid``), else its PCI bus id; only when torch gives neither does the old index rule
    (:func:`physical_index_for`) apply, exact with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` or identical GPUs.

    Returns:
        (NVML index or None, ``"uuid"`` | ``"pci_bus_id"`` | ``"index"`` | ``"none"``).
    """
    found = index_for_uuid(getattr(props, "uuid", None))
    if found is not None:
        return found, "uuid"
    found = index_for_pci_bus_id(torch_pci_bus_id(props))
    if found is not None:
        return found, "pci_bus_id"
    if getattr(props, "uuid", None) is not None and nvml_available():
        return None, "none"   # torch named the device and NVML does not see it: no guess
    try:
        return physical_index_for(torch_index, visible_devices), "index"
    except DeviceError:
        return None, "none"


def process_tree(pid: int) -> set[int]:
    """``pid`` and all its descendants, read from ``/proc/<pid>/stat`` (Linux; ``{pid}`` elsewhere)."""
    children: dict[int, list[int]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return {pid}
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:  # the process exited meanwhile
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # comm may hold spaces and parentheses
        if len(fields) > 1 and fields[1].isdigit():
            children.setdefault(int(fields[1]), []).append(int(name))
    tree, todo = {pid}, [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in tree:
                tree.add(child)
                todo.append(child)
    return tree


def _as_handle(device: Any) -> Any:
    return _handle(device) if isinstance(device, int) else device


def process_used_bytes(pids: set[int], device: Any) -> int | None:
    """Device memory (bytes) used by the processes ``pids`` on ``device`` (NVML index or handle), from
    ``nvmlDeviceGetComputeRunningProcesses``: the sum over listed processes whose pid is in ``pids``
    (0 when none is listed). None when NVML is unavailable, the call is unsupported, or a matching
    process's usage is not reported (usedGpuMemory None, e.g. Windows WDDM)."""
    handle = _as_handle(device)
    procs = None if handle is None else query("nvmlDeviceGetComputeRunningProcesses", handle)
    if procs is None:
        return None
    total = 0
    for proc in procs:
        if getattr(proc, "pid", None) in pids:
            used = getattr(proc, "usedGpuMemory", None)
            if used is None:
                return None
            total += int(used)
    return total


@dataclass(frozen=True)
class MemoryReading:
    """Device-wide memory from ``nvmlDeviceGetMemoryInfo``, all in bytes."""

    total_bytes: int
    used_bytes: int
    free_bytes: int


def memory_info(device: Any) -> MemoryReading | None:
    """Device-wide memory of ``device`` (NVML index or handle); None without NVML/support."""
    handle = _as_handle(device)
    mem = None if handle is None else query("nvmlDeviceGetMemoryInfo", handle)
    return None if mem is None else MemoryReading(int(mem.total), int(mem.used), int(mem.free))


def utilization_percent(device: Any) -> int | None:
    """GPU utilisation in percent (0-100) over NVML's last sample period
    (``nvmlDeviceGetUtilizationRates().gpu``); None without NVML/support."""
    handle = _as_handle(device)
    rates = None if handle is None else query("nvmlDeviceGetUtilizationRates", handle)
    return None if rates is None else int(rates.gpu)


@dataclass(frozen=True)
class SamplerResult:
    """What a :class:`MemorySampler` saw.

    Attributes:
        peak_used_bytes: highest device memory used, bytes; None when nothing was read.
        peak_source: ``"process"`` (sum over the pid tree, nvmlDeviceGetComputeRunningProcesses) or
            ``"device"`` (device-wide used memory, when per-process readings are unsupported or never
            listed the tree, e.g. a container hiding host pids); None when nothing was read.
        mean_utilization_percent: mean of nvmlDeviceGetUtilizationRates().gpu samples, percent; None
            when unsupported.
        samples: number of sampling rounds taken.
    """

    peak_used_bytes: int | None
    peak_source: str | None
    mean_utilization_percent: float | None
    samples: int


class _Peaks:
    """Running peaks and utilisation mean; per-process readings win over device-wide ones."""

    def __init__(self) -> None:
        self.process_peak: int | None = None
        self.device_peak: int | None = None
        self.util_sum, self.util_n, self.samples = 0.0, 0, 0

    def add(self, process_bytes: int | None, device_bytes: int | None, util: int | None) -> None:
        self.samples += 1
        if process_bytes is not None:
            self.process_peak = max(self.process_peak or 0, process_bytes)
        if device_bytes is not None:
            self.device_peak = max(self.device_peak or 0, device_bytes)
        if util is not None:
            self.util_sum, self.util_n = self.util_sum + util, self.util_n + 1

    def result(self) -> SamplerResult:
        mean = self.util_sum / self.util_n if self.util_n else None
        if self.process_peak:  # a peak of 0 means the tree was never listed: not a reading
            return SamplerResult(self.process_peak, "process", mean, self.samples)
        if self.device_peak is not None:
            return SamplerResult(self.device_peak, "device", mean, self.samples)
        return SamplerResult(None, None, mean, self.samples)


class MemorySampler:
    """Context manager: a daemon thread samples device memory and utilisation every ``interval_s``.

    Example::

        with MemorySampler(physical_index, pid=child.pid) as sampler:
            child.wait()
        sampler.result.peak_used_bytes

    Args:
        device: NVML (physical) index of the device.
        pid: root of the process tree whose memory is summed (default: this process); the tree is
            re-read from /proc every ``tree_refresh_s``.
        interval_s: sampling period in seconds (default 0.02).

    Without NVML no thread starts and the result is all None with ``samples == 0``.
    """

    def __init__(self, device: int, *, pid: int | None = None, interval_s: float = 0.02,
                 tree_refresh_s: float = 0.25) -> None:
        self.device, self.pid = device, os.getpid() if pid is None else pid
        self.interval_s, self.tree_refresh_s = interval_s, tree_refresh_s
        self._peaks = _Peaks()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "MemorySampler":
        handle = _handle(self.device) if nvml_available() else None
        if handle is not None:
            self._thread = threading.Thread(target=self._run, args=(handle,), name="oomtune-nvml-sampler",
                                            daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def _sample(self, handle: Any, pids: set[int]) -> None:
        mem = memory_info(handle)
        self._peaks.add(process_used_bytes(pids, handle), None if mem is None else mem.used_bytes,
                        utilization_percent(handle))

    def _run(self, handle: Any) -> None:
        pids, refreshed = process_tree(self.pid), time.monotonic()
        while True:
            self._sample(handle, pids)
            if self._stop.wait(self.interval_s):
                break
            if time.monotonic() - refreshed >= self.tree_refresh_s:
                pids, refreshed = process_tree(self.pid) | pids, time.monotonic()
        self._sample(handle, pids)  # one last reading at exit

    @property
    def result(self) -> SamplerResult:
        """The readings so far (final after the ``with`` block ends)."""
        return self._peaks.result()


class MultiSampler:
    """Context manager: one :class:`MemorySampler` per GPU of a multi-GPU trial, each summing the same
    process tree's memory on its device.

    Args:
        devices: NVML (physical) indices of the trial's GPUs, in the trial's order (rank order).
        pid: root of the process tree (as for :class:`MemorySampler`).

    ``result`` merges them: the highest device's peak (its source, ``process`` or ``device``) and the
    mean utilisation over the devices that reported one; ``results`` is each device's.
    """

    def __init__(self, devices: list[int], *, pid: int | None = None, interval_s: float = 0.02) -> None:
        self.devices = list(devices)
        self.samplers = [MemorySampler(d, pid=pid, interval_s=interval_s) for d in self.devices]

    def __enter__(self) -> "MultiSampler":
        for sampler in self.samplers:
            sampler.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        for sampler in self.samplers:
            sampler.__exit__(*exc)

    @property
    def results(self) -> list[SamplerResult]:
        """Each device's readings, in the order of ``devices``."""
        return [s.result for s in self.samplers]

    @property
    def result(self) -> SamplerResult:
        """The worst device's peak and the mean utilisation over the devices (see the class docstring)."""
        results = self.results
        peaks = [r for r in results if r.peak_used_bytes is not None]
        worst = max(peaks, key=lambda r: r.peak_used_bytes) if peaks else None
        utils = [r.mean_utilization_percent for r in results if r.mean_utilization_percent is not None]
        return SamplerResult(None if worst is None else worst.peak_used_bytes,
                             None if worst is None else worst.peak_source,
                             sum(utils) / len(utils) if utils else None,
                             sum(r.samples for r in results))
