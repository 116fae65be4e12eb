"""The virtual GPU: a training step run on ``meta`` (or CPU) tensors, its allocations fed live to a
caching-allocator simulator, so that a simulated out-of-memory error is raised inside the step.

Each storage the step creates becomes ``sim.malloc(size_bytes, stream)`` at the moment the op that
creates it returns, and its release becomes ``sim.free(addr)``: the same request stream the CUDA
caching allocator would receive (``NativeCachingAllocator::allocate`` / ``local_raw_delete`` in
c10/cuda/CUDACachingAllocator.cpp), within the limits listed in :mod:`oomtune.capture.recorder`
(no cuDNN workspaces or reduction staging buffers, generic kernels); cuBLAS workspaces are
modelled (``blas_workspaces``), and inside the context the step runs the kernels a CUDA run of the
target GPU runs: attention, dropout, RMS norm, ``torch.autocast`` (cuda, cpu or meta) and the
optimizers (:func:`oomtune.capture.cuda_kernels.emulate_cuda`).

The virtual GPU is a device of ``virtual_device_memory`` bytes with the budget applied as a memory
fraction, as a CUDA trial applies it (``torch.cuda.set_per_process_memory_fraction``), not a device
the size of the budget: :func:`budget_geometry` and :func:`budgeted_sim`. The difference matters for
``garbage_collection_threshold``, which acts only under a fraction (``DeviceCachingAllocator::
garbage_collect_cached_blocks`` is called only when ``set_fraction`` is true) and then relative to
the allowed memory (``allowed_memory_maximum``), i.e. the budget.

A simulated out-of-memory error raised inside ``backward()`` of a CPU run leaves the failed
graph's pending ``NodeTask`` objects (each holding its ``Node`` and the ``InputBuffer`` of gradients
flowing into it) in the calling thread's CPU ready queue (``local_ready_queue`` in
torch/csrc/autograd/engine.cpp, kept for the thread's next backward), so that memory stays live
until that thread runs another backward. On CUDA the backward runs on the device's autograd
thread, which keeps popping its queue and drops the tasks of a failed graph at once ("GraphTask
for function is no longer valid, skipping execution"). Inside the context the virtual GPU does
the same: when the engine returns with an error it runs one empty backward on the calling thread,
outside the recorder, which pops and drops the stale tasks (:func:`_drop_failed_backward_tasks`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from oomtune.alloc.geometry import budget_geometry, budgeted_sim
from oomtune.capture.recorder import StorageRecorder

__all__ = ["VirtualGPU", "budget_geometry", "budgeted_sim"]


def _drop_failed_backward_tasks() -> None:
    """Pop the tasks a failed backward left in this thread's CPU ready queue (none: no effect).

    One backward of a one-element leaf, outside every dispatch mode (nothing is recorded): the CPU
    engine drives it on this thread's ``local_ready_queue`` and drops the tasks whose ``GraphTask``
    has failed or expired, releasing their gradient buffers as CUDA's device thread would.
    """
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch.enable_grad():
        torch.zeros((), requires_grad=True).backward()


class _EngineOnFailure:
    """Stands in for ``torch.autograd.Variable._execution_engine`` inside a :class:`VirtualGPU`:
    every call is the engine's; an outermost ``run_backward`` that raises first drops the failed
    graph's queued tasks (:func:`_drop_failed_backward_tasks`), then re-raises. A reentrant one
    (checkpoint recomputation, ``_current_graph_task_id() != -1``) only re-raises: a backward run
    there would execute the outer graph's pending tasks."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def run_backward(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self._engine.run_backward(*args, **kwargs)
        except BaseException:
            if torch._C._current_graph_task_id() == -1:  # outermost backward: nothing else queued
                _drop_failed_backward_tasks()
            raise  # a reentrant backward's error unwinds to the outer one, which drops the tasks

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


class _SimSink:
    """Forwards recorded requests to a simulator, keeping ``key -> address``; ``tee`` (a
    :class:`~oomtune.capture.recorder.StreamSink` or None) also receives every request the simulator
    accepted, so the request stream can be written out (``oomtune.capture_hook``)."""

    def __init__(self, sim: Any, stream: int, tee: Any = None) -> None:
        from oomtune.capture.streams import StreamNumbers

        self.sim = sim
        self.stream = stream
        self.tee = tee
        self.streams = StreamNumbers(stream)   # CPU streams selected by device-agnostic code (FSDP2)
        self.addr: dict[int, int] = {}
        self.n_mallocs = 0
        self.n_frees = 0
        self._tee_only: set[int] = set()

    def on_alloc(self, key: int, size_bytes: int) -> None:
        addr = self.sim.malloc(size_bytes, stream=self.streams.current())  # may raise the simulated OOM
        self.addr[key] = addr
        self.n_mallocs += 1
        if self.tee is not None:
            self.tee.on_alloc(key, size_bytes)

    def on_conditional(self, key: int, kind: str, sizes: list[int]) -> None:
        """A request decided now (``try``: the first of ``sizes`` the simulator grants; ``probe``:
        cuDNN's cacheInfo-bounded, halving probe: :func:`oomtune.alloc.stream.grant_probe`)."""
        from oomtune.alloc.stream import grant_first, grant_probe

        stream = self.streams.current()
        addr, _ = grant_first(self.sim, sizes, stream) if kind == "try" else grant_probe(self.sim, sizes, stream)
        if addr:
            self.addr[key] = addr
            self.n_mallocs += 1
        if self.tee is not None:   # the request as made (the replay decides again)
            self.tee.on_conditional(key, kind, sizes)
            if not addr:
                self._tee_only.add(key)

    def on_empty_cache(self) -> None:
        """``emptyCache`` on the simulator."""
        self.sim.empty_cache()
        if self.tee is not None:
            self.tee.on_empty_cache()

    def on_free(self, key: int) -> None:
        addr = self.addr.pop(key, None)
        if key in self._tee_only:   # a conditional request the simulator granted nothing
            self._tee_only.discard(key)
            self.tee.on_free(key)
        if addr is None:  # never reached the simulator (its malloc raised) or already freed
            return
        self.sim.free(addr)
        self.n_frees += 1
        if self.tee is not None:
            self.tee.on_free(key)


class VirtualGPU:
    """Context manager that runs the enclosed PyTorch code against a ``CachingAllocatorSim``.

    Usage::

        sim = CachingAllocatorSim(settings, total_memory_bytes=16 * GiB)
        with VirtualGPU(sim, device="meta") as vgpu:
            vgpu.register(workload.tensors_before_step())   # parameters, buffers, optimizer state
            workload.step(batch)                           # may raise torch.OutOfMemoryError

    Args:
        sim: an object with ``malloc(size_bytes, stream=0) -> int`` (raising
            ``SimulatedOutOfMemoryError``, a ``torch.OutOfMemoryError``) and ``free(addr)``:
            ``oomtune.alloc.sim.CachingAllocatorSim`` or ``oomtune.alloc._compiled.make_simulator()``'s.
        device: the device type whose storages stand for GPU memory (``"meta"`` or ``"cpu"``);
            tensors on other devices (e.g. Adam's CPU ``step`` counters during a meta run) are not
            sent. Default ``None``: the device of the first tensor given to :meth:`register`, or
            every device if nothing was registered before the first op.
        stream: the CUDA stream number given to ``sim.malloc``.
        blas_workspaces: cuBLAS workspaces (:mod:`oomtune.capture.blas_workspace`), requests a CUDA
            run makes below the Python dispatch level: ``"default"`` models the main thread's as
            existing (sent with the first :meth:`register`, as a trial creates it before
            measuring) and the autograd thread's at the first backward matmul, each
            ``cublas_workspace_bytes`` of ``gpu``'s compute capability (8 MiB + 128 KiB on the default
            A100, 32 MiB on sm90 and later); a ``BlasWorkspaces`` instance; or ``None`` (none, the
            default: only the requests the enclosed code makes itself).
        gpu: the target GPU whose kernels the enclosed code runs (a ``GpuTarget`` or ``model.gpu``
            value; None: the default, :data:`oomtune.capture.gpu_target.DEFAULT_GPU`).
        tee: a :class:`~oomtune.capture.recorder.StreamSink` that also receives every request the
            simulator accepted (``on_alloc``/``on_free``, recorder keys), or None.

    Raises:
        torch.OutOfMemoryError: (the simulator's subclass) from :meth:`register` or from inside the
            enclosed code, at the exact request that does not fit; the context exits normally.
        RuntimeError: the context is entered a second time (one recording per instance).

    :meth:`register` may be called before entering or inside the context. Storages recorded before
    an OOM and released during the unwinding are freed in the simulator (after an OOM inside
    ``backward()``, the failed graph's queued gradients too, as on CUDA: see the module docstring);
    releases after the context exits are ignored, so ``sim`` keeps the state at exit. Releases from
    other threads (a DataLoader pin-memory thread dropping its last reference) are serialised by the
    recorder's lock; tensors created on other threads are not recorded (dispatch modes are
    thread-local), which matches CPU-side work that never touches the GPU allocator.
    """

    def __init__(self, sim: Any, *, device: str | torch.device | None = None, stream: int = 0,
                 blas_workspaces: Any = None, gpu: Any = None, tee: Any = None) -> None:
        if isinstance(blas_workspaces, str) and blas_workspaces == "default":
            from oomtune.capture.blas_workspace import cuda_run_workspaces

            blas_workspaces = cuda_run_workspaces(gpu)   # None: the default GPU, as the kernels
        self.sim = sim
        self._sink = _SimSink(sim, stream, tee)
        self.recorder = StorageRecorder(self._sink, device=device, blas_workspaces=blas_workspaces)
        self._workspaces_pending = getattr(blas_workspaces, "n_existing", 0)
        self._entered = False
        self._exited = False
        self.gpu = gpu
        self.notes: Any = None   # the KernelNotes of the block, once entered

    @property
    def n_mallocs(self) -> int:
        """Requests that reached the simulator and succeeded."""
        return self._sink.n_mallocs

    @property
    def n_frees(self) -> int:
        """Releases forwarded to the simulator."""
        return self._sink.n_frees

    @property
    def live_bytes(self) -> int:
        """Requested bytes live now (before the allocator's rounding)."""
        return self.recorder.live_bytes

    @property
    def peak_live_bytes(self) -> int:
        """Peak of requested live bytes since creation (before the allocator's rounding)."""
        return self.recorder.peak_live_bytes

    def register(self, tensors: Iterable[Any]) -> int:
        """Allocate the storages of tensors that already exist (each storage once).

        Returns the number of storages registered. Raises the simulated ``torch.OutOfMemoryError``
        if they do not fit (e.g. the parameters alone exceed the budget).
        """
        tensors = list(tensors)
        if self.recorder.device_type is None:
            first = next((t for t in tensors if isinstance(t, torch.Tensor)), None)
            if first is not None:
                self.recorder.device_type = first.device.type
        n = self.recorder.register_existing(tensors)
        for _ in range(self._workspaces_pending):
            self.recorder.add_workspace(self.recorder.blas_workspaces.size_bytes)
        self._workspaces_pending = 0
        if not self._exited:
            # Registered before entering: forward their releases to the simulator from now on.
            self.recorder.recording = True
        return n

    def __enter__(self) -> VirtualGPU:
        if self._entered:
            raise RuntimeError("a VirtualGPU records once; create a new one for another run")
        self._entered = True
        from oomtune.capture.cuda_kernels import emulate_cuda

        self._autocast = emulate_cuda(self.gpu)
        self.notes = self._autocast.__enter__()
        self.recorder.__enter__()
        from torch.autograd.variable import Variable

        self._engine = Variable._execution_engine
        Variable._execution_engine = _EngineOnFailure(self._engine)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._exited = True
        from torch.autograd.variable import Variable

        Variable._execution_engine = self._engine
        try:
            self.recorder.__exit__(*exc)
        finally:
            self._autocast.__exit__(*exc)
