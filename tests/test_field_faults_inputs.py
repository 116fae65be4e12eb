"""Field faults of user input: each is refused or explained before any
trial, in one line with exit status 2, or reported as data rather than display text.

Expected values come from the issue's cases, torch's documented behaviour (PYTORCH_NO_CUDA_MEMORY_CACHING
is tested for existence only: c10/cuda/CUDACachingAllocator.cpp forceUncachedAllocator, pytorch#145661),
and hand calculation (16 GiB = 16 x 2^30 = 17179869184 bytes; 16 GB = 16 x 10^9 bytes = 14.90 GiB).
"""

from __future__ import annotations

import json
import re
import shlex
import sys
import warnings
from pathlib import Path

import pytest

from oomtune.alloc.caching_env import NO_CACHING_ENV, caching_disabled_reason, check_caching_enabled
from oomtune.best import BestConfig, Choice, apply_best, load_best, write_best
from oomtune.cli import main
from oomtune.config import budget_key, budget_note, compose
from oomtune.exceptions import BestFileError, ConfigError
from oomtune.targets import validate_target
from oomtune.targets._cmd_checks import script_of

PY = shlex.quote(sys.executable)
REPO = Path(__file__).resolve().parents[1]


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


# ------------------------------------------------------------------ caching allocator turned off
@pytest.mark.parametrize("value", ["1", "0", ""])
def test_item5_any_value_turns_caching_off(value):
    reason = caching_disabled_reason({NO_CACHING_ENV: value})
    assert reason is not None and "pytorch#145661" in reason and f"{value!r}" in reason
    with pytest.raises(ConfigError, match=NO_CACHING_ENV):
        check_caching_enabled({NO_CACHING_ENV: value})
    assert caching_disabled_reason({}) is None
    check_caching_enabled({})


def test_item5_search_refuses_before_anything_is_written(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(NO_CACHING_ENV, "0")
    run_dir = tmp_path / "run"
    assert main(["search", "model=mlp", "budget=64MiB", f"hydra.run.dir={run_dir}"]) == 2
    assert NO_CACHING_ENV in _one_line_error(capsys)
    assert not run_dir.exists()


def test_item5_trial_environment_is_checked(monkeypatch):
    from oomtune.trial.record import TrialSpec
    from oomtune.trial.runner import child_environment

    spec = TrialSpec(workload={"name": "mlp"}, batch_size=4, device="cpu", budget_bytes=None, warmup_steps=1,
                     measure_steps=1, timeout_s=10)
    monkeypatch.delenv(NO_CACHING_ENV, raising=False)
    assert NO_CACHING_ENV not in child_environment(spec)
    with pytest.raises(ConfigError, match="trial environment"):
        child_environment(spec, {NO_CACHING_ENV: "0"})


def test_item5_cmd_target_that_sets_it_is_refused():
    with pytest.raises(ConfigError, match=NO_CACHING_ENV):
        validate_target({"name": "cmd", "command": f"{NO_CACHING_ENV}=1 {PY} -c pass {{batch_size}}"})


def _best(tmp_path: Path, conf: str = "expandable_segments:True", settings: dict | None = None,
          device: dict | None = None, **choice) -> Path:
    cfg = BestConfig(schema_version=1, workload={"model": {"name": "mlp"}}, device=device or {"kind": "cpu"},
                     best=Choice(batch_size=32, alloc_conf=conf, settings=settings or {}, metrics={"throughput": 1.0},
                                 **choice))
    return write_best(cfg, tmp_path / "best.yaml")


def test_item5_env_command_warns_on_stderr_and_keeps_stdout_evaluable(tmp_path, monkeypatch, capsys):
    path = _best(tmp_path)
    monkeypatch.setenv(NO_CACHING_ENV, "0")
    assert main(["env", str(path)]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True") and NO_CACHING_ENV not in out
    assert "warning" in err and NO_CACHING_ENV in err
    monkeypatch.delenv(NO_CACHING_ENV)
    assert main(["env", str(path)]) == 0 and capsys.readouterr().err == ""


def test_item5_apply_best_warns(tmp_path):
    path = _best(tmp_path)
    with pytest.warns(UserWarning, match=NO_CACHING_ENV):
        apply_best(path, environ={NO_CACHING_ENV: "0"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        env: dict[str, str] = {}
        apply_best(path, environ=env)
        assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


# ------------------------------------------------------------------ Hydra's "mismatched input '{'"
def test_item7_unquoted_braces_show_the_quoting_that_works():
    # bash turns target.command="python train.py --batch-size {batch_size}" into this argument:
    given = "target.command=python train.py --batch-size {batch_size}"
    with pytest.raises(ConfigError) as info:
        compose(["target=cmd", given])
    msg = str(info.value)
    assert "\n" not in msg and "mismatched input '{'" in msg
    suggestion = "\"target.command='python train.py --batch-size {batch_size}'\""
    assert msg.endswith(suggestion)
    # the suggestion, as bash would pass it, composes and keeps the placeholder for oomtune
    cfg = compose(["target=cmd", *shlex.split(suggestion)])
    assert cfg.target.command == "python train.py --batch-size {batch_size}"


@pytest.mark.parametrize("given", ["target.command={batch_size}", "target.command=python t.py --bs=4"])
def test_item7_other_unparsable_values_get_the_same_fix(given):
    with pytest.raises(ConfigError) as info:
        compose(["target=cmd", given])
    key, _, value = given.partition("=")
    assert str(info.value).endswith(f"\"{key}='{value}'\"")
    assert compose(["target=cmd", f"{key}='{value}'"]).target.command == value


# ------------------------------------------------------------------ target=cmd checks
@pytest.mark.parametrize("argv, script", [
    (["python", "train.py", "--bs", "4"], "train.py"),
    (["python3.11", "-u", "-W", "ignore", "src/train.py"], "src/train.py"),
    (["python", "-m", "pkg.train"], None),
    (["python", "-c", "pass"], None),
    (["bash", "run.sh", "4"], "run.sh"),
    (["torchrun", "--nproc_per_node", "2", "train.py", "--bs", "4"], "train.py"),
    # torch's docs: ``python -m torch.distributed.run`` is torchrun
    (["python", "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone", "train.py", "--bs", "4"],
     "train.py"),
    (["python3", "-mtorch.distributed.launch", "--nproc_per_node=2", "train.py"], "train.py"),
    (["accelerate", "launch", "--num_processes=2", "scripts/train.py"], "scripts/train.py"),
    (["./train", "4"], None),
    (["ls", "train.py"], None),
])
def test_item9_script_of_an_interpreter_command(argv, script):
    assert script_of(argv) == script


def test_item9_mistyped_script_is_refused_before_any_trial(tmp_path, capsys, monkeypatch):
    (tmp_path / "train.py").write_text("import os\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"script 'trian\.py' not found"):
        validate_target({"name": "cmd", "command": f"{PY} trian.py --batch-size {{batch_size}}"})
    run_dir = tmp_path / "run"
    code = main(["search", "target=cmd", f"target.command='{PY} trian.py --batch-size {{batch_size}}'",
                 f"hydra.run.dir={run_dir}", "budget=64MiB"])
    assert code == 2
    assert "trian.py" in _one_line_error(capsys)
    assert not (run_dir / "trials").exists() and not (run_dir / "study.db").exists()


def test_item9_command_without_batch_size_is_refused(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("BATCH = 32\n")
    with pytest.raises(ConfigError) as info:
        validate_target({"name": "cmd", "command": f"{PY} {script}", "cwd": str(tmp_path)})
    msg = str(info.value)
    assert "{batch_size}" in msg and "OOMTUNE_BATCH_SIZE" in msg and "\n" not in msg
    # {{batch_size}} is a literal, not the placeholder
    with pytest.raises(ConfigError, match="no {batch_size}"):
        validate_target({"name": "cmd", "command": f"{PY} {script} --x {{{{batch_size}}}}"})


def test_item9_batch_size_through_the_environment_is_accepted(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import os\nBATCH = int(os.environ['OOMTUNE_BATCH_SIZE'])\n")
    validate_target({"name": "cmd", "command": f"{PY} {script}"})                     # the script reads it
    validate_target({"name": "cmd", "command": f"{PY} -c pass --bs $OOMTUNE_BATCH_SIZE"})  # the shell passes it
    validate_target({"name": "cmd", "command": f"{PY} -c pass --bs {{batch_size}}"})


def test_item9_study_name_comes_from_the_parsed_budget():
    names = {compose(["model=mlp", f"budget={b}"]).study_name
             for b in ("16GiB", "16gib", "'16 GiB'", "17179869184B", "17179869184")}
    assert len(names) == 1, names
    assert compose(["model=mlp", "budget=16GB"]).study_name not in names   # 16 x 10^9 bytes is another budget
    assert budget_key("16GiB") == 17179869184 == 16 * 2**30
    assert budget_key("0.9") == budget_key(0.9) == "fraction=0.9"


def test_item9_decimal_budget_conversion_is_said():
    # 16 GB = 16 x 10^9 bytes = 16e9 / 2^30 GiB = 14.901... GiB
    note = budget_note("16GB")
    assert note is not None and "16,000,000,000 bytes" in note and "14.90 GiB" in note and "16GiB" in note
    assert budget_note("16GiB") is None and budget_note("0.9") is None and budget_note(17179869184) is None


def test_item9_search_prints_the_conversion_once(tmp_path, capsys, monkeypatch):
    import oomtune.trial.runner as runner_mod
    from oomtune.search.entry import search

    class Stop(Exception):
        pass

    def stop(*a, **k):  # stop right after the header lines, when the trial runner is made: no trial runs
        raise Stop

    monkeypatch.setattr(runner_mod, "TrialRunner", stop)
    with pytest.raises(Stop):
        search(["model=mlp", "budget=16MB", f"hydra.run.dir={tmp_path / 'run'}"])
    text = capsys.readouterr()
    combined = text.out + text.err
    assert combined.count("16 MB = 16,000,000 bytes = 15.26 MiB") == 1, combined   # 16e6 / 2^20 = 15.2588


# ------------------------------------------------------------------ best.yaml, show --json, check
def test_item9_best_yaml_alloc_conf_contradicting_settings_is_refused(tmp_path, capsys):
    path = _best(tmp_path, conf="expandable_segments:True,max_split_size_mb:512",
                 settings={"expandable_segments": True, "max_split_size_mb": 256})
    with pytest.raises(BestFileError) as info:
        load_best(path)
    msg = str(info.value)
    diff = msg[msg.index("contradicts"):]
    assert "(max_split_size_mb: 512 in alloc_conf, 256 in settings)" in diff and "expandable_segments" not in diff
    for cmd in (["env", str(path)], ["check", str(path), "--mode", "predict"]):
        assert main(cmd) == 2
        assert "contradicts" in _one_line_error(capsys)
    with pytest.raises(BestFileError, match="contradicts"):
        apply_best(path, environ={})


def test_item9_best_yaml_agreeing_forms_load(tmp_path):
    # the Optuna form the search writes: every key, "off" values included
    settings = {"expandable_segments": True, "max_split_size_mb": None, "garbage_collection_threshold": 0.0,
                "backend": "native"}
    assert load_best(_best(tmp_path, "expandable_segments:True", settings)).alloc_conf == "expandable_segments:True"
    assert load_best(_best(tmp_path, "expandable_segments:True", {})).alloc_conf == "expandable_segments:True"


def test_item9_show_json_carries_data_not_display_strings(tmp_path, capsys):
    import optuna

    from oomtune.study import records as R
    from oomtune.trial.record import Throughput, TrialResult

    url = f"sqlite:///{tmp_path / 'study.db'}"
    study = optuna.create_study(storage=url, study_name="s", direction="maximize")
    for number, (conf, params) in enumerate([("", {"expandable_segments": False}),
                                              ("expandable_segments:True", {"expandable_segments": True,
                                                                            "data.num_workers": 2})]):
        res = TrialResult(outcome="ok", batch_size=8, alloc_conf=conf,
                          throughput=Throughput(samples_per_s=10.0 + number))
        dists = {"batch_size": optuna.distributions.IntDistribution(8, 64),
                 "expandable_segments": optuna.distributions.CategoricalDistribution([False, True])}
        if "data.num_workers" in params:
            dists["data.num_workers"] = optuna.distributions.CategoricalDistribution([0, 2])
        study.add_trial(optuna.trial.create_trial(
            params={"batch_size": 8, **params}, distributions=dists, value=10.0 + number,
            user_attrs={R.ATTR_RESULT: res.to_dict(), R.ATTR_ROLE: "search", R.ATTR_CONF: conf,
                        R.ATTR_OUTCOME: "ok"}))
    assert main(["show", "--storage", url, "--study", "s", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["alloc_conf"] for r in rows] == ["", "expandable_segments:True"]
    assert [r["settings"] for r in rows] == [{}, {"expandable_segments": True}]
    assert rows[1]["data"] == {"num_workers": 2} and rows[0]["data"] == {}
    assert "(default)" not in json.dumps(rows)


def test_item9_corrupt_study_db_names_the_file_and_what_to_do(tmp_path, capsys):
    db = tmp_path / "study.db"
    db.write_bytes(b"this is not an SQLite file" * 10)
    assert main(["show", "--storage", f"sqlite:///{db}", "--study", "s"]) == 2
    err = _one_line_error(capsys)
    assert str(db) in err and "not a readable SQLite database" in err and "move it away" in err


def test_item9_missing_database_driver_names_the_package():
    from oomtune.study.storage import storage_error_message

    exc = ImportError("Failed to import DB access module for the specified storage URL.")
    exc.__cause__ = ModuleNotFoundError("No module named 'psycopg2'", name="psycopg2")
    msg = storage_error_message("postgresql+psycopg2://user:secret@db/optuna", exc)
    assert "pip install 'psycopg2-binary'" in msg and "secret" not in msg
    exc.__cause__ = ModuleNotFoundError("No module named 'pymysql'", name="pymysql")
    assert "pip install 'PyMySQL'" in storage_error_message("mysql+pymysql://u@h/d", exc)


def test_item9_python_target_docs_agree_on_dict_and_tuple():
    from oomtune.targets.python_entry import _unpack

    conf = (REPO / "conf" / "target" / "python.yaml").read_text()
    sections = []
    for page in ("README.md", "docs/training-script.md"):   # the short and the full description
        doc = (REPO / page).read_text()
        start = doc.index("**`target=python`**")
        end = re.search(r"\n\n(\*\*|#)", doc[start + 1:])     # the next bold paragraph or heading
        sections.append(doc[start:start + 1 + end.start()] if end else doc[start:])
    for text in (conf, *sections):
        assert "dict" in text and "tuple" in text and '"model"' in text
    # and both forms they describe are what the loader takes
    for made in ({"model": 1, "optimizer": 2, "batches": 3}, (1, 2, 3)):
        parts = _unpack("e", made)
        assert (parts["model"], parts["optimizer"], parts["batches"]) == (1, 2, 3)


def test_item9_readme_documents_the_cpu_wheel():
    # torch and torchvision together: a torchvision that needs another torch makes the project's install
    # replace the CPU torch with the CUDA build (a new user's torch-only step was undone that way)
    for page in ("README.md", "docs/install.md"):
        assert ("pip install torch torchvision --index-url https://download.pytorch.org/whl/cpu"
                in (REPO / page).read_text())


@pytest.mark.parametrize("headroom, code", [(0.05, 1), (0.0, 0), (None, 0)])
@pytest.mark.usefixtures("no_cublas_workspaces")   # a hand-sized device of a few MiB
def test_item9_check_uses_the_search_limit(headroom, code, tmp_path, capsys):
    """The tiny MLP needs exactly one kSmallBuffer segment, 2 MiB = 2,097,152 bytes reserved (hand
    calculation in tests/test_regression_check.py). Budget 2,202,010 bytes (2.1 MiB): with the search's
    5% headroom the limit is int(2,202,010 x 0.95) = 2,091,909 < 2,097,152, so the batch does not fit;
    without headroom 2,097,152 <= 2,202,010 fits."""
    import yaml

    from test_regression_check import MLP

    device = {"kind": "cpu", "name": "virtual GPU (CPU)", "total_memory_bytes": 80 * 2**30,
              "budget_bytes": 2_202_010, "memory_source": "simulated"}
    if headroom is not None:
        device["headroom"] = headroom
    data = {"schema_version": 1, "workload": {"model": MLP, "target": {"name": "builtin"}}, "device": device,
            "best": {"batch_size": 8, "alloc_conf": "", "settings": {},
                     "metrics": {"throughput": 100.0, "peak_reserved_bytes": 2 * 2**20, "memory_source": "simulated"},
                     "predicted_peak_reserved_bytes": 2 * 2**20}}
    path = tmp_path / "best.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["check", str(path), "--mode", "predict"]) == code
    out = capsys.readouterr().out
    if code:
        assert "does not fit the search's limit 1.99 MiB (budget 2.10 MiB minus 5% headroom)" in out  # 2,091,909 / 2^20 = 1.99499
        assert "FAIL" in out
    else:
        assert "PASS" in out
