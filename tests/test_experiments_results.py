"""Results that reproduce: every file in experiments/results/ starts
with experiments/_provenance.py's five lines, in this order::

    # command: python experiments/<script> <args>      (a script in experiments/ that exists)
    # commit: <short hash>                              (a commit of this branch; a clean tree)
    # date: <UTC, ISO 8601>
    # machine: <host name>, <n> CPUs, GPU <name | none>
    # load: <1-minute load average at the start>

(a JSON results file: the same five top-level keys). Files measured before the five-line format
existed carry the command and the commit only; they are listed in TO_RERUN until they are re-run
(then the entry must go: a listed file that already has the five lines fails). Every benchmark script
writes the header through experiments/_provenance.py, which refuses a tree with uncommitted changes,
and imports only names that exist in oomtune today.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import re
import os
import shutil
import socket
import subprocess
import sys
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
SHELL_SCRIPTS = sorted(EXPERIMENTS.glob("*.sh"))

#: experiments/_provenance.py's five lines, in order: the field and the pattern of its value.
FIELDS = {
    "command": r"(?:python3?|bash) experiments/[\w./-]+\.(?:py|sh)(?: .*)?",
    "commit": r"[0-9a-f]{7,40}",                      # no "(uncommitted changes: yes)", no "unknown"
    "date": r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z",
    "machine": r".+, \d+ CPUs, GPU .+",
    "load": r"\d+\.\d{2}",
}

#: Results files measured before the five-line header: they carry the command and commit lines only,
#: Files that still carry an older header. Empty: every file was re-run at 445a0b2 (an ancestor of
#: main) on the 2-core machine and carries the five lines. A file added here must leave once re-run
#: (test_to_rerun_names_only_files_that_still_need_it).
TO_RERUN: set[str] = set()


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


def header_problems(path: Path) -> list[str]:
    """What is missing or wrong in the five provenance lines of a results file (empty: all right)."""
    text = path.read_text(errors="replace")
    if path.suffix == ".json":
        doc = json.loads(text)
        if not isinstance(doc, dict):
            return ["not a JSON object"]
        values = [(k, str(doc.get(k, ""))) for k in FIELDS]
    else:
        lines = text.splitlines()[:len(FIELDS)]
        lines += [""] * (len(FIELDS) - len(lines))
        values = [(k, line[len(f"# {k}: "):] if line.startswith(f"# {k}: ") else f"<line {line[:60]!r}>")
                  for k, line in zip(FIELDS, lines)]
    return [f"{k}: {v[:80]!r} is not {FIELDS[k]}" for k, v in values if not re.fullmatch(FIELDS[k], v)]


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
    if path.name not in TO_RERUN and _is_commit(commit.group(1)) is False:
        pytest.fail(f"{path.name}: commit {commit.group(1)} is not a commit of this branch's history (rebased away? re-run the command at HEAD)")


def test_results_files_start_with_the_five_provenance_lines():
    problems = {p.name: header_problems(p) for p in RESULT_FILES if p.name not in TO_RERUN}
    assert {k: v for k, v in problems.items() if v} == {}, (
        "re-run these commands on a clean tree at a commit (experiments/_provenance.py writes command, "
        "commit, date, machine, load)")


def test_to_rerun_names_only_files_that_still_need_it():
    names = {p.name for p in RESULT_FILES}
    assert TO_RERUN <= names, f"TO_RERUN names files that are not in experiments/results/: {TO_RERUN - names}"
    done = sorted(n for n in TO_RERUN if not header_problems(RESULTS / n))
    assert done == [], f"{done}: re-run with the five-line header: remove from TO_RERUN"


def test_the_header_check_can_fail(tmp_path):
    good = ("# command: python experiments/bench_plan.py --repeat 3\n# commit: 1a2b3c4\n"
            "# date: 2026-12-02T11:40:00Z\n# machine: host-1, 2 CPUs, GPU none\n# load: 1.12\nbody\n")
    path = tmp_path / "r.txt"
    path.write_text(good)
    assert header_problems(path) == []
    path.write_text(good.replace("1a2b3c4", "1a2b3c4 (uncommitted changes: yes)"))
    assert [p.split(":")[0] for p in header_problems(path)] == ["commit"]
    path.write_text(good.replace("# load: 1.12\n", ""))    # four lines: the body is read as the load
    assert [p.split(":")[0] for p in header_problems(path)] == ["load"]
    doc = dict(command="python experiments/gpu_async_trial.py", commit="1a2b3c4", date="2026-12-02T11:40:00Z",
               machine="h, 16 CPUs, GPU NVIDIA H200", load="0.50")
    (tmp_path / "r.json").write_text(json.dumps(doc))
    assert header_problems(tmp_path / "r.json") == []
    (tmp_path / "r.json").write_text(json.dumps({**doc, "machine": "h"}))
    assert [p.split(":")[0] for p in header_problems(tmp_path / "r.json")] == ["machine"]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_benchmark_script_writes_the_provenance_header(script):
    text = script.read_text()
    if "results" not in text:
        pytest.skip(f"{script.name} writes no results file")
    # experiments/_provenance.py (directly, or through experiments/_baseline.py's header, which starts
    # with its five lines), never a header of its own
    assert re.search(r"^\s*from _provenance import ", text, re.M) or re.search(
        r"^\s*from _baseline import [^\n]*\bheader\b", text, re.M), (
        f"{script.name} writes into experiments/results/ without experiments/_provenance.py's header")
    assert "rev-parse" not in text, f"{script.name}: the commit comes from experiments/_provenance.py"


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: p.name)
def test_every_shell_script_takes_its_header_from_provenance(script):
    text = script.read_text()
    assert "experiments/_provenance.py --command" in text and "rev-parse" not in text, script.name


def _provenance_module():
    sys.path.insert(0, str(EXPERIMENTS))
    try:
        import _provenance
    finally:
        sys.path.remove(str(EXPERIMENTS))
    return _provenance


def test_provenance_header_format(monkeypatch):
    prov = _provenance_module()
    monkeypatch.setenv("OOMTUNE_ALLOW_DIRTY", "1")   # this checkout may have uncommitted changes
    argv = [str(EXPERIMENTS / "bench_plan.py"), "--out", "x y.txt"]
    assert prov.command_line(argv) == "python experiments/bench_plan.py --out 'x y.txt'"
    lines = prov.header(argv=argv).splitlines()
    assert [line.split(":")[0] for line in lines] == [f"# {k}" for k in FIELDS]
    assert lines[0] == "# command: python experiments/bench_plan.py --out 'x y.txt'"
    for key, line in zip(FIELDS, lines):
        value = line[len(f"# {key}: "):]
        if key == "commit":   # this checkout: clean, or marked as not
            value = value.removesuffix(" (uncommitted changes: yes)")
        assert re.fullmatch(FIELDS[key], value), line
    assert lines[3].startswith(f"# machine: {socket.gethostname()}, {os.cpu_count()} CPUs, GPU ")


def _git_repo(tmp_path: Path) -> Path:
    """A fresh repository holding experiments/_provenance.py and _baseline.py, a tracked source file
    and a tracked results file, all committed."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    repo = tmp_path / "repo"
    (repo / "experiments" / "results").mkdir(parents=True)
    for name in ("_provenance.py", "_baseline.py"):
        shutil.copy(EXPERIMENTS / name, repo / "experiments" / name)
    (repo / "code.py").write_text("x = 1\n")
    (repo / "experiments" / "results" / "a.txt").write_text("old\n")
    for args in (["init", "-q"], ["add", "-A"],
                 ["-c", "user.name=t", "-c", "user.email=t@example.org", "commit", "-q", "-m", "init"]):
        subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)
    return repo


def _short_head(repo: Path) -> str:
    return subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()


def _env(allow_dirty: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "OOMTUNE_ALLOW_DIRTY"}
    return {**env, "OOMTUNE_ALLOW_DIRTY": "1"} if allow_dirty else env


def _header_of(repo: Path, allow_dirty: bool) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(repo / "experiments" / "_provenance.py"), "--command",
                           "bash experiments/x.sh"], capture_output=True, text=True, env=_env(allow_dirty),
                          timeout=60)


def test_a_dirty_tree_is_refused_in_one_line(tmp_path):
    repo = _git_repo(tmp_path)
    head = _short_head(repo)
    clean = _header_of(repo, allow_dirty=False)
    assert clean.returncode == 0, clean.stderr
    assert clean.stdout.splitlines()[:2] == ["# command: bash experiments/x.sh", f"# commit: {head}"]
    # a results file rewritten by an earlier benchmark of the same series does not make the tree dirty
    (repo / "experiments" / "results" / "a.txt").write_text("new\n")
    assert _header_of(repo, allow_dirty=False).stdout.splitlines()[1] == f"# commit: {head}"
    (repo / "code.py").write_text("x = 2\n")
    dirty = _header_of(repo, allow_dirty=False)
    assert dirty.returncode == 2 and dirty.stdout == ""
    assert dirty.stderr.count("\n") == 1 and "uncommitted changes" in dirty.stderr \
        and "code.py" in dirty.stderr and "commit or stash first" in dirty.stderr, dirty.stderr
    allowed = _header_of(repo, allow_dirty=True)
    assert allowed.returncode == 0
    assert allowed.stdout.splitlines()[1] == f"# commit: {head} (uncommitted changes: yes)"


def test_baseline_header_is_the_provenance_header_and_the_old_commit(tmp_path):
    repo = _git_repo(tmp_path)
    head = _short_head(repo)
    code = ("import sys; sys.path.insert(0, 'experiments'); from _baseline import header; "
            "print('\\n'.join(header('bench_plan.py', ['--repeat', '3'], 'HEAD')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True,
                         env=_env(False), timeout=60, check=True).stdout.splitlines()
    assert [line.split(":")[0] for line in out] == [*(f"# {k}" for k in FIELDS), "# compared with"]
    assert out[0] == "# command: python experiments/bench_plan.py --repeat 3" and out[1] == f"# commit: {head}"
    assert out[5] == f"# compared with: old = HEAD ({head})"


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
