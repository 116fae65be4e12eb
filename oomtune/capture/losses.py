"""Losses as CUDA runs them: the buffers their CUDA kernels keep or allocate inside the call.

The audit (docs/kernel_audit.md) compared what a capture records for torch.nn's losses with CUDA's
kernels (aten/src/ATen/native/Loss.cpp, LossNLL.cpp, cuda/Loss.cu). Cross-entropy (with label
smoothing or ``ignore_index``), NLL and the log-softmax under them run the same outputs everywhere.
These differ:

* ``mse_loss`` and ``smooth_l1_loss`` with reduction ``mean``/``sum``: the structured meta function
  shared by the CPU and CUDA kernels (``TORCH_META_FUNC(mse_loss)``: ``build_borrowing_binary_op``,
  then ``maybe_get_output().resize_({})``) allocates the output at the broadcast input size and
  shrinks only its shape, so the 0-dim loss holds a storage of ``numel x itemsize`` bytes for as
  long as it lives. The kernel (``TORCH_IMPL_FUNC(mse_loss_out)``) then fills a second
  input-sized ``loss`` tensor and reduces it into the output: one transient of the same size.
  torch's Meta kernel (a Python decomposition) returns a 4-byte scalar and no transient. While a
  capture emulates a GPU, :func:`install` registers Meta kernels that return the 0-dim loss on an
  input-sized storage (the CPU kernel already does), and :func:`transient_requests` adds the
  ``loss`` temporary on meta and CPU alike (a CPU kernel's own buffers are not recorded).
* ``binary_cross_entropy`` (``binary_cross_entropy_cuda``, Loss.cu; the CPU kernel alike): the
  output is ``empty_like(input)``; with a reduction the reduced scalar (a transient) is copied back
  after ``loss.resize_as_(loss_reduced)``, which keeps the input-sized storage. torch's Meta kernel
  returns 4 bytes: :func:`install` registers one that keeps the storage.
* ``huber_loss`` (Loss.cpp, CPU and CUDA): an input-sized ``loss`` filled, then reduced into a new
  0-dim output; the loss is a transient (meta and CPU record only the output).
* ``binary_cross_entropy_with_logits`` (CompositeExplicitAutograd: one op to the capture, its
  body not recorded): on CUDA it allocates ``log_sigmoid(input)`` (input-sized; CUDA's
  ``log_sigmoid_forward`` buffer is empty) and ``1 - target`` (target-sized) before reducing;
  with ``pos_weight`` first ``pos_weight - 1`` and ``log_weight`` (target-sized), freed before
  ``1 - target``. :func:`transient_requests` adds requests that reach the same peak inside the call.

Not modelled: the staging buffers of CUDA's reductions (``mean``/``sum`` over many elements), as
for every reduction (docs/kernel_audit.md).
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["install", "transient_requests"]

_aten = torch.ops.aten
_NONE = 0   # at::Reduction::None


def _elementwise(input: torch.Tensor, target: torch.Tensor) -> tuple[list[int], torch.dtype]:  # noqa: A002
    return list(torch.broadcast_shapes(input.shape, target.shape)), torch.result_type(input, target)


def _meta_reduced_loss(input: torch.Tensor, target: torch.Tensor, reduction: int = 1,  # noqa: A002
                       *_: Any) -> torch.Tensor:
    """The output of ``mse_loss``/``smooth_l1_loss`` as ``TORCH_META_FUNC(mse_loss)`` makes it: the
    broadcast shape for reduction ``none``; else a 0-dim tensor on a storage of the broadcast size
    (``resize_({})`` keeps the storage), numel x itemsize bytes."""
    shape, dtype = _elementwise(input, target)
    full = torch.empty(shape, dtype=dtype, device=input.device)
    if reduction == _NONE:
        return full
    out = torch.empty((), dtype=dtype, device=input.device)
    out.set_(full.untyped_storage(), 0, (), ())
    return out


def _meta_binary_cross_entropy(input: torch.Tensor, target: torch.Tensor,  # noqa: A002
                               weight: torch.Tensor | None = None, reduction: int = 1) -> torch.Tensor:
    """The output of ``binary_cross_entropy`` as ``binary_cross_entropy_cuda`` makes it: ``loss =
    empty_like(input)``; with a reduction ``loss.resize_as_(loss_reduced)`` keeps its storage, so
    a 0-dim tensor on input-sized storage (numel x itemsize bytes)."""
    full = torch.empty_like(input)
    if reduction == _NONE:
        return full
    out = torch.empty((), dtype=input.dtype, device=input.device)
    out.set_(full.untyped_storage(), 0, (), ())
    return out


def _reduced_scalar(args: tuple, kwargs: dict) -> list[int]:
    """``binary_cross_entropy`` with a reduction: ``loss_reduced`` (a 0-dim tensor) is copied into
    the output and freed."""
    reduction = args[3] if len(args) > 3 else kwargs.get("reduction", 1)
    return [] if reduction == _NONE else [args[0].element_size()]


def _huber_temporary(args: tuple, kwargs: dict) -> list[int]:
    """``huber_loss`` (Loss.cpp): ``loss = empty_like(input)`` filled, then reduced into a new
    0-dim output: the input-sized loss is a transient (with reduction none it is the output)."""
    input = args[0]  # noqa: A001
    reduction = args[2] if len(args) > 2 else kwargs.get("reduction", 1)
    return [] if reduction == _NONE else [input.numel() * input.element_size()]


def _loss_temporary(args: tuple, kwargs: dict) -> list[int]:
    input, target = args[0], args[1]  # noqa: A001
    reduction = args[2] if len(args) > 2 else kwargs.get("reduction", 1)
    if reduction == _NONE:
        return []   # the kernel writes into the output itself (mse_stub(device_type(), *this))
    shape, dtype = _elementwise(input, target)
    return [math.prod(shape) * dtype.itemsize]


def _bce_with_logits_temporaries(args: tuple, kwargs: dict) -> list[int]:
    names = ("input", "target", "weight", "pos_weight", "reduction")
    got = dict(zip(names, args)) | kwargs
    input, target = got["input"], got["target"]  # noqa: A001
    pos_weight, reduction = got.get("pos_weight"), got.get("reduction", 1)
    sizes = [input.numel() * input.element_size()]                      # log_sigmoid(input)
    t_bytes = target.numel() * torch.result_type(target, 1).itemsize     # (1 - target), log_weight
    if pos_weight is not None:
        # pos_weight - 1 and log_weight live together; both are gone before 1 - target (same size
        # as log_weight) is made, so these two reach the call's peak
        sizes += [pos_weight.numel() * pos_weight.element_size(), t_bytes]
    elif reduction != _NONE:
        sizes.append(t_bytes)   # 1 - target: with reduction none it is the output itself
    return sizes


_TRANSIENTS = {
    _aten.mse_loss.default: _loss_temporary,
    _aten.smooth_l1_loss.default: _loss_temporary,
    _aten.binary_cross_entropy_with_logits.default: _bce_with_logits_temporaries,
    _aten.binary_cross_entropy.default: _reduced_scalar,
    _aten.huber_loss.default: _huber_temporary,
}


def transient_requests(func: Any, args: tuple, kwargs: dict) -> list[int]:
    """Bytes of each buffer the CUDA kernel of ``func`` allocates and frees inside the call (see the
    module docstring), in allocation order; [] for other ops."""
    fn = _TRANSIENTS.get(func)
    return [] if fn is None else [s for s in fn(args, kwargs) if s > 0]


def install(lib: Any) -> None:
    """Register the Meta kernels of ``mse_loss``, ``smooth_l1_loss`` and ``binary_cross_entropy`` on
    ``lib`` (an ``aten`` IMPL library), replacing torch's (restored when ``lib`` is destroyed)."""
    for name, fn in (("mse_loss", _meta_reduced_loss), ("smooth_l1_loss", _meta_reduced_loss),
                     ("binary_cross_entropy", _meta_binary_cross_entropy)):
        # torch's Python meta kernels for these ops were registered by torch.library; Library.impl
        # refuses to override them, the C++ handle does.
        lib.m.impl(name, "Meta", fn, False)
