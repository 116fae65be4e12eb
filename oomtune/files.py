"""Writing a run's files whole or not at all (a full disk once left a 2.9 MB
``report.html.tmp`` and four tracebacks).

:func:`write_atomic` writes to a temporary file beside the target and renames it into place
(``os.replace``: atomic on POSIX within one file system), so a reader never sees half a best.yaml;
whatever fails, the temporary file is removed. A full disk (``ENOSPC``) or an exhausted quota
(``EDQUOT``) becomes one :class:`oomtune.exceptions.DiskFullError` naming the file.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from oomtune.exceptions import DiskFullError

__all__ = ["write_atomic", "is_disk_full", "disk_full_error"]

_FULL = (errno.ENOSPC, errno.EDQUOT)


def is_disk_full(exc: BaseException) -> bool:
    """``exc`` is an OSError for a full disk or an exhausted quota."""
    return isinstance(exc, OSError) and exc.errno in _FULL


def disk_full_error(path: str | Path, exc: OSError) -> DiskFullError:
    """The one-line error for ``exc`` (ENOSPC/EDQUOT) while writing ``path``."""
    why = exc.strerror or os.strerror(exc.errno or errno.ENOSPC)
    return DiskFullError(f"disk full: cannot write {path} ({why}): free space on its file system")


def write_atomic(path: str | Path, data: str | bytes, *, encoding: str = "utf-8") -> Path:
    """Write ``data`` (text in ``encoding``, or bytes) to ``path`` through ``path.<pid>.tmp``
    renamed into place. Returns ``path``.

    Raises:
        DiskFullError: no space (or quota) left; the temporary file was removed and ``path`` is as
            it was.
        OSError: any other failure to write (the temporary file removed too).
    """
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    payload = data.encode(encoding) if isinstance(data, str) else data
    try:
        with open(tmp, "wb") as f:
            f.write(payload)
        os.replace(tmp, path)
    except BaseException as exc:
        try:
            tmp.unlink()
        except OSError:
            pass
        if is_disk_full(exc):
            raise disk_full_error(path, exc) from None
        raise
    return path
