"""A ``target=python`` entry that ends its process with os._exit(3) (a test fixture: a library that
exits instead of raising)."""

import os


def make_workload(batch_size, device):
    os._exit(3)
