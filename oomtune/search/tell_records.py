"""A finished trial's outcome, kept in its run directory before the storage is told.

When a trial process ends, the search writes what it will tell the study (the state, the objective
value, the result attributes and the memory constraint) to ``trials/trial-NNNN/tell.json`` in the
run directory, then tells the storage (:meth:`oomtune.search.driver.Search._tell`). If the storage
stays unreachable past every retry (:mod:`oomtune.study.reconnect`, about 2 minutes), the search
stops and the trial is left RUNNING in the study; the next ``oomtune search`` with the same run
directory tells the storage those records (:func:`replay`) before Optuna's stale-trial check would
fail them for their stopped heartbeat, so a measurement is never lost to an outage.

A record is told only while its trial is RUNNING in the study it names (study name, trial id and
number must all match). A trial that the storage holds as finished *without* a result is
reconciled from its record instead (:func:`reconcile`): a full disk, or any failure, between
writing ``tell.json`` and telling the storage leaves the storage saying FAIL (the worker tells FAIL
when its tell raises), while the run directory holds the finished result. Optuna never changes a
finished trial, so the result is added to the study as a new finished trial with the same
parameters, role and candidate key (``told_from_record`` names the original's number): the
workers find the candidate's result and the resumed search does not run it again (the docs
promise that a finished trial never runs twice). A trial that has a result in the storage is left
as the study has it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

__all__ = ["RECORD_FILE", "ATTR_TOLD_FROM_RECORD", "record_path", "write_record", "replay", "reconcile"]

#: The states a record may hold, as a record spells them: the names of Optuna's ``TrialState``
#: members COMPLETE and FAIL (read back with ``TrialState[name]``).
_TOLD_STATES = ("COMPLETE", "FAIL")

RECORD_FILE = "tell.json"
#: User attribute of a trial added from a run-directory record (:func:`reconcile`): the number of the
#: trial the storage holds as finished without that result.
ATTR_TOLD_FROM_RECORD = "told_from_record"


def record_path(workdir: Path, number: int) -> Path:
    """``workdir/trial-NNNN/tell.json`` (the trial's own directory, :mod:`oomtune.trial.runner`)."""
    return Path(workdir) / f"trial-{number:04d}" / RECORD_FILE


def write_record(workdir: Path, study_name: str, trial: Any, *, state: Any, value: float | None,
                 user_attrs: dict[str, Any], constraints: dict[str, float]) -> Path:
    """Write the record of ``trial`` (an ``optuna.Trial``) that is about to be told ``state`` (Optuna's
    ``TrialState.COMPLETE`` or ``FAIL``, or its name; the record holds the name) with ``value``
    (samples/s, None for FAIL).

    Raises:
        DiskFullError: no space left (:func:`oomtune.files.write_atomic`); OSError otherwise.
        ValueError: ``state`` is neither COMPLETE nor FAIL.
    """
    from oomtune.files import write_atomic

    state = getattr(state, "name", state)   # the record spells the state by its name
    if state not in _TOLD_STATES:
        raise ValueError(f"a tell record holds a finished trial's state: COMPLETE or FAIL, not {state!r}")

    path = record_path(workdir, trial.number)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"study_name": study_name, "trial_id": trial._trial_id, "number": trial.number, "state": state,
              "value": value, "user_attrs": user_attrs, "constraints": constraints}
    return write_atomic(path, json.dumps(record, default=str))


def _read(path: Path) -> dict[str, Any] | None:
    from oomtune.safeload import read_json

    try:
        record = read_json(path, what="a tell record", error=ValueError)   # size and depth limited
    except (OSError, ValueError):
        return None
    keys = ("study_name", "trial_id", "number", "state", "value", "user_attrs", "constraints")
    if not isinstance(record, dict) or any(k not in record for k in keys) or record["state"] not in _TOLD_STATES:
        return None
    return record


def replay(study: Any, workdir: Path, say: Callable[[str], None] | None = None) -> list[int]:
    """Tell the storage every record under ``workdir`` whose trial is still RUNNING in ``study``
    (the study's trial of that number has the recorded id); returns their numbers. One line through
    ``say`` when any was told.

    Raises:
        StorageUnavailableError: the storage is still unreachable after every retry.
    """
    import optuna
    from optuna.trial import TrialState

    from oomtune.search.trial_writes import write_trial_attrs

    storage, told, reconciled = study._storage, [], []
    for path in sorted(Path(workdir).glob(f"trial-*/{RECORD_FILE}")):
        record = _read(path)
        if record is None or record["study_name"] != study.study_name:
            continue
        try:
            trial_id = storage.get_trial_id_from_study_id_trial_number(study._study_id, int(record["number"]))
        except KeyError:
            continue
        if trial_id != record["trial_id"]:
            continue
        frozen = storage.get_trial(trial_id)
        if frozen.state.is_finished():
            if reconcile(study, frozen, record):
                reconciled.append(int(record["number"]))
            continue
        if frozen.state is not TrialState.RUNNING:
            continue
        value = record["value"]
        try:
            write_trial_attrs(storage, trial_id, record["user_attrs"], record["constraints"])
            storage.set_trial_state_values(trial_id, TrialState[record["state"]],
                                           values=None if value is None else [float(value)])
        except optuna.exceptions.UpdateFinishedTrialError:
            continue  # another worker finished it meanwhile
        told.append(int(record["number"]))
    if told and say is not None:
        say(f"told the storage {len(told)} trial{'s' if len(told) != 1 else ''} whose result it could not take "
            f"when {'they' if len(told) != 1 else 'it'} finished (unreachable or out of space), from their records "
            f"in {workdir}: {', '.join(map(str, told))}")
    if reconciled and say is not None:
        say(f"restored the result of trial{'s' if len(reconciled) != 1 else ''} {', '.join(map(str, reconciled))} "
            f"from {workdir}/trial-*/{RECORD_FILE} (the storage had failed them without it): not run again")
    return told + reconciled


def reconcile(study: Any, frozen: Any, record: dict[str, Any]) -> bool:
    """Add the result of ``record`` (a trial's ``tell.json``) to ``study`` as a new finished trial
    when the storage holds its trial (``frozen``) as FAIL without a result (the user attribute
    ``result`` missing), no earlier reconciliation added it and its candidate has not run again
    (no trial with its candidate key, or retrying it, has a result); returns whether it was added.

    The new trial has the original's parameters and distributions, its user attributes (role,
    candidate key, allocator string) with the record's, the record's state, value and memory
    constraint, and :data:`ATTR_TOLD_FROM_RECORD` = the original's number.

    Raises:
        StorageUnavailableError / DiskFullError: the storage cannot be written.
    """
    from optuna.trial import TrialState, create_trial

    from oomtune.search.trial_writes import _constraint_key
    from oomtune.study import records as R

    from oomtune.search.claims import ATTR_KEY, has_result

    if (frozen.state is not TrialState.FAIL or R.ATTR_RESULT in frozen.user_attrs
            or R.ATTR_RESULT not in record["user_attrs"]):
        return False
    try:   # a record edited or damaged by hand is no result: the trial runs again
        R.TrialResult.from_dict(record["user_attrs"][R.ATTR_RESULT])
    except (ValueError, TypeError, KeyError, AttributeError):
        return False
    number, key = int(record["number"]), frozen.user_attrs.get(ATTR_KEY)
    for t in study.get_trials(deepcopy=False):
        if t.user_attrs.get(ATTR_TOLD_FROM_RECORD) == number:
            return False   # restored already
        if has_result(t) and ((key is not None and t.user_attrs.get(ATTR_KEY) == key)
                              or t.system_attrs.get("failed_trial") == number):
            return False   # its candidate ran again meanwhile (Optuna's retry of a failed trial, or a re-enqueue)
    state = TrialState[record["state"]]
    key_of = _constraint_key()
    system = {} if key_of is None else {key_of(k): float(v) for k, v in record["constraints"].items()}
    value = record["value"]
    trial = create_trial(state=state, value=None if value is None or state is not TrialState.COMPLETE else float(value),
                         params=dict(frozen.params), distributions=dict(frozen.distributions),
                         user_attrs={**frozen.user_attrs, **record["user_attrs"], ATTR_TOLD_FROM_RECORD: number},
                         system_attrs=system)
    study.add_trial(trial)
    return True
