"""Input-bound diagnosis (field case C11)."""

from __future__ import annotations

import pytest

from oomtune.diagnose import (input_bound_verdict, is_input_bound, loader_advice,
                              smallest_batch_near_best, throughput_growth)
from oomtune.outcome import Outcome
from oomtune.trial.record import Throughput, TrialResult
from oomtune.workloads import build_workload


def _res(batch_size, throughput, wait=None, util=None, outcome="ok"):
    return TrialResult(outcome=outcome, batch_size=batch_size,
                       throughput=Throughput(samples_per_s=throughput, data_wait_fraction=wait, gpu_utilization=util))


@pytest.mark.parametrize("wait, util, expected", [
    (0.9, None, True),     # most of the step waiting for data
    (0.5, None, True),     # the threshold itself counts
    (0.49, None, False),
    (0.3, 5.0, True),      # C11: ~5% GPU utilisation corroborates a moderate wait (>= 0.25)
    (0.3, 80.0, False),    # a busy GPU: the wait is not the limit
    (0.2, 5.0, False),     # below half the threshold
    (None, 5.0, False),    # no wait reading: unknown is not evidence
])
def test_is_input_bound(wait, util, expected):
    assert is_input_bound(_res(64, 100.0, wait, util)) is expected


def test_failed_trials_are_never_input_bound():
    assert is_input_bound(_res(64, None, 0.95, outcome=Outcome.OOM)) is False


def test_c11_flat_throughput_with_high_wait_is_input_bound():
    # C11: 4 workers x 50 ms per image cap the loader at 4 / 0.05 = 80 images/s at any batch.
    results = [_res(32, 79.0, 0.93, 6.0), _res(64, 80.0, 0.95, 5.0), _res(128, 80.5, 0.96, 4.0),
               _res(256, None, None, outcome=Outcome.OOM)]
    v = input_bound_verdict(results, data_cfg={"num_workers": 4})
    assert v.input_bound
    assert v.evidence["growth"] == pytest.approx(80.5 / 79.0)
    assert v.evidence["throughput_by_batch"] == {32: 79.0, 64: 80.0, 128: 80.5}
    assert "num_workers" in v.advice and "(now 4" in v.advice and "bigger batch will not help" in v.advice
    # The batch to recommend: the smallest within 5% of the best (80.5 * 0.95 = 76.5 <= 79).
    assert smallest_batch_near_best(results).batch_size == 32


def test_high_wait_but_throughput_still_growing_is_not_input_bound():
    v = input_bound_verdict([_res(16, 100.0, 0.6), _res(64, 150.0, 0.55)])
    assert not v.input_bound and "1.50x" in v.reason and v.advice is None


def test_compute_bound_study_is_not_input_bound():
    v = input_bound_verdict([_res(16, 100.0, 0.01), _res(64, 104.0, 0.02)])
    assert not v.input_bound
    assert v.evidence["median_data_wait_fraction"] == pytest.approx(0.015)


def test_without_wait_readings_flat_throughput_needs_low_utilisation():
    flat_idle = [_res(32, 80.0, util=5.0), _res(128, 81.0, util=4.0)]
    flat_busy = [_res(32, 80.0, util=97.0), _res(128, 81.0, util=98.0)]   # a saturated GPU is flat too
    assert input_bound_verdict(flat_idle).input_bound
    assert not input_bound_verdict(flat_busy).input_bound
    assert not input_bound_verdict([_res(32, 80.0), _res(128, 81.0)]).input_bound


def test_no_successful_trials():
    v = input_bound_verdict([_res(8, None, outcome=Outcome.OOM)])
    assert not v.input_bound and "no successful trial" in v.reason
    assert smallest_batch_near_best([]) is None
    assert throughput_growth([_res(8, 10.0)]) is None


def test_loader_advice_without_config_still_names_the_settings():
    text = loader_advice(None)
    assert all(k in text for k in ("num_workers", "pin_memory", "prefetch_factor"))


def _measure(cfg, batch_size, steps=2):
    wl = build_workload(cfg, batch_size, "cpu")
    wl.run_steps(1)   # warm-up (loader start)
    t = wl.run_steps(steps)
    return _res(batch_size, t.samples_per_s, t.data_wait_fraction)


MLP = {"name": "mlp", "in_features": 32, "hidden": 64, "layers": 2, "num_classes": 4}


class _Clock:
    """A stand-in for the ``time`` module of the step loop and the data source: ``sleep`` advances
    it, nothing else does. The loader's decode sleeps are then the only time that passes: the
    measurement no longer depends on how long a loaded machine takes to run the step."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


def test_slow_loader_workload_is_diagnosed_input_bound(monkeypatch):
    # 250 ms of decode per sample on the main process (num_workers 0), through the real loader and
    # step loop, timed by a clock that only the decode sleeps advance (_Clock): each step waits
    # 0.25 s x B for its batch and computes in no time, so the wait is the whole step and the
    # throughput is the loader's, B / (0.25 B) = 4 samples/s at every batch: flat (growth 1.0).
    # On the wall clock the compute time c of a step made it B / (0.25 B + c) and the wait fraction
    # 0.25 B / (0.25 B + c): a loaded machine stretched c to 340 ms and the fraction to 0.75.
    from oomtune.workloads import data, loop

    clock = _Clock()
    monkeypatch.setattr(data, "time", clock)
    monkeypatch.setattr(loop, "time", clock)
    cfg = {**MLP, "data": {"source": "synthetic", "decode_delay_s": 0.25, "num_workers": 0}}
    results = [_measure(cfg, 4), _measure(cfg, 8)]
    for r in results:
        assert r.throughput.data_wait_fraction == 1.0
        assert r.throughput.samples_per_s == pytest.approx(4.0)
    v = input_bound_verdict(results, data_cfg=cfg["data"])
    assert v.input_bound, v.reason
    assert v.evidence["growth"] == pytest.approx(1.0)
    assert "num_workers (now 0" in v.advice


def test_synthetic_workload_is_not_input_bound():
    results = [_measure(MLP, 4, steps=3), _measure(MLP, 16, steps=3)]
    for r in results:
        assert r.throughput.data_wait_fraction < 0.5   # the batch is reused: next() returns at once
    assert not input_bound_verdict(results).input_bound
