"""Run the README's main command, ``oomtune search model=resnet``, in a fresh directory and keep its
whole output: experiments/results/readme_main_command.log (the README quotes its trial lines).

Usage: ``python experiments/readme_main_command.py [--out experiments/results/readme_main_command.log]
[--keep DIR]`` (``--keep``: run in the new directory DIR and keep it, e.g. for
``experiments/bench_report.py --run-dir DIR/runs/<study>``).
Under a minute on a 2-core CPU (the virtual GPU, trials on the meta device); the figures in the log are
simulated there. ``import torch`` is timed in fresh processes in the same run (once before the search,
twice after) as the yardstick of the wall time.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # experiments/_provenance.py
from _provenance import REPO, header, write_results  # noqa: E402  (command + commit lines of every results file)


def _import_torch(env: dict[str, str]) -> float:
    """Wall seconds of ``python -c "import torch"`` in a fresh process (the yardstick of the run)."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], env=env, check=True)
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "readme_main_command.log")
    ap.add_argument("--keep", type=Path, default=None, help="run in this new directory and keep it")
    args = ap.parse_args()
    head = header()   # at the start: refuses a dirty tree, reads the load
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    if args.keep is not None and args.keep.exists() and any(args.keep.iterdir()):
        ap.error(f"--keep {args.keep}: the directory must be new or empty (a fresh directory is the point)")
    with contextlib.ExitStack() as stack:
        if args.keep is None:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="oomtune-readme-"))
        else:
            args.keep.mkdir(parents=True, exist_ok=True)
            tmp = str(args.keep)
        # an empty stream cache, as on a fresh machine (the search would read what earlier runs captured)
        env["OOMTUNE_CACHE_DIR"] = os.path.join(tmp, ".oomtune-stream-cache")
        torch_s = [_import_torch(env)]
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "oomtune", "search", "model=resnet"], cwd=tmp, env=env,
                              capture_output=True, text=True)
        wall = time.perf_counter() - t0
        torch_s += [_import_torch(env), _import_torch(env)]
    t_med = statistics.median(torch_s)
    lines = [f"# oomtune search model=resnet (README main command) in a fresh directory, "
             f"exit status {proc.returncode}, wall {wall:.1f} s",
             f"# import torch in a fresh process, same run: median {t_med:.2f} s ({', '.join(f'{x:.2f}' for x in torch_s)}; "
             f"one before, two after): the search took {wall / t_med:.1f}x",
             "# stderr (progress):", proc.stderr.rstrip(), "# stdout (final table and summary):", proc.stdout.rstrip()]
    text = head + "\n".join(lines) + "\n"
    write_results(args.out, text)
    print(text, end="")
    return proc.returncode


if __name__ == "__main__":
    raise SystemExit(main())
