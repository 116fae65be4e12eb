"""``PYTORCH_NO_CUDA_MEMORY_CACHING``: the environment variable that turns the caching allocator off.

torch's ``forceUncachedAllocator()`` (c10/cuda/CUDACachingAllocator.cpp) tests only whether the
variable exists (``getenv(...) != nullptr``), so any value, ``0`` included, sends every allocation
straight to cudaMalloc/cudaFree (pytorch/pytorch#145661; torch's Python side reads the value, the
allocator does not). Under it every PYTORCH_CUDA_ALLOC_CONF setting is a no-op and a trial's memory
says nothing about the caching allocator, so:

- ``oomtune search`` and ``oomtune check --mode run`` refuse to start (one line, exit 2) rather than
  clear it silently: the user's environment is theirs, and a tuned result must hold in it;
- every trial environment is checked again (a ``target.cmd`` or ``env`` mapping may set it);
- ``oomtune env`` and :func:`oomtune.apply_best` warn: the exported settings would do nothing.

The same commands refuse an invalid ``PYTORCH_CUDA_ALLOC_CONF`` or ``PYTORCH_ALLOC_CONF`` left in the
user's shell (:func:`check_alloc_env`) before torch is imported: the parent imports
torch with the user's environment, and a malformed string makes ``import torch`` abort with a C++
stack trace (exit 134; pytorch#186453) or makes the first allocation raise. Trials get their own
strings; the user's are never passed on.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from oomtune.exceptions import ConfigError

__all__ = ["NO_CACHING_ENV", "ALLOC_CONF_ENV", "caching_disabled_reason", "check_caching_enabled", "check_alloc_env"]

NO_CACHING_ENV = "PYTORCH_NO_CUDA_MEMORY_CACHING"
#: The variables torch reads its allocator settings from (which one first differs by version).
ALLOC_CONF_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def caching_disabled_reason(environ: Mapping[str, str] | None = None) -> str | None:
    """One line saying why the caching allocator is off in ``environ`` (default: ``os.environ``),
    or None when ``PYTORCH_NO_CUDA_MEMORY_CACHING`` is absent. Never raises."""
    env = os.environ if environ is None else environ
    if NO_CACHING_ENV not in env:
        return None
    return (f"{NO_CACHING_ENV}={env[NO_CACHING_ENV]!r} is set: torch turns its caching allocator off "
            f"whenever this variable exists, whatever its value (pytorch#145661), so every allocator "
            f"setting is a no-op; run `unset {NO_CACHING_ENV}` first")


def check_caching_enabled(environ: Mapping[str, str] | None = None, *, where: str = "the environment") -> None:
    """Refuse an environment in which the caching allocator is off (see the module docstring).

    Args:
        environ: the environment to check (default: ``os.environ``).
        where: whose environment, for the message (``"the trial environment"``).

    Raises:
        ConfigError: ``PYTORCH_NO_CUDA_MEMORY_CACHING`` is set in ``environ`` (any value).
    """
    reason = caching_disabled_reason(environ)
    if reason is not None:
        raise ConfigError(f"{reason} (found in {where})")


def check_alloc_env(environ: Mapping[str, str] | None = None) -> None:
    """Refuse an invalid allocator string in ``environ`` (default ``os.environ``) under either name of
    :data:`ALLOC_CONF_ENV`, checked with torch's grammar and rules
    (:meth:`oomtune.alloc.settings.AllocatorSettings.parse`) without importing torch.

    Raises:
        ConfigError: one line naming the variable, the problem and how to fix it.
    """
    from oomtune.alloc.settings import AllocatorSettings
    from oomtune.exceptions import AllocatorConfigError

    env = os.environ if environ is None else environ
    for name in ALLOC_CONF_ENV:
        value = env.get(name)
        if not value:
            continue
        try:
            AllocatorSettings.parse(value)
        except AllocatorConfigError as exc:
            raise ConfigError(f"{name}={value!r} in your environment is invalid ({exc}); torch would fail on it "
                              f"when imported: fix it or run `unset {name}` (oomtune sets each trial's own)") from None
