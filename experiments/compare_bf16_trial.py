"""A bf16 Hugging Face Trainer script's step time on its own against one oomtune trial of it (virtual GPU).

The script is tests/data/hf_bf16_train.py: ``TrainingArguments(bf16=True)``, a GPT-2-shaped model built from its
config (width 768, 12 heads, vocabulary 50257 by default; ``--layers`` blocks, ``--seq-len`` tokens), AdamW (the
Trainer's default, fused), random tokens, with oomtune's one added line (``callbacks=[OomtuneCallback()]``).

- standalone: the script run by itself on this CPU (``--use-cpu``: without a GPU transformers accepts bf16 only
  there; accelerate then runs ``torch.autocast("cpu", dtype=torch.bfloat16)``), ``--steps`` optimizer steps at
  ``--batch`` samples; its step time is the mean wall time of the steps after the first (the script prints it).
- trial: the same script, without ``--use-cpu``, as one ``target=cmd`` trial on the virtual GPU targeting an A100
  (``OomtuneCallback``; transformers' bf16 check answered by the A100; the steps run for real on the CPU,
  ``trial.execute=cpu``, under CUDA's autocast policy and the allocator simulator), 1 warm-up + ``--steps - 1``
  measured steps at the same batch; its step time is the trial record's ``throughput.step_time_s``.

Each is run ``--repeat`` times, alternating, so that both meet the same load; the file gives each run, the median
and spread (max - min) of each, the ratio of the medians, and the load average before each run (the machine is
shared: other processes slow every timing). A ratio is claimed only beyond the spread.

Run: python experiments/compare_bf16_trial.py [--repeat 3] [--layers 2] [--seq-len 128] [--batch 2] [--steps 4]
Writes experiments/results/compare_bf16_trial.txt (first lines: the command and the commit).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ["OOMTUNE_CACHE_DIR"] = "off"
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "experiments"))
sys.path.insert(0, str(REPO))
from _provenance import header, write_results  # noqa: E402

RESULTS = REPO / "experiments" / "results" / "compare_bf16_trial.txt"
SCRIPT = REPO / "tests" / "data" / "hf_bf16_train.py"


def model_args(args: argparse.Namespace) -> list[str]:
    return ["--layers", str(args.layers), "--d-model", str(args.d_model), "--heads", str(args.heads),
            "--vocab", str(args.vocab), "--seq-len", str(args.seq_len), "--batch-size", str(args.batch)]


def standalone(args: argparse.Namespace) -> dict:
    """The script on its own: its printed mean step time (s) and the run's wall time."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OOMTUNE_")}
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, str(SCRIPT), *model_args(args), "--steps", str(args.steps), "--use-cpu"],
                          capture_output=True, text=True, cwd=REPO, env={**env, "PYTHONPATH": str(REPO)})
    wall = time.perf_counter() - t0
    m = re.search(r"step_time_s ([0-9.]+)", proc.stdout)
    if proc.returncode != 0 or m is None:
        raise SystemExit(f"standalone run failed (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}")
    return {"kind": "standalone", "step_time_s": float(m.group(1)), "wall_s": round(wall, 1), "load": round(load, 2)}


def one_trial(args: argparse.Namespace, workdir: Path) -> dict:
    """One target=cmd trial of the script on the virtual GPU (A100): its record's step time."""
    from oomtune.trial.record import TrialSpec
    from oomtune.trial.runner import TrialRunner

    command = " ".join([sys.executable, str(SCRIPT), *model_args(args)])
    spec = TrialSpec(workload={"target": {"name": "cmd", "command": command}, "gpu": "a100"},
                     batch_size=args.batch, device="cpu", budget_bytes=80 << 30, device_memory_bytes=80 << 30,
                     warmup_steps=1, measure_steps=args.steps - 1, timeout_s=3600, execute="cpu")
    load = os.getloadavg()[0]
    runner = TrialRunner()
    t0 = time.perf_counter()
    try:
        res = runner.run(spec, workdir=workdir, env={"PYTHONPATH": str(REPO)})
    finally:
        runner.close()
    wall = time.perf_counter() - t0
    if res.outcome != "ok" or res.throughput.step_time_s is None:
        raise SystemExit(f"trial failed: {res.outcome}: {res.message}")
    return {"kind": "trial", "step_time_s": res.throughput.step_time_s, "wall_s": round(wall, 1),
            "load": round(load, 2), "precision": (res.script.reported_values() or [{}])[0].get("precision"),
            "execute": res.execution.where, "peak_reserved_bytes": res.memory.peak_reserved_bytes,
            "memory_source": res.memory.source}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps per run (the first is not timed)")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    import torch
    import transformers

    head = header()
    rows = []
    with tempfile.TemporaryDirectory(prefix="oomtune-bf16-") as tmp:
        for i in range(args.repeat):   # alternating: both kinds meet the same load
            rows.append(standalone(args))
            print(json.dumps(rows[-1]), flush=True)
            rows.append(one_trial(args, Path(tmp) / f"trial-{i}"))
            print(json.dumps(rows[-1]), flush=True)
    alone = [r["step_time_s"] for r in rows if r["kind"] == "standalone"]
    trial = [r["step_time_s"] for r in rows if r["kind"] == "trial"]
    ma, mt = statistics.median(alone), statistics.median(trial)
    ratio = mt / ma
    # the ratio's range over the runs: slowest trial / fastest standalone and fastest trial / slowest standalone
    lo, hi = min(trial) / max(alone), max(trial) / min(alone)
    spread = max(max(alone) - min(alone), max(trial) - min(trial))
    lines = head.rstrip("\n").splitlines() + [
        f"# torch {torch.__version__}, transformers {transformers.__version__}; {os.cpu_count()} CPUs shared with "
        "other processes (load = 1-minute load average before each run)",
        f"# script: tests/data/hf_bf16_train.py, GPT-2-shaped: {args.layers} layers x {args.d_model}, {args.heads} heads, "
        f"vocabulary {args.vocab}, {args.seq_len} tokens, batch {args.batch}, bf16=True, AdamW (fused); "
        f"{args.steps} optimizer steps per run, the first not timed",
        "# standalone: --use-cpu, torch.autocast('cpu', bf16) by accelerate; trial: target=cmd on the virtual GPU "
        "(A100 target, trial.execute=cpu: real CPU steps under CUDA's autocast policy, memory simulated)",
        "# step time, both: wall time from the end of the first optimizer step to the end of the last, divided by "
        "the steps between (standalone: the script's on_step_end times; trial: OomtuneCallback's measured steps)",
        "",
        f"{'run':<12} {'step s':>8} {'run wall s':>10} {'load':>6}",
    ]
    for r in rows:
        lines.append(f"{r['kind']:<12} {r['step_time_s']:>8.3f} {r['wall_s']:>10.1f} {r['load']:>6.2f}")
    lines += [
        "",
        f"standalone step: median {ma:.3f} s, spread {max(alone) - min(alone):.3f} s ({min(alone):.3f}..{max(alone):.3f})",
        f"trial step:      median {mt:.3f} s, spread {max(trial) - min(trial):.3f} s ({min(trial):.3f}..{max(trial):.3f})",
        f"trial / standalone: {ratio:.2f}x (medians); over every pairing of runs {lo:.2f}x..{hi:.2f}x "
        f"(goal: within 3x: {'met by every pairing' if hi <= 3 else 'met by the medians, not by every pairing' if ratio <= 3 else 'not met'})",
        ("the medians differ by less than the larger spread: no ratio other than the range above is claimed"
         if abs(mt - ma) < spread else f"the medians differ by more than the larger spread ({spread:.3f} s)"),
        "",
        "raw:",
    ] + [json.dumps(r) for r in rows]
    write_results(Path(args.out), "\n".join(lines) + "\n")
    print(Path(args.out).read_text())


if __name__ == "__main__":
    main()
