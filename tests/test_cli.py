"""The command line: bad input is one line on stderr and exit code 2; help and version work."""

from __future__ import annotations

import subprocess
import sys

import pytest

from oomtune.cli import main


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "oomtune", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args, needle", [
    (["search", "model=nope"], "Could not find 'model/nope'"),
    (["search", "budget=1PiB", "device=cpu"], "invalid size"),
    (["search", "budget=100GiB", "device=cpu", "virtual_device_memory=80GiB"], "above"),
    (["search", "device=cpu", "search.space.max_split_size_mb=[5]"], "max_split_size_mb"),
    (["search", "device=cpu", "search.space.expandable_segments=[true]", "search.space.garbage_collection_threshold=[1.5]"],
     "garbage_collection_threshold"),
    (["search", "device=cuda:7"], "cuda:7"),
    (["search", "search.sampler=nope", "device=cpu"], "unknown sampler"),
    (["env", "/nonexistent/best.yaml"], "cannot read"),
    (["show", "--storage", "sqlite:///:memory:", "--study", "nope"], "does not exist"),
])
def test_bad_input_exits_2_with_one_line(args, needle, tmp_path, capsys):
    code = main(args + ([f"hydra.run.dir={tmp_path}/run"] if args[0] == "search" else []))
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.startswith("oomtune: error: ") and needle in err
    assert len(err.splitlines()) == 1


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
