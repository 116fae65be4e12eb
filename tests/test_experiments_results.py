"""Results that reproduce (issue 14 item 8): every file in experiments/results/ says, in its first
lines, the exact command that regenerates it (a script in experiments/ that exists) and the commit it
was measured at (a commit of this repository); every benchmark script writes that header itself and
imports only names that exist in oomtune today.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXPERIMENTS = REPO / "experiments"
RESULTS = EXPERIMENTS / "results"
COMMAND_RE = re.compile(r"\b(?:python3?|bash|sh)\s+(experiments/[\w./-]+\.(?:py|sh))\b")
COMMIT_RE = re.compile(r"\bcommit\W+([0-9a-f]{7,40})\b", re.I)
HEAD_LINES = 5

RESULT_FILES = sorted(p for p in RESULTS.iterdir() if p.is_file() and not p.name.startswith(".")) \
    if RESULTS.is_dir() else []
SCRIPTS = sorted(p for p in EXPERIMENTS.glob("*.py") if not p.name.startswith("_"))


def _head(path: Path) -> str:
    """The part of a results file that must carry the provenance: the first lines of a text file,
    the top-level "command" and "commit" values of a JSON object."""
    text = path.read_text(errors="replace")
    if path.suffix == ".json":
        doc = json.loads(text)
        assert isinstance(doc, dict), f"{path.name}: a JSON results file must be an object with command/commit"
        return f"{doc.get('command', '')}\ncommit: {doc.get('commit', '')}"
    return "\n".join(text.splitlines()[:HEAD_LINES])


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True)


def _is_commit(ref: str) -> bool | None:
    """True/False when git can tell whether ``ref`` is a commit of the checked-out history (an
    ancestor of HEAD, so that a clean clone of main has it: a commit that exists only on a local
    branch, e.g. one rebased away, is not); None without git history or in a shallow clone."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        return None
    if _git("rev-parse", "--is-shallow-repository").stdout.strip() == "true":
        return None
    if _git("cat-file", "-e", f"{ref}^{{commit}}").returncode != 0:
        return False
    return _git("merge-base", "--is-ancestor", ref, "HEAD").returncode == 0


def test_there_are_results_files():
    assert RESULT_FILES, "experiments/results/ is empty"


@pytest.mark.parametrize("path", RESULT_FILES, ids=lambda p: p.name)
def test_results_file_names_its_command_and_commit(path):
    head = _head(path)
    command = COMMAND_RE.search(head)
    assert command, f"{path.name}: no 'python experiments/<script>' command in its first {HEAD_LINES} lines"
    script = REPO / command.group(1)
    assert script.is_file(), f"{path.name} names {command.group(1)}, which does not exist"
    commit = COMMIT_RE.search(head)
    assert commit, f"{path.name}: no 'commit <hash>' in its first {HEAD_LINES} lines"
    if _is_commit(commit.group(1)) is False:
        pytest.fail(f"{path.name}: commit {commit.group(1)} is not a commit of this branch's history (rebased away? re-run the command at HEAD)")


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_benchmark_script_writes_the_provenance_header(script):
    text = script.read_text()
    if "results" not in text:
        pytest.skip(f"{script.name} writes no results file")
    # experiments/_provenance.py's header(), a helper of the same kind (_baseline.header), or the
    # script's own `git rev-parse` next to its command line
    assert re.search(r"\b(?:header|provenance|_provenance_header)\(", text) or (
        "rev-parse" in text and "command" in text), (
        f"{script.name} writes into experiments/results/ without a command + commit header "
        "(use experiments/_provenance.py)")


def test_provenance_header_format():
    import sys

    sys.path.insert(0, str(EXPERIMENTS))
    try:
        from _provenance import command_line, header
    finally:
        sys.path.remove(str(EXPERIMENTS))
    argv = [str(EXPERIMENTS / "bench_plan.py"), "--out", "x y.txt"]
    assert command_line(argv) == "python experiments/bench_plan.py --out 'x y.txt'"
    lines = header(argv=argv).splitlines()
    assert lines[0] == "# command: python experiments/bench_plan.py --out 'x y.txt'"
    assert COMMAND_RE.search(lines[0]) and COMMIT_RE.search(lines[1]) or lines[1].startswith("# commit: unknown")


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_import_only_names_that_exist(script):
    """A script that cites a moved function fails here, not when the coordinator reruns it."""
    tree = ast.parse(script.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "oomtune":
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert alias.name == "*" or hasattr(module, alias.name) or importlib.util.find_spec(
                    f"{node.module}.{alias.name}") is not None, f"{script.name}: {node.module}.{alias.name} is gone"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "oomtune":
                    importlib.import_module(alias.name)
