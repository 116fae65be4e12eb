"""One failure classifier for trial processes: exceptions, stderr text and exit status.

Structured after Lightning's ``utilities/memory.py``: small named predicates over the exception text
and a table of rules, tried in order; anything not recognised is ``error`` (never guessed to be an
OOM). Every torch OOM message format is parsed into bytes by :func:`parse_oom_message`.

Rule order (first match wins) and why:

1. ``limit`` for element-count / 32-bit indexing limits (field case C2): these never mention memory and
   no allocator setting helps, so they come before anything memory-like.
2. The caching allocator's OOM (``CUDA out of memory. Tried to allocate``), split by cause:
   ``oom_fragmentation`` when reserved-but-unallocated >= the request (C3), else ``fraction_cap`` when an
   ``allowed`` figure below the total capacity was printed (C4), else ``oom``. Fragmentation wins over
   the fraction cap: reserved - allocated >= request implies allocated + request <= reserved <= allowed,
   so the request fits inside the cap and only the layout of the cached blocks stopped it; an allocator
   setting (expandable_segments / max_split_size_mb) fixes it under the same budget, whereas "fraction
   cap" would send the user to raise the budget.
3. ``oom_outside_allocator``: cuBLAS/cuDNN/cuFFT/cuSOLVER/cuSPARSE/NCCL allocation failures and the raw
   driver/runtime ``CUDA error: out of memory`` (torch.AcceleratorError).
4. ``host_oom``: host RAM and shared memory (C5).
5. ``limit`` for batch-size-dependent library failures (cuDNN algorithm search, CUDNN_STATUS_NOT_SUPPORTED,
   CUBLAS_STATUS_NOT_INITIALIZED) only after a smaller batch succeeded in the same setup (C1); otherwise
   (batch 1, or nothing smaller ran) they are ``error``: a setup fault. CUBLAS_STATUS_NOT_INITIALIZED is
   treated like the cuDNN cases (the reference notes list it as "batch-size-dependent but not memory");
   when it comes with an out-of-memory text, rule 3 has already called it memory.
6. The exception type: ``*OutOfMemoryError`` -> ``oom`` (an allocator OOM with an unparsed message),
   Python ``MemoryError`` -> ``host_oom``. A plain RuntimeError is never an OOM by its type.

The v2.13 ``LOG(WARNING)`` line "memory allocation failed with OOM on device ..." fires on retries that
later succeed; it is removed from stderr before anything is matched.
"""

from __future__ import annotations

import os
import re
import signal
import traceback as _tb
from dataclasses import dataclass
from decimal import ROUND_HALF_EVEN, Decimal
from typing import Callable

from oomtune.exceptions import DeviceError
from oomtune.outcome import Outcome
from oomtune.units import GiB, KiB, MiB, TiB, format_bytes

__all__ = [
    "OomInfo",
    "Classification",
    "parse_oom_message",
    "classify_text",
    "classify_exception",
    "classify_failure",
    "map_gpu_index",
    "SIMULATED_PREFIX",
]

#: Prefix of the virtual GPU's simulated OOM messages (the rest is torch's native format).
SIMULATED_PREFIX = "[virtual GPU, simulated] "
TRACEBACK_TAIL_LINES = 20
_ENV = object()  # sentinel: read CUDA_VISIBLE_DEVICES from os.environ

# ---------------------------------------------------------------- sizes and the OOM message formats
# c10::CachingAllocator::format_size prints "N bytes" (<= 1 KiB), else 2 decimals of KiB/MiB/GiB.
_SZ = r"(\d+(?:\.\d+)?)\s*(bytes|B|KiB|MiB|GiB|TiB)\b"
_SCALE = {"bytes": 1, "B": 1, "KiB": KiB, "MiB": MiB, "GiB": GiB, "TiB": TiB}


def _w(pattern: str) -> re.Pattern[str]:
    """Compile ``pattern`` with every space matching any whitespace (messages get wrapped in logs)."""
    return re.compile(pattern.replace(" ", r"\s+").replace("SIZE", _SZ), re.S)


def _bytes(num: str, unit: str) -> int:
    """``("2.51", "GiB")`` -> ``round(2.51 * 2**30)`` bytes, computed exactly in decimal."""
    return int((Decimal(num) * _SCALE[unit]).to_integral_value(ROUND_HALF_EVEN))


def _find(rx: re.Pattern[str], text: str) -> int | None:
    m = rx.search(text)
    return None if m is None else _bytes(m.group(m.lastindex - 1), m.group(m.lastindex))


_CUR_HEAD = _w(r"(CUDA|HIP|XPU) out of memory\. Tried to allocate SIZE\. GPU (\d+) has a total "
               r"capac(?:i)?ty of SIZE of which SIZE is free\.")
_CUR_SELF = _w(r"Including non-PyTorch memory, this process has SIZE memory in use")
_CUR_PROC = _w(r"Process \d+ has SIZE memory in use")
_CUR_ALLOWED = _w(r"SIZE allowed;")
_CUR_ALLOC = _w(r"Of the allocated memory SIZE is allocated by PyTorch,")
_CUR_UNALLOC = _w(r"and SIZE is reserved by PyTorch but unallocated")
_LEG_HEAD = _w(r"(CUDA|HIP) out of memory\. Tried to allocate SIZE \(GPU (\d+);([^)]*)\)")
_LEG_TOTAL = _w(r"SIZE total capac(?:i)?ty")
_LEG_ALLOC = _w(r"SIZE already allocated")
_LEG_FREE = _w(r"SIZE free")
_LEG_ALLOWED = _w(r"SIZE allowed")
_LEG_RESERVED = _w(r"SIZE reserved in total by PyTorch")
_LEG_CACHED = _w(r"SIZE cached")  # torch <= 1.3: "cached" was the same total (memory_cached == reserved)
_ASYNC_HEAD = _w(r"Allocation on device (\d+) would exceed allowed memory")
_ASYNC_ALLOC = _w(r"Currently allocated\s*: SIZE")
_ASYNC_REQ = _w(r"Requested\s*: SIZE")
_ASYNC_TOTAL = _w(r"Device limit\s*: SIZE")
_ASYNC_FREE = _w(r"Free \(according to CUDA\)\s*: SIZE")
_ASYNC_LIMIT = _w(r"PyTorch limit \(set by user-supplied memory fraction\)\s*: SIZE")
# torch 2.14 (string in libc10_cuda.so): the fraction limit checked before cudaMalloc is even tried.
_PREEMPT = _w(r"Allocation was preemptively rejected because it would exceed per_process_memory_fraction "
              r"limit\. Requested size: SIZE")


@dataclass(frozen=True)
class OomInfo:
    """The numbers in one torch OOM message, in bytes (None where the format does not print them).

    Attributes:
        requested_bytes: "Tried to allocate" (the rounded block size the allocator asked for).
        gpu_index: the device index as printed (torch's visible index, see :func:`map_gpu_index`).
        total_bytes: total device capacity (cudaMemGetInfo total).
        free_bytes: free device memory as CUDA reported it at the failure.
        allocated_bytes: allocated by PyTorch (current format: incl. private pools).
        reserved_bytes: reserved in total by PyTorch = allocated + reserved-but-unallocated.
        allowed_bytes: the per-process-fraction limit when one was set, else None.
        process_in_use_bytes: "this process has M memory in use" (or the single "Process P has M").
        source_format: "current" | "legacy" | "legacy_cached" | "cudaMallocAsync" | "preemptive".
        backend: "CUDA" | "HIP" | "XPU".
    """

    requested_bytes: int | None
    gpu_index: int | None
    total_bytes: int | None
    free_bytes: int | None
    allocated_bytes: int | None
    reserved_bytes: int | None
    allowed_bytes: int | None
    process_in_use_bytes: int | None
    source_format: str
    backend: str = "CUDA"

    @property
    def cached_free_bytes(self) -> int | None:
        """Reserved by PyTorch but unallocated (cached free blocks), bytes; None if not printed."""
        if self.reserved_bytes is None or self.allocated_bytes is None:
            return None
        return self.reserved_bytes - self.allocated_bytes


def _parse_current(text: str) -> OomInfo | None:
    """Format of ``DeviceCachingAllocator::malloc`` (c10/cuda/CUDACachingAllocator.cpp, torch >= 2.1)."""
    m = _CUR_HEAD.search(text)
    if m is None:
        return None
    rest = text[m.end():]
    allocated, unallocated = _find(_CUR_ALLOC, rest), _find(_CUR_UNALLOC, rest)
    in_use = _find(_CUR_SELF, rest)
    procs = _CUR_PROC.findall(rest)
    if in_use is None and len(procs) == 1:
        in_use = _bytes(*procs[0])
    reserved = None if allocated is None or unallocated is None else allocated + unallocated
    return OomInfo(_bytes(m[2], m[3]), int(m[4]), _bytes(m[5], m[6]), _bytes(m[7], m[8]), allocated,
                   reserved, _find(_CUR_ALLOWED, rest), in_use, "current", m[1])


def _parse_legacy(text: str) -> OomInfo | None:
    """Format of torch 1.x-2.0: ``(GPU 0; T total capacity; A already allocated; F free; [W allowed; ]
    R reserved in total by PyTorch)``; torch <= 1.3 printed ``R cached`` for the same total."""
    m = _LEG_HEAD.search(text)
    if m is None:
        return None
    body = m[5]
    reserved, fmt = _find(_LEG_RESERVED, body), "legacy"
    if reserved is None:
        reserved, fmt = _find(_LEG_CACHED, body), "legacy_cached"
    return OomInfo(_bytes(m[2], m[3]), int(m[4]), _find(_LEG_TOTAL, body), _find(_LEG_FREE, body),
                   _find(_LEG_ALLOC, body), reserved, _find(_LEG_ALLOWED, body), None, fmt, m[1])


def _parse_async(text: str) -> OomInfo | None:
    """Format of ``mallocAsync`` in c10/cuda/CUDAMallocAsyncAllocator.cpp. The limit prints SIZE_MAX
    (17179869184.00 GiB) when no fraction was set; that and any limit >= the device are ``None``."""
    m = _ASYNC_HEAD.search(text)
    if m is None:
        return None
    total, limit = _find(_ASYNC_TOTAL, text), _find(_ASYNC_LIMIT, text)
    if limit is not None and total is not None and limit >= total:
        limit = None
    return OomInfo(_find(_ASYNC_REQ, text), int(m[1]), total, _find(_ASYNC_FREE, text),
                   _find(_ASYNC_ALLOC, text), None, limit, None, "cudaMallocAsync")


def _parse_preemptive(text: str) -> OomInfo | None:
    m = _PREEMPT.search(text)
    if m is None:
        return None
    return OomInfo(_bytes(m[1], m[2]), None, None, None, None, None, None, None, "preemptive")


def parse_oom_message(text: str) -> OomInfo | None:
    """Parse any torch device-OOM message (current, legacy incl. the "total capacty" misspelling and
    "allowed", HIP/XPU, cudaMallocAsync, 2.14's preemptive fraction rejection) into bytes.

    The virtual GPU's prefix :data:`SIMULATED_PREFIX` may precede the native text. Returns None when
    ``text`` holds no recognised OOM message. Never raises.
    """
    text = text.replace(SIMULATED_PREFIX, "")
    for parse in (_parse_current, _parse_legacy, _parse_async, _parse_preemptive):
        info = parse(text)
        if info is not None:
            return info
    return None


# ---------------------------------------------------------------- classification records and rules
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
    """

    outcome: Outcome
    message: str
    advice: str
    oom: OomInfo | None = None
    gpu_index_physical: str | None = None
    traceback_tail: str | None = None


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
    Outcome.TIMEOUT: "raise the per-trial timeout or measure fewer steps",
    Outcome.CRASH: "a native crash: rerun the trial alone to reproduce it",
    Outcome.ERROR: "a setup fault or a bug, not a memory limit: see the traceback tail",
}
_LIB_LIMIT_ADVICE = ("batch-size-dependent library limit after smaller batches succeeded: this batch is "
                     "infeasible; no allocator setting helps")


def _rx(*alternatives: str) -> Callable[[str], bool]:
    """A predicate: does any of the (case-sensitive) regular expressions occur in the text?"""
    rx = re.compile("|".join(f"(?:{a})" for a in alternatives), re.S)
    return lambda text: rx.search(text) is not None


is_element_limit = _rx(r"INT_MAX", r"canUse32BitIndexMath", r"32-bit index", r"integer out of range",
                       r"cannot be converted to type int(?:32)? without overflow", r"numel[^\n]*int32",
                       r"more than 2\^31")
is_allocator_oom = _rx(r"\b(?:CUDA|HIP|XPU) out of memory\.", r"would exceed allowed memory",
                       r"preemptively rejected")
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
    if req is not None and cached is not None and cached >= req:
        return Outcome.OOM_FRAGMENTATION, (
            f"fragmentation ({where}): {head}; {format_bytes(cached)} reserved but unallocated >= the "
            f"request ({format_bytes(info.reserved_bytes)} reserved, {format_bytes(info.allocated_bytes)} allocated)")
    if info.source_format == "preemptive" or _fraction_was_limit(info):
        allowed = "" if info.allowed_bytes is None else f"{format_bytes(info.allowed_bytes)} allowed of "
        return Outcome.FRACTION_CAP, (
            f"fraction cap hit ({where}): {head}; {allowed}{format_bytes(info.total_bytes)} total")
    return Outcome.OOM, (f"out of memory ({where}): {head}; {format_bytes(info.allocated_bytes)} allocated, "
                         f"{format_bytes(info.free_bytes)} free of {format_bytes(info.total_bytes)}")


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
    etype = _exception_type(text)
    if is_outside_allocator_oom(text) and not is_allocator_oom(text):
        return Classification(Outcome.OOM_OUTSIDE_ALLOCATOR, f"out of memory outside the caching allocator: {msg}",
                              ADVICE[Outcome.OOM_OUTSIDE_ALLOCATOR])
    if is_allocator_oom(text) or etype.endswith("OutOfMemoryError"):
        info = parse_oom_message(text)
        outcome, line = _oom_classification(text, info)
        physical = _physical(info, visible_devices)
        if physical is not None:
            line += f" (physical GPU {physical})"
        return Classification(outcome, line, ADVICE[outcome], info, physical)
    if is_host_oom(text) or etype == "MemoryError":
        return Classification(Outcome.HOST_OOM, f"host memory: {msg}", ADVICE[Outcome.HOST_OOM])
    if is_cudnn_algorithm(text):
        if _library_limit(smaller_batch_succeeded, batch_size):
            return Classification(Outcome.LIMIT, f"library limit at batch {batch_size}: {msg}", _LIB_LIMIT_ADVICE)
        return Classification(Outcome.ERROR, f"setup fault (no smaller batch succeeded): {msg}", ADVICE[Outcome.ERROR])
    if is_worker_crash(text):
        return Classification(Outcome.CRASH, f"DataLoader worker died: {msg}", ADVICE[Outcome.CRASH])
    return Classification(Outcome.ERROR, msg or "error with no message", ADVICE[Outcome.ERROR])


def _physical(info: OomInfo | None, visible_devices: str | None | object) -> str | None:
    if info is None or info.gpu_index is None:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible_devices is _ENV else visible_devices
    if visible is None:
        return None
    try:
        return map_gpu_index(info.gpu_index, visible)
    except DeviceError:
        return None


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
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible_devices is _ENV else visible_devices
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


# ---------------------------------------------------------------- exceptions and dead processes
_WARNING_RX = re.compile(r"^.*memory allocation failed with OOM on device.*$\n?", re.M)
_RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s?", re.M)
_CHAIN = ("The above exception was the direct cause", "During handling of the above exception")
_TB_HEAD = "Traceback (most recent call last):"


def _drop_warnings(text: str) -> str:
    """Remove torch's LOG(WARNING) "memory allocation failed with OOM" lines (recovered retries)."""
    return _WARNING_RX.sub("", text)


def _tail(text: str, lines: int = TRACEBACK_TAIL_LINES) -> str | None:
    kept = [line for line in text.rstrip().splitlines()][-lines:]
    return "\n".join(kept) if kept else None


def _pick(texts: list[str], **kw) -> Classification | None:
    """Classify a chain of exception texts, outermost last: the outermost specific cause wins (a
    memory/limit outcome over a worker crash, e.g. "killed by signal: Bus error" raised from
    "worker exited unexpectedly"), then a crash, then the outermost error."""
    results = [classify_text(t, **kw) for t in texts if t.strip()]
    for weak in ((Outcome.ERROR, Outcome.CRASH), (Outcome.ERROR,)):
        for result in reversed(results):
            if result.outcome not in weak:
                return result
    return results[-1] if results else None


def classify_exception(exc: BaseException, *, batch_size: int | None = None,
                       smaller_batch_succeeded: bool = False,
                       visible_devices: str | None | object = _ENV) -> Classification:
    """Classify an exception caught inside a trial process (with its ``__cause__``/``__context__`` chain).

    A ``torch.OutOfMemoryError`` (or any subclass, e.g. the virtual GPU's simulated one) is always a
    device-memory outcome; other types are judged by their text only. Never raises.
    """
    chain: list[BaseException] = []
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__
    kw = dict(batch_size=batch_size, smaller_batch_succeeded=smaller_batch_succeeded, visible_devices=visible_devices)
    texts = []
    for e in reversed(chain):  # innermost first, outermost last (as Python prints them)
        names = [c.__name__ for c in type(e).__mro__]
        name = "OutOfMemoryError" if any(n.endswith("OutOfMemoryError") for n in names) else type(e).__name__
        if "MemoryError" in names and name != "OutOfMemoryError":
            name = "MemoryError"
        texts.append(f"{name}: {e}")
    result = _pick(texts, **kw) or classify_text(repr(exc), **kw)
    if result.outcome in (Outcome.ERROR, Outcome.CRASH):
        tail = _tail("".join(_tb.format_exception(exc)))
        result = Classification(result.outcome, result.message, result.advice, result.oom,
                                result.gpu_index_physical, tail)
    return result


def _exception_blocks(stderr: str) -> list[str]:
    """The exception text after each ``Traceback (most recent call last):`` in ``stderr``, in order."""
    lines = _RANK_PREFIX.sub("", stderr).splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if not lines[i].startswith(_TB_HEAD):
            i += 1
            continue
        j = i + 1
        while j < len(lines) and (lines[j][:1] in (" ", "\t") or not lines[j].strip()):
            j += 1
        k = j
        while k < len(lines) and not lines[k].startswith(_TB_HEAD) and not lines[k].startswith(_CHAIN):
            k += 1
        blocks.append("\n".join(lines[j:k]).strip())
        i = k
    return blocks


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def classify_failure(*, returncode: int | None, stderr: str, timed_out: bool = False,
                     batch_size: int | None = None, smaller_batch_succeeded: bool = False,
                     visible_devices: str | None | object = _ENV) -> Classification:
    """Classify a trial process that ended without writing its result record.

    Args:
        returncode: ``Popen.returncode`` (negative N = killed by signal N; 128+N from a shell = signal N);
            None when unknown.
        stderr: the child's stderr (its tail suffices); the last traceback's exception is classified,
            then the exceptions it was raised from.
        timed_out: the runner killed the process group at the wall limit (wins over everything).
        batch_size / smaller_batch_succeeded / visible_devices: as in :func:`classify_text`.

    Returns:
        ``timeout``; the traceback's class when recognised; ``host_oom`` for SIGKILL without a Python
        traceback (the kernel OOM killer, field case C5); ``crash`` for other signals; ``ok`` for exit 0
        without a traceback (the "memory allocation failed with OOM" warning alone never fails a trial;
        the runner judges a missing record itself); else ``error`` with the stderr tail. Never raises.
    """
    stderr = _drop_warnings(stderr or "")
    tail = _tail(stderr)
    if timed_out:
        return Classification(Outcome.TIMEOUT, "trial exceeded its wall-time limit; process group killed",
                              ADVICE[Outcome.TIMEOUT], traceback_tail=tail)
    kw = dict(batch_size=batch_size, smaller_batch_succeeded=smaller_batch_succeeded, visible_devices=visible_devices)
    blocks = _exception_blocks(stderr)
    result = _pick(blocks, **kw) if blocks else None
    if result is not None and result.outcome is not Outcome.ERROR:
        return result
    sig = -returncode if returncode is not None and returncode < 0 else None
    if returncode is not None and 128 < returncode <= 128 + 64:
        sig = returncode - 128
    if sig is not None and not blocks:
        if sig == signal.SIGKILL:
            return Classification(Outcome.HOST_OOM, "killed by SIGKILL with no Python traceback: most likely "
                                  "the host OOM killer", ADVICE[Outcome.HOST_OOM], traceback_tail=tail)
        text_result = classify_text(stderr[-4000:], **kw) if stderr.strip() else None
        if text_result is not None and text_result.outcome is not Outcome.ERROR:
            return text_result  # e.g. SIGABRT after "terminate called ... what(): CUDA out of memory"
        return Classification(Outcome.CRASH, f"killed by {_signal_name(sig)}", ADVICE[Outcome.CRASH],
                              traceback_tail=tail)
    if result is not None:
        return Classification(result.outcome, result.message, result.advice, traceback_tail=_tail(
            stderr[stderr.rfind(_TB_HEAD):] if _TB_HEAD in stderr else stderr))
    if returncode == 0:
        return Classification(Outcome.OK, "exited with status 0", ADVICE[Outcome.OK])
    text_result = classify_text(stderr[-4000:], **kw) if stderr.strip() else None
    if text_result is not None and text_result.outcome is not Outcome.ERROR:
        return text_result
    status = "unknown exit status" if returncode is None else f"exited with status {returncode}"
    return Classification(Outcome.ERROR, f"{status} without a result record", ADVICE[Outcome.ERROR],
                          traceback_tail=tail)
