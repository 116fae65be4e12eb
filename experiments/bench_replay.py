"""Benchmark: how fast the virtual GPU replays: compiled core vs pure Python vs old code, one run.

Measures replayed events per second on one core (process CPU time, best of ``--repeat``) for
  (a) a synthetic ``--events`` stream (seeded; sizes log-uniform 512 B .. 256 MiB, ~600 live),
      under default and expandable_segments:True settings (``replay_stream``);
  (b) every real trace in ``--traces``, twice: "requests" = the trace's allocation requests (alloc /
      free_completed of the replayed device, keyed by address) as an ``AllocationStream`` through
      ``replay_stream`` under the recorded settings on a 1 TiB device (the simulator's own rate);
      "replay_snapshot" = ``oomtune.trace.replay_snapshot`` with its defaults, end to end (the
      trace read, the starting state rebuilt and seeded, releases classified, every request
      replayed, segment events compared: in the compiled core, ``_fastcore.TraceReplay``, for
      "compiled"; in Python for "pure" and "old"), events = the requests replayed (the alloc,
      free_completed and oom entries given to the simulator, ``events_replayed``); below the
      table, the same replay's rate in trace entries read (what shared/traces/README.md counts
      as a trace's events) and the segments of the starting state, seeded before the first
      request (work on top of the requests);
for three codes, each in its own processes, alternating: "compiled" (this checkout with its compiled
core, oomtune.alloc._fastcore, which must be built: ``pip install -e .``), "pure" (this checkout with
OOMTUNE_PURE_PYTHON=1) and "old" (``--old``, default: main before the replay's speed changes). Checks
that all three give byte-identical results (a SHA-256 of every replay's JSON result) and reports the
rate ratios. Target: >= 2 M events/s. All figures are simulated (virtual GPU).

Run: python experiments/bench_replay.py [--old REF] [--events 1000000] [--repeat 3]
     [--traces tests/data] [--out experiments/results/bench_replay.txt]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _baseline import ROOT, TRACES, child_env, header, old_tree, trace_files  # noqa: E402
from _provenance import write_results  # noqa: E402

#: main after the simulator's real-trace fidelity fixes, before the replay's speed changes.
DEFAULT_OLD = "a53bb9e"
CODES = ("compiled", "pure", "old")

# Runs inside the child process (the tree under test is first on sys.path).
CHILD = r"""
import hashlib, json, random, sys, time
from pathlib import Path
from oomtune.alloc.stream import AllocationStream, replay_stream
args = json.loads(sys.argv[1])
if args["need_compiled"]:
    from oomtune.alloc import _compiled
    if not _compiled.enabled():
        sys.exit("the compiled core oomtune.alloc._fastcore is not built in this checkout: run "
                 "pip install -e . (or python setup.py build_ext --inplace) first")

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

def requests(snap):
    from oomtune.trace.initial_state import device_trace
    from oomtune.trace.replay import default_device
    trace, _ = device_trace(snap, default_device(snap))
    stream, live = AllocationStream(), set()
    for e in trace:
        if e["action"] == "alloc" and e["addr"] not in live:
            stream.append_alloc(e["addr"], e["size"], e.get("stream", 0))
            live.add(e["addr"])
        elif e["action"] == "free_completed" and e["addr"] in live:
            stream.append_free(e["addr"], e.get("stream", 0))
            live.discard(e["addr"])
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
from oomtune.trace import load_snapshot, rebuild_initial_state, replay_snapshot
from oomtune.trace.recorded import recorded_settings
for path in args["traces"]:
    snap = load_snapshot(path)
    name = Path(path).name
    stream, settings = requests(snap), recorded_settings(snap)[0]
    secs, r = best_of(lambda: replay_stream(stream, settings, total_memory_bytes=1 << 40), 3 * args["repeat"])
    out[f"{name} requests"] = {"events": len(stream), "seconds": secs, "digest": digest(r.to_dict())}
    try:
        secs, r = best_of(lambda: replay_snapshot(snap), args["repeat"])
    except Exception as exc:
        out[f"{name} replay_snapshot"] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
        continue
    d = r.to_dict()
    d.pop("replay_seconds", None)
    out[f"{name} replay_snapshot"] = {"events": r.events_replayed, "seconds": secs, "digest": digest(d),
                                      "entries": len(snap["device_traces"][r.device]),
                                      "start_segments": len(rebuild_initial_state(snap, r.device).segments)}
print(json.dumps(out))
"""


def run_child(tree: Path, pure: bool, payload: dict) -> dict:
    env = child_env(tree)
    env["OOMTUNE_PURE_PYTHON"] = "1" if pure else "0"
    payload = dict(payload, need_compiled=not pure and tree == ROOT)
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(payload)], env=env, cwd=tree,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"replay benchmark failed in {tree}:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", default=DEFAULT_OLD, help="git ref of the code to compare with")
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--traces", type=Path, default=TRACES)
    ap.add_argument("--out", type=Path, default=ROOT / "experiments" / "results" / "bench_replay.txt")
    args = ap.parse_args()
    head = header("bench_replay.py", sys.argv[1:], args.old)   # at the start: refuses a dirty tree, reads the load
    traces = [str(p.resolve()) for p in trace_files(args.traces, "bench_replay")]
    payload = {"events": args.events, "repeat": args.repeat, "traces": traces}
    runs = {"compiled": (ROOT, False), "pure": (ROOT, True), "old": (old_tree(args.old), True)}
    res: dict[str, dict] = {code: {} for code in CODES}
    for _ in range(2):   # alternate; keep each workload's best
        for code in CODES:
            for work, r in run_child(*runs[code], payload).items():
                prev = res[code].get(work)
                if prev is None or ("seconds" in r and r["seconds"] < prev.get("seconds", float("inf"))):
                    res[code][work] = r
    lines = list(head)
    lines += ["# events/s by process CPU time of one replay (best of --repeat, x3 for the short request "
              "streams, x 2 processes; one core); virtual GPU (simulated); compiled = the C++ core "
              "(oomtune.alloc._fastcore), pure = OOMTUNE_PURE_PYTHON=1, old = --old; identical = the "
              "same SHA-256 of the JSON results for all three", "",
              f"{'workload':<58} {'events':>9} {'compiled':>11} {'pure':>11} {'old':>11} {'c/pure':>7} "
              f"{'c/old':>7}  identical"]
    all_same = True
    rates: dict[str, list[float]] = {"stream": [], "snapshot": [], "entries": []}
    for work, comp in res["compiled"].items():
        pure, old = res["pure"].get(work, {}), res["old"].get(work, {})
        if "error" in comp or "error" in pure or "error" in old:
            lines.append(f"{work:<58} error: compiled {comp.get('error', 'ok')}; pure {pure.get('error', 'ok')}; "
                         f"old {old.get('error', 'ok')}")
            all_same = False
            continue
        rc, rp, ro = (r["events"] / r["seconds"] for r in (comp, pure, old))
        if "entries" in comp:
            rates["snapshot"].append(rc)
            rates["entries"].append(comp["entries"] / comp["seconds"])
        else:
            rates["stream"].append(rc)
        same = comp["digest"] == pure["digest"] == old["digest"]
        all_same &= same
        lines.append(f"{work:<58} {comp['events']:>9,} {rc:>11,.0f} {rp:>11,.0f} {ro:>11,.0f} {rc / rp:>6.1f}x "
                     f"{rc / ro:>6.1f}x  {'yes' if same else 'NO'}")
    lines += ["", "replay_snapshot rows, compiled: trace entries read (the unit shared/traces/README.md counts "
              "as events), the rate in entries/s, and the segments of the starting state seeded before the "
              "first event:"]
    lines += [f"  {work.split()[0]}: {r['entries']:,} entries, {r['entries'] / r['seconds']:,.0f} entries/s, "
              f"{r['start_segments']:,} starting segments"
              for work, r in res["compiled"].items() if "start_segments" in r]

    def span(v: list[float]) -> str:
        return f"{min(v) / 1e6:.2f}-{max(v) / 1e6:.2f} M" if v else "n/a"

    lines += ["", "target >= 2,000,000 events/s, compiled: the simulator on streams (synthetic and the traces' "
              f"requests) {span(rates['stream'])} events/s; replay_snapshot end to end {span(rates['snapshot'])} "
              f"requests replayed/s, {span(rates['entries'])} trace entries/s",
              f"results byte-identical (compiled, pure, old): {'yes' if all_same else 'NO'}"]
    text = "\n".join(lines) + "\n"
    write_results(args.out, text)
    print(text)
    return 0 if all_same else 1


if __name__ == "__main__":
    sys.exit(main())
