"""The virtual-GPU soak: thousands of training steps of varying shapes replayed in seconds.

Out-of-memory failures after hours of training come from varying shapes (padded text of varying
length, multi-scale images): the caching allocator's cache fragments over hundreds of steps, long
after the few measured steps of a trial. The soak looks that far ahead without running them:

1. Capture (:mod:`oomtune.capture.recorder`, on the meta device; CPU when an op lacks a meta kernel)
   the first step's request stream, from the registration of what exists before training
   (parameters, buffers, the static batch of a fixed-shape workload) through the first step at the
   data's first shape, which creates the optimizer state; then one steady-state step per DISTINCT
   shape of the sequence (a steady step frees everything it allocates: activations, gradients under
   ``zero_grad(set_to_none=True)``, the batch of a variable-shape workload). With many shapes, three
   are captured (plus one check) and the others derived exactly (:mod:`oomtune.trial._soak_derive`).
2. Replay the first stream, then the steady streams in the data's order (the seeded sequence of
   :meth:`oomtune.workloads.shapes.ShapeDistribution.iter_shapes`, the same one the live trial's
   batches follow), on ONE virtual GPU (:func:`oomtune.alloc._compiled.make_simulator`: the compiled
   core when built, else :class:`oomtune.alloc.CachingAllocatorSim`; same results) whose state carries over from
   step to step: the parameters and the optimizer state stay allocated, the cached free segments
   and their splits persist, so fragmentation builds up as it would on the device.

Step ``k`` of the soak (1-based) is the live trial's step ``k`` (warm-up steps first): the soak's
first steps reproduce a live virtual-GPU trial's memory exactly (tests/test_soak.py). A fixed-shape
workload repeats one steady stream; the replay stops early, as passed, once a step leaves the
allocator in the state it started in (every later step would repeat it exactly). Likewise, with any
distribution, a step is not replayed when the same shape was replayed before from the same state
(segments and blocks, as ``memory_snapshot()`` shows them) and left it unchanged: the simulator is
deterministic, so it would do so again (the usual case once the cache has warmed to every shape;
not used with ``garbage_collection_threshold``, whose block ages the snapshot does not show).

All sizes are bytes, on the virtual GPU (simulated).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from oomtune.alloc.settings import AllocatorSettings
from oomtune.trial._soak_derive import derive_shape_streams

__all__ = ["SoakResult", "SoakStreams", "capture_soak", "replay_soak", "soak", "soak_supported"]


@dataclass
class SoakStreams:
    """The captured request streams of a soak (see the module docstring).

    Attributes:
        batch_size: samples per step.
        shapes: the per-step shapes, step 1 first (``seq_len`` tokens / ``image_size`` pixels;
            None for models without a shape key).
        first: the ``AllocationStream`` of the registration plus step 1.
        steady: shape -> ``AllocationStream`` of one steady-state step at that shape.
        fixed: the workload has fixed shapes (enables the early stop).
        shape_key: ``seq_len`` / ``image_size`` / None, for messages.
        captured_shapes: steady streams captured (the others were derived, :mod:`oomtune.trial._soak_derive`).
        capture_s: wall seconds spent capturing.
        fallback_reason: why capture ran on CPU rather than meta (None on meta).
    """

    batch_size: int
    shapes: list[Any]
    first: Any
    steady: dict[Any, Any]
    fixed: bool
    shape_key: str | None
    captured_shapes: int = 0
    capture_s: float = 0.0
    fallback_reason: str | None = None


@dataclass
class SoakResult:
    """What a soak found. Sizes in bytes on the virtual GPU (simulated).

    Attributes:
        passed: every step ran without a simulated out-of-memory error.
        steps: steps asked for.
        steps_run: steps completed (``steps`` when passed, also after an early stop).
        failed_step: the 1-based step that ran out of memory (None when passed).
        shape_at_failure: that step's shape (``seq_len`` / ``image_size``), None when passed.
        shape_key: ``seq_len``, ``image_size`` or None.
        requested_bytes: the segment size the failing request needed ("Tried to allocate").
        reserved_bytes / allocated_bytes: reserved and allocated at the failure (at the end when
            passed); ``reserved_bytes - allocated_bytes`` is the cached-but-unused memory.
        peak_reserved_bytes / peak_allocated_bytes: peaks over the steps run.
        distinct_shapes: shapes captured.
        converged_at: the step after which a fixed-shape replay repeated itself (None otherwise).
        steps_skipped: steps not replayed because they would repeat a step exactly (same start
            state, same shape, and that step ended in the state it started in).
        capture_s / replay_s: wall seconds.
        message: one line saying what happened (None when passed).
        oom_message: the simulated allocator's own OOM message (None when passed).
        per_step: when asked for, ``(allocated, reserved, peak_allocated, peak_reserved)`` bytes
            after each step run.
    """

    passed: bool
    steps: int
    steps_run: int
    failed_step: int | None
    shape_at_failure: Any
    shape_key: str | None
    requested_bytes: int | None
    reserved_bytes: int
    allocated_bytes: int
    peak_reserved_bytes: int
    peak_allocated_bytes: int
    distinct_shapes: int
    converged_at: int | None = None
    steps_skipped: int = 0
    capture_s: float = 0.0
    replay_s: float = 0.0
    message: str | None = None
    oom_message: str | None = None
    per_step: list[tuple[int, int, int, int]] = field(default_factory=list, repr=False)

    @property
    def cached_unused_bytes(self) -> int:
        """Reserved minus allocated at the failure (or the end), in bytes."""
        return self.reserved_bytes - self.allocated_bytes

    @property
    def fragmentation_failure(self) -> bool:
        """The failing request would have fit in the cached-but-unused memory had it been one
        block: reserved - allocated >= requested (the classifier's fragmentation rule)."""
        return (not self.passed and self.requested_bytes is not None
                and self.cached_unused_bytes >= self.requested_bytes)


def soak_supported(workload_cfg: Mapping[str, Any]) -> bool:
    """Whether the soak can run ``workload_cfg``: a built-in workload (``target`` absent or
    ``builtin``) trained by one process, or a python entry that declares a shape distribution
    (``target.seq_len`` / ``target.image_size`` with ``make_batch``: :mod:`oomtune.targets.python_entry`).
    Commands (``cmd``) and python entries without one are not soaked, nor is a distributed workload
    (``model.parallel``): capturing each shape of one rank would need its collectives."""
    from oomtune.trial._base import find_target, target_name
    from oomtune.workload_spec import WorkloadSpec

    target = find_target(target_name(workload_cfg))   # the target says (Target.can_soak)
    return target is not None and target.can_soak(WorkloadSpec.from_dict(workload_cfg))


def capture_soak(workload_cfg: Mapping[str, Any], batch_size: int, steps: int, *,
                 capture_device: str = "meta", derive: bool = True) -> SoakStreams:
    """Capture the streams a soak of ``steps`` steps replays (each distinct shape once).

    Args:
        workload_cfg: the ``model`` group as a plain mapping (a built-in workload; ``data`` is
            forced to synthetic: the shapes come from the distribution, the content does not matter).
        batch_size: samples per step (>= 1).
        steps: the soak's length (>= 1).
        capture_device: ``meta`` (no compute: seconds; falls back to CPU for an op without a meta
            kernel) or ``cpu`` (runs each captured step for real; the kernels a virtual-GPU trial on
            the CPU runs, so the soak's first steps equal that trial's memory exactly: the generic
            meta kernels differ from the CPU's, e.g. CPU attention saves other tensors).
        derive: with many distinct shapes, capture three (plus one check) and derive the others
            exactly (:mod:`oomtune.trial._soak_derive`; falls back to capturing every shape).

    Raises:
        ConfigError: a bad workload config or shape distribution; a non-built-in target; an
            unknown capture device.
    """
    from oomtune.exceptions import ConfigError

    if not soak_supported(workload_cfg):
        raise ConfigError("the soak replays built-in workloads and python entries with a declared shape "
                          "distribution (target.seq_len / target.image_size) only")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"soak steps must be an integer >= 1, got {steps!r}")
    from oomtune.trial._base import target_for
    from oomtune.workload_spec import WorkloadSpec

    spec = WorkloadSpec.from_dict(workload_cfg)
    cfg = target_for(spec).for_capture(spec)   # a built-in workload: synthetic data, no target key
    if capture_device not in ("meta", "cpu"):
        raise ConfigError(f"soak capture device {capture_device!r}: expected meta or cpu")
    t0 = time.perf_counter()
    reason = None
    for device in ("meta", "cpu") if capture_device == "meta" else ("cpu",):
        try:
            out = _capture_on(cfg, batch_size, steps, device, derive)
        except (NotImplementedError, RuntimeError) as exc:
            if device == "cpu":
                raise
            reason = f"meta kernel missing or data-dependent ({str(exc).splitlines()[0][:160]}): captured on cpu"
            print(f"oomtune: note: soak at batch {batch_size}: {reason}", file=sys.stderr, flush=True)
            continue
        out.fallback_reason = reason
        out.capture_s = time.perf_counter() - t0
        return out
    raise AssertionError("unreachable")


def _capture_on(cfg: dict[str, Any], batch_size: int, steps: int, device: str, derive: bool) -> SoakStreams:
    """Capture on ``device`` (``meta`` or ``cpu``), running the target GPU's kernels
    (:func:`oomtune.capture.cuda_kernels.emulate_cuda`, ``cfg["gpu"]``): a built-in workload, or a
    python entry built under ``with torch.device(device)`` (what it creates without a device lands there)."""
    from oomtune.capture.cuda_kernels import emulate_cuda
    from oomtune.capture.gpu_target import target_gpu

    with emulate_cuda(target_gpu(cfg.get("gpu"), cfg.get("gpu_source"))):
        return _capture_emulated(cfg, batch_size, steps, device, derive)


def _capture_emulated(cfg: dict[str, Any], batch_size: int, steps: int, device: str, derive: bool) -> SoakStreams:
    import torch

    from oomtune.capture.blas_workspace import cuda_run_workspaces
    from oomtune.capture.recorder import capture_stream
    from oomtune.capture.gpu_target import target_gpu

    if "target" in cfg:
        from oomtune.trial._base import target_for
        from oomtune.workload_spec import WorkloadSpec

        spec = WorkloadSpec.from_dict(cfg)
        with torch.device(device):
            wl = target_for(spec).build_workload(spec, batch_size, device)
    else:
        from oomtune.workloads import build_workload

        wl = build_workload(cfg, batch_size, device)
    dist = wl.spec.shapes
    shapes = dist.sequence(batch_size, steps)
    # Step 1 exactly as the live trial runs it: what exists is registered, then one step of the
    # workload's own batch iterator (the distribution's first shape), creating the optimizer state.
    # ... with the target GPU's cuBLAS workspaces, as the trial's virtual GPU has them (they stay: the
    # steady steps need none)
    gpu = target_gpu(cfg.get("gpu"), cfg.get("gpu_source"))
    first = capture_stream(lambda: wl.run_steps(1, sync=False), existing=wl.tensors_before_step(),
                           device=device, gpu=gpu, blas_workspaces=cuda_run_workspaces(gpu))
    distinct = list(dict.fromkeys(shapes[1:] or shapes))   # in order of first use

    def capture_shape(shape: Any) -> Any:
        if not dist.is_fixed:
            wl.use_shapes([shape])
        return _capture_steady(wl, device)

    if derive:
        steady, captured = derive_shape_streams(distinct, capture_shape)
    else:
        steady, captured = {s: capture_shape(s) for s in distinct}, len(distinct)
    return SoakStreams(batch_size=batch_size, shapes=shapes, first=first, steady=steady,
                       fixed=dist.is_fixed, shape_key=dist.key, captured_shapes=captured)


def _capture_steady(wl: Any, device: str) -> Any:
    """One steady-state step's stream, without the registration of what already exists (the
    parameters and optimizer state are registered so that in-place updates of them are not taken
    for new storages, then left out: they are already allocated on the soak's virtual GPU)."""
    from oomtune.alloc.stream import AllocationStream
    from oomtune.capture.recorder import StorageRecorder, StreamSink

    sink = StreamSink()
    rec = StorageRecorder(sink, device=device)
    rec.register_existing(wl.tensors_before_step())
    existing = {key for _, key, _, _ in sink.events}
    start = len(sink.events)
    with rec:
        wl.run_steps(1, sync=False)
    stream = AllocationStream()
    for action, key, size, st in sink.events[start:]:
        if key in existing:   # a release of persistent state inside a steady step: not modelled
            continue
        stream.append(action, key, size, st)
    return stream


def replay_soak(streams: SoakStreams, settings: AllocatorSettings | str | None = None, *,
                device_memory_bytes: int | None = None, memory_fraction: float = 1.0,
                non_allocator_bytes: int = 0, new_sim: Callable[[], Any] | None = None,
                record_steps: bool = False) -> SoakResult:
    """Replay captured soak streams step by step on one virtual GPU (state carried across steps).

    Args:
        streams: from :func:`capture_soak`.
        settings: allocator settings (``AllocatorSettings``, a PYTORCH_CUDA_ALLOC_CONF string, None
            for torch's defaults).
        device_memory_bytes: the simulated device's capacity in bytes.
        memory_fraction: ``set_per_process_memory_fraction`` (1.0: never set), as the trial applies it.
        non_allocator_bytes: device memory outside the allocator, in bytes.
        new_sim: instead of the three figures and ``settings``: a function returning a fresh virtual
            GPU with ``CachingAllocatorSim``'s public API (the trial passes the one its own steps ran on, e.g.
            :func:`oomtune.capture.virtual_gpu.budgeted_sim`).
        record_steps: fill ``SoakResult.per_step``.

    Raises:
        ConfigError / AllocatorConfigError: bad device figures or settings; neither
            ``device_memory_bytes`` nor ``new_sim``.
    """
    from oomtune.alloc.oom_message import SimulatedOutOfMemoryError
    from oomtune.alloc._compiled import make_simulator
    from oomtune.exceptions import ConfigError

    if new_sim is not None:
        sim = new_sim()
    elif device_memory_bytes is None:
        raise ConfigError("replay_soak needs device_memory_bytes or new_sim")
    else:
        sim = make_simulator(settings, total_memory_bytes=device_memory_bytes,
                             non_allocator_bytes=non_allocator_bytes)
        if memory_fraction != 1.0:
            sim.set_per_process_memory_fraction(memory_fraction)
    steps = len(streams.shapes)
    t0 = time.perf_counter()
    per_step: list[tuple[int, int, int, int]] = []
    failure: tuple[int, SimulatedOutOfMemoryError] | None = None
    converged_at = previous = None
    memo = _memo_allowed(sim)
    loops: set[tuple[Any, Any]] = set()   # (state, shape) whose step returned to the same state
    state = None
    done = skipped = 0
    for k in range(1, steps + 1):
        shape = streams.shapes[k - 1]
        if memo and k > 1 and (state, shape) in loops:
            skipped += 1   # the step would repeat exactly: same start state, same stream
        else:
            stream = streams.first if k == 1 else streams.steady[shape]
            try:
                _replay_step(sim, stream)
            except SimulatedOutOfMemoryError as exc:
                failure = (k, exc)
                break
            if memo:
                after = _state_key(sim)
                if after == state:
                    loops.add((state, shape))
                state = after
        done = k
        if record_steps:
            st = sim.memory_stats()
            per_step.append((st["allocated_bytes.all.current"], st["reserved_bytes.all.current"],
                             st["allocated_bytes.all.peak"], st["reserved_bytes.all.peak"]))
        if streams.fixed and k >= 2 and k < steps:
            snapshot = _state_key(sim) if state is None else state
            if snapshot == previous:   # this step started and ended in the same state: all repeat it
                converged_at, done = k, steps
                break
            previous = snapshot
    stats = sim.memory_stats()
    result = SoakResult(
        passed=failure is None, steps=steps, steps_run=done, failed_step=None, shape_at_failure=None,
        shape_key=streams.shape_key, requested_bytes=None, reserved_bytes=sim.reserved_bytes,
        allocated_bytes=sim.allocated_bytes, peak_reserved_bytes=stats["reserved_bytes.all.peak"],
        peak_allocated_bytes=stats["allocated_bytes.all.peak"], distinct_shapes=len(streams.steady),
        converged_at=converged_at, capture_s=streams.capture_s, replay_s=time.perf_counter() - t0,
        steps_skipped=skipped, per_step=per_step)
    if failure is not None:
        k, exc = failure
        result.failed_step, result.shape_at_failure = k, streams.shapes[k - 1]
        result.requested_bytes = exc.requested_bytes
        if exc.reserved_bytes is not None:
            result.reserved_bytes, result.allocated_bytes = exc.reserved_bytes, exc.allocated_bytes
        result.oom_message = str(exc).splitlines()[0] if str(exc) else None
        result.message = _failure_message(result)
    return result


def _memo_allowed(sim: Any) -> bool:
    """Whether a step's outcome depends only on what :func:`_state_key` sees. Not with
    ``garbage_collection_threshold``: its cached blocks' ages (``gc_count``) are state the snapshot
    does not show."""
    settings = sim.settings
    if settings is None or isinstance(settings, str):
        settings = AllocatorSettings.parse(settings or "")
    return not settings.garbage_collection_threshold   # 0.0 (torch default): off


def _state_key(sim: Any) -> tuple:
    """The allocator's state between steps, from ``memory_snapshot()``: every segment (address,
    size, stream, pool, expandable) and its blocks (address, size, allocated or free), hashable."""
    return tuple((seg["address"], seg["total_size"], seg["stream"], seg["segment_type"], seg["is_expandable"],
                  tuple((b["address"], b["size"], b["state"]) for b in seg["blocks"]))
                 for seg in sim.memory_snapshot())


def _replay_step(sim: Any, stream: Any) -> None:
    """Feed one step's stream to ``sim`` (keys are local to the stream; allocations the stream does
    not free stay allocated: the parameters and optimizer state of step 1)."""
    malloc, free = sim.malloc, sim.free
    addr_of: dict[int, int] = {}
    for a, key, size, st in zip(stream.actions, stream.keys, stream.sizes, stream.streams):
        if a == 0:
            addr_of[key] = malloc(size, st)
        else:
            addr = addr_of.pop(key, None)
            if addr is not None:
                free(addr)


def _failure_message(r: SoakResult) -> str:
    from oomtune.units import format_bytes

    shape = f" ({r.shape_key}={r.shape_at_failure})" if r.shape_key else ""
    unused = r.cached_unused_bytes
    why = ("fragmentation: reserved - allocated = "
           f"{format_bytes(unused)} >= the {format_bytes(r.requested_bytes or 0)} request, in pieces too small"
           if r.fragmentation_failure else
           f"reserved - allocated = {format_bytes(unused)} < the {format_bytes(r.requested_bytes or 0)} request")
    return (f"out of memory at soak step {r.failed_step}/{r.steps}{shape}: reserved {format_bytes(r.reserved_bytes)}, "
            f"allocated {format_bytes(r.allocated_bytes)}; {why} (simulated)")


def soak(workload_cfg: Mapping[str, Any], batch_size: int, settings: AllocatorSettings | str | None = None, *,
         device_memory_bytes: int | None = None, memory_fraction: float = 1.0, non_allocator_bytes: int = 0,
         new_sim: Callable[[], Any] | None = None, steps: int = 2000, capture_device: str = "meta",
         record_steps: bool = False) -> SoakResult:
    """Soak a candidate for ``steps`` training steps on the virtual GPU: :func:`capture_soak` then
    :func:`replay_soak` (see the module docstring). The shape sequence is the distribution's seeded
    one (``seed`` inside the ``seq_len`` / ``image_size`` mapping), so the answer is the same run
    after run.

    Args:
        workload_cfg: the ``model`` group (plain mapping) of a built-in workload.
        batch_size: samples per step.
        settings: allocator settings (object, string or None).
        device_memory_bytes / memory_fraction / non_allocator_bytes: the virtual GPU, as the trial's
            (or ``new_sim``, see :func:`replay_soak`).
        new_sim: a function returning a fresh virtual GPU (replaces the figures; see :func:`replay_soak`).
        steps: soak length in steps (step 1 is the live trial's first, warm-up, step).
        capture_device: ``meta`` or ``cpu`` (see :func:`capture_soak`).
        record_steps: keep per-step figures in ``SoakResult.per_step``.

    Raises:
        ConfigError: bad workload config, a non-built-in target, steps < 1.
        AllocatorConfigError: malformed settings.
    """
    streams = capture_soak(workload_cfg, batch_size, steps, capture_device=capture_device)
    return replay_soak(streams, settings, device_memory_bytes=device_memory_bytes,
                       memory_fraction=memory_fraction, non_allocator_bytes=non_allocator_bytes,
                       new_sim=new_sim, record_steps=record_steps)
