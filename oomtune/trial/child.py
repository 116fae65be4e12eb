"""The trial process: one training trial, measured, written as one structured record.

Run as ``python -m oomtune.trial.child SPEC.json RESULT.json`` (a fresh interpreter, the ``spawn``
launcher) or in-process through :func:`run_child` (a process forked from the fork server,
:mod:`oomtune.trial.forkserver`). Either way the process is used for one trial only.

Order of events (each step must precede the next):

1. The parent has put the allocator string into BOTH ``PYTORCH_CUDA_ALLOC_CONF`` and
   ``PYTORCH_ALLOC_CONF`` (torch reads only the first one set, and which one first differs between
   versions; pytorch#183387) and, for ``cuda:N``, ``CUDA_VISIBLE_DEVICES`` naming one device (field
   case C10). The child re-checks both against the spec before anything touches CUDA.
2. Torch's parsed allocator config is read back (``torch._C._accelerator_getAllocatorSettings``,
   which on torch 2.14 parses the environment at its first call, not at ``import torch``) and must
   equal the spec's string; on CUDA the settings in effect are also read from the allocator itself
   (:func:`oomtune.alloc.settings.effective_settings`). A mismatch is an ``error`` record
   ``allocator settings did not take effect: expected ..., torch reports ...``.
3. CUDA: init + cuBLAS warm-up, non-allocator memory measured, the budget applied as a memory
   fraction corrected for it (field case C9, :mod:`oomtune.trial.budget`).
   CPU: a virtual GPU (:func:`oomtune.capture.virtual_gpu.budgeted_sim`: a device of
   ``device_memory_bytes`` with the budget as a memory fraction, as on CUDA) sees every storage
   of the run, so out-of-memory is raised inside the step; figures are ``"simulated"``. The steps
   run the kernels of the workload's target GPU (``model.gpu``: attention, dropout, autocast,
   optimizers; :func:`oomtune.capture.cuda_kernels.emulate_cuda`), recorded in ``execution.kernels``.
4. Warm-up steps, then measured steps (each followed by a device sync).
5. With ``spec.soak_steps``, the virtual-GPU soak (:mod:`oomtune.trial.soak_check`): running out of
   memory at soak step k makes the trial infeasible (outcome ``oom`` / ``oom_fragmentation``).

Every exception is classified (:func:`oomtune.classify.classify_exception`) and written as the
record; the process exits 0 after writing a record, also for OOM.

Test hook (tests only): ``OOMTUNE_TEST_HOOK`` makes the child misbehave on purpose right before the
first step (see :func:`_run_test_hook`): ``sleep:S`` (starts a ``sleep`` grandchild, then sleeps S
seconds), ``setsid:S`` (the same with a grandchild in its own session), ``signal:N`` (kills itself with signal N), ``raise:ValueError``, ``echo_env`` (copies the
allocator/device environment into ``allocator.environment``), ``bad_fork`` (in a process forked from the fork
server only: raises torch's "Cannot re-initialize CUDA in forked subprocess"), ``hold:BYTES``
(allocates BYTES and keeps them: on a CPU trial, memory of its virtual GPU), ``window:S`` (a time
window of S seconds for the measured steps, as ``measure_seconds``). ``rankR:HOOK`` applies
HOOK in rank R of a distributed trial only (:mod:`oomtune.trial.ranks`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import platform
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

from oomtune.alloc.caching_env import ALLOC_CONF_ENV
from oomtune.alloc.settings import AllocatorSettings
from oomtune.classify import classify_exception
from oomtune.outcome import Outcome
from oomtune.trial.budget import memory_fraction_for_budget, non_allocator_bytes
from oomtune.trial.procwait import process_start_time
from oomtune.trial.record import (MEMORY_SOURCE_DEVICE, MEMORY_SOURCE_SIMULATED, PROGRESS_FILE, TORCH_THREADS_ENV,
                                  DeviceInfo, EnvVar, KernelsRan, MemoryReadings, OomDetails, ResultDraft,
                                  StoppedOverLimit, TrialResult, TrialSpec, write_progress)
from oomtune.trial.soak_check import live_workload, run_soak, soak_verdict

__all__ = ["run_child", "main", "ALLOC_ENV_VARS", "TEST_HOOK_ENV", "SettingsMismatchError"]

#: The environment variables carrying the allocator string (:data:`oomtune.alloc.caching_env.ALLOC_CONF_ENV`);
#: both get the identical value.
ALLOC_ENV_VARS = ALLOC_CONF_ENV
#: Test-only hook (see the module docstring). Never set in production.
TEST_HOOK_ENV = "OOMTUNE_TEST_HOOK"
_TRACEBACK_LINES = 20


class SettingsMismatchError(RuntimeError):
    """The allocator environment or the settings torch reports differ from the spec (setup fault)."""


def _apply_thread_limit(rec: ResultDraft) -> None:
    """``torch.set_num_threads`` from :data:`TORCH_THREADS_ENV` (a forked child inherits the fork
    server's thread count, so the variable is applied here rather than through OMP_NUM_THREADS)."""
    value = os.environ.get(TORCH_THREADS_ENV, "")
    if value.isdigit() and int(value) >= 1:
        torch.set_num_threads(int(value))
        rec.update("process", torch_threads=int(value))


def run_child(spec: TrialSpec, *, process_start: float | None = None) -> TrialResult:
    """Run one trial in this process and return its record; never raises for trial failures.

    Args:
        spec: the trial to run.
        process_start: ``time.time()`` when this process started; default: read from /proc
            (10 ms resolution; for a forked process, the fork), else the time of this call.

    Returns:
        The :class:`TrialResult`; ``outcome`` is ``ok`` or the classified failure.
    """
    start = process_start if process_start is not None else process_start_time()
    cuda = spec.device.startswith("cuda")
    rec = ResultDraft(TrialResult(
        outcome=Outcome.ERROR,
        memory=MemoryReadings(source=MEMORY_SOURCE_DEVICE if cuda else MEMORY_SOURCE_SIMULATED),
        batch_size=spec.batch_size,
        alloc_conf=spec.alloc_conf,
    ))
    rec.update("process", pid=os.getpid())
    _apply_thread_limit(rec)
    stats: list[Callable[[], dict[str, Any]]] = []  # filled once the memory source exists
    try:
        _check_alloc_env(spec)
        _check_torch_parsed(spec, rec)
        runner = _run_cuda if cuda else _run_cpu
        runner(spec, rec, stats, lambda: _run_test_hook(rec))
        rec.set(outcome=Outcome.OK)
        soak_verdict(spec, rec)   # a failed soak makes the trial infeasible
    except SettingsMismatchError as exc:
        rec.set(outcome=Outcome.ERROR, message=str(exc),
                advice="check how the trial process was launched; the settings must be set before CUDA starts")
    except Exception as exc:  # every trial failure becomes the record
        _record_failure(rec, exc, spec)
    finally:
        if stats:
            with contextlib.suppress(Exception):
                rec.result = rec.result.fill_memory_stats(stats[0]())
        first = rec.result.process.first_step_at
        rec.set(startup_s=None if first is None else max(0.0, first - start),
                wall_s=max(0.0, time.time() - start))   # the record refuses a negative time
    return rec.result


def _check_alloc_env(spec: TrialSpec) -> None:
    """The allocator variables and the device pin must be what the spec asks (step 1)."""
    for name in ALLOC_ENV_VARS:
        seen = os.environ.get(name, "")
        if seen != spec.alloc_conf:
            raise SettingsMismatchError(
                f"allocator settings did not take effect: expected {name}={spec.alloc_conf!r}, "
                f"the trial process has {seen!r}"
            )
    if spec.device.startswith("cuda"):
        _pin_cuda_device(spec.device)


def _pin_cuda_device(device: str) -> None:
    """Make ``device`` the only visible device (C10). The runner already sets CUDA_VISIBLE_DEVICES to
    one entry; a direct invocation with none or several is narrowed here, before CUDA init."""
    if torch.cuda.is_initialized():
        raise SettingsMismatchError("CUDA was initialised before the trial pinned its device")
    index = int(device.split(":", 1)[1]) if ":" in device else 0
    visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if "CUDA_VISIBLE_DEVICES" not in os.environ:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(index)
    elif len(visible) > 1:
        if index >= len(visible):
            raise SettingsMismatchError(f"{device} is not among CUDA_VISIBLE_DEVICES={visible}")
        os.environ["CUDA_VISIBLE_DEVICES"] = visible[index].strip()


def _check_torch_parsed(spec: TrialSpec, rec: ResultDraft) -> None:
    """Step 2 (all devices): the string torch's allocator config parsed equals the spec's."""
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    if getter is None:  # older torch: only the CUDA check (effective_settings) applies
        return
    seen = getter()
    rec.update("allocator", torch_alloc_conf=seen)
    if seen != spec.alloc_conf:
        raise SettingsMismatchError(
            f"allocator settings did not take effect: expected {spec.alloc_conf!r}, torch reports {seen!r}"
        )
    rec.set(settings_effective=AllocatorSettings.parse(spec.alloc_conf).as_mapping())


#: Virtual-GPU capacity for a CPU trial without a budget: large enough never to run out.
_UNBOUNDED_SIM_BYTES = 1 << 50


def _run_cpu(spec: TrialSpec, rec: ResultDraft, stats: list, hook: Callable[[], None]) -> None:
    """Train on the virtual GPU (step 3, CPU): the steps run on the CPU for real (``spec.execute``
    ``cpu``) or on the meta device (``meta``: shapes only, no arithmetic, no host memory per tensor;
    no throughput); device memory comes from the virtual GPU either way. A meta run whose first step
    meets an operator without a meta kernel runs again on the CPU, and says so
    (``execution.fallback``)."""
    rec.set(device=cpu_device_info())
    if spec.execute == "meta":
        try:
            _run_virtual(spec, rec, stats, hook, "meta")
            return
        except _NoMetaKernel as exc:
            rec.update("execution", fallback=f"meta kernel missing ({exc}): ran on the CPU")
            stats.clear()
            rec.set(stopped_over_limit=None)
            rec.update("process", first_step_at=None)
    _run_virtual(spec, rec, stats, hook, "cpu")


class _NoMetaKernel(Exception):
    """An operator of the first meta step has no meta kernel (the step cannot run on meta)."""


def _run_virtual(spec: TrialSpec, rec: ResultDraft, stats: list, hook: Callable[[], None], where: str) -> None:
    from oomtune.capture.gpu_target import target_from_workload
    from oomtune.capture.virtual_gpu import VirtualGPU, budgeted_sim
    from oomtune.trial._base import target_for

    rec.update("execution", where=where)
    settings = AllocatorSettings.parse(spec.alloc_conf)

    def new_sim() -> Any:
        if spec.budget_bytes is None:
            return budgeted_sim(settings, None, spec.device_memory_bytes or _UNBOUNDED_SIM_BYTES)
        if not spec.memory_fraction:   # search.memory_fraction=off: a device of the budget's size, no fraction
            return budgeted_sim(settings, spec.budget_bytes, spec.budget_bytes)
        return budgeted_sim(settings, spec.budget_bytes, spec.device_memory_bytes)

    sim = new_sim()
    stats.append(sim.memory_stats)
    if getattr(sim, "allowed_bytes", None) is not None:   # the fraction the virtual GPU applies (< 1)
        rec.update("budget", memory_fraction=sim.allowed_bytes / sim.total_memory_bytes)
    torch.manual_seed(spec.seed)
    device = torch.device(where)
    live = live_workload(spec)
    gpu = target_from_workload(live)   # the GPU whose kernels the steps run (model.gpu)
    # on meta, what the workload's code makes without naming a device lands on meta too (no host memory)
    with (torch.device("meta") if where == "meta" else contextlib.nullcontext()):
        try:
            workload = target_for(live).build_workload(live, spec.batch_size, device)
            # the target GPU's cuBLAS workspaces are allocator memory of the CUDA run it stands for
            with VirtualGPU(sim, device=where, gpu=gpu, blas_workspaces="default") as vgpu:
                vgpu.register(workload.tensors_before_step())
                hook()
                try:
                    _timed_steps(spec, workload, rec, lambda: sim.memory_stats()["reserved_bytes.all.peak"],
                                 timed=where != "meta")
                finally:
                    rec.update("execution", kernels=KernelsRan.from_notes(vgpu.notes) if vgpu.notes is not None
                               else None)
        except (NotImplementedError, RuntimeError) as exc:
            if where == "meta" and not isinstance(exc, torch.OutOfMemoryError) and not rec.result.throughput.steps:
                raise _NoMetaKernel(str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__) from exc
            raise
    if rec.result.stopped_over_limit is not None:
        return
    # The soak on a virtual GPU like this one, captured where the steps ran: its first steps are theirs.
    _progress_phase("soak")
    run_soak(spec, rec, new_sim, capture_device=where)


def _run_cuda(spec: TrialSpec, rec: ResultDraft, stats: list, hook: Callable[[], None]) -> None:
    """Train on the pinned CUDA device under the budget (steps 2-4, CUDA)."""
    from oomtune.alloc.settings import effective_settings
    from oomtune.gpu import nvml
    from oomtune.trial._base import target_for

    dev = torch.device("cuda", 0)  # the only visible device (CUDA_VISIBLE_DEVICES, C10)
    torch.cuda.set_device(dev)
    props = torch.cuda.get_device_properties(dev)
    device, physical = _cuda_device_info(nvml, props, rec)
    rec.set(device=device)
    a = torch.ones((64, 64), device=dev)
    (a @ a).sum().item()  # creates the cuBLAS handle and workspace before measuring (C9)
    del a
    torch.cuda.synchronize(dev)
    _verify_effective(spec, rec, effective_settings())
    rec.update("memory", non_allocator_bytes=_outside_allocator(dev))
    rec.update("budget", non_allocator_bytes_at_start=rec.result.memory.non_allocator_bytes)
    # torch's total (cudaDeviceProp::totalGlobalMem), which set_per_process_memory_fraction multiplies:
    # smaller than NVML's total (A100-80GB: 79.15 GiB vs 80 GiB), so the budget is judged against it
    total = int(props.total_memory)
    rec.update("device", total_memory_bytes=total)
    if spec.budget_bytes is not None and spec.memory_fraction:
        _apply_fraction(spec, rec, dev, total)
    torch.cuda.reset_peak_memory_stats(dev)
    stats.append(lambda: torch.cuda.memory_stats(dev))
    torch.manual_seed(spec.seed)
    live = live_workload(spec)
    workload = target_for(live).build_workload(live, spec.batch_size, dev)
    sampler = nvml.MemorySampler(physical) if physical is not None else contextlib.nullcontext()

    def after_step(done: int) -> None:
        if done == max(1, spec.warmup_steps):
            remeasure_outside_allocator(spec, rec, dev, total)

    try:
        with sampler:
            hook()
            _timed_steps(spec, workload, rec,
                         lambda: torch.cuda.max_memory_reserved(dev) + (rec.result.memory.non_allocator_bytes or 0),
                         on_step=after_step)
    finally:
        reading = getattr(sampler, "result", None)
        if reading is not None:
            rec.update("memory", device_peak_bytes=reading.peak_used_bytes)
            rec.update("throughput", gpu_utilization=reading.mean_utilization_percent)
            rec.update("budget", device_peak_source=reading.peak_source)
    if rec.result.stopped_over_limit is not None:
        return
    # The soak predicts the device's future on a virtual GPU of the device's geometry (meta capture).
    run_soak(spec, rec, lambda: _device_like_sim(spec, total, rec.result), capture_device="meta")


def remeasure_outside_allocator(spec: TrialSpec, rec: ResultDraft, dev: Any, total: int) -> None:
    """After the warm-up steps: measure the memory outside the allocator again.

    It grows during the first steps (cuDNN/cuBLAS handles and workspaces created at first use, kernel
    modules loaded lazily: ``CUDA_MODULE_LOADING=LAZY``, torch's default), after the reading taken
    before them. The larger reading counts (``memory.non_allocator_bytes``; both kept in ``budget``),
    and a memory fraction in force is applied again for it, so that allocator plus outside memory
    stay within the budget for the measured steps (field case C9). The reading is kept for later
    plans of the same GPU, driver and torch (:func:`oomtune.gpu.outside.remember_measured`)."""
    again = _outside_allocator(dev)
    rec.update("budget", non_allocator_bytes_after_warmup=again)
    if again > (rec.result.memory.non_allocator_bytes or 0):
        rec.update("memory", non_allocator_bytes=again)
        if rec.result.budget.memory_fraction is not None:
            _apply_fraction(spec, rec, dev, total)
    # kept per (GPU, driver, torch) for later plans of this device (oomtune.gpu.outside.read_measured);
    # a reading whose device is not identified cannot be keyed, so it is not kept
    result = rec.result
    if result.device is None or not result.device.name:
        return
    from oomtune.gpu.outside import remember_measured
    from oomtune.packages import installed_version

    remember_measured(result.device.name, result.device.driver_version, installed_version("torch"),
                      int(result.memory.non_allocator_bytes or 0))


def _outside_allocator(dev: Any) -> int:
    """Device memory this process uses outside the caching allocator now, bytes
    (:func:`oomtune.trial.budget.non_allocator_bytes` of ``mem_get_info`` and ``memory_reserved``)."""
    free, total_info = torch.cuda.mem_get_info(dev)
    return non_allocator_bytes(total_info, free, torch.cuda.memory_reserved(dev))


def _apply_fraction(spec: TrialSpec, rec: ResultDraft, dev: Any, total: int) -> None:
    """``set_per_process_memory_fraction`` for the budget, corrected for the non-allocator memory
    measured so far (field case C9); the fraction applied is ``budget.memory_fraction``."""
    fraction = memory_fraction_for_budget(spec.budget_bytes, total, rec.result.memory.non_allocator_bytes or 0)
    torch.cuda.set_per_process_memory_fraction(fraction, dev)
    rec.update("budget", memory_fraction=fraction)


def _device_like_sim(spec: TrialSpec, total_bytes: int, result: TrialResult) -> Any:
    """A virtual GPU with the CUDA trial's geometry: the device's capacity, the non-allocator memory
    measured, the memory fraction applied (for the soak)."""
    from oomtune.alloc._compiled import make_simulator

    sim = make_simulator(AllocatorSettings.parse(spec.alloc_conf), total_memory_bytes=total_bytes,
                         non_allocator_bytes=min(result.memory.non_allocator_bytes or 0, total_bytes))
    if result.budget.memory_fraction is not None:
        sim.set_per_process_memory_fraction(result.budget.memory_fraction)
    return sim


def _cuda_device_info(nvml: Any, props: Any, rec: ResultDraft | None = None) -> tuple[DeviceInfo, int | None]:
    """The physical device behind visible index 0 (C10) and its NVML index (None if unknown), found
    by the UUID / PCI bus id torch reports (:func:`oomtune.gpu.nvml.physical_index_of_torch_device`:
    CUDA's device order is not NVML's on a host with mixed GPUs); ``budget.nvml_match`` says how."""
    physical, how = nvml.physical_index_of_torch_device(props, 0)
    if rec is not None:
        rec.update("budget", nvml_match=how)
    info = nvml.device_identity(physical, torch_index=0) if physical is not None else None
    if info is None:
        info = DeviceInfo(kind="cuda", index=0, name=getattr(props, "name", None),
                          uuid=nvml.normal_uuid(getattr(props, "uuid", None)),
                          pci_bus_id=nvml.torch_pci_bus_id(props))
    info = dataclasses.replace(info, cuda_version=info.cuda_version or torch.version.cuda)
    return info, physical


def _verify_effective(spec: TrialSpec, rec: ResultDraft, effective: dict | None) -> None:
    """Compare the spec's settings with what the CUDA allocator reports (``effective_settings()``:
    the snapshot's ``allocator_settings``, torch's keys and units) and raise on any difference."""
    rec.set(settings_effective=effective)
    if effective is None:
        return
    want = AllocatorSettings.parse(spec.alloc_conf)
    expected: dict[str, Any] = {
        "PYTORCH_CUDA_ALLOC_CONF": spec.alloc_conf,
        "backend": want.backend,
        "expandable_segments": want.expandable_segments,
        "garbage_collection_threshold": want.garbage_collection_threshold,
        "release_lock_on_cudamalloc": want.release_lock_on_cudamalloc,
        "pinned_use_cuda_host_register": want.pinned_use_cuda_host_register,
        "pinned_num_register_threads": want.pinned_num_register_threads,
        "max_split_size": want.max_split_size_bytes if want.max_split_size_bytes is not None else 2**64 - 1,
    }
    seen = {k: effective[k] for k in expected if k in effective}
    if isinstance(seen.get("max_split_size"), int):
        # torch/csrc/cuda/Module.cpp writes int64_t(max_split_size): the default SIZE_MAX shows as -1.
        seen["max_split_size"] %= 2**64
    wrong = {k: v for k, v in expected.items() if k in seen and seen[k] != v}
    divisions = effective.get("roundup_power2_divisions")
    if isinstance(divisions, dict) and len(divisions) == len(want.roundup_power2_divisions):
        got = tuple(int(v) for _, v in sorted(divisions.items(), key=lambda kv: int(kv[0])))
        if got != want.roundup_power2_divisions:
            wrong["roundup_power2_divisions"], seen["roundup_power2_divisions"] = want.roundup_power2_divisions, got
    if wrong:
        raise SettingsMismatchError(
            f"allocator settings did not take effect: expected {wrong}, "
            f"torch reports { {k: seen[k] for k in wrong} }"
        )


def _timed_steps(spec: TrialSpec, workload: Any, rec: ResultDraft,
                 used_bytes: Callable[[], int] | None = None, *, timed: bool = True,
                 on_step: Callable[[int], None] | None = None) -> None:
    """Warm-up steps, then measured steps (``Workload.run_steps``, synchronised on CUDA): mean step
    time, throughput (samples/s) and data-wait fraction of the measured steps; with ``timed`` False
    (steps on the meta device: no arithmetic) none of them, only ``execution.meta_step_s``.

    Steps run one at a time. With ``spec.limit_bytes`` and ``used_bytes`` (memory used so far, bytes:
    the peak reserved, plus the non-allocator memory on CUDA), they stop after the first whose
    reading exceeds the limit: peaks only grow (``max_memory_reserved`` is a running maximum), so
    time. ``throughput.steps`` is then the steps run, ``stopped_over_limit`` the step (1-based)
    and the reading; throughput covers the measured steps run (None before any). After each step the
    progress record (:func:`oomtune.trial.record.write_progress`) gets the steps done and their mean
    time, for the parent's estimate; ``on_step(done)`` runs after each step, outside its timing (the
    CUDA trial measures memory there)."""
    rec.update("process", first_step_at=time.time())
    watch = spec.limit_bytes is not None and used_bytes is not None
    total = spec.warmup_steps + spec.measure_steps
    # a time window for throughput; meta steps time nothing, so exactly measure_steps there
    window = float(getattr(spec, "measure_seconds", 0.0) or 0.0) if timed else 0.0
    if _WINDOW_OVERRIDE:   # the test hook's window:S
        window = _WINDOW_OVERRIDE[-1]
    timings, done, spent = None, 0, 0.0
    _progress(0, total)

    def more() -> bool:   # the measured steps so far fill the time window (measure_seconds)
        if done < total:
            return True
        want = window > 0 and timings is not None and timings.total_s < window
        return _ranks_agree(want) if window > 0 else want

    while more():
        step = workload.run_steps(1, sync=True)
        done += 1
        rec.update("throughput", steps=done)
        spent += step.total_s
        total = max(total, done)
        _progress(done, total, spent / done)
        if on_step is not None:
            on_step(done)
        if done > spec.warmup_steps:
            if timings is None:
                timings = step
            else:
                timings.step_s += step.step_s
                timings.data_wait_s += step.data_wait_s
        if watch and more():
            reading = int(used_bytes())
            if reading > spec.limit_bytes:
                rec.set(stopped_over_limit=StoppedOverLimit(step=done, used_bytes=reading,
                                                            limit_bytes=spec.limit_bytes))
                break
    rec.update("throughput", steps=done)
    if timings is None:  # no measured step (stopped during warm-up, or measure_steps 0)
        return
    if not timed:   # meta: the steps did no arithmetic, their times say nothing about any device
        rec.update("execution", meta_step_s=timings.mean_step_s)
        return
    rec.update("throughput", step_time_s=timings.mean_step_s, samples_per_s=timings.samples_per_s,
               data_wait_fraction=timings.data_wait_fraction)


def _record_failure(rec: ResultDraft, exc: BaseException, spec: TrialSpec) -> None:
    """Classify ``exc`` and write outcome, message, advice, OOM numbers and traceback tail."""
    cls = classify_exception(
        exc, batch_size=spec.batch_size, smaller_batch_succeeded=spec.smaller_batch_succeeded
    )
    outcome = cls.outcome if isinstance(cls.outcome, Outcome) else Outcome(cls.outcome)
    rec.set(outcome=outcome, message=cls.message, advice=cls.advice)
    if cls.oom is not None:
        rec.update("memory", oom_requested_bytes=getattr(cls.oom, "requested_bytes", None))
        rec.set(oom=OomDetails.from_info(cls.oom))
    if outcome is Outcome.ERROR or not outcome.is_memory:
        lines = "".join(traceback.format_exception(exc)).splitlines()
        rec.set(traceback_tail=cls.traceback_tail or "\n".join(lines[-_TRACEBACK_LINES:]))


_HELD: list[Any] = []   # the test hook's "hold" tensors
_WINDOW_OVERRIDE: list[float] = []   # the test hook's "window" (seconds)


def _in_ranks() -> bool:
    """Whether this process is one rank of several (a distributed trial's process group is up)."""
    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


def _ranks_agree(want: bool) -> bool:
    """Whether to run another measured step past ``measure_steps`` (the time window): in a
    distributed trial every rank must run the same steps (a rank that stops early leaves the others
    waiting in their next collective, then failing on its teardown), so the ranks take the answer of
    the one that wants most (an all-reduce MAX of the flag, on the backend's device: NCCL reduces
    CUDA tensors only). One process: ``want`` itself."""
    if not _in_ranks():
        return want
    import torch
    import torch.distributed as dist

    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    flag = torch.tensor([1 if want else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _run_test_hook(rec: ResultDraft) -> None:
    """Misbehave as ``OOMTUNE_TEST_HOOK`` asks (tests only; no-op when unset)."""
    hook = os.environ.get(TEST_HOOK_ENV)
    if not hook:
        return
    if hook.startswith("rank"):   # rankR:HOOK: only in rank R of a distributed trial
        target, _, hook = hook.partition(":")
        if target != f"rank{os.environ.get('RANK', '')}":
            return
    name, _, arg = hook.partition(":")
    if name in ("sleep", "setsid"):  # a grandchild, then hang: the runner must kill both
        # sleep: the grandchild stays in our process group; setsid: it leaves it (its own session),
        # out of reach of a process-group kill
        child = subprocess.Popen(["sleep", str(float(arg) + 60)], start_new_session=name == "setsid")
        Path("grandchild.pid").write_text(str(child.pid))
        time.sleep(float(arg))
    elif name == "signal":
        os.kill(os.getpid(), int(arg))
        time.sleep(5)
    elif name == "raise":
        raise {"ValueError": ValueError, "RuntimeError": RuntimeError}[arg]("raised by the test hook")
    elif name == "bad_fork":   # torch's error in a forked child whose parent had initialised CUDA
        forkserver = sys.modules.get("oomtune.trial.forkserver")
        if forkserver is not None and getattr(forkserver, "IN_FORKED_TRIAL", False):
            raise RuntimeError("Cannot re-initialize CUDA in forked subprocess. To use CUDA with multiprocessing, "
                               "you must use the 'spawn' start method")
    elif name == "window":   # measure past measure_steps until the measured steps took ARG seconds
        _WINDOW_OVERRIDE.append(float(arg))
    elif name == "hold":   # keep ARG bytes allocated (on the virtual GPU of a CPU trial) until the end
        _HELD.append(torch.empty(int(arg), dtype=torch.uint8))
    elif name == "echo_env":
        keys = (*ALLOC_ENV_VARS, "CUDA_VISIBLE_DEVICES")
        rec.update("allocator", environment=tuple(EnvVar(k, os.environ.get(k)) for k in keys))
    else:
        raise ValueError(f"unknown {TEST_HOOK_ENV} {hook!r}")


#: Where :func:`main` records the steps done (``PROGRESS_FILE`` next to RESULT.json); None in-process
#: (:func:`run_child` called directly). One trial per process, so one path per process.
_progress_path: Path | None = None


def _progress(done: int, total: int, step_s: float | None = None) -> None:
    if _progress_path is not None:
        write_progress(_progress_path, done, total, step_s=step_s)


def _progress_phase(phase: str) -> None:
    """Say in the progress record that the trial has moved on to ``phase`` (``soak``)."""
    if _progress_path is not None:
        from oomtune.trial.record import read_progress_record

        record = read_progress_record(_progress_path) or {}
        write_progress(_progress_path, record.get("steps_done", 0), record.get("steps_total", 0),
                       step_s=record.get("step_s"), phase=phase)


def cpu_device_info() -> DeviceInfo:
    """The host CPU as a :class:`DeviceInfo` (no memory figures: they are simulated)."""
    return DeviceInfo(kind="cpu", name=platform.processor() or platform.machine() or None)


def _run_rank(spec: TrialSpec, rank: int) -> TrialResult:
    """One rank's trial (:func:`oomtune.trial.ranks.run_ranks` calls it in each rank process):
    :func:`run_child`, with the steps done reported by rank 0 only."""
    global _progress_path
    if rank != 0:
        _progress_path = None
    return run_child(spec)


def main(argv: list[str] | None = None) -> int:
    """``python -m oomtune.trial.child SPEC.json RESULT.json``: run, write the record, exit 0.

    Returns 2 when the spec cannot be read (an error record is still written when possible).
    """
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m oomtune.trial.child SPEC.json RESULT.json", file=sys.stderr)
        return 2
    global _progress_path
    _progress_path = Path(args[1]).with_name(PROGRESS_FILE)
    try:
        spec = TrialSpec.from_json(Path(args[0]).read_text())
    except (OSError, ValueError, TypeError) as exc:
        TrialResult(outcome=Outcome.ERROR, message=f"unreadable trial spec: {exc}").write(args[1])
        return 2
    run_distributed = False
    with contextlib.suppress(Exception):   # a bad workload fails in run_child, with its record
        from oomtune.trial.ranks import is_distributed_trial

        run_distributed = is_distributed_trial(spec)
    if run_distributed:   # the ranks run the protocol, each for itself; their records are merged
        from oomtune.trial.ranks import run_ranks

        run_ranks(spec, args[1], _run_rank).write(args[1])
    else:
        run_child(spec).write(args[1])
    return 0


if __name__ == "__main__":
    from oomtune.exiting import exit_now

    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    exit_now(main())   # the record is written: no teardown of torch (oomtune.exiting)
