"""``oomtune plan``: the feasibility map predicted on the virtual GPU, without trials (the CLI,
:mod:`oomtune.commands.plan`, parses arguments and calls :func:`plan`; peers: :mod:`oomtune.search.run`
for ``oomtune search``, :mod:`oomtune.regression` for ``oomtune check``).

Same Hydra overrides as ``oomtune search`` (``model=resnet model.depth=50 budget=16GiB``). The grid is
``search.batch_size.low..high`` (powers of two plus both ends) or ``+plan.batch_sizes=[8,16,...]``.
A batch fits as in the search: its replay completes and the predicted peak reserved is at most
``budget * (1 - search.headroom)``. ``backend:cudaMallocAsync`` configurations cannot be simulated:
they are skipped with a notice (an error when nothing else is left). Writes plan.yaml into the run
directory (``hydra.run.dir``) or ``--out``.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from oomtune.workload_spec import JsonObject, WorkloadSpec

__all__ = ["plan"]


def _explicit_batches(conf: Any) -> list[int] | None:
    """``plan.batch_sizes`` of the typed config (:class:`oomtune.schema.RootConf`), None when unset.

    Raises:
        ConfigError: ``plan`` not a mapping, or ``batch_sizes`` not a list.
    """
    from oomtune.config import to_container
    from oomtune.exceptions import ConfigError

    node = conf.plan
    if node is None:
        return None
    plan_cfg = to_container(node)
    if not isinstance(plan_cfg, dict):
        raise ConfigError("plan must be a mapping, e.g. +plan.batch_sizes=[8,16]")
    value = plan_cfg.get("batch_sizes")
    if value is not None and not isinstance(value, list):
        raise ConfigError(f"plan.batch_sizes={value!r}: expected a list such as [8,16,32]")
    return value


def _validate_workload(spec: WorkloadSpec, cache: Any = None) -> None:
    """A built-in workload: :func:`validate_workload_config` (skipped when ``cache``, a
    :class:`oomtune.plan.stream_cache.StreamCache`, records that the same config passed under the same
    versions and code: the check imports torch); a python target: the entry's form (its import, in a
    process of its own: :func:`oomtune.plan.entry_check.check_user_code`).

    Raises:
        ConfigError: unknown model, bad model key, a malformed entry, a cmd target.
    """
    from oomtune.exceptions import ConfigError
    from oomtune.targets import validate_target
    from oomtune.trial._base import find_target, get_target, target_names

    if not get_target(spec.target_name).capturable:
        able = " or ".join(f"target={n}" for n in target_names() if find_target(n).capturable)
        raise ConfigError(f"oomtune plan needs {able}, not target={spec.target_name}: "
                          "a training command cannot be traced without running it")
    validate_target(spec.target)
    if spec.model is not None:   # a built-in workload: the model group describes it
        from oomtune.workloads.keys import check_model_keys

        check_model_keys(spec.model)   # before torch is imported (a typo costs no seconds of imports)
        if cache is not None and cache.validated(spec):
            return
        from oomtune.workloads import validate_workload_config

        validate_workload_config(spec.to_dict())
        if cache is not None:
            cache.mark_validated(spec)


def plan(overrides: list[str], *, out: Path | None = None, console: Any = None, cache: bool = True,
         write_report: Callable[[Path, Callable[[str], None]], Any] | None = None) -> Any:
    """Compose the config, predict the map, print it and write plan.yaml.

    ``cache``: read and write captured streams in the stream cache (:func:`oomtune.plan.stream_cache.
    default_cache`; a plan whose captures are all there does not import torch); False: capture
    everything afresh (and refresh the entries). ``write_report(run_dir, say)``: called after a
    ``plan.yaml`` (not another ``--out`` name) is written, to write the run directory's report
    (the CLI passes :func:`oomtune.htmlreport.write_report`; the report layer sits above this one).

    Returns:
        the :class:`oomtune.plan.feasibility.FeasibilityMap`.

    Raises:
        ConfigError: bad override, unknown model, bad batch grid, a typed key out of range
        (:func:`oomtune.schema.validate`, as the search checks them; ``search.headroom`` in [0, 1)),
        only cudaMallocAsync configurations. AllocatorConfigError: a malformed allocator value in
        search.space. DeviceError: a budget above the device. All before anything is captured or written.
    """
    from oomtune.display import output_console
    from oomtune.plan.feasibility import (build_plan, check_writable, grid_batches, limit_bytes_of, split_simulable,
                                          validate_headroom, write_plan)
    from oomtune.plan.predictor import Predictor, sim_geometry, trial_steps
    from oomtune.prepared import compose_checked, prepare
    from oomtune.units import format_bytes

    console = console or output_console()
    # every typed key as the search checks it (a plan is run with the search's overrides), before
    # torch is imported by the workload check: bad input exits at once
    cfg = compose_checked(overrides)
    headroom = validate_headroom(cfg.search.get("headroom", 0.0))
    cards = _cards_of(cfg, overrides)   # gpu=[l4,a100-40gb]: checked here, before any import of torch
    from oomtune.plan.stream_cache import cacheable, default_cache

    store = default_cache()
    unwritable = None

    def checked(conf: Any, spec: WorkloadSpec, space: Any) -> None:
        nonlocal store, unwritable
        if store is not None and not cacheable(spec):
            store = None
        unwritable = store.unwritable() if store is not None else None
        _validate_workload(spec, store if cache else None)
        from oomtune.plan.entry_check import check_user_code

        # the user's entry imported and inspected in a process of its own, under trial.timeout
        check_user_code(spec, timeout_s=conf.trial.timeout)

    # the workload's paths as given (the stream cache's keys); the model.gpu key resolved by
    # prepare: the kernels the captures run (auto: the device); across cards budget= is each card's
    # (card_budgets, checked above), not the virtual GPU's
    prepared = prepare(overrides, resolve_paths=False, cfg=cfg, checked=checked, space_last=True,
                       device_budget=cards is None)
    device, budget_bytes, space = prepared.device, prepared.budget_bytes, prepared.space
    conf, spec = prepared.conf, prepared.workload
    workload = spec.to_dict()   # the flat form: the plan's record, the soak
    from oomtune.capture.gpu_target import target_from_workload

    gpu = target_from_workload(spec)
    choices = space.batch_choices()   # a global batch: its micro-batches only
    grid = grid_batches(space.batch_low, space.batch_high, _explicit_batches(conf)) if choices is None else choices
    settings, skipped = split_simulable(space.all_settings())
    if not settings:
        from oomtune.exceptions import ConfigError

        raise ConfigError("every configuration of search.space uses backend:cudaMallocAsync, which the virtual "
                          "GPU cannot simulate: add native to search.space.backend to plan")
    path = check_writable(out if out is not None else prepared.run_dir / "plan.yaml", "--out")
    from oomtune.plan.parallel import default_workers

    # Under a shape distribution: predicted at its worst shape, with the search's code (so both agree)
    from oomtune.trial._base import worst_shape_spec

    worst_spec = worst_shape_spec(spec)
    worst = workload if worst_spec is spec else worst_spec.to_dict()
    if cards is not None:
        from oomtune.plan.cards import plan_multi

        return plan_multi(cards, conf, workload=worst_spec, shaped=worst_spec is not spec, settings=settings,
                          skipped=skipped,
                          grid=grid, headroom=headroom, store=store, cache=cache, path=path, console=console,
                          global_batch=space.global_batch, label=prepared.target.label(spec))
    limit_bytes = limit_bytes_of(budget_bytes, headroom)
    geometry, steps = sim_geometry(device, budget_bytes), trial_steps(conf.trial)
    if space.global_batch is None:
        predictor = Predictor(worst_spec, geometry, steps=steps, workers=default_workers(), cache=store,
                              read_cache=cache, timeout_s=conf.trial.timeout)
    else:   # one micro-batch per step at the top, two (accumulating) below: PredictorVariants
        from oomtune.plan.variants import PredictorVariants

        predictor = PredictorVariants(worst_spec, lambda w: Predictor(w, geometry, steps=steps, cache=store,
                                                                 read_cache=cache, timeout_s=conf.trial.timeout),
                                      grad_accum_of=space.grad_accum_for)
    dev = {"kind": device.kind, "name": device.name, "total_memory_bytes": device.total_memory_bytes,
           "budget_bytes": budget_bytes, "memory_source": device.memory_source, "target_gpu": gpu.to_dict()}
    say = _printer(console)
    sized = "" if device.simulated else f"{device.name}'s capacity, "   # not "(virtual GPU (CPU), ..."
    batches = (f"batch {grid[0]}..{grid[-1]} ({len(grid)} grid points + bisection)" if choices is None else
               f"micro-batch {', '.join(map(str, grid))} of global batch {space.global_batch}")
    say(f"oomtune plan: {prepared.target.label(spec)} on the virtual GPU ({sized}budget "
        f"{format_bytes(budget_bytes)}, limit {format_bytes(limit_bytes)} with headroom {headroom:.0%}), "
        f"{len(settings)} allocator configurations x {batches}")
    say(f"target GPU: {gpu.describe()}: attention, dropout, mixed precision and optimizers run its kernels")
    if space.checkpointing is not None:
        say("note: plan maps the workload as configured (activation checkpointing "
            f"{'on' if workload.get('activation_checkpointing') else 'off'}); the search also varies "
            "search.space.activation_checkpointing")
    if skipped:
        say(f"note: skipping {len(skipped)} backend:cudaMallocAsync configuration(s): the virtual GPU "
            "simulates only the native caching allocator (measure them with oomtune search on a GPU)")
    if unwritable:
        say(f"note: the stream cache {store.directory} cannot be written ({unwritable}): the captures made now "
            f"are not kept (set OOMTUNE_CACHE_DIR to a writable directory, or to off)")
    from oomtune.config import budget_note
    from oomtune.device import fraction_note

    for note in (budget_note(conf.budget), fraction_note(conf.budget, device, budget_bytes)):
        if note:
            say(note)
    with _capture_progress(console, len(settings)) as on_row:
        fmap = build_plan(predictor, settings, grid, workload=workload, device=dev, limit_bytes=limit_bytes,
                          headroom=headroom, on_row=on_row, dense=choices is None)
    captured_on = set(predictor.captured_on)   # the map's captures (the soak may add more)
    fmap.skipped = skipped
    if worst is not workload:
        _soak_plan(fmap, workload, worst, predictor, conf.trial.soak_steps, grid[0], say)
    _print_plan(console, say, fmap)
    for reason in fmap.fallback:
        say(f"note: {reason}")
    if predictor.derivation_note:
        say(f"note: {predictor.derivation_note}")
    source = "cpu" if "cpu" in captured_on else "meta"   # the captures' device (a field, not the notes' words)
    if fmap.cached:
        source = (f"{source}, all read from the stream cache {predictor.cache.directory}" if fmap.cached == fmap.captures
                  else f"{source}, {fmap.cached} of them read from the stream cache {predictor.cache.directory}")
    elif getattr(predictor, "cache", None) is not None and not unwritable:
        source = f"{source}, kept in the stream cache {predictor.cache.directory}"
    say(f"capture {fmap.capture_s:.2f} s ({fmap.captures} batch sizes on {source}"
        f"{f', {fmap.derived} more derived' if fmap.derived else ''}), replay "
        f"{fmap.replay_s:.2f} s ({fmap.replays} replays), total {fmap.total_s:.2f} s")
    say(f"wrote {write_plan(fmap, path)}")
    if path.name == "plan.yaml" and write_report is not None:
        write_report(path.parent, say)
    return fmap


def _cards_of(cfg: Any, overrides: list[str]) -> Any:
    """``gpu=``'s cards and budgets (:func:`oomtune.gpu.catalogue.resolve_cards`,
    :func:`oomtune.plan.cards.card_budgets`: each card's memory unless ``budget=`` was given), or
    None without ``gpu=`` (the single-card plan of ``model.gpu``).

    Raises:
        ConfigError / DeviceError: an unknown card, a bad card file, a budget above a card.
    """
    value = cfg.get("gpu")
    if value is None:
        return None
    from oomtune import config as C
    from oomtune.gpu.catalogue import resolve_cards
    from oomtune.plan.cards import card_budgets

    cards = resolve_cards(value if isinstance(value, (str, int, float)) else C.to_container(value))
    given = any(o.lstrip("+").split("=", 1)[0].strip() == "budget" for o in list(overrides) + C.env_overrides())
    budget = str(cfg.budget) if given else None
    return cards, card_budgets(cards, budget), budget


def _soak_plan(fmap: Any, workload: JsonObject, worst: JsonObject, predictor: Any, steps: int, low: int,
               say: Any) -> None:
    """Under a shape distribution: record the worst shape in ``fmap.shapes`` and soak every
    configuration's largest batch for ``steps`` steps of the data's shapes, stepping it down to the
    largest that survives (:func:`oomtune.plan.soak_frontier.soak_rows`); ``steps`` 0: no soak."""
    from oomtune.plan.feasibility import PlanCell
    from oomtune.trial.soak import soak_supported
    from oomtune.workloads.shapes import shape_distribution

    dist = shape_distribution({k: v for k, v in workload.items() if k != "target"})
    fmap.shapes = {"key": dist.key, "worst": worst.get(dist.key), "soak_steps": steps}
    say(f"shapes: {dist.key} varies ({dist.kind}): the map is predicted at the worst shape, {dist.key}={worst.get(dist.key)}"
        + (f", and each configuration's largest batch soaked for {steps} steps of the data's shapes" if steps else ""))
    if steps <= 0 or not soak_supported(workload):
        return
    from oomtune.plan.soak_frontier import soak_rows

    limit = fmap.limit_bytes
    done = soak_rows(fmap.rows, workload, predictor.geometry, steps=steps, low=low,
                     cell=lambda b, st: PlanCell.of(predictor.predict_detail(b, st), limit),
                     timeout_s=predictor.timeout_s, limit_name=predictor.timeout_name)
    fmap.shapes.update(soak_captures=done.captures, soak_s=round(done.seconds, 3),
                       stepped_down={k: list(v) for k, v in done.stepped_down.items()})
    if done.stepped_down:
        first_conf, (was, now) = next(iter(done.stepped_down.items()))
        row = next(r for r in fmap.rows if r.alloc_conf == first_conf)
        failed = row.soak["failed"]
        say(f"soak: {len(done.stepped_down)} configuration(s) stepped down to the largest batch that survives "
            f"{steps} steps, e.g. {first_conf or 'the default allocator'} {was} -> {now if now is not None else 'none'} "
            f"(batch {was} ran out of memory at soak step {failed['step']}, {dist.key}={failed['shape']}; simulated)")
    else:
        say(f"soak: every configuration's largest batch survives {steps} steps (simulated)")


def _print_plan(console: Any, say: Any, fmap: Any) -> None:
    """The compact map (fits 120 columns: configurations abbreviated, with a legend) and the one-line
    recommendation; the full table goes into report.html."""
    from oomtune.display import plan_compact_table, plan_recommendation

    data = fmap.to_dict()
    table, legend = plan_compact_table(data, width=min(120, getattr(console, "width", None) or 120))
    console.print(table)
    say(legend)
    rec = plan_recommendation(data["configurations"])
    if rec:
        say(f"recommendation (simulated): {rec}")
        high = max((c.get("max_batch_size") or 0 for c in data["configurations"]), default=0)
        if high and high >= max(data.get("batch_sizes") or [0]) > 0:
            say(f"note: batch {high} is the top of the searched range: a larger batch was not tried; "
                "raise search.batch_size.high")


@contextlib.contextmanager
def _capture_progress(console: Any, n_configs: int) -> Any:
    """A live bar over the configurations (capture and replay; elapsed and estimate to the end) on a
    terminal; nothing otherwise (CI logs get the table). Yields the ``on_row`` callback."""
    if not getattr(console, "is_terminal", False):
        yield None
        return
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn,
                               TimeElapsedColumn, TimeRemainingColumn)

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(bar_width=24), MofNCompleteColumn(),
                  TextColumn("elapsed"), TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                  console=console, transient=True) as bar:
        task = bar.add_task("capturing on meta, replaying configurations", total=n_configs)
        yield lambda row: bar.update(task, advance=1, description=f"replayed {row.alloc_conf or '(default)'}"[:60])


def _printer(console: Any) -> Any:
    def say(text: str) -> None:
        console.print(text, highlight=False, markup=False)

    return say
