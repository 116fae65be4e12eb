"""``target=python``: the user's own model, optimizer and data, built by a function oomtune calls.

``target.entry`` names the function as ``package.module:function`` (imported normally) or
``path/to/file.py:function`` (loaded from the file; its folder is put first on ``sys.path`` so that
it can import its neighbours). The protocol, kept small::

    def make_workload(batch_size: int, device: torch.device) -> dict:
        model = MyNet().to(device)
        return {
            "model": model,                                      # torch.nn.Module
            "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
            "batches": loader,                                   # iterable of (inputs, targets)
            "loss_fn": torch.nn.functional.cross_entropy,        # optional: (output, targets) -> loss
        }

- ``device`` is passed only when the function has a parameter named ``device`` (keyword); without
  it the model is moved with ``model.to(device)`` after the call.
- The function may instead return a tuple ``(model, optimizer, batches)`` or
  ``(model, optimizer, batches, loss_fn)``.
- ``batches`` is any iterable of ``(inputs, targets)``: a DataLoader, a list or an endless
  generator. It is iterated again when exhausted; an iterator that is used up is an error. Each
  batch is moved to the device (tensors inside tuples, lists and dicts). ``inputs`` may be a tensor
  (``model(inputs)``), a tuple/list (``model(*inputs)``) or a dict (``model(**inputs)``).
- ``loss_fn`` defaults to cross-entropy over the last dimension, as the built-in workloads.

One training step is forward, loss, ``backward()``, ``optimizer.step()``,
``optimizer.zero_grad(set_to_none=True)``: :class:`UserWorkload` is a
:class:`oomtune.workloads.Workload`, so the builtin trial process runs it unchanged (timing,
data-wait fraction, virtual GPU registration through ``tensors_before_step()``).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from oomtune.exceptions import ConfigError
from oomtune.targets import is_file_entry
from oomtune.trial._base import Target
from oomtune.workloads.loop import Workload

__all__ = ["load_entry", "build_user_workload", "UserWorkload", "PythonTarget", "TARGET"]

_FORMAT = "expected 'package.module:function' or 'path/to/file.py:function'"


def load_entry(entry: str) -> Callable[..., Any]:
    """Import the function named by ``entry`` (``pkg.mod:func`` or ``file.py:func``).

    A relative file path is taken from the current directory. Errors raised while the module runs
    (other than import errors) propagate unchanged.

    Raises:
        ConfigError: a malformed entry, a module or file that cannot be found or imported (its own
            missing dependency or syntax error included, named in the message), a missing attribute,
            or an attribute that is not callable.
    """
    if not isinstance(entry, str) or entry.count(":") < 1 or entry.strip() in ("", "???"):
        raise ConfigError(f"target.entry={entry!r}: {_FORMAT}")
    where, _, name = entry.rpartition(":")
    where, name = where.strip(), name.strip()
    if not where or not name.isidentifier():
        raise ConfigError(f"target.entry={entry!r}: {_FORMAT}")
    module = _load_file(entry, where) if is_file_entry(where) else _import_module(entry, where)
    fn = getattr(module, name, None)
    if fn is None:
        raise ConfigError(f"target.entry={entry!r}: {where!r} has no function {name!r}")
    if not callable(fn):
        raise ConfigError(f"target.entry={entry!r}: {where}.{name} is a {type(fn).__name__}, not a function")
    return fn


def _import_module(entry: str, modname: str) -> Any:
    try:
        return importlib.import_module(modname)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (modname == exc.name or modname.startswith(exc.name + ".")):
            raise ConfigError(f"target.entry={entry!r}: no module named {exc.name!r} "
                              f"(is it installed or on PYTHONPATH?)") from None
        raise ConfigError(f"target.entry={entry!r}: importing {modname!r} failed: {exc}") from None
    except (ImportError, SyntaxError) as exc:
        raise ConfigError(f"target.entry={entry!r}: importing {modname!r} failed: "
                          f"{type(exc).__name__}: {exc}") from None


def _load_file(entry: str, filename: str) -> Any:
    path = Path(filename).expanduser().resolve()
    if not path.is_file():
        raise ConfigError(f"target.entry={entry!r}: file {filename!r} not found")
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:8]
    modname = f"oomtune_user_{path.stem}_{digest}"
    if modname in sys.modules:
        return sys.modules[modname]
    spec = importlib.util.spec_from_file_location(modname, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"target.entry={entry!r}: cannot load {filename!r} as Python")
    module = importlib.util.module_from_spec(spec)
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    sys.modules[modname] = module
    try:
        spec.loader.exec_module(module)
    except (ImportError, SyntaxError) as exc:
        sys.modules.pop(modname, None)
        raise ConfigError(f"target.entry={entry!r}: loading {filename!r} failed: "
                          f"{type(exc).__name__}: {exc}") from None
    except BaseException:
        sys.modules.pop(modname, None)
        raise
    return module


def _to_device(obj: Any, device: torch.device) -> Any:
    """``obj`` with every tensor moved to ``device`` (through tuples, lists and dicts)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, tuple):
        return tuple(_to_device(o, device) for o in obj)
    if isinstance(obj, list):
        return [_to_device(o, device) for o in obj]
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    return obj


def _endless(batches: Iterable[Any], device: torch.device, entry: str) -> Iterator[Any]:
    """Iterate ``batches`` again and again, moving each batch to ``device``.

    Raises:
        ConfigError: (when iterated) the iterable yields nothing on a pass.
    """
    served = 0
    while True:
        got = 0
        for batch in batches:
            got += 1
            yield _to_device(batch, device)
        served += got
        if got == 0:
            what = "is empty" if served == 0 else f"ran out after {served} batches"
            raise ConfigError(f"target.entry={entry!r}: batches {what}; return a list, a DataLoader "
                              "or an endless generator")


def _default_loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the last dimension (as the built-in workloads)."""
    return nn.functional.cross_entropy(output.flatten(0, -2).float(), targets.flatten())


class UserWorkload(Workload):
    """A :class:`Workload` around the user's model, optimizer, batches and loss function.

    Attributes as :class:`Workload` (``model``, ``optimizer``, ``device``, ``batch_size``,
    ``samples_per_step`` = batch size, ``precision`` = ``"fp32"``: the user's code decides its own
    autocast, ``fallback_reason`` = None), plus ``entry`` and ``loss_fn``.
    """

    def __init__(self, entry: str, model: nn.Module, optimizer: torch.optim.Optimizer,
                 batches: Iterable[Any], loss_fn: Callable[..., torch.Tensor] | None,
                 device: torch.device, batch_size: int) -> None:
        self.spec, self.entry = None, entry
        self.model, self.optimizer, self.device = model, optimizer, device
        self.batch_size = self.samples_per_step = batch_size
        self.precision, self.fallback_reason = "fp32", None
        self.loss_fn = loss_fn or _default_loss
        self._batches = _endless(batches, device, entry)
        self._static_batch, self._scaler = None, None

    def step(self, batch: Any) -> None:
        """Forward, loss, backward, ``optimizer.step()``, ``zero_grad(set_to_none=True)``."""
        try:
            inputs, targets = batch
        except (TypeError, ValueError):
            raise ConfigError(f"target.entry={self.entry!r}: each batch must be a pair (inputs, targets), "
                              f"got {type(batch).__name__}") from None
        if isinstance(inputs, (tuple, list)):
            out = self.model(*inputs)
        elif isinstance(inputs, dict):
            out = self.model(**inputs)
        else:
            out = self.model(inputs)
        loss = self.loss_fn(out, targets)
        del out
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def _unpack(entry: str, made: Any) -> tuple[Any, Any, Any, Any]:
    if isinstance(made, Mapping):
        missing = [k for k in ("model", "optimizer", "batches") if k not in made]
        if missing:
            raise ConfigError(f"target.entry={entry!r}: the returned dict lacks {', '.join(missing)}")
        return made["model"], made["optimizer"], made["batches"], made.get("loss_fn")
    if isinstance(made, tuple) and len(made) in (3, 4):
        return (*made, None) if len(made) == 3 else made
    raise ConfigError(f"target.entry={entry!r}: expected a dict(model=, optimizer=, batches=[, loss_fn=]) "
                      f"or a tuple (model, optimizer, batches[, loss_fn]), got {type(made).__name__}")


def _check(entry: str, model: Any, optimizer: Any, batches: Any, loss_fn: Any) -> None:
    problems = (
        (isinstance(model, nn.Module), f"model is a {type(model).__name__}, not a torch.nn.Module"),
        (isinstance(optimizer, torch.optim.Optimizer),
         f"optimizer is a {type(optimizer).__name__}, not a torch.optim.Optimizer"),
        (isinstance(batches, Iterable) and not isinstance(batches, (torch.Tensor, str, bytes)),
         f"batches is a {type(batches).__name__}, not an iterable of (inputs, targets)"),
        (loss_fn is None or callable(loss_fn), f"loss_fn is a {type(loss_fn).__name__}, not callable"),
    )
    for ok, message in problems:
        if not ok:
            raise ConfigError(f"target.entry={entry!r}: {message}")


def build_user_workload(target_cfg: Mapping[str, Any], batch_size: int,
                        device: torch.device | str) -> UserWorkload:
    """Call the user's ``target.entry`` function for ``batch_size`` on ``device`` and wrap the result.

    Args:
        target_cfg: the Hydra ``target`` group: ``{"name": "python", "entry": "pkg.mod:make_workload"}``.
        batch_size: samples per step, >= 1.
        device: where the trial runs (``cpu`` or ``cuda``).

    Returns:
        A :class:`UserWorkload` (a :class:`oomtune.workloads.Workload`).

    Raises:
        ConfigError: a bad batch size or entry (:func:`load_entry`), or a return value that does
            not follow the protocol (module docstring). Exceptions raised by the user's function
            itself (an OOM while building the model included) propagate unchanged.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size={batch_size!r}: expected an integer >= 1")
    entry = str(target_cfg.get("entry"))
    fn = load_entry(entry)
    device = torch.device(device)
    try:
        takes_device = "device" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins / C functions without a signature
        takes_device = False
    made = fn(batch_size, device=device) if takes_device else fn(batch_size)
    model, optimizer, batches, loss_fn = _unpack(entry, made)
    _check(entry, model, optimizer, batches, loss_fn)
    if not takes_device:
        model.to(device)
    return UserWorkload(entry, model, optimizer, batches, loss_fn, device, batch_size)


class PythonTarget(Target):
    """``target=python``: the user's ``make_workload`` function, trained inside oomtune's trial
    process (:func:`build_user_workload`)."""

    name = "python"
    own_process = False

    def validate(self, target_cfg: Mapping[str, Any]) -> None:
        load_entry(target_cfg.get("entry"))  # type: ignore[arg-type]

    def build_workload(self, workload: Mapping[str, Any], batch_size: int, device: Any) -> Any:
        return build_user_workload(workload.get("target") or {}, batch_size, device)


TARGET = PythonTarget()
