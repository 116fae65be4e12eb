"""oomtune: out-of-memory auto-tuning for PyTorch training.

Public face (imports are lazy so that ``import oomtune`` in a training script stays cheap and never
initialises CUDA):

- :func:`load_best` / :func:`apply_best`: read a tuned best.yaml; set its allocator settings in the
  environment before CUDA initialises.
- :func:`report`: from a user's training script run by ``target=cmd``, report throughput;
  :func:`launched`: whether oomtune launched this process (a trial); :func:`trial_settings`: what the
  trial asks (micro-batch, accumulation, ...). The frameworks' one-line integrations are in
  :mod:`oomtune.integrations`.
- :class:`AllocatorSettings`, :class:`CachingAllocatorSim`: the allocator model (virtual GPU).
- :func:`predict` -> :class:`Prediction`: one configuration's memory on a named GPU (peak allocated,
  reserved, outside the allocator, what nvidia-smi would show), as ``oomtune plan`` predicts it.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.2.0"

_LAZY = {
    "load_best": "oomtune.best",
    "apply_best": "oomtune.best",
    "BestConfig": "oomtune.best",
    "report": "oomtune.script_api",
    "capture_hook": "oomtune.script_api",
    "launched": "oomtune.script_api",
    "trial_settings": "oomtune.script_api",
    "AllocatorSettings": "oomtune.alloc.settings",
    "CachingAllocatorSim": "oomtune.alloc.sim",
    "predict": "oomtune.predict_api",
    "Prediction": "oomtune.predict_api",
}

__all__ = ["__version__", *sorted(_LAZY)]

# The composition root: importing the targets registers them with the trial protocol's contract
# (oomtune.trial._base.register_target), so the trial layer never imports a target. Light: no torch.
from oomtune import targets as _targets  # noqa: E402,F401


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'oomtune' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
