"""The memory fraction travels with the answer: best.yaml records it when the answer
needs it (``garbage_collection_threshold`` acts only under a fraction < 1: torch calls
``garbage_collect_cached_blocks`` only with ``allowed_memory_maximum`` set), ``apply_best`` and
``oomtune env`` apply it (``per_process_memory_fraction``, accepted by torch 2.14.1), and
``search.memory_fraction=off`` keeps such configurations out of the answer."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import oomtune.best as B
from oomtune.best import BestConfig, Choice, apply_best, conf_with_fraction, load_best, needs_memory_fraction, write_best
from oomtune.cli import main
from oomtune.exceptions import BestFileError
from oomtune.search.outputs import answer_fraction
from oomtune.trial.record import BudgetReadings, TrialResult, TrialSpec
from oomtune.units import GiB, MiB

GC = "garbage_collection_threshold:0.8,max_split_size_mb:64"
F = 8 * GiB / (80 * GiB)   # the GPT-2 case: an 8 GiB budget on the 80 GiB virtual GPU = 0.1


def _best(tmp_path: Path, conf: str = GC, fraction: float | None = F) -> Path:
    cfg = BestConfig(schema_version=1, workload={"model": {"name": "mlp"}},
                     device={"kind": "cpu", "total_memory_bytes": 80 * GiB, "budget_bytes": 8 * GiB,
                             "memory_source": "simulated", "memory_fraction": "auto"},
                     best=Choice(batch_size=5, alloc_conf=conf, metrics={"throughput": 1.0}, memory_fraction=fraction))
    return write_best(cfg, tmp_path / "best.yaml")


def test_which_answers_need_a_fraction():
    assert needs_memory_fraction("garbage_collection_threshold:0.8") and needs_memory_fraction(GC)
    assert not needs_memory_fraction("") and not needs_memory_fraction("expandable_segments:True")
    assert conf_with_fraction("expandable_segments:True", None) == "expandable_segments:True"
    assert conf_with_fraction("", 0.1) == "per_process_memory_fraction:0.1"
    assert conf_with_fraction(GC, 1 / 3) == f"{GC},per_process_memory_fraction:0.3333333333333333"
    assert B.fraction_key_supported("2.14.1") and not B.fraction_key_supported("2.1.0")


def test_the_fraction_recorded_is_the_trials_for_a_threshold_answer_only():
    res = TrialResult(outcome="ok", budget=BudgetReadings(memory_fraction=F))
    assert answer_fraction(res, GC) == F
    assert answer_fraction(res, "expandable_segments:True") is None        # needs none
    assert answer_fraction(res, GC, mode="off") is None
    assert answer_fraction(TrialResult(outcome="ok"), GC) is None          # the trial had none (1.0): inert there too


def test_a_cpu_trial_records_the_fraction_its_virtual_gpu_applies(monkeypatch):
    from oomtune.trial.child import run_child

    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):   # run in this process: torch's defaults
        monkeypatch.delenv(name, raising=False)

    mlp = {"name": "mlp", "in_features": 64, "hidden": 128, "layers": 1, "num_classes": 10, "optimizer": "sgd",
           "lr": 0.1, "precision": "fp32", "data": {"source": "synthetic"}}
    spec = TrialSpec(workload=mlp, batch_size=4, alloc_conf="", device="cpu",
                     budget_bytes=1 * GiB, device_memory_bytes=80 * GiB, warmup_steps=1, measure_steps=1)
    on = run_child(spec)
    assert on.outcome == "ok" and on.budget.memory_fraction == 1 / 80
    off = run_child(TrialSpec(**{**spec.__dict__, "memory_fraction": False}))
    assert off.budget.memory_fraction is None and off.outcome == "ok"   # a device of the budget's size


def test_best_yaml_round_trips_the_fraction_and_rejects_a_bad_one(tmp_path):
    assert load_best(_best(tmp_path)).memory_fraction == F
    bad = tmp_path / "bad.yaml"
    bad.write_text(_best(tmp_path).read_text().replace("memory_fraction: 0.1\n", "memory_fraction: 1.5\n"))
    with pytest.raises(BestFileError, match="best.memory_fraction must be a number in"):
        load_best(bad)


def test_apply_best_puts_the_fraction_in_the_allocator_variables(tmp_path):
    env: dict[str, str] = {}
    config = apply_best(_best(tmp_path), environ=env)
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == env["PYTORCH_ALLOC_CONF"] == f"{GC},per_process_memory_fraction:0.1"
    assert config.memory_fraction == F and config.memory_fraction_applied
    plain: dict[str, str] = {}
    assert not apply_best(_best(tmp_path, "expandable_segments:True", None), environ=plain).memory_fraction_applied
    assert plain["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


def test_apply_best_returns_the_fraction_where_torch_does_not_accept_the_key(tmp_path, monkeypatch):
    monkeypatch.setattr(B, "fraction_key_supported", lambda version=None: False)
    env: dict[str, str] = {}
    with pytest.warns(UserWarning, match=r"call torch.cuda.set_per_process_memory_fraction\(0.1\) before the first"):
        config = apply_best(_best(tmp_path), environ=env)
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == GC and config.memory_fraction == F and not config.memory_fraction_applied


def test_the_installed_torch_reads_the_fraction_from_the_variable(tmp_path):
    """torch 2.14.1's allocator config parses per_process_memory_fraction (pytorch#161035): the string
    apply_best exports is what torch reports, without error, in a fresh process."""
    path = _best(tmp_path)
    code = ("import oomtune; oomtune.apply_best(%r); import torch; "
            "print(torch._C._accelerator_getAllocatorSettings())" % str(path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"{GC},per_process_memory_fraction:0.1"


def test_oomtune_env_prints_the_fraction(tmp_path, capsys, monkeypatch):
    path = _best(tmp_path)
    assert main(["env", str(path)]) == 0
    assert capsys.readouterr().out.strip() == (f"export PYTORCH_CUDA_ALLOC_CONF={GC},per_process_memory_fraction:0.1 "
                                               f"PYTORCH_ALLOC_CONF={GC},per_process_memory_fraction:0.1")
    monkeypatch.setattr(B, "fraction_key_supported", lambda version=None: False)
    assert main(["env", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"export PYTORCH_CUDA_ALLOC_CONF={GC} PYTORCH_ALLOC_CONF={GC}"
    assert lines[1].startswith("# this answer needs a per-process memory fraction of 0.1 of the 80.00 GiB device")
    assert main(["env"]) == 0
    assert "memory fraction in PYTORCH_CUDA_ALLOC_CONF (per_process_memory_fraction): not accepted" in capsys.readouterr().out


# ---------------------------------------------------------------- search.memory_fraction=off
def test_off_drops_the_threshold_and_predicts_without_a_fraction():
    from oomtune import config as C
    from oomtune.device import resolve_device
    from oomtune.plan.predictor import sim_geometry
    from oomtune.space import SearchSpace

    space = SearchSpace(8, 64, {"garbage_collection_threshold": [None, 0.8, 0.6], "expandable_segments": [False, True]})
    assert space.drop_garbage_collection() == [0.8, 0.6]
    assert all(m["garbage_collection_threshold"] is None for m in space.all_settings()) and len(space.all_settings()) == 2
    dev = resolve_device("cpu", virtual_device_memory="80GiB")
    assert sim_geometry(dev, 1 * GiB) == {"total_memory_bytes": 80 * GiB, "memory_fraction": 1 / 80}
    assert sim_geometry(dev, 1 * GiB, memory_fraction=False) == {"total_memory_bytes": 1 * GiB, "memory_fraction": 1.0}
    auto, off = (C.default_study_name(C.compose([f"search.memory_fraction={m}"])) for m in ("auto", "off"))
    assert auto == C.default_study_name(C.compose([])) and off != auto


@pytest.mark.slow
def test_a_search_with_the_fraction_off_never_recommends_the_threshold(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["search", "model=mlp", "model.in_features=4096", "budget=128MiB", "device=cpu",
                 "search.batch_size.low=8", "search.batch_size.high=512", "search.memory_fraction=off",
                 "search.space.max_split_size_mb=[null]", "search.space.roundup_power2_divisions=[null]",
                 # what is searched and answered is the subject: no clean-process confirmation of the
                 # winner (a spawned interpreter less; it runs the winner's alloc_conf, asserted below)
                 "trial.measure_steps=1", "search.confirm=false", f"hydra.run.dir={run}"]) == 0
    out = capsys.readouterr()
    assert "garbage_collection_threshold [0.8] not searched" in out.err + out.out
    best = load_best(run / "best.yaml")
    assert "garbage_collection_threshold" not in best.alloc_conf and best.memory_fraction is None
    assert best.device["memory_fraction"] == "off"
    import json

    trials = json.loads((run / "trials.json").read_text())
    assert trials and not any("garbage_collection_threshold" in (t.get("alloc_conf") or "") for t in trials)
