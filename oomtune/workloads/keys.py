"""The built-in workloads' ``model`` keys, checked without torch.

Refusing ``model.depth=19`` used to wait for ``import torch`` and torchvision (seconds; 17 s on a
loaded machine): the builders in :mod:`oomtune.workloads.models` validate their keys as they build.
:func:`check_model_keys` checks the same keys with the same helpers and messages first, importing
nothing heavy; the builders still check everything (this is an early subset, never a replacement).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from oomtune.exceptions import ConfigError

__all__ = ["MODEL_NAMES", "RESNET_DEPTHS", "OPTIMIZERS", "PRECISION_NAMES", "cfg_int", "cfg_float", "cfg_bool",
           "cfg_choice", "check_model_keys"]

MODEL_NAMES = ("mlp", "resnet", "transformer")
RESNET_DEPTHS = (18, 34, 50, 101, 152)
OPTIMIZERS = ("sgd", "adam", "adamw")
PRECISION_NAMES = ("fp32", "bf16", "fp16")


def cfg_int(cfg: Mapping[str, Any], key: str, default: int, *, minimum: int = 1,
            prefix: str = "model.") -> int:
    """``cfg[key]`` as an int >= ``minimum`` (a bool is not an int). Raises ConfigError naming the
    key and the value otherwise."""
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{prefix}{key}={value!r}: expected an integer >= {minimum}")
    return value


def cfg_float(cfg: Mapping[str, Any], key: str, default: float, *, lo: float = 0.0,
              hi: float = float("inf"), prefix: str = "model.") -> float:
    """``cfg[key]`` as a finite float in ``[lo, hi]`` (ints accepted, bools not). Raises
    ConfigError naming the key and the value otherwise."""
    value = cfg.get(key, default)
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or not lo <= value <= hi):
        where = f"in [{lo:g}, {hi:g}]" if math.isfinite(hi) else f">= {lo:g}"
        raise ConfigError(f"{prefix}{key}={value!r}: expected a finite number {where}")
    return float(value)


def cfg_bool(cfg: Mapping[str, Any], key: str, default: bool, *, prefix: str = "model.") -> bool:
    """``cfg[key]`` as a real bool (``true``/``false`` in YAML and Hydra overrides): ``"abc"``,
    ``1`` or ``"yes"`` are refused rather than read as truthy. Raises ConfigError naming the key."""
    value = cfg.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{prefix}{key}={value!r}: expected true or false")
    return value


def cfg_choice(cfg: Mapping[str, Any], key: str, default: Any, choices: Sequence[Any], *,
               prefix: str = "model.") -> Any:
    """``cfg[key]``, which must be one of ``choices`` (compared by type as well: ``True`` is not 1,
    ``18.0`` is not 18). Raises ConfigError naming the key, the value and the choices."""
    value = cfg.get(key, default)
    if not any(type(value) is type(c) and value == c for c in choices):
        raise ConfigError(f"{prefix}{key}={value!r}: choose one of {', '.join(str(c) for c in choices)}")
    return value


def check_model_keys(cfg: Mapping[str, Any]) -> None:
    """The ``model`` group's name and the keys each built-in model reads (type, range, choices,
    d_model divisible by heads), as the builders would refuse them, without importing torch. Keys of
    other groups (``target``, ``data``, shape distributions) are left to their own checks.

    Raises:
        ConfigError: the first problem, in one line (the builders' own message).
    """
    name = cfg.get("name")
    if not isinstance(name, str) or name not in MODEL_NAMES:
        raise ConfigError(f"unknown model {name!r}: choose one of {', '.join(MODEL_NAMES)}")
    cfg_choice(cfg, "optimizer", "sgd", OPTIMIZERS)
    cfg_float(cfg, "lr", 0.1)
    cfg_choice(cfg, "precision", "fp32", PRECISION_NAMES)
    if name == "resnet":
        cfg_choice(cfg, "depth", 50, RESNET_DEPTHS)
        cfg_int(cfg, "num_classes", 1000)
        cfg_bool(cfg, "channels_last", False)
    elif name == "transformer":
        d_model, heads = cfg_int(cfg, "d_model", 512), cfg_int(cfg, "heads", 8)
        if d_model % heads:
            raise ConfigError(f"model.d_model={d_model} is not divisible by model.heads={heads}")
        cfg_int(cfg, "vocab_size", 50304, minimum=2)
        cfg_int(cfg, "layers", 6)
        cfg_float(cfg, "dropout", 0.1, hi=1.0)
        if cfg.get("max_seq_len") is not None:
            cfg_int(cfg, "max_seq_len", 1)
    else:
        cfg_int(cfg, "in_features", 1024)
        cfg_int(cfg, "hidden", 4096)
        cfg_int(cfg, "num_classes", 1000)
        cfg_int(cfg, "layers", 2, minimum=0)
