"""Clean-process confirmation runs of ranked trials, and what an objective's confirmation is given.

The search (:class:`oomtune.search.driver.Search`) ranks the feasible trials under its objective
(:mod:`oomtune.search.objectives`); the objective decides which of them are re-run and how the runs
are compared (:meth:`oomtune.search.objectives.Objective.confirm`); this module runs them: every
trial's candidate ``times`` times in a clean process, one round at once, or (the throughput
objective) one run at a time in rotating order on one device, so that every candidate meets the
same drift of the machine as the baseline.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from oomtune.study import records as R
from oomtune.trial.record import TrialResult

__all__ = ["ConfirmContext", "Confirmed", "confirm_runs", "same_allocator", "ratio", "ATTR_REPEAT", "ATTR_DEVICE"]

#: For role=confirm: which repetition of the confirmation of one trial (0, 1, ...), so that
#: repeated clean-process runs of one candidate are distinct candidates for the workers.
ATTR_REPEAT = "repeat"
#: The device a trial must run on, whichever worker claims it (the throughput confirmation runs all
#: on one GPU, so that the baseline and the candidates are timed on the same card).
ATTR_DEVICE = "device"

#: (trials, times, interleave=) -> trial number -> its clean-process confirmation trials
Runs = Callable[..., "dict[int, list[Any]]"]


@dataclass(frozen=True)
class ConfirmContext:
    """What an objective's confirmation is given by the search; it launches nothing itself.

    ``runs``: :func:`confirm_runs` bound to the search's study and workers; ``baseline``: the
    baseline trial now (the default allocator at its largest feasible measured batch) or None;
    ``is_default``: whether a trial ran the default allocator and data-loader settings;
    ``repeats``/``finalists``/``min_gain``: ``search.repeats``, ``search.finalists``,
    ``search.min_gain`` (a fraction)."""

    runs: Runs
    baseline: Callable[[], Any | None]
    is_default: Callable[[Any], bool]
    repeats: int
    finalists: int
    min_gain: float


class Confirmed(NamedTuple):
    """An objective's confirmation: the winner trial (None: none passed), its confirmation result (or
    the trial's own), whether it passed a clean-process run, and the figures against the baseline
    (None: nothing to compare; the search keeps an earlier one)."""

    winner: Any | None
    result: TrialResult | None
    confirmed: bool
    gain: dict[str, Any] | None = None


def confirm_runs(trials: Sequence[Any], times: int, *, interleave: bool, done: dict[int, list[Any]],
                 candidate_of: Callable[[Any], Any], confirms: dict[Any, int],
                 run_batch: Callable[..., list[Any]], pin_device: str) -> dict[int, list[Any]]:
    """Clean-process runs of each trial's candidate, ``times`` each (``done``: the finished
    confirmation trials by the number they confirm, which count: resume). Returns trial number ->
    its confirmation trials. ``confirms`` (candidate -> trial number it confirms) is filled for the
    runs' descriptions; ``run_batch(cands, "confirm", attrs=None)`` runs one round.

    Without ``interleave``, launched as one round (any free workers). With it (the throughput
    objective), one run at a time in rotating order (A B C, B C A, C A B, ...) on one device
    (``pin_device``, :data:`ATTR_DEVICE`), so that every candidate meets the same drift of the
    machine (clocks, temperature, other load) as the baseline and no two are timed on different
    GPUs. A candidate that failed a repeat is not run again (its other repeats would decide nothing)."""
    cands = {}
    for t in trials:
        cands[t.number] = candidate_of(t)
        confirms[cands[t.number]] = t.number
    if not interleave:
        todo = [cands[t.number] for t in trials for _ in range(max(0, times - len(done.get(t.number, []))))]
        for cand, frozen in zip(todo, run_batch(todo, "confirm")):
            done.setdefault(confirms[cand], []).append(frozen)
        return {t.number: done.get(t.number, []) for t in trials}
    pin = [{ATTR_DEVICE: pin_device}]
    order = [t.number for t in trials]
    for rep in range(times):
        k = rep % len(order)
        for number in order[k:] + order[:k]:
            if len(done.get(number, [])) > rep:
                continue   # a resumed search: this repeat ran already
            if any(not R.is_feasible_ok(r) for r in done.get(number, [])):
                continue   # it did not survive a repeat: it is out, and its other repeats would decide nothing
            frozen = run_batch([cands[number]], "confirm", pin)[0]
            done.setdefault(number, []).append(frozen)
    return {t.number: done.get(t.number, []) for t in trials}


def ratio(value: int | None, base: int | None) -> float | None:
    """``value / base``; None when either is missing or zero."""
    return value / base if value and base else None


def same_allocator(a: Any, b: Any) -> bool:
    """Whether two trials ran the same allocator configuration (the settings torch parses from their
    alloc_conf strings are equal, e.g. ``""`` and ``"expandable_segments:False"``)."""
    from oomtune.alloc.settings import AllocatorSettings

    try:
        return not AllocatorSettings.parse(a.user_attrs.get(R.ATTR_CONF) or "").differences(
            AllocatorSettings.parse(b.user_attrs.get(R.ATTR_CONF) or ""))
    except Exception:  # noqa: BLE001 - an unparsable stored string: compare the strings
        return (a.user_attrs.get(R.ATTR_CONF) or "") == (b.user_attrs.get(R.ATTR_CONF) or "")
