"""The search driver (baseline, Optuna loop, confirmation) against a fake trial runner whose memory
model is hand-computable: peak reserved = batch x 12 MiB under the default allocator, batch x 10 MiB
with expandable_segments; out of memory above the budget."""

from __future__ import annotations

from dataclasses import replace

import optuna
import pytest

from oomtune.exceptions import ConfigError
from oomtune.outcome import Outcome
from oomtune.study import records as R
from oomtune.schema import SearchConf, TrialConf
from oomtune.search.driver import Search, SearchOptions, SetupFault
from oomtune.space import SearchSpace
from oomtune.trial.record import MemoryReadings, StoppedOverLimit, Throughput, TrialResult
from oomtune.units import MiB
from oomtune.workload_spec import WorkloadSpec

#: The fake workload the fake runners "train" (no target GPU: the runners read none).
FAKE = WorkloadSpec(target={"name": "builtin"}, model={"name": "fake"}, gpu=None)
#: trial.* as these searches had them: 10 confirmation steps, no soak (the fake runners soak nothing).
TRIAL = TrialConf(confirm_steps=10, soak_steps=0)

BUDGET = 1000 * MiB


class FakeRunner:
    def __init__(self, *, fail_confirm_batches=(), error_at=None):
        self.calls: list[tuple[int, str, int]] = []
        self.fail_confirm_batches = set(fail_confirm_batches)
        self.error_at = error_at

    def run(self, spec, *, workdir):
        self.calls.append((spec.batch_size, spec.alloc_conf, spec.measure_steps))
        b = spec.batch_size
        if self.error_at is not None and b == self.error_at:
            return TrialResult(outcome="error", batch_size=b, alloc_conf=spec.alloc_conf, message="boom")
        per = 10 * MiB if "expandable_segments:True" in spec.alloc_conf else 12 * MiB
        peak = b * per
        if peak > spec.budget_bytes or (spec.measure_steps > 3 and b in self.fail_confirm_batches):
            return TrialResult(outcome="oom", batch_size=b, alloc_conf=spec.alloc_conf, message="CUDA out of memory")
        return TrialResult(outcome="ok", batch_size=b, alloc_conf=spec.alloc_conf,
                           throughput=Throughput(samples_per_s=float(b)),
                           memory=MemoryReadings(source="simulated", peak_reserved_bytes=peak,
                                                 peak_allocated_bytes=peak))

    def kill_all(self):
        pass

    def close(self):
        pass


def make(tmp_path, *, low=8, high=256, n_trials=0, headroom=0.05, runner=None, confirm_runner=None,
         space=None, sampler=None):
    study = optuna.create_study(direction="maximize", sampler=sampler or optuna.samplers.RandomSampler(seed=0))
    space = SearchSpace(low, high, space if space is not None else {"expandable_segments": [False, True]})
    opts = SearchOptions(workload=FAKE, device="cpu", budget_bytes=BUDGET,
                         search=SearchConf(headroom=headroom, n_trials=n_trials), trial=TRIAL)
    runner = runner or FakeRunner()
    return Search(study, space, opts, runner=runner, confirm_runner=confirm_runner or runner,
                  workdir=tmp_path), study, runner


def test_baseline_finds_largest_default_batch_by_doubling_then_bisection(tmp_path):
    # limit = 1000 MiB * 0.95 = 950 MiB. Default: 12 MiB/sample -> feasible up to 79 (948 MiB);
    # 80..83 run but exceed the limit; >= 84 is out of memory (1008 MiB > 1000 MiB).
    # Probes: 8, 16, 32, 64 ok; 128 oom; 96 oom; 80 over limit; 72 ok; 76 ok; (80-76=4 <= 7.6) stop.
    search, study, runner = make(tmp_path)
    baseline = search.run_frontier()
    assert [c[0] for c in runner.calls] == [8, 16, 32, 64, 128, 96, 80, 72, 76]
    assert all(c[1] == "" for c in runner.calls)  # the default allocator
    assert baseline.params["batch_size"] == 76


def test_infeasible_outcomes_are_complete_trials_with_violated_constraint(tmp_path):
    search, study, _ = make(tmp_path)
    search.run_frontier()
    by_batch = {t.params["batch_size"]: t for t in study.trials}
    oom = by_batch[128]
    assert oom.state == optuna.trial.TrialState.COMPLETE
    assert oom.user_attrs[R.ATTR_OUTCOME] == "oom"
    assert oom.constraints["memory"] > 0
    over = by_batch[80]  # ran, 960 MiB > 950 MiB limit: (960-950)/950
    assert over.user_attrs[R.ATTR_OUTCOME] == "ok"
    assert over.constraints["memory"] == pytest.approx((960 - 950) / 950, rel=1e-3)
    assert by_batch[64].constraints["memory"] <= 0


def test_answer_is_a_batch_that_ran_c6(tmp_path):
    # Field case C6: 2, 4 and 8 pass and the search ends: the answer is 8, never an untested 16.
    search, study, runner = make(tmp_path, low=2, high=8)
    search.run_frontier()
    search.run_search()
    best, result, confirmed = search.confirm()
    assert best.params["batch_size"] == 8
    assert confirmed and result.outcome == "ok"
    assert {c[0] for c in runner.calls} == {2, 4, 8}


def test_confirmation_failure_falls_back_to_next_best_c7(tmp_path):
    # The top candidate (76, default) fails its clean-process confirmation (C7): the next best (72) wins.
    # Throughput objective: the two finalists (76, the baseline, and 72) are measured 3 times each (repeats=3),
    # one run at a time in rotating order (76 72, 72 76, 76 72); 76 is out after its first failure.
    runner = FakeRunner(fail_confirm_batches={76})
    search, study, _ = make(tmp_path, runner=runner)
    search.run_frontier()
    best, result, confirmed = search.confirm()
    assert best.params["batch_size"] == 72 and confirmed
    confirms = [t for t in study.trials if t.user_attrs.get(R.ATTR_ROLE) == "confirm"]
    n76, n72 = (next(by.number for by in study.trials if by.params["batch_size"] == b
                     and by.user_attrs[R.ATTR_ROLE] == "baseline") for b in (76, 72))
    assert [t.user_attrs[R.ATTR_CONFIRMS] for t in confirms] == [n76, n72, n72, n72]
    assert all(c[2] == 10 for c in runner.calls[-4:])  # confirmation runs use confirm_steps
    assert search.gain is None  # the baseline (76) did not survive: no gain is claimed against it


def test_batch_objective_confirms_the_largest_feasible_batch_once(tmp_path):
    # objective=batch: the ranking is by batch (76 > 72 ...); one clean run of the top candidate.
    search, study, runner = make(tmp_path)
    search.opt = replace(search.opt, objective="batch")
    search.run_frontier()
    best, result, confirmed = search.confirm()
    assert best.params["batch_size"] == 76 and confirmed
    assert [c for c in runner.calls if c[2] == 10] == [(76, "", 10)]


def test_error_at_smallest_batch_is_a_setup_fault(tmp_path):
    search, study, _ = make(tmp_path, runner=FakeRunner(error_at=8))
    with pytest.raises(SetupFault, match="batch 8"):
        search.run_frontier()
    assert study.trials[0].state == optuna.trial.TrialState.FAIL


def test_search_skips_batches_above_a_known_oom_under_same_settings(tmp_path):
    search, study, runner = make(tmp_path, n_trials=12, high=512)
    search.run_frontier()
    search.run_search()
    launched = len(runner.calls)
    skipped = [t for t in study.trials if t.user_attrs.get(R.ATTR_OUTCOME) == Outcome.PREDICTED_INFEASIBLE.value]
    for t in skipped:  # each skipped one is above an OOM batch with the same settings
        same = [u for u in study.trials if u.user_attrs.get(R.ATTR_OUTCOME) == "oom"
                and u.params["expandable_segments"] == t.params["expandable_segments"]
                and u.params["batch_size"] <= t.params["batch_size"]]
        assert same
        assert t.state == optuna.trial.TrialState.COMPLETE and t.constraints["memory"] > 0
    assert launched + len(skipped) + sum(R.ATTR_REUSED in t.user_attrs for t in study.trials) == len(study.trials)


def test_expandable_segments_wins_when_it_fits_a_larger_batch(tmp_path):
    # With expandable_segments the model needs 10 MiB/sample: feasible up to 95 (950 MiB), vs 79.
    # A grid over the two settings at batch 95 must find it.
    search, study, runner = make(tmp_path, low=79, high=95, n_trials=4,
                                 sampler=optuna.samplers.GridSampler({"batch_size": [79, 95],
                                                                      "expandable_segments": [False, True]}))
    search.run_search()
    best, result, confirmed = search.confirm()
    assert best.params == {"batch_size": 95, "expandable_segments": True}
    assert result.memory.peak_reserved_bytes == 950 * MiB


class FakePredictor:
    """The FakeRunner's memory model as a virtual-GPU prediction (exact): 12 MiB per sample under the
    default allocator, 10 MiB with expandable_segments; completes when within the budget."""

    def __init__(self, per_expandable=10 * MiB):
        self.per_expandable = per_expandable
        self.capture_seconds = self.replay_seconds = 0.0

    def peak(self, batch, conf):
        return batch * (self.per_expandable if "expandable_segments:True" in conf else 12 * MiB)

    def predict_detail(self, batch, settings):
        from oomtune.plan.predictor import Prediction

        conf = settings if isinstance(settings, str) else settings.render()
        peak = self.peak(batch, conf)
        return Prediction(batch, conf, peak, peak, 0.0, peak <= BUDGET, 0, peak)

    def predict_raw(self, batch, settings):
        return self.predict_detail(batch, settings).peak_reserved_bytes


def test_frontier_first_probes_each_configuration_at_its_predicted_frontier(tmp_path):
    # limit = 950 MiB. Predicted frontiers: default 950 // 12 = 79 (948 MiB); expandable 950 // 10 = 95
    # (950 MiB, inclusive). Round 1: default@79, expandable@95, both ok; round 2: the boundaries,
    # default@80 (960 MiB) and expandable@96 (960 MiB), both over the limit. Four trials, no sampler.
    search, study, runner = make(tmp_path, n_trials=0)
    search.predictor = FakePredictor()
    baseline = search.run_frontier()
    assert [c[:2] for c in runner.calls] == [(79, ""), (95, "expandable_segments:True"),
                                             (80, ""), (96, "expandable_segments:True")]
    assert baseline.params["batch_size"] == 79
    rows = {c.alloc_conf: c for c in search.planner.configs}
    assert (rows[""].predicted, rows[""].measured_text()) == (79, "79")
    assert (rows["expandable_segments:True"].predicted, rows["expandable_segments:True"].measured_text()) == (95, "95")
    assert [t.user_attrs[R.ATTR_ROLE] for t in study.trials] == ["baseline", "frontier", "baseline", "frontier"]


def test_frontier_probes_are_calibrated_by_the_measured_peak(tmp_path):
    # The prediction underestimates expandable_segments: predicted 9 MiB/sample (frontier 950 // 9 =
    # 105), measured 10 MiB. The probe at 105 measures 1050 MiB: out of memory (> 1000 MiB), so the
    # ratio is at least 1000 / 945 (the whole budget over the prediction); the calibrated frontier is
    # then the largest b with ceil(9 MiB * b * 1000/945) <= 950 MiB -> b = 99 (99 * 9 * 1000/945 =
    # 942.9 MiB; 100 -> 952.4 MiB). 99 -> 990 MiB: ran, over the limit, ratio 990/891 = 10/9 exactly;
    # calibrated frontier = largest b with 10 MiB * b <= 950 MiB = 95: ok; then 96 (the boundary of
    # the leader): over the limit. Measured frontier 95, as the runner's model says.
    search, study, runner = make(tmp_path, n_trials=0)
    search.predictor = FakePredictor(per_expandable=9 * MiB)
    search.run_frontier()
    probes = [c[0] for c in runner.calls if c[1]]
    assert probes == [105, 99, 95, 96]
    row = next(c for c in search.planner.configs if c.alloc_conf)
    assert (row.predicted, row.measured_text()) == (105, "95")


def test_search_range_starts_at_a_quarter_of_the_baseline(tmp_path):
    # Baseline 76 (see above) -> the sampler's batches are drawn from [76 // 4 = 19, 256].
    search, study, runner = make(tmp_path, n_trials=8)
    baseline = search.run_frontier()
    search.run_search(baseline)
    drawn = [t.params["batch_size"] for t in study.trials if t.user_attrs.get(R.ATTR_ROLE) == "search"]
    assert len(drawn) == 8 and min(drawn) >= 19
    search.confirm()  # confirmation of a batch below 19 would still record its own batch
    for t in study.trials:
        if t.user_attrs.get(R.ATTR_ROLE) == "confirm":
            assert t.params["batch_size"] == study.trials[t.user_attrs[R.ATTR_CONFIRMS]].params["batch_size"]


def test_data_loader_settings_are_searchable_and_reach_the_trial(tmp_path):
    seen = []

    class Recording(FakeRunner):
        def run(self, spec, *, workdir):
            seen.append((spec.workload.data or {}).get("num_workers"))
            return super().run(spec, workdir=workdir)

    study = optuna.create_study(direction="maximize",
                                sampler=optuna.samplers.GridSampler({"batch_size": [16], "data.num_workers": [0, 2],
                                                                     "expandable_segments": [False]}))
    space = SearchSpace(8, 64, {"expandable_segments": [False]}, {"num_workers": [0, 2]})
    opts = SearchOptions(workload=replace(FAKE, model={"name": "fake", "data": {"num_workers": 0, "pin_memory": False}}),
                         device="cpu", budget_bytes=BUDGET, search=SearchConf(n_trials=2), trial=TRIAL)
    runner = Recording()
    search = Search(study, space, opts, runner=runner, confirm_runner=runner, workdir=tmp_path)
    search.run_search()
    assert sorted(seen) == [0, 2]
    assert {t.params["data.num_workers"] for t in study.trials} == {0, 2}
    with pytest.raises(ConfigError, match="not a data-loader setting"):
        SearchSpace(8, 64, {}, {"batch_size": [1]})


def test_non_default_settings_must_beat_the_default_by_min_gain(tmp_path):
    # Default fits 79 (948 MiB <= 950 MiB); expandable_segments fits 80 (800 MiB). Throughput = batch:
    # 80 / 79 = +1.3% < 2%: within measurement noise, so the default allocator is the answer.
    search, study, runner = make(tmp_path, low=79, high=80, n_trials=4,
                                 sampler=optuna.samplers.GridSampler({"batch_size": [79, 80],
                                                                      "expandable_segments": [False, True]}))
    search.run_search()
    best, result, confirmed = search.confirm()
    assert best.params == {"batch_size": 79, "expandable_segments": False}


class ScriptedThroughput(FakeRunner):
    """FakeRunner whose confirmation runs (10 steps) measure the scripted throughputs, in order, per
    (batch, alloc_conf): the measured noise the honest ranking must respect."""

    def __init__(self, script):
        super().__init__()
        self.script = {k: list(v) for k, v in script.items()}

    def run(self, spec, *, workdir):
        res = super().run(spec, workdir=workdir)
        key = (spec.batch_size, spec.alloc_conf)
        if spec.measure_steps == 10 and res.outcome == "ok" and self.script.get(key):
            res = replace(res, throughput=replace(res.throughput, samples_per_s=self.script[key].pop(0)))
        return res


def _two_candidates(tmp_path, script):
    # Baseline (default) at 76 (see the first test); a search trial of expandable_segments at 90
    # (900 MiB: feasible). Search-trial throughput = batch, so 90 leads the search phase.
    runner = ScriptedThroughput(script)
    search, study, _ = make(tmp_path, runner=runner)
    search.run_frontier()
    search._run_batch([search.space.candidate(90, {"expandable_segments": True})], "search")
    return search, study, runner


def test_throughput_gain_within_the_measured_noise_is_not_claimed(tmp_path):
    # Confirmation runs: expandable@90 measures 100, 120, 110 (mean 110), the baseline 76 measures 95,
    # 115, 105 (mean 105): 110 > 105 * 1.02, but the ranges overlap (100 < 115): no gain is claimed
    # and the default allocator stays the answer, with the ratio of the confirmation means reported.
    search, study, runner = _two_candidates(tmp_path, {(90, "expandable_segments:True"): [100.0, 120.0, 110.0],
                                                       (76, ""): [95.0, 115.0, 105.0]})
    best, result, confirmed = search.confirm()
    assert best.params == {"batch_size": 76, "expandable_segments": False} and confirmed
    assert search.gain["claimed"] is False and search.gain["throughput_ratio"] == pytest.approx(1.0)
    assert search.gain["winner"]["mean"] == pytest.approx(105.0)


def test_throughput_gain_beyond_the_noise_is_claimed_from_the_confirmation(tmp_path):
    # expandable@90: 130, 134, 132 (mean 132); baseline: 100, 104, 102 (mean 102): 130 > 104 and
    # 132 > 102 * 1.02. The gain is the confirmation means' ratio 132 / 102, not the search trials' 90 / 76.
    search, study, runner = _two_candidates(tmp_path, {(90, "expandable_segments:True"): [130.0, 134.0, 132.0],
                                                       (76, ""): [100.0, 104.0, 102.0]})
    best, result, confirmed = search.confirm()
    assert best.params == {"batch_size": 90, "expandable_segments": True} and confirmed
    assert search.gain["claimed"] is True
    assert search.gain["throughput_ratio"] == pytest.approx(132.0 / 102.0)
    assert result.throughput.samples_per_s == 132.0  # the winner's last confirmation run


def test_batch_at_the_top_of_the_range_is_reported(tmp_path):
    # high = 64: the default fits all of it (64 x 12 MiB = 768 MiB): the answer is the range's top.
    search, study, runner = make(tmp_path, high=64)
    search.opt = replace(search.opt, objective="batch")
    baseline = search.run_frontier()
    best, result, confirmed = search.confirm()
    summary = search.summary(best, result, confirmed, baseline)
    assert best.params["batch_size"] == 64 and summary.at_top_of_range


class StoppingRunner(FakeRunner):
    """A trial with a limit stops once above it (TrialSpec.limit_bytes): here its first step reads
    10 MiB less than its full peak, so a trial whose first step is already above the limit reports
    that reading and stops."""

    def run(self, spec, *, workdir):
        self.limits = getattr(self, "limits", []) + [(spec.measure_steps, spec.limit_bytes)]
        res = super().run(spec, workdir=workdir)
        first = (res.memory.peak_reserved_bytes or 0) - 10 * MiB
        if res.outcome == "ok" and spec.limit_bytes is not None and first > spec.limit_bytes:
            res = replace(res, memory=replace(res.memory, peak_reserved_bytes=first, peak_allocated_bytes=first),
                          stopped_over_limit=StoppedOverLimit(step=1, used_bytes=first, limit_bytes=spec.limit_bytes))
        return res


def test_a_trial_stopped_above_the_limit_bounds_the_calibration_from_below(tmp_path):
    # As test_frontier_probes_are_calibrated_by_the_measured_peak (limit 950 MiB, predicted 9 MiB and
    # measured 10 MiB per sample under expandable_segments), but 99 stops after a first step reading
    # 980 MiB: its full peak is at least that, so 980/891 is a floor of the ratio, not a ratio.
    # Calibrated: largest b with 9 MiB * b * 980/891 <= 950 MiB -> 95 (940.4 MiB; 96 -> 950.3 MiB).
    # 95 (950 MiB, first step 940 MiB: runs every step) ok; 96 (960 MiB, first 950 MiB: not above) over.
    runner = StoppingRunner()
    search, study, _ = make(tmp_path, n_trials=0, runner=runner)
    search.predictor = FakePredictor(per_expandable=9 * MiB)
    search.run_frontier()
    assert [c[0] for c in runner.calls if c[1]] == [105, 99, 95, 96]
    row = next(c for c in search.planner.configs if c.alloc_conf)
    assert row.measured_text() == "95"
    assert row.ratios == [pytest.approx(10 / 9), pytest.approx(10 / 9)]   # 95 and 96 ran every step
    assert row.ratio_floor == pytest.approx(980 / 891)
    stopped = next(t for t in study.trials if t.params["batch_size"] == 99)
    assert stopped.constraints["memory"] == pytest.approx((980 - 950) / 950, rel=1e-3)


def test_probes_carry_the_limit_and_the_confirmation_runs_every_step(tmp_path):
    runner = StoppingRunner()
    search, study, _ = make(tmp_path, n_trials=0, runner=runner)
    search.predictor = FakePredictor()
    search.run_frontier()
    search.confirm()
    limit = int(BUDGET * 0.95)
    assert {lim for steps, lim in runner.limits if steps == 3} == {limit}   # probes (measure_steps 3)
    confirms = [lim for steps, lim in runner.limits if steps == 10]        # confirmations (confirm_steps 10)
    assert confirms and set(confirms) == {None}


def test_frontier_line_says_when_nothing_is_predicted_to_fit():
    from types import SimpleNamespace

    from oomtune.search.frontier import ConfigFrontier, FrontierPlanner
    from oomtune.search.run import _frontier_line

    planner = FrontierPlanner([ConfigFrontier({}, "", None, selected=True)], 8, 512, 950 * MiB, peak=None)
    line = _frontier_line(planner, SimpleNamespace(capture_seconds=1.0, replay_seconds=0.5))
    # a configuration is probed only while it can win: the line says so before naming them
    assert line.endswith("probing (a configuration only while its frontier can beat the largest batch measured "
                         "so far): (default) (none predicted to fit: from batch 8)")
    assert "None" not in line


def _per_sample(conf):
    """10 MiB/sample with expandable_segments, 11 with roundup_power2_divisions:4, else 12."""
    if "expandable_segments:True" in conf:
        return 10 * MiB
    return 11 * MiB if "roundup_power2_divisions:4" in conf else 12 * MiB


class ThreeWayRunner(FakeRunner):
    def run(self, spec, *, workdir):
        self.calls.append((spec.batch_size, spec.alloc_conf, spec.measure_steps))
        peak = spec.batch_size * _per_sample(spec.alloc_conf)
        if peak > spec.budget_bytes:
            return TrialResult(outcome="oom", batch_size=spec.batch_size, alloc_conf=spec.alloc_conf,
                               message="CUDA out of memory")
        return TrialResult(outcome="ok", batch_size=spec.batch_size, alloc_conf=spec.alloc_conf,
                           throughput=Throughput(samples_per_s=float(spec.batch_size)),
                           memory=MemoryReadings(source="simulated", peak_reserved_bytes=peak,
                                                 peak_allocated_bytes=peak))


class ThreeWayPredictor(FakePredictor):
    def peak(self, batch, conf):
        return batch * _per_sample(conf)


def test_batch_objective_with_one_worker_probes_one_at_a_time_and_skips_what_cannot_win(tmp_path):
    # limit 950 MiB. Predicted frontiers: default 950 // 12 = 79, roundup_power2_divisions:4 950 // 11 =
    # 86, expandable_segments 95 (with r2:4 too: the same prediction, folded). One probe at a time:
    # default@79 ok, its boundary default@80 (960 MiB, over the limit), expandable@95 ok, then r2:4's
    # frontier 86 cannot beat the leader's measured 95: never launched; expandable's boundary 96 over.
    # In rounds, r2:4@86 would have run with the first round.
    runner = ThreeWayRunner()
    search, study, _ = make(tmp_path, runner=runner,
                            space={"expandable_segments": [False, True], "roundup_power2_divisions": [None, 4]})
    search.opt = replace(search.opt, objective="batch")
    search.predictor = ThreeWayPredictor()
    search.run_frontier()
    assert [c[:2] for c in runner.calls] == [(79, ""), (80, ""), (95, "expandable_segments:True"),
                                             (96, "expandable_segments:True")]
    r2 = next(c for c in search.planner.configs if c.alloc_conf == "roundup_power2_divisions:4")
    assert r2.selected and r2.predicted == 86 and r2.probes == 0


class DeviceRecorder(ScriptedThroughput):
    """Records the device and time window of each confirmation run (10 steps)."""

    def __init__(self, script):
        super().__init__(script)
        self.confirms: list[tuple[int, str, str, float]] = []

    def run(self, spec, *, workdir):
        if spec.measure_steps == 10:
            self.confirms.append((spec.batch_size, spec.alloc_conf, spec.device, spec.measure_seconds))
        return super().run(spec, workdir=workdir)


def test_throughput_confirmation_interleaves_three_repeats_on_one_gpu_over_time_windows(tmp_path):
    """Before, 2 repeats per side let a 2% gain pass by chance 1 time in 6 (4!/(2!2!) orders of
    4 runs), and grouped runs on different GPUs compare cards, not settings. Now: the baseline and
    the candidate alternate in rotating order (base, cand; cand, base; base, cand), 3 runs each, all
    on the first worker's GPU, each timed over a window of seconds (search.window)."""
    runner = DeviceRecorder({(90, "expandable_segments:True"): [130.0, 134.0, 132.0],
                             (76, ""): [100.0, 104.0, 102.0]})
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=0))
    space = SearchSpace(8, 256, {"expandable_segments": [False, True]})
    opts = SearchOptions(workload=FAKE, device="cuda:0", budget_bytes=BUDGET,
                         search=SearchConf(headroom=0.05, n_trials=0, finalists=1), trial=TRIAL, window_s=4.0)
    search = Search(study, space, opts, runner=runner, confirm_runner=runner, workdir=tmp_path,
                    slots=["cuda:0", "cuda:1"])
    search.run_frontier()
    search._run_batch([search.space.candidate(90, {"expandable_segments": True})], "search")
    best, result, confirmed = search.confirm()
    es = "expandable_segments:True"
    assert [(b, c) for b, c, _, _ in runner.confirms] == [(76, ""), (90, es), (90, es), (76, ""), (76, ""), (90, es)]
    assert {d for _, _, d, _ in runner.confirms} == {"cuda:0"} and {w for *_, w in runner.confirms} == {4.0}
    assert best.params["batch_size"] == 90 and search.gain["claimed"] is True


def test_fewer_than_three_repeats_is_refused():
    from oomtune import config as C
    from oomtune.schema import validate

    cfg = C.compose(["search.repeats=2"])
    with pytest.raises(ConfigError, match=r"search.repeats=2: must be >= 3 \(or 1: one clean run"):
        validate(cfg)
    validate(C.compose(["search.repeats=1"]))     # one clean run: no throughput comparison at all


def test_a_dropped_prediction_bisects_the_default_frontier_past_max_probes():
    """A recording that contradicts the derived stream drops the predictions
    (search/recordings.py ``learn_recording``); the default allocator's frontier must then be
    bisected by trials to ``precision``, as without predictions. Field case: the Lightning example
    at 128 MiB, where the three recordings (8, 16, 32) counted as probes, the probe at its predicted
    frontier 85 (ok, calibrated from its own recording) was the fourth, 170 and 127 failed, and the
    search stopped at 85..126 with no other configuration tried."""
    from oomtune.search.frontier import ConfigFrontier, FrontierPlanner

    default = ConfigFrontier({}, "", 85, predicted_peak_bytes=112 * MiB)
    other = ConfigFrontier({"expandable_segments": True}, "expandable_segments:True", 85,
                           predicted_peak_bytes=112 * MiB)
    planner = FrontierPlanner([default, other], 8, 512, int(128 * MiB * 0.95),
                              peak=lambda b, p: (b * MiB, True), max_probes=6)
    for b in (8, 16, 32):          # the recordings, learnt as the default allocator's probes
        default.record(b, True, ratio=1.0)
        default.probes += 1
    planner.drop_predictions()     # the probe at 85 recorded a stream unlike the derived one ...
    default.record(85, True, ratio=1.0)   # ... and is calibrated from its own recording
    default.probes += 1
    for b in (170, 127):           # then the unpredicted doubling and bisection
        default.record(b, False)
        default.probes += 1
    assert default.probes == 6
    # (85 + 127) // 2: 127 - 85 = 42 > precision 10% of 85 (frontier.py _unpredicted_probe)
    assert planner.next_probe(default) == 106
    assert planner.next_probe(other) is None   # the others wait for the baseline's exact frontier
    default.record(86, False)      # the boundary known to one batch: the baseline is done
    default.probes += 1
    assert default.exact
    assert planner.next_probe(default) is None
    assert planner.next_probe(other) == 86   # the smallest batch above the baseline's largest
