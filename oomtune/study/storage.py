"""Optuna storage and study handling: URLs, heartbeats, samplers, loading existing studies.

Any Optuna storage URL works (``sqlite:///``, ``postgresql://``, ``mysql://``, ``journal:PATH``); several
``oomtune search`` processes on several machines pointed at one storage and study name share the
trials (Optuna's distributed optimisation). RDB storages get a heartbeat so that trials of a killed
process are failed on the next start instead of staying RUNNING (optuna.storages.fail_stale_trials).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from oomtune.exceptions import ConfigError, StudyNotFoundError
from oomtune.study.lock_study import is_lock_study, record_once_by_lock_study
from oomtune.study.reconnect import STORAGE_RETRY_S, reconnecting_storage_class, retrying

__all__ = ["storage_url", "driver_url", "make_storage", "open_study", "load_study", "storage_error_message",
           "retrying", "record_once", "again_on_conflict", "HEARTBEAT_INTERVAL_S", "GRACE_PERIOD_S", "MAX_RETRIES",
           "STORAGE_RETRY_S"]

HEARTBEAT_INTERVAL_S = 10   # a RUNNING trial's worker writes a heartbeat this often (seconds)
GRACE_PERIOD_S = 30         # ... and its trial is failed (and retried) this long after the last one
MAX_RETRIES = 3             # re-runs of a trial whose worker stopped (RetryHeartbeatStaleTrialCallback)


def storage_url(storage: str | None, run_dir: Path) -> str:
    """The configured URL, or ``sqlite:///<run dir>/study.db``."""
    if storage in (None, "", "null"):
        return f"sqlite:///{(run_dir / 'study.db').resolve()}"
    return str(storage)


def make_storage(url: str, *, heartbeat_interval_s: int = HEARTBEAT_INTERVAL_S,
                 grace_period_s: int = GRACE_PERIOD_S, say: Any = None) -> Any:
    """An Optuna storage for ``url`` (RDB with heartbeat, a JournalStorage for ``journal:PATH``, or
    the client of a gRPC storage proxy for ``grpc://HOST:PORT``: :mod:`oomtune.study.grpc_proxy`).

    RDB storages get Optuna's heartbeat (``heartbeat_interval``, ``grace_period``) and its retry
    callback (``RetryHeartbeatStaleTrialCallback``, ``RetryFailedTrialCallback`` before Optuna 4.9):
    a trial whose worker stopped is failed ``grace_period_s`` after its last heartbeat and enqueued
    again, at most :data:`MAX_RETRIES` times. Connections are checked before use
    (SQLAlchemy ``pool_pre_ping``), so a dropped connection is replaced, not reused, and every
    storage call outlasts a lost connection for about 2 minutes, one line through ``say`` per retry
    (:func:`oomtune.study.reconnect.reconnecting_storage_class`). A URL without a driver is opened
    with an installed one (:func:`driver_url`).

    Raises:
        ConfigError: the URL is not a storage Optuna can open (one line).
    """
    import optuna

    from oomtune.study.grpc_proxy import is_grpc_url

    if is_grpc_url(url):   # Optuna's gRPC storage proxy, with heartbeats and reconnection added
        from oomtune.study.grpc_proxy import make_grpc_storage

        import warnings

        with warnings.catch_warnings():   # ExperimentalWarning: Optuna's retry callback
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            callback = next(iter(_retry_callback(optuna).values()))
        return make_grpc_storage(url, heartbeat_interval_s=int(heartbeat_interval_s), grace_period_s=int(grace_period_s),
                                 say=say, stale_callback=callback)
    try:
        if url.startswith("journal:"):
            from optuna.storages.journal import JournalFileBackend

            return optuna.storages.JournalStorage(JournalFileBackend(url[len("journal:"):]))
        import warnings

        rdb = reconnecting_storage_class()
        with warnings.catch_warnings():  # heartbeat_interval is marked experimental in Optuna 5
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            storage = _first_open(lambda: rdb(
                driver_url(url), engine_kwargs=_engine_kwargs(url), heartbeat_interval=int(heartbeat_interval_s),
                grace_period=int(grace_period_s), **_retry_callback(optuna),
            ))
        storage.say = say
        if url.startswith("sqlite"):
            _begin_immediate(storage.engine)
        return storage
    except Exception as exc:  # SQLAlchemy/driver errors come in many types
        raise ConfigError(storage_error_message(url, exc)) from None


# URL scheme without "+driver" -> the SQLAlchemy drivers that serve it, in order of preference,
# each with the Python module it imports.
_SCHEME_DRIVERS = {
    "postgresql": (("psycopg", "psycopg"), ("psycopg2", "psycopg2"), ("pg8000", "pg8000")),
    "mysql": (("mysqldb", "MySQLdb"), ("pymysql", "pymysql"), ("mysqlconnector", "mysql.connector")),
}


def driver_url(url: str) -> str:
    """``url`` with a driver SQLAlchemy can load here. A ``postgresql://`` (or ``mysql://``) URL
    that names no driver means SQLAlchemy's default driver for the scheme (``registry.load(scheme)``:
    psycopg 3 since SQLAlchemy 2.1, psycopg2 before); when that driver's module is not installed,
    the first installed one of :data:`_SCHEME_DRIVERS` is named instead (without it the
    documented ``postgresql://`` failed where only psycopg2 was installed). URLs naming a driver,
    other schemes, and URLs none of whose drivers is installed are returned unchanged (the error then
    names the package to install: :func:`storage_error_message`)."""
    import importlib.util

    scheme, sep, rest = url.partition("://")
    if not sep or "+" in scheme or scheme not in _SCHEME_DRIVERS:
        return url
    drivers = dict(_SCHEME_DRIVERS[scheme])
    try:
        from sqlalchemy.dialects import registry

        default = registry.load(scheme).driver
    except Exception:  # noqa: BLE001 - an SQLAlchemy without the dialect: leave the URL to its error
        return url
    if _installed(drivers.get(default, default), importlib.util):
        return url
    for driver, module in drivers.items():
        if driver != default and _installed(module, importlib.util):
            return f"{scheme}+{driver}://{rest}"
    return url


def _installed(module: str, util: Any) -> bool:
    try:
        return util.find_spec(module) is not None
    except (ImportError, ValueError):   # a parent package missing (mysql.connector without mysql)
        return False


# Python module SQLAlchemy imports for a URL -> the package that provides it (pip names).
_DRIVER_PACKAGES = {"psycopg": "psycopg[binary]", "psycopg2": "psycopg2-binary", "pg8000": "pg8000",
                    "asyncpg": "asyncpg", "pymysql": "PyMySQL", "MySQLdb": "mysqlclient",
                    "mysql": "mysql-connector-python", "mariadb": "mariadb", "oracledb": "oracledb",
                    "cx_Oracle": "cx_Oracle", "pyodbc": "pyodbc", "pymssql": "pymssql"}


#: How to name a storage, said by every refusal of a storage URL.
STORAGE_FORMS = ("give storage= a database URL Optuna opens (sqlite:///PATH, postgresql://USER:PASSWORD@HOST/DB), "
                 "grpc://HOST:PORT for an oomtune storage-proxy, journal:PATH, or leave it unset for a SQLite file "
                 "in the run directory")


def check_storage_url(url: Any, run_dir: Path | None = None) -> None:
    """Refuse, before a run directory or a study is created, a ``storage=`` that cannot name a
    storage: a URL SQLAlchemy cannot parse (``sqlalchemy.engine.make_url``) or whose dialect is not
    one it has (its ``get_dialect()``: "Can't load plugin: sqlalchemy.dialects:NAME"), or a SQLite
    file in a folder that does not exist (SQLite creates the file, never its folder: "unable to open
    database file") and that is neither ``run_dir`` nor a folder above it (the run directory is
    created, with its parents, before the study is opened). Nothing is connected to; a server that
    cannot be reached is found when the study is opened. None, ``""`` and ``null`` (the default) pass.

    Raises:
        ConfigError: one line naming the URL (its password masked) and the storage forms oomtune opens.
    """
    if url is None or str(url).strip() in ("", "null"):
        return
    text = str(url).strip()
    from oomtune.study.grpc_proxy import is_grpc_url

    if is_grpc_url(text) or text.startswith("journal:"):
        return
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    try:
        parsed = make_url(text)
    except ArgumentError:
        raise ConfigError(f"storage {_redact(text)!r} is not a storage URL: {STORAGE_FORMS}") from None
    try:
        parsed.get_dialect()
    except NoSuchModuleError:
        raise ConfigError(f"storage {_redact(text)!r}: SQLAlchemy has no database named {parsed.drivername!r}: "
                          f"{STORAGE_FORMS}") from None
    database = parsed.database or ""
    if parsed.get_backend_name() == "sqlite" and database and database != ":memory:" and not database.startswith("file:"):
        folder = Path(database).expanduser().resolve().parent
        made = [] if run_dir is None else [run_dir.expanduser().resolve(), *run_dir.expanduser().resolve().parents]
        if not folder.is_dir() and folder not in made:
            raise ConfigError(f"storage {text!r}: the folder {str(folder)!r} does not exist (SQLite creates the file, "
                              f"not its folder): create it, or {STORAGE_FORMS}")


def storage_error_message(url: str, exc: BaseException) -> str:
    """One line for a storage that cannot be opened: the file and what to do for a corrupt SQLite
    file, the package to install for a missing database driver, else the first line of the error.

    Args:
        url: the storage URL as given.
        exc: what Optuna/SQLAlchemy raised (its ``__cause__``/``__context__`` are searched for the
            missing module: SQLAlchemy's ``ModuleNotFoundError`` names it, Optuna's ImportError not).
    """
    chain, cur = [], exc
    while cur is not None and cur not in chain:
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__
    missing = next((e.name for e in chain if isinstance(e, ModuleNotFoundError) and e.name), None)
    if missing is not None:
        root = missing.split(".")[0]
        package = _DRIVER_PACKAGES.get(root, root)
        scheme = url.split("://", 1)[0]
        return (f"cannot open storage {_redact(url)!r}: its database driver (Python module {root!r}) is not "
                f"installed: pip install '{package}' (or name another driver in the URL, {scheme.split('+')[0]}"
                f"+DRIVER://...)")
    text = " ".join(str(e) for e in chain)
    if url.startswith("sqlite:///") and ("file is not a database" in text or "database disk image is malformed" in text):
        path = url[len("sqlite:///"):]
        return (f"storage file {path} is not a readable SQLite database (corrupt, or another kind of file): move "
                f"it away to start a new study there, or set storage= to another file")
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return f"cannot open storage {_redact(url)!r}: {first}"


from oomtune.runfile import redact as _redact  # noqa: E402 - one definition (show, report print URLs too)


def _first_open(open_rdb: Any, attempts: int = 6) -> Any:
    """``open_rdb()``, tried again when several workers create a new database's tables at once:
    Optuna's RDBStorage creates its schema and stamps alembic_version on first use
    (optuna/storages/_rdb/storage.py, ``RDBStorage.__init__``: ``metadata.create_all``, then
    ``_VersionManager``), and Optuna leaves concurrent first opens to the caller (optuna/optuna#1092).
    create_all checks which tables and enum types exist, then CREATEs the rest, so an opener that
    checked before another committed gets an IntegrityError (PostgreSQL's ``UniqueViolation`` on
    pg_type for ``CREATE TYPE studydirection``; SQLite's UNIQUE alembic_version), a ProgrammingError
    ("type ... already exists", "relation ... already exists") or an OperationalError ("table ...
    already exists", "database is locked"). Each failure means another opener committed schema;
    the next try finds it and creates nothing. Measured with 3 processes on one new SQLite file
    (experiments/bench_workers.py); reproduced on SQLite and PostgreSQL by
    tests/test_study_open_race.py."""
    import random
    import time

    from sqlalchemy import exc as sa_exc

    for attempt in range(attempts):
        try:
            return open_rdb()
        except (sa_exc.IntegrityError, sa_exc.OperationalError, sa_exc.ProgrammingError):
            if attempt == attempts - 1:
                raise
            time.sleep(0.2 + random.random() * (attempt + 1))  # let the winner finish its schema
    raise AssertionError("unreachable")


def _engine_kwargs(url: str) -> dict[str, Any]:
    """SQLAlchemy engine options: ``pool_pre_ping`` for servers; for SQLite a 60 s busy timeout, so
    that several writers wait for the lock instead of failing with "database is locked", and the
    driver's own transaction handling off (``isolation_level=None``: :func:`_begin_immediate`
    begins every transaction)."""
    if url.startswith("sqlite"):
        return {"connect_args": {"timeout": 60, "isolation_level": None}}
    return {"pool_pre_ping": True}


def _begin_immediate(engine: Any) -> None:
    """Begin every transaction on ``engine`` (SQLite) with ``BEGIN IMMEDIATE``, which takes the
    database's write lock at once, so a transaction that reads and then writes is atomic across
    threads and processes.

    Why: Optuna's RDB storage makes its read-then-write steps atomic with ``SELECT ... FOR
    UPDATE`` (a trial's WAITING -> RUNNING claim, failing a stale trial). SQLite has no row locks,
    and Python's sqlite3 begins a transaction only at the first write, so the read ran outside it:
    measured, 4 processes claiming 60 WAITING trials of one SQLite file made 71-81 claims
    (tests/test_workers.py::test_sqlite_claims_are_atomic_across_processes). With the write lock
    taken at BEGIN, the second claimer reads RUNNING and moves on. SQLAlchemy's documented recipe
    for pysqlite transactions ("Serializable isolation / Savepoints / Transactional DDL"); readers
    then wait for the lock too (busy timeout: :func:`_engine_kwargs`)."""
    from sqlalchemy import event

    @event.listens_for(engine, "begin")
    def _begin(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")


def _retry_callback(optuna: Any) -> dict[str, Any]:
    cls = getattr(optuna.storages, "RetryHeartbeatStaleTrialCallback", None)
    if cls is not None:  # Optuna >= 4.9
        return {"heartbeat_stale_trial_callback": cls(max_retry=MAX_RETRIES)}
    return {"failed_trial_callback": optuna.storages.RetryFailedTrialCallback(max_retry=MAX_RETRIES)}


def again_on_conflict(fn: Any) -> Any:
    """``fn()``; once more if a concurrent worker inserted the same row first (SQLAlchemy
    IntegrityError: Optuna's attribute setters read, then insert or update, so two workers setting
    the same new study attribute at once collide; the second try updates)."""
    from sqlalchemy import exc as sa_exc

    try:
        return fn()
    except sa_exc.IntegrityError:
        return fn()


def record_once(study: Any, key: str, value: Any) -> Any:
    """Store ``value`` under the study's system attribute ``key`` unless one is already stored;
    return the stored value (ours or the earlier one). Exactly one writer wins, on any machine:

    - RDB storages: a plain INSERT into Optuna's ``study_system_attributes`` table, whose unique
      (study_id, key) constraint lets exactly one concurrent INSERT commit; the losers read the
      winner's value.
    - a gRPC storage proxy: the creator of a lock study wins (:mod:`oomtune.study.grpc_proxy`).
    - a JournalStorage (``journal:PATH``, shared by processes through its file): the creator of a lock
      study wins, as through the proxy (:func:`oomtune.study.lock_study.record_once_by_lock_study`).
    - an in-memory storage: read, then write if absent (one process).
    """
    import json

    storage = study._storage
    if hasattr(storage, "record_once"):   # a gRPC storage proxy: its own one-writer record
        return storage.record_once(study._study_id, study.study_name, key, value)
    stored = storage.get_study_system_attrs(study._study_id).get(key)
    if stored is not None:
        return stored
    from optuna.storages import JournalStorage

    if isinstance(storage, JournalStorage):
        return record_once_by_lock_study(storage, study._study_id, study.study_name, key, value)
    backend = getattr(storage, "_backend", storage)  # studies wrap an RDBStorage in _CachedStorage
    engine = getattr(backend, "engine", None)
    if engine is None:
        study._storage.set_study_system_attr(study._study_id, key, value)
        return study._storage.get_study_system_attrs(study._study_id).get(key)
    from sqlalchemy import exc as sa_exc
    from sqlalchemy import text

    def insert() -> None:
        try:
            with engine.begin() as conn:
                conn.execute(text("INSERT INTO study_system_attributes (study_id, key, value_json) "
                                  "VALUES (:study_id, :key, :value)"),
                             {"study_id": study._study_id, "key": key, "value": json.dumps(value)})
        except sa_exc.IntegrityError:
            pass  # another process recorded it first (or our own attempt, before its connection dropped)

    retrying(insert, "record the study's answer", say=getattr(backend, "say", None))
    return storage.get_study_system_attrs(study._study_id)[key]


def open_study(url: str, study_name: str, sampler: Any, *, heartbeat_interval_s: int = HEARTBEAT_INTERVAL_S,
               grace_period_s: int = GRACE_PERIOD_S, say: Any = None, before_stale: Any = None) -> Any:
    """Create the study, or load it when it exists (resume; or join it: other workers on the same
    storage and study name). Calls ``before_stale(study)`` (e.g. telling the storage the trials
    that finished while it was unreachable: :func:`oomtune.search.tell_records.replay`), then fails
    stale RUNNING trials. Every storage call outlasts a lost connection for about 2 minutes
    (:mod:`oomtune.study.reconnect`), one line through ``say`` per retry.

    Raises:
        ConfigError: the storage cannot be opened (:func:`make_storage`).
        StorageUnavailableError: the connection stayed lost through every retry.
    """
    import optuna

    storage = make_storage(url, heartbeat_interval_s=heartbeat_interval_s, grace_period_s=grace_period_s, say=say)

    def create() -> Any:
        try:
            return optuna.create_study(storage=storage, study_name=study_name, sampler=sampler,
                                       direction="maximize", load_if_exists=True)
        except optuna.exceptions.DuplicatedStudyError:  # another worker created it just now
            return optuna.load_study(study_name=study_name, storage=storage, sampler=sampler)

    study = retrying(create, "open the study", say=say)
    if before_stale is not None:
        before_stale(study)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        # a no-op for storages without heartbeat (JournalStorage)
        retrying(lambda: optuna.storages.fail_stale_trials(study), "fail stale trials", say=say)
    return study


def load_study(url: str, study_name: str) -> Any:
    """Load an existing study for reading (``oomtune show``, ``oomtune best``, the report): never
    writes. Optuna's RDBStorage creates its tables and stamps their version when it opens a
    database without them, so a SQLite file is first inspected read-only (:func:`_check_study_file`):
    a zero-byte ``study.db`` stays zero bytes.

    Raises:
        StudyNotFoundError: the SQLite file is missing, empty, or holds no Optuna study tables, or
            no study of that name is in the storage (one line listing those that exist).
        ConfigError: the file is not a SQLite database (:func:`storage_error_message`).
    """
    import optuna

    if url.startswith("sqlite:///") and url != "sqlite:///:memory:":
        db = Path(url[len("sqlite:///"):])
        if not db.is_file():
            raise StudyNotFoundError(f"study {study_name!r}: no storage at {db} (the SQLite file does not exist)")
        _check_study_file(url, db, study_name)
    storage = make_storage(url)
    names = [s.study_name for s in optuna.study.get_all_study_summaries(storage, include_best_trial=False)
             if not is_lock_study(s.study_name)]
    if study_name not in names:
        have = ", ".join(names) if names else "none"
        raise StudyNotFoundError(f"study {study_name!r} does not exist in {url} (studies there: {have})")
    return optuna.load_study(study_name=study_name, storage=storage)


def _check_study_file(url: str, db: Path, study_name: str) -> None:
    """Refuse a SQLite file that holds no Optuna study, reading it in SQLite's read-only mode
    (``file:PATH?mode=ro``, sqlite3's URI form), so nothing is written into it.

    Raises:
        StudyNotFoundError: the file is empty (0 bytes) or has no ``studies`` table (Optuna's schema:
            optuna/storages/_rdb/models.py, ``StudyModel.__tablename__``).
        ConfigError: it is not a SQLite database (the message of :func:`storage_error_message`).
    """
    import sqlite3
    from urllib.parse import quote

    if db.stat().st_size == 0:
        raise StudyNotFoundError(f"study {study_name!r}: {db} is empty (0 bytes, no study was ever written to it); "
                                 "give the run directory or storage of a search that ran")
    try:
        con = sqlite3.connect(f"file:{quote(str(db))}?mode=ro", uri=True)
        try:
            tables = {row[0] for row in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        finally:
            con.close()
    except sqlite3.DatabaseError as exc:
        raise ConfigError(storage_error_message(url, exc)) from None
    if "studies" not in tables:
        raise StudyNotFoundError(f"study {study_name!r}: {db} is a SQLite database without Optuna's tables (no "
                                 "study was ever written to it); give the run directory or storage of a search "
                                 "that ran")
