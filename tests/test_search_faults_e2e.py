"""Trial faults that must not take the search down, end to end on the CPU with tiny ``target=cmd``
scripts (no torch import in them; short timeouts): a malformed result record, a command that hangs,
``search.timeout`` ending the search.

The scripts write the results channel by hand, as a user's script that bypasses
:func:`oomtune.report` would (the line format of oomtune/script_api.py's ``report``).
"""

from __future__ import annotations

import json
import shlex
import sys
import textwrap
from pathlib import Path

import optuna
import pytest

from oomtune.cli import main

pytestmark = pytest.mark.slow
PY = shlex.quote(sys.executable)
# two allocator configurations: the default and max_split_size_mb:64
TWO_CONFIGS = ["search.space.expandable_segments=[false]", "search.space.max_split_size_mb=[null,64]",
               "search.space.roundup_power2_divisions=[null]", "search.space.garbage_collection_threshold=[null]"]
COMMON = ["target=cmd", "device=cpu", "budget=64MiB", "search.batch_size.low=4", "search.batch_size.high=32",
          "trial.measure_steps=1", *TWO_CONFIGS]
# Where the fault is in what the script reports or prints, its trials are spawned: a script server
# (oomtune/trial/script_fork.py, the default launcher on Linux) costs seconds of CPU to start, and
# that a forked script exits, prints and fails as python runs it is tests/test_script_fork.py's.
# The hangs keep the default launcher: a forked script past trial.timeout is killed there.
SPAWNED = ["trial.launcher=spawn"]

REPORT = """
    import json, os, sys, time
    b = int(sys.argv[1])
    time.sleep(float(sys.argv[2]) if len(sys.argv) > 2 else 0.0)
    mib = 1 << 20
    line = {"event": "report", "time": time.time(), "samples": SAMPLES, "seconds": 0.5,
            "memory": {"source": "simulated", "stats": {"reserved_bytes.all.peak": b * mib,
                       "allocated_bytes.all.peak": b * mib, "active_bytes.all.peak": b * mib}}}
    with open(os.environ["OOMTUNE_RESULT_FILE"], "a") as f:
        f.write(json.dumps(line) + "\\n")
"""


def _script(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return f"{PY} {shlex.quote(str(path))}"


def _study(run: Path) -> optuna.Study:
    name = json.loads((run / "run.json").read_text())["study_name"]
    return optuna.load_study(study_name=name, storage=f"sqlite:///{run / 'study.db'}")


def test_a_malformed_record_fails_its_trial_and_the_search_completes(tmp_path, capsys):
    # the field report: "samples": "lots" (here from batch 16 up, so that smaller batches can answer)
    cmd = _script(tmp_path, "train.py", REPORT.replace("SAMPLES", '"lots" if b >= 16 else b * 4'))
    run = tmp_path / "run"
    args = ["search", *COMMON, *SPAWNED, f"target.command='{cmd} {{batch_size}}'", "trial.timeout=30",
            f"hydra.run.dir={run}"]
    assert main(args) == 0
    trials = _study(run).get_trials()
    bad = [t for t in trials if t.user_attrs.get("outcome") == "bad_record"]
    assert bad and all(t.params["batch_size"] >= 16 and t.state.name == "FAIL" for t in bad)
    message = bad[0].user_attrs["result"]["message"]
    assert "samples='lots' is not a finite number >= 0" in message and '"samples": "lots"' in message
    assert all(t.user_attrs.get("outcome") for t in trials)           # no interrupted trial
    assert (run / "best.yaml").is_file()
    # a re-run is a resume, not a crash: nothing is run again
    assert main(args) == 0
    assert len(_study(run).get_trials()) == len(trials)


def test_a_command_that_hangs_is_waited_for_once_not_once_per_configuration(tmp_path, capsys):
    cmd = _script(tmp_path, "hang.py", "import time\ntime.sleep(600)\n")
    run = tmp_path / "run"
    # trial.execute=cpu: every trial runs the command's steps (with meta steps its one-step smoke test
    # meets the hang first and ends the search: test_a_command_that_hangs_in_its_smoke_test_ends_the_search_in_one_line)
    code = main(["search", *COMMON, f"target.command='{cmd} {{batch_size}}'", "trial.timeout=2", "trial.execute=cpu",
                 f"hydra.run.dir={run}"])
    captured = capsys.readouterr()
    err = " ".join((captured.out + captured.err).split())
    assert code == 1                                                   # nothing fitted: SetupFault
    (trial,) = _study(run).get_trials()                                # one wait of 2 s, not one per configuration
    assert trial.user_attrs["outcome"] == "timeout" and trial.params["batch_size"] == 4
    assert ("the command hung: the default allocator's trial at batch 4 ran past trial.timeout=2 s (trial 0); a hang "
            "is not an allocator's doing, so no other configuration was run at batch 4 or above") in err


def test_a_command_that_hangs_in_its_smoke_test_ends_the_search_in_one_line(tmp_path, capsys):
    cmd = _script(tmp_path, "hang.py", "import time\ntime.sleep(600)\n")
    run = tmp_path / "run"
    code = main(["search", *COMMON, f"target.command='{cmd} {{batch_size}}'", "trial.timeout=2",
                 f"hydra.run.dir={run}"])
    captured = capsys.readouterr()
    err = " ".join((captured.out + captured.err).split())
    assert code == 1                                                   # nothing can run: a setup fault, one line
    assert ("the workload fails on the CPU at batch 4 (the smoke test: one real step, default allocator): timeout: "
            "trial exceeded its 2 s limit") in err
    (trial,) = _study(run).get_trials()                                # the baseline's probe, then the smoke test
    assert trial.user_attrs["outcome"] == "timeout" and trial.params["batch_size"] == 4


def test_search_timeout_says_it_ended_the_search_and_names_the_untried_configurations(tmp_path, capsys):
    # every trial takes 1.2 s > search.timeout: the sampler's first trial, if any, ends the phase. Whether
    # that one starts is not guaranteed: search.timeout counts from the phase's start, before its first
    # read of the study, which can itself take the whole second on a loaded machine (no sampler trial
    # then, and the summary says 0 of 12)
    cmd = _script(tmp_path, "slow.py", REPORT.replace("SAMPLES", "b * 4"))
    run = tmp_path / "run"
    assert main(["search", *COMMON, *SPAWNED, f"target.command='{cmd} {{batch_size}} 1.2'",
                 "search.objective=throughput",
                 "search.n_trials=12", "search.timeout=1", "search.confirm=false",
                 "search.space.max_split_size_mb=[null,64,256]", "trial.timeout=30", f"hydra.run.dir={run}"]) == 0
    out = " ".join(capsys.readouterr().out.split())                    # the summary, unwrapped
    trials = _study(run).get_trials()
    ran = sum(1 for t in trials if t.user_attrs.get("role") == "search")
    assert ran <= 1                                                    # none started after the deadline
    tried = {t.user_attrs.get("alloc_conf") or "" for t in trials}
    untried = [short for conf, short in (("", "default"), ("max_split_size_mb:64", "ms:64"),
                                         ("max_split_size_mb:256", "ms:256")) if conf not in tried]
    assert untried                                                     # 3 configurations, at most 2 tried
    assert (f"no verdict on the allocator settings: search.timeout=1 s ended the search after {ran} of 12 sampler "
            f"trials: {len(untried)} of 3 allocator configurations were never tried ({', '.join(untried)})") in out
    assert "no allocator gain" not in out and "the default allocator won" not in out


# ---------------------------------------------------------------- failures every configuration repeats
def _run(tmp_path: Path, cmd: str, run: Path, capsys) -> tuple[int, str]:
    code = main(["search", *COMMON, *SPAWNED, f"target.command='{cmd} {{batch_size}}'", "trial.timeout=30",
                 f"hydra.run.dir={run}"])
    captured = capsys.readouterr()
    return code, " ".join((captured.out + captured.err).split())


def test_a_command_that_never_reports_stops_after_one_trial_with_the_callback_hint_and_reruns_once_fixed(
        tmp_path, capsys):
    # e.g. a Lightning script that does not pass OomtuneCallback: it trains and exits 0, never reporting.
    # The fix here is outside the script (a file it reads), so the study name (which digests the
    # script's text: a changed script is another study) stays the same and the resumed study is read.
    script = tmp_path / "train.py"
    flag = tmp_path / "callback_added"
    report = textwrap.indent(textwrap.dedent(REPORT.replace("SAMPLES", "b * 4")), "    ")
    script.write_text(f"import os\nif not os.path.exists({str(flag)!r}):\n    print('training done')\n"
                      f"else:\n{report}")
    cmd, run = f"{PY} {shlex.quote(str(script))}", tmp_path / "run"
    code, text = _run(tmp_path, cmd, run, capsys)
    assert code == 2
    assert len(_study(run).get_trials()) == 1                          # found after the first trial
    assert ("oomtune: error: trial 0 (batch 4, default allocator) failed in a way every allocator configuration "
            "would repeat, so the search stops: the command never called oomtune.report()") in text
    assert "callbacks=[OomtuneCallback()]" in text and f"{run}/trials/trial-0000/stderr.txt" in text
    # fixed, the same command runs that candidate again (its failure is no result)
    flag.write_text("yes\n")
    code, text = _run(tmp_path, cmd, run, capsys)
    assert code == 0
    first = [t for t in _study(run).get_trials() if t.params.get("batch_size") == 4 and not t.user_attrs.get("alloc_conf")]
    assert [t.user_attrs["outcome"] for t in first if t.user_attrs.get("role") == "baseline"] == ["error", "ok"]


@pytest.mark.parametrize("body, line", [
    # an integration's usage error: oomtune/integrations/_session.py fail() prints one line and exits 2
    ("import sys\nprint('oomtune: training ended after 3 optimizer steps, before the 4 the trial needs', "
     "file=sys.stderr)\nsys.exit(2)\n",
     "exited with status 2: oomtune: training ended after 3 optimizer steps, before the 4 the trial needs"),
    # argparse's usage error: ArgumentParser.error exits 2 with "PROG: error: MESSAGE" (Lib/argparse.py)
    ("import argparse\np = argparse.ArgumentParser(prog='train.py')\np.add_argument('--bs', type=int)\np.parse_args()\n",
     "exited with status 2: train.py: error: unrecognized arguments: 4"),
    # an import crash: the traceback's last line
    ("import oomtune_no_such_module_xyz\n", "ModuleNotFoundError: No module named 'oomtune_no_such_module_xyz'"),
])
def test_a_hidden_cause_is_shown_on_the_console_and_stops_the_search_after_one_trial(tmp_path, capsys, body, line):
    cmd, run = _script(tmp_path, "train.py", body), tmp_path / "run"
    code, text = _run(tmp_path, cmd, run, capsys)
    assert code == 2
    (trial,) = _study(run).get_trials()
    assert trial.user_attrs["outcome"] == "error" and trial.user_attrs["result"]["message"].endswith(line)
    assert f"[trial 0] baseline bs=4 default error {trial.user_attrs['result']['message']}" in text   # with its outcome
    assert f"so the search stops: {trial.user_attrs['result']['message']}" in text
