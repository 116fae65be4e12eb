"""A search that cannot run, or cannot fit anything, is refused before any trial, and
the advice at the end of a failed search matches how its trials failed."""

from __future__ import annotations

from pathlib import Path

import pytest

from oomtune.cli import main
from oomtune.device import fraction_note, resolve_device
from oomtune.search.outputs import nothing_fitted_message

REPO = Path(__file__).resolve().parent.parent
# The tiny MLP of tests/test_regression_check.py: every tensor below 1 MiB and all live tensors well
# below 2 MiB, so the caching allocator holds exactly one small-pool segment of 2 MiB (kSmallBuffer).
TINY_MLP = ["model=mlp", "model.in_features=64", "model.hidden=128", "model.layers=1", "model.num_classes=10",
            "model.optimizer=sgd", "device=cpu"]


def test_a_command_without_baseline_under_the_batch_objective_is_refused_before_it_starts(tmp_path, capsys):
    run = tmp_path / "run"
    code = main(["search", "target=cmd", f"target.command='python {REPO / 'examples' / 'train_cmd.py'} --batch-size {{batch_size}}'",
                 "search.objective=batch", "search.baseline=false", "device=cpu", f"hydra.run.dir={run}"])
    err = capsys.readouterr().err
    assert code == 2
    assert ("this search would launch no trial: search.objective=batch, search.baseline=false, no prediction "
            "(target=cmd: a command cannot be captured); set search.baseline=true or search.objective=throughput with "
            "search.n_trials > 0") in err
    assert not (run / "study.db").exists() and not (run / "trials").exists()


def test_no_baseline_and_no_frontier_configurations_is_refused(tmp_path, capsys):
    code = main(["search", *TINY_MLP, "search.objective=batch", "search.baseline=false", "search.frontier_configs=0",
                 f"hydra.run.dir={tmp_path / 'run'}"])
    assert code == 2 and "search.frontier_configs=0" in capsys.readouterr().err


@pytest.mark.usefixtures("no_cublas_workspaces")   # a hand-sized device of a few MiB
def test_a_budget_nothing_fits_is_refused_naming_the_smallest_predicted_peak(tmp_path, capsys):
    # limit = 2 MiB x 0.95 = 1992294 B = 1.90 MiB; the smallest peak is the one 2 MiB small-pool segment (hand
    # calculation). A budget below 2 MiB is refused before any prediction (tests/test_bad_input_refused.py).
    run = tmp_path / "run"
    code = main(["search", *TINY_MLP, "budget=2MiB", f"hydra.run.dir={run}"])
    err = capsys.readouterr().err
    assert code == 2
    assert ("nothing fits budget 2.00 MiB: the smallest predicted peak reserved is 2.00 MiB (simulated) at batch 8 "
            "with the default allocator, above the limit 1.90 MiB (budget minus 5% headroom)") in err
    assert not (run / "trials").exists()


def test_a_fraction_budget_on_the_virtual_gpu_names_the_device_size_it_assumes():
    dev = resolve_device("cpu", virtual_device_memory="80GiB")
    note = fraction_note("0.5", dev, 40 << 30)
    assert note.startswith("note: budget=0.5 is a fraction of the virtual GPU's 80.00 GiB (virtual_device_memory): "
                           "40.00 GiB; set virtual_device_memory to your GPU's memory")
    assert fraction_note("16GiB", dev, 16 << 30) is None


@pytest.mark.parametrize("outcomes, says, not_says", [
    ({"oom": 3, "ok_over_limit": 1}, ["ran out of memory or above the limit (3 oom, 1 ok_over_limit",
                                      "memory: lower search.batch_size.low or raise budget"], ["timeout"]),
    ({"timeout": 2}, ["failed (2 timeout;", "timeout: not memory: raise the per-trial timeout (trial.timeout)"],
     ["lower search.batch_size.low"]),
    ({"crash": 1, "error": 1, "oom": 1}, ["failed (1 crash, 1 error, 1 oom;", "crash: a native crash or a kill from outside",
                                          "error: a setup fault or a bug, not a memory limit", "memory: lower"], []),
])
def test_the_advice_of_a_failed_search_matches_how_its_trials_failed(outcomes, says, not_says):
    text = nothing_fitted_message(outcomes, Path("runs/x/trials.json"))
    for needle in says:
        assert needle in text, text
    for needle in not_says:
        assert needle not in text, text
