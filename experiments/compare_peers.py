"""Peers side by side: Lightning's BatchSizeFinder (power and binsearch),
Accelerate's find_executable_batch_size and `oomtune search`, on the same workload and budget, on
the virtual GPU (every memory figure simulated).

Each peer runs its released package (``pip install -e ".[peers]"``: lightning, accelerate), unchanged,
in its own process on the CPU, with the virtual GPU (the same ``CachingAllocatorSim`` as oomtune's
trials: torch's default allocator, a device of ``virtual_device_memory`` with the budget as a memory
fraction) recording every storage of the whole tuning run. The simulated out-of-memory error is a
``torch.OutOfMemoryError`` whose text starts "CUDA out of memory", which both peers recognise through
their own code (Lightning ``is_oom_error``, Accelerate ``should_reduce_batch_size``: checked below
before anything runs). Between tries the peers empty the CUDA cache (Lightning
``garbage_collection_cuda``, Accelerate ``clear_device_cache``): ``torch.cuda.empty_cache`` is routed
to the virtual GPU's ``empty_cache`` for that, and Accelerate's ``clear_device_cache`` is told CUDA is
available (on a CPU it would otherwise skip ``empty_cache``: it checks ``is_cuda_available()``; only
that name in ``accelerate.utils.memory`` is changed). A try that runs out of memory inside
``backward()`` returns its memory when its exception is released, as on CUDA (the virtual GPU drops
the failed graph's tasks from the CPU autograd queue: :mod:`oomtune.capture.virtual_gpu`); before
that fix every Accelerate try after the first failed one ran out of memory (889 MiB of the failed
batch-512 graph stayed allocated).

Reported per tool: batch found, allocator settings, whether the answer survives a clean run (an
oomtune trial in a fresh process for ``trial.confirm_steps`` steps under the same budget) and the
virtual-GPU soak of ``trial.soak_steps`` steps (:mod:`oomtune.trial.soak_check`), tries
(batch sizes run: in-process tries for the peers, trial processes for oomtune), wall time.

Run: python experiments/compare_peers.py [--budget 1GiB] [--workloads resnet,transformer] [--tools lightning-power,...]
Writes experiments/results/compare_peers.txt (first lines: the command and the commit).
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

# Every search here captures afresh: no stream cache left by another run (oomtune.plan.stream_cache).
os.environ["OOMTUNE_CACHE_DIR"] = "off"

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "experiments"))
from _provenance import header, write_results  # noqa: E402  (the first lines of every results file)

RESULTS = REPO / "experiments" / "results" / "compare_peers.txt"
TOOLS = ("lightning-power", "lightning-binsearch", "accelerate", "oomtune")
WORKLOADS = {"resnet": ["model=resnet"],   # the README main command's workload (ResNet-18, 64x64)
             "transformer": ["model=transformer"],  # the built-in decoder LM, seq_len 256
             "tiny": ["model=resnet", "model.image_size=32", "model.num_classes=10"]}  # smoke test
LOW, HIGH = 8, 512                        # oomtune's default batch range, given to every tool
STEPS = 4                                 # steps per try: oomtune's warm-up 1 + measure 3


# ------------------------------------------------------------------ in the peer's own process
def _setup(overrides: list[str], budget: str):
    """The workload config, the virtual GPU and its context, as an oomtune trial would see them."""
    from oomtune import config as C
    from oomtune.alloc.settings import AllocatorSettings
    from oomtune.capture.virtual_gpu import VirtualGPU, budgeted_sim
    from oomtune.device import resolve_budget, resolve_device
    from oomtune.schema import typed
    from oomtune.search.run import search_workload

    cfg = C.compose([*overrides, f"budget={budget}", "device=cpu"])
    device = resolve_device("cpu", virtual_device_memory=cfg.virtual_device_memory)
    budget_bytes = resolve_budget(cfg.budget, device)
    sim = budgeted_sim(AllocatorSettings.parse(""), budget_bytes, device.total_memory_bytes)
    return search_workload(typed(cfg)).to_dict(), sim, VirtualGPU(sim, device="cpu")


def _route_empty_cache(sim) -> None:
    import torch

    torch.cuda.empty_cache = sim.empty_cache  # what the peers call between tries, on the virtual GPU
    try:
        import accelerate.utils.memory as acc_memory
    except ImportError:  # Lightning's process needs no accelerate
        return
    acc_memory.is_cuda_available = lambda: True  # clear_device_cache: gc.collect(), then empty_cache as on CUDA


def _check_recognised() -> None:
    """Both peers must recognise the virtual GPU's out-of-memory error through their own code."""
    from accelerate.utils.memory import should_reduce_batch_size
    from lightning.pytorch.utilities.memory import is_oom_error

    from oomtune.capture.virtual_gpu import budgeted_sim

    sim = budgeted_sim("", 1 << 20, 1 << 30)
    try:
        sim.malloc(2 << 20)
    except Exception as exc:  # noqa: BLE001 - the simulated torch.OutOfMemoryError
        if not (is_oom_error(exc) and should_reduce_batch_size(exc)):
            raise SystemExit(f"a peer does not recognise the simulated OOM: {exc!r}")
        return
    raise SystemExit("the virtual GPU did not run out of memory")


def run_accelerate(overrides: list[str], budget: str) -> dict:
    """Accelerate's documented pattern: build everything inside the decorated function; it retries
    at 0.9x the batch on out-of-memory, starting from the top of the range."""
    import torch
    from accelerate.utils import find_executable_batch_size

    from oomtune.workloads import build_workload

    workload, sim, vgpu = _setup(overrides, budget)
    _route_empty_cache(sim)
    tries: list[dict] = []

    @find_executable_batch_size(starting_batch_size=HIGH)
    def train(batch_size: int) -> int:
        tries.append({"batch": batch_size, "ok": False})
        torch.manual_seed(0)
        wl = build_workload({k: v for k, v in workload.items() if k != "target"}, batch_size, "cpu")
        vgpu.register(wl.tensors_before_step())
        for _ in range(STEPS):
            wl.step(next(wl.batches()))
        tries[-1]["ok"] = True
        return batch_size

    with vgpu:
        batch = train()
    return {"batch": batch, "tries": tries}


def run_lightning(overrides: list[str], budget: str, mode: str) -> dict:
    """Lightning's Tuner.scale_batch_size (BatchSizeFinder) on a LightningModule wrapping the same
    model, loss and optimizer; ``steps_per_trial`` = the trial's steps, from the range's low end, up
    to Lightning's own ``max_val`` (8192: with max_val=512 power mode returns 512 without running it)."""
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.tuner import Tuner
    from torch.utils.data import DataLoader, Dataset

    from oomtune.workloads import build_workload

    workload, sim, vgpu = _setup(overrides, budget)
    _route_empty_cache(sim)
    cfg = {k: v for k, v in workload.items() if k != "target"}
    proto = build_workload(cfg, 1, "cpu")
    n = HIGH * STEPS
    host_x, host_y = proto.spec.make_batch(n, torch.device("cpu"))  # host data: outside the virtual GPU
    tries: list[dict] = []
    steps_run: list[int] = []

    class Data(Dataset):
        def __len__(self) -> int:
            return n

        def __getitem__(self, i: int):
            return host_x[i], host_y[i]

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = build_workload(cfg, 1, "cpu").model
            self.batch_size = LOW

        def train_dataloader(self):
            return DataLoader(Data(), batch_size=self.batch_size, shuffle=False)

        def on_train_start(self) -> None:  # one per fit the finder runs: a try
            tries.append({"batch": self.batch_size})

        def training_step(self, batch, _):
            steps_run.append(self.batch_size)
            x, y = batch  # the loss of oomtune's step (oomtune.workloads.loop.Workload.step)
            return torch.nn.functional.cross_entropy(self.net(x).flatten(0, -2).float(), y.flatten())

        def configure_optimizers(self):
            return proto.optimizer.__class__(self.parameters(), **{k: v for k, v in proto.optimizer.defaults.items()
                                                                   if k in ("lr", "momentum")})

    import lightning.fabric.utilities.cloud_io as cloud_io
    from torch.utils._python_dispatch import _disable_current_modes

    load = cloud_io._load

    def host_load(*a, **kw):  # the finder restores its checkpoint into host memory (map_location cpu)
        with _disable_current_modes():
            return load(*a, **kw)

    import lightning.fabric.plugins.io.torch_io as torch_io

    cloud_io._load = torch_io.pl_load = host_load
    model = Lit()
    with tempfile.TemporaryDirectory() as tmp:
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp)
        with vgpu:
            vgpu.register(list(model.parameters()) + list(model.buffers()))
            batch = Tuner(trainer).scale_batch_size(model, mode=mode, steps_per_trial=STEPS, init_val=LOW,
                                                    max_trials=25)  # Lightning's own max_val (8192)
    return {"batch": batch, "tries": tries, "steps_run": steps_run,
            "sim_peak_reserved_bytes": sim.memory_stats()["reserved_bytes.all.peak"]}


# ------------------------------------------------------------------ the parent
def _peer(tool: str, workload: str, budget: str) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--peer", tool, "--workload", workload, "--budget", budget],
                          capture_output=True, text=True, cwd=REPO)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        return {"tool": tool, "error": proc.stderr.strip().splitlines()[-1:] or ["?"], "wall_s": wall}
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"tool": tool, "batch": out["batch"], "alloc_conf": "", "tries": len(out["tries"]),
            "tried": [t["batch"] for t in out["tries"]], "wall_s": wall}


def _oomtune(workload: str, budget: str, run_dir: Path) -> dict:
    import yaml

    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "oomtune", "search", *WORKLOADS[workload], f"budget={budget}",
                           "device=cpu", f"hydra.run.dir={run_dir}"], capture_output=True, text=True, cwd=REPO)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        return {"tool": "oomtune", "error": proc.stderr.strip().splitlines()[-1:], "wall_s": wall}
    best = yaml.safe_load((run_dir / "best.yaml").read_text())
    return {"tool": "oomtune", "batch": best["best"]["batch_size"], "alloc_conf": best["best"]["alloc_conf"],
            "tries": best["study"]["launches"], "wall_s": wall, "objective": best["objective"]["name"]}


def _clean_run(workload: str, budget: str, batch: int, alloc_conf: str, work: Path) -> dict:
    """The answer in a fresh process for trial.confirm_steps steps under the same budget."""
    from oomtune import config as C
    from oomtune.device import resolve_budget, resolve_device
    from oomtune.study.records import MemoryLimit
    from oomtune.schema import typed
    from oomtune.search.run import search_workload
    from oomtune.trial.record import TrialSpec
    from oomtune.trial.runner import TrialRunner

    cfg = C.compose([*WORKLOADS[workload], f"budget={budget}", "device=cpu"])
    device = resolve_device("cpu", virtual_device_memory=cfg.virtual_device_memory)
    budget_bytes = resolve_budget(cfg.budget, device)
    spec = TrialSpec(workload=search_workload(typed(cfg)).to_dict(), batch_size=batch, alloc_conf=alloc_conf, device="cpu",
                     budget_bytes=budget_bytes, warmup_steps=int(cfg.trial.warmup_steps),
                     measure_steps=int(cfg.trial.confirm_steps), timeout_s=float(cfg.trial.timeout) * 4,
                     device_memory_bytes=device.total_memory_bytes, soak_steps=int(cfg.trial.soak_steps))
    res = TrialRunner(launcher="spawn").run(spec, workdir=work)
    limit = MemoryLimit(budget_bytes, float(cfg.search.headroom)).limit_bytes
    peak = res.memory.peak_reserved_bytes
    return {"outcome": res.outcome.value, "steps": cfg.trial.confirm_steps, "peak_reserved_bytes": peak,
            "within_headroom": peak is not None and peak <= limit, "soak_steps": int(cfg.trial.soak_steps),
            "soak_passed": res.soak.passed if res.soak is not None else None, "message": res.message}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", default="1GiB")
    ap.add_argument("--workloads", default="resnet")
    ap.add_argument("--tools", default=",".join(TOOLS))
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--peer", help=argparse.SUPPRESS)
    ap.add_argument("--workload", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.peer:  # inside one peer's process
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        overrides = WORKLOADS[args.workload]
        out = (run_accelerate(overrides, args.budget) if args.peer == "accelerate"
               else run_lightning(overrides, args.budget, args.peer.split("-", 1)[1]))
        print(json.dumps(out))
        return
    head = header().splitlines()   # at the start: refuses a dirty tree, reads the load
    _check_recognised()
    import accelerate
    import lightning
    import torch

    lines = [*head,
             f"# torch {torch.__version__}, lightning {lightning.__version__}, accelerate {accelerate.__version__}; "
             "each tool's load average at its start in its raw row (load_at_start)",
             "# all memory figures are SIMULATED (virtual GPU: CPU training, CachingAllocatorSim); wall times "
             "are this machine's CPU",
             "# tries: batch sizes run (peers: in one process; oomtune: trial processes launched); clean run: "
             "the answer in a fresh process for trial.confirm_steps steps under the same budget, then the "
             "virtual-GPU soak of trial.soak_steps steps (soak)", ""]
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="oomtune-peers-") as tmp:
        for workload in args.workloads.split(","):
            for tool in args.tools.split(","):
                load = round(os.getloadavg()[0], 1)
                r = (_oomtune(workload, args.budget, Path(tmp) / f"{workload}-oomtune") if tool == "oomtune"
                     else _peer(tool, workload, args.budget))
                r["workload"], r["load_at_start"] = workload, load
                if "batch" in r:
                    r["clean"] = _clean_run(workload, args.budget, r["batch"], r["alloc_conf"],
                                            Path(tmp) / f"{workload}-{tool}-clean")
                rows.append(r)
                print(json.dumps(r), flush=True)
                write_table(Path(args.out), lines, rows, args.budget)  # after each tool: a partial run leaves a file
    print(Path(args.out).read_text())


def write_table(path: Path, head: list[str], rows: list[dict], budget: str) -> None:
    """The results file: ``head`` (command, commit, notes), the table, then the raw JSON rows."""
    header = (f"{'workload':<9} {'tool':<20} {'batch':>5}  {'allocator settings':<34} {'clean run':<22} "
              f"{'soak':<7} {'peak resv (sim)':>15} {'tries':>5} {'wall s':>7}")
    lines = head + [f"budget {budget} (simulated), batch range {LOW}..{HIGH}", header, "-" * len(header)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['workload']:<9} {r['tool']:<20} error: {' '.join(r['error'])}")
            continue
        c = r["clean"]
        clean = c["outcome"] + ("" if c["outcome"] != "ok" else (" (in headroom)" if c["within_headroom"] else " (>headroom)"))
        soak = {True: "passed", False: "FAILED", None: "-"}[c.get("soak_passed")]
        peak = "-" if c["peak_reserved_bytes"] is None else f"{c['peak_reserved_bytes'] / 2**20:.0f} MiB"
        lines.append(f"{r['workload']:<9} {r['tool']:<20} {r['batch']:>5}  {r['alloc_conf'] or '(default)':<34} "
                     f"{clean:<22} {soak:<7} {peak:>15} {r['tries']:>5} {r['wall_s']:>7.1f}")
    lines += ["", "raw:"] + [json.dumps(r) for r in rows]
    write_results(path, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
