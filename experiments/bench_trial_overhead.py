"""Fixed cost per trial: spawn (fresh interpreter) vs fork server, against a tiny ResNet's step time.

For each launcher, runs a few identical CPU trials (resnet18, image 32, batch 8, virtual GPU with a
4 GiB budget) through :class:`oomtune.trial.runner.TrialRunner` and reports, per trial:

* launch -> first step: from the runner's launch call to the start of the child's first training
  step (wall clock, ``process.launch_to_first_step_s``): the fixed cost a trial pays before it
  trains (interpreter + imports for spawn; fork + workload build for the fork server);
* startup_s: the child's own view, from its process start (/proc, 10 ms) to the first step;
* the mean measured step time, for scale.

The fork server's one-off start (importing torch once) is reported separately. Target: <= 0.5 s per
trial on CPU with the fork server.

Usage: ``python experiments/bench_trial_overhead.py [--trials N]``; writes
experiments/results/bench_trial_overhead.txt.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))  # experiments/_provenance.py
from _provenance import header, write_results  # noqa: E402  (command + commit lines of every results file)

import torch

from oomtune.trial.record import TrialSpec
from oomtune.trial.runner import TrialRunner
from oomtune.units import GiB

WORKLOAD = {"name": "resnet", "depth": 18, "image_size": 32, "num_classes": 10}
TARGET_S = 0.5


def _trials(runner: TrialRunner, n: int, root: Path, tag: str) -> list[dict]:
    rows = []
    for i in range(n):
        spec = TrialSpec(workload=WORKLOAD, batch_size=8, device="cpu", budget_bytes=4 * GiB,
                         warmup_steps=1, measure_steps=3, timeout_s=300, seed=i)
        r = runner.run(spec, workdir=root / f"{tag}-{i}")
        if r.outcome != "ok":
            raise SystemExit(f"{tag} trial {i} failed: {r.outcome}: {r.message}\n{r.traceback_tail}")
        rows.append({"launch": r.process.launch_to_first_step_s, "startup": r.startup_s,
                     "step": r.throughput.step_time_s, "launcher": r.process.launcher,
                     "peak_reserved": r.memory.peak_reserved_bytes})
    return rows


def _line(name: str, rows: list[dict]) -> str:
    launch = [r["launch"] for r in rows]
    startup = [r["startup"] for r in rows]
    step = statistics.mean(r["step"] for r in rows)
    return (f"{name:<12} {len(rows):>6} {statistics.mean(launch):>10.3f} {min(launch):>8.3f} "
            f"{max(launch):>8.3f} {statistics.mean(startup):>10.3f} {step * 1000:>10.1f} "
            f"{statistics.mean(launch) / step:>10.1f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=4)
    args = ap.parse_args()
    head = header()   # at the start: refuses a dirty tree, reads the load
    out = Path(__file__).resolve().parent / "results" / "bench_trial_overhead.txt"
    with tempfile.TemporaryDirectory(prefix="oomtune-bench-") as tmp:
        root = Path(tmp)
        spawn_rows = _trials(TrialRunner(launcher="spawn"), args.trials, root, "spawn")
        fork = TrialRunner(launcher="fork")
        t0 = time.perf_counter()
        if not fork.start_fork_server():
            raise SystemExit(f"fork server unavailable: {fork._server_failed}")
        server_start = time.perf_counter() - t0
        try:
            fork_rows = _trials(fork, args.trials, root, "fork")
        finally:
            fork.close()
    assert all(r["launcher"] == "fork" for r in fork_rows)
    same_peak = {r["peak_reserved"] for r in spawn_rows + fork_rows}
    fork_mean = statistics.mean(r["launch"] for r in fork_rows)
    lines = [
        "bench_trial_overhead: fixed cost per trial, spawn vs fork server",
        f"python {sys.version.split()[0]}  torch {torch.__version__}  threads/trial {torch.get_num_threads()}",
        "workload resnet18 image 32 batch 8 on CPU (virtual GPU, 4 GiB), 1 warm-up + 3 measured steps",
        "",
        f"{'launcher':<12} {'trials':>6} {'launch->1st':>10} {'min':>8} {'max':>8} {'startup_s':>10} "
        f"{'step ms':>10} {'cost/step':>10}",
        _line("spawn", spawn_rows),
        _line("fork server", fork_rows),
        "",
        f"fork server start (once, imports torch/torchvision/oomtune): {server_start:.2f} s",
        f"speed-up of the per-trial fixed cost: "
        f"{statistics.mean(r['launch'] for r in spawn_rows) / fork_mean:.1f}x",
        f"target <= {TARGET_S} s per trial with the fork server: {'met' if fork_mean <= TARGET_S else 'NOT met'}",
        f"simulated peak reserved identical across launchers and trials: {len(same_peak) == 1} "
        f"({sorted(same_peak)})",
        "(times in seconds; launch->1st = runner launch call to the child's first training step; "
        "startup_s = child process start to first step)",
    ]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    write_results(out, head + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
