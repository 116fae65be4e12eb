"""What ``oomtune search`` writes for the report beside best.yaml: the predicted frontier
(``frontier.yaml``, plan.yaml's schema, for the configurations the study tried) and the winner's step
(``winner_step.pickle``, ``_dump_snapshot()`` format). Both come from the virtual GPU (simulated).

Called by the search once its outputs are written; reads best.yaml and the study's trials, so it
depends on the stored artifacts, not on the search driver.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from oomtune.htmlreport._data import FRONTIER_FILE, STEP_FILE
from oomtune.workload_spec import JsonObject

__all__ = ["write_search_artifacts", "frontier_settings", "MAX_FRONTIER_CONFIGS"]

#: Configurations drawn in a search's frontier: the default, the winner and the most-tried others.
MAX_FRONTIER_CONFIGS = 6


def frontier_settings(best: dict[str, Any], trials: list[dict[str, Any]], candidates: list[str] = (),
                      limit: int = MAX_FRONTIER_CONFIGS) -> list[str]:
    """The alloc_conf strings to draw: torch's default (""), the winner's, the configurations the study
    tried (most trials first, predicted-infeasible ones included), then ``candidates`` (the search
    space, fewest keys first), at most ``limit`` in all; cudaMallocAsync ones are left out (the
    virtual GPU cannot replay them)."""
    chosen = [""]
    winner = ((best or {}).get("best") or {}).get("alloc_conf") or ""
    if winner not in chosen:
        chosen.append(winner)
    counts: dict[str, int] = {}
    for t in trials:
        if t.get("role") != "confirm":
            conf = t.get("alloc_conf") or ""
            counts[conf] = counts.get(conf, 0) + 1
    tried = [c for c, _n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
    rest = sorted(candidates, key=lambda c: (c.count(",") if c else -1, c))
    for conf in tried + rest:
        if len(chosen) >= limit:
            break
        if conf not in chosen and "cudaMallocAsync" not in conf:
            chosen.append(conf)
    return chosen


def frontier_batches(trials: list[dict[str, Any]], best_batch: int | None, *, captured: bool,
                     limit: int = 8) -> list[int]:
    """The frontier's batch sizes: those of the study's trials (the search's predictor has captured
    them already: ``captured``), plus the winner's. Without a predictor to reuse, at most ``limit``
    of them, spread over the range (each new batch size costs one capture on meta)."""
    sizes = sorted({int(t["batch_size"]) for t in trials if t.get("batch_size")} | ({best_batch} if best_batch else set()))
    if captured or len(sizes) <= limit:
        return sizes
    keep = {sizes[round(i * (len(sizes) - 1) / (limit - 1))] for i in range(limit)}
    return sorted(keep | ({best_batch} if best_batch else set()))


def write_search_artifacts(run_dir: Path, *, workload: JsonObject, device: Any, budget_bytes: int,
                           headroom: float, predictor: Any = None, space: Any = None,
                           predicted_frontiers: bool | None = None) -> list[str]:
    """Write frontier.yaml and winner_step.pickle into ``run_dir`` (simulated on the virtual GPU).

    The frontier (plan.yaml's schema): with the search's predictor, every configuration of ``space``
    exactly as ``oomtune plan`` computes it (the search's frontier probes already predicted them, so
    the replays are cached); without one (``search.prune=off``), :func:`frontier_settings` at
    :func:`frontier_batches`, each configuration's ``max_batch_size`` the largest of those batches
    that fits (not bisected, to keep captures few). The winner's step is its captured stream replayed under
    its settings (:func:`oomtune.htmlreport._step.synthesise_snapshot`).

    Args:
        workload: the trial workload mapping (built-in model or ``target=python``; a ``cmd`` target
            cannot be captured and nothing is written).
        device: the resolved :class:`oomtune.device.TargetDevice`; budget_bytes / headroom: the search's.
        predictor: the search's :class:`oomtune.plan.predictor.Predictor`, or its
            :class:`oomtune.plan.variants.PredictorVariants` when the candidates train different
            steps (a global batch's accumulation, activation checkpointing searched: the winner's
            step is then its own variant's stream). Built once per search, by
            :mod:`oomtune.search.run`; its captures are reused. None: nothing to predict with (a
            ``cmd`` target whose trials recorded no streams).
        predicted_frontiers: whether ``predictor`` predicted the search's frontiers
            (``search.prune=predicted``: the whole map is in its cache); default: it did when given.
        space: the :class:`oomtune.space.SearchSpace`; its configurations fill the frontier up to
            :data:`MAX_FRONTIER_CONFIGS` when the study tried fewer.

    Returns:
        notes to print (what was written, or why not).

    Raises:
        whatever capture or replay raises (the caller reports it in one line and goes on).
    """
    from oomtune.alloc.settings import AllocatorSettings
    from oomtune.plan.feasibility import (FeasibilityMap, PlanCell, PlanRow, build_plan, grid_batches, limit_bytes_of,
                                          write_plan)
    from oomtune.plan.predictor import sim_geometry
    from oomtune.htmlreport._data import gather
    from oomtune.htmlreport._step import synthesise_snapshot, write_step_snapshot

    from oomtune.trial._base import find_target, target_name

    target = target_name(workload)
    known = find_target(target)
    if (known is None or not known.capturable) and predictor is None:
        return [f"report: no predicted frontier or winner's step for target={target} (its trials recorded no "
                "allocation streams to replay, and a command cannot be captured without running it)"]
    if predictor is None:
        return [f"report: no predicted frontier or winner's step for target={target} (the search gave no predictor)"]
    data = gather(run_dir)
    captured = predictor is not None if predicted_frontiers is None else predicted_frontiers
    best = (data.best or {}).get("best") or {}
    limit_bytes = limit_bytes_of(budget_bytes, headroom)
    dev = {"kind": device.kind, "name": device.name, "total_memory_bytes": device.total_memory_bytes,
           "budget_bytes": budget_bytes, "memory_source": "simulated"}
    ckpt = best.get("activation_checkpointing")
    variant = {} if ckpt is None else {"checkpointing": ckpt}
    if captured and space is not None:
        # The search predicted every configuration's frontier with this predictor (plan's code, same
        # grid): the whole map is in its cache, so this is plan.yaml's map at no capture cost. With
        # activation checkpointing searched, the map is the winner's (on or off).
        choices = space.batch_choices()
        grid = choices if choices is not None else grid_batches(space.batch_low, space.batch_high)
        grid = [b for b in grid if getattr(predictor, "can_predict", lambda b, **kw: True)(b, **variant)]
        settings_list = [{**m, **({} if ckpt is None else {"activation_checkpointing": ckpt})}
                         for m in space.all_settings()]
        fmap = build_plan(predictor, settings_list, grid, workload=workload, device=dev,
                          limit_bytes=limit_bytes, headroom=headroom, dense=choices is None)
        rows = fmap.rows
    else:
        grid = frontier_batches(data.trials, best.get("batch_size"), captured=captured)
        candidates = []
        for mapping in space.all_settings() if space is not None else ():
            settings = AllocatorSettings.from_mapping({k: v for k, v in mapping.items() if v is not None})
            candidates.append(settings.render())
        rows = []
        for conf in frontier_settings(data.best or {}, data.trials, candidates):
            settings = AllocatorSettings.parse(conf)
            cells = [PlanCell.of(predictor.predict_detail(b, settings, **variant), limit_bytes) for b in grid]
            fitting = [c for c in cells if c.fits]
            rows.append(PlanRow(settings.render(), settings.as_mapping(), cells,
                                fitting[-1].batch_size if fitting else None, fitting[-1] if fitting else None))
        fmap = FeasibilityMap(workload=workload, device=dev, geometry=dict(predictor.geometry), batch_sizes=grid,
                              rows=rows, headroom=float(headroom), limit_bytes=limit_bytes,
                              fallback=sorted(predictor.fallback_reasons))
    write_plan(fmap, run_dir / FRONTIER_FILE)
    notes = [f"wrote {run_dir / FRONTIER_FILE} (predicted frontier: {len(rows)} configurations x "
             f"{len(grid)} batch sizes, simulated)"]
    can = getattr(predictor, "can_predict", lambda b, **kw: True)
    if best.get("batch_size") and can(int(best["batch_size"]), **variant):
        geometry = sim_geometry(device, budget_bytes)
        stream = predictor.stream(int(best["batch_size"]), **variant)
        snap = synthesise_snapshot(stream, best.get("alloc_conf") or "",
                                   total_memory_bytes=int(geometry["total_memory_bytes"]),
                                   memory_fraction=float(geometry["memory_fraction"]))
        write_step_snapshot(run_dir / STEP_FILE, snap)
        notes.append(f"wrote {run_dir / STEP_FILE} (the winner's step on the virtual GPU in _dump_snapshot "
                     "format: drag it onto https://pytorch.org/memory_viz)")
    return notes
