"""oomtune in a plain PyTorch training loop: wrap the loop's iterable of optimizer steps.

    from oomtune.integrations.loop import steps
    for step in steps(range(num_steps), model=model, optimizer=optimizer):
        for micro in range(grad_accum):
            loss = model(next(data)).loss / grad_accum
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

Without oomtune, ``steps`` yields what the iterable yields and nothing else happens. Under oomtune
(``oomtune search target=cmd "target.command='python train.py --batch-size {batch_size} --grad-accum
{grad_accum}'"``) it:

- attaches the virtual GPU on a CPU trial before the first step (with the model's parameters and the
  optimizer's state; create the DDP wrapper after the first ``next()`` to have its buckets counted,
  or pass ``model`` before wrapping); on CUDA applies the budget as a memory fraction;
- ends the loop after the trial's warm-up + measured optimizer steps (one iteration is one optimizer
  step), times the measured ones (synchronising CUDA before reading the clock) and reports global
  samples: ``samples_per_step`` (this rank's samples per optimizer step; default the trial's
  micro-batch x accumulation) x world size, from rank 0 only.

The micro-batch and accumulation come from the command line (``{batch_size}``, ``{grad_accum}``) or
from :func:`oomtune.trial_settings`. The iterable must hold the longest trial's steps: the search's
confirmation runs ``trial.warmup_steps + trial.confirm_steps`` (1 + 10 by default), more than its
probes (1 + 3); a shorter one passes every probe and fails the confirmation in one line (exit status 2).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from oomtune.integrations._session import TrialSession

__all__ = ["steps"]


def steps(iterable: Iterable[Any], *, model: Any = None, optimizer: Any = None,
          samples_per_step: float | None = None) -> Iterator[Any]:
    """Yield the items of ``iterable`` (one per optimizer step); under oomtune, only the trial's
    warm-up + measured steps, measured and reported as the module docstring says.

    Args:
        iterable: the loop's steps (``range(num_steps)``, an epoch's batches, ...).
        model / optimizer: registered on the virtual GPU before the first step (the optimizer's state,
            once it exists, is created by its first step and counted then).
        samples_per_step: this rank's samples per optimizer step (default: the trial's micro-batch x
            accumulation).

    Raises:
        SystemExit: (under oomtune, status 2, one line) the iterable ended before the trial's steps.
    """
    session = TrialSession("loop")
    if not session.active:
        yield from iterable
        return
    session.samples_per_step = samples_per_step
    session.attach(model, optimizer)
    for item in iterable:
        session.step_begin()
        yield item
        if session.step_end():
            break
    session.finish()
