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

__all__ = ["storage_url", "make_storage", "make_sampler", "open_study", "load_study", "storage_error_message"]

HEARTBEAT_INTERVAL_S = 10
GRACE_PERIOD_S = 30


def storage_url(storage: str | None, run_dir: Path) -> str:
    """The configured URL, or ``sqlite:///<run dir>/study.db``."""
    if storage in (None, "", "null"):
        return f"sqlite:///{(run_dir / 'study.db').resolve()}"
    return str(storage)


def make_storage(url: str) -> Any:
    """An Optuna storage for ``url`` (RDB with heartbeat, or a JournalStorage for ``journal:PATH``).

    Raises:
        ConfigError: the URL is not a storage Optuna can open (one line).
    """
    import optuna

    try:
        if url.startswith("journal:"):
            from optuna.storages.journal import JournalFileBackend

            return optuna.storages.JournalStorage(JournalFileBackend(url[len("journal:"):]))
        import warnings

        with warnings.catch_warnings():  # heartbeat_interval is marked experimental in Optuna 5
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.storages.RDBStorage(
                url, heartbeat_interval=HEARTBEAT_INTERVAL_S, grace_period=GRACE_PERIOD_S
            )
    except Exception as exc:  # SQLAlchemy/driver errors come in many types
        raise ConfigError(storage_error_message(url, exc)) from None


# Python module SQLAlchemy imports for a URL -> the package that provides it (pip names).
_DRIVER_PACKAGES = {"psycopg": "psycopg[binary]", "psycopg2": "psycopg2-binary", "pg8000": "pg8000",
                    "asyncpg": "asyncpg", "pymysql": "PyMySQL", "MySQLdb": "mysqlclient",
                    "mysql": "mysql-connector-python", "mariadb": "mariadb", "oracledb": "oracledb",
                    "cx_Oracle": "cx_Oracle", "pyodbc": "pyodbc", "pymssql": "pymssql"}


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


def _redact(url: str) -> str:
    """The URL with its password replaced by ``***`` (``postgresql://user:***@host/db``)."""
    head, sep, rest = url.partition("://")
    if not sep or "@" not in rest:
        return url
    cred, _, host = rest.rpartition("@")
    user, colon, _ = cred.partition(":")
    return f"{head}://{user}{':***' if colon else ''}@{host}"


def make_sampler(name: str, seed: int | None) -> Any:
    """An Optuna sampler by name: tpe (default), random, qmc, gp.

    Constraints reach the samplers through ``Trial.set_constraint`` (Optuna >= 5), so infeasible
    trials (OOM) inform TPE/GP instead of being discarded as FAIL.

    Raises:
        ConfigError: an unknown sampler name.
    """
    import optuna

    samplers = {
        "tpe": lambda: optuna.samplers.TPESampler(seed=seed, n_startup_trials=4, multivariate=True),
        "random": lambda: optuna.samplers.RandomSampler(seed=seed),
        "qmc": lambda: optuna.samplers.QMCSampler(seed=seed),
        "gp": lambda: optuna.samplers.GPSampler(seed=seed),
    }
    if name not in samplers:
        raise ConfigError(f"unknown sampler {name!r}: choose one of {', '.join(sorted(samplers))}")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", category=optuna.exceptions.ExperimentalWarning)
        return samplers[name]()


def open_study(url: str, study_name: str, sampler: Any) -> Any:
    """Create the study, or load it when it exists (resume). Fails stale RUNNING trials."""
    import optuna

    storage = make_storage(url)
    study = optuna.create_study(
        storage=storage, study_name=study_name, sampler=sampler, direction="maximize", load_if_exists=True
    )
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        try:
            optuna.storages.fail_stale_trials(study)
        except Exception:  # JournalStorage without heartbeat support
            pass
    return study


def load_study(url: str, study_name: str) -> Any:
    """Load an existing study for reading.

    Raises:
        StudyNotFoundError: no study of that name in the storage (one line listing those that exist).
    """
    import optuna

    if url.startswith("sqlite:///") and url != "sqlite:///:memory:":
        db = Path(url[len("sqlite:///"):])
        if not db.is_file():
            raise StudyNotFoundError(f"study {study_name!r}: no storage at {db} (the SQLite file does not exist)")
    storage = make_storage(url)
    names = [s.study_name for s in optuna.study.get_all_study_summaries(storage, include_best_trial=False)]
    if study_name not in names:
        have = ", ".join(names) if names else "none"
        raise StudyNotFoundError(f"study {study_name!r} does not exist in {url} (studies there: {have})")
    return optuna.load_study(study_name=study_name, storage=storage)
