"""Scaled dot-product attention as torch's CUDA dispatcher runs it, on meta and CPU tensors.

``F.scaled_dot_product_attention`` (the aten op ``scaled_dot_product_attention``, a
CompositeImplicitAutograd kernel in aten/src/ATen/native/transformers/attention.cpp) asks
``_fused_sdp_choice_stub`` which backend to run, by the device of the query: on CUDA
``select_sdp_backend`` (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp) picks cuDNN, flash,
memory-efficient or math attention by dtype, head size, mask, dropout, layout and the GPU's compute
capability; on meta it is always math, on the CPU the CPU's flash kernel. The math path keeps the
B x H x T x T scores and softmax for backward; the fused kernels keep the output and a B x H x T
fp32 logsumexp. While a capture emulates a GPU (:mod:`oomtune.capture.cuda_kernels`) this module:

1. replaces the op's autograd kernel for Meta and CPU tensors (a ``torch.library`` registration at
   ``AutogradMeta``/``AutogradCPU``, removed when the capture ends) by :func:`_sdpa`, which makes
   the composite's choice with :func:`select_backend` (a port of ``select_sdp_backend`` for the
   target GPU, :class:`oomtune.capture.gpu_target.GpuTarget`) and then does what the composite does
   for that choice (mask conversion, head-dim padding to 8 for flash, ``preprocess_mask`` for
   memory-efficient attention) and calls the same aten op:
   ``_scaled_dot_product_flash_attention``, ``_scaled_dot_product_efficient_attention``,
   ``_scaled_dot_product_cudnn_attention`` or ``_scaled_dot_product_attention_math``. Autograd then
   records the op's own backward node with the tensors ``tools/autograd/derivatives.yaml`` saves;
2. on meta, those ops and their ``_backward`` ops run torch's meta kernels (torch/_meta_registrations.py);
   on the CPU, which has no kernel for them, it registers CPU kernels (:func:`_cpu_flash` ...) that
   compute the attention for real (the CPU trial trains) and return tensors of the shapes, dtypes
   and strides the CUDA kernels return (the meta kernels'), so the recorder sees what CUDA keeps;
3. gives the recorder the workspaces the CUDA kernels allocate from the caching allocator inside
   the call and free before returning (:func:`transient_requests`): FlashAttention's split-KV
   accumulators in the forward (``set_params_splitkv``), its backward's ``softmax_d`` and fp32
   ``dq_accum`` and, for grouped-query attention, ``dk_expanded``/``dv_expanded`` (``mha_bwd`` in
   flash_attn/flash_api.cpp), the contiguous copies ``_flash_attention_backward`` and
   ``_efficient_attention_backward`` make (attention_backward.cu), the memory-efficient backward's
   fp32 ``delta`` and its forward's fp32 output accumulator for head sizes over 128
   (``kNeedsOutputAccumulatorBuffer``, mem_eff_attention/kernel_forward.h).

Not modelled (said in docs/kernel_audit.md): cuDNN's workspace (sized by the cuDNN graph at run
time), the memory-efficient backward's CUTLASS workspace, nested tensors, FlashAttention-3 (off
unless ``torch.backends.cuda.enable_fa3``), ROCm. The selection reads the runtime switches a CUDA
run reads (``torch.backends.cuda.enable_flash_sdp`` ..., ``sdpa_kernel``, the priority order,
deterministic algorithms) and the cuDNN version of the installed torch build.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from oomtune.capture.gpu_target import GpuTarget

__all__ = ["MATH", "FLASH", "EFFICIENT", "CUDNN", "BACKEND_NAMES", "SdpaParams", "select_backend",
           "install", "uninstall", "transient_requests", "flash_split_count", "cudnn_version",
           "current_target", "set_target"]

MATH, FLASH, EFFICIENT, CUDNN, OVERRIDEABLE = 0, 1, 2, 3, 4   # at::SDPBackend (torch.nn.attention.SDPBackend)
BACKEND_NAMES = {MATH: "math", FLASH: "flash", EFFICIENT: "efficient", CUDNN: "cudnn"}
_DEFAULT_ORDER = [FLASH, EFFICIENT, MATH, CUDNN, OVERRIDEABLE]   # Context::sdp_priority_order default
_aten = torch.ops.aten


@dataclass
class SdpaParams:
    """``sdp::sdp_params`` (sdp_utils_cpp.h) plus whether grad is required (``input_requires_grad``:
    any input requires grad and grad mode is on)."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attn_mask: torch.Tensor | None
    dropout: float
    is_causal: bool
    enable_gqa: bool
    requires_grad: bool


def cudnn_version() -> int | None:
    """The cuDNN version a CUDA run of the installed torch would use (``torch.backends.cudnn.version()``,
    e.g. 92400 for 9.24.0); None for a torch built without cuDNN (CPU wheels): cuDNN attention is then
    never chosen."""
    try:
        return torch.backends.cudnn.version()
    except Exception:  # noqa: BLE001 - no cuDNN in this build
        return None


def _cuda_version() -> tuple[int, int] | None:
    v = torch.version.cuda
    if not v:
        return None
    parts = v.split(".")
    return int(parts[0]), int(parts[1]) if len(parts) > 1 else 0


# -- the checks of sdp_utils_cpp.h / cuda/sdp_utils.cpp, each named as there ---------------------------
def _in_sm_range(gpu: GpuTarget, lo: tuple[int, int], hi: tuple[int, int]) -> bool:
    """``check_sm_version<lower, upper>``: lower <= (major, minor) <= upper."""
    return lo <= gpu.capability <= hi


def _is_half(p: SdpaParams) -> bool:
    return p.query.dtype in (torch.float16, torch.bfloat16)


def minimum_gemm_alignment(p: SdpaParams, gpu: GpuTarget) -> int:
    """``minimum_gemm_alignment``: 4 from sm80 (1 before), at least 128 bits when tensor cores are
    used (``use_tensor_cores``: sm80+, or sm70+ for fp16/bf16)."""
    is_half = _is_half(p)
    use_tc = gpu.major >= 8 or (gpu.major >= 7 and is_half)
    align = 4 if gpu.major >= 8 else 1
    if use_tc:
        align = max(align, 128 // (16 if is_half else 32))
    return align


def check_tensor_shapes(p: SdpaParams, gpu: GpuTarget) -> bool:
    return p.query.dim() == p.key.dim() == p.value.dim() == 4


def check_for_attn_mask(p: SdpaParams, gpu: GpuTarget) -> bool:
    """Flash attention takes no mask."""
    return p.attn_mask is None


def check_head_dim_size_flash(p: SdpaParams, gpu: GpuTarget) -> bool:
    d = p.query.size(-1)
    return d == p.key.size(-1) == p.value.size(-1) and d <= 256


def check_head_dim_size_mem_efficient(p: SdpaParams, gpu: GpuTarget) -> bool:
    a = minimum_gemm_alignment(p, gpu)
    dq, dv = p.query.size(-1), p.value.size(-1)
    return dq == p.key.size(-1) and dq % a == 0 and dq > 0 and dv % a == 0 and dv > 0


def check_data_ptr_alignment_mem_efficient(p: SdpaParams, gpu: GpuTarget) -> bool:
    """From sm80: each of q, k, v starts at a storage offset aligned to ``minimum_gemm_alignment``
    elements (the caching allocator's blocks are 512-byte aligned, so the offset decides)."""
    if gpu.major < 8:
        return True
    align_bytes = minimum_gemm_alignment(p, gpu) * p.query.element_size()
    return all(t.numel() == 0 or (t.storage_offset() * t.element_size()) % align_bytes == 0
               for t in (p.query, p.key, p.value))


def check_flash_attention_hardware_support(p: SdpaParams, gpu: GpuTarget) -> bool:
    return _in_sm_range(gpu, (8, 0), (12, 1))


def check_mem_efficient_hardware_support(p: SdpaParams, gpu: GpuTarget) -> bool:
    return _in_sm_range(gpu, (5, 0), (12, 1))


def check_cudnn_hardware_support(p: SdpaParams, gpu: GpuTarget) -> bool:
    return _in_sm_range(gpu, (8, 0), (12, 1))


def check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120(p: SdpaParams, gpu: GpuTarget) -> bool:
    """Flash attention's backward on sm86-sm89 and sm120-121 supports head_dim <= 192, or > 224
    without dropout."""
    if p.requires_grad and (_in_sm_range(gpu, (8, 6), (8, 9)) or _in_sm_range(gpu, (12, 0), (12, 1))):
        d = p.query.size(-1)
        return d <= 192 or (p.dropout <= 0.0 and d > 224)
    return True


def check_flash_causal_non_square_seqlens(p: SdpaParams, gpu: GpuTarget) -> bool:
    return not p.is_causal or p.query.size(-2) == p.key.size(-2)


def check_dtypes_flash_attention(p: SdpaParams, gpu: GpuTarget) -> bool:
    """``check_dtypes_low_precision`` (FlashAttention-3's fp8 only with ``enable_fa3``: not modelled):
    fp16/bf16 from sm80, fp16 before."""
    allowed = (torch.float16, torch.bfloat16) if gpu.major >= 8 else (torch.float16,)
    return _same_dtype(p) and p.query.dtype in allowed


def check_dtypes_mem_efficient(p: SdpaParams, gpu: GpuTarget) -> bool:
    allowed = (torch.float16, torch.float32, torch.bfloat16) if gpu.major >= 8 else (torch.float16, torch.float32)
    return _same_dtype(p) and p.query.dtype in allowed


def check_dtypes_low_precision(p: SdpaParams, gpu: GpuTarget) -> bool:
    return check_dtypes_flash_attention(p, gpu)


def _same_dtype(p: SdpaParams) -> bool:
    return p.query.dtype == p.key.dtype == p.value.dtype


def check_nonzero_sequence_lengths_dense(p: SdpaParams, gpu: GpuTarget) -> bool:
    return p.query.size(-2) != 0 and p.key.size(-2) != 0


def _last_dim_stride_1(p: SdpaParams, ignore_singleton_dim: bool) -> bool:
    """``check_last_dim_stride_equals_1_dense<ignore_singleton_dim>``."""
    ok = all(t.stride(-1) == 1 for t in (p.query, p.key, p.value))
    if ignore_singleton_dim:
        ok = ok or p.query.size(-1) == 1
    mask_ok = p.attn_mask is None or p.attn_mask.stride(-1) == 1
    return ok and mask_ok


def check_grouped_query_attention(p: SdpaParams) -> bool:
    hq, hk, hv = p.query.size(-3), p.key.size(-3), p.value.size(-3)
    return hk == hv and hq % hk == 0


def check_batch_size_and_num_heads_dense(p: SdpaParams, *, supports_gqa: bool, requires_same_num_heads: bool) -> bool:
    """Same batch size; same head counts, or grouped-query attention where the backend supports it
    (``enable_gqa``), or, for a backend that does not require equal head counts (cuDNN), key/value
    heads dividing the query heads (the template's ``supports_mqa``/``requires_same_num_heads``
    arguments in sdp_utils.cpp; their exact effect on non-GQA calls is inferred)."""
    if not p.query.size(0) == p.key.size(0) == p.value.size(0):
        return False
    if p.enable_gqa and supports_gqa:
        return check_grouped_query_attention(p)
    if p.query.size(-3) == p.key.size(-3) == p.value.size(-3):
        return True
    return not requires_same_num_heads and check_grouped_query_attention(p)


def check_attn_mask_shape(p: SdpaParams, gpu: GpuTarget) -> bool:
    m = p.attn_mask
    if m is None:
        return True
    if m.requires_grad:
        return False
    q_len, kv_len = p.query.size(2), p.key.size(2)
    if m.size(-2) not in (q_len, 1) or m.size(-1) not in (kv_len, 1):
        return False
    if m.dim() == 2:
        return True
    return m.dim() == 4 and m.size(0) in (1, p.query.size(0)) and m.size(1) in (1, p.query.size(1))


def check_cudnn_dropout(p: SdpaParams, gpu: GpuTarget) -> bool:
    return p.dropout * 16.0 == math.floor(p.dropout * 16.0)


def _cudnn_supports_d256(gpu: GpuTarget, version: int) -> bool:
    """sm90 / sm10x (not sm107 with cuDNN <= 9.25) with cuDNN > 9.22 (and a cuDNN frontend >= 1.24,
    which torch's CUDA 13 builds ship: assumed)."""
    sm90_or_10x = (gpu.major == 9 and gpu.minor == 0) or gpu.major == 10
    unsupported_sm107 = gpu.major == 10 and gpu.minor == 7 and version <= 92500
    return sm90_or_10x and not unsupported_sm107 and version > 92200


def check_cudnn_tensor_shapes(p: SdpaParams, gpu: GpuTarget, version: int) -> bool:
    b, h = p.query.size(0), p.query.size(1)
    if b > 65535 or h > 65535:
        return False
    s_q, s_k = p.query.size(2), p.key.size(2)
    d_qk, d_v = p.query.size(3), p.value.size(3)
    limit = 128
    sm90_or_10x = (gpu.major == 9 and gpu.minor == 0) or gpu.major == 10
    if _cudnn_supports_d256(gpu, version):
        limit = 256
    elif sm90_or_10x and version >= 91100 and d_qk == 192 and d_v == 128:
        limit = 192
    if d_qk > limit or d_v > limit or d_qk % 8 or d_v % 8:
        return False
    if s_k == 1:
        return False
    return not (p.dropout != 0.0 and s_q == 1)


def check_cudnn_d256_bprop_head_dim(p: SdpaParams, gpu: GpuTarget, version: int) -> bool:
    if not p.requires_grad or not _cudnn_supports_d256(gpu, version):
        return True
    d_qk, d_v = p.query.size(3), p.value.size(3)
    return (d_qk <= 128 and d_v <= 128) or (d_qk, d_v) in ((192, 128), (256, 256))


@dataclass(frozen=True)
class _Switches:
    """The runtime switches a CUDA run reads (``at::globalContext()``)."""

    flash: bool
    efficient: bool
    math: bool
    cudnn: bool
    order: tuple[int, ...]
    deterministic: bool
    deterministic_warn_only: bool

    @classmethod
    def read(cls) -> "_Switches":
        return cls(flash=torch.backends.cuda.flash_sdp_enabled(),
                   efficient=torch.backends.cuda.mem_efficient_sdp_enabled(),
                   math=torch.backends.cuda.math_sdp_enabled(), cudnn=torch.backends.cuda.cudnn_sdp_enabled(),
                   order=tuple(int(x) for x in torch._C._get_sdp_priority_order()),
                   deterministic=torch.are_deterministic_algorithms_enabled(),
                   deterministic_warn_only=torch.is_deterministic_algorithms_warn_only_enabled())


def can_use_flash_attention(p: SdpaParams, gpu: GpuTarget, sw: _Switches) -> bool:
    """``can_use_flash_attention`` (dense inputs)."""
    if not sw.flash:
        return False
    general = (check_tensor_shapes, check_for_attn_mask, check_head_dim_size_flash,
               check_flash_attention_hardware_support,
               check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120,
               check_flash_causal_non_square_seqlens, check_dtypes_flash_attention)
    if not all(c(p, gpu) for c in general):
        return False
    return (check_batch_size_and_num_heads_dense(p, supports_gqa=True, requires_same_num_heads=True)
            and check_nonzero_sequence_lengths_dense(p, gpu) and _last_dim_stride_1(p, True))


def can_use_mem_efficient_attention(p: SdpaParams, gpu: GpuTarget, sw: _Switches) -> bool:
    """``can_use_mem_efficient_attention`` (dense inputs, CUDA)."""
    if not sw.efficient:
        return False
    general = (check_mem_efficient_hardware_support, check_tensor_shapes, check_head_dim_size_mem_efficient,
               check_data_ptr_alignment_mem_efficient)
    if not all(c(p, gpu) for c in general):
        return False
    if not (check_nonzero_sequence_lengths_dense(p, gpu) and _last_dim_stride_1(p, False)
            and check_batch_size_and_num_heads_dense(p, supports_gqa=True, requires_same_num_heads=True)):
        return False
    return check_dtypes_mem_efficient(p, gpu)


def can_use_cudnn_attention(p: SdpaParams, gpu: GpuTarget, sw: _Switches, version: int | None) -> bool:
    """``can_use_cudnn_attention`` (dense inputs): needs a torch built with cuDNN >= 9."""
    if version is None or version < 90000:
        return False
    if p.dropout > 0.0 and 91100 < version < 91400:
        return False
    if not sw.cudnn or not check_tensor_shapes(p, gpu):
        return False
    if sw.deterministic and not sw.deterministic_warn_only:
        return False
    if not (check_dtypes_low_precision(p, gpu) and check_attn_mask_shape(p, gpu)
            and check_cudnn_hardware_support(p, gpu) and check_cudnn_dropout(p, gpu)):
        return False
    return (check_nonzero_sequence_lengths_dense(p, gpu) and _last_dim_stride_1(p, True)
            and check_batch_size_and_num_heads_dense(p, supports_gqa=True, requires_same_num_heads=False)
            and check_cudnn_tensor_shapes(p, gpu, version) and check_cudnn_d256_bprop_head_dim(p, gpu, version))


def check_prefer_cudnn_attention(gpu: GpuTarget, version: int | None, cuda: tuple[int, int] | None) -> bool:
    """cuDNN first on sm90 / sm10x with cuDNN > 9.15 (CUDA < 13 builds: only sm90, sm100, sm103,
    i.e. minor 0 or 3), unless ``TORCH_CUDNN_SDPA_DEPRIORITIZED`` is set."""
    import os

    if os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED", "").lower() in ("1", "true", "on", "yes"):
        return False
    if version is None or version <= 91500 or gpu.major not in (9, 10):
        return False
    if cuda is not None and cuda < (13, 0):
        return gpu.minor in (0, 3)
    return True


def priority_order(gpu: GpuTarget, sw: _Switches, version: int | None, cuda: tuple[int, int] | None) -> list[int]:
    """``priority_order``: the context's order, with cuDNN moved first where preferred (applied once,
    to the default order; an order the user set with ``sdpa_kernel(..., set_priority=True)`` is kept)."""
    order = list(sw.order)
    if order == _DEFAULT_ORDER and check_prefer_cudnn_attention(gpu, version, cuda):
        order = [CUDNN, FLASH, EFFICIENT, MATH]
    return order


def select_backend(p: SdpaParams, gpu: GpuTarget, *, switches: _Switches | None = None,
                   cudnn: int | None | str = "installed", cuda: tuple[int, int] | None | str = "installed") -> int:
    """``select_sdp_backend`` for ``gpu``: the first backend of :func:`priority_order` whose checks
    pass (:data:`FLASH`, :data:`EFFICIENT`, :data:`CUDNN`, :data:`MATH`).

    ``cudnn``/``cuda``: the cuDNN version (int, None: none) and CUDA version of the run; by default the
    installed torch build's.

    Raises:
        RuntimeError: every backend disabled or unusable ("No available kernel", as torch raises).
    """
    sw = switches or _Switches.read()
    version = cudnn_version() if cudnn == "installed" else cudnn
    cuda_v = _cuda_version() if cuda == "installed" else cuda
    if not (sw.math or sw.flash or sw.efficient or sw.cudnn):
        raise RuntimeError("No available kernel. Aborting execution.")
    for backend in priority_order(gpu, sw, version, cuda_v):
        if backend == CUDNN and can_use_cudnn_attention(p, gpu, sw, version):
            return CUDNN
        if backend == FLASH and can_use_flash_attention(p, gpu, sw):
            return FLASH
        if backend == EFFICIENT and can_use_mem_efficient_attention(p, gpu, sw):
            return EFFICIENT
        if backend == MATH and sw.math:
            return MATH
    raise RuntimeError("No available kernel. Aborting execution.")


# -- the composite, per backend (attention.cpp: scaled_dot_product_attention) -------------------------
_state = threading.local()
_targets: list[GpuTarget] = []
_on_choice: list[Callable[[int, SdpaParams], None]] = []


def set_target(gpu: GpuTarget | None, on_choice: Callable[[int, SdpaParams], None] | None = None) -> None:
    """Push (``gpu``) or pop (None) the target the installed kernel selects for, with a callback
    told every choice (the capture's notes)."""
    if gpu is None:
        _targets.pop()
        _on_choice.pop()
    else:
        _targets.append(gpu)
        _on_choice.append(on_choice or (lambda b, p: None))


def current_target() -> GpuTarget | None:
    """The innermost target set by :func:`set_target` (None: not emulating)."""
    return _targets[-1] if _targets else None


def _validate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> None:
    """``validate_sdpa_input``, with torch's messages."""
    if not q.dtype == k.dtype == v.dtype:
        raise RuntimeError(f"Expected query, key, and value to have the same dtype, but got query.dtype: "
                           f"{q.dtype} key.dtype: {k.dtype} and value.dtype: {v.dtype} instead.")
    if not q.device == k.device == v.device:
        raise RuntimeError(f"Expected query, key, and value to have the same device type, but got query.device: "
                           f"{q.device} key.device: {k.device} and value.device: {v.device} instead.")
    if q.dim() < 2 or k.dim() < 2 or v.dim() < 2:
        raise RuntimeError(f"Expected query, key, and value to all be  at least 2 dimensional, but got query.dim: "
                           f"{q.dim()} key.dim: {k.dim()} and value.dim: {v.dim()} instead.")
    if mask is not None and mask.dtype not in (torch.bool, torch.float32, q.dtype):
        raise RuntimeError(f"Expected attn_mask dtype to be bool or float or to match query dtype, but got "
                           f"attn_mask.dtype: {mask.dtype} and  query.dtype: {q.dtype} instead.")


def _convert_boolean_mask(mask: torch.Tensor | None, dtype: torch.dtype, cudnn: bool = False) -> torch.Tensor | None:
    """``convert_boolean_attn_mask`` (-inf where masked out) / ``convert_boolean_attn_mask_cudnn``
    (-65504: cuDNN's -inf workaround)."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    if cudnn:
        return torch.where(mask.logical_not(), -65504.0, torch.scalar_tensor(0.0, dtype=dtype))
    return torch.where(mask.logical_not(), -math.inf, torch.scalar_tensor(0.0, dtype=dtype, device=mask.device))


def _pad_last_dim(t: torch.Tensor, alignment: int) -> torch.Tensor:
    """``pad_last_dim<alignment, false>``."""
    d = t.size(-1)
    if d % alignment == 0:
        return t
    return torch.nn.functional.pad(t, (0, alignment - d % alignment))


def _aligned(t: torch.Tensor, alignment: int) -> bool:
    return all(t.stride(i) % alignment == 0 for i in range(t.dim() - 1)) and t.stride(-1) == 1


def _preprocess_mask(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``preprocess_mask``: pad the bias's last dim (``pad_bias<8>``) unless aligned, then expand to
    (B, H, L, S)."""
    if not _aligned(mask, 8):
        last = mask.size(-1)
        mask = torch.nn.functional.pad(mask, (0, 8 - last % 8))[..., :last]
    return mask.expand(q.size(0), q.size(1), q.size(2), k.size(2))


def _sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
          dropout_p: float = 0.0, is_causal: bool = False, *, scale: float | None = None,
          enable_gqa: bool = False) -> torch.Tensor:
    """The ``scaled_dot_product_attention`` composite with the CUDA backend choice for the target."""
    _validate(query, key, value, attn_mask)
    gpu = current_target()
    grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
    params = SdpaParams(query, key, value, attn_mask, float(dropout_p), bool(is_causal), bool(enable_gqa), grad)
    backend = MATH if gpu is None else select_backend(params, gpu)
    if _on_choice:
        _on_choice[-1](backend, params)
    if backend == CUDNN:
        mask = _convert_boolean_mask(attn_mask, query.dtype, cudnn=True)
        return _aten._scaled_dot_product_cudnn_attention.default(
            query, key, value, mask, grad, dropout_p, is_causal, False, scale=scale)[0]
    if backend == FLASH:
        og = query.size(-1)
        qp, kp, vp = (_pad_last_dim(t, 8) for t in (query, key, value))
        og_scale = scale if scale is not None else 1.0 / math.sqrt(og)
        out = _aten._scaled_dot_product_flash_attention.default(qp, kp, vp, dropout_p, is_causal, False,
                                                                 scale=og_scale)[0]
        return out[..., :og] if out.size(-1) != og else out
    mask = _convert_boolean_mask(attn_mask, query.dtype)
    if backend == EFFICIENT:
        if mask is not None:
            mask = _preprocess_mask(mask, query, key)
        return _aten._scaled_dot_product_efficient_attention.default(
            query, key, value, mask, grad, dropout_p, is_causal, scale=scale)[0]
    return _aten._scaled_dot_product_attention_math.default(
        query, key, value, mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa)[0]


# -- CPU kernels: real attention, CUDA's outputs -----------------------------------------------------
def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, causal: bool,
               dropout_p: float, scale: float | None, seed: int) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """Attention in fp32 on the CPU: (output, logsumexp B x H x L, what the backward needs).
    Grouped-query inputs (fewer key/value heads) are repeated; dropout keeps elements where
    ``torch.rand(generator seeded by seed) >= dropout_p`` (so the backward regenerates the mask)."""
    qf, kf, vf = q.float(), k.float(), v.float()
    hq, hk = qf.size(1), kf.size(1)
    if hk != hq:
        kf = kf.repeat_interleave(hq // hk, 1)
        vf = vf.repeat_interleave(hq // vf.size(1), 1)
    s = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    scores = torch.matmul(qf, kf.transpose(-2, -1)) * s
    if causal:
        L, S = scores.size(-2), scores.size(-1)
        scores = scores.masked_fill(~torch.ones(L, S, dtype=torch.bool).tril(), -math.inf)
    if bias is not None:
        scores = scores + bias.float()
    lse = torch.logsumexp(scores, -1)
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    keep = None
    if dropout_p > 0.0:
        gen = torch.Generator().manual_seed(int(seed))
        keep = torch.rand(probs.shape, generator=gen) >= dropout_p
        dropped = probs * keep / (1.0 - dropout_p)
    else:
        dropped = probs
    out = torch.matmul(dropped, vf)
    return out, lse, (qf, kf, vf, probs, keep, s, hq // hk)


def _reference_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        bias: torch.Tensor | None, causal: bool, dropout_p: float, scale: float | None,
                        seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`_reference` (q, k, v, bias) in fp32: dV = P_d^T dO, dP = dO V^T (masked
    and scaled as the dropout was), dS = P (dP - rowsum(dP P)), dQ = s dS K, dK = s dS^T Q; grouped
    heads summed back."""
    _, _, (qf, kf, vf, probs, keep, s, groups) = _reference(q, k, v, bias, causal, dropout_p, scale, seed)
    go = grad_out.float()
    dropped = probs if keep is None else probs * keep / (1.0 - dropout_p)
    dv = torch.matmul(dropped.transpose(-2, -1), go)
    dp = torch.matmul(go, vf.transpose(-2, -1))
    if keep is not None:
        dp = dp * keep / (1.0 - dropout_p)
    ds = probs * (dp - (dp * probs).sum(-1, keepdim=True))
    dq = torch.matmul(ds, kf) * s
    dk = torch.matmul(ds.transpose(-2, -1), qf) * s
    if groups > 1:
        b, h, t, d = dk.shape
        dk = dk.view(b, h // groups, groups, t, d).sum(2)
        dv = dv.view(b, h // groups, groups, t, dv.size(-1)).sum(2)
    return dq, dk, dv, ds


def _like(template: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """A CPU tensor with ``template``'s shape, strides and dtype holding ``value``."""
    out = torch.empty_strided(template.shape, template.stride(), dtype=template.dtype)
    out.copy_(value)
    return out


def _meta(t: Any) -> Any:
    if isinstance(t, torch.Tensor):
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    return t


def _seed() -> int:
    return int(torch.randint(0, 2**62, (1,)).item())


def _cpu_flash(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):  # noqa: ANN001, ANN201
    """``_scaled_dot_product_flash_attention`` on the CPU: the meta kernel's outputs, filled."""
    shapes = _aten._scaled_dot_product_flash_attention.default(
        _meta(query), _meta(key), _meta(value), dropout_p, is_causal, return_debug_mask, scale=scale)
    seed = _seed()
    out, lse, _ = _reference(query, key, value, None, is_causal, dropout_p, scale, seed)
    rng = torch.tensor([seed, 0], dtype=torch.uint64)
    return (_like(shapes[0], out), _like(shapes[1], lse), None, None, shapes[4], shapes[5], rng,
            torch.zeros((), dtype=torch.uint64), torch.empty(shapes[8].shape, dtype=shapes[8].dtype))


def _cpu_flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,  # noqa: ANN001, ANN201
                        dropout_p, is_causal, philox_seed, philox_offset, *, scale=None):
    dq, dk, dv, _ = _reference_backward(grad_out, query, key, value, None, is_causal, dropout_p, scale,
                                        int(philox_seed[0].item()))
    return _like_grad(query, dq), _like_grad(key, dk), _like_grad(value, dv)


def _like_grad(t: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``empty_like(t)`` (same strides) holding ``value``: the flash/cuDNN backward's gradients."""
    out = torch.empty_like(t)
    out.copy_(value)
    return out


def _cpu_efficient(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None):  # noqa: ANN001, ANN201
    shapes = _aten._scaled_dot_product_efficient_attention.default(
        _meta(query), _meta(key), _meta(value), _meta(attn_bias), compute_log_sumexp, dropout_p, is_causal,
        scale=scale)
    seed = _seed()
    out, lse, _ = _reference(query, key, value, attn_bias, is_causal, dropout_p, scale, seed)
    lse_out = torch.zeros(shapes[1].shape, dtype=torch.float32)
    if lse_out.numel():
        lse_out[..., :lse.size(-1)] = lse
    return (_like(shapes[0], out), lse_out, torch.tensor(seed, dtype=torch.long), torch.zeros((), dtype=torch.long))


def _cpu_efficient_backward(grad_out_, query, key, value, attn_bias, out, logsumexp, philox_seed, philox_offset,  # noqa: ANN001, ANN201
                            dropout_p, grad_input_mask, is_causal=False, *, scale=None):
    shapes = _aten._scaled_dot_product_efficient_attention_backward.default(
        _meta(grad_out_), _meta(query), _meta(key), _meta(value), _meta(attn_bias), _meta(out),
        _meta(logsumexp), _meta(philox_seed), _meta(philox_offset), dropout_p, grad_input_mask, is_causal,
        scale=scale)
    dq, dk, dv, ds = _reference_backward(grad_out_, query, key, value, attn_bias, is_causal, dropout_p, scale,
                                         int(philox_seed.item()))
    grad_bias = None
    if shapes[3] is not None:
        full = torch.empty(shapes[3].shape[:-1] + (shapes[3].size(-1) + (-shapes[3].size(-1)) % 16,),
                           dtype=shapes[3].dtype)[..., :shapes[3].size(-1)]
        grad_bias = full.copy_(ds.to(full.dtype))
    return _like(shapes[0], dq), _like(shapes[1], dk), _like(shapes[2], dv), grad_bias


def _cpu_cudnn(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False,  # noqa: ANN001, ANN201
               return_debug_mask=False, *, scale=None):
    shapes = _aten._scaled_dot_product_cudnn_attention.default(
        _meta(query), _meta(key), _meta(value), _meta(attn_bias), compute_log_sumexp, dropout_p, is_causal,
        return_debug_mask, scale=scale)
    seed = _seed()
    out, lse, _ = _reference(query, key, value, attn_bias, is_causal, dropout_p, scale, seed)
    return (_like(shapes[0], out), _like(shapes[1], lse.unsqueeze(-1)), None, None, shapes[4], shapes[5],
            torch.tensor(seed, dtype=torch.long), torch.zeros((), dtype=torch.long), None)


def _cpu_cudnn_backward(grad_out, query, key, value, out, logsumexp, philox_seed, philox_offset, attn_bias,  # noqa: ANN001, ANN201
                        cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, *, scale=None):
    bias = attn_bias if isinstance(attn_bias, torch.Tensor) and attn_bias.numel() else None
    dq, dk, dv, _ = _reference_backward(grad_out, query, key, value, bias, is_causal, dropout_p, scale,
                                        int(philox_seed.item()))
    return _like_grad(query, dq), _like_grad(key, dk), _like_grad(value, dv)


# -- workspaces inside the CUDA kernels ----------------------------------------------------------------
def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def flash_split_count(batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int, sm_count: int | None) -> int:
    """FlashAttention forward's ``num_splits`` for dropout 0: ``num_splits_heuristic(batch * heads *
    ceil(seqlen_q / 64), 2 * SMs, ceil(seqlen_k / block_n), 128)`` with block_n 256 / 128 / 64 for head
    sizes <= 64 / <= 128 / larger (``set_params_splitkv``, flash_api.cpp); 1 when the SM count is
    unknown."""
    if not sm_count:
        return 1
    block_n = 256 if head_dim <= 64 else (128 if head_dim <= 128 else 64)
    n_blocks = -(-seqlen_k // block_n)
    work = batch * heads * -(-seqlen_q // 64)
    sms = 2 * sm_count
    if work >= 0.8 * sms:
        return 1
    max_splits = min(128, sms, n_blocks)
    eligible = [s == 1 or -(-n_blocks // s) != -(-n_blocks // (s - 1)) for s in range(1, max_splits + 1)]
    eff = []
    for s in range(1, max_splits + 1):
        if not eligible[s - 1]:
            eff.append(0.0)
            continue
        waves = work * s / sms
        eff.append(waves / math.ceil(waves))
    best = max(eff) if eff else 0.0
    for s in range(1, max_splits + 1):
        if eligible[s - 1] and eff[s - 1] >= 0.85 * best:
            return s
    return 1


def _head_size_rounded(d: int) -> int:
    d8 = _round_up(d, 8)
    return _round_up(d8, 32 if d8 <= 128 else 64)


def _flash_forward_ws(args: tuple, kwargs: dict, gpu: GpuTarget) -> list[int]:
    q, k = args[0], args[1]
    dropout = float(args[3]) if len(args) > 3 else float(kwargs.get("dropout_p", 0.0))
    if dropout > 0.0:
        return []
    b, h, lq, d = q.shape
    splits = flash_split_count(b, h, lq, k.size(2), d, gpu.sm_count)
    if splits <= 1:
        return []
    return [splits * b * h * lq * 4, splits * b * h * lq * _head_size_rounded(d) * 4]


def _transposed_contiguous_copy(t: torch.Tensor) -> int:
    """Bytes of ``t.transpose(1, 2).contiguous()`` when that copies (0 when it is a view)."""
    tt = t.transpose(1, 2)
    return 0 if tt.is_contiguous() else tt.numel() * tt.element_size()


def _flash_backward_ws(args: tuple, kwargs: dict, gpu: GpuTarget) -> list[int]:
    grad_out, q, k, out = args[0], args[1], args[2], args[4]
    b, h, lq, d = q.shape
    hk = k.size(1)
    sizes = [_transposed_contiguous_copy(grad_out), _transposed_contiguous_copy(out)]
    lq_r = _round_up(lq, 128)
    sizes.append(b * h * lq_r * 4)                                   # softmax_d
    if torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled():
        nsplits = (gpu.sm_count + b * h - 1) // (b * h) if gpu.sm_count else 1
        sizes.append(nsplits * b * lq_r * h * _head_size_rounded(d) * 4)
    else:
        sizes.append(b * lq_r * h * _head_size_rounded(d) * 4)      # dq_accum
    if hk != h:                                                      # dk_expanded, dv_expanded
        sizes += [b * k.size(2) * h * d * q.element_size()] * 2
    return [s for s in sizes if s > 0]


def _efficient_forward_ws(args: tuple, kwargs: dict, gpu: GpuTarget) -> list[int]:
    q, v = args[0], args[2]
    kv = v.size(-1)
    if kv > 128 and q.dtype != torch.float32:   # kNeedsOutputAccumulatorBuffer: fp32 accumulator
        b, h, lq, _ = q.shape
        return [b * lq * h * kv * 4]
    return []


def _efficient_backward_ws(args: tuple, kwargs: dict, gpu: GpuTarget) -> list[int]:
    grad_out, q = args[0], args[1]
    b, h, lq, _ = q.shape
    return [s for s in (_transposed_contiguous_copy(grad_out), b * h * _round_up(lq, 32) * 4) if s > 0]


_WORKSPACES: dict[Any, Callable[[tuple, dict, GpuTarget], list[int]]] = {
    _aten._scaled_dot_product_flash_attention.default: _flash_forward_ws,
    _aten._scaled_dot_product_flash_attention_backward.default: _flash_backward_ws,
    _aten._scaled_dot_product_efficient_attention.default: _efficient_forward_ws,
    _aten._scaled_dot_product_efficient_attention_backward.default: _efficient_backward_ws,
}


def transient_requests(func: Any, args: tuple, kwargs: dict) -> list[int]:
    """Bytes of each workspace the CUDA kernel of ``func`` allocates inside the call and frees before
    it returns (see the module docstring), for the current target; [] for other ops or when not
    emulating."""
    fn = _WORKSPACES.get(func)
    gpu = current_target()
    if fn is None or gpu is None:
        return []
    return fn(args, kwargs, gpu)


# -- installation --------------------------------------------------------------------------------------
_CPU_KERNELS = {
    "_scaled_dot_product_flash_attention": _cpu_flash,
    "_scaled_dot_product_flash_attention_backward": _cpu_flash_backward,
    "_scaled_dot_product_efficient_attention": _cpu_efficient,
    "_scaled_dot_product_efficient_attention_backward": _cpu_efficient_backward,
    "_scaled_dot_product_cudnn_attention": _cpu_cudnn,
    "_scaled_dot_product_cudnn_attention_backward": _cpu_cudnn_backward,
}


def install(lib: Any) -> None:
    """Register :func:`_sdpa` for ``scaled_dot_product_attention`` at AutogradMeta and AutogradCPU and
    the CPU kernels of the fused attention ops (those the installed torch lacks) on ``lib`` (a
    ``torch.library.Library("aten", "IMPL")``; destroying it removes them)."""
    for key in ("AutogradMeta", "AutogradCPU"):
        lib.impl("scaled_dot_product_attention", _sdpa, key)
    for name, fn in _CPU_KERNELS.items():
        if not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", "CPU"):
            lib.impl(name, fn, "CPU")


def uninstall() -> None:
    """Nothing beyond destroying the library (kept for symmetry with the other kernel families)."""
