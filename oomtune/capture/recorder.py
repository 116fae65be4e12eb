"""Record the stream of storage allocations and releases a training step makes, without a GPU.

Every tensor's memory lives in one ``torch.UntypedStorage``. On a CUDA device each new storage of
``nbytes > 0`` is exactly one request to the caching allocator (``NativeCachingAllocator::allocate``
in c10/cuda/CUDACachingAllocator.cpp calls ``malloc(size)`` only ``if (size != 0)``), and the
storage's death is one ``free``. So recording, in program order, which storages ops create and when
they die gives the request stream the caching allocator would see; running the step on the ``meta``
device (no data, no arithmetic) or on the CPU gives that stream without a GPU.

Mechanism (after ``torch.distributed._tools.mem_tracker.MemTracker``): a ``TorchDispatchMode`` sees
every aten op's outputs, forward, backward (the autograd engine carries the mode to its threads) and
optimizer alike; an output whose untyped storage was not seen before is a new allocation, and a
``weakref`` callback on that storage object reports its release. torch keeps one Python object per
live storage (PyObject preservation), so views (``view``, ``t``, indexing), in-place ops and
``out=`` ops that reuse their storage add nothing.

Known differences from a real CUDA run (the recorded stream omits or differs in):

* Workspaces allocated inside kernels below the Python dispatch key: cuDNN convolution workspaces
  are added as requests decided at replay time under :func:`oomtune.capture.cuda_kernels.emulate_cuda`
  (:mod:`oomtune.capture.cudnn_conv`; their size is a per-architecture rule, 0 bytes by default,
  as cuDNN's engine choice is not published), the staging
  buffers of large reductions (``max``/``sum`` over a 10,000-wide vocabulary: 157 MiB and 39 MiB
  plus 16-byte semaphores in lm-ctx128-fullstep, freed at once), cuFFT plans, NCCL buffers.
  cuBLAS workspaces are added when ``blas_workspaces`` is given
  (:mod:`oomtune.capture.blas_workspace`).
* Kernel choice: ``meta``/CPU follow the generic kernels; :func:`capture_stream` (and
  :class:`~oomtune.capture.virtual_gpu.VirtualGPU`) run the step under
  :func:`oomtune.capture.cuda_kernels.emulate_cuda`, which makes attention, dropout, RMS norm,
  autocast and the optimizers pick CUDA's kernels for the target GPU and adds the workspaces those
  kernels allocate inside the call (:meth:`StorageRecorder.add_transients`). Still generic: cuDNN
  batch norm's extra reserve buffer, cuDNN/cuBLASLt workspaces beyond cuBLAS's (docs/kernel_audit.md).
* ``torch.UntypedStorage.resize_`` called directly (FSDP2 frees and re-allocates its unsharded
  parameters that way: ``free_storage``/``alloc_storage`` in torch/distributed/fsdp/_fully_shard/
  _fsdp_param.py) is seen while a recorder is active (:func:`_resize_seen`): on CUDA it allocates a
  block of the new size, copies, and frees the old one (``resize_bytes_cuda``), so it is recorded as
  the new request, then the release (resizing to 0 is a release only, from 0 a request only). A
  storage that grows under an aten op is recorded the same way.
* Storages kept alive by a reference cycle are released when the cyclic garbage collector runs, not
  when the last direct reference goes (the same happens on the GPU).
* Wrapper tensor subclasses (``DTensor``) are counted by their inner tensors (a rank's shard), not by
  the wrapper's storage, which reports the global size; an op on DTensors is seen once, at the
  outside, so the local temporaries it frees before returning are not recorded.
* Tensors created with the mode inactive (other threads, e.g. a DataLoader pin-memory thread, or
  ``no_dispatch``) are not recorded; releases are recorded from any thread (under a lock).
* Collectives (``c10d`` ops: gloo on a CPU rank) run through
  :func:`oomtune.capture.collectives.run_collective`: the communication thread gets non-owning
  aliases and the call waits for it, so a storage given to a collective dies on the thread that drops
  it, in program order, as under NCCL (not whenever gloo's worker lets go of its work), and gloo's
  own reduce-scatter buffer is never seen.

Speed: on meta, a few ops' kernels are Python decompositions that cost far more than the
rest of the step (batch norm forward and backward: ~70% of a ResNet-50 capture). Their outputs
depend only on the inputs' metadata, so :class:`StorageRecorder` runs each such op once per
signature (:data:`MEMO_OPS`, :func:`_signature`) and afterwards makes outputs of the same shapes,
strides and dtypes directly (``torch.empty_strided`` on meta): the same new storages of the same
sizes, so the same stream (tests/test_capture_memo.py compares with the unmemoized capture).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from oomtune.capture import collectives as _collectives
from oomtune.capture import cuda_kernels as _kernels

__all__ = ["AllocationSink", "StreamSink", "StorageRecorder", "capture_stream", "MEMO_OPS", "HostMemoryError"]

_aten = torch.ops.aten
#: Ops whose meta kernels are slow Python decompositions (kept for reference: every op whose outputs
#: pass :func:`_output_spec`'s checks is now memoized, these included).
MEMO_OPS = frozenset({_aten.native_batch_norm.default, _aten.native_batch_norm_backward.default,
                      _aten.threshold_backward.default})
_PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)
_NO_MEMO = object()   # a signature whose outputs cannot be rebuilt (aliases, odd storages)


class _Unkeyable(Exception):
    """An argument that does not fit in a memo key (a tensor off meta or a wrapper subclass, an object
    not plain)."""


def _key(x: Any, tensors: list | None) -> Any:
    """The hashable key of one argument: a meta tensor's (shape, stride, storage offset, dtype), a
    plain value with its type (``True`` is not ``1``), a list or tuple of keys; appends every tensor
    met to ``tensors`` in order. Raises :class:`_Unkeyable` otherwise."""
    if isinstance(x, torch.Tensor):
        # a wrapper subclass on meta (DTensor on a mesh on meta: workloads/_meta_fsdp.py) is no plain
        # meta tensor: its op's outputs are subclasses too, which empty_strided would not rebuild
        if not x.is_meta or x.layout is not torch.strided or is_traceable_wrapper_subclass(x):
            raise _Unkeyable
        if tensors is not None:
            tensors.append(x)
        return (x.shape, x.stride(), x.storage_offset(), x.dtype)
    if isinstance(x, (list, tuple)):
        return (type(x), tuple([_key(y, tensors) for y in x]))
    if isinstance(x, _PLAIN):
        return (type(x), x)
    raise _Unkeyable


def _signature(func: Any, args: tuple, kwargs: dict, tensors: list | None = None) -> tuple | None:
    """A hashable key of ``func``'s call: per argument, a meta tensor's (shape, stride, storage
    offset, dtype) or a plain value; None when an argument is a tensor off meta or not plain.
    ``tensors``: a list that receives the call's tensor arguments in key order (for the outputs
    that are one of them: in-place and ``out=`` ops)."""
    try:
        return (func, _key(args, tensors), _key(tuple(kwargs.items()), tensors) if kwargs else ())
    except _Unkeyable:
        return None


_VIEWS: dict[Any, bool] = {}


def _is_view(func: Any) -> bool:
    """Whether ``func``'s schema returns an alias of an input that it does not write (a view: ``view``,
    ``t``, ``split``, ...): such outputs share an input's storage and are never memoized (their
    kernels run in C++ anyway, so the key would cost more than it saves)."""
    got = _VIEWS.get(func)
    if got is None:
        try:
            got = any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)
        except AttributeError:
            got = True
        _VIEWS[func] = got
    return got


def _state(t: torch.Tensor) -> tuple:
    """A tensor's metadata and storage identity, to see whether an op changed them."""
    st = t.untyped_storage()
    return (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, st._cdata, st.nbytes())


def _output_spec(out: Any, tensors: list, before: list | None = None) -> Any:
    """How to rebuild ``out`` without running the op again: (tree spec, per leaf None, ``("new",
    shape, stride, dtype)`` for a fresh dense meta tensor with a storage of its own, or ``("arg",
    j)`` for the call's ``j``-th tensor argument returned as it is: an in-place or ``out=`` op), or
    :data:`_NO_MEMO` when an output is neither (a view of an input or of another output, an offset,
    a storage not exactly the size ``empty_strided`` gives) or when the call changed any tensor
    argument's metadata or storage (``resize_``, ``set_``, ``as_strided_``; ``before``: the
    arguments' :func:`_state` before the call)."""
    if before is not None and any(_state(t) != b for t, b in zip(tensors, before)):
        return _NO_MEMO
    in_storages = {t.untyped_storage()._cdata for t in tensors}
    leaves, spec = tree_flatten(out)
    rebuilt: list[Any] = []
    for t in leaves:
        if t is None:
            rebuilt.append(None)
            continue
        if not isinstance(t, torch.Tensor):
            return _NO_MEMO
        j = next((i for i, a in enumerate(tensors) if a is t), None)
        if j is not None:
            rebuilt.append(("arg", j))
            continue
        if (not t.is_meta or t.layout is not torch.strided or t.storage_offset() != 0
                or is_traceable_wrapper_subclass(t)):
            return _NO_MEMO
        st = t.untyped_storage()
        extent = 0 if t.numel() == 0 else 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
        if st._cdata in in_storages or st.nbytes() != extent * t.element_size():
            return _NO_MEMO
        in_storages.add(st._cdata)
        rebuilt.append(("new", tuple(t.shape), t.stride(), t.dtype))
    if len(leaves) == 1 and isinstance(out, torch.Tensor):
        return None, rebuilt   # a single tensor: no tree to rebuild
    return spec, rebuilt


def _rebuild(spec: Any, tensors: list) -> Any:
    tree, leaves = spec
    out = [None if x is None else tensors[x[1]] if x[0] == "arg"
           else torch.empty_strided(x[1], x[2], dtype=x[3], device="meta") for x in leaves]
    if tree is None:
        return out[0]
    from torch.utils._pytree import tree_unflatten

    return tree_unflatten(out, tree)


class AllocationSink(Protocol):
    """Receives the recorded requests. ``key`` identifies one storage for its lifetime (int >= 1)."""

    def on_alloc(self, key: int, size_bytes: int) -> None:
        """A new storage of ``size_bytes`` (> 0) bytes; may raise (e.g. a simulated OOM)."""

    def on_free(self, key: int) -> None:
        """The storage recorded under ``key`` was released."""


class StreamSink:
    """A sink that keeps the events as ``(action, key, size_bytes, stream)`` tuples.

    ``action`` is ``"alloc"`` or ``"free"``; a free carries the size and stream of its allocation.
    ``stream`` is ``stream`` unless the recorded code selected another CPU stream
    (:class:`oomtune.capture.streams.StreamNumbers`: FSDP2's communication streams). Also keeps
    the live and peak live requested bytes (the sum of live storage sizes, before any rounding by
    the allocator).
    """

    def __init__(self, stream: int = 0) -> None:
        from oomtune.capture.streams import StreamNumbers

        self.stream = stream
        self.streams = StreamNumbers(stream)   # CPU streams selected by device-agnostic code (FSDP2)
        self.events: list[tuple[str, int, int, int]] = []
        self._stream_of: dict[int, int] = {}
        self._sizes: dict[int, int] = {}
        self.live_bytes = 0
        self.peak_live_bytes = 0

    def on_alloc(self, key: int, size_bytes: int) -> None:
        stream = self._stream_of[key] = self.streams.current()
        self.events.append(("alloc", key, size_bytes, stream))
        self._sizes[key] = size_bytes
        self.live_bytes += size_bytes
        self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)

    def on_free(self, key: int) -> None:
        size = self._sizes.pop(key)
        self.live_bytes -= size
        self.events.append(("free", key, size, self._stream_of.pop(key)))

    def on_conditional(self, key: int, kind: str, sizes: list[int]) -> None:
        """A request decided when made (``kind`` ``"try"`` or ``"probe"`` over ``sizes`` bytes:
        :mod:`oomtune.alloc.stream`), kept as one event per size; live bytes count its first size
        (a probe: its largest)."""
        stream = self._stream_of[key] = self.streams.current()
        for size in sizes:
            self.events.append((kind, key, size, stream))
        size = max(sizes) if kind == "probe" else sizes[0]
        self._sizes[key] = size
        self.live_bytes += size
        self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)

    def on_empty_cache(self) -> None:
        """``emptyCache`` (cuDNN's benchmark after its search)."""
        self.events.append(("empty_cache", 0, 0, self.streams.current()))

    @property
    def alloc_sizes(self) -> list[int]:
        """The requested sizes in bytes, in allocation order."""
        return [size for action, _, size, _ in self.events if action == "alloc"]

    def to_stream(self) -> Any:
        """The events as an ``oomtune.alloc.stream.AllocationStream``."""
        from oomtune.alloc.stream import AllocationStream

        return AllocationStream(list(self.events))


class _Entry:
    __slots__ = ("key", "size_bytes", "ref", "freed")

    def __init__(self, key: int, size_bytes: int) -> None:
        self.key, self.size_bytes = key, size_bytes
        self.ref: weakref.ref | None = None
        self.freed = False


class StorageRecorder(TorchDispatchMode):
    """A dispatch mode that reports each new storage and each release to ``sink``, in program order.

    Use as a context manager around the code to record (forward, ``loss.backward()``,
    ``optimizer.step()``, ...). Storages that exist before (parameters, buffers, optimizer state,
    inputs) should be passed to :meth:`register_existing` first, so that their views are not taken
    for new allocations and their releases are reported.

    Args:
        sink: an :class:`AllocationSink` (``on_alloc(key, size_bytes)``, ``on_free(key)``).
        device: record only storages on this device type (``"meta"``, ``"cpu"``, ``"cuda"``);
            ``None`` records every device. Capturing on meta with ``device="meta"`` skips CPU
            tensors such as Adam's ``step`` counters, which on a GPU run also stay on the host.

        blas_workspaces: a :class:`~oomtune.capture.blas_workspace.BlasWorkspaces`: the first BLAS op
            (mm, bmm, addmm, ...) on a cuBLAS handle without a workspace is followed by one request
            of its size that is never released (torch keeps workspaces for the process's life).
        memo: run each :data:`MEMO_OPS` op on meta once per signature and rebuild its outputs
            afterwards (see the module docstring; False: always run the kernel).

    Zero-byte storages are tracked but not reported (the CUDA allocator makes no request for them).
    Releases after the mode exits are not reported. Exceptions raised by ``sink.on_alloc`` (a
    simulated OOM) propagate out of the op that allocated; that storage is not counted as live.
    Thread safety: sink calls are serialised by a lock; a release that arrives while a sink call is
    running on the same thread (cyclic GC inside the sink) is deferred until that call returns.
    """

    def __init__(self, sink: AllocationSink, *, device: str | torch.device | None = None,
                 blas_workspaces: Any = None, memo: bool = True) -> None:
        super().__init__()
        self.sink = sink
        self._memo: dict[tuple, Any] | None = {} if memo else None
        self.blas_workspaces = blas_workspaces
        self._workspace_refs: list[Any] = []
        self.device_type = None if device is None else torch.device(device).type
        self._live: dict[int, _Entry] = {}   # id(storage object) -> entry
        self._next_key = 1
        self._lock = threading.RLock()
        self._busy = False
        self._pending: list[_Entry] = []
        self.recording = False
        self.live_bytes = 0
        self.peak_live_bytes = 0
        self.n_allocs = 0
        self.n_frees = 0

    # -- context ---------------------------------------------------------------------------------
    def __enter__(self) -> StorageRecorder:
        self.recording = True
        _resize_seen(self, True)
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            _resize_seen(self, False)
            with self._lock:
                self.recording = False

    def _storage_resized(self, st: Any, new_size: int) -> None:
        """``st.resize_(new_size)`` has run (see the module docstring): the new request, then the
        release of the old one."""
        device = getattr(st, "device", None)
        if self.device_type is not None and getattr(device, "type", None) != self.device_type:
            return
        with self._lock:
            if not self.recording:
                return
            old = self._live.get(id(st))
            known = old is not None and old.ref is not None and old.ref() is st and not old.freed
            if known and old.size_bytes == new_size:
                return
            if new_size > 0:
                self._report_alloc(id(st), st, new_size)   # replaces the entry of this storage
            elif known:
                del self._live[id(st)]
            if known:
                self._report_free(old)

    # -- registration ----------------------------------------------------------------------------
    def register_existing(self, tensors: Iterable[Any]) -> int:
        """Report the storages of ``tensors`` (nested containers allowed) as allocations now.

        Each storage is reported once, however many tensors view it. Works with or without the mode
        active. Returns the number of newly registered storages (zero-byte ones included).

        Raises:
            whatever ``sink.on_alloc`` raises (e.g. a simulated OOM: the parameters alone do not fit).
        """
        leaves, _ = tree_flatten(list(tensors) if not isinstance(tensors, torch.Tensor) else tensors)
        was = self.recording
        self.recording = True
        try:
            return sum(self._track(t) for t in leaves if isinstance(t, torch.Tensor))
        finally:
            self.recording = was

    # -- dispatch ----------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        tensors: list = []
        collective = _collectives.is_collective(func)
        key = (_signature(func, args, kwargs, tensors)
               if self._memo is not None and not collective and not _is_view(func) else None)
        spec = None if key is None else self._memo.get(key)
        if collective:   # its storages die on this thread, in program order (capture/collectives.py)
            out = _collectives.run_collective(func, args, kwargs)
        elif spec is not None and spec is not _NO_MEMO:
            out = _rebuild(spec, tensors)
        else:
            before = [_state(t) for t in tensors] if key is not None else None
            out = func(*args, **kwargs)
            if key is not None and spec is None:
                self._memo[key] = _output_spec(out, tensors, before)
        if self.recording:
            leaves, _ = tree_flatten(out)
            for t in leaves:
                if isinstance(t, torch.Tensor):
                    self._track(t)
            ws = self.blas_workspaces
            if ws is not None and ws.needs_workspace(func):
                self.add_workspace(ws.size_bytes)
            if _kernels.active():
                sizes = _kernels.transient_requests(func, args, kwargs)
                if sizes and self._on_device(leaves):
                    self.add_transients(sizes)
                requests = _kernels.conditional_requests(func, args, kwargs)
                if requests and self._on_device(leaves):
                    self.add_conditional(requests)
        return out

    def add_conditional(self, requests: list[tuple[str, list[int]]]) -> None:
        """Report requests decided when made, each released before the next, now: ``("try",
        sizes)`` / ``("probe", sizes)`` (bytes) and ``("empty_cache", [])``
        (:func:`oomtune.capture.cuda_kernels.conditional_requests`; the events of
        :mod:`oomtune.alloc.stream`). A sink without ``on_conditional`` gets the first size as a
        plain request. Raises what the sink raises."""
        with self._lock:
            for kind, sizes in requests:
                if kind == "empty_cache":
                    hook = getattr(self.sink, "on_empty_cache", None)
                    if hook is not None:
                        self._call(hook)
                    continue
                key = self._next_key
                self._next_key += 1
                hook = getattr(self.sink, "on_conditional", None)
                if hook is not None:
                    self._call(hook, key, kind, list(sizes))
                else:
                    self._call(self.sink.on_alloc, key, sizes[0])
                self.n_allocs += 1
                self.n_frees += 1
                self._call(self.sink.on_free, key)

    def _on_device(self, leaves: list[Any]) -> bool:
        first = next((t for t in leaves if isinstance(t, torch.Tensor)), None)
        return first is not None and (self.device_type is None or first.device.type == self.device_type)

    def add_transients(self, sizes: list[int]) -> None:
        """Report requests of ``sizes`` bytes (in order) and their releases (in reverse order), now:
        the workspaces a CUDA kernel allocates from the caching allocator inside the call
        (:func:`oomtune.capture.cuda_kernels.transient_requests`). Raises what ``sink.on_alloc`` raises
        (a simulated OOM), after releasing the ones already made."""
        with self._lock:
            made: list[int] = []
            try:
                for size in sizes:
                    key = self._next_key
                    self._next_key += 1
                    self._call(self.sink.on_alloc, key, size)
                    made.append(key)
                    self.n_allocs += 1
                    self.live_bytes += size
                    self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)
            finally:
                for key, size in reversed(list(zip(made, sizes))):
                    self.n_frees += 1
                    self.live_bytes -= size
                    self._call(self.sink.on_free, key)

    def add_workspace(self, size_bytes: int) -> None:
        """Report one request of ``size_bytes`` that stays live (a cuBLAS workspace), now."""
        with self._lock:
            holder = torch.empty(0, device="meta").untyped_storage()
            self._workspace_refs.append(holder)  # keeps the entry alive: never released
            if isinstance(self.sink, _LimitedSink):   # device memory only: no tensor holds it on the host
                self.sink.device_only_bytes += size_bytes
            self._report_alloc(-len(self._workspace_refs), holder, size_bytes)

    def _track(self, t: torch.Tensor) -> int:
        """Register ``t``'s storage if new (or grown); return 1 if a new storage was registered."""
        if self.device_type is not None and t.device.type != self.device_type:
            return 0
        if is_traceable_wrapper_subclass(t):
            # A wrapper (DTensor: a shard of FSDP2's parameters, gradients, optimizer states) owns no
            # memory; its storage reports the global size. Its inner tensors hold the rank's bytes.
            names, _ = t.__tensor_flatten__()
            inner = (getattr(t, name) for name in names)
            return sum(self._track(x) for x in inner if isinstance(x, torch.Tensor))
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse or storage-less tensors
            return 0
        size = st.nbytes()
        with self._lock:
            old = self._live.get(id(st))
            if old is not None and old.ref is not None and old.ref() is st:
                if old.size_bytes == size:
                    return 0
                # The storage grew in place (resize under an aten op): CUDA allocates a new block,
                # copies, then frees the old one (StorageImpl reallocation); report it that way.
                self._report_alloc(id(st), st, size)
                self._report_free(old)
                return 0
            self._report_alloc(id(st), st, size)
            return 1

    def _report_alloc(self, sid: int, st: torch.UntypedStorage, size: int) -> None:
        key = self._next_key
        self._next_key += 1
        if size > 0:
            self._call(self.sink.on_alloc, key, size)  # raises before the entry exists
            self.n_allocs += 1
            self.live_bytes += size
            self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)
        entry = _Entry(key, size)
        entry.ref = weakref.ref(st, _make_callback(weakref.ref(self), sid, entry))
        self._live[sid] = entry

    def _report_free(self, entry: _Entry) -> None:
        if entry.freed:
            return
        entry.freed = True
        if entry.size_bytes > 0:
            self.n_frees += 1
            self.live_bytes -= entry.size_bytes
            self._call(self.sink.on_free, entry.key)

    def _released(self, sid: int, entry: _Entry) -> None:
        with self._lock:
            if self._live.get(sid) is entry:
                del self._live[sid]
            if not self.recording or entry.size_bytes == 0 or entry.freed:
                return
            if self._busy:
                self._pending.append(entry)  # re-entered from inside a sink call (cyclic GC)
                return
            self._report_free(entry)

    def _call(self, fn: Callable[..., None], *args: Any) -> None:
        self._busy = True
        try:
            fn(*args)
        finally:
            self._busy = False
        while self._pending and self.recording:
            self._report_free(self._pending.pop(0))


_ACTIVE: list[StorageRecorder] = []          # recorders that see UntypedStorage.resize_ now
_RESIZE_LOCK = threading.Lock()
_ORIGINAL_RESIZE: list[Any] = []


def _resize_seen(rec: StorageRecorder, on: bool) -> None:
    """While any recorder is active, ``torch.UntypedStorage.resize_`` reports to them (a wrapper on
    the class, installed by the first recorder and removed by the last)."""
    with _RESIZE_LOCK:
        if on:
            _ACTIVE.append(rec)
            if len(_ACTIVE) == 1:
                original = torch.UntypedStorage.resize_
                _ORIGINAL_RESIZE.append(original)

                def resize_(storage: Any, size: int) -> Any:
                    out = original(storage, size)
                    for active in list(_ACTIVE):
                        active._storage_resized(storage, int(size))
                    return out

                torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        elif rec in _ACTIVE:
            _ACTIVE.remove(rec)
            if not _ACTIVE and _ORIGINAL_RESIZE:
                torch.UntypedStorage.resize_ = _ORIGINAL_RESIZE.pop()  # type: ignore[method-assign]


def _make_callback(rec_ref: weakref.ref, sid: int, entry: _Entry) -> Callable[[Any], None]:
    def _on_release(_ref: Any) -> None:
        rec = rec_ref()
        if rec is not None:
            rec._released(sid, entry)

    return _on_release


def capture_stream(
    step_fn: Callable[[], None],
    *,
    existing: Iterable[torch.Tensor] = (),
    device: str | torch.device | None = None,
    stream: int = 0,
    blas_workspaces: Any = None,
    cuda_autocast: bool = True,
    calls: int = 1,
    step_ends: list[int] | None = None,
    memo: bool = True,
    gpu: Any = None,
    notes: list[Any] | None = None,
    host_limit_bytes: int | None = None,
) -> Any:
    """Run ``step_fn()`` (``calls`` times) under a :class:`StorageRecorder` and return its request stream.

    ``existing`` tensors (parameters, buffers, optimizer state, inputs) are registered first as
    allocations, so the stream starts with them. Returns an ``oomtune.alloc.stream.AllocationStream``
    of ``(action, key, size_bytes, stream)`` events. ``device`` filters as in
    :class:`StorageRecorder`. ``blas_workspaces``: a ``BlasWorkspaces``; its ``n_existing``
    workspaces are registered after ``existing``, others are added at the first BLAS op of their
    handle. ``cuda_autocast``: the step runs the kernels a CUDA run of ``gpu`` runs (a
    :class:`~oomtune.capture.gpu_target.GpuTarget` or ``model.gpu`` value; None: the default),
    ``torch.autocast`` included (:func:`oomtune.capture.cuda_kernels.emulate_cuda`); False: the
    meta/CPU kernels. ``notes``: a list the block's :class:`~oomtune.capture.cuda_kernels.KernelNotes`
    is appended to. ``step_ends``: a list to which the number of events recorded so far is appended
    after each call (the step boundaries). ``memo``: as in :class:`StorageRecorder`.
    ``host_limit_bytes``: raise :class:`HostMemoryError` as soon as the live recorded bytes exceed
    it (a CPU capture holds them in host memory).

    Raises:
        HostMemoryError: over ``host_limit_bytes``.
    """
    import contextlib

    from oomtune.capture.cuda_kernels import emulate_cuda

    sink = StreamSink(stream) if host_limit_bytes is None else _LimitedSink(stream, host_limit_bytes)
    rec = StorageRecorder(sink, device=device, blas_workspaces=blas_workspaces, memo=memo)
    rec.register_existing(existing)
    for _ in range(getattr(blas_workspaces, "n_existing", 0)):
        rec.add_workspace(blas_workspaces.size_bytes)
    with (emulate_cuda(gpu) if cuda_autocast else contextlib.nullcontext()) as kernel_notes, rec:
        for _ in range(calls):
            step_fn()
            if step_ends is not None:
                step_ends.append(len(sink.events))
    if notes is not None and kernel_notes is not None:
        notes.append(kernel_notes)
    return sink.to_stream()


class HostMemoryError(MemoryError):
    """A capture on the CPU would need more host memory than the limit it was given (bytes in
    ``needed_bytes`` at least, ``limit_bytes``)."""

    def __init__(self, needed_bytes: int, limit_bytes: int) -> None:
        from oomtune.units import format_bytes

        super().__init__(f"the capture holds {format_bytes(needed_bytes)} of tensors in host memory, over its "
                         f"limit of {format_bytes(limit_bytes)}")
        self.needed_bytes, self.limit_bytes = needed_bytes, limit_bytes


class _LimitedSink(StreamSink):
    """A :class:`StreamSink` that raises :class:`HostMemoryError` when the live bytes that tensors hold in
    host memory pass a limit: its live bytes less ``device_only_bytes`` (the cuBLAS workspaces
    :meth:`StorageRecorder.add_workspace` reports, which no host tensor holds)."""

    def __init__(self, stream: int, limit_bytes: int) -> None:
        super().__init__(stream)
        self.limit_bytes = limit_bytes
        self.device_only_bytes = 0

    def on_alloc(self, key: int, size_bytes: int) -> None:
        host = self.live_bytes - self.device_only_bytes + size_bytes
        if host > self.limit_bytes:
            raise HostMemoryError(host, self.limit_bytes)
        super().on_alloc(key, size_bytes)
