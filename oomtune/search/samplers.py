"""The study's sampler, by name (``search.sampler``): Optuna's, each trial's draws seeded per trial
(:mod:`oomtune.search.seeding`) so that processes sharing a study draw distinct candidates."""

from __future__ import annotations

from typing import Any

from oomtune.exceptions import ConfigError

__all__ = ["make_sampler"]


def make_sampler(name: str, seed: int | None) -> Any:
    """An Optuna sampler by name: tpe (default), random, qmc, gp.

    With a seed, the tpe, random and gp samplers draw each trial's values from its own seed,
    ``(seed, trial number)`` (:class:`oomtune.search.seeding.TrialSeeded`): processes sharing one
    study then draw distinct candidates, and one process draws the same ones on every run.

    Constraints reach the samplers through ``Trial.set_constraint`` (Optuna >= 5), so infeasible
    trials (OOM) inform TPE/GP instead of being discarded as FAIL.

    Raises:
        ConfigError: an unknown sampler name.
    """
    import optuna

    samplers = {
        # constant_liar: trials still RUNNING (other workers') count as bad, so that workers do not
        # all sample the same point; without concurrent trials it changes nothing.
        "tpe": lambda s: optuna.samplers.TPESampler(seed=s, n_startup_trials=4, multivariate=True,
                                                    constant_liar=True),
        "random": lambda s: optuna.samplers.RandomSampler(seed=s),
        "qmc": lambda s: optuna.samplers.QMCSampler(seed=s),
        "gp": lambda s: optuna.samplers.GPSampler(seed=s),
    }
    if name not in samplers:
        raise ConfigError(f"unknown sampler {name!r}: choose one of {', '.join(sorted(samplers))}")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", category=optuna.exceptions.ExperimentalWarning)
        if seed is None or name == "qmc":  # QMC's points are numbered by the study, not drawn
            return samplers[name](seed)
        from oomtune.search.seeding import TrialSeeded

        return TrialSeeded(samplers[name], seed)   # processes sharing the study draw distinct candidates
