"""What a finished trial means for the search: limits, constraint values, and the attributes each
Optuna trial stores (so ``oomtune show`` and a resumed search read results without re-running)."""

from __future__ import annotations

from typing import Any

from oomtune.outcome import Outcome
from oomtune.trial.record import TrialResult

__all__ = ["ATTR_DUPLICATE_OF", "MemoryLimit", "used_bytes", "violation", "result_of", "outcome_of", "ATTR_RESULT", "ATTR_ROLE"]

ATTR_RESULT = "result"        # TrialResult.to_dict()
ATTR_ROLE = "role"            # "record" | "baseline" | "frontier" | "search" | "confirm"
ATTR_OUTCOME = "outcome"      # Outcome value, for quick filtering
ATTR_CONF = "alloc_conf"      # the exact PYTORCH_CUDA_ALLOC_CONF string
ATTR_PREDICTED = "predicted_peak_reserved_bytes"
ATTR_REUSED = "reused_from"   # trial number whose measurement this one repeats
#: A probe not launched because a recording (role record) of the same candidate already measured it
#: within the limit: the trial number of that recording. Unlike ``reused_from`` the probe counts as
#: the candidate's measurement (the recording itself is not a probe).
ATTR_FROM_RECORDING = "from_recording"
ATTR_CONFIRMS = "confirms"    # for role=confirm: the trial number confirmed
ATTR_PEAK_RESERVED = "peak_reserved"  # "966.00 MiB (simulated)": for people reading the study
ATTR_RECHECK_OF = "recheck_of"  # a re-run of an infeasible trial below a feasible one
ATTR_DUPLICATE_OF = "oomtune.duplicate_of"  # a trial finished as a duplicate of this trial number
#: The objective's name, shown by optuna-dashboard (``Study.set_metric_names``).
METRIC_NAME = "throughput (samples/s)"


from oomtune.trial.budget import MemoryLimit  # noqa: E402,F401 - one definition, below plan and search


def used_bytes(result: TrialResult) -> int | None:
    """Device-level memory a trial used at its peak, in bytes: the larger of the NVML peak of the
    trial's processes (sampled every 20 ms) and the allocator's exact peak reserved plus the measured
    non-allocator memory (CUDA context; field case C9). A sampled peak can miss the moment of the
    peak (``garbage_collection_threshold`` or a release-and-retry frees memory within a step), and
    taking it alone would favour exactly those configurations; the allocator's peak
    cannot miss it. On the virtual GPU: peak reserved (no NVML reading). None without any reading.
    """
    exact = None
    if result.memory.peak_reserved_bytes is not None:
        exact = result.memory.peak_reserved_bytes + (result.memory.non_allocator_bytes or 0)
    readings = [r for r in (result.memory.device_peak_bytes, exact) if r is not None]
    return max(readings) if readings else None


def violation(result: TrialResult, limit: MemoryLimit) -> float:
    """Optuna constraint value (feasible when <= 0): ``(used - limit) / limit`` for a trial that ran,
    ``1.0`` for an infeasible outcome (OOM, limit, timeout, predicted infeasible) without a reading."""
    outcome = result.outcome
    if outcome is Outcome.OK:
        used = used_bytes(result)
        stopped = result.stopped_over_limit
        if stopped is not None:  # the trial stopped once above the limit (TrialSpec.limit_bytes): its reading then
            used = max(used or 0, stopped.used_bytes)
        return 0.0 if used is None else (used - limit.limit_bytes) / limit.limit_bytes
    return 1.0


def result_of(trial: Any) -> TrialResult | None:
    """The TrialResult stored on an Optuna (frozen) trial, or None."""
    data = trial.user_attrs.get(ATTR_RESULT)
    return None if data is None else TrialResult.from_dict(data)


def outcome_of(trial: Any) -> Outcome | None:
    """The :class:`~oomtune.outcome.Outcome` a trial's user attribute ``outcome`` holds (stored as its
    string value); None when it holds none, or a string that names no outcome (an older or edited
    study). Code compares the enum; the storage keeps the string."""
    value = trial.user_attrs.get(ATTR_OUTCOME)
    if not isinstance(value, str):
        return None
    try:
        return Outcome(value)
    except ValueError:
        return None


def is_feasible_ok(trial: Any) -> bool:
    """A COMPLETE trial that ran ok within the memory limit."""
    import optuna

    if trial.state != optuna.trial.TrialState.COMPLETE:
        return False
    if outcome_of(trial) is not Outcome.OK:
        return False
    return all(v <= 0 for v in trial.constraints.values())


def peak_reserved_label(result: TrialResult) -> str | None:
    """``"966.00 MiB (simulated)"``: the peak reserved and where it came from, for optuna-dashboard's
    user-attribute view (the bytes stay in ``user_attrs["result"]``); None without a reading."""
    from oomtune.units import format_bytes

    if result.memory.peak_reserved_bytes is None:
        return None
    return f"{format_bytes(result.memory.peak_reserved_bytes)} ({result.memory.source})"
