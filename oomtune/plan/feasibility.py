"""The feasibility map of ``oomtune plan``: per allocator configuration, the largest batch that fits
the budget on the virtual GPU, and the predicted peak reserved / fragmentation at each batch size.

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
    timing: {capture_s, replay_s, total_s, captures, replays}
    fallback: [reasons the capture did not run as asked (CPU fallback, precision)]
    configurations:
      - {alloc_conf, settings, max_batch_size (null: not even the smallest),
         at_max: {peak_reserved_bytes, peak_allocated_bytes, fragmentation} | null,
         batches: [{batch_size, fits, peak_reserved_bytes, peak_allocated_bytes, fragmentation,
                    num_alloc_retries}]}
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

__all__ = ["PlanCell", "PlanRow", "FeasibilityMap", "grid_batches", "largest_fitting", "build_plan",
           "write_plan", "plan_table", "PLAN_SCHEMA_VERSION"]

PLAN_SCHEMA_VERSION = 1


@dataclass(frozen=True)
class PlanCell:
    """One (configuration, batch size) prediction; bytes, simulated."""

    batch_size: int
    fits: bool
    peak_reserved_bytes: int
    peak_allocated_bytes: int
    fragmentation: float | None
    num_alloc_retries: int

    @classmethod
    def of(cls, pred: Any) -> "PlanCell":
        """From a :class:`oomtune.plan.predictor.Prediction`."""
        return cls(pred.batch_size, bool(pred.fits), int(pred.peak_reserved_bytes),
                   int(pred.peak_allocated_bytes), pred.fragmentation, int(pred.num_alloc_retries))


@dataclass
class PlanRow:
    """One allocator configuration: the grid cells and the largest fitting batch (None: not even
    the smallest grid batch fits)."""

    alloc_conf: str
    settings: dict[str, Any]
    cells: list[PlanCell]
    max_batch_size: int | None
    at_max: PlanCell | None


@dataclass
class FeasibilityMap:
    """The whole plan: rows per configuration, the grid, where and how long it took."""

    workload: dict[str, Any]
    device: dict[str, Any]
    geometry: dict[str, Any]
    batch_sizes: list[int]
    rows: list[PlanRow]
    capture_s: float = 0.0
    replay_s: float = 0.0
    total_s: float = 0.0
    captures: int = 0
    replays: int = 0
    fallback: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """The plan.yaml mapping (see the module docstring)."""
        return {
            "schema_version": PLAN_SCHEMA_VERSION, "kind": "plan",
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "workload": self.workload, "device": self.device, "geometry": self.geometry,
            "memory_source": "simulated", "batch_sizes": list(self.batch_sizes),
            "timing": {"capture_s": round(self.capture_s, 3), "replay_s": round(self.replay_s, 3),
                       "total_s": round(self.total_s, 3), "captures": self.captures,
                       "replays": self.replays},
            "fallback": sorted(self.fallback),
            "configurations": [
                {"alloc_conf": r.alloc_conf, "settings": r.settings, "max_batch_size": r.max_batch_size,
                 "at_max": None if r.at_max is None else _cell_figures(r.at_max),
                 "batches": [asdict(c) for c in r.cells]}
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
    if not (isinstance(low, int) and isinstance(high, int)) or not 1 <= low <= high:
        raise ConfigError(f"search.batch_size must satisfy 1 <= low <= high, got low={low!r} high={high!r}")
    out = {low, high}
    p = 1
    while p <= high:
        if p >= low:
            out.add(p)
        p *= 2
    return sorted(out)


def largest_fitting(fits: Callable[[int], bool], grid: Sequence[int]) -> int | None:
    """The largest batch ``b`` in ``[grid[0], grid[-1]]`` with ``fits(b)``, assuming ``fits`` is
    monotone (True up to some batch, False above).

    Scans the sorted ``grid`` upward until the first failure, then bisects between the last fitting
    grid point and that failure: O(len(grid) + log2(gap)) calls of ``fits``.

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
    if first_bad is None:
        return last_ok
    lo, hi = last_ok, first_bad  # fits(lo), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def build_plan(predictor: Any, settings_list: Sequence[dict[str, Any]], grid: Sequence[int], *,
               workload: dict[str, Any], device: dict[str, Any], on_row: Callable[[PlanRow], None] | None = None
               ) -> FeasibilityMap:
    """Predict every configuration at every grid batch and bisect its largest fitting batch.

    Args:
        predictor: a :class:`oomtune.plan.predictor.Predictor` (its geometry is the trial's).
        settings_list: allocator key -> value mappings (None = unset), e.g.
            ``SearchSpace.all_settings()``.
        grid: batch sizes, see :func:`grid_batches`.
        workload / device: recorded as they are in plan.yaml.
        on_row: called after each configuration (progress).

    Raises:
        AllocatorConfigError: a combination torch would reject. ConfigError: a bad workload.
    """
    from oomtune.alloc.settings import AllocatorSettings

    t0 = time.perf_counter()
    grid = sorted(grid)
    rows: list[PlanRow] = []
    for mapping in settings_list:
        settings = AllocatorSettings.from_mapping({k: v for k, v in mapping.items() if v is not None})
        conf = settings.render()
        cells = [PlanCell.of(predictor.predict_detail(b, settings)) for b in grid]
        best = largest_fitting(lambda b: predictor.predict_detail(b, settings).fits, grid)
        at_max = None if best is None else PlanCell.of(predictor.predict_detail(best, settings))
        rows.append(PlanRow(conf, {k: v for k, v in mapping.items() if v is not None}, cells, best, at_max))
        if on_row is not None:
            on_row(rows[-1])
    return FeasibilityMap(
        workload=workload, device=device, geometry=dict(predictor.geometry), batch_sizes=list(grid),
        rows=rows, capture_s=predictor.capture_seconds, replay_s=predictor.replay_seconds,
        total_s=time.perf_counter() - t0, captures=len(predictor._streams),
        replays=getattr(predictor, "replays", 0), fallback=sorted(predictor.fallback_reasons),
    )


def write_plan(plan: FeasibilityMap, path: str | Path) -> Path:
    """Write plan.yaml atomically (temp file + rename). Returns the path.

    Raises:
        ConfigError: the file cannot be written (one line naming the path).
    """
    import yaml

    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(yaml.safe_dump(plan.to_dict(), sort_keys=False))
        tmp.replace(path)
    except OSError as exc:
        raise ConfigError(f"cannot write {str(path)!r}: {exc.strerror or exc}") from None
    return path


def _short(n: int) -> str:
    """Compact binary size for table cells: ``"24.0M"``, ``"1.50G"``."""
    for unit, scale in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale:
            value = n / scale
            return f"{value:.2f}{unit}" if value < 10 else f"{value:.1f}{unit}"
    return f"{n}B"


def _cell_text(c: PlanCell) -> str:
    if not c.fits:
        return f"[red]OOM[/red] {_short(c.peak_reserved_bytes)}"
    frag = "-" if c.fragmentation is None else f"{c.fragmentation:.0%}"
    return f"{_short(c.peak_reserved_bytes)} {frag}"


def plan_table(plan: FeasibilityMap) -> Any:
    """A rich Table: one row per configuration, its largest fitting batch and, per grid batch, the
    predicted peak reserved and fragmentation (all simulated)."""
    from rich.table import Table

    budget = plan.device.get("budget_bytes")
    table = Table(title=f"feasibility map (simulated), budget {format_bytes(budget)}",
                  header_style="bold", caption="b=N: predicted peak reserved (simulated, K/M/G = KiB/MiB/GiB) "
                  "and fragmentation (1 - peak active / peak reserved); OOM: does not fit, needs that much")
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
