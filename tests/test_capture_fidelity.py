"""Capture fidelity against real GPU recordings.

The recordings are the copies in tests/data (byte-identical to the project's shared traces; see
tests/data/README.md), so these tests run, and can fail, in any clone. Expected figures come from the
recordings and from the workload facts in tests/data/README.md (written from the public code and the
traces, independently of this code); tolerances from experiments/results/capture_fidelity.md (every
error there is within +-0.4%).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / "tests" / "data"
sys.path.insert(0, str(ROOT / "experiments"))

#: The table supports +-0.4% on every peak; the tests allow 1%.
TOLERANCE = 0.01


def _cf():
    import capture_fidelity

    return capture_fidelity


def _load(name: str):
    from oomtune.trace.snapshot import load_snapshot

    return load_snapshot(TRACES / f"{name}.pickle")


@pytest.mark.parametrize("name, peak, phases", [
    # README "Workload facts": Peak and alloc events per phase, as read from the public code/traces
    ("lm-ctx128-fullstep", 54_802_667_524,
     {"forward": 2058, "loss": 14, "backward": 3535, "optimizer": 1164}),
    ("lm-medium-ctx512-training", 12_426_629_128,
     {"forward": 1666, "loss": 11, "backward": 2848, "optimizer": 3066}),
])
def test_recorded_figures_read_from_the_trace(name, peak, phases):
    rec = _cf().recorded_figures(_load(name))
    assert rec["peak_allocated_bytes"] == peak
    assert rec["phases"] == phases


def test_fp32_eager_capture_predicts_the_2_7b_recording():
    """lm-ctx128-fullstep-emptycache: the 2.7B-shape (3.4e9 parameters) model built on meta, the
    recorded step (empty_cache, forward, loss, backward, lazy AdamW); peaks within 1%."""
    out = _cf().compare("lm-ctx128-fullstep-emptycache", TRACES)
    assert abs(out["peak_reserved_err"]) <= TOLERANCE, out["peak_reserved_err"]
    assert abs(out["peak_allocated_err"]) <= TOLERANCE, out["peak_allocated_err"]
    # the forward and the optimizer request exactly what the GPU requested, phase by phase
    rec, pred = out["recorded"]["phases"], out["predicted"]["phases"]
    assert pred["forward"] == rec["forward"] and pred["optimizer"] == rec["optimizer"]
    # the cuBLAS workspace of the autograd thread: one 32 MiB request, recorded and captured
    assert out["recorded"]["sizes"].count(33_554_432) == 1
    assert out["predicted"]["sizes"].count(33_554_432) == 1


def test_bf16_autocast_capture_predicts_the_medium_recording():
    """lm-medium-ctx512-training under torch.autocast("cuda", bfloat16) captured on meta: within 1%;
    ignoring autocast (the capture before CUDA's policy) over-predicts by far more."""
    cf = _cf()
    out = cf.compare("lm-medium-ctx512-training", TRACES)
    assert abs(out["peak_reserved_err"]) <= TOLERANCE, out["peak_reserved_err"]
    assert abs(out["peak_allocated_err"]) <= TOLERANCE, out["peak_allocated_err"]
    assert out["predicted"]["phases"]["forward"] == out["recorded"]["phases"]["forward"]
    old = cf.compare("lm-medium-ctx512-training, autocast ignored (old capture)", TRACES)
    assert old["peak_allocated_err"] > 0.05
