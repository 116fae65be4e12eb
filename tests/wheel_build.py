"""The wheel of a clean clone, built once per test session (tests/test_packaging.py and
tests/test_wheel_install.py share it: the build compiles the replay core, about a minute). Under
pytest-xdist the workers of one run share it too: the first builds it in a directory named after
the run (``PYTEST_XDIST_TESTRUNUID``) under a file lock, the others wait for it and reuse it.

``git clone`` of the repository (its committed HEAD: what CI and a release build see, without the
working tree's untracked or ignored files), then ``pip wheel --no-build-isolation`` (the build
requirements, setuptools and Cython, are in the ``dev`` extra; no index is reached).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["REPO", "clean_clone_wheel", "package_dirs"]

REPO = Path(__file__).resolve().parents[1]
_BUILT: dict[str, Path] = {}


def _unavailable(reason: str) -> None:
    """Skip, except under CI (``CI=true``), where the wheel must build."""
    import pytest

    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"the wheel could not be built under CI: {reason}")
    pytest.skip(reason)


def clean_clone_wheel() -> Path:
    """The path of ``oomtune-*.whl`` built from a fresh ``git clone`` of this repository.

    Skips (fails under CI) when git or setuptools is missing or this is not a git checkout."""
    if "wheel" in _BUILT:
        return _BUILT["wheel"]
    if shutil.which("git") is None:
        _unavailable("git is not installed")
    try:
        import setuptools  # noqa: F401
    except ImportError:
        _unavailable("setuptools is not installed (pip install -e '.[dev]')")
    if subprocess.run(["git", "-C", str(REPO), "rev-parse", "--git-dir"], capture_output=True).returncode != 0:
        _unavailable(f"{REPO} is not a git checkout")
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID", "")
    if run.isalnum():   # pytest-xdist: one build for all the run's workers
        work = Path(tempfile.gettempdir()) / f"oomtune-wheel-{run}"
        work.mkdir(exist_ok=True)
        with open(work / "lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)   # released when the file closes: after the build below
            built = sorted((work / "dist").glob("oomtune-*.whl"))
            if not built:
                _build(work)
            (wheel,) = (work / "dist").glob("oomtune-*.whl")
    else:
        work = Path(tempfile.mkdtemp(prefix="oomtune-wheel-"))
        _build(work)
        (wheel,) = (work / "dist").glob("oomtune-*.whl")
    _BUILT["wheel"], _BUILT["clone"] = wheel, work / "src"
    return wheel


def _build(work: Path) -> None:
    """Clone the repository into ``work/src`` and build its wheel into ``work/dist``."""
    clone = work / "src"
    shutil.rmtree(clone, ignore_errors=True)   # a build an earlier worker left half done
    subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(REPO), str(clone)], check=True,
                   capture_output=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", str(clone), "--no-deps", "--no-build-isolation",
                            "--disable-pip-version-check", "-q", "-w", str(work / "dist")],
                           capture_output=True, text=True, env=env, cwd=work)
    assert build.returncode == 0, build.stderr[-3000:]


def package_dirs(root: Path) -> list[str]:
    """Every directory under ``root/oomtune`` that holds ``.py`` files, as a path relative to
    ``root`` with ``/`` separators (``oomtune``, ``oomtune/search``, ...)."""
    found = {p.parent.relative_to(root).as_posix() for p in (root / "oomtune").rglob("*.py")
             if "__pycache__" not in p.parts}
    return sorted(found)
