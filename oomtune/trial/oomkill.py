"""Evidence that the kernel's OOM killer ended a trial process, as opposed to any other SIGKILL.

A trial process that dies of SIGKILL without a Python traceback was often killed by the host's OOM
killer (field case C5), but a user's ``kill -9``, a cluster's preemption or a supervisor's cleanup
look exactly the same from the exit status. Calling every SIGKILL ``host_oom`` made one stray kill
an infeasible point, so a SIGKILL counts as the OOM killer's only with evidence,
read where the system lets us read it:

* cgroup v2: ``memory.events`` of the trial's cgroup, its ``oom_kill`` counter ("the number of
  processes belonging to this cgroup killed by any kind of OOM killer", Documentation/admin-guide/
  cgroup-v2.rst; incremented in ``__oom_kill_process``, mm/oom_kill.c, for a global OOM too);
* cgroup v1: ``memory.oom_control`` of the memory cgroup, its ``oom_kill`` line (kernel >= 4.13);
* the kernel log (``/dev/kmsg``, readable by root or with ``kernel.dmesg_restrict=0``): a line
  ``Killed process <pid>`` or ``oom-kill:... pid=<pid>`` naming the trial's process.

The counters are read before the trial starts and again after it died: a counter that grew is the
evidence. The trial runs in the cgroup of the process that launched it, so our own cgroup's files
are read. A counter counts every OOM kill in the cgroup, so an unrelated kill in the same cgroup
during the trial is also taken as evidence (the kernel log, when readable, names the pid).
Nothing here raises: a file that cannot be read is simply no evidence.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path

__all__ = ["read_oom_kill_counters", "kernel_log_kills", "OomKillWatch"]

_COUNTER = re.compile(r"^oom_kill\s+(\d+)\s*$", re.M)


def _mounts(mountinfo: str) -> tuple[str | None, str | None]:
    """(cgroup2 mount point, cgroup v1 memory controller mount point) from /proc/self/mountinfo text."""
    v2 = v1_memory = None
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        point, fstype, options = fields[4], tail[0], tail[2]
        if fstype == "cgroup2" and v2 is None:
            v2 = point
        elif fstype == "cgroup" and "memory" in options.split(",") and v1_memory is None:
            v1_memory = point
    return v2, v1_memory


def _counter_files(pid: int | str, proc: Path) -> list[Path]:
    """The files holding the oom_kill counter of ``pid``'s memory cgroup (v2 and/or v1)."""
    try:
        cgroups = (proc / str(pid) / "cgroup").read_text()
        mountinfo = (proc / "self" / "mountinfo").read_text()
    except OSError:
        return []
    v2, v1 = _mounts(mountinfo)
    out: list[Path] = []
    for line in cgroups.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hier, controllers, path = parts
        rel = path.lstrip("/")
        if hier == "0" and controllers == "" and v2 is not None:
            out.append(Path(v2) / rel / "memory.events")
        elif "memory" in controllers.split(",") and v1 is not None:
            out.append(Path(v1) / rel / "memory.oom_control")
    return out


def read_oom_kill_counters(pid: int | str = "self", *, proc: str | Path = "/proc") -> dict[str, int]:
    """``{file: oom_kill count}`` for ``pid``'s memory cgroup: cgroup v2 ``memory.events`` and/or v1
    ``memory.oom_control`` (see the module docstring); empty when none can be read (no memory
    controller, the root cgroup of v2, which has no ``memory.events``, another OS)."""
    found: dict[str, int] = {}
    for path in _counter_files(pid, Path(proc)):
        try:
            m = _COUNTER.search(path.read_text())
        except OSError:
            continue
        if m:
            found[str(path)] = int(m.group(1))
    return found


_KILLED = re.compile(r"(?:Killed process (\d+)\b|oom-kill:.*\bpid=(\d+)\b)")


def kernel_log_kills(pids: Iterable[int], *, path: str | Path = "/dev/kmsg",
                     max_bytes: int = 4 << 20) -> list[str] | None:
    """The kernel log records that name one of ``pids`` as killed by the OOM killer (``Killed
    process <pid> (...)`` from ``__oom_kill_process``, or the ``oom-kill:...,pid=<pid>`` summary
    line); None when the log cannot be read (``/dev/kmsg`` needs root or dmesg_restrict=0).

    ``/dev/kmsg`` gives one record per read (a read into a too-small buffer fails with EINVAL), so
    it is read record by record, non-blocking, until no record is left (or ``max_bytes``)."""
    wanted = {int(p) for p in pids}
    try:
        fd = os.open(str(path), os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    hits: list[str] = []
    total = 0
    try:
        while total < max_bytes:
            try:
                record = os.read(fd, 8192)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == 32:   # EPIPE: a record was overwritten while reading; go on
                    continue
                break
            if not record:
                break
            total += len(record)
            for line in record.decode(errors="replace").splitlines():
                if not line.strip() or line[:1].isspace():   # a record's key=value continuation lines
                    continue
                head, sep, message = line.partition(";")   # "prio,seq,usec,flags;message"
                message = message if sep and "," in head else line
                for m in _KILLED.finditer(message):
                    if int(m.group(1) or m.group(2)) in wanted:
                        hits.append(message.strip())
                        break
    finally:
        os.close(fd)
    return hits


class OomKillWatch:
    """Read the OOM-kill counters before a trial starts; :meth:`evidence` after it died.

    Args:
        proc: the proc file system (tests point it at a fake tree).
        kmsg: the kernel log device.
    """

    def __init__(self, *, proc: str | Path = "/proc", kmsg: str | Path = "/dev/kmsg") -> None:
        self.proc, self.kmsg = proc, kmsg
        self.before = read_oom_kill_counters(proc=proc)
        self.kernel_log_read: bool | None = None   # set by evidence(): whether the kernel log was readable

    def evidence(self, pids: Iterable[int]) -> str | None:
        """One line naming the evidence that the OOM killer killed one of ``pids``, or None (no
        counter grew and the kernel log, if readable, names none of them)."""
        after = read_oom_kill_counters(proc=self.proc)
        for path, count in sorted(after.items()):
            old = self.before.get(path)
            if old is not None and count > old:
                return f"{path}: oom_kill {old} -> {count} during the trial"
        lines = kernel_log_kills(pids, path=self.kmsg)
        self.kernel_log_read = lines is not None
        if lines:
            return f"kernel log: {lines[-1][:200]}"
        return None

    def sources(self) -> str:
        """What was read, in words, after :meth:`evidence` found nothing: ``"memory.oom_control
        oom_kill unchanged; kernel log names no OOM kill of the trial"``."""
        parts = [f"{Path(p).name} oom_kill unchanged" for p in sorted(self.before)] or ["no cgroup OOM counter readable"]
        parts.append({True: "kernel log names no OOM kill of the trial", False: "kernel log not readable",
                      None: "kernel log not read"}[self.kernel_log_read])
        return "; ".join(parts)
