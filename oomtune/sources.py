"""What a user's code depends on, read without running it: its files, its local imports, the
versions of the packages it imports, and the environment variables it names.

Two users of it: the stream cache (:func:`oomtune.plan.stream_cache.entry_fingerprint`: a python
entry's captures are keyed by its code) and the study name (:func:`oomtune.config.default_study_name`:
a changed script, package version or environment variable the script reads starts a new study
instead of resuming one whose trials ran other code). Everything here reads source text (``ast``),
never imports or executes the user's code; package versions come from package metadata.
"""

from __future__ import annotations

import ast
import hashlib
import os
import sys
from pathlib import Path
from typing import Any

__all__ = ["fingerprint", "imported_packages", "environ_names", "imported_names"]


def fingerprint(path: str | Path, *, environ: bool = False) -> dict[str, Any] | None:
    """What the Python file ``path`` depends on, or None when it cannot be read:

    * ``files``: ``{path: SHA-256}`` of ``path`` and of every local module it imports, transitively
      (a module is local when ``name.py`` or the package ``name/`` lies in the importing file's
      folder, the folder Python puts first on ``sys.path`` for a script; a package counts with every
      ``.py`` file under it). A file that does not parse as Python (a shell script) counts by its
      bytes alone.
    * ``packages``: ``{module: "dist==version"}`` of the other modules those files import (standard
      library left out; None: not installed), from package metadata.
    * with ``environ``: ``environ``: ``{name: value now (None: unset)}`` of every environment variable
      those files name literally (:func:`environ_names`).
    """
    found = _closure(path)
    if found is None:
        return None
    files, third_party, names = found
    out: dict[str, Any] = {"files": dict(sorted(files.items())), "packages": _versions(sorted(third_party))}
    if environ:
        out["environ"] = {name: os.environ.get(name) for name in sorted(names)}
    return out


def imported_packages(path: str | Path) -> set[str] | None:
    """The top-level modules outside the standard library that the Python file ``path`` and its
    local modules import, transitively (the ``packages`` of :func:`fingerprint`, without reading
    package metadata); None when the file cannot be read."""
    found = _closure(path)
    return None if found is None else found[1]


def _closure(path: str | Path) -> tuple[dict[str, str], set[str], set[str]] | None:
    """(``{file: SHA-256}`` of ``path`` and its local modules, the other modules they import, the
    environment variables they name) as :func:`fingerprint` describes them; None when a file cannot
    be read."""
    path = Path(path).expanduser()
    if not path.is_file():
        return None
    files: dict[str, str] = {}
    third_party: set[str] = set()
    names: set[str] = set()
    todo = [path.resolve()]
    while todo:
        f = todo.pop()
        if str(f) in files:
            continue
        try:
            source = f.read_bytes()
        except OSError:
            return None
        files[str(f)] = hashlib.sha256(source).hexdigest()
        tree = _parse(source)
        if tree is None:
            continue
        names.update(environ_names(tree))
        for name in imported_names(tree):
            local = f.parent / f"{name}.py"
            package = f.parent / name
            if local.is_file():
                todo.append(local.resolve())
            elif (package / "__init__.py").is_file():
                todo += sorted(p.resolve() for p in package.rglob("*.py"))
            elif name not in sys.stdlib_module_names:
                third_party.add(name)
    return files, third_party, names


def _parse(source: bytes) -> ast.AST | None:
    try:
        return ast.parse(source)
    except (SyntaxError, ValueError):
        return None


def imported_names(tree: ast.AST) -> list[str]:
    """The first component of every module an ``import`` statement in ``tree`` names (absolute
    imports; a relative one names its module's first component), in order, once each."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.module:
                names.append(node.module.split(".")[0])
            elif node.level:
                names += [a.name.split(".")[0] for a in node.names]
    return list(dict.fromkeys(names))


def _is_environ(node: ast.AST) -> bool:
    """``os.environ`` or a bare ``environ`` (``from os import environ``)."""
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or \
        (isinstance(node, ast.Name) and node.id == "environ")


def _literal(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def environ_names(tree: ast.AST) -> list[str]:
    """The environment variables ``tree`` names literally, sorted: ``os.environ["N"]``,
    ``os.environ.get("N")`` (also ``setdefault``, ``pop``), ``os.getenv("N")`` / ``getenv("N")``,
    ``"N" in os.environ``. A name computed at run time (``os.environ[f"X_{i}"]``) is not seen
    (the stream cache sees it: :mod:`oomtune.capture.reads`)."""
    found: set[str] = set()
    for node in ast.walk(tree):
        name = None
        if isinstance(node, ast.Subscript) and _is_environ(node.value):
            name = _literal(node.slice)
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in ("get", "setdefault", "pop") and _is_environ(func.value):
                name = _literal(node.args[0])
            elif (isinstance(func, ast.Attribute) and func.attr == "getenv") or \
                    (isinstance(func, ast.Name) and func.id == "getenv"):
                name = _literal(node.args[0])
        elif isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.In, ast.NotIn)) \
                and _is_environ(node.comparators[0]):
            name = _literal(node.left)
        if name:
            found.add(name)
    return sorted(found)


def _versions(modules: list[str]) -> dict[str, str | None]:
    """``{module: version of the distribution that provides it}`` (None: not installed)."""
    if not modules:
        return {}
    from importlib import metadata

    from oomtune.packages import installed_version

    try:
        provides = metadata.packages_distributions()
    except Exception:  # noqa: BLE001 - a broken distribution's metadata must not stop a plan
        provides = {}
    out: dict[str, str | None] = {}
    for m in modules:
        dists = sorted(set(provides.get(m, [m])))
        versions = [f"{d}=={installed_version(d)}" for d in dists if installed_version(d) is not None]
        out[m] = ",".join(versions) or None
    return out
