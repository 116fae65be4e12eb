"""``run.json``: which storage and study a run directory belongs to (``oomtune show RUN_DIR``,
``oomtune report RUN_DIR``).

A run directory is self-contained: when the study's SQLite file lies inside the
directory (the default, ``RUN_DIR/study.db``), run.json stores its path relative to the directory
(``storage_file``), so a copied or moved directory reads the study beside it, not the original's
(a copy used to report the original study; a moved one could not read its own). ``storage`` keeps
the URL the search used (any Optuna storage: PostgreSQL, a SQLite file elsewhere), read when there
is no ``storage_file``.

Every reader says in one line which storage it read and why (:attr:`RunStorage.line`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from oomtune.exceptions import BestFileError

__all__ = ["RUN_FILE", "RunStorage", "write_run_file", "read_run_file", "sqlite_path", "redact"]

RUN_FILE = "run.json"


def sqlite_path(url: str) -> Path | None:
    """The file of a ``sqlite:///PATH`` URL (None for other URLs and ``sqlite:///:memory:``)."""
    if not url.startswith("sqlite:///") or url == "sqlite:///:memory:":
        return None
    return Path(url[len("sqlite:///"):])


def redact(url: str) -> str:
    """The URL with its password replaced by ``***`` (``postgresql://user:***@host/db``)."""
    head, sep, rest = url.partition("://")
    if not sep or "@" not in rest:
        return url
    cred, _, host = rest.rpartition("@")
    user, colon, _ = cred.partition(":")
    return f"{head}://{user}{':***' if colon else ''}@{host}"


def write_run_file(run_dir: Path, url: str, study_name: str) -> Path:
    """Write ``run_dir/run.json``: ``{"storage": url, "study_name": ..., "storage_file": relative path}``,
    ``storage_file`` only when ``url`` is a SQLite file inside ``run_dir``.

    Raises:
        DiskFullError: no space left (:func:`oomtune.files.write_atomic`).
    """
    from oomtune.files import write_atomic

    info: dict[str, str] = {"storage": url, "study_name": study_name}
    db = sqlite_path(url)
    if db is not None:
        try:
            info["storage_file"] = db.resolve().relative_to(Path(run_dir).resolve()).as_posix()
        except ValueError:
            pass  # a SQLite file outside the run directory: the URL as given
    return write_atomic(Path(run_dir) / RUN_FILE, json.dumps(info))


@dataclass(frozen=True)
class RunStorage:
    """The storage URL and study name a run directory names, and where the URL came from."""

    url: str
    study_name: str
    source: str   # why this storage: "the study.db beside run.json", "run.json's storage URL", ...

    @property
    def line(self) -> str:
        """One line for the reader: ``reading study NAME from URL (SOURCE)``, password redacted."""
        return f"reading study {self.study_name!r} from {redact(self.url)} ({self.source})"


def read_run_file(run_dir: Path) -> RunStorage | None:
    """The storage of ``run_dir`` from its run.json; None when there is none.

    A relative ``storage_file`` is read beside run.json. A run.json written before it existed (only
    an absolute ``sqlite:///.../study.db``) whose directory is not this one, while this directory
    holds a study.db, was copied or moved: the study.db beside it is read, and the line says so.

    Raises:
        BestFileError: run.json is not a mapping with ``storage`` and ``study_name``.
    """
    run_dir = Path(run_dir)
    path = run_dir / RUN_FILE
    if not path.is_file():
        return None
    from oomtune.safeload import read_json

    info = read_json(path, what=f"an oomtune {RUN_FILE}", max_bytes=2**20, error=BestFileError)
    try:
        url, name = str(info["storage"]), str(info["study_name"])
        relative = info.get("storage_file")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError, OSError):
        raise BestFileError(f"{path} is corrupt: expected {{\"storage\": ..., \"study_name\": ...}}") from None
    if isinstance(relative, str) and relative:
        db = (run_dir / relative).resolve()
        return RunStorage(f"sqlite:///{db}", name, f"the {relative} beside {RUN_FILE}")
    db = sqlite_path(url)
    beside = run_dir / (db.name if db is not None else "study.db")
    if db is not None and db.resolve().parent != run_dir.resolve() and beside.is_file():
        return RunStorage(f"sqlite:///{beside.resolve()}", name,
                          f"the {db.name} beside {RUN_FILE}; it names {db}, from before the directory was copied or moved")
    return RunStorage(url, name, f"{RUN_FILE}'s storage URL")
