"""Data sources for the built-in workloads: synthetic, an image folder, or a token file.

``data`` mapping keys (all optional): ``source`` (``synthetic`` | ``imagefolder`` | ``tokens``,
default synthetic), ``path``, ``num_workers`` (0), ``pin_memory`` (False), ``prefetch_factor``
(torch's default 2 when workers > 0), ``decode_delay_s`` (0: synthetic only, a per-sample CPU sleep
in the loader that emulates slow decoding, field case C11).

Synthetic batches follow the model's shape distribution (:mod:`oomtune.workloads.shapes`): one
static batch for a fixed shape, a fresh batch per step in the distribution's seeded order otherwise.

Token file format: a raw little-endian ``uint16`` array of token ids with no header (nanoGPT's
``train.bin``); each sample is a random window of ``seq_len + 1`` tokens (inputs, targets shifted
by one).
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from oomtune.exceptions import ConfigError
from oomtune.workloads.models import ModelSpec, cfg_bool, cfg_float, cfg_int

__all__ = ["SOURCES", "make_batches", "check_data_config", "TokenWindows", "DelayDataset"]

SOURCES = ("synthetic", "imagefolder", "tokens")
Batch = tuple[torch.Tensor, torch.Tensor]


class DelayDataset(Dataset):
    """``length`` placeholder samples, each costing ``delay_s`` seconds of CPU-side sleep."""

    def __init__(self, delay_s: float, length: int = 1 << 30) -> None:
        self.delay_s, self.length = delay_s, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> int:
        time.sleep(self.delay_s)
        return i


class TokenWindows(Dataset):
    """Windows of ``seq_len + 1`` tokens from a raw little-endian uint16 file.

    Sample ``i`` is ``(tokens[i : i + seq_len], tokens[i + 1 : i + seq_len + 1])`` as int64.

    Raises:
        ConfigError: the file is missing, not a whole number of uint16 values, or shorter than
            ``seq_len + 1`` tokens.
    """

    def __init__(self, path: str, seq_len: int) -> None:
        if not os.path.isfile(path):
            raise ConfigError(f"model.data.path={path!r}: token file not found")
        size = os.path.getsize(path)
        if size % 2:
            raise ConfigError(f"token file {path!r}: {size} bytes is not a whole number of uint16")
        if size // 2 < seq_len + 1:
            raise ConfigError(f"token file {path!r}: {size // 2} tokens, need at least "
                              f"seq_len + 1 = {seq_len + 1}")
        self.path, self.seq_len, self.n_tokens = path, seq_len, size // 2
        self._data: np.memmap | None = None   # opened lazily (once per loader worker)

    def __len__(self) -> int:
        return self.n_tokens - self.seq_len

    def __getitem__(self, i: int) -> Batch:
        if self._data is None:
            self._data = np.memmap(self.path, dtype="<u2", mode="r")
        chunk = torch.from_numpy(self._data[i: i + self.seq_len + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]


_DATA = "model.data."


def _loader_kwargs(data: Mapping[str, Any], batch_size: int) -> dict[str, Any]:
    """DataLoader keyword arguments from the ``data`` mapping, type-checked.

    ``prefetch_factor`` is passed only with ``num_workers`` > 0: torch's DataLoader raises
    ``ValueError`` for a prefetch factor without workers. :func:`check_data_config` refuses that
    combination in the user's config; here (a built trial, whose data settings may come from a
    searched combination) it is dropped, since it has no effect without workers.

    Raises:
        ConfigError: ``num_workers`` not an int >= 0, ``pin_memory`` not a bool, ``prefetch_factor``
            neither null nor an int >= 1.
    """
    workers = cfg_int(data, "num_workers", 0, minimum=0, prefix=_DATA)
    kw: dict[str, Any] = {"batch_size": batch_size, "num_workers": workers,
                          "pin_memory": cfg_bool(data, "pin_memory", False, prefix=_DATA), "drop_last": True}
    prefetch = data.get("prefetch_factor")
    if prefetch is not None:
        cfg_int(data, "prefetch_factor", 2, minimum=1, prefix=_DATA)
        if workers > 0:
            kw["prefetch_factor"] = prefetch
    return kw


def _decode_delay(data: Mapping[str, Any]) -> float:
    """``decode_delay_s`` in seconds: null means 0; else a finite number >= 0 (ConfigError)."""
    if data.get("decode_delay_s") is None:
        return 0.0
    return cfg_float(data, "decode_delay_s", 0.0, prefix=_DATA)


def _forever(loader: DataLoader) -> Iterator[Any]:
    while True:
        yielded = False
        for item in loader:
            yielded = True
            yield item
        if not yielded:
            raise ConfigError("the dataset has fewer samples than one batch")


def _to_device(batches: Iterator[Batch], device: torch.device, non_blocking: bool) -> Iterator[Batch]:
    for x, y in batches:
        yield x.to(device, non_blocking=non_blocking), y.to(device, non_blocking=non_blocking)


def _synthetic(spec: ModelSpec, data: Mapping[str, Any], batch_size: int,
               device: torch.device) -> tuple[Iterator[Batch], Batch | None]:
    """Fixed shapes: one batch made once on the device and reused every step (static, returned).
    Variable shapes (:mod:`oomtune.workloads.shapes`): a new batch per step in the distribution's
    seeded order, made when the step asks for it and released when the step drops it (no static
    batch)."""
    delay = _decode_delay(data)
    kw = _loader_kwargs(data, batch_size)   # checked even when unused, as in a real-data run
    if spec.shapes.is_fixed:
        static: Batch | None = spec.make_batch(batch_size, device)
        ticks: Iterator[Any] = itertools.repeat(None)
    else:
        static = None
    if delay > 0:
        kw["pin_memory"] = False   # the placeholders never go to the device
        ticks = _forever(DataLoader(DelayDataset(float(delay)), **kw))
    if static is not None:
        return (static for _ in ticks), static
    shapes = spec.shapes.iter_shapes(batch_size)
    if delay == 0:
        return (spec.make_batch(batch_size, device, s) for s in shapes), None
    return (spec.make_batch(batch_size, device, s) for s, _ in zip(shapes, ticks)), None


def check_data_config(spec: ModelSpec, data: Mapping[str, Any] | None) -> None:
    """Validate the ``data`` mapping for ``spec`` without opening a loader: ``source`` one of
    :data:`SOURCES`, ``path`` a string (and an existing file/folder for real data), ``num_workers``
    an int >= 0, ``pin_memory`` a bool, ``prefetch_factor`` null or an int >= 1 and only with
    ``num_workers`` > 0 (torch's DataLoader rule), ``decode_delay_s`` a finite number >= 0.

    Raises:
        ConfigError: the first problem, naming the key and the value.
    """
    data = _as_mapping(data)
    source = _source(data)
    kw = _loader_kwargs(data, 1)
    if data.get("prefetch_factor") is not None and kw["num_workers"] == 0:
        raise ConfigError(f"model.data.prefetch_factor={data['prefetch_factor']!r} needs model.data.num_workers "
                          "> 0 (torch's DataLoader takes a prefetch factor only with worker processes); "
                          "set it to null or add workers")
    _decode_delay(data)
    path = data.get("path")
    if path is not None and not isinstance(path, str):
        raise ConfigError(f"model.data.path={path!r}: expected a path string or null")
    if source == "synthetic":
        return
    _real_dataset(spec, data, source)


def _as_mapping(data: Any) -> dict[str, Any]:
    """The ``data`` group as a dict (None: {}). Raises ConfigError for anything but a mapping."""
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"model.data={data!r}: expected a mapping such as {{source: synthetic}}")
    return dict(data)


def _source(data: Mapping[str, Any]) -> str:
    source = data.get("source", "synthetic")
    if not isinstance(source, str) or source not in SOURCES:
        raise ConfigError(f"model.data.source={source!r}: choose one of {', '.join(SOURCES)}")
    return source


def make_batches(spec: ModelSpec, data: Mapping[str, Any] | None, batch_size: int,
                 device: torch.device) -> tuple[Iterator[Batch], Batch | None]:
    """An endless iterator of ``(inputs, targets)`` on ``device``, and the static synthetic batch
    (None for real data), which stays allocated for the whole run.

    Raises:
        ConfigError: unknown source, missing path, a source that does not fit the model, real data
            asked for on the meta device, or bad loader settings.
    """
    data = _as_mapping(data)
    source = _source(data)
    if source == "synthetic":
        return _synthetic(spec, data, batch_size, device)
    if device.type == "meta":
        raise ConfigError(f"model.data.source={source!r}: the meta device takes synthetic data only")
    kw = _loader_kwargs(data, batch_size)
    dataset = _real_dataset(spec, data, source)
    loader = DataLoader(dataset, shuffle=True, persistent_workers=kw["num_workers"] > 0, **kw)
    return _to_device(_forever(loader), device, kw["pin_memory"]), None


def _real_dataset(spec: ModelSpec, data: Mapping[str, Any], source: str) -> Dataset:
    path = data.get("path")
    if not spec.shapes.is_fixed:
        raise ConfigError(f"model.{spec.shapes.key}: a shape distribution shapes synthetic batches; "
                          f"with model.data.source={source!r} give one fixed {spec.shapes.key}")
    if not path:
        raise ConfigError(f"model.data.source={source!r} needs model.data.path")
    if source == "imagefolder":
        if spec.kind != "image":
            raise ConfigError("model.data.source='imagefolder' needs an image model (resnet)")
        return _image_folder(str(path), spec.info["image_size"])
    if spec.kind != "tokens":
        raise ConfigError("model.data.source='tokens' needs a token model (transformer)")
    return TokenWindows(str(path), spec.info["seq_len"])


def _image_folder(path: str, image_size: int) -> Dataset:
    from torchvision import datasets, transforms

    if not os.path.isdir(path):
        raise ConfigError(f"model.data.path={path!r}: image folder not found")
    tf = transforms.Compose([transforms.Resize(image_size), transforms.CenterCrop(image_size),
                             transforms.ToTensor()])
    try:
        return datasets.ImageFolder(path, transform=tf)
    except FileNotFoundError as e:   # no class folders / no images
        raise ConfigError(f"model.data.path={path!r}: {e}") from None
