"""A GPT-2-sized search at a 24 GiB budget on a CPU-only machine: it completes, and its
peak host memory stays far below the budget, since the trials run their steps on the meta device.

Usage: ``python experiments/bench_search_llm.py [--out experiments/results/bench_search_llm.txt]
[--builtin]``

Runs, in a fresh directory with an empty stream cache, ``oomtune search target=python
target.entry=examples/gpt2_workload.py:make_workload budget=24GiB search.batch_size.low=1
search.batch_size.high=64`` (transformers' GPT2LMHeadModel(GPT2Config()), 124M parameters, context
1024; ``--builtin``: the built-in transformer of the same size instead), and samples every 0.2 s the
resident memory (RSS, /proc/PID/status VmRSS) of the search process and all its descendants (the fork
server, the trial processes): the peak of their sum and the largest single process; plus the
kernel's high-water mark of the largest waited-for descendant (``ru_maxrss`` of RUSAGE_CHILDREN).
Before trials ran their steps on meta, the first trial process of this search grew to 20.8 GB RSS in its first step.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _provenance import REPO, header, write_results  # noqa: E402

ENTRY = ["target=python", "target.entry=" + str(REPO / "examples/gpt2_workload.py") + ":make_workload"]
BUILTIN = ["model=transformer", "model.layers=12", "model.d_model=768", "model.heads=12", "model.vocab_size=50257",
           "model.seq_len=1024", "model.precision=bf16", "model.optimizer=adamw"]
COMMON = ["budget=24GiB", "search.batch_size.low=1", "search.batch_size.high=64"]


def _tree(root: int) -> list[int]:
    """``root`` and every descendant (by /proc/*/stat parent links)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "experiments" / "results" / "bench_search_llm.txt")
    ap.add_argument("--builtin", action="store_true", help="the built-in transformer of GPT-2's size")
    args = ap.parse_args()
    head = header()   # at the start: refuses a dirty tree, reads the load
    overrides = (BUILTIN if args.builtin else ENTRY) + COMMON
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    peak = {"sum": 0, "single": 0, "samples": 0}
    with tempfile.TemporaryDirectory(prefix="oomtune-llm-search-") as tmp:
        env["OOMTUNE_CACHE_DIR"] = os.path.join(tmp, ".oomtune-stream-cache")
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "oomtune", "search", *overrides], cwd=tmp, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                sizes = [_rss(p) for p in _tree(proc.pid)]
                peak["sum"] = max(peak["sum"], sum(sizes))
                peak["single"] = max(peak["single"], max(sizes, default=0))
                peak["samples"] += 1
                done.wait(0.2)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        stdout, stderr = proc.communicate()
        done.set()
        sampler.join()
        wall = time.perf_counter() - t0
    maxrss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024   # Linux: kB
    try:
        available = next(int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                         if line.startswith("MemTotal:"))
    except (OSError, StopIteration):
        available = None
    gib = 2 ** 30
    lines = [f"# oomtune search {' '.join(overrides)} in a fresh directory with an empty stream cache"
             + (f", host memory {available / gib:.1f} GiB" if available else ""),
             f"# exit status {proc.returncode}, wall {wall:.1f} s",
             f"# peak host memory (RSS sampled every 0.2 s, {peak['samples']} samples): the search and all its "
             f"descendants together {peak['sum'] / gib:.2f} GiB; the largest single process {peak['single'] / gib:.2f} "
             f"GiB; kernel high-water mark of the largest waited-for descendant (ru_maxrss) {maxrss / gib:.2f} GiB",
             "# stderr (progress):", stderr.rstrip(), "# stdout (final table and summary):", stdout.rstrip()]
    text = head + "\n".join(lines) + "\n"
    write_results(args.out, text)
    print(text, end="")
    return proc.returncode


if __name__ == "__main__":
    raise SystemExit(main())
