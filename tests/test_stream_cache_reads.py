"""The stream cache keys on what a capture read from its process: environment variables and argv.

The field case: ``N_LAYER=2 SEQ_LEN=128 oomtune plan target=python ...`` then ``N_LAYER=1 SEQ_LEN=32
oomtune search ...`` read all five captures of the first model from the cache (errors of +45..+174%).
What must hold: a capture records the variables its workload read with their values; a lookup under
another value of one of them is a miss (captured again, another figure); back under the first value
the first entry is read again, not captured.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from oomtune.capture import reads as RD
from oomtune.exceptions import UserCodeError
from oomtune.plan import stream_cache as SC
from oomtune.plan.stream_cache import StreamCache
from oomtune.workload_spec import WorkloadSpec

# width read inside make_workload (every capture reads it) and depth at module level (read once, when
# the module loads: later captures in the process must still be keyed on it)
ENTRY = """import os
import torch
from torch import nn

DEPTH = int(os.environ.get("OOMTUNE_TEST_DEPTH", "1"))

def make_workload(batch_size, device):
    width = int(os.getenv("OOMTUNE_TEST_WIDTH", "32"))
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(DEPTH)]).to(device)
    def batches():
        while True:
            yield (torch.randn(batch_size, width, device=device),
                   torch.randint(0, width, (batch_size,), device=device))
    return model, torch.optim.SGD(model.parameters(), lr=0.1), batches()
"""


@pytest.fixture(autouse=True)
def _fresh_log():
    """Each test starts as a new process would: nothing read yet (the log only grows in a process)."""
    RD.forget()
    yield
    RD.forget()


def _entry(tmp_path: Path) -> dict:
    (tmp_path / "envwl.py").write_text(ENTRY)
    SC._entry_prints.clear()
    return {"target": {"name": "python", "entry": str(tmp_path / "envwl.py") + ":make_workload"}}


def test_reads_by_name_and_argv_are_recorded_with_the_value_before_the_block(monkeypatch):
    monkeypatch.setenv("OOMTUNE_TEST_A", "1")
    monkeypatch.delenv("OOMTUNE_TEST_B", raising=False)
    monkeypatch.delenv("OOMTUNE_TEST_SET", raising=False)
    monkeypatch.setattr(sys, "argv", ["prog", "--layers", "3"])
    from os import environ   # a module's own reference to os.environ is seen too

    with RD.recording():
        os.getenv("OOMTUNE_TEST_A")
        environ.get("OOMTUNE_TEST_B")
        os.environ["OOMTUNE_TEST_SET"] = "mine"   # set by the recorded code before it reads it: not an input
        assert os.environ["OOMTUNE_TEST_SET"] == "mine"
        assert sys.argv[1:] == ["--layers", "3"]
    got = RD.reads()
    assert got["OOMTUNE_TEST_A"] == "1" and got["OOMTUNE_TEST_B"] is None
    assert "OOMTUNE_TEST_SET" not in got
    assert got[RD.ARGV] == ["prog", "--layers", "3"]
    assert type(sys.argv) is list   # the recorder is gone after the block
    assert RD.matches({"OOMTUNE_TEST_A": "1", "OOMTUNE_TEST_B": None})
    monkeypatch.setenv("OOMTUNE_TEST_B", "")   # set, even empty, is another value than unset
    assert not RD.matches({"OOMTUNE_TEST_A": "1", "OOMTUNE_TEST_B": None})


def test_an_entry_under_another_value_is_kept_beside_and_only_a_matching_one_is_read(tmp_path, monkeypatch):
    from oomtune.alloc.stream import AllocationStream

    cache = StreamCache(tmp_path)
    key, material = cache.capture_key(WorkloadSpec.from_dict({"name": "mlp", "target": {"name": "builtin"}}), 8, 2, False)
    a = AllocationStream([("alloc", 1, 512, 0), ("free", 1)])
    b = AllocationStream([("alloc", 1, 1024, 0), ("free", 1)])
    a.reads, b.reads = {"OOMTUNE_TEST_V": "a"}, {"OOMTUNE_TEST_V": "b"}
    cache.put(key, material, a, None)
    cache.put(key, material, b, None)
    monkeypatch.setenv("OOMTUNE_TEST_V", "a")
    assert cache.get(key, material)[0] == a
    monkeypatch.setenv("OOMTUNE_TEST_V", "b")
    assert cache.get(key, material)[0] == b
    monkeypatch.setenv("OOMTUNE_TEST_V", "c")
    assert cache.get(key, material) is None
    monkeypatch.delenv("OOMTUNE_TEST_V")
    assert cache.get(key, material) is None
    assert (cache.hits, cache.misses) == (2, 2)


def test_a_changed_environment_variable_is_a_miss_and_the_first_value_reads_the_cache_again(tmp_path, monkeypatch):
    from oomtune.device import resolve_device
    from oomtune.plan import predictor as P

    device = resolve_device("cpu", virtual_device_memory="1GiB")
    cache = StreamCache(tmp_path / "cache")
    wl = _entry(tmp_path)
    for name in [m for m in sys.modules if m.startswith("oomtune_user_envwl_")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setenv("OOMTUNE_TEST_DEPTH", "2")
    monkeypatch.setenv("OOMTUNE_TEST_WIDTH", "64")

    def plan() -> tuple[P.Predictor, int]:
        pred = P.Predictor.for_search(WorkloadSpec.from_dict(wl), device, 64 << 20, cache=cache)
        return pred, pred.predict_detail(16, "").peak_allocated_bytes

    first, peak_a = plan()
    assert first.cached_batches == [] and first.captures == 1
    stored = first._captured[16].reads
    assert stored["OOMTUNE_TEST_WIDTH"] == "64"
    assert stored["OOMTUNE_TEST_DEPTH"] == "2"   # read when the module loaded, inside the first capture

    # VAR=b: captured again, another figure. By hand: the model's parameters (and SGD's gradients) are
    # depth x (width^2 + width) floats: 2 x (64^2 + 64) x 4 B = 33280 B of weights at width 64, and
    # 2 x (128^2 + 128) x 4 B = 132096 B at width 128: the peak grows by at least the difference.
    monkeypatch.setenv("OOMTUNE_TEST_WIDTH", "128")
    second, peak_b = plan()
    assert second.cached_batches == [] and second.captures == 1
    assert peak_b - peak_a >= 132096 - 33280

    # VAR=a again: read from the cache (the capture function refuses, so it must not be called)
    def no_capture(*a, **k):
        raise AssertionError("captured although the cache holds the stream")

    monkeypatch.setattr(P, "capture_training_stream", no_capture)
    monkeypatch.setenv("OOMTUNE_TEST_WIDTH", "64")
    third, peak_again = plan()
    assert third.cached_batches == [16] and peak_again == peak_a

    # a variable read once at module level (this process loaded the module already): still keyed
    # (the capture of a python entry runs in a process of its own: what it raised arrives as one line)
    monkeypatch.setenv("OOMTUNE_TEST_DEPTH", "3")
    with pytest.raises(UserCodeError, match="raised AssertionError .*captured although"):
        plan()


def test_another_threads_reads_during_a_recording_are_not_the_workloads(monkeypatch):
    import threading

    monkeypatch.setenv("OOMTUNE_TEST_MINE", "1")
    monkeypatch.setenv("OOMTUNE_TEST_THEIRS", "2")
    with RD.recording():
        worker = threading.Thread(target=lambda: os.environ.get("OOMTUNE_TEST_THEIRS"))
        worker.start()
        worker.join()
        os.environ.get("OOMTUNE_TEST_MINE")
    assert RD.reads() == {"OOMTUNE_TEST_MINE": "1"}


@pytest.mark.slow
def test_plans_in_fresh_processes_under_another_value_capture_again_and_the_first_value_reads_the_cache(tmp_path):
    """The field case's shape, each command its own process: plan with VAR=a, plan with VAR=b (a
    miss: captured again, a larger model's figures), VAR=a again (every capture read from the cache,
    the first plan's map)."""
    import subprocess

    import yaml

    (tmp_path / "envwl.py").write_text(ENTRY)
    root = Path(__file__).resolve().parents[1]

    def plan(depth: str, name: str) -> dict:
        env = dict(os.environ, OOMTUNE_CACHE_DIR=str(tmp_path / "cache"), OOMTUNE_TEST_DEPTH=depth,
                   OOMTUNE_TEST_WIDTH="1024", PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        out = tmp_path / name
        subprocess.run([sys.executable, "-m", "oomtune", "plan", "target=python", "target.entry=envwl.py:make_workload",
                        "budget=84MiB", "device=cpu", "virtual_device_memory=1GiB", "search.batch_size.low=8",
                        "search.batch_size.high=4096", f"hydra.run.dir={out}"],
                       cwd=tmp_path, env=env, check=True, capture_output=True, timeout=600)
        return yaml.safe_load((out / "plan.yaml").read_text())

    def rows(p: dict) -> dict:
        return {r["alloc_conf"]: r["max_batch_size"] for r in p["configurations"]}

    a = plan("1", "a")
    assert a["timing"]["cached"] == 0 and a["timing"]["captures"] >= 3
    b = plan("4", "b")
    assert b["timing"]["cached"] == 0                      # another value: every capture made again
    # by hand: one 1024 x 1024 layer is 4 MiB of fp32 weights and 4 MiB of gradients; four of them hold
    # 32 MiB of the 64 MiB the budget leaves beside the cuBLAS workspaces' 20 MiB segment where one holds
    # 8 MiB, and each sample's activations pass four layers instead of one: the default allocator's
    # largest batch must be smaller
    assert rows(b)[""] < rows(a)[""]
    again = plan("1", "again")
    assert again["timing"]["cached"] == again["timing"]["captures"] == a["timing"]["captures"]
    assert rows(again) == rows(a)
