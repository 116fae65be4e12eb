"""What a search found (:class:`SearchSummary`) and the counts over its study (:func:`study_counts`):
outcomes, trial processes launched, launches saved; plus the one line said when the command hung
(:func:`hang_note`). The summary is what ``best.yaml`` and the closing lines are written from
(:mod:`oomtune.search.outputs`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from oomtune.outcome import Outcome
from oomtune.search.frontier import ConfigFrontier
from oomtune.search.trial_sets import PROBE_ROLES, default_hang
from oomtune.study import records as R
from oomtune.trial.record import TrialResult

__all__ = ["SearchSummary", "study_counts", "hang_note", "steps_ran_on", "confirmation_failure"]

#: The count of a trial that ran ok but whose peak exceeded budget x (1 - headroom): not an
#: :class:`~oomtune.outcome.Outcome` of its own (the outcome is ``ok``), a key of the summary's counts.
OK_OVER_LIMIT = "ok_over_limit"
#: The count of a trial killed by Ctrl-C/SIGTERM (FAIL without a result).
INTERRUPTED = "interrupted"


@dataclass
class SearchSummary:
    """What the search found; numbers of Optuna trials refer to the study. ``objective`` is the
    objective's name as the configuration spells it (``search.objective``, resolved)."""

    best: Any | None                     # FrozenTrial of the winner (its measurement)
    best_result: TrialResult | None      # the confirmation's result when confirmed, else the trial's
    confirmed: bool
    baseline: Any | None                 # FrozenTrial of the baseline
    outcomes: dict[str, int] = field(default_factory=dict)
    launches: int = 0
    launches_saved: int = 0
    verdict: Any = None                  # oomtune.diagnose.Verdict (input-bound diagnosis)
    objective: str = "throughput"
    objective_reason: str = ""
    gain: dict[str, Any] | None = None   # confirmation figures against the baseline's
    frontiers: list[ConfigFrontier] = field(default_factory=list)
    at_top_of_range: bool = False
    notes: list[str] = field(default_factory=list)
    execute: str = "cpu"                 # where the virtual GPU's trials ran their steps: meta | cpu | mixed
    configs_known: tuple[int, int] = (0, 0)   # configurations predicted or tried, of all (oomtune.search.frontier)
    global_batch: int | None = None
    timeout_note: str | None = None       # search.timeout ended the search: what was left untried
    causes: list[str] = field(default_factory=list)   # why trials failed, said with the answer or its absence
    confirm_failed: str | None = None     # no answer because every confirmation failed: why (confirmation_failure)


def steps_ran_on(trials: Sequence[Any], asked: str) -> str:
    """Where the virtual GPU's trials ran their steps, from their records (``execution.where``, written
    by the trial process: trial/child.py, targets/cmd.py): ``meta`` or ``cpu`` when every record that
    says agrees, ``mixed`` when they differ (a command without an integration, or a step meta cannot
    run, computes on the CPU although meta was asked); ``asked`` (trial.execute, resolved) when no
    record says. Unknown, so not counted: a record without ``execution.where`` (None), and the record
    of a command that failed before its first report (``script.reports == 0``: nothing says where its
    steps ran; records written before targets/cmd.py kept None there said ``cpu``)."""
    from oomtune.study import records as R

    where = set()
    for t in trials:
        res = R.result_of(t)
        if res is None or (res.script.reports == 0 and res.outcome is not Outcome.OK):
            continue
        value = res.execution.where
        if value in ("meta", "cpu"):
            where.add(value)
    if not where:
        return asked
    return where.pop() if len(where) == 1 else "mixed"


def study_counts(trials: Sequence[Any]) -> tuple[dict[str, int], int, int]:
    """``(outcomes, launched, saved)`` over a study's trials (every session and process of it):
    outcomes by name (``ok_over_limit``: ran but exceeded the limit; ``interrupted``: killed by
    Ctrl-C/SIGTERM, FAIL without a result), trial processes launched, and launches saved by
    prediction or by reusing an identical earlier trial. A trial restored from its run-directory
    record (:mod:`oomtune.search.tell_records`) counts its outcome once and its launch once (the
    original's)."""
    from optuna.trial import TrialState

    from oomtune.search.tell_records import ATTR_TOLD_FROM_RECORD

    outcomes: dict[str, int] = {}
    saved = launched = 0
    restored = {t.user_attrs[ATTR_TOLD_FROM_RECORD] for t in trials if ATTR_TOLD_FROM_RECORD in t.user_attrs}
    for t in trials:
        key = t.user_attrs.get(R.ATTR_OUTCOME)
        if key is None:
            if t.number in restored:
                launched += 1   # ran; its result is the restored trial's
                continue
            if t.state is TrialState.FAIL and R.ATTR_ROLE in t.user_attrs and R.ATTR_DUPLICATE_OF not in t.user_attrs:
                outcomes[INTERRUPTED] = outcomes.get(INTERRUPTED, 0) + 1
                launched += 1
            continue
        outcome = R.outcome_of(t)
        if outcome is Outcome.OK and t.state is TrialState.COMPLETE and not R.is_feasible_ok(t):
            key = OK_OVER_LIMIT  # ran, but its peak exceeded budget x (1 - headroom)
        outcomes[key] = outcomes.get(key, 0) + 1
        if ATTR_TOLD_FROM_RECORD in t.user_attrs:
            continue   # its launch is the original trial's (counted there)
        if outcome is Outcome.PREDICTED_INFEASIBLE or R.ATTR_REUSED in t.user_attrs \
                or R.ATTR_FROM_RECORDING in t.user_attrs:
            saved += 1
        else:
            launched += 1
    return outcomes, launched, saved


def hang_note(trials: Sequence[Any], timeout_s: float) -> str | None:
    """One line when the default allocator's trial hung (ran past ``trial.timeout``): the batch, the
    trial, and that no other configuration was run at it or above; None when none hung."""
    hang = default_hang(trials)
    if hang is None:
        return None
    batch = hang.params["batch_size"]
    return (f"the command hung: the default allocator's trial at batch {batch} ran past trial.timeout={timeout_s:g} s "
            f"(trial {hang.number}); a hang is not an allocator's doing, so no other configuration was run at batch "
            f"{batch} or above (see its stderr.txt in the run's trials/ folder, or raise trial.timeout)")


def confirmation_failure(trials: Sequence[Any], *, confirm_steps: int | None = None) -> str | None:
    """One line when the search has no answer only because the confirmations failed: some probe or
    sampler trial ran within the limit (a candidate), every clean-process confirmation trial
    (role ``confirm``) failed, and none passed. The line names how many failed, the first failure
    (trial, batch, allocator configuration, outcome) and its own message, which carries the fix
    its process gave (e.g. an integration's "...; give it more data or steps"), and where its output
    is; ``confirm_steps`` (``trial.confirm_steps``), when given, is said with it. None otherwise
    (no candidate, no confirmation, or one passed)."""
    candidates = [t for t in trials if t.user_attrs.get(R.ATTR_ROLE) in PROBE_ROLES and R.is_feasible_ok(t)
                  and R.ATTR_REUSED not in t.user_attrs]
    confirms = sorted((t for t in trials if t.user_attrs.get(R.ATTR_ROLE) == "confirm" and R.result_of(t) is not None),
                      key=lambda t: t.number)
    if not candidates or not confirms or any(R.is_feasible_ok(t) for t in confirms):
        return None
    first = confirms[0]
    res = R.result_of(first)
    steps = f" of trial.confirm_steps={confirm_steps} measured steps" if confirm_steps is not None else ""
    over = " (it ran, but above the limit)" if res.outcome is Outcome.OK else ""
    return (f"the confirmations failed: {len(candidates)} trial(s) ran within the limit, but every clean-process "
            f"confirmation{steps} failed ({len(confirms)} run(s)); the first, trial {first.number} (batch "
            f"{first.params.get('batch_size', res.batch_size)}, {res.alloc_conf or 'default allocator'}), was "
            f"{res.outcome.value}{over}: {res.message or 'no message'} (see trial-{first.number:04d}/stderr.txt in "
            "the run's trials/ folder)")
