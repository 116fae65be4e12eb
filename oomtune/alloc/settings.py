"""PYTORCH_CUDA_ALLOC_CONF strings: parse, validate, render (the caching allocator's settings).

Reproduces ``ConfigTokenizer`` (c10/core/AllocatorConfig.h), ``AcceleratorAllocatorConfig::parseArgs``
(c10/core/AllocatorConfig.cpp) and ``CUDAAllocatorConfig::parseArgs`` (c10/cuda/CUDAAllocatorConfig.cpp),
checked against torch 2.14.1 (libc10.so strings and ``torch._C._accelerator_setAllocatorSettings``).
oomtune accepts what torch 2.14.1 accepts with a defined meaning, normalised by :meth:`render`: a
trailing ``,`` (``expandable_segments:True,``), a ``,`` before a list's ``]``, a ``+`` sign. It refuses
what torch refuses, naming torch's minimum (``max_split_size_mb:0`` -> "the minimum is 20"), and
what torch accepts without a defined meaning, saying what torch would do: its ``checkToken`` result
is ignored (``max_split_size_mb,512`` is read as 512), ``stoull`` takes a prefix (``20.5`` -> 20,
``-1`` wraps to SIZE_MAX), ``[]`` sets nothing, text after ``]`` is ignored, a repeated key silently
keeps its last value; a missing value or unclosed ``[`` is an INTERNAL ASSERT that aborts
``import torch`` (pytorch #186453). tests/test_alloc_settings.py checks every verdict against
torch's own parser (``torch._C._accelerator_setAllocatorSettings``).
Whitespace is dropped anywhere, as ``ConfigTokenizer`` does (``std::isspace``).
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from typing import Any, Mapping

from oomtune.alloc._conf_syntax import (
    _FLOAT_RE,
    _INTERVALS,
    _MAX_MB,
    _bad,
    _bool,
    _divisions,
    _divisions_mapping,
    _is_pow2,
    _mb_bytes,
    _split_pairs,
    _token,
    _uint,
)
from oomtune.exceptions import AllocatorConfigError
from oomtune.units import MiB

__all__ = ["AllocatorSettings", "supported_keys", "validate_alloc_conf", "effective_settings"]

_MIN_LARGE_ALLOC_MB = 10             # kMinLargeAlloc / kMB: large_segment_size_mb must be > this
_MAX_REGISTER_THREADS = 128          # pinned_max_register_threads() (torch 2.14.1 message)
_MODELLED = ("backend", "expandable_segments", "garbage_collection_threshold", "large_segment_size_mb",
             "max_non_split_rounding_mb", "max_split_size_mb", "pinned_num_register_threads",
             "pinned_use_background_threads", "pinned_use_cuda_host_register",
             "release_lock_on_cudamalloc", "roundup_power2_divisions")
_ALIASES = {"release_lock_on_hipmalloc": "release_lock_on_cudamalloc",   # torch accepts both spellings
            "pinned_use_hip_host_register": "pinned_use_cuda_host_register"}
# Key -> first torch (major, minor) that accepts it. The 2.14 set is verified against torch 2.14.1
# (tests/test_alloc_settings.py probes it); the earlier boundaries are [unverified] best estimates.
_SINCE = {"max_split_size_mb": (1, 10), "garbage_collection_threshold": (1, 12),
          "roundup_power2_divisions": (1, 12), "backend": (2, 0), "expandable_segments": (2, 1),
          "release_lock_on_cudamalloc": (2, 2), "release_lock_on_hipmalloc": (2, 2),
          "pinned_use_cuda_host_register": (2, 2), "pinned_use_hip_host_register": (2, 2),
          "pinned_num_register_threads": (2, 2), "max_non_split_rounding_mb": (2, 6),
          "pinned_use_background_threads": (2, 6), "graph_capture_record_stream_reuse": (2, 9),
          "per_process_memory_fraction": (2, 10), "pinned_reserve_segment_size_mb": (2, 10),
          "large_segment_size_mb": (2, 11), "throw_on_cudamalloc_oom": (2, 12),
          "pinned_free_catch_all": (2, 12), "pinned_max_round_threshold_mb": (2, 12),
          "pinned_max_cached_size_mb": (2, 12)}
_REMOVED = {"roundup_bypass_threshold_mb": ((1, 13), (2, 1))}   # [unverified] range; gone in 2.14.1
# '>' in the list form fills from last_index + 1 since the ConfigTokenizer rewrite (2.9); before, it
# filled from last_index and overwrote the last explicit entry [boundary version unverified].
_GT_FIX = (2, 9)
# torch's cudaMallocAsync backend never reads these (native caching allocator only); the host
# (pinned) allocator keys still apply. Torch itself warns only about the first three.
_NATIVE_ONLY = ("max_split_size_mb", "roundup_power2_divisions", "garbage_collection_threshold",
                "max_non_split_rounding_mb", "large_segment_size_mb", "expandable_segments",
                "release_lock_on_cudamalloc")



def _installed_torch() -> str | None:
    from oomtune.packages import installed_version

    return installed_version("torch")  # no ``import torch``: cheap, and never touches CUDA


def _version_tuple(torch_version: str | None) -> tuple[int, int] | None:
    """``"2.14.1+cu130"`` -> (2, 14); None -> the installed torch's, or None without torch."""
    torch_version = torch_version if torch_version is not None else _installed_torch()
    if torch_version is None:
        return None
    m = re.match(r"\s*(\d+)\.(\d+)", torch_version)
    if not m:
        raise AllocatorConfigError(f"torch version {torch_version!r} is not of the form 'MAJOR.MINOR[...]'")
    return int(m.group(1)), int(m.group(2))


def supported_keys(torch_version: str | None = None) -> frozenset[str]:
    """Keys that torch ``torch_version`` (default: the installed one) accepts in its alloc conf.

    Any other key makes torch raise ``ValueError: Unrecognized key 'K' in Accelerator allocator
    config.`` (2.9+; ``RuntimeError: Unrecognized CachingAllocator option: K`` before). Includes keys
    that oomtune does not model (e.g. ``per_process_memory_fraction``). Without torch installed, the
    newest known set. Source: ``AcceleratorAllocatorConfig::getKeys`` + ``CUDAAllocatorConfig::getKeys``.

    Raises:
        AllocatorConfigError: ``torch_version`` is not a version string.
    """
    v = _version_tuple(torch_version) or (99, 0)
    keys = {k for k, since in _SINCE.items() if v >= since}
    keys |= {k for k, (lo, hi) in _REMOVED.items() if lo <= v < hi}
    return frozenset(keys)



def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _mib_text(nbytes: int) -> str:
    """A byte count as the ``_mb`` value a user wrote (``512``), or ``N bytes`` when not whole MiB."""
    return str(nbytes // MiB) if nbytes % MiB == 0 else f"{nbytes} bytes"


@dataclasses.dataclass(frozen=True)
class AllocatorSettings:
    """The caching allocator's settings, sizes in bytes (a validated PYTORCH_CUDA_ALLOC_CONF).

    Defaults are torch's (``AcceleratorAllocatorConfig`` / ``CUDAAllocatorConfig``). The constructor
    applies torch's value checks; it raises :class:`AllocatorConfigError` naming the torch key.
    ``roundup_power2_divisions[k]`` is the division count for sizes with
    ``clamp(floor(log2 n) - 20, 0, 15) == k`` (``roundup_power2_divisions(size)``); 0 = off.
    """

    backend: str = "native"
    max_split_size_bytes: int | None = None          # None = unlimited (torch: SIZE_MAX)
    max_non_split_rounding_bytes: int = 20 * MiB
    garbage_collection_threshold: float = 0.0        # 0 = off
    roundup_power2_divisions: tuple[int, ...] = (0,) * _INTERVALS
    expandable_segments: bool = False
    large_segment_size_bytes: int = 20 * MiB
    release_lock_on_cudamalloc: bool = False
    pinned_use_cuda_host_register: bool = False
    pinned_num_register_threads: int = 1
    pinned_use_background_threads: bool = False

    def __post_init__(self) -> None:
        if self.backend not in ("native", "cudaMallocAsync"):
            raise _bad("backend", self.backend, "unknown: options are native and cudaMallocAsync")
        for name in ("expandable_segments", "release_lock_on_cudamalloc", "pinned_use_cuda_host_register",
                     "pinned_use_background_threads"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(name, repr(getattr(self, name)), "is not a boolean (True or False)")
        large_bytes = self.large_segment_size_bytes
        if _is_int(large_bytes) and large_bytes <= _MIN_LARGE_ALLOC_MB * MiB:  # before the MiB check: 0 too
            raise _bad("large_segment_size_mb", _mib_text(large_bytes),
                       f"too small: the minimum is {_MIN_LARGE_ALLOC_MB + 1} (MiB; torch: must be > {_MIN_LARGE_ALLOC_MB})")
        large = self._mib("large_segment_size_mb", large_bytes)
        for key, nbytes in (("max_split_size_mb", self.max_split_size_bytes),
                            ("max_non_split_rounding_mb", self.max_non_split_rounding_bytes)):
            # torch: "CachingAllocator option max_split_size_mb too small, must be >= 20" (the large
            # segment size, kLargeBuffer = 20 MiB by default); 0 included (not "unlimited": omit the key)
            if _is_int(nbytes) and nbytes < large * MiB:
                raise _bad(key, _mib_text(nbytes), f"too small: the minimum is {large} (MiB, the large segment "
                           f"size; torch: must be >= {large})" + ("; omit the key for no limit"
                                                                  if key == "max_split_size_mb" else ""))
            if nbytes is not None:
                self._mib(key, nbytes)
        gc = self.garbage_collection_threshold
        if isinstance(gc, bool) or not isinstance(gc, (int, float)) or not (gc == 0 or 0 < gc < 1):
            raise _bad("garbage_collection_threshold", gc, "invalid: set it in (0.0, 1.0) exclusive (0 = off)")
        object.__setattr__(self, "garbage_collection_threshold", float(gc))
        div = tuple(self.roundup_power2_divisions)
        if len(div) != _INTERVALS or any(isinstance(d, bool) or not isinstance(d, int) or d < 0
                                         or d >= 2**64 or (d and not _is_pow2(d)) for d in div):
            raise _bad("roundup_power2_divisions", div, "invalid: need 16 entries, each 0 or a power of 2")
        object.__setattr__(self, "roundup_power2_divisions", div)
        n = self.pinned_num_register_threads
        if isinstance(n, bool) or not isinstance(n, int) or not _is_pow2(n) or n > _MAX_REGISTER_THREADS:
            raise _bad("pinned_num_register_threads", n, f"invalid: must be a power of 2 <= {_MAX_REGISTER_THREADS}")

    @staticmethod
    def _mib(key: str, nbytes: Any) -> int:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0 or nbytes % MiB:
            raise AllocatorConfigError(f"{key}: {nbytes!r} bytes is not a positive whole number of MiB")
        if nbytes // MiB > _MAX_MB:
            raise _bad(key, nbytes // MiB, f"too large: must be <= {_MAX_MB} (MiB)")
        return nbytes // MiB

    @classmethod
    def parse(cls, text: str, *, torch_version: str | None = None) -> AllocatorSettings:
        """Parse a PYTORCH_CUDA_ALLOC_CONF string (``"key:value,key:[a:b,>:c]"``); "" = defaults.

        Args:
            text: the settings string. Keys are case-sensitive; whitespace anywhere is ignored.
            torch_version: when given (e.g. ``"2.11.0"``), also refuse keys that torch version does
                not know (see :func:`supported_keys`) and use its meaning of ``>`` in list form.

        Raises:
            AllocatorConfigError: malformed syntax, unknown or duplicate key, a key torch accepts but
                oomtune does not model, or a value outside torch's range (one line naming all three).
        """
        if not isinstance(text, str):
            raise AllocatorConfigError(f"allocator settings must be a string, got {type(text).__name__}")
        version = _version_tuple(torch_version) if torch_version is not None else None
        allowed = supported_keys(torch_version) if torch_version is not None else None
        values: dict[str, Any] = {}
        for key, value in _split_pairs(text):
            name = _ALIASES.get(key, key)
            if key in _REMOVED or (key not in _SINCE and key not in _ALIASES):
                import difflib

                close = difflib.get_close_matches(key, _MODELLED, n=1)   # difflib's default cutoff, 0.6
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise AllocatorConfigError(f"Unrecognized key {key!r} (torch raises 'Unrecognized key'); {hint}"
                                           f"oomtune models: {', '.join(_MODELLED)}")
            if allowed is not None and key not in allowed:
                raise AllocatorConfigError(f"key {key!r} is not known to torch {torch_version} (Unrecognized key)")
            if name not in _MODELLED:
                raise AllocatorConfigError(f"key {key!r} is accepted by torch but not modelled by oomtune; remove it")
            if name in values:
                raise AllocatorConfigError(f"duplicate key {name!r} in {text!r}: torch would keep the last value "
                                           "and silently ignore the first; give each key once")
            if isinstance(value, list) and name != "roundup_power2_divisions":
                raise AllocatorConfigError(f"{key} takes a single value, not a '[...]' list")
            values[name] = (key, value)
        return cls._from_tokens(values, gt_fix=version is None or version >= _GT_FIX)

    @classmethod
    def _from_tokens(cls, values: dict[str, Any], *, gt_fix: bool) -> AllocatorSettings:
        kw: dict[str, Any] = {}
        for name, (key, tok) in values.items():  # key: as the user spelled it (hip aliases)
            if name == "backend":
                kw["backend"] = tok
            elif name == "garbage_collection_threshold":
                if not _FLOAT_RE.fullmatch(tok) or not 0 < float(tok) < 1:
                    raise _bad(name, tok, "invalid: set it in (0.0, 1.0) exclusive (torch's range; for "
                               "off, omit the key)")
                kw[name] = float(tok)
            elif name == "roundup_power2_divisions":
                kw[name] = _divisions(tok, gt_fix)
            elif name == "pinned_num_register_threads":
                kw[name] = _uint(name, tok)
            elif name.endswith("_mb"):
                kw[name[:-3] + "_bytes"] = _mb_bytes(name, tok)
            else:
                kw[name] = _bool(key, tok)
        large = kw.get("large_segment_size_bytes", 20 * MiB)
        kw.setdefault("max_non_split_rounding_bytes", large)  # its default follows the large segment size
        return cls(**kw)

    def _full_mapping(self) -> dict[str, Any]:
        return {"backend": self.backend, "expandable_segments": self.expandable_segments,
                "garbage_collection_threshold": self.garbage_collection_threshold,
                "large_segment_size_mb": self.large_segment_size_bytes // MiB,
                "max_non_split_rounding_mb": self.max_non_split_rounding_bytes // MiB,
                "max_split_size_mb": None if self.max_split_size_bytes is None
                else self.max_split_size_bytes // MiB,
                "pinned_num_register_threads": self.pinned_num_register_threads,
                "pinned_use_background_threads": self.pinned_use_background_threads,
                "pinned_use_cuda_host_register": self.pinned_use_cuda_host_register,
                "release_lock_on_cudamalloc": self.release_lock_on_cudamalloc,
                "roundup_power2_divisions": _divisions_mapping(self.roundup_power2_divisions)}

    def as_mapping(self) -> dict[str, Any]:
        """The non-default settings as ``{torch key: value in torch's units}``, keys sorted.

        Sizes are ints in MiB (``max_split_size_mb``), booleans are bool, divisions an int or a
        ``{"MiB boundary" | ">": n}`` dict. ``{}`` for the defaults. ``max_non_split_rounding_mb``
        is always listed when ``large_segment_size_mb`` is, since torch's default for it follows the
        large segment size. Inverse: :meth:`from_mapping`.
        """
        full, default = self._full_mapping(), _DEFAULTS._full_mapping()
        keep_rounding = full["large_segment_size_mb"] != default["large_segment_size_mb"]
        return {k: v for k, v in full.items()
                if v != default[k] or (keep_rounding and k == "max_non_split_rounding_mb")}

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any], *,
                     torch_version: str | None = None) -> AllocatorSettings:
        """Build settings from ``{torch key: value}`` (Optuna params, best.yaml); missing keys = defaults.

        Values may be Python values or torch tokens (``True``/``"True"``, ``512``/``"512"``; divisions
        an int or a dict with int or str keys). "Off" values are accepted as the default:
        ``max_split_size_mb: None``, ``garbage_collection_threshold: 0``, ``roundup_power2_divisions: 0``.

        Raises:
            AllocatorConfigError: as :meth:`parse`, or ``mapping`` is not a mapping.
        """
        if not isinstance(mapping, Mapping):
            raise AllocatorConfigError(f"allocator settings mapping expected, got {type(mapping).__name__}")
        off = {"max_split_size_mb": (None,), "garbage_collection_threshold": (0, 0.0),
               "roundup_power2_divisions": (0,)}
        parts = []
        for key, value in mapping.items():
            if not isinstance(value, (Mapping, bool)) and value in off.get(str(key), ()):
                continue
            parts.append(f"{key}:{_token(value)}")
        return cls.parse(",".join(parts), torch_version=torch_version)

    def render(self) -> str:
        """The canonical PYTORCH_CUDA_ALLOC_CONF string: non-default keys, sorted; "" for defaults.

        ``AllocatorSettings.parse(s.render()) == s``; e.g. ``"expandable_segments:True,max_split_size_mb:512"``.
        """
        return ",".join(f"{k}:{_token(v)}" for k, v in self.as_mapping().items())

    def differences(self, other: AllocatorSettings) -> dict[str, tuple[Any, Any]]:
        """``{torch key: (self's value, other's value)}`` for every key whose value differs, in
        torch's units (``max_split_size_mb`` in MiB, None = unlimited); {} when they are equal."""
        mine, theirs = self._full_mapping(), other._full_mapping()
        return {k: (mine[k], theirs[k]) for k in mine if mine[k] != theirs[k]}

    def inert_keys(self) -> list[str]:
        """Keys set (non-default) that ``backend:cudaMallocAsync`` ignores; [] for the native backend."""
        if self.backend != "cudaMallocAsync":
            return []
        return [k for k in self.as_mapping() if k in _NATIVE_ONLY]


_DEFAULTS = AllocatorSettings()



def validate_alloc_conf(text: str) -> AllocatorSettings:
    """Full check of a PYTORCH_CUDA_ALLOC_CONF string against the installed torch.

    :meth:`AllocatorSettings.parse` with ``torch_version`` = the installed torch, plus a
    ``UserWarning`` naming the keys that ``backend:cudaMallocAsync`` makes inert (torch warns
    "backend:cudaMallocAsync ignores max_split_size_mb,roundup_power2_divisions, and ...").

    Raises:
        AllocatorConfigError: as :meth:`AllocatorSettings.parse`.
    """
    settings = AllocatorSettings.parse(text, torch_version=_installed_torch())
    inert = settings.inert_keys()
    if inert:
        warnings.warn(f"backend:cudaMallocAsync ignores {', '.join(inert)} (they have no effect)",
                      UserWarning, stacklevel=2)
    return settings


def effective_settings() -> dict[str, Any] | None:
    """What the running torch's CUDA allocator took, or None when CUDA is unavailable.

    **Initialises CUDA** in this process (creates a context on the current device), so call it
    only after the settings were set and in a process meant to use the GPU. Returns
    ``torch.cuda.memory._snapshot()["allocator_settings"]`` (torch's keys: ``PYTORCH_CUDA_ALLOC_CONF``
    (the string parsed), ``max_split_size`` in bytes, ``roundup_power2_divisions`` as
    {"1": d0, "2": d1, ..., "32768": d15}, ...) plus ``"backend"`` from
    ``torch.cuda.get_allocator_backend()``. Source: torch/csrc/cuda/Module.cpp ``_cuda_memorySnapshot``.
    """
    import torch

    if not torch.cuda.is_available():
        return None
    torch.cuda.init()
    result: dict[str, Any] = {"backend": torch.cuda.get_allocator_backend()}
    try:
        result.update(torch.cuda.memory._snapshot().get("allocator_settings") or {})
    except RuntimeError:  # cudaMallocAsync: snapshot metadata unsupported on some versions
        pass
    return result
