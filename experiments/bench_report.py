"""Benchmark the HTML report of the README main command's run: its size and build time.

Usage::

    python experiments/bench_report.py [--run-dir DIR] [--screenshot docs/report.png [--screenshot-height 2130]]
                                       [--out experiments/results/bench_report.txt]

Without ``--run-dir`` it first runs the README main command, ``oomtune search model=resnet``, into
``runs/readme-report`` (minutes on a CPU; that run writes report.html itself). Then it times
``oomtune report RUN_DIR`` as a fresh process three times (wall time and the process's CPU time,
which a loaded machine inflates less), and ``build_report()`` inside this process (first call
includes the imports of optuna/plotly; later calls are warm). Targets: < 5 MB, < 2 s.
With ``--screenshot`` it loads the report in headless Chromium (tests/cdp.py) and saves a PNG of
the whole page.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))
from _provenance import header, write_results  # noqa: E402  (the first lines of every results file)

README_COMMAND = ["oomtune", "search", "model=resnet"]


def _child_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _time_cli(run_dir: Path, out: Path) -> tuple[float, float]:
    cpu0, t0 = _child_cpu(), time.perf_counter()
    subprocess.run([sys.executable, "-m", "oomtune", "report", str(run_dir), "--out", str(out)], check=True,
                   stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0, _child_cpu() - cpu0


def _screenshot(report: Path, png: Path, max_height: int | None) -> str:
    sys.path.insert(0, str(ROOT / "tests"))
    from cdp import Browser, chromium_path

    if chromium_path() is None:
        return "screenshot: skipped (no chromium)"
    with tempfile.TemporaryDirectory() as profile, Browser(Path(profile)) as browser:
        browser.load(report.resolve().as_uri())
        errors = browser.console_errors()
        browser.screenshot(png, max_height=max_height)
    return f"screenshot: {png} ({png.stat().st_size} bytes), JavaScript console errors: {len(errors)}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", type=Path, default=None, help="an existing run of the README main command")
    parser.add_argument("--screenshot", type=Path, default=None, help="write a full-page PNG of the report here")
    parser.add_argument("--screenshot-height", type=int, default=2130,
                        help="CSS pixels from the top of the page in the screenshot (0: the whole page)")
    parser.add_argument("--out", type=Path, default=ROOT / "experiments" / "results" / "bench_report.txt")
    args = parser.parse_args()

    lines = header().splitlines()   # command, commit, date, machine, load at start
    run_dir = args.run_dir
    if run_dir is None:
        run_dir = ROOT / "runs" / "readme-report"
        t0 = time.perf_counter()
        subprocess.run([*README_COMMAND, f"hydra.run.dir={run_dir}"], cwd=ROOT, check=True)
        lines.append(f"run: {' '.join(README_COMMAND)} hydra.run.dir={run_dir} took {time.perf_counter() - t0:.0f} s")
    else:
        lines.append(f"run: existing run directory {run_dir} (of: {' '.join(README_COMMAND)})")

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.html"
        cli = [_time_cli(run_dir, out) for _ in range(3)]
        size = out.stat().st_size
        from plotly.offline import get_plotlyjs

        from oomtune.htmlreport import build_report

        cold0 = time.perf_counter()
        build_report(run_dir, out)
        cold = time.perf_counter() - cold0
        warm = []
        for _ in range(3):
            t0 = time.perf_counter()
            build_report(run_dir, out)
            warm.append(time.perf_counter() - t0)
        js = len(get_plotlyjs().encode())
    wall = statistics.median(w for w, _ in cli)
    cpu = statistics.median(c for _, c in cli)
    lines += [
        f"size: {size} bytes = {size / 1e6:.2f} MB (plotly.js {js / 1e6:.2f} MB of it)  "
        f"(target < 5 MB: {'met' if size < 5e6 else 'MISSED'})",
        f"oomtune report RUN_DIR, fresh process, median of 3: wall {wall:.2f} s, CPU {cpu:.2f} s  "
        f"(target < 2 s: {'met' if wall < 2 else 'MISSED'} on wall time"
        + ("" if wall < 2 else f"; CPU time {'within' if cpu < 2 else 'over'} 2 s") + ")",
        f"build_report() in process: first call {cold:.2f} s (imports included), warm median "
        f"{statistics.median(warm):.2f} s",
        f"load average at end: {os.getloadavg()[0]:.1f} (wall times on a loaded machine are inflated)",
    ]
    if args.screenshot is not None:
        lines.append(_screenshot(run_dir / "report.html", args.screenshot, args.screenshot_height or None))
    text = "\n".join(lines) + "\n"
    write_results(args.out, text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
