"""Tests of oomtune.classify: every OOM message format, field cases C1-C5 and C10, exit statuses.

Expected byte counts are computed by hand from the printed figures: ``X GiB`` -> round(X * 2**30),
``X MiB`` -> round(X * 2**20) (torch's format_size prints two decimals of binary units).
"""

from __future__ import annotations

import pytest
import torch

from oomtune.classify import (
    SIMULATED_PREFIX,
    Classification,
    OomInfo,
    classify_exception,
    classify_failure,
    classify_text,
    map_gpu_index,
    parse_oom_message,
)
from oomtune.exceptions import DeviceError
from oomtune.outcome import Outcome


def gib(x: float) -> int:
    return round(x * 2**30)


def mib(x: float) -> int:
    return round(x * 2**20)


# ------------------------------------------------------------------ field case texts (cases/README.md)
C1_TEXT = "RuntimeError: Unable to find a valid cuDNN algorithm to run convolution"
C2_TEXT = ("RuntimeError: upsample_nearest3d only supports output tensors with less than INT_MAX "
           "elements, but got [2, 64, 86, 483, 483]")
# C3 legacy exactly as the case README wraps it
C3_LEGACY = """CUDA out of memory. Tried to allocate 2.51 GiB (GPU 0; 15.78 GiB total capacity; 6.25 GiB already
  allocated; 283.44 MiB free; 13.91 GiB reserved in total by PyTorch) If reserved memory is >> allocated
  memory try setting max_split_size_mb to avoid fragmentation."""
# C3 newer form (torch 2.1, with the real "capacty" misspelling); the case elides the tail, completed
# here with the same allocator state: 6.25 GiB allocated, 13.91 - 6.25 = 7.66 GiB reserved-unallocated.
C3_CURRENT = ("CUDA out of memory. Tried to allocate 2.51 GiB. GPU 5 has a total capacty of 15.78 GiB of which "
              "765.44 MiB is free. Process 4125680 has 15.02 GiB memory in use. Of the allocated memory 6.25 GiB "
              "is allocated by PyTorch, and 7.66 GiB is reserved by PyTorch but unallocated. If reserved but "
              "unallocated memory is large try setting max_split_size_mb to avoid fragmentation.  See "
              "documentation for Memory Management and PYTORCH_CUDA_ALLOC_CONF")
C4_A = ("OutOfMemoryError: CUDA out of memory. Tried to allocate 4.00 GiB (GPU 3; 11.93 GiB total capacity; "
        "10.67 GiB already allocated; 515.38 MiB free; 11.93 GiB allowed; 10.92 GiB reserved in total by PyTorch)")
C4_B = C4_A.replace("11.93 GiB allowed; 10.92 GiB reserved", "4.77 GiB allowed; 4.74 GiB reserved")
C5_BUS = ("RuntimeError: DataLoader worker (pid 1234) is killed by signal: Bus error. It is possible that "
          "dataloader's workers are out of shared memory.")


# ------------------------------------------------------------------ parsing: C3 two formats, same numbers
def test_c3_legacy_parses_every_field():
    info = parse_oom_message(C3_LEGACY)
    assert info == OomInfo(requested_bytes=gib(2.51), gpu_index=0, total_bytes=gib(15.78),
                           free_bytes=mib(283.44), allocated_bytes=gib(6.25), reserved_bytes=gib(13.91),
                           allowed_bytes=None, process_in_use_bytes=None, source_format="legacy")
    assert info.requested_bytes == 2695091978  # 2.51 * 2**30 = 2695091978.24
    assert info.reserved_bytes == 14935748772  # 13.91 * 2**30 = 14935748771.84


def test_c3_current_format_with_misspelling_parses_same_numbers():
    legacy, current = parse_oom_message(C3_LEGACY), parse_oom_message(C3_CURRENT)
    assert current.source_format == "current"
    assert current.gpu_index == 5
    assert current.free_bytes == mib(765.44)
    assert current.process_in_use_bytes == gib(15.02)  # the single "Process P has M" line
    for field in ("requested_bytes", "total_bytes", "allocated_bytes", "reserved_bytes"):
        assert getattr(current, field) == getattr(legacy, field), field
    # reserved = allocated + reserved-but-unallocated: 6710886400 + 8224862372 (7.66 * 2**30 = ...371.84)
    assert current.reserved_bytes == 6710886400 + 8224862372
    assert current.cached_free_bytes == legacy.cached_free_bytes == gib(13.91) - gib(6.25)


@pytest.mark.parametrize("text", [C3_LEGACY, C3_CURRENT, "torch.OutOfMemoryError: " + C3_CURRENT])
def test_c3_is_fragmentation_with_allocator_advice_first(text):
    c = classify_text(text)
    assert c.outcome is Outcome.OOM_FRAGMENTATION
    assert "expandable_segments:True" in c.advice and "max_split_size_mb" in c.advice
    assert "before lowering the batch" in c.advice
    assert "7.66 GiB" in c.message and "2.51 GiB" in c.message


# ------------------------------------------------------------------ C4 fraction cap
def test_c4_allowed_equal_to_total_is_the_card_not_a_cap():
    c = classify_text(C4_A)
    assert c.oom.allowed_bytes == c.oom.total_bytes == gib(11.93)
    # 10.92 - 10.67 = 0.25 GiB cached < 4 GiB request, and no fraction below the card: plain OOM
    assert c.outcome is Outcome.OOM


def test_c4_allowed_below_total_is_fraction_cap():
    c = classify_text(C4_B)
    assert c.oom.allowed_bytes == gib(4.77) and c.oom.reserved_bytes == gib(4.74)
    assert c.outcome is Outcome.FRACTION_CAP
    assert "fraction" in c.advice and "fraction cap" in c.message


def test_c4_consistent_variant_and_current_format_are_fraction_cap():
    legacy = ("CUDA out of memory. Tried to allocate 4.00 GiB (GPU 3; 11.93 GiB total capacity; 4.51 GiB already "
              "allocated; 6.83 GiB free; 4.77 GiB allowed; 4.74 GiB reserved in total by PyTorch)")
    current = ("CUDA out of memory. Tried to allocate 4.00 GiB. GPU 3 has a total capacity of 11.93 GiB of which "
               "6.83 GiB is free. Including non-PyTorch memory, this process has 5.05 GiB memory in use. 4.77 GiB "
               "allowed; Of the allocated memory 4.51 GiB is allocated by PyTorch, and 230.00 MiB is reserved by "
               "PyTorch but unallocated.")
    assert classify_text(legacy).outcome is Outcome.FRACTION_CAP
    c = classify_text(current)
    assert c.outcome is Outcome.FRACTION_CAP
    assert c.oom.allowed_bytes == 5121748500  # 4.77 * 2**30 = 4294967296 + 826781204.48
    assert c.oom.process_in_use_bytes == gib(5.05)
    assert c.oom.reserved_bytes == gib(4.51) + mib(230.00)


def test_fragmentation_wins_over_fraction_cap():
    # cached 2.70 GiB >= 2.50 GiB request, so allocated + request <= reserved <= allowed: layout, not cap
    text = ("CUDA out of memory. Tried to allocate 2.50 GiB. GPU 0 has a total capacity of 11.93 GiB of which "
            "6.00 GiB is free. 4.77 GiB allowed; Of the allocated memory 2.00 GiB is allocated by PyTorch, and "
            "2.70 GiB is reserved by PyTorch but unallocated.")
    assert classify_text(text).outcome is Outcome.OOM_FRAGMENTATION


def test_card_out_under_a_loose_cap_is_plain_oom():
    # reserved 2.00 + request 1.00 = 3.00 GiB fits the 10.00 GiB cap, but the card had 0.50 GiB free
    text = ("CUDA out of memory. Tried to allocate 1.00 GiB (GPU 0; 11.93 GiB total capacity; 2.00 GiB already "
            "allocated; 512.00 MiB free; 10.00 GiB allowed; 2.00 GiB reserved in total by PyTorch)")
    assert classify_text(text).outcome is Outcome.OOM


# ------------------------------------------------------------------ the other formats of section 4
def test_current_format_with_several_processes_private_pools_and_zero_free():
    text = ("CUDA out of memory. Tried to allocate 24.00 MiB. GPU 0 has a total capacity of 7.60 GiB of which "
            "0 bytes is free. Process 3936 has 5.38 GiB memory in use. Including non-PyTorch memory, this process "
            "has 2.19 GiB memory in use. Of the allocated memory 1.50 GiB is allocated by PyTorch, with 1.00 GiB "
            "allocated in private pools (e.g., CUDA Graphs), and 12.00 KiB is reserved by PyTorch but "
            "unallocated. If reserved but unallocated memory is large try setting "
            "PYTORCH_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")
    info = parse_oom_message(text)
    assert info.free_bytes == 0
    assert info.requested_bytes == 24 * 2**20
    assert info.process_in_use_bytes == gib(2.19)  # this process, not process 3936
    assert info.allocated_bytes == gib(1.50)
    assert info.reserved_bytes == gib(1.50) + 12 * 1024
    assert classify_text(text).outcome is Outcome.OOM


def test_hip_current_format():
    text = ("HIP out of memory. Tried to allocate 20.00 MiB. GPU 1 has a total capacity of 23.98 GiB of which "
            "1024 bytes is free. Of the allocated memory 23.10 GiB is allocated by PyTorch, and 10.00 MiB is "
            "reserved by PyTorch but unallocated.")
    info = parse_oom_message(text)
    assert (info.backend, info.gpu_index, info.free_bytes) == ("HIP", 1, 1024)
    # "20.00 MiB" is the segment (kLargeBuffer) torch asked for, shared by requests below 10 MiB
    # (get_allocation_size): 1024 bytes free < the 20 MiB segment, and the request (at most
    # 10 MiB - 512 B) <= 1024 B + 10 MiB cached: the layout stopped it (it was
    # "oom" while the cache was compared with the segment)
    assert classify_text(text).outcome is Outcome.OOM_FRAGMENTATION
    assert classify_text(text.replace("10.00 MiB is reserved", "9.00 MiB is reserved")).outcome is Outcome.OOM


def test_oldest_cached_format_raised_as_runtime_error_is_oom_by_its_text():
    text = ("RuntimeError: CUDA out of memory. Tried to allocate 12.50 MiB (GPU 0; 10.92 GiB total capacity; "
            "8.57 MiB already allocated; 9.28 GiB free; 4.68 MiB cached)")
    info = parse_oom_message(text)
    assert info.source_format == "legacy_cached"
    # torch <= 1.3's "cached" is reserved - allocated: reserved = 8.57 + 4.68 MiB
    assert info.reserved_bytes == mib(8.57) + mib(4.68) and info.requested_bytes == mib(12.50)
    assert info.cached_free_bytes == mib(4.68)
    # 9.28 GiB free already covers the 12.50 MiB request: not fragmentation, a plain OOM
    assert classify_text(text).outcome is Outcome.OOM


ASYNC = ("torch.OutOfMemoryError: Allocation on device 0 would exceed allowed memory. (out of memory)\n"
         "Currently allocated     : 22.43 GiB\nRequested               : 4.07 GiB\n"
         "Device limit            : 16.00 GiB\nFree (according to CUDA): 0 bytes\n"
         "PyTorch limit (set by user-supplied memory fraction)\n                        : {limit}")


def test_cuda_malloc_async_without_fraction():
    c = classify_text(ASYNC.format(limit="17179869184.00 GiB"))  # SIZE_MAX: no fraction set
    assert c.outcome is Outcome.OOM
    assert c.oom == OomInfo(requested_bytes=gib(4.07), gpu_index=0, total_bytes=16 * 2**30, free_bytes=0,
                            allocated_bytes=gib(22.43), reserved_bytes=None, allowed_bytes=None,
                            process_in_use_bytes=None, source_format="cudaMallocAsync")
    assert c.oom.cached_free_bytes is None


def test_cuda_malloc_async_with_fraction_is_fraction_cap():
    c = classify_text(ASYNC.format(limit="8.00 GiB"))
    assert c.oom.allowed_bytes == 8 * 2**30
    assert c.outcome is Outcome.FRACTION_CAP


def test_preemptive_fraction_rejection():
    text = ("torch.OutOfMemoryError: CUDA out of memory. Allocation was preemptively rejected because it would "
            "exceed per_process_memory_fraction limit. Requested size: 2.00 GiB")
    c = classify_text(text)
    assert c.outcome is Outcome.FRACTION_CAP and c.oom.requested_bytes == 2 * 2**30


@pytest.mark.parametrize("text, expected", [
    ("1024 bytes", 1024), ("0 bytes", 0), ("12.00 KiB", 12 * 1024), ("283.44 MiB", 297208381),
    ("2.51 GiB", 2695091978),
])
def test_sizes_as_format_size_prints_them(text, expected):
    info = parse_oom_message(f"CUDA out of memory. Tried to allocate {text} (GPU 0; 1.00 GiB total capacity; "
                             f"0 bytes already allocated; 0 bytes free; 0 bytes reserved in total by PyTorch)")
    assert info.requested_bytes == expected


@pytest.mark.parametrize("text", [
    "ValueError: bad config", "memory allocation failed with OOM on device 0", "", "CUDA error: out of memory",
])
def test_non_allocator_texts_do_not_parse(text):
    assert parse_oom_message(text) is None


# ------------------------------------------------------------------ memory outside the allocator, host
@pytest.mark.parametrize("text", [
    "RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
    "RuntimeError: cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
    "RuntimeError: cuFFT error: CUFFT_ALLOC_FAILED",
    "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1691, unhandled cuda error\n"
    "ncclUnhandledCudaError: Call to CUDA function failed.\nLast error:\nCuda failure 'out of memory'",
    "RuntimeError: NCCL WARN Failed to CUDA calloc 6291456 bytes",
    "torch.AcceleratorError: CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported",
])
def test_outside_allocator(text):
    c = classify_text(text)
    assert c.outcome is Outcome.OOM_OUTSIDE_ALLOCATOR and c.oom is None


@pytest.mark.parametrize("text", [
    C5_BUS,
    "RuntimeError: DataLoader worker (pid 77) is killed by signal: Killed.",
    "RuntimeError: [enforce fail at alloc_cpu.cpp:114] data. DefaultCPUAllocator: not enough memory: you "
    "tried to allocate 1099511627776 bytes.",
    "RuntimeError: DefaultCPUAllocator: can't allocate memory: you tried to allocate 1099511627776 bytes. "
    "Error code 12 (Cannot allocate memory)",
    "MemoryError: Unable to allocate 8.00 GiB for an array",
    "ERROR: Unexpected bus error encountered in worker. This might be caused by insufficient shared memory (shm).",
])
def test_host_oom(text):
    c = classify_text(text)
    assert c.outcome is Outcome.HOST_OOM
    assert "num_workers" in c.advice and "--shm-size" in c.advice


# ------------------------------------------------------------------ limits (C1, C2) and errors
def test_c2_int_max_is_an_element_limit_without_allocator_advice():
    c = classify_text(C2_TEXT, batch_size=2)
    assert c.outcome is Outcome.LIMIT
    assert "element-count limit, not memory" in c.advice and "no allocator setting helps" in c.advice
    assert "expandable" not in c.advice and "max_split" not in c.advice


@pytest.mark.parametrize("text", [
    "RuntimeError: Expected canUse32BitIndexMath(input) && canUse32BitIndexMath(output) to be true, but got false.",
    "RuntimeError: integer out of range",
    "RuntimeError: cub sort does not support sorting more than INT_MAX elements",
    "RuntimeError: input tensor must fit into 32-bit index math",
])
def test_32bit_indexing_limits(text):
    assert classify_text(text, batch_size=512).outcome is Outcome.LIMIT


def test_c1_cudnn_algorithm_after_smaller_batches_is_a_limit():
    c = classify_text(C1_TEXT, batch_size=256, smaller_batch_succeeded=True)
    assert c.outcome is Outcome.LIMIT
    assert "no allocator setting helps" in c.advice


@pytest.mark.parametrize("batch_size, smaller", [(1, False), (1, True), (256, False), (None, False)])
def test_c1_cudnn_algorithm_without_smaller_success_is_a_setup_fault(batch_size, smaller):
    assert classify_text(C1_TEXT, batch_size=batch_size, smaller_batch_succeeded=smaller).outcome is Outcome.ERROR


@pytest.mark.parametrize("text", [
    "RuntimeError: cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a "
    "non-contiguous input.",
    "RuntimeError: CUDA error: CUBLAS_STATUS_NOT_INITIALIZED when calling `cublasCreate(handle)`",
])
def test_library_failures_are_limits_only_after_smaller_success(text):
    assert classify_text(text, batch_size=64, smaller_batch_succeeded=True).outcome is Outcome.LIMIT
    assert classify_text(text, batch_size=64).outcome is Outcome.ERROR


@pytest.mark.parametrize("text", [
    "RuntimeError: Expected all tensors to be on the same device, but found at least two devices",
    "RuntimeError: CUDA error: device-side assert triggered",
    "RuntimeError: mat1 and mat2 shapes cannot be multiplied (64x512 and 256x10)",
    "RuntimeError: memory allocation failed with OOM on device 0",  # the v2.13 warning text alone
])
def test_other_runtime_errors_are_never_oom(text):
    c = classify_text(text, batch_size=64, smaller_batch_succeeded=True)
    assert c.outcome is Outcome.ERROR and not c.outcome.is_memory


# ------------------------------------------------------------------ classify_exception
class _SimOOM(torch.OutOfMemoryError):
    pass


def test_exception_simulated_oom_subclass():
    msg = SIMULATED_PREFIX + C3_CURRENT.replace("capacty", "capacity")
    c = classify_exception(_SimOOM(msg))
    assert c.outcome is Outcome.OOM_FRAGMENTATION
    assert "simulated" in c.message and c.oom.requested_bytes == gib(2.51)


def test_simulated_prefix_matches_the_allocator_model():
    from oomtune.alloc.oom_message import SIMULATED_PREFIX as ALLOC_PREFIX

    assert SIMULATED_PREFIX == ALLOC_PREFIX


def test_exception_oom_type_with_unparsed_message_is_oom():
    c = classify_exception(torch.OutOfMemoryError("custom out-of-memory text"))
    assert c.outcome is Outcome.OOM and c.oom is None


def test_exception_types_outside_allocator_host_and_error():
    assert classify_exception(torch.AcceleratorError("CUDA error: out of memory")).outcome is Outcome.OOM_OUTSIDE_ALLOCATOR
    assert classify_exception(MemoryError()).outcome is Outcome.HOST_OOM
    assert classify_exception(RuntimeError("CUDA error: an illegal memory access was encountered")).outcome is Outcome.ERROR


def test_exception_chain_finds_the_oom_cause():
    try:
        try:
            raise torch.OutOfMemoryError(C4_B.split(": ", 1)[1])
        except torch.OutOfMemoryError as inner:
            raise RuntimeError("training step failed") from inner
    except RuntimeError as outer:
        c = classify_exception(outer)
    assert c.outcome is Outcome.FRACTION_CAP


def _deep_raise(n: int) -> None:
    if n == 0:
        raise ValueError("learning rate must be positive")
    _deep_raise(n - 1)


def test_generic_value_error_keeps_traceback_tail():
    try:
        _deep_raise(30)
    except ValueError as exc:
        c = classify_exception(exc)
    assert c.outcome is Outcome.ERROR
    assert c.message == "ValueError: learning rate must be positive"
    lines = c.traceback_tail.splitlines()
    assert 1 < len(lines) <= 20
    assert lines[-1] == "ValueError: learning rate must be positive"


# ------------------------------------------------------------------ classify_failure (dead child process)
def _traceback(exc_line: str, frames: int = 2) -> str:
    body = "".join(f'  File "train.py", line {i}, in step\n    loss = model(x)\n' for i in range(frames))
    return f"Traceback (most recent call last):\n{body}{exc_line}\n"


@pytest.mark.parametrize("rc", [-9, 137])
def test_sigkill_without_traceback_is_host_oom_only_with_evidence(rc):
    evidence = "memory.events: oom_kill 0 -> 1 during the trial"
    c = classify_failure(returncode=rc, stderr="loading data...\n", oom_kill_evidence=evidence)
    assert c.outcome is Outcome.HOST_OOM and "SIGKILL" in c.message and evidence in c.message
    # the same exit without evidence (a kill -9, a preemption) is a crash, not memory
    c = classify_failure(returncode=rc, stderr="loading data...\n", no_evidence_reason="memory.events unchanged")
    assert c.outcome is Outcome.CRASH and "no evidence of the OOM killer (memory.events unchanged)" in c.message
    assert not c.outcome.is_memory and c.outcome.is_fault


def test_sigsegv_is_crash():
    c = classify_failure(returncode=-11, stderr="")
    assert c.outcome is Outcome.CRASH and "SIGSEGV" in c.message


def test_abort_after_cpp_oom_is_classified_by_its_what():
    stderr = ("terminate called after throwing an instance of 'c10::OutOfMemoryError'\n  what():  "
              + C4_A.split(": ", 1)[1] + "\n")
    assert classify_failure(returncode=-6, stderr=stderr).outcome is Outcome.OOM


def test_timeout_wins():
    c = classify_failure(returncode=-9, stderr="", timed_out=True)
    assert c.outcome is Outcome.TIMEOUT


def test_traceback_oom_in_stderr_with_rank_prefix_and_warning_lines():
    stderr = ("[W511 CUDACachingAllocator.cpp:1198] memory allocation failed with OOM on device 0\n"
              + "".join(f"[rank0]: {line}\n" for line in _traceback("torch.OutOfMemoryError: " + C3_CURRENT).splitlines()))
    c = classify_failure(returncode=1, stderr=stderr, visible_devices="2,7,5,4,3,6")
    assert c.outcome is Outcome.OOM_FRAGMENTATION
    assert c.gpu_index_physical == "6"  # "GPU 5" is the 6th visible device


def test_warning_line_then_successful_exit_is_ok():
    stderr = "[W CUDACachingAllocator.cpp:1198] memory allocation failed with OOM on device 0 (retrying)\n"
    assert classify_failure(returncode=0, stderr=stderr).outcome is Outcome.OK
    c = classify_failure(returncode=1, stderr=stderr)
    assert c.outcome is Outcome.ERROR and not c.outcome.is_memory


def test_value_error_traceback_tail_is_kept():
    stderr = "step 1 done\n" + _traceback("ValueError: bad batch", frames=25)
    c = classify_failure(returncode=1, stderr=stderr)
    assert c.outcome is Outcome.ERROR and c.message == "ValueError: bad batch"
    tail = c.traceback_tail.splitlines()
    assert len(tail) == 20 and tail[-1] == "ValueError: bad batch"


def test_dataloader_bus_error_chain_is_host_oom():
    stderr = (_traceback(C5_BUS) + "\nThe above exception was the direct cause of the following exception:\n\n"
              + _traceback("RuntimeError: DataLoader worker (pid(s) 1234) exited unexpectedly"))
    assert classify_failure(returncode=1, stderr=stderr).outcome is Outcome.HOST_OOM


def test_dataloader_segfault_is_crash():
    stderr = _traceback("RuntimeError: DataLoader worker (pid 99) is killed by signal: Segmentation fault.")
    assert classify_failure(returncode=1, stderr=stderr).outcome is Outcome.CRASH


def test_cudnn_limit_through_stderr_needs_smaller_success():
    stderr = _traceback(C1_TEXT)
    assert classify_failure(returncode=1, stderr=stderr, batch_size=256,
                            smaller_batch_succeeded=True).outcome is Outcome.LIMIT
    assert classify_failure(returncode=1, stderr=stderr, batch_size=1).outcome is Outcome.ERROR


# ------------------------------------------------------------------ C10: index mapping
def test_map_gpu_index():
    assert map_gpu_index(0, "5") == "5"
    assert map_gpu_index(1, "3, 7") == "7"
    assert map_gpu_index(0, "GPU-8f2a4c1e-0000") == "GPU-8f2a4c1e-0000"
    assert map_gpu_index(2, None) == "2"
    with pytest.raises(DeviceError):
        map_gpu_index(1, "5")
    with pytest.raises(DeviceError):
        map_gpu_index(1, "5,,6")  # the CUDA runtime stops at the empty entry
    with pytest.raises(DeviceError):
        map_gpu_index(-1, "0")


def test_map_gpu_index_reads_environment(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    assert map_gpu_index(0) == "5"
    c = classify_text(C3_LEGACY)  # says "GPU 0"; the process saw only physical GPU 5
    assert c.gpu_index_physical == "5" and "physical GPU 5" in c.message
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert classify_text(C3_LEGACY).gpu_index_physical is None


def test_classification_is_a_frozen_record():
    c = classify_text("ValueError: x")
    assert isinstance(c, Classification)
    with pytest.raises(AttributeError):
        c.outcome = Outcome.OK  # type: ignore[misc]


@pytest.mark.parametrize("text", ["ValueError: print_max must be positive", "KeyError: 'hint_max'"])
def test_limit_codes_are_matched_case_sensitively(text):
    assert classify_text(text, batch_size=8, smaller_batch_succeeded=True).outcome is Outcome.ERROR


def test_errno_12_is_host_memory():
    assert classify_text("OSError: [Errno 12] Cannot allocate memory").outcome is Outcome.HOST_OOM


def test_virtual_gpu_message_round_trip():
    from oomtune.alloc.oom_message import SimulatedOutOfMemoryError, build_oom_message

    msg = build_oom_message(alloc_size_bytes=2 * 2**30, device_index=0, total_bytes=8 * 2**30, free_bytes=2**30,
                            allocated_bytes=3 * 2**30, reserved_bytes=6 * 2**30, allowed_bytes=7 * 2**30)
    c = classify_exception(SimulatedOutOfMemoryError(msg))
    # 6 - 3 = 3 GiB cached >= 2 GiB request: fragmentation even under the 7 GiB cap
    assert c.outcome is Outcome.OOM_FRAGMENTATION and "(simulated)" in c.message
    assert (c.oom.requested_bytes, c.oom.reserved_bytes, c.oom.allowed_bytes) == (2 * 2**30, 6 * 2**30, 7 * 2**30)


def test_c8_trapped_cache_is_fragmentation_even_when_cached_alone_is_smaller():
    # C8 (pytorch#35901): 10.26 GiB free < 10.84 GiB <= free + 10.37 GiB cached-but-unallocated: the
    # batch fits, the split cached block stopped it -> fragmentation, never "needs more memory".
    text = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 10.84 GiB. GPU 0 has a total "
            "capacity of 23.65 GiB of which 10.26 GiB is free. Of the allocated memory 486.39 MiB is "
            "allocated by PyTorch, and 10.37 GiB is reserved by PyTorch but unallocated.")
    assert classify_text(text).outcome is Outcome.OOM_FRAGMENTATION
    # The same request with little cached memory is a plain OOM: 10.26 + 0.30 < 10.84.
    plain = text.replace("10.37 GiB is reserved", "0.30 GiB is reserved")
    assert classify_text(plain).outcome is Outcome.OOM
