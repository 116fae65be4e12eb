"""The contract every objective of the search implements (:class:`Objective`).

An objective says what the search maximises and how: how feasible trials are ranked, whether the
sampler's trials run at all, whether every configuration's frontier is probed to its boundary, how
the winner is confirmed and what is compared against the baseline, and the summary's line about
that comparison. :class:`oomtune.search.driver.Search` keeps the loop and asks its objective; it
never compares the objective's name (as Optuna's study asks its sampler, ``optuna.samplers``).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from oomtune.outcome import Outcome
from oomtune.search.confirmation import ConfirmContext, Confirmed
from oomtune.trial.record import TrialResult

__all__ = ["Objective"]


class Objective(abc.ABC):
    """One objective of ``search.objective``; stateless (one instance serves every search).

    Class attributes:
        name: the configuration's spelling (``search.objective``), also stored in best.yaml and in
            the gain figures (``gain["objective"]``).
        direction: the study's direction (Optuna's ``create_study(direction=...)``) for the value
            :meth:`value` tells it.
        uses_sampler: whether the sampler's trials run after the frontier probes (else the probes
            decide).
        probes_every_frontier: whether every probed configuration's frontier is found to its
            boundary (:class:`oomtune.search.frontier.FrontierPlanner` ``boundary_all``), not only
            those that can still beat the leader's batch.
        measures_time: whether the answer depends on the time a step takes (so a recording of
            another number of micro-batches per step is not a probe's result, and the confirmation
            is timed over ``search.window`` seconds).
    """

    name: ClassVar[str]
    direction: ClassVar[str] = "maximize"
    uses_sampler: ClassVar[bool]
    probes_every_frontier: ClassVar[bool]
    measures_time: ClassVar[bool]

    @staticmethod
    def value(result: TrialResult) -> float | None:
        """The value told to Optuna for a trial's result: samples/s when it ran ok (0.0 without a
        measurement), 0.0 for any other result (infeasible: its memory constraint is violated),
        None for a fault (the trial is FAIL). Every objective tells samples/s, so that the
        sampler (TPE) and optuna-dashboard read one metric across objectives."""
        if result.outcome.is_fault:
            return None
        if result.outcome is Outcome.OK:
            return float(result.throughput.samples_per_s or 0.0)
        return 0.0

    @abc.abstractmethod
    def rank(self, trials: Sequence[Any], *, is_default: Callable[[Any], bool], min_gain: float,
             input_bound: bool = False) -> list[Any]:
        """Feasible trials (Optuna FrozenTrials that ran ok within the limit), best first.

        ``is_default``: whether a trial ran the default allocator and data-loader settings;
        ``min_gain``: the fraction by which non-default settings must beat the default to rank
        first; ``input_bound``: the workload waits for its data (:func:`oomtune.diagnose.
        input_bound_verdict`)."""

    def leader(self, trials: Sequence[Any], *, is_default: Callable[[Any], bool], min_gain: float) -> Any | None:
        """The best trial so far (the progress line's "best"): the first under :meth:`rank` without
        the input-bound rule (which needs every trial); None without feasible trials."""
        ranked = self.rank(trials, is_default=is_default, min_gain=min_gain)
        return ranked[0] if ranked else None

    @abc.abstractmethod
    def confirm(self, ctx: ConfirmContext, ranked: list[Any], max_candidates: int) -> Confirmed:
        """Confirm the winner of ``ranked`` (best first, not empty) in clean processes through
        ``ctx.runs``; the gain figures compare the confirmation with the baseline."""

    @abc.abstractmethod
    def gain_line(self, gain: dict[str, Any], *, summary: Any, best: Any, baseline: Any,
                  memory_source: str) -> str:
        """The summary's line about ``gain`` (this objective's figures, as :meth:`confirm` made them):
        the answer against the default allocator at its largest batch. ``summary``: the
        :class:`oomtune.search.summary.SearchSummary`; ``best``/``baseline``:
        :class:`oomtune.best.Choice` of the answer and of the baseline; ``memory_source``:
        ``device`` or ``simulated``."""
