"""Memory outside the request stream where the budget is computed.

Figures: pytorch/pytorch#86509 (CUDA context 287,047,680 bytes lazy / 666,632,192 eager) and the
fraction rule of field case C9, ``fraction = (budget - non_allocator) / total``.
"""

from __future__ import annotations

import pytest

from oomtune.device import TargetDevice
from oomtune.plan.predictor import sim_geometry
from oomtune.trial.budget import (
    CUDA_CONTEXT_EAGER_BYTES,
    estimated_non_allocator_bytes,
    memory_fraction_for_budget,
)
from oomtune.workload_spec import WorkloadSpec

GiB = 1 << 30


def test_estimate_without_a_reading_is_the_eager_cuda_context():
    assert estimated_non_allocator_bytes() == 666_632_192 == CUDA_CONTEXT_EAGER_BYTES
    assert estimated_non_allocator_bytes(1_063_780_352) == 1_063_780_352   # a trial's reading wins
    with pytest.raises(ValueError):
        estimated_non_allocator_bytes(-1)


def test_plan_geometry_on_a_real_device_leaves_the_context_outside_the_fraction():
    gpu = TargetDevice("cuda:0", "cuda", 0, "H100", 80 * GiB, False)
    g = sim_geometry(gpu, 40 * GiB)
    assert g["non_allocator_bytes"] == 666_632_192
    # the same fraction the trial sets for this budget with this much outside the allocator (C9)
    assert g["memory_fraction"] == memory_fraction_for_budget(40 * GiB, 80 * GiB, 666_632_192)
    assert g["memory_fraction"] == (40 * GiB - 666_632_192) / (80 * GiB)
    cpu = TargetDevice("cpu", "cpu", None, "cpu", 16 * GiB, True)
    assert "non_allocator_bytes" not in sim_geometry(cpu, 8 * GiB)   # the virtual GPU has no context


@pytest.mark.parametrize("gpu, workspace", [
    ("h100", 4096 * 8 * 1024),               # sm90: 32 MiB (getChosenWorkspaceSize, CublasHandlePool.cpp)
    ("a100", 4096 * 1024 * 2 + 16 * 1024 * 8),   # below sm90: ':4096:2:16:8' = 8,519,680 bytes
])
def test_a_plan_for_a_real_gpu_and_for_the_virtual_gpu_both_hold_the_target_gpus_cublas_workspaces(
        gpu, workspace, monkeypatch):
    """Two requests of the target GPU's workspace size (the forward's and the autograd thread's
    workspaces) that stay live, on a real device's plan and on the virtual GPU's alike: they are
    caching-allocator memory of every CUDA run. ``CUBLAS_WORKSPACE_CONFIG=:0:0`` asks torch's
    ``getNewWorkspace`` for 0 bytes, which allocates nothing (``NativeCachingAllocator::allocate``
    mallocs only when ``size != 0``): then the stream holds none, and the rest is the same."""
    from oomtune.plan.predictor import Predictor

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    mlp = {"name": "mlp", "in_features": 8, "hidden": 16, "layers": 1, "num_classes": 4, "gpu": gpu}
    device = TargetDevice("cuda:0", "cuda", 0, gpu.upper(), 80 * GiB, False)
    cpu = TargetDevice("cpu", "cpu", None, "cpu", 16 * GiB, True)
    real = Predictor.for_search(WorkloadSpec.from_dict(mlp), device, 40 * GiB).stream(4)
    sim = Predictor.for_search(WorkloadSpec.from_dict(mlp), cpu, 8 * GiB).stream(4)
    sizes_real = [n for a, _, n, _ in real if a == "alloc"]
    sizes_sim = [n for a, _, n, _ in sim if a == "alloc"]
    assert sizes_real.count(workspace) == 2 and sizes_sim.count(workspace) == 2
    assert sizes_real == sizes_sim
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
    none = Predictor.for_search(WorkloadSpec.from_dict(mlp), cpu, 8 * GiB).stream(4)
    sizes_none = [n for a, _, n, _ in none if a == "alloc"]
    assert sizes_none.count(workspace) == 0 and len(sizes_none) == len(sizes_sim) - 2


def test_a_device_reading_is_kept_per_gpu_driver_and_torch_and_read_by_the_plan(monkeypatch, tmp_path):
    """A trial's reading (the larger one wins) is what a later plan of the same device plans with;
    another driver gets the budget's estimate; OOMTUNE_CACHE_DIR=off keeps nothing."""
    from oomtune.gpu.outside import read_measured, remember_measured
    from oomtune.packages import installed_version

    monkeypatch.setenv("OOMTUNE_CACHE_DIR", str(tmp_path))
    torch_version = installed_version("torch")
    remember_measured("NVIDIA H200", "550.54", torch_version, 1_063_780_352)   # field case C9's ~1 GB
    remember_measured("NVIDIA H200", "550.54", torch_version, 900_000_000)     # smaller: not kept
    assert read_measured("NVIDIA H200", "550.54", torch_version) == 1_063_780_352
    assert read_measured("NVIDIA H200", "560.28", torch_version) is None
    h200 = TargetDevice("cuda:0", "cuda", 0, "NVIDIA H200", 150_000_000_000, False, driver_version="550.54")
    assert sim_geometry(h200, 100_000_000_000)["non_allocator_bytes"] == 1_063_780_352
    other = TargetDevice("cuda:0", "cuda", 0, "NVIDIA H200", 150_000_000_000, False, driver_version="560.28")
    assert sim_geometry(other, 100_000_000_000)["non_allocator_bytes"] == 666_632_192
    monkeypatch.setenv("OOMTUNE_CACHE_DIR", "off")
    remember_measured("NVIDIA H200", "550.54", torch_version, 2_000_000_000)
    assert read_measured("NVIDIA H200", "550.54", torch_version) is None
    with pytest.raises(ValueError):
        remember_measured("NVIDIA H200", "550.54", torch_version, -1)
