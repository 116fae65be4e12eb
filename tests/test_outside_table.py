"""The table of memory outside the caching allocator (oomtune.gpu.outside): each figure's arithmetic
done by hand from its source, the row chosen per CUDA major, loading mode and GPU, and the cuBLAS
workspace of a virtual GPU following its target GPU (CublasHandlePool.cpp getChosenWorkspaceSize)."""

from __future__ import annotations

import pytest
from pathlib import Path

import oomtune
from oomtune.alloc.sim import CachingAllocatorSim
from oomtune.capture.virtual_gpu import VirtualGPU
from oomtune.gpu.outside import TABLE, outside_allocator

MIB = 1_048_576


def test_lazy_context_is_the_pull_requests_reading_less_its_tensors_segment():
    """pytorch/pytorch#86509: total - free = 287,047,680 bytes after torch.randn(20, 16, 50, 100).cuda();
    that tensor is 1,600,000 floats = 6,400,000 bytes, between 1 MiB and 10 MiB, so the allocator
    gives it a 20 MiB segment (kLargeBuffer): 287,047,680 - 20,971,520 = 266,076,160."""
    got = outside_allocator()
    assert 20 * 16 * 50 * 100 * 4 == 6_400_000 and MIB < 6_400_000 < 10 * MIB
    assert got.total_bytes == 287_047_680 - 20_971_520 == 266_076_160
    assert "pytorch/pytorch#86509" in got.sources[0] and not got.measured


def test_eager_context_is_the_pull_requests_default_loading_reading_less_the_segment():
    """The same pull request with CUDA_MODULE_LOADING=DEFAULT: 666,632,192 - 20,971,520."""
    assert outside_allocator(lazy_loading=False).total_bytes == 645_660_672


def test_cuda13_context_is_the_nvidia_smi_reading_of_a_process_without_allocator_memory():
    """unslothai/unsloth-zoo#1053: nvidia-smi 426 MiB after torch.cuda.mem_get_info(0) alone, torch
    allocated/reserved 0 / 0 (torch 2.10.0+cu130, RTX 6000 Ada, sm89): 426 x 1,048,576 bytes, all of
    it outside the allocator. Other GPUs on CUDA 13 have no row of their own: they take it too."""
    ada = outside_allocator(cuda_major=13, capability=(8, 9))
    assert ada.total_bytes == 426 * MIB == 446_693_376
    assert outside_allocator(cuda_major=13, capability=(9, 0)).total_bytes == 446_693_376
    assert "sm89" in ada.sources[0]


def test_v100_before_lazy_loading_takes_its_own_row():
    """Hugging Face transformers docs, "Model training anatomy": NVML used 1343 MiB (0 MiB before)
    after torch.ones((1, 1)).to("cuda") on a Tesla V100 (driver 460.91, CUDA 11.2: no lazy
    loading); the 4-byte tensor's block sits in a 2 MiB small-pool segment: (1343 - 2) x 1,048,576.
    An A100 (sm80) on CUDA 11 has no row of its own: the pull request's eager reading."""
    assert outside_allocator(cuda_major=11, capability=(7, 0)).total_bytes == 1341 * MIB == 1_406_140_416
    assert outside_allocator(cuda_major=11, capability=(8, 0)).total_bytes == 645_660_672


def test_every_row_names_its_source_and_the_gaps_are_listed():
    assert all(row.source and row.bytes > 0 for row in TABLE)
    cnn = outside_allocator(cudnn=True, nccl=True)
    gaps = " ".join(cnn.unsourced)
    assert "cuDNN" in gaps and "NCCL" in gaps and "lazily" in gaps and "cuBLAS" in gaps
    assert "not counted" in cnn.describe()


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="cuda_major=9"):
        outside_allocator(cuda_major=9)
    with pytest.raises(ValueError, match="negative"):
        outside_allocator(measured_bytes=-1)


@pytest.mark.parametrize("gpu, workspace", [(None, 8_519_680), ("a100", 8_519_680), ("h100", 33_554_432)])
def test_a_virtual_gpus_default_cublas_workspace_follows_its_gpu(gpu, workspace):
    """getChosenWorkspaceSize (aten/src/ATen/cuda/CublasHandlePool.cpp) with CUBLAS_WORKSPACE_CONFIG
    unset: ":4096:2:16:8" = 4096 KiB x 2 + 16 KiB x 8 = 8,519,680 bytes below sm90 (the default
    target is the A100, sm80), 4096 KiB x 8 = 33,554,432 bytes on sm90."""
    vgpu = VirtualGPU(CachingAllocatorSim(total_memory_bytes=1 << 30), device="meta", blas_workspaces="default", gpu=gpu)
    assert vgpu.recorder.blas_workspaces.size_bytes == workspace


def test_predict_reports_the_tables_context_in_device_used():
    """An A100 on the default stack (CUDA 12, lazy loading): device_used = reserved + 266,076,160."""
    entry = str(Path(__file__).parent / "data" / "predict" / "tiny_mlp.py") + ":make_workload"
    got = oomtune.predict(entry, 8, steps=1)
    assert got.outside_allocator_bytes == 266_076_160
    assert got.device_used_bytes == got.peak_reserved_bytes + 266_076_160
