"""Distributed trials: one rank's memory under DDP and FSDP2, and what running ranks costs.

Part 1, simulated (the virtual GPU): a GPT-2-shaped built-in transformer (d_model 768, 12 heads,
context 1024, vocabulary 50304, untied head, AdamW, fp32; ``--layers`` blocks: 12 in GPT-2, fewer
here by default because every capture runs the step's arithmetic on this CPU, see below). For DDP
and FSDP2 at 2 and 4 ranks, rank 0's training steps are captured as ``oomtune plan`` captures them
(torch's fake process group, world size N, the real DDP/FSDP2 code; on the CPU, since both need
materialised parameters) and replayed on the virtual GPU under torch's default allocator:

- the memory held between steps (the stream's live allocations after the last step, requested
  bytes): parameters, AdamW's two states and its step counters, DDP's gradient buckets; beside it
  the analytical expectation from the parameter shapes: full for DDP, FSDP2's padded shard
  ``ceil(dim0 / N) x rest`` of every parameter for rank 0 (the largest shard);
- peak allocated and peak reserved at batch 1, beside the analytical expectation: the states, the
  gradients (full for DDP; FSDP2: the sharded gradients plus the unsharded parameters and gradients
  of the largest FSDP unit in use and its reduce-scatter input) and the activations of the same step
  without data parallelism (a meta capture of ``model.parallel=none``: its peak allocated minus its
  parameters, gradients and optimizer states);
- the largest batch per rank whose replay fits 8 GiB (no headroom): streams captured at batch 2, 3,
  4 fit an affine model of every request's size (:class:`oomtune.plan.derive.AffineStreamModel`;
  batch 1 takes other kernel paths),
  larger batches are derived from it and replayed under the 8 GiB memory fraction, and the answer is
  checked against a real capture at that batch (event by event).

Part 2, measured on this CPU (gloo): the cost of a 2-rank trial over a 1-rank trial. Real trials
through :class:`oomtune.trial.runner.TrialRunner` (fork server) of the built-in transformer of the
README (4 layers, d_model 256, context 256, vocabulary 8192, AdamW), batch 8 per rank,
``model.parallel=ddp`` with 1 and 2 ranks, and without parallelism for reference, alternated
``--trials`` times: launch to first step (start-up) and the mean measured step (the slowest
rank's). On this 2-core machine two ranks share the cores (one torch thread each).

Usage: ``python experiments/bench_distributed.py [--layers 2] [--trials 4] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # experiments/_provenance.py
from _provenance import header, write_results  # noqa: E402

import torch  # noqa: E402

from oomtune.alloc.geometry import budget_geometry  # noqa: E402
from oomtune.alloc.settings import AllocatorSettings  # noqa: E402
from oomtune.alloc.stream import replay_stream  # noqa: E402
from oomtune.plan.derive import AffineStreamModel  # noqa: E402
from oomtune.plan.predictor import capture_training_stream  # noqa: E402
from oomtune.units import GiB, MiB  # noqa: E402

GPT2 = {"name": "transformer", "d_model": 768, "heads": 12, "seq_len": 1024, "vocab_size": 50304, "dropout": 0.0,
        "optimizer": "adamw", "lr": 3e-4, "precision": "fp32", "data": {"source": "synthetic"},
        "target": {"name": "builtin"}}
README_LM = {"name": "transformer", "layers": 4, "d_model": 256, "heads": 4, "seq_len": 256, "vocab_size": 8192,
             "dropout": 0.0, "optimizer": "adamw", "lr": 3e-4, "precision": "fp32", "data": {"source": "synthetic"}}
BUDGET = 8 * GiB
DEVICE = 80 * GiB
STEPS = 2            # optimizer states created, then the steady step
CONFIGS = [("ddp", 2), ("fsdp", 2), ("ddp", 4), ("fsdp", 4)]


def _gib(n: float | None) -> str:
    return "-" if n is None else f"{n / GiB:.3f}"


def _round512(n: int) -> int:
    return -(-n // 512) * 512


def _shapes(layers: int) -> list[tuple[int, ...]]:
    from oomtune.workloads.models import build_model

    spec = build_model({**GPT2, "layers": layers}, torch.device("meta"))
    return [tuple(p.shape) for p in spec.module.parameters()]


def _shard_numel(shape: tuple[int, ...], n: int) -> int:
    """Rank 0's shard of a parameter under FSDP2 (dim-0 chunks of ceil(dim0 / n) rows)."""
    if n == 1:
        return math.prod(shape)
    return -(-shape[0] // n) * math.prod(shape[1:])


def analytic(shapes: list[tuple[int, ...]], mode: str, n: int, units: list[int]) -> dict[str, int]:
    """Bytes of rank 0 between steps and the step's own extras, from the parameter shapes (fp32)."""
    full = sum(4 * math.prod(s) for s in shapes)
    steps = 4 * len(shapes)                       # AdamW's float32 step counter per parameter
    if mode == "none":
        return {"states": 3 * full + steps, "grads": full, "buffers": 0}
    if mode == "ddp":                             # + its buckets: a flat copy of every gradient
        return {"states": 4 * full + steps, "grads": full, "buffers": 0}
    shard = sum(4 * _shard_numel(s, n) for s in shapes)
    largest = max(units)                          # unsharded parameters + gradients + RS input of one unit
    return {"states": 3 * shard + steps, "grads": shard, "buffers": 3 * largest}


def _units(layers: int) -> list[int]:
    """Bytes of every FSDP2 unit's parameters: each layer, and the root (embeddings, final norm, head)."""
    from oomtune.workloads.models import build_model

    module = build_model({**GPT2, "layers": layers}, torch.device("meta")).module
    per_layer = [sum(4 * p.numel() for p in layer.parameters()) for layer in module.blocks.layers]
    root = sum(4 * p.numel() for p in module.parameters()) - sum(per_layer)
    return per_layer + [root]


def _capture(cfg: dict, batch: int) -> tuple[object, float]:
    t0 = time.perf_counter()
    stream, _ = capture_training_stream(cfg, batch, steps=STEPS)
    return stream, time.perf_counter() - t0


def _replay(stream: object, budget: int | None) -> object:
    if budget is None:
        return replay_stream(stream, AllocatorSettings.parse(""), total_memory_bytes=DEVICE)
    return replay_stream(stream, AllocatorSettings.parse(""), **budget_geometry(budget, DEVICE))


def _largest_batch(cfg: dict, captured: dict[int, object], say) -> tuple[int, str]:
    """The largest batch whose replay fits the budget (8 GiB), and how it was found (see the module docstring);
    a checked capture is added to ``captured``."""
    fits = {b: not _replay(s, BUDGET).oom for b, s in captured.items()}
    if not all(fits.values()):
        ok = [b for b in sorted(fits) if fits[b]]
        return (ok[-1] if ok else 0), "captured"
    # batch 1 makes other requests (kernels pick other paths for a single sample): fitted from 2 on
    model = AffineStreamModel.fit({b: s for b, s in captured.items() if b >= 2})
    b = max(captured)
    if model is None:   # capture upwards
        while fits[b]:
            b += 1
            captured[b], _ = _capture(cfg, b)
            fits[b] = not _replay(captured[b], BUDGET).oom
        return b - 1, "captured at every batch (no affine fit)"
    wide = dataclasses.replace(model, high=1 << 20)   # extrapolated, checked below

    def fit(batch: int) -> bool:
        if batch not in fits:
            fits[batch] = not _replay(wide.derive(batch), BUDGET).oom
        return fits[batch]

    low, high = b, 2 * b
    while fit(high):                 # doubling, then bisection: fits at low, not at high
        low, high = high, 2 * high
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fit(mid) else (low, mid)
    best = low
    check, seconds = _capture(cfg, best)
    say(f"    check capture at batch {best}: {seconds:.0f} s")
    captured[best] = check
    if check == wide.derive(best):
        return best, (f"derived from the captures at 2-4 (each request affine in the batch), checked: the capture "
                      f"at {best} equals the derived stream; {best + 1} does not fit")
    if _replay(check, BUDGET).oom:
        return best, f"derived, but the capture at {best} differs from it and does not fit: answer unchecked"
    return best, f"derived; the capture at {best} differs from the derived stream but fits"


def part1(layers: int, say) -> list[str]:
    shapes, units = _shapes(layers), _units(layers)
    params = sum(math.prod(s) for s in shapes)
    lines = [f"Part 1 (simulated on the virtual GPU): GPT-2-shaped transformer, {layers} layers "
             f"(GPT-2: 12; fewer: each capture runs the step's arithmetic on this 2-core CPU, and batch b costs "
             f"b times batch 1), d_model {GPT2['d_model']}, {GPT2['heads']} heads, context {GPT2['seq_len']}, "
             f"vocabulary {GPT2['vocab_size']}, untied head: "
             f"{params / 1e6:.1f} M parameters ({4 * params / GiB:.3f} GiB fp32); AdamW; rank 0 of N captured "
             f"with torch's fake process group on the CPU, {STEPS} steps, replayed under the default allocator"]
    # activations of the step without data parallelism, captured on the CPU like the ranks' steps
    from oomtune.plan.predictor import _capture_on

    none_cfg = {**GPT2, "layers": layers}
    t0 = time.perf_counter()
    none_stream, _ = _capture_on(none_cfg, 1, STEPS, False, ("cpu",), None)
    none_s = time.perf_counter() - t0
    none = _replay(none_stream, None)
    a_none = analytic(shapes, "none", 1, units)
    activations = none.peak_allocated_bytes - a_none["states"] - a_none["grads"]
    say(f"  none: capture {none_s:.0f} s, peak allocated {_gib(none.peak_allocated_bytes)} GiB")
    lines.append(f"without data parallelism (one process, batch 1): peak allocated {_gib(none.peak_allocated_bytes)} "
                 f"GiB, peak reserved {_gib(none.peak_reserved_bytes)} GiB; activations and temporaries at the peak "
                 f"(peak allocated - parameters, gradients, optimizer states): {_gib(activations)} GiB")
    rows = []
    for mode, n in CONFIGS:
        cfg = {**GPT2, "layers": layers, "parallel": mode, "ranks": n}
        captured, seconds = {}, []
        for b in (1, 2, 3, 4):
            captured[b], s = _capture(cfg, b)
            seconds.append(s)
            say(f"  {mode} x{n}: batch {b} captured in {s:.0f} s")
        at1 = _replay(captured[1], None)
        states = sum(captured[1]._live.values())
        exp = analytic(shapes, mode, n, units)
        expected_peak = exp["states"] + exp["grads"] + exp["buffers"] + activations
        largest, how = _largest_batch(cfg, captured, say)
        at_max = _replay(captured[largest], None) if largest in captured else None
        rows.append((mode, n, states, exp["states"], at1, expected_peak, largest, how, at_max))
        say(f"  {mode} x{n}: states {_gib(states)} (analytic {_gib(exp['states'])}), largest batch {largest} ({how})")
    lines += ["", "rank 0 of N, GiB (simulated)   states between steps    batch 1: peak allocated    "
                  "peak     largest batch per rank",
              f"config          measured  analytic     measured  analytic  reserved   within {BUDGET / GiB:g} GiB",
              "-" * 94]
    for mode, n, states, exp_states, at1, exp_peak, largest, how, at_max in rows:
        lines.append(f"{mode + ' x' + str(n):<14} {_gib(states):>9} {_gib(exp_states):>9}    {_gib(at1.peak_allocated_bytes):>9} "
                     f"{_gib(exp_peak):>9} {_gib(at1.peak_reserved_bytes):>9}   {largest:>4}")
    lines.append("")
    for mode, n, states, exp_states, at1, exp_peak, largest, how, at_max in rows:
        extra = "" if at_max is None else (f"; at batch {largest}: peak reserved {_gib(at_max.peak_reserved_bytes)} GiB, "
                                           f"allocated {_gib(at_max.peak_allocated_bytes)} GiB")
        lines.append(f"{mode} x{n}: largest batch {largest}: {how}{extra}")
    ddp2 = next(r for r in rows if r[:2] == ("ddp", 2))
    fsdp2 = next(r for r in rows if r[:2] == ("fsdp", 2))
    lines += ["",
              "analytic states: DDP = parameters + 2 AdamW states + gradient buckets = 4 x "
              f"{_gib(4 * params)} GiB (+ step counters); FSDP2 rank 0 = 3 x its padded shard; analytic peak = "
              "states + gradients (DDP: full; FSDP2: sharded) + FSDP2's buffers (3 x the largest unit: unsharded "
              "parameters, unsharded gradients, reduce-scatter input) + the activations above",
              f"FSDP2 over DDP at 2 ranks, batch 1: peak allocated {_gib(fsdp2[4].peak_allocated_bytes - ddp2[4].peak_allocated_bytes)} "
              f"GiB, peak reserved {_gib(fsdp2[4].peak_reserved_bytes - ddp2[4].peak_reserved_bytes)} GiB "
              f"(negative: FSDP2 needs less)",
              "FSDP2's peak reserved exceeds its peak allocated by more than DDP's: its all-gather buffers live in "
              "the all-gather copy-in stream's pool and its sharded gradients in the reduce-scatter stream's, which "
              "the default stream cannot reuse (modelled as on CUDA: oomtune.capture.streams)"]
    return lines


def _trial(runner, workload: dict, ranks: int, root: Path, tag: str):
    from oomtune.trial.record import TrialSpec

    spec = TrialSpec(workload=workload, batch_size=8, device="cpu", budget_bytes=4 * GiB, warmup_steps=1,
                     measure_steps=3, timeout_s=600, ranks=ranks)
    r = runner.run(spec, workdir=root / tag)
    if r.outcome != "ok":
        raise SystemExit(f"{tag} failed: {r.outcome}: {r.message}\n{r.traceback_tail}")
    return r


def part2(trials: int, say) -> list[str]:
    from oomtune.trial.runner import TrialRunner

    kinds = [("no parallelism, 1 process", {**README_LM}, 1),
             ("DDP, 1 rank", {**README_LM, "parallel": "ddp", "ranks": 1}, 1),
             ("DDP, 2 ranks", {**README_LM, "parallel": "ddp", "ranks": 2}, 2)]
    got: dict[str, list] = {k: [] for k, _, _ in kinds}
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-distributed-") as tmp, TrialRunner(launcher="fork") as runner:
        t0 = time.perf_counter()
        runner.start_fork_server()
        say(f"  fork server started in {time.perf_counter() - t0:.1f} s")
        for i in range(trials):
            for name, workload, ranks in kinds:
                r = _trial(runner, workload, ranks, Path(tmp), f"{i}-{ranks}-{name[:3]}")
                got[name].append(r)
                say(f"  {name} #{i}: launch->1st {r.process.launch_to_first_step_s:.2f} s, "
                    f"step {r.throughput.step_time_s * 1e3:.0f} ms")
    lines = [f"Part 2 (measured on this CPU, gloo): README transformer (4 layers, d_model 256, context 256, "
             f"vocabulary 8192, AdamW), batch 8 per rank, 1 warm-up + 3 measured steps, {trials} trials each, "
             "alternated; fork server",
             "",
             f"{'trial':<28}{'launch->1st step s':>20}{'range':>16}{'step ms':>10}{'range':>14}{'samples/s':>11}",
             "-" * 99]
    med = {}
    for name, _, _ in kinds:
        rs = got[name]
        launch = [r.process.launch_to_first_step_s for r in rs]
        step = [r.throughput.step_time_s * 1e3 for r in rs]
        thr = [r.throughput.samples_per_s for r in rs]
        med[name] = (statistics.median(launch), statistics.median(step), min(launch), max(launch), min(step), max(step))
        lines.append(f"{name:<28}{statistics.median(launch):>20.2f}{f'{min(launch):.2f}-{max(launch):.2f}':>16}"
                     f"{statistics.median(step):>10.0f}{f'{min(step):.0f}-{max(step):.0f}':>14}"
                     f"{statistics.median(thr):>11.1f}")
    one, two = med["DDP, 1 rank"], med["DDP, 2 ranks"]
    lines += ["",
              f"2 ranks over 1 rank (medians): start-up {two[0] - one[0]:+.2f} s ({two[0] / one[0]:.2f}x), "
              f"per step {two[1] - one[1]:+.0f} ms ({two[1] / one[1]:.2f}x); ranges overlap: "
              f"start-up {'yes' if two[2] <= one[3] and one[2] <= two[3] else 'no'}, "
              f"step {'yes' if two[4] <= one[5] and one[4] <= two[5] else 'no'}",
              "the 2-rank trial trains 16 samples per step (8 per rank) against 8; each rank gets one of the 2 "
              "cores; start-up adds the ranks' fork, the gloo rendezvous (file store) and DDP's construction",
              f"load average during part 2: {load0:.1f} at its start, {os.getloadavg()[0]:.1f} at its end: on a "
              "shared machine the scheduler's share of the cores differs between a trial of one process and one of "
              "two, so a difference within the ranges above, or against the load, says nothing about the ranks",
              "a 1-rank DDP trial over a single process: start-up "
              f"{one[0] - med['no parallelism, 1 process'][0]:+.2f} s, per step "
              f"{one[1] - med['no parallelism, 1 process'][1]:+.0f} ms (medians)"]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=768, help="GPT-2: 768 (smaller only for a smoke run)")
    ap.add_argument("--seq-len", type=int, default=1024, help="GPT-2: 1024 (smaller only for a smoke run)")
    ap.add_argument("--vocab", type=int, default=50304, help="GPT-2 (nanoGPT's padding): 50304 (smaller only for a smoke run)")
    ap.add_argument("--budget-mib", type=int, default=8192, help="per-rank budget: 8 GiB (smaller only for a smoke run)")
    ap.add_argument("--trials", type=int, default=4)
    ap.add_argument("--skip-memory", action="store_true", help="part 2 only")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "bench_distributed.txt")
    args = ap.parse_args()
    started = time.perf_counter()

    def say(line: str) -> None:
        print(line, flush=True)

    lines = [header().rstrip("\n"),
             "bench_distributed: one rank's memory under DDP and FSDP2, and what running ranks costs",
             f"date {dt.datetime.now().isoformat(timespec='seconds')}  nproc {os.cpu_count()}  python "
             f"{sys.version.split()[0]}  torch {torch.__version__}  load average {os.getloadavg()[0]:.1f}",
             ""]
    GPT2.update(d_model=args.d_model, seq_len=args.seq_len, vocab_size=args.vocab)
    global BUDGET
    BUDGET = args.budget_mib * MiB
    if not args.skip_memory:
        lines += part1(args.layers, say) + [""]
    lines += part2(args.trials, say)
    lines += ["", f"bench wall time {time.perf_counter() - started:.0f} s; load average at the end "
                  f"{os.getloadavg()[0]:.1f} (the machine is shared: CPU times are indicative)"]
    write_results(args.out, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
