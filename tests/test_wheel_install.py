"""A regular install works as well as an editable one: the wheel of a clean clone
(tests/wheel_build.py) installed into a fresh virtual environment, not editable, then from outside
the source tree ``oomtune --help``, ``oomtune search --help`` and a one-trial search of the MLP on
the virtual GPU.

The environment is made with ``--system-site-packages`` so that torch and the other dependencies
already installed are reused (nothing is downloaded: ``--no-deps``); oomtune itself must then come
from the environment's own site-packages, which the test checks (``oomtune.__file__``), with
PYTHONPATH unset and the working directory outside the repository.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from wheel_build import REPO, clean_clone_wheel  # noqa: E402

pytestmark = pytest.mark.slow

# One sampler trial, no baseline or confirmation, no prediction (quick: ~20 s on 2 cores).
ONE_TRIAL = ["model=mlp", "device=cpu", "budget=256MiB", "search.objective=throughput", "search.n_trials=1",
             "search.baseline=false", "search.confirm=false", "search.prune=off", "trial.soak_steps=0"]


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    wheel = clean_clone_wheel()
    root = tmp_path_factory.mktemp("venv")
    env_dir = root / "env"
    # --without-pip: the system's pip (visible through --system-site-packages) installs into the
    # environment it runs in; Debian's python3 needs no python3-venv package for this
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(env_dir)],
                   check=True, capture_output=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PATH"] = f"{env_dir / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    install = subprocess.run([str(env_dir / "bin" / "python"), "-m", "pip", "install", "--no-deps",
                              "--force-reinstall", "--disable-pip-version-check", "-q", str(wheel)],
                             capture_output=True, text=True, env=env, cwd=root)
    assert install.returncode == 0, install.stderr[-3000:]
    outside = root / "elsewhere"
    outside.mkdir()
    return env_dir, env, outside


def _run(venv, *argv, timeout=600):
    env_dir, env, cwd = venv
    return subprocess.run(list(argv), capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)


def test_oomtune_is_imported_from_the_environments_site_packages(venv):
    env_dir, _, cwd = venv
    out = _run(venv, str(env_dir / "bin" / "python"), "-c",
               "import oomtune, oomtune.commands, oomtune.search, sysconfig; "
               "print(oomtune.__file__); print(sysconfig.get_paths()['purelib'])")
    assert out.returncode == 0, out.stderr
    where, purelib = (Path(line) for line in out.stdout.split())
    assert where.is_relative_to(purelib) and where.is_relative_to(env_dir), (where, purelib)
    assert not where.is_relative_to(REPO) and not cwd.is_relative_to(REPO)
    assert Path(sysconfig.get_paths()["purelib"]) != purelib  # not this interpreter's (editable) one


def test_help_and_search_help_run_from_the_installed_script(venv):
    env_dir, _, _ = venv
    script = env_dir / "bin" / "oomtune"
    assert script.is_file()
    top = _run(venv, str(script), "--help")
    assert top.returncode == 0, top.stderr
    assert "search" in top.stdout and "report" in top.stdout
    search = _run(venv, str(script), "search", "--help")
    assert search.returncode == 0, search.stderr
    assert "Hydra" in search.stdout and "overrides" in search.stdout


def test_a_one_trial_search_runs_from_the_installed_package(venv):
    env_dir, _, cwd = venv
    run_dir = cwd / "run"
    out = _run(venv, str(env_dir / "bin" / "oomtune"), "search", *ONE_TRIAL, f"hydra.run.dir={run_dir}")
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    from oomtune.best import load_best

    best = load_best(run_dir / "best.yaml")
    assert best.best.trial_number == 0 and best.study["trials"] == 1
    assert best.best.metrics["memory_source"] == "simulated"
    assert (run_dir / "report.html").is_file()
    (trial_dir,) = (run_dir / "trials").glob("trial-*")
    assert (trial_dir / "result.json").is_file()
