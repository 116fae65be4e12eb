"""Built-in training workloads (resnet, transformer, mlp), their data sources and the step loop.

Models are built from code with random weights; nothing is downloaded. See
:func:`build_workload` for the configuration keys. The names below are imported when first used, so
that the torch-free modules of this package (:mod:`oomtune.workloads.keys`,
:mod:`oomtune.workloads.shapes`) can be imported without torch.
"""

from __future__ import annotations

from typing import Any

_LAZY = {
    "StepTimings": "oomtune.workloads.loop",
    "Workload": "oomtune.workloads.loop",
    "build_capture_workload": "oomtune.workloads.loop",
    "build_workload": "oomtune.workloads.loop",
    "validate_workload_config": "oomtune.workloads.loop",
    "DecoderLM": "oomtune.workloads.models",
    "MODEL_NAMES": "oomtune.workloads.keys",
}

__all__ = ["MODEL_NAMES", "DecoderLM", "StepTimings", "Workload", "build_capture_workload",
           "build_workload", "validate_workload_config"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'oomtune.workloads' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
