"""Signals that stop a run (SIGTERM, Ctrl-C), made to stop it even where Python would drop the raise.

CPython runs a Python-level signal handler in the main thread between two bytecodes of whatever that
thread runs at the moment. When that code is a ``__del__`` method or a weakref callback run by the
garbage collector (SQLAlchemy's event registry has one, ``_collection_gced``, and the collector runs
at any allocation), the exception the handler raises cannot propagate: CPython reports it as
"Exception ignored in ..." (``PyErr_WriteUnraisable``) and goes on. A handler that only raises then
loses the signal. Field case (a suite run, 2026-12-05): ``oomtune search`` got SIGTERM while a trial
ran, the handler's raise was ignored inside ``_collection_gced``, and the search ran to its end and
exited 0 instead of 143, its running trial told as if nothing had happened.

So the handler installed here (:func:`stopping_on`) does three things: it remembers the signal, it
calls the run's stoppers at once (the trial runners' ``kill_all``, safe in a signal handler), and
then raises :class:`oomtune.exceptions.Interrupted`. The search's loops call
:func:`raise_if_pending` at their safe points (between trials, while waiting for worker threads,
before a result is told), so a raise that was dropped is raised again there, and a trial killed by
the stoppers is never told as a result of its own.

A raise between any two bytecodes can also leave a half-made state behind. Field cases (a CI run
of that test, 2026-12-06, reproduced here in 3 of about 60 runs beside three busy loops): once the
signal landed inside Optuna's heartbeat context while its thread started
(``HeartbeatThread.start`` waits for the thread), so ``__exit__`` never ran, the thread (not a
daemon) beat on, and the interpreter waited for it for ever after printing "terminated"; twice
the search's next storage call waited on SQLite's write lock past the 60 s the test allows (the
busy timeout, spent in C, where no handler runs). A raise inside a storage call leaves that lock
taken: experiments/stress_stop_signal.py sends SIGTERM at a random moment of the worker loop and
counts the rounds that left the study write-locked or a heartbeat thread alive, before this
module deferred the raise and after (experiments/results/stress_stop_signal.txt).

So within :func:`deferred` (every storage call: :func:`oomtune.study.reconnect.retrying`; the
heartbeat's start and stop) the handler remembers the signal and runs the stoppers at once, but
the section raises it only when it ends.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from oomtune.exceptions import Interrupted

__all__ = ["deferred", "handler", "pending", "raise_if_pending", "stopping_on"]

_pending: int | None = None
_stoppers: list[Callable[[], object]] = []
_deferring = 0                    # depth of deferred() sections in the main thread
_deferred: int | None = None      # a signal received inside them, not raised yet


def handler(signum: int, frame: Any) -> None:
    """The signal handler: remember ``signum``, run the stoppers, raise
    :class:`~oomtune.exceptions.Interrupted` (``128 + signum`` is the CLI's exit status), unless
    the main thread is inside :func:`deferred`: then the section raises it when it ends.

    Raises:
        Interrupted: outside :func:`deferred` (it may be dropped by CPython, see the module
            docstring; the signal stays pending for :func:`raise_if_pending`).
    """
    global _pending, _deferred
    _pending = signum
    for stop in list(_stoppers):
        with contextlib.suppress(Exception):   # a stopper's failure must not hide the signal
            stop()
    if _deferring:
        _deferred = signum
        return
    raise Interrupted(signum)


def pending() -> int | None:
    """The signal received since the innermost :func:`stopping_on` began, or None."""
    return _pending


def raise_if_pending() -> None:
    """Raise the signal received, if any, again (it may have been dropped where it was first raised).

    Raises:
        Interrupted: a signal was received inside :func:`stopping_on`.
    """
    global _deferred
    if _pending is not None:
        _deferred = None   # raised now: a deferred() section ending later must not raise it again
        raise Interrupted(_pending)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """A section that a stop signal must not cut in two (a storage transaction, a thread's start):
    within it, the handler remembers the signal and runs the stoppers but does not raise; the
    section raises :class:`~oomtune.exceptions.Interrupted` when it ends (after the block, never
    inside it). Sections nest (the outermost raises); in a thread other than the main one (where
    no handler runs) this does nothing.

    A block that raises is not changed: its exception propagates, and the signal stays pending
    for :func:`raise_if_pending`.

    Raises:
        Interrupted: a stop signal arrived within the section.
    """
    global _deferring, _deferred
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _deferring += 1
    try:
        yield
    finally:
        _deferring -= 1
    if not _deferring and _deferred is not None:
        signum, _deferred = _deferred, None
        raise Interrupted(signum)


@contextlib.contextmanager
def stopping_on(signums: Iterable[int] = (signal.SIGTERM,), *,
                stoppers: Iterable[Callable[[], object]] = ()) -> Iterator[None]:
    """Within the block, each of ``signums`` runs :func:`handler`; ``stoppers`` are called by it.

    SIGINT is taken over only where Python's own Ctrl-C handler (or this module's, an outer block's)
    is installed (a process started in the background inherits it ignored, and stays so). On exit
    the previous handlers and stoppers are restored and the pending signal is forgotten (it has been
    raised by then). In a thread other than the main one (where CPython refuses ``signal.signal``)
    nothing is installed.
    """
    global _pending, _deferred
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous: dict[int, Any] = {}
    for signum in signums:
        current = signal.getsignal(signum)
        if signum == signal.SIGINT and current is not signal.default_int_handler and current is not handler:
            continue   # ignored (a background process) or the program's own: left as it is
        previous[signum] = signal.signal(signum, handler)
    added = list(stoppers)
    _stoppers.extend(added)
    outer, _pending = _pending, None
    outer_deferred, _deferred = _deferred, None
    try:
        yield
    finally:
        for signum, before in previous.items():
            signal.signal(signum, before)
        for stop in added:
            _stoppers.remove(stop)
        _pending, _deferred = outer, outer_deferred
