"""Ending one of oomtune's own processes (the CLI, a spawned trial) without the interpreter's teardown.

What ``Py_FinalizeEx`` does that anyone outside the process can see, and so what :func:`exit_now`
does, in its order (CPython 3.11-3.13, ``Python/pylifecycle.c``): threads that are not daemons are
joined (``threading._shutdown``, which first calls the callbacks ``concurrent.futures`` registers to
end its workers), ``atexit`` handlers run (logging's flush, temporary directories' clean-up,
multiprocessing's children), the standard streams are flushed. What follows in the interpreter, the
teardown of every module and object (torch's, SQLAlchemy's, Optuna's, Hydra's), changes nothing
outside the process and costs seconds: 1.6-2.8 s of a search's exit, about 0.5 CPU-s of any process
that imported torch, on the 2-core development machine (experiments/results/bench_exit.txt). It is
skipped with ``os._exit``.

What is lost with it: a buffered file object that the code left open and unreferenced until the end
(the teardown would have flushed it when freeing it). oomtune's own code closes what it writes.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from typing import NoReturn

__all__ = ["exit_now", "flush_std_streams", "run_exit_steps"]


def flush_std_streams() -> None:
    """Flush stdout and stderr; a reader gone (BrokenPipeError) or a closed stream is ignored."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            stream.flush()


def exit_now(code: int) -> NoReturn:
    """End this process with status ``code`` after the interpreter's visible exit steps (module
    docstring), without its teardown. Call it from the main thread.

    Raises:
        SystemExit: ``code``, where ``threading._shutdown`` is missing (a Python other than CPython):
            the interpreter's own exit then.
    """
    if getattr(threading, "_shutdown", None) is None or threading.current_thread() is not threading.main_thread():
        raise SystemExit(code)
    run_exit_steps()
    os._exit(code)


def run_exit_steps() -> None:
    """The interpreter's visible exit steps, in its order (module docstring): non-daemon threads
    joined (``threading._shutdown``; an error there is ignored, as ``Py_FinalizeEx`` goes on), the
    ``atexit`` handlers run, stdout and stderr flushed. Also what a forked script's process does
    before it exits (:func:`oomtune.trial.script_main.run_script`)."""
    try:
        threading._shutdown()   # type: ignore[attr-defined]  # what Py_FinalizeEx does first
    except Exception:  # noqa: BLE001
        pass
    atexit._run_exitfuncs()
    flush_std_streams()
