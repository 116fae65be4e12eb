"""oomtune.predict: the same figures as `oomtune plan` for the same entry on the same card; the outside
part of a whole-card prediction comes from the documented table (oomtune.gpu.outside)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import oomtune
from oomtune.exceptions import ConfigError
from oomtune.gpu.outside import CONTEXT_LAZY_BYTES, card_of, outside_allocator

ENTRY = str(Path(__file__).parent / "data" / "predict" / "tiny_mlp.py") + ":make_workload"
A100_40GB = 40_536 << 20   # cudaDeviceProp::totalGlobalMem of an A100-SXM4-40GB: "total_memory=40536MB"


def test_predict_equals_plan_on_the_same_card(monkeypatch, tmp_path):
    """`oomtune plan` on an A100-SXM4-40GB (the device resolver answers as that card would: torch's
    total memory, not simulated) predicts the same peaks for the default allocator settings."""
    import oomtune.device as device_mod
    from oomtune.plan.run import plan

    card = device_mod.TargetDevice(spec="cuda:0", kind="cuda", index=0, name="NVIDIA A100-SXM4-40GB",
                                   total_memory_bytes=A100_40GB, simulated=False)
    monkeypatch.setattr(device_mod, "resolve_device", lambda spec, **_: card)
    monkeypatch.setenv("OOMTUNE_CACHE_DIR", "off")
    monkeypatch.chdir(tmp_path)
    fmap = plan(["target=python", f"target.entry={ENTRY}", "budget=1.0", "+plan.batch_sizes=[48]"],
                out=tmp_path / "plan.yaml")
    row = next(r for r in fmap.rows if r.alloc_conf == "")
    cell = next(c for c in row.cells if c.batch_size == 48)
    got = oomtune.predict(ENTRY, 48, gpu="A100-SXM4-40GB")
    assert (got.peak_reserved_bytes, got.peak_allocated_bytes) == (cell.peak_reserved_bytes,
                                                                  cell.peak_allocated_bytes)
    assert got.fits and cell.fits


def test_prediction_is_frozen_and_adds_the_outside_part():
    got = oomtune.predict(ENTRY, 8)
    assert isinstance(got, oomtune.Prediction)
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.fits = False   # type: ignore[misc]
    # torch 2.x on CUDA 12 loads modules lazily: pytorch/pytorch#86509 read 287,047,680 bytes after
    # one 6,400,000-byte tensor, whose request (1 MiB < size < 10 MiB) took a 20 MiB segment
    assert got.outside_allocator_bytes == CONTEXT_LAZY_BYTES == 287_047_680 - 20 * 1_048_576
    assert got.device_used_bytes == got.peak_reserved_bytes + 266_076_160
    # hand count, a lower bound of the peak allocated: parameters (256*1024+1024 + 1024*16+16 floats),
    # their gradients and Adam's two states = 4 x 279,568 floats x 4 bytes, plus the two cuBLAS
    # workspaces of an sm80 card (':4096:2:16:8' = 8,519,680 bytes each, CublasHandlePool.cpp)
    params = 256 * 1024 + 1024 + 1024 * 16 + 16
    assert params == 279_568
    floor = 4 * params * 4 + 2 * 8_519_680
    assert floor <= got.peak_allocated_bytes < floor + (4 << 20)
    assert any("not counted" in n for n in got.notes)


def test_callable_entry_equals_file_entry():
    import importlib.util

    spec = importlib.util.spec_from_file_location("tiny_mlp_for_predict", ENTRY.rpartition(":")[0])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    by_name, by_fn = oomtune.predict(ENTRY, 16, steps=2), oomtune.predict(module.make_workload, 16, steps=2)
    assert (by_fn.peak_reserved_bytes, by_fn.peak_allocated_bytes) == (by_name.peak_reserved_bytes,
                                                                      by_name.peak_allocated_bytes)


@pytest.mark.parametrize("kwargs, message", [
    ({"gpu": "B300-SXM"}, r"^gpu='B300-SXM': unknown card; choose one of the device catalogue's [^\n]*a100-40gb, "
                          r"a100-80gb[^\n]*h100-80gb[^\n]*l4[^\n]* \(or a display name such as A100-SXM4-40GB\)$"),
    ({"steps": 0}, r"^steps=0: expected an integer >= 1"),
])
def test_bad_input_is_one_line(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        oomtune.predict(ENTRY, 8, **kwargs)


def test_bad_batch_size_is_one_line():
    with pytest.raises(ConfigError, match=r"^batch_size=0: expected an integer >= 1$"):
        oomtune.predict(ENTRY, 0)


def test_outside_table():
    assert card_of("NVIDIA A100-SXM4-40GB").total_memory_bytes == 42_505_076_736 == 40_536 * 1_048_576
    eager = outside_allocator(lazy_loading=False)
    assert eager.total_bytes == 666_632_192 - 20 * 1_048_576 and not eager.measured   # pytorch/pytorch#86509
    cnn = outside_allocator(cudnn=True)
    assert any("cuDNN" in u for u in cnn.unsourced)
    measured = outside_allocator(measured_bytes=1_063_780_352)
    assert measured.total_bytes == 1_063_780_352 and measured.measured and measured.unsourced == ()
    with pytest.raises(ValueError):
        outside_allocator(measured_bytes=-1)


def test_a_batch_beyond_the_card_does_not_fit():
    """Batch 10,000,000 of the tiny MLP: the input (10^7 x 256 fp32 = 10.24 GB) and the first layer's
    output (10^7 x 1024 fp32 = 40.96 GB) are live together, 51.2 GB > the A100-40GB's 42.5 GB."""
    got = oomtune.predict(ENTRY, 10_000_000, steps=1)
    assert not got.fits
    assert got.peak_allocated_bytes >= 10_000_000 * (256 + 1024) * 4 > A100_40GB


@pytest.mark.parametrize("name", ["l4", "h100-80gb", "a100-40gb-1g.5gb", "NVIDIA H100 80GB HBM3"])
def test_catalogue_names_are_accepted(name):
    """The catalogue's names and the names torch reports; the memory in the notes is the card's
    (h100-80gb: 81,082 MiB; the 1g.5gb slice: 4.75 GiB = 4,864 MiB; l4: 22,593 MiB)."""
    got = oomtune.predict(ENTRY, 8, gpu=name, steps=1)
    mib = {"l4": 22_593, "h100-80gb": 81_082, "a100-40gb-1g.5gb": 4_864, "NVIDIA H100 80GB HBM3": 81_082}[name]
    assert got.fits and f"({mib} MiB, " in got.notes[0]


def test_a_batch_fits_the_80gb_card_not_the_mig_slice():
    """Batch 1,000,000 of the tiny MLP: while ReLU runs, the input (256 floats a sample), the first
    layer's output and ReLU's output (1024 each) are live: 10^6 x 2304 x 4 = 9.216 GB, above the
    1g.5gb slice's 5,100,273,664 bytes; everything the step can hold at once (input, two 1024-wide
    activations and their two gradients, the 16-wide logits) stays below 10^6 x 4,500 x 4 = 18 GB,
    far below the H100 80GB's 85,020,639,232."""
    big = oomtune.predict(ENTRY, 1_000_000, gpu="h100-80gb", steps=1)
    mig = oomtune.predict(ENTRY, 1_000_000, gpu="a100-40gb-1g.5gb", steps=1)
    assert big.fits and big.peak_allocated_bytes < 18_000_000_000
    assert not mig.fits and mig.peak_allocated_bytes >= 9_216_000_000 > 5_100_273_664


def test_warm_capture_loads_once_per_process_from_a_built_in_workload(monkeypatch):
    # The forks that capture the user's code start from the warmed process: the warm-up captures
    # oomtune's built-in MLP (never the user's entry), once per process, and a failure there is
    # only a cold start, never an error of the prediction.
    from oomtune.plan import predictor as P

    seen = []

    def fake_capture(cfg, batch_size, *, steps):
        seen.append((cfg["name"], batch_size, steps))
        raise RuntimeError("no capture here")

    monkeypatch.setattr(P, "capture_training_stream", fake_capture)
    monkeypatch.setattr(P, "_WARM_PID", None)
    P.warm_capture()
    P.warm_capture()
    assert seen == [("mlp", 2, 1)]
    assert "target" not in P._WARM_WORKLOAD      # a built-in model, no user entry
