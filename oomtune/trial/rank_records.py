"""One trial, several ranks: the ranks' records merged into the trial's record.

A distributed trial runs one process per GPU (``TrialSpec.ranks``; on the CPU one per virtual GPU),
each with its own memory budget, and each writes its own record (``result.rank<R>.json``, with
``extra["rank"]``). The trial's record (:func:`merge_ranks`):

- **memory** is the worst rank's: peak reserved, allocated and active are the maxima over the ranks,
  the NVML device peak too; ``extra["worst_rank"]`` names the rank with the highest peak reserved
  (the lowest such rank on a tie) and ``extra["ranks"]`` keeps every rank's figures
  (:data:`RANK_FIELDS`). The budget is per rank, so the worst rank decides feasibility.
- **throughput** is global and counts every sample once: each rank trains its own
  ``samples_r`` samples in ``seconds_r``, concurrently, so the trial trains ``sum(samples_r)`` in
  ``max(seconds_r)`` (:func:`global_throughput`), not the mean of per-rank rates and not
  ``sum(samples) / sum(seconds)`` (which is the per-rank rate when every rank reports).
- **outcome**: ok when every rank is ok. Otherwise one rank's failure is the trial's, and the
  message names it (``rank 1 of 2: ...``, ``extra["failed_rank"]``): a device-memory outcome on any
  rank first (an out-of-memory on any rank makes the trial infeasible), then the launcher's first
  observed failure, then the lowest rank. Failures that are consequences of another rank's (a
  collective broken by the dead peer: gloo's "Connection closed by peer", NCCL's aborted
  communicator; the launcher's SIGTERM to the surviving ranks) are never chosen
  (:func:`oomtune.classify._launcher.is_peer_teardown`); they stay visible in ``extra["ranks"]``
  with ``teardown: true``.

No torch import: the runner and the ``cmd`` target use this module too.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from oomtune.outcome import Outcome
from oomtune.trial.record import TrialResult, TrialSpec

__all__ = ["RANK_FIELDS", "rank_result_path", "rank_stderr_path", "global_throughput", "merge_ranks",
           "merge_rank_files", "merge_memory", "rank_summary", "read_rank_results", "rank_oom_kill"]

#: The figures kept per rank in ``extra["ranks"]``.
RANK_FIELDS = ("outcome", "peak_reserved_bytes", "peak_allocated_bytes", "device_peak_bytes", "throughput",
               "step_time_s", "message")


def rank_result_path(result_path: str | Path, rank: int) -> Path:
    """``result.rank<R>.json`` next to the trial's ``result.json``."""
    path = Path(result_path)
    return path.with_name(f"{path.stem}.rank{rank}{path.suffix}")


def rank_stderr_path(workdir: str | Path, rank: int) -> Path:
    """``stderr.rank<R>.txt`` in the trial's directory: one rank's standard error."""
    return Path(workdir) / f"stderr.rank{rank}.txt"


def read_rank_results(result_path: str | Path, ranks: int) -> list[TrialResult | None]:
    """Each rank's record, None where a rank wrote none (killed, or never started)."""
    out: list[TrialResult | None] = []
    for rank in range(ranks):
        try:
            out.append(TrialResult.read(rank_result_path(result_path, rank)))
        except (OSError, ValueError, TypeError):
            out.append(None)
    return out


def global_throughput(intervals: Sequence[tuple[float, float]]) -> float | None:
    """Samples per second of ranks training at once: ``sum(samples) / max(seconds)`` over the
    ``(samples, seconds)`` of each rank (the slowest rank's interval bounds the trial's). None
    without a positive interval."""
    spans = [(float(n), float(s)) for n, s in intervals if s and s > 0]
    if not spans:
        return None
    return sum(n for n, _ in spans) / max(s for _, s in spans)


def rank_summary(rank: int, result: TrialResult | None, *, exitcode: int | None = None,
                 teardown: bool = False) -> dict[str, Any]:
    """One entry of ``extra["ranks"]``: the rank, :data:`RANK_FIELDS` of its record, its exit
    status, whether its failure was a consequence of another rank's (``teardown``) and its device
    identity (UUID) when known."""
    entry: dict[str, Any] = {"rank": rank}
    for name in RANK_FIELDS:
        entry[name] = getattr(result, name, None) if result is not None else None
    if result is not None and result.device is not None and result.device.uuid:
        entry["device_uuid"] = result.device.uuid
    if exitcode is not None:
        entry["exitcode"] = exitcode
    entry["teardown"] = teardown
    return entry


_MEMORY_FIRST = 0
_ROOT = 1
_OTHER = 2


def merge_ranks(spec: TrialSpec, results: Sequence[TrialResult | None], *,
                exitcodes: Sequence[int | None] | None = None, root_rank: int | None = None,
                stderr_tails: Sequence[str] | None = None, launcher: str = "torch.multiprocessing") -> TrialResult:
    """The trial's record from its ranks' records (see the module docstring).

    Args:
        spec: the trial.
        results: per rank, its record or None (no record: killed, or never started).
        exitcodes: per rank, the process's exit status (negative: killed by that signal), when known.
        root_rank: the launcher's first observed failure (torch.multiprocessing's ``error_index``,
            torchrun's root cause), if any.
        stderr_tails: per rank, the end of its standard error (classifies a rank without a record).
        launcher: what started the ranks (kept in ``extra["rank_launcher"]``).

    Returns:
        A :class:`TrialResult`; never raises.
    """
    from oomtune.classify import classify_failure
    from oomtune.classify._launcher import is_peer_teardown

    n = len(results)
    exitcodes = list(exitcodes or [None] * n)
    tails = list(stderr_tails or [""] * n)
    records: list[TrialResult] = []
    teardown: list[bool] = []
    for rank, res in enumerate(results):
        code = exitcodes[rank] if rank < len(exitcodes) else None
        if res is None:
            cls = classify_failure(returncode=code if code is not None else -signal.SIGKILL,
                                   stderr=tails[rank] if rank < len(tails) else "", batch_size=spec.batch_size,
                                   smaller_batch_succeeded=spec.smaller_batch_succeeded)
            res = TrialResult(outcome=Outcome(cls.outcome).value, batch_size=spec.batch_size,
                              alloc_conf=spec.alloc_conf, message=f"{cls.message} (the rank wrote no record)",
                              advice=cls.advice, traceback_tail=cls.traceback_tail)
            if cls.oom is not None:
                res.oom_requested_bytes = getattr(cls.oom, "requested_bytes", None)
            # terminated by the launcher (SIGTERM/SIGKILL) after another rank had failed first
            killed_after = (root_rank is not None and rank != root_rank and code is not None
                            and code in (-signal.SIGTERM, -signal.SIGKILL, -signal.SIGINT))
            teardown.append(killed_after or is_peer_teardown(tails[rank] if rank < len(tails) else ""))
        else:
            failed = res.outcome_enum is not Outcome.OK and not res.outcome_enum.is_memory
            teardown.append(failed and is_peer_teardown(" ".join(filter(None, (res.message, res.traceback_tail)))))
        records.append(res)
    merged = _pick(spec, records, teardown, root_rank)
    merge_memory(merged, records)
    merged.extra["ranks"] = [rank_summary(r, rec, exitcode=exitcodes[r] if r < len(exitcodes) else None,
                                          teardown=teardown[r]) for r, rec in enumerate(records)]
    merged.extra["world_size"] = n
    merged.extra["rank_launcher"] = launcher
    return merged


def _pick(spec: TrialSpec, records: list[TrialResult], teardown: list[bool], root_rank: int | None) -> TrialResult:
    """The record the trial's outcome comes from (a copy), message prefixed with its rank."""
    n = len(records)
    failed = [r for r, rec in enumerate(records) if rec.outcome_enum is not Outcome.OK]
    if not failed:
        merged = TrialResult.from_dict(records[0].to_dict())
        _merge_throughput(merged, records)
        return merged
    causes = [r for r in failed if not teardown[r]] or failed

    def order(r: int) -> tuple[int, int]:
        if records[r].outcome_enum.is_memory:
            return (_MEMORY_FIRST, r)
        return (_ROOT if r == root_rank else _OTHER, r)

    rank = min(causes, key=order)
    merged = TrialResult.from_dict(records[rank].to_dict())
    merged.message = f"rank {rank} of {n}: {merged.message or merged.outcome}"
    merged.extra["failed_rank"] = rank
    merged.throughput = merged.step_time_s = None   # a failed trial has no values (Optuna's rule)
    return merged


def _merge_throughput(merged: TrialResult, records: list[TrialResult]) -> None:
    """Global samples/s (:func:`global_throughput`) and the slowest rank's step time. Every rank runs
    the same measured steps, so a mean step (``throughput x step_time_s`` samples in ``step_time_s``
    seconds) stands for the interval."""
    intervals = [(rec.throughput * rec.step_time_s, rec.step_time_s) for rec in records
                 if rec.throughput is not None and rec.step_time_s is not None]
    merged.throughput = global_throughput(intervals) if len(intervals) == len(records) else None
    steps = [rec.step_time_s for rec in records if rec.step_time_s is not None]
    merged.step_time_s = max(steps) if steps else None
    waits = [rec.data_wait_fraction for rec in records if rec.data_wait_fraction is not None]
    merged.data_wait_fraction = max(waits) if waits else None
    starts = [rec.startup_s for rec in records if rec.startup_s is not None]
    merged.startup_s = max(starts) if starts else None
    firsts = [rec.extra.get("first_step_at") for rec in records if rec.extra.get("first_step_at") is not None]
    if firsts:
        merged.extra["first_step_at"] = max(firsts)


def merge_memory(merged: TrialResult, records: list[TrialResult]) -> None:
    """Peaks: the maxima over the ranks; ``worst_rank`` the rank with the highest peak reserved;
    fragmentation and the memory outside the allocator are the worst rank's; counters summed."""
    def top(name: str) -> int | None:
        values = [getattr(rec, name) for rec in records if getattr(rec, name) is not None]
        return max(values) if values else None

    reserved = [(rec.peak_reserved_bytes, r) for r, rec in enumerate(records) if rec.peak_reserved_bytes is not None]
    if reserved:
        peak, worst = max(reserved, key=lambda pr: (pr[0], -pr[1]))
        merged.extra["worst_rank"] = worst
        merged.fragmentation = records[worst].fragmentation
        merged.non_allocator_bytes = records[worst].non_allocator_bytes
    merged.peak_reserved_bytes = top("peak_reserved_bytes")
    merged.peak_allocated_bytes = top("peak_allocated_bytes")
    merged.peak_active_bytes = top("peak_active_bytes")
    merged.device_peak_bytes = top("device_peak_bytes")
    for name in ("num_alloc_retries", "num_ooms"):
        values = [getattr(rec, name) for rec in records if getattr(rec, name) is not None]
        setattr(merged, name, sum(values) if values else None)
    stops = [rec.extra["stopped_over_limit"] for rec in records if rec.extra.get("stopped_over_limit")]
    if stops:   # the rank that stopped with the highest reading (violation() reads it)
        merged.extra["stopped_over_limit"] = max(stops, key=lambda s: s.get("used_bytes", 0))


def merge_rank_files(spec: TrialSpec, result_path: str | Path, *, timed_out: bool = False) -> TrialResult | None:
    """The trial's record from the rank records next to ``result_path`` when the trial process
    left no merged record of its own (it was killed, or the runner's timeout killed the group):
    None when no rank wrote a record. A timeout stays a timeout; the ranks' figures are kept."""
    path = Path(result_path)
    found = sorted(path.parent.glob(f"{path.stem}.rank*{path.suffix}"))
    ranks = [int(p.name[len(path.stem) + 5:-len(path.suffix)]) for p in found
             if p.name[len(path.stem) + 5:-len(path.suffix)].isdigit()]
    if not ranks:
        return None
    n = max(spec.ranks, max(ranks) + 1)
    tails = []
    for rank in range(n):
        try:
            tails.append(rank_stderr_path(path.parent, rank).read_text(errors="replace")[-4000:])
        except OSError:
            tails.append("")
    merged = merge_ranks(spec, read_rank_results(path, n), stderr_tails=tails)
    if timed_out:
        merged.outcome = Outcome.TIMEOUT.value
        merged.message = f"trial exceeded its {spec.timeout_s:g} s limit; process group killed"
        merged.throughput = merged.step_time_s = None
    else:
        merged.extra["launcher_lost"] = True   # the ranks' launcher left no merged record
    return merged


def rank_oom_kill(result: TrialResult, evidence: Any) -> None:
    """Make a distributed trial whose failed rank was killed by SIGKILL without a record (``crash``:
    no evidence could be read inside the trial) ``host_oom`` when the host's OOM killer did it, as
    :func:`oomtune.classify.classify_failure` decides for one process (issue 23: SIGKILL is the
    OOM killer's only with evidence). ``evidence``: called with the rank's pid
    (``extra["rank_pids"]``), returns one line of evidence or None
    (:meth:`oomtune.trial.oomkill.OomKillWatch.evidence`). Changes ``result`` in place; never raises.
    """
    from oomtune.classify import ADVICE

    extra = result.extra or {}
    rank, ranks, pids = extra.get("failed_rank"), extra.get("ranks") or [], extra.get("rank_pids") or []
    if result.outcome != Outcome.CRASH.value or not isinstance(rank, int) or not 0 <= rank < min(len(ranks), len(pids)):
        return
    if ranks[rank].get("exitcode") != -signal.SIGKILL:
        return
    try:
        found = evidence([pids[rank]])
    except Exception:   # evidence unreadable: the crash stands
        return
    if found:
        result.outcome = Outcome.HOST_OOM.value
        result.message = (f"rank {rank} of {len(ranks)}: killed by SIGKILL with no Python traceback, by the host "
                          f"OOM killer ({found})")
        result.advice = ADVICE[Outcome.HOST_OOM]
