"""oomtune in a Lightning script: one argument.

    from oomtune.integrations.lightning import OomtuneCallback
    trainer = lightning.pytorch.Trainer(max_epochs=3, callbacks=[OomtuneCallback()])
    trainer.fit(model)

Without oomtune the callback does nothing. Under oomtune (``oomtune search target=cmd
"target.command='python train.py'"``) it:

- sets the trial's micro-batch on the module's ``batch_size`` attribute (or its ``hparams`` or
  datamodule's, found as ``Tuner.scale_batch_size`` finds it: ``lightning_hasattr`` /
  ``lightning_setattr``), ``trainer.accumulate_grad_batches`` and, when the search varies it, the
  module's ``activation_checkpointing`` attribute, at ``setup`` (before the dataloaders are made);
  stops after the trial's warm-up + measured optimizer steps (``fit_loop`` ``max_steps``, and no
  epoch limit);
- attaches the virtual GPU on a CPU trial at ``setup``, before the strategy wraps the model
  (DDP's buckets are counted), and registers the optimizers' state at ``on_train_start``;
- counts optimizer steps (``trainer.global_step`` after each batch), times the measured ones and
  reports global samples (micro-batch x accumulation x world size) from rank 0 and the memory of
  every rank; passes ``trainer.precision`` on in the report.

On the virtual GPU with meta steps (``trial.execute=auto|meta``, one rank) the module moves to the
meta device at ``setup`` and ``cpu`` means ``meta`` (:mod:`oomtune.integrations._meta`): the
strategy's ``batch_to_device`` (lightning/fabric/utilities/apply_func.py ``move_data_to_device``:
``data.to(root_device)``) copies each batch the data loader collated on the host to meta, where a
GPU run copies it to the device. The value reads of Lightning 2.6's single-device fit, and their
answers:

- ``has_len_all_ranks`` (lightning/pytorch/utilities/data.py, from ``_FitLoop.setup_data`` and
  ``_EvaluationLoop.setup_data``, the sanity check's too) compares the loader's length, made with
  ``torch.tensor(local_length, device=root_device)``, with 0: a value known on the host, answered
  exactly;
- the logged metrics (``self.log``) turned into numbers for the logger and the progress bar
  (``_ResultCollection.metrics`` -> ``convert_tensors_to_scalars``' ``to_item``,
  lightning/fabric/utilities/apply_func.py; the ``RichProgressBar``'s ``get_metrics``,
  lightning/pytorch/callbacks/progress/) get placeholders (0.0 for a float, 0 for an integer, False
  for a bool): they steer no allocation;
- read by nothing else in a default ``fit``: gradient clipping (``clip_grad_norm_`` without
  ``error_if_nonfinite``) and the automatic optimization closure read no value
  (``check_finite_loss`` is not called there in 2.6), ``_broadcast_sigterm_tensor``'s ``item()``
  runs only with several ranks, the progress bar shows the metrics already converted;
- a callback that decides on a value (``EarlyStopping``, ``ModelCheckpoint(monitor=...)``), a
  ``GradScaler`` (``precision="16-mixed"``) or the module's own code reads a value meta has none of:
  the trial runs again on the CPU (``execution.fallback``).

Several ranks keep CPU steps (gloo's collectives move real tensors), with ``execution.note``.

Batches and datasets that ``train_dataloader()`` creates as tensors on the main thread count as
device memory on the virtual GPU (every CPU storage does there; build datasets before ``fit`` or in
DataLoader workers to keep them out).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback

from oomtune.integrations._session import TrialSession, fail

__all__ = ["OomtuneCallback"]

#: Lightning's files whose value reads of meta tensors feed its logs only (module docstring): the one
#: value read of lightning/fabric/utilities/apply_func.py is ``convert_tensors_to_scalars``' ``to_item``.
_LOGGING_READS = ("lightning/fabric/utilities/apply_func.py", "lightning/pytorch/callbacks/progress/")


class OomtuneCallback(Callback):
    """A ``lightning.pytorch.Callback`` that runs ``Trainer.fit`` as an oomtune trial (module
    docstring); a no-op when oomtune did not launch the process."""

    def __init__(self) -> None:
        # checked with lightning 2.6.6 (module docstring): the logged metrics' conversion to numbers
        # (convert_tensors_to_scalars' to_item) and the progress bars feed the logs only, so on meta they
        # get placeholders; has_len_all_ranks' length is known on the host (oomtune.integrations._meta)
        self.session = TrialSession("Lightning", placeholder_reads=_LOGGING_READS)
        self._steps_seen = 0

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        s = self.session
        if not s.active or stage != "fit":
            return
        from lightning.pytorch.utilities.parsing import lightning_hasattr, lightning_setattr

        t = s.settings
        if not lightning_hasattr(pl_module, "batch_size"):
            fail("Lightning: the LightningModule (or its hparams or datamodule) has no batch_size attribute, so "
                 "oomtune cannot set the trial's micro-batch; add one and build the DataLoader with it (as "
                 "Tuner.scale_batch_size requires)")
        lightning_setattr(pl_module, "batch_size", t.batch_size)
        trainer.accumulate_grad_batches = t.grad_accum
        if t.activation_checkpointing is not None:
            if not lightning_hasattr(pl_module, "activation_checkpointing"):
                fail("Lightning: search.space.activation_checkpointing needs an activation_checkpointing attribute "
                     "on the LightningModule that its forward honours")
            lightning_setattr(pl_module, "activation_checkpointing", bool(t.activation_checkpointing))
        trainer.fit_loop.epoch_loop.max_steps = s.total_steps
        trainer.fit_loop.max_epochs = -1   # the steps decide, not the epochs
        s.precision = str(getattr(trainer, "precision", None))
        s.attach(pl_module)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        s = self.session
        if not s.active:
            return
        optimizers = list(getattr(trainer, "optimizers", []) or [])
        s.require_optimizer(optimizers[0] if optimizers else None)
        for opt in optimizers:
            s.attach(pl_module, opt)
        self._steps_seen = int(trainer.global_step)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.session.step_begin()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        s = self.session
        if not s.active or s.done:
            return
        while int(trainer.global_step) > self._steps_seen:   # an optimizer step ended with this batch
            self._steps_seen += 1
            if s.step_end():
                trainer.should_stop = True
                s.finish()
                break

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.session.finish()
