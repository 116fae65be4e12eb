"""How a step trains, torch-free: gradient accumulation and activation checkpointing.

These keys describe how a workload's step trains rather than what it trains, and every target honours
them (built-in workloads, python entries, commands through their placeholders and environment). They
are read here without torch so that a command's search, ``oomtune show`` and the report need not
import it; :mod:`oomtune.workloads.loop` re-exports them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from oomtune.exceptions import ConfigError

__all__ = ["TRAINING_KEYS", "grad_accum_of", "checkpointing_of", "prediction_workload"]


#: Workload keys that describe how a step trains rather than what (every target honours them):
#: ``grad_accum`` (micro-batches per optimizer step, default 1) and ``activation_checkpointing``
#: (recompute activations in backward instead of keeping them, default false).
from oomtune.workload_spec import TRAINING_KEYS  # noqa: E402 - one tuple for the spec and the trials


def grad_accum_of(workload: Mapping[str, Any]) -> int:
    """``workload["grad_accum"]``: micro-batches per optimizer step (default 1).

    Raises:
        ConfigError: not an integer >= 1.
    """
    value = workload.get("grad_accum", 1)
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"grad_accum={value!r}: expected an integer >= 1 (micro-batches per optimizer step)")
    return value


def checkpointing_of(workload: Mapping[str, Any]) -> bool:
    """``workload["activation_checkpointing"]`` as a bool (default False).

    Raises:
        ConfigError: not true, false or null.
    """
    value = workload.get("activation_checkpointing", False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ConfigError(f"activation_checkpointing={value!r}: expected true or false")
    return value


def prediction_workload(workload: Mapping[str, Any]) -> dict[str, Any]:
    """The workload a prediction captures for ``workload``: the same, with at most two micro-batches
    per optimizer step. Accumulation's memory is the gradients that live from the first micro-batch's
    backward through the next micro-batch's forward and backward (the optimizer step and
    ``zero_grad`` come after the last one); a third micro-batch makes the same requests as the second
    (gradients are accumulated in place: ``AccumulateGrad`` adds into the existing ``.grad``,
    torch/csrc/autograd/functions/accumulate_grad.h), so a step of two micro-batches holds the
    memory of any larger accumulation, and every batch size's stream has the same structure (the
    condition for deriving streams, :mod:`oomtune.plan.derive`)."""
    out = dict(workload)
    if grad_accum_of(workload) > 2:
        out["grad_accum"] = 2
    return out
