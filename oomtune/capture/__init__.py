"""Recording allocation streams without a GPU, and feeding them live to the simulator.

:class:`StorageRecorder` turns a training step run on ``meta`` or CPU tensors into the stream of
caching-allocator requests a CUDA run would make; :class:`VirtualGPU` feeds that stream to a
``CachingAllocatorSim`` while the step runs, so a simulated OOM is raised inside the step. While
they record, the step runs the kernels a CUDA run of the target GPU would run
(:mod:`oomtune.capture.cuda_kernels`: attention, dropout, norms, activations, losses, mixed
precision, optimizers).

The names are imported lazily: :mod:`oomtune.capture.gpu_target` (the target GPU, read by ``oomtune
plan`` before torch is imported) must not pull torch in through this package.
"""

from __future__ import annotations

from typing import Any

__all__ = ["AllocationSink", "StorageRecorder", "StreamSink", "VirtualGPU", "capture_stream"]

_WHERE = {"AllocationSink": "recorder", "StorageRecorder": "recorder", "StreamSink": "recorder",
          "capture_stream": "recorder", "VirtualGPU": "virtual_gpu"}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'oomtune.capture' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"oomtune.capture.{module}"), name)
