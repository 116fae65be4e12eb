"""GPU readings through NVML (never a CUDA context): device identity, index mapping, memory sampling.

The implementation lives in :mod:`oomtune.gpu.nvml`; see its docstring for how missing NVML and
unsupported metrics are told apart.
"""

from __future__ import annotations

from oomtune.gpu.nvml import (
    MemoryReading,
    MemorySampler,
    SamplerResult,
    device_count,
    device_identity,
    memory_info,
    nvml_available,
    physical_index_for,
    process_tree,
    process_used_bytes,
    query,
    utilization_percent,
)

__all__ = [
    "MemoryReading", "MemorySampler", "SamplerResult", "device_count", "device_identity",
    "memory_info", "nvml_available", "physical_index_for", "process_tree", "process_used_bytes",
    "query", "utilization_percent",
]
