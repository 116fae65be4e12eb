"""The feasibility map of ``oomtune plan``: per allocator configuration, the largest batch that fits
the budget on the virtual GPU, and the predicted peak reserved / fragmentation at each batch size.

"Fits" is the search's feasibility (:class:`oomtune.study.records.MemoryLimit`): the replay under
the trial's limits completes without running out of memory AND the predicted peak reserved is at
most the limit ``budget_bytes * (1 - search.headroom)`` (inclusive). Configurations the virtual GPU
cannot simulate (``backend:cudaMallocAsync``: the driver's stream-ordered pool, not the caching
allocator) are left out (:func:`split_simulable`).

Every figure is simulated: the workload's request stream is captured on the meta device once per
batch size (:class:`oomtune.plan.predictor.Predictor`) and replayed under each configuration with
the trial's geometry (:func:`oomtune.plan.predictor.sim_geometry`: on CPU the budget is the virtual
GPU's capacity; on a CUDA device the budget is a memory fraction of the device).

The largest fitting batch is found exactly: the grid (powers of two from ``low`` to ``high``, plus
both ends) brackets it, then bisection between the last fitting and the first failing grid point.
This relies on memory being monotone (non-decreasing) in the batch size, which holds for the
built-in workloads (every activation scales with the batch) and is assumed for user targets.

plan.yaml (schema 1)::

    schema_version: 1
    kind: plan
    created: ISO-8601 time
    workload: {model: {...}, target: {...}}
    device: {kind, name, total_memory_bytes, budget_bytes, memory_source}
    geometry: {total_memory_bytes, memory_fraction}     # the virtual GPU replays ran on
    memory_source: simulated
    batch_sizes: [8, 16, ...]                           # the grid
    timing: {capture_s, derive_s, replay_s, total_s, captures, derived, cached, replays}  # cached: captures read from the stream cache
    limit: {headroom, limit_bytes}                      # fits: completes and peak <= limit_bytes
    fallback: [reasons the capture did not run as asked (CPU fallback, precision)]
    skipped: [alloc_conf strings the virtual GPU cannot simulate (cudaMallocAsync)]
    shapes: {key, worst, soak_steps, soak_captures, stepped_down} | null   # a shape distribution (else null)
    configurations:
      - {alloc_conf, settings, max_batch_size (null: not even the smallest),
         at_max: {peak_reserved_bytes, peak_allocated_bytes, fragmentation} | null,
         batches: [{batch_size, fits, completes, peak_reserved_bytes, peak_allocated_bytes,
                    fragmentation, num_alloc_retries}],
         twins: [alloc_conf strings predicted identical, folded into this one],
         twin_of: alloc_conf this one is folded into | null,
         worst_shape_max_batch_size, soak: {steps, passed, batch_size, failed}}   # under a distribution only

Under a shape distribution the cells are predicted at the distribution's worst shape (as the search's
frontier) and ``max_batch_size`` is the largest batch that also survives ``trial.soak_steps`` steps of
the data's shapes (:mod:`oomtune.plan.soak_frontier`).

Configurations with identical predictions (:func:`twin_key`) are *twins*: ``oomtune plan`` shows
them once and the search probes them once (:mod:`oomtune.search.frontier`), represented by the one
with the fewest keys set (:func:`fold_rank`).
"""

from __future__ import annotations

import datetime as _dt
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from oomtune.exceptions import ConfigError
from oomtune.units import format_bytes
from oomtune.workload_spec import JsonObject

__all__ = ["PlanCell", "PlanRow", "FeasibilityMap", "grid_batches", "largest_fitting", "frontier_row", "build_plan",
           "write_plan", "plan_table", "check_writable", "validate_headroom", "limit_bytes_of", "split_simulable",
           "PLAN_SCHEMA_VERSION", "twin_key", "fold_rank", "fold_twins"]

PLAN_SCHEMA_VERSION = 1


def validate_headroom(value: Any) -> float:
    """``search.headroom`` as a float in ``[0, 1)``: the fraction of the budget kept free.

    Raises:
        ConfigError: not a number, or outside ``[0, 1)``.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ConfigError(f"search.headroom={value!r}: expected a fraction in [0, 1) such as 0.05 "
                          "(the share of the budget kept free)")
    return float(value)


def limit_bytes_of(budget_bytes: int, headroom: float) -> int:
    """The peak a feasible trial may reach, ``int(budget_bytes * (1 - headroom))``: the search's own
    :class:`oomtune.trial.budget.MemoryLimit`, so that plan and search agree to the byte."""
    from oomtune.trial.budget import MemoryLimit

    return MemoryLimit(int(budget_bytes), float(headroom)).limit_bytes


def split_simulable(settings_list: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """Separate the configurations the virtual GPU can replay (``backend`` native or unset) from the
    others. Returns (simulable mappings, rendered alloc_conf strings of the rest)."""
    from oomtune.alloc.settings import AllocatorSettings

    kept: list[dict[str, Any]] = []
    skipped: list[str] = []
    for mapping in settings_list:
        if mapping.get("backend") in (None, "native"):
            kept.append(mapping)
        else:
            set_keys = {k: v for k, v in mapping.items() if v is not None and k != CHECKPOINTING_KEY}
            skipped.append(AllocatorSettings.from_mapping(set_keys).render())
    return kept, skipped


@dataclass(frozen=True)
class PlanCell:
    """One (configuration, batch size) prediction; bytes, simulated.

    ``completes``: the replay under the trial's limits ran without OOM; ``fits``: it completes and
    the peak reserved is within the limit (budget minus headroom)."""

    batch_size: int
    fits: bool
    peak_reserved_bytes: int
    peak_allocated_bytes: int
    fragmentation: float | None
    num_alloc_retries: int
    completes: bool = True
    predicted: bool = True   # False: not captured, above a batch whose requests alone exceed the limit

    @classmethod
    def beyond(cls, batch_size: int) -> "PlanCell":
        """A cell left unpredicted: above a batch whose live requests alone exceed the limit
        (:meth:`oomtune.plan.predictor.Predictor.known_over_limit`), so it cannot fit either; no peaks."""
        return cls(batch_size, False, 0, 0, None, 0, False, predicted=False)

    @classmethod
    def of(cls, pred: Any, limit_bytes: int | None = None) -> "PlanCell":
        """From a :class:`oomtune.plan.predictor.Prediction`; ``limit_bytes`` None: no headroom
        (fits = completes)."""
        completes = bool(pred.fits)
        fits = completes and (limit_bytes is None or int(pred.peak_reserved_bytes) <= limit_bytes)
        return cls(pred.batch_size, fits, int(pred.peak_reserved_bytes), int(pred.peak_allocated_bytes),
                   pred.fragmentation, int(pred.num_alloc_retries), completes)


@dataclass
class PlanRow:
    """One allocator configuration: the grid cells and the largest fitting batch (None: not even
    the smallest grid batch fits)."""

    alloc_conf: str
    settings: dict[str, Any]
    cells: list[PlanCell]
    max_batch_size: int | None
    at_max: PlanCell | None
    worst_shape_max_batch_size: int | None = None   # under a shape distribution: before the soak
    soak: dict[str, Any] | None = None              # the soak of the largest batch (oomtune.plan.soak_frontier)


def twin_key(row: PlanRow) -> tuple:
    """What makes two configurations *twins* (identical predictions: shown once by ``oomtune plan``,
    probed once by the search): the same largest fitting batch, the same predicted peak reserved and
    allocated there, and the same predicted peak reserved at every grid batch."""
    at = row.at_max
    return (row.max_batch_size, None if at is None else (at.peak_reserved_bytes, at.peak_allocated_bytes),
            tuple((c.batch_size, c.peak_reserved_bytes) for c in row.cells))


def fold_rank(alloc_conf: str) -> tuple[int, int]:
    """Which twin stands for the others: the fewest keys set, then the shortest string (the first
    listed on a tie)."""
    return (0 if not alloc_conf else alloc_conf.count(",") + 1, len(alloc_conf))


def fold_twins(rows: Sequence[PlanRow]) -> dict[str, str]:
    """``{alloc_conf of a folded row: alloc_conf of the row it is folded into}`` over the rows with
    identical predictions (:func:`twin_key`); representatives (:func:`fold_rank`) are not keys."""
    groups: dict[tuple, list[PlanRow]] = {}
    for row in rows:
        groups.setdefault(twin_key(row), []).append(row)
    folded = {}
    for members in groups.values():
        rep = min(members, key=lambda r: fold_rank(r.alloc_conf))
        folded.update({r.alloc_conf: rep.alloc_conf for r in members if r is not rep})
    return folded


@dataclass
class FeasibilityMap:
    """The whole plan: rows per configuration, the grid, where and how long it took."""

    workload: JsonObject
    device: dict[str, Any]
    geometry: dict[str, Any]
    batch_sizes: list[int]
    rows: list[PlanRow]
    capture_s: float = 0.0
    replay_s: float = 0.0
    total_s: float = 0.0
    captures: int = 0
    replays: int = 0
    derived: int = 0   # batch sizes whose stream was derived, not captured
    derive_s: float = 0.0   # seconds deriving streams from the affine model
    cached: int = 0   # of the captures, those read from the stream cache (oomtune.plan.stream_cache)
    fallback: list[str] = field(default_factory=list)
    headroom: float = 0.0
    limit_bytes: int | None = None
    skipped: list[str] = field(default_factory=list)
    shapes: dict[str, Any] | None = None   # a shape distribution: {key, worst, soak_steps, ...} (None: fixed)

    def to_dict(self) -> dict[str, Any]:
        """The plan.yaml mapping (see the module docstring)."""
        folded = fold_twins(self.rows)
        return {
            "schema_version": PLAN_SCHEMA_VERSION, "kind": "plan",
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "workload": self.workload, "device": self.device, "geometry": self.geometry,
            "memory_source": "simulated", "batch_sizes": list(self.batch_sizes),
            "timing": {"capture_s": round(self.capture_s, 3), "derive_s": round(self.derive_s, 3),
                       "replay_s": round(self.replay_s, 3),
                       "total_s": round(self.total_s, 3), "captures": self.captures,
                       "derived": self.derived, "cached": self.cached, "replays": self.replays},
            "limit": {"headroom": self.headroom, "limit_bytes": self.limit_bytes},
            "fallback": sorted(self.fallback),
            "skipped": list(self.skipped),
            "shapes": self.shapes,
            "configurations": [
                {"alloc_conf": r.alloc_conf, "settings": r.settings, "max_batch_size": r.max_batch_size,
                 "at_max": None if r.at_max is None else _cell_figures(r.at_max),
                 "batches": [asdict(c) for c in r.cells],
                 "twins": [x.alloc_conf for x in self.rows if folded.get(x.alloc_conf) == r.alloc_conf],
                 "twin_of": folded.get(r.alloc_conf),
                 **({} if r.soak is None else {"worst_shape_max_batch_size": r.worst_shape_max_batch_size,
                                               "soak": r.soak})}
                for r in self.rows
            ],
        }


def _cell_figures(c: PlanCell) -> dict[str, Any]:
    return {"peak_reserved_bytes": c.peak_reserved_bytes, "peak_allocated_bytes": c.peak_allocated_bytes,
            "fragmentation": c.fragmentation}


def grid_batches(low: int, high: int, explicit: Sequence[int] | None = None) -> list[int]:
    """The batch sizes to tabulate: ``explicit`` (sorted, deduplicated) if given, else the powers of
    two in ``[low, high]`` plus ``low`` and ``high`` themselves.

    Raises:
        ConfigError: ``1 <= low <= high`` violated, or an explicit size that is not an int >= 1.
    """
    if explicit is not None:
        values = list(explicit)
        if not values or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in values):
            raise ConfigError(f"plan.batch_sizes={values!r}: expected a non-empty list of integers >= 1")
        return sorted(set(values))
    from oomtune.space import check_batch_range

    check_batch_range(low, high)
    out = {low, high}
    p = 1
    while p <= high:
        if p >= low:
            out.add(p)
        p *= 2
    return sorted(out)


def largest_fitting(fits: Callable[[int], bool], grid: Sequence[int], *, dense: bool = True) -> int | None:
    """The largest batch ``b`` in ``[grid[0], grid[-1]]`` with ``fits(b)``, assuming ``fits`` is
    monotone (True up to some batch, False above).

    Scans the sorted ``grid`` upward until the first failure, then bisects between the last fitting
    grid point and that failure: O(len(grid) + log2(gap)) calls of ``fits``. ``dense=False``: only the
    grid's own values are batch sizes (the micro-batches of a global batch): no bisection between them.

    Returns:
        the batch size, or None when ``fits(grid[0])`` is False.
    """
    grid = sorted(grid)
    last_ok: int | None = None
    first_bad: int | None = None
    for b in grid:
        if fits(b):
            last_ok = b
        else:
            first_bad = b
            break
    if last_ok is None:
        return None
    if first_bad is None or not dense:
        return last_ok
    lo, hi = last_ok, first_bad  # fits(lo), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


#: A configuration key that is not an allocator key: activation checkpointing (a training setting,
#: ``search.space.activation_checkpointing``), predicted by another variant of the workload
#: (:class:`oomtune.plan.variants.PredictorVariants`).
CHECKPOINTING_KEY = "activation_checkpointing"


def frontier_row(predictor: Any, mapping: dict[str, Any], grid: Sequence[int], limit_bytes: int | None, *,
                 dense: bool = True) -> PlanRow:
    """One configuration's predicted frontier: the grid cells and the largest batch that fits
    (:func:`largest_fitting` over ``grid``, exact by bisection), as ``oomtune plan`` and the search's
    frontier probes (:mod:`oomtune.search.frontier`) both compute it.

    Args:
        predictor: a :class:`oomtune.plan.predictor.Predictor` (or
            :class:`oomtune.plan.variants.PredictorVariants` when ``mapping`` has
            ``activation_checkpointing``).
        mapping: allocator key -> value (None = unset); must be simulable (:func:`split_simulable`);
            may also hold ``activation_checkpointing``.
        grid: sorted batch sizes (:func:`grid_batches`).
        limit_bytes: as in :func:`build_plan`.
        dense: False when only the grid's batch sizes are allowed (a global batch's micro-batches).

    Raises:
        AllocatorConfigError: a combination torch would reject. ConfigError: a bad workload.
    """
    from oomtune.alloc.settings import AllocatorSettings

    settings = AllocatorSettings.from_mapping({k: v for k, v in mapping.items()
                                               if v is not None and k != CHECKPOINTING_KEY})
    variant = {"checkpointing": mapping[CHECKPOINTING_KEY]} if mapping.get(CHECKPOINTING_KEY) is not None else {}

    def cell(b: int) -> PlanCell:
        return PlanCell.of(predictor.predict_detail(b, settings, **variant), limit_bytes)

    beyond = [b for b in grid if _known_over(predictor, b, variant)]   # no capture: cannot fit
    cells = [PlanCell.beyond(b) if b in beyond else cell(b) for b in grid]
    predicted = [b for b in grid if b not in beyond]
    best = largest_fitting(lambda b: cell(b).fits, predicted, dense=dense) if predicted else None
    at_max = None if best is None else cell(best)
    return PlanRow(settings.render(), {k: v for k, v in mapping.items() if v is not None}, cells, best, at_max)


def _known_over(predictor: Any, batch_size: int, variant: dict[str, Any]) -> bool:
    """Whether ``predictor`` knows ``batch_size`` cannot fit without predicting it (above a batch
    whose requests alone exceed the limit, :meth:`oomtune.plan.predictor.Predictor.known_over_limit`)
    and holds no stream for it."""
    over = getattr(predictor, "known_over_limit", None)
    if over is None or not over(batch_size, **variant):
        return False
    return not predictor.can_predict(batch_size, **variant)


def build_plan(predictor: Any, settings_list: Sequence[dict[str, Any]], grid: Sequence[int], *,
               workload: JsonObject, device: dict[str, Any], limit_bytes: int | None = None,
               headroom: float = 0.0, on_row: Callable[[PlanRow], None] | None = None,
               dense: bool = True) -> FeasibilityMap:
    """Predict every configuration at every grid batch and bisect its largest fitting batch.

    Args:
        predictor: a :class:`oomtune.plan.predictor.Predictor` (its geometry is the trial's).
        settings_list: allocator key -> value mappings (None = unset), e.g.
            ``SearchSpace.all_settings()``. Configurations the virtual GPU cannot simulate
            (:func:`split_simulable`) are left out and listed in ``FeasibilityMap.skipped``.
        grid: batch sizes, see :func:`grid_batches`.
        workload / device: recorded as they are in plan.yaml.
        limit_bytes: the search's limit (:func:`limit_bytes_of`): a batch fits when its replay
            completes and its predicted peak reserved is <= this. None: completing is enough.
        headroom: recorded in plan.yaml with the limit.
        on_row: called after each configuration (progress).
        dense: False when only the grid's batch sizes are allowed (a global batch's micro-batches:
            no bisection between them).

    Raises:
        AllocatorConfigError: a combination torch would reject. ConfigError: a bad workload, or no
            configuration the virtual GPU can simulate.
    """
    t0 = time.perf_counter()
    grid = sorted(grid)
    kept, skipped = split_simulable(settings_list)
    if not kept:
        raise ConfigError("every configuration uses backend:cudaMallocAsync, which the virtual GPU cannot "
                          "simulate: add native to search.space.backend (or run oomtune search on a GPU)")
    rows: list[PlanRow] = []
    if hasattr(predictor, "prepare"):  # capture the anchors of the derived streams (Predictor.prepare)
        predictor.prepare(grid, limit_bytes=limit_bytes)
    if int(getattr(predictor, "workers", 1)) > 1 and len(kept) > 1:   # spread over processes
        from oomtune.plan._spread import rows_forked

        import functools

        rows = rows_forked(predictor, kept, grid, limit_bytes, on_row, functools.partial(frontier_row, dense=dense))
    else:
        for mapping in kept:
            rows.append(frontier_row(predictor, mapping, grid, limit_bytes, dense=dense))
            if on_row is not None:
                on_row(rows[-1])
    return FeasibilityMap(
        workload=workload, device=device, geometry=dict(predictor.geometry), batch_sizes=list(grid),
        rows=rows, capture_s=predictor.capture_seconds, replay_s=predictor.replay_seconds,
        derive_s=getattr(predictor, "derive_seconds", 0.0),
        total_s=time.perf_counter() - t0, captures=predictor.captures if hasattr(predictor, "captures") else len(predictor._streams),
        derived=len(getattr(predictor, "derived_batches", ())),
        cached=len(set(getattr(predictor, "cached_batches", ())) & set(getattr(predictor, "_captured", ()))), replays=getattr(predictor, "replays", 0), fallback=sorted(predictor.fallback_reasons),
        headroom=float(headroom), limit_bytes=limit_bytes, skipped=skipped,
    )


def check_writable(path: str | Path, label: str) -> Path:
    """Check, before any work, that a file can be written at ``path``: not a directory, and a file
    can be created in its nearest existing parent folder (probed with a temporary file removed at
    once: permission bits alone do not tell, e.g. for root or read-only file systems such as /proc).
    Nothing is left behind; missing folders are created only by the real write.

    Raises:
        ConfigError: one line naming ``label`` (e.g. ``--out``), the path and the reason.
    """
    import os
    import tempfile

    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{label} {str(path)!r} is a directory: give a file path")
    parent = path.absolute().parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    try:
        if not parent.is_dir():
            raise NotADirectoryError(f"{str(parent)!r} is not a directory")
        fd, probe = tempfile.mkstemp(prefix=".oomtune-probe-", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        # the path the user gave first, then why (the nearest existing folder and what it said: /proc
        # answers ENOENT to a new file, a read-only mount EROFS), then what to do
        missing = "" if parent == path.absolute().parent else f"; its folder {str(path.absolute().parent)!r} does not exist"
        raise ConfigError(f"{label} {str(path)!r}: cannot create the file{missing} and no file can be created in "
                          f"{str(parent)!r} ({exc.strerror or exc}): give a path in a folder you can write to, "
                          f"e.g. {label} ./{path.name}") from None
    if path.exists() and not os.access(path, os.W_OK):
        raise ConfigError(f"{label} {str(path)!r}: the file exists and is not writable")
    return path


def write_plan(plan: Any, path: str | Path) -> Path:
    """Write plan.yaml atomically (temp file + rename: :func:`oomtune.files.write_atomic`): ``plan``'s
    ``to_dict()`` (a :class:`FeasibilityMap`, or a multi-card plan). Returns the path.

    Raises:
        DiskFullError: no space left (no temporary file is left behind).
        ConfigError: the file cannot be written otherwise (one line naming the path).
    """
    import yaml

    # libyaml's emitter where PyYAML was built with it (4x faster on a ResNet-50 plan, 0.03 s against
    # 0.14 s; the same text: tests/test_plan.py), else PyYAML's own: the same safe representer
    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
    from oomtune.files import disk_full_error, is_disk_full, write_atomic

    path = Path(path)
    text = yaml.dump(plan.to_dict(), Dumper=dumper, sort_keys=False)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return write_atomic(path, text)
    except OSError as exc:
        if is_disk_full(exc):
            raise disk_full_error(path, exc) from None
        raise ConfigError(f"cannot write {str(path)!r}: {exc.strerror or exc}") from None


def _cell_text(c: PlanCell) -> str:
    if not c.predicted:
        return "[dim]>limit[/dim] (not captured)"
    size = format_bytes(c.peak_reserved_bytes)
    if not c.completes:
        return f"[red]OOM[/red] {size}"
    if not c.fits:
        return f"[yellow]>limit[/yellow] {size}"
    frag = "-" if c.fragmentation is None else f"{c.fragmentation:.0%}"
    return f"{size} {frag}"


def plan_table(plan: FeasibilityMap) -> Any:
    """A rich Table: one row per configuration, its largest fitting batch and, per grid batch, the
    predicted peak reserved and fragmentation (all simulated)."""
    from rich.table import Table

    budget = plan.device.get("budget_bytes")
    title = f"feasibility map (simulated), budget {format_bytes(budget)}"
    if plan.limit_bytes is not None:
        title += f", limit {format_bytes(plan.limit_bytes)} (headroom {plan.headroom:.0%})"
    table = Table(title=title, header_style="bold",
                  caption="b=N: predicted peak reserved (simulated) and fragmentation (1 - peak active / peak "
                  "reserved); >limit: completes but above the limit (budget minus headroom); OOM: does not "
                  "fit the budget, needs that much")
    table.add_column("alloc_conf", justify="left", overflow="fold", min_width=20)
    table.add_column("max batch", justify="right", no_wrap=True)
    table.add_column("at max (sim)", justify="right", no_wrap=True)
    for b in plan.batch_sizes:
        table.add_column(f"b={b}", justify="right", no_wrap=True)
    for r in plan.rows:
        at = "-" if r.at_max is None else _cell_text(r.at_max)
        table.add_row(r.alloc_conf or "(default)", "none" if r.max_batch_size is None else str(r.max_batch_size),
                      at, *(_cell_text(c) for c in r.cells))
    return table
