"""Waiting for a trial process to exit without polling (polling's delays add up with many trials at once).

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
