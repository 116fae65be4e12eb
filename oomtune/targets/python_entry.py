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
- ``step_fn`` (optional, instead of the forward and ``loss_fn``): ``step_fn(model, batch) -> loss``,
  a scalar tensor; any forward the model needs (Hugging Face outputs, ``torch.autocast``, several
  losses added up). oomtune still calls ``backward()`` on it, owns the accumulation, the timing and
  the optimizer step's placement. With ``step_fn`` a batch may be anything (a dict of tensors).
- ``max_grad_norm`` (optional float): ``torch.nn.utils.clip_grad_norm_`` before each optimizer step,
  as trainers clip.
- ``activation_checkpointing``: passed (keyword) when the function has a parameter of that name; the
  search's ``search.space.activation_checkpointing`` needs it.
- Shapes that vary by step (padded text of varying length, multi-scale images): declare the
  distribution in the target group, ``target.seq_len={low: 64, high: 512, pad_multiple: 8}`` (or a
  token file's documents, or ``target.image_size=[64, 96, 128]``: the spellings of the built-in
  models, :mod:`oomtune.workloads.shapes`), and return ``make_batch(shape) -> batch``: oomtune then
  makes each step's batch of the distribution's shape in its seeded order (``batches`` may be left
  out), so the virtual-GPU soak and the frontier at the worst shape apply to the entry.

One training step is one optimizer step: ``grad_accum`` micro-batches (the workload key
``grad_accum``, set by ``search.global_batch``), each forward, loss (divided by ``grad_accum``) and
``backward()``, then ``optimizer.step()`` and ``optimizer.zero_grad(set_to_none=True)``:
:class:`UserWorkload` is a :class:`oomtune.workloads.Workload`, so the builtin trial process runs it
unchanged (timing, data-wait fraction, virtual GPU registration through ``tensors_before_step()``).
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
from oomtune.workloads.loop import Workload

__all__ = ["entry_label", "load_entry", "build_user_workload", "UserWorkload", "PythonTarget", "TARGET"]


def entry_label(entry: Any) -> str:
    """How an entry is named in messages: the string itself, or ``module.qualname`` of a function
    passed directly (:func:`oomtune.predict` takes ``make_workload`` itself)."""
    if callable(entry) and not isinstance(entry, str):
        return f"{getattr(entry, '__module__', '?')}.{getattr(entry, '__qualname__', type(entry).__name__)}"
    return str(entry)


def load_entry(entry: str | Callable[..., Any]) -> Callable[..., Any]:
    """Import the function named by ``entry`` (``pkg.mod:func`` or ``file.py:func``); a function
    passed directly (not a string) is returned as it is.

    A relative file path is taken from the current directory. Errors raised while the module runs
    (other than import errors) propagate unchanged. The environment variables and ``sys.argv`` the
    module reads while it loads are logged (:func:`oomtune.capture.reads.recording`).

    Raises:
        ConfigError: a malformed entry, a module or file that cannot be found or imported (its own
            missing dependency or syntax error included, named in the message), a missing attribute,
            or an attribute that is not callable.
    """
    if callable(entry) and not isinstance(entry, str):
        return entry
    from oomtune.targets._entry_form import split_entry

    where, name = split_entry(entry)
    from oomtune.capture.reads import recording

    with recording():   # module-level reads of os.environ / sys.argv key the stream cache's entries
        module = _load_file(entry, where) if is_file_entry(where) else _import_module(entry, where)
    fn = getattr(module, name, None)
    if fn is None:
        import difflib

        functions = [k for k, v in vars(module).items() if callable(v) and not k.startswith("_")]
        close = difflib.get_close_matches(name, functions, n=1)
        hint = f" (did you mean {where}:{close[0]}?)" if close else ""
        raise ConfigError(f"target.entry={entry!r}: {where!r} has no function {name!r}{hint}")
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
    """A :class:`Workload` around the user's model, optimizer, batches and loss (or step) function.

    Attributes as :class:`Workload` (``model``, ``optimizer``, ``device``, ``batch_size`` (the
    micro-batch), ``grad_accum``, ``samples_per_step`` = batch size x grad_accum, ``precision`` =
    ``"fp32"``: the user's code decides its own autocast, ``fallback_reason`` = None), plus ``entry``,
    ``loss_fn``, ``step_fn`` and ``max_grad_norm``.
    """

    def __init__(self, entry: str, model: nn.Module, optimizer: torch.optim.Optimizer,
                 batches: Iterable[Any], loss_fn: Callable[..., torch.Tensor] | None,
                 device: torch.device, batch_size: int, *, step_fn: Callable[..., Any] | None = None,
                 grad_accum: int = 1, max_grad_norm: float | None = None) -> None:
        self.spec, self.entry = None, entry
        self.model, self.optimizer, self.device = model, optimizer, device
        self.batch_size, self.grad_accum = batch_size, grad_accum
        self.samples_per_step = batch_size * grad_accum
        self.precision, self.fallback_reason = "fp32", None
        self.loss_fn = loss_fn or _default_loss
        self.step_fn, self.max_grad_norm = step_fn, max_grad_norm
        self._batches = _endless(batches, device, entry)
        self._static_batch, self._scaler = None, None

    def loss(self, batch: Any) -> torch.Tensor:
        """The micro-batch's loss: ``step_fn(model, batch)``, or the forward and ``loss_fn``.

        Raises:
            ConfigError: a batch that is not a pair (without ``step_fn``), or a ``step_fn`` that
                does not return a scalar tensor.
        """
        if self.step_fn is not None:
            loss = self.step_fn(self.model, batch)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ConfigError(f"target.entry={self.entry!r}: step_fn(model, batch) must return the loss as "
                                  f"a scalar tensor, got {type(loss).__name__}")
            return loss
        try:
            inputs, targets = batch
        except (TypeError, ValueError):
            raise ConfigError(f"target.entry={self.entry!r}: each batch must be a pair (inputs, targets), "
                              f"got {type(batch).__name__} (or return a step_fn)") from None
        if isinstance(inputs, (tuple, list)):
            out = self.model(*inputs)
        elif isinstance(inputs, dict):
            out = self.model(**inputs)
        else:
            out = self.model(inputs)
        loss = self.loss_fn(out, targets)
        del out
        return loss

    def update(self) -> None:
        """``clip_grad_norm_`` (with ``max_grad_norm``), ``optimizer.step()``, ``zero_grad(set_to_none=True)``."""
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        super().update()


_KNOWN_KEYS = ("model", "optimizer", "batches", "loss_fn", "step_fn", "max_grad_norm", "make_batch")


def _unpack(entry: str, made: Any) -> dict[str, Any]:
    """The returned workload as a dict with the keys of :data:`_KNOWN_KEYS` (absent ones None)."""
    if isinstance(made, Mapping):
        missing = [k for k in ("model", "optimizer") if k not in made]
        if "batches" not in made and "make_batch" not in made:
            missing.append("batches")
        if missing:
            raise ConfigError(f"target.entry={entry!r}: the returned dict lacks {', '.join(missing)}")
        unknown = sorted(set(made) - set(_KNOWN_KEYS))
        if unknown:
            raise ConfigError(f"target.entry={entry!r}: the returned dict has unknown key {unknown[0]!r}; "
                              f"expected some of {', '.join(_KNOWN_KEYS)}")
        return {k: made.get(k) for k in _KNOWN_KEYS}
    if isinstance(made, tuple) and len(made) in (3, 4):
        return dict(zip(_KNOWN_KEYS, made)) | {k: None for k in _KNOWN_KEYS[len(made):]}
    raise ConfigError(f"target.entry={entry!r}: expected a dict(model=, optimizer=, batches=[, loss_fn=, step_fn=]) "
                      f"or a tuple (model, optimizer, batches[, loss_fn]), got {type(made).__name__}")


def _check(entry: str, parts: Mapping[str, Any]) -> None:
    model, optimizer, batches = parts["model"], parts["optimizer"], parts["batches"]
    norm = parts["max_grad_norm"]
    problems = (
        (isinstance(model, nn.Module), f"model is a {type(model).__name__}, not a torch.nn.Module"),
        (isinstance(optimizer, torch.optim.Optimizer),
         f"optimizer is a {type(optimizer).__name__}, not a torch.optim.Optimizer"),
        (batches is None or isinstance(batches, Iterable) and not isinstance(batches, (torch.Tensor, str, bytes)),
         f"batches is a {type(batches).__name__}, not an iterable of (inputs, targets)"),
        *((parts[k] is None or callable(parts[k]), f"{k} is a {type(parts[k]).__name__}, not callable")
          for k in ("loss_fn", "step_fn", "make_batch")),
        (parts["loss_fn"] is None or parts["step_fn"] is None,
         "give loss_fn or step_fn, not both (step_fn computes the loss itself)"),
        (norm is None or (isinstance(norm, (int, float)) and not isinstance(norm, bool) and norm > 0),
         f"max_grad_norm={norm!r} is not a number > 0"),
    )
    for ok, message in problems:
        if not ok:
            raise ConfigError(f"target.entry={entry!r}: {message}")


def _entry_takes(entry: Any, name: str) -> bool:
    """Whether ``entry``'s function has a parameter ``name``: what the check before any trial found
    (:func:`oomtune.targets._entry_form.known_parameters`, the module imported in a process of its
    own), else from the function itself (imported here: a trial or capture process, the API)."""
    from oomtune.targets._entry_form import known_parameters

    known = known_parameters(entry)
    if known is False:
        return _takes(load_entry(entry), name)
    return known is not None and name in known


def _takes(fn: Callable[..., Any], name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins / C functions without a signature
        return False


def check_checkpointing_argument(target_cfg: Mapping[str, Any], wanted: bool) -> None:
    """Refuse activation checkpointing for an entry function without an ``activation_checkpointing``
    parameter (it could not be switched on: every trial would measure the same thing).

    Raises:
        ConfigError: ``wanted`` and the function lacks the parameter (or the entry is bad).
    """
    entry = entry_label(target_cfg.get("entry"))
    if wanted and not _entry_takes(target_cfg.get("entry"), "activation_checkpointing"):
        raise ConfigError(f"target.entry={entry!r}: search.space.activation_checkpointing needs the function to "
                          "take an activation_checkpointing argument (e.g. def make_workload(batch_size, device, "
                          "activation_checkpointing=False): ... model.gradient_checkpointing_enable() when true)")


def build_user_workload(target_cfg: Mapping[str, Any], batch_size: int,
                        device: torch.device | str, *, grad_accum: int = 1,
                        activation_checkpointing: bool | None = None) -> UserWorkload:
    """Call the user's ``target.entry`` function for ``batch_size`` on ``device`` and wrap the result.

    Args:
        target_cfg: the Hydra ``target`` group: ``{"name": "python", "entry": "pkg.mod:make_workload"}``.
        batch_size: samples per micro-batch, >= 1.
        device: where the trial runs (``cpu`` or ``cuda``).
        grad_accum: micro-batches per optimizer step.
        activation_checkpointing: passed to the function (keyword) when it takes such a parameter;
            True for a function without one is refused. None: not passed.

    Returns:
        A :class:`UserWorkload` (a :class:`oomtune.workloads.Workload`).

    Raises:
        ConfigError: a bad batch size or entry (:func:`load_entry`), or a return value that does
            not follow the protocol (module docstring). Exceptions raised by the user's function
            itself (an OOM while building the model included) propagate unchanged.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size={batch_size!r}: expected an integer >= 1")
    entry = entry_label(target_cfg.get("entry"))
    fn = load_entry(target_cfg.get("entry"))
    device = torch.device(device)
    takes_device = _takes(fn, "device")
    kwargs: dict[str, Any] = {"device": device} if takes_device else {}
    if activation_checkpointing is not None:
        check_checkpointing_argument(target_cfg, bool(activation_checkpointing))
        if _takes(fn, "activation_checkpointing"):
            kwargs["activation_checkpointing"] = bool(activation_checkpointing)
    from oomtune.workloads.shapes import entry_shape_distribution

    dist = entry_shape_distribution(target_cfg)   # checked before the user's code runs
    made = fn(batch_size, **kwargs)
    parts = _unpack(entry, made)
    _check(entry, parts)
    if not takes_device:
        parts["model"].to(device)
    make = parts["make_batch"]
    if dist.key is not None and make is None:
        raise ConfigError(f"target.entry={entry!r}: target.{dist.key} declares a shape distribution, so the "
                          f"returned dict needs make_batch({dist.key}) -> one batch of that shape")
    spec = None
    batches = parts["batches"]
    if make is not None:
        from oomtune.workloads.models import ModelSpec

        top = dist.max_shape

        def make_batch(n: int, dev: Any, shape: Any = None) -> Any:
            return make(top if shape is None else shape)

        spec = ModelSpec(parts["model"], "user", make_batch)
        spec.shapes = dist
        if dist.key is not None or batches is None:   # batches of the declared shapes, in the data's order
            batches = (make_batch(batch_size, device, s) for s in dist.iter_shapes(batch_size))
    wl = UserWorkload(entry, parts["model"], parts["optimizer"], batches, parts["loss_fn"], device, batch_size,
                      step_fn=parts["step_fn"], grad_accum=grad_accum, max_grad_norm=parts["max_grad_norm"])
    wl.spec = spec
    return wl

