"""The trial protocol's records: what the parent asks a trial process to do (:class:`TrialSpec`) and
what the trial process reports back (:class:`TrialResult`), as JSON written to a file the parent names.

Results travel as structured data, never by parsing logs. Sizes are bytes, times seconds. A reading
that was not taken is ``None`` (JSON null), never 0.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from oomtune.gpu.info import DeviceInfo  # noqa: F401 - re-exported: the trial records it
from oomtune.outcome import Outcome
from oomtune.workload_spec import WorkloadSpec

__all__ = ["TrialSpec", "TrialResult", "ResultDraft", "MemoryReadings", "Throughput", "SoakReadings", "RankPeak",
           "DeviceInfo", "TrialProcess", "ProcessSeen", "BadFork", "ExecutionInfo", "KernelsRan", "KernelCount",
           "GpuKernelsTarget", "BudgetReadings", "AllocatorSeen", "EnvVar", "DistributedInfo", "ScriptReports",
           "StoppedOverLimit", "OomDetails", "RetriedAfter",
           "MEMORY_SOURCE_DEVICE", "MEMORY_SOURCE_SIMULATED", "PROGRESS_FILE", "write_progress", "read_progress",
           "read_progress_record", "EXECUTE_MODES"]

#: ``TrialSpec.execute`` values (resolved: :mod:`oomtune.trial.execute`).
EXECUTE_MODES = ("cpu", "meta")

#: ``MemoryReadings.source`` for figures read from the real CUDA device.
MEMORY_SOURCE_DEVICE = "device"
#: ``MemoryReadings.source`` for figures from the virtual GPU (:class:`CachingAllocatorSim`).
MEMORY_SOURCE_SIMULATED = "simulated"


@dataclass
class TrialSpec:
    """One trial: a workload at a batch size under one allocator configuration.

    Attributes:
        workload: what the trial trains (:class:`oomtune.workload_spec.WorkloadSpec`). A flat
            mapping (the form spec.json carries: the ``model`` group's keys, e.g. ``{"name":
            "resnet", "depth": 18, ...}``, plus ``target``, ``gpu``, ``ranks`` and the training
            settings) is read with :meth:`WorkloadSpec.from_dict` on construction, so the field
            always holds a spec.
        batch_size: samples per step (>= 1).
        alloc_conf: the allocator settings string exactly as exported to PYTORCH_CUDA_ALLOC_CONF
            (``""`` for torch's defaults).
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        budget_bytes: device memory the run must fit in. On CUDA it is applied with
            ``torch.cuda.set_per_process_memory_fraction``, corrected for non-allocator memory
            (field case C9); on CPU it is a memory fraction of the virtual GPU's capacity.
        device_memory_bytes: on CPU, the virtual GPU's capacity (``virtual_device_memory``); None:
            the budget is the capacity (records written before it existed). Unused on CUDA.
        warmup_steps / measure_steps: steps run before timing / steps timed (with device sync).
        timeout_s: wall limit for the whole trial process (the runner kills its process group).
        seed: torch's manual seed for the workload.
        smaller_batch_succeeded: a smaller batch already ran in the same setup; passed to the
            classifier (a batch-dependent failure after a success is a limit, not a setup fault;
            field case C1).
        soak_steps: after the live steps pass, soak the candidate for this many steps of the
            workload's shape sequence on the virtual GPU (:mod:`oomtune.trial.soak`; built-in
            workloads; 0: no soak). Running out of memory in the soak makes the trial infeasible.
        shapes: the live steps' shapes: ``data`` (the shape distribution's seeded order) or
            ``worst`` (every live step at the distribution's largest shape; the soak still follows
            the data order): a confirmation meets the worst case.
        limit_bytes: the search's memory limit (budget x (1 - headroom)), bytes. After each step,
            once the memory used so far (peak reserved, plus the non-allocator memory on CUDA: a
            lower bound of what :func:`oomtune.study.records.used_bytes` reports) exceeds it,
            the trial stops: its peak can only grow, so it is above the limit whatever the
            remaining steps do (``TrialResult.stopped_over_limit`` names the step; no
            soak). None: every step runs.
        execute: on the virtual GPU (``device="cpu"``), where the steps run: ``cpu`` (for real;
            throughput measured) or ``meta`` (shapes only, no host memory per tensor, no throughput;
            :mod:`oomtune.trial.execute`). Ignored on CUDA.
        memory_fraction: apply the budget as a per-process memory fraction (``search.memory_fraction
            =auto``, the default). False (``off``: the user will not cap memory): no fraction is set;
            on the virtual GPU the device is then the budget's size, so the budget still bounds what
            the allocator can reserve, but ``garbage_collection_threshold`` (fraction-only) is inert,
            as on the user's device.
        measure_seconds: measured steps continue past ``measure_steps`` until they have taken at
            least this many seconds (a time window: the throughput objective's confirmation runs,
            so that short steps are timed over as long a window as long ones); 0: exactly
            ``measure_steps``.
        ranks: processes the trial runs, one per GPU (``trial.gpus``; on the CPU one per virtual
            GPU), each with ``budget_bytes`` as its own budget (its memory fraction); ``device`` then
            names that many GPUs (``cuda:0,1``). A distributed workload (``model.parallel``) runs
            its ranks even when this is 1 (:mod:`oomtune.trial.ranks`); the trial's record merges
            theirs (:mod:`oomtune.trial.rank_records`).
    """

    workload: WorkloadSpec
    batch_size: int
    alloc_conf: str = ""
    device: str = "cpu"
    budget_bytes: int | None = None
    warmup_steps: int = 1
    measure_steps: int = 3
    timeout_s: float = 300.0
    seed: int = 0
    smaller_batch_succeeded: bool = False
    device_memory_bytes: int | None = None
    soak_steps: int = 0
    shapes: str = "data"
    limit_bytes: int | None = None
    execute: str = "cpu"
    memory_fraction: bool = True
    measure_seconds: float = 0.0
    ranks: int = 1

    def __post_init__(self) -> None:
        """Reads a flat workload mapping into its :class:`WorkloadSpec`.

        Raises:
            ConfigError: (a ValueError) a workload that is neither a spec nor a flat mapping
                :meth:`WorkloadSpec.from_dict` reads, one line naming the bad key.
        """
        if not isinstance(self.workload, WorkloadSpec):
            self.workload = WorkloadSpec.from_dict(self.workload)

    def to_json(self) -> str:
        """The spec as JSON (spec.json): every field as is, the workload in its flat form
        (:meth:`WorkloadSpec.to_dict`), which :meth:`from_json` reads back to an equal spec."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["workload"] = self.workload.to_dict()
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "TrialSpec":
        """The spec that :meth:`to_json` wrote, checked field by field as it is read (the trial
        process reads it from ``spec.json``, a file anything could have changed).

        Raises:
            ValueError: not a JSON object, a missing ``workload``/``batch_size``, a key that is no
                field, a field of the wrong type (bool is not a number; an int is a float), or a
                workload :meth:`WorkloadSpec.from_dict` refuses, named.
        """
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError(f"a trial spec is a JSON object, got {type(data).__name__}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise ValueError(f"trial spec: unknown field(s) {', '.join(unknown)}")
        for name in ("workload", "batch_size"):
            if name not in data:
                raise ValueError(f"trial spec: missing field {name}")
        for name, value in data.items():
            kinds = _SPEC_TYPES[name]
            if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
                expected = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
                raise ValueError(f"trial spec: {name}={value!r}: expected {expected}")
        try:
            data["workload"] = WorkloadSpec.from_dict(data["workload"])
        except ValueError as exc:   # ConfigError: the workload's bad key, named
            raise ValueError(f"trial spec: workload: {exc}") from None
        return cls(**data)


#: The JSON types each :class:`TrialSpec` field may be read as (:meth:`TrialSpec.from_json`).
_SPEC_TYPES: dict[str, tuple[type, ...]] = {
    "workload": (dict,), "batch_size": (int,), "alloc_conf": (str,), "device": (str,),
    "budget_bytes": (int, type(None)), "warmup_steps": (int,), "measure_steps": (int,),
    "timeout_s": (int, float), "seed": (int,), "smaller_batch_succeeded": (bool,),
    "device_memory_bytes": (int, type(None)), "soak_steps": (int,), "shapes": (str,),
    "limit_bytes": (int, type(None)), "execute": (str,), "memory_fraction": (bool,),
    "measure_seconds": (int, float), "ranks": (int,),
}


def _check_bytes(section: str, name: str, value: Any) -> None:
    """A byte count: None, or a non-negative int (bool is not a count)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"{section}.{name} must be a non-negative int number of bytes or None, got {value!r}")


def _check_count(section: str, name: str, value: Any, *, minimum: int = 0) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < minimum):
        raise ValueError(f"{section}.{name} must be an int >= {minimum} or None, got {value!r}")


def _check_range(section: str, name: str, value: Any, low: float, high: float | None) -> None:
    """None, or a real number in [low, high] (high None: no upper bound; NaN is refused)."""
    if value is None:
        return
    ok = (not isinstance(value, bool) and isinstance(value, (int, float)) and value >= low
          and (high is None or value <= high))
    if not ok:
        bound = f"[{low:g}, {high:g}]" if high is not None else f">= {low:g}"
        raise ValueError(f"{section}.{name} must be a number {bound} or None, got {value!r}")


@dataclass(frozen=True, slots=True)
class MemoryReadings:
    """The device memory a trial used, bytes. Frozen: change it with :func:`dataclasses.replace`
    (which validates again). A reading that was not taken is None.

    Attributes:
        source: :data:`MEMORY_SOURCE_DEVICE` (real CUDA readings) or :data:`MEMORY_SOURCE_SIMULATED`
            (the virtual GPU); every printed memory figure carries it.
        peak_allocated_bytes / peak_reserved_bytes / peak_active_bytes: ``allocated_bytes.all.peak``,
            ``reserved_bytes.all.peak``, ``active_bytes.all.peak`` of ``torch.cuda.memory_stats()``
            (or the virtual GPU's same keys).
        fragmentation: ``1 - peak_active / peak_reserved`` (GMLake's definition), in [0, 1].
        num_alloc_retries / num_ooms: ``num_alloc_retries`` / ``num_ooms`` of ``memory_stats()``
            (counts; summed over ranks).
        device_peak_bytes: device-level peak used memory of this process sampled through NVML
            (None without NVML or on CPU).
        non_allocator_bytes: memory outside the caching allocator (CUDA context, cuBLAS workspaces),
            from ``torch.cuda.mem_get_info`` minus ``memory_reserved`` (field case C9).
        oom_requested_bytes: for memory outcomes, the size the failed request asked for (torch's
            "Tried to allocate").

    Raises:
        ValueError: on construction, a byte count or counter that is not a non-negative int, a
            fragmentation outside [0, 1], an unknown source (one line naming the field).
    """

    source: str = MEMORY_SOURCE_SIMULATED
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    peak_active_bytes: int | None = None
    fragmentation: float | None = None
    num_alloc_retries: int | None = None
    num_ooms: int | None = None
    device_peak_bytes: int | None = None
    non_allocator_bytes: int | None = None
    oom_requested_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.source not in (MEMORY_SOURCE_DEVICE, MEMORY_SOURCE_SIMULATED):
            raise ValueError(f"memory.source must be {MEMORY_SOURCE_DEVICE!r} or {MEMORY_SOURCE_SIMULATED!r}, "
                             f"got {self.source!r}")
        for name in ("peak_allocated_bytes", "peak_reserved_bytes", "peak_active_bytes", "device_peak_bytes",
                     "non_allocator_bytes", "oom_requested_bytes"):
            _check_bytes("memory", name, getattr(self, name))
        _check_count("memory", "num_alloc_retries", self.num_alloc_retries)
        _check_count("memory", "num_ooms", self.num_ooms)
        _check_range("memory", "fragmentation", self.fragmentation, 0.0, 1.0)
        _check_types(self, "memory")

    def with_memory_stats(self, stats: dict[str, Any]) -> "MemoryReadings":
        """These readings with the peaks and counters of a ``memory_stats()`` mapping
        (``torch.cuda.memory_stats`` keys, or the virtual GPU's); absent keys become None.
        fragmentation = 1 - peak_active / peak_reserved (GMLake's definition; None when nothing was
        reserved).

        Raises:
            ValueError: a figure of ``stats`` is not a non-negative int.
        """
        reserved, active = stats.get("reserved_bytes.all.peak"), stats.get("active_bytes.all.peak")
        fragmentation = None
        if reserved and active is not None:
            fragmentation = 1.0 - active / reserved
        return dataclasses.replace(
            self, peak_allocated_bytes=stats.get("allocated_bytes.all.peak"), peak_reserved_bytes=reserved,
            peak_active_bytes=active, num_alloc_retries=stats.get("num_alloc_retries"),
            num_ooms=stats.get("num_ooms"), fragmentation=fragmentation)


@dataclass(frozen=True, slots=True)
class Throughput:
    """How fast the measured steps ran (measured for real, on the device or the CPU; all None for
    steps on the meta device, ``TrialSpec.execute`` ``meta``, and for failed trials). Frozen: change
    it with :func:`dataclasses.replace`.

    Attributes:
        samples_per_s: samples per second over the measured steps (summed over ranks training at
            once: :func:`oomtune.trial.rank_records.global_throughput`).
        step_time_s: mean wall time of a measured step, seconds (the slowest rank's).
        data_wait_fraction: time waiting for the next batch over step time, in [0, 1].
        gpu_utilization: mean NVML utilisation during the measured steps, percent in [0, 100]
            (None without NVML).
        steps: steps run (warm-up and measured).

    Raises:
        ValueError: on construction, a negative rate or time, a fraction outside [0, 1], a
            utilisation outside [0, 100], a step count that is not a non-negative int.
    """

    samples_per_s: float | None = None
    step_time_s: float | None = None
    data_wait_fraction: float | None = None
    gpu_utilization: float | None = None
    steps: int | None = None

    def __post_init__(self) -> None:
        _check_range("throughput", "samples_per_s", self.samples_per_s, 0.0, None)
        _check_range("throughput", "step_time_s", self.step_time_s, 0.0, None)
        _check_range("throughput", "data_wait_fraction", self.data_wait_fraction, 0.0, 1.0)
        _check_range("throughput", "gpu_utilization", self.gpu_utilization, 0.0, 100.0)
        _check_count("throughput", "steps", self.steps)
        _check_types(self, "throughput")


@dataclass(frozen=True, slots=True)
class SoakReadings:
    """The virtual-GPU soak after the live steps (``TrialSpec.soak_steps``;
    :func:`oomtune.trial.soak_check.run_soak`). Every figure is simulated. Frozen.

    Attributes:
        passed: the soak ran every step.
        steps_run: soak steps completed.
        failed_step: the 1-based soak step that ran out of memory (step 1 is the first live step);
            None when passed.
        shape: that step's ``seq_len`` / ``image_size`` (None when passed or shape-free).
        reserved_bytes / allocated_bytes: reserved and allocated at the failure (at the end when
            passed); their difference is the cached-but-unused memory.
        peak_reserved_bytes: peak reserved over the soak.
        message: one line on the failure (None when passed).
        seconds: the soak's wall seconds.
        distinct_shapes: the shapes captured for it (the others derived or repeated).
        fragmentation_failure: a failed soak's request fitted in reserved minus allocated (outcome
            ``oom_fragmentation``); None when passed.

    Raises:
        ValueError: on construction, a byte count or step that is not a non-negative int, a passed
            soak with a failed step, a failed soak without one, negative seconds.
    """

    passed: bool
    steps_run: int | None = None
    failed_step: int | None = None
    shape: int | None = None
    reserved_bytes: int | None = None
    allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    message: str | None = None
    seconds: float | None = None
    distinct_shapes: int | None = None
    fragmentation_failure: bool | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.passed, bool):
            raise ValueError(f"soak.passed must be True or False, got {self.passed!r}")
        _check_count("soak", "steps_run", self.steps_run)
        _check_count("soak", "failed_step", self.failed_step, minimum=1)
        for name in ("reserved_bytes", "allocated_bytes", "peak_reserved_bytes"):
            _check_bytes("soak", name, getattr(self, name))
        _check_range("soak", "seconds", self.seconds, 0.0, None)
        if self.passed and self.failed_step is not None:
            raise ValueError(f"soak.failed_step must be None when the soak passed, got {self.failed_step!r}")
        if not self.passed and self.failed_step is None:
            raise ValueError("soak.failed_step must name the step that ran out of memory when the soak failed")
        _check_count("soak", "distinct_shapes", self.distinct_shapes)
        _check_types(self, "soak")


@dataclass(frozen=True, slots=True)
class RankPeak:
    """One rank of a distributed trial (:mod:`oomtune.trial.rank_records`): its own figures, kept
    beside the trial's merged ones. Frozen.

    Attributes:
        rank: the rank (as the ranks number themselves), >= 0.
        outcome: how the rank ended; None when the rank reported figures but no outcome (the ``cmd``
            target's per-rank memory lines).
        peak_reserved_bytes / peak_allocated_bytes: the rank's ``reserved_bytes.all.peak`` /
            ``allocated_bytes.all.peak`` (``memory_stats()``).
        device_peak_bytes: the rank's NVML device peak (None without NVML).
        samples_per_s / step_time_s: the rank's own rate and mean step time (None when failed).
        message: the rank's one-line failure (None when ok).
        device_uuid: the rank's GPU (NVML UUID) when known.
        exitcode: the rank's process exit status (negative: the signal), when known.
        teardown: the rank's failure was a consequence of another rank's (a broken collective, the
            launcher's SIGTERM), never the trial's cause.

    Raises:
        ValueError: on construction, a negative rank, a byte count that is not a non-negative int, a
            negative rate or time, an unknown outcome.
    """

    rank: int
    outcome: Outcome | None = None
    peak_reserved_bytes: int | None = None
    peak_allocated_bytes: int | None = None
    device_peak_bytes: int | None = None
    samples_per_s: float | None = None
    step_time_s: float | None = None
    message: str | None = None
    device_uuid: str | None = None
    exitcode: int | None = None
    teardown: bool = False

    def __post_init__(self) -> None:
        _check_count("ranks", "rank", self.rank)
        if self.rank is None:
            raise ValueError("ranks.rank must be an int >= 0, got None")
        if self.outcome is not None:
            object.__setattr__(self, "outcome", Outcome.parse(self.outcome))
        for name in ("peak_reserved_bytes", "peak_allocated_bytes", "device_peak_bytes"):
            _check_bytes("ranks", name, getattr(self, name))
        _check_range("ranks", "samples_per_s", self.samples_per_s, 0.0, None)
        _check_range("ranks", "step_time_s", self.step_time_s, 0.0, None)
        if not isinstance(self.teardown, bool):
            raise ValueError(f"ranks.teardown must be True or False, got {self.teardown!r}")
        _check_types(self, "ranks")

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["outcome"] = None if self.outcome is None else self.outcome.value
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RankPeak":
        """From :meth:`to_dict`, or from an entry of the flat form's ``extra["ranks"]`` (samples/s
        under ``throughput``); keys that are no field are left out.

        Raises:
            ValueError: a figure out of range (:class:`RankPeak`'s checks).
            TypeError / KeyError: ``data`` has no ``rank``.
        """
        data = dict(data)
        if "throughput" in data:
            data["samples_per_s"] = data.pop("throughput")
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


# ---------------------------------------------------------------------------------------------------
# What one producer records beyond the figures (formerly the free ``extra`` mapping), in typed,
# frozen sections. Every field's type is checked on construction (:func:`_check_types`).
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ProcessSeen:
    """A process found running after a trial ended (``ps``-style: pid and command line).

    Raises:
        ValueError: a pid that is not an int, a command that is not a string (one line naming the field).
    """

    pid: int
    command: str | None = None
    state: str | None = None

    def __post_init__(self) -> None:
        _check_types(self, "process")

    def describe(self) -> str:
        """``pid 12 (sleep 99)``."""
        return f"pid {self.pid} ({self.command})"


@dataclass(frozen=True, slots=True)
class BadFork:
    """A trial forked from the fork server that met torch's "Cannot re-initialize CUDA in forked
    subprocess" and was spawned again (:mod:`oomtune.trial.runner`): the forked process's pid and
    its one-line message.

    Raises:
        ValueError: a field of the wrong type.
    """

    pid: int | None = None
    message: str | None = None

    def __post_init__(self) -> None:
        _check_types(self, "process.bad_fork")


@dataclass(frozen=True, slots=True)
class TrialProcess:
    """The trial's process and how it was launched (:mod:`oomtune.trial.runner`,
    :mod:`oomtune.trial.child`, :mod:`oomtune.targets.cmd`).

    Attributes:
        pid: the trial process (for ``target=cmd``: its keeper, the process group id).
        returncode: its exit status (negative: the signal), as the runner saw it.
        launcher: ``fork`` (the fork server), ``spawn``, ``cmd`` (a target=cmd command, spawned) or
            ``cmd-fork`` (its ``python FILE.py`` forked from a script server, :mod:`oomtune.trial.script_fork`).
        launcher_fallback: why the fork server was not used (None: it was, or was not asked for).
        bad_fork: the forked attempt that failed before the trial was spawned again.
        torch_threads: ``torch.set_num_threads`` applied (``OOMTUNE_TORCH_THREADS``); None: torch's default.
        command: the ``target=cmd`` command as run (argv; a shell command is one element).
        first_step_at: ``time.time()`` when the first step began (epoch seconds; None: none began).
        launch_to_first_step_s: seconds from the launch to the first step (the runner's clock).
        hung_after_record: the trial wrote its record, then did not exit (ended by the runner).
        leftover_processes: processes of the trial found by the sweep after it ended, and killed.
        survivors: processes of the trial still running after every kill (pid and command).

    Raises:
        ValueError: a field of the wrong type, a negative time (one line naming the field).
    """

    pid: int | None = None
    returncode: int | None = None
    launcher: str | None = None
    launcher_fallback: str | None = None
    bad_fork: BadFork | None = None
    torch_threads: int | None = None
    command: tuple[str, ...] | None = None
    first_step_at: float | None = None
    launch_to_first_step_s: float | None = None
    hung_after_record: bool = False
    leftover_processes: tuple[ProcessSeen, ...] = ()
    survivors: tuple[ProcessSeen, ...] = ()

    def __post_init__(self) -> None:
        _check_count("process", "torch_threads", self.torch_threads, minimum=1)
        _check_types(self, "process")


@dataclass(frozen=True, slots=True)
class GpuKernelsTarget:
    """The target GPU whose kernels a virtual-GPU trial ran (``model.gpu``;
    :meth:`oomtune.capture.gpu_target.GpuTarget.to_dict`)."""

    name: str | None = None
    compute_capability: str | None = None
    sm_count: int | None = None
    key: str | None = None
    source: str | None = None

    def __post_init__(self) -> None:
        _check_types(self, "execution.kernels.gpu")


@dataclass(frozen=True, slots=True)
class KernelCount:
    """How many times one kernel family ran (e.g. the SDPA backend ``flash``, 4 times)."""

    name: str
    count: int

    def __post_init__(self) -> None:
        _check_count("execution.kernels", "count", self.count)
        _check_types(self, "execution.kernels")


@dataclass(frozen=True, slots=True)
class KernelsRan:
    """What a virtual-GPU trial ran in place of the CPU/meta kernels
    (:class:`oomtune.capture.cuda_kernels.KernelNotes`).

    Attributes:
        gpu: the target GPU.
        sdpa: ``scaled_dot_product_attention`` backends chosen as on that GPU, with their counts.
        optimizers: optimizer implementations as for CUDA parameters (``adam: foreach``).
        autocast: ``torch.autocast`` regions on cpu/meta run under CUDA's policy (``cpu bfloat16``).
    """

    gpu: GpuKernelsTarget = field(default_factory=GpuKernelsTarget)
    sdpa: tuple[KernelCount, ...] = ()
    optimizers: tuple[str, ...] = ()
    autocast: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _check_types(self, "execution.kernels")

    @classmethod
    def from_notes(cls, notes: Any) -> "KernelsRan":
        """From a :class:`~oomtune.capture.cuda_kernels.KernelNotes` (its ``to_dict()``)."""
        data = notes.to_dict()
        return cls(gpu=GpuKernelsTarget(**data["gpu"]),
                   sdpa=tuple(KernelCount(str(k), int(v)) for k, v in sorted(data["sdpa"].items())),
                   optimizers=tuple(data["optimizers"]), autocast=tuple(data["autocast"]))


@dataclass(frozen=True, slots=True)
class ExecutionInfo:
    """Where a virtual-GPU trial's steps ran (``TrialSpec.execute``; :mod:`oomtune.trial.execute`).

    Attributes:
        where: ``cpu`` (computed for real) or ``meta`` (shapes only); None on CUDA.
        fallback: why steps asked to run on meta ran on the CPU (an operator without a meta kernel,
            or the command's ``meta_unsupported`` line); None: they ran where asked.
        note: a ``target=cmd`` integration's reason for running CPU steps when meta was asked.
        meta_step_s: mean wall seconds of a measured meta step (no throughput: nothing was computed).
        kernels: the target GPU's kernels the steps ran (None on CUDA or before the steps).

    Raises:
        ValueError: a field of the wrong type, a negative time.
    """

    where: str | None = None
    fallback: str | None = None
    note: str | None = None
    meta_step_s: float | None = None
    kernels: KernelsRan | None = None

    def __post_init__(self) -> None:
        if self.where is not None and self.where not in EXECUTE_MODES:
            raise ValueError(f"execution.where must be one of {', '.join(EXECUTE_MODES)} or None, got {self.where!r}")
        _check_range("execution", "meta_step_s", self.meta_step_s, 0.0, None)
        _check_types(self, "execution")


@dataclass(frozen=True, slots=True)
class BudgetReadings:
    """How the budget was applied and the readings it was corrected by (:mod:`oomtune.trial.budget`).

    Attributes:
        memory_fraction: the per-process memory fraction applied (``set_per_process_memory_fraction``
            on CUDA: the budget corrected for non-allocator memory; the virtual GPU's on CPU), in (0, 1];
            None: no fraction was set.
        non_allocator_bytes_at_start / non_allocator_bytes_after_warmup: device memory outside the
            caching allocator before the steps and after the warm-up steps (real device, bytes).
        device_peak_source: how the NVML device peak was read (:class:`oomtune.gpu.nvml.MemorySampler`).
        nvml_match: how NVML's device was matched to torch's (``uuid`` / ``pci_bus_id``).
        device_peaks: the NVML device peak of each GPU of a ``target=cmd`` trial, in rank order (bytes;
            None where not read).

    Raises:
        ValueError: a fraction outside (0, 1], a byte count that is not a non-negative int.
    """

    memory_fraction: float | None = None
    non_allocator_bytes_at_start: int | None = None
    non_allocator_bytes_after_warmup: int | None = None
    device_peak_source: str | None = None
    nvml_match: str | None = None
    device_peaks: tuple[int | None, ...] = ()

    def __post_init__(self) -> None:
        _check_range("budget", "memory_fraction", self.memory_fraction, 0.0, 1.0)
        if self.memory_fraction == 0:
            raise ValueError("budget.memory_fraction must be a number in (0, 1] or None, got 0")
        _check_bytes("budget", "non_allocator_bytes_at_start", self.non_allocator_bytes_at_start)
        _check_bytes("budget", "non_allocator_bytes_after_warmup", self.non_allocator_bytes_after_warmup)
        for peak in self.device_peaks:
            _check_bytes("budget", "device_peaks", peak)
        _check_types(self, "budget")


@dataclass(frozen=True, slots=True)
class EnvVar:
    """One environment variable as the trial process saw it (None: unset)."""

    name: str
    value: str | None = None

    def __post_init__(self) -> None:
        _check_types(self, "allocator.environment")


@dataclass(frozen=True, slots=True)
class AllocatorSeen:
    """The allocator settings as the trial process saw them (verification, step 2 of
    :mod:`oomtune.trial.child`).

    Attributes:
        torch_alloc_conf: the string torch's allocator config parsed
            (``torch._C._accelerator_getAllocatorSettings``); None: not read (older torch).
        environment: the allocator/device variables as the process had them (the test hook
            ``echo_env`` only).

    Raises:
        ValueError: a field of the wrong type.
    """

    torch_alloc_conf: str | None = None
    environment: tuple[EnvVar, ...] = ()

    def __post_init__(self) -> None:
        _check_types(self, "allocator")

    def env(self, name: str) -> str | None:
        """The value of variable ``name`` as recorded (None: unset or not recorded)."""
        return next((v.value for v in self.environment if v.name == name), None)


@dataclass(frozen=True, slots=True)
class DistributedInfo:
    """A distributed trial's ranks as a whole (:mod:`oomtune.trial.ranks`,
    :mod:`oomtune.trial.rank_records`); the per-rank figures are ``TrialResult.ranks``.

    Attributes:
        rank: in one rank's own record (``result.rank<R>.json``), its rank; None in the merged record.
        world_size: processes of the trial (None: one process).
        backend: the process group's backend (``gloo``, ``nccl``, ``fake``).
        parallel: ``ddp`` / ``fsdp`` (``model.parallel``), None for none.
        memory_note / not_modelled: what the memory figures include and leave out under that backend
            (:func:`oomtune.workloads.parallel.strategy_notes`).
        rank_pids: the ranks' processes.
        rank_launcher: what started the ranks.
        launcher_lost: the ranks' launcher left no merged record.

    Raises:
        ValueError: a field of the wrong type, a negative rank or world size.
    """

    rank: int | None = None
    world_size: int | None = None
    backend: str | None = None
    parallel: str | None = None
    memory_note: str | None = None
    not_modelled: str | None = None
    rank_pids: tuple[int, ...] = ()
    rank_launcher: str | None = None
    launcher_lost: bool = False

    def __post_init__(self) -> None:
        _check_count("distributed", "rank", self.rank)
        _check_count("distributed", "world_size", self.world_size, minimum=1)
        _check_types(self, "distributed")


@dataclass(frozen=True, slots=True)
class ScriptReports:
    """What a ``target=cmd`` command reported through its channel (:mod:`oomtune.targets.cmd`).

    Attributes:
        reports: report lines read (None: not a ``target=cmd`` trial).
        reported: each report's own values (``oomtune.report(**values)``: the user's JSON, kept as
            its JSON text, keys sorted; :meth:`reported_values` reads them).
        reporting_ranks: the ranks that reported.
        rejected_readings: figures the record refused (a negative byte count, ...), one line each.
        memory_unknown: no memory reading came (no capture hook, no NVML).
        oom_caught_by_script: the command reported an OOM and exited 0.
        no_report: the command exited 0 without a report (every configuration would repeat it).
        stream_file: the step's recorded allocation stream (:mod:`oomtune.plan.recorded`).
        grad_accum: the micro-batches per step the command was given.

    Raises:
        ValueError: a field of the wrong type, a ``reported`` entry that is not a JSON object's text.
    """

    reports: int | None = None
    reported: tuple[str, ...] = ()
    reporting_ranks: tuple[int, ...] = ()
    rejected_readings: tuple[str, ...] = ()
    memory_unknown: bool = False
    oom_caught_by_script: bool = False
    no_report: bool = False
    stream_file: str | None = None
    grad_accum: int | None = None

    def __post_init__(self) -> None:
        _check_count("script", "reports", self.reports)
        _check_count("script", "grad_accum", self.grad_accum, minimum=1)
        _check_types(self, "script")
        for text in self.reported:
            try:
                ok = isinstance(json.loads(text), dict)
            except ValueError:
                ok = False
            if not ok:
                raise ValueError(f"script.reported entries must be the JSON text of an object, got {text!r}")

    def reported_values(self) -> list[dict[str, Any]]:
        """Each report's own values (``oomtune.report(**values)``), as the command gave them."""
        return [json.loads(text) for text in self.reported]

    @staticmethod
    def encode(values: dict[str, Any]) -> str:
        """One report's values as kept in :attr:`reported` (JSON, keys sorted; non-JSON values as repr)."""
        return json.dumps(values, sort_keys=True, default=repr)


@dataclass(frozen=True, slots=True)
class StoppedOverLimit:
    """A trial that stopped once the memory it used passed the search's limit
    (``TrialSpec.limit_bytes``): the step (1-based) and the reading (bytes; simulated on the
    virtual GPU, the device's on CUDA: reserved plus non-allocator memory).

    Raises:
        ValueError: a step < 1, a byte count that is not a non-negative int.
    """

    step: int
    used_bytes: int
    limit_bytes: int

    def __post_init__(self) -> None:
        _check_count("stopped_over_limit", "step", self.step, minimum=1)
        _check_bytes("stopped_over_limit", "used_bytes", self.used_bytes)
        _check_bytes("stopped_over_limit", "limit_bytes", self.limit_bytes)
        _check_types(self, "stopped_over_limit")


@dataclass(frozen=True, slots=True)
class OomDetails:
    """The numbers of the torch OOM message a trial raised (:class:`oomtune.classify.OomInfo`;
    bytes, None where the message's format does not print them)."""

    requested_bytes: int | None = None
    gpu_index: int | None = None
    total_bytes: int | None = None
    free_bytes: int | None = None
    allocated_bytes: int | None = None
    reserved_bytes: int | None = None
    allowed_bytes: int | None = None
    process_in_use_bytes: int | None = None
    source_format: str | None = None
    backend: str | None = None
    other_processes_bytes: int | None = None
    pool: str | None = None

    def __post_init__(self) -> None:
        _check_types(self, "oom")

    @classmethod
    def from_info(cls, info: Any) -> "OomDetails":
        """From an :class:`oomtune.classify.OomInfo` (its fields by name)."""
        return cls(**{f.name: getattr(info, f.name, None) for f in dataclasses.fields(cls)})


@dataclass(frozen=True, slots=True)
class RetriedAfter:
    """The first run of a trial that crashed (a signal without a record) and was run once more
    (:meth:`oomtune.search.driver.Search._launch`): the second run's record keeps the first's
    outcome, message and exit status."""

    outcome: Outcome
    message: str | None = None
    returncode: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "outcome", Outcome.parse(self.outcome))
        _check_types(self, "retried_after")


@dataclass(frozen=True, slots=True)
class TrialResult:
    """What a trial process measured (compare Optuna's ``FrozenTrial``). Written once as JSON to the
    file the parent named. Frozen: a producer changes it with :func:`dataclasses.replace` (or
    :class:`ResultDraft` while it builds one), and every constructed value is checked in
    ``__post_init__``, so a record read back holds what its fields say.

    Attributes:
        outcome: how the trial ended (:class:`oomtune.outcome.Outcome`; a string value is converted,
            an unknown one raises ValueError).
        batch_size / alloc_conf: the trial's (``TrialSpec``'s).
        memory: the memory readings (:class:`MemoryReadings`, bytes).
        throughput: the speed readings (:class:`Throughput`).
        soak: the virtual-GPU soak (:class:`SoakReadings`); None when no soak ran.
        settings_effective: the allocator settings torch reports as in effect (verification; on CUDA
            ``torch.cuda.memory._snapshot()["allocator_settings"]``'s keys, torch's own values).
        message: the one-line error message (None when ok).
        advice: what to try next, from the classifier (None when ok).
        traceback_tail: the last lines of the traceback for ``error``/``crash`` outcomes.
        wall_s: wall time of the whole trial process; startup_s: process start to first step
            (seconds, >= 0).
        device: the physical device (:class:`DeviceInfo`).
        ranks: a distributed trial's ranks, in rank order (:class:`RankPeak`; empty for one
            process). The memory section is then the worst rank's
            (:func:`oomtune.trial.rank_records.merge_memory`).
        worst_rank: the rank whose peak reserved is the trial's (None: one process).
        failed_rank: the rank whose failure is the trial's (None when ok or not known).
        process / execution / budget / allocator / distributed / script: what the producers record
            beyond the figures (:class:`TrialProcess`, :class:`ExecutionInfo`, :class:`BudgetReadings`,
            :class:`AllocatorSeen`, :class:`DistributedInfo`, :class:`ScriptReports`).
        stopped_over_limit: the step at which the trial stopped above the search's limit
            (:class:`StoppedOverLimit`); None: it ran every step.
        oom: the numbers of the OOM message (:class:`OomDetails`); None without one.
        retried_after: the crashed first run of this trial (:class:`RetriedAfter`); None: first run.

    Raises:
        ValueError: on construction, an unknown outcome, a field of the wrong type (a section
            that is not its class, a string for a number, ...), negative times, a rank number that
            is not an int >= 0 (one line naming the field); the sections check their own fields.
    """

    outcome: Outcome
    batch_size: int | None = None
    alloc_conf: str = ""
    memory: MemoryReadings = field(default_factory=MemoryReadings)
    throughput: Throughput = field(default_factory=Throughput)
    soak: SoakReadings | None = None
    settings_effective: dict[str, Any] | None = None
    message: str | None = None
    advice: str | None = None
    traceback_tail: str | None = None
    wall_s: float | None = None
    startup_s: float | None = None
    device: DeviceInfo | None = None
    ranks: tuple[RankPeak, ...] = ()
    worst_rank: int | None = None
    failed_rank: int | None = None
    process: TrialProcess = field(default_factory=TrialProcess)
    execution: ExecutionInfo = field(default_factory=ExecutionInfo)
    budget: BudgetReadings = field(default_factory=BudgetReadings)
    allocator: AllocatorSeen = field(default_factory=AllocatorSeen)
    distributed: DistributedInfo = field(default_factory=DistributedInfo)
    script: ScriptReports = field(default_factory=ScriptReports)
    stopped_over_limit: StoppedOverLimit | None = None
    oom: OomDetails | None = None
    retried_after: RetriedAfter | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "outcome", Outcome.parse(self.outcome))
        for name, kind in (("memory", MemoryReadings), ("throughput", Throughput)):
            if not isinstance(getattr(self, name), kind):
                raise ValueError(f"{name} must be a {kind.__name__}, got {type(getattr(self, name)).__name__}")
        if self.soak is not None and not isinstance(self.soak, SoakReadings):
            raise ValueError(f"soak must be a SoakReadings or None, got {type(self.soak).__name__}")
        _check_count("trial", "batch_size", self.batch_size, minimum=1)
        _check_range("trial", "wall_s", self.wall_s, 0.0, None)
        _check_range("trial", "startup_s", self.startup_s, 0.0, None)
        if not isinstance(self.ranks, tuple) or not all(isinstance(r, RankPeak) for r in self.ranks):
            raise ValueError("ranks must be a tuple of RankPeak")
        _check_count("trial", "worst_rank", self.worst_rank)
        _check_count("trial", "failed_rank", self.failed_rank)
        _check_types(self, "trial")

    def to_dict(self) -> dict[str, Any]:
        """The nested form: plain JSON types (sections as objects, tuples as lists, ``outcome`` its
        string value); :meth:`from_dict` reads it back equal."""
        return _to_json(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrialResult":
        """A record from :meth:`to_dict`'s nested form, checked key by key (a key that is no field
        is refused). Records of earlier versions are read too (records kept in Optuna storages, tell
        files and trial directories), in their documented reading (:func:`_read_old_shape`):

        - the flat form written before the sections existed (``peak_reserved_bytes``, ``throughput``
          as samples/s, ``soak_*`` at the top level);
        - the nested form with an ``extra`` mapping: each key of ``extra`` a producer wrote goes to
          its section (:data:`_OLD_EXTRA`); a key no producer wrote is dropped.

        Raises:
            ValueError: not a mapping, an unknown key (named with its section), an unknown outcome,
                a field of the wrong type or out of range (one line naming the field).
        """
        if not isinstance(data, dict):
            raise ValueError(f"a trial record is a JSON object, got {type(data).__name__}")
        flat = not isinstance(data.get("memory"), dict) and not isinstance(data.get("throughput"), dict)
        if flat or "extra" in data:
            data = _read_old_shape(_nest_flat(data) if flat else dict(data))
        if "outcome" not in data:
            raise ValueError("trial record: missing key outcome")
        return _section_from_json(cls, data, "trial record")

    def fill_memory_stats(self, stats: dict[str, Any]) -> "TrialResult":
        """This record with the memory peaks and counters of a ``memory_stats()`` mapping
        (:meth:`MemoryReadings.with_memory_stats`).

        Raises:
            ValueError: a figure of ``stats`` is not a non-negative int.
        """
        return dataclasses.replace(self, memory=self.memory.with_memory_stats(stats))

    @classmethod
    def read(cls, path: str | Path) -> "TrialResult":
        """The record at ``path`` (:meth:`from_dict`; size and depth limited by
        :func:`oomtune.safeload.read_json`).

        Raises:
            ValueError: not JSON, nested more than 64 levels, over 64 MiB, or a malformed record.
            OSError: unreadable.
        """
        from oomtune.safeload import read_json

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return cls.from_dict(read_json(path, what="a trial record (result.json)", error=ValueError))

    def write(self, path: str | Path) -> None:
        """Write the record atomically (:func:`oomtune.files.write_atomic`).

        Raises:
            DiskFullError: no space left (no temporary file is left behind).
        """
        from oomtune.files import write_atomic

        write_atomic(path, self.to_json())


class ResultDraft:
    """A trial record while one producer builds it (the trial process, the runner, the ``cmd``
    target): holds the current frozen :class:`TrialResult` in :attr:`result`; every change is a
    :func:`dataclasses.replace`, so each intermediate record is checked and a failure part-way
    (an exception between two steps) still leaves a whole, valid record to write."""

    __slots__ = ("result",)

    def __init__(self, result: TrialResult) -> None:
        self.result = result

    def set(self, **changes: Any) -> None:
        """Replace top-level fields of the record.

        Raises:
            ValueError: the new record is invalid (:class:`TrialResult`'s checks); the draft keeps the old.
        """
        self.result = dataclasses.replace(self.result, **changes)

    def update(self, section: str, **changes: Any) -> None:
        """Replace fields of one section (``memory``, ``process``, ...) of the record.

        Raises:
            ValueError: the new section is invalid (its checks); the draft keeps the old.
        """
        self.set(**{section: dataclasses.replace(getattr(self.result, section), **changes)})


# --- checking field types and reading/writing JSON, for every section alike ---------------------------

_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    """The resolved field types of dataclass ``cls`` (cached)."""
    hints = _HINTS.get(cls)
    if hints is None:
        resolved = typing.get_type_hints(cls)
        hints = _HINTS[cls] = {f.name: resolved[f.name] for f in dataclasses.fields(cls)}
    return hints


def _matches(value: Any, tp: Any) -> bool:
    """Whether ``value`` is of type ``tp`` (bool is no number; an int is a float; tuples element-wise)."""
    if tp is Any:
        return True
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if origin is tuple:
        args = typing.get_args(tp)
        return isinstance(value, tuple) and all(_matches(v, args[0]) for v in value)
    if origin is dict:
        key, val = typing.get_args(tp)
        return isinstance(value, dict) and all(_matches(k, key) and _matches(v, val) for k, v in value.items())
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, tp)


def _check_types(obj: Any, section: str) -> None:
    """Every field of dataclass ``obj`` holds a value of its declared type.

    Raises:
        ValueError: ``section.field must be TYPE, got VALUE`` for the first that does not.
    """
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if not _matches(value, _hints(type(obj))[f.name]):
            raise ValueError(f"{section}.{f.name} must be {f.type}, got {value!r}")


def _to_json(value: Any) -> Any:
    """Plain JSON types: a dataclass as an object of its fields, a tuple as a list, an enum its value."""
    if isinstance(value, Outcome):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
        return [_to_json(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_json(v) for k, v in value.items()}
    return value


def _from_json(tp: Any, value: Any, where: str) -> Any:
    """``value`` (plain JSON) as type ``tp``: objects become their section, lists tuples."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return None
        kinds = [a for a in typing.get_args(tp) if a is not type(None)]
        structured = [a for a in kinds if dataclasses.is_dataclass(a) or typing.get_origin(a) is tuple]
        return _from_json(structured[0], value, where) if len(kinds) == 1 and structured else value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{where} must be a list, got {value!r}")
        return tuple(_from_json(typing.get_args(tp)[0], v, f"{where}[{i}]") for i, v in enumerate(value))
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ValueError(f"{where} must be an object, got {value!r}")
        return _section_from_json(tp, value, where)
    return value


def _section_from_json(cls: type, data: dict[str, Any], where: str) -> Any:
    """Section ``cls`` from its JSON object; a key that is no field is refused.

    Raises:
        ValueError: ``WHERE: unknown key(s) ...``, or the section's own checks.
    """
    hints = _hints(cls)
    unknown = sorted(set(data) - set(hints))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(map(str, unknown))}")
    try:
        return cls(**{k: _from_json(hints[k], v, f"{where}.{k}") for k, v in data.items()})
    except TypeError as exc:   # a required field missing
        raise ValueError(f"{where}: {exc}") from None


# --- the shapes written by earlier versions ------------------------------------------------------------

_MEMORY_KEYS = {"memory_source": "source", **{k: k for k in (
    "peak_allocated_bytes", "peak_reserved_bytes", "peak_active_bytes", "fragmentation", "num_alloc_retries",
    "num_ooms", "device_peak_bytes", "non_allocator_bytes", "oom_requested_bytes")}}
_THROUGHPUT_KEYS = {"throughput": "samples_per_s", "step_time_s": "step_time_s",
                    "data_wait_fraction": "data_wait_fraction", "gpu_utilization": "gpu_utilization",
                    "steps": "steps"}
_SOAK_KEYS = {"soak_passed": "passed", "soak_steps_run": "steps_run", "soak_failed_step": "failed_step",
              "soak_shape": "shape", "soak_reserved_bytes": "reserved_bytes",
              "soak_allocated_bytes": "allocated_bytes", "soak_peak_reserved_bytes": "peak_reserved_bytes",
              "soak_message": "message", "soak_s": "seconds"}


def _nest_flat(data: dict[str, Any]) -> dict[str, Any]:
    """The nested form of a flat record (see :meth:`TrialResult.from_dict`); its other keys stay."""
    out: dict[str, Any] = {}
    memory: dict[str, Any] = {}
    throughput: dict[str, Any] = {}
    soak: dict[str, Any] = {}
    for key, value in data.items():
        if key in _MEMORY_KEYS:
            memory[_MEMORY_KEYS[key]] = value
        elif key in _THROUGHPUT_KEYS:
            throughput[_THROUGHPUT_KEYS[key]] = value
        elif key in _SOAK_KEYS:
            soak[_SOAK_KEYS[key]] = value
        else:
            out[key] = value
    if memory.get("source") is None:
        memory.pop("source", None)
    out["memory"] = memory
    out["throughput"] = throughput
    out["soak"] = soak if soak.get("passed") is not None else None
    extra = dict(out.get("extra") or {})   # the per-rank figures lived in extra
    for key in ("ranks", "worst_rank", "failed_rank"):
        if key in extra:
            out[key] = extra.pop(key)
    out["ranks"] = [RankPeak.from_dict(r).to_dict() for r in out.get("ranks") or ()]   # samples/s as "throughput"
    out["extra"] = extra
    return out


def _pids(value: Any) -> list[dict[str, Any]]:
    return [dict(p) for p in value or ()]


def _command(value: Any) -> list[str] | None:
    return None if value is None else [value] if isinstance(value, str) else list(value)


def _distributed(notes: Any) -> dict[str, Any]:
    notes = dict(notes or {})
    return {"parallel": notes.get("parallel"), "memory_note": notes.get("memory"),
            "not_modelled": notes.get("not_modelled")}


def _kernels(data: Any) -> dict[str, Any] | None:
    if data is None:
        return None
    return {"gpu": dict(data.get("gpu") or {}), "sdpa": [{"name": k, "count": v} for k, v in
                                                         sorted((data.get("sdpa") or {}).items())],
            "optimizers": list(data.get("optimizers") or ()), "autocast": list(data.get("autocast") or ())}


#: Where each key of the ``extra`` mapping of earlier records goes: ``key: (section, field, convert)``
#: (section None: a top-level field). The keys not listed were never written by a producer (or only
#: between two functions of one, ``meta_unsupported``) and are dropped.
_OLD_EXTRA: dict[str, tuple[str | None, str, Any]] = {
    "pid": ("process", "pid", None), "returncode": ("process", "returncode", None),
    "launcher": ("process", "launcher", None), "launcher_fallback": ("process", "launcher_fallback", None),
    "bad_fork": ("process", "bad_fork", dict), "torch_threads": ("process", "torch_threads", None),
    "command": ("process", "command", _command), "first_step_at": ("process", "first_step_at", None),
    "launch_to_first_step_s": ("process", "launch_to_first_step_s", None),
    "hung_after_record": ("process", "hung_after_record", bool),
    "leftover_processes": ("process", "leftover_processes", _pids), "survivors": ("process", "survivors", _pids),
    "execute": ("execution", "where", None), "execute_fallback": ("execution", "fallback", None),
    "meta_fallback": ("execution", "fallback", None), "meta_note": ("execution", "note", None),
    "meta_step_s": ("execution", "meta_step_s", None), "kernels": ("execution", "kernels", _kernels),
    "memory_fraction": ("budget", "memory_fraction", None),
    "non_allocator_bytes_at_start": ("budget", "non_allocator_bytes_at_start", None),
    "non_allocator_bytes_after_warmup": ("budget", "non_allocator_bytes_after_warmup", None),
    "device_peak_source": ("budget", "device_peak_source", None), "nvml_match": ("budget", "nvml_match", None),
    "device_peaks": ("budget", "device_peaks", list),
    "torch_alloc_conf": ("allocator", "torch_alloc_conf", None),
    "env": ("allocator", "environment", lambda env: [{"name": k, "value": v} for k, v in (env or {}).items()]),
    "rank": ("distributed", "rank", None), "world_size": ("distributed", "world_size", None),
    "backend": ("distributed", "backend", None), "rank_pids": ("distributed", "rank_pids", list),
    "rank_launcher": ("distributed", "rank_launcher", None), "launcher_lost": ("distributed", "launcher_lost", bool),
    "reports": ("script", "reports", None),
    "reported": ("script", "reported", lambda rs: [ScriptReports.encode(r or {}) for r in rs or ()]),
    "reporting_ranks": ("script", "reporting_ranks", list),
    "rejected_readings": ("script", "rejected_readings", list),
    "memory_unknown": ("script", "memory_unknown", bool),
    "oom_caught_by_script": ("script", "oom_caught_by_script", bool),
    "no_report": ("script", "no_report", bool), "stream_file": ("script", "stream_file", None),
    "grad_accum": ("script", "grad_accum", None),
    "soak_distinct_shapes": ("soak", "distinct_shapes", None),
    "soak_fragmentation": ("soak", "fragmentation_failure", None),
    "stopped_over_limit": (None, "stopped_over_limit", dict), "oom": (None, "oom", dict),
    "retried_after": (None, "retried_after", dict),
}


def _read_old_shape(data: dict[str, Any]) -> dict[str, Any]:
    """A record of an earlier version in the current nested form: each ``extra`` key (and each
    top-level key of the flat form that is no field) to its section (:data:`_OLD_EXTRA`), the
    distributed notes split into their fields, every other key dropped."""
    fields = set(_hints(TrialResult))
    extra = dict(data.pop("extra", None) or {})
    for key in [k for k in data if k not in fields]:
        extra.setdefault(key, data.pop(key))
    out = {k: v for k, v in data.items()}
    sections: dict[str, dict[str, Any]] = {}
    for key, value in extra.items():
        if key not in _OLD_EXTRA:
            continue
        section, name, convert = _OLD_EXTRA[key]
        value = convert(value) if convert is not None and value is not None else value
        if section is None:
            out[name] = value
        elif section == "soak":
            if isinstance(out.get("soak"), dict):
                out["soak"] = {**out["soak"], name: value}
        else:
            sections.setdefault(section, {})[name] = value
    if isinstance(extra.get("distributed"), dict):
        sections.setdefault("distributed", {}).update(_distributed(extra["distributed"]))
        if extra["distributed"].get("backend") is not None:
            sections["distributed"].setdefault("backend", extra["distributed"]["backend"])
    for section, values in sections.items():
        out[section] = {**(out.get(section) or {}), **values}
    return out


#: The environment variable naming ``torch.set_num_threads`` for a CPU trial (a count >= 1): set by the
#: search where trials or local jobs share the cores, applied by the trial process
#: (:mod:`oomtune.trial.child`; a forked child inherits the fork server's thread count, so
#: ``OMP_NUM_THREADS`` would not reach it).
TORCH_THREADS_ENV = "OOMTUNE_TORCH_THREADS"

#: The trial's progress record, next to its RESULT.json: ``{"steps_done": n, "steps_total": N,
#: "step_s": mean seconds of the steps done (null before one), "phase": "steps" | "soak"}`` (warm-up and
#: measured steps), rewritten after each step so that a parent can show how far it got and estimate
#: the rest.
PROGRESS_FILE = "progress.json"


def write_progress(path: str | Path, steps_done: int, steps_total: int, *, step_s: float | None = None,
                   phase: str = "steps") -> None:
    """Replace the progress record at ``path`` (atomically). A failed write is ignored: progress
    is for display, and a trial must not fail over it."""
    from oomtune.exceptions import DiskFullError
    from oomtune.files import write_atomic

    try:
        write_atomic(path, json.dumps({"steps_done": steps_done, "steps_total": steps_total, "step_s": step_s,
                                       "phase": phase}))
    except (OSError, DiskFullError):
        pass


def read_progress_record(path: str | Path) -> dict[str, Any] | None:
    """The whole progress record at ``path`` (see :data:`PROGRESS_FILE`); None when there is none yet
    (the trial is still starting) or it cannot be read."""
    try:
        data = json.loads(Path(path).read_text())
        return {"steps_done": int(data["steps_done"]), "steps_total": int(data["steps_total"]),
                "step_s": None if data.get("step_s") is None else float(data["step_s"]),
                "phase": str(data.get("phase", "steps"))}
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def read_progress(path: str | Path) -> tuple[int, int] | None:
    """``(steps_done, steps_total)`` from the progress record at ``path``; None when there is none
    yet (the trial is still starting) or it cannot be read."""
    record = read_progress_record(path)
    return None if record is None else (record["steps_done"], record["steps_total"])
