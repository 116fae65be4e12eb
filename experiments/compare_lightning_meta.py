"""A Lightning search with its trials' steps on meta against the same search with real CPU steps.

The script is ``examples/lightning_module.py`` (a decoder-only LM: token and position embeddings,
``nn.TransformerEncoderLayer`` blocks under a causal mask, a vocabulary head; AdamW, fp32, random
token sequences made before ``fit``) with oomtune's one added line (``callbacks=[OomtuneCallback()]``).
Both searches are the same ``oomtune search target=cmd`` (the default allocator space,
``search.global_batch``) on the virtual GPU (every memory figure
simulated), once with ``trial.execute=auto`` (the integration runs each trial's steps on the meta
device; the search runs one real CPU step as its smoke test) and once with ``trial.execute=cpu`` (every
trial runs real CPU steps). The file says whether the answers are the same (micro-batch, accumulation,
checkpointing, allocator, confirmed peak reserved, every frontier's predicted and measured batches)
and each search's wall time on this machine (and its load: other processes slow every timing).

What a CPU recording counts beyond a GPU run (and meta): host tensors, among them the example's
token data set (``samples x (seq_len + 1)`` int64, made before ``fit``), counted from the loader's
first index on (oomtune/capture/recorder.py: a storage first seen in an op's output is recorded as
new), and AdamW's host step counters; so the CPU steps' peaks can be a segment higher.

Activation checkpointing is not searched: when the committed results were measured,
``search.space.activation_checkpointing`` with a Lightning script was refused (the command check
accepted only the Hugging Face integration); it now reaches the script (the Lightning callback sets
the module's ``activation_checkpointing`` attribute), and adding the axis here would change what the
committed results compare.

Run: python experiments/compare_lightning_meta.py [--budget 64MiB] [--global-batch 64] [--layers 2]
     [--d-model 64] [--seq-len 64]
Writes experiments/results/compare_lightning_meta.txt (first lines: the command and the commit).
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

os.environ["OOMTUNE_CACHE_DIR"] = "off"
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "experiments"))
from _provenance import header, write_results  # noqa: E402
from oomtune.trial.record import TrialResult  # noqa: E402

RESULTS = REPO / "experiments" / "results" / "compare_lightning_meta.txt"
SCRIPT = "examples/lightning_module.py"
SAMPLES = 512   # the example's token sequences (TinyLM's ``samples``; 256 before drop_last, when the results were measured)
ANSWER_KEYS = ("micro_batch", "grad_accum", "activation_checkpointing", "alloc_conf", "peak_reserved_bytes")


def run_search(args: argparse.Namespace, execute: str, run_dir: Path) -> dict:
    """One ``oomtune search`` of the example; its answer, frontiers, launches and wall time (s)."""
    import yaml

    command = " ".join([sys.executable, SCRIPT, "--layers", str(args.layers), "--d-model", str(args.d_model),
                        "--seq-len", str(args.seq_len)])
    argv = ["search", "target=cmd", f"target.command='{command}'", f"budget={args.budget}", "device=cpu",
            f"search.global_batch={args.global_batch}", "search.batch_size.low=1",
            "trial.warmup_steps=0", "trial.measure_steps=1",
            "trial.confirm_steps=1", "trial.timeout=3600", f"trial.execute={execute}", f"hydra.run.dir={run_dir}"]
    load = round(os.getloadavg()[0], 1)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "oomtune", *argv], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    wall = time.perf_counter() - t0
    row = {"execute": execute, "load_at_start": load, "wall_s": round(wall, 1), "command": "oomtune " + " ".join(argv)}
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {**row, "error": f"exit {proc.returncode}: " + " | ".join(tail)}
    best = yaml.safe_load((run_dir / "best.yaml").read_text())
    b = best["best"]
    executed = _trial_executions(run_dir)
    return {**row, "micro_batch": b["batch_size"], "grad_accum": b["grad_accum"],
            "activation_checkpointing": b.get("activation_checkpointing"), "alloc_conf": b["alloc_conf"],
            "confirmed": b["confirmed"], "peak_reserved_bytes": b["metrics"]["peak_reserved_bytes"],
            "launches": best["study"]["launches"], "frontiers": best.get("frontiers"), "trials_executed": executed}


def _trial_executions(run_dir: Path) -> dict:
    """Where each launch of the search ran its steps (``execution.where`` of its record), by role
    (``trials.json``'s ``record``/``probe``/``confirm``...; ``smoke``: the smoke test), and the meta
    fallbacks' reasons."""
    roles = {}
    if (run_dir / "trials.json").exists():
        roles = {r["number"]: r.get("role", "?") for r in json.loads((run_dir / "trials.json").read_text())}
    counts: dict[str, int] = {}
    fallbacks = []
    for rec in sorted(run_dir.rglob("result.json")):
        name = rec.parent.name
        role = roles.get(int(name.split("-")[1]), "?") if name.startswith("trial-") else name
        execution = TrialResult.read(rec).execution
        key = f"{role} {execution.where or '?'}"
        counts[key] = counts.get(key, 0) + 1
        if execution.fallback:
            fallbacks.append(execution.fallback)
    return {"counts": counts, "meta_fallbacks": fallbacks}


def predicted_per_configuration(r: dict) -> dict:
    """Every configuration's predicted largest micro-batch (each frontier stands for its twins too)."""
    out = {}
    for f in r.get("frontiers") or []:
        for conf in [f["alloc_conf"], *f.get("twins", [])]:
            out[(conf, bool(f.get("activation_checkpointing")))] = f["predicted_max_batch"]
    return out


def measured_frontiers(r: dict) -> dict:
    """The probed configurations' measured largest and failing micro-batches."""
    return {(f["alloc_conf"], bool(f.get("activation_checkpointing"))): (f["measured_max_batch"],
                                                                       f["measured_fail_batch"])
            for f in r.get("frontiers") or [] if f.get("probed")}


def verdict(a: dict, b: dict) -> list[str]:
    """Lines saying which parts of two searches' answers are the same."""
    same = [k for k in ANSWER_KEYS[:-1] if a.get(k) == b.get(k)]
    lines = ["# the answer (micro-batch, accumulation, checkpointing, allocator): " +
             ("the same" if len(same) == len(ANSWER_KEYS) - 1 else
              "differs in " + ", ".join(k for k in ANSWER_KEYS[:-1] if k not in same))]
    pa, pb = a["peak_reserved_bytes"], b["peak_reserved_bytes"]
    lines.append("# its confirmed peak reserved (simulated): " + (
        "the same" if pa == pb else f"{a['execute']} {pa:,} B, {b['execute']} {pb:,} B ({pb - pa:+,} B)"))
    qa, qb = predicted_per_configuration(a), predicted_per_configuration(b)
    diff = sorted(k[0] or "(default)" for k in set(qa) | set(qb) if qa.get(k) != qb.get(k))
    lines.append(f"# every configuration's predicted largest micro-batch ({len(qa)} configurations): " +
                 ("the same" if not diff else "differs for " + ", ".join(diff)))
    ma, mb = measured_frontiers(a), measured_frontiers(b)
    common = sorted(set(ma) & set(mb))
    lines.append("# measured frontiers of the configurations both probed (" + ", ".join(
        c[0] or "(default)" for c in common) + "): " + ("the same" if all(ma[c] == mb[c] for c in common)
                                                         else "differ"))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", default="64MiB")
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    import lightning
    import torch

    head = header()
    notes = [f"# {platform.node()} ({os.cpu_count()} CPUs), load average {os.getloadavg()[0]:.1f} at start (a shared "
             f"machine: wall times are this CPU's under that load); torch {torch.__version__}, lightning "
             f"{lightning.__version__}",
             f"# {SCRIPT}: {args.layers} layers x {args.d_model}, 2 heads, vocabulary 1024, {args.seq_len} tokens, fp32, "
             f"AdamW; goal: global batch {args.global_batch} within {args.budget} (simulated, virtual GPU)",
             f"# the CPU steps' recordings also count the host data set, {SAMPLES} x {args.seq_len + 1} int64 = "
             f"{SAMPLES * (args.seq_len + 1) * 8:,} B made before fit (from the loader's first index on), and AdamW's "
             "host step counters (512 B each): a GPU run (and meta) keeps them off the device"]
    rows = []
    with tempfile.TemporaryDirectory(prefix="oomtune-lightning-") as tmp:
        for execute in ("auto", "cpu"):
            rows.append(run_search(args, execute, Path(tmp) / f"search-{execute}"))
            print(json.dumps(rows[-1]), flush=True)
    ok = [r for r in rows if "error" not in r]
    if len(ok) == 2:
        notes.append("# trial.execute=auto against trial.execute=cpu:")
        notes += verdict(*ok)
    lines = head.rstrip("\n").splitlines() + notes + [""]
    hdr = (f"{'trial.execute':<14} {'micro':>5} {'accum':>5}  {'ckpt':<5} {'allocator':<26} {'peak reserved':>14} "
           f"{'launches':>8} {'wall s':>7} {'load':>5}  steps ran on (role: device)")
    lines += [hdr, "-" * len(hdr)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['execute']:<14} error after {r['wall_s']:.0f} s: {r['error']}")
            continue
        ck = {None: "-", True: "on", False: "off"}[r.get("activation_checkpointing")]
        ran = ", ".join(f"{k} x{v}" for k, v in sorted(r["trials_executed"]["counts"].items()))
        peak = f"{r['peak_reserved_bytes'] / 2**20:.0f} MiB" if r["peak_reserved_bytes"] is not None else "-"
        lines.append(f"{r['execute']:<14} {r['micro_batch']:>5} {r['grad_accum']:>5}  {ck:<5} "
                     f"{(r['alloc_conf'] or '(default)'):<26} {peak:>14} {r['launches']:>8} {r['wall_s']:>7.0f} "
                     f"{r['load_at_start']:>5}  {ran}")
    lines += ["", "raw:"] + [json.dumps(r) for r in rows]
    write_results(Path(args.out), "\n".join(lines) + "\n")
    print(Path(args.out).read_text())


if __name__ == "__main__":
    main()
