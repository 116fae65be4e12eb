"""A regular (wheel) install holds all of oomtune: every package directory (without
``__init__.py``, ``find_packages`` left oomtune/search and oomtune/commands out of the wheel and every
command failed with ModuleNotFoundError), the Hydra configs (conf/ installed as oomtune/conf: the
config must be reachable from an installed package) and, with Cython and a compiler present, the
compiled replay core (setup.py). The wheel is built from a clean clone (tests/wheel_build.py);
tests/test_wheel_install.py installs it and runs the commands."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from wheel_build import REPO, clean_clone_wheel, package_dirs  # noqa: E402


def test_every_directory_with_python_files_is_a_regular_package():
    dirs = package_dirs(REPO)
    assert "oomtune/search" in dirs and "oomtune/commands" in dirs   # the two once left out of the wheel
    missing = [d for d in dirs if not (REPO / d / "__init__.py").is_file()]
    assert missing == [], f"add an __init__.py to {missing}: find_packages leaves them out of the wheel"


@pytest.mark.slow
def test_wheel_holds_every_package_and_conf_and_an_installed_copy_composes(tmp_path):
    wheel = clean_clone_wheel()
    names = set(zipfile.ZipFile(wheel).namelist())
    for d in package_dirs(REPO):
        assert f"{d}/__init__.py" in names, f"{d} is not in the wheel"
        for module in (REPO / d).glob("*.py"):
            assert f"{d}/{module.name}" in names, f"{d}/{module.name} is not in the wheel"
    for conf in ("config.yaml", "model/resnet.yaml", "search/default.yaml", "target/cmd.yaml"):
        assert f"oomtune/conf/{conf}" in names
    try:
        import Cython  # noqa: F401
    except ImportError:
        pass
    else:
        assert any(n.startswith("oomtune/alloc/_fastcore") and n.endswith(".so") for n in names), names
    target = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(target)
    code = ("from oomtune.config import conf_dir, compose; print(conf_dir()); "
            "print(compose(['model=mlp']).model.name); import oomtune.commands.search, oomtune.search.run")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=tmp_path, env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"})
    where, model = out.stdout.split()
    assert Path(where) == target / "oomtune" / "conf" and model == "mlp"
