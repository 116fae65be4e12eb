"""The progress bar tells the wait: the running trial's role, its step and an
estimate of the rest from the steps measured so far, read from the progress record the trial
process rewrites after each step.

Expected values: hand arithmetic on the records written here (mean step time x steps left).
"""

from __future__ import annotations

import io
import os

import pytest
from rich.console import Console

from oomtune.display import SearchProgress, running_description
from oomtune.trial.record import PROGRESS_FILE, read_progress, read_progress_record, write_progress


def test_the_description_names_role_step_and_what_is_left():
    # 6 of 10 steps at 42.5 s each: 4 x 42.5 = 170 s = 2m50s left
    record = {"steps_done": 6, "steps_total": 10, "step_s": 42.5, "phase": "steps"}
    assert running_description("confirm", 493, "es:T", record) == "confirm bs=493 es:T 6/10 steps ~2m50s left"
    assert running_description("baseline", 352, "default", None) == "baseline bs=352 default starting"
    first = {"steps_done": 0, "steps_total": 4, "step_s": None, "phase": "steps"}
    assert running_description("frontier", 8, "es:T", first) == "frontier bs=8 es:T 0/4 steps"
    soak = {"steps_done": 4, "steps_total": 4, "step_s": 0.5, "phase": "soak"}
    assert running_description("confirm", 8, "default", soak) == "confirm bs=8 default soak"
    hours = {"steps_done": 1, "steps_total": 11, "step_s": 400.0, "phase": "steps"}   # 4000 s = 1h06m
    assert running_description("confirm", 8, "default", hours) == "confirm bs=8 default 1/11 steps ~1h06m left"


def test_the_progress_record_round_trips_and_old_records_still_read(tmp_path):
    path = tmp_path / PROGRESS_FILE
    write_progress(path, 3, 10, step_s=1.25)
    assert read_progress_record(path) == {"steps_done": 3, "steps_total": 10, "step_s": 1.25, "phase": "steps"}
    assert read_progress(path) == (3, 10)
    path.write_text('{"steps_done": 2, "steps_total": 4}')    # written before step_s and phase
    assert read_progress_record(path) == {"steps_done": 2, "steps_total": 4, "step_s": None, "phase": "steps"}
    assert read_progress_record(tmp_path / "absent.json") is None


class _Runner:
    """Writes a progress record in the trial's directory and reads the bar's description meanwhile."""

    def __init__(self, progress: SearchProgress):
        self.progress, self.seen = progress, []

    def run(self, spec, *, workdir, env=None):
        os.makedirs(workdir, exist_ok=True)
        write_progress(os.path.join(workdir, PROGRESS_FILE), 2, 5, step_s=3.0)
        self.seen.append(self.progress.describe_running())
        return "result"


class _Spec:
    batch_size, alloc_conf = 64, "expandable_segments:True"


@pytest.mark.parametrize("terminal", [True, False])
def test_the_bar_shows_the_running_trial_from_its_progress_record(tmp_path, terminal):
    out = io.StringIO()
    progress = SearchProgress(Console(file=out, force_terminal=terminal, width=200), 0)
    progress.role_of = lambda: "confirm"
    inner = _Runner(progress)
    runner = progress.wrap(inner)
    try:
        assert runner.run(_Spec(), workdir=tmp_path / "trial-0004") == "result"
    finally:
        progress.close()
    if terminal:   # 3 steps left at 3 s each
        assert inner.seen == ["confirm bs=64 es:T 2/5 steps ~9s left"]
        assert progress.describe_running() == "between trials"
    else:          # no live bar in a log: nothing is tracked
        assert inner.seen == ["between trials"]


def test_a_trial_process_records_its_mean_step_time_and_the_soak(tmp_path, monkeypatch):
    from oomtune.trial import child
    from oomtune.trial.record import TrialSpec

    for name in child.ALLOC_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(child, "_progress_path", tmp_path / PROGRESS_FILE)
    wl = {"name": "resnet", "depth": 18, "image_size": {"sizes": [24, 32], "seed": 0}, "num_classes": 10,
          "optimizer": "sgd"}
    spec = TrialSpec(workload=wl, batch_size=4, device="cpu", budget_bytes=256 << 20, device_memory_bytes=1 << 33,
                     warmup_steps=1, measure_steps=2, soak_steps=10, execute="meta")
    r = child.run_child(spec)
    assert r.outcome == "ok", r.message
    record = read_progress_record(tmp_path / PROGRESS_FILE)
    assert record["steps_done"] == record["steps_total"] == 3 and record["phase"] == "soak"
    assert record["step_s"] > 0
