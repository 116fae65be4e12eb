"""Tests for oomtune.workloads: building the three models, data sources, timing, capture on meta."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from oomtune.capture import StorageRecorder, StreamSink
from oomtune.exceptions import ConfigError
from oomtune.workloads import build_capture_workload, build_workload, validate_workload_config

RESNET = {"name": "resnet", "depth": 18, "image_size": 32, "num_classes": 10}
TRANSFORMER = {"name": "transformer", "layers": 2, "d_model": 32, "heads": 4, "seq_len": 16,
               "vocab_size": 100, "dropout": 0.0, "optimizer": "adamw", "lr": 1e-3}
MLP = {"name": "mlp", "in_features": 16, "hidden": 32, "layers": 2, "num_classes": 4}


def _params_changed(wl, before):
    return any(not torch.equal(p, b) for p, b in zip(wl.model.parameters(), before))


@pytest.mark.parametrize("cfg,batch", [(RESNET, 2), (TRANSFORMER, 2), (MLP, 4)])
def test_models_build_and_train_one_step_on_cpu(cfg, batch):
    torch.manual_seed(0)
    wl = build_workload(cfg, batch, "cpu")
    assert wl.device == torch.device("cpu") and wl.batch_size == batch == wl.samples_per_step
    before = [p.detach().clone() for p in wl.model.parameters()]
    wl.step(next(wl.batches()))
    assert _params_changed(wl, before)
    assert all(p.grad is None for p in wl.model.parameters())   # zero_grad(set_to_none=True)
    assert wl.optimizer.state   # optimizer state created


def test_resnet_depth_and_transformer_shapes():
    import torchvision

    wl = build_workload({**RESNET, "depth": 34}, 1, "meta")
    n_ref = sum(p.numel() for p in torchvision.models.resnet34(num_classes=10).parameters())
    assert sum(p.numel() for p in wl.model.parameters()) == n_ref
    tr = build_workload(TRANSFORMER, 3, "meta")
    x, y = next(tr.batches())
    assert x.shape == y.shape == (3, 16) and x.dtype == torch.int64
    assert tr.model(x).shape == (3, 16, 100)


def test_optimizers_and_precision():
    assert isinstance(build_workload({**MLP, "optimizer": "adam"}, 2, "cpu").optimizer,
                      torch.optim.Adam)
    sgd = build_workload(MLP, 2, "cpu").optimizer
    assert isinstance(sgd, torch.optim.SGD) and sgd.param_groups[0]["momentum"] == 0.9
    wl = build_workload({**MLP, "precision": "bf16"}, 2, "cpu")
    assert wl.precision == "bf16" and wl.fallback_reason is None
    wl.step(next(wl.batches()))
    # meta stands for a CUDA run: bf16 is kept and CUDA's autocast policy applied
    meta = build_workload({**MLP, "precision": "bf16"}, 2, "meta")
    assert meta.precision == "bf16" and meta.fallback_reason is None
    x, _ = next(meta.batches())
    with meta._autocast():
        assert meta.model(x).dtype == torch.bfloat16


@pytest.mark.parametrize("cfg,needle", [
    ({"name": "vgg"}, "unknown model 'vgg': choose one of mlp, resnet, transformer"),
    ({**RESNET, "depth": 20}, "model.depth"),
    ({**MLP, "optimizer": "lamb"}, "model.optimizer"),
    ({**MLP, "precision": "fp8"}, "model.precision"),
    ({**MLP, "hidden": 0}, "model.hidden"),
    ({**TRANSFORMER, "heads": 5}, "divisible"),
    ({**MLP, "data": {"source": "s3"}}, "model.data.source"),
    ({**RESNET, "data": {"source": "imagefolder"}}, "model.data.path"),
    ({**RESNET, "data": {"source": "tokens", "path": "/nonexistent"}}, "token model"),
    ({**TRANSFORMER, "data": {"source": "tokens", "path": "/nonexistent/x.bin"}}, "not found"),
    ({**MLP, "data": {"decode_delay_s": -1}}, "decode_delay_s"),
])
def test_bad_config_raises_config_error(cfg, needle):
    with pytest.raises(ConfigError) as e:
        validate_workload_config(cfg)
    assert needle in str(e.value)
    with pytest.raises(ConfigError):
        build_workload(cfg, 2, "cpu")


def test_unknown_model_message_exact():
    with pytest.raises(ConfigError, match=r"^unknown model 'x': choose one of mlp, resnet, transformer$"):
        build_workload({"name": "x"}, 1, "cpu")


def test_bad_batch_size():
    with pytest.raises(ConfigError, match="batch_size"):
        build_workload(MLP, 0, "cpu")


def test_imagefolder_source(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    for cls in ("cat", "dog"):
        (tmp_path / cls).mkdir()
        for i in range(3):
            pixels = rng.integers(0, 255, (40, 50, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(tmp_path / cls / f"{i}.png")
    cfg = {**RESNET, "data": {"source": "imagefolder", "path": str(tmp_path)}}
    validate_workload_config(cfg)
    wl = build_workload(cfg, 2, "cpu")
    batches = wl.batches()
    for _ in range(4):   # 6 images / batch 2 = 3 batches per epoch: crosses an epoch boundary
        x, y = next(batches)
        assert x.shape == (2, 3, 32, 32) and x.dtype == torch.float32
        assert set(y.tolist()) <= {0, 1}
    wl.step((x, y))


def test_imagefolder_on_meta_refused(tmp_path):
    with pytest.raises(ConfigError, match="synthetic"):
        build_workload({**RESNET, "data": {"source": "imagefolder", "path": str(tmp_path)}}, 2,
                       "meta")


def test_token_file_source(tmp_path):
    path = tmp_path / "train.bin"
    tokens = (np.arange(200) % 100).astype("<u2")   # token i at position i (mod 100)
    tokens.tofile(path)
    cfg = {**TRANSFORMER, "data": {"source": "tokens", "path": str(path)}}
    wl = build_workload(cfg, 4, "cpu")
    x, y = next(wl.batches())
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.int64
    # Windows of consecutive tokens; targets are inputs shifted by one.
    assert torch.equal((x[:, 1:] - x[:, :-1]) % 100, torch.ones(4, 15, dtype=torch.int64))
    assert torch.equal(y, (x + 1) % 100)
    wl.step((x, y))


def test_token_file_too_short(tmp_path):
    path = tmp_path / "tiny.bin"
    np.arange(10, dtype="<u2").tofile(path)
    with pytest.raises(ConfigError, match="need at least seq_len"):
        build_workload({**TRANSFORMER, "data": {"source": "tokens", "path": str(path)}}, 1, "cpu")


def test_data_wait_fraction_high_with_slow_decode_low_without():
    slow = build_workload({**MLP, "data": {"decode_delay_s": 0.1}}, 4, "cpu")
    t_slow = slow.run_steps(3)
    # 4 samples x 100 ms of decode per step (0.4 s), against a sub-millisecond step: the wait stays
    # above half the step unless the machine stretches the step itself past 0.4 s (at 20 ms a sample,
    # a load of 8 on 2 cores gave 0.44).
    assert t_slow.data_wait_fraction > 0.5
    assert min(t_slow.data_wait_s) >= 4 * 0.1
    fast = build_workload(MLP, 4, "cpu")
    fast.run_steps(1)
    t_fast = fast.run_steps(5)
    assert t_fast.data_wait_fraction < 0.5
    assert len(t_fast.step_s) == 5 and t_fast.samples_per_s > 0


def test_synthetic_batch_is_reused_on_device():
    wl = build_workload(MLP, 4, "meta")
    it = wl.batches()
    a, b = next(it), next(it)
    assert a[0] is b[0] and a[0].device.type == "meta"
    assert any(t is a[0] for t in wl.tensors_before_step())


def test_capture_workload_on_meta_counts_parameters_and_state():
    wl = build_capture_workload(MLP, 4)
    assert wl.device.type == "meta" and wl.fallback_reason is None
    sink = StreamSink()
    rec = StorageRecorder(sink, device="meta")
    rec.register_existing(wl.tensors_before_step())
    # params: (16*32 + 32) + (32*32 + 32) + (32*4 + 4) = 1732 floats; SGD momentum doubles them;
    # synthetic batch: x 4*16 floats + y 4 int64.
    n_param = 16 * 32 + 32 + 32 * 32 + 32 + 32 * 4 + 4
    assert rec.live_bytes == 2 * n_param * 4 + 4 * 16 * 4 + 4 * 8
    with rec:
        wl.step(next(wl.batches()))
    assert rec.live_bytes == 2 * n_param * 4 + 4 * 16 * 4 + 4 * 8   # steady state: nothing leaks


def test_capture_workload_falls_back_to_cpu(monkeypatch):
    from oomtune.workloads import loop

    real_backward = loop.Workload.backward

    def backward(self, batch, scale=1.0):
        if self.device.type == "meta":
            raise NotImplementedError("aten::fancy: no meta kernel")
        return real_backward(self, batch, scale)

    monkeypatch.setattr(loop.Workload, "backward", backward)
    wl = build_capture_workload(MLP, 2)
    assert wl.device.type == "cpu"
    assert "aten::fancy" in wl.fallback_reason


# -- every key's type and range (the rule: one line naming the key and the value) ----------------------
@pytest.mark.parametrize("cfg, line", [
    ({**RESNET, "channels_last": "abc"}, "model.channels_last='abc': expected true or false"),
    ({**RESNET, "channels_last": 1}, "model.channels_last=1: expected true or false"),
    ({**MLP, "data": {"pin_memory": "abc"}}, "model.data.pin_memory='abc': expected true or false"),
    ({**MLP, "data": {"num_workers": 2, "prefetch_factor": "abc"}},
     "model.data.prefetch_factor='abc': expected an integer >= 1"),
    ({**MLP, "data": {"num_workers": 2, "prefetch_factor": 0}}, "model.data.prefetch_factor=0: expected an integer >= 1"),
    ({**MLP, "data": {"num_workers": -1}}, "model.data.num_workers=-1: expected an integer >= 0"),
    ({**MLP, "data": {"num_workers": True}}, "model.data.num_workers=True: expected an integer >= 0"),
    ({**MLP, "data": {"decode_delay_s": float("inf")}}, "model.data.decode_delay_s=inf: expected a finite number >= 0"),
    ({**MLP, "data": "abc"}, "model.data='abc': expected a mapping such as {source: synthetic}"),
    ({**RESNET, "depth": "abc"}, "model.depth='abc': choose one of 18, 34, 50, 101, 152"),
    ({**RESNET, "depth": 18.0}, "model.depth=18.0: choose one of 18, 34, 50, 101, 152"),
    ({**RESNET, "image_size": 0}, "model.image_size=0: expected an integer >= 8"),
    ({**MLP, "lr": "abc"}, "model.lr='abc': expected a finite number >= 0"),
    ({**MLP, "lr": float("nan")}, "model.lr=nan: expected a finite number >= 0"),
    ({**MLP, "lr": -0.1}, "model.lr=-0.1: expected a finite number >= 0"),
    ({**MLP, "layers": True}, "model.layers=True: expected an integer >= 0"),
    ({**TRANSFORMER, "dropout": 1.5}, "model.dropout=1.5: expected a finite number in [0, 1]"),
    ({**MLP, "precision": ["fp32"]}, "model.precision=['fp32']: choose one of fp32, bf16, fp16"),
    ({**MLP, "optimizer": None}, "model.optimizer=None: choose one of sgd, adam, adamw"),
])
def test_wrong_types_and_ranges_are_one_line_errors_naming_key_and_value(cfg, line):
    with pytest.raises(ConfigError) as e:
        validate_workload_config(cfg)
    assert str(e.value) == line
    with pytest.raises(ConfigError):   # the trial's own build refuses them too
        build_workload(cfg, 2, "cpu")


def test_prefetch_factor_needs_workers_as_torch_requires():
    # torch.utils.data.DataLoader: "prefetch_factor option could only be specified in multiprocessing"
    with pytest.raises(ConfigError, match=r"^model.data.prefetch_factor=2 needs model.data.num_workers > 0"):
        validate_workload_config({**MLP, "data": {"num_workers": 0, "prefetch_factor": 2}})
    validate_workload_config({**MLP, "data": {"num_workers": 2, "prefetch_factor": 2, "pin_memory": True}})
    validate_workload_config({**MLP, "data": {"num_workers": 0, "prefetch_factor": None}})


def test_well_typed_settings_are_accepted():
    validate_workload_config({**RESNET, "channels_last": True, "lr": 0, "depth": 34})
    validate_workload_config({**MLP, "layers": 0, "lr": 1, "data": {"decode_delay_s": None}})


@pytest.mark.parametrize("override, needle", [
    ("model.channels_last=abc", "model.channels_last='abc'"),
    ("model.data.pin_memory=abc", "model.data.pin_memory='abc'"),
    ("model.data.prefetch_factor=abc", "model.data.prefetch_factor='abc'"),
    ("model.depth=abc", "model.depth='abc'"),
    ("model.lr=abc", "model.lr='abc'"),
    ("model.data.num_workers=-1", "model.data.num_workers=-1"),
    ("model.image_size=0", "model.image_size=0"),
])
def test_bad_model_overrides_exit_2_on_the_command_line(override, needle, tmp_path, capsys):
    from oomtune.cli import main

    code = main(["plan", "device=cpu", "model=resnet", override, f"hydra.run.dir={tmp_path}/run"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("oomtune: error: ") and needle in err, err
    assert len(err.splitlines()) == 1
    assert not (tmp_path / "run").exists()   # refused before anything was written


@pytest.fixture
def torchvision_for_another_torch(monkeypatch):
    """Importing torchvision fails as one built for another torch does: its compiled ops do not load."""
    import importlib

    real = importlib.import_module

    def broken(name, *args, **kwargs):
        if name == "torchvision":
            raise RuntimeError("operator torchvision::nms does not exist")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib, "import_module", broken)


def test_a_torchvision_built_for_another_torch_is_one_line_naming_both(torchvision_for_another_torch):
    """A CPU torch from one index and torchvision from another: importing torchvision raises
    "operator torchvision::nms does not exist" (its compiled ops do not load); the new user saw a
    traceback. Now a ConfigError names the versions and the fix."""
    with pytest.raises(ConfigError) as err:
        build_workload({"name": "resnet", "depth": 18, "image_size": 32}, batch_size=2, device="cpu")
    text = str(err.value)
    assert "\n" not in text and f"with torch {torch.__version__}" in text
    # the fix must change an installed pair: a plain `pip install torch torchvision` keeps it
    assert "operator torchvision::nms does not exist" in text and "pip install --force-reinstall torch torchvision" in text


def test_a_broken_pair_with_a_cpu_torch_is_told_to_reinstall_from_the_cpu_index(torchvision_for_another_torch,
                                                                              monkeypatch):
    """A new user's finding: with torch 2.13.0+cpu and a torchvision that did not match, the line's fix
    (`pip install --force-reinstall torch torchvision`) took the CUDA build from the default index, the
    ~5.6 GB the README warns about. A CPU torch is told to reinstall from PyTorch's CPU index."""
    from oomtune.workloads import models

    for version, index in (("2.13.0+cpu", True), ("2.14.1+cu128", False), ("2.14.1", False)):
        monkeypatch.setattr(models.torch, "__version__", version)
        with pytest.raises(ConfigError) as err:
            models._torchvision()
        cpu_index = "torchvision --index-url https://download.pytorch.org/whl/cpu (plain" in str(err.value)
        assert cpu_index is index, (version, str(err.value))
