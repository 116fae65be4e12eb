"""``oomtune check best.yaml --mode predict --gpu l4,a100-40gb``: best.yaml's answer predicted on
each named card of the device catalogue (:mod:`oomtune.gpu.catalogue`), one pass/fail per card.

The CI gate for every card a team trains on. For each card, the answer as :func:`oomtune.best.
apply_best` would apply it there -- the batch size, the allocator settings (``best.alloc_conf``),
the memory fraction (``best.memory_fraction``, of that card's memory, when the answer needs one), the
training settings and rank count -- is replayed on the card's virtual GPU: its memory
(``total_memory_bytes``), the memory outside the allocator (``outside_allocator_bytes``: the CUDA
context), its cuBLAS workspaces, and captures that ran its kernels (its family: attention backends
by compute capability). Cards of one family share their captures (:func:`oomtune.plan.cards.
families_of`, :meth:`oomtune.plan.predictor.Predictor.retarget`), as in ``oomtune plan gpu=[...]``.

A card passes when the replay completes and its peak reserved is within the card's limit: the card's
memory less best.yaml's headroom (:func:`oomtune.plan.feasibility.limit_bytes_of`), the same test as
the ``fits`` column of ``oomtune plan gpu=[...]`` with no ``budget=``. The recorded budget is the
tuning device's, not the card's: it is not used. Nor is the recorded prediction compared (it was made
with another card's kernels and memory): the check without ``--gpu`` does that. Every figure is
simulated (virtual GPU). Sits beside :mod:`oomtune.regression` (whose best.yaml reading it uses) and
below the CLI (:mod:`oomtune.commands.check`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from oomtune.exceptions import ConfigError
from oomtune.regression import CheckCase, CheckReport, fraction_case, prepare_check, recorded_headroom
from oomtune.units import format_bytes

__all__ = ["resolve_check_cards", "card_geometry", "check_cards"]


def resolve_check_cards(value: str) -> list[Any]:
    """The cards of ``--gpu`` (comma-separated catalogue names, ``all``, or card YAML files:
    :func:`oomtune.gpu.catalogue.resolve_cards`), each with a memory figure.

    Raises:
        ConfigError: one line naming an unknown card, a bad card file, or a card without
            ``total_memory_bytes``; before best.yaml is read.
    """
    from oomtune.gpu.catalogue import resolve_cards

    cards = resolve_cards(value, flag="--gpu ")
    for card in cards:
        if card.total_memory_bytes is None:
            raise ConfigError(f"--gpu {card.name}: the catalogue has no sourced total_memory_bytes for this card; set "
                              "total_memory_bytes in a copy of its file and pass that file (--gpu mycard.yaml)")
    return cards


def card_geometry(card: Any, memory_fraction: float | None) -> dict[str, Any]:
    """The virtual GPU of ``card`` as the answer runs on it (bytes): the card's ``total_memory_bytes``,
    its ``outside_allocator_bytes`` outside the allocator (the device's free memory is the rest,
    ``cudaMemGetInfo``), and ``memory_fraction`` as :func:`oomtune.best.apply_best` sets it
    (``per_process_memory_fraction``, a fraction of the card's memory, ``setMemoryFraction`` in
    c10/cuda/CUDACachingAllocator.cpp); None: no fraction (1.0, torch's no-limit value). The
    ``non_allocator_bytes`` key also makes the captures add the card's cuBLAS workspaces."""
    return {"total_memory_bytes": int(card.total_memory_bytes),
            "non_allocator_bytes": int(card.outside_allocator_bytes),
            "memory_fraction": 1.0 if memory_fraction is None else float(memory_fraction)}


def _card_case(card: Any, batch: int, conf: str, pred: Any, limit_bytes: int, headroom: float,
               fraction: float | None, elapsed: float) -> CheckCase:
    """One card's verdict: fits when the replay completed (under the memory fraction, when the
    answer has one) and peak reserved <= the card's limit."""
    fits = bool(pred.fits) and pred.peak_reserved_bytes <= limit_bytes
    limit = (f"{format_bytes(limit_bytes)} ({format_bytes(card.total_memory_bytes)} less {headroom:.0%} headroom)"
             if headroom else f"{format_bytes(limit_bytes)}")
    if fraction is not None:   # setMemoryFraction's limit: round(fraction x total)
        limit += (f" and best.yaml's memory fraction {fraction:g} allows "
                  f"{format_bytes(round(fraction * card.total_memory_bytes))}")
    where = f"{card.family} kernels, simulated"
    if fits:
        text = (f"{card.name}: PASS batch {batch}, {conf} fits: peak reserved {format_bytes(pred.peak_reserved_bytes)} "
                f"of {limit} ({where})")
    else:
        text = (f"{card.name}: FAIL batch {batch}, {conf} does not fit: needs {format_bytes(pred.peak_reserved_bytes)} "
                f"reserved, the card allows {limit} ({where})")
    return CheckCase(f"card {card.name}", fits, text, elapsed)


def check_cards(best: Any, cards: list[Any], *, timeout_s: float | None = None) -> CheckReport:
    """Predict best.yaml's answer on each of ``cards`` (see the module docstring).

    Args:
        best: the loaded :class:`oomtune.best.BestConfig`.
        cards: catalogue cards with a memory figure (:func:`resolve_check_cards`).
        timeout_s: the wall limit of each capture of a python entry, seconds (None: the default,
            :data:`oomtune.plan.predictor.CAPTURE_TIMEOUT_S`).

    Returns:
        a report with one case per card (``card NAME``) and the memory fraction case
        (:func:`oomtune.regression.fraction_case`); ``figures["lines"]`` the per-card lines,
        ``figures["cards"]`` each card's figures (bytes, simulated).

    Raises:
        ConfigError: a target oomtune cannot capture (``target=cmd``: its recorded stream ran another
            card's kernels), settings the virtual GPU cannot simulate, a workload the current code
            cannot build. BestFileError: malformed best.yaml sections.
    """
    from oomtune.alloc.settings import AllocatorSettings
    from oomtune.plan.cards import families_of
    from oomtune.plan.feasibility import limit_bytes_of
    from oomtune.plan.predictor import PREDICT_STEPS, Predictor, simulable

    conf = best.best.alloc_conf or ""
    if not simulable(AllocatorSettings.parse(conf)):
        raise ConfigError(f"--gpu cannot simulate best.yaml's alloc_conf {conf!r} (the virtual GPU models only the "
                          "native caching allocator): check it with --mode run on each card")
    run = prepare_check(best)
    if run.target is None or not run.target.capturable:
        raise ConfigError(f"--gpu predicts by capturing the workload with each card's kernels, which target "
                          f"{run.workload.target_name!r} cannot be: check it with --mode run on each card")
    headroom = recorded_headroom(best)
    workload = run.workload
    if best.best.predicted_at_worst_shape:   # the search's frontier predicted the largest shape
        from oomtune.trial._base import worst_shape_spec

        workload = worst_shape_spec(workload)
    steps = best.best.predicted_steps or PREDICT_STEPS
    batch, shown = best.best.batch_size, conf or "the default allocator"
    by_name: dict[str, tuple[CheckCase, dict[str, Any]]] = {}
    fallback: set[str] = set()
    for family, members in families_of(cards).items():
        predictor = None
        for card in members:
            t0 = time.perf_counter()
            geometry = card_geometry(card, best.best.memory_fraction)
            if predictor is None:
                predictor = Predictor(dataclasses.replace(workload, gpu=family, gpu_source="--gpu"), geometry,
                                      steps=steps,
                                      timeout_s=timeout_s, timeout_name="--timeout")
            else:
                predictor.retarget(geometry)
            pred = predictor.predict_detail(batch, conf)
            limit_bytes = limit_bytes_of(card.total_memory_bytes, headroom)
            case = _card_case(card, batch, shown, pred, limit_bytes, headroom, best.best.memory_fraction,
                              time.perf_counter() - t0)
            by_name[card.name] = (case, {"card": card.name, "kernels": family, "fits": case.passed,
                                         "peak_reserved_bytes": int(pred.peak_reserved_bytes),
                                         "limit_bytes": limit_bytes, "total_memory_bytes": card.total_memory_bytes,
                                         "memory_source": "simulated"})
        fallback |= predictor.fallback_reasons
    cases = [by_name[c.name][0] for c in cards]
    fraction = fraction_case(best, geometry=run.geometry)
    failed = [c.name[len("card "):] for c in cases if not c.passed]
    if failed:
        summary = (f"oomtune check: FAIL batch {batch} does not fit {', '.join(failed)} ({len(failed)} of "
                   f"{len(cases)} cards; simulated)")
    else:
        summary = f"oomtune check: PASS batch {batch} fits {', '.join(c.name for c in cards)} (simulated)"
    if fraction.passed is False:
        summary = summary.replace("PASS", "FAIL", 1) + f"; memory fraction: {fraction.message}"
    figures = {"lines": [c.message for c in cases], "cards": [by_name[c.name][1] for c in cards],
               "fallback": sorted(fallback)}
    return CheckReport("predict", [*cases, fraction], summary, figures)
