"""``oomtune plan`` under a shape distribution: each configuration's planned batch must survive the soak.

The map of a variable-shape workload is predicted at the distribution's worst shape (the largest
padded length or image size, :func:`oomtune.trial._base.worst_shape_workload`), as the search
predicts its frontier: no configuration's planned batch then exceeds its planned batch at that fixed
length. A batch that fits the worst shape on a fresh allocator can still run out of memory after
hundreds of steps of mixed shapes, when the cache has fragmented (the 2000-step soak of a GPT-2-sized
answer at 24 GiB failed at step 12 with length 944). The search soaks every trial of
such a workload, so a plan that did not would recommend batches the search rejects. Here each
configuration's largest batch is soaked (:mod:`oomtune.trial.soak`: ``trial.soak_steps`` steps in the
data's order, on the trial's virtual GPU); when it fails, the largest batch below it that survives
is found by bisection (assuming that a batch that survives the soak survives it with fewer samples),
and that becomes the configuration's planned batch. Every figure is simulated.

The rows are independent: each row's largest batch is captured first, then the rows are soaked in
forked processes over the CPU cores (:func:`oomtune.plan.parallel.fork_map`; the same code per row,
so the same results as in one process). A built-in workload is captured in this process; a user's
entry (a target with ``user_code``) never is: each of its captures runs in a forked process of its
own under ``trial.timeout`` (:func:`oomtune.plan.isolation.run_isolated`), so an entry that raises,
hangs or exits in a soak capture ends the plan with one line, as in the map's captures.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["SoakedFrontier", "soak_rows"]


@dataclass
class SoakedFrontier:
    """What the soak did to a plan's rows (recorded in plan.yaml ``soak``).

    Attributes:
        steps: soak steps per candidate.
        captures: batch sizes whose soak streams were captured.
        stepped_down: ``alloc_conf -> (worst-shape batch, soak-safe batch or None)`` for the rows it lowered.
        seconds: wall seconds spent capturing and replaying.
    """

    steps: int
    captures: int = 0
    stepped_down: dict[str, tuple[int, int | None]] = field(default_factory=dict)
    seconds: float = 0.0


def soak_rows(rows: Sequence[Any], model_cfg: Mapping[str, Any], geometry: Mapping[str, Any], *, steps: int,
              low: int, cell: Callable[[int, Any], Any], timeout_s: float | None = None,
              limit_name: str = "trial.timeout") -> SoakedFrontier:
    """Soak every row's largest fitting batch and step it down until it survives (module docstring).

    Each row (a :class:`oomtune.plan.feasibility.PlanRow`) gets ``worst_shape_max_batch_size`` (its
    batch before the soak) and ``soak`` (``{steps, passed, batch_size}`` and, when it was stepped
    down, ``failed: {batch_size, step, shape, message}``); its ``max_batch_size`` and ``at_max``
    become the soak-safe batch's (None when even ``low`` fails the soak).

    Args:
        rows: the plan's rows, predicted at the worst shape.
        model_cfg: the ``model`` group with its shape distribution (not the worst-shape copy).
        geometry: the trial's virtual GPU (:func:`oomtune.plan.predictor.sim_geometry`): capacity,
            memory fraction, memory outside the allocator.
        steps: soak steps (``trial.soak_steps``, >= 1).
        low: the smallest batch of the plan's range.
        cell: ``cell(batch, settings) -> PlanCell`` at the worst shape (for a lowered row's ``at_max``).
        timeout_s: wall seconds a capture of the user's code may take (``limit_name``, as the user
            spells it: ``trial.timeout``); None: no limit. Each capture of a target with ``user_code``
            (a python entry) runs in a forked process of its own
            (:func:`oomtune.plan.isolation.run_isolated`), so that an entry that raises, hangs or
            exits ends the plan with one line, not a traceback or a hang.

    Raises:
        ConfigError: a bad workload or shape distribution.
        UserCodeError: the user's code raised, exited, was killed or ran past ``timeout_s`` in a
            soak capture (one line).
    """
    from oomtune.alloc.settings import AllocatorSettings
    from oomtune.plan.parallel import default_workers, fork_map
    from oomtune.trial.soak import capture_soak, replay_soak

    from oomtune.plan.isolation import run_isolated
    from oomtune.trial._base import get_target, target_name

    t0 = time.perf_counter()
    cfg = dict(model_cfg)   # the target too: capture_soak builds the workload it names (Target.for_capture)
    streams: dict[int, Any] = {}
    out = SoakedFrontier(steps=steps)
    user_code = get_target(target_name(cfg)).user_code
    entry = str((cfg.get("target") or {}).get("entry"))

    def captured(batches: Sequence[int], workers: int = 1) -> list[Any]:
        """The soak streams of ``batches``: the user's code each in a process of its own (in a
        forked row worker: there, :func:`run_isolated` runs it in place); oomtune's own here."""
        def one(batch: int) -> Any:
            return capture_soak(cfg, batch, steps, capture_device="meta")

        if not user_code:
            return [one(b) for b in batches]
        return run_isolated(one, batches, entry=entry, workers=workers, timeout_s=timeout_s, limit_name=limit_name)

    def soaked(batch: int, settings: AllocatorSettings) -> Any:
        if batch not in streams:
            streams[batch] = captured([batch])[0]
        return replay_soak(streams[batch], settings, device_memory_bytes=int(geometry["total_memory_bytes"]),
                           memory_fraction=float(geometry.get("memory_fraction", 1.0)),
                           non_allocator_bytes=int(geometry.get("non_allocator_bytes", 0) or 0))

    def soak_row(i: int) -> tuple[dict[str, Any], set[int]]:
        """Row ``i``'s soak record (its ``batch_size`` the soak-safe batch) and the batches captured."""
        row = rows[i]
        settings = AllocatorSettings.parse(row.alloc_conf)
        first = soaked(row.max_batch_size, settings)
        if first.passed:
            return {"steps": steps, "passed": True, "batch_size": row.max_batch_size}, set(streams)
        ok, bad = low - 1, row.max_batch_size   # bad fails the soak; find the largest that passes
        while bad - ok > 1:
            mid = (ok + bad) // 2
            if soaked(mid, settings).passed:
                ok = mid
            else:
                bad = mid
        return ({"steps": steps, "passed": False, "batch_size": ok if ok >= low else None,
                 "failed": {"batch_size": row.max_batch_size, "step": first.failed_step,
                            "shape": first.shape_at_failure, "message": first.message}}, set(streams))

    for row in rows:
        row.worst_shape_max_batch_size = row.max_batch_size
    todo = [i for i, row in enumerate(rows) if row.max_batch_size is not None]
    # every row's first batch captured here, before the rows are spread over forked processes (they
    # inherit the streams; a bisection's further captures are made where it runs)
    firsts = sorted({rows[i].max_batch_size for i in todo})
    streams.update(zip(firsts, captured(firsts, default_workers())))
    results = fork_map(soak_row, todo, default_workers())
    captured: set[int] = set(streams)
    for i, (record, batches) in zip(todo, results):
        row = rows[i]
        row.soak = record
        captured |= batches
        if not record["passed"]:
            safe = record["batch_size"]
            out.stepped_down[row.alloc_conf] = (row.max_batch_size, safe)
            row.max_batch_size = safe
            row.at_max = None if safe is None else cell(safe, AllocatorSettings.parse(row.alloc_conf))
    out.captures = len(captured)
    out.seconds = time.perf_counter() - t0
    return out
