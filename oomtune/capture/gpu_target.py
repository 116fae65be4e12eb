"""The GPU a capture stands for: its compute capability and SM count (``model.gpu``).

A capture on meta or CPU tensors records what a CUDA run would allocate; where torch picks its
kernel by device, the capture must pick it for the GPU the training will run on. The scaled
dot-product attention backends are chosen by compute capability (``check_flash_attention_hardware_
support``: sm80-sm121; ``check_mem_efficient_hardware_support``: sm50-sm121;
``check_cudnn_hardware_support``: sm80-sm121; ``check_prefer_cudnn_attention``: cuDNN first on sm90 and
sm10x; aten/src/ATen/native/transformers/cuda/sdp_utils.cpp), and FlashAttention's forward splits
the key sequence when the batch x heads x query blocks would not fill the SMs
(``num_splits_heuristic`` in flash_api.cpp), so the SM count matters too.

``model.gpu`` takes a GPU name (``a100``, ``h100``, ``t4``, ... :data:`KNOWN_GPUS`), a compute
capability (``sm80``, ``sm_86``, ``8.6``; optionally with the SM count: ``sm90:132``) or ``auto``:
the device itself where the run has one (``device=cuda``: read from NVML without initialising
CUDA), else :data:`DEFAULT_GPU`, said so wherever the target is printed. No torch import here:
``oomtune plan`` prints the target before it knows whether it needs torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

from oomtune.exceptions import ConfigError
from oomtune.workload_spec import WorkloadSpec

__all__ = ["GpuTarget", "KNOWN_GPUS", "DEFAULT_GPU", "parse_gpu", "gpu_of", "resolve_gpu_key",
           "target_from_workload", "target_gpu"]


@dataclass(frozen=True)
class GpuTarget:
    """A target GPU. ``major``/``minor``: the compute capability (``cudaDeviceProp.major/minor``);
    ``sm_count``: streaming multiprocessors (``multiProcessorCount``), None when not known (a bare
    compute capability: FlashAttention's split-KV accumulators are then not modelled);
    ``name``: for display; ``key``: the canonical ``model.gpu`` value that names it
    (:func:`parse_gpu` of it gives this target back); ``source``: where it came from (``model.gpu``,
    ``the device``, ``default``)."""

    name: str
    major: int
    minor: int
    sm_count: int | None
    key: str
    source: str = "model.gpu"

    @property
    def sm(self) -> str:
        """``sm80`` style."""
        return f"sm{self.major}{self.minor}"

    @property
    def capability(self) -> tuple[int, int]:
        return (self.major, self.minor)

    def describe(self) -> str:
        """``A100 (sm80, 108 SMs)``, with how it was chosen when not given explicitly."""
        sms = f", {self.sm_count} SMs" if self.sm_count else ""
        how = {"default": "; the default: set model.gpu= to the GPU you will train on",
               "the device": "; the device"}.get(self.source, "")
        return f"{self.name} ({self.sm}{sms}{how})"

    def to_dict(self) -> dict[str, Any]:
        """For best.yaml / plan.yaml."""
        return {"name": self.name, "compute_capability": f"{self.major}.{self.minor}",
                "sm_count": self.sm_count, "key": self.key, "source": self.source}


def _known_gpus() -> dict[str, tuple[str, int, int, int]]:
    """The named kernel families of the device catalogue (:mod:`oomtune.gpu.catalogue`, the one
    source): family -> (display name, major, minor, SM count). Every card of a family has the same
    compute capability and SM count (``a100``: A100-SXM4-40GB and -80GB); a MIG slice's family is
    its capability with its SM count (``sm80:14``), not a name.

    Raises:
        ConfigError: two cards of one family that disagree (a broken catalogue).
    """
    from oomtune.gpu.catalogue import catalogue

    out: dict[str, tuple[str, int, int, int]] = {}
    for card in catalogue().values():
        if card.family.startswith("sm"):
            continue
        entry = (card.family_name or card.family.upper(), *card.compute_capability, card.sm_count)
        if out.setdefault(card.family, entry) != entry:
            raise ConfigError(f"device catalogue: {card.path} puts family {card.family} at {entry[1:]}, "
                              f"another card of it at {out[card.family][1:]}")
    return out


#: name -> (display name, major, minor, SM count): the catalogue's named families (``conf/devices/``,
#: sourced there: NVIDIA's data sheets; the SXM parts where a PCIe one differs: H100 PCIe has 114
#: SMs, give ``sm90:114``).
KNOWN_GPUS: dict[str, tuple[str, int, int, int]] = _known_gpus()
#: The target when ``model.gpu=auto`` and the run has no GPU of its own.
DEFAULT_GPU = "a100"

_SM = re.compile(r"(?:sm_?(\d{1,2})(\d)|(\d+)\.(\d))(?::(\d+))?")


def parse_gpu(value: Any, *, source: str = "model.gpu") -> GpuTarget:
    """The :class:`GpuTarget` named by ``value`` (a :data:`KNOWN_GPUS` name, case and ``-``/space
    insensitive, or ``sm80`` / ``sm_80`` / ``8.0``, optionally ``:SMS``). ``auto`` is not accepted
    here (:func:`gpu_of` resolves it).

    Raises:
        ConfigError: anything else, in one line naming the choices.
    """
    text = str(value).strip().lower().replace("-", "").replace(" ", "")
    if text.startswith("nvidia"):
        text = text[len("nvidia"):]
    if text in KNOWN_GPUS:
        name, major, minor, sms = KNOWN_GPUS[text]
        return GpuTarget(name, major, minor, sms, text, source)
    from oomtune.gpu.catalogue import card_named

    card = card_named(text)
    if card is not None:   # a catalogue card (a100-40gb, h100-80gb-3g.40gb): its family's kernels
        return parse_gpu(card.family, source=source)
    m = _SM.fullmatch(text)
    if m:
        major = int(m.group(1) or m.group(3))
        minor = int(m.group(2) or m.group(4))
        sms = int(m.group(5)) if m.group(5) else None
        if major >= 3 and (sms is None or sms >= 1):
            key = f"sm{major}{minor}" + (f":{sms}" if sms else "")
            return GpuTarget(f"sm{major}{minor}", major, minor, sms, key, source)
    raise ConfigError(f"model.gpu={value!r}: unknown GPU; choose one of auto, {', '.join(KNOWN_GPUS)}, "
                      "or give the compute capability as sm80 (or 8.0, sm90:132 with the SM count)")


def _from_name(device_name: str) -> str | None:
    """The :data:`KNOWN_GPUS` key in an NVML/torch device name (``NVIDIA A100-SXM4-80GB`` -> a100),
    longest match first (``a10g`` before ``a10``); None if none matches."""
    from oomtune.gpu.catalogue import card_named

    card = card_named(device_name)   # the catalogue's display names first (NVIDIA H200 -> its family)
    if card is not None and card.family in KNOWN_GPUS:
        return card.family
    flat = device_name.lower().replace("-", "").replace(" ", "")
    for key in sorted(KNOWN_GPUS, key=len, reverse=True):
        display = KNOWN_GPUS[key][0].lower().replace(" ", "")
        if key in flat or display in flat:
            return key
    return None


def gpu_of(value: Any, device: Any = None) -> GpuTarget:
    """Resolve ``model.gpu``: ``auto`` (or None) is the device when ``device`` (a
    :class:`oomtune.device.TargetDevice`) is a real GPU, read from NVML (compute capability) and its
    name (SM count; a bare capability when the name is not in :data:`KNOWN_GPUS`), else
    :data:`DEFAULT_GPU` (``source="default"``). Anything else: :func:`parse_gpu`.

    Raises:
        ConfigError: an unknown value.
    """
    if value is not None and str(value).strip().lower() != "auto":
        return parse_gpu(value)
    if device is not None and not getattr(device, "simulated", True):
        capability = _device_capability(device)
        key = _from_name(device.name or "")
        if key is not None and (capability is None or KNOWN_GPUS[key][1:3] == capability):
            return parse_gpu(key, source="the device")
        if capability is not None:
            return parse_gpu(f"sm{capability[0]}{capability[1]}", source="the device")
    return parse_gpu(DEFAULT_GPU, source="default")


def _device_capability(device: Any) -> tuple[int, int] | None:
    """(major, minor) of a real device from NVML (``nvmlDeviceGetCudaComputeCapability``), without
    initialising CUDA; None when NVML cannot tell."""
    from oomtune.gpu import nvml

    index = getattr(device, "index", None) or 0
    try:
        handle = nvml._handle(nvml.physical_index_for(index))
    except Exception:  # noqa: BLE001 - no NVML, no device: the name decides
        return None
    got = nvml.query("nvmlDeviceGetCudaComputeCapability", handle)
    return tuple(int(x) for x in got) if got else None


def resolve_gpu_key(workload: WorkloadSpec, device: Any = None) -> WorkloadSpec:
    """``workload`` with ``gpu`` resolved to its canonical key (:attr:`GpuTarget.key`) and the origin
    in ``gpu_source`` (a new spec), so that captures in other processes (forked workers, trial
    processes) and the stream cache's key see the same target (:func:`gpu_of`: ``auto`` is
    ``device``'s GPU, else :data:`DEFAULT_GPU`).

    Raises:
        ConfigError: an unknown ``model.gpu``.
    """
    target = gpu_of(workload.gpu, device)
    return replace(workload, gpu=target.key, gpu_source=target.source)


def target_from_workload(workload: WorkloadSpec | None) -> GpuTarget:
    """The :class:`GpuTarget` a resolved workload (:func:`resolve_gpu_key`) names
    (:func:`target_gpu` of its ``gpu`` and ``gpu_source``); :data:`DEFAULT_GPU` for no workload.

    Raises:
        ConfigError: an unknown ``gpu``.
    """
    return target_gpu(None, None) if workload is None else target_gpu(workload.gpu, workload.gpu_source)


def target_gpu(gpu: str | None, source: str | None) -> GpuTarget:
    """The :class:`GpuTarget` of a resolved ``gpu`` key and its ``gpu_source`` (the typed fields of
    :class:`oomtune.workload_spec.WorkloadSpec`, or a capture's flat workload's keys);
    :data:`DEFAULT_GPU` (source ``default``) for None or ``auto`` (no device to read here), the
    source ``model.gpu`` when none is given.

    Raises:
        ConfigError: an unknown ``gpu``.
    """
    if gpu is None or str(gpu).strip().lower() == "auto":
        return parse_gpu(DEFAULT_GPU, source="default")
    return parse_gpu(gpu, source=str(source or "model.gpu"))
