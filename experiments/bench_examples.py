"""The searches the examples' docstrings tell a user to run, timed, and their answers against the
virtual GPU's predicted frontiers (every memory figure simulated).

Each example in examples/ that runs under ``target=cmd`` (the plain loops ``train_cmd.py`` and
``global_batch.py``, ``lightning_module.py``, ``hf_trainer.py``: GPT-2-shaped from its config, no
download) is searched with the exact ``oomtune search`` command of its docstring (its budget and global
batch), on this machine's CPU with the virtual GPU, the stream cache off (a first run), one search at a
time. For each: the wall time, the trial processes launched and the trials by role, the smoke test's
time, the answer (micro-batch, accumulation, allocator, confirmed peak reserved) and whether the answer
is the predictions' own: the largest batch predicted to fit within budget x (1 - headroom) over every
configuration, under the default allocator when it is predicted there too (search.min_gain keeps the
default on a tie). Under a global batch the recordings cover only the micro-batches that accumulate
(oomtune/plan/recorded.py): an answer of the whole global batch is above the predictions' range and
decided by a trial, which the verdict says. The goal measured: <= 180 s per example.

The search's own time is split into its trials' wall times by role (``result.json`` of each trial
directory, the smoke test's included: it runs beside the frontier rounds, on a thread of its own).

Run: python experiments/bench_examples.py [--only lightning,loop] [--out PATH]
Writes experiments/results/bench_examples.txt (first lines: the command and the commit, then
``cat /proc/loadavg`` at the start; the same at the end).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "experiments"))
from _provenance import header, write_results  # noqa: E402
from compare_hf import _exit_words  # noqa: E402  (also sets OOMTUNE_CACHE_DIR=off: a first run)
from compare_lightning_meta import _trial_executions  # noqa: E402

RESULTS = REPO / "experiments" / "results" / "bench_examples.txt"
GOAL_S = 180.0
#: name -> the search its docstring documents (the words after ``oomtune search``), as a user types them.
SEARCHES = {
    "train_cmd": ["target=cmd", "target.command='python examples/train_cmd.py --batch-size {batch_size}'"],
    "global_batch": ["target=cmd", "search.global_batch=32", "search.batch_size.low=1", "budget=96MiB",
                     "target.command='python examples/global_batch.py --micro-batch {batch_size} "
                     "--grad-accum {grad_accum}'"],
    "lightning": ["target=cmd", "target.command='python examples/lightning_module.py'", "budget=128MiB"],
    "hf_trainer": ["target=cmd", "target.command='python examples/hf_trainer.py'", "budget=256MiB",
                   "search.global_batch=32", "search.batch_size.low=1"],
}


def loadavg() -> str:
    """``cat /proc/loadavg`` (1, 5 and 15 minute load, running/total tasks, last pid)."""
    return Path("/proc/loadavg").read_text().strip()


def predicted_answer(frontiers: list[dict]) -> tuple[int | None, list[str]]:
    """(the largest predicted batch over every configuration, the configurations predicting it: the
    representative of each frontier row and its twins). (None, []) without predictions."""
    rows = [f for f in frontiers if f.get("predicted_max_batch") is not None]
    if not rows:
        return None, []
    top = max(f["predicted_max_batch"] for f in rows)
    confs = [c for f in rows if f["predicted_max_batch"] == top for c in [f["alloc_conf"], *f.get("twins", [])]]
    return top, confs


def verdict(answer: dict, frontiers: list[dict], global_batch: int | None) -> str:
    """Whether the answer is the predictions' own (module docstring), in a few words."""
    top, confs = predicted_answer(frontiers)
    batch, conf = answer["micro_batch"], answer["alloc_conf"]
    if top is None:
        return "no predictions"
    if batch == top:
        if conf in confs and (conf == "" or "" not in confs):
            return "same (batch and allocator)"
        return f"same batch, allocator differs (predicted: {confs[0] or '(default)'})"
    if global_batch is not None and batch == global_batch and answer["grad_accum"] == 1 and batch > top:
        return (f"above the predictions' range: {batch} is the whole global batch, not covered by the "
                f"recordings (largest predicted {top}); a trial decided it")
    return f"differs: predicted {top} ({confs[0] or '(default)'}), answer {batch}"


def trial_times(run_dir: Path, roles: dict[int, str]) -> dict[str, float]:
    """Seconds of the trials' processes by role (``wall_s`` of each ``result.json``; ``smoke``: the smoke
    test)."""
    out: dict[str, float] = {}
    for rec in sorted(run_dir.rglob("result.json")):
        name = rec.parent.name
        role = roles.get(int(name.split("-")[1]), "?") if name.startswith("trial-") else name
        wall = json.loads(rec.read_text()).get("wall_s") or 0.0
        out[role] = round(out.get(role, 0.0) + wall, 1)
    return out


def run_search(name: str, run_dir: Path) -> dict:
    """One documented search of example ``name``: wall time, launches, trials, answer, verdict."""
    import yaml

    argv = ["search", *SEARCHES[name], f"hydra.run.dir={run_dir}"]
    row: dict = {"example": name, "command": "oomtune search " + " ".join(SEARCHES[name]), "loadavg_start": loadavg()}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "oomtune", *argv], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    row["wall_s"] = round(time.perf_counter() - t0, 1)
    row["loadavg_end"] = loadavg()
    (run_dir.parent / f"{name}.log").write_text(proc.stdout + proc.stderr)
    roles = {}
    if (run_dir / "trials.json").exists():
        trials = json.loads((run_dir / "trials.json").read_text())
        roles = {t["number"]: t.get("role", "?") for t in trials}
        row["trials"] = len(trials)
        row["trials_by_role"] = {r: list(roles.values()).count(r) for r in dict.fromkeys(roles.values())}
    row["trial_seconds_by_role"] = trial_times(run_dir, roles)
    smoke = next((ln for ln in proc.stdout.splitlines() + proc.stderr.splitlines() if ln.startswith("smoke test")),
                 None)
    row["smoke_line"] = smoke
    if proc.returncode != 0:
        row["error"] = _exit_words(proc.returncode, proc.stderr or proc.stdout)
        return row
    best = yaml.safe_load((run_dir / "best.yaml").read_text())
    b = best["best"]
    row.update(micro_batch=b["batch_size"], grad_accum=b.get("grad_accum") or 1, alloc_conf=b["alloc_conf"],
               confirmed=b["confirmed"], peak_reserved_bytes=b["metrics"]["peak_reserved_bytes"],
               predicted_peak_reserved_bytes=b.get("predicted_peak_reserved_bytes"),
               launches=best["study"]["launches"], launches_saved=best["study"].get("launches_saved"),
               budget_bytes=best["device"]["budget_bytes"], frontiers=best.get("frontiers") or [],
               executions=_trial_executions(run_dir))
    gb = next((int(a.split("=")[1]) for a in SEARCHES[name] if a.startswith("search.global_batch=")), None)
    row["predicted_max_batch"], _ = predicted_answer(row["frontiers"])
    row["verdict"] = verdict(row, row["frontiers"], gb)
    default = next((f for f in row["frontiers"] if f["alloc_conf"] == "" and not f.get("activation_checkpointing")),
                   None)
    if default is not None:
        row["default_frontier"] = {k: default.get(k) for k in ("predicted_max_batch", "measured_max_batch",
                                                                  "measured_fail_batch")}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(SEARCHES), help="comma-separated examples (default: all)")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    names = [n for n in args.only.split(",") if n]
    unknown = [n for n in names if n not in SEARCHES]
    if unknown:
        ap.error(f"unknown example(s) {', '.join(unknown)}: choose from {', '.join(SEARCHES)}")
    import lightning
    import torch
    import transformers

    head = header()
    start = loadavg()
    rows = []
    with tempfile.TemporaryDirectory(prefix="oomtune-examples-") as tmp:
        for name in names:
            rows.append(run_search(name, Path(tmp) / name / "run"))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "frontiers"}), flush=True)
    end = loadavg()
    lines = head.rstrip("\n").splitlines() + [
        f"# cat /proc/loadavg at start: {start}",
        f"# cat /proc/loadavg at end: {end}",
        f"# {platform.node()} ({os.cpu_count()} CPUs, shared: wall times are this CPU's under that load); torch "
        f"{torch.__version__}, lightning {lightning.__version__}, transformers {transformers.__version__}; one run each",
        "# each search: the example docstring's `oomtune search` command, device auto (the virtual GPU on the CPU: "
        "memory simulated), the stream cache off, one search at a time",
        "# predicted: the largest batch predicted to fit (simulated) over every configuration; verdict: the "
        "answer against it (module docstring of experiments/bench_examples.py)",
        f"# goal: <= {GOAL_S:.0f} s per example",
        "",
    ]
    hdr = (f"{'example':<13} {'wall s':>6} {'goal':>4} {'launches':>8} {'trials':>6} {'micro':>5} {'accum':>5} "
           f"{'allocator':<12} {'peak resv':>9} {'predicted':>9} {'default frontier':>16}  verdict")
    lines += [hdr, "-" * len(hdr)]
    for r in rows:
        goal = "ok" if r["wall_s"] <= GOAL_S else "MISS"
        if "error" in r:
            lines.append(f"{r['example']:<13} {r['wall_s']:>6.0f} {goal:>4} error: {r['error']}")
            continue
        d = r.get("default_frontier") or {}
        meas = ("-" if d.get("measured_max_batch") is None else str(d["measured_max_batch"])) + (
            "" if d.get("measured_fail_batch") is None else f"/{d['measured_fail_batch']}x")
        dtext = f"{d.get('predicted_max_batch')} -> {meas}"
        lines.append(f"{r['example']:<13} {r['wall_s']:>6.0f} {goal:>4} {r['launches']:>8} {r.get('trials', '-'):>6} "
                     f"{r['micro_batch']:>5} {r['grad_accum']:>5} {(r['alloc_conf'] or '(default)'):<12} "
                     f"{r['peak_reserved_bytes'] / 2**20:>5.0f} MiB {str(r['predicted_max_batch']):>9} "
                     f"{dtext:>16}  {r['verdict']}")
    lines += ["", "default frontier: predicted -> measured largest / smallest failing (x) micro-batch of the default "
              "allocator", "", "time by role (s, the trial processes' wall time; the smoke test runs beside the "
              "frontier rounds):"]
    for r in rows:
        roles = ", ".join(f"{k} {v:.0f}" for k, v in r.get("trial_seconds_by_role", {}).items())
        lines.append(f"  {r['example']:<13} {roles}")
        if r.get("smoke_line"):
            lines.append(f"  {'':<13} {r['smoke_line']}")
        lines.append(f"  {'':<13} loadavg {r['loadavg_start']} -> {r['loadavg_end']}")
    lines += ["", "commands (each with hydra.run.dir=<a temporary directory>):"]
    lines += [f"  {r['example']}: {r['command']}" for r in rows]
    lines += ["", "raw:"] + [json.dumps(r) for r in rows]
    write_results(Path(args.out), "\n".join(lines) + "\n")
    print(Path(args.out).read_text())


if __name__ == "__main__":
    main()
