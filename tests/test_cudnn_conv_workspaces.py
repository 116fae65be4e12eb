"""cuDNN convolution workspaces: which requests torch's cuDNN path makes, in what order, and how the
virtual GPU decides them (oomtune/capture/cudnn_conv.py, the try/probe/empty_cache events of
oomtune/alloc/stream.py).

Sources of the expected values:
* the pattern: aten/src/ATen/native/cudnn/Conv_v8.cpp (run_single_conv, try_configs, try_plans,
  run_conv_plan, generate_and_filter_plans: the cacheInfo bound and the halving of
  max_workspace_size), cudnn/ConvShared.cpp (cudnn_convolution_backward: backward-data then
  backward-weight; cudnn_convolution_transpose: backward-data as its forward),
  Convolution.cpp (_select_conv_backend / use_cudnn_depthwise; conv_benchmark_empty_cache = true),
  c10/cuda/CUDACachingAllocator.cpp (cacheInfo: cudaMemGetInfo's free memory, raised to the
  largest cached free block);
* the "gemm" rule's size: the lowered matrix of Chetlur et al. 2014 (arXiv:1410.0759, section 3.1):
  (C/groups * R * S) x (N * P * Q) elements of the input's element size; the "implicit" rule:
  0 bytes (cuDNN API reference, CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM needs no workspace).
"""

from __future__ import annotations

import pytest
import torch

from oomtune.alloc.stream import AllocationStream, replay_stream
from oomtune.capture import cudnn_conv
from oomtune.capture.cudnn_conv import (BACKWARD_DATA, BACKWARD_WEIGHT, FORWARD, conditional_requests,
                                        cudnn_operations)

MiB = 1 << 20
aten = torch.ops.aten


@pytest.fixture
def gemm(monkeypatch):
    monkeypatch.setenv(cudnn_conv.ENV, "gemm")
    cudnn_conv.reset()
    yield
    cudnn_conv.reset()


def meta(*shape, **kw):
    return torch.empty(*shape, device="meta", **kw)


def fwd(x, w, stride=1, padding=0, dilation=1, transposed=False, groups=1, out_pad=0):
    d = x.dim() - 2
    return (aten.convolution.default,
            (x, w, None, [stride] * d, [padding] * d, [dilation] * d, transposed, [out_pad] * d, groups))


def bwd(grad, x, w, stride=1, padding=0, transposed=False, groups=1, mask=(True, True, False)):
    d = x.dim() - 2
    return (aten.convolution_backward.default,
            (grad, x, w, None, [stride] * d, [padding] * d, [1] * d, transposed, [0] * d, groups, list(mask)))


def test_forward_tries_the_lowered_matrix_then_the_implicit_gemm_engine(gemm):
    # Conv2d(16 -> 32, 3x3, padding 1) on 8 x 16 x 20 x 20 fp32: P = Q = 20.
    # lowered matrix: (16 * 3 * 3) x (8 * 20 * 20) = 144 x 3200 = 460,800 elements x 4 bytes
    func, args = fwd(meta(8, 16, 20, 20), meta(32, 16, 3, 3), padding=1)
    assert cudnn_operations(func, args)[0][0] == FORWARD
    assert conditional_requests(func, args, "sm80") == [("try", [1_843_200, 0])]


def test_backward_runs_backward_data_then_backward_weight(gemm):
    # cudnn_convolution_backward: grad_input (backward-data) first, then grad_weight.
    # Conv2d(16 -> 32, 3x3, stride 2, padding 1) on 4 x 16 x 15 x 15 fp32: P = Q = (15 + 2 - 3) // 2 + 1 = 8
    # lowered matrix: (16 * 9) x (4 * 8 * 8) = 144 x 256 = 36,864 elements x 4 = 147,456 bytes, each call
    func, args = bwd(meta(4, 32, 8, 8), meta(4, 16, 15, 15), meta(32, 16, 3, 3), stride=2, padding=1)
    assert [op for op, _ in cudnn_operations(func, args)] == [BACKWARD_DATA, BACKWARD_WEIGHT]
    assert conditional_requests(func, args, "sm80") == [("try", [147_456, 0]), ("try", [147_456, 0])]
    # no grad_input asked (the first layer's input): backward-weight only
    func, args = bwd(meta(4, 32, 8, 8), meta(4, 16, 15, 15), meta(32, 16, 3, 3), stride=2, padding=1,
                     mask=(False, True, True))
    assert [op for op, _ in cudnn_operations(func, args)] == [BACKWARD_WEIGHT]


def test_grouped_convolution_lowers_one_group(gemm):
    # groups = 4: C / groups = 64 / 4 = 16 input channels per group.
    # Conv2d(64 -> 64, 3x3, padding 1, groups 4) on 2 x 64 x 10 x 10 fp16 (2 bytes):
    # (16 * 9) x (2 * 10 * 10) = 144 x 200 = 28,800 elements x 2 = 57,600 bytes
    func, args = fwd(meta(2, 64, 10, 10, dtype=torch.float16), meta(64, 16, 3, 3, dtype=torch.float16),
                     padding=1, groups=4)
    assert conditional_requests(func, args, "sm80") == [("try", [57_600, 0])]


def test_depthwise_runs_the_native_kernel_unless_channels_last(gemm):
    # Convolution.cpp: a contiguous depthwise convolution (C_in == groups > 1) runs CudaDepthwise2d,
    # no cuDNN, no workspace; channels_last: "always use cudnn_depthwise for channels_last format".
    x, w = meta(2, 32, 12, 12), meta(32, 1, 3, 3)
    func, args = fwd(x, w, padding=1, groups=32)
    assert conditional_requests(func, args, "sm80") == []
    x_cl = x.contiguous(memory_format=torch.channels_last)
    func, args = fwd(x_cl, w, padding=1, groups=32)
    # (32 / 32 * 9) x (2 * 12 * 12) = 9 x 288 = 2,592 elements x 4 = 10,368 bytes
    assert conditional_requests(func, args, "sm80") == [("try", [10_368, 0])]


def test_channels_last_is_another_plan_with_the_same_lowered_matrix(gemm):
    # CacheKeyWrapper holds the memory format: another key (cached separately), same GEMM matrix.
    x, w = meta(4, 8, 6, 6), meta(16, 8, 3, 3)
    (_, plain), = cudnn_operations(*fwd(x, w, padding=1))
    (_, cl), = cudnn_operations(*fwd(x.contiguous(memory_format=torch.channels_last), w, padding=1))
    assert plain != cl and cl[-1] is True and plain[-1] is False
    # (8 * 9) x (4 * 36) = 72 x 144 = 10,368 elements x 4 = 41,472 bytes
    assert cudnn_conv.gemm_workspace_bytes(plain) == cudnn_conv.gemm_workspace_bytes(cl) == 41_472


def test_transposed_convolution_runs_backward_data_forward(gemm):
    # ConvTranspose2d(8 -> 4, 3x3) on 2 x 8 x 5 x 5: output 2 x 4 x 7 x 7. cuDNN computes the
    # convolution it transposes: input 2 x 4 x 7 x 7 (C = weight.shape[1] = 4), output 5 x 5.
    # ConvShared.cpp: its forward is raw_cudnn_convolution_backward_input_out; its backward's
    # grad_input a forward, grad_weight a backward-weight.
    # lowered matrix: (4 * 9) x (2 * 5 * 5) = 36 x 50 = 1,800 elements x 4 = 7,200 bytes
    x, w = meta(2, 8, 5, 5), meta(8, 4, 3, 3)
    func, args = fwd(x, w, transposed=True)
    assert [op for op, _ in cudnn_operations(func, args)] == [BACKWARD_DATA]
    assert conditional_requests(func, args, "sm80") == [("try", [7_200, 0])]
    func, args = bwd(meta(2, 4, 7, 7), x, w, transposed=True)
    assert [op for op, _ in cudnn_operations(func, args)] == [FORWARD, BACKWARD_WEIGHT]


def test_conv1d_and_conv3d(gemm):
    # Conv1d(6 -> 4, k 5) on 3 x 6 x 20: L_out = 16; (6 * 5) x (3 * 16) = 30 x 48 = 1,440 x 4 = 5,760
    assert conditional_requests(*fwd(meta(3, 6, 20), meta(4, 6, 5)), "sm80") == [("try", [5_760, 0])]
    # Conv3d(2 -> 4, 3x3x3, padding 1) on 1 x 2 x 4 x 4 x 4: (2 * 27) x (1 * 64) = 3,456 x 4 = 13,824
    assert conditional_requests(*fwd(meta(1, 2, 4, 4, 4), meta(4, 2, 3, 3, 3), padding=1), "sm80") \
        == [("try", [13_824, 0])]


def test_the_default_rule_requests_nothing(monkeypatch):
    # every architecture's rule is the lower bound (0 bytes): torch never asks the allocator for 0
    monkeypatch.delenv(cudnn_conv.ENV, raising=False)
    assert cudnn_conv.rule_for("sm80") == "implicit"
    assert conditional_requests(*fwd(meta(8, 16, 20, 20), meta(32, 16, 3, 3), padding=1), "sm80") == []
    monkeypatch.setenv(cudnn_conv.ENV, "winograd")
    with pytest.raises(ValueError, match="OOMTUNE_CUDNN_WORKSPACE='winograd': expected one of implicit, gemm"):
        cudnn_conv.rule_for("sm80")


def test_benchmark_probes_once_per_plan_key_then_empties_the_cache(gemm, monkeypatch):
    # run_single_conv with benchmark True: first call per key get_plans_from_find (probe), emptyCache
    # (conv_benchmark_empty_cache defaults to true), try_plans; the next call runs the cached plan.
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    func, args = fwd(meta(8, 16, 20, 20), meta(32, 16, 3, 3), padding=1)
    assert conditional_requests(func, args, "sm80") == [("probe", [1_843_200, 0]), ("empty_cache", []),
                                                        ("try", [1_843_200, 0])]
    assert conditional_requests(func, args, "sm80") == [("try", [1_843_200, 0])]


def test_a_refused_workspace_falls_back_without_an_oom():
    # try_configs catches the OutOfMemoryError of a plan's workspace and runs the next plan: a 64 MiB
    # workspace on a 32 MiB device is refused (one simulated OOM counted), the 0-byte plan runs.
    s = AllocationStream()
    s.append_alloc(1, 4 * MiB)
    s.append_try(2, [64 * MiB, 0])
    s.append_free(2)
    s.append_free(1)
    r = replay_stream(s, total_memory_bytes=32 * MiB)
    assert not r.oom and r.num_ooms == 1
    assert r.peak_allocated_bytes == 4 * MiB
    # with room, the first plan's workspace is granted (64 MiB: a multiple of 2 MiB, its own segment)
    r = replay_stream(s, total_memory_bytes=128 * MiB)
    assert r.num_ooms == 0 and r.peak_allocated_bytes == 68 * MiB


def test_probe_is_bounded_by_free_device_memory():
    # generate_and_filter_plans keeps plans with workspace <= cacheInfo; cacheInfo starts from
    # cudaMemGetInfo's free memory: 64 MiB device, 20 MiB allocated -> 44 MiB free; of [60, 10] MiB
    # only 10 MiB is kept and allocated.
    s = AllocationStream()
    s.append_alloc(1, 20 * MiB)
    s.append_probe(2, [60 * MiB, 10 * MiB])
    s.append_free(2)
    r = replay_stream(s, total_memory_bytes=64 * MiB)
    assert r.num_ooms == 0 and r.peak_allocated_bytes == 30 * MiB


def test_probe_bound_is_raised_by_the_largest_cached_block():
    # cacheInfo raises its bound to the largest free cached block: a 50 MiB block freed into the
    # cache on a 64 MiB device leaves 14 MiB free on the device, but cacheInfo says 50 MiB, so of
    # [60, 48] MiB the 48 MiB plan is kept and reuses the cached segment (reserved stays 50 MiB).
    s = AllocationStream()
    s.append_alloc(1, 50 * MiB)
    s.append_free(1)
    s.append_probe(2, [60 * MiB, 48 * MiB])
    s.append_free(2)
    r = replay_stream(s, total_memory_bytes=64 * MiB)
    assert r.num_ooms == 0
    assert r.peak_allocated_bytes == 50 * MiB and r.peak_reserved_bytes == 50 * MiB
    assert r.memory_stats["allocated_bytes.all.allocated"] == 50 * MiB + 48 * MiB


def test_probe_halves_after_each_refusal():
    # max_workspace_size /= 2 on each OutOfMemoryError. cudaMemGetInfo does not know the per-process
    # fraction: a 100 MiB device at fraction 0.25 (25 MiB allowed) reports 100 MiB free, so the
    # 80 MiB plan is kept; 80 MiB is refused, 40 MiB refused, 20 MiB granted: two OOMs counted.
    s = AllocationStream()
    s.append_probe(1, [80 * MiB, 0])
    s.append_free(1)
    r = replay_stream(s, total_memory_bytes=100 * MiB, memory_fraction=0.25)
    assert not r.oom and r.num_ooms == 2
    assert r.peak_allocated_bytes == 20 * MiB


def test_empty_cache_event_releases_cached_segments():
    s = AllocationStream()
    s.append_alloc(1, 30 * MiB)
    s.append_free(1)
    s.append_empty_cache()
    s.append_alloc(2, 4 * MiB)
    r = replay_stream(s, total_memory_bytes=64 * MiB)
    # the 30 MiB segment went back: the 4 MiB request gets a new 20 MiB segment (kLargeBuffer, for
    # requests between 1 and 10 MiB) instead of a split of the cached 30 MiB one
    assert r.memory_stats["reserved_bytes.all.current"] == 20 * MiB


@pytest.mark.parametrize("suffix", [".jsonl", ".stream"])
def test_conditional_events_survive_save_and_load(tmp_path, suffix):
    s = AllocationStream()
    s.append_try(1, [8 * MiB, 0])
    s.append_free(1)
    s.append_empty_cache()
    s.append_probe(2, [6 * MiB, 2 * MiB])
    s.append_free(2)
    s.save(tmp_path / f"s{suffix}")
    back = AllocationStream.load(tmp_path / f"s{suffix}")
    assert back == s and back.conditional
    assert list(back.grouped()) == [("try", 1, [8 * MiB, 0], 0), ("free", 1, [8 * MiB], 0),
                                    ("empty_cache", 0, [0], 0), ("probe", 2, [6 * MiB, 2 * MiB], 0),
                                    ("free", 2, [6 * MiB], 0)]


def test_a_capture_records_the_workspace_after_the_output(gemm):
    # the output is allocated before the workspace (ConvShared.cpp allocates the output, then
    # run_conv_plan the workspace, freed before the call returns)
    from oomtune.capture.recorder import capture_stream

    conv = torch.nn.Conv2d(4, 8, 3, padding=1, device="meta")
    x = meta(2, 4, 5, 5)
    s = capture_stream(lambda: conv(x), existing=list(conv.parameters()), device="meta")
    events = [(a, size) for a, _, size, _ in s]
    # output 2 x 8 x 5 x 5 fp32 = 1,600 bytes; workspace (4 * 9) x (2 * 25) = 1,800 x 4 = 7,200 bytes
    assert events[2:6] == [("alloc", 1_600), ("try", 7_200), ("try", 0), ("free", 7_200)]


def test_a_live_virtual_gpu_falls_back_to_the_next_plan_and_the_tee_keeps_the_request(gemm):
    # inside a VirtualGPU the request is decided at once: Conv2d(16 -> 32, 3x3, padding 1) on
    # 8 x 16 x 20 x 20 (the first test's 1,843,200-byte workspace) on a 2 MiB device: the workspace
    # is refused (one simulated OOM, caught as try_configs does), the 0-byte plan runs, no OOM raised.
    from oomtune.alloc.sim import CachingAllocatorSim
    from oomtune.capture.recorder import StreamSink
    from oomtune.capture.virtual_gpu import VirtualGPU

    conv = torch.nn.Conv2d(16, 32, 3, padding=1, bias=False, device="meta")
    x = meta(8, 16, 20, 20)
    sim = CachingAllocatorSim(total_memory_bytes=2 * MiB)
    tee = StreamSink()
    with VirtualGPU(sim, device="meta", tee=tee) as vgpu:
        vgpu.register(list(conv.parameters()))
        conv(x)   # output 8 x 32 x 20 x 20 fp32 = 409,600 bytes
    assert sim.num_ooms == 1
    assert [(a, size) for a, _, size, _ in tee.events if a in ("try", "free")][:3] == \
        [("try", 1_843_200), ("try", 0), ("free", 1_843_200)]


def test_the_report_snapshot_shows_the_granted_workspace():
    # htmlreport._step.synthesise_snapshot replays the winner's stream: a granted try shows its size
    from oomtune.htmlreport._step import synthesise_snapshot

    s = AllocationStream()
    s.append_try(1, [64 * MiB, 2 * MiB])
    s.append_free(1)
    small = synthesise_snapshot(s, "", total_memory_bytes=32 * MiB)
    big = synthesise_snapshot(s, "", total_memory_bytes=1024 * MiB)
    allocs = lambda snap: [e["size"] for e in snap["device_traces"][0] if e["action"] == "alloc"]  # noqa: E731
    assert allocs(small) == [2 * MiB] and allocs(big) == [64 * MiB]


def test_a_bad_workspace_rule_in_the_environment_is_refused_before_any_capture(tmp_path, capsys, monkeypatch):
    # The rule is read inside every capture; a typo must stop the search in one line (exit 2) before
    # any trial or capture, not fail each capture.
    from oomtune.cli import main

    monkeypatch.setenv("OOMTUNE_CUDNN_WORKSPACE", "winograd")
    code = main(["search", "model=mlp", "device=cpu", f"hydra.run.dir={tmp_path}/run"])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.startswith("oomtune: error: ") and len(err.splitlines()) == 1
    assert "OOMTUNE_CUDNN_WORKSPACE='winograd': expected one of implicit, gemm" in err
    assert not (tmp_path / "run" / "trials").exists()
