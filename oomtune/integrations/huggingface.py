"""oomtune in a Hugging Face ``Trainer`` script: one argument.

    from oomtune.integrations.huggingface import OomtuneCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[OomtuneCallback()])
    trainer.train()

Without oomtune the callback does nothing. Under oomtune (``oomtune search target=cmd
"target.command='python train.py'"``; the batch size reaches the Trainer through the callback, so
the command needs no ``{batch_size}``) it:

- sets the trial's micro-batch (``per_device_train_batch_size``), ``gradient_accumulation_steps``
  and, when the search varies it, ``activation_checkpointing`` (``gradient_checkpointing`` before
  transformers 5) on the Trainer when it is created (``on_init_end``), turns
  ``auto_find_batch_size`` off (it would change the batch the trial measures) and sets ``max_steps``
  to the trial's warm-up + measured steps;
- attaches the virtual GPU on a CPU trial at ``on_init_end``, before the Trainer wraps the model
  (DDP's buckets are counted), and registers the optimizer's state at ``on_train_begin``;
- counts optimizer steps (``on_step_end``), times the measured steps and stops training after them
  (``control.should_training_stop``); reports global samples (``per_device_train_batch_size x
  gradient_accumulation_steps x world size``) from rank 0 and the memory of every rank;
- passes the Trainer's precision (``bf16``/``fp16``) on in the report; the Trainer's own autocast
  runs as it would;
- on a virtual-GPU trial, has transformers' bf16 check answered by the target GPU from the moment
  this module is imported (before the script builds its ``TrainingArguments``, which checks then):
  ``bf16=True`` is accepted or refused as on that card, not as on this machine
  (:mod:`oomtune.integrations._hf_precision`).

Code after ``trainer.train()`` still runs under oomtune (guard it with ``if not oomtune.launched():``
to skip saving or evaluation in trials).

The Trainer is reached from ``on_init_end`` through the calling frame (its ``__init__`` calls the
callbacks with ``args`` but not with itself); its micro-batch is ``Trainer._train_batch_size``, which
``__init__`` copies from ``args.train_batch_size`` just before (transformers/trainer.py).
"""

from __future__ import annotations

import sys
from typing import Any

from transformers import TrainerCallback

from oomtune.integrations._hf_precision import emulated_bf16_note, install_if_virtual_gpu, target_gpu
from oomtune.integrations._session import TrialSession, fail

__all__ = ["OomtuneCallback"]

install_if_virtual_gpu(fail)   # TrainingArguments(bf16=True) checks the hardware before any callback exists


def _trainer_from_stack() -> Any | None:
    """The ``transformers.Trainer`` whose ``__init__`` is running on this thread (None: not found)."""
    from transformers import Trainer

    frame = sys._getframe(1)
    for _ in range(30):
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer):
            return candidate
        frame = frame.f_back
    return None


#: ``TrainingArguments.parallel_mode`` values (transformers' ``ParallelMode``) in which every process trains
#: alone: no ``DistributedDataParallel``, so several launched ranks would not share their samples.
_NOT_DISTRIBUTED = ("not_parallel", "not_distributed")


def _require_distributed(args: Any) -> None:
    """Several ranks (a launcher's ``WORLD_SIZE``, a process group: :func:`oomtune.script_api.rank_and_world`)
    need a Trainer that joins them. transformers decides it in ``TrainingArguments._setup_devices``: on a
    machine without CUDA, accelerate's state is distributed only with ``use_cpu=True``; otherwise
    ``parallel_mode`` is ``not_parallel``, the Trainer does not wrap the model in DDP and each rank trains
    alone on its own samples, while the trial would count ``micro-batch x accumulation x ranks`` as one
    step's global batch.

    Raises:
        SystemExit: status 2 with one line (:func:`oomtune.integrations._session.fail`) when the launch has
            several ranks and the Trainer is not distributed.
    """
    from oomtune.script_api import rank_and_world

    _rank, world = rank_and_world()
    mode = getattr(getattr(args, "parallel_mode", None), "value", None)
    if world > 1 and mode in _NOT_DISTRIBUTED:
        fail(f"Hugging Face Trainer: launched as {world} ranks, but the Trainer trains each rank alone "
             f"(TrainingArguments.parallel_mode={mode}: no DistributedDataParallel, so the global batch would not "
             "be micro-batch x accumulation x ranks); on a machine without CUDA pass "
             "TrainingArguments(use_cpu=True), which joins the ranks over gloo")


class OomtuneCallback(TrainerCallback):
    """A ``transformers.TrainerCallback`` that runs the Trainer as an oomtune trial (module docstring);
    a no-op when oomtune did not launch the process."""

    def __init__(self) -> None:
        # the Trainer's own value reads (its isnan loss filter, tr_loss.item(), grad_norm.item()) feed its
        # logs only: on meta they get a placeholder (oomtune.integrations._meta)
        self.session = TrialSession("Hugging Face Trainer", placeholder_reads=("transformers/trainer.py",),
                                    answers={("transformers/masking_utils.py", "find_packed_sequence_indices"):
                                             self._not_packed})
        self._batch_keys: set[str] = set()

    def _not_packed(self) -> bool:
        """On meta: transformers' packed-sequence check (``find_packed_sequence_indices`` reading
        ``(packed_sequence_mask[:, -1] == 0).all()``) is True, one sequence per row, when the batch
        carries no ``position_ids`` (the model made them with ``arange``); a batch that carries them
        (a packing collator) needs their values: the steps run on the CPU.

        Raises:
            MetaStepUnsupported: the batch carries ``position_ids``.
        """
        from oomtune.integrations._meta import MetaStepUnsupported

        if "position_ids" in self._batch_keys:
            raise MetaStepUnsupported("the batch carries position_ids, and whether they are packed is in their values")
        return True

    def _see_batch(self, module: Any, args: Any, kwargs: dict) -> None:
        self._batch_keys = set(kwargs)

    # -------------------------------------------------------------- set-up
    def on_init_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> Any:
        s = self.session
        if not s.active:
            return control
        _require_distributed(args)
        t = s.settings
        trainer = _trainer_from_stack()
        if trainer is None:
            fail("Hugging Face Trainer: OomtuneCallback must be passed to Trainer(callbacks=[...]) so that it runs "
                 "when the Trainer is created")
        args.per_device_train_batch_size = t.batch_size
        trainer._train_batch_size = args.train_batch_size   # what __init__ copied before the callbacks ran
        args.gradient_accumulation_steps = t.grad_accum
        args.auto_find_batch_size = False
        args.max_steps = s.total_steps
        if t.activation_checkpointing is not None:
            for name in ("activation_checkpointing", "gradient_checkpointing"):
                if hasattr(args, name):
                    setattr(args, name, bool(t.activation_checkpointing))
        s.precision = "bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False) else "fp32"
        if s.precision == "bf16" and t.device == "cpu":
            s.precision_note = emulated_bf16_note(target_gpu())
        s.attach(model)
        if s.meta is not None and model is not None:
            model.register_forward_pre_hook(self._see_batch, with_kwargs=True)
        return control

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       **kwargs: Any) -> Any:
        s = self.session
        if s.active:
            s.require_optimizer(optimizer)
            s.attach(model, optimizer)
        return control

    # -------------------------------------------------------------- steps
    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self.session.step_begin()
        return control

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        s = self.session
        if s.active and s.step_end():
            control.should_training_stop = True
            s.finish()
        return control

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self.session.finish()
        return control
