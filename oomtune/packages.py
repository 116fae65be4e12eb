"""Installed package versions, read from package metadata without importing the package.

``import torch`` costs seconds; its version (``"2.14.1+cu130"``) is in the installed distribution's
metadata (``importlib.metadata``, PEP 566), which also never touches CUDA. A leaf module: it imports
nothing from oomtune, so the lowest layer (``oomtune.alloc``) may use it.
"""

from __future__ import annotations

__all__ = ["installed_version", "torch_build"]


def installed_version(name: str) -> str | None:
    """The installed version of distribution ``name`` (e.g. ``"torch"``), or None when it is not
    installed. A few ms per call (a scan of the distributions on ``sys.path``); not cached, so a
    caller that asks often keeps the answer."""
    from importlib import metadata  # imported here: ~30 ms that most commands do not need

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def torch_build() -> tuple[str | None, str | None]:
    """(torch's ``__version__``, the CUDA version it was built with: ``torch.version.cuda``, None for a
    CPU build), without importing torch when it is not imported yet: the values are the two string
    constants of the installed ``torch/version.py`` (written by torch's build, ``tools/generate_torch_version.py``),
    read with :mod:`ast`; the package's ``__init__`` never runs. (None, None) when torch is not installed.

    Raises:
        nothing: a ``version.py`` that cannot be read or parsed gives the metadata's version and None.
    """
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "version"):
        return str(torch.__version__), getattr(torch.version, "cuda", None)
    import ast
    import importlib.util
    from pathlib import Path

    try:
        spec = importlib.util.find_spec("torch")   # a top-level package: found, not imported
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return installed_version("torch"), None
    found: dict[str, str | None] = {}
    try:
        tree = ast.parse((Path(list(spec.submodule_search_locations)[0]) / "version.py").read_text())
        for node in tree.body:
            target = (node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1
                      else node.target if isinstance(node, ast.AnnAssign) else None)
            if isinstance(target, ast.Name) and target.id in ("__version__", "cuda") and node.value is not None:
                value = ast.literal_eval(node.value)
                found[target.id] = value if isinstance(value, str) or value is None else str(value)
    except (OSError, SyntaxError, ValueError):
        return installed_version("torch"), None
    return found.get("__version__") or installed_version("torch"), found.get("cuda")
