"""Shape distributions of the built-in workloads: which input shape each training step sees.

Real out-of-memory failures after hours of training come from varying shapes (padded text of
varying length, multi-scale images): the caching allocator's cache fragments over hundreds of steps.
A distribution turns one ``model`` key into a deterministic, seeded sequence of per-step shapes,
the same run after run, shared by the live trial (its synthetic batches) and the virtual-GPU soak
(:mod:`oomtune.trial.soak`).

Spellings (Hydra YAML or overrides):

* transformer ``seq_len`` (tokens per sequence; the batch is ``N x seq_len``):

  - ``256``: fixed (the static synthetic batch of earlier versions, allocated once).
  - ``{low: 64, high: 512, pad_multiple: 8, seed: 0}``: each step's padded length drawn uniformly
    from ``[low, high]``, rounded up to a multiple of ``pad_multiple`` (default 8, as Hugging Face's
    ``pad_to_multiple_of``).
  - ``{tokens: train.bin, eos_token: 50256, max: 1024, pad_multiple: 8, seed: 0}``: document lengths
    of a token file, padded per batch to the batch maximum (dynamic padding, as
    ``DataCollatorWithPadding`` does). The file is a raw little-endian ``uint16`` array (nanoGPT's
    ``train.bin``); documents are delimited by ``eos_token``: each document ends with (and counts)
    one ``eos_token``, a non-empty tail after the last one is a document too, empty documents
    (two ``eos_token`` in a row) count as length 1. A document longer than ``max`` is truncated to
    ``max`` (the model's context). Each epoch visits the documents in a seeded random order; batch
    ``i`` holds documents ``i*N .. i*N+N-1`` of that order and is padded to their longest length,
    rounded up to ``pad_multiple`` and capped at ``max``.

* resnet ``image_size`` (pixels per side; the batch is ``N x 3 x s x s``):

  - ``64``: fixed.
  - ``[64, 96, 128]`` or ``{sizes: [64, 96, 128], seed: 0}``: multi-scale training, one size per
    step drawn uniformly from the list.

The position embedding of the transformer is sized to the distribution's largest length
(:attr:`ShapeDistribution.max_shape`), so every shape of a distribution trains the same parameters.
Variable shapes apply to synthetic data (their content is random; memory depends on the shape only);
with ``data.source=tokens`` or ``imagefolder`` the shape must be fixed.

A python entry (``target=python``) declares its distribution the same way in its ``target`` group
(``target.seq_len=...`` or ``target.image_size=...``) and returns a ``make_batch(shape)`` that makes
one batch of that shape (:func:`entry_shape_distribution`, :mod:`oomtune.targets.python_entry`).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from oomtune.exceptions import ConfigError

__all__ = ["SHAPE_KEYS", "ShapeDistribution", "shape_distribution", "entry_shape_distribution", "worst_shapes",
           "at_shape", "document_lengths"]

#: The model key carrying the per-step shape, per built-in model (mlp has fixed shapes).
SHAPE_KEYS = {"transformer": "seq_len", "resnet": "image_size"}
_DEFAULTS = {"seq_len": 512, "image_size": 224}
_MINIMUM = {"seq_len": 1, "image_size": 8}


def _int(value: Any, where: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{where}={value!r}: expected an integer >= {minimum}")
    return value


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class ShapeDistribution:
    """The per-step shapes of one workload (ints: ``seq_len`` in tokens or ``image_size`` in pixels).

    Attributes:
        key: the model key (``seq_len`` / ``image_size``; ``None`` for models without one).
        kind: ``fixed``, ``uniform``, ``documents`` or ``choice``.
        values: fixed: ``(v,)``; uniform: ``(low, high)``; choice: the sizes; documents: ``()``.
        pad_multiple: padded lengths are rounded up to a multiple of this (1 for images).
        max_shape: the largest shape the sequence can hold (sizes the position embedding).
        seed: seeds the sequence (``numpy.random.default_rng(seed)``).
        lengths: documents only: the documents' lengths in tokens, truncated to ``max_shape``.
    """

    key: str | None
    kind: str
    values: tuple[int, ...]
    pad_multiple: int = 1
    max_shape: int | None = None
    seed: int = 0
    lengths: np.ndarray | None = field(default=None, repr=False, compare=False)

    @property
    def is_fixed(self) -> bool:
        """True when every step has the same shape (one static batch, as before distributions)."""
        return self.kind == "fixed"

    def iter_shapes(self, batch_size: int) -> Iterator[int | None]:
        """The endless, seeded sequence of per-step shapes for ``batch_size`` samples per step."""
        if self.kind == "fixed":
            yield from itertools.repeat(self.values[0] if self.values else None)
            return
        rng = np.random.default_rng(self.seed)
        if self.kind == "uniform":
            low, high = self.values
            while True:
                yield min(_round_up(int(rng.integers(low, high + 1)), self.pad_multiple), self.max_shape)
        elif self.kind == "choice":
            while True:
                yield self.values[int(rng.integers(len(self.values)))]
        else:  # documents: epochs of a seeded permutation, batches padded to their longest document
            lengths = self.lengths
            per_epoch = len(lengths) // batch_size
            if per_epoch == 0:
                raise ConfigError(f"the token file holds {len(lengths)} documents, fewer than one batch "
                                  f"of {batch_size}")
            while True:
                order = rng.permutation(len(lengths))
                for i in range(per_epoch):
                    longest = int(lengths[order[i * batch_size:(i + 1) * batch_size]].max())
                    yield min(_round_up(longest, self.pad_multiple), self.max_shape)

    def sequence(self, batch_size: int, steps: int) -> list[int | None]:
        """The first ``steps`` shapes of :meth:`iter_shapes` (step 1 first)."""
        return list(itertools.islice(self.iter_shapes(batch_size), steps))

    def support(self) -> list[int | None]:
        """Every shape the sequence can hold, ascending (documents: the padded lengths of single
        documents, an upper bound on the batch maxima's set)."""
        if self.kind == "fixed":
            return [self.values[0] if self.values else None]
        if self.kind == "choice":
            return sorted(set(self.values))
        if self.kind == "uniform":
            low, high = self.values
            return sorted({min(_round_up(v, self.pad_multiple), self.max_shape) for v in range(low, high + 1)})
        return sorted({min(_round_up(int(v), self.pad_multiple), self.max_shape) for v in np.unique(self.lengths)})


def document_lengths(path: str, eos_token: int) -> np.ndarray:
    """Lengths in tokens of the documents of a raw little-endian uint16 token file delimited by
    ``eos_token`` (see the module docstring for the exact rule), in file order (int64 array).

    Raises:
        ConfigError: missing file, odd size, an empty file.
    """
    if not os.path.isfile(path):
        raise ConfigError(f"token file {path!r} not found (model.seq_len.tokens)")
    size = os.path.getsize(path)
    if size % 2 or size == 0:
        raise ConfigError(f"token file {path!r}: {size} bytes is not a non-empty whole number of uint16")
    tokens = np.memmap(path, dtype="<u2", mode="r")
    ends = np.flatnonzero(tokens == eos_token) + 1   # one past each EOS
    bounds = np.concatenate(([0], ends, [] if len(ends) and ends[-1] == len(tokens) else [len(tokens)]))
    return np.diff(bounds).astype(np.int64)


def _from_mapping(key: str, spec: Mapping[str, Any], prefix: str = "model.") -> ShapeDistribution:
    where = f"{prefix}{key}"
    seed = spec.get("seed", 0)
    _int(seed, f"{where}.seed", 0)
    known = {"seq_len": {"low", "high", "tokens", "eos_token", "max", "pad_multiple", "seed"},
             "image_size": {"sizes", "seed"}}[key]
    unknown = sorted(set(spec) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r}; expected some of {', '.join(sorted(known))}")
    if key == "image_size":
        return _choice(key, spec.get("sizes"), seed, prefix)
    pad = _int(spec.get("pad_multiple", 8), f"{where}.pad_multiple", 1)
    if spec.get("tokens") is not None:
        path = spec["tokens"]
        if not isinstance(path, str):
            raise ConfigError(f"{where}.tokens={path!r}: expected a token file path")
        eos = _int(spec.get("eos_token"), f"{where}.eos_token", 0)
        top = _int(spec.get("max"), f"{where}.max", 1)
        lengths = np.minimum(document_lengths(path, eos), top)
        return ShapeDistribution(key, "documents", (), pad, top, seed, lengths)
    if "low" not in spec or "high" not in spec:
        raise ConfigError(f"{where}: give a uniform range {{low: 64, high: 512}} or a token file "
                          f"{{tokens: PATH, eos_token: ID, max: 1024}}")
    low = _int(spec["low"], f"{where}.low", 1)
    high = _int(spec["high"], f"{where}.high", low)
    return ShapeDistribution(key, "uniform", (low, high), pad, _round_up(high, pad), seed)


def _choice(key: str, sizes: Any, seed: int, prefix: str = "model.") -> ShapeDistribution:
    where = f"{prefix}{key}"
    if not isinstance(sizes, (list, tuple)) or not sizes:
        raise ConfigError(f"{where}={sizes!r}: expected a non-empty list of sizes such as [64, 96, 128]")
    values = tuple(_int(v, f"{where}[{i}]", _MINIMUM[key]) for i, v in enumerate(sizes))
    return ShapeDistribution(key, "choice", values, 1, max(values), seed)


def shape_distribution(model_cfg: Mapping[str, Any], *, key: str | None = None,
                       prefix: str = "model.") -> ShapeDistribution:
    """The shape distribution of a ``model`` group (plain mapping; Hydra containers converted).

    ``key``: read this key (``seq_len`` or ``image_size``) instead of the model's own, with
    ``prefix`` in messages: a python entry's ``target.seq_len`` / ``target.image_size``
    (:func:`entry_shape_distribution`).

    Raises:
        ConfigError: a malformed distribution (naming the key and how to write it).
    """
    key = key or SHAPE_KEYS.get(str(model_cfg.get("name")))
    if key is None:
        return ShapeDistribution(None, "fixed", ())
    value = model_cfg.get(key, _DEFAULTS[key])
    if hasattr(value, "items") and not isinstance(value, Mapping):   # OmegaConf DictConfig
        value = dict(value.items())
    if isinstance(value, Mapping):
        return _from_mapping(key, value, prefix)
    if isinstance(value, (list, tuple)) or (hasattr(value, "__len__") and not isinstance(value, str)):
        if key != "image_size":
            raise ConfigError(f"{prefix}{key}={value!r}: a list is for image sizes; write a range "
                              f"{{low: 64, high: 512}} or a token file {{tokens: PATH, eos_token: ID, max: N}}")
        return _choice(key, list(value), 0, prefix)
    v = _int(value, f"{prefix}{key}", _MINIMUM[key])
    return ShapeDistribution(key, "fixed", (v,), 1, v)


def entry_shape_distribution(target_cfg: Mapping[str, Any]) -> ShapeDistribution:
    """The shape distribution a python entry declares in its ``target`` group: ``target.seq_len``
    or ``target.image_size``, spelled as the built-in models' (module docstring); fixed (no key)
    when it declares none.

    Raises:
        ConfigError: both keys given, or a malformed distribution.
    """
    given = [k for k in ("seq_len", "image_size") if target_cfg.get(k) is not None]
    if len(given) > 1:
        raise ConfigError("target.seq_len and target.image_size: give one shape distribution")
    if not given:
        return ShapeDistribution(None, "fixed", ())
    return shape_distribution(target_cfg, key=given[0], prefix="target.")


def worst_shapes(model_cfg: Mapping[str, Any], k: int = 1) -> list[int | None]:
    """The ``k`` largest shapes the workload's distribution can produce, largest first (the longest
    padded length, the largest image size): what a confirmation run should meet.

    Raises:
        ConfigError: as :func:`shape_distribution`.
    """
    return sorted(shape_distribution(model_cfg).support(), key=lambda s: -1 if s is None else s,
                  reverse=True)[:k]


def at_shape(model_cfg: Mapping[str, Any], shape: int | None) -> dict[str, Any]:
    """A copy of ``model_cfg`` whose every step has ``shape`` (a fixed distribution), e.g. the worst
    shape for a confirmation run. The transformer keeps its position embedding at the original
    distribution's largest length (same parameters); ``shape`` None returns a plain copy.

    Raises:
        ConfigError: as :func:`shape_distribution`; ``shape`` above the distribution's largest.
    """
    cfg = dict(model_cfg)
    dist = shape_distribution(model_cfg)
    if shape is None or dist.key is None:
        return cfg
    if dist.max_shape is not None and shape > dist.max_shape:
        raise ConfigError(f"model.{dist.key}: shape {shape} is above the distribution's largest {dist.max_shape}")
    cfg[dist.key] = shape
    if dist.key == "seq_len" and dist.max_shape != shape:
        cfg["max_seq_len"] = dist.max_shape
    return cfg
