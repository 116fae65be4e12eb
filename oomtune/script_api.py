"""The tiny API a user's own training script calls when ``target=cmd`` runs it.

Two functions, both no-ops when oomtune did not launch the script (``OOMTUNE_RESULT_FILE`` unset),
so the script runs the same with or without oomtune::

    import oomtune
    hook = oomtune.capture_hook(model=model, optimizer=optimizer)   # CPU: virtual GPU; else no-op
    ...warm-up steps...
    t0 = time.perf_counter(); ...N measured steps...
    oomtune.report(samples=N * batch_size, seconds=time.perf_counter() - t0)

The results channel is a JSON-lines file named by ``OOMTUNE_RESULT_FILE``; every call appends one
line (``{"event": "report" | "memory" | "oom", ...}``, with ``"rank"`` from ``RANK`` in a process
started by torchrun, accelerate or deepspeed, or from ``torch.distributed`` once the script (or
Lightning's own DDP launcher, which sets no ``RANK``) initialised it: each rank reports its own
samples and its own virtual GPU's memory) and the parent
(:func:`oomtune.targets.cmd.run_cmd_trial`) reads them after the script exits.

With ``OOMTUNE_STREAM_FILE`` set (the parent sets it for every trial), the capture hook also writes
the allocation stream it fed the virtual GPU (an :class:`oomtune.alloc.stream.AllocationStream`
file, plus ``<file>.json`` describing it), so the parent can replay the trial's step under every
allocator configuration without running it again (:mod:`oomtune.plan.recorded`).

The frameworks' integrations (:mod:`oomtune.integrations`) call these for the script: one callback
or iterator, and :func:`trial_settings` tells them what the trial asks (micro-batch, accumulation,
activation checkpointing, warm-up and measured steps).

Importing this module costs nothing: it never imports torch. :func:`report` reads memory only from a
torch that the script already imported (``sys.modules``); :func:`capture_hook` imports torch (it is
called from torch scripts).
"""

from __future__ import annotations

import atexit
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["report", "capture_hook", "launched", "trial_settings", "TrialSettings", "CaptureHook",
           "RESULT_FILE_ENV", "BUDGET_ENV", "BATCH_SIZE_ENV", "DEVICE_ENV", "GPU_ENV", "GRAD_ACCUM_ENV",
           "GLOBAL_BATCH_ENV", "CHECKPOINTING_ENV", "STREAM_FILE_ENV", "WARMUP_ENV", "MEASURE_ENV", "EXECUTE_ENV",
           "META_UNSUPPORTED_EVENT"]

#: The JSON-lines results file the parent reads (set only when oomtune launched the script).
RESULT_FILE_ENV = "OOMTUNE_RESULT_FILE"
#: The trial's device-memory budget in bytes (unset when the trial has none).
BUDGET_ENV = "OOMTUNE_BUDGET_BYTES"
#: The virtual GPU's capacity in bytes (``virtual_device_memory``) for a CPU trial; the budget is a
#: memory fraction of it, as on CUDA (unset: the budget is the capacity).
DEVICE_MEMORY_ENV = "OOMTUNE_DEVICE_MEMORY_BYTES"
#: The trial's batch size (also substituted for ``{batch_size}`` in the command).
BATCH_SIZE_ENV = "OOMTUNE_BATCH_SIZE"
#: ``"cpu"`` or ``"cuda"`` (the one device made visible to the script).
DEVICE_ENV = "OOMTUNE_DEVICE"
#: The target GPU (``model.gpu``) whose kernels the virtual GPU of :func:`capture_hook` runs.
GPU_ENV = "OOMTUNE_GPU"
#: Micro-batches per optimizer step (``{grad_accum}`` in the command; 1 without a global batch).
GRAD_ACCUM_ENV = "OOMTUNE_GRAD_ACCUM"
#: The global batch (``search.global_batch``; unset without one).
GLOBAL_BATCH_ENV = "OOMTUNE_GLOBAL_BATCH"
#: ``1``/``0``: activation checkpointing on or off (unset when not searched).
CHECKPOINTING_ENV = "OOMTUNE_ACTIVATION_CHECKPOINTING"
#: Where the capture hook writes the allocation stream of the trial's steps (unset: not written).
STREAM_FILE_ENV = "OOMTUNE_STREAM_FILE"
#: Warm-up and measured optimizer steps of the trial.
WARMUP_ENV, MEASURE_ENV = "OOMTUNE_WARMUP_STEPS", "OOMTUNE_MEASURE_STEPS"
#: Where a CPU trial's steps run (``meta``: an integration runs them on the meta device,
#: :mod:`oomtune.integrations._meta`; ``cpu`` or unset: for real on the CPU).
EXECUTE_ENV = "OOMTUNE_EXECUTE"
#: The channel event of a trial whose steps could not run on meta (the parent runs it again on the CPU).
META_UNSUPPORTED_EVENT = "meta_unsupported"

#: Virtual-GPU capacity when no budget is given: large enough never to run out.
_UNBOUNDED_SIM_BYTES = 1 << 50
_ACTIVE: list["CaptureHook"] = []   # the running hook (at most one per process)


def launched() -> bool:
    """True when oomtune launched this process as a ``target=cmd`` trial (``OOMTUNE_RESULT_FILE`` set)."""
    return bool(os.environ.get(RESULT_FILE_ENV))


@dataclass(frozen=True)
class TrialSettings:
    """What an oomtune trial asks of the script (read from its environment, see
    :func:`trial_settings`).

    Attributes:
        batch_size: samples per micro-batch on each rank.
        grad_accum: micro-batches per optimizer step (1 without ``search.global_batch``).
        global_batch: the global batch (None without one).
        activation_checkpointing: True/False when the search varies it, None when not.
        warmup_steps / measure_steps: optimizer steps before timing / timed.
        device: ``"cpu"`` (the virtual GPU) or ``"cuda"``.
        execute: on the virtual GPU, where the steps run: ``"meta"`` (no arithmetic, through an
            integration) or ``"cpu"`` (for real).
    """

    batch_size: int
    grad_accum: int = 1
    global_batch: int | None = None
    activation_checkpointing: bool | None = None
    warmup_steps: int = 1
    measure_steps: int = 3
    device: str = "cpu"
    execute: str = "cpu"


def _env_int(name: str, default: int | None, minimum: int) -> int | None:
    from oomtune.exceptions import ConfigError

    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise ConfigError(f"{name}={raw!r}: expected an integer >= {minimum} (set by oomtune for its trials)")
    return value


def trial_settings() -> TrialSettings | None:
    """The trial's settings when oomtune launched this process (None otherwise): ``OOMTUNE_BATCH_SIZE``,
    ``OOMTUNE_GRAD_ACCUM``, ``OOMTUNE_GLOBAL_BATCH``, ``OOMTUNE_ACTIVATION_CHECKPOINTING``,
    ``OOMTUNE_WARMUP_STEPS``, ``OOMTUNE_MEASURE_STEPS``, ``OOMTUNE_DEVICE``.

    Raises:
        ConfigError: a malformed value (not written by oomtune).
    """
    if not launched():
        return None
    ckpt = os.environ.get(CHECKPOINTING_ENV)
    return TrialSettings(
        batch_size=_env_int(BATCH_SIZE_ENV, 1, 1), grad_accum=_env_int(GRAD_ACCUM_ENV, 1, 1),
        global_batch=_env_int(GLOBAL_BATCH_ENV, None, 1),
        activation_checkpointing=None if ckpt in (None, "") else ckpt not in ("0", "false", "False"),
        warmup_steps=_env_int(WARMUP_ENV, 1, 0), measure_steps=_env_int(MEASURE_ENV, 3, 1),
        device=os.environ.get(DEVICE_ENV, "cpu"),
        execute="meta" if os.environ.get(EXECUTE_ENV) == "meta" and os.environ.get(DEVICE_ENV, "cpu") == "cpu" else "cpu")


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) from ``torch.distributed`` when the script initialised it, else from the
    launcher's ``RANK`` / ``WORLD_SIZE`` environment (torchrun, accelerate, deepspeed set them in every
    rank), else (0, 1). Never imports torch (a script that uses distributed training imported it
    already)."""
    torch = sys.modules.get("torch")
    try:
        dist = torch.distributed if torch is not None else None
        if dist is not None and dist.is_available() and dist.is_initialized():
            return int(dist.get_rank()), int(dist.get_world_size())
    except Exception:   # a broken process group must not break the report
        pass
    rank, world = os.environ.get("RANK", ""), os.environ.get("WORLD_SIZE", "")
    if rank.isdigit():
        return int(rank), int(world) if world.isdigit() and int(world) > int(rank) else int(rank) + 1
    return 0, 1


def _append(record: dict[str, Any]) -> None:
    """Append one JSON line to the results file (one ``write`` call, flushed and closed at once, so a
    line is whole even if the process is killed right after)."""
    path = os.environ.get(RESULT_FILE_ENV)
    if not path:
        return
    if "rank" not in record:
        # torchrun, accelerate and deepspeed set RANK in every rank's environment; Lightning's own DDP
        # launcher does not (only LOCAL_RANK / NODE_RANK / WORLD_SIZE, lightning/pytorch/strategies/
        # launchers/subprocess_script.py): there the rank comes from the process group it initialised
        rank, world = rank_and_world()
        if world > 1 or os.environ.get("RANK", "").isdigit():
            record["rank"] = rank
            record.setdefault("world_size", world)
    line = json.dumps(record, sort_keys=True, default=str) + "\n"
    with open(path, "a", encoding="utf-8") as f:
        f.write(line)


def _number(name: str, value: Any, *, positive: bool) -> float:
    from oomtune.exceptions import ConfigError

    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
        raise ConfigError(f"oomtune.report({name}={value!r}): expected a finite number {bound}")
    return float(value)


def report(samples: int, seconds: float, *, steps: int | None = None,
           data_wait_seconds: float | None = None, **extra: Any) -> None:
    """Report the throughput of measured training steps to oomtune (``target=cmd``).

    Call it once after the measured steps (or once per measured interval: the parent sums samples and
    seconds over one process's calls). Leave warm-up steps out. ``throughput = samples / seconds``.
    In a multi-process run every rank reports the samples it trained itself (its share of the
    global batch); the trial's throughput is ``sum over ranks of samples / the slowest rank's
    seconds`` (every sample counted once).

    Args:
        samples: training samples processed in the interval (images, sequences), >= 0.
        seconds: wall time of the interval in seconds, > 0 (synchronise the device before reading
            the clock on CUDA).
        steps: optimizer steps in the interval (for the mean step time), optional.
        data_wait_seconds: part of ``seconds`` spent waiting for the next batch (``next(loader)``),
            optional; gives the data-wait fraction used by the input-bound diagnosis.
        **extra: any JSON-serialisable values, kept in the trial record's ``script.reported``.

    Under ``torch.distributed`` every rank may report; the parent counts the samples of each
    rank's lines (the integrations report the global samples from rank 0 only, so that they are
    counted once), and each line carries its ``rank`` and ``world_size``.

    Returns None. Does nothing (no error, no torch import) when oomtune did not launch the script.
    Memory peaks are added from the running :func:`capture_hook` (``"simulated"``) or, when the
    script initialised CUDA, from ``torch.cuda.memory_stats()`` (``"device"``).

    Raises:
        ConfigError: (only under oomtune) a negative, non-finite or non-numeric figure, or
            ``seconds == 0``.
    """
    if not launched():
        return None
    rank, world = rank_and_world()
    record: dict[str, Any] = {
        "event": "report", "time": time.time(), "rank": rank, "world_size": world,
        "samples": _number("samples", samples, positive=False),
        "seconds": _number("seconds", seconds, positive=True),
        "steps": None if steps is None else int(_number("steps", steps, positive=False)),
        "data_wait_seconds": (None if data_wait_seconds is None
                              else _number("data_wait_seconds", data_wait_seconds, positive=False)),
        "extra": extra,
    }
    memory = _memory_now()
    if memory is not None:
        record["memory"] = memory
    _append(record)
    return None


def _memory_now() -> dict[str, Any] | None:
    """``{"source": "simulated" | "device", "stats": {memory_stats keys}}`` or None when unknown."""
    if _ACTIVE and _ACTIVE[-1].sim is not None:
        return {"source": "simulated", "stats": _ACTIVE[-1].sim.memory_stats()}
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if torch.cuda.is_initialized():
            return {"source": "device", "stats": dict(torch.cuda.memory_stats())}
    except Exception:  # a broken CUDA state must not break the report
        return None
    return None


class _RecordingSim:
    """Forwards to the simulator; writes an ``oom`` line before a simulated OOM propagates.

    Only the process that started the hook feeds the simulator: a forked child (a DataLoader
    worker inherits the dispatch mode) allocates host memory, not device memory, so its requests
    get placeholder addresses and never raise.
    """

    def __init__(self, sim: Any, hook: Any = None) -> None:
        self.sim = sim
        self.hook = hook
        self.pid = os.getpid()
        self._foreign = 0

    def malloc(self, size_bytes: int, stream: int = 0) -> int:
        import torch

        if os.getpid() != self.pid:
            self._foreign += 1
            return -self._foreign
        try:
            return self.sim.malloc(size_bytes, stream=stream)
        except torch.OutOfMemoryError as exc:
            if self.hook is not None:
                self.hook._oom = True
            _append({"event": "oom", "time": time.time(), "message": str(exc),
                     "requested_bytes": getattr(exc, "requested_bytes", None),
                     "memory": {"source": "simulated", "stats": self.sim.memory_stats()}})
            raise

    def free(self, addr: int) -> None:
        if addr >= 0 and os.getpid() == self.pid:
            self.sim.free(addr)


class CaptureHook:
    """The virtual GPU for a user's script on a machine without CUDA (see :func:`capture_hook`).

    Attributes:
        sim: the virtual GPU (``make_simulator``'s: ``CachingAllocatorSim``'s API; None when inactive).
        active: True while storages are being sent to the simulator.
        reason: why the hook is inactive (None when active).

    Usable as a context manager (stops at exit) or left running until the process exits.
    """

    def __init__(self, tensors: list[Any], reason: str | None, device: str = "cpu") -> None:
        self.sim: Any = None
        self.device = device   # the device type whose storages stand for GPU memory: cpu, or meta
        self.reason = reason
        self._vgpu: Any = None
        self._tee: Any = None
        self._oom = False
        self._cuda_history = False   # recording torch.cuda.memory's history (CUDA, a stream file asked for)
        #: the framework's precision setting (``bf16``, ``fp16``, ``bf16-mixed``, ...) when an integration
        #: knows it: written with the recorded stream, for captures that follow the GPU's autocast policy
        self.precision: str | None = None
        if reason is None:
            self._start(tensors)

    @property
    def active(self) -> bool:
        return self._vgpu is not None

    def _start(self, tensors: list[Any]) -> None:
        from oomtune.alloc.settings import AllocatorSettings
        from oomtune.alloc._compiled import make_simulator
        from oomtune.capture.virtual_gpu import VirtualGPU, budgeted_sim

        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", os.environ.get("PYTORCH_ALLOC_CONF", ""))
        budget = os.environ.get(BUDGET_ENV)
        device = os.environ.get(DEVICE_MEMORY_ENV)
        if budget:  # the budget as a memory fraction of the virtual device, as a builtin CPU trial
            self.sim = budgeted_sim(AllocatorSettings.parse(conf), int(budget), int(device) if device else None)
        else:
            self.sim = make_simulator(AllocatorSettings.parse(conf), total_memory_bytes=_UNBOUNDED_SIM_BYTES)
        self._pid = os.getpid()
        if os.environ.get(STREAM_FILE_ENV):
            from oomtune.capture.recorder import StreamSink

            self._tee = StreamSink()
        self._recording_sim = _RecordingSim(self.sim, self)
        # the target GPU's cuBLAS workspaces: the main thread's once the hook's tensors are registered (as a
        # trial's virtual GPU has it, so a recording agrees with a plan of the same step), the autograd
        # thread's at its first backward BLAS op
        self._vgpu = VirtualGPU(self._recording_sim, device=self.device, gpu=os.environ.get(GPU_ENV) or None,
                                tee=self._tee, blas_workspaces="default")
        _ACTIVE.append(self)
        self._vgpu.__enter__()
        try:
            self._vgpu.register(tensors)   # may raise the simulated OOM (already written as a line)
        except BaseException:
            # the caller never receives a hook that failed to start, so nothing else could stop it: stop it
            # here (its ``memory`` line written, the virtual GPU's dispatch mode left, no longer active),
            # so that a process that catches the error goes on as before the call
            self.stop()
            raise

    def register(self, *tensors: Any) -> int:
        """Allocate the storages of tensors that exist already and are not yet on the virtual GPU
        (each storage once; e.g. an optimizer's state created before the hook): returns how many.
        Does nothing when inactive.

        Raises:
            torch.OutOfMemoryError: they do not fit (simulated).
        """
        if self._vgpu is None:
            return 0
        flat: list[Any] = []
        for t in tensors:
            flat += list(t) if isinstance(t, (list, tuple)) else [t]
        return self._vgpu.register(flat)

    def _write_stream(self, stream: Any = None, source: str | None = None) -> None:
        """Write the recorded stream (the virtual GPU's, or ``stream``) and its marks
        (``OOMTUNE_STREAM_FILE`` and ``<file>.json``), unless the run ran out of memory (an incomplete
        stream would mislead the predictions)."""
        path = os.environ.get(STREAM_FILE_ENV)
        if stream is None and self._tee is not None:
            stream = self._tee.to_stream()
        if not path or stream is None or self._oom:
            return
        rank, world = rank_and_world()
        if rank > 0:   # each rank its own file: the search replays the worst rank's (oomtune.targets.cmd)
            path = f"{path}.rank{rank}"
        stream.save(path)
        source = source or f"capture_hook ({self.device})"
        meta = {"format": "oomtune-recorded-stream", "version": 1, "source": source,
                "rank": rank, "world_size": world, "events": len(stream), "precision": self.precision}
        with open(path + ".json", "w", encoding="utf-8") as f:
            json.dump(meta, f)

    def _start_cuda_history(self, torch: Any) -> None:
        """On CUDA: record the caching allocator's history (every request it serves) from now on,
        for the stream written at :meth:`stop` (``torch.cuda.memory._record_memory_history``; no
        stack traces: only the requests are needed)."""
        torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python")
        self._cuda_history = True
        self._pid = os.getpid()
        _ACTIVE.append(self)

    def _stop_cuda_history(self) -> None:
        """Take the history (``torch.cuda.memory._snapshot()``), stop recording, and write it as the
        trial's stream (:func:`oomtune.trace.to_stream.stream_from_snapshot`) unless the device ran out
        of memory (an ``oom`` entry: the stream is incomplete)."""
        import torch

        self._cuda_history = False
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        try:
            snapshot = torch.cuda.memory._snapshot()
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
        from oomtune.trace.to_stream import stream_from_snapshot

        device = torch.cuda.current_device()
        traces = snapshot.get("device_traces") or []
        if device < len(traces) and any(e.get("action") == "oom" for e in traces[device]):
            self._oom = True
            return
        self._write_stream(stream_from_snapshot(snapshot, device), source="torch.cuda.memory history (cuda)")

    def stop(self) -> None:
        """Stop recording and write the final memory peaks as a ``memory`` line (idempotent); on
        CUDA, write the recorded history as the trial's stream."""
        if self._cuda_history and os.getpid() == self._pid:
            self._stop_cuda_history()
            return
        if self._vgpu is None or os.getpid() != self._pid:   # a forked child never reports
            return
        vgpu, self._vgpu = self._vgpu, None
        vgpu.__exit__(None, None, None)
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        rank, world = rank_and_world()
        _append({"event": "memory", "time": time.time(), "rank": rank, "world_size": world,
                 "memory": {"source": "simulated", "stats": self.sim.memory_stats()}})
        self._write_stream()

    def __enter__(self) -> "CaptureHook":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _tensors(model: Any, optimizer: Any, tensors: tuple[Any, ...]) -> list[Any]:
    out: list[Any] = []
    if model is not None:
        out += list(model.parameters()) + list(model.buffers())
    if optimizer is not None:
        for state in optimizer.state.values():
            out += [v for v in state.values() if hasattr(v, "untyped_storage")]
    for t in tensors:
        out += list(t) if isinstance(t, (list, tuple)) else [t]
    return out


def capture_hook(model: Any = None, optimizer: Any = None, *tensors: Any, device: str = "cpu") -> CaptureHook:
    """Run the rest of a CPU training script on the virtual GPU, so it runs out of memory where the
    budgeted GPU would.

    Active only when oomtune launched the script (``OOMTUNE_RESULT_FILE``) and CUDA is unavailable:
    a ``CachingAllocatorSim`` of ``OOMTUNE_DEVICE_MEMORY_BYTES`` with ``OOMTUNE_BUDGET_BYTES`` as its
    memory fraction (:func:`oomtune.capture.virtual_gpu.budgeted_sim`; unbounded without a budget) under
    the settings in ``PYTORCH_CUDA_ALLOC_CONF`` receives every CPU storage the script creates on this
    thread from now on (``VirtualGPU``, :mod:`oomtune.capture.virtual_gpu`), after the storages of
    ``model`` (parameters, buffers), ``optimizer`` (existing state) and ``tensors``. A simulated OOM
    (``torch.OutOfMemoryError``, message starting ``[virtual GPU, simulated]``) is raised inside the
    op that does not fit, after an ``oom`` line is written. :func:`report` then carries the
    simulator's ``memory_stats()`` peaks (memory source ``"simulated"``).

    Limits: all CPU tensors of the main thread count as device memory (loader decode and collation
    on the main thread are over-counted; DataLoader workers are separate processes and not counted);
    the target GPU's cuBLAS workspaces are added (:func:`oomtune.capture.blas_workspace.
    cuda_run_workspaces`: the main thread's after the hook's tensors, the autograd thread's at the
    first backward BLAS op), cuDNN's are not (see :mod:`oomtune.capture.recorder`).

    Use as ``hook = capture_hook(model, opt)`` (runs until exit) or ``with capture_hook(model, opt):``.

    ``device="meta"``: the storages of meta tensors stand for GPU memory instead of CPU ones (an
    integration running the steps on meta, :mod:`oomtune.integrations._meta`; CPU tensors, such as
    Adam's host-side step counters, stay off the virtual GPU as on CUDA).

    On CUDA (under oomtune) nothing is simulated; with a budget, the caching allocator is capped at
    it with ``torch.cuda.set_per_process_memory_fraction`` (corrected for the memory outside the
    allocator, field case C9), which initialises CUDA. When the trial asks for its stream
    (``OOMTUNE_STREAM_FILE``), the allocator's history is recorded from here
    (``torch.cuda.memory._record_memory_history``) and written as that stream when the hook stops
    (:mod:`oomtune.trace.to_stream`), for the search's allocator predictions.

    Returns:
        A :class:`CaptureHook` (inactive, with ``reason`` set, when not launched or on CUDA).

    Raises:
        AllocatorConfigError: a malformed ``PYTORCH_CUDA_ALLOC_CONF``.
        torch.OutOfMemoryError: the given tensors alone exceed the budget (simulated).
        RuntimeError: a hook is already active in this process.
        DeviceError: (CUDA) the budget is smaller than the memory outside the allocator.
    """
    if not launched():
        return CaptureHook([], "not launched by oomtune")
    import torch

    if torch.cuda.is_available():
        if _ACTIVE:
            raise RuntimeError("oomtune.capture_hook() is already active in this process")
        fraction = _apply_cuda_budget(torch)
        note = "" if fraction is None else f" (budget applied as memory fraction {fraction:.4f})"
        hook = CaptureHook([], f"CUDA is available: the real device is measured{note}")
        if os.environ.get(STREAM_FILE_ENV):   # the trial's requests, for the allocator predictions
            hook._start_cuda_history(torch)
        return hook
    if _ACTIVE:
        raise RuntimeError("oomtune.capture_hook() is already active in this process")
    return CaptureHook(_tensors(model, optimizer, tensors), None, device)


def _apply_cuda_budget(torch: Any) -> float | None:
    """Cap the caching allocator at ``OOMTUNE_BUDGET_BYTES`` minus the memory outside it, as the
    built-in trial does (``torch.cuda.set_per_process_memory_fraction``, field case C9; see
    :mod:`oomtune.trial.budget`). Initialises CUDA. Returns the fraction, None without a budget.

    Raises:
        DeviceError: the budget does not even hold the memory outside the allocator.
    """
    budget = os.environ.get(BUDGET_ENV)
    if not budget:
        return None
    from oomtune.trial.budget import memory_fraction_for_budget, non_allocator_bytes

    dev = torch.device("cuda", torch.cuda.current_device())
    free, total = torch.cuda.mem_get_info(dev)
    outside = non_allocator_bytes(total, free, torch.cuda.memory_reserved(dev))
    fraction = memory_fraction_for_budget(int(budget), torch.cuda.get_device_properties(dev).total_memory,
                                          outside)
    torch.cuda.set_per_process_memory_fraction(fraction, dev)
    return fraction


@atexit.register
def _stop_at_exit() -> None:
    for hook in list(_ACTIVE):
        try:
            hook.stop()
        except Exception:  # never turn a clean exit into a failure
            pass
