"""Benchmark ``oomtune plan`` of LLM-sized workloads: the wall time of the whole command as a
ratio to ``import torch`` measured in the same run, and its map against capturing every batch size.

Usage: ``python experiments/bench_plan_llm.py [--repeat 3] [--old REF] [--no-gpt2]
[--out experiments/results/bench_plan_llm.txt]``

Variants, each a fresh process with an empty stream cache (a new temporary ``OOMTUNE_CACHE_DIR``),
alternating with ``python -c "import torch"`` in every round, so that the machine's load falls on
all of them alike:

* ``gpt2-size``: the issue's command, ``oomtune plan model=transformer model.layers=12
  model.d_model=768 model.heads=12 model.vocab_size=50257 model.seq_len=1024 model.precision=bf16
  model.optimizer=adamw budget=24GiB`` over ``search.batch_size.low=1 search.batch_size.high=128``
  (the 24 configurations of the default space);
* ``gpt2-size, lengths 64..1024``: the same with ``model.seq_len={low:64,high:1024,pad_multiple:64,seed:0}``
  (the map at the worst length, then every configuration's largest batch soaked for 2000 steps of the
  data's lengths: the ``soak`` column, :mod:`oomtune.plan.soak_frontier`);
* ``gpt2 124M entry``: ``target=python target.entry=examples/gpt2_workload.py:make_workload``
  (transformers' ``GPT2LMHeadModel(GPT2Config())``), when transformers is installed;
* once each, the same three capturing every batch size (``derive=False``): their maps must be
  identical; and the code before the LLM-scale plan changes (``--old``) on the first, for the figure it replaced.

Also the capture of one GPT-2-sized training stream (2 steps, batch 4) with the recorder's memo of
meta kernels on and off, in one process (the per-op cost the memo removes).

Goal: the first variant's wall <= 4x ``import torch``, its map identical.
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
from _baseline import ROOT, TIMED_PLAN, child_env, header, old_tree  # noqa: E402
from _provenance import write_results  # noqa: E402

#: main just before the LLM-scale plan changes (derivation in regimes, the memo of every meta kernel).
DEFAULT_OLD = "3c1a7f3"
GPT2_SIZE = ["model=transformer", "model.layers=12", "model.d_model=768", "model.heads=12", "model.vocab_size=50257",
             "model.seq_len=1024", "model.precision=bf16", "model.optimizer=adamw", "budget=24GiB"]
RANGE = ["search.batch_size.low=1", "search.batch_size.high=128"]
VARIANTS = {
    "gpt2-size": GPT2_SIZE + RANGE,
    "gpt2-size, lengths 64..1024": [("model.seq_len={low:64,high:1024,pad_multiple:64,seed:0}"
                                     if o == "model.seq_len=1024" else o) for o in GPT2_SIZE] + RANGE,
    "gpt2 124M entry": ["target=python", "target.entry=examples/gpt2_workload.py:make_workload", "budget=24GiB"]
                       + RANGE,
}


IMPORT_TORCH = "import torch"

MEMO = r"""
import json, time
import oomtune.capture.recorder as R
from oomtune.plan.predictor import capture_training_stream
cfg = {"name": "transformer", "layers": 12, "d_model": 768, "heads": 12, "seq_len": 1024, "vocab_size": 50257,
       "dropout": 0.0, "optimizer": "adamw", "lr": 3e-4, "precision": "bf16", "data": {"source": "synthetic"}}
capture_training_stream(cfg, 3, steps=2)   # warm-up: imports and first calls
out = {}
for memo in (True, False, True, False):
    R.StorageRecorder.__init__.__kwdefaults__["memo"] = memo
    R.capture_stream.__kwdefaults__["memo"] = memo
    t0 = time.perf_counter()
    stream, _ = capture_training_stream(cfg, 4, steps=2)
    out.setdefault(str(memo), []).append(time.perf_counter() - t0)
    out.setdefault("streams", {})[str(memo)] = [len(stream), sum(stream.sizes)]
print(json.dumps(out))
"""

FIELDS = ("process_s", "plan_s", "capture_s", "derive_s", "replay_s", "soak_s")   # soak: under a shape distribution


def _process(tree: Path, code: str, *args: str) -> tuple[float, str]:
    env = child_env(tree)
    env["OOMTUNE_CACHE_DIR"] = tempfile.mkdtemp(prefix="oomtune-bench-cache-")   # empty: a first plan
    try:
        t0 = time.perf_counter()
        # cwd: the tree itself (``python -c`` puts the working directory first on sys.path)
        proc = subprocess.run([sys.executable, "-c", code, *args], env=env, cwd=tree, capture_output=True, text=True)
        wall = time.perf_counter() - t0
    finally:
        shutil.rmtree(env["OOMTUNE_CACHE_DIR"], ignore_errors=True)
    if proc.returncode != 0:
        raise SystemExit(f"failed in {tree}: {args}\n{proc.stderr[-3000:]}")
    return wall, proc.stdout


def run_plan(tree: Path, overrides: list[str], derive: bool = True) -> dict:
    wall, stdout = _process(tree, TIMED_PLAN, "1" if derive else "0", json.dumps(overrides))
    out = json.loads(stdout.strip().splitlines()[-1])
    out["process_s"] = wall
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--old", default=DEFAULT_OLD, help="git ref of the code before the LLM-scale plan changes")
    parser.add_argument("--no-gpt2", action="store_true", help="leave out the transformers GPT-2 entry")
    parser.add_argument("--out", type=Path, default=ROOT / "experiments" / "results" / "bench_plan_llm.txt")
    args = parser.parse_args()
    head = header("bench_plan_llm.py", sys.argv[1:], args.old)   # at the start: refuses a dirty tree, reads the load
    variants = dict(VARIANTS)
    try:
        import transformers  # noqa: F401
    except ImportError:
        args.no_gpt2 = True
    if args.no_gpt2:
        variants.pop("gpt2 124M entry")
    torch_s: list[float] = []
    runs: dict[str, list[dict]] = {k: [] for k in variants}
    for i in range(args.repeat):
        torch_s.append(_process(ROOT, IMPORT_TORCH)[0])
        print(f"round {i + 1}: import torch {torch_s[-1]:.2f} s", flush=True)
        for name, overrides in variants.items():
            runs[name].append(run_plan(ROOT, overrides))
            print(f"  {name}: {runs[name][-1]['process_s']:.2f} s", flush=True)
    torch_s.append(_process(ROOT, IMPORT_TORCH)[0])
    full = {}
    for name, overrides in variants.items():
        full[name] = run_plan(ROOT, overrides, derive=False)
        print(f"{name}, every batch size captured: {full[name]['process_s']:.2f} s", flush=True)
    old = run_plan(old_tree(args.old), variants["gpt2-size"])
    print(f"old ({args.old}): {old['process_s']:.2f} s", flush=True)
    memo = json.loads(_process(ROOT, MEMO)[1].strip().splitlines()[-1])

    t_med = statistics.median(torch_s)
    med = {k: {f: statistics.median(r[f] for r in v) for f in FIELDS} for k, v in runs.items()}
    identical = {k: all(r["configurations"] == full[k]["configurations"] for r in runs[k]) for k in variants}
    lines = list(head)
    lines += [
        f"# oomtune plan of LLM-sized workloads, batch 1..128, budget 24 GiB (virtual GPU, simulated), "
        f"{len(runs['gpt2-size'][0]['configurations'])} allocator configurations; each plan a fresh process with "
        f"an empty stream cache; median of {args.repeat} rounds, each round `python -c \"import torch\"` and the "
        "variants in turn; OMP_NUM_THREADS=1",
        *(f"# {k}: oomtune plan {' '.join(v)}" for k, v in variants.items()), "",
        f"import torch: median {t_med:.2f} s (runs: {', '.join(f'{x:.2f}' for x in torch_s)})", "",
        f"{'variant':<30} {'process':>8} {'x torch':>8} {'plan()':>8} {'capture':>8} {'derive':>8} {'replay':>8} "
        f"{'soak':>8}"
        "  captures derived  map identical to capturing every size",
    ]
    for k in variants:
        r, m = runs[k][0], med[k]
        lines.append(f"{k:<30} {m['process_s']:7.2f}s {m['process_s'] / t_med:7.1f}x "
                     + " ".join(f"{m[f]:7.2f}s" for f in FIELDS[1:])
                     + f"  {r['captures']:>8} {r['derived']:>7}  {'yes' if identical[k] else 'NO'}")
        walls = ", ".join(f"{x['process_s']:.2f}" for x in runs[k])
        lines.append(f"{'':<30} runs: {walls} s")
    lines += ["", "capturing every batch size (derive=False, this code; one run each):"]
    for k in variants:
        f = full[k]
        lines.append(f"{k:<30} {f['process_s']:7.2f}s {f['process_s'] / t_med:7.1f}x   capture {f['capture_s']:.2f} s, "
                     f"{f['captures']} captures")
    lines.append(f"the code before the LLM-scale plan changes ({args.old}), gpt2-size: {old['process_s']:.2f} s "
                 f"({old['process_s'] / t_med:.1f}x import torch; capture {old['capture_s']:.2f} s, "
                 f"{old['captures']} captures); map identical to this code's: "
                 f"{'yes' if old['configurations'] == full['gpt2-size']['configurations'] else 'no'}")
    on, off = statistics.median(memo["True"]), statistics.median(memo["False"])
    lines += ["", f"one GPT-2-sized capture (2 steps, batch 4, in one warm process): {on:.2f} s with the recorder's memo "
              f"of meta kernels, {off:.2f} s without ({off / on:.1f}x; runs {memo['True']} / {memo['False']}); "
              f"the same stream: {'yes' if memo['streams']['True'] == memo['streams']['False'] else 'NO'}",
              "", f"goal: gpt2-size plan <= 4x import torch: {med['gpt2-size']['process_s'] / t_med:.1f}x "
              f"({'met' if med['gpt2-size']['process_s'] <= 4 * t_med else 'missed'}); maps identical: "
              f"{'yes' if all(identical.values()) else 'NO'}",
              "", "table as printed (gpt2-size):", runs["gpt2-size"][0]["table"]]
    text = "\n".join(lines)
    write_results(args.out, text + "\n")
    print(text)
    return 0 if all(identical.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
