"""One recording of a module's forward and backward under ``emulate_cuda`` (the kernel tests of
tests/test_layer_kernels.py and tests/test_norm_kernels.py read the same three figures from it)."""

from __future__ import annotations

import torch

from oomtune.capture.cuda_kernels import emulate_cuda
from oomtune.capture.recorder import StorageRecorder, StreamSink


def step(module, x, device, out_shape):
    """(forward's requested sizes, bytes alive after the forward, backward's requested sizes) for
    ``module(x)`` under emulate_cuda; the gradient of the output (``out_shape``) exists before."""
    params = list(module.parameters()) + list(module.buffers())
    g = torch.ones(out_shape, device=device)
    sink = StreamSink()
    rec = StorageRecorder(sink, device=device)
    rec.register_existing([x, g, *params])
    start, n = sink.live_bytes, len(sink.events)
    with emulate_cuda("a100"), rec:
        y = module(x)
        m, live = len(sink.events), sink.live_bytes - start
        torch.autograd.grad(y, [x, *[p for p in params if p.requires_grad]], g)
    sizes = [[s for a, _, s, _ in part if a == "alloc"] for part in (sink.events[n:m], sink.events[m:])]
    return sizes[0], live, sizes[1]
