"""CPU demo benchmark: the README's main command, and pruning on vs off.

1. `oomtune search` on the embedded defaults (built-in ResNet-18, 64x64, synthetic data, 1 GiB
   virtual GPU), timed end to end in a fresh run directory. Target: <= 5 minutes on 2 cores.
2. The same search with `search.prune=predicted` and with `search.prune=off`, both with the seeded
   random sampler and no baseline phase (whose probes differ when it starts from the prediction),
   so that both studies ask for the same 16 candidates: compares launches, wall time and
   the best configuration. (With TPE the sequence depends on measured throughput, which is noisy on a
   shared CPU, so the two studies would diverge for reasons unrelated to pruning.)

Prints a table and writes experiments/results/bench_search_cpu.txt. Run: python experiments/bench_search_cpu.py
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

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
    return (f"wall {res['wall_s']:.1f} s; launches {st['launches']} (saved {st['launches_saved']}); "
            f"trials {st['trials']} [{outcomes}]; best batch {b['batch_size']} "
            f"'{b['alloc_conf'] or '(default)'}' {b['metrics']['throughput']:.1f} samples/s, peak reserved "
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


def main() -> None:
    lines = [f"# bench_search_cpu  {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
             f"# machine: {platform.processor() or platform.machine()}, nproc {os.cpu_count()}, "
             f"python {platform.python_version()}", ""]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        main_cmd = run([], tmp / "default")
        lines += ["## README main command: oomtune search (embedded defaults)", describe(main_cmd),
                  f"target <= 300 s: {'met' if main_cmd['wall_s'] <= 300 else 'NOT met'}", ""]
        common = ["search.sampler=random", "search.seed=0", "search.baseline=false", "search.n_trials=16",
                  "search.batch_size.high=2048"]
        on = run(common + ["search.prune=predicted"], tmp / "prune_on")
        off = run(common + ["search.prune=off"], tmp / "prune_off")
        lines += ["## pruning (random sampler, seed 0, no baseline, batch 8..2048: both studies ask the same "
                  "16 candidates)",
                  f"prune=predicted: {describe(on)}", f"prune=off:       {describe(off)}"]
        lines += compare(tmp / "prune_on", tmp / "prune_off")
        lines += [f"launches saved by pruning: {off['best']['study']['launches'] - on['best']['study']['launches']}",
                  ""]
    text = "\n".join(lines)
    print(text)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(text + "\n")


if __name__ == "__main__":
    main()
