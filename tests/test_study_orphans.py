"""A trial left RUNNING without a heartbeat (its process stopped between creating it and starting the
heartbeat thread) is failed and retried once the grace period is over, as a stale trial is
(oomtune.study.orphans). A CI run's resumed search waited for such a trial for 600 s."""

from __future__ import annotations

import warnings
from datetime import datetime, timedelta

import optuna
from optuna.trial import TrialState

from oomtune.study.storage import make_storage

GRACE_S = 30


def _running(storage, study_id: int, *, started: datetime, beat: bool) -> int:
    template = optuna.trial.create_trial(state=TrialState.RUNNING, user_attrs={"role": "search"})
    template.datetime_start = started
    trial_id = storage.create_new_trial(study_id, template_trial=template)
    if beat:
        storage.record_heartbeat(trial_id)
    return trial_id


def _fail_stale(study) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)


def test_a_running_trial_without_heartbeat_is_failed_after_the_grace_period_and_retried(tmp_path):
    url = f"sqlite:///{tmp_path / 'study.db'}"
    storage = make_storage(url, heartbeat_interval_s=10, grace_period_s=GRACE_S)
    study = optuna.create_study(storage=storage, study_name="s")
    now = datetime.now()
    orphan = _running(storage, study._study_id, started=now - timedelta(seconds=2 * GRACE_S), beat=False)
    young = _running(storage, study._study_id, started=now, beat=False)   # its worker is about to beat
    beating = _running(storage, study._study_id, started=now - timedelta(seconds=2 * GRACE_S), beat=True)

    # Optuna's own storage on the same database leaves the orphan RUNNING (no heartbeat row: skipped
    # by RDBStorage._get_stale_trial_ids): the fault this module fixes.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        plain = optuna.storages.RDBStorage(url, heartbeat_interval=10, grace_period=GRACE_S)
    _fail_stale(optuna.load_study(study_name="s", storage=plain))
    assert plain.get_trial(orphan).state is TrialState.RUNNING

    _fail_stale(study)
    states = {t._trial_id: t for t in study.get_trials(deepcopy=False)}
    assert states[orphan].state is TrialState.FAIL
    assert states[young].state is TrialState.RUNNING
    assert states[beating].state is TrialState.RUNNING   # its heartbeat is fresh
    # the storage's retry callback enqueued it again, as for a stale trial, with its role
    retries = [t for t in states.values() if t.state is TrialState.WAITING]
    assert len(retries) == 1
    assert retries[0].system_attrs["failed_trial"] == states[orphan].number
    assert retries[0].user_attrs["role"] == "search"
