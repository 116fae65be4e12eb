"""A ``target=python`` entry whose module never finishes importing (a test fixture: a user's module
that waits for a server at import time). It writes its process id to $OOMTUNE_TEST_PIDFILE when set,
so a test can check that the importing process was ended."""

import os
import time

_path = os.environ.get("OOMTUNE_TEST_PIDFILE")
if _path:
    # written whole or not at all (a temporary file renamed over it): the test reads it after this
    # process was killed, which on a loaded machine can come between an open and its write
    with open(f"{_path}.{os.getpid()}.tmp", "w") as _f:
        _f.write(f"{os.getpid()}\n")
    os.replace(f"{_path}.{os.getpid()}.tmp", _path)
time.sleep(10**6)


def make_workload(batch_size, device):   # never reached
    raise AssertionError("unreachable")
