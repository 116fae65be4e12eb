"""Bad input refused early, in one line: malformed, deeply nested or oversized files (best.yaml,
JSON records), best.yaml's workload section validated once for ``apply_best`` and ``oomtune check``,
``+key`` overrides checked against the schema, a study database never written by the readers, and
the messages of a bad ``--junit`` path and of budgets without a unit.

Expected values are by hand: the limits are the constants documented in oomtune/safeload.py and
oomtune/best.py; a file nested N levels deep holds N opening brackets.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from oomtune.best import BestConfig, Choice, apply_best, load_best, write_best
from oomtune.cli import main
from oomtune.exceptions import BestFileError, ConfigError


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert err.startswith("oomtune: error: "), err
    return err


def _deep_yaml(tmp_path: Path, levels: int = 100_000) -> Path:
    path = tmp_path / "best.yaml"
    path.write_text("[" * levels + "]" * levels + "\n")
    return path


def _good_best(tmp_path: Path, **workload) -> Path:
    cfg = BestConfig(schema_version=1, workload={"model": {"name": "mlp"}, **workload}, device={"kind": "cpu"},
                     best=Choice(batch_size=8, alloc_conf="expandable_segments:True"))
    return write_best(cfg, tmp_path / "best.yaml")


# -- deep and huge files -------------------------------------------------------------------------

def test_apply_best_refuses_a_best_yaml_nested_100000_levels_with_best_file_error(tmp_path):
    path = _deep_yaml(tmp_path)
    with pytest.raises(BestFileError, match=r"nested more than 64 levels deep") as info:
        apply_best(path, environ={})
    assert str(path) in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("command", ["env", "check"])
def test_env_and_check_refuse_a_deeply_nested_best_yaml_in_one_line(tmp_path, capsys, command):
    path = _deep_yaml(tmp_path)
    assert main([command, str(path)]) == 2
    line = _one_error_line(capsys)
    assert "nested more than 64 levels deep" in line and str(path) in line


def test_a_best_yaml_just_inside_the_depth_limit_reaches_the_schema_check(tmp_path):
    # 64 levels are allowed: the file then fails as what it is (a list, not a best.yaml mapping)
    path = _deep_yaml(tmp_path, 64)
    with pytest.raises(BestFileError, match="expected a mapping at the top level"):
        load_best(path)
    path = _deep_yaml(tmp_path, 65)
    with pytest.raises(BestFileError, match="nested more than 64 levels"):
        load_best(path)


def test_a_best_yaml_over_one_mib_is_refused_before_parsing(tmp_path, capsys):
    path = tmp_path / "best.yaml"
    path.write_bytes(b"# padding\n" * (2**20 // 10 + 1))   # 1 MiB + 6 bytes of comments
    assert path.stat().st_size > 2**20
    with pytest.raises(BestFileError, match=r"larger than 1 MiB"):
        load_best(path)
    assert main(["env", str(path)]) == 2
    assert "larger than 1 MiB" in _one_error_line(capsys)


def test_json_readers_refuse_deep_nesting_with_the_callers_error():
    from oomtune.safeload import loads_json

    text = "[" * 100_000 + "]" * 100_000
    with pytest.raises(BestFileError, match="nested more than 64 levels"):
        loads_json(text, source="x.json", what="a record", error=BestFileError)
    with pytest.raises(ConfigError, match="nested more than 64 levels"):   # below the decoder's recursion limit
        loads_json("[" * 65 + "]" * 65, source="x.json", what="a record")
    assert loads_json("[" * 64 + "]" * 64, source="x.json", what="a record") is not None


def test_run_json_nested_too_deeply_is_one_line(tmp_path):
    from oomtune.runfile import read_run_file

    (tmp_path / "run.json").write_text('{"storage": ' + "[" * 50_000 + "]" * 50_000 + "}")
    with pytest.raises(BestFileError, match="nested more than 64 levels"):
        read_run_file(tmp_path)


def test_a_trial_record_nested_too_deeply_is_refused(tmp_path):
    from oomtune.trial.record import TrialResult

    path = tmp_path / "result.json"
    path.write_text('{"outcome": ' + "[" * 50_000 + "]" * 50_000 + "}")
    with pytest.raises(ValueError, match="nested more than 64 levels"):
        TrialResult.read(path)


# -- best.yaml's workload section: one validator for apply_best and check -------------------------

def test_apply_best_refuses_a_ranks_string_instead_of_skipping_the_world_size_check(tmp_path):
    path = _good_best(tmp_path, ranks="$(touch x)")
    env = {"WORLD_SIZE": "4"}
    with pytest.raises(BestFileError, match=r"workload\.ranks must be an integer >= 1.*'\$\(touch x\)'"):
        apply_best(path, environ=env)
    assert "PYTORCH_CUDA_ALLOC_CONF" not in env   # nothing applied


def test_check_refuses_the_same_ranks_with_the_same_line_as_apply_best(tmp_path, capsys):
    path = _good_best(tmp_path, ranks="$(touch x)")
    with pytest.raises(BestFileError) as info:
        apply_best(path, environ={})
    assert main(["check", str(path), "--mode", "predict"]) == 2
    assert _one_error_line(capsys) == f"oomtune: error: {info.value}"


def test_prepare_check_uses_the_shared_validator(tmp_path):
    from oomtune.regression import prepare_check

    config = load_best(_good_best(tmp_path))
    config.device.update(budget_bytes=2**30, total_memory_bytes=2**31)
    config.workload["ranks"] = 0   # as if edited after loading: prepare_check validates again
    with pytest.raises(BestFileError, match=r"workload\.ranks must be an integer >= 1.*got 0"):
        prepare_check(config)


@pytest.mark.parametrize("workload, message", [
    ({"ranks": True}, r"workload\.ranks must be an integer"),
    ({"ranks": 2.0}, r"workload\.ranks must be an integer"),
    ({"target": "cmd"}, r"workload\.target must be a mapping with a 'name'"),
    ({"training": {"grad_accum": 0}}, r"workload\.training\.grad_accum must be an integer >= 1"),
    ({"training": {"activation_checkpointing": "yes"}}, r"activation_checkpointing must be true, false or null"),
    ({"training": [1]}, r"workload\.training must be a mapping"),
])
def test_malformed_workload_keys_are_refused_by_load_best(tmp_path, workload, message):
    with pytest.raises(BestFileError, match=message):
        load_best(_good_best(tmp_path, **workload))


def test_a_valid_ranks_now_meets_the_world_size_check(tmp_path):
    from oomtune.best import RankCountError

    with pytest.raises(RankCountError, match="tuned for 2 rank"):
        apply_best(_good_best(tmp_path, ranks=2), environ={"WORLD_SIZE": "4"})
    env = {"WORLD_SIZE": "2"}
    apply_best(_good_best(tmp_path, ranks=2), environ=env)
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


# -- +key overrides checked against the schema ---------------------------------------------------

@pytest.mark.parametrize("override, needle", [
    ("+search.n_trails=5", "unknown config key 'search.n_trails' in '+search.n_trails=5'"),
    ("++search.n_trails=5", "did you mean 'search.n_trials'?"),
    ("+foo=bar", "unknown config key 'foo' in '+foo=bar'"),
    ("+trial.warmup=2", "did you mean 'trial.warmup_steps'?"),
    ("+search.batch_size.lo=4", "did you mean 'search.batch_size.low'?"),
    ("+plan.batch_size=[8]", "did you mean 'plan.batch_sizes'?"),
    ("+model.dept=18", "did you mean 'model.depth'?"),          # model=resnet (the default) has depth
    ("+model.data.workers=2", "model.data takes no 'workers'"),
    ("+target.command=x", "target takes no 'command'"),           # target=builtin (the default) has name only
])
def test_a_plus_key_the_schema_lacks_is_refused_before_any_trial(tmp_path, capsys, override, needle):
    rc = main(["search", override, "model=resnet", "device=cpu", f"hydra.run.dir={tmp_path / 'run'}"])
    assert rc == 2
    line = _one_error_line(capsys)
    assert needle in line, line
    assert not (tmp_path / "run").exists()   # refused before the run directory was made


@pytest.mark.parametrize("overrides", [
    ["+plan.batch_sizes=[8,16]"],                                    # docs/plan-and-simulate.md
    ["+search.space.activation_checkpointing=[false,true]"],          # conf/search/default.yaml
    ["target=python", "target.entry=examples/my_workload.py:make_workload",
     "+target.seq_len={low:64,high:512,pad_multiple:8}"],             # conf/target/python.yaml
    ["+hydra.job.env_set.FOO=1"],                                     # Hydra's own config: Hydra checks it
])
def test_the_documented_plus_keys_still_compose(overrides):
    from oomtune.prepared import compose_checked

    cfg = compose_checked(overrides)
    key = overrides[-1].lstrip("+").split("=", 1)[0]
    from omegaconf import OmegaConf

    assert OmegaConf.select(cfg, key) is not None


def test_added_key_reads_the_plus_forms():
    from oomtune.schema import added_key

    assert added_key("+search.n_trails=5") == "search.n_trails"
    assert added_key("++foo=bar") == "foo"
    assert added_key("search.n_trials=5") is None
    assert added_key("~search.timeout") is None


# -- show and report never write ----------------------------------------------------------------

@pytest.mark.parametrize("argv", [["show", "--storage", "URL", "--study", "s"], ["show", "RUN"], ["best", "RUN"]])
def test_a_zero_byte_study_db_is_refused_and_left_zero_bytes(tmp_path, capsys, argv):
    db = tmp_path / "study.db"
    db.write_bytes(b"")
    (tmp_path / "run.json").write_text(json.dumps({"storage": "sqlite:///study.db", "study_name": "s",
                                                   "storage_file": "study.db"}))
    argv = [{"URL": f"sqlite:///{db}", "RUN": str(tmp_path)}.get(a, a) for a in argv]
    assert main(argv) == 2
    line = _one_error_line(capsys)
    assert str(db) in line and "is empty (0 bytes" in line
    assert db.read_bytes() == b""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json", "study.db"]   # no journal left either


def test_a_sqlite_file_without_optuna_tables_is_refused_unchanged(tmp_path, capsys):
    import sqlite3

    db = tmp_path / "other.db"
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE t (x INTEGER)")
    con.commit()
    con.close()
    before = db.read_bytes()
    assert main(["show", "--storage", f"sqlite:///{db}", "--study", "s"]) == 2
    assert "without Optuna's tables" in _one_error_line(capsys)
    assert db.read_bytes() == before


def test_show_leaves_a_real_study_db_byte_for_byte(tmp_path, capsys):
    import optuna

    db = tmp_path / "study.db"
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name="s", storage=f"sqlite:///{db}")
    study.add_trial(optuna.trial.create_trial(params={}, distributions={}, value=1.0))
    del study
    before = db.read_bytes()
    assert main(["show", "--storage", f"sqlite:///{db}", "--study", "s", "--json"]) == 0
    assert isinstance(json.loads(capsys.readouterr().out), list)
    assert db.read_bytes() == before


# -- messages: the --junit path, budgets without a unit ------------------------------------------

def test_a_junit_path_under_proc_names_the_given_path_and_what_to_do(tmp_path, capsys):
    best = _good_best(tmp_path)
    assert main(["check", str(best), "--mode", "predict", "--junit", "/proc/nope/x.xml"]) == 2
    line = _one_error_line(capsys)
    assert line.startswith("oomtune: error: --junit '/proc/nope/x.xml': cannot create the file")
    assert "'/proc/nope' does not exist" in line and "give a path in a folder you can write to" in line
    assert "--junit ./x.xml" in line


# Hydra reads 1e30 as a float, which the schema's str key holds as Python writes it: 1e+30
@pytest.mark.parametrize("given, budget", [("1024", "1024"), ("1e30", "1e+30"), ("17179869184", "17179869184"),
                                           ("2.5", "2.5")])
def test_a_budget_number_above_one_without_a_unit_is_ambiguous_whatever_its_size(tmp_path, capsys, given, budget):
    rc = main(["search", "model=mlp", "device=cpu", f"budget={given}", f"hydra.run.dir={tmp_path / 'run'}"])
    assert rc == 2
    line = _one_error_line(capsys)
    if budget == "2.5":   # found by a new user: "write budget=1.5MiB, or budget=1.5B for bytes" was no fix (a
        # fraction of a byte; 1.5 MiB is below the 2 MiB minimum): a number with a fraction is offered in GiB
        assert f"budget '{budget}' is ambiguous (a number without a unit): write budget={budget}GiB (or MiB)" in line
        assert "for bytes" not in line and not (tmp_path / "run").exists()
        return
    assert f"budget '{budget}' is ambiguous (a number without a unit): write budget={budget}MiB" in line
    assert f"budget={budget}B for bytes" in line and not (tmp_path / "run").exists()


@pytest.mark.parametrize("given", ["-1GiB", "-0.5", "0MiB"])
def test_a_budget_not_above_zero_says_so_with_or_without_a_unit(tmp_path, capsys, given):
    rc = main(["search", "model=mlp", "device=cpu", f"budget={given}", f"hydra.run.dir={tmp_path / 'run'}"])
    assert rc == 2
    line = _one_error_line(capsys)
    assert line.startswith(f"oomtune: error: budget '{given}' must be > 0: give a size such as budget=16GiB"), line
    assert not (tmp_path / "run").exists()


def test_a_negative_size_is_named_as_negative():
    from oomtune.exceptions import ConfigError
    from oomtune.units import parse_size

    with pytest.raises(ConfigError, match=r"^invalid size '-2MiB': a size cannot be negative; give e.g. 512MiB$"):
        parse_size("-2MiB")
    assert parse_size("+2MiB") == 2 * 2**20


@pytest.mark.parametrize("command", [["env"], ["check"], ["check", "--mode", "predict"], ["show"]])
def test_a_missing_best_yaml_says_which_command_writes_one(tmp_path, capsys, command):
    missing = tmp_path / "runs" / "nope" / "best.yaml"
    if command == ["show"]:
        missing = missing.parent   # show reads a run directory
    assert main([command[0], str(missing), *command[1:]]) == 2
    line = _one_error_line(capsys)
    assert f"cannot read {str(missing)!r}" in line
    if command != ["show"]:
        assert "`oomtune search` writes runs/NAME/best.yaml" in line, line


@pytest.mark.parametrize("budget, expected", [
    ("1024MiB", ("bytes", 1024 * 2**20)),
    ("17179869184B", ("bytes", 16 * 2**30)),     # the byte count, said as bytes
    ("0.5", ("fraction", 0.5)),
    ("1", ("fraction", 1.0)),
    (2**30, ("bytes", 2**30)),                   # a Python int: best.yaml's device.budget_bytes
])
def test_budgets_with_a_unit_or_a_fraction_are_read(budget, expected):
    from oomtune.device import parse_budget

    assert parse_budget(budget) == expected


# The caching allocator reserves nothing smaller than a 2 MiB segment (kSmallBuffer in
# CUDACachingAllocator.cpp; allocator-spec.md "Constants"): under a smaller budget no trial could allocate.
@pytest.mark.parametrize("given, shown", [("1KiB", "budget=1KiB (1.00 KiB)"), ("1MiB", "budget=1MiB (1.00 MiB)"),
                                          ("2097151B", "budget=2097151B (2.00 MiB)")])
def test_a_budget_below_the_smallest_segment_is_refused_before_anything_runs(tmp_path, capsys, given, shown):
    rc = main(["search", "model=mlp", "device=cpu", f"budget={given}", f"hydra.run.dir={tmp_path / 'run'}"])
    assert rc == 2
    line = _one_error_line(capsys)
    assert line == (f"oomtune: error: {shown} is below 2 MiB, the smallest segment the caching allocator reserves "
                    "(kSmallBuffer): no trial could allocate a tensor; give budget=2MiB or more, or a fraction of "
                    "the device such as budget=0.9")
    assert not (tmp_path / "run").exists()   # refused before the study and the run directory


def test_the_smallest_budget_is_one_segment_as_a_size_a_byte_count_or_a_fraction():
    from oomtune.device import TargetDevice, parse_budget, resolve_budget

    assert parse_budget("2MiB") == ("bytes", 2 << 20) and parse_budget(2 << 20) == ("bytes", 2 << 20)
    with pytest.raises(ConfigError, match=r"^budget=2097151B \(2\.00 MiB\) is below 2 MiB"):
        parse_budget((2 << 20) - 1)      # best.yaml's byte count follows the same rule
    tiny = TargetDevice("cpu", "cpu", None, "virtual GPU", 100 << 20, True)
    assert resolve_budget("0.02", tiny) == int(0.02 * (100 << 20)) == 2097152   # 2 MiB exactly: one segment
    with pytest.raises(ConfigError, match=r"^budget=0\.01 \(1\.00 MiB\) is below 2 MiB"):
        resolve_budget("0.01", tiny)     # a fraction of a small device, checked once the device is known


def test_simulate_budget_follows_the_same_rule_for_large_numbers():
    from oomtune.units import parse_size_with_unit

    with pytest.raises(ConfigError, match=r"--budget '17179869184' is ambiguous.*--budget 17179869184B for bytes"):
        parse_size_with_unit("17179869184", what="--budget")
    assert parse_size_with_unit("17179869184B", what="--budget") == 16 * 2**30


# -- oomtune env: a fraction of the virtual GPU's size is said -----------------------------------

def _fraction_best(tmp_path: Path, device: dict) -> Path:
    # garbage_collection_threshold needs a fraction (oomtune/best.py needs_memory_fraction);
    # 0.025 of 80 GiB is the 2 GiB budget of the field report
    cfg = BestConfig(schema_version=1, workload={"model": {"name": "mlp"}}, device=device,
                     best=Choice(batch_size=8, alloc_conf="garbage_collection_threshold:0.8", memory_fraction=0.025))
    return write_best(cfg, tmp_path / "best.yaml")


def test_env_warns_once_on_stderr_when_the_fraction_is_of_the_virtual_gpu(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("oomtune.best.fraction_key_supported", lambda *a: True)
    path = _fraction_best(tmp_path, {"kind": "cpu", "memory_source": "simulated", "total_memory_bytes": 80 * 2**30})
    assert main(["env", str(path)]) == 0
    out, err = capsys.readouterr()
    assert "per_process_memory_fraction:0.025" in out and "warning" not in out   # stdout stays evaluable
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("oomtune: warning: per_process_memory_fraction:0.025 is a "
                                                   "fraction of the virtual GPU's 80.00 GiB")
    assert "virtual_device_memory" in lines[0]


def test_env_says_nothing_for_a_fraction_of_a_real_gpu(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("oomtune.best.fraction_key_supported", lambda *a: True)
    path = _fraction_best(tmp_path, {"kind": "cuda", "memory_source": "device", "total_memory_bytes": 80 * 2**30})
    assert main(["env", str(path)]) == 0
    out, err = capsys.readouterr()
    assert "per_process_memory_fraction:0.025" in out and err == ""


# -- host memory: target=cmd commands on the virtual GPU run real CPU steps ----------------------

def test_a_cmd_search_whose_budget_the_host_cannot_hold_stops_before_any_trial(tmp_path, capsys, monkeypatch):
    from oomtune.trial import execute

    # the field report: budget=64GiB on a host with 24 GiB available, the command's steps run for real on the
    # CPU (trial.execute=cpu; meta steps hold no tensor data in host memory)
    monkeypatch.setattr(execute, "host_available_bytes", lambda meminfo="/proc/meminfo": 24 * 2**30)
    script = Path(__file__).resolve().parents[1] / "examples" / "train_cmd.py"
    run_dir = tmp_path / "run"
    rc = main(["search", "target=cmd", f"target.command='python {script} --batch-size {{batch_size}}'",
               "budget=64GiB", "device=cpu", "trial.execute=cpu", f"hydra.run.dir={run_dir}"])
    assert rc == 2
    line = _one_error_line(capsys)
    assert "target=cmd commands on the virtual GPU run real CPU steps" in line
    assert "budget 64.00 GiB cannot fit in this host's available memory (24.00 GiB" in line
    assert not list(run_dir.glob("trials/*"))   # no trial started


def test_the_cmd_host_check_applies_on_the_virtual_gpu_only():
    from oomtune.trial.execute import check_host_memory

    with pytest.raises(ConfigError, match="target=cmd commands on the virtual GPU"):
        check_host_memory("command", 64 * 2**30, available_bytes=24 * 2**30, simulated=True)
    check_host_memory("command", 64 * 2**30, available_bytes=24 * 2**30, simulated=False)   # tensors on the GPU
    check_host_memory("command", 16 * 2**30, available_bytes=24 * 2**30, simulated=True)    # fits


# -- a global batch whose range's low end does not divide it -------------------------------------

def test_a_global_batch_range_starts_at_its_smallest_micro_batch():
    from oomtune.space import SearchSpace

    # 100 = 2^2 x 5^2: its divisors in [8, 512] are 10, 20, 25, 50, 100 (by hand)
    space = SearchSpace(8, 512, {}, global_batch=100)
    assert space.batch_choices() == [10, 20, 25, 50, 100]
    assert (space.batch_low, space.batch_high) == (10, 100)
    # what runs at "the smallest batch" (the meta search's smoke test: one CPU step at batch_low)
    # is a valid micro-batch: 100 / 10 = 10 micro-batches per optimizer step, not an error after a trial
    assert space.grad_accum_for(space.batch_low) == 10
    with pytest.raises(ConfigError, match="micro-batch 8 does not divide search.global_batch=100"):
        space.grad_accum_for(8)


def test_a_free_batch_range_keeps_its_ends():
    from oomtune.space import SearchSpace

    space = SearchSpace(8, 512, {})
    assert (space.batch_low, space.batch_high) == (8, 512)


# -- a stopped worker holding SQLite's lock is not an unreachable storage -------------------------

def _sqlite_error(text: str) -> Exception:
    import sqlite3

    from sqlalchemy import exc as sa_exc

    return sa_exc.OperationalError("BEGIN IMMEDIATE", {}, sqlite3.OperationalError(text))


def test_a_locked_sqlite_storage_is_named_locked_by_another_process_not_unreachable():
    from oomtune.exceptions import StorageUnavailableError
    from oomtune.study.reconnect import _gave_up, retrying

    said: list[str] = []

    def stuck():
        raise _sqlite_error("database is locked")   # what sqlite3 raises after its busy timeout

    try:
        with pytest.raises(StorageUnavailableError) as info:
            retrying(stuck, "claim a trial", say=said.append, delays_s=(0.0,))
    finally:
        _gave_up.clear()
    message = str(info.value)
    assert message.startswith("storage locked by another process for 0 s (1 retries")
    assert "database is locked" in message and "SIGSTOP" in message and "unreachable" not in message
    assert said == ["storage locked by another process while trying to claim a trial: database is locked; "
                    "retry 1 of 1 in 0 s"]


def test_a_lost_connection_is_still_called_unreachable():
    from oomtune.exceptions import StorageUnavailableError
    from oomtune.study.reconnect import _gave_up, retrying

    def lost():
        raise _sqlite_error("disk I/O error")

    try:
        with pytest.raises(StorageUnavailableError, match=r"^storage unreachable for 0 s"):
            retrying(lost, "claim a trial", delays_s=(0.0,))
    finally:
        _gave_up.clear()


def test_a_results_channel_line_nested_too_deeply_is_skipped_like_a_torn_line(tmp_path):
    from oomtune.targets.cmd import read_channel

    path = tmp_path / "channel.jsonl"
    path.write_text('{"event": "report", "samples": 1}\n' + "[" * 100_000 + "]" * 100_000 + "\n"
                    + '{"event": "oom"}\n')
    assert read_channel(path) == [{"event": "report", "samples": 1}, {"event": "oom"}]


def test_an_override_nested_3000_levels_deep_is_one_line_not_a_recursion_error(tmp_path, capsys):
    value = "[" * 3000 + "]" * 3000
    rc = main(["search", "device=cpu", f"search.data.num_workers={value}", f"hydra.run.dir={tmp_path / 'run'}"])
    assert rc == 2
    line = _one_error_line(capsys)
    assert "search.data.num_workers=...: its value nests lists or dictionaries 3000 levels deep" in line


def test_brackets_inside_quotes_do_not_count_as_nesting():
    from oomtune.config import check_override_depth

    check_override_depth("target.command='python t.py " + "[" * 100 + "'")   # one quoted string
    with pytest.raises(ConfigError, match="65 levels deep"):
        check_override_depth("search.space.x=" + "[" * 65 + "]" * 65)
    check_override_depth("search.space.x=" + "[" * 64 + "]" * 64)


def test_a_global_batch_the_ranks_do_not_divide_is_refused_before_any_trial(tmp_path, capsys):
    # 100 samples over trial.gpus=3 ranks: 100 = 3 x 33 + 1, so no equal micro-batch per rank; the
    # nearest multiples of 3 are 99 and 102 (by hand)
    run_dir = tmp_path / "run"
    rc = main(["search", "model=mlp", "model.parallel=ddp", "trial.gpus=3", "device=cpu", "trial.execute=cpu",
               "search.global_batch=100", "search.batch_size.low=2", f"hydra.run.dir={run_dir}"])
    assert rc == 2
    line = _one_error_line(capsys)
    assert line == ("oomtune: error: search.global_batch=100 is not divisible by the world size 3 (trial.gpus: every "
                    "rank trains the same micro-batch): give a multiple of 3, e.g. search.global_batch=99 or 102")
    assert not run_dir.exists()


def test_a_global_batch_is_split_over_the_ranks():
    from omegaconf import OmegaConf

    from oomtune.space import SearchSpace

    search = OmegaConf.create({"batch_size": {"low": 1, "high": 512}, "space": {}, "data": {},
                               "global_batch": 96})
    # 96 over 2 ranks: 48 per rank, whose divisors are 1, 2, 3, 4, 6, 8, 12, 16, 24, 48 (by hand)
    space = SearchSpace.from_config(search, world_size=2)
    assert space.batch_choices() == [1, 2, 3, 4, 6, 8, 12, 16, 24, 48]
    assert space.grad_accum_for(8) == 6   # 96 / (8 x 2)


def test_report_leaves_a_zero_byte_study_db_zero_bytes(tmp_path):
    from oomtune.htmlreport import build_report

    db = tmp_path / "study.db"
    db.write_bytes(b"")
    (tmp_path / "run.json").write_text(json.dumps({"storage": "sqlite:///study.db", "study_name": "s",
                                                   "storage_file": "study.db"}))
    build_report(tmp_path, None, say=lambda line: None)   # the report is its output; the study is only read
    assert db.read_bytes() == b""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html", "run.json", "study.db"]


# -- storage=: a URL that cannot name a storage is refused before the run directory exists ---------------
# SQLAlchemy's make_url parses the URL and get_dialect() loads its dialect ("Can't load plugin:
# sqlalchemy.dialects:bogus" for an unknown one); SQLite creates its file but never the file's folder
# ("unable to open database file"). A new user's trial of the README found each of these refused only
# after the run directory was made, with no fix in the line.
_STORAGE_FORMS = ("give storage= a database URL Optuna opens (sqlite:///PATH, postgresql://USER:PASSWORD@HOST/DB), "
                  "grpc://HOST:PORT for an oomtune storage-proxy, journal:PATH, or leave it unset for a SQLite file "
                  "in the run directory")


@pytest.mark.parametrize("storage, says", [
    ("bogus://x", "storage 'bogus://x': SQLAlchemy has no database named 'bogus': "),
    ("bogus+drv://u:secret@h/db", "storage 'bogus+drv://u:***@h/db': SQLAlchemy has no database named 'bogus+drv': "),
    ("::::", "storage '::::' is not a storage URL: "),
    ("sqlite:////nonexistent-oomtune/dir/x.db", "storage 'sqlite:////nonexistent-oomtune/dir/x.db': the folder "
     "'/nonexistent-oomtune/dir' does not exist (SQLite creates the file, not its folder): create it, or "),
])
def test_a_storage_that_cannot_be_named_is_refused_before_the_run_directory(tmp_path, capsys, storage, says):
    rc = main(["search", "model=mlp", "device=cpu", f"storage={storage}", f"hydra.run.dir={tmp_path / 'run'}"])
    assert rc == 2
    assert _one_error_line(capsys) == f"oomtune: error: {says}{_STORAGE_FORMS}"
    assert not (tmp_path / "run").exists()


def test_the_storage_forms_oomtune_opens_pass_the_early_check(tmp_path):
    from oomtune.study.storage import check_storage_url

    for url in (None, "", "null", f"sqlite:///{tmp_path / 'x.db'}", "sqlite:///:memory:", "postgresql://u:p@h/db",
                "postgresql+psycopg://u:p@h/db", "mysql+pymysql://u:p@h/db", "grpc://127.0.0.1:13000",
                f"journal:{tmp_path / 'j.log'}"):
        check_storage_url(url)   # nothing is connected to: a server that is not there is found when opened
    assert not list(tmp_path.iterdir())   # and nothing is created


def test_a_sqlite_file_in_the_run_directory_to_be_made_passes_and_one_beside_it_does_not(tmp_path):
    from oomtune.exceptions import ConfigError
    from oomtune.study.storage import check_storage_url

    run = tmp_path / "runs" / "mine"   # not made yet: run_dir_of makes it, with its parents, before the study opens
    check_storage_url(f"sqlite:///{run}/study.db", run_dir=run)
    check_storage_url(f"sqlite:///{tmp_path / 'runs'}/shared.db", run_dir=run)            # a folder above it
    check_storage_url(f"sqlite:///{run}/study.db", run_dir=run / "workers" / "worker-0")   # a worker job's
    with pytest.raises(ConfigError, match=r"the folder '.*/runs/other' does not exist"):
        check_storage_url(f"sqlite:///{tmp_path / 'runs' / 'other'}/study.db", run_dir=run)
    assert not list(tmp_path.iterdir())


def test_a_budget_above_the_virtual_gpu_names_both_ways_out(tmp_path, capsys):
    """A new user's finding: budget=1TiB on the virtual GPU (80 GiB unless virtual_device_memory says
    otherwise) said only that it was above, not what to do."""
    rc = main(["search", "model=mlp", "device=cpu", "budget=1TiB", f"hydra.run.dir={tmp_path / 'run'}"])
    assert rc == 2
    assert _one_error_line(capsys) == (
        "oomtune: error: budget 1TiB (1.00 TiB) is above virtual GPU (CPU)'s 80.00 GiB: give a budget up to "
        "80.00 GiB, or size the virtual GPU as your GPU (virtual_device_memory=1TiB)")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("given, fix", [
    (["search.batch_size.low=0"], "got low=0 high=512: set search.batch_size.low=1 or more"),
    (["search.batch_size.low=64", "search.batch_size.high=32"],
     "got low=64 high=32: set search.batch_size.high=64 or more (or a smaller search.batch_size.low)"),
])
def test_a_batch_range_that_holds_no_batch_says_which_end_to_move(tmp_path, capsys, given, fix):
    """A new user's finding: the batch-range refusal stated the rule and the values, but not the fix."""
    rc = main(["search", "model=mlp", "device=cpu", *given, f"hydra.run.dir={tmp_path / 'run'}"])
    assert rc == 2
    assert _one_error_line(capsys) == f"oomtune: error: search.batch_size must satisfy 1 <= low <= high, {fix}"
    assert not (tmp_path / "run").exists()


def test_a_batch_range_of_other_than_whole_numbers_is_refused_with_an_example():
    from oomtune.space import check_batch_range

    with pytest.raises(ConfigError, match=r"got low=8\.5 high=512: give whole numbers, e\.g\. search\.batch_size\.low=8"):
        check_batch_range(8.5, 512)
    with pytest.raises(ConfigError, match=r"got low=True high=512: give whole numbers"):
        check_batch_range(True, 512)   # a bool is not a batch size
    check_batch_range(1, 1)            # one batch size: a range
