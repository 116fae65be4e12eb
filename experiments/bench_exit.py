"""Benchmark: how long an ``oomtune`` command takes to exit after its work is done.

The console script (``oomtune.cli.console_main``) joins the threads, runs the ``atexit`` handlers,
flushes the streams and then ends with ``os._exit``, skipping the interpreter's teardown of every
module and object (torch, SQLAlchemy, Optuna, Hydra). This measures what that saves: each command runs
as a fresh process in two ways, alternating, ``--repeat`` times each:

- ``interpreter``: ``code = oomtune.cli.main(); raise SystemExit(code)`` (Python's own exit);
- ``console_main``: ``oomtune.cli.console_main()`` (the console script's exit).

In both, ``main`` writes the wall clock when it returns; the exit time is from then to the end of
the process as this script sees it (``subprocess.run`` returns). Reported per way: the median and
the range of the exit time and of the whole command, and the exit statuses (which must agree).

Run: python experiments/bench_exit.py [--repeat 3] [--out experiments/results/bench_exit.txt]
     [-- COMMAND ARGS ...]   (default: the README's main job, ``search model=resnet``)
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _provenance import REPO, header, write_results  # noqa: E402

WAYS = {
    "interpreter": "from oomtune import cli\ncode = cli.main()\n_mark()\nraise SystemExit(code)\n",
    "console_main": ("from oomtune import cli\n_main = cli.main\n"
                     "def _timed():\n    code = _main()\n    _mark()\n    return code\n"
                     "cli.main = _timed\ncli.console_main()\n"),
}
PRELUDE = ("import os, sys, time\nsys.argv = ['oomtune', *sys.argv[1:]]\n"
           "def _mark():\n    open(os.environ['OOMTUNE_BENCH_EXIT_FILE'], 'w').write(repr(time.time()))\n")


def run_once(way: str, args: list[str]) -> tuple[float, float, int]:
    """(exit seconds, whole seconds, exit status) of one command run the given way, in a fresh
    temporary directory (its run directory and study)."""
    with tempfile.TemporaryDirectory(prefix="oomtune-bench-exit-") as tmp:
        mark = Path(tmp) / "returned"
        env = {**os.environ, "OOMTUNE_BENCH_EXIT_FILE": str(mark), "PYTHONPATH": str(REPO)}
        argv = [a.replace("{tmp}", tmp) for a in args]
        t0 = time.time()
        done = subprocess.run([sys.executable, "-c", PRELUDE + WAYS[way], *argv], cwd=tmp, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        t1 = time.time()
        if not mark.exists():
            raise SystemExit(f"bench_exit: {way}: main() never returned (exit {done.returncode}): "
                             f"{done.stderr[-2000:]}")
        return t1 - float(mark.read_text()), t1 - t0, done.returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO / "experiments" / "results" / "bench_exit.txt")
    parser.add_argument("command", nargs="*", default=["search", "model=resnet", "hydra.run.dir={tmp}/run"],
                        help="oomtune's arguments ({tmp}: the run's temporary directory)")
    args = parser.parse_args()
    text = header()
    lines = [f"oomtune {' '.join(args.command)}, each way {args.repeat} times, alternating", ""]
    got: dict[str, list[tuple[float, float, int]]] = {way: [] for way in WAYS}
    for _ in range(args.repeat):
        for way in WAYS:
            got[way].append(run_once(way, args.command))
    for way, runs in got.items():
        exits, wholes = [r[0] for r in runs], [r[1] for r in runs]
        lines.append(f"{way:13s} exit {statistics.median(exits):5.2f} s (range {min(exits):.2f}-{max(exits):.2f}), "
                     f"command {statistics.median(wholes):6.2f} s (range {min(wholes):.2f}-{max(wholes):.2f}), "
                     f"exit status {sorted({r[2] for r in runs})}")
    a, b = (statistics.median(r[0] for r in got[w]) for w in WAYS)
    lines.append(f"exit time saved by console_main: {a - b:.2f} s per command (medians)")
    print("\n".join(lines))
    write_results(args.out, text + "\n".join(lines))


if __name__ == "__main__":
    main()
