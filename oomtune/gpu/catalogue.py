"""The device catalogue: one record per GPU card (``conf/devices/*.yaml``), the one source of what
oomtune knows about a card it may not have.

Each entry (a YAML mapping; copy one of ``conf/devices/`` to describe your own card and plan it with
``gpu=path/to/mycard.yaml``):

=========================  ==========================================================================
key                        meaning
=========================  ==========================================================================
name                       the catalogue key (``a100-40gb``, ``a100-40gb-1g.5gb``): ``gpu=NAME``
display_name               the name torch/NVML report (``A100-SXM4-40GB``), also accepted as ``gpu=``
family                     the kernel family: a ``model.gpu`` value (``a100``, ``t4``) or a compute
                           capability with SM count (``sm80:14``, a MIG slice). Cards of one family
                           run the same kernels and share one capture in a multi-card plan
family_name                display name of a named family (``A100``); optional
compute_capability         ``"8.0"`` (``cudaDeviceProp.major.minor``)
sm_count                   streaming multiprocessors (``multiProcessorCount``)
total_memory_bytes         ``torch.cuda.get_device_properties(i).total_memory`` (bytes; below
                           nvidia-smi's ``memory.total``); null: no sourced figure (budget= needed)
bf16                       native bf16: ``torch.cuda.is_bf16_supported(including_emulation=False)``,
                           compute capability >= 8.0 (the default call, ``including_emulation=True``,
                           answers True on every CUDA card: bf16 emulated below 8.0)
sdpa_backends              the attention backends the hardware supports, by sdp_utils.cpp's rules
cublas_workspace_bytes     one cuBLAS workspace (``getChosenWorkspaceSize``)
outside_allocator_bytes    memory outside the caching allocator (:mod:`oomtune.gpu.outside`)
mig                        optional ``{parent, profile}`` of a MIG instance
sources                    one line per figure: where it comes from (``total_memory_derivation``
                           says how a figure that is not a reading was derived)
=========================  ==========================================================================

Every entry is checked when read (:func:`load_card`): the fields that follow from the compute
capability (``bf16``, ``sdpa_backends``, ``cublas_workspace_bytes``) must agree with the rules they
come from, and every figure needs a source. A bad entry is one :class:`ConfigError` line naming the
file, the field and the fix. No torch import here: ``oomtune plan`` checks ``gpu=`` before anything.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from oomtune.exceptions import ConfigError

__all__ = ["Card", "catalogue", "card_named", "load_card", "resolve_cards", "sdpa_backends_for",
           "cublas_workspace_for", "CONTEXT_BYTES"]

#: Memory outside the allocator a catalogue card gets by default: the CUDA context under lazy module
#: loading (:data:`oomtune.gpu.outside.CONTEXT_LAZY_BYTES`, pytorch/pytorch#86509).
CONTEXT_BYTES = 266_076_160

_REQUIRED = ("name", "display_name", "family", "compute_capability", "sm_count", "total_memory_bytes", "bf16",
             "sdpa_backends", "cublas_workspace_bytes", "outside_allocator_bytes", "sources")
_OPTIONAL = ("family_name", "mig")
_FAMILY_SM = re.compile(r"sm(\d{1,2})(\d):(\d+)")


def sdpa_backends_for(capability: tuple[int, int]) -> list[str]:
    """The SDPA backends a GPU of ``capability`` supports in hardware (aten/src/ATen/native/
    transformers/cuda/sdp_utils.cpp: ``check_cudnn_hardware_support`` and
    ``check_flash_attention_hardware_support`` sm80-sm121, ``check_mem_efficient_hardware_support``
    sm50-sm121; math always), in torch's priority order. Which one runs also depends on the call
    (dtype, head size, mask): the capture decides that (:mod:`oomtune.capture.sdpa`)."""
    out = []
    if (8, 0) <= capability <= (12, 1):
        out += ["cudnn", "flash"]
    if (5, 0) <= capability <= (12, 1):
        out.append("efficient")
    return out + ["math"]


def cublas_workspace_for(capability: tuple[int, int]) -> int:
    """One cuBLAS workspace in bytes with ``CUBLAS_WORKSPACE_CONFIG`` unset (``getChosenWorkspaceSize``,
    aten/src/ATen/cuda/CublasHandlePool.cpp): 32 MiB on compute capability 9.x, 10.x, 12.x, else
    8 MiB + 128 KiB (:func:`oomtune.capture.blas_workspace.cublas_workspace_bytes`, which imports torch)."""
    return 4096 * 8 * 1024 if capability[0] in (9, 10, 12) else 4096 * 1024 * 2 + 16 * 1024 * 8


@dataclass(frozen=True)
class Card:
    """One catalogue entry (see the module docstring); bytes throughout.

    ``gpu_key``: the kernel family (``family``), the ``model.gpu`` value its captures run under;
    ``source``: the source of ``total_memory_bytes`` (with its derivation when it is not a reading);
    ``path``: the file it was read from."""

    name: str
    display_name: str
    family: str
    compute_capability: tuple[int, int]
    sm_count: int
    total_memory_bytes: int | None
    bf16: bool
    sdpa_backends: tuple[str, ...]
    cublas_workspace_bytes: int
    outside_allocator_bytes: int
    sources: dict[str, str] = field(default_factory=dict)
    family_name: str | None = None
    mig: dict[str, str] | None = None
    path: str = ""

    @property
    def gpu_key(self) -> str:
        """The ``model.gpu`` value of this card's kernels (its family)."""
        return self.family

    @property
    def source(self) -> str:
        """Where ``total_memory_bytes`` comes from (and how it was derived, when not a reading)."""
        derived = self.sources.get("total_memory_derivation")
        return self.sources["total_memory_bytes"] + (f"; {derived}" if derived else "")

    def to_dict(self) -> dict[str, Any]:
        """For plan.yaml: the figures and their sources."""
        return {"name": self.name, "display_name": self.display_name, "family": self.family,
                "compute_capability": f"{self.compute_capability[0]}.{self.compute_capability[1]}",
                "sm_count": self.sm_count, "total_memory_bytes": self.total_memory_bytes, "bf16": self.bf16,
                "sdpa_backends": list(self.sdpa_backends), "cublas_workspace_bytes": self.cublas_workspace_bytes,
                "outside_allocator_bytes": self.outside_allocator_bytes, "mig": self.mig,
                "sources": dict(self.sources)}


def _flat(text: Any) -> str:
    flat = str(text).strip().lower().replace("-", "").replace(" ", "").replace("_", "")
    return flat[len("nvidia"):] if flat.startswith("nvidia") else flat


def _bad(where: str, what: str) -> ConfigError:
    return ConfigError(f"device file {where}: {what}")


def _int(data: dict[str, Any], key: str, where: str, *, nullable: bool = False, low: int = 1) -> int | None:
    value = data.get(key)
    if value is None and nullable:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise _bad(where, f"{key}={value!r}: expected an integer >= {low} (bytes or a count)")
    return value


def card_from_mapping(data: Any, where: str) -> Card:
    """A :class:`Card` from one entry's mapping, checked (``where`` names it in errors).

    Raises:
        ConfigError: one line naming the file, the field and what is expected.
    """
    if not isinstance(data, dict):
        raise _bad(where, "expected a mapping of the catalogue's keys (copy one of oomtune's conf/devices/*.yaml)")
    missing = [k for k in _REQUIRED if k not in data]
    if missing:
        raise _bad(where, f"missing {', '.join(missing)} (copy one of oomtune's conf/devices/*.yaml and edit it)")
    unknown = sorted(set(data) - set(_REQUIRED) - set(_OPTIONAL))
    if unknown:
        raise _bad(where, f"unknown key(s) {', '.join(map(str, unknown))}; the keys are {', '.join(_REQUIRED + _OPTIONAL)}")
    for key in ("name", "display_name", "family"):
        if not isinstance(data[key], str) or not data[key].strip():
            raise _bad(where, f"{key}={data[key]!r}: expected a non-empty string")
    m = re.fullmatch(r"(\d{1,2})\.(\d)", str(data["compute_capability"]).strip())
    if not m:
        raise _bad(where, f"compute_capability={data['compute_capability']!r}: expected major.minor such as '8.0'")
    cc = (int(m.group(1)), int(m.group(2)))
    sms = _int(data, "sm_count", where)
    total = _int(data, "total_memory_bytes", where, nullable=True, low=1 << 20)
    workspace = _int(data, "cublas_workspace_bytes", where)
    outside = _int(data, "outside_allocator_bytes", where, low=0)
    if total is not None and outside >= total:
        raise _bad(where, f"outside_allocator_bytes={outside} is not below total_memory_bytes={total}")
    if not isinstance(data["bf16"], bool) or data["bf16"] != (cc >= (8, 0)):
        raise _bad(where, f"bf16={data['bf16']!r}: compute capability {cc[0]}.{cc[1]} has bf16={cc >= (8, 0)} "
                   "(native bf16, torch.cuda.is_bf16_supported(including_emulation=False): 8.0 and up)")
    backends = data["sdpa_backends"]
    expected = sdpa_backends_for(cc)
    if not isinstance(backends, list) or sorted(map(str, backends)) != sorted(expected):
        raise _bad(where, f"sdpa_backends={backends!r}: compute capability {cc[0]}.{cc[1]} supports {expected} "
                   "(sdp_utils.cpp's hardware checks)")
    if workspace != cublas_workspace_for(cc):
        raise _bad(where, f"cublas_workspace_bytes={workspace}: torch picks {cublas_workspace_for(cc)} on compute "
                   f"capability {cc[0]}.{cc[1]} (CublasHandlePool.cpp getChosenWorkspaceSize)")
    sources = data["sources"]
    if not isinstance(sources, dict):
        raise _bad(where, "sources: expected a mapping of field -> where the figure comes from")
    unsourced = [k for k in ("total_memory_bytes", "compute_capability", "sm_count", "outside_allocator_bytes")
                 if not str(sources.get(k) or "").strip()]
    if unsourced:
        raise _bad(where, f"sources: no source for {', '.join(unsourced)} (a data sheet URL, a torch source file or "
                   "a recorded reading)")
    family = _flat(data["family"])
    fm = _FAMILY_SM.fullmatch(family)
    if fm and ((int(fm.group(1)), int(fm.group(2))) != cc or int(fm.group(3)) != sms):
        raise _bad(where, f"family={data['family']!r} is not the card's compute capability {cc[0]}.{cc[1]} with "
                   f"{sms} SMs: write sm{cc[0]}{cc[1]}:{sms}, or a name shared by cards of the same kernels")
    if not fm and not re.fullmatch(r"[a-z][a-z0-9.]*", family):
        raise _bad(where, f"family={data['family']!r}: expected a name such as a100, or smXY:SMS for a MIG slice")
    mig = data.get("mig")
    if mig is not None and not (isinstance(mig, dict) and {"parent", "profile"} <= set(mig)):
        raise _bad(where, f"mig={mig!r}: expected {{parent: CARD, profile: 1g.5gb}}")
    return Card(name=data["name"].strip(), display_name=data["display_name"].strip(), family=family,
                compute_capability=cc, sm_count=sms, total_memory_bytes=total, bf16=data["bf16"],
                sdpa_backends=tuple(map(str, backends)), cublas_workspace_bytes=workspace,
                outside_allocator_bytes=outside, sources={str(k): str(v) for k, v in sources.items()},
                family_name=data.get("family_name"), mig=dict(mig) if mig else None, path=where)


def load_card(path: str | Path) -> Card:
    """Read and check one card file (a user's ``gpu=mycard.yaml``).

    Raises:
        ConfigError: missing, unreadable or not YAML, or a bad entry (:func:`card_from_mapping`).
    """
    import yaml

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise _bad(str(path), f"cannot be read ({exc.strerror or exc}): give the path of a card YAML file") from None
    except yaml.YAMLError as exc:
        raise _bad(str(path), f"is not valid YAML ({str(exc).splitlines()[0]})") from None
    return card_from_mapping(data, str(path))


def _devices_dir() -> Path:
    from oomtune.confdir import conf_dir

    return conf_dir() / "devices"


@functools.lru_cache(maxsize=1)
def catalogue() -> dict[str, Card]:
    """The built-in cards (``conf/devices/*.yaml``) by name, in file-name order.

    Raises:
        ConfigError: an entry that does not validate, or two with the same name (a broken install).
    """
    cards: dict[str, Card] = {}
    for path in sorted(_devices_dir().glob("*.yaml")):
        card = load_card(path)
        if card.name in cards:
            raise _bad(str(path), f"name {card.name!r} is also {cards[card.name].path}'s")
        cards[card.name] = card
    return cards


def card_named(name: str) -> Card | None:
    """The catalogue card whose name or display name is ``name`` (case, ``-``, spaces and a leading
    ``NVIDIA`` ignored: ``A100-SXM4-40GB``, ``a100-40gb``), or None."""
    flat = _flat(name)
    for card in catalogue().values():
        if flat in (_flat(card.name), _flat(card.display_name)):
            return card
    return None



def _closest_card(text: str) -> str | None:
    """The catalogue card a mistyped name most likely meant: among the names sharing the longest
    leading part (at least 2 characters) with ``text``, the shortest (a whole card before its MIG
    slices: ``h100x`` -> ``h100-80gb``); else :func:`difflib.get_close_matches`' best; else None."""
    import difflib

    names = list(catalogue())
    text = text.strip().lower()
    for k in range(len(text), 1, -1):
        hits = [n for n in names if n.startswith(text[:k])]
        if hits:
            return min(hits, key=len)
    close = difflib.get_close_matches(text, names, n=1)
    return close[0] if close else None


def resolve_cards(value: Any, *, flag: str = "gpu=") -> list[Card]:
    """The cards of a ``gpu=`` value: a catalogue name, a YAML file path, a list of either, or
    ``all`` (every catalogue card with a memory figure). Duplicates are dropped, order is kept.
    ``flag``: how the messages name the setting (``gpu=`` for plan, ``--gpu `` for ``oomtune check``).

    Raises:
        ConfigError: one line naming an unknown card or a bad file, before any work.
    """
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    if len(items) == 1 and isinstance(items[0], str) and "," in items[0]:
        items = [s for s in items[0].split(",") if s.strip()]
    if not items:
        raise ConfigError(f"{flag}[]: name at least one card, e.g. {flag}l4,a100-40gb or {flag}all")
    out: list[Card] = []
    for item in items:
        text = str(item).strip()
        if text.lower() == "all":
            out += [c for c in catalogue().values() if c.total_memory_bytes is not None]
            continue
        if text.endswith((".yaml", ".yml")) or "/" in text:
            out.append(load_card(text))
            continue
        card = card_named(text)
        if card is None:
            names = ", ".join(catalogue())
            close = _closest_card(text)
            hint = f"; did you mean {close!r}?" if close else ""
            raise ConfigError(f"{flag}{text!r}: unknown card; choose from {names}, all, or give a card YAML file "
                              f"(copy one of oomtune's conf/devices/*.yaml){hint}")
        out.append(card)
    seen: set[str] = set()
    return [c for c in out if not (c.name in seen or seen.add(c.name))]
