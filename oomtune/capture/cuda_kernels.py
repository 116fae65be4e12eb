"""A capture runs the kernels the target GPU would run: one switch for every kernel family.

A capture runs the training step on meta or CPU tensors; wherever torch picks its kernel by the
tensors' device, meta and CPU pick another kernel than CUDA, and the other kernel keeps other
tensors. :func:`emulate_cuda` makes the step pick CUDA's, for the target GPU
(:class:`oomtune.capture.gpu_target.GpuTarget`):

* attention: ``scaled_dot_product_attention`` selects and runs CUDA's backend
  (:mod:`oomtune.capture.sdpa`), with the workspaces its kernels allocate inside the call;
* dropout: the fused kernel with its 1-byte mask (:mod:`oomtune.capture.dropout`);
* RMS norm: the fused kernel and its derivative (:mod:`oomtune.capture.rms_norm`);
* activations: Mish's backward as one fused kernel (:mod:`oomtune.capture.activations`);
* norms: the scratch tensors of group norm's backward (:mod:`oomtune.capture.norms`);
* losses: the input-sized storages of ``mse_loss``/``smooth_l1_loss`` and the buffers of
  ``binary_cross_entropy_with_logits`` (:mod:`oomtune.capture.losses`);
* mixed precision: ``torch.autocast`` for cuda, cpu or meta follows CUDA's policy, also in
  activation checkpointing's recomputation (:mod:`oomtune.capture.cuda_autocast`);
* optimizers: foreach by default, fused where asked, as on CUDA (:mod:`oomtune.capture.optim`);
* convolutions: the workspaces cuDNN's calls request, as requests decided at replay time
  (:mod:`oomtune.capture.cudnn_conv`).

The kernel registrations live in one ``torch.library.Library("aten", "IMPL")`` created when the
outermost :func:`emulate_cuda` enters and destroyed when it exits (process-wide, reentrant,
thread-safe to enter and leave; nested blocks may name another target: the innermost wins). The
audit behind the list, and what is not modelled, is docs/kernel_audit.md.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

from oomtune.capture.gpu_target import GpuTarget, parse_gpu, DEFAULT_GPU

__all__ = ["FAMILIES", "KernelNotes", "emulate_cuda", "transient_requests", "conditional_requests", "active"]


class KernelNotes:
    """What a capture ran in place of the meta/CPU kernels, counted: SDPA backends
    (``sdpa["flash"]``), optimizer implementations (``optimizers["adam: foreach"]``),
    ``torch.autocast`` regions routed from cpu/meta (``autocast["cpu bfloat16"]``). ``lines()``
    says it for people; ``translations()`` only what changed the user's own request (autocast on
    cpu/meta: the capture's record must say so)."""

    def __init__(self, gpu: GpuTarget) -> None:
        self.gpu = gpu
        self.sdpa: Counter[str] = Counter()
        self.optimizers: Counter[str] = Counter()
        self.autocast: Counter[str] = Counter()

    def lines(self) -> list[str]:
        """One line per family that ran, e.g. ``scaled_dot_product_attention as on A100 (sm80):
        flash x4``."""
        out = []
        if self.sdpa:
            out.append(f"scaled_dot_product_attention as on {self.gpu.name} ({self.gpu.sm}): "
                       + ", ".join(f"{k} x{v}" for k, v in sorted(self.sdpa.items())))
        if self.optimizers:
            out.append("optimizer step as on CUDA: " + ", ".join(sorted(self.optimizers)))
        out += self.translations()
        return out

    def translations(self) -> list[str]:
        """The ``torch.autocast`` regions on cpu/meta that ran under CUDA's policy, one line."""
        if not self.autocast:
            return []
        kinds = ", ".join(f"torch.autocast({k})" for k in sorted(self.autocast))
        return [f"{kinds} ran under CUDA's autocast policy (the capture stands for a CUDA run)"]

    def to_dict(self) -> dict[str, Any]:
        return {"gpu": self.gpu.to_dict(), "sdpa": dict(self.sdpa), "optimizers": sorted(self.optimizers),
                "autocast": sorted(self.autocast)}


_lock = threading.RLock()
_depth = 0
_lib: Any = None
_notes: list[KernelNotes] = []


def active() -> bool:
    """Whether an :func:`emulate_cuda` block is open (in any thread)."""
    return _depth > 0


def transient_requests(func: Any, args: tuple, kwargs: dict) -> list[int]:
    """The workspaces (bytes) CUDA's kernel for ``func`` allocates and frees inside the call, for the
    current target (:func:`oomtune.capture.sdpa.transient_requests`,
    :func:`oomtune.capture.losses.transient_requests`, :func:`oomtune.capture.norms.transient_requests`);
    [] when not emulating."""
    if _depth == 0:
        return []
    from oomtune.capture import losses, norms, sdpa

    sizes = sdpa.transient_requests(func, args, kwargs) if "sdpa" in _installed else []
    if "losses" in _installed:
        sizes += losses.transient_requests(func, args, kwargs)
    if "norms" in _installed:
        sizes += norms.transient_requests(func, args, kwargs)
    return sizes


def conditional_requests(func: Any, args: tuple, kwargs: dict) -> list[tuple[str, list[int]]]:
    """The requests CUDA's kernel for ``func`` makes inside the call whose size is decided when
    made (cuDNN convolution workspaces: :func:`oomtune.capture.cudnn_conv.conditional_requests`),
    for the current target; [] when not emulating or the family is off."""
    if _depth == 0 or "cudnn" not in _installed or not _notes:
        return []
    from oomtune.capture import cudnn_conv

    return cudnn_conv.conditional_requests(func, args, _notes[-1].gpu.sm)


#: The kernel families :func:`emulate_cuda` switches (all by default).
FAMILIES = ("sdpa", "dropout", "rms_norm", "norms", "activations", "losses", "optimizers", "autocast", "cudnn")
_installed: tuple[str, ...] = ()


@contextlib.contextmanager
def emulate_cuda(gpu: GpuTarget | str | None = None, families: Any = None) -> Iterator[KernelNotes]:
    """Within this block, meta and CPU tensors run the kernels a CUDA run on ``gpu`` runs (see the
    module docstring). ``gpu``: a :class:`GpuTarget`, a ``model.gpu`` value, or None
    (:data:`~oomtune.capture.gpu_target.DEFAULT_GPU`). ``families``: a subset of :data:`FAMILIES`
    (measurements of what each one changes, experiments/kernel_fidelity.py); None: all. The
    outermost block decides the families (``torch.autocast("cuda")`` always follows CUDA's policy;
    ``"autocast"`` adds cpu/meta). Yields the block's :class:`KernelNotes`.

    Raises:
        ConfigError: an unknown ``gpu`` name. ValueError: an unknown family.
    """
    import torch

    from oomtune.capture import activations, dropout, losses, optim, rms_norm, sdpa
    from oomtune.capture.cuda_autocast import emulate_cuda_autocast

    chosen = FAMILIES if families is None else tuple(families)
    unknown = set(chosen) - set(FAMILIES)
    if unknown:
        raise ValueError(f"unknown kernel families {sorted(unknown)}: choose from {', '.join(FAMILIES)}")
    target = gpu if isinstance(gpu, GpuTarget) else parse_gpu(gpu or DEFAULT_GPU,
                                                               source="default" if gpu is None else "model.gpu")
    notes = KernelNotes(target)
    global _depth, _lib, _installed
    with _lock:
        if _depth == 0:
            _lib = torch.library.Library("aten", "IMPL")
            _installed = chosen
            if "cudnn" in chosen:
                from oomtune.capture import cudnn_conv

                cudnn_conv.reset()   # a capture starts with torch's plan cache empty
            if "sdpa" in chosen:
                sdpa.install(_lib)
            if "dropout" in chosen:
                dropout.install(_lib)
            if "rms_norm" in chosen:
                rms_norm.install(_lib)
            if "activations" in chosen:
                activations.install(_lib)
            if "losses" in chosen:
                losses.install(_lib)
            if "optimizers" in chosen:
                optim.install(_on_optimizer)
        _depth += 1
        _notes.append(notes)
        sdpa.set_target(target, lambda backend, params: _on_sdpa(notes, backend))
    try:
        with emulate_cuda_autocast(lambda device, dtype, enabled: _on_autocast(notes, device, dtype, enabled),
                                   map_devices="autocast" in _installed, gpu=target):
            yield notes
    finally:
        with _lock:
            sdpa.set_target(None)
            _notes.remove(notes)
            _depth -= 1
            if _depth == 0:
                if "optimizers" in _installed:
                    optim.uninstall()
                _lib._destroy()
                _lib = None
                _installed = ()


def _on_sdpa(notes: KernelNotes, backend: int) -> None:
    from oomtune.capture.sdpa import BACKEND_NAMES

    notes.sdpa[BACKEND_NAMES.get(backend, str(backend))] += 1


def _on_optimizer(module: str, implementation: str) -> None:
    if _notes:
        _notes[-1].optimizers[f"{module}: {implementation}"] += 1


def _on_autocast(notes: KernelNotes, device: str, dtype: Any, enabled: bool) -> None:
    if enabled:
        notes.autocast[f"{device!r}, {str(dtype).replace('torch.', '')}"] += 1
