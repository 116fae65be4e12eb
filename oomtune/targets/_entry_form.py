"""A ``target.entry`` string's form (``pkg.mod:function``, ``path/to/file.py:function``) and what the
check before any trial learnt of its function: read by the target (:mod:`oomtune.targets.python_target`,
no torch) and by the code that imports and calls the entry (:mod:`oomtune.targets.python_entry`)."""

from __future__ import annotations

from typing import Any

__all__ = ["split_entry", "known_parameters", "remember_parameters"]

_FORMAT = "expected 'package.module:function' or 'path/to/file.py:function'"

#: entry string -> the parameter names of its function (None: it has no signature), as the check before
#: any trial found them in a process of its own
#: (:meth:`oomtune.targets.python_target.PythonTarget.inspected`); read instead of importing the
#: user's module here (:func:`known_parameters`).
_PARAMETERS: dict[str, frozenset[str] | None] = {}


def split_entry(entry: Any) -> tuple[str, str]:
    """``(module or file, function name)`` of an entry string, checked for its form only (nothing is
    imported or opened).

    Raises:
        ConfigError: not ``pkg.mod:func`` / ``file.py:func`` (one line with the expected form).
    """
    from oomtune.exceptions import ConfigError

    if not isinstance(entry, str) or entry.count(":") < 1 or entry.strip() in ("", "???"):
        raise ConfigError(f"target.entry={entry!r}: {_FORMAT}")
    where, _, name = entry.rpartition(":")
    where, name = where.strip(), name.strip()
    if not where or not name.isidentifier():
        raise ConfigError(f"target.entry={entry!r}: {_FORMAT}")
    return where, name


def known_parameters(entry: Any) -> frozenset[str] | None | bool:
    """The parameter names of ``entry``'s function found by the check before any trial (None: the
    function has no signature), or False when this process has not checked it."""
    return _PARAMETERS.get(entry, False) if isinstance(entry, str) else False


def remember_parameters(entry: str, names: frozenset[str] | None) -> None:
    """Keep the parameter names of ``entry``'s function (None: no signature) as the check before any
    trial found them, for :func:`known_parameters` in this process."""
    _PARAMETERS[entry] = names
