"""A study name is one directory name under runs/ (``study_name=../../x`` once wrote
outside runs/): names with a path separator, ``.``/``..``, NUL or control characters, empty, or
longer than a file name may be are refused in one line, exit 2, before anything is written or
torch is imported (oomtune.config.check_study_name, called by compose for every command)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from oomtune.cli import main
from oomtune.config import check_study_name
from oomtune.exceptions import ConfigError

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name, why", [
    ("../../x", "contains a path separator"),
    ("/tmp/abs", "contains a path separator"),
    ("a/b", "contains a path separator"),
    ("a\\b", "contains a path separator"),
    ("..", "names the current or the parent directory"),
    (".", "names the current or the parent directory"),
    ("''", "is empty"),
    ("'   '", "is empty"),
])
@pytest.mark.parametrize("command", ["search", "plan"])
def test_a_name_that_is_not_one_directory_name_is_refused_in_one_line(command, name, why, tmp_path,
                                                                      monkeypatch, capsys):
    work = tmp_path / "deep" / "cwd"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    assert main([command, "model=mlp", f"study_name={name}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("oomtune: error: study_name ") and why in err
    assert "one directory name under runs/" in err
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["cwd", "deep"]   # nothing written anywhere


def test_nul_control_characters_and_overlong_names_are_refused():
    for name, why in (("a\x00b", "NUL"), ("a\nb", "control character"), ("x" * 256, "longer than 255 bytes"),
                      ("é" * 128, "longer than 255 bytes")):
        with pytest.raises(ConfigError, match=why):
            check_study_name(name)
    for name in ("resnet50-16g", "a..b", "x" * 255, "名前", "run 1"):
        check_study_name(name)      # one directory name: accepted


def test_the_refusal_comes_before_torch_is_imported(tmp_path):
    probe = ("import sys, json\nfrom oomtune.cli import main\n"
             "code = main(['search', 'model=resnet', 'study_name=../x'])\n"
             "print(json.dumps({'code': code, 'torch': 'torch' in sys.modules}))\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=tmp_path,
                         timeout=300)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"code": 2, "torch": False}, out.stderr
    assert not (tmp_path / "runs").exists() and not (tmp_path.parent / "x").exists()
