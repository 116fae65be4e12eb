"""The search's outputs: best.yaml, trials.json and the final table (report stage of the pipeline)."""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import os
from pathlib import Path
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from oomtune import __version__
from oomtune.best import WORKSPACE_ENV, BestConfig, Choice, load_best
from oomtune.study import records as R
from oomtune.trial.record import TrialResult
from oomtune.units import format_bytes
from oomtune.workload_spec import WorkloadSpec

if TYPE_CHECKING:
    from oomtune.schema import RootConf

__all__ = ["write_outputs", "versions", "write_recorded_best", "recorded_best", "BEST_ATTR"]

#: Study system attribute holding best.yaml's content, recorded once by the first worker to finish.
BEST_ATTR = "oomtune:best"


def write_recorded_best(study: Any, config: BestConfig, path: Path) -> Path:
    """Record ``config`` as the study's answer unless a worker already recorded one
    (:func:`oomtune.study.storage.record_once`: exactly one writer wins), then write the recorded
    answer to ``path`` (atomically). Every worker of a study, on any machine, therefore writes the
    same best.yaml, and ``oomtune best --storage URL --study NAME`` prints it again."""
    from oomtune.study.storage import record_once

    return _write_yaml(record_once(study, BEST_ATTR, json.loads(json.dumps(config.to_dict(), default=str))), path)


def recorded_best(study: Any) -> dict[str, Any] | None:
    """The best.yaml content recorded in the study, or None (no worker has finished yet)."""
    return study._storage.get_study_system_attrs(study._study_id).get(BEST_ATTR)


def _write_yaml(data: dict[str, Any], path: Path) -> Path:
    """``data`` as YAML to ``path`` (:func:`oomtune.files.write_atomic`; DiskFullError when full)."""
    import yaml

    from oomtune.files import write_atomic

    return write_atomic(path, yaml.safe_dump(data, sort_keys=False))


def versions(device: Any) -> dict[str, Any]:
    """oomtune, torch, CUDA (torch's build), driver (NVML) and Optuna versions; torch's two without
    importing it (:func:`oomtune.packages.torch_build`: a search of a script's trials never needs it here)."""
    import optuna

    from oomtune.packages import torch_build

    torch_version, cuda = torch_build()
    return {"oomtune": __version__, "torch": torch_version, "cuda": cuda,
            "driver": getattr(device, "driver_version", None), "optuna": optuna.__version__}


def _metrics(res: TrialResult) -> dict[str, Any]:
    """best.yaml's ``metrics``: the record's figures under their flat names (bytes, seconds)."""
    soak = res.soak
    return {
        "throughput": res.throughput.samples_per_s, "step_time_s": res.throughput.step_time_s,
        "peak_allocated_bytes": res.memory.peak_allocated_bytes, "peak_reserved_bytes": res.memory.peak_reserved_bytes,
        "peak_active_bytes": res.memory.peak_active_bytes, "fragmentation": res.memory.fragmentation,
        "device_peak_bytes": res.memory.device_peak_bytes, "num_alloc_retries": res.memory.num_alloc_retries,
        "data_wait_fraction": res.throughput.data_wait_fraction, "memory_source": res.memory.source,
        "steps": res.throughput.steps, "soak_passed": soak.passed if soak else None,
        "soak_steps_run": soak.steps_run if soak else None,
        "soak_peak_reserved_bytes": soak.peak_reserved_bytes if soak else None, **_rank_metrics(res),
    }


def _rank_metrics(res: TrialResult) -> dict[str, Any]:
    """A distributed trial's per-rank peaks for best.yaml: ``world_size``, ``worst_rank`` (whose peak
    the metrics are) and ``ranks``: per rank its peak reserved / allocated, NVML device peak and
    device UUID (bytes; None where not read). Empty for one process."""
    if not res.ranks:
        return {}
    keep = ("rank", "peak_reserved_bytes", "peak_allocated_bytes", "device_peak_bytes", "device_uuid")
    return {"world_size": res.distributed.world_size or len(res.ranks), "worst_rank": res.worst_rank,
            "ranks": [{k: getattr(r, k) for k in keep} for r in res.ranks]}


def answer_fraction(res: TrialResult, alloc_conf: str, mode: str = "auto") -> float | None:
    """The per-process memory fraction an answer needs (best.yaml ``memory_fraction``):
    the fraction its measuring trial ran under (``budget.memory_fraction``: the budget over the
    device, on a GPU corrected for the memory outside the allocator) when its settings rely on one
    (:func:`oomtune.best.needs_memory_fraction`: ``garbage_collection_threshold``); None otherwise,
    with ``search.memory_fraction=off``, or when the trial ran without a fraction < 1 (the threshold
    was inert there too, as it will be on the device)."""
    from oomtune.best import needs_memory_fraction

    if mode == "off" or not needs_memory_fraction(alloc_conf):
        return None
    fraction = res.budget.memory_fraction
    return float(fraction) if isinstance(fraction, (int, float)) and 0 < fraction < 1 else None


def _choice(trial: Any, res: TrialResult, confirmed: bool, measured_in: int | None, mode: str = "auto",
            space: Any = None) -> Choice:
    settings = {k: v for k, v in trial.params.items()
                if k not in ("batch_size", "activation_checkpointing") and not k.startswith("data.") and v is not None}
    conf = trial.user_attrs.get(R.ATTR_CONF, "")
    batch = int(trial.params["batch_size"])
    accum = space.grad_accum_for(batch) if space is not None else 1
    return Choice(batch_size=batch, alloc_conf=conf,
                  settings=settings, metrics=_metrics(res), confirmed=confirmed,
                  predicted_peak_reserved_bytes=trial.user_attrs.get(R.ATTR_PREDICTED),
                  trial_number=trial.number, metrics_trial_number=measured_in,
                  memory_fraction=answer_fraction(res, conf, mode), grad_accum=accum,
                  global_batch=None if space is None else space.global_batch,
                  activation_checkpointing=trial.params.get("activation_checkpointing"))


def measured_in(trials: list[Any], winner: Any, result: TrialResult | None, confirmed: bool) -> int | None:
    """The number of the trial whose measurement ``result`` is: ``winner`` itself when not
    confirmed, else the confirmation trial of ``winner`` (role ``confirm``, ``confirms`` = its number)
    that stored exactly ``result`` (with several clean runs, the one the search kept). None when no
    stored trial matches (not expected)."""
    if not confirmed:
        return winner.number
    for t in reversed(trials):
        if (t.user_attrs.get(R.ATTR_ROLE) == "confirm" and t.user_attrs.get(R.ATTR_CONFIRMS) == winner.number
                and R.result_of(t) == result):
            return t.number
    return None


def _with_loader(model: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """The model config with the winner's searched data-loader settings (``data.*`` params)."""
    loader = {k[len("data."):]: v for k, v in params.items() if k.startswith("data.")}
    if loader:
        model = {**model, "data": {**(model.get("data") or {}), **loader}}
    return model


def _workload_record(workload: WorkloadSpec, params: dict[str, Any], space: Any = None) -> dict[str, Any]:
    """best.yaml's workload (:meth:`oomtune.workload_spec.WorkloadSpec.best_record`): {model, target}
    for built-in workloads (with the winner's searched loader settings), {target} for target=python|cmd;
    plus ``training`` (the winner's ``grad_accum`` and ``activation_checkpointing``) when the search
    set them, and ``ranks`` (``trial.gpus``) for a trial of several ranks or a distributed workload:
    the answer holds per rank at that rank count."""
    training = {}
    if space is not None:
        cand = space.candidate(params["batch_size"], {k: v for k, v in params.items() if k != "batch_size"})
        training = dict(cand.apply(dataclasses.replace(workload, training={})).training)
    model = _with_loader(workload.model, params) if workload.model is not None else None
    return dataclasses.replace(workload, model=model, training=training).best_record()


def _target_gpu(workload: WorkloadSpec) -> dict[str, Any]:
    """The GPU whose kernels the captures ran (:func:`oomtune.capture.gpu_target.target_from_workload`)."""
    from oomtune.capture.gpu_target import target_from_workload

    return target_from_workload(workload).to_dict()


#: The file beside best.yaml holding the allocation stream a recorded target's prediction replayed.
PREDICTED_STREAM = "best_stream.bin"


def _keep_recorded_stream(best: Choice, predictor: Any, workload: WorkloadSpec, run_dir: Path,
                          variant: dict[str, Any]) -> None:
    """For a target oomtune cannot capture (``target=cmd`` and the HF / Lightning integrations: its
    predictions replay trials' recorded streams, :mod:`oomtune.plan.recorded`), write the stream the
    answer's prediction replayed to ``run_dir/best_stream.bin`` and name it (with its SHA-256) in
    best.yaml, so that ``oomtune check --mode predict`` can replay it again. Nothing for a capturable
    target (check re-traces the workload) or when the file cannot be written (the check then says
    that best.yaml records no stream)."""
    import hashlib

    from oomtune.trial._base import get_target

    if get_target(workload.target_name).capturable:
        return
    path = run_dir / PREDICTED_STREAM
    try:
        predictor.stream(best.batch_size, **variant).save(path)
        best.predicted_stream_sha256 = hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return
    best.predicted_stream = PREDICTED_STREAM


def write_outputs(conf: RootConf, run_dir: Path, study: Any, summary: Any, device: Any, budget_bytes: int,
                  url: str, console: Any, *, predictor: Any = None, predicted_at_worst_shape: bool = False,
                  space: Any = None,
                  workload: WorkloadSpec) -> Path:
    """Write trials.json and best.yaml into the run dir and print the final table; ``conf``: the
    search's config (:func:`oomtune.schema.typed`), ``workload``: its workload.

    Raises:
        oomtune.search.driver.SetupFault: no answer (nothing to write): no configuration ran within the
            budget, or every confirmation failed (:func:`no_answer_message` says which).
        DiskFullError: a file could not be written for lack of space (no temporary file is left).
    """
    from oomtune.display import fit_table, trial_rows, trial_table, trial_table_legend
    from oomtune.search.driver import SetupFault

    trials = study.get_trials(deepcopy=False)
    rows = trial_rows(trials)
    from oomtune.files import write_atomic

    write_atomic(run_dir / "trials.json", json.dumps(rows, indent=1, default=str))
    best_no = summary.best.number if summary.best is not None else None
    console.print(fit_table(trial_table(rows, title=f"study {study.study_name}", best_number=best_no), console.width))
    for line in trial_table_legend(rows):
        console.print(line, highlight=False, markup=False)
    if summary.best is None:
        raise SetupFault(no_answer_message(summary, run_dir / "trials.json"))
    mode = conf.search.memory_fraction
    best = _choice(summary.best, summary.best_result, summary.confirmed,
                   measured_in(trials, summary.best, summary.best_result, summary.confirmed), mode, space)
    baseline = None
    if summary.baseline is not None:
        baseline = _choice(summary.baseline, R.result_of(summary.baseline), False, summary.baseline.number, mode,
                           space)
    gain = summary.gain  # confirmation figures against the baseline's (oomtune.search.driver)
    for choice in (best, baseline):   # the trials' predictions came from the same (worst-shape) predictor
        if choice is not None and choice.predicted_peak_reserved_bytes is not None:
            choice.predicted_at_worst_shape = predicted_at_worst_shape
    if predictor is not None:
        # The raw (uncalibrated) virtual-GPU prediction: `oomtune check --mode predict` re-traces the
        # workload and compares against exactly this number.
        variant = {} if best.activation_checkpointing is None else {"checkpointing": best.activation_checkpointing}
        if getattr(predictor, "can_predict", lambda b, **kw: True)(best.batch_size, **variant):
            best.predicted_peak_reserved_bytes = predictor.predict_raw(best.batch_size, best.alloc_conf, **variant)
            best.predicted_steps = predictor.steps
            best.predicted_at_worst_shape = predicted_at_worst_shape
            if best.predicted_peak_reserved_bytes is not None:
                _keep_recorded_stream(best, predictor, workload, run_dir, variant)
    config = BestConfig(
        schema_version=1,
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        workload=_workload_record(workload, summary.best.params, space),
        device={"kind": device.kind, "name": device.name, "total_memory_bytes": device.total_memory_bytes,
                "budget_bytes": budget_bytes, "headroom": float(conf.search.headroom),
                "memory_source": device.memory_source, "uuid": device.uuid, "pci_bus_id": device.pci_bus_id,
                "target_gpu": _target_gpu(workload), "memory_fraction": mode,
                # sizes the cuBLAS workspaces the trials held (inherited from this process)
                "cublas_workspace_config": os.environ.get(WORKSPACE_ENV) or None},
        versions=versions(device), best=best, baseline=baseline, gain=gain,
        study={"storage": url, "study_name": study.study_name, "trials": len(study.trials),
               "outcomes": summary.outcomes, "launches": summary.launches,
               "launches_saved": summary.launches_saved},
        diagnosis=None if summary.verdict is None else {
            "input_bound": summary.verdict.input_bound, "reason": summary.verdict.reason,
            "advice": summary.verdict.advice},
        objective={"name": summary.objective, "reason": summary.objective_reason,
                   "at_top_of_range": summary.at_top_of_range},
        frontiers=[c.to_dict() for c in summary.frontiers],
    )
    path = write_recorded_best(study, config, run_dir / "best.yaml")
    best = load_best(path).best  # the study's recorded choice (another worker's when it was first)
    if summary.frontiers:
        console.print(fit_table(frontier_table(summary.frontiers, best.alloc_conf, simulated=device.simulated,
                                               best_ckpt=best.activation_checkpointing), console.width))
        for line in frontier_legend(summary.frontiers):
            console.print(line, highlight=False, markup=False)
    from oomtune.display import wrapped

    lines = list(summary.notes) + list(getattr(summary, "causes", ()))
    if getattr(summary, "timeout_note", None) and (summary.gain or {}).get("claimed"):
        lines.append(summary.timeout_note)
    lines += summary_lines(summary, best, baseline, simulated=device.simulated,
                           confirm_steps=conf.trial.confirm_steps, batch_high=conf.search.batch_size.high)
    if summary.verdict is not None and summary.verdict.input_bound:
        lines += [f"input-bound: {summary.verdict.reason}",
                  f"advice: {summary.verdict.advice} (a bigger batch will not help)"]
    lines.append(f"trial processes (whole study, every session of it): {summary.launches} launched, "
                 f"{summary.launches_saved} saved by prediction or reuse")
    if device.simulated and getattr(summary, "execute", "cpu") == "meta":
        lines.append("note: trials ran their steps on the meta device (no arithmetic); memory figures come from "
                     "the virtual GPU (simulated) and throughput was not measured")
    elif device.simulated and getattr(summary, "execute", "cpu") == "mixed":
        lines.append("note: some trials ran their steps on the meta device (no arithmetic, no throughput), others "
                     "on the CPU (each trial's execution.where says where); memory figures come from the "
                     "virtual GPU (simulated)")
    elif device.simulated:
        lines.append("note: trials trained on the CPU; memory figures come from the virtual GPU (simulated) "
                     "and throughput is the CPU's, so allocator settings change memory here, not speed")
    for line in lines:  # wrapped to 100 columns at spaces (the paths written below stay whole)
        for part in wrapped(line):
            console.print(part, highlight=False, markup=False)
    console.print(f"wrote {path}", highlight=False, markup=False)
    return path


def no_answer_message(summary: Any, trials_path: Path) -> str:
    """Why a search has no answer (``summary.best`` is None): the confirmations' failure when only they
    failed (``summary.confirm_failed``, :func:`oomtune.search.summary.confirmation_failure`: trials ran
    within the limit, so "no configuration ran within the budget" would be false), else
    :func:`nothing_fitted_message`; the search's ``causes`` appended either way."""
    causes = list(getattr(summary, "causes", ()))
    failed = getattr(summary, "confirm_failed", None)
    if failed:
        return f"{failed} (every trial: {trials_path})" + "".join(f"; {c}" for c in causes)
    return nothing_fitted_message(summary.outcomes, trials_path, causes=causes)


def nothing_fitted_message(outcomes: dict[str, int], trials_path: Path, *, causes: Sequence[str] = ()) -> str:
    """Why no configuration is the answer, with advice that matches how the trials ended:
    memory outcomes (and ``ok_over_limit``) -> lower the batch or raise the budget; a
    timeout, crash or error is not memory and gets its own class's advice
    (:data:`oomtune.classify.ADVICE`). ``outcomes``: the summary's counts by outcome; ``causes``:
    lines the search found about why (a hang of the command), appended."""
    from oomtune.classify import ADVICE
    from oomtune.outcome import Outcome
    from oomtune.search.summary import OK_OVER_LIMIT

    counts = {k: n for k, n in outcomes.items() if n and k != Outcome.OK.value}
    if not counts:
        return (f"no configuration ran within the budget: no trial finished with a result (see {trials_path}); "
                "check the run's trials/ folder")
    said = ", ".join(f"{n} {k}" for k, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
    memory = {k for k in counts if k == OK_OVER_LIMIT or (k in Outcome._value2member_map_ and (
        Outcome(k).is_memory or Outcome(k) is Outcome.PREDICTED_INFEASIBLE))}
    advice = []
    if memory:
        advice.append("memory: lower search.batch_size.low or raise budget")
    for k in sorted(set(counts) - memory - {"interrupted"}):
        if k in Outcome._value2member_map_:
            advice.append(f"{k}: {ADVICE[Outcome(k)]}")
    what = "ran out of memory or above the limit" if counts.keys() <= memory else "failed"
    text = f"no configuration ran within the budget: the trials {what} ({said}; see {trials_path})"
    return text + ("; " + "; ".join(advice) if advice else "") + "".join(f"; {c}" for c in causes)


def frontier_table(frontiers: list[Any], best_conf: str, *, simulated: bool = True,
                   best_ckpt: bool | None = None) -> Any:
    """Per allocator configuration (abbreviated: :func:`oomtune.display.short_conf`): the predicted
    frontier (largest batch within the limit on the virtual GPU) and the measured one (``352``:
    exact; ``>=456``: no failure measured above; ``<456``: failed there; ``-``: not probed), measured
    on the virtual GPU (``simulated``) or the device, the calibration (measured / predicted peak) and
    ``+N`` for the N configurations predicted identical that were folded into the row
    (:func:`frontier_legend` explains; named in best.yaml ``frontiers``)."""
    from rich import box
    from rich.table import Table

    from oomtune.display import short_conf

    table = Table(title="frontiers: largest batch within budget x (1 - headroom)", header_style="bold",
                  box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False, collapse_padding=True, show_edge=False)
    measured = "measured\n(sim)" if simulated else "measured\n(dev)"
    for name, justify in (("config", "left"), ("predicted\n(sim)", "right"), (measured, "right"),
                          ("calibration", "right"), ("same\nprediction", "right")):
        table.add_column(name, justify=justify, overflow="fold")
    for c in sorted(frontiers, key=lambda c: (-(c.predicted or 0), c.n_keys)):
        cal = c.calibration() if (c.ratios or c.ratio_floor) else None
        name = short_conf(c.alloc_conf) + (" +ckpt" if getattr(c, "checkpointing", None) else "")
        table.add_row(name, "-" if c.predicted is None else str(c.predicted),
                      c.measured_text(), "-" if cal is None else f"{cal:.3f}",
                      f"+{len(c.twins)}" if c.twins else "",
                      style="bold green" if c.alloc_conf == best_conf and c.checkpointing == best_ckpt else None)
    return table


def frontier_legend(frontiers: list[Any]) -> list[str]:
    """The lines under :func:`frontier_table`: the source labels, the ``same prediction`` column,
    and the abbreviations used."""
    from oomtune.display import FOLD_LEGEND, conf_legend, legend_lines

    lines = ["predicted (sim): on the virtual GPU, before any trial; calibration: measured / predicted peak",
             "measured: found by the trials, (sim) on the virtual GPU or (dev) on the device",
             "  N: exact (N fits, N+1 not); >=N: N fits, none above tried; <N: failed at N; A..B: between"]
    if any(c.twins for c in frontiers):
        lines += [FOLD_LEGEND, "  (not probed; named in best.yaml frontiers[].twins)"]
    if any(getattr(c, "checkpointing", None) for c in frontiers):
        lines.append("+ckpt: with activation checkpointing")
    used = conf_legend([c.alloc_conf for c in frontiers] + [t for c in frontiers for t in c.twins])
    if used:
        lines += legend_lines("config: ", used + "; default = torch's defaults")
    return lines


def summary_lines(summary: Any, best: Choice, baseline: Choice | None, *, simulated: bool,
                  confirm_steps: int, batch_high: int) -> list[str]:
    """The closing lines: the answer, its gain over the baseline (confirmation figures only, claimed
    only beyond the noise), the objective that decided, and a note when the batch is the range's top."""
    m = best.metrics
    src = m["memory_source"]
    speed = "" if m.get("throughput") is None else f"{m['throughput']:.1f} samples/s ({'CPU' if simulated else 'device'}), "
    figures = f"{speed}peak reserved {format_bytes(m['peak_reserved_bytes'])} ({src})"
    if best.global_batch is not None:
        head = (f"best: micro-batch {best.batch_size} x {best.grad_accum} accumulation step"
                f"{'s' if best.grad_accum != 1 else ''} (global batch {best.global_batch}), ")
    else:
        head = f"best: batch {best.batch_size}, "
    if best.activation_checkpointing is not None:
        head += f"activation checkpointing {'on' if best.activation_checkpointing else 'off'}, "
    head += best.alloc_conf or "the default allocator"
    if best.trial_number is not None:
        head += f" (trial {best.trial_number})"
    if best.confirmed:  # the figures are the clean-process confirmation's, a trial of its own
        by = "" if best.metrics_trial_number is None else f" by trial {best.metrics_trial_number}"
        # best.yaml's metrics.steps counts the warm-up steps too: say both, so that the figures agree
        ran = m.get("steps")
        warm = ran - confirm_steps if isinstance(ran, int) and ran > confirm_steps else 0
        steps = f"{confirm_steps} steps" + (f" after {warm} warm-up" if warm else "")
        lines = [f"{head}; confirmed{by} in a clean process ({steps}): {figures}"]
    else:
        lines = [f"{head}: {figures}"]
    if m.get("soak_passed"):
        lines[0] += f"; survived a {m['soak_steps_run']}-step soak ({src})"
    if best.memory_fraction is not None:
        lines.append(f"memory fraction: this answer needs per_process_memory_fraction {best.memory_fraction!r} (its "
                     "garbage_collection_threshold acts only under a fraction < 1); oomtune.apply_best and "
                     "oomtune env apply it with the settings")
    from oomtune.search.objectives import OBJECTIVES, objective_for

    gain = summary.gain or {}
    timeout_note = getattr(summary, "timeout_note", None)
    if timeout_note and not gain.get("claimed"):
        # the clock ended the search, not the other configurations' results: no "no gain" verdict
        lines.append(f"no verdict on the allocator settings: {timeout_note}")
    elif baseline is not None and gain.get("same_configuration"):
        lines.append(f"no allocator gain: the answer is the baseline's own configuration "
                     f"({best.alloc_conf or 'the default allocator'}) at batch {best.batch_size}")
    elif baseline is not None and gain.get("objective") in OBJECTIVES:
        # the objective that made the figures says what they mean (oomtune.search.objectives)
        lines.append(objective_for(gain["objective"]).gain_line(gain, summary=summary, best=best, baseline=baseline,
                                                                memory_source=src))
    lines.append(f"objective: {summary.objective} ({summary.objective_reason})")
    if summary.at_top_of_range and best.global_batch is not None:
        lines.append(f"note: micro-batch {best.batch_size} is the whole global batch per rank (no accumulation)")
    elif summary.at_top_of_range:
        lines.append(f"note: batch {best.batch_size} is the top of the searched range: raise "
                     f"search.batch_size.high (e.g. search.batch_size.high={2 * batch_high}) to look further")
    return lines
