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

__all__ = ["TrialSpec", "TrialResult", "DeviceInfo", "MEMORY_SOURCE_DEVICE", "MEMORY_SOURCE_SIMULATED",
           "PROGRESS_FILE", "write_progress", "read_progress", "read_progress_record", "EXECUTE_MODES"]

#: ``TrialSpec.execute`` values (resolved: :mod:`oomtune.trial.execute`).
EXECUTE_MODES = ("cpu", "meta")

#: ``TrialResult.memory_source`` for figures read from the real CUDA device.
MEMORY_SOURCE_DEVICE = "device"
#: ``TrialResult.memory_source`` for figures from the virtual GPU (:class:`CachingAllocatorSim`).
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
        return cls(**json.loads(text))


@dataclass
class TrialResult:
    """What a trial process measured. Written once as JSON to the file the parent named.

    Attributes:
        outcome: how the trial ended (see :class:`oomtune.outcome.Outcome`).
        memory_source: ``"device"`` (real CUDA readings) or ``"simulated"`` (virtual GPU); every
            printed memory figure carries this.
        throughput: samples per second over the measured steps (measured for real, on the device or
            the CPU; None for steps on the meta device, ``TrialSpec.execute`` ``meta``).
        step_time_s: mean wall time of a measured step, seconds.
        peak_allocated_bytes / peak_reserved_bytes / peak_active_bytes: ``allocated_bytes.all.peak``,
            ``reserved_bytes.all.peak``, ``active_bytes.all.peak`` of ``memory_stats()``.
        fragmentation: ``1 - peak_active / peak_reserved`` (GMLake's definition), in [0, 1].
        num_alloc_retries / num_ooms: from ``memory_stats()``.
        device_peak_bytes: device-level peak used memory of this process sampled through NVML
            (None without NVML or on CPU).
        non_allocator_bytes: memory outside the caching allocator (CUDA context, cuBLAS workspaces)
            measured before the budget was applied (field case C9).
        data_wait_fraction: time waiting for the next batch over step time, in [0, 1].
        gpu_utilization: mean NVML utilisation in percent during measured steps (None without NVML).
        settings_effective: the allocator settings torch reports as in effect (verification).
        oom_requested_bytes: for memory outcomes, the size the failed request asked for.
        message: the one-line error message (None when ok).
        advice: what to try next, from the classifier (None when ok).
        traceback_tail: the last lines of the traceback for ``error`` outcomes.
        wall_s: wall time of the whole trial process; startup_s: process start to first step.
        soak_passed: the virtual-GPU soak (``TrialSpec.soak_steps``) ran every step (None: no soak).
        soak_steps_run: soak steps completed; soak_failed_step: the 1-based soak step that ran out
            of memory (step 1 is the first live step); soak_shape: that step's ``seq_len`` /
            ``image_size``.
        soak_reserved_bytes / soak_allocated_bytes: reserved and allocated at the soak's failure (at
            its end when passed), simulated; their difference is the cached-but-unused memory.
        soak_peak_reserved_bytes: peak reserved over the soak, simulated.
        soak_message: one line on the soak's failure (None when passed); soak_s: its wall seconds.
    """

    outcome: str
    memory_source: str = MEMORY_SOURCE_SIMULATED
    batch_size: int | None = None
    alloc_conf: str = ""
    throughput: float | None = None
    step_time_s: float | None = None
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    peak_active_bytes: int | None = None
    fragmentation: float | None = None
    num_alloc_retries: int | None = None
    num_ooms: int | None = None
    device_peak_bytes: int | None = None
    non_allocator_bytes: int | None = None
    data_wait_fraction: float | None = None
    gpu_utilization: float | None = None
    settings_effective: dict[str, Any] | None = None
    oom_requested_bytes: int | None = None
    message: str | None = None
    advice: str | None = None
    traceback_tail: str | None = None
    wall_s: float | None = None
    startup_s: float | None = None
    steps: int | None = None
    device: DeviceInfo | None = None
    soak_passed: bool | None = None
    soak_steps_run: int | None = None
    soak_failed_step: int | None = None
    soak_shape: int | None = None
    soak_reserved_bytes: int | None = None
    soak_allocated_bytes: int | None = None
    soak_peak_reserved_bytes: int | None = None
    soak_message: str | None = None
    soak_s: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def outcome_enum(self) -> Outcome:
        return Outcome(self.outcome)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrialResult":
        data = dict(data)
        dev = data.pop("device", None)
        known = {f.name for f in dataclasses.fields(cls)}
        extra = {k: v for k, v in data.items() if k not in known}
        data = {k: v for k, v in data.items() if k in known}
        result = cls(**data)
        if dev is not None:
            result.device = DeviceInfo(**dev)
        result.extra.update(extra)
        return result

    def fill_memory_stats(self, stats: dict[str, Any]) -> None:
        """Copy peaks and counters from a ``memory_stats()`` mapping (torch.cuda.memory_stats keys, or
        the virtual GPU's); absent keys stay None. fragmentation = 1 - peak_active / peak_reserved
        (GMLake's definition; None when nothing was reserved)."""
        self.peak_allocated_bytes = stats.get("allocated_bytes.all.peak")
        self.peak_reserved_bytes = stats.get("reserved_bytes.all.peak")
        self.peak_active_bytes = stats.get("active_bytes.all.peak")
        self.num_alloc_retries = stats.get("num_alloc_retries")
        self.num_ooms = stats.get("num_ooms")
        if self.peak_reserved_bytes and self.peak_active_bytes is not None:
            self.fragmentation = 1.0 - self.peak_active_bytes / self.peak_reserved_bytes

    @classmethod
    def read(cls, path: str | Path) -> "TrialResult":
        return cls.from_dict(json.loads(Path(path).read_text()))

    def write(self, path: str | Path) -> None:
        """Write the record atomically (:func:`oomtune.files.write_atomic`).

        Raises:
            DiskFullError: no space left (no temporary file is left behind).
        """
        from oomtune.files import write_atomic

        write_atomic(path, self.to_json())


#: The trial's progress record, next to its RESULT.json: ``{"steps_done": n, "steps_total": N,
#: "step_s": mean seconds of the steps done (null before one), "phase": "steps" | "soak"}`` (warm-up and
#: measured steps), rewritten after each step so that a parent can show how far it got and estimate
#: the rest (issue 26).
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
