"""Predicting a trial's memory without running it (xMem-style: Middleware 2025, arXiv 2510.21048).

A trial process on the virtual GPU registers the workload's parameters, buffers and static batch,
then runs its steps while every new storage is fed to a :class:`CachingAllocatorSim`. The predictor
does the same on the meta device (no compute, no memory): the same request stream in the same order,
replayed under each allocator setting. ``PREDICT_STEPS`` steps are captured: the first creates the
optimizer state, the second is the steady state, and later steps repeat the second's stream.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from oomtune.alloc.settings import AllocatorSettings

__all__ = ["PREDICT_STEPS", "Prediction", "Predictor", "capture_training_stream", "sim_geometry"]

#: Training steps captured per prediction (optimizer-state creation + one steady-state step).
PREDICT_STEPS = 2
_UNBOUNDED_BYTES = 1 << 50  # capacity for "how much would it reserve" replays (1 PiB)


def capture_training_stream(model_cfg: dict[str, Any], batch_size: int, *, steps: int = PREDICT_STEPS
                            ) -> tuple[Any, str | None]:
    """The request stream of ``steps`` training steps of a built-in workload, captured on meta.

    Falls back to CPU when an op has no meta kernel (slower; the reason is returned).

    Returns:
        (AllocationStream, fallback_reason or None)

    Raises:
        ConfigError: an invalid workload config.
    """
    from oomtune.capture.recorder import capture_stream
    from oomtune.workloads import build_workload

    cfg = {k: v for k, v in model_cfg.items() if k != "target"}
    cfg["data"] = {"source": "synthetic"}
    reason = None
    for device in ("meta", "cpu"):
        wl = build_workload(cfg, batch_size, device)

        def run() -> None:
            batches = wl.batches()
            for _ in range(steps):
                wl.step(next(batches))

        try:
            stream = capture_stream(run, existing=wl.tensors_before_step())
            if wl.fallback_reason:
                reason = wl.fallback_reason if reason is None else f"{reason}; {wl.fallback_reason}"
            return stream, reason
        except NotImplementedError as exc:
            reason = f"meta kernel missing ({str(exc).splitlines()[0][:160]}): captured on cpu"
    raise AssertionError("unreachable")


def sim_geometry(device: Any, budget_bytes: int) -> dict[str, Any]:
    """The virtual GPU a trial on ``device`` sees: on CPU the budget is the capacity; on a real device
    the capacity is the device's and the budget is a memory fraction (as the trial applies it)."""
    if device.simulated:
        return {"total_memory_bytes": budget_bytes, "memory_fraction": 1.0}
    return {"total_memory_bytes": device.total_memory_bytes,
            "memory_fraction": min(1.0, budget_bytes / device.total_memory_bytes)}


@dataclass(frozen=True)
class Prediction:
    """Predicted memory of one candidate (bytes; all simulated).

    ``peak_reserved_bytes`` is what the caching allocator would reserve without a limit;
    ``fits`` whether the replay under the trial's limit completes without OOM; ``calibrated_...``
    the peak scaled by the measured/predicted ratio of earlier device trials (1.0 on CPU)."""

    batch_size: int
    alloc_conf: str
    peak_reserved_bytes: int
    peak_allocated_bytes: int
    fragmentation: float | None
    fits: bool
    num_alloc_retries: int
    calibrated_peak_reserved_bytes: int


class Predictor:
    """Caches one captured stream per batch size; replays it per allocator setting.

    Args:
        model_cfg: the ``model`` group (plain dict).
        geometry: :func:`sim_geometry` of the target device and budget.
    """

    def __init__(self, model_cfg: dict[str, Any], geometry: dict[str, Any], *, steps: int = PREDICT_STEPS):
        self.model_cfg, self.geometry, self.steps = model_cfg, geometry, steps
        self._streams: dict[int, Any] = {}
        self._cache: dict[tuple[int, str], Prediction] = {}
        self.fallback_reasons: set[str] = set()
        self.calibration = 1.0
        self.capture_seconds = 0.0
        self.replay_seconds = 0.0

    @classmethod
    def for_search(cls, workload: dict[str, Any], device: Any, budget_bytes: int, *, console: Any = None
                   ) -> "Predictor":
        return cls(workload, sim_geometry(device, budget_bytes))

    def stream(self, batch_size: int) -> Any:
        if batch_size not in self._streams:
            t0 = time.perf_counter()
            stream, reason = capture_training_stream(self.model_cfg, batch_size, steps=self.steps)
            self.capture_seconds += time.perf_counter() - t0
            if reason:
                self.fallback_reasons.add(reason)
            self._streams[batch_size] = stream
        return self._streams[batch_size]

    def predict_detail(self, batch_size: int, settings: AllocatorSettings | str) -> Prediction:
        """Replay the batch's stream under ``settings``: once without a limit (the peak), once under
        the trial's capacity and fraction (does it fit?)."""
        from oomtune.alloc.stream import replay_stream

        if isinstance(settings, str):
            settings = AllocatorSettings.parse(settings)
        key = (batch_size, settings.render())
        if key not in self._cache:
            stream = self.stream(batch_size)
            t0 = time.perf_counter()
            free = replay_stream(stream, settings, total_memory_bytes=_UNBOUNDED_BYTES)
            bounded = replay_stream(stream, settings, **self.geometry)
            self.replay_seconds += time.perf_counter() - t0
            self._cache[key] = Prediction(
                batch_size=batch_size, alloc_conf=key[1], peak_reserved_bytes=free.peak_reserved_bytes,
                peak_allocated_bytes=free.peak_allocated_bytes, fragmentation=free.fragmentation,
                fits=not bounded.oom, num_alloc_retries=bounded.num_alloc_retries,
                calibrated_peak_reserved_bytes=free.peak_reserved_bytes,
            )
        pred = self._cache[key]
        if self.calibration != 1.0:
            pred = Prediction(**{**pred.__dict__, "calibrated_peak_reserved_bytes":
                                 int(math.ceil(pred.peak_reserved_bytes * self.calibration))})
        return pred

    def predict(self, candidate: Any) -> int | None:
        """Calibrated predicted peak reserved of a search Candidate, in bytes."""
        pred = self.predict_detail(candidate.batch_size, candidate.settings)
        return pred.calibrated_peak_reserved_bytes

    def calibrate(self, pairs: list[tuple[int, int]]) -> float:
        """Set the calibration from (predicted, measured) peak reserved pairs of device trials: the
        median ratio measured/predicted (1.0 without pairs). Returns it."""
        ratios = sorted(m / p for p, m in pairs if p and m)
        if ratios:
            mid = len(ratios) // 2
            self.calibration = ratios[mid] if len(ratios) % 2 else (ratios[mid - 1] + ratios[mid]) / 2
        return self.calibration
