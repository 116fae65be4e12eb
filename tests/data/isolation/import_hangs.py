"""A ``target=python`` entry whose module never finishes importing (a test fixture: a user's module
that waits for a server at import time). It writes its process id to $OOMTUNE_TEST_PIDFILE when set,
so a test can check that the importing process was ended."""

import os
import time

_path = os.environ.get("OOMTUNE_TEST_PIDFILE")
if _path:
    with open(_path, "w") as _f:
        _f.write(f"{os.getpid()}\n")
time.sleep(10**6)


def make_workload(batch_size, device):   # never reached
    raise AssertionError("unreachable")
