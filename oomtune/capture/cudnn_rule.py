"""The rule that sizes cuDNN convolution workspaces on the virtual GPU, read from the environment.

Torch-free, so that ``oomtune search`` and ``oomtune plan`` refuse a bad value before any trial or
capture (:func:`oomtune.prepared.compose_checked`); :mod:`oomtune.capture.cudnn_conv` applies it.
"""

from __future__ import annotations

import os

from oomtune.exceptions import ConfigError

__all__ = ["RULES", "ENV", "env_rule"]

#: The workspace rules: ``implicit`` (0 bytes, implicit GEMM's documented workspace: the lower bound)
#: and ``gemm`` (explicit GEMM's lowered matrix; :func:`oomtune.capture.cudnn_conv.gemm_workspace_bytes`).
RULES = ("implicit", "gemm")

#: The environment variable that overrides every architecture's rule.
ENV = "OOMTUNE_CUDNN_WORKSPACE"


def env_rule() -> str | None:
    """The rule ``OOMTUNE_CUDNN_WORKSPACE`` names, or None when it is unset or empty.

    Raises:
        ConfigError: the variable names no rule (one line naming the choices and the fix).
    """
    env = os.environ.get(ENV, "").strip()
    if not env:
        return None
    if env not in RULES:
        raise ConfigError(f"{ENV}={env!r}: expected one of {', '.join(RULES)} (or unset it for each "
                          "architecture's rule)")
    return env
