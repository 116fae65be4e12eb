"""Run the README's main command, ``oomtune search model=resnet``, in a fresh directory and keep its
whole output: experiments/results/readme_main_command.log (the README quotes its trial lines).

Usage: ``python experiments/readme_main_command.py [--out experiments/results/readme_main_command.log]``.
About 2 minutes on a 2-core CPU (the virtual GPU); the figures in the log are simulated there.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # experiments/_provenance.py
from _provenance import REPO, header  # noqa: E402  (command + commit lines of every results file)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "readme_main_command.log")
    args = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    with tempfile.TemporaryDirectory(prefix="oomtune-readme-") as tmp:
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "oomtune", "search", "model=resnet"], cwd=tmp, env=env,
                              capture_output=True, text=True)
        wall = time.perf_counter() - t0
    lines = [f"# oomtune search model=resnet (README main command) in a fresh directory, "
             f"{datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}, nproc {os.cpu_count()}, "
             f"exit status {proc.returncode}, wall {wall:.1f} s",
             "# stderr (progress):", proc.stderr.rstrip(), "# stdout (final table and summary):", proc.stdout.rstrip()]
    text = header() + "\n".join(lines) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text, end="")
    return proc.returncode


if __name__ == "__main__":
    raise SystemExit(main())
