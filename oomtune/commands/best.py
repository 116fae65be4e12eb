"""``oomtune best``: the study's answer (best.yaml) as recorded in its storage, from any machine.

    oomtune best --storage postgresql://host/db --study NAME [--output best.yaml]
    oomtune best runs/NAME

Every worker of a study writes the same best.yaml: the first worker to finish records its content
in the study (``oomtune.search.outputs.BEST_ATTR``, exactly one writer wins) and the others write
that record. This command prints (or writes) that record; exit 1 while no worker has finished.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["register", "run"]


def register(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("best", help="print the best.yaml recorded in a study's storage (any machine)",
                       description="Print the study's recorded answer (best.yaml), read from its storage.")
    p.add_argument("path", nargs="?", help="run directory or best.yaml (instead of --storage/--study)")
    p.add_argument("--storage", help="Optuna storage URL, e.g. postgresql://user@host/db")
    p.add_argument("--study", help="study name in --storage")
    p.add_argument("--output", "-o", help="write best.yaml here instead of printing it")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    import yaml

    from oomtune.commands.show import _locate
    from oomtune.search.outputs import recorded_best
    from oomtune.study.storage import load_study

    located = _locate(args)
    name = located.study_name
    data = recorded_best(load_study(located.url, name))
    if data is None:
        print(f"oomtune best: study {name!r} has no recorded answer yet (no worker has finished)", file=sys.stderr)
        return 1
    text = yaml.safe_dump(data, sort_keys=False)
    if args.output:
        from oomtune.files import write_atomic

        write_atomic(Path(args.output), text)
    else:
        sys.stdout.write(text)
    return 0
