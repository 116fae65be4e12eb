"""The record of the physical device a trial ran on (:class:`DeviceInfo`): written by the NVML
reader (:mod:`oomtune.gpu.nvml`) and the trial process, recorded in every ``TrialResult``. Here,
below both, so that the GPU layer does not import the trial layer."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DeviceInfo"]


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    """The physical device a trial ran on (field case C10: record it, since CUDA_VISIBLE_DEVICES
    remaps indices). ``uuid``/``pci_bus_id`` come from NVML; None on CPU or without NVML. Frozen, as
    the trial record that holds it: change it with :func:`dataclasses.replace`."""

    kind: str                      # "cuda" | "cpu"
    name: str | None = None        # e.g. "NVIDIA H200"
    index: int | None = None       # torch's (visible) index
    uuid: str | None = None        # "GPU-..." from NVML
    pci_bus_id: str | None = None  # "00000000:19:00.0" from NVML
    total_memory_bytes: int | None = None
    driver_version: str | None = None
    cuda_version: str | None = None
