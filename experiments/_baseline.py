"""Helpers for issue 13's benchmarks: an old checkout to compare against, and the results header.

Every speed figure is reported next to the same measurement of the code before the change, taken in
the same run (old and new alternate), so that load from other processes on a shared machine cancels
in the ratio. The old code is extracted with ``git archive REF`` into a temporary directory (no
worktree is registered) and run with ``PYTHONPATH`` pointing there.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: main just before issue 13's changes (the code the issue measured).
DEFAULT_OLD = "48cfeb3"


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
    """First lines of a results file: the exact command, the commits, the machine and its load."""
    try:
        load = os.getloadavg()
        load_text = f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    except OSError:
        load_text = "load average unknown"
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    dirty = " (with uncommitted changes)" if git("status", "--porcelain", "--untracked-files=no") else ""
    return [
        f"# command: python experiments/{script} {' '.join(argv)}".rstrip(),
        f"# commit: {git('rev-parse', '--short', 'HEAD')}{dirty}; compared with old = {old_ref} "
        f"({git('rev-parse', '--short', f'{old_ref}^{{commit}}')})",
        f"# date {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}; nproc "
        f"{os.cpu_count()}; {load_text} at start; cpu {cpu}; python {platform.python_version()}; "
        f"{sys.platform}",
    ]
