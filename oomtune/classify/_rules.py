"""Classifying one exception text: the rule table (see :mod:`oomtune.classify` for the order and why).

Small named predicates over the text (after Lightning's ``utilities/memory.py``), tried in order by
:func:`classify_text`; anything not recognised is ``error``. Allocator OOMs are split into
fragmentation / fraction cap / plain from the figures :func:`parse_oom_message` reads.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from oomtune.classify._gpu_index import _ENV, _visible, map_gpu_index
from oomtune.classify._oom_parse import SIMULATED_PREFIX, OomInfo, parse_oom_message
from oomtune.exceptions import DeviceError
from oomtune.outcome import Outcome
from oomtune.units import format_bytes

__all__ = ["Classification", "ADVICE", "classify_text", "is_element_limit", "is_allocation_size_limit",
           "segment_and_request", "is_allocator_oom",
           "is_outside_allocator_oom", "is_host_oom", "is_tensorflow_oom", "is_cudnn_algorithm",
           "is_worker_crash", "memory_signal"]

@dataclass(frozen=True)
class Classification:
    """How a trial failed (or did not).

    Attributes:
        outcome: the :class:`Outcome`.
        message: one line: the failing exception or exit status, with the key figures.
        advice: one line: what to change (allocator setting, budget, workers, nothing).
        oom: the parsed OOM message for allocator OOMs, else None.
        gpu_index_physical: the physical device id (index or GPU-UUID) the printed index maps to under
            CUDA_VISIBLE_DEVICES; None when not remapped (field case C10).
        traceback_tail: the last lines of the traceback (at most 20) for ``error``/``crash``.
        rank: the global rank whose failure this is, when a launcher's summary named it (a
            multi-process command: :mod:`oomtune.classify._launcher`); None otherwise.
    """

    outcome: Outcome
    message: str
    advice: str
    oom: OomInfo | None = None
    gpu_index_physical: str | None = None
    traceback_tail: str | None = None
    rank: int | None = None


ADVICE = {
    Outcome.OK: "nothing to change",
    Outcome.OOM: "the batch does not fit: lower the batch size (cached free memory was smaller than the request)",
    Outcome.OOM_FRAGMENTATION: "set expandable_segments:True or max_split_size_mb before lowering the batch",
    Outcome.FRACTION_CAP: "the per-process memory fraction (budget) was the limit, not the card: lower the "
                          "batch or raise the budget",
    Outcome.OOM_OUTSIDE_ALLOCATOR: "memory outside the caching allocator (cuBLAS/cuDNN workspaces, NCCL, "
                                   "CUDA context) ran out: leave more headroom below the budget or lower the batch",
    Outcome.HOST_OOM: "host memory, not the GPU: lower num_workers / increase shared memory (--shm-size) or host RAM",
    Outcome.LIMIT: "element-count limit, not memory: no allocator setting helps; this batch is infeasible",
    Outcome.TIMEOUT: "not memory: raise the per-trial timeout (trial.timeout) or measure fewer steps",
    Outcome.CRASH: "a native crash or a kill from outside (kill -9, preemption), not memory: the search retries "
                   "it once; rerun the trial alone to reproduce it",
    Outcome.ERROR: "a setup fault or a bug, not a memory limit: see the traceback tail",
    Outcome.BAD_RECORD: "the script wrote a malformed result record: report numbers through oomtune.report("
                        "samples=..., seconds=...) instead of writing OOMTUNE_RESULT_FILE by hand",
}
_TF_ADVICE = ("TensorFlow's allocator ran out (PyTorch allocator settings do not apply to it): lower the batch "
              "size, or set TF_GPU_ALLOCATOR=cuda_malloc_async / TF_FORCE_GPU_ALLOW_GROWTH=true")
_LIB_LIMIT_ADVICE = ("batch-size-dependent library limit after smaller batches succeeded: this batch is "
                     "infeasible; no allocator setting helps")
_SIZE_LIMIT_ADVICE = ("one allocation is larger than the platform allows (a per-buffer limit, not memory): no "
                      "allocator setting or free memory helps; this batch is infeasible, a smaller one may fit")
_MPS_ADVICE = ("the MPS allocator reached its limit (max allowed: PYTORCH_MPS_HIGH_WATERMARK_RATIO x the "
               "device's working set): lower the batch; CUDA allocator settings do not apply to MPS")


def _rx(*alternatives: str) -> Callable[[str], bool]:
    """A predicate: does any of the (case-sensitive) regular expressions occur in the text?"""
    rx = re.compile("|".join(f"(?:{a})" for a in alternatives), re.S)
    return lambda text: rx.search(text) is not None


is_element_limit = _rx(r"INT_MAX", r"canUse32BitIndexMath", r"32-bit index", r"integer out of range",
                       r"cannot be converted to type int(?:32)? without overflow", r"numel[^\n]*int32",
                       r"more than 2\^31")
is_allocator_oom = _rx(r"\b(?:CUDA|HIP|XPU) out of memory\.", r"would exceed allowed memory",
                       r"preemptively rejected",
                       # any backend copying torch's allocator message (NPU, CNRT, ...)
                       r"\b[A-Z][A-Za-z]{1,11} out of memory\.\s+Tried to allocate",
                       r"\bMPS backend out of memory")
# A platform's limit on the size of one allocation, not memory: no allocator setting and no free
# memory helps, a smaller tensor (batch) does. MPS/Metal: MPSAllocator.mm's
# "Invalid buffer size: 50.62 GB" (above the device's maxBufferLength) and MPSNDArray's "total bytes
# of NDArray > 2**32"; intel-extension-for-pytorch's XPU allocator: "Current platform can NOT allocate
# memory block with size larger than 4GB!"; c10's caching allocators: "CUDA out of memory. Tried to
# allocate more than 1EB memory." (CUDACachingAllocator.cpp ``allocate``: size >= 2**60).
is_allocation_size_limit = _rx(r"Invalid buffer size: \d", r"total bytes of NDArray > 2\*\*32",
                               r"can NOT allocate memory block with size larger than",
                               r"Tried to allocate more than \d+\s*[KMGTPE]?i?B memory")
is_outside_allocator_oom = _rx(r"CUBLAS_STATUS_ALLOC_FAILED", r"CUDNN_STATUS_ALLOC_FAILED",
                               r"CUFFT_ALLOC_FAILED", r"CUSOLVER_STATUS_ALLOC_FAILED",
                               r"CUSPARSE_STATUS_ALLOC_FAILED", r"Cuda failure '?out of memory",
                               r"Failed to CUDA calloc", r"(?:CUDA|HIP) error: out of memory",
                               r"cudaErrorMemoryAllocation", r"hipErrorOutOfMemory",
                               r"CUDA driver error: out of memory", r"CUDA_ERROR_OUT_OF_MEMORY")
is_host_oom = _rx(r"DefaultCPUAllocator: (?:not enough memory|can't allocate memory)",
                  r"(?i:can't allocate memory|cannot allocate memory)",
                  r"DataLoader worker \(pid \d+\) is killed by signal: (?:Bus error|Killed)",
                  r"out of shared memory", r"insufficient shared memory",
                  r"unable to allocate shared memory", r"unable to write to file </torch_.*No space left")
# TensorFlow's own allocator (BFC) and its memory failures: users run TF scripts through target=cmd.
# tensorflow/core/common_runtime/bfc_allocator.cc, framework/op_kernel.cc,
# common_runtime/gpu/gpu_util.cc ("Dst tensor is not initialized": the copy destination got no memory).
is_tensorflow_oom = _rx(r"ResourceExhaustedError", r"\bRESOURCE_EXHAUSTED\b", r"OOM when allocating tensor",
                        r"Dst tensor is not initialized", r"ran out of memory trying to allocate",
                        r"\bfailed to allocate (?:memory\b|[\d.]+\s*[KMGTP]?i?B?\b)")
_TF_HOST = re.compile(r"device:CPU|\bcpu_allocator\b|\bmklcpu\b|Allocator \(cpu\)", re.I)
is_cudnn_algorithm = _rx(r"Unable to find a valid cuDNN algorithm", r"CUDNN_STATUS_NOT_SUPPORTED",
                         r"CUBLAS_STATUS_NOT_INITIALIZED")
is_worker_crash = _rx(r"DataLoader worker \(pid\(?s?\)? [\d, ]+\) (?:is killed by signal|exited unexpectedly)")
_TYPE_RX = re.compile(r"^\s*([A-Za-z_][\w.]*)(?::|$)")


def _exception_type(text: str) -> str:
    m = _TYPE_RX.match(text)
    return m.group(1).rsplit(".", 1)[-1] if m else ""


def _one_line(text: str, limit: int = 400) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _oom_classification(text: str, info: OomInfo | None) -> tuple[Outcome, str]:
    """Split an allocator OOM into fragmentation / fraction cap / plain (see the module docstring)."""
    where = "simulated" if SIMULATED_PREFIX in text else "device"
    if info is None:
        return Outcome.OOM, f"allocator OOM ({where}): {_one_line(text, 200)}"
    req = info.requested_bytes
    head = f"tried to allocate {format_bytes(req)}" + (f" on GPU {info.gpu_index}" if info.gpu_index is not None else "")
    cached = info.cached_free_bytes
    if info.source_format == "mps":
        used = "" if info.process_in_use_bytes is None else f"{format_bytes(info.process_in_use_bytes)} in use ("
        return Outcome.OOM, (
            f"out of memory (MPS, {where}): tried to allocate {format_bytes(req)} on the {info.pool} pool; "
            f"{used}{format_bytes(info.allocated_bytes)} by the MPS allocator) of "
            f"{format_bytes(info.allowed_bytes)} max allowed")
    if _is_fragmentation(info):
        segment, request = segment_and_request(req)
        return Outcome.OOM_FRAGMENTATION, (
            f"fragmentation ({where}): {head}; {format_bytes(_usable_free(info))} free < the "
            f"{format_bytes(segment)} segment it needs, while the request (at most {format_bytes(request)}) <= free + "
            f"{format_bytes(cached)} reserved but unallocated ({format_bytes(info.reserved_bytes)} reserved, "
            f"{format_bytes(info.allocated_bytes)} allocated): the cached memory is split across segments "
            f"that still hold live blocks")
    if info.source_format == "preemptive" or _fraction_was_limit(info):
        allowed = "" if info.allowed_bytes is None else f"{format_bytes(info.allowed_bytes)} allowed of "
        return Outcome.FRACTION_CAP, (
            f"fraction cap hit ({where}): {head}; {allowed}{format_bytes(info.total_bytes)} total")
    others = ("" if not info.other_processes_bytes
              else f"; other processes hold {format_bytes(info.other_processes_bytes)}")
    return Outcome.OOM, (f"out of memory ({where}): {head}; {format_bytes(info.allocated_bytes)} allocated, "
                         f"{format_bytes(info.free_bytes)} free of {format_bytes(info.total_bytes)}{others}")


def _usable_free(info: OomInfo) -> int | None:
    """The device's free memory as the message printed it, capped by what the per-process fraction
    still allows (``allowed - reserved``) when an ``allowed`` figure was printed; bytes."""
    free = info.free_bytes
    if free is not None and info.allowed_bytes is not None and info.reserved_bytes is not None:
        free = min(free, max(0, info.allowed_bytes - info.reserved_bytes))
    return free


#: The caching allocator's sizes (c10/cuda/CUDACachingAllocator.cpp; allocator-spec.md section 2).
_SMALL_SIZE = 1 << 20          # kSmallSize: requests up to 1 MiB go to the small pool
_SMALL_BUFFER = 2 << 20        # kSmallBuffer: every small-pool segment
_MIN_LARGE_ALLOC = 10 << 20    # kMinLargeAlloc: requests below it share a 20 MiB segment
_LARGE_BUFFER = 20 << 20       # kLargeBuffer
_ROUND_LARGE = 2 << 20         # kRoundLarge: larger segments are the request rounded up to 2 MiB
_MIN_BLOCK = 512               # kMinBlockSize


def segment_and_request(printed: int | None) -> tuple[int | None, int | None]:
    """The segment the allocator asked the device for, and the largest request behind it, from the
    "Tried to allocate" figure of a caching-allocator message, in bytes.

    Every release of the caching allocator (and the NPU/XPU allocators that copy it) prints
    ``format_size(alloc_size)`` with ``alloc_size = get_allocation_size(size)``: the *segment*, not
    the request (torch 1.1-1.3's "cached" format, 1.4-2.0's "reserved in total" and the current one;
    c10/cuda/CUDACachingAllocator.cpp). ``get_allocation_size``: a request of at most 1 MiB gets a
    2 MiB segment, one below 10 MiB a 20 MiB segment, a larger one its size rounded up to 2 MiB. So:

    * 2.00 MiB is a small-pool segment: the request was at most 1 MiB;
    * 20.00 MiB is a large segment shared by requests below 10 MiB: at most 10 MiB - 512 B;
    * another figure below 10 MiB cannot be a segment: it is the request itself (torch 1.0 printed
      some requests; so do allocators that print the request), and the segment is
      ``get_allocation_size`` of it (2 or 20 MiB);
    * from 10 MiB: the request, and the segment its size rounded up to 2 MiB (the same figure when
      it already was one; two decimals of print cannot tell them apart).
    """
    if printed is None:
        return None, None
    if printed == _SMALL_BUFFER:
        return _SMALL_BUFFER, _SMALL_SIZE
    if printed == _LARGE_BUFFER:
        return _LARGE_BUFFER, _MIN_LARGE_ALLOC - _MIN_BLOCK
    if printed <= _SMALL_SIZE:
        return _SMALL_BUFFER, printed
    if printed < _MIN_LARGE_ALLOC:
        return _LARGE_BUFFER, printed
    return -(-printed // _ROUND_LARGE) * _ROUND_LARGE, printed


def _is_fragmentation(info: OomInfo) -> bool:
    """``free < segment`` and ``request <= free + cached``, in every format (field
    cases C3, C8; the device is asked for the segment
    (:func:`segment_and_request`), not the request, so its free memory is compared with the segment,
    and the cached memory with the request it would have served).

    The message is written after the allocator's retry chain released every cached block that was a
    whole segment (``release_cached_blocks`` in ``DeviceCachingAllocator::malloc``), so the
    reserved-but-unallocated memory left sits in segments that also hold live blocks. When the usable
    free memory (capped by the fraction's allowance) alone covers the request, the layout of the
    cache did not stop it (another process took the memory, or the figures raced): not fragmentation.
    When free + that trapped cache holds the request, the batch fits the budget and the layout stopped
    it: fragmentation, fixed by max_split_size_mb or expandable_segments. Without a printed free
    figure (intel-extension-for-pytorch's XPU format) the cache alone must hold the request."""
    cached, free = info.cached_free_bytes, _usable_free(info)
    segment, request = segment_and_request(info.requested_bytes)
    if request is None or cached is None or cached <= 0:
        return False
    if free is None:
        return cached >= request
    return free < segment and request <= free + cached


def _fraction_was_limit(info: OomInfo) -> bool:
    """An "allowed" below the total capacity means set_per_process_memory_fraction capped the process
    (field case C4). Exception: the card itself was out (free < request) while reserved + request
    still fitted under the cap."""
    if info.allowed_bytes is None or info.total_bytes is None or info.allowed_bytes >= info.total_bytes:
        return False
    used = info.reserved_bytes if info.reserved_bytes is not None else info.allocated_bytes
    card_was_out = info.free_bytes is not None and info.requested_bytes is not None and info.free_bytes < info.requested_bytes
    fits_cap = used is not None and info.requested_bytes is not None and used + info.requested_bytes <= info.allowed_bytes
    return not (card_was_out and fits_cap)


def _library_limit(smaller_batch_succeeded: bool, batch_size: int | None) -> bool:
    return smaller_batch_succeeded and (batch_size is None or batch_size > 1)


def classify_text(text: str, *, batch_size: int | None = None, smaller_batch_succeeded: bool = False,
                  visible_devices: str | None | object = _ENV) -> Classification:
    """Classify one exception text (``"TypeName: message"``, possibly several lines).

    Args:
        text: the exception line(s) as Python prints them (``format_exception_only``).
        batch_size: the trial's batch size (batch 1 never yields a library ``limit``).
        smaller_batch_succeeded: a smaller batch ran in the same setup (field case C1).
        visible_devices: the trial's CUDA_VISIBLE_DEVICES (default: this process's environment).

    Returns:
        A :class:`Classification`; unrecognised text is ``error``. Never raises.
    """
    text = _drop_warnings(text).strip()
    msg = _one_line(text)
    if is_element_limit(text):
        return Classification(Outcome.LIMIT, f"element-count limit: {msg}", ADVICE[Outcome.LIMIT])
    if is_allocation_size_limit(text):
        return Classification(Outcome.LIMIT, f"per-allocation size limit of the platform (not memory): {msg}",
                              _SIZE_LIMIT_ADVICE)
    etype = _exception_type(text)
    if is_tensorflow_oom(text) and not is_allocator_oom(text):
        if _TF_HOST.search(text):
            return Classification(Outcome.HOST_OOM, f"host memory (TensorFlow's CPU allocator): {msg}",
                                  ADVICE[Outcome.HOST_OOM])
        return Classification(Outcome.OOM, f"out of memory in TensorFlow's GPU allocator: {msg}", _TF_ADVICE)
    if is_outside_allocator_oom(text) and not is_allocator_oom(text):
        return Classification(Outcome.OOM_OUTSIDE_ALLOCATOR, f"out of memory outside the caching allocator: {msg}",
                              ADVICE[Outcome.OOM_OUTSIDE_ALLOCATOR])
    if is_allocator_oom(text) or etype.endswith("OutOfMemoryError"):
        info = parse_oom_message(text)
        outcome, line = _oom_classification(text, info)
        physical = _physical(info, visible_devices) if info is None or info.backend in ("CUDA", "HIP") else None
        if physical is not None:
            line += f" (physical GPU {physical})"
        advice = _MPS_ADVICE if info is not None and info.source_format == "mps" else ADVICE[outcome]
        return Classification(outcome, line, advice, info, physical)
    if is_host_oom(text) or etype == "MemoryError":
        return Classification(Outcome.HOST_OOM, f"host memory: {msg}", ADVICE[Outcome.HOST_OOM])
    if is_cudnn_algorithm(text):
        if _library_limit(smaller_batch_succeeded, batch_size):
            return Classification(Outcome.LIMIT, f"library limit at batch {batch_size}: {msg}", _LIB_LIMIT_ADVICE)
        return Classification(Outcome.ERROR, f"setup fault (no smaller batch succeeded): {msg}", ADVICE[Outcome.ERROR])
    if is_worker_crash(text):
        return Classification(Outcome.CRASH, f"DataLoader worker died: {msg}", ADVICE[Outcome.CRASH])
    return Classification(Outcome.ERROR, msg or "error with no message", ADVICE[Outcome.ERROR])


def memory_signal(text: str, **kw) -> Classification | None:
    """The memory outcome of a memory failure named anywhere in ``text`` (a whole stderr), or None.

    Unlike :func:`classify_text`, which judges one exception, this looks for any memory signal
    (allocator OOM, TensorFlow, outside the allocator, host) in any line, e.g. NCCL's
    ``NCCL WARN Cuda failure 'out of memory'`` logged before a generic traceback.
    ``kw`` as for :func:`classify_text`. Never raises.
    """
    text = _drop_warnings(text)
    if not (is_allocator_oom(text) or is_tensorflow_oom(text) or is_outside_allocator_oom(text)
            or is_host_oom(text)):
        return None
    lines = [ln for ln in text.splitlines() if ln.strip()]
    for i, line in enumerate(lines):  # the first line that carries the signal
        if not (is_allocator_oom(line) or is_tensorflow_oom(line) or is_outside_allocator_oom(line)
                or is_host_oom(line)):
            continue
        result = classify_text(line, **kw)
        if is_allocator_oom(line) and result.oom is None:  # a message wrapped over several lines
            result = classify_text("\n".join(lines[i:i + 8]), **kw)
        if result.outcome.is_memory or result.outcome is Outcome.HOST_OOM:
            return result
    result = classify_text(text, **kw)
    return result if result.outcome.is_memory or result.outcome is Outcome.HOST_OOM else None


def _physical(info: OomInfo | None, visible_devices: str | None | object) -> str | None:
    if info is None or info.gpu_index is None:
        return None
    visible = _visible(visible_devices)
    if visible is None:
        return None
    try:
        return map_gpu_index(info.gpu_index, visible)
    except DeviceError:
        return None


_WARNING_RX = re.compile(r"^.*memory allocation failed with OOM on device.*$\n?", re.M)


def _drop_warnings(text: str) -> str:
    """Remove torch's LOG(WARNING) "memory allocation failed with OOM" lines (recovered retries)."""
    return _WARNING_RX.sub("", text)
