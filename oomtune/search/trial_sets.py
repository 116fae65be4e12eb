"""Questions the search asks of a study's trials (every process's, every session's): which trials
measure candidates, which results a re-run contradicted, which configuration a trial ran, whether the
default allocator's trial hung. Pure functions of Optuna's (frozen) trials; no storage writes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from oomtune.outcome import Outcome
from oomtune.study import records as R

__all__ = ["PROBE_ROLES", "contradicted", "config_key", "default_hang"]

#: Roles whose trials measure candidates (confirmations re-measure them).
PROBE_ROLES = ("baseline", "frontier", "search")


def config_key(trial: Any) -> tuple:
    """A trial's configuration: its parameters except the batch size (allocator and data-loader
    settings, as the search space spells them)."""
    return tuple(sorted((k, repr(v)) for k, v in trial.params.items() if k != "batch_size"))


def contradicted(trials: Sequence[Any]) -> set[int]:
    """Numbers of the trials a re-run contradicted: a trial ``recheck_of`` them passed within the
    limit (:meth:`oomtune.search.driver.Search.recheck_contradictions`)."""
    return {int(t.user_attrs[R.ATTR_RECHECK_OF]) for t in trials
            if R.ATTR_RECHECK_OF in t.user_attrs and R.is_feasible_ok(t)}


def default_hang(trials: Sequence[Any]) -> Any | None:
    """The default allocator's (no allocator key, no activation checkpointing) probe or sampler trial
    that timed out at the smallest batch; None when none did."""
    hung = [t for t in trials if R.outcome_of(t) is Outcome.TIMEOUT
            and t.user_attrs.get(R.ATTR_ROLE) in PROBE_ROLES and not (t.user_attrs.get(R.ATTR_CONF) or "")
            and not t.params.get("activation_checkpointing") and "batch_size" in t.params]
    return min(hung, key=lambda t: (int(t.params["batch_size"]), t.number)) if hung else None
