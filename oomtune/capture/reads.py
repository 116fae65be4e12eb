"""What a capture read from its process: environment variables by name and ``sys.argv``.

A captured stream depends on more than its config and code: a user's entry may read
``N_LAYER = int(os.environ["N_LAYER"])`` or ``sys.argv`` while it builds the model. The stream cache
(:mod:`oomtune.plan.stream_cache`) keys its entries on what was read and the value read, so that a
changed value is a miss (the field case: ``N_LAYER=2`` planned, ``N_LAYER=1`` searched, the search
read the first model's streams).

:func:`recording` is a context manager: while one is open, a read of an environment variable by
name (``os.environ[name]``, ``os.environ.get``, ``os.getenv``, ``name in os.environ``; the methods of
``os._Environ`` are patched, so a module that did ``from os import environ`` is seen as well) and any
read of ``sys.argv`` (replaced by a list that notes its reads) are logged with the value the process
held before the block touched it; a name read again in a later block is logged with its value then.
A variable the recorded code sets before reading it is its own value, not an input, and is not
logged; one it reads and then sets (``os.environ.setdefault``, as torch's inductor does for
``TORCHINDUCTOR_CACHE_DIR``) is compared by the value it had before, while it still holds the value
the process set. The log is per process and only grows: an entry imported once (its module-level
reads logged in the first capture) stays read by every later capture in the process, so every
capture is stored with every read that may have shaped it (more keys than needed at worst, a miss;
never a stale read). A forked worker starts with its parent's log.

Not seen: iterating over the environment (``dict(os.environ)``, ``os.environ.copy()``), reads from
C/C++ (``getenv`` in torch's native code: its documented variables such as ``CUBLAS_WORKSPACE_CONFIG``
are keyed by the cache itself), and files the code reads.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Any, Iterator

__all__ = ["recording", "reads", "current", "matches", "forget", "ARGV"]

#: The key under which a read of ``sys.argv`` is kept in :func:`reads` (never an environment name:
#: those cannot hold ``=``).
ARGV = "=argv"

#: Never logged: pytest's marker of the running test, which torch reads when imported and which pytest
#: changes between the tests of one process (not an input of any workload).
IGNORED = frozenset({"PYTEST_CURRENT_TEST"})

_lock = threading.RLock()
_depth = 0
_log: dict[str, Any] = {}        # name -> value read (None: unset); ARGV -> list of str
_written: set[str] = set()       # names the recorded code set or deleted before reading them
_own: dict[str, tuple[Any, Any]] = {}   # name -> (value before the recorded code's first write, value it wrote)
_saved: dict[str, Any] = {}


_this: set[str] = set()          # names logged in the open recording (their value is this block's)


_threads: dict[int, int] = {}    # thread ident -> open recordings of that thread (only its reads count)


def _recording_here() -> bool:
    return bool(_depth) and threading.get_ident() in _threads


def _note(key: Any) -> None:
    if _recording_here() and isinstance(key, str) and key not in _this and key not in _written and key not in IGNORED:
        _this.add(key)
        value = _saved["data"].get(_saved["encodekey"](key)) if "data" in _saved else None
        _log[key] = None if value is None else _saved["decodevalue"](value)


class _ArgvRecorder(list):
    """``sys.argv`` while a recording is open: a list that logs itself as read on any access."""

    def _read(self) -> None:
        if _recording_here() and ARGV not in _this:
            _this.add(ARGV)
            _log[ARGV] = [str(a) for a in list.__iter__(self)]

    def __getitem__(self, i: Any) -> Any:
        self._read()
        return list.__getitem__(self, i)

    def __iter__(self) -> Iterator[Any]:
        self._read()
        return list.__iter__(self)

    def __len__(self) -> int:
        self._read()
        return list.__len__(self)

    def __contains__(self, x: Any) -> bool:
        self._read()
        return list.__contains__(self, x)

    def index(self, *a: Any) -> int:  # type: ignore[override]
        self._read()
        return list.index(self, *a)

    def count(self, x: Any) -> int:
        self._read()
        return list.count(self, x)


def _install() -> None:
    cls = type(os.environ)
    _saved.update(getitem=cls.__getitem__, contains=cls.__contains__, setitem=cls.__setitem__,
                  delitem=cls.__delitem__, argv=sys.argv, data=getattr(os.environ, "_data", {}),
                  encodekey=getattr(os.environ, "encodekey", lambda k: k),
                  decodevalue=getattr(os.environ, "decodevalue", lambda v: v))
    getitem, contains, setitem, delitem = (_saved["getitem"], _saved["contains"], _saved["setitem"],
                                          _saved["delitem"])

    def __getitem__(self: Any, key: Any) -> Any:
        if self is os.environ:
            _note(key)
        return getitem(self, key)

    def __contains__(self: Any, key: Any) -> bool:
        if self is os.environ:
            _note(key)
        return contains(self, key)

    def _wrote(key: Any, value: Any) -> None:
        if not _recording_here():
            return
        if key not in _log:
            _written.add(key)
        else:   # read, then set (os.environ.setdefault): the process's own value from now on
            before = _own[key][0] if key in _own else _log[key]
            _own[key] = (before, value)

    def __setitem__(self: Any, key: Any, value: Any) -> None:
        setitem(self, key, value)
        if self is os.environ:
            _wrote(key, value)

    def __delitem__(self: Any, key: Any) -> None:
        delitem(self, key)
        if self is os.environ:
            _wrote(key, None)

    cls.__getitem__, cls.__contains__ = __getitem__, __contains__      # type: ignore[method-assign]
    cls.__setitem__, cls.__delitem__ = __setitem__, __delitem__        # type: ignore[method-assign]
    if type(sys.argv) is list:
        sys.argv = _ArgvRecorder(sys.argv)


def _uninstall() -> None:
    cls = type(os.environ)
    cls.__getitem__, cls.__contains__ = _saved["getitem"], _saved["contains"]   # type: ignore[method-assign]
    cls.__setitem__, cls.__delitem__ = _saved["setitem"], _saved["delitem"]     # type: ignore[method-assign]
    if isinstance(sys.argv, _ArgvRecorder):
        sys.argv = list(list.__iter__(sys.argv))
    _saved.clear()


@contextlib.contextmanager
def recording() -> Iterator[None]:
    """Log the environment variables and ``sys.argv`` read inside the block by the thread that
    entered it (another thread's reads meanwhile, such as a search's trial launches, are not the
    workload's; see the module docstring); nests (the outermost block installs and removes the
    hooks); thread-safe to enter."""
    global _depth
    with _lock:
        if _depth == 0:
            _this.clear()
            _install()
        _depth += 1
        me = threading.get_ident()
        _threads[me] = _threads.get(me, 0) + 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            _threads[me] -= 1
            if not _threads[me]:
                del _threads[me]
            if _depth == 0:
                _uninstall()


def forget() -> None:
    """Empty this process's log (a test that starts over; never while a recording is open)."""
    with _lock:
        _log.clear()
        _this.clear()
        _written.clear()
        _own.clear()


def reads() -> dict[str, Any]:
    """Every read this process logged so far: ``{name: value read (str, or None: unset)}`` and, when
    ``sys.argv`` was read, ``{ARGV: [str, ...]}``; a copy, sorted by name."""
    with _lock:
        return {k: (list(v) if isinstance(v, list) else v) for k, v in sorted(_log.items())}


def current(name: str) -> Any:
    """The value ``name`` has now in this process: an environment variable's (None: unset), or for
    :data:`ARGV` the list ``sys.argv``."""
    if name == ARGV:
        return [str(a) for a in list.__iter__(sys.argv)] if isinstance(sys.argv, list) else None
    value = os.environ.get(name)
    if name in _own and _own[name][1] == value:   # still the value a capture set after reading it
        return _own[name][0]
    return value


def matches(recorded: dict[str, Any]) -> bool:
    """Whether every read in ``recorded`` (as :func:`reads` returns them) has the same value now."""
    return all(current(name) == value for name, value in recorded.items())
