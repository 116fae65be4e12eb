"""Tests that cannot hide: read from the test sources themselves.

- No ``pytest.importorskip`` of oomtune's own modules: an import error in oomtune must fail the tests
  that need the module, never turn them into skips. importorskip of optional third-party packages
  (transformers, psycopg, optuna_dashboard ...) stays allowed.
- Test data lives in tests/data: no test builds a path into ``../shared`` (the project's shared
  folder is absent from a clone, and a test that skips or reads elsewhere without it hides).
- Every real GPU recording that tests/data/README.md lists is in tests/data.
- No text of the project (code, tests, docs, configs, experiments and their results) points a reader
  at an issue by its number ("issue N item M"): nobody outside the team can follow it, so a comment
  says the reason itself. CHANGELOG.md, a history of what landed, is the exception.

Each check is a function run on the real test sources and, to show it can fail, on a small source
that breaks the rule.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
DATA = TESTS / "data"
SOURCES = sorted(p for p in TESTS.rglob("*.py") if DATA not in p.parents)


def _is_importorskip(func: ast.expr) -> bool:
    return (isinstance(func, ast.Attribute) and func.attr == "importorskip") or (
        isinstance(func, ast.Name) and func.id == "importorskip")


def own_module_skips(source: str) -> list[str]:
    """``line: module`` for every importorskip of an ``oomtune`` module in ``source``, and of a module
    name that is not a string literal (it cannot be checked, so it is refused too)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and _is_importorskip(node.func)):
            continue
        arg = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "modname"), None)
        if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
            found.append(f"{node.lineno}: <module name not a literal>")
        elif arg.value == "oomtune" or arg.value.startswith("oomtune."):
            found.append(f"{node.lineno}: {arg.value}")
    return found


def shared_paths(source: str) -> list[str]:
    """``line: text`` for every path into the shared folder built in ``source``: a ``/ "shared"`` path
    join, or a string literal (not a docstring) that starts with ``../shared`` or ``shared/``."""
    tree = ast.parse(source)
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                  and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and isinstance(node.right, ast.Constant) \
                and isinstance(node.right.value, str) and re.match(r"(\.\./)?shared(/|$)", node.right.value):
            found.append(f"{node.lineno}: / {node.right.value!r}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings \
                and re.match(r"(\.\./|/work/)shared(/|$)|shared/traces", node.value):
            found.append(f"{node.lineno}: {node.value!r}")
    return found


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(TESTS)))
def test_no_importorskip_of_oomtune_modules(path):
    assert own_module_skips(path.read_text()) == [], (
        f"{path.name}: import oomtune's own modules plainly (an import error must fail, not skip)")


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(TESTS)))
def test_no_test_reads_the_shared_folder(path):
    assert shared_paths(path.read_text()) == [], f"{path.name}: read test data from tests/data"


def test_the_checks_can_fail():
    bad = ('import pytest\nfrom pytest import importorskip\n'
           'a = pytest.importorskip("oomtune.trial.child")\n'
           'b = importorskip(modname="oomtune")\n'
           'c = pytest.importorskip(NAME)\n'
           'd = pytest.importorskip("transformers")\n'
           'e = pytest.importorskip("oomtunex")\n')
    assert own_module_skips(bad) == ["3: oomtune.trial.child", "4: oomtune", "5: <module name not a literal>"]
    bad = ('"""Reads ../shared/traces in prose only."""\n'
           'A = ROOT.parent / "shared" / "traces"\n'
           'B = Path("../shared/traces/x.pickle")\n'
           'C = ROOT / "tests" / "data"\n')
    assert shared_paths(bad) == ["2: / 'shared'", "3: '../shared/traces/x.pickle'"]


def test_every_recording_listed_in_the_data_readme_is_here():
    listed = set(re.findall(r"^\| ([\w.-]+\.pickle) \|", (DATA / "README.md").read_text(), re.M))
    # tests/data/README.md's table: the cnn trace and the seven added for real-trace fidelity
    assert len(listed) == 8
    assert sorted(p.name for p in DATA.glob("*.pickle")) == sorted(listed)


#: What a reference to a numbered issue or task looks like: "issue" or "task" and a number after it.
ISSUE_REFERENCE = re.compile(r"\b(?:issue|task)s? ?#?\d+\b", re.I)
REPO = TESTS.parent
#: The project's own texts: every file under these folders of the kinds below, and the top-level files.
TEXT_DIRS = ("oomtune", "tests", "docs", "conf", "experiments")
TEXT_SUFFIXES = {".py", ".pyx", ".hpp", ".pxi", ".md", ".yaml", ".txt", ".sh", ".toml", ".cfg", ".json", ".html"}


def issue_references(text: str) -> list[str]:
    """``line: match`` for every reference to a numbered issue or task in ``text``."""
    return [f"{i}: {m.group(0)}" for i, line in enumerate(text.splitlines(), 1) for m in ISSUE_REFERENCE.finditer(line)]


def _project_texts() -> list[Path]:
    files = [p for d in TEXT_DIRS for p in (REPO / d).rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES
             and "__pycache__" not in p.parts and ".egg-info" not in str(p)]
    files += [p for p in REPO.iterdir() if p.is_file() and p.suffix in TEXT_SUFFIXES and p.name != "CHANGELOG.md"]
    return sorted(files)


def test_no_text_of_the_project_refers_to_an_issue_by_its_number():
    found = {}
    for path in _project_texts():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        hits = issue_references(text)
        if hits:
            found[str(path.relative_to(REPO))] = hits[:3]
    assert found == {}, "say the reason itself instead of an issue's number"


def test_the_issue_reference_check_can_fail():
    issue, tasks = "issue", "tasks"   # apart from their numbers, so that this file passes the check it tests
    text = (f"a fix ({issue} 23 item 2)\nsee {issue.title()} #7 and {tasks} 12\n"
            f"no {issue} here; {issue}s of memory; 3 {tasks} 4u\n")
    assert issue_references(text) == [f"1: {issue} 23", f"2: {issue.title()} #7", f"2: {tasks} 12"]
