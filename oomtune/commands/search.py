"""``oomtune search [overrides]``: run the tuning study (see :func:`oomtune.search.entry.search`)."""

from __future__ import annotations

import argparse

__all__ = ["register", "run"]


def register(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "search",
        help="run the tuning study (Hydra overrides, e.g. model=resnet budget=16GiB)",
        description="Search batch size and allocator settings with Optuna. Arguments are Hydra "
        "overrides: model=resnet|transformer|mlp, budget=16GiB|0.9, search.n_trials=N, "
        "search.timeout=S, storage=URL, study_name=NAME, device=auto|cpu|cuda:N, hydra.run.dir=DIR.",
    )
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="Hydra overrides")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from oomtune.search.driver import SetupFault
    from oomtune.search.entry import search

    try:
        search(args.overrides)
    except SetupFault as exc:
        print(f"oomtune: {exc}")
        return 1
    return 0
