"""Reading user-supplied YAML and JSON files with limits on their size and nesting depth.

Every file a user hands oomtune (best.yaml, plan.yaml, run.json, a trial's result.json, a recorded
stream's sidecar, tell.json) is read through :func:`read_yaml` / :func:`read_json` (or, for text
already in memory, :func:`loads_yaml` / :func:`loads_json`). Without limits a best.yaml nested
100,000 levels deep ended in a 3,000-line ``RecursionError`` (PyYAML's composer and Python's
``json`` decoder recurse once per level), and a multi-gigabyte file was read whole into memory.
Here such a file is refused in one line naming it: :class:`oomtune.exceptions.ConfigError` by
default, or the caller's error class (``BestFileError`` for best.yaml).

Limits: :data:`MAX_DEPTH` levels of nesting (oomtune's own files nest at most 6: best.yaml's
``frontiers`` list of mappings, plan.yaml's rows), :data:`MAX_BYTES` bytes (a plan.yaml of a wide map
is a few MiB; best.yaml a few KiB). The depth of a YAML document is counted on PyYAML's event
stream (its parser is a state machine, not recursive) before anything is composed; a JSON text's
depth is counted on the decoded value (the decoder's own ``RecursionError`` is caught first).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from oomtune.exceptions import ConfigError

__all__ = ["MAX_DEPTH", "MAX_BYTES", "read_text_limited", "loads_yaml", "loads_json", "read_yaml", "read_json",
           "check_depth"]

#: Nesting levels a user-supplied YAML or JSON document may have (mappings and lists together).
MAX_DEPTH = 64
#: Bytes a user-supplied YAML or JSON file may have (64 MiB).
MAX_BYTES = 64 * 2**20


def _fail(error: type[Exception], message: str) -> Exception:
    return error(message)


def read_text_limited(path: str | Path, *, what: str, max_bytes: int = MAX_BYTES,
                      error: type[Exception] = ConfigError) -> str:
    """The text of ``path`` (UTF-8), refused when it is larger than ``max_bytes`` bytes.

    Raises:
        ``error``: the file cannot be read, is larger than ``max_bytes`` (both sizes named, in MiB),
            or is not UTF-8 text; one line naming ``path`` and ``what`` it should be.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as exc:
        raise _fail(error, f"cannot read {str(path)!r}: {exc.strerror or exc}") from None
    if len(data) > max_bytes:
        raise _fail(error, f"{path} is larger than {max_bytes / 2**20:.0f} MiB, too large for {what}: "
                           "give the file oomtune wrote")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise _fail(error, f"{path} is not {what}: it is not a text file") from None


def _yaml_depth_ok(text: str, source: str, what: str, max_depth: int, error: type[Exception]) -> None:
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    depth = 0
    try:
        for event in yaml.parse(text, Loader=loader):
            if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                depth += 1
                if depth > max_depth:
                    raise _fail(error, f"{source} is nested more than {max_depth} levels deep: not {what} "
                                       "(give the file oomtune wrote)")
            elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                depth -= 1
    except yaml.YAMLError as exc:
        raise _yaml_error(exc, source, error) from None


def _yaml_error(exc: Exception, source: str, error: type[Exception]) -> Exception:
    mark = getattr(exc, "problem_mark", None)
    where = f" at line {mark.line + 1}" if mark is not None else ""
    return _fail(error, f"{source} is not valid YAML{where}")


def loads_yaml(text: str, *, source: str, what: str, max_depth: int = MAX_DEPTH,
               error: type[Exception] = ConfigError) -> Any:
    """``yaml.safe_load(text)`` after checking that no mapping or list is nested more than
    ``max_depth`` levels deep (PyYAML's safe loader: plain data only, no Python objects).

    Raises:
        ``error``: too deep, or not valid YAML (the line named), in one line naming ``source``.
    """
    import yaml

    _yaml_depth_ok(text, source, what, max_depth, error)
    try:
        return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except yaml.YAMLError as exc:
        raise _yaml_error(exc, source, error) from None
    except RecursionError:   # aliases cannot nest deeper than the events counted; kept as a last guard
        raise _fail(error, f"{source} is nested too deeply: not {what}") from None


def check_depth(value: Any, *, source: str, what: str, max_depth: int = MAX_DEPTH,
                error: type[Exception] = ConfigError) -> None:
    """Refuse a decoded value whose lists and mappings nest more than ``max_depth`` levels (counted
    without recursion).

    Raises:
        ``error``: too deep, in one line naming ``source``.
    """
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list, tuple)):
            if depth > max_depth:
                raise _fail(error, f"{source} is nested more than {max_depth} levels deep: not {what} "
                                   "(give the file oomtune wrote)")
            children = node.values() if isinstance(node, dict) else node
            stack.extend((child, depth + 1) for child in children)


def loads_json(text: str | bytes, *, source: str, what: str, max_depth: int = MAX_DEPTH,
               error: type[Exception] = ConfigError) -> Any:
    """``json.loads(text)`` with the nesting limited to ``max_depth`` levels.

    Raises:
        ``error``: not JSON, or nested too deeply (the decoder's ``RecursionError`` included), in
            one line naming ``source``.
    """
    import json

    try:
        value = json.loads(text)
    except RecursionError:
        raise _fail(error, f"{source} is nested more than {max_depth} levels deep: not {what} "
                           "(give the file oomtune wrote)") from None
    except ValueError as exc:   # JSONDecodeError, and bytes that are not UTF-8
        raise _fail(error, f"{source} is not valid JSON ({str(exc).splitlines()[0]}): not {what}") from None
    check_depth(value, source=source, what=what, max_depth=max_depth, error=error)
    return value


def read_yaml(path: str | Path, *, what: str, max_bytes: int = MAX_BYTES, max_depth: int = MAX_DEPTH,
              error: type[Exception] = ConfigError) -> Any:
    """The YAML document in ``path`` (:func:`read_text_limited`, then :func:`loads_yaml`).

    Raises:
        ``error``: unreadable, too large, too deep or not YAML; one line naming ``path``.
    """
    return loads_yaml(read_text_limited(path, what=what, max_bytes=max_bytes, error=error), source=str(path),
                      what=what, max_depth=max_depth, error=error)


def read_json(path: str | Path, *, what: str, max_bytes: int = MAX_BYTES, max_depth: int = MAX_DEPTH,
              error: type[Exception] = ConfigError) -> Any:
    """The JSON document in ``path`` (:func:`read_text_limited`, then :func:`loads_json`).

    Raises:
        ``error``: unreadable, too large, too deep or not JSON; one line naming ``path``.
    """
    return loads_json(read_text_limited(path, what=what, max_bytes=max_bytes, error=error), source=str(path),
                      what=what, max_depth=max_depth, error=error)
