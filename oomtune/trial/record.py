"""The trial protocol's records: what the parent asks a trial process to do (:class:`TrialSpec`) and
what the trial process reports back (:class:`TrialResult`), as JSON written to a file the parent names.

Results travel as structured data, never by parsing logs. Sizes are bytes, times seconds. A reading
that was not taken is ``None`` (JSON null), never 0.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from oomtune.gpu.info import DeviceInfo  # noqa: F401 - re-exported: the trial records it
from oomtune.outcome import Outcome

__all__ = ["TrialSpec", "TrialResult", "MemoryReadings", "Throughput", "SoakReadings", "RankPeak", "DeviceInfo",
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
        workload: the workload's config as a plain mapping (e.g. the composed ``model`` group:
            ``{"name": "resnet", "depth": 18, "image_size": 64, ...}``) plus ``target`` settings.
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
            remaining steps do (``TrialResult.extra["stopped_over_limit"]`` names the step; no
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

    workload: dict[str, Any]
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

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "TrialSpec":
        """The spec that :meth:`to_json` wrote, checked field by field as it is read (the trial
        process reads it from ``spec.json``, a file anything could have changed).

        Raises:
            ValueError: not a JSON object, a missing ``workload``/``batch_size``, a key that is no
                field, or a field of the wrong type (bool is not a number; an int is a float), named.
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


@dataclass(frozen=True)
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


@dataclass(frozen=True)
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


@dataclass(frozen=True)
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


@dataclass(frozen=True)
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


@dataclass
class TrialResult:
    """What a trial process measured (compare Optuna's ``FrozenTrial``). Written once as JSON to the
    file the parent named; checked on construction (:meth:`from_dict` too), so that a record read
    back holds what the fields say.

    Attributes:
        outcome: how the trial ended (:class:`oomtune.outcome.Outcome`; a string value assigned is
            converted, an unknown one raises ValueError).
        batch_size / alloc_conf: the trial's (``TrialSpec``'s).
        memory: the memory readings (:class:`MemoryReadings`, bytes).
        throughput: the speed readings (:class:`Throughput`).
        soak: the virtual-GPU soak (:class:`SoakReadings`); None when no soak ran.
        settings_effective: the allocator settings torch reports as in effect (verification).
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
        extra: everything else a producer records (``stopped_over_limit``, ``memory_fraction``,
            ``world_size``, pids, ...; see the producers).

    Raises:
        ValueError: on construction, an unknown outcome, a section of the wrong type, negative
            times, a rank number that is not an int >= 0 (one line naming the field); the sections
            check their own fields.
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
    extra: dict[str, Any] = field(default_factory=dict)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "outcome":   # a string value becomes the enum; an unknown one raises ValueError
            value = Outcome.parse(value)
        object.__setattr__(self, name, value)

    def __post_init__(self) -> None:
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
        if not isinstance(self.extra, dict):
            raise ValueError(f"extra must be a dict, got {type(self.extra).__name__}")

    def to_dict(self) -> dict[str, Any]:
        """The nested form (plain JSON types; ``outcome`` its string value)."""
        data = dataclasses.asdict(self)
        data["outcome"] = self.outcome.value
        data["ranks"] = [r.to_dict() for r in self.ranks]
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrialResult":
        """A record from :meth:`to_dict`'s nested form, or from the flat form written before the
        sections existed (``peak_reserved_bytes``, ``throughput`` as samples/s, ``soak_*`` at the
        top level: records kept in Optuna storages, tell files and trial directories). Keys that
        are no field go to ``extra``.

        Raises:
            ValueError: an unknown outcome or a figure out of range (one line naming the field).
            TypeError / KeyError: ``data`` is not a record.
        """
        data = dict(data)
        if not isinstance(data.get("memory"), dict) and not isinstance(data.get("throughput"), dict):   # flat
            data = _nest_flat(data)
        dev = data.pop("device", None)
        data["memory"] = MemoryReadings(**data.get("memory") or {})
        data["throughput"] = Throughput(**data.get("throughput") or {})
        soak = data.get("soak")
        data["soak"] = SoakReadings(**soak) if soak is not None else None
        data["ranks"] = tuple(RankPeak.from_dict(r) for r in data.get("ranks") or ())
        known = {f.name for f in dataclasses.fields(cls)}
        extra = {k: v for k, v in data.items() if k not in known}
        data = {k: v for k, v in data.items() if k in known}
        data["extra"] = {**(data.get("extra") or {}), **extra}
        result = cls(**data)
        if dev is not None:
            result.device = DeviceInfo(**dev)
        return result

    def fill_memory_stats(self, stats: dict[str, Any]) -> None:
        """Replace the memory peaks and counters with those of a ``memory_stats()`` mapping
        (:meth:`MemoryReadings.with_memory_stats`).

        Raises:
            ValueError: a figure of ``stats`` is not a non-negative int.
        """
        self.memory = self.memory.with_memory_stats(stats)

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


def _nest_flat(data: dict[str, Any]) -> dict[str, Any]:
    """The nested form of a flat record (see :meth:`TrialResult.from_dict`)."""
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
    out["extra"] = extra
    return out


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
