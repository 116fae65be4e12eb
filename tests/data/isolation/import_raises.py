"""A ``target=python`` entry whose module raises while it is imported (a test fixture: a user's
configuration file missing at import time)."""

raise RuntimeError("no config at /etc/fixture.yaml (fixture, module level)")


def make_workload(batch_size, device):   # never reached
    raise AssertionError("unreachable")
