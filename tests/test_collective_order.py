"""Collectives under a recording: a storage dies where the program drops it, not where a
communication thread lets go of it (oomtune/capture/collectives.py).

Why: gloo's worker thread keeps a completed work, and the tensors it was given, until it comes round
its loop (ProcessGroupGloo::runLoop); when the rank's thread dropped its own reference first, the
release reached the virtual GPU whenever that thread ran, and a DDP search answered batch 7 at
6.00 MiB in one trial and 8.00 MiB in its confirmation. On CUDA, ProcessGroupNCCL releases on the
calling thread (its stash is cleared by Work::wait), so the release is in program order.

The backend below stands in for a worker that is late without limit: it keeps every tensor it was
given for ever. Without the aliasing, the recorded tensor could never be released.
"""

from __future__ import annotations

import os
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as C10dBackend
from torch._C._distributed_c10d import _create_work_from_future

from oomtune.capture import StorageRecorder, StreamSink
from oomtune.capture.collectives import COLLECTIVES


class _Keeping(C10dBackend):
    """A one-rank backend that multiplies by 2 as its all-reduce, broadcasts as a no-op, and keeps
    every tensor list it was given (a communication thread that never lets go)."""

    def __init__(self) -> None:
        super().__init__(0, 1)
        self.kept: list[list[torch.Tensor]] = []

    def _done(self, tensors: list[torch.Tensor]):  # noqa: ANN202
        self.kept.append(tensors)
        future = torch.futures.Future()
        future.set_result(tensors)
        return _create_work_from_future(future)

    def allreduce(self, tensors, opts=None):  # noqa: ANN001, ANN201
        for t in tensors:
            t.mul_(2)
        return self._done(tensors)

    def broadcast(self, tensors, opts=None):  # noqa: ANN001, ANN201
        return self._done(tensors)

    def getBackendName(self) -> str:  # noqa: N802 - c10d's name
        return "keeping"


def _group() -> tuple[dist.ProcessGroup, _Keeping]:
    backend = _Keeping()
    pg = dist.ProcessGroup(dist.HashStore(), 0, 1)
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.CUSTOM, backend)
    pg._set_default_backend(dist.ProcessGroup.BackendType.CUSTOM)
    return pg, backend


def test_a_tensor_the_backend_keeps_is_released_where_the_program_drops_it():
    pg, backend = _group()
    sink = StreamSink()
    with StorageRecorder(sink) as rec:
        x = torch.ones(256)                      # 1,024 bytes: one request
        ptr = x.data_ptr()
        work = pg.allreduce([x])
        work.wait()
        returned = work.get_future().value()[0]
        assert returned is x                     # the caller's own tensor comes back, not an alias
        del returned, work
        del x
        assert rec.live_bytes == 0               # released here, on this thread
    assert [(e[0], e[2]) for e in sink.events] == [("alloc", 1024), ("free", 1024)]
    kept = backend.kept[0][0]
    assert kept.data_ptr() == ptr                # the backend worked on the same memory ...
    assert kept.untyped_storage().nbytes() == 1024


def test_the_backend_reduces_the_callers_memory_and_the_result_is_kept_by_the_work():
    pg, _ = _group()
    sink = StreamSink()
    with StorageRecorder(sink) as rec:
        x = torch.full((4,), 3.0)
        work = pg.allreduce([x])
        work.wait()
        assert x.tolist() == [6.0, 6.0, 6.0, 6.0]   # _Keeping doubles: it wrote through the alias
        del x
        # as with NCCL, a work still held keeps its tensors (its future's value) alive
        assert rec.live_bytes == 16
        del work
        assert rec.live_bytes == 0


def test_every_collective_schema_of_this_torch_is_known():
    """COLLECTIVES names torch's c10d ops; a renamed op would silently lose the ordering."""
    names = {str(s.name).split("::")[1] for s in torch._C._jit_get_all_schemas() if str(s.name).startswith("c10d::")}
    assert COLLECTIVES <= names
    # the ones left out are point to point or no collective (see the module's docstring)
    assert names - COLLECTIVES <= {"send", "recv_", "recv_any_source_", "check_for_nan", "monitored_barrier_"}


def _gloo_rank(rank: int, store: str, out: str) -> None:
    """One of the two gloo ranks both tests below read: the reduce-scatter first (right after the group
    is made, the rank's first collective), then the DDP steps, each under a recording of its own (a
    recorder reports only the storages it saw allocated), each rank's findings written to
    ``{out}.reduce_scatter.{rank}`` and ``{out}.ddp.{rank}``. One pair of processes for both, from one
    spawned interpreter (:func:`_two_gloo_ranks`): a rank's ``import torch`` costs seconds of CPU, more
    than its collectives."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    _reduce_scatter_rank(rank, f"{out}.reduce_scatter")
    _ddp_rank(rank, f"{out}.ddp")
    dist.destroy_process_group()


def _two_gloo_ranks(index: int, store: str, out: str) -> None:
    """Both ranks of :func:`_gloo_rank` from one spawned interpreter: it forks rank 1 before any torch
    operation (modules imported, nothing run: as oomtune's own fork server forks its trials) and runs
    rank 0 itself. Two processes, each its own gloo rank with its own threads, paying the imports once instead
    of twice (seconds of CPU each, more than the collectives); rank 1's failure is rank 0's (its exit
    status is checked)."""
    import traceback

    # A recording's first operation imports torch._dynamo (torch/_compile.py: the dispatch mode's
    # ``_disable_dynamo`` wrapper imports it at its first call; sympy and more, seconds of CPU): imported
    # here, once, for both ranks. A module import only: no rank has recorded or run anything yet.
    import torch._dynamo  # noqa: F401

    pid = os.fork()
    if pid == 0:                                 # rank 1: never back into the spawn machinery
        code = 1
        try:
            _gloo_rank(1, store, out)
            code = 0
        except BaseException:  # noqa: BLE001 - reported, then the exit status says it
            traceback.print_exc()
        finally:
            os._exit(code)
    try:
        _gloo_rank(0, store, out)
    finally:
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"rank 1 exited with status {status}"


@pytest.fixture(scope="module")
def gloo_ranks(tmp_path_factory):
    """The folder where the two ranks of :func:`_gloo_rank` wrote their findings (``out.*``)."""
    import torch.multiprocessing as mp

    folder = tmp_path_factory.mktemp("gloo")
    mp.start_processes(_two_gloo_ranks, args=(str(folder / "store"), str(folder / "out")), nprocs=1,
                       start_method="spawn")
    return folder


def _ddp_rank(rank: int, out: str) -> None:
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4))
    sink = StreamSink()
    frees_on: set[int] = set()
    on_free = sink.on_free

    def note(key: int) -> None:
        frees_on.add(threading.get_ident())
        on_free(key)

    sink.on_free = note
    with StorageRecorder(sink):
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        for _ in range(3):                       # the buckets are rebuilt after the first
            ddp(torch.randn(8, 16)).sum().backward()
    grad = model[0].weight.grad.sum().item()
    with open(f"{out}.{rank}", "w") as f:
        f.write(f"{grad!r} {sorted(frees_on) == [threading.get_ident()]}")
    # Teardown: DDP holds the process group and its last works; with it alive, gloo's worker threads can
    # outlive destroy_process_group and abort the rank at exit ("terminate called without an active
    # exception", SIGABRT: seen once in a loaded suite run; pytorch/pytorch#179291 describes the crash).
    # Both ranks past their last collective, then nothing left to hold the group (destroyed by the caller).
    del ddp
    dist.barrier()


@pytest.mark.slow
def test_ddp_over_gloo_under_a_recording_syncs_gradients_and_releases_on_the_ranks_thread(gloo_ranks):
    lines = [(gloo_ranks / f"out.ddp.{r}").read_text().split() for r in range(2)]
    assert lines[0][0] == lines[1][0]            # the all-reduce ran: both ranks hold the same gradient
    assert all(flag == "True" for _, flag in lines)


def _reduce_scatter_rank(rank: int, out: str) -> None:
    sink = StreamSink()
    with StorageRecorder(sink):
        full = torch.full((6,), float(rank + 1))   # 24 bytes
        shard = torch.empty(3)                     # 12 bytes
        dist.reduce_scatter_tensor(shard, full)
        value = shard.tolist()
    with open(f"{out}.{rank}", "w") as f:
        f.write(repr(([(e[0], e[2]) for e in sink.events], value)))


@pytest.mark.slow
def test_gloos_reduce_scatter_buffer_is_not_recorded(gloo_ranks):
    """gloo's reduce-scatter reduces into a buffer of its own and copies the rank's part out when
    waited on; a CUDA reduce-scatter (NCCL) writes the output directly. Only the program's two
    tensors are requests: 24 + 12 bytes."""
    import ast

    for rank in range(2):
        events, value = ast.literal_eval((gloo_ranks / f"out.reduce_scatter.{rank}").read_text())
        assert events == [("alloc", 24), ("alloc", 12)]
        assert value == [3.0, 3.0, 3.0]          # 1 + 2, each rank's three elements
