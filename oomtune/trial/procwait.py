"""Waiting for a trial process to exit without polling, and when a process started (polling's delays add up with many trials at once).

``subprocess.Popen.wait(timeout)`` polls: CPython sleeps between ``waitpid(WNOHANG)`` calls, up to
50 ms at a time, so each trial's end was noticed up to 50 ms late, and with N trials at once N
threads woke up to 20 times a second each. On Linux a pidfd (``os.pidfd_open``, kernel >= 5.3,
Python >= 3.9) becomes readable when the process exits, so one ``poll`` blocks until then.
"""

from __future__ import annotations

import os
import select
import subprocess
import time
from pathlib import Path

__all__ = ["exited_within"]


def exited_within(proc: subprocess.Popen, timeout_s: float) -> bool:
    """True once ``proc`` has exited (it is not reaped: call ``proc.wait()``), False after
    ``timeout_s`` seconds.

    Blocks on a pidfd where there is one; elsewhere (other systems, old kernels) falls back to
    ``Popen.wait(timeout)``, which reaps the process (``proc.wait()`` then returns at once).
    """
    if proc.returncode is not None:  # reaped already: its pid may belong to another process now
        return True
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # no pidfd here, or the pid is already reaped
        try:
            proc.wait(timeout=max(0.0, timeout_s))
            return True
        except subprocess.TimeoutExpired:
            return False
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            left_ms = max(0, int((deadline - time.monotonic()) * 1000) + 1)
            if poller.poll(min(left_ms, 2**31 - 1)):
                return True
            if time.monotonic() >= deadline:
                return False
    finally:
        os.close(fd)


def process_start_time() -> float:
    """``time.time()`` (seconds) at which this process started: Linux's ``/proc/self/stat`` field 22
    (``starttime``, in clock ticks since boot; 10 ms) against ``/proc/uptime``; for a forked process,
    the fork. Where /proc cannot be read, the time of this call. Never raises."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started_ticks = int(fields[19])  # field 22 (starttime) counted after "pid (comm)"
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        age = uptime - started_ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - max(0.0, age)
    except (OSError, ValueError, IndexError):
        return time.time()
