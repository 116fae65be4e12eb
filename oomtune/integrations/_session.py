"""What every integration does under oomtune, whatever the framework: :class:`TrialSession`.

A session is inactive (every method a no-op) when oomtune did not launch the process. Active, it
follows the trial's settings (:func:`oomtune.script_api.trial_settings`): it starts the capture hook
(:func:`oomtune.script_api.capture_hook`: the virtual GPU on a CPU trial, the budget as a memory
fraction on CUDA), counts optimizer steps, times the measured ones and reports them once.

Timing: the measured interval runs from the end of warm-up step ``warmup_steps`` (from the first
step's start when there is no warm-up) to the end of step ``warmup_steps + measure_steps``; on CUDA
the device is synchronised before each reading (``torch.cuda.synchronize``), as the built-in trials
do. Samples: ``micro-batch x grad_accum x world size`` per optimizer step (``world size`` from
``torch.distributed`` when initialised), reported by rank 0 only, so that they are counted once;
every rank's memory is written by its capture hook (the parent keeps the highest).

Meta steps: on a CPU trial whose settings say ``execute="meta"`` (``OOMTUNE_EXECUTE``), the first
:meth:`TrialSession.attach` moves the model to the meta device, records meta storages on the virtual
GPU and makes ``cpu`` mean ``meta`` from then until :meth:`TrialSession.finish`
(:mod:`oomtune.integrations._meta`). A step that cannot run there ends the process with an
uncaught error after a ``meta_unsupported`` channel line, and the parent runs the trial again on the
CPU. Several ranks (``OOMTUNE_GPUS`` or ``WORLD_SIZE`` above 1) keep CPU steps: gloo's collectives
move real tensors.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from oomtune.exceptions import ConfigError
from oomtune.script_api import (META_UNSUPPORTED_EVENT, TrialSettings, _append, capture_hook, rank_and_world, report,
                                trial_settings)

__all__ = ["TrialSession", "IntegrationError", "fail"]


class IntegrationError(ConfigError):
    """The script cannot be run as the trial asks (e.g. no optimizer when the steps begin)."""


def fail(message: str) -> None:
    """End the trial process with one line on stderr and exit status 2 (bad input, as the CLI does):
    the parent records the line as the trial's error.

    Raises:
        SystemExit: always (status 2).
    """
    print(f"oomtune: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


class TrialSession:
    """One oomtune trial inside a framework's training loop.

    Args:
        framework: named in messages (``"Hugging Face Trainer"``, ``"Lightning"``, ``"loop"``).
        settings: the trial's settings (default: :func:`oomtune.script_api.trial_settings`; None
            makes the session inactive).
        placeholder_reads: the framework's files whose value reads of meta tensors (its loss
            logging) get a placeholder (:class:`oomtune.integrations._meta.MetaSteps`).
        answers: value reads of meta tensors the framework's integration can answer
            (:class:`oomtune.integrations._meta.MetaSteps`).
        cpu_steps_because: the framework's steps cannot run on meta, and why: a trial that asks for
            meta steps runs them on the CPU, and its record says so (``execution.note``).

    Attributes:
        active: oomtune launched the process.
        settings: :class:`oomtune.script_api.TrialSettings` (None when inactive).
        steps_done: optimizer steps finished so far.
        done: warm-up and measured steps are over (the framework should stop training).
        reported: the report line was written.
        meta: the :class:`~oomtune.integrations._meta.MetaSteps` in force while the steps run on
            the meta device (None: they run on the CPU, or not yet started).
    """

    def __init__(self, framework: str, settings: TrialSettings | None = None,
                 placeholder_reads: tuple[str, ...] = (), answers: dict[tuple[str, str], Any] | None = None,
                 cpu_steps_because: str | None = None) -> None:
        self.framework = framework
        self.settings = settings if settings is not None else trial_settings()
        self.active = self.settings is not None
        self.hook: Any = None
        self.steps_done = 0
        self.done = False
        self.reported = False
        self.precision: str | None = None
        self.precision_note: str | None = None   # said in the report (e.g. bf16 emulated on the target GPU)
        self.samples_per_step: float | None = None   # this rank's samples per optimizer step, if not the trial's
        self._t0: float | None = None
        self._t_end: float | None = None
        self.placeholder_reads = placeholder_reads
        self.answers = answers
        self.meta: Any = None
        self.cpu_steps_because = cpu_steps_because

    @property
    def on_meta(self) -> bool:
        """The trial asks for meta steps and can have them (one rank: gloo moves real tensors)."""
        import os

        return self.active and self.settings.execute == "meta" and self._cpu_steps_note() is None

    def _cpu_steps_note(self) -> str | None:
        """Why a trial that asks for meta steps runs them on the CPU (None: it need not)."""
        import os

        if self.cpu_steps_because is not None:
            return f"{self.framework}: the steps ran on the CPU: {self.cpu_steps_because}"
        ranks = [os.environ.get(k, "") for k in ("OOMTUNE_GPUS", "WORLD_SIZE")]
        if any(r.isdigit() and int(r) > 1 for r in ranks):
            return "several ranks: the steps ran on the CPU: gloo's collectives move real tensors"
        return None

    # ------------------------------------------------------------------ set-up
    @property
    def total_steps(self) -> int:
        """Warm-up plus measured optimizer steps (0 when inactive)."""
        return 0 if not self.active else self.settings.warmup_steps + self.settings.measure_steps

    def attach(self, model: Any = None, optimizer: Any = None, *tensors: Any) -> None:
        """Start the capture hook with ``model``'s parameters and buffers (and an existing
        optimizer's state), or register more existing tensors when it runs already (each storage
        once). Call it before the model is wrapped for data parallelism, and again once the
        optimizer exists.

        Raises:
            torch.OutOfMemoryError: they do not fit the budget (simulated).
        """
        if not self.active:
            return
        if self.hook is None:
            if self.on_meta:
                self._start_meta(model, optimizer, tensors)
                return
            self.hook = capture_hook(model, optimizer, *tensors)
            self.hook.precision = self.precision
            return
        from oomtune.script_api import _tensors

        self.hook.register(_tensors(model, optimizer, tensors))

    def _start_meta(self, model: Any, optimizer: Any, tensors: tuple) -> None:
        """Move ``model`` to meta, start the capture hook on meta storages and make ``cpu`` mean
        ``meta`` (:class:`~oomtune.integrations._meta.MetaSteps`); an uncaught error from then on
        writes the ``meta_unsupported`` line first (the parent runs the trial again on the CPU)."""
        from oomtune.integrations._meta import MetaSteps, move_to_meta

        if optimizer is not None and optimizer.state:
            fail(f"{self.framework}: the optimizer has state before the steps start, so the steps cannot move to "
                 "the meta device")
        if model is not None or optimizer is not None:
            move_to_meta(model, optimizer)
        self.hook = capture_hook(model, optimizer, *tensors, device="meta")
        self.hook.precision = self.precision
        self.meta = MetaSteps(self.placeholder_reads, self.answers)
        self.meta.__enter__()
        previous = sys.excepthook

        def on_error(kind: Any, value: Any, tb: Any) -> None:
            import torch

            if not isinstance(value, torch.OutOfMemoryError):
                line = (str(value).strip().splitlines() or [kind.__name__])[0][:300]
                _append({"event": META_UNSUPPORTED_EVENT, "time": time.time(),
                         "reason": f"{kind.__name__}: {line}"})
            previous(kind, value, tb)

        sys.excepthook = on_error

    def _stop_meta(self) -> None:
        """Leave :class:`~oomtune.integrations._meta.MetaSteps` (``cpu`` is the CPU again)."""
        if self.meta is not None:
            meta, self.meta = self.meta, None
            meta.__exit__(None, None, None)

    def require_optimizer(self, optimizer: Any) -> None:
        """Refuse to measure steps without an optimizer (one line, exit status 2): the integration was
        attached where the optimizer does not exist yet, or the framework did not create one."""
        if self.active and optimizer is None:
            fail(f"{self.framework}: the trainer has no optimizer when training starts, so oomtune cannot count "
                 "optimizer steps or its state; create it before training (or let the trainer create it)")

    # ------------------------------------------------------------------ steps
    def _sync(self) -> None:
        torch = sys.modules.get("torch")
        if torch is not None and self.settings.device == "cuda" and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    def step_begin(self) -> None:
        """A new optimizer step starts (its first micro-batch): starts the clock when there is no
        warm-up."""
        if self.active and self._t0 is None and self.steps_done == 0 and self.settings.warmup_steps == 0:
            self._sync()
            self._t0 = time.perf_counter()

    def step_end(self) -> bool:
        """An optimizer step ended (update and ``zero_grad`` done). Returns True once the warm-up and
        measured steps are all done (stop training then)."""
        if not self.active or self.done:
            return self.done
        self.steps_done += 1
        if self.steps_done == self.settings.warmup_steps and self._t0 is None:
            self._sync()
            self._t0 = time.perf_counter()
        if self.steps_done >= self.total_steps:
            self._sync()
            self._t_end = time.perf_counter()
            self.done = True
        return self.done

    # ------------------------------------------------------------------ the end
    def finish(self) -> None:
        """Report the measured steps (rank 0: global samples; every rank: its memory) and stop the
        capture hook (writing the recorded stream). Idempotent. When training ended before the
        measured steps, ends the process with one line (exit status 2)."""
        if not self.active or self.reported:
            return
        self.reported = True
        measured = self.steps_done - self.settings.warmup_steps
        meta = self.meta
        self._stop_meta()   # the hook's own modes sit below it on the mode stack
        if not self.done:
            if self.hook is not None:
                self.hook.stop()
            # the framework's clean-up still sees a meta model (Lightning's Strategy.teardown calls the
            # module's cpu(), which a meta tensor cannot do outside MetaSteps), so the line below is the error
            self._resume_meta(meta)
            fail(f"{self.framework}: training ended after {self.steps_done} optimizer step(s), before the "
                 f"{self.total_steps} the trial needs ({self.settings.warmup_steps} warm-up + "
                 f"{self.settings.measure_steps} measured); give it more data or steps")
        rank, world = rank_and_world()
        s = self.settings
        per_step = (self.samples_per_step if self.samples_per_step is not None
                    else s.batch_size * s.grad_accum) * world
        seconds = max(self._t_end - self._t0, 1e-9)
        if rank == 0:
            extra: dict[str, Any] = {"framework": self.framework, "micro_batch": s.batch_size,
                                     "grad_accum": s.grad_accum, "world_size": world}
            if self.precision is not None:
                extra["precision"] = self.precision
            if self.precision_note is not None:
                extra["precision_note"] = self.precision_note
            if meta is not None:
                extra["execute"] = "meta"
                extra["meta_placeholder_reads"] = meta.placeholder_count
            elif s.execute == "meta" and self._cpu_steps_note() is not None:
                extra["meta_note"] = self._cpu_steps_note()
            report(samples=per_step * measured, seconds=seconds, steps=measured, **extra)
        if self.hook is not None:
            self.hook.stop()
        self._resume_meta(meta)   # the framework's code after the steps still sees a meta model

    def _resume_meta(self, meta: Any) -> None:
        """Enter ``meta`` (a :class:`~oomtune.integrations._meta.MetaSteps` left by :meth:`finish`) again;
        nothing when None (the steps ran on the CPU)."""
        if meta is not None:
            self.meta = meta
            meta.__enter__()
