"""CUDA's autocast policy, applied to a step captured on ``meta`` or the CPU.

A capture runs the user's step on meta (or CPU) tensors, where ``torch.autocast("cuda")`` does
nothing: torch disables it without CUDA (``autocast.__init__`` warns "CUDA is not available") and
meta tensors carry no ``AutocastCUDA`` dispatch key. CPU autocast has other op lists (e.g. ``exp``,
``pow``, ``sum`` are not fp32 ops there). Yet mixed precision decides most of a step's memory: which
activations are saved in bf16/fp16, the fp32 copies ``exp`` or ``softmax`` make, and the low-precision
copies of the weights that the autocast cache keeps for the whole region. This module reproduces what
the ``AutocastCUDA`` kernels do, above autograd as they are (casts are autograd-recorded ``to`` calls,
so the low-precision inputs are what autograd saves), with a ``TorchFunctionMode``.

Source: aten/src/ATen/autocast_mode.h (``AT_FORALL_LOWER_PRECISION_FP``, ``AT_FORALL_FP32``,
``AT_FORALL_FP32_SET_OPT_DTYPE``, ``AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE``, ``AT_FORALL_PROMOTE``,
registered for ``AutocastCUDA`` in autocast_mode.cpp) and ``cached_cast`` in autocast_mode.cpp:

* lower_precision_fp ops cast every floating, non-double tensor argument to the autocast dtype;
  the cast of an fp32 leaf that requires grad and is not a view (a weight) is cached until the
  outermost autocast region exits (``clear_cache`` when ``autocast_decrement_nesting() == 0``).
* fp32 ops cast lower-precision floating arguments to fp32 (not cached).
* fp32_set_opt_dtype ops (softmax, log_softmax, sum, prod, cumsum, cumprod, vector/matrix norm) get
  ``dtype=torch.float32`` unless the caller gave one, when the first argument is floating and not
  double. ``norm`` (fp32_append_dtype) is treated as fp32.
* promote ops run in the widest floating type among their arguments.
* Inside a wrapped op autocast is off (``ExcludeDispatchKeyGuard``); ops in no list run unchanged.

Limits of doing this at the Python level: a function mode sees the Python-visible call, not the ATen
ops a C++ composite decomposes into. The composites whose decomposition matters are given their net
effect: ``cross_entropy`` (log_softmax with dtype=float, then nll_loss in fp32: the input is cast to
fp32 when it is lower precision), ``multi_head_attention_forward`` (its projections and attention
are lower_precision_fp ops: the inputs and weights are cast) and ``interpolate`` (upsample ops are
fp32).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

if TYPE_CHECKING:
    from oomtune.capture.gpu_target import GpuTarget

__all__ = ["LOWER_PRECISION_FP", "FP32", "FP32_SET_OPT_DTYPE", "PROMOTE", "CudaAutocastMode",
           "cuda_autocast", "emulate_cuda_autocast", "policy_of"]

#: AT_FORALL_LOWER_PRECISION_FP (autocast_mode.h), plus cudnn_convolution(_transpose) (.cpp).
LOWER_PRECISION_FP = frozenset({
    "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d",
    "conv_transpose3d", "convolution", "prelu", "addmm", "addmv", "addr", "matmul", "einsum", "mm",
    "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
    "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell",
    "rnn_relu_cell", "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
    "cudnn_convolution", "cudnn_convolution_transpose",
    # Python spellings of the same ops
    "__matmul__", "__rmatmul__",
    # composite: in_proj/out_proj linears and the attention inside are lower_precision_fp ops
    "multi_head_attention_forward",
})
#: AT_FORALL_FP32, plus norm (fp32_append_dtype: runs in fp32) and interpolate (upsample_* ops).
FP32 = frozenset({
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal",
    "rsqrt", "sinh", "tan", "pow", "__pow__", "__rpow__", "float_power", "softplus", "layer_norm",
    "native_layer_norm", "group_norm", "frobenius_norm", "nuclear_norm", "cosine_similarity",
    "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss",
    "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss",
    "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
    "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
    "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d",
    "_upsample_nearest_exact2d", "upsample_nearest3d", "_upsample_nearest_exact3d",
    "upsample_linear1d", "upsample_bilinear2d", "_upsample_bilinear2d_aa", "upsample_trilinear3d",
    "upsample_bicubic2d", "_upsample_bicubic2d_aa",
    "norm", "interpolate",
    # composite: log_softmax(dtype=float) + nll_loss (fp32)
    "cross_entropy",
})
#: AT_FORALL_FP32_SET_OPT_DTYPE.
FP32_SET_OPT_DTYPE = frozenset({
    "prod", "softmax", "log_softmax", "cumprod", "cumsum", "linalg_vector_norm", "linalg_matrix_norm",
    "sum",
})
#: AT_FORALL_PROMOTE.
PROMOTE = frozenset({
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put",
    "tensordot", "scatter_add",
})


def policy_of(func: Any) -> str | None:
    """The CUDA autocast policy of a torch function by name: ``"lower"``, ``"fp32"``,
    ``"fp32_set_opt_dtype"``, ``"promote"`` or ``None`` (not wrapped: runs unchanged)."""
    name = getattr(func, "__name__", None)
    if name is None:
        return None
    if name in LOWER_PRECISION_FP:
        return "lower"
    if name in FP32:
        return "fp32"
    if name in FP32_SET_OPT_DTYPE:
        return "fp32_set_opt_dtype"
    if name in PROMOTE:
        return "promote"
    return None


def _eligible(t: Any) -> bool:
    """``is_eligible`` in autocast_mode.h: a defined floating tensor that is not double (the device
    check, ``is_cuda``, is what the emulation replaces: capture tensors stand for CUDA ones)."""
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64


class _State:
    __slots__ = ("enabled", "dtype", "cache_enabled")

    def __init__(self, enabled: bool, dtype: torch.dtype, cache_enabled: bool) -> None:
        self.enabled, self.dtype, self.cache_enabled = enabled, dtype, cache_enabled


class CudaAutocastMode(TorchFunctionMode):
    """A function mode applying CUDA's autocast policy while its top state is enabled.

    One instance per thread serves nested regions: :meth:`push` / :meth:`pop` mirror
    ``autocast.__enter__`` / ``__exit__``; the weight-cast cache is cleared when the outermost region
    is popped. Use :func:`cuda_autocast` rather than this class directly.
    """

    def __init__(self) -> None:
        super().__init__()
        self._states: list[_State] = []
        self._cache: dict[int, tuple[weakref.ref, torch.Tensor]] = {}

    def push(self, enabled: bool, dtype: torch.dtype, cache_enabled: bool = True) -> None:
        """Enter a region (``torch.autocast("cuda", dtype, enabled, cache_enabled)``)."""
        self._states.append(_State(enabled, dtype, cache_enabled))

    def pop(self) -> bool:
        """Leave a region; returns True when it was the outermost one (the cache is then cleared)."""
        self._states.pop()
        if not self._states:
            self._cache.clear()
            return True
        return False

    # -- casting -----------------------------------------------------------------------------------
    def _cast(self, t: Any, dtype: torch.dtype, state: _State) -> Any:
        if not _eligible(t) or t.dtype == dtype:
            return t
        cacheable = (dtype == state.dtype and t.dtype == torch.float32 and t.requires_grad
                     and t.is_leaf and not t._is_view() and state.cache_enabled)
        if not cacheable:
            return t.to(dtype)
        hit = self._cache.get(id(t))
        if hit is not None and hit[0]() is t:
            return hit[1]
        out = t.to(dtype)
        self._cache[id(t)] = (weakref.ref(t), out)
        return out

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        state = self._states[-1] if self._states else None
        policy = policy_of(func) if state is not None and state.enabled else None
        if policy is None:
            return func(*args, **kwargs)
        if policy == "lower":
            cast = self._cast
            args, kwargs = tree_map(lambda t: cast(t, state.dtype, state), (args, kwargs))
        elif policy == "fp32":
            args, kwargs = tree_map(lambda t: self._cast(t, torch.float32, state), (args, kwargs))
        elif policy == "fp32_set_opt_dtype":
            first = next((a for a in args if isinstance(a, torch.Tensor)), None)
            if _eligible(first) and kwargs.get("dtype") is None:
                kwargs = dict(kwargs, dtype=torch.float32)
        else:  # promote
            leaves = [t for t in _tensors((args, kwargs)) if _eligible(t)]
            to = torch.float32 if any(t.dtype == torch.float32 for t in leaves) else state.dtype
            args, kwargs = tree_map(lambda t: self._cast(t, to, state), (args, kwargs))
        return func(*args, **kwargs)


def _tensors(tree: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    tree_map(lambda t: out.append(t) if isinstance(t, torch.Tensor) else None, tree)
    return out


_local = threading.local()


def _mode() -> CudaAutocastMode:
    mode = getattr(_local, "mode", None)
    if mode is None:
        mode = _local.mode = CudaAutocastMode()
    return mode


@contextlib.contextmanager
def _region(enabled: bool, dtype: torch.dtype, cache_enabled: bool) -> Iterator[None]:
    mode = _mode()
    outermost = not mode._states
    mode.push(enabled, dtype, cache_enabled)
    try:
        if outermost:
            with mode:
                yield
        else:
            yield
    finally:
        mode.pop()


def cuda_autocast(dtype: torch.dtype = torch.float16, enabled: bool = True,
                  cache_enabled: bool = True) -> contextlib.AbstractContextManager:
    """A region that behaves as ``torch.autocast("cuda", dtype, enabled, cache_enabled)`` would on a
    GPU, for meta or CPU tensors (see the module docstring). ``dtype`` defaults to fp16 as CUDA's
    autocast does. Nested regions follow the innermost one; ``enabled=False`` turns it off inside.
    """
    return _region(enabled, dtype, cache_enabled)


_patch_lock = threading.Lock()
_patch_depth = 0
_saved: dict[str, Any] = {}
_mapped: list[Any] = []   # callbacks told of each torch.autocast("cpu" | "meta") routed to CUDA's policy
#: Device types whose ``torch.autocast`` a capture routes to CUDA's policy: the capture's tensors
#: stand for CUDA ones, so code that asks for autocast on the tensors' device type (the HF Trainer's
#: ``bf16=True`` and Lightning's ``bf16-mixed`` on a CPU machine, ``device_type=x.device.type``)
#: asks, on the GPU, for CUDA's.
MAPPED_DEVICES = ("cuda", "cpu", "meta")


@contextlib.contextmanager
def emulate_cuda_autocast(on_mapped: Any = None, *, map_devices: bool = True,
                          gpu: GpuTarget | None = None) -> Iterator[None]:
    """Within this block, ``torch.autocast`` for ``cuda``, ``cpu`` or ``meta`` (and
    ``torch.cuda.amp.autocast``, ``torch.cpu.amp.autocast``) in the captured code applies CUDA's
    policy to meta/CPU tensors through :func:`cuda_autocast`, instead of being disabled for lack of a
    GPU (cuda), following the CPU's op lists (cpu) or raising (meta: torch has no meta autocast).
    A ``cpu``/``meta`` region with no dtype gets CUDA's default, fp16, as the same code on a GPU would.
    ``on_mapped(device_type, dtype, enabled)`` is called for each ``cpu``/``meta`` region (the
    capture's record says so). ``torch.is_autocast_enabled(device)`` and
    ``torch.get_autocast_dtype(device)`` report the emulated region for those device types, so code
    that saves and restores the state (activation checkpointing's recomputation,
    ``torch.utils.checkpoint._get_autocast_kwargs``) restores the emulated policy.

    Mechanism: ``torch.amp.autocast_mode.autocast.__init__``/``__enter__``/``__exit__`` are wrapped for
    the duration (reentrant, process-wide; restored on exit), and the two availability checks
    ``autocast.__init__`` makes (``torch.cuda.amp.common.amp_definitely_not_available``,
    ``torch.cuda.is_bf16_supported``) report a GPU, the target GPU ``gpu`` (a
    :class:`oomtune.capture.gpu_target.GpuTarget`; None: :data:`~oomtune.capture.gpu_target.DEFAULT_GPU`):
    ``is_bf16_supported(including_emulation)`` answers as torch does on that card
    (:func:`oomtune.capture.target_cuda.bf16_supported`: True from compute capability 8.0, below it
    ``including_emulation``, default True), so a bf16 region is kept as given on any card, as on a GPU
    (``autocast.__init__`` calls the default), and the user's arguments (dtype, enabled,
    cache_enabled) are kept as given. ``map_devices=False`` and ``gpu`` are decided by the outermost
    block; with ``map_devices=False`` only ``cuda`` regions are routed, cpu and meta behave as without
    a capture.
    """
    global _patch_depth
    with _patch_lock:
        if _patch_depth == 0:
            _install(map_devices, gpu)
        _patch_depth += 1
        if on_mapped is not None:
            _mapped.append(on_mapped)
    try:
        yield
    finally:
        with _patch_lock:
            if on_mapped is not None:
                _mapped.remove(on_mapped)
            _patch_depth -= 1
            if _patch_depth == 0:
                _uninstall()


def _emulated_state() -> _State | None:
    mode = getattr(_local, "mode", None)
    return mode._states[-1] if mode is not None and mode._states else None


def _install(map_devices: bool = True, gpu: GpuTarget | None = None) -> None:
    import torch.cuda.amp.common as amp_common
    from torch.amp.autocast_mode import autocast

    from oomtune.capture.gpu_target import DEFAULT_GPU, parse_gpu
    from oomtune.capture.target_cuda import bf16_supported

    target = gpu if gpu is not None else parse_gpu(DEFAULT_GPU, source="default")

    _saved.update(init=autocast.__init__, enter=autocast.__enter__, exit=autocast.__exit__,
                  not_available=amp_common.amp_definitely_not_available,
                  bf16=torch.cuda.is_bf16_supported, is_enabled=torch.is_autocast_enabled,
                  get_dtype=torch.get_autocast_dtype)
    orig_init, orig_enter, orig_exit = autocast.__init__, autocast.__enter__, autocast.__exit__
    is_enabled, get_dtype = torch.is_autocast_enabled, torch.get_autocast_dtype

    def __init__(self, device_type, dtype=None, enabled=True, cache_enabled=None):  # noqa: ANN001, N807
        if map_devices and isinstance(device_type, str) and device_type in ("cpu", "meta"):
            for callback in list(_mapped):
                callback(device_type, dtype if dtype is not None else torch.float16, enabled)
            device_type = "cuda"
        orig_init(self, device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)

    def __enter__(self):  # noqa: ANN001, N807
        if getattr(self, "device", None) != "cuda":
            return orig_enter(self)
        self._oomtune_region = _region(self._enabled, self.fast_dtype, self._cache_enabled)
        self._oomtune_region.__enter__()
        return self

    def __exit__(self, *exc):  # noqa: ANN001, N807
        region = getattr(self, "_oomtune_region", None)
        if region is None:
            return orig_exit(self, *exc)
        self._oomtune_region = None
        region.__exit__(*exc)
        return False

    mapped = MAPPED_DEVICES if map_devices else ("cuda",)

    def is_autocast_enabled(device_type=None):  # noqa: ANN001, ANN202
        if device_type is None or device_type in mapped:
            state = _emulated_state()
            return bool(state is not None and state.enabled)
        return is_enabled(device_type)

    def get_autocast_dtype(device_type):  # noqa: ANN001, ANN202
        if device_type in mapped:
            state = _emulated_state()
            return state.dtype if state is not None else torch.float16
        return get_dtype(device_type)

    autocast.__init__, autocast.__enter__, autocast.__exit__ = __init__, __enter__, __exit__
    amp_common.amp_definitely_not_available = lambda: False
    # torch/cuda/__init__.py is_bf16_supported(including_emulation=True), answered for the target card
    torch.cuda.is_bf16_supported = lambda including_emulation=True: bf16_supported(target, including_emulation)
    torch.is_autocast_enabled = is_autocast_enabled
    torch.get_autocast_dtype = get_autocast_dtype


def _uninstall() -> None:
    import torch.cuda.amp.common as amp_common
    from torch.amp.autocast_mode import autocast

    autocast.__init__, autocast.__enter__, autocast.__exit__ = _saved["init"], _saved["enter"], _saved["exit"]
    amp_common.amp_definitely_not_available = _saved["not_available"]
    torch.cuda.is_bf16_supported = _saved["bf16"]
    torch.is_autocast_enabled = _saved["is_enabled"]
    torch.get_autocast_dtype = _saved["get_dtype"]
    _saved.clear()
