"""Multi-process launchers' failure summaries: which rank failed first, and how.

A training command started through a launcher exits with the launcher's status (torchrun: 1),
whatever killed the rank: the rank's own exit status or signal is only in the launcher's summary.
Parsed formats (each checked against the launcher's source):

- **torchrun / torch.distributed.run** (also ``accelerate launch`` with several processes or
  DeepSpeed, which call ``torch.distributed.run.run``): the ``ChildFailedError`` message,
  ``ChildFailedError.format_msg`` with ``_FAILURE_FORMAT_TEMPLATE`` in
  torch/distributed/elastic/multiprocessing/errors/__init__.py: a ``Root Cause (first observed
  failure)`` section and ``Failures`` of the other ranks, each ``rank : R (local_rank: L)``,
  ``exitcode : E (pid: P)`` (plus `` (SIGKILL)`` since pytorch#175254), ``traceback : ...``.
  When the summary was cut off, the agent's log line ``failed (exitcode: E) local_rank: L (pid: P)
  of binary: ...`` (``SubprocessContext``/``MultiprocessContext`` in
  torch/distributed/elastic/multiprocessing/api.py) names the first failed local rank.
- **DeepSpeed** (``deepspeed`` launcher, deepspeed/launcher/launch.py ``sigkill_handler``, logged
  to stdout as ``[time] [ERROR] [launch.py:N:sigkill_handler] [cmd...] exits with return code =
  E``): the return code of a failed rank. The printed command is the *last started* rank's
  (``cmd`` is the loop variable of the launch loop), so its ``--local_rank`` does not name the
  failed rank, and the rank stays unknown.
- **accelerate's single-process launcher** (``simple_launcher`` in accelerate/commands/launch.py
  raises ``subprocess.CalledProcessError(returncode, cmd)``): CPython's message ``Command '...'
  died with <Signals.SIGKILL: 9>.`` or ``... returned non-zero exit status E.``; one process (rank
  unknown).

Ranks whose failure is the launcher's teardown (torchrun sends SIGTERM to the other ranks after
the first failure) and errors a rank raises because a peer died (:func:`is_peer_teardown`: gloo's
"Connection closed by peer", NCCL's aborted communicator) are not root causes.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass, field

__all__ = ["RankFailure", "LauncherSummary", "parse_launcher_summary", "is_peer_teardown", "rank_sections"]


@dataclass(frozen=True)
class RankFailure:
    """One failed process of a launcher's summary.

    Attributes:
        rank: global rank (None when the launcher does not say which).
        local_rank: rank on its node (None when not printed).
        exitcode: the process's exit status, negative for a signal (``-9``: SIGKILL), as
            ``subprocess`` reports it; None when not printed.
        pid: the process id, when printed.
        message: the launcher's ``traceback`` field (the error file's message, or "Signal 9
            (SIGKILL) received by PID ..."), when printed.
    """

    rank: int | None
    local_rank: int | None = None
    exitcode: int | None = None
    pid: int | None = None
    message: str | None = None

    @property
    def signal(self) -> int | None:
        """The signal number that ended the process (from a negative exit code), else None."""
        return -self.exitcode if self.exitcode is not None and self.exitcode < 0 else None

    def describe(self) -> str:
        """``rank 1 (local_rank 1, pid 32204)``, or ``a rank`` when the rank is unknown."""
        details = [f"local_rank {self.local_rank}"] if self.local_rank is not None and self.local_rank != self.rank else []
        if self.pid is not None:
            details.append(f"pid {self.pid}")
        who = f"rank {self.rank}" if self.rank is not None else "a rank"
        return who + (f" ({', '.join(details)})" if details else "")


@dataclass(frozen=True)
class LauncherSummary:
    """A launcher's failure summary: ``launcher`` (``torchrun``, ``deepspeed``, ``accelerate``),
    ``root`` (the first observed failure) and ``others`` (the other failed ranks, e.g. those the
    launcher terminated)."""

    launcher: str
    root: RankFailure
    others: tuple[RankFailure, ...] = field(default_factory=tuple)


_FAILURE = re.compile(
    r"rank\s*:\s*(?P<rank>-?\d+)\s*\(local_rank:\s*(?P<local>-?\d+)\)\s*\n"
    r"\s*exitcode\s*:\s*(?P<code>-?\d+)\s*\(pid:\s*(?P<pid>\d+)\)[^\n]*\n"
    r"(?:\s*error_file\s*:[^\n]*\n)?"
    r"(?:\s*traceback\s*:\s*(?P<message>[^\n]*))?")
_ROOT_HEADER = "Root Cause (first observed failure):"
_AGENT_LINE = re.compile(r"failed \(exitcode: (?P<code>-?\d+)\) local_rank: (?P<local>\d+) \(pid: (?P<pid>\d+)\)")
_DEEPSPEED = re.compile(r"\[launch\.py:\d+:sigkill_handler\] .* exits with return code = (?P<code>-?\d+)")
_CALLED = re.compile(r"CalledProcessError: Command .* (?:died with <Signals\.(?P<sig>SIG\w+): (?P<num>\d+)>"
                     r"|returned non-zero exit status (?P<code>-?\d+))")


def _failure(m: re.Match[str]) -> RankFailure:
    message = m.group("message")
    return RankFailure(rank=int(m.group("rank")), local_rank=int(m.group("local")), exitcode=int(m.group("code")),
                       pid=int(m.group("pid")), message=message.strip() if message else None)


def _torchrun(text: str) -> LauncherSummary | None:
    at = text.rfind(_ROOT_HEADER)
    if at >= 0:
        head = text.rfind("Failures:", 0, at)
        root = _FAILURE.search(text, at)
        if root is not None:
            others = tuple(_failure(m) for m in _FAILURE.finditer(text[head:at])) if head >= 0 else ()
            return LauncherSummary("torchrun", _failure(root), others)
    lines = list(_AGENT_LINE.finditer(text))
    if lines:   # the summary was cut off: the agent's log line of the first failed worker
        m = lines[0]
        return LauncherSummary("torchrun", RankFailure(rank=None, local_rank=int(m.group("local")),
                                                       exitcode=int(m.group("code")), pid=int(m.group("pid"))))
    return None


def parse_launcher_summary(text: str) -> LauncherSummary | None:
    """The failure summary a launcher printed in ``text`` (its stderr, plus stdout for DeepSpeed,
    which logs there), or None when no known launcher's summary is in it. Never raises.

    The torchrun summary names the root cause's global rank; the other formats give its exit status
    only (see the module docstring)."""
    if not text:
        return None
    found = _torchrun(text)
    if found is not None:
        return found
    ds = list(_DEEPSPEED.finditer(text))
    if ds:
        return LauncherSummary("deepspeed", RankFailure(rank=None, exitcode=int(ds[-1].group("code"))))
    called = list(_CALLED.finditer(text))
    if called:
        m = called[-1]
        code = -int(m.group("num")) if m.group("num") else int(m.group("code"))
        return LauncherSummary("accelerate", RankFailure(rank=None, exitcode=code))
    return None


#: Errors a rank raises because a peer process died or left the collective: gloo's TCP transport
#: (third_party/gloo/gloo/transport/tcp/pair.cc: "Connection closed by peer", "Read error ...:
#: Connection reset by peer"), NCCL's abort on a peer's failure (ProcessGroupNCCL: "NCCL
#: communicator was aborted", ncclRemoteError "remote process exited or there was a network error"),
#: a collective that timed out waiting for the peer, and the TCPStore losing its server.
_TEARDOWN = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|"
    r"NCCL communicator was aborted|ncclRemoteError|remote process exited or there was a network error|"
    r"Watchdog caught collective operation timeout|Timed out waiting .*for (?:the )?(?:peer|recv|send)|"
    r"Socket Timeout|Connection refused.*TCPStore|DistStoreError|"
    r"terminated with signal SIGTERM|Signal 15 \(SIGTERM\) received", re.IGNORECASE)


def is_peer_teardown(text: str | None) -> bool:
    """Whether ``text`` (an error message or a rank's stderr tail) is a consequence of another rank's
    failure rather than a cause: a collective broken by a dead peer, or the launcher's SIGTERM."""
    return bool(text) and _TEARDOWN.search(text) is not None


_RANK_LINE = re.compile(r"^\[rank(\d+)\]:\s?(.*)$")


def rank_sections(text: str) -> dict[int, str]:
    """The lines torchrun prefixed with ``[rankN]:`` (its default for workers' output since torch 2.2,
    ``--local-ranks-filter``/``log_line_prefix_template``), per rank, prefix removed."""
    out: dict[int, list[str]] = {}
    for line in (text or "").splitlines():
        m = _RANK_LINE.match(line)
        if m:
            out.setdefault(int(m.group(1)), []).append(m.group(2))
    return {rank: "\n".join(lines) for rank, lines in out.items()}


def signal_name(number: int) -> str:
    """``SIGKILL`` for 9; ``signal N`` for a number Python does not name."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
