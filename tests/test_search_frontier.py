"""Frontier-first search on the README's default workload.

`oomtune search model=resnet` on the virtual GPU must answer with a batch of at least 0.98 x the
largest predicted frontier among the searched configurations, launching at most 14 trial processes
(what the search launched before frontier-first probes: experiments/results/bench_search_cpu.txt).
The expected frontier comes from `oomtune plan` (oomtune.commands.plan.plan) on the same overrides:
an independent path through the plan API, not the search's own output."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import oomtune
from oomtune.cli import main

sys.path.insert(0, str(Path(__file__).parent))
from shared_runs import one_cpu_thread  # noqa: E402

pytestmark = pytest.mark.slow

DEFAULT = ["model=resnet", "device=cpu"]   # the README main command, on the virtual GPU


class _Quiet:
    def print(self, *args, **kwargs):
        pass


def test_default_search_reaches_the_predicted_frontier(tmp_path):
    from oomtune.commands.plan import plan

    fmap = plan([*DEFAULT, f"hydra.run.dir={tmp_path}/plan"], console=_Quiet())
    frontier = max(r.max_batch_size for r in fmap.rows if r.max_batch_size is not None)
    best_conf = [r.alloc_conf for r in fmap.rows if r.max_batch_size == frontier]

    run_dir = tmp_path / "run"
    with one_cpu_thread():   # the smoke test's CPU step on one thread (tests/shared_runs.py)
        assert main(["search", *DEFAULT, f"hydra.run.dir={run_dir}"]) == 0
    best = oomtune.load_best(run_dir / "best.yaml")
    assert best.best.batch_size >= 0.98 * frontier, (best.best.batch_size, frontier, best_conf)
    assert best.study["launches"] <= 14
    assert best.best.confirmed and best.best.metrics["memory_source"] == "simulated"
    assert best.objective["name"] == "batch"  # auto on the virtual GPU
    # Every configuration's predicted frontier is reported, and agrees with the plan's.
    plan_max = {r.alloc_conf: r.max_batch_size for r in fmap.rows}
    reported = {}
    for row in best.frontiers:
        for conf in [row["alloc_conf"], *row["twins"]]:
            reported[conf] = row["predicted_max_batch"]
    assert reported == plan_max
    # ... and both fold the same twins into the same configurations (plan.yaml twin_of, best.yaml twins).
    plan_twins = {c["alloc_conf"]: c["twin_of"] for c in fmap.to_dict()["configurations"] if c["twin_of"] is not None}
    assert plan_twins == {t: row["alloc_conf"] for row in best.frontiers for t in row["twins"]}
