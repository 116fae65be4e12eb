"""Recording allocation streams without a GPU, and feeding them live to the simulator.

:class:`StorageRecorder` turns a training step run on ``meta`` or CPU tensors into the stream of
caching-allocator requests a CUDA run would make; :class:`VirtualGPU` feeds that stream to a
``CachingAllocatorSim`` while the step runs, so a simulated OOM is raised inside the step.
"""

from oomtune.capture.recorder import AllocationSink, StorageRecorder, StreamSink, capture_stream
from oomtune.capture.virtual_gpu import VirtualGPU

__all__ = ["AllocationSink", "StorageRecorder", "StreamSink", "VirtualGPU", "capture_stream"]
