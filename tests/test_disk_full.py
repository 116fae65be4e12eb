"""A full disk in the run directory: one line naming the file, exit 1 with "run the
same command to resume", no temporary file left behind, nothing measured lost.

ENOSPC is simulated in-process where the writes happen (:func:`oomtune.files.write_atomic`'s
``open``: the temporary file is created and partly written, then the write fails as on a full file
system), and, where this machine allows mounting, with a real 1 MiB tmpfs under the run directory
(skipped, saying why, where ``mount`` is not permitted).
"""

from __future__ import annotations

import errno
import io
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from oomtune import files
from oomtune.cli import main
from oomtune.exceptions import DiskFullError

sys.path.insert(0, str(Path(__file__).parent))
from report_run import make_run_dir  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# One sampler trial, no baseline or confirmation, no prediction. What fills the disk is the search's
# own writes (the storage, tell.json, best.yaml, the report), whatever its workload runs: the trial is
# a tiny target=cmd script that writes its result record by hand (the line format of
# oomtune/script_api.py's ``report``; no torch import), spawned (trial.launcher=spawn: no fork server
# importing torch), so a search costs under a CPU-second, not the 5 s of a built-in model's trial.
ONE_TRIAL = ["target=cmd", "trial.launcher=spawn", "device=cpu", "budget=256MiB", "search.objective=throughput",
             "search.n_trials=1", "search.baseline=false", "search.confirm=false", "search.prune=off",
             "trial.soak_steps=0"]
REPORT = """import json, os, sys, time
b = int(sys.argv[1])
stats = {"reserved_bytes.all.peak": b << 20, "allocated_bytes.all.peak": b << 20, "active_bytes.all.peak": b << 20}
line = {"event": "report", "time": time.time(), "samples": b * 4, "seconds": 0.5,
        "memory": {"source": "simulated", "stats": stats}}
with open(os.environ["OOMTUNE_RESULT_FILE"], "a") as f:
    f.write(json.dumps(line) + "\\n")
"""


def _one_trial(tmp_path: Path, run: Path) -> list[str]:
    """The arguments of the one-trial search of the script written in ``tmp_path``, into ``run``."""
    script = tmp_path / "train.py"
    script.write_text(REPORT)
    command = f"{shlex.quote(sys.executable)} {shlex.quote(str(script))} {{batch_size}}"
    return ["search", *ONE_TRIAL, f"target.command='{command}'", f"hydra.run.dir={run}"]


class _FullFile(io.BufferedWriter):
    """A file on a disk with ``room`` bytes left: the write that goes past them raises ENOSPC."""

    def __init__(self, path, room):
        super().__init__(io.FileIO(path, "wb"))
        self.room = room

    def write(self, data):
        if len(data) > self.room:
            super().write(bytes(data[:self.room]))
            self.flush()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return super().write(data)


def _fill(monkeypatch, names, room=1000):
    """Make write_atomic's writes of the files ``names`` fail for lack of space after ``room`` bytes."""
    real_open = open

    def fake_open(path, mode="r", *args, **kwargs):
        name = Path(path).name          # write_atomic's temporary file: NAME.<pid>.tmp
        if "w" in mode and name.endswith(".tmp") and any(name.startswith(f"{n}.") for n in names):
            return _FullFile(path, room)
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(files, "open", fake_open, raising=False)


def _tmp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.endswith(".tmp")]


def test_write_atomic_removes_its_temporary_file_and_keeps_the_old_file(tmp_path, monkeypatch):
    target = tmp_path / "best.yaml"
    target.write_text("old\n")
    _fill(monkeypatch, ["best.yaml"])
    with pytest.raises(DiskFullError) as info:
        files.write_atomic(target, "x" * 5000)
    assert str(info.value) == (f"disk full: cannot write {target} (No space left on device): free space on its "
                               "file system")
    assert target.read_text() == "old\n" and _tmp_files(tmp_path) == []


def test_report_on_a_full_disk_is_one_line_exit_1_and_leaves_no_temporary_file(tmp_path, monkeypatch, capsys):
    run = make_run_dir(tmp_path)
    _fill(monkeypatch, ["report.html"])
    assert main(["report", str(run)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("oomtune: disk full: cannot write ")
    assert f"{run / 'report.html'}" in err and err.rstrip().endswith("then run the same command to resume")
    assert not (run / "report.html").exists() and _tmp_files(tmp_path) == []


def test_plan_yaml_on_a_full_disk_is_disk_full_not_bad_input(tmp_path, monkeypatch):
    from oomtune.plan.feasibility import FeasibilityMap, write_plan

    plan = FeasibilityMap(workload={"name": "mlp"}, device={"kind": "cpu"}, geometry={}, batch_sizes=[8],
                          rows=[], headroom=0.05, limit_bytes=1 << 30)
    _fill(monkeypatch, ["plan.yaml"], room=10)
    with pytest.raises(DiskFullError, match="plan.yaml"):
        write_plan(plan, tmp_path / "plan.yaml")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_search_whose_best_yaml_hits_a_full_disk_stops_in_one_line_and_resumes(tmp_path, monkeypatch, capsys):
    import optuna

    run = tmp_path / "run"
    args = _one_trial(tmp_path, run)
    with monkeypatch.context() as m:
        _fill(m, ["best.yaml"])
        assert main(args) == 1
    err = capsys.readouterr().err
    last = err.rstrip().splitlines()[-1]
    assert last.startswith(f"oomtune: disk full: cannot write {run / 'best.yaml'} (No space left on device)")
    assert last.endswith("run the same command to resume") and "Traceback" not in err
    assert _tmp_files(tmp_path) == [] and not (run / "best.yaml").exists()
    study = optuna.load_study(study_name=__import__("json").loads((run / "run.json").read_text())["study_name"],
                              storage=f"sqlite:///{run / 'study.db'}")
    (trial,) = study.get_trials()
    assert trial.state.name == "COMPLETE" and "result" in trial.user_attrs    # measured, and kept
    assert main(args) == 0                                                   # the same command
    assert "resuming: 1 search trial already finished" in capsys.readouterr().err
    assert len(study.get_trials()) == 1 and (run / "best.yaml").is_file()   # nothing re-run


def _mount_tmpfs(path: Path, size: str) -> str | None:
    """Mount a tmpfs of ``size`` at ``path``; None on success, else why not."""
    if shutil.which("mount") is None:
        return "no mount command"
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                       capture_output=True, text=True)
    return None if r.returncode == 0 else f"mount -t tmpfs is not permitted here: {r.stderr.strip()[:200]}"


@pytest.mark.slow
def test_a_search_on_a_real_full_file_system_says_so_in_one_line(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    why = _mount_tmpfs(disk, "1m")     # room for the study, the trial and best.yaml, not the ~5 MB report
    if why is not None:
        pytest.skip(why)
    try:
        run = disk / "run"
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        out = subprocess.run([sys.executable, "-m", "oomtune", *_one_trial(tmp_path, run)],
                             capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
        assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
        last = out.stderr.rstrip().splitlines()[-1]
        assert last.startswith("oomtune: disk full: cannot write ") and "No space left on device" in last, last
        assert last.endswith("run the same command to resume") and "Traceback" not in out.stderr
        assert _tmp_files(disk) == []
        from oomtune.best import load_best

        assert load_best(run / "best.yaml").best.trial_number == 0   # what fitted was written whole
    finally:
        subprocess.run(["umount", str(disk)], check=False)


@pytest.mark.slow
def test_a_full_disk_while_telling_the_storage_keeps_the_result_and_the_resume_does_not_run_it_again(
        tmp_path, monkeypatch, capsys):
    # The field case: trial-0000/tell.json holds the COMPLETE result, the storage's write of it fails
    # for lack of space (oomtune.study.reconnect turns SQLite's "database or disk is full" into
    # DiskFullError), the worker tells the storage FAIL, the search stops with one line. The same
    # command must tell the storage the result from tell.json, not run the trial again.
    import json

    import optuna

    from oomtune.search import driver
    from oomtune.trial.runner import TrialRunner

    run = tmp_path / "run"
    args = _one_trial(tmp_path, run)
    real_set = driver.set_trial_attrs

    def full(trial, user_attrs, constraints=None):
        if "result" in user_attrs:
            raise DiskFullError("no space left for the storage while trying to set a trial's attributes: "
                                "database or disk is full")
        return real_set(trial, user_attrs, constraints)

    with monkeypatch.context() as m:
        m.setattr(driver, "set_trial_attrs", full)
        assert main(args) == 1
    assert "database or disk is full; then run the same command to resume" in capsys.readouterr().err
    record = json.loads((run / "trials" / "trial-0000" / "tell.json").read_text())
    assert record["state"] == "COMPLETE" and record["user_attrs"]["outcome"] == "ok"
    study = optuna.load_study(study_name=json.loads((run / "run.json").read_text())["study_name"],
                              storage=f"sqlite:///{run / 'study.db'}")
    (first,) = study.get_trials()
    assert first.state.name == "FAIL" and "result" not in first.user_attrs      # the storage says FAIL

    launched = []
    real_run = TrialRunner.run

    def counting(self, spec, **kw):
        launched.append(spec.batch_size)
        return real_run(self, spec, **kw)

    monkeypatch.setattr(TrialRunner, "run", counting)
    assert main(args) == 0                                                     # the same command
    err = capsys.readouterr().err
    assert launched == []                                                      # nothing ran again
    assert "restored the result of trial 0 from" in err and "not run again" in err
    trials = study.get_trials()
    assert [t.state.name for t in trials] == ["FAIL", "COMPLETE"]
    restored = trials[1]
    assert restored.user_attrs["told_from_record"] == 0 and restored.params == first.params
    assert restored.value == record["value"] and restored.user_attrs["result"] == record["user_attrs"]["result"]
    from oomtune.best import load_best

    assert load_best(run / "best.yaml").best.trial_number == 1                 # the restored result answers
    assert main(args) == 0                                                     # and a third run adds nothing
    assert len(study.get_trials()) == 2 and launched == []
