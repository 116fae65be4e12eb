"""``oomtune env best.yaml``: print the export line (eval it in a shell or a CI job)."""

from __future__ import annotations

import argparse

__all__ = ["register", "run"]


def register(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("env", help="print the export line of a best.yaml",
                       description="Print `export PYTORCH_CUDA_ALLOC_CONF=... PYTORCH_ALLOC_CONF=...`; "
                       "use as: eval \"$(oomtune env runs/NAME/best.yaml)\"")
    p.add_argument("best", help="best.yaml or a run directory")
    p.add_argument("--batch-size", action="store_true", help="also export OOMTUNE_BATCH_SIZE")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from oomtune.best import load_best

    best = load_best(args.best)
    print(best.export_line())
    if args.batch_size:
        print(f"export OOMTUNE_BATCH_SIZE={best.batch_size}")
    return 0
