"""Field out-of-memory texts of kinds the classifier did not know: MPS's message,
out-of-tree backends copying torch's legacy format (torch_npu, Cambricon), intel-extension-for-
pytorch's XPU figures, a platform's per-allocation size limit (not memory), and the fragmentation
rule comparing free memory with the segment torch asks the device for.

Texts are quoted from public reports (the URL by each); expected bytes are hand calculations: "X GiB"
is round(X * 2**30), "X MiB" round(X * 2**20); MPS's older "GB"/"MB" are binary too (MPSAllocator.mm's
format_size divides by 1073741824.0 and prints "GB").
"""

from __future__ import annotations

import pytest

from oomtune.classify import classify_exception, classify_failure, classify_text, parse_oom_message
from oomtune.classify._rules import segment_and_request
from oomtune.outcome import Outcome

ALLOCATOR_WORDS = ("expandable_segments", "max_split_size_mb", "PYTORCH_CUDA_ALLOC_CONF", "garbage_collection")


def gib(x: float) -> int:
    return round(x * 2**30)


def mib(x: float) -> int:
    return round(x * 2**20)


def _traceback(line: str) -> str:
    return f'Traceback (most recent call last):\n  File "train.py", line 9, in <module>\n    step()\n{line}\n'


# ------------------------------------------------------------------ MPS
# https://github.com/Comfy-Org/ComfyUI/issues/7440
MPS_NEW = ("MPS backend out of memory (MPS allocated: 9.57 GiB, other allocations: 17.35 GiB, max allowed: 27.20 "
           "GiB). Tried to allocate 292.50 MiB on private pool. Use PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0 to disable "
           "upper limit for memory allocations (may cause system failure).")
# https://github.com/Comfy-Org/ComfyUI/issues/2489 (older torch: "GB"/"MB")
MPS_OLD = ("RuntimeError: MPS backend out of memory (MPS allocated: 5.56 GB, other allocations: 1.10 GB, max allowed: "
           "6.80 GB). Tried to allocate 768.00 MB on private pool. Use PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0")
# https://github.com/pinokiocomputer/pinokio/issues/941
MPS_SHARED = ("MPS backend out of memory (MPS allocated: 16.00 GB, other allocations: 3.31 GB, max allowed: 18.13 GB)."
              " Tried to allocate 256 bytes on shared pool. Use PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0 to disable upper "
              "limit for memory allocations (may cause system failure).")


def test_mps_message_figures():
    info = parse_oom_message(MPS_NEW)
    assert (info.backend, info.source_format, info.pool) == ("MPS", "mps", "private")
    assert info.requested_bytes == mib(292.50) == 306708480
    assert info.allocated_bytes == gib(9.57) == 10275709256          # 9663676416 + 612032839.68
    assert info.process_in_use_bytes == gib(9.57) + gib(17.35) == 10275709256 + 18629420646  # 18253611008 + 375809638.4
    assert info.allowed_bytes == gib(27.20) == 29205777613           # 27.2 * 2**30 = 29205777612.8
    # 9.57 + 17.35 = 26.92 GiB in use; + 0.2856 GiB asked = 27.2056 GiB > 27.20 allowed: consistent
    assert info.process_in_use_bytes + info.requested_bytes > info.allowed_bytes
    old = parse_oom_message(MPS_OLD)
    assert (old.allocated_bytes, old.allowed_bytes, old.requested_bytes) == (gib(5.56), gib(6.80), mib(768.00))
    shared = parse_oom_message(MPS_SHARED)
    assert (shared.requested_bytes, shared.pool, shared.allowed_bytes) == (256, "shared", gib(18.13))


@pytest.mark.parametrize("text", [MPS_NEW, MPS_OLD, MPS_SHARED])
def test_mps_out_of_memory_is_a_memory_outcome_without_cuda_allocator_advice(text):
    c = classify_text(text)
    assert c.outcome is Outcome.OOM
    assert "PYTORCH_MPS_HIGH_WATERMARK_RATIO" in c.advice
    assert not any(w in c.advice for w in ALLOCATOR_WORDS[:2])
    assert "max allowed" in c.message


def test_mps_traceback_of_a_dead_process_is_out_of_memory():
    # https://github.com/lllyasviel/Fooocus/issues/1139
    line = ("RuntimeError: MPS backend out of memory (MPS allocated: 8.89 GB, other allocations: 172.98 MB, max "
            "allowed: 9.07 GB). Tried to allocate 6.25 MB on private pool. Use PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0 "
            "to disable upper limit for memory allocations (may cause system failure).")
    c = classify_failure(returncode=1, stderr=_traceback(line))
    assert c.outcome is Outcome.OOM and c.oom.requested_bytes == mib(6.25)


# ------------------------------------------------------------------ NPU and other backends' copies
# https://github.com/xingchensong/TouchNet/issues/100
NPU_FRAG = ("RuntimeError: NPU out of memory. Tried to allocate 5.03 GiB (NPU 3; 60.96 GiB total capacity; 49.47 GiB "
            "already allocated; 49.47 GiB current active; 1.32 GiB free; 57.55 GiB reserved in total by PyTorch) If "
            "reserved memory is >> allocated memory try setting max_split_size_mb to avoid fragmentation.")
# https://github.com/sgl-project/sglang/issues/29838
NPU_SMALL = ("torch.OutOfMemoryError: NPU out of memory. Tried to allocate 72.00 MiB (NPU 0; 61.27 GiB total "
             "capacity; 56.05 GiB already allocated; 56.05 GiB current active; 5.04 MiB free; 58.39 GiB reserved in "
             "total by PyTorch).If reserved memory is >> allocated memory try setting max_split_size_mb to avoid "
             "fragmentation.")


def test_npu_legacy_format_figures_and_fragmentation():
    info = parse_oom_message(NPU_FRAG)
    assert (info.backend, info.source_format, info.gpu_index) == ("NPU", "legacy", 3)
    assert info.requested_bytes == gib(5.03) and info.total_bytes == gib(60.96)
    assert (info.allocated_bytes, info.free_bytes, info.reserved_bytes) == (gib(49.47), gib(1.32), gib(57.55))
    # 57.55 - 49.47 = 8.08 GiB cached; 1.32 GiB free < the 5.03 GiB segment; 5.03 <= 1.32 + 8.08 = 9.40
    assert info.cached_free_bytes == gib(57.55) - gib(49.47)
    c = classify_text(NPU_FRAG)
    assert c.outcome is Outcome.OOM_FRAGMENTATION and c.gpu_index_physical is None   # not a CUDA index
    small = classify_text(NPU_SMALL)
    # 5.04 MiB free < 72 MiB; 72 MiB <= 5.04 MiB + (58.39 - 56.05 = 2.34 GiB) cached
    assert small.outcome is Outcome.OOM_FRAGMENTATION and small.oom.free_bytes == mib(5.04)


@pytest.mark.parametrize("prefix, device", [("NPU", "NPU"), ("CNRT", "MLU"), ("HIP", "GPU"), ("XPU", "GPU")])
def test_any_backend_copying_the_legacy_format_is_parsed(prefix, device):
    # the legacy CUDA text (https://github.com/pytorch/pytorch/issues/59778) under other backends'
    # prefixes: the kind, not one string
    text = (f"{prefix} out of memory. Tried to allocate 2.26 GiB ({device} 0; 6.00 GiB total capacity; 781.59 MiB "
            f"already allocated; 3.03 GiB free; 1.24 GiB reserved in total by PyTorch)")
    info = parse_oom_message(text)
    assert (info.backend, info.requested_bytes, info.free_bytes) == (prefix, gib(2.26), gib(3.03))
    assert classify_text(text).outcome is Outcome.OOM   # 3.03 GiB free covers the 2.26 GiB segment


# ------------------------------------------------------------------ XPU (intel-extension-for-pytorch)
# https://github.com/Comfy-Org/ComfyUI/issues/8767
XPU = ("XPU out of memory. Tried to allocate 5.12 GiB (GPU 0; 15.11 GiB total capacity; 13.40 GiB already allocated; "
       "13.90 GiB reserved in total by PyTorch)")


def test_xpu_legacy_format_figures():
    info = parse_oom_message(XPU)
    assert (info.backend, info.gpu_index, info.free_bytes) == ("XPU", 0, None)   # no free figure printed
    assert (info.requested_bytes, info.total_bytes) == (gib(5.12), gib(15.11))
    assert (info.allocated_bytes, info.reserved_bytes) == (gib(13.40), gib(13.90))
    # without a free figure the cache alone must hold the request: 13.90 - 13.40 = 0.50 GiB < 5.12 GiB
    c = classify_text(XPU)
    assert c.outcome is Outcome.OOM and "5.12 GiB" in c.message
    # https://github.com/intel/intel-extension-for-pytorch/issues/629: nothing cached at all
    ipex = classify_text("RuntimeError: XPU out of memory. Tried to allocate 1.71 GiB (GPU 0; 15.56 GiB total "
                         "capacity; 176.00 MiB already allocated; 176.00 MiB reserved in total by PyTorch)")
    assert ipex.outcome is Outcome.OOM and ipex.oom.cached_free_bytes == 0 and ipex.oom.total_bytes == gib(15.56)


# ------------------------------------------------------------------ per-allocation size limits
@pytest.mark.parametrize("text", [
    # https://github.com/kijai/ComfyUI-MimicMotionWrapper/issues/74
    "RuntimeError: Invalid buffer size: 50.62 GB",
    # https://github.com/kijai/ComfyUI-SUPIR/issues/151
    "RuntimeError: Invalid buffer size: 19.38 GiB",
    # https://github.com/intel/intel-extension-for-pytorch/issues/629
    "RuntimeError: Current platform can NOT allocate memory block with size larger than 4GB! Tried to allocate "
    "6.85 GiB (GPU  0; 15.56 GiB total capacity; 0 bytes already allocated; 0 bytes reserved in total by PyTorch)",
    # c10/cuda/CUDACachingAllocator.cpp, NativeCachingAllocator::allocate: size >= 1 EiB, raised as an OOM
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate more than 1EB memory.",
    # Metal's MPSNDArray limit on one array (MPS)
    "/AppleInternal/Library/BuildRoots/MPSNDArray.mm:725: failed assertion `[MPSNDArray initWithDevice:descriptor:] "
    "Error: total bytes of NDArray > 2**32'",
])
def test_a_per_allocation_size_limit_is_a_limit_with_no_allocator_advice(text):
    c = classify_text(text)
    assert c.outcome is Outcome.LIMIT, c.message
    assert "per-allocation size limit" in c.message
    assert not any(w in c.advice for w in ALLOCATOR_WORDS)
    assert c.oom is None
    # the same from a dead process's stderr, and from an exception object of torch's OOM type
    assert classify_failure(returncode=1, stderr=_traceback(text)).outcome is Outcome.LIMIT


def test_the_one_exabyte_limit_raised_as_out_of_memory_error_is_still_a_limit():
    class OutOfMemoryError(RuntimeError):
        pass

    exc = OutOfMemoryError("CUDA out of memory. Tried to allocate more than 1EB memory.")
    assert classify_exception(exc).outcome is Outcome.LIMIT


# ------------------------------------------------------------------ the segment torch asks for
@pytest.mark.parametrize("printed, segment, largest_request", [
    (512, 2 * 2**20, 512),                         # a small request: a 2 MiB small-pool segment
    (2**20, 2 * 2**20, 2**20),                     # 1 MiB is still small (kSmallSize, inclusive)
    (2 * 2**20, 2 * 2**20, 2**20),                 # "2.00 MiB" printed: the segment of a request <= 1 MiB
    (4 * 2**20, 20 * 2**20, 4 * 2**20),            # a request under 10 MiB: the 20 MiB segment
    (20 * 2**20, 20 * 2**20, 10 * 2**20 - 512),    # "20.00 MiB": the segment of a request < 10 MiB
    (25 * 2**20, 26 * 2**20, 25 * 2**20),          # >= 10 MiB: rounded up to 2 MiB (kRoundLarge)
    (86 * 2**20, 86 * 2**20, 86 * 2**20),          # already a multiple of 2 MiB
])
def test_segment_and_request_follow_get_allocation_size(printed, segment, largest_request):
    assert segment_and_request(printed) == (segment, largest_request)


def test_free_memory_is_compared_with_the_segment_not_the_request():
    # format of https://github.com/googlecolab/colabtools/issues/867 (torch <= 1.3, "cached"), figures
    # changed to the cases the rule decides: free memory above the printed 4 MiB request but below
    # the 20 MiB segment torch asks the device for (get_allocation_size), and 50 MiB cached
    text = ("RuntimeError: CUDA out of memory. Tried to allocate 4.00 MiB (GPU 0; 11.17 GiB total capacity; 10.67 "
            "GiB already allocated; 8.00 MiB free; 50.00 MiB cached)")
    c = classify_text(text)
    # 8 MiB free < 20 MiB segment; 4 MiB request <= 8 + 50 MiB: the cache's layout stopped it
    assert c.outcome is Outcome.OOM_FRAGMENTATION, c.message
    assert "20.00 MiB segment" in c.message
    # once free memory covers the 20 MiB segment, the cache did not stop it: a plain OOM
    assert classify_text(text.replace("8.00 MiB free", "24.00 MiB free")).outcome is Outcome.OOM


def test_a_20_mib_segment_is_held_by_a_cache_of_10_mib():
    # the googlecolab/colabtools#867 text itself: 2.81 MiB free < 20 MiB; request < 10 MiB <= 2.81 +
    # 185.39 MiB cached: fragmentation (as before)
    text = ("RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 11.17 GiB total capacity; 10.67 "
            "GiB already allocated; 2.81 MiB free; 185.39 MiB cached)")
    assert classify_text(text).outcome is Outcome.OOM_FRAGMENTATION
    # with 2.00 MiB free and 12.00 MiB cached: 14 MiB < the 20 MiB segment, but the request behind
    # a 20 MiB segment is below 10 MiB and 14 MiB would hold it: fragmentation (it was "oom")
    varied = text.replace("2.81 MiB free; 185.39 MiB cached", "2.00 MiB free; 12.00 MiB cached")
    assert classify_text(varied).outcome is Outcome.OOM_FRAGMENTATION
    # 2.00 + 7.00 = 9.00 MiB < 10 MiB - 512 B, the largest such request: a plain OOM
    assert classify_text(varied.replace("12.00 MiB cached", "7.00 MiB cached")).outcome is Outcome.OOM


def test_a_one_mib_small_request_of_torch_1_0():
    # https://github.com/shllln/GenerativeGraph/issues/5 (March 2019): "1024.00 KiB" is a request of the
    # small pool (<= 1 MiB), whose segment is 2 MiB: 576 KiB free < 2 MiB; 1 MiB <= 576 KiB + 30.96 MiB
    text = ("RuntimeError: CUDA out of memory. Tried to allocate 1024.00 KiB (GPU 0; 11.17 GiB total capacity; 10.90 "
            "GiB already allocated; 576.00 KiB free; 30.96 MiB cached)")
    c = classify_text(text)
    assert c.outcome is Outcome.OOM_FRAGMENTATION and c.oom.requested_bytes == 2**20
