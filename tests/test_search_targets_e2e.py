"""`oomtune search` end to end with the user's own workloads (README examples), on CPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import oomtune
from oomtune.cli import main

sys.path.insert(0, str(Path(__file__).parent))
from shared_runs import one_cpu_thread  # noqa: E402

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
COMMON = ["device=cpu", "search.n_trials=2", "search.batch_size.low=4", "search.batch_size.high=64",
          "trial.measure_steps=1", "trial.confirm_steps=2", "trial.timeout=120"]
#: No confirmation run of the winner (a spawned trial process of its own, the costliest process of each
#: search here): what these tests check is the target's own plumbing (the entry resolved, the command's
#: report, best.yaml's target and `oomtune check` on it, which runs best.yaml's workload in a spawned
#: process itself), and the confirmation run is tested on its own (tests/test_search_confirm_failures.py).
NO_CONFIRM = ["search.confirm=false"]


@pytest.fixture(autouse=True)
def single_thread():
    """The trials' CPU steps on one thread (tests/shared_runs.py: CPU seconds on a shared machine, not
    results; no CPU timing is asserted)."""
    with one_cpu_thread():
        yield


def test_target_python_with_a_relative_entry_path(tmp_path, monkeypatch):
    # The README's example, run from the repository root with a relative file path: trials run in
    # their own directories, so the entry must be resolved in the parent.
    monkeypatch.chdir(REPO)
    run_dir = tmp_path / "py"
    code = main(["search", "target=python", "target.entry=examples/my_workload.py:make_workload",
                 "budget=64MiB", "model.gpu=t4", *COMMON, *NO_CONFIRM, f"hydra.run.dir={run_dir}"])
    assert code == 0
    best = oomtune.load_best(run_dir / "best.yaml")
    assert best.device["target_gpu"]["key"] == "t4"   # model.gpu travels with a python target too
    assert best.workload == {"target": {"name": "python", "entry": str(REPO / "examples/my_workload.py") + ":make_workload"}}
    assert best.study["study_name"].startswith("python-")
    # on the virtual GPU the trials run their steps on the meta device (trial.execute=auto): no throughput
    assert best.best.metrics["memory_source"] == "simulated" and best.best.metrics["throughput"] is None
    assert 4 <= best.batch_size <= 64
    # and the CI check works on it, in both modes
    assert main(["check", str(run_dir / "best.yaml"), "--mode", "predict"]) == 0
    assert main(["check", str(run_dir / "best.yaml"), "--mode", "run"]) == 0


def test_target_cmd_with_the_example_script(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    run_dir = tmp_path / "cmd"
    command = "python examples/train_cmd.py --batch-size {batch_size}"
    # one batch size (4): a command target's batches are recorded and probed one run of the script each,
    # and nothing here reads which batch won (this script's recordings and probes over a batch range are
    # asserted on tests/shared_runs.py's train_cmd search, in tests/test_recorded.py)
    code = main(["search", "target=cmd", f"target.command='{command}'", "budget=64MiB",
                 *[o for o in COMMON if not o.startswith("search.batch_size.high=")], "search.batch_size.high=4",
                 *NO_CONFIRM, f"hydra.run.dir={run_dir}"])
    assert code == 0
    best = oomtune.load_best(run_dir / "best.yaml")
    assert best.workload["target"]["name"] == "cmd" and best.workload["target"]["cwd"] == str(REPO)
    # the script reported its throughput through oomtune.report() and ran on the virtual GPU
    assert best.best.metrics["throughput"] > 0 and best.best.metrics["memory_source"] == "simulated"
    assert best.best.metrics["peak_reserved_bytes"] > 0
    assert main(["check", str(run_dir / "best.yaml"), "--mode", "run"]) == 0
