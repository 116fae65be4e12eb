"""cuDNN convolution workspaces, requested from the caching allocator as torch's cuDNN path does.

On CUDA, ``aten::convolution`` and ``aten::convolution_backward`` run cuDNN for most inputs, and
each cuDNN call asks the caching allocator for a workspace inside the call and frees it before the
call returns. A capture on meta or CPU runs other kernels and sees none of it;
:func:`conditional_requests` adds those requests to the capture (:mod:`oomtune.capture.recorder`),
as requests decided when they are made (:mod:`oomtune.alloc.stream`: ``try``, ``probe``,
``empty_cache``).

The pattern, from PyTorch's source (aten/src/ATen/native/Convolution.cpp, ConvUtils.h,
cudnn/ConvShared.cpp, cudnn/Conv_v8.cpp; the cuDNN v8/v9 API path, torch's default):

* Which calls reach cuDNN (``_select_conv_backend``, ``ConvParams::use_cudnn`` /
  ``use_cudnn_depthwise``): every convolution on a CUDA tensor with ``torch.backends.cudnn.enabled``,
  except a depthwise one (input channels == groups > 1, 4-D or 5-D, not transposed) in the
  contiguous memory format, which runs the native ``CudaDepthwise2d``/``3d`` kernels (no
  workspace). A channels-last depthwise convolution runs cuDNN ("always use cudnn_depthwise for
  channels_last format"). Not ported: fp16 contiguous depthwise convolutions that pass
  ``check_cudnn_depthwise_workload``'s shape thresholds (they run cuDNN on CUDA; here they are
  taken as native, without workspace).
* Which cuDNN operations (ConvShared.cpp): ``cudnn_convolution`` runs one forward
  (``raw_cudnn_convolution_forward_out``); its backward runs backward-data for ``grad_input`` then
  backward-weight for ``grad_weight`` (``cudnn_convolution_backward``, by ``output_mask``; the bias
  gradient is a reduction, no cuDNN). ``cudnn_convolution_transpose`` runs backward-data as its
  forward; its backward runs forward for ``grad_input`` and backward-weight for ``grad_weight``.
  A 1-d convolution runs as 2-d (``view1d_as_2d``).
* One call (``run_single_conv``, Conv_v8.cpp). A plan cached for the call's key (shapes, strides'
  memory format, dtype, padding, stride, dilation, groups, deterministic, allow_tf32, alignments;
  ``CacheKeyWrapper``) allocates its workspace (``run_conv_plan``:
  ``CUDACachingAllocator::get()->allocate(plan.getWorkspaceSize())``), freed when the call ends;
  an OutOfMemoryError there drops to the search below. With ``torch.backends.cudnn.benchmark``
  False (the default) the search builds the heuristic engine configs in order and runs the first
  whose workspace the allocator grants (``get_configs_from_heuristics`` + ``try_configs``, which
  catches each ``OutOfMemoryError``), then the fallback list the same way: one ``try`` request
  over the candidates' workspaces. With benchmark True (``get_plans_from_find``): the plans whose
  workspace is not above ``cacheInfo`` (``get_available_workspace``: free device memory or the
  largest cached free block) are kept, the largest of their workspaces is allocated and halved on
  each ``OutOfMemoryError`` (``generate_and_filter_plans``: a ``probe``), held while every plan is
  timed, and freed; then ``emptyCache`` (``_cudnn_get_conv_benchmark_empty_cache()``, true by
  default: Convolution.cpp ``conv_benchmark_empty_cache``) and the timed plans are run in order
  like the heuristic ones (``try_plans``). The next calls with the same key reuse the plan.
  ``torch.backends.cudnn.deterministic`` only drops engines with the nondeterministic note
  (``filterEngineConfigs``); both workspace rules below are deterministic engines, so it changes
  nothing here.

The sizes: cuDNN picks its engine at run time and publishes no workspace size per engine and
architecture, so the size is a rule chosen per GPU architecture (:data:`ARCH_RULE`), overridable
with ``OOMTUNE_CUDNN_WORKSPACE`` (:data:`RULES`):

* ``"implicit"`` (the default everywhere): 0 bytes, the documented workspace of the implicit-GEMM
  algorithm ("CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM ... does not need any memory workspace",
  cuDNN API reference, ``cudnnConvolutionFwdAlgo_t``), which is in every fallback list: the lower
  bound of what a cuDNN call can request. Nothing is requested (torch never asks the allocator
  for 0 bytes).
* ``"gemm"``: the explicit-GEMM algorithm's workspace, the lowered input matrix of Chetlur et al.,
  "cuDNN: Efficient Primitives for Deep Learning" (arXiv:1410.0759, section 3.1: C*R*S rows by
  N*P*Q columns), per group (C/groups input channels), in the input's element size; the same
  matrix is the lowered gradient of backward-data and the lowered input of backward-weight. A
  call tries it first and falls back to 0 (the implicit-GEMM engine). Not a bound: FFT and
  Winograd engines can ask for more ("significant memory workspace", the same reference).

No rule is fitted to measurements; the per-architecture table says which one a target gets and
why (none has a published engine choice, so every architecture gets the lower bound).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from oomtune.capture.cudnn_rule import ENV, RULES, env_rule

__all__ = ["RULES", "ARCH_RULE", "ENV", "rule_for", "cudnn_operations", "gemm_workspace_bytes",
           "conditional_requests", "reset", "uses_cudnn"]

#: The rule per architecture (``GpuTarget.sm``): no architecture has a published engine choice or
#: workspace size, so each gets the lower bound ("implicit"); an architecture not listed too.
ARCH_RULE: dict[str, str] = {sm: "implicit" for sm in ("sm70", "sm75", "sm80", "sm86", "sm87", "sm89", "sm90",
                                                        "sm100", "sm120")}

_aten = torch.ops.aten
FORWARD, BACKWARD_DATA, BACKWARD_WEIGHT = "forward", "backward_data", "backward_weight"
_seen: set[tuple] = set()   # the keys whose plan torch's benchmark cache holds (this capture)


def reset() -> None:
    """Forget the plans cached so far (a new capture is a new process for torch's cache)."""
    _seen.clear()


def rule_for(sm: str) -> str:
    """The workspace rule for architecture ``sm`` (``sm80``): ``OOMTUNE_CUDNN_WORKSPACE`` when set,
    else :data:`ARCH_RULE` (``"implicit"`` for an architecture not listed).

    Raises:
        ConfigError: ``OOMTUNE_CUDNN_WORKSPACE`` names no rule (one line naming the choices;
            :func:`oomtune.capture.cudnn_rule.env_rule`).
    """
    return env_rule() or ARCH_RULE.get(sm, "implicit")


def _channels_last(t: torch.Tensor) -> bool:
    """``cudnn_conv_suggest_memory_format`` for one tensor: channels-last strides that are not also
    the contiguous ones."""
    if t.dim() == 4:
        fmt = torch.channels_last
    elif t.dim() == 5:
        fmt = torch.channels_last_3d
    else:
        return False
    return t.is_contiguous(memory_format=fmt) and not t.is_contiguous()


def uses_cudnn(x: torch.Tensor, weight: torch.Tensor, transposed: bool, groups: int) -> bool:
    """Whether CUDA runs this convolution with cuDNN (``_select_conv_backend``,
    aten/src/ATen/native/Convolution.cpp; see the module docstring): cuDNN enabled, a floating
    dtype, and not a contiguous depthwise convolution."""
    if not torch.backends.cudnn.enabled or x.dtype not in (torch.float32, torch.float16, torch.bfloat16,
                                                             torch.float64):
        return False
    depthwise = (not transposed and x.dim() in (4, 5) and groups > 1 and x.shape[1] == groups
                 and weight.shape[0] % x.shape[1] == 0)
    if depthwise:
        return _channels_last(x) or _channels_last(weight)
    return True


def cudnn_operations(func: Any, args: tuple) -> list[tuple[str, tuple]]:
    """The cuDNN operations CUDA runs for ``func(*args)`` (``aten.convolution.default`` or
    ``aten.convolution_backward.default``), in order, each ``(operation, conv)`` with ``conv`` =
    ``(N, C_in, kernel, out_spatial, groups, itemsize, channels_last)`` of the convolution cuDNN
    computes (for a transposed convolution: the convolution it transposes). [] when CUDA would not
    run cuDNN (:func:`uses_cudnn`).
    """
    if func is _aten.convolution.default:
        x, weight, _bias, _stride, _padding, _dilation, transposed, _out_pad, groups = args[:9]
        mask = None
    elif func is _aten.convolution_backward.default:
        _grad, x, weight, _bias_sizes, _stride, _padding, _dilation, transposed, _out_pad, groups, mask = args[:11]
    else:
        return []
    if not isinstance(x, torch.Tensor) or x.dim() < 3 or not uses_cudnn(x, weight, bool(transposed), int(groups)):
        return []
    groups = int(groups)
    kernel = tuple(weight.shape[2:])
    if transposed:
        # the convolution transposed: its input is this op's output (C = weight.shape[1] * groups),
        # its output this op's input
        n, c_conv, y_spatial = x.shape[0], weight.shape[1] * groups, tuple(x.shape[2:])
    else:
        n, c_conv = x.shape[0], x.shape[1]
        y_spatial = _conv_out_spatial(x, weight, args, func)
    conv = (int(n), int(c_conv), kernel, y_spatial, groups, x.element_size(),
            _channels_last(x) or _channels_last(weight))
    if func is _aten.convolution.default:
        return [(BACKWARD_DATA if transposed else FORWARD, conv)]
    ops = []
    if mask[0]:
        ops.append((FORWARD if transposed else BACKWARD_DATA, conv))
    if mask[1]:
        ops.append((BACKWARD_WEIGHT, conv))
    return ops


def _conv_out_spatial(x: torch.Tensor, weight: torch.Tensor, args: tuple, func: Any) -> tuple[int, ...]:
    """The output's spatial sizes of a (non-transposed) convolution: for the backward, the
    gradient's (``args[0]``); for the forward, (in + 2 pad - dil (k - 1) - 1) // stride + 1
    (``conv_output_size``, ConvUtils.h)."""
    if func is _aten.convolution_backward.default:
        return tuple(int(s) for s in args[0].shape[2:])
    stride, padding, dilation = args[3], args[4], args[5]
    out = []
    for i, size in enumerate(x.shape[2:]):
        k = weight.shape[2 + i]
        out.append((int(size) + 2 * padding[i] - dilation[i] * (k - 1) - 1) // stride[i] + 1)
    return tuple(out)


def gemm_workspace_bytes(conv: tuple) -> int:
    """The explicit-GEMM workspace of one cuDNN call (bytes): the lowered matrix of Chetlur et al.
    2014, section 3.1, (C/groups * prod(kernel)) x (N * prod(output spatial)) elements of the input's
    size (see the module docstring)."""
    n, c, kernel, y_spatial, groups, itemsize, _ = conv
    return (c // groups) * math.prod(kernel) * n * math.prod(y_spatial) * itemsize


def _candidates(conv: tuple, rule: str) -> list[int]:
    """The workspaces (bytes) of the engines a call tries, in order, under ``rule``."""
    if rule == "gemm":
        return [gemm_workspace_bytes(conv), 0]
    return [0]


def conditional_requests(func: Any, args: tuple, gpu_sm: str) -> list[tuple[str, list[int]]]:
    """The requests the cuDNN calls of ``func(*args)`` make on a CUDA GPU of architecture ``gpu_sm``,
    in order, each freed before the next: ``("try", sizes)``, ``("probe", sizes)`` (the benchmark's
    first call per key, followed by ``("empty_cache", [])``), see the module docstring. Requests of
    0 bytes only are left out (torch never asks the allocator for 0 bytes). Updates the plans
    cached (:func:`reset`).

    Raises:
        ValueError: ``OOMTUNE_CUDNN_WORKSPACE`` names no rule.
    """
    ops = cudnn_operations(func, args)
    if not ops:
        return []
    rule = rule_for(gpu_sm)
    benchmark = torch.backends.cudnn.benchmark
    key_flags = (torch.backends.cudnn.deterministic, torch.backends.cudnn.allow_tf32)
    out: list[tuple[str, list[int]]] = []
    for op, conv in ops:
        sizes = _candidates(conv, rule)
        key = (op, conv, key_flags)
        if benchmark and key not in _seen:
            if any(sizes):
                out.append(("probe", sizes))
            out.append(("empty_cache", []))
        _seen.add(key)
        if any(sizes):
            out.append(("try", sizes))
    return out
