"""The first lines of every results file in experiments/results/: the exact command and the commit.

Every benchmark script calls :func:`header` and writes its lines first, so that a results file says
how to regenerate it and at which code it was measured (issue 14 item 8; tests/test_experiments_results.py
checks every file). Run from anywhere; the command is written relative to the repository root::

    # command: python experiments/bench_plan.py --out experiments/results/bench_plan.txt
    # commit: 1a2b3c4 (uncommitted changes: no)
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def command_line(argv: list[str] | None = None) -> str:
    """``python <script relative to the repository> <args>`` for this process (``sys.argv``)."""
    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0]).resolve() if argv else Path(__file__)
    try:
        shown = str(script.relative_to(REPO))
    except ValueError:
        shown = str(script)
    return " ".join(["python", shlex.quote(shown), *(shlex.quote(a) for a in argv[1:])])


def commit() -> str:
    """``git rev-parse --short HEAD`` of the repository, with whether the tree had uncommitted
    changes to tracked files; ``unknown (not a git checkout)`` without git."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True,
                              timeout=30, check=True).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return "unknown (not a git checkout)"
    return f"{head} (uncommitted changes: {'yes' if dirty else 'no'})"


def header(prefix: str = "# ", argv: list[str] | None = None) -> str:
    """The two provenance lines (each starting with ``prefix``), newline-terminated."""
    return f"{prefix}command: {command_line(argv)}\n{prefix}commit: {commit()}\n"


def provenance(argv: list[str] | None = None) -> dict[str, str]:
    """The same for JSON results: ``{"command": ..., "commit": ...}``."""
    return {"command": command_line(argv), "commit": commit()}
