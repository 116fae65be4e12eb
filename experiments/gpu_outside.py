"""Measure on a real CUDA device what the predictor cannot know without one: the memory outside the
caching allocator, step by step, and the workspaces cuDNN asks the allocator for per convolution.

Part 1, memory outside the allocator (oomtune/gpu/outside.py has only the CUDA context from public
sources). A FRESH child process (nothing else has touched CUDA in it) reads, before CUDA init and
after each step:

* ``nvml_used``: NVML ``nvmlDeviceGetMemoryInfo().used`` of the whole card (what ``nvidia-smi
  memory.used`` shows, the quantity of the GPUMemNet rows), and ``nvml_process``: this process's
  ``usedGpuMemory`` (``nvmlDeviceGetComputeRunningProcesses``);
* ``meminfo_used``: ``total - free`` of ``torch.cuda.mem_get_info()`` (``cudaMemGetInfo``);
* torch's ``memory_reserved`` and ``memory_allocated``.

Memory outside the allocator is each of those less ``reserved``: ``outside_meminfo`` is exactly what a
trial measures and keeps (:func:`oomtune.trial.budget.non_allocator_bytes`, kept per GPU, driver and
torch by :func:`oomtune.gpu.outside.remember_measured`); ``outside_nvml`` also subtracts the card's
``used`` before CUDA init (memory no process of ours holds). The steps, each adding to the previous:

=================  ==========================================================================
cuda_init          ``torch.cuda.mem_get_info()``: the context is created, nothing allocated
tensor             ``torch.randn(20, 16, 50, 100).cuda()``: a host-to-device copy, no kernel
                   (pytorch/pytorch#86509's reading, the table's CUDA 11-12 lazy-loading row)
cublas_fp32        a 1024 x 1024 fp32 matmul (cuBLAS handle and kernels)
cublaslt_bf16      bf16 matmul and ``F.linear`` with a bias (cuBLASLt's ``gemm_and_bias`` path)
cudnn_conv         one ``aten.convolution`` forward and its backward, ``cudnn.benchmark`` False
                   (cuDNN loaded)
mlp_step           one training step of a GPUMemNet-shaped MLP (Linear + ReLU, cross-entropy,
                   Adam): the torch kernels a training step loads lazily
cnn_step           one training step of a GPUMemNet-shaped CNN (Conv2d + BatchNorm2d + ReLU +
                   Dropout, pooling, Linear, Softmax, cross-entropy, Adam)
=================  ==========================================================================

Inputs are copied from the host (``.cuda()``) where a kernel would load a module of its own.

Part 2, cuDNN workspaces: for GPUMemNet-shaped convolution layers (:data:`LAYER_ROWS`: the first
convolution of each row's model and the one with the largest explicit-GEMM workspace, found by
building the model on meta with experiments/_gpumemnet_models.py), the child runs the forward
(``aten.convolution``) and the backward (``aten.convolution_backward``, input gradient only when the
layer is not the model's first, as autograd asks; no bias: its gradient is a reduction, not cuDNN)
twice each, ``cudnn.benchmark`` False, with ``torch.cuda.memory._record_memory_history`` on. Every
block allocated and freed inside one call (:func:`window_summary`) is a workspace request of the
cuDNN path. The parent predicts the same calls with oomtune
(:func:`oomtune.capture.cudnn_conv.conditional_requests`, rules ``implicit`` and ``gemm``) for the
device's architecture, on a roomy device (the first candidate of each ``try`` is granted).

Writes ``gpu_outside.json`` (the child's readings, the predictions, the CUDA context row of the table
the same stack would use, the cache entry a trial would keep, the rows to propose for the table) and
``gpu_outside.md``; ``--render FILE.json`` writes the markdown again from a JSON file (the GPU check
brings back the JSON only; the markdown is in its log).

Run on a GPU machine (about 20 s on an H200)::

    PYTHONPATH=$PWD python experiments/gpu_outside.py

Dry run on CPU (``--device cpu``): the same steps on the CPU (no readings: None), the layers at
batch 1 and at most 12 x 12 pixels, nothing recorded; checks the plumbing, not figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # experiments/_provenance.py, _gpumemnet_models.py
from _provenance import provenance  # noqa: E402  (command + commit of every results file)

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "experiments" / "results"
STEPS = ("before_init", "cuda_init", "tensor", "cublas_fp32", "cublaslt_bf16", "cudnn_conv", "mlp_step", "cnn_step")
#: What each step adds (the delta of ``outside_meminfo`` from the step before), for the markdown.
STEP_MEANING = {"cuda_init": "CUDA context (lazy loading: no module yet)",
                "tensor": "a host-to-device copy (pytorch/pytorch#86509's reading)",
                "cublas_fp32": "cuBLAS: handle, kernels of an fp32 GEMM",
                "cublaslt_bf16": "cuBLASLt: bf16 GEMM, linear with bias",
                "cudnn_conv": "cuDNN: a convolution forward and backward",
                "mlp_step": "torch kernels of an MLP training step (Adam, cross-entropy)",
                "cnn_step": "torch kernels of a CNN training step (batch norm, pooling, dropout)"}
#: GPUMemNet CNN rows (github.com/itu-rad/GPUMemNet, cnn collection; Filename, Total Parameters):
#: a small uniform, a residual and a dense model, each measured on an A100 in the published data.
LAYER_ROWS = (
    ("input_channels:1_num_classes:169_depth:2_arch:uniform_base_filters:32_batch:52_input_size:134_act:mish_"
     "dropout:0.4252372788964438_dropout:False_batchnorm:True.out", 15273),
    ("input_channels:3_num_classes:435_depth:16_arch:residual_base_filters:120_batch:16_input_size:200_act:selu_"
     "dropout:0.2594242638726377_dropout:False_batchnorm:True.out", 9498236),
    ("input_channels:3_num_classes:791_depth:4_arch:dense_base_filters:111_batch:54_input_size:162_act:tanh_"
     "dropout:0.3646925180398911_dropout:True_batchnorm:True.out", 163548),
)
MAX_LAYERS = 6
DRY_RUN_BATCH, DRY_RUN_SIZE = 1, 12
MAX_ENTRIES = 200_000
_KEPT: list[Any] = []   # the tensor step's tensor, live for the later readings
_MiB = 1 << 20


# ---------------------------------------------------------------- pure helpers (unit-tested on CPU)

def window_summary(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """What one call did through the caching allocator, from the trace entries recorded during it
    (``torch.cuda.memory._snapshot()["device_traces"][device]``, the entries after the call began).

    Returns ``transient_bytes``: the sizes (bytes, as requested: the ``size`` of an ``alloc`` entry)
    of the blocks both allocated and freed inside the window, in allocation order (a free is its
    ``free_requested`` or, without one, ``free_completed`` entry); ``kept_bytes``: the blocks
    allocated and still live at the end (the call's outputs); ``ooms``: the ``oom`` entries (a
    request the device refused). Frees of blocks allocated before the window are ignored.
    """
    live: dict[int, tuple[int, int]] = {}
    transient: list[tuple[int, int]] = []
    ooms = 0
    for n, entry in enumerate(entries):
        action = entry.get("action")
        if action == "alloc":
            live[int(entry["addr"])] = (n, int(entry["size"]))
        elif action in ("free_requested", "free_completed"):
            block = live.pop(int(entry["addr"]), None)
            if block is not None:
                transient.append(block)
        elif action == "oom":
            ooms += 1
    return {"transient_bytes": [size for _, size in sorted(transient)],
            "kept_bytes": [size for _, size in sorted(live.values())], "ooms": ooms}


def outside_figures(reading: dict[str, Any], baseline_nvml_used: int | None) -> dict[str, int | None]:
    """The memory outside the allocator in one reading (bytes; None where a figure is missing):
    ``outside_meminfo`` = ``meminfo_used - reserved`` (a trial's
    :func:`oomtune.trial.budget.non_allocator_bytes`), ``outside_nvml`` = ``nvml_used -
    baseline_nvml_used - reserved`` (the card's used memory before CUDA init taken off),
    ``outside_process`` = ``nvml_process - reserved``."""
    reserved = reading.get("reserved")

    def less(value: int | None, *minus: int | None) -> int | None:
        if value is None or reserved is None or any(m is None for m in minus):
            return None
        return int(value) - sum(int(m) for m in minus) - int(reserved)

    return {"outside_meminfo": less(reading.get("meminfo_used")),
            "outside_nvml": less(reading.get("nvml_used"), baseline_nvml_used),
            "outside_process": less(reading.get("nvml_process"))}


def step_deltas(readings: dict[str, dict[str, Any]], key: str = "outside_meminfo") -> dict[str, int | None]:
    """What each step added to ``key`` (bytes): its figure less the previous step's (the first step
    with a figure: the figure itself); None where either is missing."""
    out: dict[str, int | None] = {}
    prev: int | None = 0
    for step in STEPS[1:]:
        value = (readings.get(step) or {}).get(key)
        out[step] = None if value is None or prev is None else value - prev
        prev = value
    return out


def cache_entry(identity: dict[str, Any] | None, torch_version: str | None, outside_bytes: int | None,
                cache_dir: Path) -> dict[str, Any] | None:
    """The ``outside_allocator.json`` a trial on this device would leave (the trial keeps its reading
    with :func:`oomtune.gpu.outside.remember_measured`, keyed by NVML's name and driver and the
    installed torch), written by that same function into ``cache_dir`` and read back; None without a
    device identity or reading."""
    if not identity or not identity.get("name") or outside_bytes is None:
        return None
    from oomtune.gpu.outside import read_measured, remember_measured

    saved = os.environ.get("OOMTUNE_CACHE_DIR")
    os.environ["OOMTUNE_CACHE_DIR"] = str(cache_dir)
    try:
        remember_measured(identity["name"], identity.get("driver_version"), torch_version, int(outside_bytes))
        path = cache_dir / "outside_allocator.json"
        return {"file": json.loads(path.read_text()) if path.is_file() else None,
                "read_back": read_measured(identity["name"], identity.get("driver_version"), torch_version)}
    finally:
        if saved is None:
            os.environ.pop("OOMTUNE_CACHE_DIR", None)
        else:
            os.environ["OOMTUNE_CACHE_DIR"] = saved


def proposed_rows(doc: dict[str, Any]) -> list[str]:
    """The rows a GPU run proposes for oomtune/gpu/outside.py (source text included), or [] when the
    run has no device figures: the CUDA context after ``cuda_init`` as a ``ContextFigure`` of this
    card's compute capability, CUDA major and module loading, and what each later step added
    (components the table lists as not counted), each naming card, driver, torch, CUDA, cuDNN and
    the commit."""
    child = doc.get("child") or {}
    env = child.get("env") or {}
    readings = child.get("readings") or {}
    ctx = (readings.get("cuda_init") or {}).get("outside_meminfo")
    ident = child.get("identity") or {}
    if ctx is None or not env.get("cuda") or not env.get("capability"):
        return []
    major = int(str(env["cuda"]).split(".")[0])
    cap = tuple(env["capability"])
    lazy = (env.get("CUDA_MODULE_LOADING_after_init") or "LAZY").upper() == "LAZY"
    stack = (f"{ident.get('name') or env.get('device_name')}, driver {ident.get('driver_version')}, torch "
             f"{env.get('torch')}, CUDA {env.get('cuda')}, cuDNN {env.get('cudnn')}, "
             f"CUDA_MODULE_LOADING={env.get('CUDA_MODULE_LOADING_after_init')}")
    where = f"experiments/gpu_outside.py at commit {doc.get('commit')}"
    rows = [f"ContextFigure({ctx}, ({major},), {lazy}, {cap!r}, \"CUDA context: {ctx:,} bytes "
            f"(cudaMemGetInfo total - free after torch.cuda.mem_get_info() alone, reserved 0; {stack}; "
            f"measured with {where})\")"]
    for step, delta in step_deltas(readings).items():
        if step in ("cuda_init", "tensor") or delta is None:
            continue
        rows.append(f"# {step}: +{delta:,} bytes outside the allocator ({STEP_MEANING[step]}; {stack}; {where})")
    return rows


# ---------------------------------------------------------------- layers and predictions (parent)

def layer_specs(dry_run: bool = False) -> list[dict[str, Any]]:
    """Up to :data:`MAX_LAYERS` convolutions of :data:`LAYER_ROWS`' models: per model its first one
    and the one with the largest explicit-GEMM workspace, with the input shape the row's training
    batch gives it (the model built and run on meta). ``dry_run``: batch 1 and at most 12 x 12."""
    import torch

    from _gpumemnet_models import build_model, parse_filename
    from oomtune.capture.cudnn_conv import gemm_workspace_bytes

    specs: list[dict[str, Any]] = []
    for filename, total in LAYER_ROWS:
        p = parse_filename(filename)
        with torch.device("meta"):
            model = build_model(p, total)
        seen: list[dict[str, Any]] = []

        def hook(mod: Any, inputs: tuple, _out: Any, seen: list = seen) -> None:
            x = inputs[0]
            seen.append({"row": filename, "index": len(seen), "input": list(x.shape), "out_channels": mod.out_channels,
                         "kernel": list(mod.kernel_size), "stride": list(mod.stride), "padding": list(mod.padding),
                         "dilation": list(mod.dilation), "groups": mod.groups, "first": not seen})

        handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
        size = int(p["input_size"])
        with torch.no_grad():
            model(torch.empty(int(p["batch"]), int(p["input_channels"]), size, size, device="meta"))
        for h in handles:
            h.remove()

        def gemm(s: dict[str, Any]) -> int:
            n, c, h, w = s["input"]
            out = [(d + 2 * pad - dil * (k - 1) - 1) // st + 1
                   for d, pad, dil, k, st in zip((h, w), s["padding"], s["dilation"], s["kernel"], s["stride"])]
            return gemm_workspace_bytes((n, c, tuple(s["kernel"]), tuple(out), s["groups"], 4, False))

        chosen = [seen[0]] + [max(seen[1:], key=gemm)] if len(seen) > 1 else seen[:1]
        specs.extend(chosen)
    specs = specs[:MAX_LAYERS]
    if dry_run:
        for s in specs:
            s["input"] = [DRY_RUN_BATCH, s["input"][1], min(s["input"][2], DRY_RUN_SIZE), min(s["input"][3], DRY_RUN_SIZE)]
    return specs


def _conv_args(spec: dict[str, Any], device: Any, dtype: Any = None) -> tuple[tuple, tuple]:
    """The ``aten.convolution`` and ``aten.convolution_backward`` arguments of a layer (empty tensors
    on ``device``; fp32): ``(forward_args, backward_args)``."""
    import torch

    dtype = dtype or torch.float32
    n, c, h, w = spec["input"]
    x = torch.empty(n, c, h, w, device=device, dtype=dtype)
    weight = torch.empty(spec["out_channels"], c // spec["groups"], *spec["kernel"], device=device, dtype=dtype)
    fwd = (x, weight, None, spec["stride"], spec["padding"], spec["dilation"], False, [0, 0], spec["groups"])
    out = [(d + 2 * pad - dil * (k - 1) - 1) // st + 1
           for d, pad, dil, k, st in zip((h, w), spec["padding"], spec["dilation"], spec["kernel"], spec["stride"])]
    grad = torch.empty(n, spec["out_channels"], *out, device=device, dtype=dtype)
    bwd = (grad, x, weight, None, spec["stride"], spec["padding"], spec["dilation"], False, [0, 0], spec["groups"],
           [not spec["first"], True, False])
    return fwd, bwd


def predicted_requests(spec: dict[str, Any], rule: str, sm: str) -> dict[str, list[int]]:
    """oomtune's workspace requests for the layer's forward and backward on architecture ``sm`` under
    ``rule`` (``OOMTUNE_CUDNN_WORKSPACE``), ``cudnn.benchmark`` False, on a roomy device: the first
    candidate of each ``try`` (:func:`oomtune.capture.cudnn_conv.conditional_requests`), bytes."""
    import torch

    from oomtune.capture import cudnn_conv

    saved = os.environ.get(cudnn_conv.ENV)
    os.environ[cudnn_conv.ENV] = rule
    old_benchmark = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = False
    try:
        cudnn_conv.reset()
        fwd, bwd = _conv_args(spec, "meta")
        out = {}
        for name, func, args in (("forward", torch.ops.aten.convolution.default, fwd),
                                 ("backward", torch.ops.aten.convolution_backward.default, bwd)):
            out[name] = [sizes[0] for kind, sizes in cudnn_conv.conditional_requests(func, args, sm) if kind == "try"]
        return out
    finally:
        torch.backends.cudnn.benchmark = old_benchmark
        if saved is None:
            os.environ.pop(cudnn_conv.ENV, None)
        else:
            os.environ[cudnn_conv.ENV] = saved


# ---------------------------------------------------------------- the child (a fresh process)

def _write(path: Path, rec: dict[str, Any]) -> None:
    path.write_text(json.dumps(rec, indent=1, default=str))


def _reading(torch: Any, cuda: bool, nvml: Any, index: int | None) -> dict[str, Any]:
    """One reading (bytes, None where not available); see the module docstring."""
    r: dict[str, Any] = {"nvml_used": None, "nvml_process": None, "meminfo_used": None, "reserved": None,
                         "allocated": None}
    if index is not None:
        mem = nvml.memory_info(index)
        r["nvml_used"] = None if mem is None else mem.used_bytes
        handle = nvml.query("nvmlDeviceGetHandleByIndex", index)
        procs = None if handle is None else nvml.query("nvmlDeviceGetComputeRunningProcesses", handle)
        listed = [[int(p.pid), p.usedGpuMemory] for p in procs or []]
        r["nvml_processes"] = listed
        # only when NVML lists this process (in a container it may list the host's process ids)
        mine = [used for pid, used in listed if pid == os.getpid()]
        r["nvml_process"] = int(mine[0]) if len(mine) == 1 and mine[0] is not None else None
    if cuda and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        r.update(meminfo_used=total - free, reserved=torch.cuda.memory_reserved(),
                 allocated=torch.cuda.memory_allocated())
    return r


def _train_step(torch: Any, model: Any, x: Any, y: Any) -> None:
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _run_step(name: str, torch: Any, dev: Any) -> None:
    """The work of one step (module docstring's table), inputs copied from the host."""
    F = torch.nn.functional
    if name == "cuda_init":
        if dev.type == "cuda":
            torch.cuda.mem_get_info()
    elif name == "tensor":
        _KEPT.append(torch.randn(20, 16, 50, 100).to(dev))     # kept, as pytorch/pytorch#86509's tensor was
    elif name == "cublas_fp32":
        a = torch.randn(1024, 1024).to(dev)
        a @ a   # the product alone: a reduction would load a kernel of torch's own
    elif name == "cublaslt_bf16":
        a = torch.randn(1024, 1024, dtype=torch.bfloat16).to(dev)
        b = torch.randn(1024, dtype=torch.bfloat16).to(dev)
        a @ a
        F.linear(a, a, b)
    elif name == "cudnn_conv":
        spec = {"input": [8, 3, 32, 32], "out_channels": 16, "kernel": [3, 3], "stride": [1, 1], "padding": [1, 1],
                "dilation": [1, 1], "groups": 1, "first": False}
        fwd, bwd = _conv_args(spec, "cpu")
        fwd = tuple(t.to(dev) if isinstance(t, torch.Tensor) else t for t in fwd)
        bwd = tuple(t.to(dev) if isinstance(t, torch.Tensor) else t for t in bwd)
        torch.ops.aten.convolution.default(*fwd)
        torch.ops.aten.convolution_backward.default(*bwd)
    elif name == "mlp_step":
        nn = torch.nn
        model = nn.Sequential(nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10)).to(dev)
        _train_step(torch, model, torch.randn(32, 256).to(dev), torch.randint(0, 10, (32,)).to(dev))
    elif name == "cnn_step":
        nn = torch.nn
        model = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1), nn.BatchNorm2d(16), nn.ReLU(), nn.Dropout(0.3),
                              nn.AdaptiveAvgPool2d((1, 1)), nn.Flatten(), nn.Linear(16, 10), nn.Softmax(dim=1)).to(dev)
        _train_step(torch, model, torch.randn(8, 3, 32, 32).to(dev), torch.randint(0, 10, (8,)).to(dev))
    else:
        raise ValueError(f"unknown step {name!r}")


def _start_recording(torch: Any) -> None:
    try:  # no stack frames: smaller, faster snapshots
        torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, context=None, stacks="python")
    except (TypeError, ValueError, RuntimeError):
        torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES)


def _trace(torch: Any) -> list[dict[str, Any]]:
    traces = torch.cuda.memory._snapshot().get("device_traces") or [[]]
    return list(traces[torch.cuda.current_device()])


def _measure_layers(torch: Any, dev: Any, specs: list[dict[str, Any]], rec: dict[str, Any], out: Path) -> None:
    """Each layer's forward and backward, twice, recorded: ``rec["layers"]`` (see the module docstring)."""
    cuda = dev.type == "cuda"
    if cuda:
        _start_recording(torch)
    for spec in specs:
        row: dict[str, Any] = {"spec": spec, "calls": []}
        rec["layers"].append(row)
        try:
            fwd, bwd = _conv_args(spec, dev)
            for it in (1, 2):
                for name, func, args in (("forward", torch.ops.aten.convolution.default, fwd),
                                         ("backward", torch.ops.aten.convolution_backward.default, bwd)):
                    start = len(_trace(torch)) if cuda else 0
                    result = func(*args)
                    if cuda:
                        torch.cuda.synchronize()
                        summary = window_summary(_trace(torch)[start:])
                    else:
                        summary = None   # nothing to record on the CPU
                    row["calls"].append({"iteration": it, "call": name, "measured": summary})
                    del result
            del fwd, bwd
        except Exception as exc:   # one layer's failure (an OOM) does not end the others
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
        _write(out, rec)
    if cuda:
        torch.cuda.memory._record_memory_history(enabled=None)


def child_main(args: argparse.Namespace) -> int:
    """``--child``: the readings and the layers in this fresh process; ``<out-dir>/gpu_outside_child.json``,
    rewritten after every step so that a child ended at its limit leaves what it measured."""
    out = Path(args.out_dir) / "gpu_outside_child.json"
    specs = json.loads(Path(args.specs).read_text())
    rec: dict[str, Any] = {"device": args.device, "readings": {}, "layers": [], "error": None}
    t0 = time.perf_counter()
    try:
        from oomtune.gpu import nvml
        from oomtune.packages import installed_version

        cuda = args.device == "cuda"
        index = nvml.physical_index_for(0) if cuda and nvml.nvml_available() else None
        rec["env"] = {"CUDA_MODULE_LOADING_before": os.environ.get("CUDA_MODULE_LOADING"),
                      "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
                      "torch_installed": installed_version("torch")}
        import torch

        torch.backends.cudnn.benchmark = False
        rec["readings"]["before_init"] = _reading(torch, cuda, nvml, index)
        dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
        for step in STEPS[1:]:
            t = time.perf_counter()
            _run_step(step, torch, dev)
            rec["readings"][step] = {**_reading(torch, cuda, nvml, index), "seconds": time.perf_counter() - t}
            if step == "cuda_init" and cuda:
                props = torch.cuda.get_device_properties(dev)
                physical, how = nvml.physical_index_of_torch_device(props, 0)
                if physical is not None and physical != index:   # CUDA's order is not NVML's
                    index = physical
                ident = nvml.device_identity(physical) if physical is not None else None
                rec["identity"] = None if ident is None else {"name": ident.name, "driver_version": ident.driver_version,
                                                               "uuid": ident.uuid, "nvml_match": how}
                rec["env"].update(device_name=props.name, capability=[props.major, props.minor],
                                  total_memory=int(props.total_memory), cuda=torch.version.cuda,
                                  cudnn=torch.backends.cudnn.version(), torch=torch.__version__,
                                  CUDA_MODULE_LOADING_after_init=os.environ.get("CUDA_MODULE_LOADING"))
            _write(out, rec)
        _measure_layers(torch, dev, specs, rec, out)
    except Exception as exc:  # the parent reports it
        rec["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
    rec["seconds"] = time.perf_counter() - t0
    _write(out, rec)
    return 0


# ---------------------------------------------------------------- parent

def run_child(args: argparse.Namespace, specs: list[dict[str, Any]], scratch: Path) -> dict[str, Any]:
    """The child in a fresh interpreter (nothing has touched CUDA there), its files in ``scratch``;
    its record, ``error`` set on a failure or when it reached ``--child-timeout``."""
    spec_path = scratch / "gpu_outside_layers.json"
    spec_path.write_text(json.dumps(specs))
    rec_path = scratch / "gpu_outside_child.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--device", args.device, "--out-dir", str(scratch),
           "--specs", str(spec_path)]
    error = None
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.child_timeout)
        if proc.returncode != 0:
            error = f"child exit status {proc.returncode}: {proc.stderr.strip().splitlines()[-1:] or ''}"
    except subprocess.TimeoutExpired:
        error = f"child reached its limit of {args.child_timeout:.0f} s"
    try:
        rec = json.loads(rec_path.read_text())
    except (OSError, ValueError):
        rec = {"readings": {}, "layers": [], "error": None}
    rec["error"] = rec.get("error") or error
    return rec


def _sm(child: dict[str, Any]) -> str:
    cap = (child.get("env") or {}).get("capability")
    return f"sm{cap[0]}{cap[1]}" if cap else "sm80"


def evaluate(child: dict[str, Any]) -> dict[str, Any]:
    """The derived figures: per reading the memory outside the allocator (:func:`outside_figures`),
    what each step added, and per layer call oomtune's predictions next to the measured requests."""
    readings = child.get("readings") or {}
    base = (readings.get("before_init") or {}).get("nvml_used")
    for r in readings.values():
        r.update(outside_figures(r, base))
    sm = _sm(child)
    for layer in child.get("layers") or []:
        preds = {rule: predicted_requests(layer["spec"], rule, sm) for rule in ("implicit", "gemm")}
        for call in layer["calls"]:
            call["predicted"] = {rule: p[call["call"]] for rule, p in preds.items()}
    return {"deltas_meminfo": step_deltas(readings), "deltas_nvml": step_deltas(readings, "outside_nvml"),
            "sm": sm}


def table_context(child: dict[str, Any]) -> dict[str, Any]:
    """The CUDA context row the table gives this stack (:func:`oomtune.gpu.outside.outside_allocator`
    for the device's CUDA major, module loading and compute capability), to compare with the
    ``tensor`` step's reading (that row's own measurement)."""
    from oomtune.gpu.outside import outside_allocator

    env = child.get("env") or {}
    major = int(str(env["cuda"]).split(".")[0]) if env.get("cuda") else 12
    lazy = (env.get("CUDA_MODULE_LOADING_after_init") or "LAZY").upper() == "LAZY"
    cap = tuple(env["capability"]) if env.get("capability") else None
    est = outside_allocator(cuda_major=major, lazy_loading=lazy, capability=cap, cudnn=True)
    return {"bytes": est.total_bytes, "source": est.sources[0], "not_counted": list(est.unsourced)}


def _mib(v: Any) -> str:
    return "-" if v is None else f"{v / _MiB:.1f}"


def _size(v: int) -> str:
    return f"{v / _MiB:.2f} MiB" if v >= _MiB else f"{v / 1024:.1f} KiB"


def _sizes(values: list[int] | None) -> str:
    if values is None:
        return "-"
    return "none" if not values else ", ".join(_size(v) for v in values)


def markdown(doc: dict[str, Any]) -> str:
    """The short report of a run (figures in MiB)."""
    child = doc.get("child") or {}
    env = child.get("env") or {}
    readings = child.get("readings") or {}
    derived = doc.get("derived") or {}
    lines = [f"# Memory outside the caching allocator and cuDNN workspaces ({doc.get('device')})", ""]
    where = "real device" if doc.get("device") == "cuda" else "CPU dry run: no device figures"
    lines += [f"Source of every figure: {where}. Device {env.get('device_name', '-')}, capability "
              f"{env.get('capability', '-')}, torch {env.get('torch', env.get('torch_installed', '-'))}, CUDA "
              f"{env.get('cuda', '-')}, cuDNN {env.get('cudnn', '-')}, CUDA_MODULE_LOADING "
              f"{env.get('CUDA_MODULE_LOADING_after_init', '-')}; identity {child.get('identity')}.", ""]
    if child.get("error"):
        lines += [f"Child error: {child['error']}", ""]
    lines += ["| step | nvml used | meminfo used | reserved | outside (meminfo) | outside (NVML) | outside (process) "
              "| step added (meminfo) |", "|---|---|---|---|---|---|---|---|"]
    for step in STEPS:
        r = readings.get(step) or {}
        lines.append(f"| {step} | {_mib(r.get('nvml_used'))} | {_mib(r.get('meminfo_used'))} | {_mib(r.get('reserved'))} "
                     f"| {_mib(r.get('outside_meminfo'))} | {_mib(r.get('outside_nvml'))} | "
                     f"{_mib(r.get('outside_process'))} | {_mib((derived.get('deltas_meminfo') or {}).get(step))} |")
    table = doc.get("table_context") or {}
    lines += ["", f"Table (oomtune/gpu/outside.py) for this stack: {_mib(table.get('bytes'))} MiB ({table.get('source')}); "
              f"compare with the `tensor` step's outside (meminfo): "
              f"{_mib((readings.get('tensor') or {}).get('outside_meminfo'))} MiB.", ""]
    lines += [f"cuDNN workspace requests (in order; cudnn.benchmark False; predicted for {derived.get('sm')} on a "
              "roomy device):", "", "| layer | input | out ch, kernel, stride | call | it | measured transients | "
              "kept | ooms | implicit | gemm |", "|---|---|---|---|---|---|---|---|---|---|"]
    for n, layer in enumerate(child.get("layers") or []):
        s = layer["spec"]
        arch = s["row"].split("arch:")[1].split("_")[0]
        for call in layer["calls"]:
            m = call.get("measured") or {}
            p = call.get("predicted") or {}
            lines.append(f"| {n} {arch} #{s['index']} | {s['input']} | {s['out_channels']}, {s['kernel'][0]}, "
                         f"{s['stride'][0]} | {call['call']} | {call['iteration']} | "
                         f"{_sizes(m.get('transient_bytes') if m else None)} | {_sizes(m.get('kept_bytes') if m else None)} | "
                         f"{m.get('ooms', '-') if m else '-'} | {_sizes(p.get('implicit'))} | {_sizes(p.get('gemm'))} |")
        if layer.get("error"):
            lines.append(f"| {n} | error: {layer['error']} | | | | | | | | |")
    rows = doc.get("proposed_rows") or []
    lines += ["", "Rows proposed for oomtune/gpu/outside.py (docs/limits.md: how a reading becomes a row):", ""]
    lines += [f"    {r}" for r in rows] or ["    none (no device figures)"]
    cache = doc.get("cache_entry")
    lines += ["", f"outside_allocator.json a trial on this device would keep (largest outside (meminfo) reading): "
              f"{json.dumps(cache['file']) if cache else 'none (no device identity)'}", ""]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda: the measurement; cpu: dry run (no figures, small layers)")
    p.add_argument("--out-dir", default=None, help="results directory (default experiments/results)")
    p.add_argument("--child-timeout", type=float, default=30.0, help="the measuring child's limit, seconds")
    p.add_argument("--render", default=None, metavar="JSON", help="write the markdown again from a gpu_outside.json")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--specs", default=None, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    """Measure (or dry-run) and write gpu_outside.json and .md; 0 when the child measured every step
    and layer without error, else 1."""
    args = _parser().parse_args(argv)
    results = Path(args.out_dir).resolve() if args.out_dir else RESULTS
    if args.child:
        return child_main(args)
    if args.render:
        doc = json.loads(Path(args.render).read_text())
        head = "".join(f"# {k}: {doc.get(k)}\n" for k in ("command", "commit", "date", "machine", "load"))
        (results / "gpu_outside.md").write_text(head + markdown(doc))
        return 0
    prov = provenance(None if argv is None else [__file__, *argv])   # before measuring: refuses a dirty tree
    results.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    specs = layer_specs(dry_run=args.device == "cpu")
    print(f"gpu_outside: device={args.device}, {len(specs)} layers, child limit {args.child_timeout:.0f} s", flush=True)
    with tempfile.TemporaryDirectory(prefix="gpu_outside-") as tmp:
        child = run_child(args, specs, Path(tmp))
        derived = evaluate(child)
        outside = [r.get("outside_meminfo") for r in (child.get("readings") or {}).values()
                   if r.get("outside_meminfo") is not None]
        cache = cache_entry(child.get("identity"), (child.get("env") or {}).get("torch_installed"),
                            max(outside) if outside else None, Path(tmp) / "cache")
    doc = {**prov, "device": args.device, "child": child, "derived": derived, "table_context": table_context(child),
           "cache_entry": cache, "seconds": time.perf_counter() - t0}
    doc["proposed_rows"] = proposed_rows(doc)
    (results / "gpu_outside.json").write_text(json.dumps(doc, indent=1, default=str))
    head = "".join(f"# {k}: {v}\n" for k, v in prov.items())
    (results / "gpu_outside.md").write_text(head + markdown(doc))
    complete = (not child.get("error") and set(child.get("readings") or {}) == set(STEPS)
                and len(child.get("layers") or []) == len(specs) and not any(l.get("error") for l in child["layers"]))
    print(f"gpu_outside: {'complete' if complete else 'INCOMPLETE'} in {doc['seconds']:.1f} s"
          f"{': ' + child['error'] if child.get('error') else ''}", flush=True)
    return 0 if complete else 1


if __name__ == "__main__":
    sys.exit(main())
