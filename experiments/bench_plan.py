"""Benchmark ``oomtune plan``: ResNet-50 at 224x224, batch 8..1024, the 24 allocator configurations
of the default search space, 16 GiB budget on the virtual GPU (CPU only; every figure simulated).

Usage: ``python experiments/bench_plan.py [--old REF] [--repeat 1] [--out experiments/results/bench_plan.txt]``

Runs ``oomtune plan`` (the console script's ``main``, as a user runs it) in fresh processes,
alternating: the new code (this checkout: streams derived where the affine model holds, captures and
replays spread over the cores by forked workers), the new code in one process (``workers=1``), the
new code with the pure-Python simulator (``OOMTUNE_PURE_PYTHON=1``: the replays without the compiled
core, which a checkout without a built extension also runs), the new code capturing every batch size (``derive=False``, today's behaviour on today's simulator: its
feasibility map must be identical), the new code reading every capture from a warm stream cache
(:mod:`oomtune.plan.stream_cache`, primed by one untimed plan into a temporary directory: a repeated
plan, which imports no torch), and the old code (``--old``, default: main before the plan's speed changes). Every
other variant runs with the cache off (``OOMTUNE_CACHE_DIR=off``).
Reports, per variant, the wall time of the whole process (``python -c`` that runs the command: what
a user waits for, torch import and interpreter exit included), the time inside ``plan()``, split
into capture (wall time of the captures), derive (deriving streams from the affine model), replay
(wall time of the replays; with workers the parallel phase's wall time is split over capture /
derive / replay in proportion to the workers' seconds in each) and other (``plan()`` minus those:
config, torch import, writing plan.yaml and report.html), and the ratios against the old code.
Target: the whole plan <= 5 s on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _baseline import DEFAULT_OLD, ROOT, TIMED_PLAN, child_env, header, old_tree  # noqa: E402
from _provenance import write_results  # noqa: E402

OVERRIDES = ["model=resnet", "model.depth=50", "model.image_size=224", "model.num_classes=1000",
             "budget=16GiB", "device=cpu", "virtual_device_memory=80GiB",
             "search.batch_size.low=8", "search.batch_size.high=1024"]

FIELDS = ("process_s", "plan_s", "capture_s", "derive_s", "replay_s", "other_s")


def run_variant(tree: Path, derive: bool, one_process: bool = False, pure_python: bool = False,
                cache: str = "off") -> dict:
    """One fresh ``oomtune plan`` process; ``cache``: its OOMTUNE_CACHE_DIR (``off``: capture everything)."""
    env = child_env(tree)
    env["OOMTUNE_CACHE_DIR"] = cache
    if pure_python:
        env["OOMTUNE_PURE_PYTHON"] = "1"
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", TIMED_PLAN, "1" if derive else "0", json.dumps(OVERRIDES),
                           "1" if one_process else "0"], env=env, cwd=tree, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"plan failed in {tree} (derive={derive}):\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["process_s"] = wall
    out["other_s"] = out["plan_s"] - out["capture_s"] - out["derive_s"] - out["replay_s"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", default=DEFAULT_OLD, help="git ref of the code to compare with")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--out", type=Path, default=ROOT / "experiments" / "results" / "bench_plan.txt")
    args = parser.parse_args()
    head = header("bench_plan.py", sys.argv[1:], args.old)   # at the start: refuses a dirty tree, reads the load
    warm_dir = tempfile.mkdtemp(prefix="oomtune-bench-cache-")
    variants = {"new (derived streams, workers)": (ROOT, True, False, False, "off"),
                "new, warm stream cache": (ROOT, True, False, False, warm_dir),
                "new, one process": (ROOT, True, True, False, "off"),
                "new, pure-Python replay": (ROOT, True, False, True, "off"),
                "new, every batch captured": (ROOT, False, False, False, "off"),
                f"old ({args.old})": (old_tree(args.old), False, False, False, "off")}
    runs: dict[str, list[dict]] = {k: [] for k in variants}
    try:
        primed = run_variant(ROOT, True, cache=warm_dir)   # fills the cache (not counted)
        print(f"priming the stream cache: {primed['process_s']:.2f} s", flush=True)
        for _ in range(args.repeat):
            for name, (tree, derive, one_process, pure, cache) in variants.items():
                runs[name].append(run_variant(tree, derive, one_process, pure, cache))
                print(f"{name}: {runs[name][-1]['process_s']:.2f} s", flush=True)
    finally:
        shutil.rmtree(warm_dir, ignore_errors=True)
    med = {k: {f: statistics.median(r[f] for r in v) for f in FIELDS} for k, v in runs.items()}
    names = list(variants)
    new, warm, single, pure, full, old = names
    all_cached = all(r["cached"] == r["captures"] > 0 for r in runs[warm])
    identical = all(r["configurations"] == runs[full][0]["configurations"]
                    for r in runs[new] + runs[warm] + runs[single] + runs[pure])
    same_as_old = runs[new][0]["configurations"] == runs[old][0]["configurations"]
    lines = list(head)
    lines += [
        "# oomtune plan, ResNet-50 224x224, batch 8..1024, 16 GiB budget (virtual GPU, simulated), "
        f"{len(runs[new][0]['configurations'])} allocator configurations; median of {args.repeat} fresh "
        f"process(es) per variant, variants alternating; OMP_NUM_THREADS=1",
        f"# overrides: {' '.join(OVERRIDES)}", "",
        f"{'variant':<34} {'process':>8} {'plan()':>8} {'capture':>8} {'derive':>8} {'replay':>8} {'other':>8}"
        "  captures derived  cached replays  replay core",
    ]
    for k in names:
        r, m = runs[k][0], med[k]
        lines.append(f"{k:<34} " + " ".join(f"{m[f]:7.2f}s" for f in FIELDS)
                     + f"  {r['captures']:>8} {r['derived']:>7} {r.get('cached', 0):>7} {r['replays']:>7}"
                     f"  {r.get('core', 'pure Python')}")

    def ratios(slow: str) -> str:
        return ", ".join(f"{f.replace('_s', '')} {med[slow][f] / med[new][f]:.1f}x" for f in FIELDS
                         if f != "derive_s" and med[new][f] > 0)

    lines += ["", "(process: the whole `python -c` running the command; other = plan() - capture - derive - replay: "
              "config, torch import, plan.yaml, report.html; process - plan(): interpreter start and exit; "
              "cached: captures read from the stream cache, primed by one untimed plan before the runs)",
              f"ratios old/new (same run): {ratios(old)}",
              f"ratios new/warm-stream-cache: "
              f"{', '.join(f'{f[:-2]} {med[new][f] / med[warm][f]:.1f}x' for f in FIELDS if med[warm][f] > 0.05)}",
              f"ratios one-process/new: {ratios(single)}",
              f"ratios pure-Python-replay/new: {ratios(pure)}",
              f"ratios every-batch-captured/new: {ratios(full)}",
              f"target: whole plan process <= 5 s on 2 cores: new {med[new]['process_s']:.2f} s (a first plan: "
              f"captures on meta, imports torch); {med[warm]['process_s']:.2f} s from a warm stream cache "
              f"(every capture read from it: {'yes' if all_cached else 'NO'}; torch not imported)",
              "feasibility map with derived streams (with workers, in one process, pure-Python replay) identical to "
              "capturing "
              f"every batch size (same simulator): {'yes' if identical else 'NO'}",
              "identical to the old code's map: "
              f"{'yes' if same_as_old else 'no (the simulator changed since --old: its real-trace fixes)'}",
              "", "table as printed (new):", runs[new][0]["table"]]
    text = "\n".join(lines)
    write_results(args.out, text + "\n")
    print(text)
    return 0 if identical and all_cached else 1


if __name__ == "__main__":
    raise SystemExit(main())
