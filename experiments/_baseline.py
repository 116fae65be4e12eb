"""Helpers for issue 13's benchmarks: an old checkout to compare against, and the results header.

Every speed figure is reported next to the same measurement of the code before the change, taken in
the same run (old and new alternate), so that load from other processes on a shared machine cancels
in the ratio. The old code is extracted with ``git archive REF`` into a temporary directory (no
worktree is registered) and run with ``PYTHONPATH`` pointing there.
"""

from __future__ import annotations

import os
import subprocess
import tarfile
import tempfile
from pathlib import Path

from _provenance import header as provenance_header  # experiments/ is on sys.path (this module is there)

ROOT = Path(__file__).resolve().parents[1]
#: the real GPU traces, copied from ../shared/traces (a clone has them; ../shared is not beside every checkout)
TRACES = ROOT / "tests" / "data"
#: main just before issue 13's changes (the code the issue measured).
DEFAULT_OLD = "48cfeb3"


def trace_files(directory: Path, script: str) -> list[Path]:
    """The ``*.pickle`` traces in ``directory``, sorted by name; stops with one line when there are none."""
    found = sorted(Path(directory).glob("*.pickle"))
    if not found:
        raise SystemExit(f"{script}: no *.pickle traces in {directory}: pass --traces DIR")
    return found


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()


def old_tree(ref: str) -> Path:
    """The repository at ``ref``, extracted once into $TMPDIR/oomtune-old-<sha>; returns its root."""
    sha = git("rev-parse", "--short", f"{ref}^{{commit}}")
    dest = Path(tempfile.gettempdir()) / f"oomtune-old-{sha}"
    if not (dest / "oomtune" / "__init__.py").is_file():
        tmp = Path(tempfile.mkdtemp(prefix=f"oomtune-old-{sha}-"))
        archive = subprocess.run(["git", "archive", "--format=tar", sha], cwd=ROOT, check=True,
                                 capture_output=True).stdout
        tar_path = tmp / "src.tar"
        tar_path.write_bytes(archive)
        with tarfile.open(tar_path) as tar:
            tar.extractall(tmp / "tree")
        tar_path.unlink()
        if not dest.exists():
            (tmp / "tree").rename(dest)
    return dest


def child_env(tree: Path) -> dict[str, str]:
    """Environment that runs ``tree``'s oomtune (bytecode caches allowed, one thread for BLAS)."""
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # a user's install has .pyc files; measure that case
    return env


def header(script: str, argv: list[str], old_ref: str) -> list[str]:
    """First lines of a results file: experiments/_provenance.py's five (command, commit, date,
    machine, load; it refuses a tree with uncommitted changes), then the old code compared with.
    Call it when the run starts."""
    lines = provenance_header(argv=[str(ROOT / "experiments" / script), *argv]).splitlines()
    return [*lines, f"# compared with: old = {old_ref} ({git('rev-parse', '--short', f'{old_ref}^{{commit}}')})"]
