"""PredictorVariants (one Predictor per workload variant) behind the interface the plan's forked
replays use (:func:`oomtune.plan._spread.rows_forked`): ``fork_mark`` / ``fork_delta`` /
``fork_merge`` and settable phase seconds.

Expected values: what the child predicted (the parent must then hold it without replaying or capturing
again), the routing of the module docstring (``grad_accum(b) > 1``: the two-micro-batch variant), and
hand-computed sums of seconds.
"""

from __future__ import annotations

import os
import pickle

import pytest

from oomtune.alloc.settings import AllocatorSettings
from oomtune.plan.feasibility import build_plan
from oomtune.plan.predictor import Predictor
from oomtune.plan.variants import PredictorVariants
from oomtune.workload_spec import WorkloadSpec

#: A small MLP (the input 64 features wide) on a virtual GPU of 1 GiB, all of it usable.
WORKLOAD = {"name": "mlp", "in_features": 64, "hidden": 16, "layers": 1, "num_classes": 10, "optimizer": "sgd",
            "target": {"name": "builtin"}}
GEOMETRY = {"total_memory_bytes": 1 << 30, "memory_fraction": 1.0}
GLOBAL_BATCH = 32


def _variants() -> PredictorVariants:
    """A global batch of 32: micro-batch b accumulates 32 // b micro-batches per optimizer step."""
    return PredictorVariants(WorkloadSpec.from_dict(WORKLOAD), lambda w: Predictor(w, GEOMETRY, steps=1),
                             grad_accum_of=lambda b: GLOBAL_BATCH // b)


def test_a_childs_predictions_reach_the_parents_variant_without_replaying_again():
    parent, child = _variants(), _variants()   # the child: the parent as a fork copies it (nothing predicted yet)
    since = child.fork_mark()
    assert set(since) == {(None, 1)}            # the one-micro-batch variant exists from the start
    # 8 accumulates 4 micro-batches: the two-micro-batch variant, made in the child after the mark;
    # 32 is the whole global batch: the one-micro-batch variant.
    in_child = {b: child.predict_detail(b, "") for b in (8, 32)}
    assert child.member(8).model_cfg.get("grad_accum") == 2 and "grad_accum" not in child.member(32).model_cfg
    gained = pickle.loads(pickle.dumps(child.fork_delta(since)))   # it travels back through a pipe
    assert set(gained["members"]) == {(None, 1), (None, 2)}
    assert gained["replay_seconds"] == child.member(8).replay_seconds + child.member(32).replay_seconds

    parent.fork_merge(gained)
    assert parent.member(8) is not parent.member(32)
    assert parent.member(8).model_cfg.get("grad_accum") == 2
    assert parent.replays == child.replays == 2 and parent.captures == child.captures == 2
    for b, prediction in in_child.items():
        assert parent.predict_detail(b, "") == prediction
        assert parent.member(b).stream(b) == child.member(b).stream(b)
    assert parent.replays == 2 and parent.captures == 2   # both answered from what was merged


def test_a_delta_since_the_mark_leaves_out_what_the_parent_already_held():
    parent = _variants()
    parent.predict_detail(32, "")
    child_before = parent.fork_mark()
    parent.predict_detail(32, "expandable_segments:True")   # one more replay of the captured stream
    gained = parent.fork_delta(child_before)
    one = gained["members"][(None, 1)]
    assert one["replays"] == 1 and one["captured"] == [] and len(one["cache"]) == 1


def test_the_phase_seconds_are_settable_and_keep_counting_the_members():
    variants = _variants()
    variants.predict_detail(32, "")
    member = variants.member(32)
    variants.replay_seconds = 5.0    # rows_forked sets the phase's wall time
    assert variants.replay_seconds == 5.0
    member.replay_seconds += 0.25    # work done afterwards still counts
    assert variants.replay_seconds == 5.25
    assert variants.capture_seconds == member.capture_seconds   # untouched: the members' sum


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs the fork start method")
def test_a_plan_over_variants_spread_over_processes_equals_one_process():
    # A global batch's plan replayed by forked children (two workers, three configurations in three
    # replay groups) is the plan of one process, and the parent ends up holding every prediction.
    settings = [{"expandable_segments": None}, {"expandable_segments": True}, {"max_split_size_mb": 64}]
    grid = [8, 16, 32]   # micro-batches of 32: 4, 2 and 1 micro-batches per step
    plans = []
    for workers in (1, 2):
        variants = _variants()
        variants.workers = workers
        plans.append((variants, build_plan(variants, settings, grid, workload=WORKLOAD, device={}, dense=False)))
    (one, alone), (forked, spread) = plans
    assert spread.rows == alone.rows
    assert forked.replays == one.replays == len(settings) * len(grid)
    replays = forked.replays
    for mapping in settings:
        conf = AllocatorSettings.from_mapping({k: v for k, v in mapping.items() if v is not None})
        for b in grid:
            assert forked.predict_detail(b, conf) == one.predict_detail(b, conf)
    assert forked.replays == replays   # nothing replayed again: the children's work was merged


def test_a_plan_over_recorded_variants_counts_their_recordings():
    # Recordings of a command's trials, with and without activation checkpointing: a plan over them
    # (one process: RecordedVariants has one worker) counts the five recorded streams as its captures.
    from oomtune.alloc.stream import AllocationStream
    from oomtune.plan.recorded import RecordedPredictor, RecordedVariants

    def recorded(b: int, scale: int) -> AllocationStream:
        return AllocationStream([("alloc", 1, scale * 4096 * b), ("alloc", 2, 1024), ("free", 2), ("free", 1)])

    variants = RecordedVariants({False: RecordedPredictor({b: recorded(b, 2) for b in (8, 16, 32)}, GEOMETRY),
                                 True: RecordedPredictor({b: recorded(b, 1) for b in (8, 32)}, GEOMETRY)})
    fmap = build_plan(variants, [{"expandable_segments": None, "activation_checkpointing": True}], [8, 32],
                      workload=WORKLOAD, device={})
    assert fmap.captures == 3 + 2
    # no limit: a batch fits when its replay completes (build_plan), so the largest grid batch is it
    assert fmap.rows[0].max_batch_size == 32
