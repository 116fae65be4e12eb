"""Device memory outside the caching allocator: the table used when no GPU can be read.

What ``nvidia-smi memory.used`` shows for a training process is the caching allocator's reserved
memory plus memory the allocator never sees: the CUDA context (driver state, the device stack, the
kernel modules loaded into it), the cuBLAS/cuBLASLt and cuDNN handles' own state, NCCL's buffers.
On a real GPU a trial measures it once (``total - free - reserved`` after CUDA init and a cuBLAS
warm-up: :func:`oomtune.trial.budget.non_allocator_bytes`), and that reading wins. Without a device
(``oomtune plan`` on a laptop, :func:`oomtune.predict`) this module gives the estimate, per component,
each with the source of its figure. Nothing here is fitted to a benchmark's rows.

The table (:data:`TABLE`; bytes; "-" marks a component with no published figure, counted as 0 and
said so in :attr:`OutsideAllocator.unsourced`; "0" a component that is sourced and lies inside the
allocator, so counting it here would count it twice):

=====================  ==============  ===============  ============================================
component              stack           bytes            source
=====================  ==============  ===============  ============================================
CUDA context, lazy     CUDA 11-12,     266,076,160      pull request pytorch/pytorch#86509 (torch
loading                any GPU (the                     1.13, CUDA 11.7; the GPU is not stated):
                       source names                     ``total - free`` = 287,047,680 bytes with
                       none)                            ``CUDA_MODULE_LOADING=LAZY`` after one
                                                        6,400,000-byte tensor, less that tensor's
                                                        20 MiB segment (a request between 1 MiB and
                                                        10 MiB gets a ``kLargeBuffer`` segment,
                                                        CUDACachingAllocator.cpp). Bracketed by
                                                        ptrblck's "~300MB" (pytorch/pytorch#107667)
                                                        and "around 400MB" (pytorch/pytorch#109888)
CUDA context, lazy     CUDA 13,        446,693,376      unslothai/unsloth-zoo pull request #1053:
loading                sm89 (also                       ``nvidia-smi`` 426 MiB for a process whose
                       used for other                   only CUDA call is ``torch.cuda.mem_get_info``
                       GPUs on CUDA                     (torch 2.10.0+cu130, RTX 6000 Ada, torch
                       13: no other                     allocated/reserved 0 / 0): 426 x 2^20
                       figure)
CUDA context, eager    CUDA 11-12,     645,660,672      pytorch/pytorch#86509 with
loading                any GPU                          ``CUDA_MODULE_LOADING=DEFAULT``: 666,632,192
                                                        bytes less the 20 MiB segment
CUDA context, eager    CUDA 11 (before 1,406,140,416    Hugging Face transformers docs, "Model
loading                11.7), sm70                      training anatomy": NVML ``used`` 1343 MiB
                       (V100)                           (``info.used // 1024**2``, driver 460.91,
                                                        Tesla V100-SXM2-16GB) after
                                                        ``torch.ones((1, 1)).to("cuda")``, less that
                                                        tensor's 2 MiB small-pool segment: 1341 MiB
cuBLAS workspace       torch >= 2.1    0 (allocator)    ``getCurrentCUDABlasHandle`` takes it from
                                                        the caching allocator
                                                        (aten/src/ATen/cuda/CublasHandlePool.cpp;
                                                        the 8,519,680 bytes ``memory_allocated``
                                                        shows in pytorch/pytorch#95668):
                                                        :mod:`oomtune.capture.blas_workspace`
cuBLASLt workspace     torch >= 2.1    0 (allocator)    aten/src/ATen/cuda/CUDABlas.cpp: per call
                                                        ``CUDACachingAllocator::get()->allocate(
                                                        workspaceSize)`` (torch 2.4-2.5), later a
                                                        per-(handle, stream) allocator block or the
                                                        cuBLAS workspace itself
                                                        (``getCUDABlasLtWorkspaceSize``)
kernel modules loaded  any             -                lazy loading loads a module at the first
lazily in training                                      use of one of its kernels (CUDA C
                                                        Programming Guide, "Lazy Loading"); no
                                                        published size per torch op or library
cuBLAS / cuBLASLt      any             -                ``cublasCreate``/``cublasLtCreate``: no
handle state, kernels                                   published size
cuDNN handle, kernels  any             -                loaded at the first convolution; no
                                                        published figure for cuDNN 9 under lazy
                                                        loading
NCCL buffers           distributed     -                ``NCCL_BUFFSIZE`` (4 MiB) per channel and
                                                        peer (NCCL docs, environment variables); the
                                                        channel count depends on the topology
=====================  ==============  ===============  ============================================

Choosing a context row: the rows for the CUDA major and loading mode; among them the one measured
on the card's compute capability, else one whose source names no GPU, else the other GPU's (said
in the source line). CUDA 11 with lazy loading is taken as eager: lazy loading needs CUDA 11.7 and a
driver that supports it (CUDA C Programming Guide, "Lazy Loading"), which the major alone does not
tell (conservative). The GPUMemNet A100 rows (torch 2.4-2.5, CUDA 12) show about 1.4 GiB outside the
allocator for MLPs: the uncounted rows above, which no source sizes, hold the rest (docs/limits.md).

The cuBLAS workspace size follows the GPU (``getChosenWorkspaceSize``: 8 MiB + 128 KiB below sm90,
32 MiB on sm90 and later): an allocator request, in :mod:`oomtune.capture.blas_workspace`.

Device readings are kept (:func:`remember_measured`, by the trial process after its warm-up steps)
per (GPU name, driver version, torch version) in ``outside_allocator.json`` beside the stream cache
(``$OOMTUNE_CACHE_DIR``, else ``$XDG_CACHE_HOME/oomtune``; ``OOMTUNE_CACHE_DIR=off``: not kept), so
that a later ``oomtune plan`` for the same device reads the measured figure
(:func:`read_measured`) instead of the table.

:data:`CARDS`: the device catalogue's cards with the memory torch reports (``cudaDeviceProp::totalGlobalMem``),
for :func:`oomtune.predict`'s ``gpu=`` names; every catalogue card's ``outside_allocator_bytes`` is
the CUDA 12 lazy-loading row (:data:`CONTEXT_LAZY_BYTES`: no CUDA 12 source names an architecture).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["CONTEXT_LAZY_BYTES", "CONTEXT_EAGER_BYTES", "CONTEXT_LAZY_CUDA13_SM89_BYTES",
           "CONTEXT_EAGER_SM70_CUDA11_BYTES", "ContextFigure", "TABLE", "OutsideAllocator", "outside_allocator",
           "CARDS", "Card", "card_of", "readings_path", "read_measured", "remember_measured"]

#: The 20 MiB segment of the one tensor behind pytorch/pytorch#86509's readings (``kLargeBuffer``).
_PR_86509_SEGMENT_BYTES = 20 << 20
#: The CUDA context with lazy module loading: 287,047,680 bytes read in pytorch/pytorch#86509, less
#: the allocator's segment of its one tensor.
CONTEXT_LAZY_BYTES = 287_047_680 - _PR_86509_SEGMENT_BYTES
#: The same with eager module loading: 666,632,192 bytes (pytorch/pytorch#86509) less that segment.
CONTEXT_EAGER_BYTES = 666_632_192 - _PR_86509_SEGMENT_BYTES
#: CUDA 13, lazy loading, RTX 6000 Ada (sm89): nvidia-smi's 426 MiB for a process with no allocator
#: memory (unslothai/unsloth-zoo pull request #1053, torch 2.10.0+cu130).
CONTEXT_LAZY_CUDA13_SM89_BYTES = 426 << 20
#: CUDA 11 before 11.7 (eager), Tesla V100 (sm70): NVML ``used`` 1343 MiB after a 1 x 1 tensor (Hugging
#: Face transformers docs, "Model training anatomy"), less that tensor's 2 MiB small-pool segment.
CONTEXT_EAGER_SM70_CUDA11_BYTES = (1343 - 2) << 20


@dataclass(frozen=True)
class ContextFigure:
    """One published figure of the CUDA context (bytes), with the stack it was read on.

    ``cuda_majors``: the CUDA majors it stands for; ``lazy``: the module loading mode;
    ``capability``: the GPU's compute capability when the source names the GPU, else None;
    ``source``: where the figure comes from and how it was derived."""

    bytes: int
    cuda_majors: tuple[int, ...]
    lazy: bool
    capability: tuple[int, int] | None
    source: str


#: The context rows of the module docstring's table.
TABLE: tuple[ContextFigure, ...] = (
    ContextFigure(CONTEXT_LAZY_BYTES, (11, 12), True, None,
                  "CUDA context, lazy module loading: 266,076,160 bytes (pytorch/pytorch#86509's 287,047,680 "
                  "less its tensor's 20 MiB segment; torch 1.13, CUDA 11.7, GPU not stated)"),
    ContextFigure(CONTEXT_LAZY_CUDA13_SM89_BYTES, (13,), True, (8, 9),
                  "CUDA context, lazy module loading, CUDA 13: 446,693,376 bytes (unslothai/unsloth-zoo#1053: "
                  "nvidia-smi 426 MiB, torch 2.10.0+cu130, RTX 6000 Ada sm89, no allocator memory)"),
    ContextFigure(CONTEXT_EAGER_BYTES, (11, 12), False, None,
                  "CUDA context, eager module loading: 645,660,672 bytes (pytorch/pytorch#86509's 666,632,192 "
                  "less its tensor's 20 MiB segment)"),
    ContextFigure(CONTEXT_EAGER_SM70_CUDA11_BYTES, (11,), False, (7, 0),
                  "CUDA context, eager module loading, V100: 1,406,140,416 bytes (Hugging Face transformers docs, "
                  "'Model training anatomy': NVML 1343 MiB after a 1 x 1 tensor, less its 2 MiB segment)"),
)

_UNSOURCED = {
    "modules": "kernel modules loaded lazily during training (no published size per torch op)",
    "cublas": "cuBLAS/cuBLASLt handle state and kernels outside the allocator (no published figure; their "
              "workspaces are allocator requests)",
    "cudnn": "cuDNN handle and kernels (no published figure for cuDNN 9 under lazy loading)",
    "nccl": "NCCL buffers (NCCL_BUFFSIZE per channel and peer; channels depend on the topology)",
}


def _context_row(cuda_major: int, lazy: bool, capability: tuple[int, int] | None) -> ContextFigure:
    """The context row for the stack (module docstring: "Choosing a context row")."""
    rows = [r for r in TABLE if cuda_major in r.cuda_majors and r.lazy == lazy]
    if not rows:   # a CUDA major without a row of this mode: the nearest major's row of the mode
        same_mode = [r for r in TABLE if r.lazy == lazy]
        nearest = min(same_mode, key=lambda r: min(abs(m - cuda_major) for m in r.cuda_majors))
        rows = [nearest]
    for pick in (lambda r: capability is not None and r.capability == capability,
                 lambda r: r.capability is None, lambda r: True):
        chosen = [r for r in rows if pick(r)]
        if chosen:
            return chosen[0]
    raise AssertionError("unreachable: rows is not empty")


@dataclass(frozen=True)
class OutsideAllocator:
    """Device memory outside the caching allocator, in bytes, by component.

    ``context_bytes``: the CUDA context; ``libraries_bytes``: cuBLAS, cuDNN, NCCL beyond the context
    (0 where no figure is published); ``sources``: one line per figure used; ``unsourced``: the
    components counted as 0 for want of a figure (the estimate is a lower bound when this is not
    empty); ``measured``: True when the figure is a device reading, not the table."""

    context_bytes: int
    libraries_bytes: int = 0
    sources: tuple[str, ...] = ()
    unsourced: tuple[str, ...] = field(default=())
    measured: bool = False

    @property
    def total_bytes(self) -> int:
        """``context_bytes + libraries_bytes``."""
        return self.context_bytes + self.libraries_bytes

    def describe(self) -> str:
        """One line: the total in MiB and where it came from."""
        mib = self.total_bytes / (1 << 20)
        if self.measured:
            return f"{mib:.0f} MiB outside the allocator (measured on the device)"
        gap = f"; not counted: {', '.join(self.unsourced)}" if self.unsourced else ""
        return f"{mib:.0f} MiB outside the allocator (table, no device reading: {'; '.join(self.sources)}{gap})"


def outside_allocator(*, cuda_major: int = 12, lazy_loading: bool = True, cudnn: bool = False,
                      nccl: bool = False, capability: tuple[int, int] | None = None,
                      measured_bytes: int | None = None) -> OutsideAllocator:
    """The memory outside the caching allocator of a training process, in bytes (the module
    docstring's table).

    Args:
        cuda_major: the CUDA major version torch was built with (11, 12 or 13); lazy module loading
            exists from CUDA 11.7 on, so an 11 is taken as eager (conservative).
        lazy_loading: ``CUDA_MODULE_LOADING=LAZY`` (torch sets it unless the user chose otherwise).
        cudnn: the process runs cuDNN (convolutions): the cuDNN part is listed as not counted.
        nccl: the process communicates through NCCL: listed as not counted.
        capability: the GPU's compute capability ``(major, minor)``: a context row measured on it is
            preferred; None: the row whose source names no GPU.
        measured_bytes: a device reading (:func:`oomtune.trial.budget.non_allocator_bytes`); it wins.

    Raises:
        ValueError: a negative reading or a CUDA major below 10.
    """
    if measured_bytes is not None:
        if measured_bytes < 0:
            raise ValueError(f"measured memory outside the allocator {measured_bytes} bytes is negative")
        return OutsideAllocator(measured_bytes, 0, ("measured on the device",), (), True)
    if cuda_major < 10:
        raise ValueError(f"cuda_major={cuda_major}: torch 2.x is built with CUDA 11, 12 or 13")
    lazy = lazy_loading and cuda_major >= 12
    row = _context_row(cuda_major, lazy, capability)
    unsourced = ["modules"] if lazy else []
    unsourced.append("cublas")
    if cudnn:
        unsourced.append("cudnn")
    if nccl:
        unsourced.append("nccl")
    return OutsideAllocator(row.bytes, 0, (row.source,), tuple(_UNSOURCED[k] for k in unsourced))


from oomtune.gpu.catalogue import Card  # noqa: E402 - the card record lives in the device catalogue


def _cards() -> dict[str, Card]:
    from oomtune.gpu.catalogue import catalogue

    return {c.display_name.lower().replace("-", "").replace(" ", ""): c for c in catalogue().values()
            if c.total_memory_bytes is not None}


#: Cards with a memory figure by display name (case, ``-`` and spaces ignored), from the device
#: catalogue (``conf/devices/``, :mod:`oomtune.gpu.catalogue`: the one source).
CARDS: dict[str, Card] = _cards()


def card_of(name: str) -> Card | None:
    """The catalogue card named ``name`` (``A100-SXM4-40GB``, ``NVIDIA A100-SXM4-40GB``, ``a100-40gb``)
    that has a memory figure, or None (:func:`oomtune.gpu.catalogue.card_named`)."""
    from oomtune.gpu.catalogue import card_named

    card = card_named(name)
    return card if card is not None and card.total_memory_bytes is not None else None


_OFF = {"off", "0", "none", "false", "no"}


def readings_path() -> Path | None:
    """Where device readings are kept: ``$OOMTUNE_CACHE_DIR/outside_allocator.json``, else
    ``$XDG_CACHE_HOME/oomtune/outside_allocator.json`` (``~/.cache`` when unset or relative); None
    when ``OOMTUNE_CACHE_DIR`` is ``off`` (the stream cache's switch, :mod:`oomtune.plan.stream_cache`)."""
    where = os.environ.get("OOMTUNE_CACHE_DIR", "").strip()
    if where.lower() in _OFF and where:
        return None
    if where:
        return Path(where).expanduser().absolute() / "outside_allocator.json"
    base = os.environ.get("XDG_CACHE_HOME", "").strip()
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "oomtune" / "outside_allocator.json"


def _key(gpu_name: str, driver_version: str | None, torch_version: str | None) -> str:
    return f"{gpu_name} | driver {driver_version or '?'} | torch {torch_version or '?'}"


def _load(path: Path) -> dict[str, int]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {k: int(v) for k, v in data.items() if isinstance(v, int) and v >= 0} if isinstance(data, dict) else {}


def read_measured(gpu_name: str, driver_version: str | None, torch_version: str | None) -> int | None:
    """The memory outside the allocator measured on this (GPU, driver, torch), in bytes; None when
    none was kept (or the file cannot be read: the table is used then)."""
    path = readings_path()
    return None if path is None else _load(path).get(_key(gpu_name, driver_version, torch_version))


def remember_measured(gpu_name: str, driver_version: str | None, torch_version: str | None,
                      measured_bytes: int) -> None:
    """Keep a device reading (bytes): the larger of it and the one kept for the same (GPU, driver,
    torch), written atomically (a temporary file renamed). A cache that cannot be written is skipped
    silently: the reading is only an aid to later plans.

    Raises:
        ValueError: a negative reading.
    """
    if measured_bytes < 0:
        raise ValueError(f"measured memory outside the allocator {measured_bytes} bytes is negative")
    path = readings_path()
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _load(path)
        key = _key(gpu_name, driver_version, torch_version)
        if data.get(key, -1) >= measured_bytes:
            return
        data[key] = int(measured_bytes)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".outside-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        return
