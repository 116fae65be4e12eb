"""oomtune.report() / oomtune.capture_hook(): the results channel of target=cmd scripts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import oomtune
from oomtune.exceptions import ConfigError
from oomtune.script_api import BUDGET_ENV, RESULT_FILE_ENV, capture_hook, launched, report

SIMULATED_PREFIX = "[virtual GPU, simulated] "


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def channel(tmp_path, monkeypatch):
    path = tmp_path / "results.jsonl"
    monkeypatch.setenv(RESULT_FILE_ENV, str(path))
    monkeypatch.delenv(BUDGET_ENV, raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)   # torch's default workspace size
    monkeypatch.delenv("OOMTUNE_GPU", raising=False)               # the default target GPU, an A100
    return path


# One cuBLAS workspace of the default target GPU (an A100, sm80): torch's default CUBLAS_WORKSPACE_CONFIG
# ":4096:2:16:8" (CublasHandlePool.cpp, parseChosenWorkspaceSize) = 4096 KiB x 2 + 16 KiB x 8. The hook's
# virtual GPU holds the main thread's from the start, as the CUDA run holds it from its first matmul on;
# a request in (1 MiB, 10 MiB] gets a kLargeBuffer (20 MiB) segment of its own.
WORKSPACE = 4096 * 1024 * 2 + 16 * 1024 * 8


def test_report_is_a_noop_without_oomtune_and_never_imports_torch(tmp_path):
    code = ("import sys, oomtune\n"
            "r = oomtune.report(samples=10, seconds=1.0)\n"
            "h = oomtune.capture_hook()\n"
            "print(r is None, h.active, 'torch' in sys.modules)\n")
    env = {k: v for k, v in __import__("os").environ.items() if k != RESULT_FILE_ENV}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True,
                         text=True, timeout=60, check=True).stdout.split()
    assert out == ["True", "False", "False"]
    assert list(tmp_path.iterdir()) == []


def test_report_appends_one_line_per_call(channel):
    assert launched()
    report(samples=64, seconds=2.0, steps=4, data_wait_seconds=0.5, note="a")
    oomtune.report(samples=32, seconds=1.0)
    first, second = _lines(channel)
    assert first["event"] == "report"
    assert (first["samples"], first["seconds"], first["steps"], first["data_wait_seconds"]) == (64, 2.0, 4, 0.5)
    assert first["extra"] == {"note": "a"}
    assert (second["samples"], second["seconds"], second["steps"]) == (32, 1.0, None)


@pytest.mark.parametrize("kw", [dict(samples=10, seconds=0), dict(samples=-1, seconds=1.0),
                                dict(samples=10, seconds=float("nan")), dict(samples="10", seconds=1.0)])
def test_report_rejects_bad_figures_under_oomtune(channel, kw):
    with pytest.raises(ConfigError, match="oomtune.report"):
        report(**kw)
    assert not channel.exists()


def test_capture_hook_reports_simulated_peaks(channel, monkeypatch):
    monkeypatch.setenv(BUDGET_ENV, str(64 << 20))
    lin = nn.Linear(256, 256)
    with capture_hook(model=lin) as hook:
        assert hook.active
        # weight 256*256*4 = 262144 B and bias 256*4 = 1024 B, both multiples of the 512 B rounding.
        report(samples=1, seconds=1.0)
    line, final = _lines(channel)
    assert line["memory"]["source"] == "simulated"
    assert line["memory"]["stats"]["allocated_bytes.all.peak"] == 262144 + 1024 + WORKSPACE
    # Both fit one 2 MiB small-pool segment (requests <= 1 MiB; kSmallBuffer), the workspace a 20 MiB one.
    assert line["memory"]["stats"]["reserved_bytes.all.peak"] == (2 << 20) + (20 << 20)
    assert final["event"] == "memory" and not hook.active


def test_capture_hook_raises_simulated_oom_inside_the_step_and_records_it(channel, monkeypatch):
    monkeypatch.setenv(BUDGET_ENV, str(24 << 20))   # the Linear's 2 MiB segment and the workspace's 20 MiB fit
    lin = nn.Linear(256, 256)
    with capture_hook(model=lin):
        kept = torch.empty(3 << 20, dtype=torch.uint8)   # 3 MiB: split from the workspace segment's 11.875 MiB rest
        with pytest.raises(torch.OutOfMemoryError) as info:
            torch.empty(9 << 20, dtype=torch.uint8)   # 8.875 MiB left there: needs a 20 MiB segment, 22 + 20 > 24
        del kept
    assert str(info.value).startswith(SIMULATED_PREFIX)
    oom = [e for e in _lines(channel) if e["event"] == "oom"]
    assert len(oom) == 1
    assert oom[0]["message"].startswith(SIMULATED_PREFIX)
    # Requests in (1 MiB, 10 MiB) get a kLargeBuffer (20 MiB) segment: the size the OOM reports.
    assert oom[0]["requested_bytes"] == 20 << 20


def test_a_hook_whose_own_tensors_do_not_fit_raises_and_leaves_nothing_active(channel, monkeypatch):
    """The model alone exceeds the budget: ``capture_hook`` raises the simulated OOM (an ``oom`` line
    written) and is stopped before the error leaves it, since the caller never receives the hook to stop:
    a process that catches the error allocates CPU memory as before (no virtual GPU left in the dispatch
    stack) and may start a hook again."""
    from oomtune import script_api

    monkeypatch.setenv(BUDGET_ENV, str(24 << 20))
    big = nn.Linear(2048, 4096, bias=False)   # 2048 x 4096 float32 = 32 MiB: above the 24 MiB budget alone
    with pytest.raises(torch.OutOfMemoryError):
        capture_hook(model=big)
    assert script_api._ACTIVE == []
    events = [e["event"] for e in _lines(channel)]
    assert events == ["oom", "memory"]
    torch.empty(64 << 20, dtype=torch.uint8)   # 64 MiB of CPU memory: no simulated OOM once the hook is gone
    with capture_hook() as hook:               # not "already active"
        assert hook.active


def test_capture_hook_uses_the_allocator_settings_from_the_environment(channel, monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.setenv(BUDGET_ENV, str(64 << 20))
    with capture_hook() as hook:
        assert hook.sim.settings.expandable_segments is True


def test_capture_hook_refuses_a_second_active_hook(channel):
    with capture_hook():
        with pytest.raises(RuntimeError, match="already active"):
            capture_hook()


def test_a_forked_child_never_feeds_the_simulator(channel, monkeypatch):
    from oomtune import script_api

    monkeypatch.setenv(BUDGET_ENV, str(24 << 20))
    with capture_hook() as hook:
        recording_sim = hook._vgpu.sim
        real_pid = os.getpid()
        monkeypatch.setattr(script_api.os, "getpid", lambda: real_pid + 1)   # as in a DataLoader worker
        addr = recording_sim.malloc(64 << 20)    # 64 MiB would not fit the 24 MiB device
        recording_sim.free(addr)
        monkeypatch.setattr(script_api.os, "getpid", lambda: real_pid)
        assert addr < 0 and hook.sim.memory_stats()["allocated_bytes.all.peak"] == WORKSPACE   # the workspace only
    assert [e["event"] for e in _lines(channel)] == ["memory"]
