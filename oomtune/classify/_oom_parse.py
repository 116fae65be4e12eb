"""Parsing torch's device out-of-memory messages into bytes (:func:`parse_oom_message`).

Every format torch has printed: the caching allocator's current one (``DeviceCachingAllocator::malloc``
in c10/cuda/CUDACachingAllocator.cpp, torch >= 2.1), the legacy ``(GPU 0; ... total capacity; ...)``
one of torch 1.x-2.0 (incl. the "capacty" misspelling and torch <= 1.3's "cached"), ``mallocAsync``
(c10/cuda/CUDAMallocAsyncAllocator.cpp), torch 2.14's preemptive rejection by the per-process memory
fraction, and MPS's (aten/src/ATen/mps/MPSAllocator.mm).

Whole kinds, not strings: the current and legacy formats are parsed whatever the
backend's prefix (``CUDA``, ``HIP``, ``XPU``, and out-of-tree backends that copy torch's allocator and
its message: torch_npu's ``NPU out of memory. Tried to allocate ... (NPU 0; ...; ... current active;
...)``, Cambricon's ``CNRT ... (MLU 0; ...)``) and whatever the device word in the parenthesis
(``GPU``, ``NPU``, ``MLU``; intel-extension-for-pytorch's XPU allocator prints ``(GPU 0; T total
capacity; A already allocated; R reserved in total by PyTorch)`` with no free figure).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import ROUND_HALF_EVEN, Decimal

from oomtune.units import GiB, KiB, MiB, TiB

__all__ = ["OomInfo", "parse_oom_message", "SIMULATED_PREFIX"]

#: Prefix of the virtual GPU's simulated OOM messages (the rest is torch's native format).
SIMULATED_PREFIX = "[virtual GPU, simulated] "

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


#: A backend's prefix in the allocator's message: CUDA, HIP, XPU, NPU, CNRT, ... (upper case, a word).
_BACKEND = r"([A-Z][A-Za-z]{1,11})"
#: The device word of the message: GPU, NPU, XPU, MLU, ...
_DEVICE = r"(?:[A-Z]{2,5})"
_CUR_HEAD = _w(_BACKEND + r" out of memory\. Tried to allocate SIZE\. " + _DEVICE + r" (\d+) has a total "
               r"capac(?:i)?ty of SIZE of which SIZE is free\.")
_CUR_SELF = _w(r"Including non-PyTorch memory, this process has SIZE memory in use")
_CUR_PROC = _w(r"Process [^\s.;]+ has SIZE memory in use")  # another process (NVML): pid as printed
_CUR_ALLOWED = _w(r"SIZE allowed;")
_CUR_ALLOC = _w(r"Of the allocated memory SIZE is allocated by PyTorch,")
_CUR_UNALLOC = _w(r"and SIZE is reserved by PyTorch but unallocated")
_LEG_HEAD = _w(_BACKEND + r" out of memory\. Tried to allocate SIZE \(" + _DEVICE + r" (\d+);([^)]*)\)")
_LEG_TOTAL = _w(r"SIZE total capac(?:i)?ty")
_LEG_ALLOC = _w(r"SIZE already allocated")
_LEG_FREE = _w(r"SIZE free")
_LEG_ALLOWED = _w(r"SIZE allowed")
_LEG_RESERVED = _w(r"SIZE reserved in total by PyTorch")
# torch <= 1.3 printed "C cached" where C is cached but not allocated (reserved - allocated): in every
# such report it is smaller than "already allocated", so reserved = A + C.
_LEG_CACHED = _w(r"SIZE cached")
_ASYNC_HEAD = _w(r"Allocation on device (\d+) would exceed allowed memory")
_ASYNC_ALLOC = _w(r"Currently allocated\s*: SIZE")
_ASYNC_REQ = _w(r"Requested\s*: SIZE")
_ASYNC_TOTAL = _w(r"Device limit\s*: SIZE")
_ASYNC_FREE = _w(r"Free \(according to CUDA\)\s*: SIZE")
_ASYNC_LIMIT = _w(r"PyTorch limit \(set by user-supplied memory fraction\)\s*: SIZE")
# MPS (aten/src/ATen/mps/MPSAllocator.mm): "MPS backend out of memory (MPS allocated: A, other
# allocations: O, max allowed: M). Tried to allocate R on private|shared pool." Older releases format
# sizes with their own format_size in "KB"/"MB"/"GB", binary (size / 1073741824.0 -> "GB").
_MPS_SZ = r"(\d+(?:\.\d+)?)\s*(bytes|KB|MB|GB|TB|KiB|MiB|GiB|TiB)\b"
_MPS = re.compile((r"MPS backend out of memory \(MPS allocated: SZ, other allocations: SZ, max allowed: SZ\)\. "
                   r"Tried to allocate SZ on (private|shared) pool").replace(" ", r"\s+").replace("SZ", _MPS_SZ), re.S)
_MPS_SCALE = {"bytes": 1, "KB": KiB, "MB": MiB, "GB": GiB, "TB": TiB, "KiB": KiB, "MiB": MiB, "GiB": GiB, "TiB": TiB}
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
        other_processes_bytes: the sum of "Process P has M memory in use" of the other processes
            (current format, NVML's list; None when none is printed or only one process is listed).
        source_format: "current" | "legacy" | "legacy_cached" | "cudaMallocAsync" | "preemptive" | "mps".
        backend: the message's prefix: "CUDA", "HIP", "XPU", "NPU", "CNRT", "MPS", ...
        pool: MPS only: ``"private"`` or ``"shared"``, the heap the request went to.
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
    other_processes_bytes: int | None = None
    pool: str | None = None

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
    procs = [_bytes(*p) for p in _CUR_PROC.findall(rest)]
    others = sum(procs) if procs and in_use is not None else None
    if in_use is None and len(procs) == 1:
        in_use = procs[0]
    reserved = None if allocated is None or unallocated is None else allocated + unallocated
    return OomInfo(_bytes(m[2], m[3]), int(m[4]), _bytes(m[5], m[6]), _bytes(m[7], m[8]), allocated,
                   reserved, _find(_CUR_ALLOWED, rest), in_use, "current", m[1], others)


def _parse_legacy(text: str) -> OomInfo | None:
    """Format of torch 1.x-2.0: ``(GPU 0; T total capacity; A already allocated; F free; [W allowed; ]
    R reserved in total by PyTorch)``. torch <= 1.3 printed ``C cached`` instead, C being the cached
    memory not allocated (reserved - allocated, always below "already allocated" in the reports), so
    there reserved = A + C and the cache is C itself."""
    m = _LEG_HEAD.search(text)
    if m is None:
        return None
    body = m[5]
    reserved, fmt = _find(_LEG_RESERVED, body), "legacy"
    if reserved is None:
        cached, allocated = _find(_LEG_CACHED, body), _find(_LEG_ALLOC, body)
        reserved = None if cached is None or allocated is None else allocated + cached
        fmt = "legacy_cached"
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


def _parse_mps(text: str) -> OomInfo | None:
    """MPS's message: allocated = "MPS allocated" (the MPS allocator's heaps in use), in use by the
    process = MPS allocated + "other allocations" (Metal's current driver memory), allowed = "max
    allowed" (the high-watermark limit: PYTORCH_MPS_HIGH_WATERMARK_RATIO x the device's recommended
    working set); no free or reserved figure is printed."""
    m = _MPS.search(text)
    if m is None:
        return None
    size = [int((Decimal(m[i]) * _MPS_SCALE[m[i + 1]]).to_integral_value(ROUND_HALF_EVEN)) for i in (1, 3, 5, 7)]
    allocated, other, allowed, requested = size
    return OomInfo(requested, None, None, None, allocated, None, allowed, allocated + other, "mps", "MPS",
                   pool=m[9])


def _parse_preemptive(text: str) -> OomInfo | None:
    m = _PREEMPT.search(text)
    if m is None:
        return None
    return OomInfo(_bytes(m[1], m[2]), None, None, None, None, None, None, None, "preemptive")


def parse_oom_message(text: str) -> OomInfo | None:
    """Parse any torch device-OOM message (current, legacy incl. the "total capacty" misspelling and
    "allowed", any backend prefix and device word in those formats, cudaMallocAsync, 2.14's
    preemptive fraction rejection, MPS) into bytes.

    The virtual GPU's prefix :data:`SIMULATED_PREFIX` may precede the native text. Returns None when
    ``text`` holds no recognised OOM message. Never raises.
    """
    text = text.replace(SIMULATED_PREFIX, "")
    for parse in (_parse_current, _parse_legacy, _parse_async, _parse_preemptive, _parse_mps):
        info = parse(text)
        if info is not None:
            return info
    return None
