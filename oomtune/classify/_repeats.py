"""Failures every allocator configuration repeats, and the line that says why a trial process failed.

A trial that fails before its first step for a reason of its script (a module it cannot import, a
syntax error, an argument its parser refuses, a missing integration callback, an oomtune
integration's usage error) fails the same way under every allocator configuration and batch size:
running the others only multiplies the wait. Such a failure is told apart here from what the
process left behind (its exit status and stderr), without a target's name:

- exit status 2: the usage-error status of Python's ``argparse`` (``parser.error`` exits 2,
  Lib/argparse.py ``ArgumentParser.error``), of the interpreter itself for a script it cannot open
  (``python: can't open file ...``, Modules/main.c ``pymain_run_file``: exit 2) and of oomtune's
  integrations (``oomtune.integrations._session.fail``: one ``oomtune: ...`` line, exit 2);
- an exception of the import machinery or the compiler: ``ModuleNotFoundError``, ``ImportError``,
  ``SyntaxError``, ``IndentationError``, ``TabError`` (the script never ran a step).

:func:`own_error_line` finds the first line that oomtune's own code in the trial wrote as an error
(an integration's ``oomtune: ...`` line, or the ``oomtune.exceptions.ConfigError: ...`` line of a
traceback from :func:`oomtune.report` / :func:`oomtune.capture_hook`), so that the console shows
the cause instead of only "exited with status 2".
"""

from __future__ import annotations

import re

__all__ = ["own_error_line", "usage_error_line", "repeats_everywhere", "USAGE_STATUS"]

#: The exit status of a usage error (argparse, the interpreter's "can't open file", oomtune's integrations).
USAGE_STATUS = 2
_OWN_LINE = re.compile(r"^oomtune: (?P<text>\S.*)$")
_OWN_EXCEPTION = re.compile(r"^oomtune(?:\.\w+)*\.(?P<name>\w+(?:Error|Exception)): (?P<text>.*)$")
_ARGPARSE = re.compile(r"^\S+: error: \S")            # "train.py: error: unrecognized arguments: --bs 4"
_CANT_OPEN = re.compile(r"can't open file ")          # "python: can't open file '/x/t.py': [Errno 2] ..."
_NEVER_RAN = ("ModuleNotFoundError", "ImportError", "SyntaxError", "IndentationError", "TabError")
_NEVER_RAN_LINE = re.compile(r"^(?:\[rank\d+\]:\s?)?(?:[\w.]+\.)?(?:" + "|".join(_NEVER_RAN) + r")\b")


def own_error_line(stderr: str) -> str | None:
    """The first line of ``stderr`` that oomtune's own code wrote as an error: ``oomtune: TEXT``
    (an integration's usage error) or ``oomtune.exceptions.NAME: TEXT`` (a traceback's last line
    from :func:`oomtune.report` / :func:`oomtune.capture_hook`), as ``oomtune: TEXT`` /
    ``NAME: TEXT``; None when there is none."""
    for line in (stderr or "").splitlines():
        line = line.strip()
        m = _OWN_LINE.match(line)
        if m:
            return line
        m = _OWN_EXCEPTION.match(line)
        if m:
            return f"{m.group('name')}: {m.group('text')}"
    return None


def usage_error_line(stderr: str) -> str | None:
    """The line that says why a process exited with status 2: oomtune's own (:func:`own_error_line`),
    else argparse's ``PROG: error: ...`` or the interpreter's ``can't open file``, else the last
    non-empty line; None for an empty ``stderr``."""
    own = own_error_line(stderr)
    if own:
        return own
    lines = [line.strip() for line in (stderr or "").splitlines() if line.strip()]
    for line in lines:
        if _ARGPARSE.match(line) or _CANT_OPEN.search(line):
            return line
    return lines[-1] if lines else None


def repeats_everywhere(*, returncode: int | None, message: str | None) -> bool:
    """Whether a failed trial's process (exit status ``returncode``; its classified one-line
    ``message``) failed in a way that every allocator configuration and batch size repeats: a usage
    error (exit status 2) or an import/compile error (see the module docstring)."""
    if returncode == USAGE_STATUS:
        return True
    return bool(message) and _NEVER_RAN_LINE.match(message.strip()) is not None
