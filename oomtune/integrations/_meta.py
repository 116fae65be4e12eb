"""A user's training steps on the ``meta`` device: :class:`MetaSteps`.

On a CPU trial (the virtual GPU) the memory figures come from the request stream the step makes,
not from its arithmetic, so a framework's steps can run on the ``meta`` device (shapes only: no
data, no arithmetic, no host memory per tensor) as the built-in workloads' trials do
(:mod:`oomtune.trial.execute`): the model's parameters and buffers are moved to meta once
(:func:`move_to_meta`), and while :class:`MetaSteps` is active the device the script and its
framework name for the model, ``cpu``, means ``meta``:

- a ``device=cpu`` argument of any torch function (``torch.zeros(..., device=args.device)``, the
  Trainer's loss accumulator) and a ``cpu`` device given to ``Tensor.to`` (accelerate's
  ``send_to_device``, the Trainer's ``_prepare_input``, Lightning's ``move_data_to_device``)
  become ``meta``: a batch a data loader or collator built on the CPU is moved to meta where the
  framework moves it to the model's device (a CUDA run copies it to the device at the same point,
  so the request stands where the CUDA run makes it); ``Tensor.cpu()`` of a meta tensor returns it;
- functions with no device argument keep their default (the CPU), and so does ``device=cpu`` in
  torch's optimizers (``_HOST_MEANT``): host-side tensors stay on the host and off the virtual GPU,
  as on CUDA (Adam's ``step`` counters with ``capturable=False``, a sampler's ``randperm``).

A meta tensor holds no values, except where they are known on the host: a small tensor made from
Python data (``torch.tensor(n, device=cpu)``, at most ``_KNOWN_MAX_ELEMENTS`` elements) keeps its
host copy beside the meta one, and a comparison or logical op (``_KNOWN_OPS``) whose tensor
arguments all have host copies computes its result's on the host too, so a read of the result
returns the real value (Lightning's ``has_len_all_ranks``, lightning/pytorch/utilities/data.py,
makes the data loader's length as ``torch.tensor(local_length, device=strategy.root_device)``,
reduces it over ranks -- the identity on one device, ``SingleDeviceStrategy.reduce`` -- and compares
it with 0). An in-place op on such a tensor drops its host copy (its value is then unknown).

Any other read of a meta tensor (``item``, ``bool``, ``float``, ``int``, ``tolist``, ``numpy``) from
a file listed in ``placeholder_reads`` (a framework's own logging: the Trainer's ``isnan`` loss
filter and its ``tr_loss.item()``, Lightning's logged metrics; values that steer no allocation) gets
a placeholder (0, False) and is counted; a read in a function listed in ``answers`` gets the answer
its integration knows without the values (transformers' ``find_packed_sequence_indices`` asks whether
the position ids are packed: not when the batch carries none, the model then counts them with
``arange``, one sequence per row); a read anywhere else (the model, the user's code, a GradScaler
deciding whether to skip a step, Lightning's ``EarlyStopping`` comparing a monitored loss) raises
:class:`MetaStepUnsupported`, as does an op without a meta kernel. The trial then ends and its
command is run again with real CPU steps (:func:`oomtune.targets.cmd.run_cmd_trial`), said in one
line: never a figure from a step that meta could not run faithfully.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["MetaSteps", "MetaStepUnsupported", "move_to_meta", "META"]

META = torch.device("meta")
#: Tensor methods that read a value (a meta tensor has none).
_VALUE_READS = frozenset({"item", "__bool__", "__float__", "__int__", "__index__", "tolist", "numpy", "__array__"})
_FROM_DATA = (torch.tensor, torch.as_tensor, torch.asarray)
_PLACEHOLDERS = {"__bool__": False, "__float__": 0.0, "__int__": 0, "__index__": 0}
#: Tensor methods that change their tensor in place without a trailing underscore (``x += 1``, ``x[i] = v``).
_IN_PLACE_DUNDERS = frozenset({"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
                               "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__",
                               "__imatmul__", "__setitem__"})
#: A meta tensor's value known on the host is kept under this attribute (a CPU tensor).
_HOST_VALUE = "_oomtune_host_value"
#: Tensors made from data with at most this many elements keep their host copy (a length, a flag).
_KNOWN_MAX_ELEMENTS = 64
#: Ops whose result's value is computed on the host when all their tensor arguments' values are known
#: there: comparisons and logical ops (no allocation beyond the result, no state).
_KNOWN_OPS = frozenset({"__eq__", "__ne__", "__gt__", "__ge__", "__lt__", "__le__", "eq", "ne", "gt", "ge", "lt",
                        "le", "__and__", "__or__", "__xor__", "__invert__", "logical_not", "logical_and",
                        "logical_or", "all", "any"})


class MetaStepUnsupported(RuntimeError):
    """The script's step cannot run on the meta device (a value read outside the framework's logging,
    an op without a meta kernel): the trial must run its steps on the CPU."""


def _is_cpu(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cpu"
    if isinstance(device, str):
        return device == "cpu" or device.startswith("cpu:")
    return False


#: Files whose explicit ``device="cpu"`` names the host, as it does on CUDA: torch's optimizers keep
#: their step counters on the host when ``capturable=False`` and add a host scalar to them
#: (torch/optim/adam.py ``_multi_tensor_adam``: ``torch.tensor(1.0, device="cpu")``); made on meta, it
#: would move the counters to meta and the bias correction's ``_get_value(step).item()`` would fail.
_HOST_MEANT = ("torch/optim/",)


def _caller(frame: Any) -> Any:
    """The first frame at or above ``frame`` that is not a ``TorchFunctionMode``'s ``__torch_function__``:
    the code that called the tensor method or torch function. A mode above :class:`MetaSteps` on the
    mode stack (the virtual GPU's CUDA autocast policy, :mod:`oomtune.capture.cuda_autocast`, inside a
    bf16/fp16 autocast region) passes the call on from its own ``__torch_function__``, which would
    otherwise be taken for the caller."""
    while frame is not None and frame.f_code.co_name == "__torch_function__":
        frame = frame.f_back
    return frame


def _host_side(frame: Any) -> bool:
    frame = _caller(frame)
    path = frame.f_code.co_filename.replace("\\", "/") if frame is not None else ""
    return any(p in path for p in _HOST_MEANT)


def move_to_meta(module: Any, optimizer: Any = None) -> None:
    """Move ``module``'s parameters and buffers to the meta device in place. Each distinct tensor is
    converted once and put back under every name it had, so tied weights stay one tensor (GPT-2's
    ``lm_head.weight`` is ``transformer.wte.weight``; ``Module.to`` would make a new ``Parameter`` per
    module for a cpu -> meta move, whose shallow-copy types differ, and untie them). Their values are
    gone: the module can no longer be saved or evaluated for real.

    An ``optimizer`` made before the move (a plain loop passes it to ``steps``) has its
    ``param_groups`` pointed at the meta parameters, each replacing the one it was moved from (a
    parameter the module does not hold is moved too): otherwise it would keep stepping the host
    parameters, which get no gradients from the meta model, so ``torch.optim``'s ``step`` skips them
    and makes no state (Adam's ``exp_avg``/``exp_avg_sq`` never requested). Its state must be empty
    (the caller checks).

    Meta tensors are kept as they are.
    """
    import torch.nn as nn

    done: dict[int, Any] = {}

    def convert(t: Any) -> Any:
        if t is None or t.device.type == "meta":
            return t
        if id(t) not in done:
            new = t.detach().to(META)
            if isinstance(t, nn.Parameter):
                new = nn.Parameter(new, requires_grad=t.requires_grad)
            done[id(t)] = new
        return done[id(t)]

    if module is not None:
        for sub in module.modules():
            for table in (sub._parameters, sub._buffers):
                for name, t in list(table.items()):
                    table[name] = convert(t)
    for group in getattr(optimizer, "param_groups", ()):
        group["params"] = [convert(p) for p in group["params"]]


def _known_result(func: Any, args: tuple, kwargs: dict, out: Any) -> None:
    """Give ``out`` (a meta tensor) the host value of ``func`` applied to its arguments' host values,
    when every tensor argument has one (module docstring); else leave it unknown."""
    if not isinstance(out, torch.Tensor) or out.device.type != "meta" or any(
            isinstance(v, torch.Tensor) for v in kwargs.values()):
        return
    host_args = []
    for a in args:
        if isinstance(a, torch.Tensor):
            a = getattr(a, _HOST_VALUE, None) if a.device.type == "meta" else None
            if a is None:
                return
        host_args.append(a)
    setattr(out, _HOST_VALUE, func(*host_args, **kwargs))


def _forget_values(args: tuple, kwargs: dict) -> None:
    """Drop the host values of the tensors an in-place op (or an ``out=``) may have changed, and of the
    tensor a changed view looks into (``n[0] += 1`` changes ``n``; views themselves get no host value)."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            for t in (a, a._base):
                if t is not None and hasattr(t, _HOST_VALUE):
                    delattr(t, _HOST_VALUE)


class MetaSteps(TorchFunctionMode):
    """While active (a ``with`` block or ``__enter__``/``__exit__``), ``cpu`` means ``meta`` for the
    calling thread (module docstring).

    Args:
        placeholder_reads: path fragments (``"transformers/trainer.py"``) of the files whose value
            reads of meta tensors get a placeholder.
        answers: ``{(path fragment, function name): answer}``: a value read in that function returns
            ``answer()`` (which raises :class:`MetaStepUnsupported` when it cannot know). Any other
            read raises.

    Attributes:
        placeholder_count: value reads answered with a placeholder so far.

    Raises:
        MetaStepUnsupported: (from inside the block) a value read of a meta tensor outside
            ``placeholder_reads``.
    """

    def __init__(self, placeholder_reads: tuple[str, ...] = (),
                 answers: dict[tuple[str, str], Any] | None = None) -> None:
        super().__init__()
        self.placeholder_reads = tuple(placeholder_reads)
        self.answers = dict(answers or {})
        self.placeholder_count = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        first = args[0] if args else None
        if name in _VALUE_READS and isinstance(first, torch.Tensor) and first.device.type == "meta":
            host = getattr(first, _HOST_VALUE, None)
            if host is not None:   # the value is known: no placeholder
                return func(host, *args[1:], **kwargs)
            return self._placeholder(name, first)
        if name == "cpu" and isinstance(first, torch.Tensor) and first.device.type == "meta":
            return first
        if _is_cpu(kwargs.get("device")) and not _host_side(sys._getframe(1)):
            if func in _FROM_DATA:
                # made from data on the CPU, then copied: the copy is the request a CUDA run makes (the
                # recorder does not see torch.tensor's own meta storage: tensor_ctor hides it)
                grad = bool(kwargs.get("requires_grad", False))
                host = func(*args, **{**kwargs, "device": None, "requires_grad": False})
                made = host.to(META)
                if host.numel() <= _KNOWN_MAX_ELEMENTS:
                    setattr(made, _HOST_VALUE, host)
                return made.requires_grad_(grad) if grad else made
            kwargs = {**kwargs, "device": META}
        if name == "to" and isinstance(first, torch.Tensor):
            args = tuple(META if i > 0 and _is_cpu(a) else a for i, a in enumerate(args))
        out = func(*args, **kwargs)
        if name in _KNOWN_OPS:
            _known_result(func, args, kwargs, out)
        elif name.endswith("_") or name in _IN_PLACE_DUNDERS or "out" in kwargs:
            _forget_values(args, kwargs)   # changed in place: a host copy would be stale
        return out

    def _placeholder(self, name: str, tensor: torch.Tensor) -> Any:
        frame = _caller(sys._getframe(2))   # the caller of the tensor method (1 is this mode's __torch_function__)
        where = f"{frame.f_code.co_filename}:{frame.f_lineno}"
        path = frame.f_code.co_filename.replace("\\", "/")
        for (fragment, function), answer in self.answers.items():
            if fragment in path and frame.f_code.co_name == function:
                self.placeholder_count += 1
                return answer()
        if name in _PLACEHOLDERS and any(p in frame.f_code.co_filename.replace("\\", "/")
                                         for p in self.placeholder_reads):
            self.placeholder_count += 1
            return _PLACEHOLDERS[name]
        if name == "item" and any(p in frame.f_code.co_filename.replace("\\", "/") for p in self.placeholder_reads):
            self.placeholder_count += 1
            return False if tensor.dtype == torch.bool else 0 if not tensor.dtype.is_floating_point else 0.0
        raise MetaStepUnsupported(f"the step reads a tensor's value ({name}() at {where}), and a meta tensor has "
                                  "none")
