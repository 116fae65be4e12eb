"""How a worker takes a trial of the shared study, and how it recognises the study's trials.

Small pieces of :mod:`oomtune.search.workers` that speak only to Optuna: the identity of an
enqueued candidate (:func:`trial_key`), which trials count as the sampler's, whether the storage
lets the workers of one process claim at once (:func:`claims_row_locked`), and a new sampler
trial created with its role (:func:`ask_new`).
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from oomtune.study import records as R

__all__ = ["ATTR_KEY", "ATTR_DUPLICATE_OF", "trial_key", "has_result", "is_live", "count_sampler", "claims_row_locked", "ask_new"]

ATTR_KEY = "oomtune.key"                 # the candidate's identity within its role
from oomtune.study.records import ATTR_DUPLICATE_OF  # noqa: E402 - a trial that finished as a duplicate of another


def trial_key(role: str, params: dict[str, Any], attrs: dict[str, Any] | None = None) -> str:
    """The identity of an enqueued candidate: ``role|params|attrs`` as canonical JSON."""
    return f"{role}|{json.dumps(params, sort_keys=True)}|{json.dumps(attrs or {}, sort_keys=True)}"


#: User attribute of a trial whose failure stopped the search (every configuration would repeat it:
#: :class:`oomtune.search.driver.RepeatedFault`). Its result is kept for the reports, but it is no
#: candidate's result: the same command, run again once the script is fixed, runs it again.
ATTR_STOPPED_SEARCH = "stopped_search"


def has_result(t: Any) -> bool:
    """A finished trial that holds its candidate's result (not one whose failure stopped the search)."""
    from optuna.trial import TrialState

    return (t.state in (TrialState.COMPLETE, TrialState.FAIL) and R.ATTR_RESULT in t.user_attrs
            and ATTR_STOPPED_SEARCH not in t.user_attrs)


def is_live(t: Any) -> bool:
    """A trial waiting to be claimed or running."""
    from optuna.trial import TrialState

    return t.state in (TrialState.WAITING, TrialState.RUNNING)


def count_sampler(trials: Sequence[Any], role: str) -> int:
    """Sampler trials of ``role`` in ``trials`` (finished with a result, or running; a RUNNING
    trial without role or key is one the sampler just created, its role not yet set)."""
    from optuna.trial import TrialState

    return sum(1 for t in trials if ATTR_KEY not in t.user_attrs
               and ((t.user_attrs.get(R.ATTR_ROLE) == role and (has_result(t) or t.state is TrialState.RUNNING))
                    or (R.ATTR_ROLE not in t.user_attrs and t.state is TrialState.RUNNING)))


def claims_row_locked(study: Any) -> bool:
    """Whether the workers of one process may claim at once: Optuna's
    ``RDBStorage.set_trial_state_values`` reads the trial ``FOR UPDATE``, a row lock on PostgreSQL
    and MySQL. SQLite has no row locks: a claim there is atomic only because every transaction
    takes the whole database's write lock at BEGIN (``storage._begin_immediate``; before that, a
    candidate ran 2-3 times, tests/test_workers.py), so concurrent claims would only wait for one
    another inside SQLite; they take turns in this process instead. Other storages: in turns."""
    backend = getattr(study._storage, "_backend", study._storage)
    engine = getattr(backend, "engine", None)
    return engine is not None and engine.dialect.name in ("postgresql", "mysql")


def claims_at_once(study: Any, workers: int) -> bool:
    """Whether the ``workers`` threads of one process claim and ask at once: where the storage
    row-locks a claim (:func:`claims_row_locked`) and the process has no more worker threads than
    CPU cores it may run on; otherwise they take turns. With more threads than cores, concurrent
    claims only queue for the cores and the GIL while holding database locks: on the 2-core
    machine, 8 workers on PostgreSQL reached 0.88-0.89 of linear taking turns and 0.84-0.85
    claiming at once (3 runs each, alternating, quiet machine; experiments/bench_workers.py)."""
    from oomtune.plan.parallel import usable_cores

    return claims_row_locked(study) and workers <= usable_cores()


def ask_new(study: Any, role: str) -> Any:
    """``Study.ask()`` without its first step, the claim of a WAITING trial: the caller read the
    study just before and found none waiting (a trial enqueued since then is claimed by the next
    call); the new RUNNING trial is created with its role (user attribute :data:`R.ATTR_ROLE`) in
    the same transaction (Optuna's trial template, as ``enqueue_trial`` uses). Saves the claim's
    read of every unfinished trial of the study and the role's own write. What Optuna's ask does
    besides (Optuna 3-5): drop the per-thread trial cache of the sampler, create the trial, make
    the ``Trial`` (which calls the sampler's ``before_trial``)."""
    import optuna
    from optuna.trial import TrialState

    study._thread_local.cached_all_trials = None
    template = optuna.trial.create_trial(state=TrialState.RUNNING, user_attrs={R.ATTR_ROLE: role})
    trial_id = study._storage.create_new_trial(study._study_id, template_trial=template)
    return optuna.Trial(study, trial_id)
