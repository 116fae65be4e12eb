"""Config composition, budget/device resolution, best.yaml loading and applying."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from oomtune.best import BestConfig, Choice, apply_best, load_best, write_best
from oomtune.config import compose, conf_dir, run_dir_of
from oomtune.device import TargetDevice, resolve_budget, resolve_device
from oomtune.exceptions import BestFileError, ConfigError, DeviceError
from oomtune.space import SearchSpace
from oomtune.units import GiB, parse_size

GPU16 = TargetDevice("cuda:0", "cuda", 0, "Fake 16 GiB", 16 * GiB, False)


def test_conf_dir_found_and_composes_defaults():
    assert (conf_dir() / "config.yaml").is_file()
    cfg = compose([])
    assert cfg.model.name == "resnet" and cfg.target.name == "builtin"
    assert str(cfg.hydra.run.dir) == f"runs/{cfg.study_name}"


def test_study_name_is_stable_and_config_dependent():
    a, b = compose(["budget=1GiB"]).study_name, compose(["budget=1GiB"]).study_name
    c = compose(["budget=2GiB"]).study_name
    assert a == b and a != c and a.startswith("resnet-")


def test_model_gpu_auto_keeps_the_study_names_of_before():
    """model.gpu enters the study name only when set: the README's study of
    `oomtune search model=resnet` keeps its name (resnet-3d853044, experiments/results/
    readme_main_command.log) and resumes; another target GPU is another study."""
    assert compose(["model=resnet"]).study_name == "resnet-3d853044"
    assert compose(["model=resnet", "model.gpu=h100"]).study_name not in ("resnet-3d853044",
                                                                          compose(["model=resnet", "model.gpu=t4"]).study_name)


@pytest.mark.parametrize("override, needle", [
    ("model=nope", "there is no 'nope' in the config group 'model'; choose one of mlp, resnet, transformer"),
    ("model=resnt", "choose one of mlp, resnet, transformer (did you mean model=resnet?)"),
    ("target=pyhton", "choose one of builtin, cmd, python (did you mean target=python?)"),
    ("nosuchkey=1", "unknown config key 'nosuchkey': the config has model, search"),
    ("serch.n_trials=3", "unknown config key 'serch.n_trials'; did you mean 'search.n_trials'?"),
    ("search.data.bogus=[1]", "search.data has num_workers, pin_memory, prefetch_factor"),
    ("budget", "Error parsing override"),
])
def test_bad_overrides_are_one_line_config_errors(override, needle):
    with pytest.raises(ConfigError) as info:
        compose([override])
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_run_dir_override_and_unwritable(tmp_path):
    cfg = compose([f"hydra.run.dir={tmp_path}/r"])
    assert run_dir_of(cfg) == tmp_path / "r"
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="not writable"):
        run_dir_of(compose([f"hydra.run.dir={blocker}/sub"]))


def test_budget_sizes_and_fractions():
    assert resolve_budget("8GiB", GPU16) == 8 * GiB
    assert resolve_budget("0.5", GPU16) == 8 * GiB
    assert resolve_budget(0.25, GPU16) == 4 * GiB
    assert parse_size("1.5GB") == 1_500_000_000
    with pytest.raises(DeviceError, match="above"):
        resolve_budget("17GiB", GPU16)
    with pytest.raises(ConfigError):
        resolve_budget("lots", GPU16)


def test_device_resolution_on_cpu():
    dev = resolve_device("cpu", virtual_device_memory="24GiB")
    assert dev.simulated and dev.total_memory_bytes == 24 * GiB and dev.memory_source == "simulated"
    with pytest.raises(ConfigError):
        resolve_device("tpu")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the no-CUDA path")
def test_cuda_requested_without_cuda_is_a_device_error():
    with pytest.raises(DeviceError, match="CUDA is not available"):
        resolve_device("cuda:0")


def test_space_always_contains_the_default_and_rejects_bad_values():
    space = SearchSpace(8, 64, {"expandable_segments": [True], "max_split_size_mb": [64]})
    assert space.choices == {"expandable_segments": [False, True], "max_split_size_mb": [None, 64]}
    assert space.default(32).alloc_conf == ""
    assert space.candidate(32, {"max_split_size_mb": 64}).alloc_conf == "max_split_size_mb:64"
    with pytest.raises(ConfigError, match="max_split_size_mb"):
        SearchSpace(8, 64, {"max_split_size_mb": [10]})  # torch: must be >= 20
    with pytest.raises(ConfigError):
        SearchSpace(64, 8, {})


def _best(tmp_path: Path, conf: str = "expandable_segments:True") -> Path:
    cfg = BestConfig(schema_version=1, workload={"model": {"name": "mlp"}}, device={"kind": "cpu"},
                     best=Choice(batch_size=32, alloc_conf=conf, metrics={"throughput": 1.0}))
    return write_best(cfg, tmp_path / "best.yaml")


def test_best_round_trip_and_env_line(tmp_path):
    path = _best(tmp_path)
    best = load_best(path)
    assert best.batch_size == 32 and best.alloc_conf == "expandable_segments:True"
    assert best.export_line() == ("export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
                                  "PYTORCH_ALLOC_CONF=expandable_segments:True")
    assert load_best(tmp_path).batch_size == 32  # a run directory works too


def test_the_workload_section_reads_as_one_typed_spec(tmp_path):
    """best.yaml's workload section (model with its gpu key, ranks, training) and device.target_gpu
    read back as the typed spec: the recorded target GPU wins over model.gpu, the training settings
    stand apart from the model keys, a hand-written section without a target is a built-in workload."""
    cfg = BestConfig(schema_version=1, device={"kind": "cpu", "target_gpu": {"key": "sm90:132", "source": "model.gpu"}},
                     workload={"model": {"name": "mlp", "gpu": "a100"}, "ranks": 2,
                               "training": {"grad_accum": 4}},
                     best=Choice(batch_size=8, alloc_conf="", metrics={"throughput": 1.0}))
    spec = load_best(write_best(cfg, tmp_path / "best.yaml")).workload_spec
    assert (spec.target, spec.model, spec.gpu, spec.gpu_source, spec.ranks, spec.training) == (
        {"name": "builtin"}, {"name": "mlp"}, "sm90:132", "model.gpu", 2, {"grad_accum": 4})
    # a value the typed spec cannot carry is refused when the file is read, in one line naming the key
    (tmp_path / "bad.yaml").write_text("schema_version: 1\nworkload: {ranks: two}\ndevice: {}\n"
                                       "best: {batch_size: 8, alloc_conf: ''}\n")
    with pytest.raises(BestFileError, match=r"workload\.ranks must be an integer >= 1"):
        load_best(tmp_path / "bad.yaml")


@pytest.mark.parametrize("text, needle", [
    ("best: [1, 2", "not valid YAML"),
    ("- a\n- b\n", "expected a mapping"),
    ("schema_version: 99\n", "unsupported schema_version"),
    ("schema_version: 1\nworkload: {}\ndevice: {}\n", "missing required section 'best'"),
    ("schema_version: 1\nworkload: {}\ndevice: {}\nbest: {batch_size: 0, alloc_conf: ''}\n", "positive integer"),
    ("schema_version: 1\nworkload: {}\ndevice: {}\nbest: {batch_size: 8, alloc_conf: 'expandable_segments:true'}\n",
     "alloc_conf is invalid"),
])
def test_corrupt_best_yaml_is_one_clear_error(tmp_path, text, needle):
    path = tmp_path / "best.yaml"
    path.write_text(text)
    with pytest.raises(BestFileError, match=needle):
        load_best(path)


def test_apply_best_sets_both_variables(tmp_path):
    env: dict[str, str] = {}
    apply_best(_best(tmp_path), environ=env)
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
                   "PYTORCH_ALLOC_CONF": "expandable_segments:True"}


def test_apply_best_in_a_fresh_process_before_cuda(tmp_path):
    path = _best(tmp_path)
    code = ("import oomtune, os; b = oomtune.apply_best(%r); import torch; "
            "print(os.environ['PYTORCH_CUDA_ALLOC_CONF'], b.batch_size)" % str(path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["expandable_segments:True", "32"]


def test_apply_best_refuses_a_backend_change_after_import(tmp_path, monkeypatch):
    import oomtune.best as B

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    path = _best(tmp_path, "backend:cudaMallocAsync")
    with pytest.raises(B.CudaAlreadyInitializedError, match="before `import torch`"):
        apply_best(path)


def test_a_study_created_before_model_gpu_still_resumes():
    """A study's stored workload from before ``model.gpu`` existed has no ``gpu``: compared without it (resumes);
    a stored one with another gpu is another workload (refused)."""
    import optuna

    from oomtune.exceptions import ConfigError
    from oomtune.search.run import _check_resume

    study = optuna.create_study()
    old = {"name": "mlp", "target": {"name": "builtin"}}
    study.set_user_attr("workload", old)
    study.set_user_attr("budget_bytes", 1 << 30)
    _check_resume(study, {**old, "gpu": "a100", "gpu_source": "default"}, 1 << 30)
    study.set_user_attr("workload", {**old, "gpu": "a100", "gpu_source": "default"})
    with pytest.raises(ConfigError, match="created for another workload"):
        _check_resume(study, {**old, "gpu": "h100", "gpu_source": "model.gpu"}, 1 << 30)


def test_a_missing_run_names_the_runs_beside_it(tmp_path):
    """``oomtune show/check/env runs/NAME`` with a name that is not there: one line naming what was
    asked for and the run directories next to it that hold a best.yaml, the closest name first
    (a mistyped hash), so the user can copy the right one."""
    import os

    from oomtune.best import load_best
    from oomtune.exceptions import BestFileError

    runs = tmp_path / "runs"
    for i, name in enumerate(["mlp-0818c420", "mlp-53e3f053", "resnet-0a1b2c3d"]):   # oldest first
        (runs / name).mkdir(parents=True)
        (runs / name / "best.yaml").write_text("schema_version: 1\n")
        os.utime(runs / name / "best.yaml", (1000 + i, 1000 + i))
        os.utime(runs / name, (1000 + i, 1000 + i))
    (runs / "empty-run").mkdir()   # no best.yaml: not offered
    with pytest.raises(BestFileError) as err:
        load_best(runs / "mlp-0818c42")
    assert str(err.value) == (f"cannot read {str(runs / 'mlp-0818c42')!r}: no such run directory or best.yaml; "
                              f"runs with a best.yaml in {str(runs)!r}: mlp-0818c420, resnet-0a1b2c3d, mlp-53e3f053")
    # the closest name leads although it is the oldest; the rest newest first
    with pytest.raises(BestFileError) as err:   # a path to the file itself: its directory is what is missing
        load_best(tmp_path / "elsewhere" / "best.yaml")
    assert str(err.value).endswith("`oomtune search` writes runs/NAME/best.yaml (its last lines name the file)")


def test_the_resume_line_counts_every_roles_finished_trials_and_the_interrupted():
    # Found by a new user: a target=cmd search stopped during its recordings said "0 baseline trials,
    # 0 frontier trials, 0 search trials, 0 confirm trials already finished" after 3 record trials had
    # finished (the record role was not counted), and nothing at all when no trial was interrupted.
    import optuna

    from oomtune.search.run import _resume_line
    from oomtune.study import records as R

    def study_with(*trials):
        study = optuna.create_study(storage=optuna.storages.InMemoryStorage())
        for role, state in trials:
            t = study.ask()
            t.set_user_attr(R.ATTR_ROLE, role)
            if state == "done":
                t.set_user_attr(R.ATTR_RESULT, {"outcome": "ok"})
                study.tell(t, 1.0)
            else:   # killed by a stop signal: failed, no result
                study.tell(t, state=optuna.trial.TrialState.FAIL)
        return study

    assert _resume_line(study_with()) is None
    assert _resume_line(study_with(("record", "done"), ("record", "done"), ("record", "done"))) == \
        "resuming: 3 record trials already finished"
    assert _resume_line(study_with(("record", "done"), ("baseline", "done"), ("baseline", "stopped"))) == (
        "resuming: 1 record trial, 1 baseline trial already finished; 1 interrupted without a result "
        "(each tried again only where the search still needs it)")
    assert _resume_line(study_with(("search", "stopped"))) == (
        "resuming: no trial already finished; 1 interrupted without a result (each tried again only where the "
        "search still needs it)")
