"""One FSDP2 rank captured on meta (oomtune/workloads/_meta_fsdp.py) against the same rank captured
on the CPU, the reference: event for event, stream for stream, less the tensors a GPU rank keeps on
the host.

FSDP2 itself keeps no host tensor: every tensor it makes goes to its mesh's device (the sharded
parameters, the all-gather inputs and outputs, the reduce-scatter buffers). With SGD (momentum) the
two streams are the same. AdamW without ``capturable``/``fused`` keeps its ``step`` counters on the
host (``_init_group``, torch/optim/adam.py: ``torch.tensor(0.0, dtype=_get_scalar_dtype())``, one
4-byte tensor per parameter, made at the first step) and wraps the increment in a host tensor at
every step (``_multi_tensor_adam``: ``torch.tensor(1.0, device="cpu")`` when the steps are on the
CPU, dropped at the end of the call): a CPU rank's recording counts them, a GPU rank's caching
allocator never sees them, and the meta capture leaves them out.
"""

from __future__ import annotations

import pytest

LM = {"name": "transformer", "layers": 2, "d_model": 64, "heads": 2, "seq_len": 32, "vocab_size": 512,
      "dropout": 0.0, "optimizer": "sgd", "lr": 1e-3, "precision": "fp32", "data": {"source": "synthetic"},
      "parallel": "fsdp", "ranks": 2, "target": {"name": "builtin"}}


def _capture(device: str, batch: int, **over):
    from oomtune.capture.reads import recording
    from oomtune.plan.predictor import _capture_on
    from oomtune.workloads.parallel import fake_process_group, meta_rank_scope

    cfg = {**LM, **over}
    with fake_process_group(2), meta_rank_scope(cfg), recording():
        stream, _ = _capture_on(cfg, batch, 3, False, (device,), None)
    assert stream.captured_on == device
    return stream


def _events(stream, drop: set[int] = frozenset()) -> list[tuple[str, int, int, int]]:
    """(action, ordinal of its allocation, bytes, stream) of every event, without the allocations
    whose ordinals are in ``drop`` (and their frees); ordinals counted after the drop."""
    ordinal, out, n, kept = {}, [], 0, 0
    for action, key, size, st in stream:
        if action == "alloc":
            ordinal[key] = None if n in drop else kept
            kept += n not in drop
            n += 1
        if ordinal[key] is not None:
            out.append((action, ordinal[key], size, st))
    return out


@pytest.mark.parametrize("batch", [4, 7])
def test_fsdp_rank_on_meta_is_the_cpu_rank_event_for_event(batch):
    cpu, meta = _capture("cpu", batch), _capture("meta", batch)
    assert _events(meta) == _events(cpu)
    # FSDP2's copy-in and reduce-scatter streams were used and numbered alike on both devices
    assert {st for _a, _k, _s, st in meta} == {st for _a, _k, _s, st in cpu} and len({st for *_x, st in meta}) > 1


def _host_adamw(cpu, meta) -> set[int]:
    """Ordinals of the CPU capture's allocations the meta capture lacks, found by walking both
    streams' allocations in order (an allocation of the CPU's not matched by the meta's next one is
    the CPU's own)."""
    a = [s for act, _k, s, _st in cpu if act == "alloc"]
    b = [s for act, _k, s, _st in meta if act == "alloc"]
    extra, j = set(), 0
    for i, size in enumerate(a):
        if j < len(b) and b[j] == size and (i + 1 >= len(a) or j + 1 >= len(b) or a[i + 1] == b[j + 1]
                                            or size != 4):
            j += 1
        else:
            extra.add(i)
    return extra


def test_fsdp_rank_on_meta_with_adamw_is_the_cpu_rank_less_adamws_host_tensors():
    import torch

    from oomtune.workloads.models import build_model

    params = list(build_model(LM, torch.device("meta")).module.parameters())
    assert len(params) == 29
    cpu, meta = _capture("cpu", 4, optimizer="adamw"), _capture("meta", 4, optimizer="adamw")
    host = _host_adamw(cpu, meta)
    sizes = [s for act, _k, s, _st in cpu if act == "alloc"]
    # 29 step counters and one increment per step (3 steps), each a 4-byte fp32 scalar
    assert len(host) == 29 + 3 and {sizes[i] for i in host} == {4}
    assert cpu.n_allocs - meta.n_allocs == 32
    freed = {k for act, k, _s, _st in cpu if act == "free"}
    keys = [k for act, k, _s, _st in cpu if act == "alloc"]
    assert sum(keys[i] in freed for i in host) == 3       # the increments die; the counters live on
    assert _events(meta) == _events(cpu, host)
    # each counter is made just before its parameter's two moments (exp_avg, exp_avg_sq: the shard's
    # bytes; the token embedding's 512 x 64 fp32 halved by 2 ranks: 65536 bytes)
    first = min(host)
    assert sizes[first + 1:first + 3] == [65536, 65536]


def test_stand_ins_are_scoped_to_the_block():
    import torch
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from oomtune.workloads._meta_fsdp import active, fsdp_on_meta, meta_mesh
    from oomtune.workloads.parallel import fake_process_group

    validate = FSDPParamGroup._validate_no_meta_params
    with fake_process_group(2):
        with pytest.raises(RuntimeError, match="fsdp_on_meta"):
            meta_mesh(2)
        with fsdp_on_meta():
            assert active() and torch.meta.current_device() is None
            assert torch.device("meta", torch.meta.current_device()) == torch.empty(1, device="meta").device
            assert meta_mesh(2).device_type == "meta"
            with fsdp_on_meta():
                assert active()
            assert active() and hasattr(torch, "meta")
    assert not active() and not hasattr(torch, "meta")
    assert FSDPParamGroup._validate_no_meta_params is validate
