"""The search's outputs: best.yaml, trials.json and the final table (report stage of the pipeline)."""

from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path
from typing import Any

from oomtune import __version__
from oomtune.best import BestConfig, Choice, write_best
from oomtune.search import records as R
from oomtune.trial.record import TrialResult
from oomtune.units import format_bytes

__all__ = ["write_outputs", "versions"]


def versions(device: Any) -> dict[str, Any]:
    """oomtune, torch, CUDA (torch's build), driver (NVML) and Optuna versions."""
    import optuna
    import torch

    return {"oomtune": __version__, "torch": str(torch.__version__), "cuda": torch.version.cuda,
            "driver": getattr(device, "driver_version", None), "optuna": optuna.__version__}


def _metrics(res: TrialResult) -> dict[str, Any]:
    return {
        "throughput": res.throughput, "step_time_s": res.step_time_s,
        "peak_allocated_bytes": res.peak_allocated_bytes, "peak_reserved_bytes": res.peak_reserved_bytes,
        "peak_active_bytes": res.peak_active_bytes, "fragmentation": res.fragmentation,
        "device_peak_bytes": res.device_peak_bytes, "num_alloc_retries": res.num_alloc_retries,
        "data_wait_fraction": res.data_wait_fraction, "memory_source": res.memory_source,
        "steps": res.steps,
    }


def _choice(trial: Any, res: TrialResult, confirmed: bool) -> Choice:
    settings = {k: v for k, v in trial.params.items()
                if k != "batch_size" and not k.startswith("data.") and v is not None}
    return Choice(batch_size=int(trial.params["batch_size"]), alloc_conf=trial.user_attrs.get(R.ATTR_CONF, ""),
                  settings=settings, metrics=_metrics(res), confirmed=confirmed,
                  predicted_peak_reserved_bytes=trial.user_attrs.get(R.ATTR_PREDICTED),
                  trial_number=trial.number)


def _with_loader(model: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """The model config with the winner's searched data-loader settings (``data.*`` params)."""
    loader = {k[len("data."):]: v for k, v in params.items() if k.startswith("data.")}
    if loader:
        model = {**model, "data": {**(model.get("data") or {}), **loader}}
    return model


def _ratio(a: int | None, b: int | None) -> float | None:
    return a / b if a and b else None


def _workload_record(workload: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """best.yaml's workload: {model, target} for built-in workloads (with the winner's searched
    loader settings), {target} for target=python|cmd."""
    target = workload["target"]
    if target.get("name") != "builtin":
        return {"target": target}
    model = {k: v for k, v in workload.items() if k != "target"}
    return {"model": _with_loader(model, params), "target": target}


def write_outputs(cfg: Any, run_dir: Path, study: Any, summary: Any, device: Any, budget_bytes: int,
                  url: str, console: Any, *, predictor: Any = None, space: Any = None,
                  workload: dict[str, Any]) -> Path:
    """Write trials.json and best.yaml into the run dir and print the final table.

    Raises:
        oomtune.search.driver.SetupFault: no configuration ran within the budget (nothing to write).
    """
    from oomtune.display import trial_rows, trial_table
    from oomtune.search.driver import SetupFault

    rows = trial_rows(study.get_trials(deepcopy=False))
    (run_dir / "trials.json").write_text(json.dumps(rows, indent=1, default=str))
    best_no = summary.best.number if summary.best is not None else None
    console.print(trial_table(rows, title=f"study {study.study_name}", best_number=best_no))
    if summary.best is None:
        raise SetupFault(
            "no configuration ran within the budget: every trial ran out of memory or failed "
            f"(see {run_dir / 'trials.json'}); lower search.batch_size.low or raise budget"
        )
    best = _choice(summary.best, summary.best_result, summary.confirmed)
    baseline = gain = None
    if summary.baseline is not None:
        baseline = _choice(summary.baseline, R.result_of(summary.baseline), False)
        # Like with like: both throughputs as measured in their search trials (the winner's
        # confirmation ran more steps in a clean process and is reported in best.metrics).
        best_measured, base_measured = summary.best.value, summary.baseline.value
        if best_measured and base_measured:
            gain = {"throughput_ratio": best_measured / base_measured,
                    "batch_size_ratio": best.batch_size / baseline.batch_size,
                    "peak_reserved_ratio": _ratio(best.metrics["peak_reserved_bytes"],
                                                  baseline.metrics["peak_reserved_bytes"])}
    if predictor is not None:
        # The raw (uncalibrated) virtual-GPU prediction: `oomtune check --mode predict` re-traces the
        # workload and compares against exactly this number.
        best.predicted_peak_reserved_bytes = predictor.predict_raw(best.batch_size, best.alloc_conf)
    config = BestConfig(
        schema_version=1,
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        workload=_workload_record(workload, summary.best.params),
        device={"kind": device.kind, "name": device.name, "total_memory_bytes": device.total_memory_bytes,
                "budget_bytes": budget_bytes, "headroom": float(cfg.search.headroom),
                "memory_source": device.memory_source, "uuid": device.uuid, "pci_bus_id": device.pci_bus_id},
        versions=versions(device), best=best, baseline=baseline, gain=gain,
        study={"storage": url, "study_name": study.study_name, "trials": len(study.trials),
               "outcomes": summary.outcomes, "launches": summary.launches,
               "launches_saved": summary.launches_saved},
        diagnosis=None if summary.verdict is None else {
            "input_bound": summary.verdict.input_bound, "reason": summary.verdict.reason,
            "advice": summary.verdict.advice},
    )
    path = write_best(config, run_dir / "best.yaml")
    src = best.metrics["memory_source"]
    console.print(
        f"best: batch {best.batch_size}, {best.alloc_conf or '(default allocator)'}: "
        f"{best.metrics['throughput']:.1f} samples/s, peak reserved "
        f"{format_bytes(best.metrics['peak_reserved_bytes'])} ({src})"
        f"{', confirmed in a clean process' if best.confirmed else ''}", highlight=False, markup=False)
    if gain and summary.best.number == summary.baseline.number:
        console.print(f"the default allocator won: no allocator setting beat it at batch {baseline.batch_size}",
                      highlight=False, markup=False)
    elif gain:
        console.print(
            f"vs the default allocator at its largest batch ({baseline.batch_size}): "
            f"{gain['throughput_ratio']:.2f}x throughput ({summary.best.value:.1f} vs "
            f"{summary.baseline.value:.1f} samples/s in their search trials; the figure above is the "
            "confirmation run's)" if best.confirmed else
            f"vs the default allocator at its largest batch ({baseline.batch_size}): "
            f"{gain['throughput_ratio']:.2f}x throughput", highlight=False, markup=False)
    if summary.verdict is not None and summary.verdict.input_bound:
        console.print(f"input-bound: {summary.verdict.reason}", highlight=False, markup=False)
        console.print(f"advice: {summary.verdict.advice} (a bigger batch will not help)",
                      highlight=False, markup=False)
    console.print(f"trial processes: {summary.launches} launched, {summary.launches_saved} saved by "
                  f"prediction or reuse", highlight=False, markup=False)
    if device.simulated:
        console.print("note: trials trained on the CPU; memory figures come from the virtual GPU "
                      "(simulated) and throughput is the CPU's, so allocator settings change memory "
                      "here, not speed", highlight=False, markup=False)
    console.print(f"wrote {path}", highlight=False, markup=False)
    return path
