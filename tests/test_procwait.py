"""oomtune.trial.procwait: waiting for a trial process's exit without polling."""

from __future__ import annotations

import subprocess
import sys

from oomtune.trial.procwait import exited_within


def test_a_running_process_is_not_reported_exited_and_an_exited_one_is():
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        assert exited_within(proc, 0.2) is False      # blocked reading stdin: cannot have exited
        assert proc.poll() is None                    # not reaped, still running
        proc.stdin.close()                            # now it exits
        assert exited_within(proc, 60.0) is True
        assert proc.wait() == 0
    finally:
        proc.kill()
        proc.wait()


def test_the_exit_status_is_left_for_wait():
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    assert exited_within(proc, 60.0) is True
    assert proc.wait() == 3
    assert exited_within(proc, 0.0) is True           # already reaped: no pidfd, Popen knows it
