"""Kernel fidelity: what capturing with the GPU's kernels changes in the predictions.

A capture runs the training step on meta (``oomtune plan``) or CPU tensors (virtual-GPU trials);
it now runs the kernels a CUDA run of the target GPU runs (``oomtune.capture.
cuda_kernels.emulate_cuda``: attention, dropout, RMS norm, optimizers, autocast on cpu/meta). This
script captures the same workloads both ways and replays them on the virtual GPU (torch's default
allocator settings, no capacity limit), for:

* the shared LM recordings (tests/data/*.pickle, rebuilt as experiments/capture_fidelity.py rebuilds
  them): recorded peaks against the predictions with the meta kernels (the capture before it ran the GPU's kernels)
  and with the target GPU's kernels;
* the built-in transformer (oomtune/workloads/models.py) at GPT-2-small and Llama-2-7B shapes:
  predicted peaks with the meta kernels (what ``oomtune plan`` captured before), with each kernel
  family alone, and with all of them (the capture now); GPT-2-small also captured on the CPU with the
  CPU's own kernels (what a virtual-GPU trial ran before);
* a CNN with Mish and batch norm (GPUMemNet's over-predicted rows are Mish CNNs): meta kernels against
  the activation fix and all families.

Every figure is simulated (virtual GPU) except the recorded ones (read from the GPU recordings).

Usage::

    python experiments/kernel_fidelity.py [--out experiments/results/kernel_fidelity.md] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _provenance import header, write_results  # noqa: E402

import capture_fidelity as CF  # noqa: E402

from oomtune.alloc.stream import replay_stream  # noqa: E402
from oomtune.capture.cuda_kernels import FAMILIES, emulate_cuda  # noqa: E402
from oomtune.capture.gpu_target import parse_gpu  # noqa: E402
from oomtune.capture.recorder import capture_stream  # noqa: E402
from oomtune.plan.predictor import unbounded_capacity_bytes  # noqa: E402
from oomtune.units import format_bytes  # noqa: E402

TRACES = ROOT / "tests" / "data"
#: The recordings' GPUs as their cuBLAS workspaces show them (32 MiB: Hopper), for the target.
RECORDING_GPU = {"lm-ctx128-fullstep": "h100", "lm-ctx128-fullstep-emptycache": "h100",
                 "lm-medium-ctx512-training": "a100", "lm-step-small": "a100"}

GPT2_SMALL = {"name": "transformer", "layers": 12, "d_model": 768, "heads": 12, "seq_len": 1024,
              "vocab_size": 50304, "dropout": 0.1, "optimizer": "adamw", "lr": 3e-4, "precision": "bf16"}
LLAMA2_7B = {"name": "transformer", "layers": 32, "d_model": 4096, "heads": 32, "seq_len": 2048,
             "vocab_size": 32000, "dropout": 0.0, "optimizer": "adamw", "lr": 3e-4, "precision": "bf16"}
#: Small enough to capture on the CPU for real (the CPU's own kernels: its flash attention for fp32).
SMALL = {"name": "transformer", "layers": 2, "d_model": 128, "heads": 2, "seq_len": 256, "vocab_size": 2048,
         "dropout": 0.1, "optimizer": "adamw", "lr": 3e-4, "precision": "fp32"}


def peaks(stream: Any) -> tuple[int, int]:
    """(peak allocated, peak reserved) in bytes of ``stream`` replayed under torch's defaults."""
    res = replay_stream(stream, None, total_memory_bytes=unbounded_capacity_bytes(stream))
    return res.peak_allocated_bytes, res.peak_reserved_bytes


# -- the recordings --------------------------------------------------------------------------------------
def recording_row(name: str, families: Any) -> dict[str, Any]:
    """Capture recording ``name``'s workload as capture_fidelity.py does; ``families``: None for the
    capture before it ran the GPU's kernels (CUDA autocast only), else the kernel families emulated."""
    from oomtune.trace.snapshot import load_snapshot

    wl = CF.WORKLOADS[name]
    rec = CF.recorded_figures(load_snapshot(TRACES / f"{wl.trace}.pickle"))
    gpu = RECORDING_GPU[wl.trace]
    ctx = contextlib.nullcontext() if families is None else emulate_cuda(gpu, families=families)
    t0 = time.perf_counter()
    with ctx as notes:
        sink, _ = CF.capture(wl)
    pred = CF.replay(sink, rec["settings"])
    return {"recorded": rec, "predicted": pred, "seconds": time.perf_counter() - t0, "gpu": gpu,
            "notes": notes.lines() if notes is not None else []}


# -- the built-in transformer ---------------------------------------------------------------------------
def builtin_stream(cfg: dict[str, Any], batch: int, device: str, families: Any, gpu: str) -> tuple[Any, list[str]]:
    """Two training steps of the built-in workload captured on ``device`` with the kernel
    ``families`` of ``gpu`` (None: none, the capture before it ran the GPU's kernels)."""
    from oomtune.workloads import build_workload

    ctx = contextlib.nullcontext() if families is None else emulate_cuda(gpu, families=families)
    with ctx as notes:
        torch.manual_seed(0)
        wl = build_workload({**cfg, "data": {"source": "synthetic"}}, batch, device)
        batches = wl.batches()
        stream = capture_stream(lambda: wl.step(next(batches)), existing=wl.tensors_before_step(), device=device,
                                cuda_autocast=False, calls=2)
    return stream, (notes.lines() if notes is not None else [])


def builtin_rows(label: str, cfg: dict[str, Any], batch: int, gpus: tuple[str, ...], *, cpu: bool = False,
                 each: bool = True) -> list[dict[str, Any]]:
    """Rows of one workload: meta kernels, optionally the CPU's own (a real CPU capture), each family
    alone on the first GPU, and all families per GPU of ``gpus``."""
    rows = []
    variants: list[tuple[str, str, Any, str]] = [("meta kernels (plan before)", "meta", None, gpus[0])]
    if cpu:
        variants.append(("CPU kernels (CPU trial before)", "cpu", None, gpus[0]))
    if each:
        variants += [(f"+ {f} only ({parse_gpu(gpus[0]).name})", "meta", (f,), gpus[0]) for f in FAMILIES]
    variants += [(f"{parse_gpu(g).name} kernels (all)", "meta", FAMILIES, g) for g in gpus]
    if cpu:
        variants.append((f"{parse_gpu(gpus[0]).name} kernels (all), captured on the CPU (CPU trial now)", "cpu",
                         FAMILIES, gpus[0]))
    for what, device, families, gpu in variants:
        t0 = time.perf_counter()
        stream, notes = builtin_stream(cfg, batch, device, families, gpu)
        alloc, reserved = peaks(stream)
        rows.append({"workload": label, "what": what, "alloc": alloc, "reserved": reserved,
                     "seconds": time.perf_counter() - t0, "notes": notes})
        print(f"{label} | {what}: {format_bytes(alloc)} allocated, {format_bytes(reserved)} reserved "
              f"({rows[-1]['seconds']:.1f} s)", flush=True)
    return rows


# -- a CNN with Mish (GPUMemNet's over-predicted rows) -------------------------------------------------
#: A GPUMemNet-like CNN (their generator's blocks: conv, batch norm, an activation, pooling; fp32, Adam,
#: cross-entropy): 3 x 224 x 224 images, channels 64 -> 128 -> 256 -> 512, two conv blocks per stage.
MISH_CNN = {"image": 224, "channels": (64, 128, 256, 512), "classes": 1000, "batch": 32}


def mish_cnn_stream(families: Any, cfg: dict[str, Any] = MISH_CNN) -> tuple[Any, list[str]]:
    """Two Adam training steps of the CNN of ``cfg`` captured on meta with the kernel ``families``
    of the A100 (None: meta's own kernels)."""
    from torch import nn

    layers: list[nn.Module] = []
    cin = 3
    for cout in cfg["channels"]:
        for _ in range(2):
            layers += [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.Mish()]
            cin = cout
        layers.append(nn.MaxPool2d(2))
    model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, cfg["classes"])).to("meta")
    opt = torch.optim.Adam(model.parameters())
    x = torch.empty(cfg["batch"], 3, cfg["image"], cfg["image"], device="meta")
    y = torch.zeros(cfg["batch"], dtype=torch.int64, device="meta")

    def step() -> None:
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    ctx = contextlib.nullcontext() if families is None else emulate_cuda("a100", families=families)
    with ctx as notes:
        stream = capture_stream(step, existing=[*model.parameters(), *model.buffers(), x, y], device="meta",
                                cuda_autocast=False, calls=2)
    return stream, (notes.lines() if notes is not None else [])


def mish_cnn_rows(cfg: dict[str, Any] = MISH_CNN) -> list[dict[str, Any]]:
    """Rows: meta kernels (the capture before the activation fix), the activations family alone, all
    families (the capture now)."""
    rows = []
    for what, families in (("meta kernels (plan before)", None), ("+ activations only (A100)", ("activations",)),
                           ("A100 kernels (all)", FAMILIES)):
        t0 = time.perf_counter()
        stream, notes = mish_cnn_stream(families, cfg)
        alloc, reserved = peaks(stream)
        rows.append({"workload": "Mish CNN", "what": what, "alloc": alloc, "reserved": reserved,
                     "seconds": time.perf_counter() - t0, "notes": notes})
        print(f"Mish CNN | {what}: {format_bytes(alloc)} allocated, {format_bytes(reserved)} reserved", flush=True)
    return rows


def _pct(a: int, b: int) -> str:
    return f"{(a - b) / b:+.1%}" if b else "n/a"


def render(rec_rows: list[tuple[str, dict, dict]], builtin: list[dict[str, Any]],
           cnn: list[dict[str, Any]] | None = None) -> str:
    lines = ["", "All figures simulated on the virtual GPU (torch's default allocator settings, no capacity "
             "limit) except the recorded ones, read from the GPU recordings in tests/data. Errors are "
             "(predicted - recorded) / recorded.", "",
             "## The shared LM recordings", "",
             "| recording | target | peak allocated recorded | meta kernels | err | GPU kernels | err | "
             "peak reserved recorded | meta kernels | err | GPU kernels | err |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, old, new in rec_rows:
        r = old["recorded"]
        oa, ora = old["predicted"]["peak_allocated_bytes"], old["predicted"]["peak_reserved_bytes"]
        na, nra = new["predicted"]["peak_allocated_bytes"], new["predicted"]["peak_reserved_bytes"]
        lines.append(f"| {name} | {new['gpu']} | {r['peak_allocated_bytes']:,} | {oa:,} | "
                     f"{_pct(oa, r['peak_allocated_bytes'])} | {na:,} | {_pct(na, r['peak_allocated_bytes'])} | "
                     f"{r['peak_reserved_bytes']:,} | {ora:,} | {_pct(ora, r['peak_reserved_bytes'])} | {nra:,} | "
                     f"{_pct(nra, r['peak_reserved_bytes'])} |")
    kernel_notes = sorted({n for _, _, new in rec_rows for n in new["notes"]})
    lines += ["", "Kernels the GPU-kernel captures of the recordings ran in place of meta's: "
              + ("; ".join(kernel_notes) if kernel_notes else "none") + ". None of these recordings calls "
              "scaled_dot_product_attention, dropout, RMS norm through F.rms_norm or a torch.optim optimizer "
              "(they materialise the attention scores, write their softmax, norm and AdamW by hand: "
              "tests/data/README.md), so there is no SDPA recording to compare against, and the two "
              "captures agree where they must.", ""]
    lines += ["## The built-in transformer", "",
              f"GPT-2-small shape: {GPT2_SMALL}, batch 8; Llama-2-7B shape: {LLAMA2_7B}, batch 1 (the built-in "
              f"model's attention and 4 x d_model MLP, not Llama's SwiGLU); small: {SMALL}, batch 8. Two "
              "training steps. 'vs meta' compares with the workload's first row.", "",
              "| workload | kernels | peak allocated | vs meta | peak reserved | vs meta | capture s |",
              "|---|---|---|---|---|---|---|"]
    base: dict[str, dict[str, Any]] = {}
    for row in builtin:
        b = base.setdefault(row["workload"], row)
        lines.append(f"| {row['workload']} | {row['what']} | {format_bytes(row['alloc'])} | "
                     f"{_pct(row['alloc'], b['alloc'])} | {format_bytes(row['reserved'])} | "
                     f"{_pct(row['reserved'], b['reserved'])} | {row['seconds']:.1f} |")
    notes = sorted({n for row in builtin for n in row["notes"]})
    lines += ["", "Kernels the captures ran (all families): " + "; ".join(notes) + ".", ""]
    if cnn:
        lines += ["## A CNN with Mish", "",
                  f"{MISH_CNN}: 4 stages of 2 x (3 x 3 conv without bias, BatchNorm2d, Mish), 2 x 2 max pooling, "
                  "adaptive average pooling, a linear classifier; fp32, cross-entropy, torch.optim.Adam, two "
                  "training steps captured on meta. On meta, mish_backward ran its decomposition (nine "
                  "input-sized tensors); CUDA's kernel makes one (docs/kernel_audit.md).", "",
                  "| kernels | peak allocated | vs meta | peak reserved | vs meta | capture s |", "|---|---|---|---|---|---|"]
        for row in cnn:
            b = cnn[0]
            lines.append(f"| {row['what']} | {format_bytes(row['alloc'])} | {_pct(row['alloc'], b['alloc'])} | "
                         f"{format_bytes(row['reserved'])} | {_pct(row['reserved'], b['reserved'])} | "
                         f"{row['seconds']:.1f} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "experiments" / "results" / "kernel_fidelity.md")
    ap.add_argument("--quick", action="store_true", help="smaller shapes (a smoke run; not for the results file)")
    args = ap.parse_args(argv)
    head = header(argv=None if argv is None else [__file__, *argv])   # at the start: refuses a dirty tree
    rec_rows = []
    for name in CF.MAIN:
        if args.quick and name != "lm-medium-ctx512-training":
            continue
        old, new = recording_row(name, None), recording_row(name, FAMILIES)
        rec_rows.append((name, old, new))
        print(f"{name}: recorded {old['recorded']['peak_allocated_bytes']:,}, meta kernels "
              f"{old['predicted']['peak_allocated_bytes']:,}, GPU kernels {new['predicted']['peak_allocated_bytes']:,}",
              flush=True)
    gpt2 = dict(GPT2_SMALL, layers=2) if args.quick else GPT2_SMALL
    llama = dict(LLAMA2_7B, layers=2, d_model=512, heads=4) if args.quick else LLAMA2_7B
    builtin = builtin_rows("GPT-2-small", gpt2, 8, ("a100", "h100", "t4"))
    builtin += builtin_rows("Llama-2-7B shape", llama, 1, ("a100", "h100"))
    builtin += builtin_rows("small (CPU capture too)", SMALL, 8, ("a100",), cpu=True, each=False)
    cnn = mish_cnn_rows(dict(MISH_CNN, image=64, batch=4) if args.quick else MISH_CNN)
    text = head + render(rec_rows, builtin, cnn)
    write_results(args.out, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
