"""Field faults of the classifier: the oldest OOM format, the fragmentation rule
in every format, TensorFlow's memory failures, and a memory signal anywhere in stderr.

Expected values are hand calculations from the printed figures (``X GiB`` -> round(X * 2**30),
``X MiB`` -> round(X * 2**20), torch's format_size) and the rule the issue states from PyTorch's
behaviour: a fragmentation OOM has free < request <= free + reserved-but-unallocated.
"""

from __future__ import annotations

import pytest

from oomtune.classify import classify_failure, classify_text, parse_oom_message
from oomtune.classify._rules import memory_signal
from oomtune.outcome import Outcome


def gib(x: float) -> int:
    return round(x * 2**30)


def mib(x: float) -> int:
    return round(x * 2**20)


def _traceback(exc_line: str) -> str:
    return ('Traceback (most recent call last):\n  File "train.py", line 9, in <module>\n    step()\n'
            f"{exc_line}\n")


# ------------------------------------------------------------------ torch <= 1.3, "cached"
OLDEST = ("RuntimeError: CUDA out of memory. Tried to allocate 32.00 MiB (GPU 0; 7.79 GiB total capacity; "
          "6.64 GiB already allocated; 21.00 MiB free; 150.86 MiB cached)")


def test_item1_oldest_format_cached_is_reserved_minus_allocated():
    info = parse_oom_message(OLDEST)
    assert info.source_format == "legacy_cached"
    assert info.allocated_bytes == gib(6.64) == 7129645711   # 6.64 * 2**30 = 7129645711.36
    assert info.reserved_bytes == gib(6.64) + mib(150.86)    # reserved = allocated + cached
    assert info.cached_free_bytes == mib(150.86) == 158188175  # 150.86 * 2**20 = 158188175.36
    # read as the reserved total it gave 158188175 - 7129645711 = -6,971,457,536 bytes (the figure)
    assert info.cached_free_bytes > 0


def test_item1_oldest_format_is_fragmentation():
    # free 21.00 MiB < 32.00 MiB requested <= 21.00 + 150.86 MiB: the cache would hold it
    c = classify_text(OLDEST)
    assert c.outcome is Outcome.OOM_FRAGMENTATION
    assert "expandable_segments" in c.advice


def test_item1_oldest_format_with_little_cache_is_plain_oom():
    # free 21.00 MiB + 5.00 MiB cached = 26 MiB < 32 MiB requested: the batch does not fit
    c = classify_text(OLDEST.replace("150.86 MiB cached", "5.00 MiB cached"))
    assert c.outcome is Outcome.OOM and c.oom.cached_free_bytes == mib(5.00)


# ------------------------------------------------------------------ free alone covers the request
CURRENT_OTHERS = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 86.00 MiB. GPU 0 has a total "
                  "capacity of 23.64 GiB of which 264.00 MiB is free. Process A has 419.48 MiB memory in use. "
                  "Including non-PyTorch memory, this process has 8.04 GiB memory in use. Process B has 14.85 GiB "
                  "memory in use. Of the allocated memory 7.63 GiB is allocated by PyTorch, and 40.11 MiB is "
                  "reserved by PyTorch but unallocated.")


def test_item2_current_format_free_covers_request_is_not_fragmentation():
    c = classify_text(CURRENT_OTHERS)
    # 264.00 MiB free > 86.00 MiB requested: the cache layout did not stop it
    assert c.oom.free_bytes == mib(264.00) and c.oom.requested_bytes == mib(86.00)
    assert c.outcome is Outcome.OOM
    assert "expandable_segments" not in c.advice
    # the other processes hold 419.48 MiB + 14.85 GiB = 15.26 GiB; this process 8.04 GiB
    assert c.oom.other_processes_bytes == mib(419.48) + gib(14.85)
    assert c.oom.process_in_use_bytes == gib(8.04)
    assert "other processes hold 15.26 GiB" in c.message


def test_item2_legacy_format_free_covers_request_is_not_fragmentation():
    text = ("CUDA out of memory. Tried to allocate 2.26 GiB (GPU 0; 7.79 GiB total capacity; 1.01 GiB already "
            "allocated; 3.03 GiB free; 1.24 GiB reserved in total by PyTorch)")
    # 3.03 GiB free > 2.26 GiB requested -> not fragmentation, whatever the cache
    assert classify_text(text).outcome is Outcome.OOM


@pytest.mark.parametrize("free, cached, expected", [
    # request 100 MiB: fragmentation exactly when free < 100 <= free + cached
    ("60.00 MiB", "40.00 MiB", Outcome.OOM_FRAGMENTATION),   # 60 < 100 <= 100 (boundary included)
    ("60.00 MiB", "39.00 MiB", Outcome.OOM),                 # 60 + 39 = 99 < 100
    ("100.00 MiB", "500.00 MiB", Outcome.OOM),               # free alone covers the request
    ("0 bytes", "100.00 MiB", Outcome.OOM_FRAGMENTATION),    # 0 < 100 <= 0 + 100
])
def test_item2_rule_is_the_same_in_every_format(free, cached, expected):
    current = (f"CUDA out of memory. Tried to allocate 100.00 MiB. GPU 0 has a total capacity of 15.78 GiB of "
               f"which {free} is free. Of the allocated memory 2.00 GiB is allocated by PyTorch, and {cached} is "
               f"reserved by PyTorch but unallocated.")
    oldest = (f"CUDA out of memory. Tried to allocate 100.00 MiB (GPU 0; 15.78 GiB total capacity; 2.00 GiB "
              f"already allocated; {free} free; {cached} cached)")
    legacy = (f"CUDA out of memory. Tried to allocate 100.00 MiB (GPU 0; 15.78 GiB total capacity; 1.00 GiB "
              f"already allocated; {free} free; 1.00 GiB reserved in total by PyTorch)").replace(
        "1.00 GiB reserved", f"{1024 + float(cached.split()[0]):.2f} MiB reserved")  # 1 GiB + cached
    for text in (current, oldest, legacy):
        assert classify_text(text).outcome is expected, text


def test_item2_c3_and_c8_stay_fragmentation():
    # C3: 283.44 MiB free < 2.51 GiB <= 283.44 MiB + 7.66 GiB; C8: 10.26 < 10.84 <= 10.26 + 10.37 GiB
    c3 = ("CUDA out of memory. Tried to allocate 2.51 GiB (GPU 0; 15.78 GiB total capacity; 6.25 GiB already "
          "allocated; 283.44 MiB free; 13.91 GiB reserved in total by PyTorch)")
    c8 = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 10.84 GiB. GPU 0 has a total capacity of "
          "23.65 GiB of which 10.26 GiB is free. Of the allocated memory 486.39 MiB is allocated by PyTorch, and "
          "10.37 GiB is reserved by PyTorch but unallocated.")
    assert classify_text(c3).outcome is Outcome.OOM_FRAGMENTATION
    assert classify_text(c8).outcome is Outcome.OOM_FRAGMENTATION


# ------------------------------------------------------------------ TensorFlow memory failures
@pytest.mark.parametrize("text", [
    "tensorflow.python.framework.errors_impl.ResourceExhaustedError: OOM when allocating tensor with "
    "shape[64,256,56,56] and type float on /job:localhost/replica:0/task:0/device:GPU:0 by allocator GPU_0_bfc",
    "ResourceExhaustedError: failed to allocate memory [Op:AddV2]",
    "tensorflow.python.framework.errors_impl.InternalError: Dst tensor is not initialized.",
    "W tensorflow/core/common_runtime/bfc_allocator.cc:290] Allocator (GPU_0_bfc) ran out of memory trying to "
    "allocate 2.00GiB with freed_by_count=0.",
    "2024-01-01 E tensorflow/stream_executor/cuda/cuda_driver.cc:806] failed to allocate 3.86G (4140614656 bytes)",
])
def test_item3_tensorflow_memory_failures_are_memory_outcomes(text):
    c = classify_text(text)
    assert c.outcome is Outcome.OOM, (text, c)
    assert "TensorFlow" in c.advice


def test_item3_tensorflow_cpu_allocator_is_host_memory():
    text = ("ResourceExhaustedError: OOM when allocating tensor with shape[100000,100000] and type float on "
            "/job:localhost/replica:0/task:0/device:CPU:0 by allocator cpu")
    assert classify_text(text).outcome is Outcome.HOST_OOM


def test_item3_tensorflow_traceback_through_stderr():
    stderr = _traceback("tensorflow.python.framework.errors_impl.ResourceExhaustedError: OOM when allocating "
                        "tensor with shape[512,1024] and type float on /device:GPU:0 by allocator GPU_0_bfc")
    assert classify_failure(returncode=1, stderr=stderr).outcome is Outcome.OOM


def test_item3_unrelated_failed_to_allocate_wording_is_not_matched():
    assert classify_text("ValueError: failed to allocate a port for the dashboard").outcome is Outcome.ERROR


# ------------------------------------------------------------------ a signal anywhere in stderr
def test_item4_nccl_warn_before_generic_traceback_is_outside_allocator():
    stderr = ("node1:123:456 [0] include/alloc.h:48 NCCL WARN Cuda failure 'out of memory'\n"
              "node1:123:456 [0] NCCL INFO init.cc:1234 -> 1\n"
              + _traceback("RuntimeError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error, "
                           "NCCL version 2.21.5"))
    c = classify_failure(returncode=1, stderr=stderr)
    assert c.outcome is Outcome.OOM_OUTSIDE_ALLOCATOR
    assert c.traceback_tail is not None and "NCCL error" in c.traceback_tail


def test_item4_failed_to_cuda_calloc_then_generic_error():
    stderr = ("node1:1:1 [0] NCCL WARN Failed to CUDA calloc 6291456 bytes\n"
              + _traceback("RuntimeError: something went wrong in the collective"))
    assert classify_failure(returncode=1, stderr=stderr).outcome is Outcome.OOM_OUTSIDE_ALLOCATOR


def test_item4_signal_without_any_traceback_and_nonzero_exit():
    stderr = "NCCL WARN Cuda failure 'out of memory'\nterminate called without an active exception\n"
    assert classify_failure(returncode=-6, stderr=stderr).outcome is Outcome.OOM_OUTSIDE_ALLOCATOR


def test_item4_generic_error_without_memory_signal_stays_error():
    stderr = "loading\n" + _traceback("RuntimeError: NCCL error: invalid usage")
    assert classify_failure(returncode=1, stderr=stderr).outcome is Outcome.ERROR
    assert memory_signal(stderr) is None


def test_item4_allocator_oom_logged_then_generic_error_is_parsed():
    # A script that logs the OOM it caught, then fails for a generic reason; the message is wrapped.
    stderr = ("caught: CUDA out of memory. Tried to allocate 2.51 GiB (GPU 0; 15.78 GiB total capacity;\n"
              "6.25 GiB already allocated; 283.44 MiB free; 13.91 GiB reserved in total by PyTorch)\n"
              + _traceback("RuntimeError: retry budget exhausted"))
    c = classify_failure(returncode=1, stderr=stderr)
    # 283.44 MiB free < 2.51 GiB <= 283.44 MiB + (13.91 - 6.25) GiB
    assert c.outcome is Outcome.OOM_FRAGMENTATION and c.oom.requested_bytes == gib(2.51)


def test_item4_exit_zero_with_memory_text_is_not_a_failure():
    # a successful run that merely logged a recovered NCCL warning is judged by its record, not its log
    assert classify_failure(returncode=0, stderr="NCCL WARN Cuda failure 'out of memory'\n").outcome is Outcome.OK
