"""A built-in workload: model + optimizer + data + one training step, and its timed loop."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from oomtune.exceptions import ConfigError
from oomtune.workloads.data import make_batches
from oomtune.workloads.models import ModelSpec, build_model, cfg_choice, cfg_float

__all__ = ["Workload", "StepTimings", "build_workload", "build_capture_workload",
           "validate_workload_config", "grad_accum_of", "checkpointing_of", "prediction_workload",
           "TRAINING_KEYS"]

from oomtune.workloads.keys import OPTIMIZERS, PRECISION_NAMES  # noqa: E402

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
assert tuple(PRECISIONS) == PRECISION_NAMES


from oomtune.workloads.training import (TRAINING_KEYS, checkpointing_of, grad_accum_of,  # noqa: E402,F401
                                       prediction_workload)


@dataclass
class StepTimings:
    """Wall times of measured steps, in seconds.

    ``step_s[i]`` is the whole step i (waiting for its batch included); ``data_wait_s[i]`` the part
    spent blocked in ``next(batches)``.
    """

    step_s: list[float] = field(default_factory=list)
    data_wait_s: list[float] = field(default_factory=list)
    samples_per_step: int = 0

    @property
    def total_s(self) -> float:
        """Sum of the measured step times, in seconds (0.0 without steps)."""
        return sum(self.step_s)

    @property
    def mean_step_s(self) -> float | None:
        """Mean step time in seconds; None without steps."""
        return self.total_s / len(self.step_s) if self.step_s else None

    @property
    def data_wait_fraction(self) -> float | None:
        """Time blocked on data / step time (0..1); near 1 means input-bound. None without steps."""
        return sum(self.data_wait_s) / self.total_s if self.step_s and self.total_s > 0 else None

    @property
    def samples_per_s(self) -> float | None:
        """Throughput in samples per second over the measured steps; None without step time."""
        return self.samples_per_step * len(self.step_s) / self.total_s if self.total_s > 0 else None


class Workload:
    """One training setup. A *step* is one optimizer step: ``grad_accum`` micro-batches of
    ``batch_size`` samples, each forward, loss and backward (the loss divided by ``grad_accum``, as
    accumulating trainers do), then ``optimizer.step()`` and ``zero_grad(set_to_none=True)``
    (:meth:`train_step`; :meth:`step` is one micro-batch and the update, for ``grad_accum`` 1);
    ``batches()`` is the endless micro-batch iterator on ``device``.

    Attributes: ``model``, ``optimizer``, ``device``, ``batch_size`` (the micro-batch),
    ``grad_accum``, ``samples_per_step`` (= batch_size x grad_accum: images or sequences per
    optimizer step; per rank under ``model.parallel``), ``precision`` (effective:
    ``fp32``/``bf16``/``fp16``), ``fallback_reason`` (None, or why the workload runs other than
    asked: precision not available on this device, or meta ops missing so capture ran on CPU),
    ``pending_wrap`` (``wrap(model, device)`` applied at the first forward, e.g. DDP:
    :mod:`oomtune.workloads.parallel`; None once applied or when there is none).
    """

    grad_accum = 1

    def __init__(self, spec: ModelSpec, optimizer: torch.optim.Optimizer, device: torch.device,
                 batch_size: int, precision: str, batches: Iterator[Any],
                 static_batch: Any, fallback_reason: str | None, grad_accum: int = 1) -> None:
        self.spec, self.model, self.optimizer = spec, spec.module, optimizer
        self.device, self.batch_size = device, batch_size
        self.grad_accum = grad_accum
        self.samples_per_step = batch_size * grad_accum
        self.precision, self.fallback_reason = precision, fallback_reason
        self._batches, self._static_batch = batches, static_batch
        self._scaler = (torch.amp.GradScaler("cuda")
                        if precision == "fp16" and device.type == "cuda" else None)
        self.pending_wrap: Any = None

    def batches(self) -> Iterator[Any]:
        """The endless iterator of ``(inputs, targets)`` batches on ``self.device`` (shared state)."""
        return self._batches

    def _autocast(self) -> contextlib.AbstractContextManager:
        dtype = PRECISIONS[self.precision]
        if dtype is None:
            return contextlib.nullcontext()
        if self.device.type in ("meta", "cpu"):
            # Captures and CPU trials stand for a CUDA run: CUDA's autocast policy (op lists,
            # weight-cast cache), not the CPU's (oomtune.capture.cuda_autocast).
            from oomtune.capture.cuda_autocast import cuda_autocast

            return cuda_autocast(dtype)
        return torch.autocast(self.device.type, dtype=dtype)

    def loss(self, batch: Any) -> torch.Tensor:
        """Forward and loss of one micro-batch (under the workload's autocast). The first call
        applies ``pending_wrap`` first (DDP's construction allocates its buckets there)."""
        if self.pending_wrap is not None:
            wrap, self.pending_wrap = self.pending_wrap, None
            self.model = wrap(self.model, self.device)
        x, y = batch
        with self._autocast():
            out = self.model(x)
            loss = nn.functional.cross_entropy(out.flatten(0, -2).float(), y.flatten())
        del out
        return loss

    def backward(self, batch: Any, scale: float = 1.0) -> None:
        """Forward, loss and backward of one micro-batch, the loss multiplied by ``scale``
        (``1 / grad_accum`` when accumulating); gradients add up in ``.grad``."""
        loss = self.loss(batch)
        if scale != 1.0:
            loss = loss * scale
        if self._scaler is not None:
            self._scaler.scale(loss).backward()
        else:
            loss.backward()

    def update(self) -> None:
        """The optimizer step (through the GradScaler for fp16 on CUDA) and ``zero_grad(set_to_none=True)``."""
        if self._scaler is not None:
            self._scaler.step(self.optimizer)
            self._scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def step(self, batch: Any) -> None:
        """One micro-batch (forward, loss, backward) and the optimizer update on ``batch``; returns
        nothing (no host sync). With ``grad_accum`` > 1 use :meth:`train_step`."""
        self.backward(batch)
        self.update()

    def train_step(self, batches: Iterator[Any] | None = None) -> float:
        """One optimizer step: ``grad_accum`` micro-batches from ``batches`` (default: the
        workload's own iterator), then the update. Returns the seconds spent waiting for batches."""
        it = self._batches if batches is None else batches
        waited = 0.0
        n = self.grad_accum
        for i in range(n):
            t0 = time.perf_counter()
            batch = next(it)
            waited += time.perf_counter() - t0
            self.backward(batch, 1.0 / n if n > 1 else 1.0)
            del batch
        self.update()
        return waited

    def use_shapes(self, shapes: Iterable[Any]) -> None:
        """Replace the batch iterator by fresh synthetic batches of ``shapes`` (``seq_len`` /
        ``image_size`` per step, see :mod:`oomtune.workloads.shapes`), each made when a step asks
        for it, as the variable-shape data source makes them: for capturing one shape's step
        (:mod:`oomtune.trial.soak`)."""
        self._batches = (self.spec.make_batch(self.batch_size, self.device, s) for s in shapes)

    def hold_first_batch(self) -> None:
        """Take the first batch out of :meth:`batches` and hold it as the static batch: counted as
        alive before the step (:meth:`tensors_before_step`, as a built-in's static synthetic batch:
        the inputs occupy device memory during the step) and yielded first again by :meth:`batches`."""
        import itertools

        first = next(self._batches)
        self._static_batch = first
        self._batches = itertools.chain([first], self._batches)

    def tensors_before_step(self) -> list[torch.Tensor]:
        """Tensors alive between steps: parameters, buffers, optimizer state, the static synthetic
        batch (for ``VirtualGPU.register`` / ``capture_stream(existing=...)``)."""
        out = list(self.model.parameters()) + list(self.model.buffers())
        for state in self.optimizer.state.values():
            out += [v for v in state.values() if isinstance(v, torch.Tensor)]
        if self._static_batch is not None:
            out += list(self._static_batch)
        return out

    def run_steps(self, n: int, *, sync: bool = True) -> StepTimings:
        """Run ``n`` optimizer steps (:meth:`train_step`), timing each (wall clock) and the time
        blocked waiting for its micro-batches.

        ``sync``: on CUDA, synchronise after each step so its time includes the GPU work.
        """
        timings = StepTimings(samples_per_step=self.samples_per_step)
        do_sync = sync and self.device.type == "cuda"
        for _ in range(n):
            t0 = time.perf_counter()
            waited = self.train_step()
            if do_sync:
                torch.cuda.synchronize(self.device)
            t2 = time.perf_counter()
            timings.step_s.append(t2 - t0)
            timings.data_wait_s.append(waited)
        return timings


def _optimizer(cfg: Mapping[str, Any], model: nn.Module) -> torch.optim.Optimizer:
    name = cfg_choice(cfg, "optimizer", "sgd", OPTIMIZERS)
    lr = cfg_float(cfg, "lr", 0.1 if name == "sgd" else 1e-3)  # >= 0, as torch.optim requires
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=lr)
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr)
    raise ConfigError(f"model.optimizer={name!r}: choose one of {', '.join(OPTIMIZERS)}")


def _precision(cfg: Mapping[str, Any], device: torch.device) -> tuple[str, str | None]:
    asked = cfg_choice(cfg, "precision", "fp32", tuple(PRECISIONS))
    if asked == "fp32" or device.type in ("meta", "cpu") or torch.amp.is_autocast_available(device.type):
        return asked, None  # meta/cpu: CUDA's autocast policy is emulated (Workload._autocast)
    return "fp32", f"precision {asked} unavailable on {device.type} (no autocast): ran fp32"


def build_workload(cfg: Mapping[str, Any], batch_size: int,
                   device: torch.device | str) -> Workload:
    """Build the workload described by the Hydra ``model`` group ``cfg`` (a plain mapping).

    ``cfg["name"]`` is ``resnet``, ``transformer`` or ``mlp`` (see :mod:`oomtune.workloads.models`
    for their keys); common keys ``optimizer`` (sgd with momentum 0.9 | adam | adamw), ``lr``,
    ``precision`` (fp32 | bf16 | fp16, autocast; GradScaler for fp16 on CUDA), ``data`` (see
    :mod:`oomtune.workloads.data`), ``grad_accum`` (micro-batches per optimizer step, default 1) and
    ``activation_checkpointing`` (transformer blocks / ResNet stages recomputed in backward, see
    :mod:`oomtune.workloads.models`). ``device="meta"`` builds everything on meta for capture.
    ``parallel`` (none | ddp | fsdp, :mod:`oomtune.workloads.parallel`) needs the process group of
    the rank (or :func:`oomtune.workloads.parallel.fake_process_group`): ``fsdp`` builds the model
    on meta and shards it before the optimizer is made, ``ddp`` wraps it at the first step.

    Raises:
        ConfigError: unknown model, optimizer, precision, data source or parallel mode; bad sizes;
            batch_size < 1; a bad ``grad_accum``; ``activation_checkpointing`` on a model without it
            (mlp); ``parallel`` without a process group.
    """
    from oomtune.workloads.parallel import fsdp_model, parallel_mode, wrap_lazily

    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size={batch_size!r}: expected an integer >= 1")
    device = torch.device(device)
    mode = parallel_mode(cfg)
    if mode == "fsdp":
        spec = build_model(cfg, torch.device("meta"))
        spec.module = fsdp_model(spec.module, device)
    else:
        spec = build_model(cfg, device)
    optimizer = _optimizer(cfg, spec.module)
    precision, reason = _precision(cfg, device)
    batches, static = make_batches(spec, cfg.get("data"), batch_size, device)
    workload = Workload(spec, optimizer, device, batch_size, precision, batches, static, reason,
                        grad_accum=grad_accum_of(cfg))
    if mode == "ddp":
        wrap_lazily(workload)
    return workload


def build_capture_workload(cfg: Mapping[str, Any], batch_size: int) -> Workload:
    """Build on meta and run one probe step there (creating the optimizer state, so the next step
    is the steady state); if an op lacks a meta kernel, rebuild on CPU and say so in
    ``fallback_reason``. Data is forced to synthetic (no loader, no decode delay).

    Raises:
        ConfigError: as :func:`build_workload`.
    """
    cfg = dict(cfg)
    cfg["data"] = {"source": "synthetic"}
    wl = build_workload(cfg, batch_size, "meta")
    try:
        wl.train_step()
        return wl
    except (NotImplementedError, RuntimeError) as e:
        reason = f"meta kernel missing ({str(e).splitlines()[0][:200]}): captured on cpu"
    wl = build_workload(cfg, batch_size, "cpu")
    wl.train_step()
    wl.fallback_reason = reason if wl.fallback_reason is None else f"{wl.fallback_reason}; {reason}"
    return wl


def validate_workload_config(cfg: Mapping[str, Any]) -> None:
    """Check a ``model`` group without running anything: name and sizes (the model is built on
    meta, which costs no memory), optimizer, precision and data settings (source, path existence,
    loader options). Every key used is checked for type and range: integers are ints (not bools)
    with their minimum, numbers finite, switches (``channels_last``, ``data.pin_memory``) real
    bools, ``data.prefetch_factor`` null or an int >= 1 and only with ``data.num_workers`` > 0 (as
    ``torch.utils.data.DataLoader`` requires). Keys this module does not use (e.g. ``target``) are
    ignored.

    Raises:
        ConfigError: the first problem found, in one line.
    """
    from oomtune.workloads.data import check_data_config

    from oomtune.workloads.parallel import parallel_mode, world_size

    spec = build_model(cfg, torch.device("meta"))
    _optimizer(cfg, spec.module)
    _precision(cfg, torch.device("cpu"))
    check_data_config(spec, cfg.get("data"))
    grad_accum_of(cfg)
    checkpointing_of(cfg)
    parallel_mode(cfg)
    world_size(cfg)
