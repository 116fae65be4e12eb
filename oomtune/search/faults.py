"""Failures that stop a search rather than rank a candidate."""

from __future__ import annotations

from oomtune.exceptions import OomtuneError
from oomtune.trial.record import TrialResult

__all__ = ["SetupFault", "RepeatedFault", "disk_full_text"]


class SetupFault(RuntimeError):
    """The workload fails even at the smallest batch with the default allocator: not a tuning result."""


class RepeatedFault(OomtuneError):
    """A trial failed in a way that every allocator configuration and batch size would repeat (a
    usage error of its command, an import error, a command that never reports), before any trial
    succeeded: the search stops after that trial (exit status 2 on the command line, one line)."""


def disk_full_text(result: TrialResult) -> bool:
    """A failed trial whose message or traceback says the disk is full (its process could not write
    its record or output: ENOSPC, "No space left on device", or oomtune's DiskFullError)."""
    text = " ".join(str(x) for x in (result.message, result.traceback_tail) if x)
    return "No space left on device" in text or "DiskFullError" in text or "Disk quota exceeded" in text
