"""Validate the virtual GPU (snapshot replay) and the meta-device predictor on a real CUDA device.

For each allocator setting, a FRESH child process (the allocator reads PYTORCH_CUDA_ALLOC_CONF /
PYTORCH_ALLOC_CONF once, at CUDA init) trains torchvision ResNet-50 (random weights, synthetic data,
batch 64, 224x224, SGD momentum 0.9, ``--steps`` steps) with ``torch.cuda.memory._record_memory_history``
on from process start, dumps the snapshot (``torch.cuda.memory._dump_snapshot``) and records
``max_memory_reserved``/``max_memory_allocated`` and the snapshot's ``allocator_settings``. The parent
then replays each snapshot with :func:`oomtune.trace.replay_snapshot` under the same settings, and
predicts the same training with the meta-device capture used by ``oomtune plan``
(:func:`oomtune.plan.predictor.capture_training_stream` + :func:`oomtune.alloc.stream.replay_stream`).

Cases: defaults, expandable_segments, max_split_size_mb:128, roundup_power2_divisions:4,
garbage_collection_threshold:0.8 under a memory fraction (gc acts only with a fraction set; the
fraction is chosen so that the allowed memory is 1.15x the default case's measured peak reserved,
so the threshold 0.8 * allowed lies below that peak and gc really runs), and the defaults again with
recording started after the first step (a late recording: replay rebuilds the starting state).

``replay_snapshot`` takes no memory fraction (only ``total_memory_bytes``), so the fraction case is
replayed with :func:`replay_case`, which makes the replay's simulator call
``set_per_process_memory_fraction`` (``DeviceCachingAllocator::setMemoryFraction``: allowed =
fraction * cudaMemGetInfo total) right after it is built.

Goal (replay): median |error| <= 2 % and no under-prediction worse than 5 % of the measured peak
reserved; printed as PASS/FAIL. A case that produced no data makes the verdict FAIL (incomplete).
Where a recording from process start still gets a non-empty rebuilt starting state (replay.py's
rebuild does not undo segment_map/segment_unmap, so expandable segments look pre-existing), the
same trace is also replayed from an empty allocator and the goal uses that figure; both are shown.
Snapshots go to <results>/gpu_validate_snapshots/ (not copied anywhere).

Run on a GPU machine (about 2-3 minutes on an H200)::

    PYTHONPATH=$PWD python experiments/gpu_validate.py

Dry run on CPU (``--device cpu``): a tiny ResNet-18; the parent captures its training stream on meta
once (the same deterministic stream every child would capture: a torchvision import and a capture
each) and each child runs it through the simulator under its own settings, which writes a snapshot in
torch's format. The "device" is then the simulator itself, so this checks the plumbing (env,
children, replay, table), not accuracy.
Writes experiments/results/gpu_validate.md and .json (or ``--out-dir``).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))  # experiments/_provenance.py
from _provenance import provenance  # noqa: E402  (command + commit of every results file)
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "experiments" / "results"
ALLOC_ENV_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
GPU_MODEL = {"name": "resnet", "depth": 50, "image_size": 224, "num_classes": 1000, "optimizer": "sgd",
             "precision": "fp32", "data": {"source": "synthetic"}}
GPU_BATCH = 64
CPU_MODEL = {"name": "resnet", "depth": 18, "image_size": 32, "num_classes": 10, "optimizer": "sgd",
             "precision": "fp32", "data": {"source": "synthetic"}}
CPU_BATCH = 4
DRY_RUN_CAPACITY_BYTES = 16 << 30   # the dry run's simulated device
MAX_ENTRIES = 2_000_000             # trace ring buffer: ResNet-50 writes ~4k entries per step
GC_HEADROOM = 1.15                  # allowed memory = this x the default case's peak reserved
MEDIAN_GOAL_PCT, UNDER_GOAL_PCT = 2.0, 5.0
_MiB = 1 << 20
#: (summary key, row column): the goal verdict is on ``goal`` (the replay from an empty start where
#: the rebuild wrongly found a starting state, else replay_snapshot's own figure).
SUMMARIES = (("goal", "goal_error_pct"), ("replay", "replay_error_pct"), ("predictor", "predicted_error_pct"))
SUMMARY_TITLES = {"goal": "GOAL (replay accuracy: median |err| <= 2 %, under-prediction <= 5 %)",
                  "replay": "replay_snapshot as `oomtune simulate` runs it (initial-state rebuild)",
                  "predictor": "Meta-device prediction (`oomtune plan`), same thresholds for reference"}


@dataclass(frozen=True)
class Case:
    """One child run: ``conf`` (PYTORCH_CUDA_ALLOC_CONF), ``gc_fraction`` (set a memory fraction),
    ``record_late`` (start recording after the first step)."""

    name: str
    conf: str
    gc_fraction: bool = False
    record_late: bool = False


CASES = (
    Case("default", ""),
    Case("expandable_segments", "expandable_segments:True"),
    Case("max_split_size_mb_128", "max_split_size_mb:128"),
    Case("roundup_power2_divisions_4", "roundup_power2_divisions:4"),
    Case("gc_threshold_0.8_fraction", "garbage_collection_threshold:0.8", gc_fraction=True),
    Case("default_late_recording", "", record_late=True),
)


# ---------------------------------------------------------------- pure helpers (unit-tested on CPU)

def child_env(conf: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """The child's environment: ``base`` (default os.environ) with BOTH allocator variables set to
    ``conf`` (torch reads whichever it checks first; pytorch#183387) and the repo on PYTHONPATH."""
    env = dict(os.environ if base is None else base)
    for name in ALLOC_ENV_VARS:
        env[name] = conf
    paths = [str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def gc_fraction(default_peak_reserved_bytes: int | None, total_memory_bytes: int,
                headroom: float = GC_HEADROOM) -> float:
    """Memory fraction making the allowed maximum ``headroom`` x the default peak reserved, so that
    ``garbage_collection_threshold`` 0.8 (of allowed) is below that peak and gc acts. Capped at 0.5;
    0.5 when the default peak is unknown (gc then likely never acts: stated in the row's notes)."""
    if not default_peak_reserved_bytes or total_memory_bytes <= 0:
        return 0.5
    return min(0.5, headroom * default_peak_reserved_bytes / total_memory_bytes)


def error_pct(simulated: int | None, measured: int | None) -> float | None:
    """(simulated - measured) / measured in percent; negative = under-prediction. None if missing."""
    if simulated is None or not measured:
        return None
    return 100.0 * (simulated - measured) / measured


def summarize(errors: list[float | None], *, median_goal: float = MEDIAN_GOAL_PCT,
              under_goal: float = UNDER_GOAL_PCT) -> dict[str, Any]:
    """Median |error|, worst under-prediction (percent, >= 0) and the verdict against the goal.

    ``errors``: one per case, None where the case produced no figure. The verdict is ``PASS`` only
    when every case has a figure, median |error| <= ``median_goal`` and no error < -``under_goal``.
    """
    have = [e for e in errors if e is not None]
    missing = len(errors) - len(have)
    out: dict[str, Any] = {"cases": len(errors), "with_data": len(have), "missing": missing,
                           "median_abs_error_pct": None, "worst_under_prediction_pct": None,
                           "max_abs_error_pct": None, "median_goal_pct": median_goal,
                           "under_goal_pct": under_goal}
    if not have:
        out.update(verdict="FAIL", reason="no case produced a figure")
        return out
    med = statistics.median(abs(e) for e in have)
    under = max(0.0, -min(have))
    out.update(median_abs_error_pct=med, worst_under_prediction_pct=under,
               max_abs_error_pct=max(abs(e) for e in have))
    reasons = []
    if med > median_goal:
        reasons.append(f"median |error| {med:.2f}% > {median_goal}%")
    if under > under_goal:
        reasons.append(f"worst under-prediction {under:.2f}% > {under_goal}%")
    if missing:
        reasons.append(f"incomplete: {missing} case(s) without a figure")
    out.update(verdict="FAIL" if reasons else "PASS", reason="; ".join(reasons) or "goal met")
    return out


def settings_match(conf: str, torch_conf: str | None, allocator_settings: dict | None) -> tuple[bool, str]:
    """Did the child's allocator take ``conf``? Compares torch's parsed string and, when the
    snapshot carries ``allocator_settings`` (torch/csrc/cuda/Module.cpp ``_cuda_memorySnapshot``),
    the keys this experiment sets (max_split_size in bytes, divisions as {"1": d, ...})."""
    from oomtune.alloc.settings import AllocatorSettings

    problems = []
    if torch_conf is not None and torch_conf != conf:
        problems.append(f"torch parsed {torch_conf!r}")
    if allocator_settings:
        want = AllocatorSettings.parse(conf)
        seen = allocator_settings
        if "expandable_segments" in seen and bool(seen["expandable_segments"]) != want.expandable_segments:
            problems.append(f"expandable_segments={seen['expandable_segments']}")
        if want.max_split_size_bytes is not None and seen.get("max_split_size", want.max_split_size_bytes) \
                % 2**64 != want.max_split_size_bytes:
            problems.append(f"max_split_size={seen.get('max_split_size')}")
        gc = seen.get("garbage_collection_threshold")
        if gc is not None and abs(float(gc) - want.garbage_collection_threshold) > 1e-9:
            problems.append(f"garbage_collection_threshold={gc}")
        div = seen.get("roundup_power2_divisions")
        if isinstance(div, dict) and any(want.roundup_power2_divisions) and \
                sorted(set(int(v) for v in div.values())) != sorted(set(want.roundup_power2_divisions)):
            problems.append(f"roundup_power2_divisions={div}")
    return (not problems, "; ".join(problems) or "ok")


def replay_case(snapshot: dict, conf: str, *, total_memory_bytes: int | None, fraction: float | None) -> Any:
    """``replay_snapshot`` under ``conf`` on a device of ``total_memory_bytes``, with the child's
    memory fraction applied to the simulator when ``fraction`` is not None. Returns SnapshotReplay."""
    from oomtune.trace import replay_snapshot

    return replay_snapshot(snapshot, conf, total_memory_bytes=total_memory_bytes, memory_fraction=fraction)


def synthetic_snapshot(stream: Any, conf: str, *, total_memory_bytes: int, memory_fraction: float = 1.0,
                       drop_first: int = 0) -> tuple[dict[str, Any], dict[str, int]]:
    """A snapshot in torch's format (``_snapshot()``) made by running ``stream`` through the simulator:
    segment events before the ``alloc`` they serve (as ``DeviceCachingAllocator::malloc`` records
    them), ``free_requested`` + ``free_completed`` per free (one stream), requested sizes. The first
    ``drop_first`` trace entries are dropped, as a late ``_record_memory_history`` would. Returns
    (snapshot, the simulator's memory_stats). A simulated OOM ends the trace with an ``oom`` entry."""
    from oomtune.alloc.oom_message import SimulatedOutOfMemoryError
    from oomtune.alloc.sim import CachingAllocatorSim

    sim = CachingAllocatorSim(conf, total_memory_bytes=total_memory_bytes, memory_fraction=memory_fraction,
                              record_segment_events=True)
    trace: list[dict[str, Any]] = []
    addr_of: dict[int, int] = {}
    for action, key, size, st in zip(stream.actions, stream.keys, stream.sizes, stream.streams):
        if action == 0:
            seen = len(sim.segment_events)
            try:
                addr = sim.malloc(size, st)
            except SimulatedOutOfMemoryError:
                trace.append({"action": "oom", "addr": 0, "size": size, "stream": st})
                break
            trace += [{"action": ev["action"], "addr": ev["addr"], "size": ev["size"], "stream": st}
                      for ev in sim.segment_events[seen:]]
            trace.append({"action": "alloc", "addr": addr, "size": size, "stream": st})
            addr_of[key] = addr
        elif key in addr_of:
            addr = addr_of.pop(key)
            trace += [{"action": a, "addr": addr, "size": size, "stream": st}
                      for a in ("free_requested", "free_completed")]
            sim.free(addr)
    snapshot = {"segments": sim.memory_snapshot(), "device_traces": [trace[drop_first:]],
                "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": conf}}
    return snapshot, sim.memory_stats()


# ---------------------------------------------------------------- child process

def _torch_conf() -> str | None:
    import torch

    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    return getter() if getter is not None else None


def _start_recording(torch: Any) -> None:
    try:  # no stack frames: smaller, faster snapshots (context None is documented as allowed)
        torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, context=None, stacks="python")
    except (TypeError, ValueError, RuntimeError):
        torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES)


def _child_cuda(args: argparse.Namespace, rec: dict[str, Any], snap_path: Path) -> None:
    """Train on CUDA with recording on; fills ``rec`` and dumps the snapshot."""
    import torch

    from oomtune.workloads import build_workload

    # CUDA init allocates nothing through the caching allocator, so recording right after it still
    # holds the full history (torch's _record_memory_history also lazily initialises CUDA itself).
    torch.cuda.init()
    if not args.record_late:
        _start_recording(torch)
    dev = torch.device("cuda", 0)
    rec["torch_alloc_conf"] = _torch_conf()
    free, total = torch.cuda.mem_get_info(dev)
    rec.update(total_memory_bytes=total, free_at_start_bytes=free, device_name=torch.cuda.get_device_name(dev),
               properties_total_memory_bytes=torch.cuda.get_device_properties(dev).total_memory)
    if args.fraction is not None:
        torch.cuda.set_per_process_memory_fraction(args.fraction, dev)
    torch.manual_seed(0)
    wl = build_workload(json.loads(args.model), args.batch, dev)
    batches = wl.batches()
    try:
        for i in range(args.steps):
            if args.record_late and i == 1:
                _start_recording(torch)
            wl.step(next(batches))
            torch.cuda.synchronize(dev)
            rec["steps_done"] = i + 1
    except torch.cuda.OutOfMemoryError as exc:
        rec["device_oom"] = str(exc).splitlines()[0][:300]
    stats = torch.cuda.memory_stats(dev)
    rec.update(max_memory_reserved_bytes=torch.cuda.max_memory_reserved(dev),
               max_memory_allocated_bytes=torch.cuda.max_memory_allocated(dev),
               num_alloc_retries=stats.get("num_alloc_retries"), num_device_alloc=stats.get("num_device_alloc"),
               num_device_free=stats.get("num_device_free"))
    snap = torch.cuda.memory._snapshot()
    rec["allocator_settings"] = snap.get("allocator_settings")
    rec["trace_entries"] = len(snap["device_traces"][0]) if snap.get("device_traces") else 0
    torch.cuda.memory._dump_snapshot(str(snap_path))
    if not rec["trace_entries"]:
        rec["error"] = "the snapshot holds no trace entries: _record_memory_history did not record"


def _child_cpu(args: argparse.Namespace, rec: dict[str, Any], snap_path: Path) -> None:
    """Dry run: the training stream captured on meta (by the parent, ``--stream``; else here), run
    through the simulator as the 'device'."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    rec["torch_alloc_conf"] = _torch_conf()
    if args.stream:
        from oomtune.alloc.stream import AllocationStream

        stream = AllocationStream.load(args.stream)
    else:
        from oomtune.plan.predictor import capture_training_stream

        stream, _ = capture_training_stream(json.loads(args.model), args.batch, steps=args.steps)
    total = DRY_RUN_CAPACITY_BYTES
    probe, _ = synthetic_snapshot(stream, conf, total_memory_bytes=total,
                                  memory_fraction=1.0 if args.fraction is None else args.fraction)
    drop = len(probe["device_traces"][0]) // 2 if args.record_late else 0
    snap, stats = synthetic_snapshot(stream, conf, total_memory_bytes=total, drop_first=drop,
                                     memory_fraction=1.0 if args.fraction is None else args.fraction)
    rec.update(total_memory_bytes=total, device_name="virtual GPU (dry run)", steps_done=args.steps,
               max_memory_reserved_bytes=stats["reserved_bytes.all.peak"],
               max_memory_allocated_bytes=stats["allocated_bytes.all.peak"],
               num_alloc_retries=stats["num_alloc_retries"], allocator_settings=snap["allocator_settings"],
               trace_entries=len(snap["device_traces"][0]))
    if any(e["action"] == "oom" for e in snap["device_traces"][0]):
        rec["device_oom"] = "simulated OOM"
    snap_path.write_bytes(pickle.dumps(snap))


def child_main(args: argparse.Namespace) -> int:
    """``--child``: one case in this (fresh) process; writes ``<out>/<name>.json`` and the snapshot."""
    out = Path(args.out_dir)
    snap_path = out / f"{args.name}.pickle"
    rec: dict[str, Any] = {"name": args.name, "conf": args.conf, "fraction": args.fraction,
                           "record_late": args.record_late, "device_oom": None, "steps_done": 0,
                           "env": {n: os.environ.get(n) for n in ALLOC_ENV_VARS}}
    t0 = time.perf_counter()
    try:
        import torch

        rec["torch_version"] = torch.__version__
        (_child_cuda if args.device == "cuda" else _child_cpu)(args, rec, snap_path)
        if "error" not in rec:
            rec["snapshot"] = str(snap_path)
    except Exception as exc:  # the parent reports it in the table
        rec["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
    rec["seconds"] = time.perf_counter() - t0
    (out / f"{args.name}.json").write_text(json.dumps(rec, indent=1, default=str))
    return 0


# ---------------------------------------------------------------- parent

def run_child(case: Case, args: argparse.Namespace, fraction: float | None, out: Path) -> dict[str, Any]:
    """Launch one case in a fresh interpreter and return its record (``error`` set on failure)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--name", case.name, "--conf", case.conf,
           "--device", args.device, "--out-dir", str(out), "--model", args.model, "--batch", str(args.batch),
           "--steps", str(args.steps)]
    if fraction is not None:
        cmd += ["--fraction", repr(fraction)]
    if case.record_late:
        cmd.append("--record-late")
    if args.device == "cpu" and args.stream:
        cmd += ["--stream", args.stream]
    rec_path = out / f"{case.name}.json"
    rec_path.unlink(missing_ok=True)
    try:
        proc = subprocess.run(cmd, env=child_env(case.conf), capture_output=True, text=True,
                              timeout=args.child_timeout, cwd=REPO)
    except subprocess.TimeoutExpired:
        return {"name": case.name, "conf": case.conf, "error": f"child timed out after {args.child_timeout:.0f} s"}
    if not rec_path.is_file():
        tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-3:]
        return {"name": case.name, "conf": case.conf, "error": f"child exited {proc.returncode}: {' | '.join(tail)}"}
    return json.loads(rec_path.read_text())


def build_row(case: Case, rec: dict[str, Any], replay: Any, predicted: Any) -> dict[str, Any]:
    """One table row (bytes, seconds, percent) from the child's record, the replay and the prediction."""
    ok, detail = settings_match(case.conf, rec.get("torch_alloc_conf"), rec.get("allocator_settings"))
    env_ok = all(v == case.conf for v in (rec.get("env") or {}).values()) if rec.get("env") else None
    measured = rec.get("max_memory_reserved_bytes")
    row: dict[str, Any] = {
        "case": case.name, "conf": case.conf, "fraction": rec.get("fraction"), "record_late": case.record_late,
        "measured_peak_reserved_bytes": measured,
        "measured_peak_allocated_bytes": rec.get("max_memory_allocated_bytes"),
        "device_oom": rec.get("device_oom"),
        "settings_took_effect": None if env_ok is None and rec.get("torch_alloc_conf") is None
        else ok and env_ok is not False,
        "settings_detail": detail, "allocator_settings": rec.get("allocator_settings"),
        "trace_entries": rec.get("trace_entries"), "child_seconds": rec.get("seconds"),
        "error": rec.get("error"), "notes": [],
    }
    if replay is not None:
        row.update(
            simulated_peak_reserved_bytes=replay.peak_reserved_bytes,
            simulated_peak_allocated_bytes=replay.peak_allocated_bytes,
            replay_error_pct=error_pct(replay.peak_reserved_bytes, measured),
            trace_peak_reserved_bytes=replay.recorded_peak_reserved_bytes,
            recorded_segment_allocs=len(replay.recorded_segment_allocs),
            simulated_segment_allocs=len(replay.simulated_segment_allocs),
            recorded_segment_frees=replay.recorded_segment_frees,
            simulated_segment_frees=replay.simulated_segment_frees,
            first_divergence=replay.first_divergence, initial_state_exact=replay.initial_state_exact,
            initial_reserved_bytes=replay.initial_reserved_bytes, replay_seconds=replay.replay_seconds,
            simulated_oom=replay.oom, simulated_retries=replay.num_alloc_retries)
        row["notes"] += list(replay.notes)
    if predicted is not None:
        row.update(predicted_peak_reserved_bytes=predicted.peak_reserved_bytes,
                   predicted_error_pct=error_pct(predicted.peak_reserved_bytes, measured),
                   predicted_oom=predicted.oom)
    if case.gc_fraction and rec.get("fraction") is not None and not rec.get("gc_fraction_from_default"):
        row["notes"].append("fraction not derived from the default case's peak: gc may never act")
    return row


def _mib(v: Any) -> str:
    return "-" if v is None else f"{v / _MiB:,.1f}"


def _pct(v: Any) -> str:
    return "-" if v is None else f"{v:+.2f}"


def markdown(rows: list[dict[str, Any]], summary: dict[str, Any], header: dict[str, Any]) -> str:
    """The results as a markdown document (MiB for display; device = measured, simulated = replay)."""
    lines = [f"# gpu_validate: virtual GPU vs {header.get('device_name')}", "",
             f"torch {header.get('torch_version')}, model {header['model']}, batch {header['batch']}, "
             f"{header['steps']} steps, device total {_mib(header.get('total_memory_bytes'))} MiB", "",
             "| case | PYTORCH_CUDA_ALLOC_CONF | fraction | peak reserved MiB (device) | replay MiB (simulated) "
             "| replay err % | from empty MiB (err %) | trace peak MiB | seg allocs rec/sim | first div. | init exact | replay s "
             "| meta-predicted MiB (simulated) | pred. err % | settings ok | notes |",
             "|" + "---|" * 16]
    for r in rows:
        notes = "; ".join(([r["error"]] if r.get("error") else []) + r.get("notes", []))
        if r.get("device_oom"):
            notes = f"device OOM: {r['device_oom'][:80]}; " + notes
        frac = "-" if r.get("fraction") is None else f"{r['fraction']:.4f}"
        segs = "-" if r.get("recorded_segment_allocs") is None else \
            f"{r['recorded_segment_allocs']}/{r['simulated_segment_allocs']}"
        lines.append(
            f"| {r['case']} | `{r['conf'] or '(defaults)'}` | {frac} | {_mib(r.get('measured_peak_reserved_bytes'))} "
            f"| {_mib(r.get('simulated_peak_reserved_bytes'))} | {_pct(r.get('replay_error_pct'))} "
            f"| {_from_empty(r)} "
            f"| {_mib(r.get('trace_peak_reserved_bytes'))} | {segs} | {r.get('first_divergence', '-')} "
            f"| {r.get('initial_state_exact', '-')} | {_fmt_s(r.get('replay_seconds'))} "
            f"| {_mib(r.get('predicted_peak_reserved_bytes'))} | {_pct(r.get('predicted_error_pct'))} "
            f"| {r.get('settings_took_effect')} | {notes} |")
    for key, _ in SUMMARIES:
        s, title = summary[key], SUMMARY_TITLES[key]
        lines += ["", f"**{title}**: {s['verdict']} ({s['reason']}); median |error| "
                  f"{_pct(s['median_abs_error_pct'])} %, worst under-prediction {_pct(s['worst_under_prediction_pct'])} %, "
                  f"max |error| {_pct(s['max_abs_error_pct'])} % over {s['with_data']}/{s['cases']} cases "
                  f"(goal: median <= {s['median_goal_pct']} %, under-prediction <= {s['under_goal_pct']} %)."]
    return "\n".join(lines) + "\n"


def _from_empty(r: dict[str, Any]) -> str:
    v = r.get("replay_from_empty_peak_reserved_bytes")
    return "-" if v is None else f"{_mib(v)} ({_pct(r.get('replay_from_empty_error_pct'))})"


def _fmt_s(v: Any) -> str:
    return "-" if v is None else f"{v:.2f}"


def _predict(args: argparse.Namespace) -> tuple[Any, str | None]:
    """The meta-device training stream (``oomtune plan``'s), captured once for all cases."""
    from oomtune.plan.predictor import capture_training_stream

    try:
        stream, reason = capture_training_stream(json.loads(args.model), args.batch)
        return stream, reason
    except Exception as exc:
        return None, f"capture failed: {type(exc).__name__}: {exc}"


def _evaluate(case: Case, rec: dict[str, Any], stream: Any) -> dict[str, Any]:
    """Replay + prediction for one finished child; errors become row notes, never exceptions."""
    from oomtune.alloc.stream import replay_stream
    from oomtune.trace import load_snapshot

    replay = predicted = snap = None
    problems = []
    total, fraction = rec.get("total_memory_bytes"), rec.get("fraction")
    if rec.get("snapshot") and not rec.get("error"):
        try:
            snap = load_snapshot(rec["snapshot"])
            replay = replay_case(snap, case.conf, total_memory_bytes=total, fraction=fraction)
        except Exception as exc:
            problems.append(f"replay failed: {type(exc).__name__}: {exc}")
    if stream is not None and total:
        try:
            predicted = replay_stream(stream, case.conf, total_memory_bytes=total,
                                      memory_fraction=1.0 if fraction is None else fraction)
        except Exception as exc:
            problems.append(f"prediction failed: {type(exc).__name__}: {exc}")
    row = build_row(case, rec, replay, predicted)
    row["notes"] += problems
    row["goal_error_pct"] = row.get("replay_error_pct")
    if replay is not None and not case.record_late and replay.initial_reserved_bytes > 0:
        _replay_from_empty(row, case, snap, total, fraction)
    return row


def _replay_from_empty(row: dict[str, Any], case: Case, snap: dict, total: int | None,
                       fraction: float | None) -> None:
    """A recording from process start has nothing before its first entry, yet the rebuild found a
    starting state (replay.py's ``_starting_segments`` undoes segment_alloc/segment_free only, not
    segment_map/segment_unmap, so expandable segments mapped during the trace count as pre-existing).
    Replays the same trace from an empty allocator (``segments`` cleared) and uses that figure for
    the goal, since the other one starts from the final state."""
    try:
        empty = replay_case({**snap, "segments": []}, case.conf, total_memory_bytes=total, fraction=fraction)
    except Exception as exc:
        row["notes"].append(f"replay from empty failed: {type(exc).__name__}: {exc}")
        return
    row["replay_from_empty_peak_reserved_bytes"] = empty.peak_reserved_bytes
    row["replay_from_empty_error_pct"] = error_pct(empty.peak_reserved_bytes, row["measured_peak_reserved_bytes"])
    row["replay_from_empty_segment_allocs"] = len(empty.simulated_segment_allocs)
    row["goal_error_pct"] = row["replay_from_empty_error_pct"]
    row["notes"].append(
        f"recorded from process start, yet the rebuilt starting state holds "
        f"{_mib(row.get('initial_reserved_bytes'))} MiB (segment_map not undone by the rebuild); from an "
        f"empty start: {_mib(empty.peak_reserved_bytes)} MiB ({_pct(row['replay_from_empty_error_pct'])} %), "
        f"{len(empty.simulated_segment_allocs)} simulated segment events; the goal uses this figure")


def _dry_run_stream(args: argparse.Namespace, out: Path) -> str | None:
    """The CPU dry run's training stream of ``--steps`` steps, captured on meta once and saved for the
    children (``--stream``); None when the capture fails (each child then captures and reports)."""
    from oomtune.plan.predictor import capture_training_stream

    try:
        stream, _ = capture_training_stream(json.loads(args.model), args.batch, steps=args.steps)
        path = out / "dry_run_stream.bin"
        stream.save(path)
        return str(path)
    except Exception:
        return None


def run_all(args: argparse.Namespace, out: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every selected case (defaults first: its peak sets the gc case's fraction); rows + header."""
    t_start = time.perf_counter()
    cases = [c for c in CASES if not args.cases or c.name in args.cases]
    stream, capture_note = _predict(args)
    if args.device == "cpu":
        args.stream = _dry_run_stream(args, out)
    header: dict[str, Any] = {"model": json.loads(args.model), "batch": args.batch, "steps": args.steps,
                              "device": args.device, "capture_note": capture_note}
    rows, default_peak = [], None
    for case in cases:
        left = args.budget_s - (time.perf_counter() - t_start)
        if left < args.child_timeout * 0.5:
            rows.append(build_row(case, {"name": case.name, "conf": case.conf,
                                         "error": f"skipped: {left:.0f} s left of the time budget"}, None, None))
            continue
        fraction = None
        if case.gc_fraction:
            fraction = gc_fraction(default_peak, header.get("total_memory_bytes") or 0)
        rec = run_child(case, args, fraction, out)
        rec["gc_fraction_from_default"] = bool(case.gc_fraction and default_peak)
        if case.name == "default" and not rec.get("error"):
            default_peak = rec.get("max_memory_reserved_bytes")
        for key in ("total_memory_bytes", "device_name", "torch_version"):
            if header.get(key) is None and rec.get(key) is not None:
                header[key] = rec[key]
        row = _evaluate(case, rec, stream)
        rows.append(row)
        print(f"  {case.name:30} measured {_mib(row.get('measured_peak_reserved_bytes'))} MiB, replay "
              f"{_mib(row.get('simulated_peak_reserved_bytes'))} MiB ({_pct(row.get('replay_error_pct'))} %), "
              f"predicted {_mib(row.get('predicted_peak_reserved_bytes'))} MiB "
              f"({_pct(row.get('predicted_error_pct'))} %) {row.get('error') or ''}", flush=True)
    header["seconds"] = time.perf_counter() - t_start
    return rows, header


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda: the real validation; cpu: dry run on the simulator (tiny ResNet-18)")
    p.add_argument("--cases", type=lambda s: [c for c in s.split(",") if c], default=None,
                   help=f"comma-separated subset of: {', '.join(c.name for c in CASES)}")
    p.add_argument("--out-dir", default=None, help="results directory (default experiments/results)")
    p.add_argument("--model", default=None, help="model config as JSON (default per device)")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--budget-s", type=float, default=270.0, help="wall budget for all cases")
    p.add_argument("--child-timeout", type=float, default=90.0, help="per-case child limit, seconds")
    # child-only arguments
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--name", help=argparse.SUPPRESS)
    p.add_argument("--conf", default="", help=argparse.SUPPRESS)
    p.add_argument("--fraction", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--record-late", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--stream", default=None, help=argparse.SUPPRESS)   # the CPU dry run's saved stream
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the validation; returns 0 when every case produced data (the verdict is printed), else 1."""
    args = _parser().parse_args(argv)
    gpu = args.device == "cuda"
    args.model = args.model or json.dumps(GPU_MODEL if gpu else CPU_MODEL)
    args.batch = args.batch or (GPU_BATCH if gpu else CPU_BATCH)
    results = Path(args.out_dir).resolve() if args.out_dir else RESULTS
    snaps = results / "gpu_validate_snapshots"
    if args.child:
        return child_main(args)
    unknown = set(args.cases or ()) - {c.name for c in CASES}
    if unknown:
        print(f"gpu_validate: unknown case(s) {sorted(unknown)}", file=sys.stderr)
        return 2
    prov = provenance(None if argv is None else [__file__, *argv])   # before measuring: refuses a dirty tree
    snaps.mkdir(parents=True, exist_ok=True)
    print(f"gpu_validate: device={args.device} batch={args.batch} steps={args.steps}", flush=True)
    rows, header = run_all(args, snaps)
    summary = {key: summarize([r.get(col) for r in rows]) for key, col in SUMMARIES}
    doc = {**prov, "header": header, "summary": summary, "rows": rows}
    (results / "gpu_validate.json").write_text(json.dumps(doc, indent=1, default=str))
    head = "".join(f"# {k}: {v}\n" for k, v in prov.items())   # experiments/_provenance.py's header
    (results / "gpu_validate.md").write_text(head + markdown(rows, summary, header))
    for key, _ in SUMMARIES:
        s = summary[key]
        print(f"gpu_validate {key}: {s['verdict']} ({s['reason']}); median |error| "
              f"{_pct(s['median_abs_error_pct'])} %, worst under-prediction {_pct(s['worst_under_prediction_pct'])} %")
    return 0 if all(r.get("error") is None for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
