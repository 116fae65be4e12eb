"""The plan's work spread over forked processes (issue 13, item 3): the same results as one process.

Expected values: hand-computed for fork_map and the replay groups; for whole plans, the reference is
the plan computed in one process capturing every batch size (no derivation, no workers).
"""

from __future__ import annotations

import os

import pytest

from oomtune.alloc.stream import AllocationStream
from oomtune.plan import predictor as P
from oomtune.plan.feasibility import build_plan, grid_batches, replay_groups
from oomtune.plan.parallel import default_workers, fork_imap, fork_map

needs_fork = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs the fork start method")
GEOMETRY = {"total_memory_bytes": 1 << 30, "memory_fraction": 1.0}
RESNET = {"name": "resnet", "depth": 18, "image_size": 32, "num_classes": 10, "optimizer": "sgd"}


def _stream(b: int) -> AllocationStream:
    """weight 4096, activation b * 3000 + 512 (freed), gradient 4096."""
    return AllocationStream([("alloc", 1, 4096), ("alloc", 2, b * 3000 + 512), ("free", 2), ("alloc", 3, 4096)])


# -- fork_map ----------------------------------------------------------------------------------------
@needs_fork
def test_fork_map_keeps_the_order_and_runs_in_other_processes():
    offset = 1000  # a closure: fn reaches the workers by inheritance, not by pickling

    def work(x):
        return x * x + offset, os.getpid()

    got = fork_map(work, list(range(7)), 2)
    assert [v for v, _ in got] == [1000, 1001, 1004, 1009, 1016, 1025, 1036]
    assert os.getpid() not in {pid for _, pid in got}


def test_fork_map_with_one_worker_runs_here():
    got = fork_map(lambda x: (x + 1, os.getpid()), [1, 2, 3], 1)
    assert got == [(2, os.getpid()), (3, os.getpid()), (4, os.getpid())]


@needs_fork
def test_fork_map_raises_the_workers_exception():
    from oomtune.exceptions import ConfigError

    def work(x):
        if x == 2:
            raise ConfigError("batch 2 is bad")
        return x

    with pytest.raises(ConfigError, match="batch 2 is bad"):
        fork_map(work, [1, 2, 3], 2)


@needs_fork
def test_fork_imap_inside_a_worker_runs_in_that_worker():
    def inner(x):
        return os.getpid()

    def outer(x):
        return os.getpid(), fork_map(inner, [x, x], 2)

    for pid, inner_pids in fork_map(outer, [1, 2], 2):
        assert inner_pids == [pid, pid]


def test_default_workers_is_between_one_and_the_cores():
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert 1 <= default_workers() <= max(1, cores)


def test_fork_imap_is_lazy_with_one_worker():
    seen = []
    it = fork_imap(lambda x: seen.append(x) or x, [1, 2, 3], 1)
    assert seen == [] and next(it) == 1 and seen == [1]


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
    pred = P.Predictor({"name": "fake"}, GEOMETRY, workers=2)
    pred.prepare([8, 16, 32, 64, 128])
    # smallest, largest, median anchor the model; 16, the smallest other one, is the spot check
    assert list(pred._captured) == [8, 128, 32, 16] and pred.spot_checked == [16]
    assert pred.derivation_note is None and pred._precaptured == {}
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
        pred = P.Predictor({"name": "fake"}, GEOMETRY, workers=workers)
        pred.prepare([8, 16, 32, 64, 128])
        notes.append(pred.derivation_note)
    assert notes[0] == notes[1] and "differs from its capture" in notes[0]


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
    reference = P.Predictor(RESNET, geometry, derive=False)
    ref = build_plan(reference, settings, grid, workload=RESNET, device={"kind": "cpu"})
    pred = P.Predictor(RESNET, geometry, derive=derive, workers=2)
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
