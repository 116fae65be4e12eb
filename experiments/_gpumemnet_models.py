"""The GPUMemNet generators' models, rebuilt from their parameters (for experiments/fidelity_public.py).

GPUMemNet (github.com/itu-rad/GPUMemNet, arXiv 2602.17817; data CC-BY 4.0) trains generated MLPs and
CNNs on an A100-SXM4-40GB and records the card's memory; every generator parameter is written into the
row's ``Filename``. This module is our own rebuild, written from reading the generators
(NeuroNetGen_scripts/MLP/mlp.py, mlp_next.py, NeuroNetGen_scripts/CNN/cnn.py at commit f01eb05): the
same layer sequence, widths and parameter counts; no code is copied. :func:`check_params` compares a
rebuild with the row's ``Total Parameters``.

What the generators do that matters for memory (read there, not measured here):

* MLP (``mlp.py``, the first collection, ``mlp_step1``): Linear + ReLU per hidden layer; the widths by
  architecture: ``pyramid`` and ``bottleneck`` halve (never below the output size; bottleneck adds one
  more halved layer), ``uniform`` keeps the input width, ``gradual`` steps down by
  ``(input - output) // depth``; a final Linear; no output activation.
* MLP (``mlp_next.py``, ``mlp_step2``): the same widths, each hidden layer Linear [+ BatchNorm1d] +
  activation [+ Dropout]; a Softmax after the last Linear (output > 1), else Sigmoid or Identity at
  random (neither has parameters).
* Training (both): ``TensorDataset`` of 4,096 random samples, ``DataLoader(batch_size, shuffle=True)``,
  ``torch.optim.Adam`` defaults, ``CrossEntropyLoss`` (``BCEWithLogitsLoss`` for one output), fp32.
* CNN (``cnn.py``): ConvBlocks (Conv2d 3x3 padding 1 [+ BatchNorm2d] + activation [+ Dropout]); filter
  counts by architecture (pyramid, reverse_pyramid, bottleneck, gradual, hourglass, uniform), residual
  blocks (two ConvBlocks + a 1x1 Conv shortcut [+ BatchNorm2d] when the shape changes, stride 2 on odd
  blocks while the map is larger than 7), dense blocks (4 ConvBlocks of growth 32 on the concatenation,
  a 1x1 transition halving the channels with 2x2 average pooling after block ``i`` when ``i %
  pooling_frequency == 0`` except the last; ``pooling_frequency`` is drawn at random per run: either
  ``max(1, ceil(depth / max(1, int(log2(size // 7)))))`` or 5, told apart by the parameter count);
  ``use_pooling`` is never passed by the launcher, so no max pooling; then AdaptiveAvgPool2d(1),
  Linear, Softmax. Training: 4,096 random images per epoch, Adam(lr=1e-3), CrossEntropyLoss, fp32;
  a torchinfo summary forward at the training batch before training.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch
from torch import nn

__all__ = ["parse_filename", "build_mlp", "build_cnn", "build_model", "count_params", "check_params",
           "make_workload_for"]

_ACT = {"relu": nn.ReLU, "leaky_relu": nn.LeakyReLU, "prelu": nn.PReLU, "elu": nn.ELU, "selu": nn.SELU,
        "tanh": nn.Tanh, "softplus": nn.Softplus, "swish": nn.SiLU, "mish": nn.Mish, "gelu": nn.GELU,
        "identity": nn.Identity}
NUM_SAMPLES = 4096   # the generators' default --num_samples (the launchers do not pass one)


def parse_filename(name: str) -> dict[str, str]:
    """The generator parameters in a row's ``Filename`` (``input:1259_output:79_..._batch:717.out``),
    as strings by key; the CNN's repeated ``dropout`` key becomes ``dropout_rate`` then ``dropout``."""
    stem = name[:-4] if name.endswith(".out") else name
    out: dict[str, str] = {}
    keys = ("input_channels", "num_classes", "base_filters", "input_size", "batchnorm", "dropout", "output",
            "input", "depth", "arch", "batch", "act")
    parts = re.split(r"_(?=(?:%s):)" % "|".join(keys), stem)
    for part in parts:
        key, _, value = part.partition(":")
        if key == "dropout" and "dropout_rate" not in out and value not in ("True", "False"):
            key = "dropout_rate"
        out[key] = value
    return out


def _mlp_widths(n_in: int, n_out: int, depth: int, arch: str) -> list[int]:
    """Hidden widths of the generators' MLP (mlp.py / mlp_next.py) by architecture."""
    widths, width = [], n_in
    if arch in ("pyramid", "bottleneck"):
        for _ in range(depth):
            width = max(int(width * 0.5), n_out)
            widths.append(width)
        if arch == "bottleneck":
            widths.append(max(int(width * 0.5), n_out))
    elif arch == "uniform":
        widths = [n_in] * depth
    elif arch == "gradual":
        step = (n_in - n_out) // depth
        for _ in range(depth):
            width = max(width - step, n_out)
            widths.append(width)
    else:
        raise ValueError(f"unknown MLP architecture {arch!r}")
    return widths


def build_mlp(p: dict[str, str]) -> nn.Module:
    """The MLP of a ``mlp_step1`` (no ``act`` key) or ``mlp_step2`` row."""
    n_in, n_out, depth = int(p["input"]), int(p["output"]), int(p["depth"])
    nxt = "act" in p
    act = _ACT.get(p.get("act", "relu"), nn.ReLU)
    layers: list[nn.Module] = []
    width = n_in
    for w in _mlp_widths(n_in, n_out, depth, p["arch"]):
        layers.append(nn.Linear(width, w))
        if nxt and p.get("batchnorm") == "True":
            layers.append(nn.BatchNorm1d(w))
        layers.append(act())
        if nxt and p.get("dropout") == "True":
            layers.append(nn.Dropout(float(p["dropout_rate"])))
        width = w
    layers.append(nn.Linear(width, n_out))
    if nxt:
        layers.append(nn.Softmax(dim=1) if n_out > 1 else nn.Identity())
    return nn.Sequential(*layers)


class _ConvBlock(nn.Sequential):
    def __init__(self, c_in: int, c_out: int, p: dict[str, Any], kernel: int = 3, stride: int = 1,
                 padding: int = 1, act: bool = True, extras: bool = True) -> None:
        layers: list[nn.Module] = [nn.Conv2d(c_in, c_out, kernel, stride, padding)]
        if p["bn"]:
            layers.append(nn.BatchNorm2d(c_out))
        layers.append(p["act"]())
        if extras and p["dropout"]:
            layers.append(nn.Dropout(p["rate"]))
        super().__init__(*layers)


class _Residual(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int, p: dict[str, Any]) -> None:
        super().__init__()
        self.a = _ConvBlock(c_in, c_out, p, stride=stride)
        self.b = _ConvBlock(c_out, c_out, p)
        self.skip: nn.Module = nn.Identity()
        if c_in != c_out or stride != 1:
            self.skip = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride),
                                      nn.BatchNorm2d(c_out) if p["bn"] else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x)) + self.skip(x)


class _Dense(nn.Module):
    def __init__(self, c_in: int, growth: int, p: dict[str, Any]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_ConvBlock(c_in + i * growth, growth, p) for i in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        feats = [x]
        for layer in self.layers:
            feats.append(layer(torch.cat(feats, 1)))
        return torch.cat(feats, 1)


class _Transition(nn.Module):
    def __init__(self, c_in: int, c_out: int, p: dict[str, Any]) -> None:
        super().__init__()
        # the transition's ConvBlock gets the batch-norm flag only: default activation ReLU, no dropout
        self.conv = _ConvBlock(c_in, c_out, {**p, "act": nn.ReLU}, kernel=1, padding=0, extras=False)
        self.pool = nn.AvgPool2d(2, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        return self.pool(x) if x.size(2) > 1 and x.size(3) > 1 else x


class _CNN(nn.Module):
    def __init__(self, blocks: list[nn.Module], c_last: int, n_classes: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.pool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(c_last, n_classes)
        self.out = nn.Softmax(dim=1) if n_classes > 1 else nn.Sigmoid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.out(self.fc(torch.flatten(self.pool(x), 1)))


def _cnn_channels(arch: str, base: int, depth: int, i: int) -> int:
    top = 2048
    if arch == "pyramid":
        return min(int(base * ((top / base) ** (1 / depth)) ** i), top)
    if arch == "reverse_pyramid":
        return max(int(base / ((top / base) ** (1 / depth)) ** i), 1)
    if arch == "bottleneck":
        g = 2 if depth <= 2 else (top / base) ** (1 / (depth - 1))
        return base * 2 if i == 0 else min(int(base * g ** (i - 1)), top)
    if arch == "gradual":
        return min(int(base * ((top / base) ** (1 / (2 * depth))) ** i), top)
    if arch == "hourglass":
        half = depth // 2
        if i < half:
            return min(int(base * ((top / base) ** (1 / half)) ** i), top)
        return max(int(base * ((top / base) ** (1 / (depth - half))) ** (depth - i - 1)), base)
    if arch == "uniform":
        return base
    raise ValueError(f"unknown CNN architecture {arch!r}")


def build_cnn(p: dict[str, str], dense_pooling: int | None = None) -> nn.Module:
    """The CNN of a ``cnn`` row. ``dense_pooling``: the dense architecture's pooling frequency (drawn
    at random by the generator; :func:`build_model` tries both values)."""
    c_in, n_classes, depth = int(p["input_channels"]), int(p["num_classes"]), int(p["depth"])
    base, size, arch = int(p["base_filters"]), int(p["input_size"]), p["arch"]
    opts = {"bn": p.get("batchnorm") == "True", "dropout": p.get("dropout") == "True",
            "rate": float(p.get("dropout_rate", 0.5)), "act": _ACT[p.get("act", "relu")]}
    blocks: list[nn.Module] = []
    if arch == "residual":
        growth = (2048 / base) ** (1 / depth)
        current = size
        for i in range(depth // 2):
            c_out = min(int(base * growth ** i), 2048)
            stride = 2 if i % 2 == 1 and current > 7 else 1
            blocks.append(_Residual(c_in, c_out, stride, opts))
            c_in = c_out
            if stride == 2:
                current //= 2
            if current <= 7:
                break
    elif arch == "dense":
        freq = dense_pooling or 5
        count = depth // 4
        for i in range(count):
            blocks.append(_Dense(c_in, 32, opts))
            c_in += 32 * 4
            if i % freq == 0 and i != count - 1:
                blocks.append(_Transition(c_in, c_in // 2, opts))
                c_in //= 2
    else:
        for i in range(depth):
            c_out = _cnn_channels(arch, base, depth, i)
            blocks.append(_ConvBlock(c_in, c_out, opts))
            c_in = c_out
    return _CNN(blocks, c_in, n_classes)


def count_params(model: nn.Module) -> int:
    """Parameters of ``model`` as the rows' ``Total Parameters`` count them: every parameter except
    PReLU's one weight per layer (the rows of PReLU models are short by exactly one per PReLU layer:
    the generators' summaries leave it out)."""
    prelu = sum(t.numel() for m in model.modules() if isinstance(m, nn.PReLU) for t in m.parameters())
    return sum(t.numel() for t in model.parameters()) - prelu


def _dense_frequencies(p: dict[str, str]) -> list[int]:
    depth, size = int(p["depth"]), int(p["input_size"])
    poolings = max(1, int(math.log2(size // 7))) if size // 7 >= 1 else 1
    return sorted({max(1, math.ceil(depth / poolings)), 5})


def build_model(p: dict[str, str], total_params: int | None = None) -> nn.Module:
    """The row's model on the current default device (``with torch.device("meta")`` for no memory).
    For a dense CNN the pooling frequency whose parameter count equals ``total_params`` is taken."""
    if "input_channels" not in p:
        return build_mlp(p)
    if p["arch"] != "dense":
        return build_cnn(p)
    candidates = [build_cnn(p, f) for f in _dense_frequencies(p)]
    for model in candidates:
        if total_params is None or count_params(model) == total_params:
            return model
    return candidates[0]


def check_params(row: dict[str, str]) -> tuple[int, int]:
    """(rebuilt parameter count, the row's ``Total Parameters``), the model built on meta."""
    p = parse_filename(row["Filename"])
    with torch.device("meta"):
        model = build_model(p, int(row["Total Parameters"]))
    return count_params(model), int(row["Total Parameters"])


def make_workload_for(row: dict[str, str]) -> Any:
    """The ``make_workload(batch_size, device)`` of a row (the ``target=python`` protocol): the rebuilt
    model, Adam with torch's defaults, one random batch of the row's shapes (fp32 inputs, int64
    labels as ``DataLoader`` collates them), cross-entropy (``BCEWithLogitsLoss`` for one output)."""
    p = parse_filename(row["Filename"])
    total = int(row["Total Parameters"])
    cnn = "input_channels" in p

    def make_workload(batch_size: int, device: Any) -> dict[str, Any]:
        model = build_model(p, total).to(device)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        n = min(batch_size, NUM_SAMPLES)
        if cnn:
            size = int(p["input_size"])
            x = torch.randn(n, int(p["input_channels"]), size, size, device=device)
            classes = int(p["num_classes"])
        else:
            x = torch.randn(n, int(p["input"]), device=device)
            classes = int(p["output"])
        if classes > 1:
            y = torch.randint(0, classes, (n,), device=device)
            return {"model": model, "optimizer": optimizer, "batches": [(x, y)]}
        y = torch.randint(0, 2, (n, 1), device=device).float()
        return {"model": model, "optimizer": optimizer, "batches": [(x, y)],
                "loss_fn": nn.functional.binary_cross_entropy_with_logits}

    return make_workload
