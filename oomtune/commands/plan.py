"""``oomtune plan [overrides]``: the command line only. The plan itself (compose, predict, print,
write plan.yaml) is :func:`oomtune.plan.run.plan`; :func:`plan` here wires in the report writer
(:func:`oomtune.htmlreport.write_report`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

__all__ = ["register", "run", "plan"]


def register(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "plan",
        help="predict the feasibility map with the virtual GPU, without running trials",
        description="Capture the workload's allocation stream on the meta device once per batch size "
        "and replay it under every allocator configuration of the search space: the largest batch that "
        "fits the budget per configuration (exact, by bisection), and the predicted peak reserved and "
        "fragmentation at each batch. All figures are simulated. Arguments are Hydra overrides as for "
        "`oomtune search`; +plan.batch_sizes=[8,16] sets the batch grid.",
    )
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="Hydra overrides")
    p.add_argument("--out", type=Path, default=None, help="plan.yaml path (default: <run dir>/plan.yaml)")
    p.add_argument("--no-cache", action="store_true",
                   help="capture every stream afresh instead of reading the stream cache and refresh its "
                        "entries (the cache: $OOMTUNE_CACHE_DIR, else $XDG_CACHE_HOME/oomtune/streams, else "
                        "~/.cache/oomtune/streams; OOMTUNE_CACHE_DIR=off turns it off)")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from oomtune.alloc.caching_env import check_alloc_env

    from oomtune.display import output_console

    check_alloc_env()   # before anything imports torch, which would abort on a malformed string
    console = output_console()   # logs and CI: wide, lines unbroken (the compact map fits 120 columns)
    plan(args.overrides, out=args.out, console=console, cache=not args.no_cache)
    # The process ends next: move every object to the permanent generation so that the interpreter's
    # shutdown does not walk the ~10^6 objects of torch & co. with the cyclic collector (0.5-1 s of
    # the plan's wall time). Nothing here is needed any more.
    import gc

    gc.freeze()
    return 0


def plan(overrides: list[str], *, out: Path | None = None, console: Any = None, cache: bool = True) -> Any:
    """:func:`oomtune.plan.run.plan` with the run directory's report written after plan.yaml
    (:func:`oomtune.htmlreport.write_report`); returns the :class:`oomtune.plan.feasibility.FeasibilityMap`.

    Raises:
        as :func:`oomtune.plan.run.plan` (bad input, before anything is captured or written).
    """
    from oomtune.htmlreport import write_report
    from oomtune.plan.run import plan as run_plan

    return run_plan(overrides, out=out, console=console, cache=cache, write_report=write_report)
