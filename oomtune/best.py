"""best.yaml: the tuned configuration that training scripts and CI checks read.

Schema (version 1)::

    schema_version: 1
    created: ISO-8601 time
    workload: {model: {...}, target: {...}, ranks: N (several ranks per trial, or model.parallel)}
    device: {kind, name, total_memory_bytes, budget_bytes, memory_source: device|simulated, uuid, pci_bus_id,
             target_gpu, memory_fraction, cublas_workspace_config}
    versions: {oomtune, torch, cuda, driver, optuna}
    best: {batch_size, alloc_conf, settings: {...}, metrics: {...}, confirmed, predicted_peak_reserved_bytes,
           predicted_steps, predicted_at_worst_shape, trial_number, metrics_trial_number, memory_fraction, grad_accum, global_batch, activation_checkpointing}
    baseline: {batch_size, alloc_conf, metrics, trial_number, metrics_trial_number} | null
    gain: {objective, throughput_ratio | batch_size_ratio, claimed, from, ...} | null
    study: {storage, study_name, trials, outcomes: {ok: n, oom: n, ...}, launches_saved}
    diagnosis: {input_bound, reason, advice} | null
    objective: {name: batch|throughput, reason, at_top_of_range}
    frontiers: [{alloc_conf, predicted_max_batch, measured_max_batch, measured_fail_batch,
                 calibration, probed, twins}]

``batch_size`` is the micro-batch (samples per forward and backward on one rank); ``grad_accum`` the
micro-batches per optimizer step (1 unless ``search.global_batch`` was set; ``global_batch`` is then
that global batch) and ``activation_checkpointing`` true/false when the search varied it (null
otherwise). ``workload.training`` repeats ``grad_accum`` and ``activation_checkpointing`` for the
checks that re-run or re-trace the workload (``oomtune check``).

Sizes are bytes. ``alloc_conf`` is the exact string for PYTORCH_CUDA_ALLOC_CONF. Trial numbers are
the study's (``oomtune show``): ``trial_number`` is the trial that won the ranking (its batch size and
settings), ``metrics_trial_number`` the trial whose measurement ``metrics`` holds: the clean-process
confirmation when ``confirmed``, else the same trial. Files written before ``metrics_trial_number``
existed read as None there (their metrics are the confirmation's when ``confirmed``).

``memory_fraction``: the per-process memory fraction the answer needs, of
``device.total_memory_bytes`` (the trials' fraction: the budget over the device, corrected on a GPU for
the memory outside the allocator), or None when it needs none. Only ``garbage_collection_threshold``
needs one: torch runs ``garbage_collect_cached_blocks`` only under a fraction < 1
(c10/cuda/CUDACachingAllocator.cpp), so without it the threshold is inert and the batch found with it
may not fit. :func:`apply_best` applies it; ``device.memory_fraction`` records the search's
``search.memory_fraction`` (``auto``: trials ran under the fraction; ``off``: without one).

``device.cublas_workspace_config``: ``CUBLAS_WORKSPACE_CONFIG`` as the search's trials had it (null:
unset, torch's default). It sizes the cuBLAS workspaces every CUDA step takes from the caching
allocator (torch's ``parseChosenWorkspaceSize``; :mod:`oomtune.capture.blas_workspace`), so what fits
depends on it: :func:`apply_best` and ``oomtune env`` set it when recorded, and warn when it is set
where the answer was tuned without it; ``oomtune check`` predicts and runs under the recorded value.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from oomtune.exceptions import BestFileError, OomtuneError
from oomtune.workload_spec import JsonObject, WorkloadSpec

__all__ = ["SCHEMA_VERSION", "BestConfig", "Choice", "load_best", "apply_best", "write_best",
           "CudaAlreadyInitializedError", "RankCountError", "check_world_size", "trials_text",
           "needs_memory_fraction", "fraction_key_supported", "conf_with_fraction", "FRACTION_KEY", "check_workload",
           "BEST_MAX_BYTES", "virtual_fraction_note"]

SCHEMA_VERSION = 1
#: The largest best.yaml read (bytes): the search writes a few KiB (its frontiers list included).
BEST_MAX_BYTES = 2**20
ENV_KEYS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
#: the variable that sizes the cuBLAS workspaces (aten/src/ATen/cuda/CublasHandlePool.cpp)
WORKSPACE_ENV = "CUBLAS_WORKSPACE_CONFIG"
#: The allocator key that sets the per-process memory fraction at allocator start (pytorch#161035;
#: ``CUDAAllocatorConfig::parsePerProcessMemoryFraction``, applied in the ``DeviceCachingAllocator``
#: constructor: ``setMemoryFraction(CUDAAllocatorConfig::per_process_memory_fraction())``).
FRACTION_KEY = "per_process_memory_fraction"


def needs_memory_fraction(alloc_conf: str) -> bool:
    """Whether an allocator configuration relies on a memory fraction < 1 to behave as it did in the
    trials: ``garbage_collection_threshold`` > 0, which torch applies only when a fraction is set
    (``garbage_collect_cached_blocks`` is reached only with ``allowed_memory_maximum`` set, i.e. a
    fraction < 1; c10/cuda/CUDACachingAllocator.cpp, torch 2.14.1). False for an unparsable string."""
    from oomtune.alloc.settings import AllocatorSettings

    try:
        return AllocatorSettings.parse(alloc_conf or "").garbage_collection_threshold > 0
    except OomtuneError:
        return False


def fraction_key_supported(torch_version: str | None = None) -> bool:
    """Whether torch ``torch_version`` (default: the installed one, read from its package metadata
    without importing it) accepts :data:`FRACTION_KEY` in PYTORCH_CUDA_ALLOC_CONF
    (:func:`oomtune.alloc.settings.supported_keys`; torch 2.14.1 does)."""
    from oomtune.alloc.settings import supported_keys

    return FRACTION_KEY in supported_keys(torch_version)


def conf_with_fraction(alloc_conf: str, fraction: float | None) -> str:
    """``alloc_conf`` with ``per_process_memory_fraction:F`` appended (``F`` as Python's shortest
    round-trip repr, which torch's ``std::stod`` reads back exactly); ``alloc_conf`` itself when
    ``fraction`` is None."""
    if fraction is None:
        return alloc_conf
    part = f"{FRACTION_KEY}:{float(fraction)!r}"
    return f"{alloc_conf},{part}" if alloc_conf else part


class CudaAlreadyInitializedError(OomtuneError):
    """:func:`apply_best` was called after CUDA initialised: the allocator has read its settings."""


class RankCountError(OomtuneError):
    """:func:`apply_best` runs in a world of another size than best.yaml was tuned for: the batch and
    settings hold per rank at the tuned rank count only (FSDP shards by it)."""


def check_world_size(config: "BestConfig", env: Any) -> None:
    """When best.yaml records ``workload.ranks`` and this process was started by a launcher that sets
    ``WORLD_SIZE`` (torchrun, accelerate, deepspeed), the two must agree.

    Raises:
        RankCountError: they differ.
    """
    ranks = config.workload_spec.ranks if config.workload is not None else None
    world = str(env.get("WORLD_SIZE", "") or "")
    if isinstance(ranks, int) and world.isdigit() and int(world) != ranks:
        raise RankCountError(f"best.yaml was tuned for {ranks} rank(s) (trial.gpus={ranks}) but this process runs "
                             f"in a world of {world} (WORLD_SIZE): search again with trial.gpus={world}")


@dataclass
class Choice:
    """One measured configuration: a batch size under allocator settings, and what it measured.

    ``metrics`` holds throughput (samples/s), step_time_s, peak_allocated_bytes, peak_reserved_bytes,
    fragmentation, device_peak_bytes and memory_source ("device" | "simulated"). ``trial_number``:
    the study's trial that was chosen; ``metrics_trial_number``: the trial that measured ``metrics``
    (its clean-process confirmation when ``confirmed``; None in files from before it was recorded)."""

    batch_size: int
    alloc_conf: str
    settings: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    confirmed: bool = False
    predicted_peak_reserved_bytes: int | None = None
    trial_number: int | None = None
    metrics_trial_number: int | None = None
    predicted_steps: int | None = None   # training steps that prediction replayed (None: 2, before 0.3)
    # the prediction is of the shape distribution's largest shape (what the search's frontier judged
    # fits by); False: of the workload as recorded (fixed shapes, or a file from before it was recorded)
    predicted_at_worst_shape: bool = False
    memory_fraction: float | None = None  # the fraction this answer needs (garbage_collection_threshold)
    grad_accum: int = 1                  # micro-batches per optimizer step (search.global_batch)
    global_batch: int | None = None      # samples per optimizer step over all ranks, when fixed
    activation_checkpointing: bool | None = None   # when the search varied it
    # a target whose steps oomtune cannot capture (target=cmd, HF, Lightning): the allocation stream
    # the prediction replayed (recorded by a trial, or derived from the recordings), a file beside
    # best.yaml in AllocationStream.save's format, and its SHA-256; `check --mode predict` replays it
    predicted_stream: str | None = None
    predicted_stream_sha256: str | None = None

    def trials_text(self) -> str | None:
        """Which trials this choice comes from, in words (:func:`trials_text`)."""
        return trials_text(dataclasses.asdict(self))


def trials_text(choice: dict[str, Any]) -> str | None:
    """Which trials a best.yaml choice (the ``best`` or ``baseline`` mapping) comes from, for people:
    ``"trial 1, figures from trial 5 (its clean-process confirmation)"``, ``"trial 0"`` (figures
    from the trial itself), ``"trial 1, figures from its clean-process confirmation"`` (a file from
    before ``metrics_trial_number``); None when no trial is named (a hand-written file)."""
    chosen, measured = choice.get("trial_number"), choice.get("metrics_trial_number")
    confirmed = bool(choice.get("confirmed"))
    if chosen is None:
        return None if measured is None else f"figures from trial {measured}"
    if measured is None:
        return f"trial {chosen}" + (", figures from its clean-process confirmation" if confirmed else "")
    if measured == chosen:
        return f"trial {chosen}"
    return f"trial {chosen}, figures from trial {measured}" + (" (its clean-process confirmation)" if confirmed else "")


@dataclass
class BestConfig:
    """A parsed best.yaml (see the module docstring for the schema)."""

    schema_version: int
    workload: JsonObject   # best.yaml's workload section as written (WorkloadSpec.best_record); typed: workload_spec
    device: dict[str, Any]
    best: Choice
    versions: dict[str, Any] = field(default_factory=dict)
    baseline: Choice | None = None
    gain: dict[str, Any] | None = None
    study: dict[str, Any] = field(default_factory=dict)
    diagnosis: dict[str, Any] | None = None
    created: str | None = None
    objective: dict[str, Any] | None = None        # {name: batch|throughput, reason}: what decided
    frontiers: list[dict[str, Any]] | None = None  # per configuration: predicted and measured frontier
    #: set by :func:`apply_best`: the memory fraction travels in PYTORCH_CUDA_ALLOC_CONF
    memory_fraction_applied: ClassVar[bool] = False

    @property
    def alloc_conf(self) -> str:
        return self.best.alloc_conf

    @property
    def batch_size(self) -> int:
        """The micro-batch: samples per forward and backward on one rank."""
        return self.best.batch_size

    @property
    def grad_accum(self) -> int:
        """Micro-batches per optimizer step (1 unless the search kept a global batch)."""
        return self.best.grad_accum

    @property
    def activation_checkpointing(self) -> bool | None:
        """Activation checkpointing of the answer (None: the search did not vary it)."""
        return self.best.activation_checkpointing

    @property
    def workload_spec(self) -> WorkloadSpec:
        """The workload this answer was tuned for, typed: :meth:`WorkloadSpec.from_best` of the
        ``workload`` section and ``device.target_gpu`` (the one validator of the section,
        :func:`oomtune.workload_spec.check_record`, runs first). A new spec each call.

        Raises:
            BestFileError: a malformed or unknown key of the section, one line naming it.
        """
        device = self.device if isinstance(self.device, dict) else {}
        return WorkloadSpec.from_best(self.workload, device.get("target_gpu"))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def cublas_workspace_config(self) -> str | None:
        """``CUBLAS_WORKSPACE_CONFIG`` as the search's trials had it (``device.cublas_workspace_config``),
        or None: unset (torch's default workspaces), or a file from before it was recorded."""
        value = self.device.get("cublas_workspace_config") if isinstance(self.device, dict) else None
        return value or None

    def workspace_mismatch(self, env: Any = None) -> str | None:
        """One line when ``env`` (default ``os.environ``) sets ``CUBLAS_WORKSPACE_CONFIG`` though the
        answer was tuned with torch's default workspaces (the value sizes them, so what fits changes);
        None otherwise (unset, or the answer records a value: :func:`apply_best` sets that one)."""
        env = os.environ if env is None else env
        here = env.get(WORKSPACE_ENV)
        if self.cublas_workspace_config is not None or not here:
            return None
        return (f"{WORKSPACE_ENV}={here} is set, but this answer was tuned with torch's default cuBLAS "
                f"workspaces, whose size changes what fits: unset it, or tune with it set")

    @property
    def memory_fraction(self) -> float | None:
        """The per-process memory fraction the answer needs (``best.memory_fraction``), or None."""
        return self.best.memory_fraction

    def env_value(self, *, fraction_key: bool | None = None) -> str:
        """The PYTORCH_CUDA_ALLOC_CONF value that applies the answer: ``best.alloc_conf``, plus
        ``per_process_memory_fraction:F`` when the answer needs a fraction and ``fraction_key``
        (default: :func:`fraction_key_supported` for the installed torch)."""
        if fraction_key is None:
            fraction_key = fraction_key_supported()
        return conf_with_fraction(self.best.alloc_conf, self.memory_fraction if fraction_key else None)

    def export_line(self, *, fraction_key: bool | None = None) -> str:
        """The shell line that applies the allocator settings (both variable names, field notes §1)
        and, where torch accepts it, the memory fraction the answer needs (:meth:`env_value`)."""
        import shlex

        value = shlex.quote(self.env_value(fraction_key=fraction_key))
        workspaces = ("" if self.cublas_workspace_config is None
                      else f" {WORKSPACE_ENV}={shlex.quote(self.cublas_workspace_config)}")
        return "export " + " ".join(f"{key}={value}" for key in ENV_KEYS) + workspaces

    def fraction_advice(self) -> str | None:
        """What to do when the fraction cannot travel in the environment (a torch without
        :data:`FRACTION_KEY`): call ``torch.cuda.set_per_process_memory_fraction(F)`` before the first
        CUDA allocation. None when the answer needs no fraction."""
        if self.memory_fraction is None:
            return None
        total = self.device.get("total_memory_bytes")
        of = "" if not isinstance(total, int) else f" of the {_gib(total)} device best.yaml was tuned for"
        return (f"this answer needs a per-process memory fraction of {self.memory_fraction!r}{of} "
                f"({self.best.alloc_conf}: garbage_collection_threshold acts only under a fraction < 1): call "
                f"torch.cuda.set_per_process_memory_fraction({self.memory_fraction!r}) before the first CUDA "
                "allocation")


def virtual_fraction_note(config: BestConfig) -> str | None:
    """One line when best.yaml's memory fraction was computed on the virtual GPU's size (the search
    ran without a real device: ``device.memory_source`` ``simulated``, its ``total_memory_bytes`` the
    ``virtual_device_memory``, 80 GiB unless set), not a measured GPU's: the same fraction of a GPU of
    another size is another budget (``0.025`` of 80 GiB is 2 GiB, of 24 GiB 0.6 GiB). None when the
    answer needs no fraction or the fraction is of a real device (``memory_source: device``)."""
    if config.memory_fraction is None:
        return None
    device = config.device or {}
    if device.get("memory_source") != "simulated" and device.get("kind") == "cuda":
        return None
    total = device.get("total_memory_bytes")
    size = _gib(total) if isinstance(total, int) and not isinstance(total, bool) and total > 0 else "assumed"
    return (f"{FRACTION_KEY}:{config.memory_fraction!r} is a fraction of the virtual GPU's {size} "
            "(virtual_device_memory; simulated, not a real device's memory): on a GPU of another size it allows "
            "another budget; search again with virtual_device_memory set to your GPU's memory, or on the GPU")


def write_best(config: BestConfig, path: str | Path) -> Path:
    """Write best.yaml atomically (temp file + rename: :func:`oomtune.files.write_atomic`). Returns
    the path.

    Raises:
        DiskFullError: no space left (the temporary file removed, an existing best.yaml intact).
    """
    import yaml

    from oomtune.files import write_atomic

    return write_atomic(path, yaml.safe_dump(config.to_dict(), sort_keys=False))


def _choice(data: Any, where: str) -> Choice:
    if not isinstance(data, dict):
        raise BestFileError(f"{where} must be a mapping")
    try:
        choice = Choice(**data)
    except TypeError as exc:
        raise BestFileError(f"{where}: {exc}") from None
    if not isinstance(choice.batch_size, int) or isinstance(choice.batch_size, bool) or choice.batch_size < 1:
        raise BestFileError(f"{where}.batch_size must be a positive integer, got {choice.batch_size!r}")
    if not isinstance(choice.alloc_conf, str):
        raise BestFileError(f"{where}.alloc_conf must be a string, got {choice.alloc_conf!r}")
    steps = choice.predicted_steps
    if steps is not None and (not isinstance(steps, int) or isinstance(steps, bool) or steps < 1):
        raise BestFileError(f"{where}.predicted_steps must be a positive integer or absent, got {steps!r}")
    if not isinstance(choice.predicted_at_worst_shape, bool):
        raise BestFileError(f"{where}.predicted_at_worst_shape must be true or false, got "
                            f"{choice.predicted_at_worst_shape!r}")
    for name in ("predicted_stream", "predicted_stream_sha256"):
        if getattr(choice, name) is not None and not isinstance(getattr(choice, name), str):
            raise BestFileError(f"{where}.{name} must be a string or absent, got {getattr(choice, name)!r}")
    accum = choice.grad_accum
    if not isinstance(accum, int) or isinstance(accum, bool) or accum < 1:
        raise BestFileError(f"{where}.grad_accum must be a positive integer, got {accum!r}")
    ckpt = choice.activation_checkpointing
    if ckpt is not None and not isinstance(ckpt, bool):
        raise BestFileError(f"{where}.activation_checkpointing must be true, false or null, got {ckpt!r}")
    return choice


def _missing_best(path: Path) -> str:
    """The one line for a best.yaml (or run directory) that does not exist: what was asked for, and
    the run directories beside it that hold a best.yaml (the closest name first, then the newest;
    at most five), or where ``oomtune search`` writes one when there are none."""
    import difflib

    asked = path.parent if path.name == "best.yaml" else path
    where = asked.parent
    runs = sorted((d for d in (where.iterdir() if where.is_dir() else ()) if (d / "best.yaml").is_file()),
                  key=lambda d: -d.stat().st_mtime)
    close = difflib.get_close_matches(asked.name, [d.name for d in runs], n=1)
    names = close + [d.name for d in runs if d.name not in close]
    if names:
        more = f" and {len(names) - 5} more" if len(names) > 5 else ""
        hint = f"runs with a best.yaml in {str(where)!r}: {', '.join(names[:5])}{more}"
    else:
        hint = "`oomtune search` writes runs/NAME/best.yaml (its last lines name the file)"
    return f"cannot read {str(path)!r}: no such run directory or best.yaml; {hint}"


def load_best(path: str | Path) -> BestConfig:
    """Read and validate a best.yaml written by ``oomtune search``.

    Also accepts a run directory (reads ``<dir>/best.yaml``).

    Raises:
        BestFileError: the file is missing, larger than :data:`BEST_MAX_BYTES`, nested more than
            :data:`oomtune.safeload.MAX_DEPTH` levels, not YAML, not a mapping, of another schema
            version, missing a required section, its ``workload`` section malformed (read as
            :attr:`BestConfig.workload_spec` is: :meth:`oomtune.workload_spec.WorkloadSpec.from_best`,
            whose validator is :func:`check_workload`'s), its ``alloc_conf`` is not a valid allocator string, or it
            contradicts its ``settings`` mapping (the keys that differ are named).
    """
    from oomtune.safeload import read_yaml

    path = Path(path)
    if path.is_dir():
        path = path / "best.yaml"
    if not path.exists():
        raise BestFileError(_missing_best(path))
    # size and depth limited: a file nested 100,000 levels deep is one line, not a RecursionError
    data = read_yaml(path, what="a best.yaml", max_bytes=BEST_MAX_BYTES, error=BestFileError)
    if not isinstance(data, dict):
        raise BestFileError(f"{path} is not a best.yaml: expected a mapping at the top level")
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise BestFileError(f"{path}: unsupported schema_version {version!r} (this oomtune reads {SCHEMA_VERSION})")
    for key in ("workload", "device", "best"):
        if key not in data:
            raise BestFileError(f"{path}: missing required section '{key}'")
    for key in ("workload", "device", "study", "versions", "gain", "diagnosis"):
        if key in data and data[key] is not None and not isinstance(data[key], dict):
            raise BestFileError(f"{path}: section '{key}' must be a mapping")
    for key in ("workload", "device"):
        if data[key] is None:
            raise BestFileError(f"{path}: section '{key}' must be a mapping")
    if data.get("study") is None:
        data["study"] = {}
    fraction = (data["best"] or {}).get("memory_fraction") if isinstance(data["best"], dict) else None
    if fraction is not None and (isinstance(fraction, bool) or not isinstance(fraction, (int, float))
                                 or not 0 < fraction < 1):
        raise BestFileError(f"{path}: best.memory_fraction must be a number in (0, 1) or null, got {fraction!r}")
    workspaces = data["device"].get("cublas_workspace_config")
    if workspaces is not None and not isinstance(workspaces, str):
        raise BestFileError(f"{path}: device.cublas_workspace_config must be a CUBLAS_WORKSPACE_CONFIG string "
                            f"(e.g. ':4096:8') or null, got {workspaces!r}")
    known = {f.name for f in dataclasses.fields(BestConfig)}
    data = {k: v for k, v in data.items() if k in known}
    data["best"] = _choice(data["best"], f"{path}: best")
    if data.get("baseline") is not None:
        data["baseline"] = _choice(data["baseline"], f"{path}: baseline")
    config = BestConfig(**data)
    # the section read once as the typed spec (check_record, the one validator, runs first)
    WorkloadSpec.from_best(config.workload, data["device"].get("target_gpu"), where=f"{path}: workload")
    for where, choice in (("best", config.best), ("baseline", config.baseline)):
        if choice is not None:
            _check_agreement(path, where, choice)
    return config


def check_workload(workload: Any, *, where: str = "best.yaml workload") -> None:
    """The one validator of best.yaml's ``workload`` section
    (:func:`oomtune.workload_spec.check_record`), shared by :func:`load_best` (so :func:`apply_best`,
    ``oomtune env`` and ``oomtune show``) and ``oomtune check``
    (:meth:`oomtune.workload_spec.WorkloadSpec.from_best`).

    Raises:
        BestFileError: the first malformed or unknown key, in one line naming it and the value.
    """
    from oomtune.workload_spec import check_record

    check_record(workload, where=where)


def _check_agreement(path: Path, where: str, choice: Choice) -> None:
    """``alloc_conf`` must be a valid string and say what ``settings`` says (a
    hand-edited best.yaml whose two forms disagree would apply one and report the other). An empty
    ``settings`` mapping is not compared (hand-written files may give only the string).

    Raises:
        BestFileError: an invalid string or mapping, or the keys that differ with both values.
    """
    from oomtune.alloc.settings import AllocatorSettings

    try:
        conf = AllocatorSettings.parse(choice.alloc_conf)
    except OomtuneError as exc:
        raise BestFileError(f"{path}: {where}.alloc_conf is invalid: {exc}") from None
    if not choice.settings:
        return
    if not isinstance(choice.settings, dict):
        raise BestFileError(f"{path}: {where}.settings must be a mapping, got {choice.settings!r}")
    try:
        mapped = AllocatorSettings.from_mapping(choice.settings)
    except OomtuneError as exc:
        raise BestFileError(f"{path}: {where}.settings is invalid: {exc}") from None
    diff = conf.differences(mapped)
    if diff:
        said = "; ".join(f"{k}: {a!r} in alloc_conf, {b!r} in settings" for k, (a, b) in sorted(diff.items()))
        raise BestFileError(f"{path}: {where}.alloc_conf {choice.alloc_conf!r} contradicts {where}.settings ({said}); "
                            f"edit both to say the same (alloc_conf is what gets exported)")


def apply_best(path: str | Path, *, environ: dict[str, str] | None = None) -> BestConfig:
    """Set PYTORCH_CUDA_ALLOC_CONF and PYTORCH_ALLOC_CONF from a best.yaml, before CUDA initialises
    (and ``CUBLAS_WORKSPACE_CONFIG`` where best.yaml records one: it sizes the cuBLAS workspaces the
    answer was tuned with).

    Call it at the top of a training script, before any CUDA use. The caching allocator reads its
    settings when CUDA initialises (``backend`` already when torch loads), so a later change would be
    silently ignored; this function refuses instead.

    When the answer needs a per-process memory fraction (``best.memory_fraction``: its
    ``garbage_collection_threshold`` acts only under one), the fraction travels in the same variables as
    ``per_process_memory_fraction:F`` where the installed torch accepts that key
    (:func:`fraction_key_supported`, pytorch#161035); otherwise ``config.memory_fraction_applied`` is
    False and the caller must call ``torch.cuda.set_per_process_memory_fraction(config.memory_fraction)``
    before the first CUDA allocation (a ``UserWarning`` says so).

    Warns (``UserWarning``) when PYTORCH_NO_CUDA_MEMORY_CACHING is set (any value): torch then runs
    without its caching allocator and these settings have no effect (pytorch#145661); and when
    ``CUBLAS_WORKSPACE_CONFIG`` is set though the answer was tuned without it
    (:meth:`BestConfig.workspace_mismatch`).

    Returns:
        The loaded :class:`BestConfig`: ``.batch_size`` (the micro-batch), ``.grad_accum``
        (micro-batches per optimizer step) and ``.activation_checkpointing`` are what to train with;
        ``.memory_fraction`` and ``.memory_fraction_applied``: whether the environment carries it.

    Raises:
        CudaAlreadyInitializedError: ``torch.cuda.is_initialized()`` is already true, or torch was
            imported with a different ``backend`` than best.yaml asks for.
        RankCountError: best.yaml was tuned for another number of ranks than ``WORLD_SIZE`` says this
            process runs in (:func:`check_world_size`).
        BestFileError: as :func:`load_best`.
    """
    config = load_best(path)
    env = os.environ if environ is None else environ
    check_world_size(config, env)
    torch = sys.modules.get("torch")
    if torch is not None and environ is None:
        if torch.cuda.is_initialized():
            raise CudaAlreadyInitializedError(
                "apply_best() must run before CUDA initialises: the caching allocator has already "
                "read its settings (call it at the top of the script, before any .cuda()/.to('cuda'))"
            )
        wanted = "cudaMallocAsync" if "backend:cudaMallocAsync" in config.best.alloc_conf else "native"
        current = env.get("PYTORCH_CUDA_ALLOC_CONF", "") or env.get("PYTORCH_ALLOC_CONF", "")
        have = "cudaMallocAsync" if "backend:cudaMallocAsync" in current else "native"
        if wanted != have:
            raise CudaAlreadyInitializedError(
                f"best.yaml sets backend:{wanted}, but torch was imported with backend:{have}; torch "
                "reads the backend at import, so call apply_best() before `import torch`"
            )
    supported = fraction_key_supported()
    value = config.env_value(fraction_key=supported)
    for key in ENV_KEYS:
        env[key] = value
    config.memory_fraction_applied = config.memory_fraction is not None and supported
    import warnings

    if config.cublas_workspace_config is not None:   # read at the first cuBLAS handle, after CUDA initialises
        env[WORKSPACE_ENV] = config.cublas_workspace_config
    mismatch = config.workspace_mismatch(env)
    if mismatch is not None:
        warnings.warn(f"apply_best(): {mismatch}", UserWarning, stacklevel=2)

    if config.memory_fraction is not None and not supported:
        warnings.warn(f"apply_best(): {config.fraction_advice()} (the installed torch does not accept "
                      f"{FRACTION_KEY} in PYTORCH_CUDA_ALLOC_CONF)", UserWarning, stacklevel=2)
    other_size = _other_device_size(config) if config.memory_fraction is not None else None
    if other_size is not None:
        warnings.warn(f"apply_best(): {other_size}", UserWarning, stacklevel=2)
    from oomtune.alloc.caching_env import caching_disabled_reason

    reason = caching_disabled_reason(env)
    if reason is not None:  # the settings just exported would do nothing
        warnings.warn(f"apply_best(): {reason}", UserWarning, stacklevel=2)
    return config


def _gib(nbytes: int) -> str:
    from oomtune.units import format_bytes

    return format_bytes(nbytes)


def _other_device_size(config: BestConfig, tolerance: float = 0.05) -> str | None:
    """A line when the GPU NVML sees first (no CUDA context) differs in size by more than
    ``tolerance`` from the device best.yaml's fraction is of (e.g. the virtual GPU's
    ``virtual_device_memory``): the fraction then allows another budget. None when the sizes agree,
    or nothing can be read (no NVML, no GPU)."""
    total = config.device.get("total_memory_bytes")
    if not isinstance(total, int) or total <= 0 or config.memory_fraction is None:
        return None
    try:
        from oomtune.gpu import nvml

        if not nvml.nvml_available():
            return None
        ident = nvml.device_identity(nvml.physical_index_for(0))
    except Exception:  # noqa: BLE001 - a warning's probe must never fail apply_best
        return None
    here = getattr(ident, "total_memory_bytes", None)
    if not here or abs(here - total) <= tolerance * total:
        return None
    return (f"best.yaml's memory fraction {config.memory_fraction!r} is of a {_gib(total)} device "
            f"({config.device.get('name') or 'the tuned device'}); this GPU has {_gib(here)}, where it allows "
            f"{_gib(int(config.memory_fraction * here))} instead of {_gib(int(config.memory_fraction * total))}: "
            "search again with virtual_device_memory set to this GPU's memory (or on this GPU)")
