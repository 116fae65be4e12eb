"""A finished trial's outcome, kept in its run directory before the storage is told (issue 25 item 3).

When a trial process ends, the search writes what it will tell the study (the state, the objective
value, the result attributes and the memory constraint) to ``trials/trial-NNNN/tell.json`` in the
run directory, then tells the storage (:meth:`oomtune.search.driver.Search._tell`). If the storage
stays unreachable past every retry (:mod:`oomtune.study.reconnect`, about 2 minutes), the search
stops and the trial is left RUNNING in the study; the next ``oomtune search`` with the same run
directory tells the storage those records (:func:`replay`) before Optuna's stale-trial check would
fail them for their stopped heartbeat, so a measurement is never lost to an outage.

A record is told only while its trial is RUNNING in the study it names (study name, trial id and
number must all match): a trial that has since finished (told, or failed by another worker and
run again) is left as the study has it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

__all__ = ["RECORD_FILE", "record_path", "write_record", "replay"]

RECORD_FILE = "tell.json"


def record_path(workdir: Path, number: int) -> Path:
    """``workdir/trial-NNNN/tell.json`` (the trial's own directory, :mod:`oomtune.trial.runner`)."""
    return Path(workdir) / f"trial-{number:04d}" / RECORD_FILE


def write_record(workdir: Path, study_name: str, trial: Any, *, state: str, value: float | None,
                 user_attrs: dict[str, Any], constraints: dict[str, float]) -> Path:
    """Write the record of ``trial`` (an ``optuna.Trial``) that is about to be told ``state``
    (``"COMPLETE"`` or ``"FAIL"``) with ``value`` (samples/s, None for FAIL).

    Raises:
        DiskFullError: no space left (:func:`oomtune.files.write_atomic`); OSError otherwise.
    """
    from oomtune.files import write_atomic

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
    if not isinstance(record, dict) or any(k not in record for k in keys) or record["state"] not in ("COMPLETE", "FAIL"):
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

    storage, told = study._storage, []
    for path in sorted(Path(workdir).glob(f"trial-*/{RECORD_FILE}")):
        record = _read(path)
        if record is None or record["study_name"] != study.study_name:
            continue
        try:
            trial_id = storage.get_trial_id_from_study_id_trial_number(study._study_id, int(record["number"]))
        except KeyError:
            continue
        if trial_id != record["trial_id"] or storage.get_trial(trial_id).state is not TrialState.RUNNING:
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
        say(f"told the storage {len(told)} trial{'s' if len(told) != 1 else ''} that finished while it was "
            f"unreachable, from their records in {workdir}: {', '.join(map(str, told))}")
    return told
