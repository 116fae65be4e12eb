"""Benchmark: how fast the virtual GPU (CachingAllocatorSim) replays, old code vs new, one run.

Measures replayed events per second on one core (process CPU time, best of ``--repeat``) for
  (a) a synthetic ``--events`` stream (seeded; sizes log-uniform 512 B .. 256 MiB, ~600 live),
      under default and expandable_segments:True settings (``replay_stream``);
  (b) every real trace in ``--traces`` (``oomtune.trace.replay_snapshot`` with its defaults: the
      recorded settings, the starting state rebuilt; events = trace entries replayed);
for the new code (this checkout) and the old code (``--old``, default: main before issue 13's
replay changes), each in its own process, alternating; checks that both give byte-identical
results (a SHA-256 of every replay's JSON result) and reports the ratio new/old of the rates.
Target (issue 13): >= 2 M events/s. All figures are simulated (virtual GPU).

Run: python experiments/bench_replay.py [--old REF] [--events 1000000] [--repeat 3]
     [--traces ../shared/traces] [--out experiments/results/bench_replay.txt]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _baseline import ROOT, child_env, header, old_tree  # noqa: E402

#: main after issue 11's simulator fixes, before issue 13's replay changes.
DEFAULT_OLD = "a53bb9e"

# Runs inside the child process (the tree under test is first on sys.path).
CHILD = r"""
import hashlib, json, random, sys, time
from pathlib import Path
from oomtune.alloc.stream import AllocationStream, replay_stream
args = json.loads(sys.argv[1])

def synthetic(n_events, seed=0, live_target=600):
    rng = random.Random(seed)
    stream, live, key = AllocationStream(), [], 0
    while len(stream) < n_events:
        if live and (len(live) > live_target or rng.random() < 0.5 * len(live) / live_target):
            stream.append_free(live.pop(rng.randrange(len(live))))
        else:
            key += 1
            stream.append_alloc(key, int(2 ** rng.uniform(9, 28)), 0)
            live.append(key)
    return stream

def digest(obj):
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]

def best_of(fn, repeat):
    best, result = float("inf"), None
    for _ in range(repeat):
        c0 = time.process_time()
        result = fn()
        best = min(best, time.process_time() - c0)
    return best, result

out = {}
big = synthetic(args["events"])
for conf in (None, "expandable_segments:True"):
    secs, r = best_of(lambda: replay_stream(big, conf, total_memory_bytes=80 << 30), args["repeat"])
    out[f"synthetic {len(big):,} events, {conf or 'default'}"] = {
        "events": len(big), "seconds": secs, "digest": digest(r.to_dict())}
from oomtune.trace import load_snapshot, replay_snapshot
for path in args["traces"]:
    snap = load_snapshot(path)
    try:
        secs, r = best_of(lambda: replay_snapshot(snap), args["repeat"])
    except Exception as exc:
        out[Path(path).name] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
        continue
    d = r.to_dict()
    d.pop("replay_seconds", None)
    out[Path(path).name] = {"events": r.events_replayed, "seconds": secs, "digest": digest(d)}
print(json.dumps(out))
"""


def run_child(tree: Path, payload: dict) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(payload)], env=child_env(tree),
                          cwd=tree, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"replay benchmark failed in {tree}:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", default=DEFAULT_OLD, help="git ref of the code to compare with")
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--traces", type=Path, default=ROOT.parent / "shared" / "traces")
    ap.add_argument("--out", type=Path, default=ROOT / "experiments" / "results" / "bench_replay.txt")
    args = ap.parse_args()
    payload = {"events": args.events, "repeat": args.repeat,
               "traces": [str(p.resolve()) for p in sorted(args.traces.glob("*.pickle"))]}
    trees = {"new": ROOT, "old": old_tree(args.old)}
    res: dict[str, dict] = {"new": {}, "old": {}}
    for name in ("old", "new", "old", "new"):   # alternate; keep each workload's best
        for work, r in run_child(trees[name], payload).items():
            prev = res[name].get(work)
            if prev is None or ("seconds" in r and r["seconds"] < prev.get("seconds", float("inf"))):
                res[name][work] = r
    lines = header("bench_replay.py", sys.argv[1:], args.old)
    lines += ["# events/s by process CPU time of one replay (best of --repeat x 2 processes; one core); "
              "virtual GPU (simulated); byte-identical = same SHA-256 of the JSON results", "",
              f"{'workload':<58} {'events':>9} {'new ev/s':>11} {'old ev/s':>11} {'new/old':>8}  identical"]
    all_same = True
    for work, new in res["new"].items():
        old = res["old"].get(work, {})
        if "error" in new or "error" in old:
            lines.append(f"{work:<58} error: new {new.get('error', 'ok')}; old {old.get('error', 'ok')}")
            continue
        rn, ro = new["events"] / new["seconds"], old["events"] / old["seconds"]
        same = new["digest"] == old["digest"]
        all_same &= same
        lines.append(f"{work:<58} {new['events']:>9,} {rn:>11,.0f} {ro:>11,.0f} {rn / ro:>7.2f}x  "
                     f"{'yes' if same else 'NO'}")
    lines += ["", f"target >= 2,000,000 events/s; results byte-identical to old: {'yes' if all_same else 'NO'}"]
    text = "\n".join(lines) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0 if all_same else 1


if __name__ == "__main__":
    sys.exit(main())
