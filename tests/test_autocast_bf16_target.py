"""Inside a capture for a target GPU (:func:`oomtune.capture.cuda_kernels.emulate_cuda`), the
``torch.cuda.is_bf16_supported`` that CUDA's autocast emulation puts in place answers as torch does
on that card (torch/cuda/__init__.py ``is_bf16_supported``: compute capability >= 8.0 -> True; below,
``including_emulation``, default True, since a bf16 tensor can be made on every CUDA card), not True
for every card. A T4 is compute capability 7.5, an A100 8.0 (NVIDIA's CUDA GPUs table)."""

from __future__ import annotations

import torch

from oomtune.capture.cuda_kernels import emulate_cuda


def test_a_card_below_8_0_has_bf16_only_by_emulation():
    before = torch.cuda.is_bf16_supported
    with emulate_cuda("t4"):
        assert torch.cuda.is_bf16_supported() is True                            # the default: emulation counts
        assert torch.cuda.is_bf16_supported(including_emulation=True) is True
        assert torch.cuda.is_bf16_supported(including_emulation=False) is False  # not native on 7.5
        # autocast.__init__ asks the default question: a bf16 region stays bf16, as on a T4
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = torch.nn.functional.linear(torch.ones(2, 4), torch.ones(3, 4))
        assert out.dtype is torch.bfloat16
    assert torch.cuda.is_bf16_supported is before   # restored


def test_a_card_from_8_0_has_native_bf16():
    with emulate_cuda("a100"):
        assert torch.cuda.is_bf16_supported(including_emulation=False) is True
        assert torch.cuda.is_bf16_supported() is True
