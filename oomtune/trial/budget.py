"""Budget math: emulating a device-memory budget with torch's per-process memory fraction.

``torch.cuda.set_per_process_memory_fraction(f)`` caps what the *caching allocator* may reserve at
``floor(f * total_memory)`` bytes (``DeviceCachingAllocator::setMemoryFraction`` in
c10/cuda/CUDACachingAllocator.cpp: ``allowed_memory_maximum = static_cast<size_t>(fraction *
static_cast<double>(device_prop.totalGlobalMem))``; older torch took ``total`` from
``cudaMemGetInfo``, which reports the same total). Memory outside the allocator (the CUDA context,
cuBLAS/cuDNN handles and workspaces, NCCL buffers) is not capped, so the process's device-level
usage is ``reserved + non_allocator``.

Field case C9: ``set_per_process_memory_fraction(0.5)`` on a 10,989 MB card allows 5,494.5 MB, yet
nvidia-smi showed 6,509 MB for the process (about 1 GB of context). A budget ``B`` emulated with the
fraction must therefore subtract the measured non-allocator memory:
``fraction = (B - non_allocator) / total``, so that ``fraction * total + non_allocator <= B``.

Memory outside the request stream, and what the recordings can show of it:

* cuBLAS workspaces are *inside* the allocator since torch 2.1 (``getNewWorkspace`` in
  CublasHandlePool.cpp allocates them through ``CUDACachingAllocator``): one per cuBLAS handle (per
  thread: the forward's and the autograd engine's) and stream, 32 MiB on compute capability 9.x
  (``4096 * 8 * 1024``), else 8 MiB + 128 KiB (``:4096:2:16:8``), or ``CUBLAS_WORKSPACE_CONFIG``.
  The recordings show them (lm-ctx128-fullstep: two 33,554,432-byte requests from
  ``at::cuda::getNewWorkspace()``; lm-medium-ctx512-training: two 8,519,680-byte blocks live before
  recording), so they are modelled as requests (:mod:`oomtune.capture.blas_workspace`), not here.
* The CUDA context (driver state, loaded kernel modules, cuBLAS/cuDNN handles' own state) is outside
  the allocator: no recording can show it (``_record_memory_history`` sees allocator events only).
  On a GPU it is measured (:func:`non_allocator_bytes`); without one it is estimated
  (:func:`estimated_non_allocator_bytes`) from published measurements: 287,047,680 bytes after CUDA
  init with lazy module loading (``CUDA_MODULE_LOADING=LAZY``, torch's default since 1.13) and
  666,632,192 bytes with eager loading (pytorch/pytorch#86509); about 1 GiB during training in field
  case C9. cuDNN workspaces and reduction staging buffers are allocator requests made inside
  kernels, freed at once; the recordings show the latter (157 MiB for a max over a 10,000-wide
  vocabulary in lm-ctx128-fullstep) but a meta capture cannot (oomtune.capture.recorder).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from oomtune.exceptions import DeviceError
from oomtune.units import format_bytes

__all__ = [
    "MemoryLimit",
    "CUDA_CONTEXT_LAZY_BYTES",
    "CUDA_CONTEXT_EAGER_BYTES",
    "estimated_non_allocator_bytes",
    "non_allocator_bytes",
    "memory_fraction_for_budget",
    "allowed_allocator_bytes",
    "device_peak_bound_bytes",
]


#: CUDA context after init with lazy module loading (pytorch/pytorch#86509, measured there).
CUDA_CONTEXT_LAZY_BYTES = 287_047_680
#: The same with eager module loading (pytorch/pytorch#86509): the estimate used without a reading.
CUDA_CONTEXT_EAGER_BYTES = 666_632_192


def estimated_non_allocator_bytes(measured_bytes: int | None = None) -> int:
    """Device memory outside the caching allocator to plan for, in bytes: ``measured_bytes`` when a
    trial measured it on the device (:func:`non_allocator_bytes`), else the CUDA context with eager
    module loading, :data:`CUDA_CONTEXT_EAGER_BYTES` (above the 287 MB of lazy loading, torch's
    default, so the estimate errs on the side of a smaller allocator share).

    Raises:
        ValueError: a negative measurement.
    """
    if measured_bytes is None:
        return CUDA_CONTEXT_EAGER_BYTES
    if measured_bytes < 0:
        raise ValueError(f"measured non-allocator memory {measured_bytes} bytes is negative")
    return measured_bytes


def non_allocator_bytes(total_bytes: int, free_bytes: int, reserved_bytes: int) -> int:
    """Device memory in use by this process outside the caching allocator, in bytes.

    Computed as ``total - free - reserved`` from ``torch.cuda.mem_get_info()`` (``free``, ``total``;
    ``cudaMemGetInfo``) and ``torch.cuda.memory_reserved()`` taken right after CUDA init and a
    cuBLAS warm-up. ``free`` is device-wide: memory held by *other* processes on the same device is
    counted too, which errs on the safe side (the budget shrinks). Clamped at 0.

    Raises:
        ValueError: a negative reading, or ``free > total``.
    """
    if min(total_bytes, free_bytes, reserved_bytes) < 0 or free_bytes > total_bytes:
        raise ValueError(
            f"inconsistent memory readings: total={total_bytes} free={free_bytes} "
            f"reserved={reserved_bytes} (bytes)"
        )
    return max(0, total_bytes - free_bytes - reserved_bytes)


def memory_fraction_for_budget(budget_bytes: int, total_bytes: int, non_allocator_bytes: int) -> float:
    """The per-process memory fraction that keeps the device-level peak within ``budget_bytes``.

    ``fraction = (budget - non_allocator) / total`` (field case C9), to be passed to
    ``torch.cuda.set_per_process_memory_fraction``. A budget equal to the whole device still gets
    the non-allocator memory subtracted.

    Args:
        budget_bytes: the device-memory budget of the trial (bytes, > 0).
        total_bytes: the device's total memory (``get_device_properties().total_memory``).
        non_allocator_bytes: memory outside the allocator, from :func:`non_allocator_bytes`.

    Returns:
        A fraction in (0, 1].

    Raises:
        DeviceError: the budget exceeds the device, or leaves nothing for the allocator once the
            non-allocator memory is taken out.
    """
    if total_bytes <= 0:
        raise DeviceError(f"device reports total memory {total_bytes} bytes; expected > 0")
    if budget_bytes > total_bytes:
        raise DeviceError(
            f"memory budget {format_bytes(budget_bytes)} exceeds the device's "
            f"{format_bytes(total_bytes)}"
        )
    if budget_bytes <= non_allocator_bytes:
        raise DeviceError(
            f"memory budget {format_bytes(budget_bytes)} is not above the "
            f"{format_bytes(non_allocator_bytes)} already used outside the caching allocator "
            "(CUDA context, cuBLAS)"
        )
    return min(1.0, (budget_bytes - non_allocator_bytes) / total_bytes)


def allowed_allocator_bytes(fraction: float, total_bytes: int) -> int:
    """What the caching allocator may reserve under ``fraction``: ``floor(fraction * total)`` bytes.

    Mirrors ``static_cast<size_t>(fraction * total)`` in ``setMemoryFraction``
    (c10/cuda/CUDACachingAllocator.cpp). A fraction of 1 means no cap in newer torch; the value
    returned is then simply ``total``.
    """
    return int(math.floor(fraction * total_bytes))


def device_peak_bound_bytes(fraction: float, total_bytes: int, non_allocator_bytes: int) -> int:
    """Upper bound of the process's device-level usage (what nvidia-smi shows) under ``fraction``:
    ``allowed_allocator_bytes(fraction, total) + non_allocator`` bytes (field case C9)."""
    return allowed_allocator_bytes(fraction, total_bytes) + non_allocator_bytes


@dataclass(frozen=True)
class MemoryLimit:
    """The peak a feasible trial may reach: ``budget_bytes * (1 - headroom)`` (bytes; the search's
    feasibility and ``oomtune plan``'s limit, :func:`oomtune.plan.feasibility.limit_bytes_of`)."""

    budget_bytes: int
    headroom: float

    @property
    def limit_bytes(self) -> int:
        """``budget_bytes * (1 - headroom)``, truncated to whole bytes."""
        return int(self.budget_bytes * (1.0 - self.headroom))
