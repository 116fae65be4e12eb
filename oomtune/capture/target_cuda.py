"""``torch.cuda``'s capability queries answered as the target GPU (``model.gpu``) would answer them.

A trial on the virtual GPU runs on a machine without CUDA, so ``torch.cuda.is_available()`` is
False there and every library check that asks "does this device support X" before training answers
for the CPU. Where such a check decides whether the script may run at all (transformers'
``TrainingArguments(bf16=True)``: ``is_torch_bf16_gpu_available``, transformers/utils/
import_utils.py), the trial must get the answer the target GPU gives, not the laptop's. This module
is that answer, and nothing more: :func:`answering_as` makes ``torch.cuda`` look like one device of
the target's compute capability for the duration of one query (the caller wraps the library's own
check in it, so whatever that check reads -- ``is_bf16_supported``, ``get_device_properties().major``,
``get_device_capability`` -- it reads the target's values), and never around a training step: the
step's tensors stay on the CPU/meta device, where the virtual GPU records them.

bf16 (:func:`bf16_supported`) follows ``torch.cuda.is_bf16_supported`` (torch/cuda/__init__.py):
compute capability 8.0 and up is native; below it the answer is ``including_emulation`` (default
True), because torch then creates a bf16 tensor on the device (``_check_bf16_tensor_supported``),
which succeeds on every CUDA card torch runs on (bf16 is emulated in fp32 there, slowly and without
bf16 tensor cores: pytorch/pytorch#124996 shows a V100 answering True and multiplying bf16
matrices). So a T4 or V100 answers True to the default call and False only to
``is_bf16_supported(including_emulation=False)``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from types import SimpleNamespace

from oomtune.capture.gpu_target import GpuTarget

__all__ = ["bf16_supported", "bf16_native", "answering_as"]

#: Compute capability from which bf16 is native (torch/cuda/__init__.py ``is_bf16_supported``:
#: ``get_device_properties(device).major >= 8``).
BF16_NATIVE_MAJOR = 8

_lock = threading.Lock()


def bf16_native(gpu: GpuTarget) -> bool:
    """Whether ``gpu`` computes bf16 natively (compute capability >= 8.0; tensor cores with bf16)."""
    return gpu.major >= BF16_NATIVE_MAJOR


def bf16_supported(gpu: GpuTarget, including_emulation: bool = True) -> bool:
    """``torch.cuda.is_bf16_supported(including_emulation)`` on ``gpu`` (a CUDA build of torch; see
    the module docstring): True from compute capability 8.0, else ``including_emulation``."""
    return bf16_native(gpu) or bool(including_emulation)


def _properties(gpu: GpuTarget) -> SimpleNamespace:
    """The fields of ``torch.cuda.get_device_properties`` the target defines: ``name``, ``major``,
    ``minor``, ``multi_processor_count`` (0 when the SM count is not known). Other fields are absent
    (an ``AttributeError``, never a made-up value)."""
    return SimpleNamespace(name=gpu.name, major=gpu.major, minor=gpu.minor,
                           multi_processor_count=gpu.sm_count or 0)


@contextlib.contextmanager
def answering_as(gpu: GpuTarget) -> Iterator[None]:
    """Within this block (process-wide, one block at a time), ``torch.cuda`` answers as one device
    of ``gpu``: ``is_available()`` True, ``device_count()`` 1, ``current_device()`` 0,
    ``get_device_capability()`` (major, minor), ``get_device_properties()`` :func:`_properties`,
    ``is_bf16_supported(including_emulation=True)`` :func:`bf16_supported`. The originals are
    restored on exit, also when the block raises. For wrapping one capability check, not code that
    places tensors (it would try to put them on a CUDA device that does not exist).
    """
    import torch

    cuda = torch.cuda
    names = ("is_available", "device_count", "current_device", "get_device_capability",
             "get_device_properties", "is_bf16_supported")
    props = _properties(gpu)
    answers = {
        "is_available": lambda: True,
        "device_count": lambda: 1,
        "current_device": lambda: 0,
        "get_device_capability": lambda device=None: (gpu.major, gpu.minor),
        "get_device_properties": lambda device=None: props,
        "is_bf16_supported": lambda including_emulation=True: bf16_supported(gpu, including_emulation),
    }
    with _lock:
        saved = {name: getattr(cuda, name) for name in names}
        try:
            for name in names:
                setattr(cuda, name, answers[name])
            yield
        finally:
            for name, value in saved.items():
                setattr(cuda, name, value)
