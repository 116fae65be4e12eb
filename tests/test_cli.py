"""The command line: bad input is one line on stderr and exit code 2; help and version work."""

from __future__ import annotations

import subprocess
import sys

import pytest

from oomtune.cli import main


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "oomtune", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args, needle", [
    (["search", "model=nope"], "there is no 'nope' in the config group 'model'"),
    (["search", "budget=1PiB", "device=cpu"], "invalid size"),
    (["search", "budget=100GiB", "device=cpu", "virtual_device_memory=80GiB"], "above"),
    (["search", "device=cpu", "search.space.max_split_size_mb=[5]"], "max_split_size_mb"),
    (["search", "device=cpu", "search.space.expandable_segments=[true]", "search.space.garbage_collection_threshold=[1.5]"],
     "garbage_collection_threshold"),
    (["search", "device=cuda:7"], "cuda:7"),
    (["search", "search.sampler=nope", "device=cpu"], "unknown sampler"),
    (["search", "search.n_trials=abc"], "could not be converted to Integer"),
    (["search", "search.space=garbage"], "search.space=garbage"),
    (["search", "trial=garbage"], "trial=garbage"),
    (["search", "budget=${foo}"], "Interpolation key 'foo' not found"),
    (["search", "search.batch_size.low=8.5"], "search.batch_size.low=8.5"),
    (["search", "search.seed=-1"], "search.seed"),
    (["search", "search.timeout=-1"], "search.timeout"),
    (["search", "trial.timeout=0"], "trial.timeout"),
    (["search", "trial.measure_steps=0"], "trial.measure_steps"),
    (["search", "trial.launcher=foo"], "trial.launcher"),
    (["search", "search.prune_margin=-1"], "search.prune_margin"),
    (["search", "device=cpu", "budget=1.5"], "ambiguous"),
    (["search", "device=cpu", "budget=0"], "budget '0' must be > 0: give a size such as budget=16GiB, or a "
                                             "fraction of the device in (0, 1] such as budget=0.9"),
    (["search", "device=cpu", "model.gpu=x9000"], "model.gpu='x9000': unknown GPU"),
    (["plan", "device=cpu", "model.gpu=sm"], "model.gpu='sm': unknown GPU"),
    (["search", "device=cpu", "search.space.backend=[native,cudaMallocAsync]"], "cudaMallocAsync needs a CUDA device"),
    (["search", "search.space.max_split_size_mb=[null,64,]"], "search.space.max_split_size_mb"),
    (["env", "/nonexistent/best.yaml"], "cannot read"),
    (["show", "--storage", "sqlite:///:memory:", "--study", "nope"], "does not exist"),
])
def test_bad_input_exits_2_with_one_line(args, needle, tmp_path, capsys):
    code = main(args + ([f"hydra.run.dir={tmp_path}/run"] if args[0] == "search" else []))
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.startswith("oomtune: error: ") and needle in err
    assert len(err.splitlines()) == 1


@pytest.mark.parametrize("override, line", [
    ("serch.n_trials=3", "oomtune: error: unknown config key 'serch.n_trials'; did you mean 'search.n_trials'?"),
    ("search.n_trialz=3", "oomtune: error: unknown config key 'search.n_trialz'; did you mean 'search.n_trials'?"),
    ("trial.confirm_step=3", "oomtune: error: unknown config key 'trial.confirm_step'; did you mean 'trial.confirm_steps'?"),
    ("hydra.run.dri=x", "oomtune: error: unknown config key 'hydra.run.dri'; did you mean 'hydra.run.dir'?"),
    ("serch.data.bogus=1", "oomtune: error: unknown config key 'serch.data.bogus': search.data has num_workers, "
                           "pin_memory, prefetch_factor"),
])
def test_typo_in_a_key_names_the_closest_key_before_any_trial(override, line, tmp_path, capsys):
    # conf/config.yaml has search.n_trials, trial.confirm_steps, search.data.{num_workers,pin_memory,
    # prefetch_factor}; Hydra's run node has hydra.run.dir
    run_dir = tmp_path / "run"
    assert main(["search", "model=resnet", override, f"hydra.run.dir={run_dir}"]) == 2
    assert capsys.readouterr().err.strip() == line
    assert not run_dir.exists()  # refused while composing the config: no study, no trial


@pytest.mark.parametrize("built, pure, status", [
    (True, None, "compiled (oomtune.alloc._fastcore), in use"),
    (True, "1", "compiled, but disabled by OOMTUNE_PURE_PYTHON=1: the pure-Python simulator runs (slower)"),
    (False, None, "not built: the pure-Python simulator runs (slower)"),
])
def test_env_without_best_yaml_says_which_replay_core_runs(built, pure, status, monkeypatch, capsys):
    from oomtune.alloc import _compiled

    monkeypatch.setattr(_compiled, "_fastcore", object() if built else None)
    if pure is None:
        monkeypatch.delenv("OOMTUNE_PURE_PYTHON", raising=False)
    else:
        monkeypatch.setenv("OOMTUNE_PURE_PYTHON", pure)
    assert main(["env"]) == 0
    out = capsys.readouterr().out.replace("\n  ", " ")   # one wrapped line joined again
    line = next(x for x in out.splitlines() if x.startswith("replay core: "))
    assert line.startswith(f"replay core: {status}")
    assert ("OOMTUNE_PURE_PYTHON=1" in out) == (pure == "1")   # the allocator variables line
    assert main(["env", "--batch-size"]) == 2                    # --batch-size needs a best.yaml


def test_bad_input_writes_nothing(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["search", "device=cpu", "trial.timeout=-1", f"hydra.run.dir={run_dir}"]) == 2
    assert not (run_dir / "study.db").exists() and not (run_dir / "run.json").exists()


@pytest.mark.parametrize("content, needle", [
    (bytes(range(256)) * 4, "not a text file"),
    (b"schema_version: 1\nworkload: {}\ndevice: {}\nstudy: x\nbest: {batch_size: 8, alloc_conf: ''}\n",
     "section 'study' must be a mapping"),
])
def test_show_env_check_refuse_broken_best_yaml(tmp_path, capsys, content, needle):
    path = tmp_path / "best.yaml"
    path.write_bytes(content)
    for cmd in (["show", str(path)], ["env", str(path)], ["check", str(path)]):
        assert main(cmd) == 2, cmd
        err = capsys.readouterr().err.strip()
        assert needle in err and len(err.splitlines()) == 1


def test_show_corrupt_run_json_and_missing_storage(tmp_path, capsys):
    (tmp_path / "run.json").write_text("[1]")
    assert main(["show", str(tmp_path)]) == 2
    assert "run.json is corrupt" in capsys.readouterr().err
    db = tmp_path / "x.db"
    assert main(["show", "--storage", f"sqlite:///{db}", "--study", "nope"]) == 2
    assert "no storage at" in capsys.readouterr().err
    assert not db.exists()  # a read-only command creates nothing


def test_unwritable_run_dir_exits_2(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["search", "device=cpu", f"hydra.run.dir={blocker}/x"]) == 2
    assert "not writable" in capsys.readouterr().err


def test_help_and_version_through_python_m():
    out = run_cli("--help")
    assert out.returncode == 0 and "search" in out.stdout and "simulate" in out.stdout
    assert run_cli("--version").stdout.startswith("oomtune ")
    bad = run_cli("nosuchcommand")
    assert bad.returncode == 2


def test_show_on_a_plan_only_directory_says_no_search_ran(tmp_path, capsys):
    """`oomtune plan` writes plan.yaml and report.html into the run directory; `show` there names
    what the directory holds instead of calling it no run directory (fresh-user pass)."""
    (tmp_path / "plan.yaml").write_text("schema_version: 1\n")
    assert main(["show", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "holds a plan (plan.yaml) but no search yet" in err and "report.html" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["show", str(empty)]) == 2
    assert "is not an oomtune run directory" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["env", "simulate"])
def test_a_reader_that_went_away_is_exit_1_without_a_traceback(command, tmp_path):
    """`oomtune env best.yaml | head -0`: the pipe's read end is closed before oomtune writes. Python
    raises BrokenPipeError (it ignores SIGPIPE); print() output surfaces it at the final flush,
    which without care prints "Exception ignored ... BrokenPipeError" and exits 120, while rich's
    console (simulate) exits 1 silently. Both exit 1 with nothing on stderr, as the Python docs'
    "Note on SIGPIPE" recipe does."""
    import os

    if command == "env":
        best = tmp_path / "best.yaml"
        best.write_text("schema_version: 1\nworkload: {model: {name: mlp}}\ndevice: {kind: cpu}\n"
                        "best: {batch_size: 32, alloc_conf: 'expandable_segments:True'}\n")
        args = ["env", str(best)]
    else:
        from pathlib import Path

        args = ["simulate", str(Path(__file__).parent / "data" / "cnn-small-default.pickle")]
    read_end, write_end = os.pipe()
    os.close(read_end)
    proc = subprocess.run([sys.executable, "-m", "oomtune", *args], stdout=write_end,
                          stderr=subprocess.PIPE, text=True, timeout=120)
    os.close(write_end)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "BrokenPipeError" not in proc.stderr, proc.stderr
