"""Optimizer implementations chosen as on CUDA: foreach by default, fused where asked.

``torch.optim`` picks an implementation per step when the user gave none
(``_default_to_fused_or_foreach`` in torch/optim/optimizer.py): foreach when every parameter is on a
device of ``_get_foreach_kernels_supported_devices()`` (cuda, xpu, mtia, privateuse1). Meta and CPU
parameters are not, so a capture runs the per-tensor loop, while a CUDA run of the same code runs
the foreach one, whose step allocates temporaries in proportion to the parameters (e.g. Adam's
``torch._foreach_sqrt(exp_avg_sqs)``, ``_foreach_mul`` of the bias corrections). ``fused=True``
checks ``_get_fused_kernels_supported_devices()`` at construction and keeps ``step`` on the device
(``_init_group``). While a capture emulates a GPU, both lists also name the capture's device types
(meta, cpu), so the same code picks the implementation a CUDA run picks; the foreach and fused ops
have meta kernels and CPU fallbacks that return the same tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["install", "uninstall"]

_saved: dict[str, Any] = {}
_wrapped: dict[str, Any] = {}


def install(on_use: Callable[[str, str], None]) -> None:
    """Patch ``torch.optim.optimizer``'s two device lists, and wrap ``_default_to_fused_or_foreach``
    where each ``torch.optim`` module imported it, so that ``on_use(optimizer module, implementation)``
    (``"adamw", "foreach"``; ``"fused"``, ``"for-loop"``) tells the capture's notes what ran."""
    import sys

    import torch.optim.optimizer as O

    foreach, fused = O._get_foreach_kernels_supported_devices, O._get_fused_kernels_supported_devices
    _saved.update(foreach=foreach, fused=fused)
    O._get_foreach_kernels_supported_devices = lambda: list(dict.fromkeys([*foreach(), "meta", "cpu"]))
    O._get_fused_kernels_supported_devices = lambda: list(dict.fromkeys([*fused(), "meta", "cpu"]))
    for name, module in list(sys.modules.items()):
        original = getattr(module, "_default_to_fused_or_foreach", None) if name.startswith("torch.optim.") else None
        if original is None or name == "torch.optim.optimizer":
            continue

        def choose(params: Any, differentiable: bool, use_fused: bool = False, *, _f: Any = original,
                   _n: str = name.rsplit(".", 1)[-1]) -> tuple[bool, bool]:
            got = _f(params, differentiable, use_fused)
            on_use(_n, "fused" if got[0] else "foreach" if got[1] else "for-loop")
            return got

        _wrapped[name] = original
        module._default_to_fused_or_foreach = choose


def uninstall() -> None:
    """Restore the device lists and the wrapped functions."""
    import sys

    import torch.optim.optimizer as O

    if _saved:
        O._get_foreach_kernels_supported_devices = _saved.pop("foreach")
        O._get_fused_kernels_supported_devices = _saved.pop("fused")
    for name, original in _wrapped.items():
        if name in sys.modules:
            sys.modules[name]._default_to_fused_or_foreach = original
    _wrapped.clear()
