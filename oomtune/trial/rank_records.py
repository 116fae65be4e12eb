"""One trial, several ranks: the ranks' records merged into the trial's record.

A distributed trial runs one process per GPU (``TrialSpec.ranks``; on the CPU one per virtual GPU),
each with its own memory budget, and each writes its own record (``result.rank<R>.json``, with
``distributed.rank``). The trial's record (:func:`merge_ranks`):

- **memory** is the worst rank's: peak reserved, allocated and active are the maxima over the ranks,
  the NVML device peak too; ``worst_rank`` names the rank with the highest peak reserved
  (the lowest such rank on a tie) and ``ranks`` keeps every rank's figures
  (:class:`oomtune.trial.record.RankPeak`). The budget is per rank, so the worst rank decides feasibility.
- **throughput** is global and counts every sample once: each rank trains its own
  ``samples_r`` samples in ``seconds_r``, concurrently, so the trial trains ``sum(samples_r)`` in
  ``max(seconds_r)`` (:func:`global_throughput`), not the mean of per-rank rates and not
  ``sum(samples) / sum(seconds)`` (which is the per-rank rate when every rank reports).
- **outcome**: ok when every rank is ok. Otherwise one rank's failure is the trial's, and the
  message names it (``rank 1 of 2: ...``, ``failed_rank``): a device-memory outcome on any
  rank first (an out-of-memory on any rank makes the trial infeasible), then the launcher's first
  observed failure, then the lowest rank. Failures that are consequences of another rank's (a
  collective broken by the dead peer: gloo's "Connection closed by peer", NCCL's aborted
  communicator; the launcher's SIGTERM to the surviving ranks) are never chosen
  (:func:`oomtune.classify._launcher.is_peer_teardown`); they stay visible in ``ranks``
  with ``teardown: true``.

No torch import: the runner and the ``cmd`` target use this module too.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from oomtune.outcome import Outcome
from oomtune.trial.record import MemoryReadings, RankPeak, TrialResult, TrialSpec

__all__ = ["RANK_FIELDS", "rank_result_path", "rank_stderr_path", "global_throughput", "merge_ranks",
           "merge_rank_files", "merge_memory", "rank_summary", "read_rank_results", "rank_oom_kill"]

#: The figures of each rank's record kept in ``TrialResult.ranks`` (:class:`RankPeak`).
RANK_FIELDS = ("outcome", "peak_reserved_bytes", "peak_allocated_bytes", "device_peak_bytes", "samples_per_s",
               "step_time_s", "message")


def rank_result_path(result_path: str | Path, rank: int) -> Path:
    """``result.rank<R>.json`` next to the trial's ``result.json``."""
    path = Path(result_path)
    return path.with_name(f"{path.stem}.rank{rank}{path.suffix}")


def rank_stderr_path(workdir: str | Path, rank: int) -> Path:
    """``stderr.rank<R>.txt`` in the trial's directory: one rank's standard error."""
    return Path(workdir) / f"stderr.rank{rank}.txt"


def read_rank_results(result_path: str | Path, ranks: int) -> list[TrialResult | None]:
    """Each rank's record, None where a rank wrote none (killed, or never started); a record that
    cannot be read (a field of the wrong type, NaN, a negative count: :class:`TrialResult`'s checks)
    is that rank's ``bad_record``, its first 200 characters quoted."""
    from oomtune.classify import ADVICE

    out: list[TrialResult | None] = []
    for rank in range(ranks):
        path = rank_result_path(result_path, rank)
        try:
            out.append(TrialResult.read(path))
        except OSError:
            out.append(None)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            try:
                text = path.read_text(encoding="utf-8", errors="replace").strip()
            except OSError:
                text = ""
            quoted = text if len(text) <= 200 else text[:200] + "..."
            out.append(TrialResult(outcome=Outcome.BAD_RECORD, message=f"malformed result record ({path.name}): "
                                   f"{exc}: {quoted}", advice=ADVICE[Outcome.BAD_RECORD]))
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
                 teardown: bool = False) -> RankPeak:
    """One entry of ``TrialResult.ranks``: the rank, its record's outcome, peaks, rate, step time
    and message (:data:`RANK_FIELDS`), its exit status, whether its failure was a consequence of
    another rank's (``teardown``) and its device identity (UUID) when known."""
    if result is None:
        return RankPeak(rank=rank, exitcode=exitcode, teardown=teardown)
    uuid = result.device.uuid if result.device is not None and result.device.uuid else None
    return RankPeak(rank=rank, outcome=result.outcome, peak_reserved_bytes=result.memory.peak_reserved_bytes,
                    peak_allocated_bytes=result.memory.peak_allocated_bytes,
                    device_peak_bytes=result.memory.device_peak_bytes,
                    samples_per_s=result.throughput.samples_per_s, step_time_s=result.throughput.step_time_s,
                    message=result.message, device_uuid=uuid, exitcode=exitcode, teardown=teardown)


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
        launcher: what started the ranks (kept in ``distributed.rank_launcher``).

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
            requested = getattr(cls.oom, "requested_bytes", None) if cls.oom is not None else None
            res = TrialResult(outcome=Outcome(cls.outcome), batch_size=spec.batch_size,
                              alloc_conf=spec.alloc_conf, message=f"{cls.message} (the rank wrote no record)",
                              advice=cls.advice, traceback_tail=cls.traceback_tail,
                              memory=MemoryReadings(oom_requested_bytes=requested))
            # terminated by the launcher (SIGTERM/SIGKILL) after another rank had failed first
            killed_after = (root_rank is not None and rank != root_rank and code is not None
                            and code in (-signal.SIGTERM, -signal.SIGKILL, -signal.SIGINT))
            teardown.append(killed_after or is_peer_teardown(tails[rank] if rank < len(tails) else ""))
        else:
            failed = res.outcome is not Outcome.OK and not res.outcome.is_memory
            teardown.append(failed and is_peer_teardown(" ".join(filter(None, (res.message, res.traceback_tail)))))
        records.append(res)
    merged = merge_memory(_pick(spec, records, teardown, root_rank), records)
    ranks = tuple(rank_summary(r, rec, exitcode=exitcodes[r] if r < len(exitcodes) else None,
                               teardown=teardown[r]) for r, rec in enumerate(records))
    return replace(merged, ranks=ranks,
                   distributed=replace(merged.distributed, rank=None, world_size=n, rank_launcher=launcher))


def _pick(spec: TrialSpec, records: list[TrialResult], teardown: list[bool], root_rank: int | None) -> TrialResult:
    """The record the trial's outcome comes from (a copy), message prefixed with its rank."""
    n = len(records)
    failed = [r for r, rec in enumerate(records) if rec.outcome is not Outcome.OK]
    if not failed:
        return _merge_throughput(records[0], records)
    causes = [r for r in failed if not teardown[r]] or failed

    def order(r: int) -> tuple[int, int]:
        if records[r].outcome.is_memory:
            return (_MEMORY_FIRST, r)
        return (_ROOT if r == root_rank else _OTHER, r)

    rank = min(causes, key=order)
    merged = records[rank]
    # a failed trial has no values (Optuna's rule)
    return replace(merged, message=f"rank {rank} of {n}: {merged.message or merged.outcome}", failed_rank=rank,
                   throughput=replace(merged.throughput, samples_per_s=None, step_time_s=None))


def _merge_throughput(merged: TrialResult, records: list[TrialResult]) -> TrialResult:
    """Global samples/s (:func:`global_throughput`) and the slowest rank's step time. Every rank runs
    the same measured steps, so a mean step (``throughput x step_time_s`` samples in ``step_time_s``
    seconds) stands for the interval."""
    rates = [rec.throughput for rec in records]
    intervals = [(t.samples_per_s * t.step_time_s, t.step_time_s) for t in rates
                 if t.samples_per_s is not None and t.step_time_s is not None]
    steps = [t.step_time_s for t in rates if t.step_time_s is not None]
    waits = [t.data_wait_fraction for t in rates if t.data_wait_fraction is not None]
    throughput = replace(
        merged.throughput, samples_per_s=global_throughput(intervals) if len(intervals) == len(records) else None,
        step_time_s=max(steps) if steps else None, data_wait_fraction=max(waits) if waits else None)
    starts = [rec.startup_s for rec in records if rec.startup_s is not None]
    firsts = [rec.process.first_step_at for rec in records if rec.process.first_step_at is not None]
    process = replace(merged.process, first_step_at=max(firsts)) if firsts else merged.process
    return replace(merged, throughput=throughput, startup_s=max(starts) if starts else None, process=process)


def merge_memory(merged: TrialResult, records: list[TrialResult]) -> TrialResult:
    """``merged`` with the ranks' memory: peaks the maxima over the ranks; ``worst_rank`` the rank with
    the highest peak reserved; fragmentation and the memory outside the allocator the worst rank's;
    counters summed; ``stopped_over_limit`` the rank's that stopped with the highest reading."""
    memories = [rec.memory for rec in records]

    def values(name: str) -> list[int]:
        return [getattr(m, name) for m in memories if getattr(m, name) is not None]

    changes: dict[str, Any] = {}
    top: dict[str, Any] = {}
    reserved = [(m.peak_reserved_bytes, r) for r, m in enumerate(memories) if m.peak_reserved_bytes is not None]
    if reserved:
        peak, worst = max(reserved, key=lambda pr: (pr[0], -pr[1]))
        top["worst_rank"] = worst
        changes.update(fragmentation=memories[worst].fragmentation,
                       non_allocator_bytes=memories[worst].non_allocator_bytes)
    for name in ("peak_reserved_bytes", "peak_allocated_bytes", "peak_active_bytes", "device_peak_bytes"):
        found = values(name)
        changes[name] = max(found) if found else None
    for name in ("num_alloc_retries", "num_ooms"):
        found = values(name)
        changes[name] = sum(found) if found else None
    stops = [rec.stopped_over_limit for rec in records if rec.stopped_over_limit is not None]
    if stops:   # the rank that stopped with the highest reading (violation() reads it)
        top["stopped_over_limit"] = max(stops, key=lambda s: s.used_bytes)
    return replace(merged, memory=replace(merged.memory, **changes), **top)


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
        return replace(merged, outcome=Outcome.TIMEOUT,
                       message=f"trial exceeded its {spec.timeout_s:g} s limit; process group killed",
                       throughput=replace(merged.throughput, samples_per_s=None, step_time_s=None))
    # the ranks' launcher left no merged record
    return replace(merged, distributed=replace(merged.distributed, launcher_lost=True))


def rank_oom_kill(result: TrialResult, evidence: Any) -> TrialResult:
    """Make a distributed trial whose failed rank was killed by SIGKILL without a record (``crash``:
    no evidence could be read inside the trial) ``host_oom`` when the host's OOM killer did it, as
    :func:`oomtune.classify.classify_failure` decides for one process (SIGKILL is the
    OOM killer's only with evidence). ``evidence``: called with the rank's pid
    (``distributed.rank_pids``), returns one line of evidence or None
    (:meth:`oomtune.trial.oomkill.OomKillWatch.evidence`). Returns ``result``, changed or not; never raises.
    """
    from oomtune.classify import ADVICE

    rank, ranks, pids = result.failed_rank, result.ranks, result.distributed.rank_pids
    if result.outcome is not Outcome.CRASH or not isinstance(rank, int) or not 0 <= rank < min(len(ranks), len(pids)):
        return result
    if ranks[rank].exitcode != -signal.SIGKILL:
        return result
    try:
        found = evidence([pids[rank]])
    except Exception:   # evidence unreadable: the crash stands
        return result
    if not found:
        return result
    return replace(result, outcome=Outcome.HOST_OOM, advice=ADVICE[Outcome.HOST_OOM],
                   message=(f"rank {rank} of {len(ranks)}: killed by SIGKILL with no Python traceback, by the host "
                            f"OOM killer ({found})"))
