"""Memory outside the request stream where the budget is computed (issue 15, item 3).

Figures: pytorch/pytorch#86509 (CUDA context 287,047,680 bytes lazy / 666,632,192 eager) and the
fraction rule of field case C9, ``fraction = (budget - non_allocator) / total``.
"""

from __future__ import annotations

import pytest

from oomtune.device import TargetDevice
from oomtune.plan.predictor import sim_geometry
from oomtune.trial.budget import (
    CUDA_CONTEXT_EAGER_BYTES,
    estimated_non_allocator_bytes,
    memory_fraction_for_budget,
)

GiB = 1 << 30


def test_estimate_without_a_reading_is_the_eager_cuda_context():
    assert estimated_non_allocator_bytes() == 666_632_192 == CUDA_CONTEXT_EAGER_BYTES
    assert estimated_non_allocator_bytes(1_063_780_352) == 1_063_780_352   # a trial's reading wins
    with pytest.raises(ValueError):
        estimated_non_allocator_bytes(-1)


def test_plan_geometry_on_a_real_device_leaves_the_context_outside_the_fraction():
    gpu = TargetDevice("cuda:0", "cuda", 0, "H100", 80 * GiB, False)
    g = sim_geometry(gpu, 40 * GiB)
    assert g["non_allocator_bytes"] == 666_632_192
    # the same fraction the trial sets for this budget with this much outside the allocator (C9)
    assert g["memory_fraction"] == memory_fraction_for_budget(40 * GiB, 80 * GiB, 666_632_192)
    assert g["memory_fraction"] == (40 * GiB - 666_632_192) / (80 * GiB)
    cpu = TargetDevice("cpu", "cpu", None, "cpu", 16 * GiB, True)
    assert sim_geometry(cpu, 8 * GiB) == {"total_memory_bytes": 8 * GiB, "memory_fraction": 1.0}
