"""``oomtune check --mode predict`` on a best.yaml from a target oomtune cannot capture (target=cmd,
the HF and Lightning integrations): it replays the allocation stream the search's prediction replayed
(``best.predicted_stream``, beside best.yaml) on the current virtual GPU.

The field case: check --mode predict was refused for HF and Lightning runs ("no prediction
recorded"). Expected figures are hand calculations from CUDACachingAllocator.cpp.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import yaml

from oomtune.alloc.stream import AllocationStream
from oomtune.cli import main
from oomtune.units import GiB, MiB

from shared_runs import train_cmd_search  # noqa: F401  (a session's shared search)

# One request of 512 B and one of 4 MiB, both live at the end. CUDACachingAllocator.cpp,
# get_allocation_size: a request <= kSmallSize (1 MiB) gets a kSmallBuffer (2 MiB) segment; one
# below kMinLargeAlloc (10 MiB) a kLargeBuffer (20 MiB) segment: peak reserved 2 + 20 = 22 MiB.
STREAM = AllocationStream([("alloc", 1, 512, 0), ("alloc", 2, 4 * MiB, 0)])
PEAK = 22 * MiB


def _write(tmp_path: Path, *, predicted: int | None = PEAK, stream: AllocationStream | None = STREAM,
           sha: str | None = None, budget: int = 1 * GiB) -> Path:
    best = {"batch_size": 8, "alloc_conf": "", "settings": {},
            "metrics": {"throughput": 1.0, "peak_reserved_bytes": PEAK, "memory_source": "simulated"},
            "predicted_peak_reserved_bytes": predicted}
    if stream is not None:
        stream.save(tmp_path / "best_stream.bin")
        best["predicted_stream"] = "best_stream.bin"
        best["predicted_stream_sha256"] = sha or hashlib.sha256((tmp_path / "best_stream.bin").read_bytes()).hexdigest()
    data = {"schema_version": 1,
            "workload": {"target": {"name": "cmd", "command": "python train.py --batch-size {batch_size}"}},
            "device": {"kind": "cpu", "name": "virtual GPU (CPU)", "total_memory_bytes": 80 * GiB,
                       "budget_bytes": budget, "memory_source": "simulated"},
            "best": best}
    (tmp_path / "best.yaml").write_text(yaml.safe_dump(data))
    return tmp_path / "best.yaml"


def test_a_recorded_stream_is_replayed_and_matches(tmp_path, capsys):
    path = _write(tmp_path)
    assert main(["check", str(path), "--mode", "predict"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == (
        "oomtune check: PASS predicted peak reserved 22.00 MiB (simulated) vs recorded 22.00 MiB "
        "(+0.00%, tolerance 0.50%)")
    assert main(["check", str(tmp_path), "--mode", "predict"]) == 0   # the run directory works as well


def test_a_prediction_that_moved_fails_and_a_budget_too_small_does_not_fit(tmp_path, capsys):
    assert main(["check", str(_write(tmp_path, predicted=20 * MiB)), "--mode", "predict"]) == 1   # +10%
    assert "+10.00%" in capsys.readouterr().out
    assert main(["check", str(_write(tmp_path, budget=21 * MiB)), "--mode", "predict"]) == 1
    assert "does not fit" in capsys.readouterr().out


def test_a_missing_or_replaced_stream_and_no_stream_exit_2_with_one_line(tmp_path, capsys):
    path = _write(tmp_path, sha="0" * 64)   # not the stream that was recorded
    assert main(["check", str(path), "--mode", "predict"]) == 2
    err = capsys.readouterr().err.strip()
    assert "is not the stream the search recorded" in err and len(err.splitlines()) == 1
    path = _write(tmp_path)
    (tmp_path / "best_stream.bin").unlink()
    assert main(["check", str(path), "--mode", "predict"]) == 2
    assert "best.predicted_stream: cannot read" in capsys.readouterr().err
    path = _write(tmp_path, stream=None)   # a best.yaml from before streams were kept
    assert main(["check", str(path), "--mode", "predict"]) == 2
    err = capsys.readouterr().err
    assert "names no recorded allocation stream" in err and "--mode run" in err


@pytest.mark.slow
def test_a_cmd_search_writes_a_stream_that_check_predict_replays(train_cmd_search, capsys):
    # `oomtune search target=cmd` of examples/train_cmd.py (hidden 1024) at 64 MiB: tests/shared_runs.py's
    # search, shared with tests/test_recorded.py (which checks its recordings and predictions against plan)
    code, run = train_cmd_search
    assert code == 0
    best = yaml.safe_load((run / "best.yaml").read_text())["best"]
    assert best["predicted_stream"] == "best_stream.bin"
    assert isinstance(best["predicted_peak_reserved_bytes"], int)
    capsys.readouterr()
    assert main(["check", str(run / "best.yaml"), "--mode", "predict"]) == 0
    assert "PASS" in capsys.readouterr().out
