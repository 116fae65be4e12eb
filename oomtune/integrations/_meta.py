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
  torch's optimizers (``_HOST_MEANT``): host-side tensors stay on the host and off the virtual GPU, as on CUDA (Adam's ``step`` counters with ``capturable=False``,
  a sampler's ``randperm``).

A meta tensor holds no values. A read of one (``item``, ``bool``, ``float``, ``int``, ``tolist``,
``numpy``) from a file listed in ``placeholder_reads`` (a framework's own logging: the Trainer's
``isnan`` loss filter and its ``tr_loss.item()``; values that steer no allocation) gets a
placeholder (0, False) and is counted; a read in a function listed in ``answers`` gets the answer its
integration knows without the values (transformers' ``find_packed_sequence_indices`` asks whether the
position ids are packed: not when the batch carries none, the model then counts them with
``arange``, one sequence per row); a read anywhere else (the model, the user's code, a
GradScaler deciding whether to skip a step) raises :class:`MetaStepUnsupported`, as does an op
without a meta kernel. The trial then ends and its command is run again with real CPU steps
(:func:`oomtune.targets.cmd.run_cmd_trial`), said in one line: never a figure from a step that
meta could not run faithfully.
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


def _host_side(frame: Any) -> bool:
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
            return self._placeholder(name, first)
        if name == "cpu" and isinstance(first, torch.Tensor) and first.device.type == "meta":
            return first
        if _is_cpu(kwargs.get("device")) and not _host_side(sys._getframe(1)):
            if func in _FROM_DATA:
                # made from data on the CPU, then copied: the copy is the request a CUDA run makes (the
                # recorder does not see torch.tensor's own meta storage: tensor_ctor hides it)
                grad = bool(kwargs.get("requires_grad", False))
                made = func(*args, **{**kwargs, "device": None, "requires_grad": False}).to(META)
                return made.requires_grad_(grad) if grad else made
            kwargs = {**kwargs, "device": META}
        if name == "to" and isinstance(first, torch.Tensor):
            args = tuple(META if i > 0 and _is_cpu(a) else a for i, a in enumerate(args))
        return func(*args, **kwargs)

    def _placeholder(self, name: str, tensor: torch.Tensor) -> Any:
        frame = sys._getframe(2)   # the caller of the tensor method (1 is this mode's __torch_function__)
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
