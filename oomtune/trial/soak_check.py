"""The trial's soak: after the measured steps pass, the virtual GPU soaks the candidate for
``TrialSpec.soak_steps`` steps of the workload's shape sequence (:mod:`oomtune.trial.soak`); running
out of memory at soak step k makes the trial infeasible, and the record says at which step and why.

Also the shape order of the live steps (``TrialSpec.shapes``): ``data`` (the distribution's seeded
order) or ``worst`` (every live step at the distribution's largest shape,
:func:`oomtune.workloads.shapes.worst_shapes`: a confirmation run meets the worst case).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from oomtune.outcome import Outcome
from oomtune.trial.record import ResultDraft, SoakReadings, TrialSpec
from oomtune.workload_spec import WorkloadSpec

__all__ = ["SHAPE_ORDERS", "live_workload", "run_soak", "soak_verdict"]

#: ``TrialSpec.shapes`` values.
SHAPE_ORDERS = ("data", "worst")


def live_workload(spec: TrialSpec) -> WorkloadSpec:
    """The workload the live steps train: ``spec.workload``, or for ``shapes="worst"`` the same
    workload fixed at its largest shape (:meth:`oomtune.trial._base.Target.at_shape`; for a built-in
    workload :func:`oomtune.workloads.shapes.at_shape`).

    Raises:
        ConfigError: an unknown ``spec.shapes``, a bad shape distribution.
    """
    from oomtune.exceptions import ConfigError

    if spec.shapes not in SHAPE_ORDERS:
        raise ConfigError(f"trial shapes={spec.shapes!r}: expected one of {', '.join(SHAPE_ORDERS)}")
    workload = spec.workload
    if spec.shapes == "data":
        return workload
    from oomtune.trial._base import target_for

    target = target_for(workload)
    dist = target.shapes(workload)
    if dist.is_fixed:
        return workload
    return target.at_shape(workload, max(dist.support(), key=lambda s: -1 if s is None else s))


def run_soak(spec: TrialSpec, rec: ResultDraft, new_sim: Callable[[], Any], *,
             capture_device: str = "meta") -> None:
    """Soak ``spec`` (its workload's data order, ``spec.soak_steps`` steps) on a fresh virtual GPU
    from ``new_sim()`` and write ``result.soak`` (:class:`SoakReadings`) (:func:`soak_verdict` then
    judges them). Nothing happens for ``soak_steps`` 0 or a non-built-in target.

    Args:
        new_sim: makes a ``CachingAllocatorSim`` of the trial's geometry: the one the trial's own
            steps ran on (CPU trial) or the device's figures (CUDA trial).
        capture_device: ``cpu`` on a CPU trial (its first steps then equal the trial's own),
            ``meta`` otherwise.
    """
    from oomtune.trial.soak import soak, soak_supported

    if spec.soak_steps <= 0:
        return
    flat = spec.workload.to_dict()   # the soak captures (and caches) a built-in workload's flat form
    if not soak_supported(flat):
        return
    t0 = time.perf_counter()
    res = soak(flat, spec.batch_size, spec.alloc_conf, steps=spec.soak_steps, capture_device=capture_device,
               new_sim=new_sim)
    rec.set(soak=SoakReadings(
        passed=res.passed, steps_run=res.steps_run, failed_step=res.failed_step, shape=res.shape_at_failure,
        reserved_bytes=res.reserved_bytes, allocated_bytes=res.allocated_bytes,
        peak_reserved_bytes=res.peak_reserved_bytes, message=res.message, seconds=time.perf_counter() - t0,
        distinct_shapes=res.distinct_shapes, fragmentation_failure=None if res.passed else res.fragmentation_failure))
    if not res.passed:
        rec.update("memory", oom_requested_bytes=res.requested_bytes)


def soak_verdict(spec: TrialSpec, rec: ResultDraft) -> None:
    """After the live steps passed (``result.outcome`` ok): a failed soak makes the trial infeasible:
    outcome ``oom_fragmentation`` (reserved - allocated >= the request) or ``oom``, with a message
    naming the soak step, the shape and the figures, and the classifier's advice."""
    from oomtune.classify import ADVICE

    soak = rec.result.soak
    if soak is None or soak.passed:
        return
    outcome = Outcome.OOM_FRAGMENTATION if soak.fragmentation_failure else Outcome.OOM
    rec.set(outcome=outcome, message=f"passed the {spec.warmup_steps + spec.measure_steps} live steps, then {soak.message}",
            advice=ADVICE[outcome])
