"""One failure classifier for trial processes: exceptions, stderr text and exit status.

Structured after Lightning's ``utilities/memory.py``: small named predicates over the exception text
and a table of rules, tried in order; anything not recognised is ``error`` (never guessed to be an
OOM). Every torch OOM message format is parsed into bytes by :func:`parse_oom_message`.

Rule order (first match wins) and why:

1. ``limit`` for element-count / 32-bit indexing limits (field case C2): these never mention memory and
   no allocator setting helps, so they come before anything memory-like. So do a platform's limits on
   the size of one allocation: MPS's "Invalid buffer size: X GB" and MPSNDArray's
   "total bytes of NDArray > 2**32", intel-extension-for-pytorch's "can NOT allocate memory block with
   size larger than 4GB", and c10's "out of memory. Tried to allocate more than 1EB memory" (raised as
   an OutOfMemoryError, yet no memory would hold it).
2. TensorFlow's memory failures (``ResourceExhaustedError: OOM when allocating tensor``, "failed to
   allocate", "Dst tensor is not initialized"): ``oom`` (``host_oom`` on TF's CPU allocator); PyTorch's
   allocator settings do not apply to TF's allocator, the advice says so.
2b. The caching allocator's OOM (``CUDA out of memory. Tried to allocate``), split by cause:
   ``oom_fragmentation`` when free < the segment torch asked the device for and the request <= free +
   reserved-but-unallocated (:func:`oomtune.classify._rules.segment_and_request`: the printed "Tried
   to allocate" is the segment, ``get_allocation_size`` of the request), "free"
   capped by what the fraction still allows (C3, C8; free memory alone covering the
   segment is not fragmentation), else ``fraction_cap`` when an ``allowed`` figure below the total capacity was
   printed (C4), else ``oom``. Fragmentation wins over the fraction cap: the request fits inside the
   cap and only the layout of the cached blocks stopped it; an allocator setting (expandable_segments
   / max_split_size_mb) fixes it under the same budget, whereas "fraction cap" would send the user to
   raise the budget. torch <= 1.3's "C cached" is reserved - allocated. Any backend
   prefix in torch's formats counts (NPU, XPU, CNRT: out-of-tree allocators copy the message), and
   MPS's "MPS backend out of memory (MPS allocated: ..., max allowed: ...)" is ``oom`` with MPS's own
   advice (its high-watermark limit; CUDA allocator settings do not apply).
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

For a dead process (:func:`classify_failure`), the exceptions of its tracebacks decide first; when
they are not recognised, a memory signal anywhere in stderr counts (e.g. NCCL's
"Cuda failure 'out of memory'" before a generic RuntimeError).

The v2.13 ``LOG(WARNING)`` line "memory allocation failed with OOM on device ..." fires on retries that
later succeed; it is removed from stderr before anything is matched.

Implementation (the public names are re-exported here; import them from :mod:`oomtune.classify`):

- ``_oom_parse``: :func:`parse_oom_message` -> :class:`OomInfo` (every torch OOM message format).
- ``_rules``: :class:`Classification`, the predicates and :func:`classify_text` (one exception text).
- ``_gpu_index``: :func:`map_gpu_index` (CUDA_VISIBLE_DEVICES, field case C10).
- ``_failure``: :func:`classify_exception` (an exception chain) and :func:`classify_failure` (a dead
  process: stderr tracebacks and exit status).
"""

from __future__ import annotations

# ADVICE, TRACEBACK_TAIL_LINES and the is_* predicates are not in __all__ but stay importable from here,
# as they were from the single module.
from oomtune.classify._failure import TRACEBACK_TAIL_LINES, classify_exception, classify_failure
from oomtune.classify._gpu_index import map_gpu_index
from oomtune.classify._oom_parse import SIMULATED_PREFIX, OomInfo, parse_oom_message
from oomtune.classify._rules import (
    ADVICE,
    Classification,
    classify_text,
    is_allocator_oom,
    is_cudnn_algorithm,
    is_element_limit,
    is_host_oom,
    is_outside_allocator_oom,
    is_tensorflow_oom,
    is_worker_crash,
    memory_signal,
)

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
