"""When the clean-process confirmations fail: a failure every confirmation repeats stops the search
(exit status 2) after one launch, and a search whose only failures were its confirmations says so,
not "no configuration ran within the budget". Also where the summary says the steps ran (records'
``execution.where``), in-process and for the parent of worker jobs.

The fake runner's memory model is test_search_driver.py's (peak reserved = batch x 12 MiB under the
default allocator, out of memory above the 1000 MiB budget); a confirmation is the run with
``trial.confirm_steps=10`` measured steps (the probes run 3).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import optuna
import pytest

from oomtune.exceptions import OomtuneError
from oomtune.outcome import Outcome
from oomtune.schema import SearchConf, TrialConf
from oomtune.search.driver import RepeatedFault, Search, SearchOptions
from oomtune.search.jobs import study_summary
from oomtune.search.outputs import no_answer_message
from oomtune.search.summary import SearchSummary, steps_ran_on
from oomtune.space import SearchSpace
from oomtune.study import records as R
from oomtune.trial.record import (ExecutionInfo, MemoryReadings, ScriptReports, Throughput, TrialProcess,
                                  TrialResult)
from oomtune.units import MiB
from oomtune.workload_spec import WorkloadSpec

FAKE = WorkloadSpec(target={"name": "builtin"}, model={"name": "fake"}, gpu=None)
TRIAL = TrialConf(warmup_steps=1, measure_steps=3, confirm_steps=10, soak_steps=0)
BUDGET = 1000 * MiB
#: the line oomtune's integrations write when the training ends before the trial's steps
#: (oomtune/integrations/_session.py), as the cmd target classifies it (exit status 2: the message)
SHORT = ("exited with status 2: oomtune: lightning: training ended after 4 optimizer step(s), before the 11 "
         "the trial needs (1 warm-up + 10 measured); give it more data or steps")


class Runner:
    """Probes (3 measured steps) pass while they fit the budget; a confirmation (10 steps) ends as
    ``confirm`` says: ``"usage"`` exit status 2 with :data:`SHORT`, ``"crash"`` exit status 1."""

    def __init__(self, confirm: str, where: str | None = None):
        self.confirm, self.where = confirm, where
        self.calls: list[tuple[int, int]] = []

    def run(self, spec, *, workdir):
        b = spec.batch_size
        self.calls.append((b, spec.measure_steps))
        peak = b * 12 * MiB
        if peak > spec.budget_bytes:
            return TrialResult(outcome="oom", batch_size=b, alloc_conf=spec.alloc_conf, message="CUDA out of memory",
                               execution=ExecutionInfo(where=self.where))
        if spec.measure_steps == TRIAL.confirm_steps:
            if self.confirm == "usage":
                return TrialResult(outcome="error", batch_size=b, alloc_conf=spec.alloc_conf, message=SHORT,
                                   process=TrialProcess(returncode=2))
            return TrialResult(outcome="error", batch_size=b, alloc_conf=spec.alloc_conf,
                               message="exited with status 1 without a result record",
                               process=TrialProcess(returncode=1))
        return TrialResult(outcome="ok", batch_size=b, alloc_conf=spec.alloc_conf,
                           throughput=Throughput(samples_per_s=float(b)), execution=ExecutionInfo(where=self.where),
                           memory=MemoryReadings(source="simulated", peak_reserved_bytes=peak,
                                                 peak_allocated_bytes=peak))

    def kill_all(self):
        pass

    def close(self):
        pass


def _search(tmp_path: Path, runner: Runner, *, low=8, high=32) -> tuple[Search, optuna.Study]:
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=0))
    space = SearchSpace(low, high, {"expandable_segments": [False]})
    opts = SearchOptions(workload=FAKE, device="cpu", budget_bytes=BUDGET, objective="batch",
                         search=SearchConf(headroom=0.05, n_trials=0), trial=TRIAL)
    return Search(study, space, opts, runner=runner, confirm_runner=runner, workdir=tmp_path), study


def test_a_confirmation_failure_every_confirmation_repeats_stops_the_search_after_one_launch(tmp_path):
    # batch 8, 16, 32 fit (32 x 12 MiB = 384 MiB < 950 MiB): the batch objective confirms 32 first.
    # Its confirmation exits 2 with the integration's own line: the confirmation of 16 (and 8) would run
    # the same 10 steps and end the same way, so the search stops there (RepeatedFault: exit status 2).
    runner = Runner("usage")
    search, study = _search(tmp_path, runner)
    search.run_frontier()
    with pytest.raises(RepeatedFault) as caught:
        search.confirm()
    assert isinstance(caught.value, OomtuneError)   # the CLI's one line and exit status 2 (oomtune/cli.py)
    assert [c for c in runner.calls if c[1] == 10] == [(32, 10)]   # one confirmation, at the top batch
    text = str(caught.value)
    assert "every confirmation would repeat" in text and "give it more data or steps" in text
    assert "batch 32" in text and "trial.confirm_steps=10" in text and "trial.measure_steps=3" in text
    stopped = [t for t in study.trials if t.user_attrs.get(R.ATTR_ROLE) == "confirm"]
    assert len(stopped) == 1 and stopped[0].state == optuna.trial.TrialState.FAIL


def test_a_search_whose_only_failures_are_its_confirmations_says_so(tmp_path):
    # Every probe passes (8, 16, 32); each confirmation exits 1 (not a failure every configuration repeats),
    # so the batch objective tries its three candidates (32, 16, 8) and none is confirmed.
    runner = Runner("crash")
    search, study = _search(tmp_path, runner)
    baseline = search.run_frontier()
    best, result, confirmed = search.confirm()
    assert best is None and not confirmed
    assert [c for c in runner.calls if c[1] == 10] == [(32, 10), (16, 10), (8, 10)]
    summary = search.summary(best, result, confirmed, baseline)
    first = min(t.number for t in study.trials if t.user_attrs.get(R.ATTR_ROLE) == "confirm")
    text = no_answer_message(summary, Path("runs/x/trials.json"))
    assert not text.startswith("no configuration ran within the budget")
    assert text.startswith("the confirmations failed: 3 trial(s) ran within the limit")
    assert f"the first, trial {first} (batch 32, default allocator), was error: exited with status 1" in text
    assert "trial.confirm_steps=10" in text and "(3 run(s))" in text


def test_without_any_trial_within_the_budget_the_old_line_stands(tmp_path):
    # batch 128 and up need more than the budget: nothing fits, no confirmation ran.
    runner = Runner("crash")
    search, study = _search(tmp_path, runner, low=128, high=256)
    baseline = search.run_frontier()
    summary = search.summary(*search.confirm(), baseline)
    assert summary.confirm_failed is None
    assert no_answer_message(summary, Path("t.json")).startswith("no configuration ran within the budget")


def _told(study: optuna.Study, result: TrialResult, role: str = "baseline") -> None:
    trial = study.ask()
    trial.set_user_attr(R.ATTR_ROLE, role)
    trial.set_user_attr(R.ATTR_RESULT, result.to_dict())
    trial.set_user_attr(R.ATTR_OUTCOME, result.outcome.value)
    study.tell(trial, 1.0 if result.outcome is Outcome.OK else 0.0)


def _ok(where: str | None, *, reports: int | None = None) -> TrialResult:
    return TrialResult(outcome="ok", batch_size=8, execution=ExecutionInfo(where=where),
                       script=ScriptReports(reports=reports), throughput=Throughput(samples_per_s=1.0),
                       memory=MemoryReadings(source="simulated", peak_reserved_bytes=MiB, peak_allocated_bytes=MiB))


def test_a_command_that_failed_before_its_first_report_does_not_say_where_steps_ran():
    # two meta trials that reported, and a command's trial that failed before any report; its record
    # (as written before targets/cmd.py kept None there) says cpu: unknown, so the summary says meta, not mixed.
    study = optuna.create_study(direction="maximize")
    _told(study, _ok("meta", reports=1))
    _told(study, _ok("meta", reports=1))
    failed = TrialResult(outcome="error", batch_size=8, message="exited with status 1 without a result record",
                         execution=ExecutionInfo(where="cpu"), script=ScriptReports(reports=0))
    _told(study, failed)
    assert steps_ran_on(study.get_trials(), "cpu") == "meta"
    # a record without execution.where is unknown too; nothing known: the requested mode
    only = optuna.create_study(direction="maximize")
    _told(only, replace(failed, execution=ExecutionInfo(where=None)))
    assert steps_ran_on(only.get_trials(), "meta") == "meta"


def test_the_parent_of_worker_jobs_says_where_the_records_say_the_steps_ran():
    # A job's summary said "meta" (its own view, or trial.execute=meta as asked); the study's records
    # say the steps ran on the CPU (a command without an integration): the parent's summary says cpu.
    study = optuna.create_study(direction="maximize")
    _told(study, _ok("cpu", reports=1))
    _told(study, _ok("cpu", reports=1))
    job = SearchSummary(best=None, best_result=None, confirmed=False, baseline=None, execute="meta")
    parent = study_summary(job, study.get_trials(), confirm_steps=10)
    assert parent.execute == "cpu"
    assert parent.outcomes == {"ok": 2} and parent.launches == 2


@pytest.mark.slow
def test_end_to_end_a_command_whose_confirmation_exits_2_stops_the_search_with_its_line(tmp_path, capsys):
    # A command (no torch import) that reports for the probes' 1 measured step and, for the confirmation's
    # 10, writes an integration's line and exits 2 (as oomtune/integrations/_session.py's fail does).
    import json
    import shlex
    import sys
    import textwrap

    from oomtune.cli import main

    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import json, os, sys, time
        b = int(sys.argv[1])
        if int(os.environ["OOMTUNE_MEASURE_STEPS"]) > 1:
            sys.stderr.write("oomtune: lightning: training ended after 4 optimizer step(s), before the 11 the "
                             "trial needs (1 warm-up + 10 measured); give it more data or steps\\n")
            sys.exit(2)
        mib = 1 << 20
        stats = {"reserved_bytes.all.peak": b * mib, "allocated_bytes.all.peak": b * mib,
                 "active_bytes.all.peak": b * mib}
        line = {"event": "report", "time": time.time(), "samples": b, "seconds": 0.5,
                "memory": {"source": "simulated", "stats": stats}}
        with open(os.environ["OOMTUNE_RESULT_FILE"], "a") as f:
            f.write(json.dumps(line) + "\\n")
    """))
    cmd = f"{shlex.quote(sys.executable)} {shlex.quote(str(script))}"
    run = tmp_path / "run"
    code = main(["search", "target=cmd", "device=cpu", "budget=64MiB", "search.batch_size.low=4",
                 "search.batch_size.high=32", "trial.warmup_steps=1", "trial.measure_steps=1",
                 "trial.confirm_steps=10", "trial.execute=cpu", "trial.timeout=30",
                 "search.space.expandable_segments=[false]", "search.space.max_split_size_mb=[null]",
                 "search.space.roundup_power2_divisions=[null]", "search.space.garbage_collection_threshold=[null]",
                 f"target.command='{cmd} {{batch_size}}'", f"hydra.run.dir={run}"])
    captured = capsys.readouterr()
    text = " ".join((captured.out + captured.err).split())
    assert code == 2, text
    assert "every confirmation would repeat" in text and "give it more data or steps" in text
    name = json.loads((run / "run.json").read_text())["study_name"]
    trials = optuna.load_study(study_name=name, storage=f"sqlite:///{run / 'study.db'}").get_trials()
    confirms = [t for t in trials if t.user_attrs.get(R.ATTR_ROLE) == "confirm"]
    assert [t.params["batch_size"] for t in confirms] == [32]   # batch 16 was not confirmed after it
