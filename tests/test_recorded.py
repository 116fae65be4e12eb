"""Allocator tuning for users' own commands: the trial's recorded allocation stream and the
predictions made from recordings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from oomtune.alloc.geometry import budget_geometry
from oomtune.alloc.settings import AllocatorSettings
from oomtune.alloc.stream import AllocationStream, replay_stream
from oomtune.plan.recorded import NoPrediction, RecordedPredictor, load_recording

from shared_runs import TRAIN_CMD_COMMON, train_cmd_search  # noqa: F401  (a session's shared search)

REPO = Path(__file__).resolve().parents[1]
GEOMETRY = budget_geometry(64 << 20, 80 << 30)


def affine_stream(b: int, *, extra_small_batch_op: bool = False) -> AllocationStream:
    """A step's stream whose sizes are affine in the batch ``b`` (hand-made): weights 4096 B,
    activations 1024 b + 512 B and 2048 b B, a gradient 4096 B, a temporary 64 b B."""
    events = [("alloc", 1, 4096), ("alloc", 2, 1024 * b + 512), ("alloc", 3, 2048 * b), ("free", 2),
              ("alloc", 4, 4096), ("alloc", 5, 64 * b), ("free", 5), ("free", 3), ("free", 4)]
    if extra_small_batch_op:   # a batch of 1 running one more op (a squeeze, a broadcast)
        events.insert(1, ("alloc", 9, 8))
        events.insert(2, ("free", 9))
    return AllocationStream([(a, k, *(s or ())) for a, k, *s in events])


def test_streams_of_other_batch_sizes_are_derived_and_extrapolated_exactly():
    p = RecordedPredictor({b: affine_stream(b) for b in (2, 4, 8)}, GEOMETRY)
    assert p.usable and p.can_predict(6) and p.can_predict(1000)
    assert p.stream(6) == affine_stream(6)          # between the recordings
    assert p.stream(1000) == affine_stream(1000)    # above them (the frontier is usually far above)
    assert not p.can_predict(1)                     # below them: not derived
    with pytest.raises(NoPrediction):
        p.stream(1)


def test_a_smaller_batch_that_runs_other_code_is_left_out_of_the_fit():
    recs = {1: affine_stream(1, extra_small_batch_op=True), 2: affine_stream(2), 4: affine_stream(4)}
    p = RecordedPredictor(recs, GEOMETRY)
    assert not p.usable and "fewer than 3 recordings of one structure" in p.derivation_note
    p = RecordedPredictor({**recs, 8: affine_stream(8)}, GEOMETRY)
    assert p.usable and p.stream(16) == affine_stream(16)
    assert p.stream(1) == recs[1]                   # its own recording still answers for it


def test_a_later_recording_verifies_the_derived_stream_or_stops_the_predictions():
    p = RecordedPredictor({b: affine_stream(b) for b in (2, 4, 8)}, GEOMETRY)
    assert p.add_recording(64, affine_stream(64)) and p.verified == [64] and p.usable
    other = affine_stream(128)
    other.sizes[2] += 512                            # one request differs from the derived one
    assert not p.add_recording(128, other)
    assert p.mismatch == 128 and not p.usable and "differs from the one derived" in p.derivation_note
    assert p.stream(128) == other                    # the recording itself is kept


def test_covers_limits_the_batch_sizes_the_recordings_stand_for():
    p = RecordedPredictor({b: affine_stream(b) for b in (2, 4, 8)}, GEOMETRY, covers=lambda b: b < 32)
    assert p.can_predict(16) and not p.can_predict(32)
    assert p.predict_raw(32, "") is None


# -- the capture hook writes the stream it fed the virtual GPU --------------------------------------------
@pytest.fixture
def channel(tmp_path, monkeypatch):
    monkeypatch.setenv("OOMTUNE_RESULT_FILE", str(tmp_path / "results.jsonl"))
    monkeypatch.setenv("OOMTUNE_STREAM_FILE", str(tmp_path / "stream.bin"))
    monkeypatch.setenv("OOMTUNE_BUDGET_BYTES", str(64 << 20))
    monkeypatch.setenv("OOMTUNE_DEVICE_MEMORY_BYTES", str(80 << 30))
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    return tmp_path


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, batch: int) -> None:
    for _ in range(steps):
        x = torch.randn(batch, 32)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_the_recorded_stream_replays_to_the_virtual_gpus_own_peaks(channel):
    import oomtune

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 8))
    opt = torch.optim.Adam(model.parameters())
    hook = oomtune.capture_hook(model, opt)
    _train(model, opt, 3, 64)
    hook.stop()
    stream, meta = load_recording(channel / "stream.bin")
    assert meta["source"] == "capture_hook (cpu)" and meta["events"] == len(stream) > 0
    live = hook.sim.memory_stats()
    again = replay_stream(stream, AllocatorSettings.parse(""), total_memory_bytes=80 << 30,
                          memory_fraction=(64 << 20) / (80 << 30))
    assert again.peak_reserved_bytes == live["reserved_bytes.all.peak"]
    assert again.peak_allocated_bytes == live["allocated_bytes.all.peak"]


def test_no_stream_is_written_after_a_simulated_out_of_memory(channel, monkeypatch):
    import oomtune

    # 24 MiB: the Linear's 2 MiB small-pool segment and the cuBLAS workspace's 20 MiB one (8.125 MiB used)
    # fit; a 12 MiB request fits neither the workspace segment's 11.875 MiB rest nor a segment of its own
    monkeypatch.setenv("OOMTUNE_BUDGET_BYTES", str(24 << 20))
    model = nn.Linear(32, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hook = oomtune.capture_hook(model, opt)
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(12 << 20, dtype=torch.uint8)
    hook.stop()
    assert not (channel / "stream.bin").exists()


# -- on CUDA: the allocator's own memory history as the stream -------------------------------------------
DATA = REPO / "tests" / "data"


@pytest.mark.parametrize("name, device", [("cnn-small-default", 0), ("lm-ctx128-fullstep", 0),
                                          ("gnn-dataparallel-expandable-oom", 0)])
def test_a_real_gpus_memory_history_replays_to_its_recorded_peak_reserved(name, device):
    # Real GPU recordings whose history starts with nothing cached beyond live blocks (as a trial's does,
    # from capture_hook on): the stream of their requests, replayed under the recorded settings, reserves
    # what the device reserved (expected: the trace's own segment events, summed).
    from oomtune.trace.initial_state import device_trace, rebuild_initial_state
    from oomtune.trace.recorded import recorded_settings
    from oomtune.trace.releases import recorded_reserved_walk
    from oomtune.trace.snapshot import load_snapshot
    from oomtune.trace.to_stream import stream_from_snapshot

    snap = load_snapshot(DATA / f"{name}.pickle")
    trace, _ = device_trace(snap, device)
    _, recorded_peak = recorded_reserved_walk(trace, rebuild_initial_state(snap, device).reserved_bytes)
    stream = stream_from_snapshot(snap, device)
    assert stream.n_allocs == sum(e["action"] == "alloc" for e in trace) + sum(
        len(s.live_blocks) for s in rebuild_initial_state(snap, device).segments)
    got = replay_stream(stream, recorded_settings(snap)[0], total_memory_bytes=1 << 40)
    assert not got.oom and got.peak_reserved_bytes == recorded_peak


class _FakeHistory:
    """torch.cuda.memory's history API, answering with a recorded snapshot (no GPU here)."""

    def __init__(self, snapshot):
        self.snapshot, self.calls = snapshot, []

    def record(self, enabled="all", **kw):
        self.calls.append(enabled)

    def take(self):
        return self.snapshot


@pytest.fixture
def fake_cuda(tmp_path, monkeypatch):
    from oomtune.trace.snapshot import load_snapshot

    monkeypatch.setenv("OOMTUNE_RESULT_FILE", str(tmp_path / "results.jsonl"))
    monkeypatch.setenv("OOMTUNE_STREAM_FILE", str(tmp_path / "stream.bin"))
    monkeypatch.delenv("OOMTUNE_BUDGET_BYTES", raising=False)
    fake = _FakeHistory(load_snapshot(DATA / "cnn-small-default.pickle"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", fake.record)
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", fake.take)
    return fake


def test_on_cuda_the_hook_writes_the_allocators_history_as_the_stream(fake_cuda, tmp_path):
    import oomtune
    from oomtune.trace.to_stream import stream_from_snapshot

    hook = oomtune.capture_hook()
    assert not hook.active and "CUDA is available" in hook.reason
    hook.stop()
    assert fake_cuda.calls == ["all", None]          # recorded from the hook on, then stopped
    stream, meta = load_recording(tmp_path / "stream.bin")
    assert meta["source"] == "torch.cuda.memory history (cuda)"
    assert stream == stream_from_snapshot(fake_cuda.snapshot, 0)
    hook.stop()                                      # idempotent
    assert fake_cuda.calls == ["all", None]


def test_on_cuda_no_stream_is_written_after_an_out_of_memory(fake_cuda, tmp_path):
    import oomtune

    fake_cuda.snapshot = {**fake_cuda.snapshot, "device_traces": [
        fake_cuda.snapshot["device_traces"][0] + [{"action": "oom", "addr": 0, "size": 1 << 40, "stream": 0}]]}
    hook = oomtune.capture_hook()
    hook.stop()
    assert fake_cuda.calls == ["all", None] and not (tmp_path / "stream.bin").exists()


_CUDA_SCRIPT = """
import json, sys, torch
from torch import nn
import oomtune
model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 10)).cuda()
opt = torch.optim.Adam(model.parameters())
torch.cuda.reset_peak_memory_stats()
hook = oomtune.capture_hook(model, opt)
for _ in range(3):
    model(torch.randn(256, 1024, device="cuda")).sum().backward()
    opt.step(); opt.zero_grad(set_to_none=True)
torch.cuda.synchronize()
hook.stop()
print(json.dumps({"peak_reserved": torch.cuda.max_memory_reserved()}))
"""


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_trials_recorded_stream_replays_to_the_devices_peak(tmp_path):
    # a fresh process on the device: the stream written from the allocator's history, replayed under the
    # default settings, reserves what the device's caching allocator reserved
    env = {**os.environ, "OOMTUNE_RESULT_FILE": str(tmp_path / "r.jsonl"), "OOMTUNE_STREAM_FILE": str(tmp_path / "s.bin"),
           "PYTHONPATH": str(REPO)}
    env.pop("OOMTUNE_BUDGET_BYTES", None)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    out = subprocess.run([sys.executable, "-c", _CUDA_SCRIPT], env=env, capture_output=True, text=True, check=True,
                         timeout=300)
    peak = json.loads(out.stdout.strip().splitlines()[-1])["peak_reserved"]
    stream, meta = load_recording(tmp_path / "s.bin")
    assert meta["source"] == "torch.cuda.memory history (cuda)"
    total = torch.cuda.get_device_properties(0).total_memory
    assert replay_stream(stream, AllocatorSettings.parse(""), total_memory_bytes=total).peak_reserved_bytes == peak


# -- end to end: examples/train_cmd.py ------------------------------------------------------------------
def _record_example(tmp_path: Path, batch: int) -> AllocationStream:
    env = {**os.environ, "OOMTUNE_RESULT_FILE": str(tmp_path / f"r{batch}.jsonl"),
           "OOMTUNE_STREAM_FILE": str(tmp_path / f"s{batch}.bin"), "PYTHONPATH": str(REPO),
           "OMP_NUM_THREADS": "1"}   # one small process: no OpenMP threads spinning on shared cores
    subprocess.run([sys.executable, "examples/train_cmd.py", "--hidden", "1024", "--batch-size", str(batch)],
                   cwd=REPO, env=env, check=True, capture_output=True, timeout=300)
    return load_recording(tmp_path / f"s{batch}.bin")[0]


@pytest.mark.slow
def test_the_example_scripts_recordings_derive_its_stream_at_any_batch(tmp_path, train_cmd_search):
    # the recordings at batch 4, 8 and 16 are the first trials of tests/shared_runs.py's search of the same
    # command (each trial's stream.bin is what the script writes under OOMTUNE_STREAM_FILE, as in
    # _record_example); the stream derived for 1000 is compared with a run of the script by hand
    code, run = train_cmd_search
    assert code == 0
    first = {}
    for row in sorted(json.loads((run / "trials.json").read_text()), key=lambda r: r["number"]):
        first.setdefault(row["batch_size"], row["number"])
    recs = {b: load_recording(run / "trials" / f"trial-{first[b]:04d}" / "stream.bin")[0] for b in (4, 8, 16)}
    p = RecordedPredictor(recs, GEOMETRY)
    assert p.usable
    assert p.stream(1000) == _record_example(tmp_path, 1000)


@pytest.mark.slow
def test_cmd_search_predicts_and_probes_the_allocator_and_agrees_with_plan(tmp_path, monkeypatch, train_cmd_search):
    # examples/train_cmd.py (hidden 1024) on the virtual GPU at 64 MiB, and the same model, optimizer and
    # step written as a python entry (tests/data/train_cmd_entry.py) planned on meta: the search's answer
    # (recorded streams, derived, replayed under every configuration, then probed) is the configuration
    # and batch that plan predicts for the entry. The search is tests/shared_runs.py's, shared with
    # tests/test_check_recorded.py (which replays its best.yaml's predicted stream).
    from oomtune.cli import main

    monkeypatch.chdir(REPO)
    common = TRAIN_CMD_COMMON
    code, run = train_cmd_search
    assert code == 0
    import oomtune
    import yaml

    best = oomtune.load_best(run / "best.yaml")
    rows = sorted(json.loads((run / "trials.json").read_text()), key=lambda r: r["number"])
    assert [r["batch_size"] for r in rows[:3]] == [4, 8, 16]   # the three recordings came first
    assert all((run / "trials" / f"trial-{n:04d}" / "stream.bin").is_file() for n in range(3))
    # the report's frontier and the winner's step come from the recordings too
    assert (run / "frontier.yaml").is_file() and (run / "winner_step.pickle").is_file()
    probed = {f["alloc_conf"] for f in best.frontiers if f["probed"]}
    assert len(probed) >= 2                                  # not only the default allocator
    assert all(f["predicted_max_batch"] is not None for f in best.frontiers)   # every configuration predicted

    plan_dir = tmp_path / "plan"
    assert main(["plan", "target=python", "target.entry=tests/data/train_cmd_entry.py:make_workload", *common,
                 f"hydra.run.dir={plan_dir}"]) == 0
    plan = yaml.safe_load((plan_dir / "plan.yaml").read_text())
    top = max(r["max_batch_size"] or 0 for r in plan["configurations"])
    winners = {r["alloc_conf"] for r in plan["configurations"] if r["max_batch_size"] == top}
    assert best.batch_size == top and best.alloc_conf in winners
    by_conf = {r["alloc_conf"]: r["max_batch_size"] for r in plan["configurations"]}
    for f in best.frontiers:                                 # every predicted frontier is plan's
        assert f["predicted_max_batch"] == by_conf[f["alloc_conf"]]
