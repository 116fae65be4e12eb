"""``oomtune show PATH``: the trial table of a run directory, a best.yaml, or a storage + study."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

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
        raise ConfigError(f"{path} is not an oomtune run directory (no {RUN_FILE} or best.yaml)")
    from oomtune.best import load_best

    best = load_best(path)
    if not best.study.get("storage") or not best.study.get("study_name"):
        raise BestFileError(f"{path}: its 'study' section names no storage and study_name")
    return str(best.study["storage"]), str(best.study["study_name"])


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from oomtune.display import trial_rows, trial_table
    from oomtune.search.storage import load_study

    url, name = _locate(args)
    study = load_study(url, name)
    rows = trial_rows(study.get_trials(deepcopy=False))
    if args.json:
        print(json.dumps(rows, indent=1, default=str))
        return 0
    console = Console()
    if not console.is_terminal:
        console = Console(width=200)
    console.print(trial_table(rows, title=f"study {name} ({url})"))
    return 0
