"""Predicting a trial's memory without running it (xMem-style: Middleware 2025, arXiv 2510.21048).

A trial process on the virtual GPU registers the workload's parameters, buffers and static batch,
then runs its steps while every new storage is fed to a :class:`CachingAllocatorSim`. The predictor
does the same on the meta device (no compute, no memory): the same request stream in the same order,
replayed under each allocator setting. As many steps are captured as the trial runs
(``trial.warmup_steps + trial.measure_steps``, :func:`trial_steps`; ``PREDICT_STEPS`` without a
config): the first creates the optimizer state, the later ones are the steady state, and the
allocator's state after them can still differ (a ``garbage_collection_threshold`` frees cached
blocks by age, so a later step can peak higher: ResNet-18 at batch 456 under
``garbage_collection_threshold:0.8`` peaks at 988 MiB in step 4, above what 2 steps show), so the
prediction is the peak of exactly the steps the trial measures.

Most batch sizes are not captured at all: captures whose streams share one structure
fit every request's size as a polynomial of low degree in the batch size, checked and verified by
further captures (:class:`oomtune.plan.derive.StreamDeriver`), and the streams of the batch sizes
between them are derived; batch sizes where the step makes other requests (batch 1, often) are
captured.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from dataclasses import dataclass
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from oomtune.alloc.settings import AllocatorSettings
from oomtune.plan import _spread
from oomtune.exceptions import HostMemoryRefused
from oomtune.plan.derive import MIN_FIT_CAPTURES, StreamDeriver

if TYPE_CHECKING:
    from oomtune.plan.stream_cache import StreamCache
    from oomtune.workload_spec import WorkloadSpec

__all__ = ["PREDICT_STEPS", "Prediction", "trial_steps", "Predictor", "capture_training_stream", "python_target_workload",
           "sim_geometry", "unbounded_capacity_bytes", "simulable"]

#: Training steps captured per prediction (optimizer-state creation + one steady-state step).
PREDICT_STEPS = 2
#: The wall limit of one capture of the user's code without a ``trial.timeout`` (seconds; the
#: config's default, conf/config.yaml).
CAPTURE_TIMEOUT_S = 300.0
_SEGMENT_SLACK_BYTES = 20 << 20  # the most a request's segment exceeds it (kLargeBuffer rounding)


def trial_steps(trial_cfg: Any) -> int:
    """Steps a trial runs before its memory is read: ``warmup_steps + measure_steps`` of the
    ``trial`` config group (at least 1), the steps a prediction must capture to equal the trial's
    peak (a trial stopped above the limit ran fewer, and is above the limit either way)."""
    return max(1, int(trial_cfg.warmup_steps) + int(trial_cfg.measure_steps))


def unbounded_capacity_bytes(stream: Any) -> int:
    """A virtual-GPU capacity at which no request of ``stream`` can fail, so a replay there equals a
    replay without any limit: every request gets at most one new segment of at most twice its size
    (``roundup_power2_divisions``) plus 20 MiB (the large-pool rounding), plus 1 GiB to spare.

    Not simply 1 PiB: an expandable segment reserves address space for 1.125x the capacity and the
    simulator keeps one byte per page of it (``ExpandableSegment``), so 1 PiB costs ~0.5 s and 0.5 GB
    per replay.
    """
    from oomtune.alloc.stream import REQUESTS

    sizes = [s for a, s in zip(stream.actions, stream.sizes) if a in REQUESTS]
    return 2 * sum(sizes) + len(sizes) * _SEGMENT_SLACK_BYTES + (1 << 30)


def capture_training_stream(model_cfg: dict[str, Any], batch_size: int, *, steps: int = PREDICT_STEPS,
                            blas_workspaces: bool = True) -> tuple[Any, str | None]:
    """The request stream of ``steps`` training steps of a workload, captured on meta.

    ``model_cfg`` is the ``model`` group, optionally with ``target``: a built-in workload
    (:func:`oomtune.workloads.build_workload`), or with ``target: {name: python, entry:
    "pkg.mod:fn"}`` the user's factory (:func:`python_target_workload`). Only storages on the capture
    device are recorded (on meta, Adam's CPU ``step`` counters stay off the virtual GPU, as they
    stay on the host in a CUDA run). Falls back to CPU when an op has no meta kernel (slower; the
    reason is returned). ``torch.autocast("cuda")`` and ``precision: bf16|fp16`` follow CUDA's
    autocast policy. ``blas_workspaces``: add the cuBLAS workspaces a CUDA run of the target GPU takes
    from the caching allocator (:func:`oomtune.capture.blas_workspace.cuda_run_workspaces`): the main
    thread's exists before the step (a GPU trial creates it before measuring), the autograd thread's
    comes at the first backward matmul. On by default, for a real GPU and the virtual GPU alike: they
    are allocator memory of every CUDA run (False: the step's own requests only).

    A step is one optimizer step: with ``grad_accum`` > 1, two micro-batches and the update
    (:func:`oomtune.workloads.loop.prediction_workload`: more micro-batches repeat the second's
    requests). A built-in workload of fixed shapes captures at most 2 steps: steps 3, 4, ... repeat step 2's
    requests (:func:`oomtune.plan.derive.repeat_steady_step`, which checks that step 2 is
    self-contained, else every step is captured); tests/test_plan_derive.py compares the result
    with a capture of every step.

    The step runs the kernels a CUDA run of the workload's target GPU runs (``gpu``:
    :func:`oomtune.capture.gpu_target.target_gpu`; :func:`oomtune.capture.cuda_kernels.
    emulate_cuda`), the workload's construction included. A fallback to the CPU is said on stderr at
    once, and the CPU capture stops as soon as the tensors it holds pass 80% of the host memory
    available (:func:`cpu_capture_limit_bytes`).

    Returns:
        (AllocationStream, reason or None): the reason says how the capture ran other than asked: the
        CPU fallback and why, a precision the device lacks, ``torch.autocast`` on cpu/meta run under
        CUDA's policy. The stream's ``reads`` holds the environment variables (and ``sys.argv``) this
        process's captures read, with their values (:mod:`oomtune.capture.reads`): the stream cache
        keys on them.

    Raises:
        ConfigError: an invalid workload config or python target entry.
        HostMemoryRefused: the CPU capture would exceed the host memory available.
    """
    from oomtune.workloads.parallel import fake_process_group, meta_rank_scope, world_size

    reason = None
    devices: tuple[str, ...] = ("meta", "cpu")
    group: Any = contextlib.nullcontext()
    if _target(model_cfg).distributed(_spec(model_cfg)):
        # One rank's stream, through torch's fake process group (rank 0 of the world), on meta: DDP
        # (oomtune/workloads/_meta_rank.py) and FSDP2 (oomtune/workloads/_meta_fsdp.py, whose mesh on
        # meta needs its stand-ins for the whole capture: meta_rank_scope).
        group = contextlib.ExitStack()
        group.enter_context(fake_process_group(world_size(model_cfg)))
        group.enter_context(meta_rank_scope(model_cfg))
        reason = (f"model.parallel={model_cfg['parallel']}: rank 0 of {world_size(model_cfg)} with torch's fake "
                  "process group")
    from oomtune.capture.reads import reads, recording

    with group, recording():   # the environment variables and argv the workload reads key its cache entry
        stream, reason = _capture_on(model_cfg, batch_size, steps, blas_workspaces, devices, reason)
    stream.reads = reads()
    return stream, reason


def _capture_on(model_cfg: dict[str, Any], batch_size: int, steps: int, blas_workspaces: bool,
                devices: tuple[str, ...], reason: str | None) -> tuple[Any, str | None]:
    """:func:`capture_training_stream` on the first of ``devices`` that has every kernel."""
    from oomtune.capture.blas_workspace import cuda_run_workspaces
    from oomtune.capture.cuda_kernels import emulate_cuda
    from oomtune.capture.gpu_target import target_gpu
    from oomtune.capture.recorder import HostMemoryError, capture_stream
    from oomtune.plan.derive import repeat_steady_step
    from oomtune.workloads.training import prediction_workload

    gpu = target_gpu(model_cfg.get("gpu"), model_cfg.get("gpu_source"))
    model_cfg = prediction_workload(model_cfg)   # accumulation: at most two micro-batches per step
    pending = None   # the meta build's failure, said once the CPU build has worked (else the CPU's error is all)
    for device in devices:
        notes: list[Any] = []
        host_limit = None if device == "meta" else cpu_capture_limit_bytes()
        try:
            with emulate_cuda(gpu):   # the workload too: fused=True optimizers check the device at construction
                try:
                    wl = _build(model_cfg, batch_size, device)
                except (NotImplementedError, RuntimeError) as exc:
                    if device == "cpu" or not _target(model_cfg).user_code:
                        raise
                    # e.g. a data generator reading a tensor's value (Tensor.item() has no meaning on meta)
                    reason = pending = (f"the workload cannot be built on meta ({str(exc).splitlines()[0][:160]}): "
                                        "captured on cpu; make make_workload's model and batches from shapes only "
                                        "to capture on meta")
                    continue
                if pending is not None:
                    say_now(f"note: batch {batch_size}: {pending}")
                    pending = None
                shapes = getattr(getattr(wl, "spec", None), "shapes", None)
                repeat = steps > 2 and not _target(model_cfg).user_code and bool(getattr(shapes, "is_fixed", False))

                def capture(calls: int, ends: list[int]) -> Any:
                    batches = wl.batches()
                    workspaces = cuda_run_workspaces(gpu) if blas_workspaces else None
                    return capture_stream(lambda: wl.train_step(batches), existing=wl.tensors_before_step(),
                                          device=device, blas_workspaces=workspaces, calls=calls, step_ends=ends,
                                          gpu=gpu, notes=notes, host_limit_bytes=host_limit)

                ends: list[int] = []
                stream = capture(2 if repeat else steps, ends)
                if repeat:
                    longer = repeat_steady_step(stream, ends[0], steps - 2)
                    if longer is None:   # step 2 is not self-contained: capture every step, afresh
                        wl = _build(model_cfg, batch_size, device)
                        longer = capture(steps, [])
                    stream = longer
        except HostMemoryError as exc:
            raise _refuse(reason, batch_size, exc) from None
        except (NotImplementedError, RuntimeError) as exc:
            if device == "cpu":
                raise
            reason = f"meta kernel missing or data-dependent ({str(exc).splitlines()[0][:160]}): captured on cpu"
            say_now(f"note: batch {batch_size}: {reason}; the CPU capture runs the step for real, in host "
                    f"memory (at most {_gib(cpu_capture_limit_bytes())} of it)")
            continue
        stream.captured_on = device   # the capture's device, a field (never read back from the reason's words)
        # the attention backends the step ran (the target GPU's choice: flash on an A100, efficient on a T4)
        stream.sdpa = dict(sum((n.sdpa for n in notes), start=__import__("collections").Counter()))
        notes_text = "; ".join(line for n in notes[:1] for line in n.translations())
        for extra in (wl.fallback_reason, notes_text or None):
            if extra:
                reason = extra if reason is None else f"{reason}; {extra}"
        return stream, reason
    raise AssertionError("unreachable")


def _gib(n: int) -> str:
    from oomtune.units import format_bytes

    return format_bytes(n)


def cpu_capture_limit_bytes() -> int:
    """Host memory a capture on the CPU may hold: 80% of what the kernel reports available
    (``MemAvailable`` in /proc/meminfo) when the capture starts; 80% of physical memory where that
    file is missing (``os.sysconf``)."""
    import os

    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(int(line.split()[1]) * 1024 * 0.8)
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 0.8)


def _refuse(reason: str | None, batch_size: int, exc: Any) -> Exception:
    """The one-line error of a CPU capture refused for its host memory."""
    from oomtune.exceptions import HostMemoryRefused

    why = reason or "the capture runs on the CPU"
    return HostMemoryRefused(f"batch {batch_size}: {why}, and {exc}: refused before the host runs out of memory; "
                             "plan smaller batches (search.batch_size.high), a smaller model, or on a machine with more "
                             "memory")


def say_now(text: str) -> None:
    """Print a note on stderr at once (a capture's fallback: the plan's own notes come at its end)."""
    import sys

    print(f"oomtune: {text}", file=sys.stderr, flush=True)


#: The process (pid) whose capture machinery :func:`warm_capture` has loaded.
_WARM_PID: int | None = None

#: A built-in workload small enough to capture in milliseconds (``conf/model/mlp.yaml``'s keys).
_WARM_WORKLOAD: dict[str, Any] = {
    "name": "mlp", "in_features": 8, "hidden": 8, "layers": 1, "num_classes": 2, "optimizer": "sgd", "lr": 0.01,
    "precision": "fp32", "gpu": "a100", "parallel": "none",
    "data": {"source": "synthetic", "path": None, "num_workers": 0, "pin_memory": False, "prefetch_factor": None,
             "decode_delay_s": 0.0}}


def warm_capture() -> None:
    """Load, once per process, what every capture loads on its first run: the modules torch imports
    lazily (``torch._dynamo``, reached through the capture's dispatch modes, takes seconds to
    import) and the first calls of the meta kernels, by capturing a tiny built-in workload
    (oomtune's own code, never the user's) in this process. A capture of the user's code runs in a
    process forked from this one (:mod:`oomtune.plan.isolation`): without this, every such fork
    paid the import again (about 8 s per ``oomtune.predict`` of a small MLP on a loaded 2-core
    machine, 0.3 s after it: experiments/fidelity_public.py's seconds per row). Errors are not
    raised: a failed warm-up only leaves the forks cold."""
    global _WARM_PID
    if _WARM_PID == os.getpid():
        return
    _WARM_PID = os.getpid()
    try:
        capture_training_stream(dict(_WARM_WORKLOAD), 2, steps=1)
    except Exception:   # noqa: BLE001 - a speed-up only; the real capture reports its own errors
        pass


def _target(model_cfg: dict[str, Any]) -> Any:
    """The :class:`oomtune.trial._base.Target` of ``model_cfg`` (what it can do decides the capture)."""
    from oomtune.trial._base import get_target, target_name

    return get_target(target_name(model_cfg))


def _spec(model_cfg: dict[str, Any]) -> WorkloadSpec:
    """The :class:`oomtune.workload_spec.WorkloadSpec` of a capture's flat workload (what the
    :class:`oomtune.trial._base.Target` contract reads).

    Raises:
        ConfigError: as :meth:`WorkloadSpec.from_dict`.
    """
    from oomtune.targets.python_entry import entry_label
    from oomtune.workload_spec import WorkloadSpec

    target = model_cfg.get("target")
    if isinstance(target, dict) and _callable_entry(target):   # oomtune.predict's function: named by its label
        model_cfg = {**model_cfg, "target": {**target, "entry": entry_label(target["entry"])}}
    return WorkloadSpec.from_dict(model_cfg)


def _callable_entry(target: Mapping[str, Any]) -> bool:
    """Whether a python target's ``entry`` is the function itself (:func:`oomtune.predict`), not a name."""
    entry = target.get("entry")
    return callable(entry) and not isinstance(entry, str)


def _forks_after_capture(model_cfg: dict[str, Any]) -> bool:
    """Whether a process that captured ``model_cfg`` may fork workers that capture. Not under FSDP2:
    after one FSDP2 capture on meta, a forked child's first backward raises "Unable to handle
    autograd's threading in combination with fork-based multiprocessing" (the autograd engine's
    ``track_bad_autograd_forks``, torch/csrc/autograd/engine.cpp, registered when it starts device
    threads; seen in this process after an FSDP2 capture, not after a DDP one), so its captures stay
    in this process (derived all the same)."""
    return model_cfg.get("parallel") != "fsdp"


def _build(model_cfg: dict[str, Any], batch_size: int, device: str) -> Any:
    """The workload to capture on ``device``: the target's (:meth:`Target.for_capture`: a built-in
    workload on synthetic data), the user's code built as :func:`python_target_workload` does."""
    target = _target(model_cfg)
    if target.user_code:
        return _user_workload(target, model_cfg, batch_size, device)
    return target.build_workload(_spec(target.for_capture(_spec(model_cfg))), batch_size, device)


def python_target_workload(target: dict[str, Any], batch_size: int, device: str, *,
                           workload: dict[str, Any] | None = None) -> Any:
    """The user's ``make_workload`` (:func:`oomtune.targets.python_entry.build_user_workload`), called
    under ``with torch.device(device)`` so that what it creates without an explicit device lands on
    ``device`` directly (on meta: no host memory for the model, parameters on the capture device so
    the optimizer state is recorded). The first batch is taken out and counted as alive before the
    step, as the built-ins' static batch (:meth:`oomtune.workloads.Workload.hold_first_batch`): the
    inputs occupy device memory during the step. ``workload``: the whole workload mapping, for its
    training keys (``grad_accum``, ``activation_checkpointing``).

    Raises:
        ConfigError: as ``build_user_workload`` (bad entry, protocol not followed).
    """
    workload = {**(workload or {}), "target": target}
    return _user_workload(_target(workload), workload, batch_size, device)


def _user_workload(target: Any, workload: dict[str, Any], batch_size: int, device: str) -> Any:
    import torch

    with torch.device(device):
        if _callable_entry(workload.get("target") or {}):   # the function itself travels outside the spec
            from oomtune.targets.python_target import build_entry_workload

            wl = build_entry_workload(workload["target"], _spec(workload).training, batch_size, device)
        else:
            wl = target.build_workload(_spec(workload), batch_size, device)
        wl.hold_first_batch()
    return wl


def simulable(settings: AllocatorSettings) -> bool:
    """Whether the virtual GPU can replay under ``settings``: only the native caching allocator
    (``DeviceCachingAllocator`` in c10/cuda/CUDACachingAllocator.cpp) is simulated; with
    ``backend:cudaMallocAsync`` the CUDA driver's stream-ordered pool manages memory
    (c10/cuda/CUDAMallocAsyncAllocator.cpp), whose segment behaviour is not modelled."""
    return settings.backend == "native"


def sim_geometry(device: Any, budget_bytes: int, *, memory_fraction: bool = True,
                 outside_bytes: int | None = None) -> dict[str, Any]:
    """The virtual GPU a trial on ``device`` sees: the device's capacity (on CPU the virtual GPU's,
    ``virtual_device_memory``) with the budget as a memory fraction, as the trial applies it
    (:func:`oomtune.alloc.geometry.budget_geometry`). On a real device the trial's fraction is
    ``(budget - non_allocator) / total`` (field case C9, :func:`oomtune.trial.budget.
    memory_fraction_for_budget`); with no device reading at plan time the memory outside the
    allocator is estimated (:func:`oomtune.trial.budget.estimated_non_allocator_bytes`).

    ``memory_fraction`` False (``search.memory_fraction=off``): the trials set no fraction, so neither
    does the virtual GPU: on CPU a device of the budget's size, on a real device its whole capacity.
    ``outside_bytes``: the memory outside the allocator to plan a real device with (bytes;
    :func:`oomtune.predict` passes :func:`oomtune.gpu.outside.outside_allocator`'s); None: the
    reading an earlier trial kept for this GPU, driver and torch (:func:`oomtune.gpu.outside.
    read_measured`), else the budget's estimate."""
    if device.simulated:
        from oomtune.alloc.geometry import budget_geometry

        return budget_geometry(budget_bytes, device.total_memory_bytes if memory_fraction else budget_bytes)
    from oomtune.trial.budget import estimated_non_allocator_bytes

    if outside_bytes is None:   # a reading kept by an earlier trial on this GPU, driver and torch wins
        from oomtune.gpu.outside import read_measured
        from oomtune.packages import installed_version

        outside_bytes = read_measured(device.name, getattr(device, "driver_version", None),
                                      installed_version("torch"))
    estimate = estimated_non_allocator_bytes() if outside_bytes is None else int(outside_bytes)
    outside = min(estimate, max(0, budget_bytes - 1))
    if not memory_fraction:
        return {"total_memory_bytes": device.total_memory_bytes, "non_allocator_bytes": outside,
                "memory_fraction": 1.0}
    return {"total_memory_bytes": device.total_memory_bytes, "non_allocator_bytes": outside,
            "memory_fraction": min(1.0, (budget_bytes - outside) / device.total_memory_bytes)}


@dataclass(frozen=True)
class Prediction:
    """Predicted memory of one candidate (bytes; all simulated).

    ``peak_reserved_bytes`` is what the caching allocator would reserve without a limit;
    ``fits`` whether the replay under the trial's limit completes without OOM; ``calibrated_...``
    the peak scaled by the measured/predicted ratio of earlier device trials (1.0 on CPU)."""

    batch_size: int
    alloc_conf: str
    peak_reserved_bytes: int
    peak_allocated_bytes: int
    fragmentation: float | None
    fits: bool
    num_alloc_retries: int
    calibrated_peak_reserved_bytes: int


class Predictor:
    """Holds one request stream per batch size, captured or derived; replays it per allocator setting.

    Streams are captured on the meta device (:func:`capture_training_stream`) and grouped by a
    :class:`~oomtune.plan.derive.StreamDeriver` into regimes of equal structure, each fitting every
    request's size as a polynomial of low degree in the batch size; a batch size inside a regime whose
    polynomials are fitted, checked and verified by enough captures is derived, any other is captured.
    :meth:`prepare` makes the captures that let the most of a grid be derived, several at once. A
    capture inside an accepted regime that differs from its derivation turns derivation off and drops
    what was derived (never expected; the regime rule makes it rare). Every replayed stream is
    therefore captured, or equal to what a capture gives wherever checked.

    Args:
        workload: the :class:`oomtune.workload_spec.WorkloadSpec` captured (its flat form,
            :meth:`~oomtune.workload_spec.WorkloadSpec.to_dict`, is what :func:`capture_training_stream`
            builds: the attribute ``model_cfg``).
        geometry: :func:`sim_geometry` of the target device and budget. Every capture includes the
            target GPU's cuBLAS workspaces (:func:`capture_training_stream`).
        steps: training steps per stream (:data:`PREDICT_STEPS`).
        derive: derive streams from the polynomial models (False: capture every batch size).
        workers: processes for :meth:`prepare`'s captures and :func:`oomtune.plan.feasibility.
            build_plan`'s replays (forked, :mod:`oomtune.plan.parallel`); 1: all in this process.
            The results are the same either way, only where they are computed changes. A workload
            whose process cannot fork after a capture (:func:`_forks_after_capture`) gets 1.
        cache: a :class:`oomtune.plan.stream_cache.StreamCache`: captures of a cacheable workload
            (:func:`~oomtune.plan.stream_cache.cacheable`) are read from it when there and written to
            it when made; ``cached_batches`` lists the batch sizes it served. None: always capture.
        read_cache: False: capture every stream even when ``cache`` holds it (and write it there).
        timeout_s: the wall limit of one capture of the user's code, seconds (``trial.timeout``; None:
            :data:`CAPTURE_TIMEOUT_S`). A target that runs the user's code (:attr:`Target.user_code`:
            a python entry) is captured in a forked process of its own (:mod:`oomtune.plan.isolation`):
            whatever the code does (raise, hang, ``os._exit``, a signal) ends as one
            :class:`oomtune.exceptions.UserCodeError`, never this process. Built-in workloads are
            captured here (oomtune's own code; no fork's cost).
        timeout_name: the setting ``timeout_s`` came from, as the messages name it (``--timeout`` for
            ``oomtune check``).
        entry: a python target's ``make_workload`` passed as the function itself
            (:func:`oomtune.predict`), which a spec (JSON) cannot hold: it stands for
            ``workload.target["entry"]`` in what the capture builds; never cached (no file to
            fingerprint).
    """

    def __init__(self, workload: WorkloadSpec, geometry: dict[str, Any], *, steps: int = PREDICT_STEPS,
                 derive: bool = True, workers: int = 1, cache: StreamCache | None = None, read_cache: bool = True,
                 timeout_s: float | None = None, timeout_name: str = "trial.timeout",
                 entry: Callable[..., Any] | None = None):
        self.workload, self.geometry, self.steps = workload, geometry, steps
        model_cfg: dict[str, object] = workload.to_dict()   # what the capture builds (the Target contract's form)
        if entry is not None:
            model_cfg["target"] = {**workload.target, "entry": entry}
            cache = None
        self.model_cfg = model_cfg
        self._streams: dict[int, Any] = {}
        self._captured: dict[int, Any] = {}
        self._capture_reasons: dict[int, str | None] = {}
        self._capture_devices: dict[int, str | None] = {}   # batch -> meta | cpu (AllocationStream.captured_on)
        self._cache: dict[tuple[int, str], Prediction] = {}
        self._replays: dict[tuple[int, str], tuple[Any, Any]] = {}
        self._deriver = StreamDeriver()
        self.derive = derive
        self.derived_batches: list[int] = []
        self.fallback_reasons: set[str] = set()
        self.calibration = 1.0
        self.capture_seconds = 0.0
        self.derive_seconds = 0.0
        self.replay_seconds = 0.0
        self.replays = 0
        self.workers = 1 if not _forks_after_capture(model_cfg) else max(1, int(workers))
        self._pid, self._warm = os.getpid(), False   # whether this process has captured (warmed up) yet
        self.isolate = bool(_target(model_cfg).user_code)   # the user's code: each capture in a process of its own
        self.limit_bytes: int | None = None     # prepare's limit: a batch whose requests alone exceed it cannot fit
        self.over_limit_at: int | None = None   # the smallest captured batch over limit_bytes: none above is captured
        self.host_refused_at: int | None = None   # the smallest batch whose CPU capture the host could not hold
        self.bound_notes: list[str] = []        # one line per such bound, for the plan's and the search's notes
        self.timeout_s = float(timeout_s) if timeout_s is not None else CAPTURE_TIMEOUT_S
        self.timeout_name = timeout_name
        from oomtune.plan.stream_cache import cacheable

        self.cache = cache if cache is not None and cacheable(workload) else None
        self.cached_batches: list[int] = []
        self.read_cache = bool(read_cache)

    @classmethod
    def for_search(cls, workload: WorkloadSpec, device: Any, budget_bytes: int, *,
                   steps: int = PREDICT_STEPS, cache: StreamCache | None = None, memory_fraction: bool = True,
                   timeout_s: float | None = None) -> "Predictor":
        """A predictor whose virtual GPU has the trial's geometry (:func:`sim_geometry`) for
        ``device`` (a :class:`oomtune.device.TargetDevice`) and ``budget_bytes``, capturing the
        trial's ``steps`` (:func:`trial_steps`), its captures spread over the cores as a plan's
        (:func:`oomtune.plan.parallel.default_workers`); ``cache``: as for the constructor;
        ``memory_fraction``: as for :func:`sim_geometry`; ``timeout_s``: as for the constructor."""
        from oomtune.plan.parallel import default_workers

        return cls(workload, sim_geometry(device, budget_bytes, memory_fraction=memory_fraction), steps=steps,
                   cache=cache, workers=default_workers(), timeout_s=timeout_s)

    @property
    def captured_on(self) -> set[str]:
        """The devices this predictor's captures ran on (``meta``, ``cpu``: each capture's
        :attr:`oomtune.alloc.stream.AllocationStream.captured_on`, also for those read from the cache)."""
        return {d for d in self._capture_devices.values() if d is not None}

    @property
    def sdpa_backends(self) -> dict[str, int]:
        """The ``scaled_dot_product_attention`` backends this predictor's captures ran, with their call
        counts summed over the captures (``{"flash": 24}``; empty: no attention, or captures read from
        a stream cache entry written before the backends were recorded)."""
        total: dict[str, int] = {}
        for stream in self._captured.values():
            for name, count in (getattr(stream, "sdpa", None) or {}).items():
                total[name] = total.get(name, 0) + int(count)
        return total

    def retarget(self, geometry: dict[str, Any]) -> None:
        """Replay the same captures on another card of the same kernels (``geometry``: its
        :func:`sim_geometry`): the streams, regimes and derivations are kept, the replays (which depend
        on the card's capacity and fraction) are dropped, and the bound on what is captured is
        recomputed by :meth:`prepare` for the new limit. A multi-card plan calls it between cards of
        one kernel family (:mod:`oomtune.plan.cards`)."""
        self.geometry = dict(geometry)
        self._cache.clear()
        self._replays.clear()
        self.limit_bytes = None
        self.over_limit_at = None

    @property
    def captures(self) -> int:
        """Batch sizes captured on the meta device (those read from the stream cache count too:
        ``cached_batches``)."""
        return len(self._captured)

    @property
    def derivation_note(self) -> str | None:
        """Where derivation stopped and why (one line; None when every derivable batch size was
        derived in one regime, or derivation is off by request)."""
        if not self.derive and self._deriver.broken is None:
            return None
        notes = self._deriver.notes()
        return "; ".join(notes) if notes else None

    def can_predict(self, batch_size: int, **_: Any) -> bool:
        """Whether a stream can be had for ``batch_size``: yes when it is held, else it is captured when
        needed, except above ``over_limit_at`` (a smaller batch's requests alone exceed the limit, so no
        larger one fits: nothing more is captured there) and from ``host_refused_at`` up (the host could
        not hold its CPU capture). Recorded-stream predictors (:mod:`oomtune.plan.recorded`) answer
        otherwise."""
        if batch_size in self._streams:
            return True
        if self.host_refused_at is not None and batch_size >= self.host_refused_at:
            return False
        return self.over_limit_at is None or batch_size <= self.over_limit_at

    def known_over_limit(self, batch_size: int, **_: Any) -> bool:
        """Whether ``batch_size`` is known not to fit without a stream of its own: it lies above
        ``over_limit_at``, a captured batch whose live requests alone exceed ``limit_bytes``."""
        return self.over_limit_at is not None and batch_size > self.over_limit_at

    def prepare(self, batch_sizes: Any, *, limit_bytes: int | None = None) -> None:
        """Make the captures that let the most of ``batch_sizes`` (all that will be asked) be derived
        (:meth:`oomtune.plan.derive.StreamDeriver.wanted`), in rounds: each round's captures are read
        from the stream cache or made at once in forked processes (``workers > 1``,
        :func:`oomtune.plan.parallel.fork_map`) and then taken in ascending order, so the regimes,
        models and notes are the same as in one process. Does nothing when derivation is off or fewer
        than three distinct sizes come.

        ``limit_bytes`` (the search's limit, bytes): a batch whose live requests alone exceed it
        (:meth:`oomtune.alloc.stream.AllocationStream.peak_live_bytes`: reserved >= allocated >=
        requested, under every allocator setting) cannot fit, and neither can a larger one (the
        frontier's monotonicity, :func:`oomtune.plan.feasibility.largest_fitting`): sizes above the
        first such capture are neither captured nor asked (:meth:`can_predict`). Captures go in
        rounds chosen by the deriver; those made one at a time stop at the first over the limit; a CPU
        capture the host cannot hold (:class:`oomtune.exceptions.HostMemoryRefused`) above a
        smaller captured batch bounds the sizes the same way, with a note (``bound_notes``).

        Raises:
            ConfigError: as :func:`capture_training_stream`. HostMemoryRefused: the host cannot hold
                even the smallest size's capture.
        """
        if limit_bytes is not None:
            self.limit_bytes = int(limit_bytes)
            over = [b for b, st in self._captured.items() if st.peak_live_bytes() > self.limit_bytes]
            if over and (self.over_limit_at is None or min(over) < self.over_limit_at):
                self.over_limit_at = min(over)   # held captures bound a retargeted predictor too
        sizes = sorted(set(int(b) for b in batch_sizes))
        if not self.derive or len(sizes) < MIN_FIT_CAPTURES:
            return
        for _ in range(12):   # rounds; each adds captures, so this ends; the bound is a safety net
            sizes = [b for b in sizes if self.can_predict(b)]
            wanted = [b for b in self._deriver.wanted(sizes) if b not in self._streams]
            if not wanted or not self.derive:
                return
            self._capture_many(wanted)

    def _capture_many(self, batch_sizes: list[int]) -> None:
        """Capture ``batch_sizes`` (cache first; the rest in forked workers when there are several)."""
        t0 = time.perf_counter()
        got: dict[int, tuple[Any, str | None]] = {}
        for b in batch_sizes:
            hit = self._from_cache(b)
            if hit is not None:
                got[b] = hit
        rest = [b for b in batch_sizes if b not in got]
        if self.workers > 1 and len(rest) > 1 and self.isolate:
            # the user's code: every capture in a process of its own, none here
            got.update(zip(rest, self._isolated(rest)))
        elif self.workers > 1 and len(rest) > 1:
            if not self._warm:
                # The first capture of a process pays one-time costs (imports such as torch._dynamo or the
                # user's transformers, first calls of meta kernels): paid here once, the forked workers and
                # this process's later captures start warm.
                got[rest[0]] = self._capture_raw(rest[0])
                rest = rest[1:]
            if len(rest) > 1:
                from oomtune.plan.parallel import fork_map

                got.update(zip(rest, fork_map(self._capture_raw, rest, self.workers)))
            else:
                got.update((b, self._capture_raw(b)) for b in rest)
        else:   # one at a time, upwards: stop at the first batch over the limit or beyond the host
            for b in sorted(rest):
                if self._beyond(b, got):
                    continue
                try:
                    got[b] = self._capture_raw(b)
                except HostMemoryRefused as exc:
                    if not got and not self._captured:
                        raise
                    self._host_refused(b, exc)
        self.capture_seconds += time.perf_counter() - t0   # the wall time of the (parallel) captures
        for b in sorted(got):
            self._keep_capture(b, *got[b])

    def _beyond(self, batch_size: int, got: dict[int, tuple[Any, str | None]]) -> bool:
        """Whether ``batch_size`` need not be captured: a smaller one (held, or in ``got``) has live
        requests above ``limit_bytes``, or the host could not hold a smaller or equal one's capture."""
        if self.host_refused_at is not None and batch_size >= self.host_refused_at:
            return True
        if self.limit_bytes is None:
            return False
        held = [(b, st) for b, st in self._captured.items()] + [(b, v[0]) for b, v in got.items()]
        return any(b < batch_size and st.peak_live_bytes() > self.limit_bytes for b, st in held)

    def _host_refused(self, batch_size: int, exc: Exception) -> None:
        """Note that the host cannot hold ``batch_size``'s CPU capture: no size from it up is captured."""
        if self.host_refused_at is None or batch_size < self.host_refused_at:
            self.host_refused_at = batch_size
            self.bound_notes.append(f"batch {batch_size} and above not predicted: {exc}")
            say_now(f"note: batch {batch_size} and above not predicted (the host cannot hold the capture)")

    def stream(self, batch_size: int) -> Any:
        """The training step's allocation stream at ``batch_size`` (cached): derived where a regime's
        polynomial model covers it (:class:`oomtune.plan.derive.StreamDeriver`), else captured on the
        meta device (:func:`capture_training_stream`); capture time adds to ``capture_seconds``.

        Raises:
            ConfigError: as :func:`capture_training_stream`.
        """
        stream = self._streams.get(batch_size)
        if stream is not None:
            return stream
        if self.derive:
            t0 = time.perf_counter()
            derived = self._deriver.derive(batch_size)
            self.derive_seconds += time.perf_counter() - t0
            if derived is not None:
                self._streams[batch_size] = derived
                self.derived_batches.append(batch_size)
                return derived
        return self._capture(batch_size)

    def _from_cache(self, batch_size: int) -> tuple[Any, str | None] | None:
        """(stream, fallback reason) of ``batch_size`` from ``self.cache``, or None (no cache, a miss).
        Called in this process only, so ``cached_batches`` sees every hit."""
        if self.cache is None or not self.read_cache:
            return None
        hit = self.cache.get(*self.cache.capture_key(self.workload, batch_size, self.steps, True))
        if hit is not None:
            self.cached_batches.append(batch_size)
        return hit

    def _isolated(self, batch_sizes: list[int]) -> list[tuple[Any, str | None]]:
        """:meth:`_capture_here` of each of ``batch_sizes``, each in a forked process under
        ``timeout_s`` (:func:`oomtune.plan.isolation.run_isolated`).

        Raises:
            UserCodeError: the user's code raised, hung, exited or was killed (one line).
        """
        from oomtune.plan.isolation import in_child, run_isolated

        if not in_child():
            warm_capture()
        entry = str(self.model_cfg["target"].get("entry"))   # type: ignore[union-attr]
        return run_isolated(self._capture_here, batch_sizes, entry=entry, workers=self.workers,
                            timeout_s=self.timeout_s, limit_name=self.timeout_name)

    def _capture_raw(self, batch_size: int) -> tuple[Any, str | None]:
        """(stream, fallback reason) of one capture at ``batch_size``: :meth:`_capture_here`, in a
        process of its own for the user's code (``isolate``)."""
        if self.isolate:
            return self._isolated([batch_size])[0]
        return self._capture_here(batch_size)

    def _capture_here(self, batch_size: int) -> tuple[Any, str | None]:
        """(stream, fallback reason) of one capture at ``batch_size`` in this process:
        :func:`capture_training_stream`, the target GPU's cuBLAS workspaces included; stored in
        ``self.cache`` when there is one (also from a forked worker)."""
        got = capture_training_stream(self.model_cfg, batch_size, steps=self.steps)
        self._warm = self._warm or os.getpid() == self._pid
        if self.cache is not None:
            self.cache.put(*self.cache.capture_key(self.workload, batch_size, self.steps, True),
                           *got)
        return got

    def _capture(self, batch_size: int) -> Any:
        t0 = time.perf_counter()
        got = self._from_cache(batch_size)
        stream, reason = got if got is not None else self._capture_raw(batch_size)
        self.capture_seconds += time.perf_counter() - t0
        return self._keep_capture(batch_size, stream, reason)

    def _keep_capture(self, batch_size: int, stream: Any, reason: str | None) -> Any:
        """Hold a capture (and give it to the deriver); returns the stream. A capture whose live
        requests alone exceed ``limit_bytes`` bounds what is captured (``over_limit_at``)."""
        if (self.limit_bytes is not None and stream.peak_live_bytes() > self.limit_bytes
                and (self.over_limit_at is None or batch_size < self.over_limit_at)):
            self.over_limit_at = batch_size
        if reason:
            self.fallback_reasons.add(reason)
        self._streams[batch_size] = self._captured[batch_size] = stream
        self._capture_reasons[batch_size] = reason
        self._capture_devices[batch_size] = getattr(stream, "captured_on", None)
        if self.derive and not self._deriver.add(batch_size, stream, reason):
            self._forget_derived()
        return stream

    def _forget_derived(self) -> None:
        """Derivation turned out wrong somewhere (a capture differed from its derivation): derive no
        more, and drop every derived stream and what was replayed from it (captured again on demand)."""
        self.derive = False
        gone = set(self.derived_batches)
        for b in gone:
            self._streams.pop(b, None)
        for key in [k for k in self._cache if k[0] in gone]:
            del self._cache[key]
        for key in [k for k in self._replays if k[0] in gone]:
            del self._replays[key]
        self.derived_batches.clear()

    def predict_detail(self, batch_size: int, settings: AllocatorSettings | str) -> Prediction:
        """Replay the batch's stream under ``settings`` on the trial's virtual GPU (``self.geometry``).

        When it fits, the figures are that replay's: exactly what a virtual-GPU trial of the same
        steps measures (with a memory fraction set, ``garbage_collection_threshold`` acts relative to
        the allowed memory, so a replay without the limit would differ). When it runs out of memory,
        the peaks come from a second replay without a limit (how much it would need).

        Raises:
            AllocatorConfigError: malformed settings. ConfigError: a bad workload config, or settings
                the virtual GPU cannot simulate (``backend:cudaMallocAsync``, see :func:`simulable`).
        """
        from oomtune.exceptions import ConfigError

        if isinstance(settings, str):
            settings = AllocatorSettings.parse(settings)
        if not simulable(settings):
            raise ConfigError(f"the virtual GPU cannot simulate backend:{settings.backend} (only the native "
                              "caching allocator is modelled)")
        key = (batch_size, settings.render())
        if key not in self._cache:
            stream = self.stream(batch_size)
            t0 = time.perf_counter()
            bounded, peaks = self._replay(stream, batch_size, settings, key[1])
            self.replay_seconds += time.perf_counter() - t0
            self.replays += 1
            self._cache[key] = Prediction(
                batch_size=batch_size, alloc_conf=key[1], peak_reserved_bytes=peaks.peak_reserved_bytes,
                peak_allocated_bytes=peaks.peak_allocated_bytes, fragmentation=peaks.fragmentation,
                fits=not bounded.oom, num_alloc_retries=bounded.num_alloc_retries,
                calibrated_peak_reserved_bytes=peaks.peak_reserved_bytes,
            )
        pred = self._cache[key]
        if self.calibration != 1.0:
            pred = Prediction(**{**pred.__dict__, "calibrated_peak_reserved_bytes":
                                 int(math.ceil(pred.peak_reserved_bytes * self.calibration))})
        return pred

    def _replay(self, stream: Any, batch_size: int, settings: AllocatorSettings, rendered: str
                ) -> tuple[Any, Any]:
        """(replay under the trial's limits, replay without a limit when that one ran out of memory,
        else the same) for ``stream`` under ``settings``; cached by (batch size, settings).

        A garbage_collection_threshold T reuses the replays under the same settings without it when
        they prove it idle (exact): ``garbage_collect_cached_blocks`` returns at once while
        reserved memory <= T x allowed (:meth:`CachingAllocatorSim._garbage_collect`), and reserved
        memory never exceeds its peak, so when the replay without T peaked at or below that, the
        replay with T makes the same calls with the same results; and a replay without a limit has
        no fraction, so T never acts in it (torch: garbage collection only under a memory fraction).
        """
        from oomtune.alloc.sim import CachingAllocatorSim
        from oomtune.alloc.stream import replay_stream

        bounded = peaks = None
        threshold = settings.garbage_collection_threshold
        base = None
        if threshold:
            plain = dataclasses.replace(settings, garbage_collection_threshold=0.0)
            base = self._replays.get((batch_size, plain.render()))
        if base is not None:
            allowed = CachingAllocatorSim(**self.geometry).allowed_bytes   # None: no fraction, no gc
            if allowed is None or base[0].peak_reserved_bytes <= int(threshold * allowed):
                bounded = base[0]
        if bounded is None:
            bounded = replay_stream(stream, settings, **self.geometry)
        peaks = bounded
        if bounded.oom:
            if base is not None and base[1].oom is False and base[1] is not base[0]:
                peaks = base[1]
            else:
                capacity = max(unbounded_capacity_bytes(stream), int(self.geometry["total_memory_bytes"]))
                peaks = replay_stream(stream, settings, total_memory_bytes=capacity)
        self._replays[(batch_size, rendered)] = (bounded, peaks)
        return bounded, peaks

    def predict(self, candidate: Any) -> int | None:
        """Calibrated predicted peak reserved of a search Candidate (``batch_size``, ``settings``), in
        bytes; None (no prediction: the candidate must be measured) when the virtual GPU cannot
        simulate its settings (``backend:cudaMallocAsync``, :func:`simulable`).

        Raises:
            ConfigError: a bad workload config (as :meth:`predict_detail`).
        """
        settings = candidate.settings
        if isinstance(settings, str):
            settings = AllocatorSettings.parse(settings)
        if not simulable(settings):
            return None
        pred = self.predict_detail(candidate.batch_size, settings)
        return pred.calibrated_peak_reserved_bytes

    def predict_raw(self, batch_size: int, settings: AllocatorSettings | str) -> int | None:
        """Uncalibrated predicted peak reserved (bytes) of ``batch_size`` under ``settings``; None when
        the virtual GPU cannot simulate them (``backend:cudaMallocAsync``, :func:`simulable`).

        Raises:
            AllocatorConfigError: malformed settings. ConfigError: a bad workload config.
        """
        if isinstance(settings, str):
            settings = AllocatorSettings.parse(settings)
        if not simulable(settings):
            return None
        return self.predict_detail(batch_size, settings).peak_reserved_bytes

    def calibrate(self, pairs: list[tuple[int, int]]) -> float:
        """Set the calibration from (predicted, measured) peak reserved pairs of device trials: the
        median ratio measured/predicted (1.0 without pairs). Returns it."""
        ratios = sorted(m / p for p, m in pairs if p and m)
        if ratios:
            mid = len(ratios) // 2
            self.calibration = ratios[mid] if len(ratios) % 2 else (ratios[mid - 1] + ratios[mid]) / 2
        return self.calibration

    # ------------------------------------------------------------------ work done in forked children
    def fork_mark(self) -> tuple:
        """What this predictor holds now (:func:`oomtune.plan._spread.mark`), for :meth:`fork_delta`
        in a forked child (:func:`oomtune.plan._spread.rows_forked`)."""
        return _spread.mark(self)

    def fork_delta(self, since: tuple | None) -> dict[str, Any]:
        """What this predictor gained since :meth:`fork_mark` gave ``since`` (None: everything it
        holds), picklable, for :meth:`fork_merge` in the parent (:func:`oomtune.plan._spread.delta`;
        the seconds gained under ``capture_seconds`` / ``derive_seconds`` / ``replay_seconds``)."""
        return _spread.delta(self, since)

    def fork_merge(self, gained: dict[str, Any]) -> None:
        """Take a child's :meth:`fork_delta` in (:func:`oomtune.plan._spread.merge`; seconds are the
        caller's to account)."""
        _spread.merge(self, gained)
