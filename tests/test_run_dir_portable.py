"""A run directory is self-contained: run.json stores the study.db that lies inside
it relative to it, so ``oomtune show`` and ``oomtune report`` of a copied directory read the copy's
study (they read the original's before) and those of a moved directory read the study beside them
(they failed before); both say in one line which storage they read (oomtune/runfile.py).

The run directory is tests/report_run.py's hand-made one (a real SQLite study of 6 trials); the copy
and the original are told apart by adding a trial to one of them.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import optuna
import pytest

from oomtune.cli import main
from oomtune.runfile import read_run_file, write_run_file

sys.path.insert(0, str(Path(__file__).parent))
from report_run import TRIALS, make_run_dir  # noqa: E402

optuna.logging.set_verbosity(optuna.logging.ERROR)


def _portable_run(root: Path) -> Path:
    """The hand-made run directory with run.json as `oomtune search` now writes it."""
    run = make_run_dir(root)
    write_run_file(run, f"sqlite:///{(run / 'study.db').resolve()}", "handmade")
    return run


def _add_trial(run: Path) -> None:
    study = optuna.load_study(study_name="handmade", storage=f"sqlite:///{run / 'study.db'}")
    study.add_trial(optuna.trial.create_trial(
        params={"batch_size": 8}, distributions={"batch_size": optuna.distributions.IntDistribution(8, 512)},
        value=1.0, user_attrs={"role": "search", "outcome": "ok", "result": {"outcome": "ok", "batch_size": 8}}))


def _show(path: Path, capsys) -> tuple[list[dict], str]:
    assert main(["show", str(path), "--json"]) == 0
    out = capsys.readouterr()
    return json.loads(out.out), out.err


def test_run_json_stores_a_study_db_inside_the_run_directory_relative_to_it(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    write_run_file(run, f"sqlite:///{run.resolve() / 'study.db'}", "s")
    info = json.loads((run / "run.json").read_text())
    assert info["storage_file"] == "study.db" and info["study_name"] == "s"
    elsewhere = tmp_path / "shared.db"
    write_run_file(run, f"sqlite:///{elsewhere}", "s")                 # outside: the URL as given
    assert "storage_file" not in json.loads((run / "run.json").read_text())
    assert read_run_file(run).url == f"sqlite:///{elsewhere}"
    write_run_file(run, "postgresql://u:secret@db/optuna", "s")
    found = read_run_file(run)
    assert found.url == "postgresql://u:secret@db/optuna" and "secret" not in found.line


def test_show_and_report_of_a_copied_run_directory_read_the_copy(tmp_path, capsys):
    original = _portable_run(tmp_path / "a")
    copy = tmp_path / "b" / "run"
    shutil.copytree(original, copy)
    _add_trial(original)                                   # the two studies now differ: 7 vs 6 trials
    rows, err = _show(copy, capsys)
    assert len(rows) == len(TRIALS)
    assert err.strip() == f"reading study 'handmade' from sqlite:///{copy.resolve() / 'study.db'} (the study.db beside run.json)"
    rows, _ = _show(original, capsys)
    assert len(rows) == len(TRIALS) + 1
    rows, _ = _show(copy / "best.yaml", capsys)            # a best.yaml reads the run.json beside it
    assert len(rows) == len(TRIALS)
    assert main(["report", str(copy)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"reading study 'handmade' from sqlite:///{copy.resolve() / 'study.db'} (the study.db beside run.json)"
    html = (copy / "report.html").read_text()
    assert f"study handmade in sqlite:///{copy.resolve() / 'study.db'}" in html
    assert str(original) not in html


def test_show_and_report_of_a_moved_run_directory_read_the_study_beside_it(tmp_path, capsys):
    original = _portable_run(tmp_path / "a")
    moved = tmp_path / "elsewhere" / "run"
    moved.parent.mkdir()
    shutil.move(str(original), str(moved))
    assert not original.exists()
    rows, err = _show(moved, capsys)
    assert len(rows) == len(TRIALS) and str(moved.resolve() / "study.db") in err
    assert main(["report", str(moved)]) == 0
    assert str(moved.resolve() / "study.db") in capsys.readouterr().out
    assert "could not be read" not in (moved / "report.html").read_text()


@pytest.mark.parametrize("how", ["copy", "move"])
def test_an_older_run_json_with_an_absolute_path_reads_the_study_db_beside_it_and_says_why(tmp_path, capsys, how):
    original = make_run_dir(tmp_path / "a")               # run.json as before: {"storage": absolute URL}
    assert "storage_file" not in json.loads((original / "run.json").read_text())
    other = tmp_path / "b" / "run"
    (shutil.copytree if how == "copy" else shutil.move)(str(original), str(other))
    if how == "copy":
        _add_trial(original)
    rows, err = _show(other, capsys)
    assert len(rows) == len(TRIALS)
    assert str(other.resolve() / "study.db") in err and "from before the directory was copied or moved" in err
