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
        # written whole or not at all (a temporary file renamed over it): the test reads it after this
        # process was killed, which on a loaded machine can come between an open and its write
        with open(f"{path}.{os.getpid()}.tmp", "w") as f:
            f.write(f"{os.getpid()} {child.pid}\n")
        os.replace(f"{path}.{os.getpid()}.tmp", path)
    while True:
        time.sleep(1)
