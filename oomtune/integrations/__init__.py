"""One-line integrations of oomtune into training scripts (``target=cmd``).

- :mod:`oomtune.integrations.huggingface`: ``OomtuneCallback`` for ``transformers.Trainer``
  (``callbacks=[OomtuneCallback()]``);
- :mod:`oomtune.integrations.lightning`: ``OomtuneCallback`` for ``lightning.pytorch.Trainer``
  (``callbacks=[OomtuneCallback()]``);
- :mod:`oomtune.integrations.loop`: ``steps(...)`` for a plain training loop (``for step in
  steps(range(n), model=model, optimizer=optimizer):``).

Each does nothing when oomtune did not launch the process (:func:`oomtune.launched`), so the script
runs unchanged on its own. Under oomtune each one, through :class:`oomtune.integrations._session.
TrialSession`:

- applies the trial's micro-batch, gradient accumulation and activation checkpointing (read from
  the environment oomtune sets, :func:`oomtune.trial_settings`) where the framework lets it;
- attaches the virtual GPU on a CPU trial (:func:`oomtune.capture_hook`) before the model is
  wrapped for data parallelism (so DDP's buckets are counted) and registers the optimizer's state
  once the optimizer exists; on CUDA applies the budget as a memory fraction instead;
- records the allocation stream of the trial's steps on the virtual GPU (the parent replays it
  under every allocator configuration: :mod:`oomtune.plan.recorded`), with the framework's precision
  setting (the Trainer's ``bf16``/``fp16``, Lightning's ``precision``) in its description and in the
  report, for captures that follow the GPU's autocast policy;
- stops training after ``warmup + measure`` optimizer steps, times the measured ones (synchronising
  CUDA before reading the clock) and reports global samples (micro-batch x accumulation x world size,
  from rank 0 only, so they are counted once) and memory (:func:`oomtune.report`).

Importing this package imports neither torch nor the frameworks; each submodule imports its own.
"""

from __future__ import annotations

__all__ = ["huggingface", "lightning", "loop"]
