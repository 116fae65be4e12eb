"""A ``target=python`` entry whose process dies of SIGKILL (a test fixture: a native crash or a kill
from outside, without the OOM killer)."""

import os
import signal


def make_workload(batch_size, device):
    os.kill(os.getpid(), signal.SIGKILL)
