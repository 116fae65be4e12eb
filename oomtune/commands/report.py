"""``oomtune report RUN_DIR``: (re)build RUN_DIR/report.html from the run's stored artifacts."""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["register", "run"]


def register(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "report", help="write the HTML report of a run directory (search or plan)",
        description="Build one self-contained HTML file (works offline) from a run directory of oomtune search "
        "or oomtune plan: the memory frontier, throughput against batch, the trial timeline, the winner's "
        "memory over one step, the best.yaml summary and advice per failure class.")
    p.add_argument("run_dir", type=Path, help="the run directory (holds run.json, best.yaml or plan.yaml)")
    p.add_argument("--out", type=Path, default=None, help="where to write (default: RUN_DIR/report.html)")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    import time

    from oomtune.htmlreport import build_report

    t0 = time.perf_counter()
    path = build_report(args.run_dir, args.out, say=print)
    size = path.stat().st_size
    print(f"wrote {path} ({size / 1e6:.1f} MB, {time.perf_counter() - t0:.1f} s)")
    return 0
