"""oomtune against the Hugging Face Trainer's ``auto_find_batch_size`` on one Trainer script, on the
virtual GPU (every memory figure simulated).

The script is ``examples/hf_trainer.py``: a GPT-2-shaped model built from its config (no weights),
random token sequences, AdamW, fp32, with oomtune's one added line (``callbacks=[OomtuneCallback()]``).
The goal: a global batch of ``--global-batch`` sequences of ``--seq-len`` tokens within ``--budget``.

- **The Trainer's auto_find_batch_size** (its documented use: ``per_device_train_batch_size`` = the
  batch wanted, ``gradient_accumulation_steps=1``, ``auto_find_batch_size=True``; on each
  out-of-memory it retries with a smaller per-device batch (accelerate's ``find_executable_batch_size``:
  0.9x), keeping the accumulation, so the global batch it trains shrinks with it). The same script runs in its own process with a virtual GPU (torch's default
  allocator, a device of ``virtual_device_memory`` with the budget as a memory fraction, as oomtune's
  trials) recording every CPU storage of the run; the simulated out-of-memory error is a
  ``torch.OutOfMemoryError`` reading "CUDA out of memory", which accelerate's
  ``should_reduce_batch_size`` (the Trainer's) recognises; ``torch.cuda.empty_cache`` and accelerate's
  ``clear_device_cache`` are routed to the virtual GPU's ``empty_cache`` (as in
  experiments/compare_peers.py). Tries: the per-device batches ``_inner_training_loop`` was called with.
  Its answer is then run as an oomtune trial in a fresh process (the clean run).
- **oomtune**: ``oomtune search target=cmd`` of the same script with ``search.global_batch``,
  ``search.space.activation_checkpointing=[false,true]`` and the default allocator space
  (mode ``full``); or, when a search's trials are too slow for this CPU (mode ``predict``),
  only what the search does before its first probe: the recordings (the default allocator at the
  smallest micro-batches, two micro-batches per step, with and without activation checkpointing, as
  trials in fresh processes) and every configuration's predicted frontier from them (simulated,
  not confirmed by a trial: said so in the file).

Soak: the sequences are all ``--seq-len`` long, so every step makes the same requests; the soak of
variable shapes does not apply (and oomtune does not soak commands).

Size: the issue asks for GPT-2 124M at a budget of 8 GiB. On the 2-core machine this runs on, the
virtual GPU's trials compute every step on the CPU for real: the Trainer's finder alone ran over 35
minutes there without finishing (a step of GPT-2 124M at sequence 512 and micro-batch 6 is about
2.3 TFLOP), so the committed run uses the ``small`` preset: GPT-2's vocabulary, positions and block
structure (GPT2Config) with 2 layers of width 128, at a budget of 1 GiB, where the token embedding and
the language-model head (50257 x 128) and the logits (50257 per token) dominate memory as in GPT-2.
``--runs gpt2:8GiB:full`` runs the issue's size where time allows.

Trials' steps: with ``--execute auto`` (the default) the integration runs each trial's steps on the
meta device and the search runs one real CPU step as its smoke test; ``--execute cpu`` runs every
trial's steps on the CPU for real (the behaviour before meta steps); ``--execute auto,cpu`` runs the
search both ways and says whether their answers (micro-batch, accumulation, checkpointing, allocator,
confirmed peak reserved, every frontier's predicted and measured batch) are the same.

Run: python experiments/compare_hf.py [--runs small:1GiB:full] [--parts peer,oomtune] [--execute auto|cpu|auto,cpu]
Writes experiments/results/compare_hf.txt (first lines: the command and the commit).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import runpy
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ["OOMTUNE_CACHE_DIR"] = "off"
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "experiments"))
from _provenance import header, write_results  # noqa: E402

RESULTS = REPO / "experiments" / "results" / "compare_hf.txt"
SCRIPT = "examples/hf_trainer.py"
PRESETS = {   # model sizes: GPT-2 124M, and a GPT-2-shaped one small enough for this CPU
    "gpt2": {"layers": 12, "d_model": 768, "heads": 12, "vocab": 50257},
    "small": {"layers": 2, "d_model": 128, "heads": 2, "vocab": 50257},
    "tiny": {"layers": 2, "d_model": 64, "heads": 2, "vocab": 1024},   # a smoke test of this script
}


def script_args(model: dict, seq_len: int) -> list[str]:
    return [SCRIPT, "--layers", str(model["layers"]), "--d-model", str(model["d_model"]), "--heads",
            str(model["heads"]), "--vocab", str(model["vocab"]), "--seq-len", str(seq_len)]


# ------------------------------------------------------------------ the Trainer's own finder, in its process
def peer_child(argv: list[str], budget: str) -> None:
    """Run the script with ``auto_find_batch_size`` on a virtual GPU; print one JSON line."""
    import torch

    from oomtune.alloc.settings import AllocatorSettings
    from oomtune.capture.virtual_gpu import VirtualGPU, budgeted_sim
    from oomtune.units import parse_size

    sim = budgeted_sim(AllocatorSettings.parse(""), parse_size(budget), parse_size("80GiB"))
    torch.cuda.empty_cache = sim.empty_cache
    import accelerate.utils.memory as acc_memory

    acc_memory.is_cuda_available = lambda: True   # clear_device_cache: gc.collect(), then empty_cache
    from accelerate.utils.memory import should_reduce_batch_size

    try:
        sim.malloc(parse_size(budget) + (1 << 20))
    except torch.OutOfMemoryError as exc:
        assert should_reduce_batch_size(exc), "the Trainer would not recognise the simulated OOM"
    import transformers

    tries: list[int] = []
    real_loop = transformers.Trainer._inner_training_loop

    def loop(self, batch_size=None, *a, **kw):   # noqa: ANN001, ANN202
        tries.append(int(batch_size))
        return real_loop(self, batch_size, *a, **kw)

    transformers.Trainer._inner_training_loop = loop
    sys.argv = argv
    t0 = time.perf_counter()
    with VirtualGPU(sim, device="cpu"):
        runpy.run_path(argv[0], run_name="__main__")
    print(json.dumps({"tries": tries, "found": tries[-1] if tries else None, "wall_s": time.perf_counter() - t0,
                      "sim_peak_reserved_bytes": sim.memory_stats()["reserved_bytes.all.peak"]}))


def run_peer(model: dict, seq_len: int, global_batch: int, budget: str) -> dict:
    argv = [*script_args(model, seq_len), "--batch-size", str(global_batch), "--grad-accum", "1", "--steps", "1",
            "--samples", str(2 * global_batch), "--auto-find-batch-size"]
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--peer-child", "--budget", budget, "--", *argv],
                          capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        return {"tool": "transformers auto_find_batch_size", "error": [_exit_words(proc.returncode, proc.stderr)],
                "wall_s": wall, "host_peak_rss_bytes": _children_peak_rss()}
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"tool": "transformers auto_find_batch_size", "micro_batch": out["found"], "grad_accum": 1,
            "trained_global_batch": out["found"], "tried": out["tries"], "tries": len(out["tries"]),
            "wall_s": wall, "command": " ".join(argv), "host_peak_rss_bytes": _children_peak_rss()}


def _exit_words(returncode: int, stderr: str) -> str:
    """Why a process failed, in one line: its signal (SIGKILL: on this shared machine, the host's
    out-of-memory killer) or its last error line."""
    import signal

    if returncode < 0:
        name = signal.Signals(-returncode).name
        return f"killed by {name}" + (" (the host ran out of memory: the kernel's OOM killer)" if name == "SIGKILL" else "")
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip() and "Warning" not in ln and not ln.startswith(" ")]
    return f"exit status {returncode}: {lines[-1] if lines else '?'}"


def _children_peak_rss() -> int:
    """The largest resident set of any child process waited for so far, in bytes (Linux: KiB units)."""
    import resource

    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024


def clean_run(model: dict, seq_len: int, micro: int, accum: int, alloc_conf: str, budget: str | None, work: Path,
              ckpt: bool | None = None, steps: int = 1) -> dict:
    """The answer as an oomtune trial in a fresh process under the same budget (the callback sets
    the micro-batch and accumulation); ``budget`` None: an unbounded virtual GPU (a recording)."""
    from oomtune.device import resolve_budget, resolve_device
    from oomtune.study.records import MemoryLimit
    from oomtune.targets.cmd import run_cmd_trial
    from oomtune.trial.record import TrialSpec

    device = resolve_device("cpu", virtual_device_memory="80GiB")
    budget_bytes = resolve_budget(budget, device) if budget is not None else None
    workload = {"target": {"name": "cmd", "command": [sys.executable, *script_args(model, seq_len)],
                           "cwd": str(REPO)}, "grad_accum": accum}
    if ckpt is not None:
        workload["activation_checkpointing"] = ckpt
    spec = TrialSpec(workload=workload, batch_size=micro, alloc_conf=alloc_conf, device="cpu",
                     budget_bytes=budget_bytes, warmup_steps=0, measure_steps=steps, timeout_s=24 * 3600,
                     device_memory_bytes=device.total_memory_bytes)
    t0 = time.perf_counter()
    res = run_cmd_trial(spec, workdir=work, env={"PYTHONPATH": str(REPO)})
    limit = MemoryLimit(budget_bytes, 0.05).limit_bytes if budget_bytes is not None else None
    peak = res.memory.peak_reserved_bytes
    return {"outcome": res.outcome.value, "steps": steps, "peak_reserved_bytes": peak,
            "within_headroom": limit is None or peak is not None and peak <= limit,
            "message": res.message, "wall_s": time.perf_counter() - t0}


# ------------------------------------------------------------------ oomtune
def run_oomtune_search(model: dict, seq_len: int, global_batch: int, budget: str, run_dir: Path,
                       execute: str = "auto") -> dict:
    import yaml

    command = " ".join([sys.executable, *script_args(model, seq_len)])
    argv = ["search", "target=cmd", f"target.command='{command}'", f"budget={budget}", "device=cpu",
            f"search.global_batch={global_batch}", "search.batch_size.low=1",
            "+search.space.activation_checkpointing=[false,true]", "trial.warmup_steps=0", "trial.measure_steps=1",
            "trial.confirm_steps=1", "trial.timeout=86400", f"trial.execute={execute}", f"hydra.run.dir={run_dir}"]
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "oomtune", *argv], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    wall = time.perf_counter() - t0
    (run_dir.parent / "oomtune-search.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        return {"tool": "oomtune", "error": [_exit_words(proc.returncode, proc.stderr or proc.stdout)], "wall_s": wall,
                "host_peak_rss_bytes": _children_peak_rss()}
    best = yaml.safe_load((run_dir / "best.yaml").read_text())
    b = best["best"]
    limit = best["device"]["budget_bytes"] * (1 - best["device"]["headroom"])
    peak = b["metrics"]["peak_reserved_bytes"]
    clean = {"outcome": "ok" if b["confirmed"] else "not confirmed", "steps": 1, "peak_reserved_bytes": peak,
             "within_headroom": peak is not None and peak <= limit, "from": "the search's own clean-process confirmation"}
    return {"tool": "oomtune", "clean": clean, "micro_batch": b["batch_size"], "grad_accum": b["grad_accum"],
            "trained_global_batch": b["batch_size"] * b["grad_accum"], "activation_checkpointing":
            b.get("activation_checkpointing"), "alloc_conf": b["alloc_conf"], "tries": best["study"]["launches"],
            "wall_s": wall, "confirmed": b["confirmed"], "peak_reserved_bytes": b["metrics"]["peak_reserved_bytes"],
            "frontiers": best.get("frontiers"), "command": "oomtune " + " ".join(argv),
            "host_peak_rss_bytes": _children_peak_rss()}


def run_oomtune_predict(model: dict, seq_len: int, global_batch: int, budget: str, work: Path) -> dict:
    """What the search does before its first probe: record the default allocator at the three
    smallest micro-batches (two micro-batches per step; a fourth when the smallest runs other code),
    with and without activation checkpointing, each as a trial in a fresh process; then every
    configuration's predicted frontier from the recordings (the search's own functions)."""
    from oomtune.device import resolve_budget, resolve_device
    from oomtune.plan.predictor import sim_geometry
    from oomtune.plan.recorded import RecordedPredictor, load_recording
    from oomtune.search.frontier import predicted_frontiers
    from oomtune.study.records import MemoryLimit
    from oomtune.space import SearchSpace

    space = SearchSpace(1, 512, {"expandable_segments": [False, True], "max_split_size_mb": [None, 64, 256],
                                 "roundup_power2_divisions": [None, 4], "garbage_collection_threshold": [None, 0.8],
                                 "activation_checkpointing": [False, True]}, global_batch=global_batch)
    device = resolve_device("cpu", virtual_device_memory="80GiB")
    budget_bytes = resolve_budget(budget, device)
    limit = MemoryLimit(budget_bytes, 0.05).limit_bytes
    anchors = [b for b in space.batch_choices() if space.grad_accum_for(b) > 1][:5]
    t0 = time.perf_counter()
    trials, frontiers = 0, []
    for ckpt in (False, True):
        got: dict[int, object] = {}
        predictor = None
        for i, b in enumerate(anchors):
            res = clean_run(model, seq_len, b, 2, "", None, work / f"record-{ckpt}-{b}", ckpt=ckpt)
            trials += 1
            if res["outcome"] != "ok":
                return {"tool": "oomtune (predicted)", "wall_s": time.perf_counter() - t0,
                        "error": [f"recording micro-batch {b} (checkpointing={ckpt}): {res['outcome']}: "
                                  f"{res['message']}"], "host_peak_rss_bytes": _children_peak_rss()}
            got[b] = load_recording(work / f"record-{ckpt}-{b}" / "stream.bin")[0]
            if len(got) >= 3:
                predictor = RecordedPredictor(got, sim_geometry(device, budget_bytes), steps=1,
                                              covers=lambda x: space.grad_accum_for(x) > 1)
                if predictor.usable:
                    break
        if predictor is None or not predictor.usable:
            return {"tool": "oomtune (predicted)", "error": [f"recordings with checkpointing={ckpt}: "
                                                             f"{getattr(predictor, 'derivation_note', 'too few')}"]}
        configs = [{k: v for k, v in m.items() if k != "activation_checkpointing"}
                   for m in space.all_configs() if m["activation_checkpointing"] == ckpt]
        for c in predicted_frontiers(predictor, configs, 1, 512, limit, choices=space.batch_choices()):
            frontiers.append({"activation_checkpointing": ckpt, "alloc_conf": c.alloc_conf,
                              "predicted_micro_batch": c.predicted, "twins": len(c.twins),
                              "predicted_peak_reserved_bytes": c.predicted_peak_bytes})
    # the search's rule: it probes the default allocator and the configurations predicted above it, so on a
    # tie the default wins, then the fewest keys (checkpointing counts as one), then the lower peak
    ranked = sorted((f for f in frontiers if f["predicted_micro_batch"]),
                    key=lambda f: (-f["predicted_micro_batch"],
                                   bool(f["alloc_conf"]) or f["activation_checkpointing"],
                                   f["alloc_conf"].count(",") + bool(f["alloc_conf"]) + f["activation_checkpointing"],
                                   f["predicted_peak_reserved_bytes"]))
    top = ranked[0] if ranked else None
    out = {"tool": "oomtune (predicted)", "tries": trials, "wall_s": time.perf_counter() - t0,
           "frontiers": frontiers, "recorded_micro_batches": sorted(predictor.recorded),
           "host_peak_rss_bytes": _children_peak_rss()}
    if top is not None:
        out.update(micro_batch=top["predicted_micro_batch"], grad_accum=global_batch // top["predicted_micro_batch"],
                   trained_global_batch=global_batch, activation_checkpointing=top["activation_checkpointing"],
                   alloc_conf=top["alloc_conf"], peak_reserved_bytes=top["predicted_peak_reserved_bytes"])
    return out


# ------------------------------------------------------------------ the file
ANSWER_KEYS = ("micro_batch", "grad_accum", "activation_checkpointing", "alloc_conf", "peak_reserved_bytes")


def same_answer(rows: list[dict]) -> list[str]:
    """One line per (preset, budget) searched with more than one ``trial.execute``: whether the
    searches' answers and frontiers are the same, naming what differs."""
    out = []
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if "execute" in r and "error" not in r:
            groups.setdefault((r["preset"], r["budget"]), []).append(r)
    for (preset, budget), rs in groups.items():
        if len(rs) < 2:
            continue
        a, b = rs[0], rs[1]
        diff = [k for k in ANSWER_KEYS if a.get(k) != b.get(k)]

        def fronts(r: dict) -> list:
            return sorted((f["alloc_conf"], bool(f.get("activation_checkpointing")), f["predicted_max_batch"],
                           f["measured_max_batch"], f["measured_fail_batch"]) for f in r.get("frontiers") or [])
        if fronts(a) != fronts(b):
            diff.append("frontiers (predicted or measured batches)")
        names = f"trial.execute={a['execute']} and trial.execute={b['execute']}"
        out.append(f"# {preset} at {budget}: {names}: " + ("the same answer (micro-batch, accumulation, checkpointing, "
                                                            "allocator, confirmed peak reserved, every frontier)"
                                                            if not diff else "answers differ in " + ", ".join(diff)))
    return out


def user_lines() -> list[str]:
    """The lines each example adds for oomtune (those naming it), per framework."""
    out = []
    for name, path in (("Hugging Face Trainer", "examples/hf_trainer.py"),
                       ("Lightning", "examples/lightning_module.py"), ("plain loop", "examples/global_batch.py")):
        code = [ln.strip() for ln in (REPO / path).read_text().splitlines()
                if not ln.lstrip().startswith(('"', "#")) and (("import" in ln and "oomtune" in ln)
                                                               or "OomtuneCallback()" in ln
                                                               or ln.strip().startswith("for _ in steps("))]
        out.append(f"  {name} ({path}): {len(code)} lines: " + " | ".join(code))
    return out


def write(path: Path, head: str, notes: list[str], rows: list[dict]) -> None:
    lines = head.rstrip("\n").splitlines() + notes + [""]
    hdr = (f"{'model':<6} {'budget':<7} {'tool':<36} {'micro':>5} {'accum':>5} {'global':>6}  {'ckpt':<5} "
           f"{'allocator':<26} {'clean run':<18} {'tries':>5} {'wall s':>7}")
    lines += [hdr, "-" * len(hdr)]
    for r in rows:
        if "error" in r:
            rss = r.get("host_peak_rss_bytes")
            lines.append(f"{r['preset']:<6} {r['budget']:<7} {r['tool']:<36} error after {r['wall_s']:.0f} s: "
                         f"{' '.join(r['error'])}" + ("" if not rss else f" (largest child process: {rss / 2**30:.1f} GiB "
                                                                          "resident)"))
            continue
        c = r.get("clean")
        clean = ("not run" if c is None else c["outcome"] + ("" if c["outcome"] != "ok" else
                                                             (" (in headroom)" if c["within_headroom"] else " (>headroom)")))
        ck = {None: "-", True: "on", False: "off"}[r.get("activation_checkpointing")]
        lines.append(f"{r['preset']:<6} {r['budget']:<7} {r['tool']:<36} {r['micro_batch']:>5} {r['grad_accum']:>5} "
                     f"{r['trained_global_batch']:>6}  {ck:<5} {(r.get('alloc_conf') or '(default)'):<26} "
                     f"{clean:<18} {r['tries']:>5} {r['wall_s']:>7.0f}")
    lines += ["", "raw:"] + [json.dumps(r) for r in rows]
    write_results(path, "\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default="small:1GiB:full",
                    help="comma-separated PRESET:BUDGET:MODE (MODE: full = an oomtune search, predict = its "
                         "recordings and predicted frontiers only)")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--parts", default="peer,oomtune")
    ap.add_argument("--execute", default="auto",
                    help="oomtune's trial.execute, or several comma-separated (auto,cpu: both searches, compared): "
                         "auto (the integration runs the steps on meta, one real CPU step "
                         "as the smoke test) or cpu (every trial runs real CPU steps)")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--budget", default="8GiB", help=argparse.SUPPRESS)   # the peer child's
    ap.add_argument("--peer-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("rest", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.peer_child:
        peer_child(args.rest, args.budget)
        return
    import torch
    import transformers

    runs = [r.split(":") for r in args.runs.split(",")]
    notes = [f"# {platform.node()} ({os.cpu_count()} CPUs), load average {os.getloadavg()[0]:.1f} at start; torch "
             f"{torch.__version__}, transformers {transformers.__version__}",
             *[f"# model {name}: GPT-2-shaped from GPT2Config, {PRESETS[name]['layers']} layers x "
               f"{PRESETS[name]['d_model']}, {PRESETS[name]['heads']} heads, vocabulary {PRESETS[name]['vocab']}"
               for name in dict.fromkeys(r[0] for r in runs)],
             f"# every model: sequences of {args.seq_len} tokens, fp32, AdamW; goal: global batch {args.global_batch}; "
             "memory simulated (virtual GPU on the CPU); wall times are this CPU's",
             "# clean run: the answer as an oomtune trial in a fresh process, 1 optimizer step, same budget; "
             "'ok (in headroom)': its peak reserved within budget x (1 - 5% headroom), the limit oomtune searches "
             "under; '>headroom': it ran, but above that limit; soak: n/a (every sequence is the same length, so "
             "every step makes the same requests)",
             "# tries: the Trainer's: per-device batches its inner training loop was called with; oomtune's: trial "
             "processes launched (recordings, probes, confirmation)",
             "# lines a user adds (the examples):", *[f"#{ln}" for ln in user_lines()]]
    rows: list[dict] = []
    out = Path(args.out)
    head = header()
    with tempfile.TemporaryDirectory(prefix="oomtune-hf-") as tmp:
        for preset, budget, mode in runs:
            model = PRESETS[preset]
            work = Path(tmp) / preset
            work.mkdir()
            if "peer" in args.parts:
                r = run_peer(model, args.seq_len, args.global_batch, budget)
                if "error" not in r:
                    r["clean"] = clean_run(model, args.seq_len, r["micro_batch"], 1, "", budget, work / "peer-clean")
                rows.append({"preset": preset, "budget": budget, "load_at_start": round(os.getloadavg()[0], 1), **r})
                print(json.dumps(rows[-1]), flush=True)
                write(out, head, notes, rows)
            if "oomtune" in args.parts:
                load = round(os.getloadavg()[0], 1)
                if mode == "full":
                    for execute in args.execute.split(","):
                        r = run_oomtune_search(model, args.seq_len, args.global_batch, budget,
                                               work / f"search-{execute}", execute)
                        if "error" not in r:
                            r["tool"] = f"oomtune (trial.execute={execute})"
                        rows.append({"preset": preset, "budget": budget, "load_at_start": load, "execute": execute,
                                     **r})
                        print(json.dumps(rows[-1]), flush=True)
                        write(out, head, notes + same_answer(rows), rows)
                        load = round(os.getloadavg()[0], 1)
                    continue
                else:
                    r = run_oomtune_predict(model, args.seq_len, args.global_batch, budget, work)
                    if "error" not in r:
                        r["clean"] = None   # the predicted answer is not run: see the notes
                rows.append({"preset": preset, "budget": budget, "load_at_start": load, **r})
                print(json.dumps(rows[-1]), flush=True)
                write(out, head, notes, rows)
    print(out.read_text())


if __name__ == "__main__":
    main()
