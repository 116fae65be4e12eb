"""The allocator model: PyTorch's CUDA caching-allocator settings and its simulator (virtual GPU).

Lowest layer of oomtune: imports only :mod:`oomtune.exceptions` and :mod:`oomtune.units`.

- :class:`AllocatorSettings`, :func:`validate_alloc_conf`, :func:`supported_keys`,
  :func:`effective_settings` (settings.py): PYTORCH_CUDA_ALLOC_CONF strings.
- Lazily (imported on first use, listed in ``__all__`` once their module exists):
  :class:`CachingAllocatorSim` (sim.py), :class:`SimulatedOutOfMemoryError` and
  :func:`build_oom_message` (oom_message.py), :class:`AllocationStream` and :func:`replay_stream`
  (stream.py), :func:`make_simulator` (_compiled.py: the compiled simulator when built, else
  ``CachingAllocatorSim``).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from oomtune.alloc.settings import AllocatorSettings, effective_settings, supported_keys, validate_alloc_conf

_LAZY = {
    "CachingAllocatorSim": "oomtune.alloc.sim",
    "SimulatedOutOfMemoryError": "oomtune.alloc.oom_message",
    "build_oom_message": "oomtune.alloc.oom_message",
    "AllocationStream": "oomtune.alloc.stream",
    "replay_stream": "oomtune.alloc.stream",
    "make_simulator": "oomtune.alloc._compiled",
}

__all__ = [
    "AllocatorSettings", "effective_settings", "supported_keys", "validate_alloc_conf",
    *sorted(name for name, mod in _LAZY.items() if importlib.util.find_spec(mod) is not None),
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'oomtune.alloc' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
