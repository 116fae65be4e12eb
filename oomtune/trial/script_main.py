"""The main process of a forked ``target=cmd`` script (:mod:`oomtune.trial.script_fork`): run a
file as ``python FILE ARGS`` runs it, in a process that did not start as that command.

What the interpreter does for ``python FILE ARGS`` and what is done here instead (CPython 3.11+,
``Modules/main.c`` ``pymain_run_python`` and ``Py_FinalizeEx``): ``sys.argv`` is ``[FILE, *ARGS]``;
the file's directory is first on ``sys.path``; the file runs as module ``__main__`` (``runpy.run_path``
installs it in ``sys.modules`` while it runs, so pickling and ``multiprocessing`` find it); SIGINT
raises KeyboardInterrupt; at the end non-daemon threads are joined (``threading._shutdown``), then
``atexit`` handlers run, then the standard streams are flushed. The exit status: 0, ``sys.exit(n)``'s
n (the kernel keeps n mod 256), 1 with the message on stderr for ``sys.exit("text")``, 1 with the
traceback on stderr (from the script's own frame: runpy's frames are not the script's) for an
uncaught exception; an uncaught KeyboardInterrupt ends the process by SIGINT.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

__all__ = ["run_script"]


def run_script(argv: list[str]) -> int:
    """In a forked trial process: run ``argv[0]`` as ``python argv[0] argv[1:]`` would (see the module
    docstring) and return its exit status; never raises."""
    import atexit
    import runpy
    import signal

    path = os.path.abspath(argv[0])
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(path))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    code = 0
    interrupted = False
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as exc:
        code = _exit_status(exc.code)
    except KeyboardInterrupt:
        _print_uncaught(path)
        interrupted = True
    except BaseException:  # noqa: BLE001 - the interpreter's behaviour for any uncaught exception
        _print_uncaught(path)
        code = 1
    try:
        threading._shutdown()   # type: ignore[attr-defined]  # what Py_Finalize does first
    except Exception:  # noqa: BLE001
        pass
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream, as at the interpreter's exit
            pass
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


def _print_uncaught(path: str) -> None:
    """The uncaught exception's traceback through ``sys.excepthook``, from the script's own frame
    on (as ``python SCRIPT`` prints it: without this module's and runpy's frames)."""
    kind, exc, tb = sys.exc_info()
    first = tb
    while first is not None and os.path.abspath(first.tb_frame.f_code.co_filename) != path:
        first = first.tb_next
    if exc is not None and first is not None:
        exc.__traceback__ = first   # the default hook prints the exception's own traceback
    sys.excepthook(kind, exc, first or tb)


def _exit_status(value: Any) -> int:
    """``SystemExit.code`` as the interpreter's exit status (None: 0, an int: itself mod 256 is the
    kernel's business, anything else: printed to stderr, 1)."""
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1
