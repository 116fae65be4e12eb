"""Where oomtune's ``conf/`` directory is (Hydra's config groups and the device catalogue's
``conf/devices/``). A module of its own, below every layer that reads conf/: the device catalogue
(:mod:`oomtune.gpu.catalogue`, low in the import graph) needs the directory but not the Hydra
composition of :mod:`oomtune.config`, which re-exports :func:`conf_dir`."""

from __future__ import annotations

from pathlib import Path

from oomtune.exceptions import ConfigError

__all__ = ["conf_dir"]


def conf_dir() -> Path:
    """The directory holding config.yaml: ``oomtune/conf`` in an installed wheel (force-included at
    build time), else the repository's top-level ``conf/`` (editable installs and checkouts).

    Raises:
        ConfigError: neither exists (a broken installation).
    """
    here = Path(__file__).resolve().parent
    for candidate in (here / "conf", here.parent / "conf"):
        if (candidate / "config.yaml").is_file():
            return candidate
    raise ConfigError(f"oomtune's conf/ directory was not found next to {here}; reinstall oomtune")
