"""The peers compared in experiments/compare_peers.py must recognise the virtual GPU's simulated
out-of-memory error through their own code: Lightning's ``is_oom_error`` (its
BatchSizeFinder) and Accelerate's ``should_reduce_batch_size`` (find_executable_batch_size). Skipped
unless the optional ``peers`` extra is installed."""

from __future__ import annotations

import pytest


def _simulated_oom() -> BaseException:
    from oomtune.capture.virtual_gpu import budgeted_sim

    sim = budgeted_sim("", 64 << 20, 1 << 30)   # a 64 MiB budget on a 1 GiB virtual GPU
    with pytest.raises(Exception) as info:
        sim.malloc(128 << 20)
    return info.value


def test_lightning_recognises_the_simulated_oom():
    memory = pytest.importorskip("lightning.pytorch.utilities.memory")
    exc = _simulated_oom()
    assert memory.is_oom_error(exc)
    assert not memory.is_oom_error(RuntimeError("some other failure"))


def test_accelerate_recognises_the_simulated_oom():
    memory = pytest.importorskip("accelerate.utils.memory")
    exc = _simulated_oom()
    assert memory.should_reduce_batch_size(exc)
    assert not memory.should_reduce_batch_size(RuntimeError("some other failure"))
