"""The built-in models, built from code with random weights (nothing is ever downloaded).

Each builder takes the Hydra ``model`` group as a plain mapping and returns the module plus a
function making one synthetic batch ``(inputs, targets)`` on a given device.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from oomtune.exceptions import ConfigError
from oomtune.workloads.shapes import shape_distribution

__all__ = ["MODEL_NAMES", "ModelSpec", "build_model", "DecoderLM", "Checkpointed", "cfg_int", "cfg_float", "cfg_bool",
           "cfg_choice"]

from oomtune.workloads.keys import MODEL_NAMES, RESNET_DEPTHS, cfg_bool, cfg_choice, cfg_float, cfg_int  # noqa: E402

#: ``make_batch(batch_size, device, shape=None)``: ``shape`` is the step's ``seq_len`` / ``image_size``
#: (None: the model's fixed or largest one; see :mod:`oomtune.workloads.shapes`).
BatchFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class ModelSpec:
    """A built model: ``module``, ``make_batch(batch_size, device, shape=None)`` and the input
    description; ``shapes`` is the per-step :class:`~oomtune.workloads.shapes.ShapeDistribution`.

    ``kind`` is ``"image"`` (inputs N x 3 x H x W float, targets N int64 class ids), ``"tokens"``
    (inputs and targets N x seq_len int64 token ids) or ``"vector"`` (N x in_features float, N int64).
    """

    def __init__(self, module: nn.Module, kind: str, make_batch: BatchFn, **info: Any) -> None:
        self.module, self.kind, self.make_batch, self.info = module, kind, make_batch, info
        self.shapes = shape_distribution({})


def _torchvision() -> Any:
    """``torchvision``, imported.

    Raises:
        ConfigError: it is not installed, or it was built for another torch (its compiled operators
            fail to load: ``operator torchvision::nms does not exist``), in one line naming both
            versions (read from package metadata) and the fix.
    """
    import importlib

    try:
        return importlib.import_module("torchvision")
    except (ImportError, RuntimeError, OSError) as exc:
        from oomtune.packages import installed_version

        tv = installed_version("torchvision")
        what = "is not installed" if tv is None else f"{tv} does not work with torch {torch.__version__}"
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        # a CPU build of torch (its version ends in "+cpu") is reinstalled from PyTorch's CPU index: from the
        # default index pip would take the CUDA build and its ~5.6 GB of nvidia-* wheels (README, Quick start)
        index = " --index-url https://download.pytorch.org/whl/cpu" if "+cpu" in str(torch.__version__) else ""
        raise ConfigError(f"model=resnet needs torchvision, which {what} ({first}): install the torchvision built "
                          "for this torch: reinstall both from one index, e.g. pip install --force-reinstall torch "
                          f"torchvision{index} (plain 'pip install' keeps the installed pair)") from None


def _resnet(cfg: Mapping[str, Any]) -> ModelSpec:
    torchvision = _torchvision()

    depth = cfg_choice(cfg, "depth", 50, RESNET_DEPTHS)
    shapes = shape_distribution(cfg)   # image_size: one size, or a list (multi-scale)
    size = shapes.max_shape
    classes = cfg_int(cfg, "num_classes", 1000)
    channels_last = cfg_bool(cfg, "channels_last", False)
    module = getattr(torchvision.models, f"resnet{depth}")(weights=None, num_classes=classes)
    if cfg_bool(cfg, "activation_checkpointing", False, prefix=""):
        for name in ("layer1", "layer2", "layer3", "layer4"):   # each residual stage recomputed in backward
            setattr(module, name, Checkpointed(getattr(module, name)))
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    if channels_last:
        module = module.to(memory_format=torch.channels_last)

    def make_batch(n: int, device: torch.device, shape: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        s = size if shape is None else shape
        x = torch.randn(n, 3, s, s, device=device).contiguous(memory_format=fmt)
        return x, torch.randint(0, classes, (n,), device=device)

    spec = ModelSpec(module, "image", make_batch, image_size=size, num_classes=classes,
                     memory_format=fmt)
    spec.shapes = shapes
    return spec


class Checkpointed(nn.Module):
    """``inner`` run under activation checkpointing (``torch.utils.checkpoint.checkpoint`` with
    ``use_reentrant=False``): its forward keeps only its inputs for backward and recomputes the rest
    there, as ``gradient_checkpointing_enable()`` does per block in Hugging Face models. The
    parameters are ``inner``'s (state dict keys gain an ``inner.`` prefix)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        from torch.utils.checkpoint import checkpoint

        if not torch.is_grad_enabled():
            return self.inner(*args, **kwargs)
        return checkpoint(self.inner, *args, use_reentrant=False, **kwargs)


class DecoderLM(nn.Module):
    """A decoder-only language model: token + learned position embeddings, ``layers`` pre-norm
    ``nn.TransformerEncoderLayer`` blocks under a causal mask, a final LayerNorm and an untied
    vocabulary head. Input ``(N, T)`` int64 token ids, output ``(N, T, vocab_size)`` logits.
    ``checkpointing``: each block runs under activation checkpointing (:class:`Checkpointed`).
    """

    def __init__(self, *, vocab_size: int, d_model: int, heads: int, layers: int, seq_len: int,
                 dropout: float, checkpointing: bool = False) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.checkpointing = checkpointing
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        block = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout,
                                           activation="gelu", batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        h = self.tok(idx) + self.pos(pos)
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=idx.device, dtype=h.dtype)
        if self.checkpointing and torch.is_grad_enabled():
            from torch.utils.checkpoint import checkpoint

            # the encoder's own loop (no nested tensors, no final norm), one checkpoint per block
            for layer in self.blocks.layers:
                h = checkpoint(layer, h, mask, None, True, use_reentrant=False)
        else:
            h = self.blocks(h, mask=mask, is_causal=True)
        return self.head(self.norm(h))


def _transformer(cfg: Mapping[str, Any]) -> ModelSpec:
    d_model = cfg_int(cfg, "d_model", 512)
    heads = cfg_int(cfg, "heads", 8)
    if d_model % heads:
        raise ConfigError(f"model.d_model={d_model} is not divisible by model.heads={heads}")
    shapes = shape_distribution(cfg)   # seq_len: fixed, a uniform range or a token file's documents
    seq_len = shapes.max_shape
    if cfg.get("max_seq_len") is not None:   # set by shapes.at_shape: keep the distribution's embedding
        seq_len = max(seq_len, cfg_int(cfg, "max_seq_len", seq_len))
    vocab = cfg_int(cfg, "vocab_size", 50304, minimum=2)
    module = DecoderLM(vocab_size=vocab, d_model=d_model, heads=heads, seq_len=seq_len,
                       layers=cfg_int(cfg, "layers", 6),
                       dropout=cfg_float(cfg, "dropout", 0.1, hi=1.0),
                       checkpointing=cfg_bool(cfg, "activation_checkpointing", False, prefix=""))

    fixed_len = shapes.max_shape

    def make_batch(n: int, device: torch.device, shape: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        t = fixed_len if shape is None else shape
        return (torch.randint(0, vocab, (n, t), device=device),
                torch.randint(0, vocab, (n, t), device=device))

    spec = ModelSpec(module, "tokens", make_batch, seq_len=fixed_len, vocab_size=vocab)
    spec.shapes = shapes
    return spec


def _mlp(cfg: Mapping[str, Any]) -> ModelSpec:
    if cfg_bool(cfg, "activation_checkpointing", False, prefix=""):
        raise ConfigError("activation_checkpointing=true: the built-in mlp has no activation checkpointing "
                          "(the transformer and the resnet have); leave it out of search.space")
    in_features = cfg_int(cfg, "in_features", 1024)
    hidden = cfg_int(cfg, "hidden", 4096)
    classes = cfg_int(cfg, "num_classes", 1000)
    mods: list[nn.Module] = []
    width = in_features
    for _ in range(cfg_int(cfg, "layers", 2, minimum=0)):
        mods += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    mods.append(nn.Linear(width, classes))

    def make_batch(n: int, device: torch.device, shape: None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.randn(n, in_features, device=device),
                torch.randint(0, classes, (n,), device=device))

    return ModelSpec(nn.Sequential(*mods), "vector", make_batch, in_features=in_features,
                     num_classes=classes)


_BUILDERS = {"mlp": _mlp, "resnet": _resnet, "transformer": _transformer}


def build_model(cfg: Mapping[str, Any], device: torch.device) -> ModelSpec:
    """Build the model named by ``cfg["name"]`` directly on ``device`` (meta allowed).
    ``cfg["activation_checkpointing"]`` (transformer, resnet): blocks / stages recomputed in
    backward (:class:`Checkpointed`).

    Raises:
        ConfigError: unknown model name or a bad model parameter.
    """
    name = cfg.get("name")
    if not isinstance(name, str) or name not in _BUILDERS:
        raise ConfigError(f"unknown model {name!r}: choose one of {', '.join(MODEL_NAMES)}")
    with torch.device(device):
        spec = _BUILDERS[name](cfg)
    return spec
