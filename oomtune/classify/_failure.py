"""Classifying what a trial left behind: an exception chain, or a dead process's stderr and exit status."""

from __future__ import annotations

import re
import signal
import traceback as _tb
from typing import Any

from oomtune.classify._gpu_index import _ENV
from oomtune.classify._rules import ADVICE, Classification, _drop_warnings, classify_text, memory_signal
from oomtune.outcome import Outcome

__all__ = ["classify_exception", "classify_failure", "classify_process", "TRACEBACK_TAIL_LINES"]

TRACEBACK_TAIL_LINES = 20
_RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s?", re.M)
_CHAIN = ("The above exception was the direct cause", "During handling of the above exception")
_TB_HEAD = "Traceback (most recent call last):"


def _tail(text: str, lines: int = TRACEBACK_TAIL_LINES) -> str | None:
    kept = [line for line in text.rstrip().splitlines()][-lines:]
    return "\n".join(kept) if kept else None


def _pick(texts: list[str], **kw) -> Classification | None:
    """Classify a chain of exception texts, outermost last: the outermost specific cause wins (a
    memory/limit outcome over a worker crash, e.g. "killed by signal: Bus error" raised from
    "worker exited unexpectedly"), then a crash, then the outermost error."""
    results = [classify_text(t, **kw) for t in texts if t.strip()]
    for weak in ((Outcome.ERROR, Outcome.CRASH), (Outcome.ERROR,)):
        for result in reversed(results):
            if result.outcome not in weak:
                return result
    return results[-1] if results else None


def classify_exception(exc: BaseException, *, batch_size: int | None = None,
                       smaller_batch_succeeded: bool = False,
                       visible_devices: str | None | object = _ENV) -> Classification:
    """Classify an exception caught inside a trial process (with its ``__cause__``/``__context__`` chain).

    A ``torch.OutOfMemoryError`` (or any subclass, e.g. the virtual GPU's simulated one) is always a
    device-memory outcome; other types are judged by their text only. Never raises.
    """
    chain: list[BaseException] = []
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__
    kw = dict(batch_size=batch_size, smaller_batch_succeeded=smaller_batch_succeeded, visible_devices=visible_devices)
    texts = []
    for e in reversed(chain):  # innermost first, outermost last (as Python prints them)
        names = [c.__name__ for c in type(e).__mro__]
        name = "OutOfMemoryError" if any(n.endswith("OutOfMemoryError") for n in names) else type(e).__name__
        if "MemoryError" in names and name != "OutOfMemoryError":
            name = "MemoryError"
        texts.append(f"{name}: {e}")
    result = _pick(texts, **kw) or classify_text(repr(exc), **kw)
    if result.outcome in (Outcome.ERROR, Outcome.CRASH):
        tail = _tail("".join(_tb.format_exception(exc)))
        result = Classification(result.outcome, result.message, result.advice, result.oom,
                                result.gpu_index_physical, tail)
    return result


def _exception_blocks(stderr: str) -> list[str]:
    """The exception text after each ``Traceback (most recent call last):`` in ``stderr``, in order."""
    lines = _RANK_PREFIX.sub("", stderr).splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if not lines[i].startswith(_TB_HEAD):
            i += 1
            continue
        j = i + 1
        while j < len(lines) and (lines[j][:1] in (" ", "\t") or not lines[j].strip()):
            j += 1
        k = j
        while k < len(lines) and not lines[k].startswith(_TB_HEAD) and not lines[k].startswith(_CHAIN):
            k += 1
        blocks.append("\n".join(lines[j:k]).strip())
        i = k
    return blocks


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def _recognised_text(stderr: str, kw: dict) -> Classification | None:
    """The stderr tail (last 4000 characters) classified as one text, when that is not ``error``."""
    result = classify_text(stderr[-4000:], **kw) if stderr.strip() else None
    return result if result is not None and result.outcome is not Outcome.ERROR else None


def classify_failure(*, returncode: int | None, stderr: str, timed_out: bool = False,
                     batch_size: int | None = None, smaller_batch_succeeded: bool = False,
                     visible_devices: str | None | object = _ENV, oom_kill_evidence: str | None = None,
                     no_evidence_reason: str | None = None) -> Classification:
    """Classify a trial process that ended without writing its result record: as
    :func:`classify_process`, except that when ``stderr`` holds a multi-process launcher's failure
    summary (torchrun's ``ChildFailedError``, DeepSpeed's, accelerate's:
    :func:`oomtune.classify._launcher.parse_launcher_summary`), the first failed rank's failure is
    classified instead of the launcher's own exit status: its traceback (torchrun's ``[rankN]:``
    lines) or, without one, its exit code or signal (``exitcode: -9`` is the rank's SIGKILL). The
    message then starts with the rank (``rank 1 (pid 32204): ...``) and ``rank`` is set. Never raises.
    """
    kw = dict(batch_size=batch_size, smaller_batch_succeeded=smaller_batch_succeeded, visible_devices=visible_devices,
              oom_kill_evidence=oom_kill_evidence, no_evidence_reason=no_evidence_reason)
    if not timed_out:
        from oomtune.classify._launcher import parse_launcher_summary

        summary = parse_launcher_summary(stderr or "")
        if summary is not None:
            return _root_cause(summary, stderr or "", returncode, **kw)
    return classify_process(returncode=returncode, stderr=stderr, timed_out=timed_out, **kw)


def _root_cause(summary: Any, stderr: str, returncode: int | None, **kw: Any) -> Classification:
    """The launcher summary's root-cause rank, classified (see :func:`classify_failure`)."""
    from oomtune.classify._launcher import rank_sections

    root = summary.root
    own = rank_sections(stderr).get(root.rank) if root.rank is not None else None
    if own and _TB_HEAD in own:           # the rank's own traceback decides
        result = classify_process(returncode=root.exitcode if root.exitcode is not None else returncode,
                                  stderr=own, **kw)
    elif root.signal is not None:        # killed without a traceback: the rank's signal decides
        result = classify_process(returncode=root.exitcode, stderr=own or "", **kw)
    else:                                # an exit status: whatever the output shows
        result = classify_process(returncode=root.exitcode if root.exitcode is not None else returncode,
                                  stderr=stderr, **kw)
    return Classification(result.outcome, f"{root.describe()} ({summary.launcher}): {result.message}",
                          result.advice, result.oom, result.gpu_index_physical, result.traceback_tail,
                          rank=root.rank)


def classify_process(*, returncode: int | None, stderr: str, timed_out: bool = False,
                     batch_size: int | None = None, smaller_batch_succeeded: bool = False,
                     visible_devices: str | None | object = _ENV, oom_kill_evidence: str | None = None,
                     no_evidence_reason: str | None = None) -> Classification:
    """Classify one process that ended without writing its result record.

    Args:
        returncode: ``Popen.returncode`` (negative N = killed by signal N; 128+N from a shell = signal N);
            None when unknown.
        stderr: the child's stderr (its tail suffices); the last traceback's exception is classified,
            then the exceptions it was raised from; when they are not recognised, a memory signal
            anywhere in ``stderr`` (:func:`memory_signal`) decides.
        timed_out: the runner killed the process group at the wall limit (wins over everything).
        batch_size / smaller_batch_succeeded / visible_devices: as in :func:`classify_text`.
        oom_kill_evidence: one line of evidence that the kernel's OOM killer killed the process
            (:class:`oomtune.trial.oomkill.OomKillWatch`: the cgroup's oom_kill counter grew, or the
            kernel log names the pid); None: no evidence.
        no_evidence_reason: what was read and found nothing (for the ``crash`` message).

    Returns:
        ``timeout``; the traceback's class when recognised; for SIGKILL without a Python traceback
        ``host_oom`` with ``oom_kill_evidence`` (the kernel OOM killer, field case C5), else
        ``crash`` (a ``kill -9``, a preemption; the search retries a crash once);
        ``crash`` for other signals; ``ok`` for exit 0
        without a traceback (the "memory allocation failed with OOM" warning alone never fails a trial;
        the runner judges a missing record itself); else ``error`` with the stderr tail. Never raises.
    """
    stderr = _drop_warnings(stderr or "")
    tail = _tail(stderr)
    if timed_out:
        return Classification(Outcome.TIMEOUT, "trial exceeded its wall-time limit; process group killed",
                              ADVICE[Outcome.TIMEOUT], traceback_tail=tail)
    kw = dict(batch_size=batch_size, smaller_batch_succeeded=smaller_batch_succeeded, visible_devices=visible_devices)
    blocks = _exception_blocks(stderr)
    result = _pick(blocks, **kw) if blocks else None
    if result is not None and result.outcome is not Outcome.ERROR:
        return result
    if returncode != 0 or blocks:
        # A memory signal anywhere counts, even when a generic traceback follows it (e.g.
        # "NCCL WARN Cuda failure 'out of memory'", then a RuntimeError from the collective).
        found = memory_signal(stderr, **kw)
        if found is not None:
            return Classification(found.outcome, found.message, found.advice, found.oom,
                                  found.gpu_index_physical, tail)
    sig = -returncode if returncode is not None and returncode < 0 else None
    if returncode is not None and 128 < returncode <= 128 + 64:
        sig = returncode - 128
    if sig is not None and not blocks:
        if sig == signal.SIGKILL and oom_kill_evidence:
            return Classification(Outcome.HOST_OOM, "killed by SIGKILL with no Python traceback, by the host "
                                  f"OOM killer ({oom_kill_evidence})", ADVICE[Outcome.HOST_OOM], traceback_tail=tail)
        if sig == signal.SIGKILL:
            why = f" ({no_evidence_reason})" if no_evidence_reason else ""
            return Classification(Outcome.CRASH, "killed by SIGKILL with no Python traceback and no evidence of "
                                  f"the OOM killer{why}: killed from outside (kill -9, preemption)?",
                                  ADVICE[Outcome.CRASH], traceback_tail=tail)
        text_result = _recognised_text(stderr, kw)
        if text_result is not None:
            return text_result  # e.g. SIGABRT after "terminate called ... what(): CUDA out of memory"
        return Classification(Outcome.CRASH, f"killed by {_signal_name(sig)}", ADVICE[Outcome.CRASH],
                              traceback_tail=tail)
    if result is not None:
        return Classification(result.outcome, result.message, result.advice, traceback_tail=_tail(
            stderr[stderr.rfind(_TB_HEAD):] if _TB_HEAD in stderr else stderr))
    if returncode == 0:
        return Classification(Outcome.OK, "exited with status 0", ADVICE[Outcome.OK])
    text_result = _recognised_text(stderr, kw)
    if text_result is not None:
        return text_result
    status = "unknown exit status" if returncode is None else f"exited with status {returncode}"
    from oomtune.classify._repeats import USAGE_STATUS, own_error_line, usage_error_line

    # the line that says why: oomtune's own error line in the trial (an integration's usage error),
    # or for a usage error (exit 2) argparse's / the interpreter's
    why = usage_error_line(stderr) if returncode == USAGE_STATUS else own_error_line(stderr)
    if why:
        return Classification(Outcome.ERROR, f"{status}: {why}", ADVICE[Outcome.ERROR], traceback_tail=tail)
    return Classification(Outcome.ERROR, f"{status} without a result record", ADVICE[Outcome.ERROR],
                          traceback_tail=tail)
