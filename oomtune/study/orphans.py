"""RUNNING trials that never recorded a heartbeat: failed like stale ones once the grace period is over.

Optuna fails a RUNNING trial whose last heartbeat is older than the storage's ``grace_period``
(``optuna.storages.fail_stale_trials`` over ``RDBStorage._get_stale_trial_ids``), but it skips a
trial with *no* heartbeat row at all (``if len(trial.heartbeats) == 0: continue``). A worker creates
a trial RUNNING (``Study.ask`` / ``_pop_waiting_trial_id``) and only then starts its heartbeat
thread; a process stopped in between (SIGTERM or Ctrl-C on the search, SIGKILL, a lost machine)
leaves a trial that stays RUNNING for ever. A search that resumes waits for every RUNNING trial of
its phase to finish, so it waited for ever too (a CI run: the resumed search of
``tests/test_search_e2e.py`` timed out after 600 s).

Here such a trial counts as stale when it started more than ``grace_period`` seconds ago: a live
worker records its first heartbeat milliseconds after it claims the trial, so a trial with no
heartbeat after the grace period has no worker. It is then failed by Optuna's own
``fail_stale_trials`` and enqueued again by the storage's retry callback, as a stale trial is.

``datetime_start`` is written by the process that created the trial, from its clock
(``datetime.now()`` in ``optuna.trial.create_trial`` and ``RDBStorage.set_trial_state_values``);
Optuna 5 stores it in UTC (``TrialModel._datetime_start_utc``), earlier releases in the writer's
local time. It is compared with this process's clock in the same form.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

__all__ = ["stale_trial_ids"]


def grace_period_s(storage: Any) -> float:
    """The storage's grace period in seconds (Optuna's default: twice the heartbeat interval)."""
    if storage.grace_period is not None:
        return float(storage.grace_period)
    return 2.0 * float(storage.heartbeat_interval)


def stale_trial_ids(storage: Any, study_id: int, *, now: datetime | None = None) -> list[int]:
    """Optuna's stale trials of the study (``RDBStorage._get_stale_trial_ids``) plus its RUNNING
    trials without any heartbeat that started more than the grace period before ``now`` (an aware
    datetime; default: this process's clock).

    Args:
        storage: an ``optuna.storages.RDBStorage`` with a heartbeat interval.
        study_id: the study's id in that storage.

    Raises:
        sqlalchemy / Optuna storage errors as the storage's own calls do.
    """
    import sqlalchemy
    from optuna.storages import RDBStorage
    from optuna.storages._rdb import models
    from optuna.storages._rdb.storage import _create_scoped_session
    from optuna.trial import TrialState

    stale = list(RDBStorage._get_stale_trial_ids(storage, study_id))
    now = now or datetime.now(timezone.utc)
    column = getattr(models.TrialModel, "_datetime_start_utc", None)   # Optuna >= 5: naive UTC
    if column is None:   # earlier Optuna: naive local time
        column, now = models.TrialModel.datetime_start, now.astimezone()
    cutoff = now.replace(tzinfo=None) - timedelta(seconds=grace_period_s(storage))
    with _create_scoped_session(storage.scoped_session) as session:
        beating = sqlalchemy.select(models.TrialHeartbeatModel.trial_id)
        rows = (session.query(models.TrialModel.trial_id)
                .filter(models.TrialModel.study_id == study_id)
                .filter(models.TrialModel.state == TrialState.RUNNING)
                .filter(column < cutoff)
                .filter(models.TrialModel.trial_id.not_in(beating))
                .all())
    return stale + [trial_id for (trial_id,) in rows if trial_id not in stale]
