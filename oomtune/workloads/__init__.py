"""Built-in training workloads (resnet, transformer, mlp), their data sources and the step loop.

Models are built from code with random weights; nothing is downloaded. See
:func:`build_workload` for the configuration keys.
"""

from oomtune.workloads.loop import (
    StepTimings,
    Workload,
    build_capture_workload,
    build_workload,
    validate_workload_config,
)
from oomtune.workloads.models import MODEL_NAMES, DecoderLM

__all__ = ["MODEL_NAMES", "DecoderLM", "StepTimings", "Workload", "build_capture_workload",
           "build_workload", "validate_workload_config"]
