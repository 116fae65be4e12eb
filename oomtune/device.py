"""Resolving the ``device`` and ``budget`` settings in the parent process, without a CUDA context.

The parent never creates a CUDA context (it would occupy device memory the trials need). The
device's capacity is torch's ``total_memory`` (``cudaDeviceProp::totalGlobalMem``, read by
``torch.cuda.get_device_properties``, which needs no context): the figure a trial's
``set_per_process_memory_fraction`` is a fraction of, smaller than NVML's total (A100-80GB: 79.15 GiB
against 80 GiB), so that ``budget=1.0`` or ``0.99`` means the same bytes in the parent and in the
trial. The identity (name, UUID, PCI bus id, driver) comes from NVML, matched to
torch's device by UUID (:func:`oomtune.gpu.nvml.physical_index_of_torch_device`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from oomtune.alloc._blocks import K_SMALL_BUFFER
from oomtune.exceptions import ConfigError, DeviceError
from oomtune.units import format_bytes, parse_size

__all__ = ["TargetDevice", "resolve_device", "resolve_budget", "parse_budget", "check_device_spec", "fraction_note"]


@dataclass(frozen=True)
class TargetDevice:
    """The device trials run on. ``simulated`` is True on CPU, where memory comes from the virtual GPU
    whose capacity is ``total_memory_bytes`` (``virtual_device_memory``)."""

    spec: str                     # "cpu" | "cuda:N" (as passed to trials)
    kind: str                     # "cpu" | "cuda"
    index: int | None
    name: str
    total_memory_bytes: int
    simulated: bool
    uuid: str | None = None
    pci_bus_id: str | None = None
    driver_version: str | None = None

    @property
    def memory_source(self) -> str:
        return "simulated" if self.simulated else "device"


def cuda_surely_absent() -> bool:
    """Whether ``torch.cuda.is_available()`` is certainly False, told without importing torch (about
    4 s on a 2-core machine): the installed torch is a CPU-only build (its version's local part is
    ``+cpu``), or it is a CUDA build and NVML reports no NVIDIA driver (:func:`oomtune.gpu.nvml.
    no_driver`: without libnvidia-ml there is no libcuda either) or no GPU at all. A ROCm build
    (``+rocm``: NVML does not see AMD GPUs), a torch without package metadata and any other NVML
    state answer False: torch decides (``device=auto`` then imports it).
    """
    from oomtune.packages import installed_version

    version = installed_version("torch")
    if version is None:
        return False
    local = version.partition("+")[2]
    if local == "cpu":
        return True
    if local.startswith("rocm") or "hip" in local:
        return False
    from oomtune.gpu import nvml

    if nvml.no_driver():
        return True
    return nvml.nvml_available() and nvml.device_count() == 0


def resolve_device(spec: str, *, virtual_device_memory: str | int = "80GiB") -> TargetDevice:
    """Resolve ``auto | cpu | cuda | cuda:N``. ``auto`` is CPU (the virtual GPU) without importing
    torch when :func:`cuda_surely_absent`, else ``cuda`` when ``torch.cuda.is_available()``.

    Raises:
        DeviceError: CUDA asked for but unavailable, or an index that does not exist.
        ConfigError: an unrecognised device string.
    """
    spec = check_device_spec(spec)
    m = re.fullmatch(r"(auto|cpu|cuda)(?::(\d+))?", spec)
    kind = m.group(1)
    if kind == "auto" and cuda_surely_absent():
        kind = "cpu"
    if kind != "cpu":   # device=cpu needs no torch (a plan from the stream cache imports none)
        import torch

    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cpu":
        total = parse_size(virtual_device_memory)
        if total <= 0:
            raise ConfigError("virtual_device_memory must be > 0")
        return TargetDevice("cpu", "cpu", None, "virtual GPU (CPU)", total, True)
    if not torch.cuda.is_available():
        raise DeviceError(f"device {spec!r}: CUDA is not available on this machine (use device=cpu for the virtual GPU)")
    index = int(m.group(2) or 0)
    count = torch.cuda.device_count()
    if index >= count:
        raise DeviceError(f"device cuda:{index} does not exist: this machine has {count} CUDA device(s)")
    from oomtune.gpu import nvml

    props = torch.cuda.get_device_properties(index)   # torch's total memory: what a fraction is of
    physical, _how = nvml.physical_index_of_torch_device(props, index)
    ident = nvml.device_identity(physical) if physical is not None else None
    if ident is None:
        return TargetDevice(f"cuda:{index}", "cuda", index, props.name, int(props.total_memory), False,
                            nvml.normal_uuid(getattr(props, "uuid", None)), nvml.torch_pci_bus_id(props))
    return TargetDevice(f"cuda:{index}", "cuda", index, ident.name or props.name, int(props.total_memory), False,
                        ident.uuid, ident.pci_bus_id, ident.driver_version)


#: How to write a budget, said by the refusals of a budget that is not above 0.
_BUDGET_FORMS = "give a size such as budget=16GiB, or a fraction of the device in (0, 1] such as budget=0.9"


def parse_budget(budget: str | int | float) -> tuple[str, float | int]:
    """The budget's syntax, checked without a device (so bad input is refused before torch is
    imported): ``("fraction", F)`` for a number in (0, 1] (a fraction of the device), ``("bytes", N)``
    for a size with a unit (``16GiB``, ``1.5GB``, ``17179869184B``). A Python ``int`` (not text) is a
    byte count: what oomtune itself passes (best.yaml's ``device.budget_bytes``).

    A number above 1 written without a unit (``budget=1024``, ``budget=1e30``) is ambiguous, whatever
    its size: 1024 bytes, or the 1024 MiB whoever typed it probably meant? It is refused with the
    spellings that say it (``1024MiB``, ``1024B``); before, ``1e30`` was read as bytes while
    ``1024`` was refused.

    A size below 2 MiB is refused (:func:`_check_holds_a_segment`): the caching allocator reserves
    nothing smaller (CUDACachingAllocator.cpp, ``kSmallBuffer``), so no trial could allocate a tensor.

    Raises:
        ConfigError: not a finite positive size or fraction, a number above 1 without a unit, or a size
            below 2 MiB; one line with the fix.
    """
    if isinstance(budget, int) and not isinstance(budget, bool):
        if budget <= 0:
            raise ConfigError(f"budget {budget!r} must be > 0: {_BUDGET_FORMS}")
        if budget == 1:
            return "fraction", 1.0
        _check_holds_a_segment(f"{budget}B", budget)
        return "bytes", budget
    text = str(budget).strip()
    try:
        number = float(text)
    except ValueError:
        number = None
    if number is not None and not math.isfinite(number):
        raise ConfigError(f"budget {text!r} must be a finite size or fraction")
    if number is not None and number <= 0:
        raise ConfigError(f"budget {text!r} must be > 0: {_BUDGET_FORMS}")
    if number is not None and number <= 1:
        return "fraction", number
    if number is not None and not number.is_integer():   # 1.5 bytes is no size: GiB, as 1.5 is likely meant
        raise ConfigError(
            f"budget {text!r} is ambiguous (a number without a unit): write budget={text}GiB (or MiB), "
            f"or a fraction of the device in (0, 1] such as budget=0.9"
        )
    if number is not None:
        raise ConfigError(
            f"budget {text!r} is ambiguous (a number without a unit): write budget={text}MiB (or GiB, "
            f"or budget={text}B for bytes), or a fraction of the device in (0, 1] such as budget=0.9"
        )
    if text.startswith("-"):   # a negative size: the same line as a negative number
        raise ConfigError(f"budget {text!r} must be > 0: {_BUDGET_FORMS}")
    try:
        budget_bytes = parse_size(text)
    except ConfigError as exc:
        raise ConfigError(f"budget={text}: {exc} (a budget may also be a fraction of the device in (0, 1], "
                          "e.g. budget=0.9)") from exc
    if budget_bytes <= 0:
        raise ConfigError(f"budget {text!r} must be > 0: {_BUDGET_FORMS}")
    _check_holds_a_segment(text, budget_bytes)
    return "bytes", budget_bytes


def _check_holds_a_segment(text: str, budget_bytes: int) -> None:
    """Refuse a budget below the smallest segment the caching allocator reserves: 2 MiB
    (``kSmallBuffer`` in CUDACachingAllocator.cpp; a request of up to 1 MiB is served from a 2 MiB
    segment, anything larger from a larger one, and expandable segments map 2 MiB pages), so under
    such a budget no trial could allocate a single tensor.

    Raises:
        ConfigError: ``budget_bytes`` below 2 MiB; one line with the fix.
    """
    if budget_bytes < K_SMALL_BUFFER:
        raise ConfigError(
            f"budget={text} ({format_bytes(budget_bytes)}) is below 2 MiB, the smallest segment the caching "
            f"allocator reserves (kSmallBuffer): no trial could allocate a tensor; give budget=2MiB or more, "
            f"or a fraction of the device such as budget=0.9")


def check_device_spec(spec: str) -> str:
    """``auto | cpu | cuda | cuda:N`` checked for syntax only (no torch import); returns it
    normalised (stripped, lower case).

    Raises:
        ConfigError: an unrecognised device string.
    """
    spec = str(spec).strip().lower()
    m = re.fullmatch(r"(auto|cpu|cuda)(?::(\d+))?", spec)
    if not m or (m.group(1) != "cuda" and m.group(2) is not None):
        raise ConfigError(f"invalid device {spec!r}: expected auto, cpu, cuda or cuda:N (e.g. device=cuda:0 for the "
                          "first GPU; device=cpu for the virtual GPU)")
    return spec


def resolve_budget(budget: str | int | float, device: TargetDevice) -> int:
    """The memory budget in bytes: a size (``16GiB``) or a fraction of the device (``0.9``).

    Raises:
        ConfigError: not a size or fraction (:func:`parse_budget`).
        DeviceError: above the device's total memory.
    """
    text = str(budget).strip()
    kind, value = parse_budget(text)
    budget_bytes = int(value * device.total_memory_bytes) if kind == "fraction" else int(value)
    if budget_bytes <= 0:
        raise ConfigError(f"budget {text!r} must be > 0: {_BUDGET_FORMS}")
    _check_holds_a_segment(text, budget_bytes)
    if budget_bytes > device.total_memory_bytes:
        total = format_bytes(device.total_memory_bytes)
        way = (f"give a budget up to {total}, or size the virtual GPU as your GPU (virtual_device_memory={text})"
               if device.simulated else
               f"give a budget up to {total}, or a fraction of the device such as budget=0.9")
        raise DeviceError(f"budget {text} ({format_bytes(budget_bytes)}) is above {device.name}'s {total}: {way}")
    return budget_bytes


def fraction_note(budget: str | int | float, device: TargetDevice, budget_bytes: int) -> str | None:
    """For a budget given as a fraction on the virtual GPU, the line naming the device size it is a
    fraction of (without it ``budget=0.5`` silently meant 40 GiB, half of the assumed 80 GiB);
    None for a size, or on a real device (whose capacity is printed with the device). Never raises."""
    try:
        kind, value = parse_budget(budget)
    except ConfigError:
        return None
    if kind != "fraction" or not device.simulated:
        return None
    return (f"note: budget={str(budget).strip()} is a fraction of the virtual GPU's "
            f"{format_bytes(device.total_memory_bytes)} (virtual_device_memory): {format_bytes(budget_bytes)}; "
            f"set virtual_device_memory to your GPU's memory (e.g. virtual_device_memory=24GiB) for a fraction "
            f"of that, or give the budget as a size (budget=16GiB)")
