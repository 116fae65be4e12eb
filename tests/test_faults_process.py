"""The process / output / snapshot scenarios of the fault table (experiments/_faults_process.py, run by
experiments/faults.py): each runs, returns the table's keys, and shows the behaviour wanted
(no process left, a bounded output, the study resumed).
Every scenario starts real processes (seconds to a minute each): marked slow."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[1] / "experiments" / "_faults_process.py"
KEYS = {"fault", "done", "outcome", "trials_lost", "seconds"}


def _module():
    spec = importlib.util.spec_from_file_location("_faults_process", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_module_lists_its_scenarios():
    names = [name for name, _ in _module().SCENARIOS]
    assert names == ["kill -9 of the search", "kill -9 of a trial", "kill -9 of a rank", "100 MB stderr",
                     "shared-frames snapshot"]
    assert all(callable(fn) for _, fn in _module().SCENARIOS)


def _run(name: str, tmp_path: Path) -> dict:
    fn = dict(_module().SCENARIOS)[name]
    row = fn(tmp_path)
    assert set(row) == KEYS, row
    assert row["seconds"] > 0
    return row


@pytest.mark.slow
def test_kill_rank_leaves_no_rank(tmp_path):
    row = _run("kill -9 of a rank", tmp_path)
    assert "rank 1 ended with the trial; 0 process(es) left" in row["outcome"], row


@pytest.mark.slow
def test_stderr_100mb_keeps_the_run_directory_small(tmp_path):
    row = _run("100 MB stderr", tmp_path)
    assert row["outcome"].startswith("outcomes ok, ok, ok; run directory ")
    size_mib = float(row["outcome"].split("run directory ")[1].split(" MiB")[0])
    assert size_mib < 12      # 3 trials x (1 MiB head + 2 MiB tail), not 300 MiB


@pytest.mark.slow
def test_shared_frames_snapshot_simulates(tmp_path):
    row = _run("shared-frames snapshot", tmp_path)
    assert row["outcome"].startswith("exit 0 in "), row


@pytest.mark.slow
def test_kill_search_leaves_no_trial_and_resumes(tmp_path):
    row = _run("kill -9 of the search", tmp_path)
    assert row["outcome"].startswith("0 trial process(es) left after 2 s; rerun exit 0, resuming:"), row
    assert row["trials_lost"] == 0


@pytest.mark.slow
def test_kill_trial_is_recorded_and_leaves_nothing(tmp_path):
    row = _run("kill -9 of a trial", tmp_path)
    assert "the search went on, exit 0; 0 trial process(es) left" in row["outcome"], row
    assert row["trials_lost"] == 0
