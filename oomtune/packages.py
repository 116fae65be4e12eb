"""Installed package versions, read from package metadata without importing the package.

``import torch`` costs seconds; its version (``"2.14.1+cu130"``) is in the installed distribution's
metadata (``importlib.metadata``, PEP 566), which also never touches CUDA. A leaf module: it imports
nothing from oomtune, so the lowest layer (``oomtune.alloc``) may use it.
"""

from __future__ import annotations

__all__ = ["installed_version"]


def installed_version(name: str) -> str | None:
    """The installed version of distribution ``name`` (e.g. ``"torch"``), or None when it is not
    installed. A few ms per call (a scan of the distributions on ``sys.path``); not cached, so a
    caller that asks often keeps the answer."""
    from importlib import metadata  # imported here: ~30 ms that most commands do not need

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
