"""The search's objectives (``search.objective``), one module each behind one contract
(:class:`Objective`, :mod:`.base`), as Optuna's ``samplers`` package holds its samplers:

- :mod:`.batch`: the largest batch that fits the budget;
- :mod:`.throughput`: samples/s within the memory limit, a gain claimed only beyond the noise.

:data:`OBJECTIVES` maps the configuration's spelling to the class; :func:`objective_for` is the one
place a name becomes an objective (``auto`` is resolved before, by
:func:`oomtune.search.ranking.resolve_objective`).
"""

from __future__ import annotations

from oomtune.search.objectives.base import Objective
from oomtune.search.objectives.batch import BatchObjective
from oomtune.search.objectives.throughput import ThroughputObjective

__all__ = ["Objective", "BatchObjective", "ThroughputObjective", "OBJECTIVES", "objective_for", "sampler_trials"]

#: ``search.objective`` (resolved) -> its objective class.
OBJECTIVES: dict[str, type[Objective]] = {cls.name: cls for cls in (ThroughputObjective, BatchObjective)}

_INSTANCES: dict[str, Objective] = {name: cls() for name, cls in OBJECTIVES.items()}


def objective_for(name: str) -> Objective:
    """The objective ``name`` (``search.objective`` after ``auto`` is resolved) names; objectives are
    stateless, so one instance serves every search.

    Raises:
        ConfigError: ``name`` names no objective (one line listing the objectives).
    """
    from oomtune.exceptions import ConfigError

    try:
        return _INSTANCES[name]
    except (KeyError, TypeError):
        raise ConfigError(f"search.objective={name!r}: choose one of {', '.join(OBJECTIVES)}") from None


def sampler_trials(name: str, n_trials: int) -> int:
    """The sampler's trials a search of objective ``name`` runs after its frontier probes:
    ``search.n_trials`` when the objective uses the sampler (:attr:`Objective.uses_sampler`), else 0
    (the progress line's total).

    Raises:
        ConfigError: ``name`` names no objective.
    """
    return n_trials if objective_for(name).uses_sampler else 0
