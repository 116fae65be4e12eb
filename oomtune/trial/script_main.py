"""The main process of a forked ``target=cmd`` script (:mod:`oomtune.trial.script_fork`): run a
file as ``python FILE ARGS`` runs it, in a process that did not start as that command.

``python -m MODULE ARGS`` is run as the interpreter runs it: ``runpy._run_module_as_main`` with the
working directory first on ``sys.path``, in a fresh ``__main__`` module. What the interpreter does
for ``python FILE ARGS`` (CPython 3.11+, ``Modules/main.c`` ``pymain_run_python`` and
``Py_FinalizeEx``), and so what is done here: ``sys.argv`` is
``[FILE, *ARGS]`` as typed; ``__file__`` (and the code's file name, which tracebacks show) is that
path joined to the working directory, not normalised; the file's real directory is first on
``sys.path``; the file runs as module ``__main__`` (``__spec__`` and ``__package__`` None, a
``SourceFileLoader``), installed in ``sys.modules`` so that pickling and ``multiprocessing`` find
it; SIGINT raises KeyboardInterrupt; at the end non-daemon threads are joined
(``threading._shutdown``), then ``atexit`` handlers run, then the standard streams are flushed.
The exit status: 0; ``sys.exit(n)``'s n (the kernel keeps n mod 256); 1 with the message on stderr
for ``sys.exit("text")``; 1 with the traceback on stderr for an uncaught exception (from the
script's own frame on, as the interpreter has no frame of its own; a SyntaxError with its line
only); an uncaught KeyboardInterrupt ends the process by SIGINT.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from oomtune.exiting import run_exit_steps

__all__ = ["run_script"]


def run_script(argv: list[str]) -> int:
    """In a forked trial process: run ``argv`` (``[FILE, *ARGS]`` or ``["-m", MODULE, *ARGS]``) as
    ``python`` followed by those words would (see the module docstring) and return its exit status;
    never raises."""
    import builtins
    import signal
    import types
    from importlib.machinery import SourceFileLoader

    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main   # for good: pickling, multiprocessing and atexit handlers find it
    module = argv[1] if argv[0] == "-m" else None
    if module is not None:   # python -m MODULE ARGS: the working directory first, runpy does the rest
        path = None
        sys.argv = ["-m", *argv[2:]]   # runpy puts the module's file in argv[0]
        sys.path.insert(0, os.getcwd())
    else:
        typed = argv[0]
        path = typed if os.path.isabs(typed) else os.path.join(os.getcwd(), typed)   # not normalised, as CPython
        sys.argv = list(argv)
        sys.path.insert(0, os.path.dirname(os.path.realpath(path)))
        main.__dict__.update(__file__=path, __cached__=None, __package__=None, __spec__=None,
                             __loader__=SourceFileLoader("__main__", path))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    code = 0
    interrupted = False
    try:
        if module is not None:
            import runpy

            runpy._run_module_as_main(module, alter_argv=True)   # type: ignore[attr-defined]  # what -m calls
        else:
            with open(path, "rb") as f:
                source = f.read()
            exec(compile(source, path, "exec"), main.__dict__)
    except SystemExit as exc:
        code = _exit_status(exc.code)
    except KeyboardInterrupt:
        _print_uncaught(path)
        interrupted = True
    except BaseException:  # noqa: BLE001 - the interpreter's behaviour for any uncaught exception
        _print_uncaught(path)
        code = 1
    run_exit_steps()   # threads joined, atexit handlers, streams flushed: the interpreter's order
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


def _print_uncaught(path: str | None) -> None:
    """The uncaught exception's traceback through ``sys.excepthook``, as the interpreter prints it:
    from the script's own frame on (``path``), or for ``-m`` (None) from runpy's frames on (the
    interpreter calls runpy, whose frames CPython shows); never this module's frame."""
    kind, exc, tb = sys.exc_info()
    first = tb
    if path is None:
        while first is not None and first.tb_frame.f_code.co_filename == __file__:
            first = first.tb_next
    while path is not None and first is not None and first.tb_frame.f_code.co_filename != path:
        first = first.tb_next
    if exc is not None:
        # the default hook prints the exception's own traceback; none when the script never ran
        # (a SyntaxError from compiling it: CPython prints the error and its line only)
        exc.__traceback__ = first
    sys.excepthook(kind, exc, first)


def _exit_status(value: Any) -> int:
    """``SystemExit.code`` as the interpreter's exit status (None: 0, an int: itself mod 256 is the
    kernel's business, anything else: printed to stderr, 1)."""
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1
