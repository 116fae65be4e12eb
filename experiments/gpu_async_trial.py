"""One trial under ``backend:cudaMallocAsync`` on the GPU, through oomtune's own trial runner.

The virtual GPU models the native caching allocator only, so nothing but a device run checks that a
trial with the driver's stream-ordered allocator starts, is spawned (torch reads ``backend`` at
import, so the fork server cannot run it), reports the backend in effect and is measured::

    PYTHONPATH=$PWD python experiments/gpu_async_trial.py --out-dir experiments/results

ResNet-50 (224x224, 1000 classes, SGD), batch 32, 1 warm-up + 3 measured steps, budget 0.99 of the
device (a near-full budget: the trial's memory fraction is taken from torch's total).
Writes ``gpu_async_trial.json`` (the command, the commit, the trial record and the verdict) and keeps
the trial's directory (``gpu_async/``). Dry run on CPU (``--device cpu``): the virtual GPU cannot run
cudaMallocAsync, so a tiny ResNet-18 runs the native allocator instead and the file says so.
Exit 0 when the trial ran ok with the asked backend in effect, else 1.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # experiments/_provenance.py
from _provenance import provenance  # noqa: E402  (command + commit of every results file)

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "experiments" / "results"
GPU_MODEL = {"name": "resnet", "depth": 50, "image_size": 224, "num_classes": 1000, "optimizer": "sgd",
             "precision": "fp32", "data": {"source": "synthetic"}, "target": {"name": "builtin"}}
CPU_MODEL = {"name": "resnet", "depth": 18, "image_size": 32, "num_classes": 10, "optimizer": "sgd",
             "precision": "fp32", "data": {"source": "synthetic"}, "target": {"name": "builtin"}}
ASYNC = "backend:cudaMallocAsync"


def verdict(record: dict, conf: str, *, cuda: bool) -> tuple[bool, str]:
    """(ok, why): the trial ran ok and the backend asked for is the one torch parsed and, on CUDA, the
    one the allocator reports in effect (``settings_effective``)."""
    from oomtune.trial.record import TrialResult

    res = TrialResult.from_dict(record)   # the current shape, or an earlier one in its documented reading
    if res.outcome.value != "ok":
        return False, f"outcome {res.outcome.value}: {res.message}"
    parsed = res.allocator.torch_alloc_conf
    if parsed != conf:
        return False, f"torch parsed {parsed!r}, not {conf!r}"
    if cuda:
        effective = (res.settings_effective or {}).get("backend")
        if effective != "cudaMallocAsync":
            return False, f"the allocator reports backend {effective!r}"
        if res.process.launcher != "spawn":
            return False, "a cudaMallocAsync trial must be spawned (torch reads backend at import)"
    return True, "ran ok with the backend in effect"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: dry run (native backend)")
    p.add_argument("--out-dir", default=None, help="results directory (default experiments/results)")
    p.add_argument("--timeout", type=float, default=30.0, help="the trial's limit, seconds")
    p.add_argument("--budget", default="0.99", help="budget= as oomtune reads it (a fraction of the device)")
    args = p.parse_args(argv)
    prov = provenance(None if argv is None else [__file__, *argv])   # at the start: refuses a dirty tree
    cuda = args.device == "cuda"
    out = Path(args.out_dir).resolve() if args.out_dir else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    from oomtune.device import resolve_budget, resolve_device
    from oomtune.trial.record import TrialSpec
    from oomtune.trial.runner import TrialRunner

    device = resolve_device("cuda:0" if cuda else "cpu")
    budget = resolve_budget(args.budget, device)
    conf = ASYNC if cuda else ""
    spec = TrialSpec(workload=GPU_MODEL if cuda else CPU_MODEL, batch_size=32 if cuda else 4, alloc_conf=conf,
                     device=device.spec, budget_bytes=budget,
                     device_memory_bytes=None if cuda else device.total_memory_bytes,
                     warmup_steps=1, measure_steps=3, timeout_s=args.timeout)
    workdir = out / "gpu_async" / "trial"
    shutil.rmtree(workdir, ignore_errors=True)
    with TrialRunner(launcher="auto") as runner:
        record = runner.run(spec, workdir=workdir).to_dict()
    ok, why = verdict(record, conf, cuda=cuda)
    doc = {**prov, "device": device.name, "budget_bytes": budget, "alloc_conf": conf,
           "dry_run": not cuda, "verdict": "PASS" if ok else "FAIL", "why": why, "record": record}
    if not cuda:
        doc["note"] = "dry run on CPU: the virtual GPU cannot run cudaMallocAsync; the native allocator ran instead"
    (out / "gpu_async_trial.json").write_text(json.dumps(doc, indent=1, default=str))
    print(f"gpu_async_trial: {doc['verdict']} ({why}); {conf or 'native'} batch {spec.batch_size} on "
          f"{device.name}, budget {budget} bytes; outcome {record.get('outcome')}, launcher "
          f"{(record.get('extra') or {}).get('launcher')}, "
          f"peak reserved {(record.get('memory') or {}).get('peak_reserved_bytes')}",
          flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
