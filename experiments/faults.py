"""Fault table: what oomtune does when its surroundings fail mid-run.

    python experiments/faults.py [--only NAME ...] [--out experiments/results/faults.md] [--keep DIR]

Runs the fault scenarios of every ``experiments/_faults_*.py`` module present (sorted by file name):
each module exposes ``SCENARIOS: list[tuple[str, Callable[[Path], dict]]]``, a name and a function
that gets an empty scratch directory and returns ``{"fault", "done", "outcome", "trials_lost",
"seconds"}`` (``trials_lost``: finished trials whose result is not in the study when the run, and its
rerun where the scenario makes one, is over; ``seconds``: what the scenario says it timed). A
scenario that raises is a row too, its outcome the error (the table must show a broken scenario,
not hide it). ``--only NAME`` (repeatable) runs the scenarios whose name contains NAME (case
ignored), e.g. ``--only postgresql``.

Writes a Markdown table to ``--out`` (default experiments/results/faults.md) after the provenance
header (experiments/_provenance.py: the command and the commit; run it on a clean committed tree).
Modules: experiments/_faults_process.py (kills, a noisy trial, a shared-frames snapshot),
experiments/_faults_storage.py (PostgreSQL outages, full disks, a zero-byte study.db),
experiments/_faults_usercode.py (target=python entries that raise, hang or exit; target=cmd scripts
with a malformed record or that hang; a deeply nested best.yaml); others add their own.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

EXPERIMENTS = Path(__file__).resolve().parent
REPO = EXPERIMENTS.parent
sys.path[:0] = [str(EXPERIMENTS), str(REPO)]   # this tree's oomtune, as the scenarios' processes (PYTHONPATH)
from _provenance import header, write_results  # noqa: E402

KEYS = ("fault", "done", "outcome", "trials_lost", "seconds")


def scenario_modules() -> list[Path]:
    """Every experiments/_faults_*.py, sorted by name."""
    return sorted(EXPERIMENTS.glob("_faults_*.py"))


def load_scenarios() -> list[tuple[str, str, Callable[[Path], dict[str, Any]]]]:
    """``(module file name, scenario name, function)`` for every scenario of every module."""
    found = []
    for path in scenario_modules():
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        for name, fn in module.SCENARIOS:
            found.append((path.name, name, fn))
    return found


def _cell(value: Any) -> str:
    text = "" if value is None else (f"{value:.1f}" if isinstance(value, float) else str(value))
    return text.replace("|", "\\|").replace("\n", " ")


def run_one(name: str, fn: Callable[[Path], dict[str, Any]], scratch: Path) -> dict[str, Any]:
    """One scenario in its own scratch directory; a scenario that raises becomes a row saying so."""
    scratch.mkdir(parents=True)
    started = time.monotonic()
    try:
        row = dict(fn(scratch))
    except Exception as exc:  # noqa: BLE001 - reported in the table
        traceback.print_exc()
        row = {"fault": name, "done": "", "outcome": f"scenario failed: {type(exc).__name__}: {exc}",
               "trials_lost": "?", "seconds": time.monotonic() - started}
    missing = [k for k in KEYS if k not in row]
    if missing:
        row = {**row, "outcome": f"{row.get('outcome', '')} (scenario returned no {', '.join(missing)})"}
    return row


def table(rows: list[dict[str, Any]]) -> str:
    """The Markdown table of ``rows``."""
    lines = ["| fault | what was done | outcome | trials lost | seconds |", "|---|---|---|---|---|"]
    lines += ["| " + " | ".join(_cell(row.get(k)) for k in KEYS) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", action="append", default=[], metavar="NAME",
                    help="run the scenarios whose name contains NAME (repeatable; default: all)")
    ap.add_argument("--out", type=Path, default=EXPERIMENTS / "results" / "faults.md")
    ap.add_argument("--keep", type=Path, default=None, help="keep the scratch directories here")
    args = ap.parse_args(argv)
    head = header(argv=None if argv is None else [__file__, *argv])   # at the start: refuses a dirty tree
    chosen = [(mod, name, fn) for mod, name, fn in load_scenarios()
              if not args.only or any(o.lower() in name.lower() for o in args.only)]
    if not chosen:
        print(f"no scenario matches {args.only} in {', '.join(p.name for p in scenario_modules())}", file=sys.stderr)
        return 2
    root = args.keep or Path(tempfile.mkdtemp(prefix="oomtune-faults-"))
    rows = []
    try:
        for i, (mod, name, fn) in enumerate(chosen):
            print(f"[{i + 1}/{len(chosen)}] {name} ({mod}) ...", flush=True)
            row = run_one(name, fn, root / f"{i:02d}")
            print(f"    {row['outcome']} (trials lost: {row['trials_lost']}, {_cell(row['seconds'])} s)", flush=True)
            rows.append(row)
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    modules = ", ".join(sorted({mod for mod, _, _ in chosen}))
    text = (head + "\n"
            + f"Fault scenarios of {modules}" + (f" (--only {' '.join(args.only)})" if args.only else "")
            + ". Trials lost: finished trials whose result is not in the study at the end (after the "
              "rerun where one is made). Trials run on this machine's CPU (virtual GPU or a sleeping "
              "command target): no memory figure here.\n\n"
            + table(rows))
    write_results(args.out, text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
