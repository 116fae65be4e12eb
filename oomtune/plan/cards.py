"""``oomtune plan ... gpu=[l4,a100-40gb,h100-80gb]``: one plan across cards of the device catalogue.

Cards that run the same kernels (one *family*: the same compute capability and SM count,
:attr:`oomtune.gpu.catalogue.Card.family`) share one set of captures: one :class:`oomtune.plan.
predictor.Predictor` per family, whose streams are replayed on each of its cards in turn
(:meth:`~oomtune.plan.predictor.Predictor.retarget`, largest card first), so a family of three cards
costs one capture and three replays per configuration and batch. Each card is a real GPU to the
virtual GPU (:func:`oomtune.plan.predictor.sim_geometry`): its capacity (``total_memory_bytes``), the
memory outside the allocator from the catalogue, cuBLAS workspaces in the captures, and its own
memory as the budget unless ``budget=`` was given (a fraction is then of each card). A batch fits as
in a single-card plan (:func:`oomtune.plan.feasibility.build_plan`). All figures are simulated.

Per card: the best configuration (the largest fitting batch; ties: the fewest keys set), its largest
batch, ``device_used`` there (the allocator's peak reserved plus the memory outside it: the whole
card, as nvidia-smi would show) and the attention backends the captures ran; with ``+plan.batch=B``
also the smallest card that fits batch B. Below :mod:`oomtune.plan.run` (which routes ``gpu=`` here);
imports nothing from the CLI or the report.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from oomtune.workload_spec import JsonObject, WorkloadSpec

__all__ = ["CardResult", "CardsPlan", "families_of", "plan_cards", "write_cards_plan"]


@dataclass
class CardResult:
    """One card's plan (bytes; simulated): ``fmap`` its :class:`~oomtune.plan.feasibility.FeasibilityMap`;
    ``best`` the chosen configuration's plan.yaml row (None: nothing fits); ``sdpa`` the attention
    backends its family's captures ran (call counts)."""

    card: Any
    budget_bytes: int
    limit_bytes: int
    fmap: Any
    best: dict[str, Any] | None
    sdpa: dict[str, int]

    @property
    def max_batch_size(self) -> int | None:
        """The best configuration's largest fitting batch (None: none fits)."""
        return None if self.best is None else self.best["max_batch_size"]

    @property
    def device_used_bytes(self) -> int | None:
        """Peak reserved at the largest batch plus the memory outside the allocator (the whole card)."""
        if self.best is None or self.best.get("at_max") is None:
            return None
        return int(self.best["at_max"]["peak_reserved_bytes"]) + int(self.card.outside_allocator_bytes)

    def fits(self, batch_size: int) -> bool:
        """Whether some configuration fits ``batch_size`` (each row's frontier is monotone:
        :func:`oomtune.plan.feasibility.largest_fitting`)."""
        return self.max_batch_size is not None and self.max_batch_size >= batch_size

    def to_dict(self) -> dict[str, Any]:
        data = self.fmap.to_dict()
        return {"card": self.card.to_dict(), "budget_bytes": self.budget_bytes, "limit_bytes": self.limit_bytes,
                "attention": dict(self.sdpa),
                "best": None if self.best is None else {
                    "alloc_conf": self.best["alloc_conf"], "max_batch_size": self.best["max_batch_size"],
                    "peak_reserved_bytes": (self.best.get("at_max") or {}).get("peak_reserved_bytes"),
                    "device_used_bytes": self.device_used_bytes},
                "geometry": data["geometry"], "fallback": data["fallback"],
                "configurations": data["configurations"]}


@dataclass
class CardsPlan:
    """The whole multi-card plan: per card its result, the grid, the batch asked (``plan.batch``)."""

    workload: JsonObject
    batch_sizes: list[int]
    results: list[CardResult]
    headroom: float
    budget: str | None
    batch: int | None
    captures: int
    replays: int
    total_s: float

    def smallest_fitting(self) -> CardResult | None:
        """The card with the least memory that fits ``batch`` (None: none does, or no batch asked)."""
        if self.batch is None:
            return None
        fit = [r for r in self.results if r.fits(self.batch)]
        return min(fit, key=lambda r: (r.card.total_memory_bytes, r.card.name)) if fit else None

    def to_dict(self) -> dict[str, Any]:
        """The plan.yaml mapping: ``kind: plan_cards``, one entry per card under ``cards``."""
        from oomtune.plan.feasibility import PLAN_SCHEMA_VERSION

        small = self.smallest_fitting()
        return {"schema_version": PLAN_SCHEMA_VERSION, "kind": "plan_cards",
                "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                "memory_source": "simulated", "workload": self.workload, "batch_sizes": list(self.batch_sizes),
                "limit": {"headroom": self.headroom, "budget": self.budget or "each card's total_memory_bytes"},
                "timing": {"captures": self.captures, "replays": self.replays, "total_s": round(self.total_s, 3)},
                "cards": [r.to_dict() for r in self.results],
                "batch": self.batch,
                "smallest_card_fitting_batch": None if small is None else small.card.name}


def families_of(cards: list[Any]) -> dict[str, list[Any]]:
    """Cards grouped by kernel family (first appearance order), each group largest memory first
    (so a smaller card's bound on what to capture is already known from a larger one's)."""
    out: dict[str, list[Any]] = {}
    for card in cards:
        out.setdefault(card.family, []).append(card)
    return {k: sorted(v, key=lambda c: -(c.total_memory_bytes or 0)) for k, v in out.items()}


def _best_row(configurations: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The configuration with the largest fitting batch (ties: the fewest keys, then the shortest)."""
    from oomtune.plan.feasibility import fold_rank

    fitting = [c for c in configurations if c.get("max_batch_size")]
    if not fitting:
        return None
    return min(fitting, key=lambda c: (-c["max_batch_size"], fold_rank(c["alloc_conf"])))


def card_budgets(cards: list[Any], budget: str | None) -> dict[str, int]:
    """Each card's budget in bytes: its ``total_memory_bytes``, or ``budget`` (a size, or a fraction
    of the card) when given.

    Raises:
        ConfigError: a card without a memory figure and no budget, or a bad budget. DeviceError: a
            budget above a card's memory. All before any capture.
    """
    from oomtune.device import TargetDevice, resolve_budget
    from oomtune.exceptions import ConfigError

    out = {}
    for card in cards:
        if card.total_memory_bytes is None:
            raise ConfigError(f"gpu={card.name}: the catalogue has no sourced total_memory_bytes for this card; set "
                              "total_memory_bytes in a copy of its file (gpu=mycard.yaml)")
        device = TargetDevice(spec="cuda:0", kind="cuda", index=0, name=card.display_name,
                              total_memory_bytes=card.total_memory_bytes, simulated=False)
        out[card.name] = card.total_memory_bytes if budget is None else resolve_budget(budget, device)
    return out


def plan_cards(cards: list[Any], budgets: dict[str, int], *, workload: WorkloadSpec, settings: list[dict[str, Any]],
               grid: list[int], headroom: float, steps: int, cache: Any, read_cache: bool, timeout_s: float,
               workers: int, budget: str | None, batch: int | None,
               say: Callable[[str], None] = lambda _s: None) -> CardsPlan:
    """Plan ``workload`` on every card: one predictor per kernel family (:func:`families_of`), one
    :func:`~oomtune.plan.feasibility.build_plan` per card (bytes; simulated).

    Raises:
        ConfigError / AllocatorConfigError: as :func:`oomtune.plan.feasibility.build_plan`.
    """
    from oomtune.device import TargetDevice
    from oomtune.plan.feasibility import build_plan, limit_bytes_of
    from oomtune.plan.predictor import Predictor, sim_geometry

    t0 = time.perf_counter()
    by_name: dict[str, CardResult] = {}
    captures = replays = 0
    for family, members in families_of(cards).items():
        fam_workload = dataclasses.replace(workload, gpu=family, gpu_source="gpu=")
        predictor = None
        for card in members:
            device = TargetDevice(spec="cuda:0", kind="cuda", index=0, name=card.display_name,
                                  total_memory_bytes=card.total_memory_bytes, simulated=False)
            geometry = sim_geometry(device, budgets[card.name], outside_bytes=card.outside_allocator_bytes)
            if predictor is None:
                predictor = Predictor(fam_workload, geometry, steps=steps, workers=workers, cache=cache,
                                      read_cache=read_cache, timeout_s=timeout_s)
            else:
                predictor.retarget(geometry)
            limit = limit_bytes_of(budgets[card.name], headroom)
            before = predictor.replays
            dev = {"kind": "cuda", "name": card.display_name, "total_memory_bytes": card.total_memory_bytes,
                   "budget_bytes": budgets[card.name], "memory_source": "device catalogue", "target_gpu": family}
            fmap = build_plan(predictor, settings, grid, workload=fam_workload.to_dict(), device=dev, limit_bytes=limit,
                              headroom=headroom)
            replays += predictor.replays - before
            by_name[card.name] = CardResult(card, budgets[card.name], limit, fmap,
                                            _best_row(fmap.to_dict()["configurations"]), predictor.sdpa_backends)
            say(f"  {card.name}: replayed ({family} kernels, {predictor.captures} captures shared by "
                f"{len(members)} card{'s' if len(members) > 1 else ''})")
        captures += predictor.captures
    results = [by_name[c.name] for c in cards]
    return CardsPlan(workload=workload.to_dict(), batch_sizes=list(grid), results=results, headroom=headroom,
                     budget=budget, batch=batch, captures=captures, replays=replays,
                     total_s=time.perf_counter() - t0)


def write_cards_plan(plan: CardsPlan, path: str | Path) -> Path:
    """Write the multi-card plan.yaml atomically, as a single-card one is written
    (:func:`oomtune.plan.feasibility.write_plan`).

    Raises:
        DiskFullError: no space left. ConfigError: the file cannot be written otherwise.
    """
    from oomtune.plan.feasibility import write_plan

    return write_plan(plan, path)


def _batch_cell(largest: int | None, top: int) -> str:
    """``largest`` as the table shows it: ``>=N`` when it is the top of the planned range (every size
    fits; none above was planned), ``none`` when no size fits."""
    if largest is None:
        return "none"
    return f">={largest}" if largest >= top else str(largest)


def cards_table(plan: CardsPlan) -> Any:
    """The terminal table: one row per card (figures simulated; ``device used`` is the whole card)."""
    from rich.table import Table

    from oomtune.units import format_bytes

    table = Table(title="per card (simulated on the virtual GPU)", title_justify="left")
    for col in ("card", "memory", "kernels", "attention", "best configuration", "largest batch",
                "device used at it") + ((f"fits {plan.batch}",) if plan.batch is not None else ()):
        table.add_column(col, justify="right" if col in ("memory", "largest batch", "device used at it") else "left")
    for r in plan.results:
        used = r.device_used_bytes
        attention = ", ".join(sorted(r.sdpa)) or "-"
        best = "-" if r.best is None else (r.best["alloc_conf"] or "default")
        row = [r.card.name, format_bytes(r.card.total_memory_bytes), r.card.family, attention, best,
               _batch_cell(r.max_batch_size, plan.batch_sizes[-1]),
               format_bytes(used) if used is not None else "-"]
        if plan.batch is not None:
            row.append("yes" if r.fits(plan.batch) else "no")
        table.add_row(*row)
    return table


def plan_multi(cards: Any, cfg: Any, *, workload: WorkloadSpec, shaped: bool, settings: list[dict[str, Any]],
               skipped: list[str], grid: list[int], headroom: float, store: Any, cache: bool, path: Path,
               console: Any, global_batch: Any, label: str) -> CardsPlan:
    """``oomtune plan ... gpu=[...]`` after the config is checked (:func:`oomtune.plan.run.plan`):
    plan every card (:func:`plan_cards`), print the table and the smallest card that fits
    ``plan.batch``, write plan.yaml (``kind: plan_cards``). ``cards``: (cards, budgets, budget or None).

    Raises:
        ConfigError: a global batch (not planned across cards), a bad ``plan.batch``; as :func:`plan_cards`.
    """
    from oomtune import config as C
    from oomtune.exceptions import ConfigError
    from oomtune.plan.parallel import default_workers
    from oomtune.plan.predictor import trial_steps
    from oomtune.units import format_bytes

    cards, budgets, budget = cards
    if global_batch is not None:
        raise ConfigError("gpu=[...] plans micro-batches of search.batch_size, not a search.global_batch: "
                          "drop search.global_batch, or plan one card with model.gpu=")
    node = C.to_container(cfg.plan) if cfg.plan is not None else {}
    batch = node.get("batch") if isinstance(node, dict) else None
    if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int) or batch < 1):
        raise ConfigError(f"plan.batch={batch!r}: expected an integer >= 1, e.g. +plan.batch=64")
    if batch is not None and batch > grid[-1]:
        raise ConfigError(f"plan.batch={batch} is above the planned range (search.batch_size.high={grid[-1]}): "
                          f"give search.batch_size.high={batch} or more")

    def say(text: str) -> None:
        console.print(text, highlight=False, markup=False)

    fams = families_of(cards)
    say(f"oomtune plan: {label} on the virtual GPU, {len(cards)} cards in {len(fams)} kernel families (one capture "
        f"set per family), budget {budget or 'each card’s memory'}, headroom {headroom:.0%}, {len(settings)} "
        f"allocator configurations x batch {grid[0]}..{grid[-1]}")
    if shaped:
        say("note: the shapes vary: every card is predicted at the worst shape (no soak across cards)")
    if skipped:
        say(f"note: skipping {len(skipped)} backend:cudaMallocAsync configuration(s): the virtual GPU simulates only "
            "the native caching allocator")
    plan = plan_cards(cards, budgets, workload=workload, settings=settings, grid=grid, headroom=headroom,
                      steps=trial_steps(cfg.trial), cache=store, read_cache=cache,
                      timeout_s=float(cfg.trial.timeout), workers=default_workers(), budget=budget, batch=batch,
                      say=say)
    from oomtune.display import fit_table

    console.print(fit_table(cards_table(plan), console.width))   # narrow: whole cells move, none is cut
    say("device used = the allocator's peak reserved + the memory outside it (CUDA context: the catalogue's "
        "outside_allocator_bytes): the whole card, as nvidia-smi would show; memory as torch reports it; the "
        "headroom limit bounds the peak reserved, so device used may lie above it")
    if any(r.max_batch_size is not None and r.max_batch_size >= grid[-1] for r in plan.results):
        say(f">=N: every batch up to the top of the range fits (none above {grid[-1]} planned: raise "
            "search.batch_size.high to find the card's limit)")
    if batch is not None:
        small = plan.smallest_fitting()
        say(f"smallest card that fits batch {batch} (simulated): "
            + (f"{small.card.name} ({format_bytes(small.card.total_memory_bytes)}, {small.best['alloc_conf'] or 'default allocator'}"
               f" fits up to batch {small.max_batch_size})" if small is not None else "none of these cards"))
    for r in plan.results:
        for reason in r.fmap.fallback:
            say(f"note: {r.card.name}: {reason}")
    say(f"{plan.captures} capture(s) for {len(cards)} cards, {plan.replays} replays, total {plan.total_s:.2f} s")
    say(f"wrote {write_cards_plan(plan, path)} (the HTML report covers single-card plans only)")
    return plan
