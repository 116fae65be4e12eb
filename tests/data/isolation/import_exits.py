"""A ``target=python`` entry whose module ends its process while it is imported (a test fixture: a
library that calls ``os._exit`` at import)."""

import os

os._exit(3)


def make_workload(batch_size, device):   # never reached
    raise AssertionError("unreachable")
