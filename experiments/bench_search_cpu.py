"""CPU demo benchmark: the README's main command (three times), and pruning on vs off.

1. `oomtune search model=resnet` on the embedded defaults (built-in ResNet-18, 64x64, synthetic data,
   1 GiB virtual GPU; trials step on the meta device, ``trial.execute=auto``), three times, each in a
   fresh run directory: the answer must be the same each time (objective batch on the virtual GPU: memory is simulated and deterministic). Per run: the
   answer, trial processes launched, wall time (target <= 120 s on 2 cores), and the answer's batch
   against every configuration's predicted and measured frontier (best.yaml ``frontiers``).
2. The same search with `search.prune=predicted` and with `search.prune=off`, both with the seeded
   random sampler, objective throughput (trials train on the CPU: ``trial.execute=cpu``), no baseline
   and no frontier probes (whose probes differ
   when they start from the prediction), so that both studies ask for the same 16 candidates:
   compares launches, wall time and the best configuration. (With TPE the sequence depends on
   measured throughput, which is noisy on a shared CPU, so the two studies would diverge for reasons
   unrelated to pruning.)

Prints a table and writes experiments/results/bench_search_cpu.txt. Run: python experiments/bench_search_cpu.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _provenance import header, write_results  # noqa: E402  (the first lines of every results file)

# Every search here captures afresh: no stream cache left by another run (oomtune.plan.stream_cache).
os.environ["OOMTUNE_CACHE_DIR"] = "off"

RESULTS = Path(__file__).resolve().parent / "results" / "bench_search_cpu.txt"


def run(args: list[str], run_dir: Path) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "oomtune", "search", *args, f"hydra.run.dir={run_dir}"],
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"search failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    best = yaml.safe_load((run_dir / "best.yaml").read_text())
    return {"wall_s": wall, "best": best, "stdout": proc.stdout, "stderr": proc.stderr}


def describe(res: dict) -> str:
    b = res["best"]["best"]
    st = res["best"]["study"]
    outcomes = ", ".join(f"{k} {v}" for k, v in sorted(st["outcomes"].items()))
    speed = b["metrics"]["throughput"]   # None for trials on the meta device (no arithmetic to time)
    speed = "no throughput (meta trials)" if speed is None else f"{speed:.1f} samples/s"
    return (f"wall {res['wall_s']:.1f} s; launches {st['launches']} (saved {st['launches_saved']}); "
            f"trials {st['trials']} [{outcomes}]; best batch {b['batch_size']} "
            f"'{b['alloc_conf'] or '(default)'}' {speed}, peak reserved "
            f"{b['metrics']['peak_reserved_bytes'] / 2**20:.1f} MiB ({b['metrics']['memory_source']})")


def _trials(run_dir: Path) -> list[dict]:
    import json

    import optuna

    info = json.loads((run_dir / "run.json").read_text())
    study = optuna.load_study(study_name=info["study_name"], storage=info["storage"])
    out = []
    for t in study.trials:
        if t.user_attrs.get("role") != "search":
            continue
        res = t.user_attrs.get("result", {})
        out.append({"params": t.params, "outcome": t.user_attrs.get("outcome"),
                    "throughput": res.get("throughput"), "peak_reserved_bytes": res.get("peak_reserved_bytes"),
                    "feasible": t.user_attrs.get("outcome") == "ok" and all(v <= 0 for v in t.constraints.values())})
    return out


def compare(on_dir: Path, off_dir: Path) -> list[str]:
    """Falsifiable checks that pruning changed launches, not answers."""
    on, off = _trials(on_dir), _trials(off_dir)
    same_asks = [a["params"] for a in on] == [b["params"] for b in off]
    pruned = [(a, b) for a, b in zip(on, off) if a["outcome"] == "predicted_infeasible"]
    pruned_right = all(b["outcome"] in ("oom", "oom_fragmentation", "fraction_cap") or not b["feasible"]
                       for _, b in pruned)
    feas_on = [(str(a["params"]), a["peak_reserved_bytes"]) for a in on if a["feasible"]]
    feas_off = [(str(b["params"]), b["peak_reserved_bytes"]) for b in off if b["feasible"]]
    best_on = max((a for a in on if a["feasible"]), key=lambda a: a["throughput"])
    best_off = max((b for b in off if b["feasible"]), key=lambda b: b["throughput"])
    twin = next(b for b in off if b["params"] == best_on["params"])
    return [
        f"same 16 candidates asked in both studies: {same_asks}",
        f"candidates pruned without launching: {len(pruned)}; each of them failed (out of memory or over the "
        f"limit) when launched with pruning off: {pruned_right}",
        f"feasible candidates and their simulated peak reserved identical in both studies: {feas_on == feas_off} "
        f"({len(feas_on)} feasible)",
        f"best (prune=predicted): {best_on['params']} {best_on['throughput']:.1f} samples/s; the same candidate "
        f"measured {twin['throughput']:.1f} samples/s in the prune=off study",
        f"best (prune=off):       {best_off['params']} {best_off['throughput']:.1f} samples/s",
        f"same best configuration: {best_on['params'] == best_off['params']} (the feasible set is identical; "
        "a different winner can only come from CPU throughput noise between near-equal candidates)",
    ]


def frontier_lines(res: dict) -> list[str]:
    """The answer's batch against each configuration's predicted and measured frontier."""
    best = res["best"]
    batch = best["best"]["batch_size"]
    out = [f"  {'alloc_conf':<62} {'predicted':>9} {'measured':>9}  answer/predicted"]
    for row in sorted(best.get("frontiers") or [], key=lambda r: -(r["predicted_max_batch"] or 0)):
        pred, ok, bad = row["predicted_max_batch"], row["measured_max_batch"], row["measured_fail_batch"]
        measured = (("-" if bad is None else f"<{bad}") if ok is None
                    else str(ok) if bad == ok + 1 else f">={ok}" if bad is None else f"{ok}..{bad - 1}")
        ratio = f"{batch / pred:.3f}" if pred else "-"
        name = (row["alloc_conf"] or "(default)") + (f" (+{len(row['twins'])} same)" if row["twins"] else "")
        out.append(f"  {name:<62} {str(pred):>9} {measured:>9}  {ratio}")
    return out


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description="README main command x3, and pruning on vs off")
    ap.add_argument("--skip-pruning", action="store_true", help="only the three main-command runs")
    args = ap.parse_args()
    lines = [*header().splitlines(), "# memory figures simulated (virtual GPU)", ""]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        runs = [run(["model=resnet"], tmp / f"default-{i}") for i in range(3)]
        answers = [(r["best"]["best"]["batch_size"], r["best"]["best"]["alloc_conf"]) for r in runs]
        lines += ["## README main command: oomtune search model=resnet (embedded defaults), three runs"]
        for i, r in enumerate(runs):
            lines.append(f"run {i + 1}: {describe(r)}; objective {r['best']['objective']['name']}")
        lines += [f"same answer in all three runs: {len(set(answers)) == 1} ({answers[0][0]}, "
                  f"'{answers[0][1] or '(default)'}')",
                  f"wall target <= 120 s: {'met' if max(r['wall_s'] for r in runs) <= 120 else 'NOT met'} "
                  f"(max {max(r['wall_s'] for r in runs):.1f} s)",
                  "answer batch vs each configuration's frontier (run 1; predicted: virtual GPU, as `oomtune plan`):"]
        lines += frontier_lines(runs[0]) + [""]
        lines += ["## run 1's output (stderr: progress; stdout: tables and summary)", runs[0]["stderr"].rstrip(),
                  runs[0]["stdout"].rstrip(), ""]
        if args.skip_pruning:
            lines.append("## pruning: skipped (--skip-pruning)")
        else:
            # trial.execute=cpu: the objective is throughput, which trials on the meta device do not measure
            common = ["trial.execute=cpu", "search.sampler=random", "search.seed=0", "search.baseline=false", "search.n_trials=16",
                      "search.batch_size.high=2048", "search.objective=throughput", "search.frontier_configs=0",
                      "search.repeats=1"]
            on = run(common + ["search.prune=predicted"], tmp / "prune_on")
            off = run(common + ["search.prune=off"], tmp / "prune_off")
            lines += ["## pruning (random sampler, seed 0, objective throughput, no baseline or frontier probes, "
                      "batch 8..2048: both studies ask the same 16 candidates)",
                      f"prune=predicted: {describe(on)}", f"prune=off:       {describe(off)}"]
            lines += compare(tmp / "prune_on", tmp / "prune_off")
            lines += [f"launches saved by pruning: "
                      f"{off['best']['study']['launches'] - on['best']['study']['launches']}", ""]
    text = "\n".join(lines)
    write_results(RESULTS, text + "\n")
    print(text)


if __name__ == "__main__":
    main()
