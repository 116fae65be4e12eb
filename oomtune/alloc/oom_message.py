"""The native caching allocator's out-of-memory message, built from simulator state.

Reproduces the ``TORCH_CHECK_WITH(OutOfMemoryError, ...)`` at the end of
``DeviceCachingAllocator::malloc`` in c10/cuda/CUDACachingAllocator.cpp, as carried by torch
2.14.1's libc10_cuda.so (checked against its strings: the documentation link now points to
docs.pytorch.org ...#optimizing-memory-usage-with-pytorch-cuda-alloc-conf; older releases link
pytorch.org/docs/stable/notes/cuda.html#environment-variables), and ``c10::format_size``.
Messages from the simulator start with :data:`SIMULATED_PREFIX` so that no one mistakes them for
a device reading.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["SIMULATED_PREFIX", "SimulatedOutOfMemoryError", "format_size", "build_oom_message"]

SIMULATED_PREFIX = "[virtual GPU, simulated] "

_DOC_TIP = (" If reserved but unallocated memory is large try setting"
            " PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation. "
            " See documentation for Memory Management "
            " (https://docs.pytorch.org/docs/stable/notes/cuda.html"
            "#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)")


def format_size(size_bytes: int) -> str:
    """Format a byte count as c10's ``format_size`` does (c10/core/CachingDeviceAllocator.h).

    ``<= 1024`` -> ``"N bytes"``; ``<= 1 MiB`` -> KiB; ``<= 1 GiB`` -> MiB; else GiB; two decimals
    (``std::fixed``, precision 2). Note the inclusive bounds: 1048576 -> "1024.00 KiB".
    """
    size_bytes = int(size_bytes)
    if size_bytes <= 1024:
        return f"{size_bytes} bytes"
    if size_bytes <= 1048576:
        return f"{size_bytes / 1024.0:.2f} KiB"
    if size_bytes <= 1073741824:
        return f"{size_bytes / 1048576.0:.2f} MiB"
    return f"{size_bytes / 1073741824.0:.2f} GiB"


def build_oom_message(*, alloc_size_bytes: int, device_index: int, total_bytes: int,
                      free_bytes: int, allocated_bytes: int, reserved_bytes: int,
                      allowed_bytes: int | None = None, process_bytes: int | None = None,
                      simulated: bool = True) -> str:
    """The native OOM message for the given numbers (all in bytes).

    Args:
        alloc_size_bytes: the segment size that could not be obtained ("Tried to allocate").
        device_index: the GPU index shown ("GPU d").
        total_bytes / free_bytes: the device's total and free memory (``cudaMemGetInfo``).
        allocated_bytes / reserved_bytes: ``allocated_bytes.all.current`` and
            ``reserved_bytes.all.current``.
        allowed_bytes: the per-process fraction limit, or None when no fraction was set.
        process_bytes: this process's device memory (NVML), or None to omit that sentence.
        simulated: prefix :data:`SIMULATED_PREFIX`.
    """
    proc = ("" if process_bytes is None else
            f"Including non-PyTorch memory, this process has {format_size(process_bytes)} memory in use. ")
    allowed = "" if allowed_bytes is None else f"{format_size(allowed_bytes)} allowed; "
    text = (f"CUDA out of memory. Tried to allocate {format_size(alloc_size_bytes)}. GPU "
            f"{device_index} has a total capacity of {format_size(total_bytes)} of which "
            f"{format_size(free_bytes)} is free. {proc}{allowed}Of the allocated memory "
            f"{format_size(allocated_bytes)} is allocated by PyTorch, and "
            f"{format_size(reserved_bytes - allocated_bytes)} is reserved by PyTorch but "
            f"unallocated.{_DOC_TIP}")
    return (SIMULATED_PREFIX + text) if simulated else text


class SimulatedOutOfMemoryError(RuntimeError):
    """A simulated CUDA OOM; a ``torch.OutOfMemoryError`` whenever torch is imported in the process.

    Raised by ``CachingAllocatorSim.malloc`` when the whole retry chain of
    ``DeviceCachingAllocator::malloc`` fails. Code that catches ``torch.OutOfMemoryError`` handles
    it as a real OOM. All sizes are in bytes.

    The allocator layer does not import torch (``oomtune simulate`` replays a snapshot without it,
    to start fast), so the instance's class is chosen when it is made: if ``torch`` is in ``sys.modules``
    the instance is of a subclass of both this class and ``torch.OutOfMemoryError`` (so of
    RuntimeError), same name; otherwise of this class alone (a RuntimeError). Code that can name
    ``torch.OutOfMemoryError`` has imported torch, so it always catches the simulated OOM; catch
    this class to handle it in torch-free code. Pickling keeps the rule on the receiving side.

    Attributes:
        requested_bytes: the segment size that failed (the "Tried to allocate" figure).
        request_size_bytes: the size the caller asked for (before rounding), or None.
        allocated_bytes, reserved_bytes: allocator totals at the failure.
        free_bytes, total_bytes: the simulated device's free and total memory.
        allowed_bytes: the memory-fraction limit, None when no fraction was set.
        device_index: the simulated GPU index.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> SimulatedOutOfMemoryError:
        if cls is SimulatedOutOfMemoryError and "torch" in sys.modules:
            cls = _torch_flavour()
        return super().__new__(cls, *args)

    def __init__(self, message: str = "", *, requested_bytes: int | None = None,
                 request_size_bytes: int | None = None, allocated_bytes: int | None = None,
                 reserved_bytes: int | None = None, free_bytes: int | None = None,
                 total_bytes: int | None = None, allowed_bytes: int | None = None,
                 device_index: int = 0) -> None:
        super().__init__(message)
        self.requested_bytes = requested_bytes
        self.request_size_bytes = request_size_bytes
        self.allocated_bytes = allocated_bytes
        self.reserved_bytes = reserved_bytes
        self.free_bytes = free_bytes
        self.total_bytes = total_bytes
        self.allowed_bytes = allowed_bytes
        self.device_index = device_index

    @property
    def gpu_index(self) -> int:
        """Alias of :attr:`device_index`."""
        return self.device_index

    def __reduce__(self):  # keep the attributes across pickling (trial processes)
        cls = type(self)
        if cls is _FLAVOUR.get("torch"):  # rebuilt by the receiver's rule (torch imported or not)
            cls = SimulatedOutOfMemoryError
        return (_rebuild, (cls, self.args[0] if self.args else "", dict(self.__dict__)))


_FLAVOUR: dict[str, type] = {}


def _torch_flavour() -> type:
    """The subclass of :class:`SimulatedOutOfMemoryError` and ``torch.OutOfMemoryError`` (made once)."""
    flavour = _FLAVOUR.get("torch")
    if flavour is None:
        from torch import OutOfMemoryError  # torch.cuda.OutOfMemoryError, a RuntimeError subclass

        flavour = type("SimulatedOutOfMemoryError", (SimulatedOutOfMemoryError, OutOfMemoryError),
                       {"__module__": __name__, "__doc__": SimulatedOutOfMemoryError.__doc__})
        flavour.__qualname__ = "SimulatedOutOfMemoryError"
        _FLAVOUR["torch"] = flavour
    return flavour


def _rebuild(cls: type, message: str, state: dict) -> SimulatedOutOfMemoryError:
    err = cls(message)
    err.__dict__.update(state)
    return err
