"""Capture fidelity: predict real GPU recordings of known workloads from a meta-device capture.

For each recording in tests/data (copied from ../shared/traces) whose workload is known (the traces' README,
"Workload facts"), the
workload is rebuilt (experiments/fidelity_lm.py), captured on ``meta`` with oomtune's recorder (the
recorded step: what exists before recording, lazy optimizer state, what is freed when, cuBLAS
workspaces, CUDA autocast policy), replayed on the virtual GPU under the recorded allocator settings,
and compared with what the GPU recorded:

* peak allocated (live requested bytes, including what was live before recording) and peak reserved
  (segments), bytes and signed error (negative = under-prediction, the costly direction);
* alloc events per phase (forward, loss, backward, optimizer);
* the share of the recorded request sizes the capture reproduces (multiset overlap).

Recorded figures are read from the traces; predicted ones are simulated (virtual GPU).

Usage::

    python experiments/capture_fidelity.py [--traces DIR] [--out experiments/results/capture_fidelity.md]
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _baseline import TRACES  # noqa: E402
from _provenance import header, write_results  # noqa: E402  (the first lines of every results file)
from fidelity_lm import LazyAdamW, OutOfPlaceAdamW, TransformerLM, course_loss, reference_loss  # noqa: E402

from oomtune.alloc.sim import CachingAllocatorSim  # noqa: E402
from oomtune.capture.blas_workspace import (  # noqa: E402
    DEFAULT_WORKSPACE_BYTES,
    HOPPER_WORKSPACE_BYTES,
    BlasWorkspaces,
)
from oomtune.capture.cuda_autocast import emulate_cuda_autocast  # noqa: E402
from oomtune.capture.recorder import StorageRecorder  # noqa: E402

PHASES = ("forward", "loss", "backward", "optimizer")


# -- recorded side -------------------------------------------------------------------------------
def _round_block(size: int) -> int:
    return max(512, -(-size // 512) * 512)


def recorded_phase(entry: dict[str, Any]) -> str:
    """The phase of a recorded alloc, from its Python frames: the optimizer (torch/optim/optimizer.py
    wrapper), the loss (a ``*cross_entropy*`` function), backward (no Python frame: the autograd
    device thread; or ``backward`` in torch/_tensor.py / torch/autograd), else forward."""
    py = [f for f in entry.get("frames", []) if f.get("filename", "").endswith(".py")]
    if not py:
        return "backward"
    names = [(f["name"], f["filename"]) for f in py]
    if any(fn.endswith("optim/optimizer.py") for _, fn in names):
        return "optimizer"
    if any(n == "backward" and ("_tensor.py" in fn or "autograd" in fn) for n, fn in names):
        return "backward"
    if any("cross_entropy" in n for n, _ in names):
        return "loss"
    return "forward"


def recorded_figures(snapshot: dict[str, Any], device: int = 0) -> dict[str, Any]:
    """Figures read from a recording: peak live requested bytes (starting state included: the
    final live requested bytes with the trace undone), peak reserved (starting segments, rebuilt as
    in the memory viewer, plus segment_alloc minus segment_free), allocs per phase, request sizes."""
    from oomtune.trace.initial_state import device_trace, rebuild_initial_state

    trace, final = device_trace(snapshot, device)
    state = rebuild_initial_state(snapshot, device)
    final_live = sum(b.get("requested_size", b["size"]) for s in final for b in s["blocks"]
                     if b["state"] == "active_allocated")
    net = 0
    sizes: list[int] = []
    phases: collections.Counter = collections.Counter()
    for e in trace:
        if e["action"] == "alloc":
            net += e["size"]
            sizes.append(e["size"])
            phases[recorded_phase(e)] += 1
        elif e["action"] == "free_completed":
            net -= e["size"]
    live = final_live - net
    peak_live = live
    reserved = peak_reserved = state.reserved_bytes
    for e in trace:
        a = e["action"]
        if a == "alloc":
            live += e["size"]
            peak_live = max(peak_live, live)
        elif a == "free_completed":
            live -= e["size"]
        elif a in ("segment_alloc", "segment_map"):
            reserved += e["size"]
            peak_reserved = max(peak_reserved, reserved)
        elif a in ("segment_free", "segment_unmap"):
            reserved -= e["size"]
    return {"peak_allocated_bytes": peak_live, "peak_reserved_bytes": peak_reserved,
            "initial_live_bytes": final_live - net, "initial_reserved_bytes": state.reserved_bytes,
            "phases": dict(phases), "sizes": sizes,
            "settings": (snapshot.get("allocator_settings") or {}).get("PYTORCH_CUDA_ALLOC_CONF") or ""}


# -- predicted side ------------------------------------------------------------------------------
class PhaseSink:
    """Keeps the captured events with the phase current at each alloc, and markers."""

    def __init__(self) -> None:
        self.phase = "existing"
        self.events: list[tuple] = []

    def on_alloc(self, key: int, size_bytes: int) -> None:
        self.events.append(("alloc", key, size_bytes, self.phase))

    def on_free(self, key: int) -> None:
        self.events.append(("free", key))

    def mark(self, what: str) -> None:
        self.events.append((what,))


@dataclass
class Workload:
    """A recording's workload as rebuilt: model shape, step, and what exists before recording."""

    trace: str
    model: dict[str, Any]
    batch: int
    context: int
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    optimizer: str                       # "lazy" (state at first step) | "out_of_place" (state exists)
    autocast_dtype: torch.dtype | None   # None: fp32, no autocast
    workspace_bytes: int
    workspaces_existing: tuple[str, ...]
    empty_cache_first: bool = False
    warmup: int = 0                      # steps run (and replayed) before the recorded one
    compile: bool = False                # torch.compile the model (on meta)
    zero_grad: bool = True               # False: gradients accumulate across steps
    notes: list[str] = field(default_factory=list)


_COURSE_27B = dict(vocab=10_000, d_model=2560, layers=32, heads=32, d_ff=10_240, style="course",
                   rope_len=128)
_MEDIUM = dict(vocab=10_000, d_model=1024, layers=24, heads=16, d_ff=4096, style="reference",
               rope_len=640)

WORKLOADS = {
    "lm-ctx128-fullstep": Workload(
        "lm-ctx128-fullstep", _COURSE_27B, 4, 128, course_loss, "lazy", None,
        HOPPER_WORKSPACE_BYTES, ()),
    "lm-ctx128-fullstep-emptycache": Workload(
        "lm-ctx128-fullstep-emptycache", _COURSE_27B, 4, 128, course_loss, "lazy", None,
        HOPPER_WORKSPACE_BYTES, ("forward",), empty_cache_first=True),
    "lm-medium-ctx512-training": Workload(
        "lm-medium-ctx512-training", _MEDIUM, 4, 512, reference_loss, "out_of_place",
        torch.bfloat16, DEFAULT_WORKSPACE_BYTES, ("forward", "backward")),
    # What the capture predicted before CUDA's autocast policy: meta had no autocast, so the step
    # ran in fp32 (the same workload, autocast left out).
    "lm-medium-ctx512-training, autocast ignored (old capture)": Workload(
        "lm-medium-ctx512-training", _MEDIUM, 4, 512, reference_loss, "out_of_place",
        None, DEFAULT_WORKSPACE_BYTES, ("forward", "backward")),
    # What the capture predicted before cuBLAS workspaces were modelled.
    "lm-ctx128-fullstep, no cuBLAS workspaces (old capture)": Workload(
        "lm-ctx128-fullstep", _COURSE_27B, 4, 128, course_loss, "lazy", None, 0, ()),
}
_SMALL = dict(vocab=50_257, d_model=768, layers=12, heads=12, d_ff=3072, style="reference",
              rope_len=64)
WORKLOADS["lm-step-small"] = Workload(
    "lm-step-small", _SMALL, 1, 64, reference_loss, "out_of_place", None, DEFAULT_WORKSPACE_BYTES,
    ("forward", "backward"), warmup=10, compile=True, zero_grad=False)
WORKLOADS["lm-step-small, eager (no torch.compile)"] = Workload(
    "lm-step-small", _SMALL, 1, 64, reference_loss, "out_of_place", None, DEFAULT_WORKSPACE_BYTES,
    ("forward", "backward"), warmup=10, compile=False, zero_grad=False)

#: The recordings compared by default (the "old capture" rows are shown with --with-old).
MAIN = ("lm-ctx128-fullstep", "lm-ctx128-fullstep-emptycache", "lm-medium-ctx512-training",
        "lm-step-small")


def capture(wl: Workload) -> tuple[PhaseSink, float]:
    """Build ``wl`` on meta, record its step; returns the sink and the capture time in seconds."""
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = TransformerLM(**wl.model)
        ids = torch.randint(0, wl.model["vocab"], (wl.batch, wl.context))
        targets = ids if wl.optimizer == "lazy" else torch.randint(0, wl.model["vocab"],
                                                                   (wl.batch, wl.context))
        if wl.optimizer == "lazy":
            opt: torch.optim.Optimizer = LazyAdamW(model.parameters())
        else:
            opt = OutOfPlaceAdamW(model.parameters())
            if not wl.warmup:
                opt.init_state()  # the state earlier (unrecorded, unreplayed) steps left
    sink = PhaseSink()
    ws = BlasWorkspaces(wl.workspace_bytes, wl.workspaces_existing) if wl.workspace_bytes else None
    rec = StorageRecorder(sink, device="meta", blas_workspaces=ws)
    existing = list(model.parameters()) + list(model.buffers()) + [ids, targets]
    for st in opt.state.values():
        existing += [v for v in st.values() if isinstance(v, torch.Tensor)]
    rec.register_existing(existing)
    for _ in range(ws.n_existing if ws else 0):
        rec.add_workspace(ws.size_bytes)

    fwd = torch.compile(model) if wl.compile else model

    def step(recorded: bool = True) -> None:
        if wl.empty_cache_first:
            sink.mark("empty_cache")
        if wl.zero_grad:
            opt.zero_grad(set_to_none=True)
        sink.phase = "forward" if recorded else "warmup"
        # the user's own spelling; emulate_cuda_autocast (below) gives it CUDA's policy on meta
        ctx = torch.autocast("cuda", dtype=wl.autocast_dtype) if wl.autocast_dtype else _null()
        with ctx:
            logits = fwd(ids)
            sink.phase = "loss" if recorded else "warmup"
            loss = wl.loss(logits, targets)
        sink.phase = "backward" if recorded else "warmup"
        loss.backward()
        sink.phase = "optimizer" if recorded else "warmup"
        opt.step()
        sink.phase = "after"

    with emulate_cuda_autocast(), rec:
        for _ in range(wl.warmup):
            step(recorded=False)
        step()
    return sink, time.perf_counter() - t0


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def replay(sink: PhaseSink, settings: str = "") -> dict[str, Any]:
    """Replay the captured events on the virtual GPU (no capacity limit); peaks in bytes."""
    sim = CachingAllocatorSim(settings or None, total_memory_bytes=1 << 40)
    addr: dict[int, int] = {}
    size_of: dict[int, int] = {}
    live = peak_live = 0
    phases: collections.Counter = collections.Counter()
    sizes: list[int] = []
    for ev in sink.events:
        if ev[0] == "alloc":
            _, key, size, phase = ev
            addr[key] = sim.malloc(size)
            size_of[key] = size
            live += size
            peak_live = max(peak_live, live)
            if phase not in ("existing", "warmup"):
                phases[phase] += 1
                sizes.append(size)
        elif ev[0] == "free":
            sim.free(addr.pop(ev[1]))
            live -= size_of.pop(ev[1])
        elif ev[0] == "empty_cache":
            sim.empty_cache()
    stats = sim.memory_stats()
    return {"peak_allocated_bytes": peak_live, "peak_reserved_bytes": stats["reserved_bytes.all.peak"],
            "phases": dict(phases), "sizes": sizes}


def overlap(recorded: list[int], captured: list[int]) -> float:
    """Share of the recorded requests whose size the capture also requests (multiset overlap)."""
    rc, cc = collections.Counter(recorded), collections.Counter(captured)
    return sum(min(n, cc[s]) for s, n in rc.items()) / max(1, len(recorded))


def compare(name: str, traces: Path) -> dict[str, Any]:
    """Recorded vs predicted figures for one recording."""
    from oomtune.trace.snapshot import load_snapshot

    wl = WORKLOADS[name]
    rec = recorded_figures(load_snapshot(traces / f"{wl.trace}.pickle"))
    sink, seconds = capture(wl)
    pred = replay(sink, rec["settings"])
    out = {"name": name, "recorded": rec, "predicted": pred, "capture_s": seconds,
           "overlap": overlap(rec["sizes"], pred["sizes"])}
    for k in ("peak_allocated_bytes", "peak_reserved_bytes"):
        out[k.replace("_bytes", "_err")] = (pred[k] - rec[k]) / rec[k]
    return out


def _fmt(n: int) -> str:
    return f"{n:,}"


def render(rows: list[dict[str, Any]], head: str) -> str:
    """The results file: ``head`` (experiments/_provenance.py's header), then the table."""
    lines = [*head.splitlines(), "",
             "Recorded = read from the GPU recording (tests/data, from ../shared/traces); predicted = captured on the "
             "meta device by oomtune and replayed on the virtual GPU (simulated). Errors are "
             "(predicted - recorded) / recorded: negative = under-prediction.", "",
             "| recording | peak allocated recorded | predicted | err | peak reserved recorded | "
             "predicted | err | request-size overlap | capture s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rec, pred = r["recorded"], r["predicted"]
        lines.append(
            f"| {r['name']} | {_fmt(rec['peak_allocated_bytes'])} | {_fmt(pred['peak_allocated_bytes'])}"
            f" | {r['peak_allocated_err']:+.2%} | {_fmt(rec['peak_reserved_bytes'])} | "
            f"{_fmt(pred['peak_reserved_bytes'])} | {r['peak_reserved_err']:+.2%} | "
            f"{r['overlap']:.1%} | {r['capture_s']:.1f} |")
    lines += ["", "Alloc events per phase, recorded / predicted:", "",
              "| recording | " + " | ".join(PHASES) + " | total |", "|---|---|---|---|---|---|"]
    for r in rows:
        rp, pp = r["recorded"]["phases"], r["predicted"]["phases"]
        cells = [f"{rp.get(p, 0)} / {pp.get(p, 0)}" for p in PHASES]
        cells.append(f"{sum(rp.values())} / {sum(pp.values())}")
        lines.append(f"| {r['name']} | " + " | ".join(cells) + " |")
    return "\n".join(lines + ["", NOTES]) + "\n"


NOTES = """Where the capture and the recordings differ (read from the traces' frames):

* Loss: the GPU's large reductions (max and sum over the 10,000-wide vocabulary) allocate staging
  buffers and 16-byte semaphores inside the kernel (164,626,432 and 41,156,608 bytes in
  lm-ctx128-fullstep, freed at once); a meta capture cannot see them (4 of the 5 missing loss
  requests). Their segments stay cached, part of the remaining reserved gap.
* Backward (ctx128): the GPU recording has no layout copy of the weight gradients, the capture has
  one per einsum weight (AccumulateGrad's ``clone_obey_contract``: the installed torch's einsum
  returns the weight gradient transposed; the recording's torch 2.6 did not). 65 reduction staging
  buffers of 10,485,760 bytes (RMSNorm weight gradients) are recorded and not captured.
* lm-step-small: torch.compile on meta runs, but the stream it gives equals the eager one (forward
  and backward request counts of the uncompiled graph, vs the fused graph's 270 and 328 recorded);
  the 10 warm-up steps are captured and replayed too, since the recorded peak reserved is the cache
  those steps left.
* Workloads are rebuilt from the facts; where the README does not say (the medium optimizer's
  expressions, RoPE table lengths) the code follows what the traces show (request counts per line).
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", type=Path, default=TRACES)
    ap.add_argument("--out", type=Path, default=ROOT / "experiments" / "results" / "capture_fidelity.md")
    ap.add_argument("--only", nargs="*", default=list(MAIN), choices=list(WORKLOADS))
    ap.add_argument("--with-old", action="store_true",
                    help="also the rows of the capture before this work (no autocast policy, no workspaces)")
    args = ap.parse_args(argv)
    head = header(argv=None if argv is None else [__file__, *argv])   # at the start: refuses a dirty tree
    names = list(args.only) + ([n for n in WORKLOADS if n not in MAIN] if args.with_old else [])
    rows = [compare(n, args.traces) for n in names]
    text = render(rows, head)
    write_results(args.out, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
