"""Which stream an allocation made on the CPU stands for.

The CUDA caching allocator keeps its blocks per stream: a request is served from the pool of the
stream current on the calling thread (``getCurrentCUDAStream()`` in ``NativeCachingAllocator::
malloc``, c10/cuda/CUDACachingAllocator.cpp), and a block freed by a tensor goes back to the pool
of the stream it was allocated on. Device-agnostic code selects streams through
``torch.get_device_module(device).stream(s)``; on the CPU that is ``torch.cpu.stream``, whose
``current_stream()`` returns the ``torch.cpu.Stream`` object selected (torch/cpu/__init__.py: the
object only, no execution). FSDP2 is such code: it allocates its all-gather buffers inside its
all-gather copy-in stream and its reduce-scatter outputs inside its reduce-scatter stream
(``FSDPCommContext.lazy_init``, torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py). Giving
every CPU stream object its own number lets the virtual GPU keep the per-stream pools a CUDA run
would have. Code that never selects a CPU stream allocates on stream 0 only, as before.
"""

from __future__ import annotations

from typing import Any

__all__ = ["StreamNumbers"]


def _default_cpu_stream() -> Any:
    import torch

    return getattr(torch.cpu, "_default_cpu_stream", None)


class StreamNumbers:
    """Numbers the CPU streams selected while recording: the default stream is ``base``; every other
    ``torch.cpu.Stream`` gets ``base + 1``, ``base + 2``, ... in the order it is first current (per
    instance, so two recordings of the same program number their streams alike). Holds a reference
    to each numbered stream, so its ``id`` is never reused."""

    def __init__(self, base: int = 0) -> None:
        self.base = base
        self._default = _default_cpu_stream()
        self._numbers: dict[int, int] = {}
        self._streams: list[Any] = []

    def current(self) -> int:
        """The number of the CPU stream current now (``torch.cpu.current_stream()``)."""
        import torch

        stream = torch.cpu.current_stream()
        if stream is self._default or stream is None:
            return self.base
        number = self._numbers.get(id(stream))
        if number is None:
            self._streams.append(stream)
            number = self._numbers[id(stream)] = self.base + len(self._streams)
        return number

    @property
    def used(self) -> int:
        """Streams other than the default one seen so far."""
        return len(self._streams)
