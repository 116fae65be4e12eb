"""A ``target=python`` entry whose make_workload raises (a test fixture: a user's missing data set)."""


def make_workload(batch_size, device):
    raise RuntimeError("no training data at /data/train (fixture)")
