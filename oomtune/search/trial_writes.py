"""Fewer storage round trips per trial: what a trial writes, in one transaction where the storage
is an RDB storage (with 8 workers on PostgreSQL the in-study time per trial beyond its
process grew from 70 ms to 470 ms, spent mostly in storage calls; experiments/bench_workers.py).

Optuna's Trial API opens, checks and commits one transaction per value (``set_user_attr``,
``set_constraint``, and ``set_trial_param`` for each suggested parameter). The helpers here write
the same rows, with the same checks, through Optuna's own storage method and tables
(``RDBStorage._set_trial_attr_without_commit``, ``TrialParamModel``; see :func:`_write`), several
in one session; for other storages (journal, in-memory) they fall back to the Trial API unchanged.

Each write outlasts a lost database connection like Optuna's own calls do
(:func:`oomtune.study.reconnect.retrying`, one line per retry through the storage's ``say``); a
retry after a connection lost at the commit does not insert a parameter twice (:func:`_write`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = ["set_trial_attrs", "one_transaction", "write_trial_attrs"]


def _rdb(trial: Any) -> Any:
    """The trial's RDBStorage when it has the methods used here, else None."""
    backend = getattr(trial.storage, "_backend", None)   # a study wraps its RDBStorage in a cache
    needed = ("_set_trial_attr_without_commit", "check_trial_is_updatable", "scoped_session")
    if backend is None or not all(hasattr(backend, name) for name in needed) or _constraint_key() is None:
        return None
    return backend


def set_trial_attrs(trial: Any, user_attrs: dict[str, Any], constraints: dict[str, float] | None = None) -> None:
    """Store user attributes and constraint values of a running trial, in one transaction where
    the storage is an RDB storage (``Trial.set_user_attr`` and ``Trial.set_constraint`` each open,
    check and commit their own; ``set_constraint`` also reads the trial's system attributes first);
    inside :func:`one_transaction`, in that block's transaction. Elsewhere (journal, in-memory), the
    values are set one by one through Optuna's Trial API.

    Same effect as ``trial.set_user_attr(key, value)`` per item and ``trial.set_constraint(key,
    value)`` per constraint (Optuna >= 5: stored as the system attribute ``constraints:KEY``,
    read back by ``FrozenTrial.constraints``), except that a constraint already set is
    overwritten instead of ignored with a warning (oomtune sets each once, when the trial ends).

    Args:
        trial: a running ``optuna.Trial``.
        user_attrs: JSON-serialisable values by key.
        constraints: constraint values by name (feasible when <= 0).

    Raises:
        Optuna's errors for a finished trial (``UpdateFinishedTrialError``) or a storage failure.
    """
    constraints = constraints or {}
    batch = trial.storage if isinstance(trial.storage, _Batch) else None
    backend = _rdb(trial) if batch is None else batch.backend
    if backend is None:
        for key, value in user_attrs.items():
            trial.set_user_attr(key, value)
        for key, value in constraints.items():
            trial.set_constraint(key, value)
        return
    key_of = _constraint_key()
    system = {key_of(key): float(value) for key, value in constraints.items()}
    if batch is not None:
        batch.attrs.append((trial._trial_id, user_attrs, system))
    else:
        _write_retrying(backend, [], [(trial._trial_id, user_attrs, system)], "store a trial's result")
    cached = getattr(trial, "_cached_frozen_trial", None)   # what Trial.set_user_attr also updates
    if cached is not None:
        cached.user_attrs.update(user_attrs)
        cached.system_attrs.update(system)


class _Batch:
    """A trial's storage, except that ``set_trial_param`` (and :func:`set_trial_attrs`) are kept for
    the end of :func:`one_transaction`."""

    def __init__(self, storage: Any, backend: Any) -> None:
        self._storage, self.backend = storage, backend
        self.params: list[tuple[int, str, float, Any, Any]] = []
        self.attrs: list[tuple[int, dict[str, Any], dict[str, Any]]] = []

    def set_trial_param(self, trial_id: int, name: str, value_internal: float, distribution: Any) -> None:
        self.params.append((trial_id, name, value_internal, distribution,
                            _known_distribution(self._storage, trial_id, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._storage, name)


@contextlib.contextmanager
def one_transaction(trial: Any) -> Iterator[None]:
    """Within the block, the parameters the trial suggests (``trial.suggest_*``) and the attributes
    given to :func:`set_trial_attrs` are written to an RDB storage in one transaction when the block
    ends, instead of one transaction each (Optuna's ``Trial._suggest`` calls
    ``storage.set_trial_param`` per parameter; the search space has one parameter per allocator key
    and data-loader setting plus the batch size). Each value is sampled, checked and cached by
    Optuna as usual; what is written is what Optuna would write (the rows and checks of
    ``RDBStorage._set_trial_param_without_commit``: :func:`_write`). Other storages: nothing
    changes.

    Raises:
        Optuna's errors for an incompatible distribution or a finished trial, when the block ends.
    """
    storage, backend = trial.storage, _rdb(trial)
    if backend is None:
        yield
        return
    batch = trial.storage = _Batch(storage, backend)
    try:
        yield
    finally:
        trial.storage = storage
        _write_retrying(backend, batch.params, batch.attrs, "store a trial's parameters")
        for trial_id, name, _, distribution, _ in batch.params:
            _remember_distribution(storage, trial_id, name, distribution)


def write_trial_attrs(storage: Any, trial_id: int, user_attrs: dict[str, Any],
                      constraints: dict[str, float] | None = None) -> None:
    """:func:`set_trial_attrs` for a trial known by its id (no ``optuna.Trial`` at hand: telling the
    storage a trial recorded while it was unreachable, :mod:`oomtune.search.tell_records`); through
    the storage's methods where it is not an RDB storage.

    Raises:
        Optuna's ``UpdateFinishedTrialError`` for a finished trial; StorageUnavailableError.
    """
    backend = getattr(storage, "_backend", storage)
    key_of = _constraint_key()
    system = {key_of(key): float(value) for key, value in (constraints or {}).items()} if key_of else {}
    needed = ("_set_trial_attr_without_commit", "check_trial_is_updatable", "scoped_session")
    if key_of is None or not all(hasattr(backend, name) for name in needed):
        for key, value in user_attrs.items():
            storage.set_trial_user_attr(trial_id, key, value)
        for key, value in system.items():
            storage.set_trial_system_attr(trial_id, key, value)
        return
    _write_retrying(backend, [], [(trial_id, user_attrs, system)], "store a trial's result")


def _write_retrying(backend: Any, params: list[tuple], attrs: list[tuple], what: str) -> None:
    """:func:`_write` through :func:`oomtune.study.reconnect.retrying`: a retry skips the
    parameters an attempt lost at its commit had already stored (attributes are upserts)."""
    from oomtune.study.reconnect import retrying

    attempts: list[int] = []

    def attempt() -> None:
        attempts.append(1)
        _write(backend, params, attrs, skip_stored=len(attempts) > 1)

    retrying(attempt, what, say=getattr(backend, "say", None))


def _write(backend: Any, params: list[tuple], attrs: list[tuple], *, skip_stored: bool = False) -> None:
    """``params`` ``(trial_id, name, internal value, distribution, known distribution)`` and
    ``attrs`` ``(trial_id, user attrs, system attrs)`` in one session of ``backend``.

    The attributes go through Optuna's own ``_set_trial_attr_without_commit`` (an upsert per
    database dialect). The parameters are the rows ``RDBStorage._set_trial_param_without_commit``
    adds, inserted in one statement through Optuna's table (``TrialParamModel``) after the same
    checks: the trial is not finished (read once per trial, not once per parameter) and each
    distribution is compatible with the one the study already has for the name (from Optuna's
    per-Study cache, else the same query Optuna makes); ``_set_trial_attr_without_commit`` refuses a
    finished trial itself. ``skip_stored``: leave out parameters the trial already has (a retry after
    a commit whose acknowledgement was lost)."""
    if not params and not attrs:
        return
    from optuna.distributions import check_distribution_compatibility, distribution_to_json
    from optuna.storages._rdb import models
    from optuna.storages._rdb.storage import _create_scoped_session
    from sqlalchemy import insert

    with _create_scoped_session(backend.scoped_session) as session:
        studies = {}
        for trial_id in sorted({p[0] for p in params}):
            trial = models.TrialModel.find_or_raise_by_id(trial_id, session)
            backend.check_trial_is_updatable(trial_id, trial.state)
            studies[trial_id] = trial.study_id
        stored = set()
        if skip_stored and params:
            stored = set(session.query(models.TrialParamModel.trial_id, models.TrialParamModel.param_name)
                         .filter(models.TrialParamModel.trial_id.in_(sorted(studies))).all())
        rows = []
        for trial_id, name, value, distribution, known in params:
            if (trial_id, name) in stored:
                continue
            known = known if known is not None else _stored_distribution(session, studies[trial_id], name)
            if known is not None:
                check_distribution_compatibility(known, distribution)
            rows.append({"trial_id": trial_id, "param_name": name, "param_value": value,
                         "distribution_json": distribution_to_json(distribution)})
        if rows:
            session.execute(insert(models.TrialParamModel), rows)
        for trial_id, user_attrs, system_attrs in attrs:
            for key, value in user_attrs.items():
                backend._set_trial_attr_without_commit(session, models.TrialUserAttributeModel, trial_id, key, value)
            for key, value in system_attrs.items():
                backend._set_trial_attr_without_commit(session, models.TrialSystemAttributeModel, trial_id, key, value)


def _stored_distribution(session: Any, study_id: int, name: str) -> Any:
    """The distribution of parameter ``name`` in any trial of the study, or None (the query of
    ``RDBStorage._set_trial_param_without_commit``)."""
    from optuna.distributions import json_to_distribution
    from optuna.storages._rdb import models

    record = (session.query(models.TrialParamModel).join(models.TrialModel)
              .filter(models.TrialModel.study_id == study_id)
              .filter(models.TrialParamModel.param_name == name).first())
    return None if record is None else json_to_distribution(record.distribution_json)


def _known_distribution(storage: Any, trial_id: int, name: str) -> Any:
    """The distribution of parameter ``name`` that Optuna's per-Study cache (``_CachedStorage``)
    already checked for this study, or None (the write then checks it against the database, as
    ``_CachedStorage.set_trial_param`` does on a cache miss)."""
    try:
        with storage._lock:
            study_id, _ = storage._trial_id_to_study_id_and_number[trial_id]
            return storage._studies[study_id].param_distribution.get(name)
    except (AttributeError, KeyError):
        return None


def _remember_distribution(storage: Any, trial_id: int, name: str, distribution: Any) -> None:
    """What ``_CachedStorage.set_trial_param`` records after a write (see :func:`_known_distribution`)."""
    try:
        with storage._lock:
            study_id, _ = storage._trial_id_to_study_id_and_number[trial_id]
            storage._studies[study_id].param_distribution.setdefault(name, distribution)
    except (AttributeError, KeyError):
        pass


def _constraint_key() -> Any:
    """``name -> system attribute key`` as Optuna's ``Trial.set_constraint`` stores a constraint,
    or None where this Optuna stores constraints otherwise (then the Trial API is used)."""
    try:
        from optuna.study._constrained_optimization import _CONSTRAINTS_KEY
        from optuna.trial import Trial
    except ImportError:
        return None
    if not hasattr(Trial, "set_constraint"):
        return None
    return lambda name: f"{_CONSTRAINTS_KEY}:{name}"
