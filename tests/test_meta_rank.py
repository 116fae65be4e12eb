"""One DDP rank captured on meta (oomtune/workloads/_meta_rank.py) against the same rank captured on
the CPU, the reference: event for event, less the tensors a GPU rank keeps on the host.

A CPU rank's recording counts every storage on the CPU, host tensors included. Three of DDP's are
host tensors on a GPU rank (torch/csrc/distributed/c10d/reducer.cpp): ``control``, the copy of the
broadcast sizes and strides that ``verify_params_across_processes`` reads back, and the host
``indices_tensor`` and ``bucket_sizes_tensor`` that ``Reducer::sync_bucket_indices`` fills before it
copies them to the device (at the first forward after the first backward, when the buckets are
rebuilt). The meta capture leaves them out, as a GPU rank's caching allocator never sees them; the
workload trains with SGD (momentum), which keeps no host tensor of its own (Adam's ``step`` counters
are the other known difference of a CPU rank: tests/test_trial_execute.py).
"""

from __future__ import annotations

import pytest

LM = {"name": "transformer", "layers": 2, "d_model": 64, "heads": 2, "seq_len": 32, "vocab_size": 512,
      "dropout": 0.0, "optimizer": "sgd", "lr": 1e-3, "precision": "fp32", "data": {"source": "synthetic"},
      "parallel": "ddp", "ranks": 2, "target": {"name": "builtin"}}


def _capture(device: str, batch: int):
    from oomtune.capture.reads import recording
    from oomtune.plan.predictor import _capture_on
    from oomtune.workloads.parallel import fake_process_group

    with fake_process_group(2), recording():
        stream, _ = _capture_on(LM, batch, 3, False, (device,), None)
    assert stream.captured_on == device
    return stream


def _events(stream, drop: set[int] = frozenset()) -> list[tuple[str, int, int]]:
    """(action, ordinal of its allocation, bytes) of every event, without the allocations whose
    ordinals are in ``drop`` (and their frees); ordinals counted after the drop (keys differ)."""
    ordinal, out, n = {}, [], 0
    for i, (action, key, size, _stream) in enumerate(stream):
        if action == "alloc":
            if n in drop:
                ordinal[key] = None
            else:
                ordinal[key] = len([v for v in ordinal.values() if v is not None])
            n += 1
        if ordinal[key] is not None:
            out.append((action, ordinal[key], size))
    return out


def _host_allocations(stream, metadata_bytes: int, indices_bytes: int, sizes_bytes: int) -> set[int]:
    """Ordinals of the three host tensors of the module docstring in a CPU capture: the second of
    the two ``metadata_bytes`` allocations after the three 8-byte ones of the parameter count and its
    two all-gather outputs (``control``), and the host one of each (host, device) pair of the bucket
    indices and the bucket sizes (the host tensor is made first)."""
    sizes = [s for a, _k, s, _st in stream if a == "alloc"]
    verify = next(i for i in range(len(sizes)) if sizes[i:i + 5] == [8, 8, 8, metadata_bytes, metadata_bytes])
    sync = next(i for i in range(len(sizes))
                if sizes[i:i + 4] == [indices_bytes, indices_bytes, sizes_bytes, sizes_bytes])
    return {verify + 4, sync, sync + 2}


@pytest.mark.parametrize("batch", [4, 7])
def test_ddp_rank_on_meta_is_the_cpu_rank_less_its_host_tensors(batch):
    import torch

    from oomtune.workloads.models import build_model

    params = list(build_model(LM, torch.device("meta")).module.parameters())
    # sizes and strides of every parameter (int64); the bucket indices of every parameter plus the
    # bucket count, and one size per bucket (int32): one bucket, the parameters' 670,720 bytes being
    # below DDP's first bucket of 1 MiB (dist._DEFAULT_FIRST_BUCKET_BYTES)
    assert sum(p.numel() * 4 for p in params) == 670720
    metadata_bytes = sum(2 * p.dim() for p in params) * 8
    indices_bytes, sizes_bytes = (len(params) + 1) * 4, 1 * 4
    cpu, meta = _capture("cpu", batch), _capture("meta", batch)
    host = _host_allocations(cpu, metadata_bytes, indices_bytes, sizes_bytes)
    assert _events(meta) == _events(cpu, host)
    # and the difference is exactly those three tensors, never a device storage more or less
    assert cpu.n_allocs - meta.n_allocs == 3


def test_ddp_rank_on_meta_makes_the_buckets_of_the_cpu_rank():
    # the buckets DDP allocates in its constructor and rebuilds after the first iteration, and the
    # flat buffer of the parameter broadcast: each 670,720 bytes (every fp32 parameter in one bucket)
    meta = _capture("meta", 4)
    assert [s for a, _k, s, _st in meta if a == "alloc"].count(670720) == 3
