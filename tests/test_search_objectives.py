"""The search's objectives behind one contract (oomtune.search.objectives): the registry, what each
objective states about itself, and how each ranks and confirms hand-made trials. Every expected
order and figure below is worked out by hand in the comments from the ranking rules the objective
modules state (batch: larger batch, lower peak reserved, fewer keys, earlier trial; throughput:
samples/s, the default allocator unless beaten by min_gain, smallest batch within 5% when input-bound;
a throughput gain only when the slowest repeat beats the baseline's fastest and the mean beats the
baseline's by more than min_gain)."""

from __future__ import annotations

import optuna
import pytest

from oomtune.best import Choice
from oomtune.exceptions import ConfigError
from oomtune.search.confirmation import ConfirmContext
from oomtune.search.objectives import (OBJECTIVES, BatchObjective, Objective, ThroughputObjective,
                                       objective_for)
from oomtune.study import records as R
from oomtune.units import MiB

ES = "expandable_segments:True"


def _add(study, *, batch, conf="", reserved=None, throughput=0.0, feasible=True, es=None):
    """A finished trial as the search stores it (result, outcome, allocator string, constraint)."""
    result = {"outcome": "ok", "batch_size": batch, "alloc_conf": conf, "throughput": throughput,
              "peak_reserved_bytes": reserved, "memory_source": "simulated", "extra": {}}
    params = {"batch_size": batch, **({} if es is None else {"expandable_segments": es})}
    dists = {"batch_size": optuna.distributions.IntDistribution(1, 4096)}
    if es is not None:
        dists["expandable_segments"] = optuna.distributions.CategoricalDistribution([False, True])
    study.add_trial(optuna.trial.create_trial(
        value=throughput, params=params, distributions=dists,
        user_attrs={R.ATTR_ROLE: "search", R.ATTR_OUTCOME: "ok", R.ATTR_CONF: conf, R.ATTR_RESULT: result},
        system_attrs={"constraints": [0.0 if feasible else 0.5]}))
    return study.trials[-1]


def _default(t) -> bool:
    return not t.params.get("expandable_segments")


def test_the_registry_maps_each_configured_name_to_its_objective_once():
    assert set(OBJECTIVES) == {"batch", "throughput"}
    for name, cls in OBJECTIVES.items():
        obj = objective_for(name)
        assert isinstance(obj, cls) and isinstance(obj, Objective) and obj.name == name
        assert objective_for(name) is obj   # stateless: one instance serves every search
    with pytest.raises(ConfigError, match=r"^search\.objective='fast': choose one of throughput, batch$"):
        objective_for("fast")


def test_each_objective_states_what_the_search_asks_of_it():
    batch, speed = objective_for("batch"), objective_for("throughput")
    # the batch objective: the frontier probes decide; no sampler, no timing
    assert (batch.uses_sampler, batch.probes_every_frontier, batch.measures_time) == (False, False, False)
    assert (speed.uses_sampler, speed.probes_every_frontier, speed.measures_time) == (True, True, True)
    # both tell Optuna samples/s (oomtune.study.storage.open_study creates the study to maximize it)
    assert batch.direction == speed.direction == "maximize"


def test_the_value_told_to_optuna_is_samples_per_second_for_a_run_and_zero_or_none_otherwise():
    from oomtune.trial.record import Throughput, TrialResult

    ok = TrialResult(outcome="ok", batch_size=8, alloc_conf="", throughput=Throughput(samples_per_s=123.5))
    oom = TrialResult(outcome="oom", batch_size=8, alloc_conf="")
    crash = TrialResult(outcome="crash", batch_size=8, alloc_conf="")
    for obj in (BatchObjective(), ThroughputObjective()):
        assert (obj.value(ok), obj.value(oom), obj.value(crash)) == (123.5, 0.0, None)


def test_batch_ranks_larger_batch_then_lower_peak_then_fewer_keys_whatever_the_throughput():
    study = optuna.create_study(direction="maximize")
    a = _add(study, batch=64, reserved=900 * MiB, throughput=500.0)
    b = _add(study, batch=72, conf=ES, reserved=940 * MiB, throughput=10.0)
    c = _add(study, batch=72, conf=ES + ",max_split_size_mb:128", reserved=930 * MiB, throughput=10.0)
    d = _add(study, batch=72, conf=ES, reserved=930 * MiB, throughput=10.0)
    # 72 before 64 (A last despite its 500 samples/s); among the 72s C and D (930 MiB) before B
    # (940 MiB); C has two keys, D one: D first.
    ranked = BatchObjective().rank([a, b, c, d], is_default=_default, min_gain=0.02)
    assert [t.number for t in ranked] == [d.number, c.number, b.number, a.number]
    assert BatchObjective().leader([a, b, c, d], is_default=_default, min_gain=0.02).number == d.number


def test_throughput_keeps_the_default_allocator_first_unless_beaten_by_min_gain():
    study = optuna.create_study(direction="maximize")
    base = _add(study, batch=64, throughput=100.0, es=False)
    close = _add(study, batch=72, conf=ES, throughput=101.5, es=True)
    slow = _add(study, batch=80, conf=ES, throughput=99.0, es=True)
    obj = ThroughputObjective()
    # fastest first: close (101.5), base (100), slow (99); 101.5 < 100 x 1.02 = 102: the default first
    assert [t.number for t in obj.rank([slow, close, base], is_default=_default, min_gain=0.02)] == \
        [base.number, close.number, slow.number]
    # with min_gain 1%: 101.5 >= 101, the setting earned its place
    assert [t.number for t in obj.rank([slow, close, base], is_default=_default, min_gain=0.01)] == \
        [close.number, base.number, slow.number]


def test_throughput_input_bound_prefers_the_smallest_batch_within_five_percent():
    study = optuna.create_study(direction="maximize")
    base = _add(study, batch=64, throughput=100.0, es=False)
    fast = _add(study, batch=72, conf=ES, throughput=103.0, es=True)
    small = _add(study, batch=32, throughput=99.0, es=False)
    far = _add(study, batch=16, throughput=90.0, es=False)
    obj = ThroughputObjective()
    trials = [base, fast, small, far]
    # by speed: fast 103, base 100, small 99, far 90; 103 >= 100 x 1.02 = 102: fast stays first
    assert [t.number for t in obj.rank(trials, is_default=_default, min_gain=0.02)] == \
        [fast.number, base.number, small.number, far.number]
    # input-bound: within 0.95 x 103 = 97.85 are fast, base and small; by batch 32, 64, 72; far after
    assert [t.number for t in obj.rank(trials, is_default=_default, min_gain=0.02, input_bound=True)] == \
        [small.number, base.number, fast.number, far.number]
    # the leader (progress line) does not apply the input-bound rule
    assert obj.leader(trials, is_default=_default, min_gain=0.02).number == fast.number


def _context(study, speeds: dict[int, list[float]], baseline, *, repeats=3, min_gain=0.02):
    """A ConfirmContext whose clean-process runs are hand-made trials of the given samples/s."""
    asked = []

    def runs(trials, times, interleave=False):
        asked.append(([t.number for t in trials], times, interleave))
        return {t.number: [_add(study, batch=t.params["batch_size"], conf=t.user_attrs[R.ATTR_CONF],
                                throughput=s, reserved=1 * MiB) for s in speeds[t.number][:times]]
                for t in trials}

    return ConfirmContext(runs=runs, baseline=lambda: baseline, is_default=_default, repeats=repeats,
                          finalists=2, min_gain=min_gain), asked


def test_throughput_confirmation_claims_a_gain_only_beyond_the_measured_spread():
    study = optuna.create_study(direction="maximize")
    base = _add(study, batch=64, throughput=100.0, es=False)
    cand = _add(study, batch=72, conf=ES, throughput=112.0, es=True)
    # baseline repeats 100, 101, 102 (mean 101); candidate 110, 111, 112 (mean 111): its slowest 110
    # beats the baseline's fastest 102, and 111 > 101 x 1.02 = 103.02: claimed, ratio 111/101
    ctx, asked = _context(study, {base.number: [100.0, 101.0, 102.0], cand.number: [110.0, 111.0, 112.0]}, base)
    done = ThroughputObjective().confirm(ctx, [cand, base], 3)
    assert asked == [([base.number, cand.number], 3, True)]   # the baseline first, interleaved
    assert done.winner.number == cand.number and done.confirmed
    assert done.gain["claimed"] is True and done.gain["throughput_ratio"] == pytest.approx(111.0 / 101.0)
    # candidate 101, 104, 107 (mean 104 > 103.02) but its slowest 101 is below the baseline's fastest
    # 102: within the noise, the baseline is the answer
    ctx, _ = _context(study, {base.number: [100.0, 101.0, 102.0], cand.number: [101.0, 104.0, 107.0]}, base)
    done = ThroughputObjective().confirm(ctx, [cand, base], 3)
    assert done.winner.number == base.number and done.gain["claimed"] is False
    assert done.gain["throughput_ratio"] == pytest.approx(1.0)


def test_batch_confirmation_compares_the_winners_batch_with_the_baselines():
    study = optuna.create_study(direction="maximize")
    base = _add(study, batch=76, reserved=912 * MiB, es=False)
    cand = _add(study, batch=95, conf=ES, reserved=950 * MiB, es=True)
    ctx, asked = _context(study, {cand.number: [1.0]}, base)
    done = BatchObjective().confirm(ctx, [cand, base], 3)
    assert asked == [([cand.number], 1, False)]                 # one clean run of the top candidate
    # 95 / 76 = 1.25; the confirmation's peak (1 MiB, hand-made) over the baseline's 912 MiB
    assert done.winner.number == cand.number and done.gain["claimed"] is True
    assert done.gain["batch_size_ratio"] == pytest.approx(1.25)
    assert done.gain["peak_reserved_ratio"] == pytest.approx(1 / 912)
    line = BatchObjective().gain_line(done.gain, summary=None, best=Choice(batch_size=95, alloc_conf=ES),
                                      baseline=Choice(batch_size=76, alloc_conf=""), memory_source="simulated")
    assert line == ("vs the default allocator at its largest batch (76): 1.25x batch (95 vs 76) within the same "
                    "budget (simulated memory)")
