"""Shape distributions for users' own models: a python entry declares its lengths
in ``target.seq_len``; the trial's batches follow them, the frontier is predicted at the worst one
and the virtual-GPU soak replays them."""

from __future__ import annotations

from pathlib import Path

import pytest

from oomtune.exceptions import ConfigError
from oomtune.trial.soak import soak, soak_supported
from oomtune.search.run import worst_shape_workload
from oomtune.targets.python_entry import build_user_workload
from oomtune.trial.soak_check import live_workload
from oomtune.trial.record import TrialSpec
from oomtune.workloads.shapes import entry_shape_distribution

ENTRY = str(Path(__file__).resolve().parent / "data" / "lm_entry.py") + ":make_workload"
LENGTHS = {"low": 8, "high": 64, "pad_multiple": 8, "seed": 3}
WORKLOAD = {"target": {"name": "python", "entry": ENTRY, "seq_len": LENGTHS}}


def test_the_trials_batches_follow_the_declared_lengths():
    wl = build_user_workload(WORKLOAD["target"], 4, "cpu")
    expected = entry_shape_distribution(WORKLOAD["target"]).sequence(4, 12)
    got = [next(wl.batches())[0].shape for _ in range(12)]
    assert [tuple(s) for s in got] == [(4, n) for n in expected]
    assert len(set(expected)) > 2 and all(n % 8 == 0 and 8 <= n <= 64 for n in expected)


def test_the_frontier_and_a_confirmation_meet_the_longest_sequences():
    worst = worst_shape_workload(WORKLOAD)
    assert worst["target"]["seq_len"] == 64 and worst["target"]["entry"] == ENTRY
    spec = TrialSpec(workload=WORKLOAD, batch_size=2, shapes="worst")
    assert live_workload(spec).target["seq_len"] == 64   # the spec read from spec.json's flat form
    assert worst_shape_workload({"target": {"name": "python", "entry": ENTRY}}) == {
        "target": {"name": "python", "entry": ENTRY}}   # nothing declared: fixed


def test_the_soak_replays_the_declared_lengths():
    assert soak_supported(WORKLOAD) and not soak_supported({"target": {"name": "python", "entry": ENTRY}})
    res = soak(WORKLOAD, 4, "", device_memory_bytes=1 << 30, steps=200)
    distinct = set(entry_shape_distribution(WORKLOAD["target"]).sequence(4, 200))
    assert res.passed and res.steps_run == 200 and res.distinct_shapes == len(distinct)
    # Batch 32: the logits (32 x T x 256 fp32) are 32 KiB x T; from T = 32 on they reach 1 MiB and go to
    # the large pool, whose first segment for a request under 10 MiB is kLargeBuffer = 20 MiB
    # (CUDACachingAllocator.cpp); every other tensor stays in 2 MiB small-pool segments. On a 16 MiB
    # device the soak therefore runs out of memory at the first step of length 32 or more, not before.
    sequence = entry_shape_distribution(WORKLOAD["target"]).sequence(32, 200)
    first_long = next(i for i, n in enumerate(sequence) if n >= 32)
    tight = soak(WORKLOAD, 32, "", device_memory_bytes=16 << 20, steps=200)
    assert not tight.passed and tight.failed_step == first_long + 1 and tight.shape_at_failure == sequence[first_long]


def test_a_declared_distribution_needs_make_batch(tmp_path):
    path = tmp_path / "no_make.py"
    path.write_text("import torch\n"
                    "def make_workload(batch_size):\n"
                    "    m = torch.nn.Linear(2, 2)\n"
                    "    return {'model': m, 'optimizer': torch.optim.SGD(m.parameters(), lr=0.1), 'batches': []}\n")
    with pytest.raises(ConfigError, match=r"target.seq_len declares a shape distribution, so the returned dict "
                                          r"needs make_batch\(seq_len\)"):
        build_user_workload({"name": "python", "entry": f"{path}:make_workload", "seq_len": LENGTHS}, 2, "cpu")
    with pytest.raises(ConfigError, match="target.seq_len.low=0: expected an integer >= 1"):
        entry_shape_distribution({"seq_len": {"low": 0, "high": 8}})
