"""An installed (non-editable) oomtune finds its Hydra configs: conf/ is installed in the wheel as
oomtune/conf (style notes: the config must be reachable from an installed package); with Cython and a
compiler present, the wheel carries the compiled replay core too (setup.py)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def test_wheel_carries_conf_and_an_installed_copy_composes(tmp_path):
    pytest.importorskip("setuptools")
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path / "dist")], check=True, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("oomtune-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
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
            "print(compose(['model=mlp']).model.name)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=tmp_path, env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"})
    where, model = out.stdout.split()
    assert Path(where) == target / "oomtune" / "conf" and model == "mlp"
