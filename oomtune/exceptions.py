"""oomtune's exceptions: one root, one subclass per meaning (after optuna/exceptions.py).

Every :class:`OomtuneError` is a problem with the user's input or environment; the CLI prints it
as one line (``oomtune: error: <message>``) and exits with code 2.
"""

from __future__ import annotations

__all__ = [
    "OomtuneError",
    "ConfigError",
    "AllocatorConfigError",
    "SnapshotError",
    "StudyNotFoundError",
    "BestFileError",
    "DeviceError",
    "ResumableError",
    "StorageUnavailableError",
    "DiskFullError",
    "WorkerJobsFailed",
    "Interrupted",
    "HostMemoryRefused",
    "UserCodeError",
]


class OomtuneError(Exception):
    """Root of oomtune's user-facing errors (exit code 2 on the command line)."""


class ConfigError(OomtuneError, ValueError):
    """A bad configuration value: an override, a size string, a search space, a model name."""


class AllocatorConfigError(ConfigError):
    """A malformed or torch-incompatible allocator settings string (PYTORCH_CUDA_ALLOC_CONF).

    The message names the key, the value and the allowed range, following torch's own checks in
    c10/cuda/CUDAAllocatorConfig.cpp and c10/core/AllocatorConfig.cpp.
    """


class SnapshotError(OomtuneError):
    """A memory snapshot file that is truncated, not a snapshot, or holds objects other than plain
    containers, strings and numbers (refused without executing anything)."""


class StudyNotFoundError(OomtuneError):
    """An Optuna study name that does not exist in the given storage."""


class BestFileError(OomtuneError):
    """A best.yaml (or plan.yaml) that is missing, corrupt or of an unknown schema version."""


class DeviceError(OomtuneError):
    """A device that does not exist, or a memory budget above what the device has."""


class ResumableError(Exception):
    """A run stopped by a fault of its surroundings, not of its input: the storage stayed
    unreachable, the disk filled. Everything finished is kept; the CLI prints one line ending in
    "run the same command to resume" and exits with code 1 (not an :class:`OomtuneError`: the input
    was fine)."""


class StorageUnavailableError(ResumableError):
    """The study's storage stayed unreachable through every retry (about 2 minutes:
    :data:`oomtune.study.reconnect.STORAGE_RETRY_S`)."""


class DiskFullError(ResumableError):
    """A file of the run could not be written: no space left on the device (``ENOSPC``) or the
    user's quota is exhausted (``EDQUOT``); also SQLite's "database or disk is full". Its
    temporary file has been removed (:func:`oomtune.files.write_atomic`)."""


class WorkerJobsFailed(ResumableError):
    """Every worker job of ``launcher=local|slurm`` ended without an answer (killed, out of time,
    stopped by the storage): the study keeps what they finished, and the same command resumes it."""


class Interrupted(KeyboardInterrupt):
    """The run was stopped by a signal: Ctrl-C (SIGINT) or a termination request (SIGTERM).

    A KeyboardInterrupt, so every ``except KeyboardInterrupt`` clean-up runs; ``signum`` gives the
    CLI its exit status, ``128 + signum`` as a shell reports a process killed by that signal (130
    for SIGINT, 143 for SIGTERM).
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class HostMemoryRefused(OomtuneError):
    """A capture that must run on the CPU (an op without a meta kernel, a data-dependent branch)
    would hold more tensors in host memory than is available: refused before the host runs out."""


class UserCodeError(OomtuneError):
    """The user's code (a ``target=python`` entry, its step function or data generator) failed while
    oomtune ran it to predict memory: it raised, ran past ``trial.timeout``, exited or was killed.
    It ran in a process of its own (:func:`oomtune.plan.parallel.fork_each`); the message is one line
    naming the entry, the batch size, and the file:line and exception or the exit status."""
