"""Predictions for a search whose candidates train different steps: activation checkpointing on or
off (``search.space.activation_checkpointing``) and, under a fixed global batch
(``search.global_batch``), one micro-batch per optimizer step or several (gradient accumulation).

Each such *variant* of the workload makes other requests, so it has its own
:class:`oomtune.plan.predictor.Predictor` (its own captures and derived streams: a stream is derived
only from captures of the same variant, :mod:`oomtune.plan.derive`). :class:`PredictorVariants`
routes every question to the variant of the batch size and configuration asked about, and otherwise
answers as one predictor (timings and counts summed over its members), so the search, the frontier
and the report use it where they use a Predictor.

Accumulation variants: a batch size ``b`` with ``grad_accum(b) > 1`` is predicted from captures with
two micro-batches per step (:func:`oomtune.workloads.loop.prediction_workload`: a third micro-batch
repeats the second's requests); ``grad_accum(b) == 1`` (the micro-batch is the whole global batch)
from captures of one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

from oomtune.workload_spec import WorkloadSpec

__all__ = ["PredictorVariants", "variant_workload"]

#: ``search.space`` key of activation checkpointing (oomtune.space.CHECKPOINTING_KEY; the plan
#: layer does not import the search layer).
_CKPT = "activation_checkpointing"

#: The phase seconds a Predictor counts (and :func:`oomtune.plan._spread.rows_forked` sets).
_SECONDS = ("capture_seconds", "derive_seconds", "replay_seconds")


def variant_workload(workload: WorkloadSpec, *, grad_accum: int, checkpointing: bool | None) -> WorkloadSpec:
    """``workload`` training ``grad_accum`` micro-batches per optimizer step (the ``training`` key
    left out for 1) with ``activation_checkpointing`` set (unchanged when None)."""
    training = {k: v for k, v in workload.training.items() if k != "grad_accum"}
    if grad_accum > 1:
        training["grad_accum"] = grad_accum
    if checkpointing is not None:
        training[_CKPT] = bool(checkpointing)
    return dataclasses.replace(workload, training=training)


class PredictorVariants:
    """One :class:`~oomtune.plan.predictor.Predictor` per workload variant, behind the Predictor API.

    Args:
        workload: the search's :class:`oomtune.workload_spec.WorkloadSpec`.
        make: ``make(variant_workload) -> Predictor`` (the trial's geometry and steps, the cache).
        grad_accum_of: micro-batches per optimizer step at a batch size (None: always 1).

    Methods taking ``checkpointing`` use the workload's own setting when it is None.
    """

    def __init__(self, workload: WorkloadSpec, make: Callable[[WorkloadSpec], Any], *,
                 grad_accum_of: Callable[[int], int] | None = None) -> None:
        self.workload = workload
        self._make = make
        self._accum = grad_accum_of or (lambda b: 1)
        self._members: dict[tuple, Any] = {}
        self._seconds_set = {name: 0.0 for name in _SECONDS}   # seconds set on top of the members' sums
        self.calibration = 1.0
        first = self._member(None, 1)
        self.geometry, self.steps = first.geometry, first.steps
        self.workers = getattr(first, "workers", 1)
        self.cache = getattr(first, "cache", None)

    # ------------------------------------------------------------------ routing
    def _member(self, checkpointing: bool | None, grad_accum: int) -> Any:
        return self._keyed((checkpointing, min(grad_accum, 2)))

    def _keyed(self, key: tuple) -> Any:
        """The member of ``key`` = (checkpointing, micro-batches captured per step: 1 or 2), made on
        first use."""
        member = self._members.get(key)
        if member is None:
            member = self._make(variant_workload(self.workload, grad_accum=key[1], checkpointing=key[0]))
            member.calibration = self.calibration
            self._members[key] = member
        return member

    def member(self, batch_size: int, checkpointing: bool | None = None) -> Any:
        """The Predictor that answers for ``batch_size`` (and ``checkpointing``)."""
        return self._member(checkpointing, self._accum(int(batch_size)))

    # ------------------------------------------------------------------ the Predictor API
    def prepare(self, batch_sizes: Iterable[int], checkpointing: bool | None = None, *,
                limit_bytes: int | None = None) -> None:
        """:meth:`Predictor.prepare` of each variant with the batch sizes it answers for (and
        ``limit_bytes``: sizes past the first over it are not captured)."""
        groups: dict[int, list[int]] = {}
        for b in batch_sizes:
            groups.setdefault(min(self._accum(int(b)), 2), []).append(int(b))
        for accum, sizes in groups.items():
            self._member(checkpointing, accum).prepare(sizes, limit_bytes=limit_bytes)

    def can_predict(self, batch_size: int, *, checkpointing: bool | None = None) -> bool:
        return self.member(batch_size, checkpointing).can_predict(batch_size)

    def known_over_limit(self, batch_size: int, *, checkpointing: bool | None = None) -> bool:
        return self.member(batch_size, checkpointing).known_over_limit(batch_size)

    def stream(self, batch_size: int, checkpointing: bool | None = None) -> Any:
        return self.member(batch_size, checkpointing).stream(batch_size)

    def predict_detail(self, batch_size: int, settings: Any, *, checkpointing: bool | None = None) -> Any:
        return self.member(batch_size, checkpointing).predict_detail(batch_size, settings)

    def predict_raw(self, batch_size: int, settings: Any, *, checkpointing: bool | None = None) -> int | None:
        return self.member(batch_size, checkpointing).predict_raw(batch_size, settings)

    def predict(self, candidate: Any) -> int | None:
        """Calibrated predicted peak reserved (bytes) of a search Candidate (its batch size, allocator
        settings and ``activation_checkpointing``); None when its settings cannot be simulated."""
        return self.member(candidate.batch_size, getattr(candidate, _CKPT, None)).predict(candidate)

    def calibrate(self, pairs: list[tuple[int, int]]) -> float:
        """Set every variant's calibration from (predicted, measured) peak reserved pairs; returns it."""
        first = next(iter(self._members.values()))
        self.calibration = first.calibrate(pairs)
        for m in self._members.values():
            m.calibration = self.calibration
        return self.calibration

    # ------------------------------------------------------------------ work done in forked children
    def fork_mark(self) -> dict[tuple, tuple]:
        """What each member holds now (:meth:`Predictor.fork_mark` by variant), for :meth:`fork_delta`
        in a forked child (:func:`oomtune.plan._spread.rows_forked`)."""
        return {key: m.fork_mark() for key, m in self._members.items()}

    def fork_delta(self, since: dict[tuple, tuple]) -> dict[str, Any]:
        """What each member gained since :meth:`fork_mark` gave ``since`` (a member made since then:
        everything it holds), picklable, for :meth:`fork_merge`: ``{"members": {variant: delta}}``
        plus the seconds gained by all of them under ``capture_seconds`` / ``derive_seconds`` /
        ``replay_seconds`` (as :meth:`Predictor.fork_delta` gives them)."""
        members = {key: m.fork_delta(since.get(key)) for key, m in self._members.items()}
        out: dict[str, Any] = {"members": members}
        out.update({name: sum(d[name] for d in members.values()) for name in _SECONDS})
        return out

    def fork_merge(self, gained: dict[str, Any]) -> None:
        """Take a child's :meth:`fork_delta` in, each variant's into its member (made here when only the
        child had made it); seconds are the caller's to account (settable, as a Predictor's)."""
        for key, part in gained["members"].items():
            self._keyed(key).fork_merge(part)

    # ------------------------------------------------------------------ summed figures
    def _sum(self, name: str) -> Any:
        return sum(getattr(m, name) for m in self._members.values())

    def _seconds(self, name: str) -> float:
        return self._sum(name) + self._seconds_set[name]

    def _set_seconds(self, name: str, value: float) -> None:
        self._seconds_set[name] = float(value) - self._sum(name)

    capture_seconds = property(lambda self: self._seconds("capture_seconds"),
                               lambda self, v: self._set_seconds("capture_seconds", v),
                               doc="Seconds spent capturing, all variants (settable: the wall time of forked work).")
    replay_seconds = property(lambda self: self._seconds("replay_seconds"),
                              lambda self, v: self._set_seconds("replay_seconds", v),
                              doc="Seconds spent replaying, all variants (settable, as capture_seconds).")
    derive_seconds = property(lambda self: self._seconds("derive_seconds"),
                              lambda self, v: self._set_seconds("derive_seconds", v),
                              doc="Seconds spent deriving streams, all variants (settable, as capture_seconds).")

    @property
    def replays(self) -> int:
        return self._sum("replays")

    @property
    def captures(self) -> int:
        return self._sum("captures")

    @property
    def cached_batches(self) -> list[int]:
        return [b for m in self._members.values() for b in m.cached_batches]

    @property
    def derived_batches(self) -> list[int]:
        return [b for m in self._members.values() for b in m.derived_batches]

    @property
    def _streams(self) -> dict[int, Any]:
        """Every variant's streams by batch size (for counts; variants of one batch size overlap)."""
        return {b: st for m in self._members.values() for b, st in m._streams.items()}

    @property
    def _captured(self) -> dict[int, Any]:
        return {b: st for m in self._members.values() for b, st in m._captured.items()}

    @property
    def captured_on(self) -> set[str]:
        return set().union(*(m.captured_on for m in self._members.values()))

    @property
    def fallback_reasons(self) -> set[str]:
        return set().union(*(m.fallback_reasons for m in self._members.values()))

    @property
    def derivation_note(self) -> str | None:
        notes = sorted({m.derivation_note for m in self._members.values() if m.derivation_note})
        return "; ".join(notes) or None
