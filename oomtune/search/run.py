"""A search in this process: from composed config (:func:`compose_search`, :func:`prepare_search`)
through the trials (:func:`search_here`) to best.yaml and the report (:func:`write_search_outputs`).
``oomtune search`` starts at :func:`oomtune.search.entry.search`, which runs these here or hands
them to worker jobs (:mod:`oomtune.search.jobs`, whose jobs run them in turn)."""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from oomtune import config as C
from oomtune import interrupts
from oomtune.exceptions import ConfigError, StorageUnavailableError
from oomtune.prepared import PreparedRun, compose_checked, prepare, workload_spec_of
from oomtune.study import records as R
from oomtune.search.driver import Search, SearchOptions
from oomtune.search.objectives import OBJECTIVES, objective_for, sampler_trials
from oomtune.space import SearchSpace
from oomtune.search.samplers import make_sampler
from oomtune.study.storage import again_on_conflict, open_study, storage_url
from oomtune.search.workers import ATTR_DUPLICATE_OF
from oomtune.units import format_bytes
from oomtune.workload_spec import JsonObject, WorkloadSpec

if TYPE_CHECKING:
    from oomtune.schema import RootConf, TrialConf

__all__ = ["search_here", "write_search_outputs", "compose_search", "prepare_search", "Searched",
           "RUN_FILE"]

from oomtune.runfile import RUN_FILE, write_run_file  # noqa: E402 - run.json: `oomtune show RUN_DIR` finds the study


def _options(conf: RootConf, workload: WorkloadSpec, device: Any, budget_bytes: int) -> SearchOptions:
    """The driver's options: the typed config's ``search`` and ``trial`` sections as they are, the
    workload, the device and the budget, and what the search resolves from them (the objective,
    ``trial.execute``, the confirmation window, the virtual GPU's capacity, the host's memory)."""
    from oomtune.search.ranking import resolve_objective

    from oomtune.trial.execute import host_available_bytes, resolve_execute

    s, t = conf.search, conf.trial
    objective, reason = resolve_objective(s.objective, simulated=device.simulated)
    execute, _ = resolve_execute(t.execute, simulated=device.simulated, objective=objective_for(objective),
                                 workload=workload)
    return SearchOptions(
        workload=workload, device=device.spec, budget_bytes=budget_bytes, search=s, trial=t,
        objective=objective, objective_reason=reason, window_s=_window(s.window, device), execute=execute,
        device_memory_bytes=device.total_memory_bytes if device.simulated else None,
        torch_threads=_torch_threads(s.workers * t.gpus) if device.simulated else None,
        host_available_bytes=host_available_bytes() if device.simulated else None,
        variable_shapes=worst_shape_spec(workload) is not workload,
        # without a sampler to explore them, configurations with no prediction are probed one by one
        probe_unpredicted=not objective_for(objective).uses_sampler,
    )


def _window(value: float | None, device: Any) -> float:
    """``search.window`` in seconds; null: 5 s on a GPU (timing windows long enough to average
    clock and thermal swings), 0 on the virtual GPU (the CPU's timings decide nothing about a GPU)."""
    if value is not None:
        return float(value)
    return 0.0 if device.simulated else 5.0


def worst_shape_workload(workload: JsonObject) -> JsonObject:
    """:func:`oomtune.trial._base.worst_shape_workload` (the search's and plan's worst shape: one
    code), imported when called."""
    from oomtune.trial._base import worst_shape_workload as worst

    return worst(workload)


def worst_shape_spec(workload: WorkloadSpec) -> WorkloadSpec:
    """:func:`oomtune.trial._base.worst_shape_spec`, imported when called."""
    from oomtune.trial._base import worst_shape_spec as worst

    return worst(workload)


def check_launches(options: SearchOptions, *, predicts: bool, target: Any) -> None:
    """Refuse, before anything starts, a search that could launch no trial at all:
    the batch objective has no sampler, so its trials are the frontier probes; without the baseline
    (``search.baseline=false``) those are the ``search.frontier_configs`` configurations the virtual
    GPU predicts above the default, and there are none without a prediction (``target=cmd``: its
    predictions come from the default allocator's recorded trials, which are the baseline;
    ``search.prune=off``) or with ``search.frontier_configs=0``. Likewise the throughput objective
    with no baseline, no frontier configurations and ``search.n_trials=0``. ``target``: the
    workload's :class:`oomtune.trial._base.Target`.

    Raises:
        ConfigError: one line naming the settings that leave nothing to run and how to fix it.
    """
    if options.search.baseline:
        return
    uses_sampler = objective_for(options.objective).uses_sampler
    sampler = uses_sampler and options.search.n_trials > 0
    frontier = predicts and options.search.frontier_configs > 0
    if sampler or frontier:
        return
    why = [f"search.objective={options.objective}", "search.baseline=false"]
    if not predicts:
        why.append(f"no prediction (target={target.name}: a command cannot be captured)" if not target.capturable
                   else "no prediction (search.prune=off)")
    elif options.search.frontier_configs <= 0:
        why.append("search.frontier_configs=0")
    if uses_sampler:
        why.append("search.n_trials=0")
    samplers = ", ".join(n for n in OBJECTIVES if objective_for(n).uses_sampler)
    fix = ("set search.baseline=true" + (" or search.n_trials > 0" if uses_sampler else
                                          f" or search.objective={samplers} with search.n_trials > 0"))
    raise ConfigError(f"this search would launch no trial: {', '.join(why)}; {fix}")


def check_fits(planner: Any, predictor: Any, *, device: Any, budget_bytes: int, headroom: float,
               prune_margin: float) -> None:
    """Refuse, before any trial, a budget nothing fits in: no configuration is
    predicted to fit even the smallest batch. On the virtual GPU the prediction is what the trials
    measure, so that is certain; on a device, where predictions are calibrated only by trials, the
    smallest predicted peak must also exceed the limit by more than ``search.prune_margin`` (the
    margin within which the search would still launch it). Configurations the virtual GPU cannot
    simulate (cudaMallocAsync) keep the search going.

    Raises:
        ConfigError: one line naming the smallest predicted peak, its batch and configuration, and
            the limit.
    """
    from oomtune.study.records import MemoryLimit

    if any(c.predicted is not None for c in planner.configs) or any(
            "cudaMallocAsync" in (c.alloc_conf or "") for c in planner.configs):
        return
    limit = MemoryLimit(budget_bytes, headroom).limit_bytes
    peaks = []
    for c in planner.configs:
        got = planner.peak(planner.low, c.params) if planner.peak is not None else None
        if got is not None:
            peaks.append((got[0], c.alloc_conf))
    if not peaks:
        return
    peak, conf = min(peaks)
    if not device.simulated and peak <= limit * (1 + prune_margin):
        return
    source = "simulated" if device.simulated else "simulated, uncalibrated"
    raise ConfigError(
        f"nothing fits budget {format_bytes(budget_bytes)}: the smallest predicted peak reserved is "
        f"{format_bytes(peak)} ({source}) at batch {planner.low} with {conf or 'the default allocator'}, above "
        f"the limit {format_bytes(limit)} (budget minus {headroom:.0%} headroom); raise budget or lower "
        f"search.batch_size.low")


def check_planned_launches(planner: Any, options: SearchOptions) -> None:
    """After the frontier prediction: refuse a search whose frontier probes select nothing and that
    has no sampler to run instead (``search.baseline=false`` and no configuration predicted above the
    default allocator's frontier), before any trial.

    Raises:
        ConfigError: one line naming the settings.
    """
    if options.search.baseline or any(c.selected for c in planner.configs):
        return
    uses_sampler = objective_for(options.objective).uses_sampler
    if uses_sampler and options.search.n_trials > 0:
        return
    raise ConfigError(
        "this search would launch no trial: search.baseline=false and no configuration is predicted to fit a "
        f"larger batch than the default allocator (search.objective={options.objective}"
        + (", search.n_trials=0" if uses_sampler else "")
        + "); set search.baseline=true")


def _torch_threads(workers: int) -> int | None:
    """torch threads per CPU trial process when ``workers`` of them (trials x ranks) share this
    machine's cores (None for one: torch's own default)."""
    import os

    return None if workers <= 1 else max(1, (os.cpu_count() or 1) // workers)


def worker_slots(cfg_device: str, device: Any, workers: int, gpus: int = 1,
                 visible: int | None = None) -> list[str]:
    """The device of each worker thread: on CUDA, trials own their GPUs, ``gpus`` each (one rank per
    GPU), so ``device=cuda`` (or ``auto``) with ``V`` visible GPUs gives ``k = min(workers, V // gpus)``
    slots of consecutive GPUs: ``cuda:0 .. cuda:k-1`` for one GPU per trial, ``cuda:0,1``,
    ``cuda:2,3``, ... for two (each trial's GPUs made visible by UUID, their physical identity
    recorded: field case C10); ``search.workers x trial.gpus`` never exceeds the visible GPUs.
    ``cuda:N`` is one GPU, so one worker of one GPU. On the virtual GPU, ``workers`` CPU trials (their
    ranks' torch threads split: :func:`_torch_threads`). ``visible``: the visible GPU count (default:
    ``torch.cuda.device_count()``).

    Raises:
        ConfigError: ``trial.gpus`` more than the visible GPUs, or more than one with ``cuda:N``.
    """
    if device.simulated:
        return [device.spec] * max(1, workers)
    if ":" in str(cfg_device):
        if gpus > 1:
            raise ConfigError(f"device={cfg_device} names one GPU but trial.gpus={gpus}: use device=cuda (the "
                              f"trials then take {gpus} visible GPUs each)")
        return [device.spec]
    if workers <= 1 and gpus == 1:
        return [device.spec]
    if visible is None:
        import torch

        visible = max(1, torch.cuda.device_count())
    if gpus > visible:
        raise ConfigError(f"trial.gpus={gpus} but only {visible} GPU(s) are visible: lower trial.gpus or make "
                          "more GPUs visible (CUDA_VISIBLE_DEVICES)")
    slots = min(max(1, workers), visible // gpus)
    return [f"cuda:{','.join(str(s * gpus + g) for g in range(gpus))}" for s in range(slots)]


def _comparable(workload: JsonObject, stored: Any) -> Any:
    """``workload`` as stored in a study's attributes; a study created before the target GPU was part
    of the workload (no ``gpu`` key) is compared without it, so it still resumes."""
    plain = json.loads(json.dumps(workload))
    if isinstance(stored, dict) and "gpu" not in stored:
        plain = {k: v for k, v in plain.items() if k not in ("gpu", "gpu_source")}
    return plain


#: The study system attribute naming what a study was created for: ``{"workload": ..., "budget_bytes": ...}``,
#: recorded once by the first worker (:func:`_check_resume`).
STUDY_IDENTITY_ATTR = "oomtune:identity"


def _check_resume(study: Any, workload: JsonObject, budget_bytes: int) -> None:
    """Claim ``study`` for ``workload`` and ``budget_bytes`` (bytes), or check that it was created for
    them (resume, or another worker joining it).

    The claim is one record written once (:func:`oomtune.study.storage.record_once`: on an RDB
    storage a single INSERT into Optuna's ``study_system_attributes``, whose unique (study_id, key)
    lets exactly one concurrent writer commit; the others read the winner's record). Workers started
    at once therefore never see half a claim: with two attributes written one after the other
    (``Study.set_user_attr`` is one transaction per key: optuna/storages/_rdb/storage.py,
    ``RDBStorage.set_study_user_attr``), a worker reading between them found the workload without the
    budget and refused the study as another one's. Studies created before the claim existed hold
    the ``workload`` and ``budget_bytes`` user attributes instead; they are compared as before.

    Raises:
        ConfigError: the study was created for another workload or budget (one line).
    """
    from oomtune.study.storage import record_once

    stored = study._storage.get_study_system_attrs(study._study_id).get(STUDY_IDENTITY_ATTR)
    if stored is None and study.user_attrs.get("workload") is not None:   # a study of an earlier oomtune
        stored = {"workload": study.user_attrs.get("workload"), "budget_bytes": study.user_attrs.get("budget_bytes")}
    if stored is None:
        mine = {"workload": json.loads(json.dumps(workload)), "budget_bytes": int(budget_bytes)}
        stored = record_once(study, STUDY_IDENTITY_ATTR, mine)
    if (stored.get("workload") != _comparable(workload, stored.get("workload"))
            or stored.get("budget_bytes") != budget_bytes):
        raise ConfigError(
            f"study {study.study_name!r} was created for another workload or budget; "
            "pick a new study_name= (or drop study_name= to get one derived from the config)"
        )


def search_workload(conf: RootConf) -> WorkloadSpec:
    """The search's workload (:func:`oomtune.prepared.workload_spec_of`, its paths made absolute:
    trials run in their own directories), checked (:func:`check_model_and_target`).

    Raises:
        ConfigError: an invalid target or model config.
    """
    spec = workload_spec_of(conf, resolve_paths=True)
    check_model_and_target(spec)
    return spec


def check_model_and_target(spec: WorkloadSpec) -> None:
    """The target group (:func:`oomtune.targets.validate_target`) and, for a built-in workload, the
    model keys before torch is imported (:func:`oomtune.workloads.keys.check_model_keys`: a typo costs
    no seconds of imports), then the whole model config
    (:func:`oomtune.workloads.validate_workload_config`: builds the model on meta, imports torch).

    Raises:
        ConfigError: an invalid target or model config, in one line.
    """
    from oomtune.targets import validate_target

    validate_target(spec.target)
    if spec.model is None:   # the target group alone describes the workload
        return
    from oomtune.workloads.keys import check_model_keys

    check_model_keys(spec.model)
    from oomtune.workloads import validate_workload_config

    validate_workload_config(spec.to_dict())


@dataclass(frozen=True)
class _Prepared:
    """Everything validated before any file is written or study opened: the :class:`oomtune.
    prepared.PreparedRun` (``run``) and what only the search adds to it: the driver's options (their
    ``workload`` the trial workload of ``run.workload``), the garbage-collection thresholds
    ``search.memory_fraction=off`` dropped, whether the frontier is predicted, the Optuna sampler."""

    run: PreparedRun
    options: SearchOptions
    dropped_gc: list[float]
    predicts: bool
    sampler: Any   # an optuna.samplers.BaseSampler (optuna imported when the search starts)


def refuse_plan_cards(cfg: Any) -> None:
    """``gpu=`` names the cards of a multi-card plan (``oomtune plan gpu=[...]``); a search tunes one
    device and would ignore it, so it is refused, pointing at what a search reads instead:
    ``model.gpu`` (the kernels its captures run; a catalogue name is accepted there) and
    ``virtual_device_memory`` (the virtual GPU's memory: for one catalogue card, its
    ``total_memory_bytes``).

    Raises:
        ConfigError: ``gpu=`` is set; one line, before anything else is checked or imported.
    """
    value = cfg.get("gpu")
    if value is None:
        return
    shown = C.to_container(value) if not isinstance(value, (str, int, float)) else value
    text = ",".join(map(str, shown)) if isinstance(shown, list) else str(shown)
    from oomtune.gpu.catalogue import card_named

    card = card_named(text) if "," not in text else None
    if card is not None and card.total_memory_bytes is not None:
        use = (f"model.gpu={card.name} virtual_device_memory={card.total_memory_bytes} (its kernels and its "
               f"memory in bytes)")
    else:
        use = "model.gpu=NAME for the kernels its captures run (virtual_device_memory= for the card's memory)"
    raise ConfigError(f"gpu={text} is oomtune plan's list of cards; a search tunes one device and would ignore it: use "
                      f"{use}, or compare the cards first with oomtune plan gpu=[...]")


def compose_search(overrides: Sequence[str]) -> Any:
    """The search's config, composed and checked before torch is imported: the allocator's
    environment, every typed key (:func:`oomtune.prepared.compose_checked`), a stray ``gpu=``
    (:func:`refuse_plan_cards`) and the ``launcher``
    group (:func:`oomtune.search.launchers.check_launcher`).

    Raises:
        ConfigError: bad input, in one line.
    """
    from oomtune.alloc.caching_env import check_alloc_env, check_caching_enabled
    from oomtune.search.launchers import check_launcher

    check_caching_enabled()   # PYTORCH_NO_CUDA_MEMORY_CACHING would make every setting a no-op
    check_alloc_env()         # a malformed string in the shell would abort `import torch` (exit 134)
    cfg = compose_checked(overrides)
    refuse_plan_cards(cfg)
    check_launcher(cfg)       # before anything is opened or submitted
    return cfg


def prepare_search(overrides: Sequence[str], *, cfg: Any = None) -> _Prepared:
    """Compose and validate the search's config once (:func:`compose_search`, unless ``cfg`` is that
    config already, then :func:`oomtune.prepared.prepare`), then the search's own checks, in the
    order bad input is reported.

    Raises:
        ConfigError / DeviceError / AllocatorConfigError: bad input, before any trial starts and
            before anything is written.
    """
    cfg = compose_search(overrides) if cfg is None else cfg

    def checked(conf: RootConf, work: WorkloadSpec, space: Any) -> None:
        from oomtune.plan.entry_check import check_user_code
        from oomtune.trial._base import get_target

        check_model_and_target(work)   # builds the model on meta: imports torch
        # the user's entry imported and inspected in a process of its own, under trial.timeout
        check_user_code(work, timeout_s=conf.trial.timeout)
        get_target(work.target_name).check_training(   # the training settings must reach the trials
            work, accumulates=space.global_batch is not None,
            checkpointing=bool(space.checkpointing and True in space.checkpointing))

    # the GPU the captures stand for (model.gpu; auto: the device, or the default on the CPU) is
    # resolved once by prepare, so that every capture (workers, trial processes) and best.yaml agree
    # the search space first (allocator values: no torch needed; a global batch split over the ranks)
    run = prepare(overrides, resolve_paths=True, cfg=cfg, checked=checked)
    conf, device, budget_bytes, space = run.conf, run.device, run.budget_bytes, run.space
    dropped_gc = space.drop_garbage_collection() if conf.search.memory_fraction == "off" else []
    if device.simulated and "cudaMallocAsync" in space.choices.get("backend", []):
        raise ConfigError("search.space.backend: cudaMallocAsync needs a CUDA device; the virtual GPU "
                          "(device=cpu) models the native allocator only")
    options = _options(conf, run.workload, device, budget_bytes)
    from oomtune.trial.execute import check_host_memory

    # CPU trials hold their tensors in host memory (every rank its own budget): a budget the host
    # cannot hold stops here (exit 2)
    check_host_memory(options.execute, budget_bytes, conf.search.workers * conf.trial.gpus,
                      available_bytes=options.host_available_bytes, simulated=device.simulated)
    predicts = conf.search.prune == "predicted" and run.target.capturable
    check_launches(options, predicts=predicts, target=run.target)
    return _Prepared(run=run, options=options, dropped_gc=dropped_gc, predicts=predicts,
                     sampler=make_sampler(conf.search.sampler, conf.search.seed))


@dataclass
class Searched:
    """A search this process ran to its end (:func:`search_here`), before its outputs are written
    (:func:`write_search_outputs`): what a worker job hands back to the process that launched it."""

    prepared: _Prepared
    study: Any
    url: str
    summary: Any                 # oomtune.search.driver.SearchSummary
    predictor: Any               # the frontier's predictor (None: not predicted)
    drive_predictor: Any         # a recorded target's predictor over its trials' streams


def search_here(p: _Prepared, overrides: Sequence[str], *, console: Any) -> Searched:
    """The search's trials on this process's worker threads, from the prepared config to the
    summary: the study opened (or joined), frontier probes, the sampler, the confirmation.

    Raises:
        SetupFault / KeyboardInterrupt / StorageUnavailableError: as :func:`search`.
    """
    from oomtune.trial.runner import TrialRunner

    run, options = p.run, p.options
    conf, device, space, workload = run.conf, run.device, run.space, options.workload
    url = storage_url(conf.storage, run.run_dir)
    say = lambda line: _say(console, line)  # noqa: E731
    from oomtune.search.tell_records import replay

    study = open_study(url, str(conf.study_name), p.sampler, heartbeat_interval_s=conf.search.heartbeat_interval,
                       grace_period_s=conf.search.grace_period, say=say,
                       before_stale=lambda study: replay(study, run.run_dir / "trials", say))
    with warnings.catch_warnings():  # ExperimentalWarning: the API exists since Optuna 3.2
        warnings.simplefilter("ignore")
        again_on_conflict(lambda: study.set_metric_names([R.METRIC_NAME]))  # optuna-dashboard names the objective
    again_on_conflict(lambda: _check_resume(study, workload.to_dict(), run.budget_bytes))  # other workers start at once
    C.save_config(conf, run.run_dir, overrides)
    write_run_file(run.run_dir, url, study.study_name)

    predictor = recording = None
    if p.predicts:
        # Under a shape distribution the frontier is predicted at the worst (largest) shape. The
        # captures come from the stream cache where a plan or an earlier search left them.
        predictor = search_predictor(workload, space, device, run.budget_bytes, conf.trial,
                                     memory_fraction=options.search.memory_fraction != "off")
    elif conf.search.prune == "predicted" and run.target.records_streams:
        from oomtune.plan.predictor import sim_geometry
        from oomtune.plan.recorded import RecordedPredictor

        # trials of the user's own command record their step's allocation stream (oomtune.plan.recorded):
        # on the virtual GPU through capture_hook's recorder, on CUDA from the allocator's memory history
        geometry = sim_geometry(device, run.budget_bytes, memory_fraction=options.search.memory_fraction != "off")

        def recording(recordings: dict, steps: int, covers: Any) -> Any:
            return RecordedPredictor(recordings, geometry, steps=steps, covers=covers)

    _say(console, f"oomtune search: study {study.study_name!r} in {url}")
    done = _resume_line(study)
    if done:
        _say(console, done)
    from oomtune.display import device_words, wrapped

    from oomtune.trial.execute import resolve_execute

    execute_why = resolve_execute(conf.trial.execute, simulated=device.simulated,
                                  objective=objective_for(options.objective), workload=workload)[1]
    steps_where = {"meta": "their steps on the meta device, memory simulated, throughput not measured",
                   "cpu": "their steps on the CPU, memory simulated, throughput this CPU's"}.get(
        "cpu" if options.execute == "command" and device.simulated else options.execute)
    for line in (f"device: {device_words(device)}, budget {format_bytes(run.budget_bytes)}, headroom "
                 f"{options.search.headroom:.0%}, {len(space.all_settings())} allocator configurations x batch "
                 f"{space.batch_low}..{space.batch_high}",
                 f"objective: {options.objective} ({options.objective_reason})",
                 *([f"trials: {steps_where} ({execute_why})"] if steps_where else [])):
        for part in wrapped(line):   # 100 columns at spaces
            _say(console, part)
    if C.budget_note(conf.budget):
        _say(console, C.budget_note(conf.budget))   # 16GB = 14.90 GiB, said once
    from oomtune.device import fraction_note

    if p.dropped_gc:
        _say(console, f"search.memory_fraction=off: garbage_collection_threshold {p.dropped_gc} not searched "
                      "(torch applies it only under a memory fraction < 1; without one it does nothing)")
    if fraction_note(conf.budget, device, run.budget_bytes):
        _say(console, fraction_note(conf.budget, device, run.budget_bytes))   # 0.5 of which device
    from oomtune.display import SearchProgress

    progress = SearchProgress(console, sampler_trials(options.objective, options.search.n_trials), study=study)
    progress.legend(simulated=device.simulated, confs=_rendered(space), execute=options.execute,
                    own_process=run.target.own_process)
    slots = worker_slots(conf.device, device, conf.search.workers, conf.trial.gpus)
    if len(slots) > 1 or conf.search.workers > 1:
        _say(console, f"workers: {len(slots)} trial{'s' if len(slots) != 1 else ''} at once on "
                      f"{', '.join(sorted(set(slots)))}"
                      + (f" ({options.torch_threads} torch thread(s) each)" if options.torch_threads else "")
                      + ("" if len(slots) == conf.search.workers else
                         f"; search.workers={conf.search.workers} capped: each trial owns "
                         f"{conf.trial.gpus} GPU(s)"))
    runner = TrialRunner(launcher=conf.trial.launcher)
    # The fork server imports torch once (~3 s) while this process predicts the frontiers: on two
    # cores or more they overlap (the first trial waits for it, as it would anyway).
    if not run.target.own_process:   # an own-process target (cmd) runs its own processes
        threading.Thread(target=runner.start_fork_server, name="oomtune-forkserver-start", daemon=True).start()
    confirm_runner = TrialRunner(launcher="spawn")
    drive = Search(study, space, options, runner=progress.wrap(runner), confirm_runner=progress.wrap(confirm_runner),
                   workdir=run.run_dir / "trials", predict=_calibrated(predictor, study) if predictor else None,
                   predictor=predictor, prune_margin=conf.search.prune_margin, on_trial=progress, slots=slots,
                   say=lambda text: _say(console, text), recording=recording)
    progress.leader = drive.leader
    progress.role_of = drive.running_role
    # SIGTERM and Ctrl-C end the live trials at once and stop the search, even where CPython drops the
    # handler's raise (oomtune.interrupts)
    stop_signals = contextlib.ExitStack()
    stop_signals.enter_context(interrupts.stopping_on((signal.SIGTERM, signal.SIGINT),
                                                      stoppers=(runner.kill_all, confirm_runner.kill_all)))
    try:
        if predictor is not None:
            _say(console, "predicting every configuration's frontier on the virtual GPU ...")
            drive.planner = drive.plan_frontiers()
            _say(console, _frontier_line(drive.planner, predictor))
            check_fits(drive.planner, predictor, device=device, budget_bytes=run.budget_bytes,
                       headroom=options.search.headroom, prune_margin=conf.search.prune_margin)
            check_planned_launches(drive.planner, options)
        elif recording is not None:
            _say(console, "recording the allocation streams of the default allocator's trials at the smallest "
                          f"batch sizes ({', '.join(map(str, drive.anchor_batches()[:3]))}; more only while their "
                          "recordings do not determine the others) ...")
            drive.planner = drive.plan_frontiers()
            if drive.recording_note:
                _say(console, drive.recording_note)
            if drive.predictor is not None:
                predictor = drive.predictor
                drive.predict = _calibrated(predictor, study)
                _say(console, _frontier_line(drive.planner, predictor))
        drive.start_smoke_test()   # trials on meta: one real CPU step, once per search, beside the frontier rounds
        baseline = drive.run_frontier()
        drive.run_search(baseline)
        smoke = drive.finish_smoke_test()   # before the answer is confirmed: a failure stops the search here
        if smoke:
            _say(console, smoke)
        best, best_result, confirmed = drive.confirm()
    except KeyboardInterrupt:
        runner.kill_all()
        confirm_runner.kill_all()
        _say(console, f"interrupted: finished trials are saved in {url}; run the same command to resume")
        raise
    except StorageUnavailableError as exc:
        runner.kill_all()
        confirm_runner.kill_all()
        raise StorageUnavailableError(
            f"{exc}; finished trials are kept: in the storage, and those it was not told in "
            f"{run.run_dir / 'trials'}/trial-*/tell.json (told when it is back)") from exc.__cause__
    finally:
        progress.close()
        stop_signals.close()
        runner.close()
        confirm_runner.close()
    summary = drive.summary(best, best_result, confirmed, baseline)
    # Coordination counters of this process (the Executor's own storage calls and seconds in them;
    # the trial's writes are not counted here, experiments/bench_workers.py counts the database's
    # transactions), trials claimed, duplicates finished without running.
    from oomtune.files import write_atomic

    write_atomic(run.run_dir / "workers.json", json.dumps({"slots": slots, **drive.executor.stats}))
    return Searched(prepared=p, study=study, url=url, summary=summary, predictor=predictor,
                    drive_predictor=drive.predictor)


def write_search_outputs(run: Searched, *, out: Any, html: bool = True) -> Path:
    """best.yaml, trials.json, the final table and the report of a search this process ran
    (:func:`oomtune.search.outputs.write_outputs`, :func:`oomtune.htmlreport.write_search_report`);
    ``html=False``: the report's frontier and winner's step without report.html (a worker job: its
    parent writes the run's report).

    Raises:
        SetupFault: no answer: no configuration ran within the budget, or every confirmation failed
            (the report is written all the same).
        DiskFullError: a file could not be written for lack of space.
    """
    from oomtune.search.outputs import write_outputs

    from oomtune.htmlreport import write_search_report

    p, predictor, options = run.prepared.run, run.predictor, run.prepared.options
    space = p.space
    try:
        # a target whose trials record their streams: the driver's predictor over the recordings
        return write_outputs(p.conf, p.run_dir, run.study, run.summary, p.device, p.budget_bytes, run.url, out,
                             predictor=predictor if predictor is not None else run.drive_predictor,
                             space=space, workload=p.workload,
                             # one predictor: under a shape distribution best.yaml records the worst
                             # shape's prediction, as the frontier judged it (check predicts the same)
                             predicted_at_worst_shape=(predictor is not None and run.prepared.predicts
                                                       and options.variable_shapes))
    finally:  # also when nothing fitted (SetupFault): the report then shows why, trial by trial
        # the report draws with the search's predictor; without one (search.prune=off) the one
        # predictor of this search is made here, for the report only (best.yaml records no prediction)
        write_search_report(p.run_dir, lambda text: _say(out, text), html=html, workload=options.workload.to_dict(),
                            device=p.device, budget_bytes=p.budget_bytes, headroom=options.search.headroom,
                            predictor=predictor if predictor is not None else _report_predictor(p, space),
                            predicted_frontiers=predictor is not None, space=space)


def _report_predictor(p: PreparedRun, space: SearchSpace) -> Any:
    """The predictor of a search that predicted nothing (``search.prune=off``), for its report's
    frontier and winner's step: the workload at its worst shape, replayed under the search's geometry
    (one per variant when the candidates train different steps, as :func:`search_predictor`'s, so the
    winner's step is its own variant's); None for a target oomtune cannot capture (``cmd``)."""
    if not p.target.capturable:
        return None
    from oomtune.plan.predictor import Predictor
    from oomtune.plan.stream_cache import default_cache

    def make(w: WorkloadSpec) -> Predictor:
        return Predictor.for_search(worst_shape_spec(w), p.device, p.budget_bytes, cache=default_cache(),
                                    timeout_s=p.conf.trial.timeout)

    return _per_variant(p.workload, space, make)


def _per_variant(workload: WorkloadSpec, space: SearchSpace, make: Callable[[WorkloadSpec], Any]) -> Any:
    """``make(workload)``, or one ``make`` per workload variant
    (:class:`oomtune.plan.variants.PredictorVariants`) when the candidates train different steps (a
    global batch's accumulation, activation checkpointing searched)."""
    if space.global_batch is None and space.checkpointing is None:
        return make(workload)
    from oomtune.plan.variants import PredictorVariants

    return PredictorVariants(workload, make, grad_accum_of=space.grad_accum_for)


def search_predictor(workload: WorkloadSpec, space: SearchSpace, device: Any, budget_bytes: int,
                     trial_cfg: TrialConf, *, memory_fraction: bool = True) -> Any:
    """The search's predictor for a workload oomtune can capture (built-in, python entry): one
    :class:`oomtune.plan.predictor.Predictor` of the workload at its worst shape (the workload
    itself when its shapes are fixed), or, when the candidates train different steps (a global batch's accumulation, activation
    checkpointing searched), one per variant (:class:`oomtune.plan.variants.PredictorVariants`).
    ``memory_fraction``: as for :meth:`Predictor.for_search` (``search.memory_fraction`` not off)."""
    from oomtune.plan.predictor import Predictor, trial_steps
    from oomtune.plan.stream_cache import default_cache

    def make(w: WorkloadSpec) -> Predictor:
        return Predictor.for_search(worst_shape_spec(w), device, budget_bytes,
                                    steps=trial_steps(trial_cfg), cache=default_cache(),
                                    memory_fraction=memory_fraction, timeout_s=trial_cfg.timeout)

    return _per_variant(workload, space, make)


def _rendered(space: SearchSpace) -> list[str]:
    """Every configuration of the space as its PYTORCH_CUDA_ALLOC_CONF string (for the legend)."""
    from oomtune.alloc.settings import AllocatorSettings

    return [AllocatorSettings.from_mapping({k: v for k, v in m.items() if v is not None}).render()
            for m in space.all_settings()]


def _count(study: Any, role: str) -> int:
    from oomtune.search.claims import ATTR_STOPPED_SEARCH

    # a trial whose failure stopped the search is no result: it runs again
    return sum(1 for t in study.get_trials(deepcopy=False)
               if t.user_attrs.get(R.ATTR_ROLE) == role and R.ATTR_RESULT in t.user_attrs
               and ATTR_STOPPED_SEARCH not in t.user_attrs)


#: Every role a trial of a search has, in the order the search runs them (the recordings of a
#: target=cmd search first): what the resume line counts.
RESUME_ROLES = ("record", "baseline", "frontier", "search", "confirm")


def _resume_line(study: Any) -> str | None:
    """The line a resumed search starts with: the finished trials of each role, and those
    interrupted without a result; None for a study without either."""
    counts = {role: n for role in RESUME_ROLES if (n := _count(study, role))}
    from optuna.trial import TrialState

    from oomtune.search.tell_records import ATTR_TOLD_FROM_RECORD

    trials = study.get_trials(deepcopy=False)
    restored = {t.user_attrs[ATTR_TOLD_FROM_RECORD] for t in trials if ATTR_TOLD_FROM_RECORD in t.user_attrs}
    interrupted = sum(1 for t in trials
                      if t.state is TrialState.FAIL and R.ATTR_RESULT not in t.user_attrs
                      and ATTR_DUPLICATE_OF not in t.user_attrs and t.number not in restored)
    if not counts and not interrupted:
        return None
    line = ("resuming: " + (", ".join(f"{n} {role} trial{'s' if n != 1 else ''}" for role, n in counts.items())
                            or "no trial") + " already finished")
    return line + (f"; {interrupted} interrupted without a result (each tried again only where the search still "
                   "needs it)" if interrupted else "")


def _calibrated(predictor: Any, study: Any) -> Any:
    """predictor.predict, recalibrated before each call from the study's device trials (measured /
    predicted peak reserved); on the virtual GPU there are none and the factor stays 1."""

    def predict(cand: Any) -> int | None:
        pairs = []
        for t in study.get_trials(deepcopy=False):
            res = R.result_of(t)
            if res is not None and res.memory.source == "device" and res.memory.peak_reserved_bytes:
                raw = predictor.predict_raw(res.batch_size, res.alloc_conf)
                if raw is not None:  # None: not simulable (backend:cudaMallocAsync)
                    pairs.append((raw, int(res.memory.peak_reserved_bytes)))
        predictor.calibrate(pairs)
        return predictor.predict(cand)

    return predict


def _say(console: Any, text: str) -> None:
    console.print(text, highlight=False, markup=False, soft_wrap=True)  # one line, never wrapped


def _cached_words(predictor: Any) -> str:
    """``", N of M read from the stream cache"`` when the stream cache served captures, else ``""``."""
    cached = len(set(getattr(predictor, "cached_batches", ())))
    return f", {cached} of {predictor.captures} read from the stream cache" if cached else ""


def _frontier_line(planner: Any, predictor: Any) -> str:
    """One line: how long the frontier prediction took and what it says."""
    probed = [c for c in planner.configs if c.selected]
    parts = [f"{c.label or '(default)'} "
             + (str(c.predicted) if c.predicted is not None else
                f"(none predicted to fit: from batch {planner.bottom})") for c in probed]
    recorded = getattr(predictor, "recorded", None)
    source = (f"from {len(recorded)} recorded streams" if recorded is not None
              else f"capture {predictor.capture_seconds:.1f} s{_cached_words(predictor)}")
    return (f"predicted frontiers of {sum(1 + len(c.twins) for c in planner.configs)} configurations "
            f"(simulated; {source}, replay {predictor.replay_seconds:.1f} s); "
            f"probing (a configuration only while its frontier can beat the largest batch measured so far): "
            f"{', '.join(parts)}")
