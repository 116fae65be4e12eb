"""A recording trial (role record) stands for the probe of the same candidate: not launched twice.

The field case: a target=cmd search under a global batch ran trials 0-4 (role record) and 5-9 (role
baseline) at the same batch sizes with the default allocator, and said "0 saved by prediction or
reuse". A recording runs on an unbounded virtual GPU; when its peak stayed within the limit the
caching allocator never reached the budget's memory fraction (CUDACachingAllocator.cpp,
DeviceCachingAllocator::alloc_block: the fraction is checked only for a new segment), so the probe
under the budget would have made the same calls: its result is the recording's.
"""

from __future__ import annotations

import json
import types

import optuna
import pytest

from oomtune.outcome import Outcome
from oomtune.search.driver import Search
from oomtune.space import SearchSpace
from oomtune.study import records as R
from oomtune.trial.budget import MemoryLimit
from oomtune.trial.record import MEMORY_SOURCE_SIMULATED, MemoryReadings, TrialResult
from oomtune.units import MiB

LIMIT = MemoryLimit(budget_bytes=24 * MiB, headroom=0.0)   # the limit is the budget: 24 MiB


def _search(space: SearchSpace, objective: str = "batch"):
    study = optuna.create_study()
    fake = types.SimpleNamespace(space=space, opt=types.SimpleNamespace(objective=objective), recording=object(),
                                 study=study, limit=LIMIT)
    return fake, study


def _add(fake, batch, peak_mib, **kw):
    res = TrialResult(outcome=kw.get("outcome", Outcome.OK), batch_size=batch, alloc_conf="",
                      memory=MemoryReadings(source=MEMORY_SOURCE_SIMULATED, peak_reserved_bytes=peak_mib * MiB))
    cand = fake.space.candidate(batch, kw.get("params"))
    dists = {k: optuna.distributions.CategoricalDistribution([v]) for k, v in cand.optuna_params().items()}
    fake.study.add_trial(optuna.trial.create_trial(
        params=cand.optuna_params(), distributions=dists, value=1.0,
        user_attrs={R.ATTR_ROLE: kw.get("role", "record"), R.ATTR_RESULT: res.to_dict()}))


SPACE = {"expandable_segments": [False, True]}


def test_a_recording_within_the_limit_is_the_probes_result_under_the_batch_objective():
    space = SearchSpace(1, 16, SPACE, global_batch=16)
    fake, study = _search(space)
    _add(fake, 4, 10)    # recorded at two micro-batches per step, 10 MiB: within 24 MiB
    _add(fake, 8, 32)    # 32 MiB: above the limit, the probe must run under the budget
    _add(fake, 2, 8, outcome=Outcome.CRASH)
    got = Search._from_recording(fake, space.default(4))   # micro-batch 4 x 4 steps: accumulating too
    assert got is not None and got.params["batch_size"] == 4
    assert Search._from_recording(fake, space.default(8)) is None
    assert Search._from_recording(fake, space.default(2)) is None
    # another allocator configuration: not what was recorded
    assert Search._from_recording(fake, space.candidate(4, {"expandable_segments": True})) is None
    # micro-batch 16 is the whole global batch: one micro-batch per step, another step than the recording's
    _add(fake, 16, 12)
    assert space.grad_accum_for(16) == 1 and Search._from_recording(fake, space.default(16)) is None


def test_under_the_throughput_objective_only_the_recordings_own_step_counts():
    space = SearchSpace(1, 16, SPACE, global_batch=16)
    fake, _ = _search(space, objective="throughput")
    _add(fake, 4, 10)
    _add(fake, 8, 10)
    assert Search._from_recording(fake, space.default(4)) is None        # 4 micro-batches, recorded 2
    assert Search._from_recording(fake, space.default(8)).params["batch_size"] == 8   # 2 micro-batches: the same


def test_a_baseline_is_never_taken_from_a_target_that_records_nothing():
    space = SearchSpace(1, 16, SPACE, global_batch=16)
    fake, _ = _search(space)
    _add(fake, 4, 10)
    fake.recording = None
    assert Search._from_recording(fake, space.default(4)) is None
    fake.recording = object()
    _add(fake, 2, 8, role="baseline")   # a probe, not a recording
    assert Search._from_recording(fake, space.default(2)) is None


@pytest.mark.slow
def test_a_global_batch_search_reuses_its_recordings_as_the_baselines_probes(global_batch_loop_search):
    # `oomtune search target=cmd` of examples/global_batch.py under a global batch of 16 at 44 MiB
    # (conftest.py: the same run as tests/test_integrations.py's search of that example)
    code, run = global_batch_loop_search
    assert code == 0
    rows = {r["number"]: r for r in json.loads((run / "trials.json").read_text())}
    records = {r["batch_size"]: n for n, r in rows.items() if r["role"] == "record"}
    reused = [r for r in rows.values() if r["role"] == "baseline" and r["from_recording"] is not None]
    assert reused, rows
    for r in reused:   # the recording of the same batch, within the limit, its peak taken as measured
        rec = rows[r["from_recording"]]
        assert records[r["batch_size"]] == r["from_recording"] and rec["feasible"]
        assert r["peak_reserved_bytes"] == rec["peak_reserved_bytes"]
    launched_baselines = [r for r in rows.values() if r["role"] == "baseline" and r["from_recording"] is None]
    assert all(r["batch_size"] not in records or not rows[records[r["batch_size"]]]["feasible"]
               for r in launched_baselines)
