"""transformers' bf16 check answered by the target GPU on a virtual-GPU trial.

``TrainingArguments(bf16=True)`` validates the hardware when it is built, before any Trainer or
callback exists: ``if not self.use_cpu and not is_torch_bf16_gpu_available() and not
is_torch_xla_available(): raise ValueError("Your setup doesn't support bf16/gpu. ...")``
(transformers/training_args.py ``TrainingArguments._validate_args``, called from ``__post_init__``).
``is_torch_bf16_gpu_available`` (transformers/utils/import_utils.py) returns
``torch.cuda.is_bf16_supported()`` when ``torch.cuda.is_available()``, and False on a machine
without a GPU: the trial process of a CPU-only search would be refused for the laptop, not for the
GPU the user trains on.

On a virtual-GPU trial (oomtune launched the process, ``OOMTUNE_DEVICE=cpu``),
:func:`answer_as_target` replaces that function, wherever transformers' loaded modules hold it, by
one that runs transformers' own check (its function body, bypassing its ``lru_cache``) inside
:func:`oomtune.capture.target_cuda.answering_as` for the target GPU (``OOMTUNE_GPU``, else the
default A100): transformers reads the target card's ``is_bf16_supported`` / compute capability,
whatever its version's check reads. It is installed when :mod:`oomtune.integrations.huggingface` is
imported, which a script does before it builds its ``TrainingArguments``.

Why answering the check, and not ``use_cpu=True``: only this one question changes. The Trainer
still places the model where it would on this machine (the CPU, no CUDA), accelerate's
``mixed_precision="bf16"`` still enters ``torch.autocast(device_type="cpu", dtype=torch.bfloat16)``
around the forward (accelerate/accelerator.py ``native_amp``; ``get_mixed_precision_context_manager``),
and inside the virtual GPU that region runs CUDA's autocast policy
(:mod:`oomtune.capture.cuda_autocast`: the ``lower_precision_fp`` ops -- linear, matmul, addmm,
baddbmm, bmm, scaled_dot_product_attention -- cast to bf16, ``fp32`` ops such as layer_norm, softmax
with its dtype, and cross_entropy in fp32). The parameters stay fp32 (master weights, the
autocast cache's bf16 copies live for one region) and so do Adam's states (created like the fp32
parameters): the stream is the one a CUDA bf16 run makes.

On a target whose check says no (a transformers version whose check reads the compute capability:
``major < 8`` -> False, or a future one asking ``is_bf16_supported(including_emulation=False)``), the
trial refuses exactly where that card would, in one line naming the card and the fix, exit status 2
(:func:`oomtune.integrations._session.fail`: the search stops after that first trial). With the
installed transformers the check is ``torch.cuda.is_bf16_supported()``'s default, True on every CUDA
card (bf16 emulated below compute capability 8.0: :mod:`oomtune.capture.target_cuda`), so a T4
target trains in bf16 as a real T4 does; the trial's record says the bf16 is emulated there.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any

__all__ = ["answer_as_target", "target_gpu", "emulated_bf16_note", "CHECK_NAME"]

#: transformers' hardware check for bf16 on a GPU (transformers/utils/import_utils.py).
CHECK_NAME = "is_torch_bf16_gpu_available"
#: The file whose call of the check refuses ``bf16=True`` when it is False (``_validate_args``).
_VALIDATING_FILE = "transformers/training_args.py"
_MARK = "_oomtune_target_answer"


def target_gpu() -> Any:
    """The trial's target GPU: ``OOMTUNE_GPU`` (``model.gpu``), else the default
    (:data:`oomtune.capture.gpu_target.DEFAULT_GPU`).

    Raises:
        ConfigError: an unknown ``OOMTUNE_GPU`` value (not written by oomtune).
    """
    from oomtune.capture.gpu_target import DEFAULT_GPU, parse_gpu
    from oomtune.script_api import GPU_ENV

    value = os.environ.get(GPU_ENV) or None
    return parse_gpu(value or DEFAULT_GPU, source="default" if value is None else "model.gpu")


def _refusal(gpu: Any) -> str:
    return (f"Hugging Face Trainer: TrainingArguments(bf16=True) is refused on the target GPU {gpu.name} "
            f"({gpu.sm}): transformers' {CHECK_NAME}() is False on that card, as on a real one; use fp16=True "
            "instead, or target a card with bf16 (compute capability 8.0 and up: model.gpu=a100, h100, l4, ...)")


def emulated_bf16_note(gpu: Any) -> str | None:
    """The line a bf16 trial's record carries when ``gpu`` accepts bf16 only by emulation (compute
    capability below 8.0: no bf16 tensor cores, so a real step is much slower than fp16); None when
    bf16 is native there."""
    from oomtune.capture.target_cuda import bf16_native

    if bf16_native(gpu):
        return None
    return (f"bf16 on {gpu.name} ({gpu.sm}) is emulated (compute capability below 8.0): transformers accepts it "
            "as there, the memory is that of bf16, but a real step runs without bf16 tensor cores (fp16 is faster)")


def answer_as_target(gpu: Any, fail: Any) -> int:
    """Replace transformers' :data:`CHECK_NAME` in every loaded ``transformers`` module that holds it
    (and in ``transformers.utils.import_utils``, where later imports take it from) by the target's
    answer (module docstring). Idempotent. ``fail(message)`` ends the process (exit status 2) when
    ``TrainingArguments`` asks and the target says no.

    Returns:
        The number of module bindings replaced (0: already installed, or transformers is not
        installed).
    """
    try:
        from transformers.utils import import_utils
    except ImportError:
        return 0
    original = getattr(import_utils, CHECK_NAME, None)
    if original is None or getattr(original, _MARK, False):
        return 0
    body = getattr(original, "__wrapped__", original)   # past lru_cache: the answer is the target's, every call

    @functools.wraps(body)
    def answer() -> bool:
        from oomtune.capture.target_cuda import answering_as

        with answering_as(gpu):
            ok = bool(body())
        if not ok:
            caller = sys._getframe(1).f_code.co_filename.replace("\\", "/")
            if caller.endswith(_VALIDATING_FILE):   # TrainingArguments raises next: the card's refusal
                fail(_refusal(gpu))
        return ok

    setattr(answer, _MARK, True)
    replaced = 0
    for name, module in list(sys.modules.items()):
        if (name == "transformers" or name.startswith("transformers.")) and module is not None:
            if getattr(module, "__dict__", {}).get(CHECK_NAME) is original:
                setattr(module, CHECK_NAME, answer)
                replaced += 1
    return replaced


def install_if_virtual_gpu(fail: Any) -> int:
    """:func:`answer_as_target` when this process is a trial on the virtual GPU (oomtune launched it
    and ``OOMTUNE_DEVICE`` is ``cpu``); nothing on CUDA (the device answers itself) or outside
    oomtune. Returns the bindings replaced.

    Raises:
        ConfigError: an unknown ``OOMTUNE_GPU`` value.
    """
    from oomtune.script_api import DEVICE_ENV, launched

    if not launched() or os.environ.get(DEVICE_ENV, "cpu") != "cpu":
        return 0
    return answer_as_target(target_gpu(), fail)
