"""The first lines of every results file in experiments/results/: how to regenerate it and what it measured.

Every benchmark script calls :func:`header` (text results) or :func:`provenance` (JSON results) when it
starts, before it measures anything, and writes those lines first. One format for every file
(tests/test_experiments_results.py checks each committed file)::

    # command: python experiments/bench_plan.py --repeat 3
    # commit: 1a2b3c4
    # date: 2026-12-02T11:40:00Z
    # machine: build-host, 2 CPUs, GPU none
    # load: 1.12

``command`` is relative to the repository root (run the script from anywhere); ``commit`` is
``git rev-parse --short HEAD``; ``date`` is UTC (ISO 8601, seconds); ``machine`` is the host name, the
CPU count (``os.cpu_count()``) and the GPU (``nvidia-smi --query-gpu=name``: ``N x NAME`` for several,
``none`` without a driver); ``load`` is the 1-minute load average (``os.getloadavg()``) when the header
was made, i.e. at the start of the run (other processes on a shared machine slow every timing).

Results are measured at a commit: with uncommitted changes to tracked files outside
experiments/results/ (the results files themselves change as the scripts run one after the other),
:func:`header` and :func:`provenance` print one line naming the problem and exit with status 2 before
anything is measured. ``OOMTUNE_ALLOW_DIRTY=1`` (tests only) writes the header anyway with
``(uncommitted changes: yes)`` after the hash, which the results test refuses in a committed file.
Outside a git checkout (a copy of the tree on a device machine) the commit is ``unknown (not a git
checkout)``, which no committed results file may carry either.

``python experiments/_provenance.py --command "bash experiments/gpu_check.sh"`` prints the header for
a shell script (same rules, same exit status).
"""

from __future__ import annotations

import datetime
import os
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ALLOW_DIRTY_ENV = "OOMTUNE_ALLOW_DIRTY"
#: The results files change while a series of benchmarks runs: not counted as uncommitted changes.
RESULTS_PATHSPEC = ":(exclude)experiments/results"
FIELDS = ("command", "commit", "date", "machine", "load")


def command_line(argv: list[str] | None = None) -> str:
    """``python <script relative to the repository> <args>`` for this process (``sys.argv``)."""
    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0]).resolve() if argv else Path(__file__)
    try:
        shown = str(script.relative_to(REPO))
    except ValueError:
        shown = str(script)
    return " ".join(["python", shlex.quote(shown), *(shlex.quote(a) for a in argv[1:])])


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True,
                          timeout=30, check=True).stdout


def commit() -> str:
    """The short hash of HEAD (``git rev-parse --short HEAD``).

    Exits with status 2 and one line on stderr when tracked files outside experiments/results/ have
    uncommitted changes, unless ``OOMTUNE_ALLOW_DIRTY=1`` (then ``<hash> (uncommitted changes: yes)``).
    ``unknown (not a git checkout)`` without git or outside a checkout.
    """
    try:
        head = _git("rev-parse", "--short", "HEAD").strip()
        dirty = _git("status", "--porcelain", "--untracked-files=no", "--", ".", RESULTS_PATHSPEC).splitlines()
    except (OSError, subprocess.SubprocessError):
        return "unknown (not a git checkout)"
    if not dirty:
        return head
    if os.environ.get(ALLOW_DIRTY_ENV) == "1":
        return f"{head} (uncommitted changes: yes)"
    files = [line[3:] for line in dirty]   # porcelain v1: "XY path"
    shown = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
    print(f"experiments: uncommitted changes to tracked files ({shown}): commit or stash first; results "
          f"are measured at a commit", file=sys.stderr)
    raise SystemExit(2)


def gpu_name() -> str:
    """The GPU(s) of this machine as ``nvidia-smi`` names them (``2 x NVIDIA H100 80GB HBM3`` for
    two alike), or ``none`` without nvidia-smi or a working driver. Does not import torch."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "none"
    try:
        out = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return "none"
    names = [n.strip() for n in out.stdout.splitlines() if n.strip()] if out.returncode == 0 else []
    if not names:
        return "none"
    groups = {n: names.count(n) for n in dict.fromkeys(names)}
    return ", ".join(n if k == 1 else f"{k} x {n}" for n, k in groups.items())


def machine() -> str:
    """``<hostname>, <n> CPUs, GPU <name | none>``."""
    return f"{socket.gethostname()}, {os.cpu_count()} CPUs, GPU {gpu_name()}"


def load() -> str:
    """The 1-minute load average now (two decimals), ``unknown`` where the OS has none."""
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except (OSError, AttributeError):
        return "unknown"


def provenance(argv: list[str] | None = None) -> dict[str, str]:
    """The header's fields for JSON results: ``{"command", "commit", "date", "machine", "load"}``.

    Raises:
        SystemExit: (status 2) uncommitted changes, as :func:`commit`.
    """
    revision = commit()   # first: refuse before anything else runs
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"command": command_line(argv), "commit": revision, "date": date, "machine": machine(),
            "load": load()}


def header(prefix: str = "# ", argv: list[str] | None = None) -> str:
    """The five provenance lines (each ``<prefix><field>: <value>``), newline-terminated. Call it when
    the run starts (the load is read now) and write it first.

    Raises:
        SystemExit: (status 2) uncommitted changes, as :func:`commit`.
    """
    return "".join(f"{prefix}{k}: {v}\n" for k, v in provenance(argv).items())


def write_results(path: str | Path, text: str) -> None:
    """Write a results file (``text``, which starts with :func:`header`'s lines) to ``path``, its
    directory created, ending with one newline.

    Raises:
        OSError: the file cannot be written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text if text.endswith("\n") else text + "\n")


def main(args: list[str] | None = None) -> int:
    """``--command "<the command line>"``: print its header (for shell scripts)."""
    args = sys.argv[1:] if args is None else args
    if len(args) != 2 or args[0] != "--command":
        print('usage: python experiments/_provenance.py --command "bash experiments/<script>.sh ..."',
              file=sys.stderr)
        return 2
    fields = provenance()
    fields["command"] = args[1]
    sys.stdout.write("".join(f"# {k}: {v}\n" for k, v in fields.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
