"""Storage calls that outlast a lost database connection.

A PostgreSQL (or MySQL) server that restarts, fails over or drops the network for a while must not
end a search that has measured trials: every storage call is retried with backoff
(:data:`STORAGE_RETRY_S`: 1, 2, 4 ... 30 s, about 2 minutes in all), one line per retry, whatever
exception carries the lost connection:

- SQLAlchemy's ``OperationalError``/``InterfaceError``/``DisconnectionError`` (the driver's
  "server closed the connection unexpectedly", "connection refused", "the database system is
  starting up"), or any ``DBAPIError`` that invalidated its connection;
- Optuna's ``StorageInternalError``, which ``optuna.storages._rdb.storage._create_scoped_session``
  raises for *any* SQLAlchemy error during a session ("An exception is raised during the commit")
  with the original as its ``__cause__``: the chain is searched;
- the drivers' own (``psycopg.OperationalError``, ``psycopg2.OperationalError`` ...) where they
  escape SQLAlchemy;
- gRPC's ``UNAVAILABLE`` from a storage proxy that went away or restarts (``storage=grpc://``:
  :mod:`oomtune.study.grpc_proxy`), and ``CANCELLED`` from one that shut down while the call waited
  for a handler (grpc/grpc#41785; oomtune's client never cancels a storage call itself).

Three layers use :func:`retrying`: Optuna's storage methods (:func:`reconnecting_storage_class`, a
subclass of Optuna's ``RDBStorage``), the batched writes of :mod:`oomtune.search.trial_writes`, and
the workers' composite calls (:class:`oomtune.search.workers.Executor`). The outermost retry loop of
a thread is in charge (an inner one calls straight through), so one logical call has one sequence of
retries and lines. After the last retry :class:`oomtune.exceptions.StorageUnavailableError` is
raised, which no outer layer retries again. A full disk under a SQLite storage is not a lost
connection: it becomes :class:`oomtune.exceptions.DiskFullError` at once.
"""

from __future__ import annotations

import errno
import threading
import time
from typing import Any, Callable

from oomtune import interrupts
from oomtune.exceptions import DiskFullError, StorageUnavailableError

__all__ = ["STORAGE_RETRY_S", "RETRY_ENV", "retry_schedule", "is_connection_error", "retrying", "reconnecting_storage_class", "exception_chain"]

#: Seconds before each retry of a storage call whose connection was lost (121 s in all); the
#: environment variable ``OOMTUNE_STORAGE_RETRY_S`` (comma-separated seconds) sets another schedule.
STORAGE_RETRY_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0)
RETRY_ENV = "OOMTUNE_STORAGE_RETRY_S"


def retry_schedule() -> tuple[float, ...]:
    """The retry delays: ``OOMTUNE_STORAGE_RETRY_S`` (e.g. ``1,2,4,8,16,30,30,30,60,60`` for a longer
    outage budget; ``""`` for none) when set, else :data:`STORAGE_RETRY_S`.

    Raises:
        ConfigError: the variable is not a comma-separated list of non-negative seconds.
    """
    import os

    from oomtune.exceptions import ConfigError

    text = os.environ.get(RETRY_ENV)
    if text is None:
        return STORAGE_RETRY_S
    try:
        delays = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        delays = (-1.0,)
    if any(not (d >= 0) for d in delays):
        raise ConfigError(f"{RETRY_ENV}={text!r}: give comma-separated seconds >= 0, e.g. 1,2,4,8,16,30,30,30")
    return delays

# SQLite errors that are OperationalError in the DB-API but no lost connection: retrying cannot help.
_PERMANENT = ("no such table", "no such column", "syntax error", "readonly database", "unable to open database file",
              "has no column named")
_DISK_FULL = ("database or disk is full", "no space left on device", "disk quota exceeded")
_DRIVER_MODULES = ("psycopg", "psycopg2", "pg8000", "asyncpg", "pymysql", "MySQLdb", "mysql", "sqlite3", "oracledb")
# gRPC status codes of a storage call whose proxy went away. UNAVAILABLE: refused, or cut by the proxy's
# shutdown ("Cancelling all calls"). CANCELLED: a call the proxy had received but not yet handed to a
# handler when it shut down (grpc/grpc#41785, gRPC Python: "Pending calls are CANCELLED on server
# shut-down"); oomtune's storage client sets no deadline and never cancels a call itself, so a CANCELLED
# storage call can only come from the proxy's side.
_GRPC_LOST = ("UNAVAILABLE", "CANCELLED")
_depth = threading.local()
# Set when a call ran out of retries, cleared by the next call that succeeds: while it is set, calls
# try once without waiting, so that unwinding after the search gave up (telling a trial FAIL,
# reporting the last trial) does not wait through the whole schedule again.
_gave_up = threading.Event()


def exception_chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and its causes/contexts (``__cause__`` first, else ``__context__``), each once."""
    chain: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and not any(cur is seen for seen in chain):
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__
    return chain


def _text(chain: list[BaseException]) -> str:
    return " ".join(str(e) for e in chain).lower()


def _is_disk_full(chain: list[BaseException]) -> bool:
    if any(isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) for e in chain):
        return True
    return any(marker in _text(chain) for marker in _DISK_FULL)


def _is_locked(chain: list[BaseException]) -> bool:
    """SQLite's "database is locked" (SQLITE_BUSY after the busy timeout): the file is reachable but
    another connection holds its write lock -- a process sharing the study that stopped (SIGSTOP,
    Ctrl-Z) or hung inside a transaction, not a lost connection."""
    return "database is locked" in _text(chain)


def is_connection_error(exc: BaseException) -> bool:
    """Whether ``exc`` (or anything in its cause chain) is a lost or refused storage connection, as
    opposed to a programming error, a constraint violation, or a permanent SQLite error (see the
    module docstring for the types recognised)."""
    chain = exception_chain(exc)
    if _is_disk_full(chain) or any(marker in _text(chain) for marker in _PERMANENT):
        return False
    try:
        from sqlalchemy import exc as sa_exc
    except ImportError:  # pragma: no cover - SQLAlchemy comes with Optuna
        sa_exc = None
    for e in chain:
        if sa_exc is not None:
            if isinstance(e, (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.DisconnectionError,
                              sa_exc.TimeoutError)):
                return True
            if isinstance(e, sa_exc.DBAPIError) and getattr(e, "connection_invalidated", False):
                return True
            if isinstance(e, sa_exc.SQLAlchemyError):
                continue  # another SQLAlchemy error: look at its cause (the DB-API one)
        if isinstance(e, ConnectionError):
            return True
        module = (type(e).__module__ or "").split(".")[0]
        if module == "grpc" and _grpc_code(e) in _GRPC_LOST:
            return True   # a gRPC storage proxy that went away (or is restarting): oomtune.study.grpc_proxy
        names = {c.__name__ for c in type(e).__mro__}
        if module in _DRIVER_MODULES and names & {"OperationalError", "InterfaceError"}:
            return True
    return False


def _grpc_code(exc: BaseException) -> str | None:
    """The status code name of a gRPC call's error (``grpc.RpcError`` that is also a ``grpc.Call``:
    ``UNAVAILABLE``), None for anything else."""
    code = getattr(exc, "code", None)
    try:
        return getattr(code(), "name", None) if callable(code) else None
    except Exception:  # noqa: BLE001 - not a gRPC call after all
        return None


def _first_line(exc: BaseException) -> str:
    """The most telling line: the driver's message (the DB-API error SQLAlchemy wraps as ``orig``),
    else the first message in the chain below Optuna's and oomtune's wrappers (SQLAlchemy's internal
    ``InvalidatePoolError``, whose text is ``()``, is skipped)."""
    chain = exception_chain(exc)
    wrappers = ("optuna", "oomtune")
    for e in chain:
        if (type(e).__module__ or "").split(".")[0] == "grpc" and _grpc_code(e) is not None:
            details = getattr(e, "details", None)
            return f"{_grpc_code(e)}: {details() if callable(details) else ''}".strip()[:200]
        orig = getattr(e, "orig", None)
        if orig is not None and str(orig).strip():
            return str(orig).strip().splitlines()[0][:200]
    for e in chain:
        text = str(e).strip()
        if (type(e).__module__ or "").split(".")[0] not in wrappers and text and text != "()":
            return text.splitlines()[0][:200]
    return type(exc).__name__


def retrying(fn: Callable[[], Any], what: str, *, say: Callable[[str], None] | None = None,
             delays_s: tuple[float, ...] | None = None) -> Any:
    """``fn()``, retried with backoff while the storage connection is lost.

    Each retry is announced by ``say`` in one line ("storage connection lost while trying to WHAT:
    <the driver's message>; retry 2 of 8 in 2 s"); other exceptions propagate at once. Inside
    another :func:`retrying` of the same thread, ``fn()`` is called once (the outer loop retries).
    After a call of this process ran out of retries, calls try once without waiting until one
    succeeds (the search is stopping: its last storage calls must not wait 2 minutes each).
    A stop signal (SIGTERM, Ctrl-C) that arrives during ``fn()`` is raised when ``fn()`` returns
    (:func:`oomtune.interrupts.deferred`): a transaction is never left open with its locks; one
    that arrives between retries stops the waiting at once.

    Raises:
        Interrupted: a stop signal arrived (:mod:`oomtune.interrupts`).
        StorageUnavailableError: still no connection after ``len(delays_s)`` retries (about 2
            minutes by default); its ``__cause__`` is the last error.
        DiskFullError: the storage's disk is full (SQLite "database or disk is full", ENOSPC).
        Anything else ``fn`` raises, unchanged.

    ``delays_s`` defaults to :func:`retry_schedule`.
    """
    if getattr(_depth, "n", 0) > 0:
        return fn()
    delays_s = retry_schedule() if delays_s is None else delays_s
    if _gave_up.is_set():
        delays_s = ()
    _depth.n = 1
    try:
        for attempt, delay in enumerate((*delays_s, None), start=1):
            try:
                with interrupts.deferred():   # a stop signal waits for the transaction's end
                    value = fn()
                _gave_up.clear()
                return value
            except Exception as exc:
                if _is_disk_full(exception_chain(exc)) and not isinstance(exc, DiskFullError):
                    raise DiskFullError(f"no space left for the storage while trying to {what}: "
                                        f"{_first_line(exc)}") from exc
                if not is_connection_error(exc):
                    raise
                locked = _is_locked(exception_chain(exc))
                if delay is None:
                    _gave_up.set()
                    if locked:   # reachable, but another process holds the write lock: say so
                        raise StorageUnavailableError(
                            f"storage locked by another process for {sum(delays_s):g} s ({len(delays_s)} retries, "
                            f"each after SQLite's busy timeout) while trying to {what}: {_first_line(exc)}; a "
                            f"process sharing the study holds its write lock (a worker stopped with Ctrl-Z or "
                            f"SIGSTOP, or hung): resume it (fg, kill -CONT PID) or end it (fuser FILE names it)") from exc
                    raise StorageUnavailableError(
                        f"storage unreachable for {sum(delays_s):g} s ({len(delays_s)} retries) while trying to "
                        f"{what}: {_first_line(exc)}") from exc
                if say is not None:
                    lost = "storage locked by another process" if locked else "storage connection lost"
                    say(f"{lost} while trying to {what}: {_first_line(exc)}; retry {attempt} of "
                        f"{len(delays_s)} in {delay:g} s")
                time.sleep(delay)
        raise AssertionError("unreachable")
    finally:
        _depth.n = 0


# RDBStorage methods (public, and the private ones Optuna's _CachedStorage calls) -> what the
# retry line says the call was trying to do.
_METHODS = {
    "create_new_study": "create the study", "delete_study": "delete the study",
    "set_study_user_attr": "set a study attribute", "set_study_system_attr": "set a study attribute",
    "set_study_directions": "set the study's direction", "get_study_id_from_name": "find the study",
    "get_study_name_from_id": "read the study", "get_study_directions": "read the study",
    "get_study_user_attrs": "read the study's attributes", "get_study_system_attrs": "read the study's attributes",
    "get_trial_user_attrs": "read a trial", "get_trial_system_attrs": "read a trial",
    "get_all_studies": "list the studies", "create_new_trial": "create a trial",
    "_create_new_trial": "create a trial", "set_trial_param": "store a parameter",
    "_set_trial_param": "store a parameter", "get_trial_param": "read a parameter",
    "set_trial_state_values": "store a trial's state", "set_trial_intermediate_value": "store a value",
    "set_trial_user_attr": "store a trial attribute", "set_trial_system_attr": "store a trial attribute",
    "get_trial_id_from_study_id_trial_number": "find a trial", "get_trial": "read a trial",
    "get_all_trials": "read trials", "_get_trials": "read trials", "get_n_trials": "count trials",
    "get_best_trial": "read the best trial", "_get_best_trial_id": "read the best trial",
    "_get_stale_trial_ids": "look for stale trials",
}
_CLASS: list[type] = []


def reconnecting_storage_class() -> type:
    """A subclass of Optuna's ``RDBStorage`` whose storage calls outlast a lost connection.

    Every method of :data:`_METHODS` goes through :func:`retrying`, its lines through the
    instance's ``say`` (default: none printed). Two calls get more than a retry:

    - ``set_trial_state_values``: when a retry finds the trial already finished in the state being
      set, the lost attempt had committed before its connection dropped; that is success (True),
      not Optuna's ``UpdateFinishedTrialError``.
    - ``record_heartbeat`` (Optuna's heartbeat thread, every ``heartbeat_interval`` s): not retried
      but skipped with one line; the next beat tries again, and the thread does not die with a
      traceback (``optuna.storages._heartbeat.HeartbeatThread`` has no handler of its own).

    And one change of what counts as stale: ``_get_stale_trial_ids`` (read by
    ``optuna.storages.fail_stale_trials``) also returns RUNNING trials that never recorded a
    heartbeat and started more than the grace period ago (:mod:`oomtune.study.orphans`).

    Still an ``RDBStorage``: Optuna wraps it in its per-Study cache (``_CachedStorage``), and
    ``oomtune.search.trial_writes`` uses its sessions as before.
    """
    if _CLASS:
        return _CLASS[0]
    from optuna.exceptions import UpdateFinishedTrialError
    from optuna.storages import RDBStorage

    def wrap(name: str, what: str) -> Callable[..., Any]:
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            base = getattr(RDBStorage, name)   # looked up per call: RDBStorage's own, as patched if it is
            return retrying(lambda: base(self, *args, **kwargs), what, say=self.say, delays_s=self.retry_delays_s)

        method.__name__, method.__doc__ = name, getattr(RDBStorage, name).__doc__
        return method

    def set_trial_state_values(self: Any, trial_id: int, state: Any, values: Any = None) -> bool:
        attempts = []

        def call() -> bool:
            attempts.append(1)
            try:
                return RDBStorage.set_trial_state_values(self, trial_id, state, values)
            except UpdateFinishedTrialError:
                if len(attempts) > 1 and RDBStorage.get_trial(self, trial_id).state == state:
                    return True  # the attempt whose connection dropped had committed
                raise

        return retrying(call, "store a trial's state", say=self.say, delays_s=self.retry_delays_s)

    def record_heartbeat(self: Any, trial_id: int) -> None:
        try:
            RDBStorage.record_heartbeat(self, trial_id)
        except Exception as exc:  # noqa: BLE001 - classified below; the heartbeat thread must live on
            if not is_connection_error(exc):
                raise
            if self.say is not None:
                self.say(f"storage connection lost while recording a heartbeat: {_first_line(exc)}; "
                         f"next try in {self.heartbeat_interval} s")

    namespace: dict[str, Any] = {name: wrap(name, what) for name, what in _METHODS.items()
                                 if hasattr(RDBStorage, name)}
    def _get_stale_trial_ids(self: Any, study_id: int) -> list[int]:
        from oomtune.study.orphans import stale_trial_ids

        return retrying(lambda: stale_trial_ids(self, study_id), "find stale trials", say=self.say,
                        delays_s=self.retry_delays_s)

    namespace.update(set_trial_state_values=set_trial_state_values, record_heartbeat=record_heartbeat,
                     _get_stale_trial_ids=_get_stale_trial_ids, say=None, retry_delays_s=None, __module__=__name__,
                     __doc__=reconnecting_storage_class.__doc__)
    cls = type("ReconnectingRDBStorage", (RDBStorage,), namespace)
    globals()["ReconnectingRDBStorage"] = cls   # picklable by name, as Optuna's storages are
    _CLASS.append(cls)
    return cls
