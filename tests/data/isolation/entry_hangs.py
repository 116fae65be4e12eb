"""A ``target=python`` entry whose make_workload never returns (a test fixture: a user's stuck data
loader). It writes its process id to $OOMTUNE_TEST_PIDFILE when set, so a test can check that the
process was ended, and starts a child process in its own session-less group that would outlive a
plain kill of the process alone."""

import os
import subprocess
import sys
import time


def make_workload(batch_size, device):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    path = os.environ.get("OOMTUNE_TEST_PIDFILE")
    if path:
        with open(path, "w") as f:
            f.write(f"{os.getpid()} {child.pid}\n")
    while True:
        time.sleep(1)
