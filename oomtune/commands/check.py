"""``oomtune check best.yaml``: the CI regression check (see :mod:`oomtune.regression`).

Exit status: 0 pass, 1 regression, 2 bad input (missing/corrupt best.yaml, no recorded prediction in
predict mode, bad flags). A one-line summary is always printed; ``--junit PATH`` also writes a JUnit
XML report with one testcase per check. Flags and the JUnit path are validated before anything runs.

``--max-slowdown`` defaults to 0.10 for a best.yaml measured on a CUDA device; for one measured on
the virtual GPU (CPU) the slowdown is not checked unless ``--max-slowdown`` is given (CPU step times
on shared machines swing ~3x), and a note says so; the memory checks apply either way.

``--gpu l4,a100-40gb`` (predict mode): best.yaml's answer predicted on each named card of the device
catalogue, one line per card, exit 1 when any card fails (:mod:`oomtune.regression_cards`); an
unknown card, or ``--gpu`` with ``--mode run``, is one line, exit 2, before best.yaml is read.

``--mode run`` prints progress on stderr while the trial runs: what runs, a line per step done (from
the trial's progress record), and the trial's end.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from oomtune.regression import DEFAULT_MAX_MEMORY_GROWTH, DEFAULT_MAX_SLOWDOWN, DEFAULT_TOLERANCE

__all__ = ["register", "run"]


def register(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "check",
        help="CI regression check of a best.yaml (run or predict)",
        description="Check that the configuration in best.yaml still fits and performs. --mode predict "
        "(no GPU, deterministic): re-trace the recorded workload with the current code on the virtual "
        "GPU and compare the predicted peak reserved with the one recorded at tuning time. --mode run: "
        "run the recorded configuration as a trial (CUDA, or the virtual GPU on CPU) and compare peak "
        "reserved and throughput with the recorded metrics. Default: run when CUDA is available and "
        "best.yaml was measured on a CUDA device, else predict. Exit 0 pass, 1 regression, 2 bad input.",
    )
    p.add_argument("best", help="best.yaml or a run directory holding one")
    p.add_argument("--mode", choices=("run", "predict"), default=None, help="default: see above")
    p.add_argument("--max-memory-growth", type=float, default=DEFAULT_MAX_MEMORY_GROWTH, metavar="FRACTION",
                   help="run mode: allowed growth of peak reserved over the recorded one, >= 0 "
                   f"(default {DEFAULT_MAX_MEMORY_GROWTH})")
    p.add_argument("--max-slowdown", type=float, default=None, metavar="FRACTION",
                   help=f"run mode: allowed loss of throughput, in [0, 1) (default {DEFAULT_MAX_SLOWDOWN} for a "
                   "CUDA best.yaml; not checked for a virtual-GPU (CPU) best.yaml unless given)")
    p.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE, metavar="FRACTION",
                   help=f"predict mode: allowed growth of the predicted peak reserved, >= 0 (default {DEFAULT_TOLERANCE})")
    p.add_argument("--gpu", default=None, metavar="CARDS",
                   help="predict mode: predict the answer on each of these cards of the device catalogue "
                   "(comma-separated names such as l4,a100-40gb,h100-80gb, all, or a card YAML file); one line "
                   "per card, exit 1 when any does not fit")
    p.add_argument("--device", default=None, help="run mode: cpu | cuda | cuda:N (default: the recorded kind)")
    p.add_argument("--steps", type=int, default=10, help="run mode: measured steps (default 10)")
    p.add_argument("--timeout", type=float, default=600.0, help="trial wall limit, seconds (predict mode: the limit of each capture of a python entry)")
    p.add_argument("--junit", type=Path, default=None, metavar="PATH", help="write a JUnit XML report")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from oomtune.best import load_best
    from oomtune.regression import check_junit_path, validate_limits, write_junit

    from oomtune.alloc.caching_env import check_alloc_env

    check_alloc_env()   # before torch is imported (run mode, and the default mode's CUDA probe)
    validate_limits(max_slowdown=args.max_slowdown, max_memory_growth=args.max_memory_growth,
                    tolerance=args.tolerance)
    if args.junit is not None:
        check_junit_path(args.junit)
    cards = None
    if args.gpu is not None:
        from oomtune.exceptions import ConfigError
        from oomtune.regression_cards import resolve_check_cards

        if args.mode == "run":
            raise ConfigError("--gpu predicts the answer on catalogue cards (--mode predict); --mode run measures the "
                              "device it runs on: drop --gpu, or use --mode predict")
        cards = resolve_check_cards(args.gpu)
    best = load_best(args.best)
    with _recorded_workspaces(best):
        report = _check(args, best, cards)
    for note in [*(report.figures.get("fallback") or ()), *(report.figures.get("notes") or ())]:
        print(f"note: {note}")
    for line in report.figures.get("lines") or ():
        print(line)
    print(report.summary)
    if args.junit is not None:
        write_junit(report, args.junit)
    return report.exit_code


def _check(args: argparse.Namespace, best: Any, cards: Any) -> Any:
    """The check's report: on catalogue cards, predicted, or run (the mode ``args`` asks for, else the
    default for best.yaml and this machine)."""
    from oomtune.regression import check_predict, check_run, default_mode

    mode = args.mode
    if mode is None:
        if cards is not None:
            mode = "predict"
        else:
            import torch

            mode = default_mode(best, torch.cuda.is_available())
    if cards is not None:
        from oomtune.regression_cards import check_cards

        report = check_cards(best, cards, timeout_s=args.timeout)
    elif mode == "predict":
        report = check_predict(best, tolerance=args.tolerance, timeout_s=args.timeout, best_path=args.best)
    else:
        from oomtune.alloc.caching_env import check_caching_enabled

        check_caching_enabled()  # a run without the caching allocator measures something else
        report = check_run(best, max_memory_growth=args.max_memory_growth, max_slowdown=args.max_slowdown,
                           device=args.device, steps=args.steps, timeout_s=args.timeout, say=_progress)
    return report


@contextlib.contextmanager
def _recorded_workspaces(best: Any) -> Iterator[None]:
    """Predict and run under the ``CUBLAS_WORKSPACE_CONFIG`` best.yaml records (it sizes the cuBLAS
    workspaces the answer was tuned with): set in this process, whose captures read it and whose trial
    processes inherit it, and restored on exit (``main`` may run in a caller's process). Where
    best.yaml records none, the environment's value (if any) stays, and a note on stderr says it sizes
    the workspaces (:meth:`oomtune.best.BestConfig.workspace_mismatch`)."""
    import os
    import sys

    from oomtune.best import WORKSPACE_ENV

    recorded = best.cublas_workspace_config
    if recorded is None:
        mismatch = best.workspace_mismatch()
        if mismatch is not None:
            print(f"oomtune check: note: {mismatch}; checked under it", file=sys.stderr)
        yield
        return
    before = os.environ.get(WORKSPACE_ENV)
    os.environ[WORKSPACE_ENV] = recorded
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(WORKSPACE_ENV, None)
        else:
            os.environ[WORKSPACE_ENV] = before


def _progress(text: str) -> None:
    """A progress line of the run mode on stderr (stdout keeps the notes and the summary), wrapped
    to 100 columns."""
    import sys

    from oomtune.display import wrapped

    for part in wrapped(text):
        print(part, file=sys.stderr, flush=True)
