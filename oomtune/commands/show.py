"""``oomtune show PATH``: the trial table of a run directory, a best.yaml, or a storage + study."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from oomtune.exceptions import BestFileError, ConfigError

__all__ = ["register", "run"]


def register(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("show", help="print the trial table of a run directory or a best.yaml")
    p.add_argument("path", nargs="?", help="run directory or best.yaml")
    p.add_argument("--storage", help="Optuna storage URL (with --study instead of PATH)")
    p.add_argument("--study", help="study name in --storage")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.set_defaults(func=run)
    return p


def _locate(args: argparse.Namespace) -> tuple[str, str]:
    from oomtune.search.run import RUN_FILE

    if args.storage or args.study:
        if not (args.storage and args.study):
            raise ConfigError("--storage and --study go together")
        return args.storage, args.study
    if not args.path:
        raise ConfigError("give a run directory, a best.yaml, or --storage URL --study NAME")
    path = Path(args.path)
    if path.is_dir() and (path / RUN_FILE).is_file():
        try:
            info = json.loads((path / RUN_FILE).read_text())
            return str(info["storage"]), str(info["study_name"])
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            raise BestFileError(f"{path / RUN_FILE} is corrupt: expected {{\"storage\": ..., "
                                f"\"study_name\": ...}}") from None
    if path.is_dir() and not (path / "best.yaml").exists():
        if (path / "plan.yaml").is_file():   # `oomtune plan` wrote here; no search has run yet
            raise ConfigError(f"{path} holds a plan (plan.yaml) but no search yet: its map is in "
                              f"{path / 'report.html'}; run `oomtune search` with the same overrides for trials")
        raise ConfigError(f"{path} is not an oomtune run directory (no {RUN_FILE} or best.yaml)")
    from oomtune.best import load_best

    best = load_best(path)
    if not best.study.get("storage") or not best.study.get("study_name"):
        raise BestFileError(f"{path}: its 'study' section names no storage and study_name")
    return str(best.study["storage"]), str(best.study["study_name"])


def json_rows(rows: list[dict[str, Any]], trials: list[Any]) -> list[dict[str, Any]]:
    """The rows for ``--json``: data, not display strings (issue 14 item 9). ``alloc_conf`` is the
    exact PYTORCH_CUDA_ALLOC_CONF string ("" for torch's defaults, never "(default)"), ``settings``
    its keys (``{torch key: value}``, {} for the defaults; None when the string does not parse) and
    ``data`` the searched data-loader settings (``{"num_workers": 2}``)."""
    from oomtune.alloc.settings import AllocatorSettings
    from oomtune.exceptions import AllocatorConfigError
    from oomtune.search import records as R

    by_number = {t.number: t for t in trials}
    out = []
    for row in rows:
        t = by_number.get(row.get("number"))
        conf = (t.user_attrs.get(R.ATTR_CONF) if t is not None else None) or ""
        try:
            settings: dict[str, Any] | None = AllocatorSettings.parse(conf).as_mapping()
        except AllocatorConfigError:
            settings = None
        data = {k[len("data."):]: v for k, v in sorted((t.params if t is not None else {}).items())
                if k.startswith("data.")}
        out.append({**row, "alloc_conf": conf, "settings": settings, "data": data})
    return out


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from oomtune.display import trial_rows, trial_table, trial_table_legend
    from oomtune.search.storage import load_study

    url, name = _locate(args)
    study = load_study(url, name)
    trials = study.get_trials(deepcopy=False)
    rows = trial_rows(trials)
    if args.json:
        print(json.dumps(json_rows(rows, trials), indent=1, default=str))
        return 0
    console = Console()
    if not console.is_terminal:
        console = Console(width=200)
    from oomtune.search.outputs import recorded_best

    recorded = recorded_best(study)
    best = (recorded or {}).get("best") or {}
    console.print(trial_table(rows, title=f"study {name} ({url})", best_number=best.get("trial_number")))
    for line in trial_table_legend(rows):
        console.print(line, highlight=False, markup=False)
    if recorded is not None:  # the answer every worker wrote (oomtune best prints all of it)
        from oomtune.best import trials_text

        trials = trials_text(best)
        console.print(f"best (recorded in the study): batch {best.get('batch_size')}, "
                      f"{best.get('alloc_conf') or '(default allocator)'}" + (f"; {trials}" if trials else ""),
                      highlight=False, markup=False)
    return 0
