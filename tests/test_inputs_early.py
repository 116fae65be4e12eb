"""Input checked early: an invalid allocator string left in the user's shell, a
model key the builders refuse, a mistyped sub-command or flag, each refused in one line with exit 2
before torch is imported; and the final tables fit an 80-column terminal without cutting a word.

The import checks run in a fresh interpreter (other tests of the session import torch), as
tests/test_lazy_imports.py does.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from oomtune.cli import main
from oomtune.display import fit_table, trial_table

ROOT = Path(__file__).resolve().parents[1]


def _fresh(code: str, env: dict[str, str] | None = None) -> dict:
    """Run ``code`` (which sets ``rc``) in a fresh interpreter; its rc, stderr and whether torch was imported."""
    probe = (code + "\nimport json, sys\nprint(json.dumps({'rc': rc, 'torch': 'torch' in sys.modules}))\n")
    full_env = dict(os.environ, PYTHONPATH=str(ROOT), OOMTUNE_CACHE_DIR="off", **(env or {}))
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=full_env,
                          timeout=300, cwd=str(ROOT))
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["stderr"] = proc.stderr
    return out


@pytest.mark.parametrize("name", ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
@pytest.mark.parametrize("command", ["search", "plan"])
def test_an_invalid_allocator_string_in_the_shell_is_refused_before_torch(tmp_path, name, command):
    r = _fresh(f"from oomtune.cli import main\nrc = main([{command!r}, 'model=mlp', 'device=cpu', "
               f"'hydra.run.dir={tmp_path}'])", env={name: "expandable_segments:true"})
    assert r["rc"] == 2 and r["torch"] is False
    line = r["stderr"].strip()
    assert "\n" not in line and line.startswith(f"oomtune: error: {name}='expandable_segments:true' in your environment")
    assert f"unset {name}" in line


def test_a_valid_allocator_string_in_the_shell_is_not_refused():
    from oomtune.alloc.caching_env import check_alloc_env

    check_alloc_env({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,max_split_size_mb:128",
                     "PYTORCH_ALLOC_CONF": ""})


@pytest.mark.parametrize("command", ["search", "plan"])
def test_a_model_key_the_builder_refuses_is_refused_before_torch(tmp_path, command):
    r = _fresh(f"from oomtune.cli import main\nrc = main([{command!r}, 'model=resnet', 'model.depth=19', "
               f"'device=cpu', 'hydra.run.dir={tmp_path}'])")
    assert r["rc"] == 2 and r["torch"] is False
    assert r["stderr"].strip() == "oomtune: error: model.depth=19: choose one of 18, 34, 50, 101, 152"


@pytest.mark.parametrize("override, message", [
    ("model.d_model=100", "model.d_model=100 is not divisible by model.heads=8"),
    ("model.optimizer=lamb", "model.optimizer='lamb': choose one of sgd, adam, adamw"),
    ("model.dropout=2", "model.dropout=2: expected a finite number in [0, 1]"),
])
def test_other_model_keys_are_checked_without_torch_too(override, message):
    from oomtune.workloads.keys import check_model_keys
    from oomtune.exceptions import ConfigError

    key, _, value = override.partition("=")
    cfg = {"name": "transformer", key.split(".", 1)[1]: int(value) if value.isdigit() else value}
    with pytest.raises(ConfigError) as err:
        check_model_keys(cfg)
    assert str(err.value) == message


def test_a_mistyped_subcommand_gets_a_suggestion(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serach", "model=mlp"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "invalid choice: 'serach'" in err and "did you mean 'search'?" in err


def test_a_mistyped_flag_gets_a_suggestion(capsys):
    trace = ROOT / "tests" / "data" / "cnn-small-default.pickle"
    with pytest.raises(SystemExit) as exit_:
        main(["simulate", str(trace), "--budgett", "1GiB"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "did you mean '--budget' for '--budgett'?" in err
    with pytest.raises(SystemExit):
        main(["simulate", str(trace), "--zzzzzz"])
    assert "did you mean" not in capsys.readouterr().err   # nothing close: no guess


def test_a_dashed_override_is_told_to_drop_its_dashes(capsys):
    """`oomtune search --budgt=1GiB` (a new user's flag): search takes Hydra overrides, key=value
    without dashes; the one line says so (nothing close among search's flags to suggest)."""
    with pytest.raises(SystemExit) as exit_:
        main(["search", "model=resnet", "--budgt=1GiB"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "written without dashes: budgt=1GiB" in err



@pytest.mark.parametrize("argv, override", [
    (["search", "--budget", "2GiB"], "budget=2GiB"),            # conf/config.yaml: budget
    (["plan", "--budget=2GiB"], "budget=2GiB"),
    (["search", "--workers", "4"], "search.workers=4"),         # conf/search/default.yaml: workers
    (["search", "--n-trials=4"], "search.n_trials=4"),          # dashes for underscores, as in flags
    (["search", "--layers", "4"], "model.layers=4"),            # conf/model/transformer.yaml: layers
    (["search", "--budget"], "budget=VALUE"),                   # no value given: none invented
])
def test_a_flag_naming_a_config_key_is_told_the_override(argv, override, capsys):
    """`oomtune search --budget 2GiB`, as a new user types it: argparse takes "2GiB" as an override
    and refuses "--budget"; the one line names the override meant, with its value."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"written without dashes: {override} " in err


@pytest.mark.parametrize("argv, quoted", [
    # bash split an unquoted command: its first word is the value, the next no KEY=VALUE at all
    (["search", "target=cmd", "target.command=python", "examples/train_cmd.py"],
     "\"target.command='python examples/train_cmd.py'\""),
    # ... with its flags too, which argparse refuses before Hydra sees anything; the next override stays out
    (["search", "target=cmd", "target.command=python", "train.py", "--batch-size", "{batch_size}", "budget=1GiB"],
     "\"target.command='python train.py --batch-size {batch_size}'\""),
])
def test_a_value_the_shell_split_is_told_to_quote_the_whole_value(argv, quoted, capsys, tmp_path):
    """`oomtune search target.command=python train.py` typed without quotes: one line, exit 2,
    showing the whole value quoted inside one argument (not Hydra's 'mismatched input')."""
    code = None
    try:
        code = main([*argv, f"hydra.run.dir={tmp_path}"] if "--batch-size" not in argv else argv)
    except SystemExit as exit_:
        code = exit_.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"quote the whole value inside one argument: {quoted}" in err
    assert "mismatched input" not in err


@pytest.mark.parametrize("target, key", [("cmd", "target.command"), ("python", "target.entry")])
@pytest.mark.parametrize("command", ["search", "plan"])
def test_a_target_without_its_required_key_is_one_line(target, key, command, tmp_path, capsys):
    """conf/target/cmd.yaml leaves ``command`` and conf/target/python.yaml ``entry`` as OmegaConf's
    ``???``: a search or plan without them is one line naming the key, exit 2 (it was OmegaConf's
    MissingMandatoryValue traceback)."""
    assert main([command, f"target={target}", f"hydra.run.dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"oomtune: error: {key} has no value: target={target} needs it; add {key}=VALUE")


def test_a_config_key_flag_of_a_command_without_overrides_gets_no_override(capsys):
    """check reads a best.yaml and takes no Hydra overrides: no `search.workers=` advice there."""
    with pytest.raises(SystemExit) as exit_:
        main(["check", "best.yaml", "--workers", "4"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --workers 4" in err and "without dashes" not in err


def test_a_budget_that_is_not_a_size_names_the_budget_key(tmp_path, capsys):
    assert main(["search", "budget=lots", f"hydra.run.dir={tmp_path}/run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("oomtune: error: budget=lots: invalid size 'lots'") and "budget=0.9" in err
    assert len(err.splitlines()) == 1 and not (tmp_path / "run").exists()


# ------------------------------------------------------------------ 80 columns
def _rows() -> list[dict]:
    def row(n, role, bs, conf, outcome, label, resv=None, alloc=None, frag=None, err=None, thr=None):
        return {"number": n, "role": role, "batch_size": bs, "alloc_conf": conf, "outcome": outcome,
                "outcome_label": label, "peak_reserved_bytes": resv, "peak_allocated_bytes": alloc,
                "fragmentation": frag, "prediction_error": err, "throughput": thr, "memory_source": "simulated"}

    return [row(0, "baseline", 352, "(default)", "ok", "ok", 966 << 20, 700 << 20, 0.247, 0.0, 35.4),
            row(1, "baseline", 353, "(default)", "ok", "ok >limit@1", 1012 << 20, 720 << 20, 0.25, 0.0),
            row(2, "frontier", 493, "expandable_segments:True,roundup_power2_divisions:4", "ok", "ok",
                972 << 20, 950 << 20, 0.015, 0.0, 37.6),
            row(3, "confirm", 493, "expandable_segments:True num_workers=2", "predicted_infeasible",
                "predicted_infeasible"),
            row(4, "search", 512, "garbage_collection_threshold:0.8,max_split_size_mb:256", "oom_fragmentation",
                "oom_fragmentation")]


def _render(renderable, width: int) -> list[str]:
    out = io.StringIO()
    Console(file=out, width=width).print(renderable)
    return out.getvalue().splitlines()


@pytest.mark.parametrize("width", [80, 60])
def test_the_trial_table_fits_80_columns_and_never_cuts_a_word(width):
    lines = _render(fit_table(trial_table(_rows()), width), width)
    assert max(len(line.rstrip()) for line in lines) <= width
    words = re.findall(r"\S+", "\n".join(lines))
    # every cell's words are whole (rich folded them before: "defau" / "lt", ">limi" / "t@1")
    for word in ("default", ">limit@1", "num_workers=2", "fragmentation", "infeasible", "predicted", "gc:0.8",
                 "ms:256", "35.4", "1012.0", "24.7%"):
        assert word in words, (word, lines)
    assert not any(w in words for w in ("defau", "lt", ">limi", "t@1", "fragm"))
    # every trial is listed once per part: whole rows, every column somewhere
    assert sum(1 for line in lines if line.startswith("0 ")) == len([x for x in lines if x.startswith("#")])


def test_the_trial_table_is_one_table_when_it_fits():
    table = trial_table(_rows())
    assert fit_table(table, 200) is table


def test_simulate_table_at_80_columns_keeps_settings_whole(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    trace = ROOT / "tests" / "data" / "cnn-small-default.pickle"
    assert main(["simulate", str(trace), "--conf", "", "--conf", "expandable_segments:True,max_split_size_mb:128",
                 "--conf", "garbage_collection_threshold:0.6,max_split_size_mb:64", "--memory-fraction", "0.9",
                 "--budget", "8GiB"]) == 0
    out = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(out) if "Replay under each setting" in line)
    end = next(i for i, line in enumerate(out) if i > start and line.startswith("peak alloc / resv"))
    table = out[start:end]
    assert max(len(line.rstrip()) for line in table) <= 80, table
    words = re.findall(r"\S+", "\n".join(table))
    for word in ("default", "es:T", "ms:128", "gc:0.6", "ms:64"):
        assert word in words, (word, table)
