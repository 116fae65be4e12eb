"""Mapping the device index torch printed to the physical GPU under CUDA_VISIBLE_DEVICES (field case C10)."""

from __future__ import annotations

import os

from oomtune.exceptions import DeviceError

__all__ = ["map_gpu_index"]

_ENV = object()  # sentinel: read CUDA_VISIBLE_DEVICES from os.environ


def _visible(visible_devices: str | None | object) -> str | None:
    """The CUDA_VISIBLE_DEVICES string given, or this process's when ``visible_devices`` is ``_ENV``."""
    return os.environ.get("CUDA_VISIBLE_DEVICES") if visible_devices is _ENV else visible_devices


def map_gpu_index(index_in_message: int, visible_devices: str | None | object = _ENV) -> str:
    """Map a device index as torch printed it to the physical id under CUDA_VISIBLE_DEVICES (C10).

    Args:
        index_in_message: torch's (visible) device index, e.g. the ``N`` of "GPU N has a total capacity".
        visible_devices: the CUDA_VISIBLE_DEVICES string (default: this process's environment). Entries
            are indices or ``GPU-``/``MIG-`` UUIDs; as in the CUDA runtime, parsing stops at the first
            empty entry.

    Returns:
        The physical id as written in CUDA_VISIBLE_DEVICES (``"5"``, ``"GPU-8f2..."``), or
        ``str(index_in_message)`` when CUDA_VISIBLE_DEVICES is unset.

    Raises:
        DeviceError: the index is negative or not among the visible devices.
    """
    visible = _visible(visible_devices)
    if index_in_message < 0:
        raise DeviceError(f"GPU index {index_in_message} is negative")
    if visible is None:
        return str(index_in_message)
    entries = []
    for entry in str(visible).split(","):
        if not entry.strip() or entry.strip().startswith("-"):
            break
        entries.append(entry.strip())
    if index_in_message >= len(entries):
        raise DeviceError(f"GPU index {index_in_message} is not visible under CUDA_VISIBLE_DEVICES={visible!r}")
    return entries[index_in_message]
