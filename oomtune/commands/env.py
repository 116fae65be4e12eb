"""``oomtune env best.yaml``: print the export line (eval it in a shell or a CI job).

Warns on stderr when PYTORCH_NO_CUDA_MEMORY_CACHING is set: the exported settings would do nothing
(:mod:`oomtune.alloc.caching_env`).
"""

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

    import sys

    from oomtune.alloc.caching_env import caching_disabled_reason

    best = load_best(args.best)
    reason = caching_disabled_reason()
    if reason is not None:  # stderr, so that eval "$(oomtune env ...)" still gets only the exports
        print(f"oomtune: warning: {reason}", file=sys.stderr)
    print(best.export_line())
    if args.batch_size:
        print(f"export OOMTUNE_BATCH_SIZE={best.batch_size}")
    return 0
