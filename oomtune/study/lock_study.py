"""One writer of a study attribute where the storage has no unique key oomtune can insert into (a
JournalStorage, Optuna's gRPC storage proxy): the writer is whoever creates a *lock study* first.
Study names are unique in every Optuna storage, so exactly one ``create_new_study`` of a name
succeeds. The lock studies are named with :data:`LOCK_PREFIX` and left out of oomtune's listings."""

from __future__ import annotations

from typing import Any

__all__ = ["LOCK_PREFIX", "is_lock_study", "record_once_by_lock_study"]

#: Studies named with this prefix are :func:`record_once_by_lock_study`'s locks, not searches.
LOCK_PREFIX = "oomtune-lock:"


def is_lock_study(name: str) -> bool:
    """Whether a study of this name is a lock of :func:`record_once_by_lock_study` (left out of listings)."""
    return str(name).startswith(LOCK_PREFIX)


def record_once_by_lock_study(storage: Any, study_id: int, study_name: str, key: str, value: Any,
                               wait_s: float = 120.0, poll_s: float = 0.2) -> Any:
    """:func:`oomtune.study.storage.record_once` on a storage without a unique key oomtune can insert
    into (a JournalStorage; Optuna's gRPC storage proxy):
    the writer is whoever creates the study ``LOCK_PREFIX + study_name + ":" + key`` first. A journal
    applies its operations in the order of its file, and of two CREATE_STUDY operations with one name
    the later one raises ``DuplicatedStudyError`` in its writer (optuna/storages/journal/_storage.py,
    ``JournalStorageReplayResult._apply_create_study``). A loser polls every ``poll_s`` seconds, up to
    ``wait_s``, for the winner's value; past that (the winner stopped between its lock and its write)
    it stores its own. The lock studies are left out of oomtune's listings (:func:`is_lock_study`).

    Returns:
        the stored value (``value`` or the winner's; JSON-serializable, as Optuna's attributes).
    """
    import time

    from optuna.exceptions import DuplicatedStudyError
    from optuna.study import StudyDirection

    try:
        storage.create_new_study([StudyDirection.MAXIMIZE], f"{LOCK_PREFIX}{study_name}:{key}")
        won = True
    except DuplicatedStudyError:
        won = False
    deadline = time.monotonic() + (0.0 if won else wait_s)
    while not won and time.monotonic() < deadline:
        stored = storage.get_study_system_attrs(study_id).get(key)
        if stored is not None:
            return stored
        time.sleep(poll_s)
    storage.set_study_system_attr(study_id, key, value)
    return storage.get_study_system_attrs(study_id)[key]
