"""The virtual GPU holds the cuBLAS workspaces of the CUDA run it stands for.

Since torch 2.1 a cuBLAS workspace is a caching-allocator request: ``getCurrentCUDABlasHandle``
(aten/src/ATen/cuda/CublasHandlePool.cpp) calls ``getNewWorkspace()`` = ``allocate(getChosenWorkspaceSize())``
the first time a (handle, stream) pair is used, one handle per thread, so the thread running the forward
and the autograd engine's device thread (the backward) get one each, kept for the life of the process.
``parseChosenWorkspaceSize``: unset ``CUBLAS_WORKSPACE_CONFIG`` is ``:4096:2:16:8`` = 8 MiB + 128 KiB, and
``4096 * 8`` KiB = 32 MiB on compute capability 9.x; ``:0:0`` asks for 0 bytes, which allocates nothing
(``NativeCachingAllocator::allocate`` mallocs only when ``size != 0``).

Segment sizes (c10/cuda/CUDACachingAllocator.cpp ``get_allocation_size``): a request in (1 MiB, 10 MiB]
gets a kLargeBuffer (20 MiB) segment, one above 10 MiB a segment of its size rounded up to 2 MiB; a free
rest above 1 MiB of a large block is split off (``should_split``) and serves the next request.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from oomtune.alloc.sim import CachingAllocatorSim
from oomtune.capture.virtual_gpu import VirtualGPU

MiB = 1 << 20
A100_WS = 4096 * 1024 * 2 + 16 * 1024 * 8    # 8,519,680 bytes
H100_WS = 4096 * 8 * 1024                    # 33,554,432 bytes


def _step(gpu: str | None):
    """One forward and backward of a 64 x 64 Linear on meta under a virtual GPU with the target GPU's
    workspaces; returns the simulator's memory_stats."""
    sim = CachingAllocatorSim("", total_memory_bytes=80 << 30)
    lin = nn.Linear(64, 64, bias=False, device="meta")
    x = torch.empty(8, 64, device="meta")
    with VirtualGPU(sim, device="meta", gpu=gpu, blas_workspaces="default") as vgpu:
        vgpu.register([lin.weight, x])
        lin(x).sum().backward()
    return sim.memory_stats()


@pytest.fixture(autouse=True)
def _default_config(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)


def test_an_a100_step_holds_two_workspaces_in_one_20_mib_segment():
    # weight 64*64*4 = 16 KiB, x 8*64*4 = 2 KiB, the output, its gradient and the weight's gradient: all
    # small-pool requests (<= 1 MiB) in one 2 MiB segment. The main thread's workspace (registered with what
    # exists) takes a 20 MiB segment; the backward's matmul adds the autograd thread's from its rest.
    st = _step("a100")
    assert st["allocated_bytes.large_pool.peak"] == 2 * A100_WS
    assert st["reserved_bytes.large_pool.peak"] == 20 * MiB
    assert st["reserved_bytes.all.peak"] == 20 * MiB + 2 * MiB
    assert st["num_alloc_retries"] == 0


def test_an_h100_step_holds_two_32_mib_workspaces_each_in_its_own_segment():
    st = _step("h100")   # sm90: 32 MiB each, above 10 MiB: a segment of exactly that size each
    assert st["allocated_bytes.large_pool.peak"] == 2 * H100_WS
    assert st["reserved_bytes.large_pool.peak"] == 2 * 32 * MiB


def test_the_default_target_is_the_a100(monkeypatch):
    assert _step(None)["allocated_bytes.large_pool.peak"] == 2 * A100_WS


def test_workspace_config_sizes_them_and_0_0_leaves_them_out(monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")    # the determinism setting torch documents
    assert _step("a100")["allocated_bytes.large_pool.peak"] == 2 * 4096 * 8 * 1024
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
    st = _step("a100")
    assert st["allocated_bytes.large_pool.peak"] == 0 and st["reserved_bytes.all.peak"] == 2 * MiB


def test_a_cpu_capture_does_not_count_the_workspaces_as_host_memory():
    """A CPU capture stops when the tensors it holds in host memory pass its limit; the workspaces are
    device requests no host tensor holds, so a 1 MiB limit passes a step of a few KiB beside them."""
    from oomtune.capture.blas_workspace import cuda_run_workspaces
    from oomtune.capture.recorder import capture_stream

    lin = nn.Linear(64, 64, bias=False)
    x = torch.randn(8, 64)
    stream = capture_stream(lambda: lin(x).sum().backward(), existing=[lin.weight, x], device="cpu",
                            blas_workspaces=cuda_run_workspaces("a100"), cuda_autocast=False,
                            host_limit_bytes=1 * MiB)
    sizes = [n for a, _, n, _ in stream if a == "alloc"]
    assert sizes.count(A100_WS) == 2


# -- the answer carries the workspaces' size ---------------------------------------------------------------
def _best_yaml(path, **device):
    import yaml

    mlp = {"name": "mlp", "in_features": 64, "hidden": 128, "layers": 1, "num_classes": 10, "optimizer": "sgd",
           "lr": 0.1, "precision": "fp32", "data": {"source": "synthetic"}}
    path.write_text(yaml.safe_dump({
        "schema_version": 1, "workload": {"model": mlp, "target": {"name": "builtin"}},
        "device": {"kind": "cpu", "name": "virtual GPU (CPU)", "total_memory_bytes": 80 << 30,
                   "budget_bytes": 1 << 30, "memory_source": "simulated", **device},
        "best": {"batch_size": 8, "alloc_conf": "", "settings": {},
                 "metrics": {"peak_reserved_bytes": 2 * MiB, "memory_source": "simulated"},
                 "predicted_peak_reserved_bytes": 2 * MiB}}))
    return path


def test_apply_best_and_env_set_the_recorded_workspace_config(tmp_path):
    import oomtune
    from oomtune.best import load_best

    path = _best_yaml(tmp_path / "best.yaml", cublas_workspace_config=":4096:8")
    env: dict[str, str] = {}
    oomtune.apply_best(path, environ=env)
    assert env["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and env["PYTORCH_CUDA_ALLOC_CONF"] == ""
    assert load_best(path).export_line(fraction_key=False).endswith(" CUBLAS_WORKSPACE_CONFIG=:4096:8")


def test_apply_best_warns_when_the_environment_sizes_workspaces_the_answer_was_not_tuned_with(tmp_path):
    import oomtune

    path = _best_yaml(tmp_path / "best.yaml")   # tuned with torch's default workspaces
    with pytest.warns(UserWarning, match="CUBLAS_WORKSPACE_CONFIG=:4096:8 is set, but this answer was tuned"):
        oomtune.apply_best(path, environ={"CUBLAS_WORKSPACE_CONFIG": ":4096:8"})


def test_a_workspace_config_that_is_not_a_string_is_one_line_exit_2(tmp_path, capsys):
    from oomtune.cli import main

    path = _best_yaml(tmp_path / "best.yaml", cublas_workspace_config=4096)
    assert main(["env", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "device.cublas_workspace_config must be a CUBLAS_WORKSPACE_CONFIG string" in err[0]


def test_check_predicts_under_the_recorded_workspace_config(tmp_path, capsys):
    """The tiny MLP's tensors all fit one 2 MiB small-pool segment (kSmallBuffer); under the recorded
    ``:0:0`` there are no workspaces, so the check predicts the recorded 2 MiB though this process has
    torch's default (which would add a 20 MiB segment)."""
    from oomtune.cli import main

    import os

    path = _best_yaml(tmp_path / "best.yaml", cublas_workspace_config=":0:0")
    assert main(["check", str(path), "--mode", "predict"]) == 0
    assert "predicted peak reserved 2.00 MiB (simulated) vs recorded 2.00 MiB" in capsys.readouterr().out
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ   # the caller's environment as it was
