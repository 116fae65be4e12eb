"""CPU tests of experiments/gpu_outside.py (the GPU check's step that measures memory outside the caching
allocator and cuDNN's workspace requests): its pure logic on hand-written traces and readings, the
layers it picks (derived by hand from the GPUMemNet generators' parameters), the table row and cache
entry a device run proposes, and the dry run's JSON shape (no device figures)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from oomtune.gpu import outside
from oomtune.gpu.outside import ContextFigure, outside_allocator

REPO = Path(__file__).resolve().parent.parent
MiB = 1 << 20


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "experiments" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


go = _load("gpu_outside")


def test_window_summary_keeps_the_blocks_allocated_and_freed_inside_the_call():
    """A cuDNN forward as the allocator records it: the output (kept), a workspace freed by the call
    (free_requested then free_completed: counted once), a second request freed with free_completed
    only, a refused request (oom), and the free of a block allocated before the window (ignored)."""
    entries = [
        {"action": "alloc", "addr": 0x1000, "size": 4_194_304, "stream": 0},     # output
        {"action": "alloc", "addr": 0x2000, "size": 165_888, "stream": 0},       # workspace
        {"action": "free_requested", "addr": 0x2000, "size": 165_888, "stream": 0},
        {"action": "free_completed", "addr": 0x2000, "size": 165_888, "stream": 0},
        {"action": "oom", "addr": 0, "size": 1 << 40, "stream": 0},
        {"action": "alloc", "addr": 0x3000, "size": 512, "stream": 0},
        {"action": "free_completed", "addr": 0x3000, "size": 512, "stream": 0},
        {"action": "free_completed", "addr": 0x9000, "size": 2048, "stream": 0},  # allocated before the window
        {"action": "segment_alloc", "addr": 0x4000, "size": 2 * MiB, "stream": 0},
    ]
    assert go.window_summary(entries) == {"transient_bytes": [165_888, 512], "kept_bytes": [4_194_304], "ooms": 1}
    assert go.window_summary([]) == {"transient_bytes": [], "kept_bytes": [], "ooms": 0}


def test_outside_figures_take_reserved_and_the_cards_baseline_off():
    """meminfo used 700 MiB, NVML used 702 MiB with 2 MiB used before CUDA init, this process 690 MiB,
    reserved 20 MiB: outside = 680, 680 and 670 MiB."""
    r = {"meminfo_used": 700 * MiB, "nvml_used": 702 * MiB, "nvml_process": 690 * MiB, "reserved": 20 * MiB}
    assert go.outside_figures(r, 2 * MiB) == {"outside_meminfo": 680 * MiB, "outside_nvml": 680 * MiB,
                                               "outside_process": 670 * MiB}
    missing = go.outside_figures({"meminfo_used": 700 * MiB, "nvml_used": None, "nvml_process": None,
                                  "reserved": 20 * MiB}, None)
    assert missing == {"outside_meminfo": 680 * MiB, "outside_nvml": None, "outside_process": None}
    assert go.outside_figures({"meminfo_used": None, "reserved": None}, None)["outside_meminfo"] is None


def test_step_deltas_are_what_each_step_added():
    readings = {"cuda_init": {"outside_meminfo": 500}, "tensor": {"outside_meminfo": 500},
                "cublas_fp32": {"outside_meminfo": 560}, "cublaslt_bf16": {"outside_meminfo": 600},
                "cudnn_conv": {"outside_meminfo": None}, "mlp_step": {"outside_meminfo": 900},
                "cnn_step": {"outside_meminfo": 950}}
    assert go.step_deltas(readings) == {"cuda_init": 500, "tensor": 0, "cublas_fp32": 60, "cublaslt_bf16": 40,
                                        "cudnn_conv": None, "mlp_step": None, "cnn_step": 50}


def test_layers_are_the_first_and_the_largest_gemm_convolution_of_each_row():
    """By hand from the rows' parameters (experiments/_gpumemnet_models.py): uniform depth 2, base 32,
    1 channel, batch 52, 134 px: 1 -> 32, then 32 -> 32; residual base 120, 3 channels, batch 16,
    200 px: block 0's first conv 3 -> 120, its second 120 -> 120 at 200 px (block 1 has stride 2, so
    a quarter of the pixels: smaller lowered matrices); dense depth 4 (one dense block of 4 layers,
    growth 32), 3 channels, batch 54, 162 px: inputs 3, 35, 67, 99 channels, the last the largest."""
    specs = go.layer_specs()
    got = [(s["row"].split("arch:")[1].split("_")[0], s["index"], s["input"], s["out_channels"], s["first"])
           for s in specs]
    assert got == [("uniform", 0, [52, 1, 134, 134], 32, True), ("uniform", 1, [52, 32, 134, 134], 32, False),
                   ("residual", 0, [16, 3, 200, 200], 120, True), ("residual", 1, [16, 120, 200, 200], 120, False),
                   ("dense", 0, [54, 3, 162, 162], 32, True), ("dense", 3, [54, 99, 162, 162], 32, False)]
    assert all(s["kernel"] == [3, 3] and s["stride"] == [1, 1] and s["padding"] == [1, 1] for s in specs)


def test_predictions_under_each_rule():
    """Rule implicit: no request (0 bytes is never asked for). Rule gemm: the lowered matrix, C x 3 x 3
    rows by N x 12 x 12 columns, 4 bytes: 32 x 9 x 144 x 4 = 165,888 bytes for the forward, the same
    for backward-data and backward-weight; a model's first layer gets no input gradient, so its
    backward is backward-weight alone: 1 x 9 x 144 x 4 = 5,184 bytes."""
    spec = {"input": [1, 32, 12, 12], "out_channels": 32, "kernel": [3, 3], "stride": [1, 1], "padding": [1, 1],
            "dilation": [1, 1], "groups": 1, "first": False}
    assert go.predicted_requests(spec, "implicit", "sm80") == {"forward": [], "backward": []}
    assert go.predicted_requests(spec, "gemm", "sm90") == {"forward": [165_888], "backward": [165_888, 165_888]}
    first = {**spec, "input": [1, 1, 12, 12], "first": True}
    assert go.predicted_requests(first, "gemm", "sm80") == {"forward": [5_184], "backward": [5_184]}


def _device_doc() -> dict:
    """A device run's JSON as the script writes it (figures invented for the arithmetic)."""
    readings = {"cuda_init": {"outside_meminfo": 524_288_000}, "tensor": {"outside_meminfo": 524_288_000},
                "cublas_fp32": {"outside_meminfo": 600 * MiB}, "cublaslt_bf16": {"outside_meminfo": 610 * MiB},
                "cudnn_conv": {"outside_meminfo": 900 * MiB}, "mlp_step": {"outside_meminfo": 950 * MiB},
                "cnn_step": {"outside_meminfo": 960 * MiB}}
    env = {"cuda": "12.4", "capability": [9, 0], "CUDA_MODULE_LOADING_after_init": "LAZY", "torch": "2.5.1+cu124",
           "cudnn": 90100, "device_name": "NVIDIA H200"}
    return {"commit": "abc1234", "child": {"env": env, "readings": readings,
                                           "identity": {"name": "NVIDIA H200", "driver_version": "550.54.15"}}}


def test_a_device_runs_context_row_is_a_table_row_chosen_for_its_card_only(monkeypatch):
    """The proposed context row (cuda_init's reading) evaluates to a ContextFigure that the table then
    gives an sm90 card on CUDA 12 with lazy loading (524,288,000 bytes), while an A100 (sm80) keeps the
    row whose source names no GPU (pytorch/pytorch#86509's 266,076,160 bytes). The later steps are
    listed with what they added: 600 - 500 = 100 MiB (cuBLAS), 10, 290, 50, 10 MiB."""
    rows = go.proposed_rows(_device_doc())
    row = eval(rows[0], {"ContextFigure": ContextFigure})   # the text is pasted into TABLE as it is
    assert (row.bytes, row.cuda_majors, row.lazy, row.capability) == (524_288_000, (12,), True, (9, 0))
    for part in ("NVIDIA H200", "driver 550.54.15", "torch 2.5.1+cu124", "CUDA 12.4", "cuDNN 90100",
                 "CUDA_MODULE_LOADING=LAZY", "commit abc1234"):
        assert part in row.source, part
    monkeypatch.setattr(outside, "TABLE", outside.TABLE + (row,))
    assert outside_allocator(cuda_major=12, capability=(9, 0)).total_bytes == 524_288_000
    assert outside_allocator(cuda_major=12, capability=(8, 0)).total_bytes == 266_076_160
    added = [r.split(":")[1].split(" bytes")[0].strip() for r in rows[1:]]
    assert [r.split(":")[0] for r in rows[1:]] == ["# cublas_fp32", "# cublaslt_bf16", "# cudnn_conv", "# mlp_step",
                                                   "# cnn_step"]
    assert added == [f"+{100 * MiB:,}", f"+{10 * MiB:,}", f"+{290 * MiB:,}", f"+{50 * MiB:,}", f"+{10 * MiB:,}"]
    assert go.proposed_rows({"child": {"readings": {}}}) == []


def test_the_cache_entry_is_what_a_plan_for_the_same_device_reads(tmp_path, monkeypatch):
    """The entry is written by the trial's own function (remember_measured) and read by a plan's
    virtual GPU for the same GPU name, driver and torch (oomtune.plan.predictor.sim_geometry, no
    outside figure given): its non_allocator_bytes is the reading."""
    from types import SimpleNamespace

    from oomtune.packages import installed_version
    from oomtune.plan.predictor import sim_geometry

    ident = {"name": "NVIDIA H200", "driver_version": "550.54.15"}
    torch_version = installed_version("torch")
    got = go.cache_entry(ident, torch_version, 960 * MiB, tmp_path)
    assert got["read_back"] == 960 * MiB and list(got["file"].values()) == [960 * MiB]
    monkeypatch.setenv("OOMTUNE_CACHE_DIR", str(tmp_path))
    device = SimpleNamespace(simulated=False, name="NVIDIA H200", driver_version="550.54.15",
                             total_memory_bytes=150_754_820_096)
    assert sim_geometry(device, 100 << 30)["non_allocator_bytes"] == 960 * MiB
    other_driver = SimpleNamespace(**{**vars(device), "driver_version": "560.28"})
    assert sim_geometry(other_driver, 100 << 30)["non_allocator_bytes"] != 960 * MiB
    assert go.cache_entry(None, torch_version, 1, tmp_path) is None


@pytest.mark.slow
def test_dry_run_writes_the_json_shape(tmp_path):
    """The CPU dry run: every step has a reading (no figure: None), six layers with a forward and a
    backward per iteration (two), nothing measured on the CPU, oomtune's predictions for the dry
    layers (batch 1, 12 x 12: the uniform row's second layer's gemm forward 32 x 9 x 144 x 4 bytes),
    no proposed row and no cache entry; --render writes the same markdown again from the JSON. The
    child's 30 s default limit is sized for the GPU session's budget; on a loaded 2-core machine its
    CPU imports alone may take longer, so the dry run (about the JSON, not the limit) allows 300 s."""
    assert go.main(["--device", "cpu", "--out-dir", str(tmp_path), "--child-timeout", "300"]) == 0
    doc = json.loads((tmp_path / "gpu_outside.json").read_text())
    assert doc["command"].startswith("python experiments/gpu_outside.py") and doc["device"] == "cpu"
    child = doc["child"]
    assert child["error"] is None and list(child["readings"]) == list(go.STEPS)
    for reading in child["readings"].values():
        assert {"nvml_used", "meminfo_used", "reserved", "outside_meminfo", "outside_nvml"} <= set(reading)
        assert reading["outside_meminfo"] is None
    layers = child["layers"]
    assert len(layers) == go.MAX_LAYERS == 6 and all("error" not in layer for layer in layers)
    for layer in layers:
        assert layer["spec"]["input"][0] == 1 and layer["spec"]["input"][2:] == [12, 12]
        assert [(c["iteration"], c["call"]) for c in layer["calls"]] == [
            (1, "forward"), (1, "backward"), (2, "forward"), (2, "backward")]
        assert all(c["measured"] is None and c["predicted"]["implicit"] == [] for c in layer["calls"])
    assert layers[1]["calls"][0]["predicted"]["gemm"] == [32 * 9 * 144 * 4]
    assert doc["proposed_rows"] == [] and doc["cache_entry"] is None
    assert doc["table_context"]["bytes"] == 266_076_160
    md = (tmp_path / "gpu_outside.md").read_text()
    assert "CPU dry run" in md and "| cnn_step |" in md
    again = tmp_path / "again"
    again.mkdir()
    assert go.main(["--render", str(tmp_path / "gpu_outside.json"), "--out-dir", str(again)]) == 0
    assert (again / "gpu_outside.md").read_text() == md
