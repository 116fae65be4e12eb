"""The plan's work spread over forked processes: the same results as one process.

Expected values: hand-computed for fork_map and the replay groups; for whole plans, the reference is
the plan computed in one process capturing every batch size (no derivation, no workers).
"""

from __future__ import annotations

import os

import pytest

from oomtune.alloc.stream import AllocationStream
from oomtune.plan import predictor as P
from oomtune.plan._spread import replay_groups
from oomtune.plan.feasibility import build_plan, grid_batches
from oomtune.plan.parallel import default_workers, fork_map
from oomtune.workload_spec import WorkloadSpec

needs_fork = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs the fork start method")
GEOMETRY = {"total_memory_bytes": 1 << 30, "memory_fraction": 1.0}
RESNET = {"name": "resnet", "depth": 18, "image_size": 32, "num_classes": 10, "optimizer": "sgd"}


def _stream(b: int) -> AllocationStream:
    """weight 4096, activation b * 3000 + 512 (freed), gradient 4096."""
    return AllocationStream([("alloc", 1, 4096), ("alloc", 2, b * 3000 + 512), ("free", 2), ("alloc", 3, 4096)])


# -- fork_map ----------------------------------------------------------------------------------------
def _two_processes():
    """A barrier that the first two items pass only together: taken by two different processes."""
    import multiprocessing

    return multiprocessing.get_context("fork").Barrier(2, timeout=120)


@needs_fork
def test_fork_map_keeps_the_order_and_uses_a_child():
    offset = 1000  # a closure: fn reaches the child by inheritance, not by pickling
    barrier = _two_processes()

    def work(x):
        if x < 2:
            barrier.wait()
        return x * x + offset, os.getpid()

    got = fork_map(work, list(range(7)), 2)
    assert [v for v, _ in got] == [1000, 1001, 1004, 1009, 1016, 1025, 1036]
    assert len({pid for _, pid in got}) == 2 and os.getpid() in {pid for _, pid in got}


@needs_fork
def test_fork_map_reports_every_result_once():
    barrier = _two_processes()
    seen = []

    def work(x):
        if x < 2:
            barrier.wait()
        return 10 * x

    assert fork_map(work, [0, 1, 2, 3], 2, on_result=lambda i, r: seen.append((i, r))) == [0, 10, 20, 30]
    assert sorted(seen) == [(0, 0), (1, 10), (2, 20), (3, 30)]


def test_fork_map_with_one_worker_runs_here_in_order():
    seen = []
    got = fork_map(lambda x: (x + 1, os.getpid()), [1, 2, 3], 1, on_result=lambda i, r: seen.append(i))
    assert got == [(2, os.getpid()), (3, os.getpid()), (4, os.getpid())] and seen == [0, 1, 2]


@needs_fork
def test_fork_map_raises_the_exception_of_the_first_failing_item():
    from oomtune.exceptions import ConfigError

    barrier = _two_processes()

    def work(x):
        if x < 2:
            barrier.wait()
        if x in (1, 3):
            raise ConfigError(f"batch {x} is bad")
        return x

    with pytest.raises(ConfigError, match="batch 1 is bad"):
        fork_map(work, [0, 1, 2, 3], 2)


@needs_fork
def test_fork_map_says_when_a_child_dies():
    barrier = _two_processes()
    parent = os.getpid()

    def work(x):
        barrier.wait()
        if os.getpid() != parent:
            os._exit(3)   # the child dies without sending its results
        return x

    with pytest.raises(RuntimeError, match="ended without its results"):
        fork_map(work, [0, 1], 2)


@needs_fork
def test_fork_map_computes_here_what_a_child_without_autograd_could_not(monkeypatch):
    # Field case (a suite run under pytest-xdist): a plan's forked capture raised torch's "Unable to
    # handle autograd's threading in combination with fork-based multiprocessing" (engine.cpp's
    # forked_autograd_child: the worker process had started the autograd engine's device threads
    # in an earlier test) and the whole plan failed. Expected: every piece the child failed is
    # computed in the parent, each result reported once, and later calls do not fork again.
    from oomtune.plan import parallel

    monkeypatch.setattr(parallel, "_forks_unusable", False)
    barrier = _two_processes()
    parent = os.getpid()
    seen, waited = [], []   # each process passes the barrier once (the parent computes item 0 or 1 again)

    def work(x):
        if x < 2 and not waited:
            waited.append(x)
            barrier.wait()
        if os.getpid() != parent:
            raise RuntimeError(parallel.BAD_AUTOGRAD_FORK + ". See https://github.com/pytorch/pytorch/wiki/Autograd-and-Fork")
        return 10 * x, os.getpid()

    got = fork_map(work, [0, 1, 2, 3], 2, on_result=lambda i, r: seen.append(i))
    assert got == [(0, parent), (10, parent), (20, parent), (30, parent)]
    assert sorted(seen) == [0, 1, 2, 3]
    assert fork_map(lambda x: os.getpid(), [0, 1], 2) == [parent, parent]   # no child forked again


@needs_fork
def test_fork_map_inside_fork_map_runs_in_place():
    barrier = _two_processes()

    def inner(x):
        return os.getpid()

    def outer(x):
        barrier.wait()
        return os.getpid(), fork_map(inner, [x, x], 2)

    got = fork_map(outer, [1, 2], 2)
    assert len({pid for pid, _ in got}) == 2
    for pid, inner_pids in got:
        assert inner_pids == [pid, pid]


def test_default_workers_is_between_one_and_the_cores():
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert 1 <= default_workers() <= max(1, cores)


# -- replay groups -------------------------------------------------------------------------------------
def test_replay_groups_pair_each_configuration_with_its_garbage_collection_twin():
    mappings = [{"garbage_collection_threshold": None, "expandable_segments": None},
                {"garbage_collection_threshold": 0.8, "expandable_segments": None},
                {"garbage_collection_threshold": None, "expandable_segments": True},
                {"garbage_collection_threshold": 0.8, "expandable_segments": True},
                {"garbage_collection_threshold": 0.6, "expandable_segments": None}]
    assert replay_groups(mappings) == [[0, 1, 4], [2, 3]]


# -- the predictor's captures in workers -------------------------------------------------------------------
@needs_fork
def test_prepare_with_workers_takes_the_same_captures_in_the_same_order(monkeypatch):
    def capture(model_cfg, batch_size, **kwargs):
        return _stream(batch_size), None

    monkeypatch.setattr(P, "capture_training_stream", capture)
    taken = []
    for workers in (1, 2):
        pred = P.Predictor(WorkloadSpec.from_dict({"name": "fake"}), GEOMETRY, workers=workers)
        pred.prepare([8, 16, 32, 64, 128])
        taken.append(list(pred._captured))
    # the smallest two, the median and the largest, taken in ascending order either way
    assert taken[0] == taken[1] == [8, 16, 32, 128]
    assert pred.derivation_note is None
    assert pred.stream(64) == _stream(64) and pred.derived_batches == [64]


@needs_fork
def test_prepare_with_workers_turns_derivation_off_like_one_process(monkeypatch):
    def capture(model_cfg, batch_size, **kwargs):   # batch 16 one byte off the line
        s = _stream(batch_size)
        if batch_size == 16:
            s = AllocationStream([("alloc", 1, 4096), ("alloc", 2, 16 * 3000 + 513), ("free", 2), ("alloc", 3, 4096)])
        return s, None

    monkeypatch.setattr(P, "capture_training_stream", capture)
    notes = []
    for workers in (1, 2):
        pred = P.Predictor(WorkloadSpec.from_dict({"name": "fake"}), GEOMETRY, workers=workers)
        pred.prepare([8, 16, 32, 64, 128])
        notes.append(pred.derivation_note)
    assert notes[0] == notes[1] and "are not a polynomial of degree <= 2 in the batch size" in notes[0]


# -- whole plans: workers change nothing -------------------------------------------------------------------
@needs_fork
@pytest.mark.parametrize("derive", [True, False])
def test_plan_with_workers_equals_one_process_capturing_every_batch(monkeypatch, derive):
    for key in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(key, raising=False)
    settings = [{}, {"garbage_collection_threshold": 0.6}, {"expandable_segments": True},
                {"max_split_size_mb": 20, "roundup_power2_divisions": 4},
                {"max_split_size_mb": 20, "roundup_power2_divisions": 4, "garbage_collection_threshold": 0.6}]
    # 0.5 x 340 MiB allowed: the threshold acts at the larger batches, fits end between 32 and 64
    geometry = {"total_memory_bytes": 340 << 20, "memory_fraction": 0.5}
    grid = grid_batches(4, 64)
    reference = P.Predictor(WorkloadSpec.from_dict(RESNET), geometry, derive=False)
    ref = build_plan(reference, settings, grid, workload=RESNET, device={"kind": "cpu"})
    pred = P.Predictor(WorkloadSpec.from_dict(RESNET), geometry, derive=derive, workers=2)
    seen = []
    fmap = build_plan(pred, settings, grid, workload=RESNET, device={"kind": "cpu"},
                      on_row=lambda row: seen.append(row.alloc_conf))
    assert fmap.to_dict()["configurations"] == ref.to_dict()["configurations"]
    assert seen == [r.alloc_conf for r in ref.rows]                    # progress in order
    assert fmap.replays == ref.replays                                  # gc twins still share replays
    assert {c["max_batch_size"] for c in fmap.to_dict()["configurations"]} - set(grid), "no bisection happened"
    if derive:
        assert pred.derived_batches and fmap.captures == 4
        assert len(set(pred.derived_batches)) == len(pred.derived_batches)
    # the parent holds every prediction the workers made: asking again replays nothing
    replays = pred.replays
    for row in fmap.rows:
        for cell in row.cells:
            pred.predict_detail(cell.batch_size, row.alloc_conf)
    assert pred.replays == replays


def _cpu_work(n: int) -> float:
    import torch

    a = torch.ones(600, 600, dtype=torch.float64) * n   # sums exact in float64
    return float((a @ a).sum())


@pytest.mark.timeout(120)
def test_fork_map_workers_compute_on_the_cpu_after_the_parent_did():
    # GNU OpenMP does not survive fork: a child forked after the parent ran a parallel CPU kernel used
    # to wait forever in its first one (a CPU-fallback capture in a plan worker); the workers now run
    # torch on one thread each
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _cpu_work(1)                                    # the parent's OpenMP pool exists now
        assert fork_map(_cpu_work, [1, 2, 3], 2) == [600.0 * 600 * 600 * n * n for n in (1, 2, 3)]
    finally:
        torch.set_num_threads(threads)
