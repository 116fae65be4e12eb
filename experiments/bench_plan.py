"""Benchmark ``oomtune plan``: ResNet-50 at 224x224, batch 8..1024, the 24 allocator configurations
of the default search space, 16 GiB budget on the virtual GPU (CPU only; every figure simulated).

Usage: ``python experiments/bench_plan.py [--old REF] [--repeat 1] [--out experiments/results/bench_plan.txt]``

Runs the plan in fresh processes, alternating: the new code (this checkout, streams derived where
the affine model holds), the new code capturing every batch size (``derive=False``, today's
behaviour on today's simulator: its feasibility map must be identical), and the old code
(``--old``, default: main before issue 13). Reports, per variant, the wall time of the whole process
(``python -c`` that imports oomtune's plan and runs it: what a user waits for, torch import
included), the time inside ``plan()``, split into capture and replay, and the ratios old/new.
Target (issue 13): the whole plan <= 5 s on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _baseline import DEFAULT_OLD, ROOT, child_env, header, old_tree  # noqa: E402

OVERRIDES = ["model=resnet", "model.depth=50", "model.image_size=224", "model.num_classes=1000",
             "budget=16GiB", "device=cpu", "virtual_device_memory=80GiB",
             "search.batch_size.low=8", "search.batch_size.high=1024"]

# Runs inside the child process (the tree under test is first on sys.path).
CHILD = r"""
import io, json, sys, tempfile, time
from pathlib import Path
derive = sys.argv[1] == "1"
overrides = json.loads(sys.argv[2])
from rich.console import Console
from oomtune.commands.plan import plan
import oomtune.plan.predictor as P
if not derive and "derive" in (P.Predictor.__init__.__kwdefaults__ or {}):
    P.Predictor.__init__.__kwdefaults__["derive"] = False
console = Console(file=io.StringIO(), width=240, color_system=None)
with tempfile.TemporaryDirectory() as tmp:
    t0 = time.perf_counter()
    fmap = plan([*overrides, f"hydra.run.dir={tmp}/run"], out=Path(tmp) / "plan.yaml", console=console)
    wall = time.perf_counter() - t0
    configs = fmap.to_dict()["configurations"]
print(json.dumps({"plan_s": wall, "capture_s": fmap.capture_s, "replay_s": fmap.replay_s,
                  "captures": fmap.captures, "derived": getattr(fmap, "derived", 0), "replays": fmap.replays,
                  "configurations": configs, "table": console.file.getvalue()}))
"""


def run_variant(tree: Path, derive: bool) -> dict:
    env = child_env(tree)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CHILD, "1" if derive else "0", json.dumps(OVERRIDES)],
                          env=env, cwd=tree, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"plan failed in {tree} (derive={derive}):\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["process_s"] = wall
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", default=DEFAULT_OLD, help="git ref of the code to compare with")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--out", type=Path, default=ROOT / "experiments" / "results" / "bench_plan.txt")
    args = parser.parse_args()
    variants = {"new (derived streams)": (ROOT, True), "new, every batch captured": (ROOT, False),
                f"old ({args.old})": (old_tree(args.old), False)}
    runs: dict[str, list[dict]] = {k: [] for k in variants}
    for _ in range(args.repeat):
        for name, (tree, derive) in variants.items():
            runs[name].append(run_variant(tree, derive))
            print(f"{name}: {runs[name][-1]['process_s']:.2f} s", flush=True)
    med = {k: {f: statistics.median(r[f] for r in v) for f in ("process_s", "plan_s", "capture_s", "replay_s")}
           for k, v in runs.items()}
    names = list(variants)
    new, full, old = names
    identical = runs[new][0]["configurations"] == runs[full][0]["configurations"]
    same_as_old = runs[new][0]["configurations"] == runs[old][0]["configurations"]
    lines = header("bench_plan.py", sys.argv[1:], args.old)
    lines += [
        "# oomtune plan, ResNet-50 224x224, batch 8..1024, 16 GiB budget (virtual GPU, simulated), "
        f"{len(runs[new][0]['configurations'])} allocator configurations; median of {args.repeat} fresh "
        f"process(es) per variant, variants alternating; OMP_NUM_THREADS=1",
        f"# overrides: {' '.join(OVERRIDES)}", "",
        f"{'variant':<34} {'process':>8} {'plan()':>8} {'capture':>8} {'replay':>8}  captures derived replays",
    ]
    for k in names:
        r, m = runs[k][0], med[k]
        lines.append(f"{k:<34} {m['process_s']:7.2f}s {m['plan_s']:7.2f}s {m['capture_s']:7.2f}s "
                     f"{m['replay_s']:7.2f}s  {r['captures']:>8} {r['derived']:>7} {r['replays']:>7}")
    lines += ["", "ratios old/new (same run): " + ", ".join(
        f"{f.replace('_s', '')} {med[old][f] / med[new][f]:.1f}x" for f in ("process_s", "plan_s", "capture_s", "replay_s")),
        "ratios every-batch-captured/new: " + ", ".join(
        f"{f.replace('_s', '')} {med[full][f] / med[new][f]:.1f}x" for f in ("process_s", "plan_s", "capture_s", "replay_s")),
        f"target: whole plan process <= 5 s on 2 cores: new {med[new]['process_s']:.2f} s",
        f"feasibility map with derived streams identical to capturing every batch size (same simulator): "
        f"{'yes' if identical else 'NO'}",
        f"identical to the old code's map: {'yes' if same_as_old else 'no (the simulator changed since --old: issue 11)'}",
        "", "table as printed (new):", runs[new][0]["table"]]
    text = "\n".join(lines)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")
    print(text)
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
