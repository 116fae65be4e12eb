"""Everything the report shows, read from a run directory's stored artifacts only.

Sources (each optional; a missing file or field leaves its part of the report out, never fails it):
``run.json`` -> the Optuna storage and study (trials and their ``user_attrs``), ``best.yaml``,
``plan.yaml`` (``oomtune plan``) or ``frontier.yaml`` (written by ``oomtune search``; same schema), and
``winner_step.pickle`` (the winner's step in ``torch.cuda.memory._dump_snapshot()`` format).
The report reads these files, never the search driver's objects, so the driver may change freely.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from oomtune.study.records import ATTR_DUPLICATE_OF

__all__ = ["RunData", "gather", "trial_records", "RUN_FILE", "PLAN_FILE", "FRONTIER_FILE", "STEP_FILE"]

from oomtune.runfile import RUN_FILE, redact  # noqa: E402
PLAN_FILE = "plan.yaml"
FRONTIER_FILE = "frontier.yaml"
STEP_FILE = "winner_step.pickle"


@dataclass
class RunData:
    """A run directory's artifacts as plain data (bytes, seconds; None where not recorded).

    Attributes:
        run_dir: the directory.
        study_name / storage: from run.json or best.yaml (None for a plan-only directory).
        trials: :func:`trial_records` of the study, in trial-number order.
        best: best.yaml as a mapping, or None.
        plan: plan.yaml (or frontier.yaml) as a mapping, or None; ``plan_file`` names which.
        step_file: the winner's step snapshot pickle, or None.
        notes: why a part could not be read (shown in the report).
    """

    run_dir: Path
    study_name: str | None = None
    storage: str | None = None
    trials: list[dict[str, Any]] = field(default_factory=list)
    best: dict[str, Any] | None = None
    plan: dict[str, Any] | None = None
    plan_file: str | None = None
    step_file: Path | None = None
    study_attrs: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    storage_line: str | None = None   # which storage was read, and why (oomtune.runfile.RunStorage.line)

    @property
    def memory_source(self) -> str | None:
        """``"device"`` or ``"simulated"`` for the measured trials (None without any)."""
        from oomtune.outcome import Outcome

        sources = {t["memory_source"] for t in self.trials
                   if t.get("memory_source") and t["outcome"] != Outcome.PREDICTED_INFEASIBLE.value}
        if "device" in sources:
            return "device"
        return "simulated" if sources else None


def _read_yaml(path: Path, notes: list[str]) -> dict[str, Any] | None:
    from oomtune.exceptions import ConfigError
    from oomtune.safeload import read_yaml

    if not path.is_file():
        return None
    try:
        # libyaml's parser where installed (same objects, ~8x faster: the plan's report reads these); size
        # and depth limited (a file nested 100,000 levels deep is a note, not a RecursionError)
        data = read_yaml(path, what=f"oomtune's {path.name}")
    except ConfigError as exc:
        notes.append(f"{path.name} could not be read: {str(exc).splitlines()[0]}")
        return None
    if not isinstance(data, dict):
        notes.append(f"{path.name} is not a mapping; left out")
        return None
    return data


def _locate_study(run_dir: Path, best: dict[str, Any] | None, notes: list[str]) -> Any:
    """The run's :class:`oomtune.runfile.RunStorage`: from run.json (a relative study.db beside it:
    a copied or moved run directory reads its own study), else best.yaml's ``study``; None."""
    from oomtune.exceptions import BestFileError
    from oomtune.runfile import RunStorage, read_run_file

    try:
        found = read_run_file(run_dir)
    except BestFileError:
        found = None
        notes.append(f"{RUN_FILE} is corrupt; trials read from best.yaml's study if named there")
    if found is not None:
        return found
    study = (best or {}).get("study") or {}
    if study.get("storage") and study.get("study_name"):
        return RunStorage(str(study["storage"]), str(study["study_name"]), "best.yaml's study section")
    return None


def _result_fields(stored: Any) -> dict[str, Any]:
    """The figures the report shows from a stored trial record (``user_attrs["result"]``, nested or
    the earlier flat form: :meth:`oomtune.trial.record.TrialResult.from_dict`), under flat names;
    {} when there is none or it cannot be read (the report leaves those cells empty)."""
    from oomtune.trial.record import TrialResult

    if not isinstance(stored, dict):
        return {}
    try:
        res = TrialResult.from_dict(stored)
    except (ValueError, TypeError, KeyError):
        return {}
    return {"outcome": res.outcome.value, "batch_size": res.batch_size, "alloc_conf": res.alloc_conf,
            "throughput": res.throughput.samples_per_s, "peak_reserved_bytes": res.memory.peak_reserved_bytes,
            "peak_allocated_bytes": res.memory.peak_allocated_bytes, "fragmentation": res.memory.fragmentation,
            "memory_source": res.memory.source, "message": res.message, "advice": res.advice}


def trial_records(trials: list[Any]) -> list[dict[str, Any]]:
    """One plain dict per Optuna trial, from its ``user_attrs`` (the stored TrialResult) and times.

    Keys: number, state, role, outcome, batch_size, alloc_conf, throughput (samples/s),
    peak_reserved_bytes, peak_allocated_bytes, fragmentation, memory_source, predicted_bytes,
    feasible, start (datetime or None), duration_s, message, advice, reused_from. Missing -> None.
    """
    from optuna.trial import TrialState

    from oomtune.outcome import Outcome

    out = []
    for t in trials:
        attrs = t.user_attrs
        res = _result_fields(attrs.get("result"))
        values = list((getattr(t, "constraints", None) or {}).values())
        outcome = attrs.get("outcome") or res.get("outcome") or (
            "duplicate" if attrs.get(ATTR_DUPLICATE_OF) is not None
            else "interrupted" if t.state is TrialState.FAIL else t.state.name.lower())
        fixed = (getattr(t, "system_attrs", None) or {}).get("fixed_params") or {}
        start, end = t.datetime_start, t.datetime_complete
        out.append({
            "number": t.number, "state": t.state.name, "role": attrs.get("role") or "",
            "outcome": outcome,
            "batch_size": t.params.get("batch_size", res.get("batch_size", fixed.get("batch_size"))),
            "alloc_conf": attrs.get("alloc_conf", res.get("alloc_conf")) or "",
            "throughput": res.get("throughput"), "peak_reserved_bytes": res.get("peak_reserved_bytes"),
            "peak_allocated_bytes": res.get("peak_allocated_bytes"), "fragmentation": res.get("fragmentation"),
            "memory_source": res.get("memory_source"), "predicted_bytes": attrs.get("predicted_peak_reserved_bytes"),
            "feasible": (outcome == Outcome.OK.value and t.state is TrialState.COMPLETE and all(v <= 0 for v in values)),
            "start": start, "duration_s": (end - start).total_seconds() if start and end else None,
            "message": res.get("message"), "advice": res.get("advice"), "reused_from": attrs.get("reused_from", attrs.get(ATTR_DUPLICATE_OF)),
            "data": {k[len("data."):]: v for k, v in t.params.items() if k.startswith("data.")},
        })
    return sorted(out, key=lambda r: r["number"])


def gather(run_dir: str | Path) -> RunData:
    """Read a run directory (``oomtune search`` or ``oomtune plan`` output).

    Raises:
        ConfigError: ``run_dir`` is not a directory, or holds none of run.json, best.yaml, plan.yaml.
    """
    from oomtune.exceptions import ConfigError

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"{str(run_dir)!r} is not a directory: give the run directory of oomtune search or plan")
    data = RunData(run_dir=run_dir)
    data.best = _read_yaml(run_dir / "best.yaml", data.notes)
    for name in (PLAN_FILE, FRONTIER_FILE):
        data.plan = _read_yaml(run_dir / name, data.notes)
        if data.plan is not None:
            data.plan_file = name
            break
    step = run_dir / STEP_FILE
    data.step_file = step if step.is_file() else None
    located = _locate_study(run_dir, data.best, data.notes)
    if located is not None:
        data.storage, data.study_name, data.storage_line = located.url, located.study_name, located.line
    if data.storage is None and data.best is None and data.plan is None:
        raise ConfigError(f"{str(run_dir)!r} holds no {RUN_FILE}, best.yaml or {PLAN_FILE}: "
                          "give the run directory of oomtune search or oomtune plan")
    if data.storage is not None:
        _read_trials(data)
    return data


def _read_trials(data: RunData) -> None:
    import optuna

    from oomtune.study.storage import load_study

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    try:
        study = load_study(data.storage, data.study_name)
        data.trials = trial_records(study.get_trials(deepcopy=False))
        data.study_attrs = dict(study.user_attrs)
    except Exception as exc:  # noqa: BLE001 - any storage problem (gone, moved): the report without trials
        data.notes.append(f"trials could not be read from {redact(data.storage)}: {str(exc).splitlines()[0][:200]}")
