"""``oomtune show PATH``: the trial table of a run directory, a best.yaml, or a storage + study."""

from __future__ import annotations

import argparse
import json
import sys
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


def _locate(args: argparse.Namespace) -> Any:
    """The :class:`oomtune.runfile.RunStorage` to read: ``--storage``/``--study``; a run directory's
    run.json (the study.db beside it when it lies inside: a copied or moved directory reads its own
    study); a best.yaml's run.json beside it, else its ``study`` section."""
    from oomtune.runfile import RUN_FILE, RunStorage, read_run_file

    if args.storage or args.study:
        if not (args.storage and args.study):
            raise ConfigError("--storage and --study go together")
        return RunStorage(args.storage, args.study, "--storage")
    if not args.path:
        raise ConfigError("give a run directory, a best.yaml, or --storage URL --study NAME")
    path = Path(args.path)
    if path.is_dir():
        found = read_run_file(path)   # BestFileError when corrupt
        if found is not None:
            return found
    elif path.is_file():
        try:
            found = read_run_file(path.parent)
        except BestFileError:
            found = None   # the best.yaml's own study section below
        if found is not None and _same_study(path, found):
            return found
    if path.is_dir() and not (path / "best.yaml").exists():
        if (path / "plan.yaml").is_file():   # `oomtune plan` wrote here; no search has run yet
            raise ConfigError(f"{path} holds a plan (plan.yaml) but no search yet: its map is in "
                              f"{path / 'report.html'}; run `oomtune search` with the same overrides for trials")
        raise ConfigError(f"{path} is not an oomtune run directory (no {RUN_FILE} or best.yaml)")
    from oomtune.best import load_best

    best = load_best(path)
    if not best.study.get("storage") or not best.study.get("study_name"):
        raise BestFileError(f"{path}: its 'study' section names no storage and study_name")
    return RunStorage(str(best.study["storage"]), str(best.study["study_name"]), f"{path.name}'s study section")


def _same_study(best_path: Path, found: Any) -> bool:
    """Whether the best.yaml at ``best_path`` names the study of the run.json beside it (its
    ``study.study_name``; the file's other sections are not needed to show the trials)."""
    from oomtune.best import BEST_MAX_BYTES
    from oomtune.safeload import read_yaml

    try:   # size and depth limited: a deep file falls to load_best, which refuses it in one line
        data = read_yaml(best_path, what="a best.yaml", max_bytes=BEST_MAX_BYTES)
        return data["study"]["study_name"] == found.study_name
    except Exception:  # noqa: BLE001 - not a best.yaml of this study: the caller loads it as given
        return False


def json_rows(rows: list[dict[str, Any]], trials: list[Any]) -> list[dict[str, Any]]:
    """The rows for ``--json``: data, not display strings. ``alloc_conf`` is the
    exact PYTORCH_CUDA_ALLOC_CONF string ("" for torch's defaults, never "(default)"), ``settings``
    its keys (``{torch key: value}``, {} for the defaults; None when the string does not parse) and
    ``data`` the searched data-loader settings (``{"num_workers": 2}``)."""
    from oomtune.alloc.settings import AllocatorSettings
    from oomtune.exceptions import AllocatorConfigError
    from oomtune.study import records as R

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
    from oomtune.display import fit_table, output_console, trial_rows, trial_table, trial_table_legend
    from oomtune.study.storage import load_study

    located = _locate(args)
    url, name = located.url, located.study_name
    study = load_study(url, name)
    print(located.line, file=sys.stderr)   # once it opened (bad input stays one line); stderr: --json stays JSON
    trials = study.get_trials(deepcopy=False)
    rows = trial_rows(trials)
    if args.json:
        print(json.dumps(json_rows(rows, trials), indent=1, default=str))
        return 0
    console = output_console()
    from oomtune.search.outputs import recorded_best

    recorded = recorded_best(study)
    best = (recorded or {}).get("best") or {}
    from oomtune.runfile import redact

    console.print(fit_table(trial_table(rows, title=f"study {name} ({redact(url)})",
                                        best_number=best.get("trial_number")), console.width))
    for line in trial_table_legend(rows):
        console.print(line, highlight=False, markup=False)
    if recorded is not None:  # the answer every worker wrote (oomtune best prints all of it)
        from oomtune.best import trials_text

        trials = trials_text(best)
        console.print(f"best (recorded in the study): batch {best.get('batch_size')}, "
                      f"{best.get('alloc_conf') or 'the default allocator'}" + (f"; {trials}" if trials else ""),
                      highlight=False, markup=False)
    return 0
