"""Build script for the optional compiled replay core (everything else is in pyproject.toml).

``oomtune.alloc._fastcore`` (oomtune/alloc/_fastcore.pyx + _fastcore.hpp, C++) makes the virtual
GPU's ``replay_stream`` several times faster. It is optional: when Cython or a C++ compiler is
missing, or the compile fails, the install goes on without it and oomtune uses the pure-Python
simulator (the same results; see oomtune/alloc/_compiled.py). Set OOMTUNE_NO_EXTENSION=1 to skip it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py


class BuildPyWithConf(build_py):
    """``build_py`` that installs the Hydra configs (conf/ at the repository root) as oomtune/conf.

    Copied rather than mapped as a package so that editable installs stay a plain path entry (the
    source tree's conf/ is found there: oomtune.config.conf_dir)."""

    def run(self) -> None:
        super().run()
        if not getattr(self, "editable_mode", False):
            self.copy_tree("conf", str(Path(self.build_lib) / "oomtune" / "conf"))


class OptionalBuildExt(build_ext):
    """``build_ext`` that warns instead of failing: the extension is an accelerator, not a need."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - any compiler/toolchain failure
            print(f"warning: oomtune's compiled replay core was not built ({exc}); "
                  "the pure-Python simulator will be used", file=sys.stderr)

    def build_extension(self, ext) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001
            print(f"warning: {ext.name} was not built ({exc}); the pure-Python simulator will be used",
                  file=sys.stderr)


def _extensions() -> list:
    if os.environ.get("OOMTUNE_NO_EXTENSION") == "1":
        return []
    try:
        from Cython.Build import cythonize
    except ImportError:
        print("warning: Cython is not installed: oomtune's compiled replay core is not built",
              file=sys.stderr)
        return []
    from setuptools import Extension

    ext = Extension("oomtune.alloc._fastcore", ["oomtune/alloc/_fastcore.pyx"], language="c++",
                    include_dirs=["oomtune/alloc"], extra_compile_args=["-O2", "-std=c++14"],
                    depends=["oomtune/alloc/_fastcore.hpp", "oomtune/alloc/_fasttrace.pxi"],
                    optional=True)
    try:
        return cythonize([ext], language_level=3, quiet=True)
    except Exception as exc:  # noqa: BLE001 - a Cython error must not break the install
        print(f"warning: cythonize failed ({exc}): the compiled replay core is not built", file=sys.stderr)
        return []


setup(
    packages=find_packages(include=["oomtune", "oomtune.*"]),
    # {"": "."}: an editable install is then a plain .pth entry for the repository root (as with
    # hatchling before), not an import hook that a stray oomtune/ directory on sys.path would shadow
    package_dir={"": "."},
    ext_modules=_extensions(),
    cmdclass={"build_ext": OptionalBuildExt, "build_py": BuildPyWithConf},
)
