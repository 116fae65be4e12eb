"""A seeded sampler whose random draws depend on the trial, not on the process that asks.

With ``search.seed`` set, every process of a shared study used to build the same seeded sampler, so
the processes drew the same sequence of candidates: measured with 3 ``oomtune search`` processes on
one study (``search.sampler=random``, 16 trials), 6 candidates were launched twice, once by each of
two processes, at about the same time (so neither could reuse the other's result). Seeding each
trial's draws from ``(seed, trial number)`` gives every trial of the study its own stream: the
processes (which create distinct trial numbers) draw distinct candidates, and one process with one
worker draws the same candidates on every run with the same seed, as before.

:class:`TrialSeeded` is an Optuna sampler that builds one inner sampler per trial, seeded from
``numpy.random.SeedSequence([seed, number])`` (numpy's tool for independent streams from one
seed), and hands that trial's calls to it. The inner samplers keep no state between trials that
the study does not hold (TPE, random and GP read the history from the study), so nothing is lost
but the GP sampler's cache of kernel parameters (a warm start; its fit starts from defaults).
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from optuna.samplers import BaseSampler

__all__ = ["TrialSeeded", "trial_seed"]


def trial_seed(seed: int, number: int) -> int:
    """The seed of trial ``number``'s draws: a 32-bit word of ``SeedSequence([seed, number])``."""
    import numpy as np

    return int(np.random.SeedSequence([int(seed), int(number)]).generate_state(1)[0])


class TrialSeeded(BaseSampler):
    """An Optuna sampler: for each trial, ``make(trial_seed(seed, trial.number))`` does the work.

    Args:
        make: ``seed -> sampler`` (e.g. ``lambda s: optuna.samplers.TPESampler(seed=s, ...)``).
        seed: the search's seed (``search.seed``).

    Thread-safe: several workers of one process may ask at once (one inner sampler per trial, made
    under a lock). Each inner sampler is dropped after its trial's ``after_trial``.
    """

    def __init__(self, make: Callable[[int], Any], seed: int) -> None:
        self._make, self._seed = make, int(seed)
        self._inner: dict[int, Any] = {}
        self._lock = threading.Lock()

    def _for(self, trial: Any) -> Any:
        with self._lock:
            sampler = self._inner.get(trial.number)
            if sampler is None:
                sampler = self._inner[trial.number] = self._make(trial_seed(self._seed, trial.number))
            return sampler

    def infer_relative_search_space(self, study: Any, trial: Any) -> dict[str, Any]:
        return self._for(trial).infer_relative_search_space(study, trial)

    def sample_relative(self, study: Any, trial: Any, search_space: dict[str, Any]) -> dict[str, Any]:
        return self._for(trial).sample_relative(study, trial, search_space)

    def sample_independent(self, study: Any, trial: Any, param_name: str, param_distribution: Any) -> Any:
        return self._for(trial).sample_independent(study, trial, param_name, param_distribution)

    def before_trial(self, study: Any, trial: Any) -> None:
        self._for(trial).before_trial(study, trial)

    def after_trial(self, study: Any, trial: Any, state: Any, values: Any) -> None:
        try:
            self._for(trial).after_trial(study, trial, state, values)
        finally:
            with self._lock:
                self._inner.pop(trial.number, None)

    def reseed_rng(self) -> None:
        """Nothing to reseed: each trial's draws come from its own seed."""
