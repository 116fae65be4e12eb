"""The virtual GPU's geometry: a device of ``virtual_device_memory`` bytes with the budget applied as
a memory fraction, as a CUDA trial applies it (``torch.cuda.set_per_process_memory_fraction``), not
a device the size of the budget.

The difference matters for ``garbage_collection_threshold``, which acts only under a fraction
(``DeviceCachingAllocator::garbage_collect_cached_blocks`` is called only when ``set_fraction`` is
true) and then relative to the allowed memory (``allowed_memory_maximum``), i.e. the budget.
Needs no torch (a plan read from the stream cache imports none); :mod:`oomtune.capture.virtual_gpu`
re-exports both functions.
"""

from __future__ import annotations

from typing import Any

__all__ = ["budget_geometry", "budgeted_sim"]


def budget_geometry(budget_bytes: int | None, device_memory_bytes: int | None) -> dict[str, Any]:
    """The virtual device a trial sees: ``{"total_memory_bytes", "memory_fraction"}``.

    ``device_memory_bytes`` (``virtual_device_memory``) is the capacity; ``budget_bytes`` becomes the
    fraction ``budget / device``, whose limit ``round(fraction * device)`` (``setMemoryFraction`` in
    c10/cuda/CUDACachingAllocator.cpp, torch 2.14.1) is the budget to the byte. A budget equal to
    the device is fraction 1.0, which torch treats as no limit. Without a device size (records
    written before it existed) the budget is the capacity, fraction 1.0; without a budget, the
    device with fraction 1.0.

    Raises:
        ValueError: a budget above the device memory, or a non-positive size.
    """
    if device_memory_bytes is None:
        if budget_bytes is None:
            raise ValueError("budget_geometry needs a budget or a device size")
        return {"total_memory_bytes": int(budget_bytes), "memory_fraction": 1.0}
    total = int(device_memory_bytes)
    if total <= 0 or (budget_bytes is not None and not 0 < budget_bytes <= total):
        raise ValueError(f"budget {budget_bytes!r} bytes must be in (0, device memory {total} bytes]")
    if budget_bytes is None or budget_bytes == total:
        return {"total_memory_bytes": total, "memory_fraction": 1.0}
    fraction = budget_bytes / total  # round(fraction * total) == budget_bytes for any size below 2**52
    return {"total_memory_bytes": total, "memory_fraction": fraction}


def budgeted_sim(settings: Any, budget_bytes: int | None, device_memory_bytes: int | None) -> Any:
    """A virtual GPU (:func:`oomtune.alloc._compiled.make_simulator`: the compiled core when built, else
    a ``CachingAllocatorSim``; same results) of :func:`budget_geometry`, its fraction always set (as a CUDA
    trial calls ``set_per_process_memory_fraction`` when it has a budget), so that
    ``garbage_collection_threshold`` acts as on the device.

    Raises:
        ValueError: as :func:`budget_geometry`. AllocatorConfigError: malformed settings.
    """
    from oomtune.alloc._compiled import make_simulator

    geometry = budget_geometry(budget_bytes, device_memory_bytes)
    sim = make_simulator(settings, total_memory_bytes=geometry["total_memory_bytes"])
    if budget_bytes is not None:
        sim.set_per_process_memory_fraction(geometry["memory_fraction"])
    return sim
