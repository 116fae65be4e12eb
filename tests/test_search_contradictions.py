"""Contradictions are checked, not believed: a crash is run once more, an
infeasible result below a feasible batch of the same configuration is re-run once, a gain is never
claimed for a configuration over itself, and a stray SIGKILL of a baseline trial (a kill -9 from
outside, no OOM killer) leaves its point feasible. The fake runner's memory model is hand-computable:
peak reserved = batch x 12 MiB (default allocator) or 10 MiB (expandable_segments); out of memory
above the 1000 MiB budget; limit 950 MiB (headroom 5%), so the default fits up to batch 79."""

from __future__ import annotations

import sys
from pathlib import Path

import optuna
import pytest

from oomtune.outcome import Outcome
from oomtune.study import records as R
from oomtune.schema import SearchConf, TrialConf
from oomtune.search.driver import Search, SearchOptions
from oomtune.space import SearchSpace
from oomtune.trial.record import MemoryReadings, Throughput, TrialProcess, TrialResult
from oomtune.units import MiB
from oomtune.workload_spec import WorkloadSpec

sys.path.insert(0, str(Path(__file__).parent))
from shared_runs import one_cpu_thread  # noqa: E402

#: The fake workload the fake runners "train" (no target GPU: the runners read none).
FAKE = WorkloadSpec(target={"name": "builtin"}, model={"name": "fake"}, gpu=None)
#: trial.* as these searches had them: 10 confirmation steps, no soak (the fake runners soak nothing).
TRIAL = TrialConf(confirm_steps=10, soak_steps=0)

BUDGET = 1000 * MiB


class Runner:
    """Default 12 MiB/sample, expandable 10 MiB/sample; ``once``: {(batch, conf): outcome} returned the
    first time that candidate runs (a stray event), the memory model afterwards."""

    def __init__(self, once=None):
        self.once = dict(once or {})
        self.calls: list[tuple[int, str]] = []

    def run(self, spec, *, workdir):
        self.calls.append((spec.batch_size, spec.alloc_conf))
        key = (spec.batch_size, spec.alloc_conf)
        if key in self.once:
            outcome = self.once.pop(key)
            return TrialResult(outcome=outcome, batch_size=spec.batch_size, alloc_conf=spec.alloc_conf,
                               message=f"scripted {outcome}", process=TrialProcess(returncode=-9))
        per = 10 * MiB if "expandable_segments:True" in spec.alloc_conf else 12 * MiB
        peak = spec.batch_size * per
        if peak > spec.budget_bytes:
            return TrialResult(outcome="oom", batch_size=spec.batch_size, alloc_conf=spec.alloc_conf,
                               message="CUDA out of memory")
        return TrialResult(outcome="ok", batch_size=spec.batch_size, alloc_conf=spec.alloc_conf,
                           throughput=Throughput(samples_per_s=float(spec.batch_size)),
                           memory=MemoryReadings(source="simulated", peak_reserved_bytes=peak))

    def kill_all(self):
        pass


def _search(tmp_path, runner, *, objective="throughput"):
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=0))
    space = SearchSpace(8, 256, {"expandable_segments": [False, True]})
    opts = SearchOptions(workload=FAKE, device="cpu", budget_bytes=BUDGET,
                         search=SearchConf(headroom=0.05, n_trials=0), trial=TRIAL, objective=objective)
    return Search(study, space, opts, runner=runner, confirm_runner=runner, workdir=tmp_path), study


def _trial(study, batch, conf=""):
    return next(t for t in study.trials if t.params.get("batch_size") == batch
                and t.user_attrs.get(R.ATTR_CONF) == conf and t.user_attrs.get(R.ATTR_ROLE) != "confirm"
                and R.ATTR_RECHECK_OF not in t.user_attrs)


def test_a_crash_is_run_once_more_and_the_second_result_stands(tmp_path):
    # baseline probes without prediction: 8, 16, 32, 64 ok, 128 oom, 96 oom, 80 over the limit, 72, 76 ok;
    # the first run of batch 32 crashes (a kill from outside): run again, ok, and the probing goes on.
    runner = Runner(once={(32, ""): "crash"})
    search, study = _search(tmp_path, runner)
    baseline = search.run_frontier()
    assert runner.calls[:4] == [(8, ""), (16, ""), (32, ""), (32, "")]
    t32 = _trial(study, 32)
    res = R.result_of(t32)
    assert res.outcome == "ok" and res.retried_after.outcome == "crash"
    assert t32.state == optuna.trial.TrialState.COMPLETE and baseline.params["batch_size"] == 76


def test_an_infeasible_result_below_a_feasible_batch_is_rerun_before_it_is_used(tmp_path):
    # A stray host_oom at batch 64 (as SIGKILL was read before): the baseline bisects 48, 56, 60 and
    # stops at 60 (64 - 60 <= 10% of 60). A sampler
    # trial of the same default allocator then passes batch 72: 64 contradicts it and is run again
    # (recheck_of), passes, and the baseline's frontier is probed on from there.
    runner = Runner(once={(64, ""): "host_oom"})
    search, study = _search(tmp_path, runner)
    assert search.run_frontier().params["batch_size"] == 60
    search._run_batch([search.space.candidate(72, {"expandable_segments": False})], "search")
    best, result, confirmed = search.confirm()
    first = _trial(study, 64)
    assert first.user_attrs[R.ATTR_OUTCOME] == "host_oom"
    recheck = [t for t in study.trials if t.user_attrs.get(R.ATTR_RECHECK_OF) == first.number]
    assert len(recheck) == 1 and R.is_feasible_ok(recheck[0]) and recheck[0].params["batch_size"] == 64
    assert recheck[0].user_attrs[R.ATTR_ROLE] == "baseline"
    # probed on from the sampler's 72: 144 oom, 108 oom, 90 oom, 81 over the limit (972 MiB > 950), 76 ok,
    # and 81 - 76 <= 10% of 76 ends the bisection
    base = search.baseline_trial()
    assert base.params["batch_size"] == 76 and base.user_attrs[R.ATTR_ROLE] == "baseline"
    assert confirmed and best.params["batch_size"] == 76
    assert not (search.gain or {}).get("claimed")               # the default allocator over itself


def test_a_gain_is_never_claimed_for_a_configuration_over_itself(tmp_path):
    # The baseline ends at 76 (bisection to 10%); a sampler trial of the default allocator passes 78
    # and leads the ranking (throughput = batch). It is the answer, but no gain over the baseline is
    # claimed: the same allocator configuration (the "33.5x gain of the default over itself").
    runner = Runner()
    search, study = _search(tmp_path, runner)
    assert search.run_frontier().params["batch_size"] == 76
    search._run_batch([search.space.candidate(78, {"expandable_segments": False})], "search")
    best, result, confirmed = search.confirm()
    assert best.params == {"batch_size": 78, "expandable_segments": False} and confirmed
    assert search.gain["claimed"] is False and search.gain["same_configuration"] is True
    from oomtune.search.outputs import summary_lines
    from oomtune.best import Choice

    summary = search.summary(best, result, confirmed, search.baseline_trial())
    lines = summary_lines(summary, Choice(batch_size=78, alloc_conf="", metrics={"memory_source": "simulated",
                          "peak_reserved_bytes": 936 * MiB, "throughput": 78.0}),
                          Choice(batch_size=76, alloc_conf=""), simulated=True, confirm_steps=10, batch_high=256)
    assert "no allocator gain: the answer is the baseline's own configuration (the default allocator) at batch 78" in lines


def test_the_batch_objective_claims_no_batch_gain_over_itself(tmp_path):
    runner = Runner()
    search, study = _search(tmp_path, runner, objective="batch")
    base = search.run_frontier()
    trial = _trial(study, 78) if any(t.params.get("batch_size") == 78 for t in study.trials) else None
    assert trial is None and base.params["batch_size"] == 76
    search._run_batch([search.space.candidate(78, {"expandable_segments": False})], "search")
    best, result, confirmed = search.confirm()
    assert best.params["batch_size"] == 78 and search.gain["claimed"] is False
    assert search.gain["same_configuration"] is True and search.gain["batch_size_ratio"] == pytest.approx(78 / 76)


# ---------------------------------------------------------------- end to end: a stray kill -9
@pytest.mark.slow
def test_a_stray_sigkill_during_the_baseline_does_not_make_the_point_infeasible(tmp_path, monkeypatch):
    from oomtune.search.entry import search
    from oomtune.trial.child import TEST_HOOK_ENV
    from oomtune.trial.oomkill import OomKillWatch
    from oomtune.trial.runner import TrialRunner

    run_dir = tmp_path / "run"
    # The stray kill -9: trial 0's first launch kills itself with SIGKILL before its first step (the
    # documented test hook), so it never writes its record; its second launch runs as it is. A kill from
    # a thread that scanned /proc for the trial's process came too late on a loaded machine.
    killed: list[Path] = []
    run = TrialRunner.run

    def run_killed_once(self, spec, *, workdir, env=None):
        if Path(workdir).name == "trial-0000" and not killed:
            killed.append(Path(workdir))
            env = {**(env or {}), TEST_HOOK_ENV: "signal:9"}
        return run(self, spec, workdir=workdir, env=env)

    monkeypatch.setattr(TrialRunner, "run", run_killed_once)
    # The host's OOM-killer evidence (cgroup counters, kernel log) is the machine's, not the trial's: read
    # as none here, so the SIGKILL is a crash without evidence, whatever else the machine's OOM killer did.
    monkeypatch.setattr(OomKillWatch, "evidence", lambda self, pids: None)
    with one_cpu_thread():   # the smoke test's CPU step on one thread (tests/shared_runs.py)
        path = search(["model=resnet", "model.image_size=32", "model.num_classes=10", "budget=192MiB", "device=cpu",
                       "search.batch_size.low=2", "search.batch_size.high=256", "trial.warmup_steps=1",
                       "trial.measure_steps=3", "trial.confirm_steps=2", "trial.timeout=300",
                       "search.objective=batch", "search.frontier_configs=0",
                       # the killed baseline is the subject: no clean-process confirmation of the winner
                       # (a spawned interpreter less; nothing below reads it)
                       "search.confirm=false", f"hydra.run.dir={run_dir}"])
    assert [d.resolve() for d in killed] == [(run_dir / "trials" / "trial-0000").resolve()], "no trial 0 launched"
    from oomtune import load_best

    best = load_best(path)
    info = __import__("json").loads((run_dir / "run.json").read_text())
    study = optuna.load_study(study_name=info["study_name"], storage=info["storage"])
    first = study.trials[0]
    res = R.result_of(first)
    # the killed run was a crash without OOM-killer evidence, run again: the point is feasible
    assert res.retried_after.outcome == Outcome.CRASH.value
    assert "no evidence of the OOM killer" in res.retried_after.message
    assert res.outcome == "ok" and R.is_feasible_ok(first) and first.user_attrs[R.ATTR_ROLE] == "baseline"
    assert best.baseline is not None and best.baseline.batch_size >= first.params["batch_size"]
    assert best.study["outcomes"].get("host_oom", 0) == 0
