"""``oomtune search ... launcher=local search.workers=2``: two worker jobs, real subprocesses started
through submitit's LocalExecutor (the code path of launcher=slurm), sharing one study on a throwaway
PostgreSQL server (tests/pg_server.py; skipped when it cannot start, except under CI).

The target of the first test is tests/data/sleep_trial.py: each trial sleeps, "runs out of memory"
above batch 48 and reports throughput = batch, so the answer is known by hand: batch 48 under the
default allocator (no setting changes the throughput; the default wins ties, search.min_gain), and
the default allocator's probes are 8, 16, 32, 64 (doubling from search.batch_size.low until the
first failure), then 48, 56, 52 (bisecting 32..64 to search.baseline_precision 0.1 x 48 < 8): the same
probes tests/test_workers_pg.py finds with three processes started by hand.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from pg_server import held_trial
from pg_server import launched_trials as _launched
from pg_server import shared_study, sleep_search_overrides
from pg_server import start_sleep_search as _start


pytest.importorskip("submitit")
pytestmark = pytest.mark.slow

PROBES = [8, 16, 32, 48, 52, 56, 64]


def _overrides(url: str, study: str, run_dir: Path, *extra: str) -> list[str]:
    return sleep_search_overrides(url, study, run_dir, "launcher=local", "search.workers=2", *extra, grace_period_s=3)


def _study(url: str, name: str):
    return shared_study(url, name)


def _check_every_trial_told_once(study, run_dir: Path) -> dict[int, list[Path]]:
    """No trial lost or duplicated: every trial finished; each trial that ran has exactly one
    directory and one run-directory record (tell.json, written before the storage is told) over
    all worker jobs, and that record is what the study holds. Returns trial number -> its dirs."""
    from oomtune.search.workers import ATTR_DUPLICATE_OF

    trials = study.get_trials(deepcopy=False)
    assert not [t.number for t in trials if t.state.name in ("RUNNING", "WAITING")]
    dirs: dict[int, list[Path]] = {}
    for d in (run_dir / "workers").glob("worker-*/trials/trial-*"):
        dirs.setdefault(int(d.name.split("-")[1]), []).append(d)
    assert {n: ds for n, ds in dirs.items() if len(ds) > 1} == {}            # no trial ran in two jobs
    from oomtune.study import records as R

    for t in trials:
        if (ATTR_DUPLICATE_OF in t.user_attrs or R.ATTR_RESULT not in t.user_attrs or R.ATTR_REUSED in t.user_attrs
                or R.ATTR_FROM_RECORDING in t.user_attrs or t.user_attrs.get(R.ATTR_OUTCOME) == "predicted_infeasible"):
            continue   # no trial process: nothing to tell from a run directory
        (d,) = dirs[t.number]
        record = json.loads((d / "tell.json").read_text())
        assert (record["number"], record["trial_id"], record["state"]) == (t.number, t._trial_id, t.state.name)
        assert record["value"] == t.value and record["user_attrs"][R.ATTR_RESULT] == t.user_attrs[R.ATTR_RESULT]
    return dirs


def _jobs_running_a_trial(run_dir: Path, held: bool = False) -> set[str]:
    """The worker jobs (worker-N) with a trial process running: its stdout.txt and no tell.json yet;
    with ``held``, only a trial held by tests/data/sleep_trial.py (its "holding" line printed)."""
    running = [p for p in (run_dir / "workers").glob("worker-*/trials/trial-*/stdout.txt")
               if not (p.parent / "tell.json").exists() and (not held or held_trial(p.parent))]
    return {p.parent.parent.parent.name for p in running}


def test_two_local_worker_jobs_cancelled_by_ctrl_c_resume_to_the_answer_and_tell_every_trial_once(
        pg, tmp_path, monkeypatch):
    # One command run twice: Ctrl-C in the parent while each worker job runs a trial (the jobs and their
    # trial processes are cancelled, the running trials told FAIL), then the same command again, which
    # resumes the study to the answer. What any run of two local worker jobs must leave (one answer
    # written by each job and the parent, every trial told once, each probe once, the jobs' logs and
    # workers/jobs.json, the parent's progress lines) is asserted on the resumed whole; the jobs
    # sharing the work is the first run's precondition (a trial running in each job at once).
    from oomtune.best import load_best
    from oomtune.search.workers import ATTR_DUPLICATE_OF
    from oomtune.study import records as R

    url = pg.create_database()
    run_dir = tmp_path / "run"
    overrides = _overrides(url, "cancel", run_dir)
    # The first run's trials stop before their end while the hold file exists (tests/data/sleep_trial.py),
    # so the trials seen running are still running when the cancel reaches them: Ctrl-C -> the parent ->
    # SIGTERM to each job -> its trials killed takes a second or more on a loaded machine, longer than
    # what is left of a trial seen late in its 3 s.
    hold = tmp_path / "hold"
    monkeypatch.setenv("OOMTUNE_TEST_HOLD_FILE", str(hold))
    proc = _start(overrides, tmp_path / "first", sleep_s=3.0)
    deadline = time.monotonic() + 300
    while len(_jobs_running_a_trial(run_dir)) < 2:   # both jobs have a trial process running
        if time.monotonic() > deadline:
            pytest.fail("the jobs never ran a trial each: " + (tmp_path / "first.err").read_text()[-2000:])
        time.sleep(0.2)
    hold.touch()
    # ... and each job has one held: its end waits for the cancel. A trial that was past its hold check
    # finishes; its job's next trial holds.
    while len(_jobs_running_a_trial(run_dir, held=True)) < 2:
        if time.monotonic() > deadline:
            pytest.fail("the jobs never held a trial each: " + (tmp_path / "first.err").read_text()[-2000:])
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGINT)                                         # Ctrl-C in the parent only
    assert proc.wait(timeout=120) == 130
    err = (tmp_path / "first.err").read_text()
    assert "interrupted: cancelling 2 worker jobs" in err and err.rstrip().endswith("oomtune: interrupted")
    # the jobs and their trial processes are gone
    left = subprocess.run(["pgrep", "-f", str(run_dir)], capture_output=True, text=True).stdout.split()
    assert left == []
    study = _study(url, "cancel")
    trials = study.get_trials(deepcopy=False)
    assert not [t.number for t in trials if t.state.name in ("RUNNING", "WAITING")]
    interrupted = [t for t in trials if t.state.name == "FAIL" and "result" not in t.user_attrs]
    assert len(interrupted) >= 2                                             # each job's running trial
    finished_before = {t.number: t.user_attrs["result"] for t in trials if "result" in t.user_attrs}
    assert not (run_dir / "best.yaml").exists() and not (run_dir / "workers" / "jobs.json").exists()

    hold.unlink()
    monkeypatch.delenv("OOMTUNE_TEST_HOLD_FILE")                             # the resumed run holds nothing
    proc = _start(overrides, tmp_path / "second", sleep_s=0.5)
    assert proc.wait(timeout=900) == 0, (tmp_path / "second.err").read_text()[-3000:]
    err = (tmp_path / "second.err").read_text()
    assert "already finished" in err

    best = load_best(run_dir / "best.yaml").best
    assert (best.batch_size, best.alloc_conf) == (48, "")                    # by hand: module docstring
    # one answer: the run directory's best.yaml is the study's recorded one, as each job wrote it
    text = (run_dir / "best.yaml").read_text()
    assert [(d / "best.yaml").read_text() for d in sorted((run_dir / "workers").glob("worker-*"))] == [text] * 2
    assert len(list(run_dir.rglob("best.yaml"))) == 3 and (run_dir / "report.html").is_file()
    assert not list((run_dir / "workers").glob("worker-*/report.html"))      # the parent writes the report

    study = _study(url, "cancel")
    after = {t.number: t for t in study.get_trials(deepcopy=False)}
    assert all(after[n].user_attrs["result"] == r for n, r in finished_before.items())   # nothing lost
    dirs = _check_every_trial_told_once(study, run_dir)
    assert sorted(t.params["batch_size"] for t in _launched(study, "baseline")) == PROBES  # each probe once
    assert len(_launched(study, "search")) == 4
    # the jobs shared the work: each ran trials
    assert {d[0].parent.parent.name for d in dirs.values()} == {"worker-0", "worker-1"}

    # the workers' logs, named where the user sees them and in workers/jobs.json
    jobs = json.loads((run_dir / "workers" / "jobs.json").read_text())["jobs"]
    assert [j["index"] for j in jobs] == [0, 1] and all(j["exit_code"] == 0 for j in jobs)
    for j in jobs:
        log = Path(j["log"])
        assert f"worker job {j['index']}: pid {j['job_id']}, log {log}" in err
        assert f"oomtune worker job {j['index']} on " in log.read_text()
        assert Path(j["run_dir"]) == (run_dir / "workers" / f"worker-{j['index']}").resolve()
    # the parent's progress: one line per trial that ran while it followed the jobs (the resumed run's
    # trials), as the in-process search prints them
    roles = {t.user_attrs[R.ATTR_ROLE] for t in after.values() if R.ATTR_ROLE in t.user_attrs}
    ran_now = [t for role in roles for t in _launched(study, role)
               if t.number not in finished_before and ATTR_DUPLICATE_OF not in t.user_attrs]
    assert ran_now                                                           # at least the interrupted trials
    for t in ran_now:
        assert f"[trial {t.number}] {t.user_attrs[R.ATTR_ROLE]}" in err
    assert "worker jobs: 2 running" in err and "worker jobs: 2 finished" in err
    out = (tmp_path / "second.out").read_text()
    assert "best: batch 48, the default allocator" in out and f"wrote {run_dir / 'best.yaml'}" in out


def test_a_built_in_model_through_local_jobs(pg, tmp_path, capsys):
    # the brief's workload: a tiny MLP on the virtual GPU (objective batch: frontier probes, confirmation); the
    # budget holds the A100's cuBLAS workspaces (one 20 MiB segment) beside the MLP's 48 MiB. The parent runs in
    # this process (what `oomtune search` runs): its worker jobs, the processes this test is about, are
    # processes of their own all the same (the signals to the parent are the first test's).
    from oomtune.best import load_best
    from oomtune.cli import main

    url = pg.create_database()
    run_dir = tmp_path / "run"
    overrides = ["model=mlp", "model.in_features=1024", "model.hidden=1024", "model.layers=2", "budget=68MiB",
                 "device=cpu", "search.batch_size.low=8", "search.batch_size.high=4096", "trial.timeout=120",
                 "search.heartbeat_interval=1", "search.grace_period=5", f"storage={url}", "study_name=mlp",
                 f"hydra.run.dir={run_dir}", "launcher=local", "search.workers=2",
                 # 4 allocator configurations, not 24: each worker job and the parent predict every
                 # configuration's frontier (a replay each), and the jobs, not the space, are this test's
                 # subject; expandable_segments and roundup_power2_divisions still give the frontier
                 # probes their non-default configurations
                 "search.space.max_split_size_mb=[null]", "search.space.garbage_collection_threshold=[null]"]
    assert main(["search", *overrides]) == 0, capsys.readouterr().err[-3000:]
    best = load_best(run_dir / "best.yaml")
    study = _study(url, "mlp")
    _check_every_trial_told_once(study, run_dir)
    winner = study.trials[best.best.trial_number]
    # the answer is a trial that ran within the limit, confirmed in a clean process of its own
    assert winner.params["batch_size"] == best.batch_size and winner.user_attrs["outcome"] == "ok"
    assert best.best.confirmed and best.best.metrics["peak_reserved_bytes"] <= 0.95 * 68 * 2**20
    assert best.best.metrics["memory_source"] == "simulated"
    # each probe ran once: no two trials that ran share a candidate
    from oomtune.search.workers import ATTR_KEY

    keys = [t.user_attrs[ATTR_KEY] for t in study.trials if "result" in t.user_attrs and ATTR_KEY in t.user_attrs]
    assert len(keys) == len(set(keys))
    for name in ("frontier.yaml", "winner_step.pickle", "report.html", "trials.json"):
        assert (run_dir / name).is_file(), name
    assert [(d / "best.yaml").read_text() for d in sorted((run_dir / "workers").glob("worker-*"))] == \
        [(run_dir / "best.yaml").read_text()] * 2
