"""The outcomes a trial can have, shared by the classifier, the trial runner, the search and reports."""

from __future__ import annotations

import enum

__all__ = ["Outcome"]


class Outcome(str, enum.Enum):
    """How a trial ended. The string values are what records, storage and best.yaml hold.

    Memory outcomes are split by cause because the advice differs: a fragmentation OOM is fixed by an
    allocator setting before a smaller batch; a fraction cap is the budget working as intended; a
    failure outside the caching allocator (cuBLAS/cuDNN workspaces, NCCL, a raw ``CUDA error: out of
    memory``) needs headroom that the allocator does not see; host memory is not the GPU at all.
    """

    OK = "ok"
    OOM = "oom"                              # caching allocator could not satisfy a request
    OOM_FRAGMENTATION = "oom_fragmentation"  # ... although reserved-but-unallocated >= the request
    FRACTION_CAP = "fraction_cap"            # ... because the per-process memory fraction was the limit
    OOM_OUTSIDE_ALLOCATOR = "oom_outside_allocator"  # cuBLAS/cuDNN/cuFFT/NCCL/driver allocation failed
    HOST_OOM = "host_oom"                    # host RAM / shared memory: SIGKILL, DataLoader bus error
    LIMIT = "limit"                          # batch-size-dependent non-memory limit (INT_MAX, cuDNN algo)
    TIMEOUT = "timeout"                      # per-trial wall limit, process group killed
    CRASH = "crash"                          # killed by a signal (other than host OOM)
    ERROR = "error"                          # anything else (setup fault, bug): traceback tail kept
    BAD_RECORD = "bad_record"                # the trial's result record is malformed (wrong type, NaN, ...)
    PREDICTED_INFEASIBLE = "predicted_infeasible"  # virtual GPU, a smaller OOM or the default's hang
    #                                                  at a batch no larger says so; never launched

    def __str__(self) -> str:
        """The stored value (``"ok"``), so that messages and tables print what records hold."""
        return self.value

    def __format__(self, format_spec: str) -> str:
        return format(self.value, format_spec)

    @classmethod
    def parse(cls, value: "Outcome | str") -> "Outcome":
        """The outcome named by ``value`` (an :class:`Outcome` or its string value).

        Raises:
            ValueError: ``value`` names no outcome (the message lists the allowed values).
        """
        try:
            return cls(value)
        except ValueError:
            allowed = ", ".join(o.value for o in cls)
            raise ValueError(f"unknown trial outcome {value!r}: expected one of {allowed}") from None

    @property
    def is_memory(self) -> bool:
        """True for device-memory outcomes (the batch or settings do not fit the budget)."""
        return self in _DEVICE_MEMORY

    @property
    def is_fault(self) -> bool:
        """True for ``error``, ``crash`` and ``bad_record``: the trial says nothing about the configuration's
        feasibility (told to Optuna as FAIL); every other outcome is a result (COMPLETE: ok, or
        infeasible with a violated memory constraint, so the sampler learns from it)."""
        return self in _FAULTS


_DEVICE_MEMORY = frozenset(
    {Outcome.OOM, Outcome.OOM_FRAGMENTATION, Outcome.FRACTION_CAP, Outcome.OOM_OUTSIDE_ALLOCATOR}
)
_FAULTS = frozenset({Outcome.ERROR, Outcome.CRASH, Outcome.BAD_RECORD})
