"""Device memory outside the caching allocator: the table used when no GPU can be read.

What ``nvidia-smi memory.used`` shows for a training process is the caching allocator's reserved
memory plus memory the allocator never sees: the CUDA context (driver state, the device stack, the
kernel modules loaded into it), the cuBLAS/cuBLASLt and cuDNN handles' own state, NCCL's buffers.
On a real GPU a trial measures it once (``total - free - reserved`` after CUDA init and a cuBLAS
warm-up: :func:`oomtune.trial.budget.non_allocator_bytes`), and that reading wins. Without a device
(``oomtune plan`` on a laptop, :func:`oomtune.predict`) this module gives the estimate, per component,
each with the source of its figure. Nothing here is fitted to a benchmark's rows.

The table (bytes; "-" marks a component with no published figure, counted as 0 and said so in
:attr:`OutsideAllocator.unsourced`):

=========================  ===============  ===================================================
component                  bytes            source
=========================  ===============  ===================================================
CUDA context, lazy         287,047,680      pytorch/pytorch#86509 (measured after CUDA init with
loading (CUDA >= 11.7)                      ``CUDA_MODULE_LOADING=LAZY``, torch's default since
                                            1.13); ptrblck in pytorch/pytorch#107667 ("~300MB")
CUDA context, eager        666,632,192      pytorch/pytorch#86509 (``CUDA_MODULE_LOADING=EAGER``);
loading, or CUDA < 11.7                     ">1000MB" before CUDA 11.7 (pytorch/pytorch#107667)
kernel modules loaded      -                lazy loading loads a kernel's whole module at its
lazily during training                      first launch (CUDA C Programming Guide, "Lazy
                                            Loading"); no published size per torch op
cuBLAS / cuBLASLt handle   -                the workspaces are allocator requests since torch
state                                       2.1 (:mod:`oomtune.capture.blas_workspace`); the
                                            handle's own state and cuBLAS's kernels: no figure
cuDNN handle and kernels   -                loaded at the first convolution; no published figure
                                            for cuDNN 9 under lazy loading
NCCL buffers               -                ``NCCL_BUFFSIZE`` (4 MiB) per channel and peer (NCCL
                                            docs, environment variables); channel count depends
                                            on the topology: not modelled
=========================  ===============  ===================================================

No published measurement separates the context by GPU architecture, so the context figure is the
same for every compute capability; what does depend on it, the cuBLAS workspace size
(``getChosenWorkspaceSize`` in aten/src/ATen/cuda/CublasHandlePool.cpp: 8 MiB + 128 KiB below
sm90, 32 MiB on sm90), is an allocator request and lives in :mod:`oomtune.capture.blas_workspace`.

:data:`CARDS`: the memory torch reports for a card (``cudaDeviceProp::totalGlobalMem``), for
:func:`oomtune.predict`'s ``gpu=`` names.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["CONTEXT_LAZY_BYTES", "CONTEXT_EAGER_BYTES", "OutsideAllocator", "outside_allocator", "CARDS", "Card",
           "card_of"]

#: The CUDA context after init with lazy module loading (pytorch/pytorch#86509).
CONTEXT_LAZY_BYTES = 287_047_680
#: The same with eager module loading (pytorch/pytorch#86509).
CONTEXT_EAGER_BYTES = 666_632_192

_SOURCES = {
    "context_lazy": "CUDA context after init, lazy module loading: 287,047,680 bytes (pytorch/pytorch#86509)",
    "context_eager": "CUDA context after init, eager module loading: 666,632,192 bytes (pytorch/pytorch#86509)",
}
_UNSOURCED = {
    "modules": "kernel modules loaded lazily during training (no published size per torch op)",
    "cublas": "cuBLAS/cuBLASLt handle state and kernels outside the allocator (no published figure)",
    "cudnn": "cuDNN handle and kernels (no published figure for cuDNN 9 under lazy loading)",
    "nccl": "NCCL buffers (NCCL_BUFFSIZE per channel and peer; channels depend on the topology)",
}


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
                      nccl: bool = False, measured_bytes: int | None = None) -> OutsideAllocator:
    """The memory outside the caching allocator of a training process, in bytes.

    Args:
        cuda_major: the CUDA major version torch was built with (11 or 12 for torch 2.x); lazy module
            loading exists from CUDA 11.7 on, so an 11 is taken as eager (conservative).
        lazy_loading: ``CUDA_MODULE_LOADING=LAZY`` (torch sets it unless the user chose otherwise).
        cudnn: the process runs cuDNN (convolutions): the cuDNN part is listed as not counted.
        nccl: the process communicates through NCCL: listed as not counted.
        measured_bytes: a device reading (:func:`oomtune.trial.budget.non_allocator_bytes`); it wins.

    Raises:
        ValueError: a negative reading or a CUDA major below 10.
    """
    if measured_bytes is not None:
        if measured_bytes < 0:
            raise ValueError(f"measured memory outside the allocator {measured_bytes} bytes is negative")
        return OutsideAllocator(measured_bytes, 0, ("measured on the device",), (), True)
    if cuda_major < 10:
        raise ValueError(f"cuda_major={cuda_major}: torch 2.x is built with CUDA 11 or 12")
    lazy = lazy_loading and cuda_major >= 12
    context = CONTEXT_LAZY_BYTES if lazy else CONTEXT_EAGER_BYTES
    source = _SOURCES["context_lazy" if lazy else "context_eager"]
    unsourced = ["modules"] if lazy else []
    unsourced.append("cublas")
    if cudnn:
        unsourced.append("cudnn")
    if nccl:
        unsourced.append("nccl")
    return OutsideAllocator(context, 0, (source,), tuple(_UNSOURCED[k] for k in unsourced))


@dataclass(frozen=True)
class Card:
    """A GPU card: its :data:`oomtune.capture.gpu_target.KNOWN_GPUS` key (compute capability, SMs),
    ``total_memory_bytes`` as torch reports it (``cudaDeviceProp::totalGlobalMem``, below nvidia-smi's
    ``memory.total``) and the source of that figure."""

    name: str
    gpu_key: str
    total_memory_bytes: int
    source: str


#: Cards by name (case, ``-`` and spaces ignored), with torch's total memory.
CARDS: dict[str, Card] = {c.name.lower().replace("-", ""): c for c in (
    Card("A100-SXM4-40GB", "a100", 40_536 << 20,
         "get_device_properties: total_memory=40536MB, 108 SMs (PaddlePaddle's device-properties docstring)"),
    Card("A100-SXM4-80GB", "a100", 81_050 << 20,
         "torch.cuda.get_device_properties: 79.15 GiB (oomtune.device's docstring, A100-80GB)"),
)}


def card_of(name: str) -> Card | None:
    """The :class:`Card` named ``name`` (``A100-SXM4-40GB``, ``NVIDIA A100-SXM4-40GB``), or None."""
    flat = str(name).strip().lower().replace("-", "").replace(" ", "")
    if flat.startswith("nvidia"):
        flat = flat[len("nvidia"):]
    return CARDS.get(flat)
