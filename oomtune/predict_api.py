"""``oomtune.predict``: one training configuration's memory on a named GPU, from Python.

The same predictor as ``oomtune plan`` (:class:`oomtune.plan.predictor.Predictor`: the user's
``make_workload`` captured on the meta device under the target GPU's kernels, replayed on the virtual
GPU), for one batch size and one ``PYTORCH_CUDA_ALLOC_CONF``, with the card's geometry: its whole
memory as the budget, the cuBLAS workspaces of a CUDA process as requests, and the memory outside the
allocator from the table (:func:`oomtune.gpu.outside.outside_allocator`), so that the figure compared
with ``nvidia-smi`` is :attr:`Prediction.device_used_bytes`. Every figure is simulated (virtual GPU).

Example::

    import oomtune
    p = oomtune.predict("train.py:make_workload", 64, gpu="A100-SXM4-40GB")
    print(p.device_used_bytes / 2**20, p.fits)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["Prediction", "predict"]


@dataclass(frozen=True)
class Prediction:
    """The predicted memory of one training configuration (bytes; simulated on the virtual GPU).

    Attributes:
        peak_allocated_bytes: the peak of ``torch.cuda.max_memory_allocated()`` over the steps.
        peak_reserved_bytes: the peak of ``torch.cuda.max_memory_reserved()`` (what the caching
            allocator holds from the device, cuBLAS workspaces included).
        outside_allocator_bytes: memory outside the allocator (CUDA context, libraries): the table's
            estimate (:func:`oomtune.gpu.outside.outside_allocator`), a lower bound where
            ``notes`` name components without a published figure.
        device_used_bytes: ``peak_reserved_bytes + outside_allocator_bytes``: what ``nvidia-smi
            memory.used`` would show for the process at its peak.
        fits: the steps complete on the card: the replay under the card's memory (less the outside
            part) ran without an out-of-memory error.
        notes: how the prediction was made (capture device, the outside part's sources and gaps).
    """

    peak_allocated_bytes: int
    peak_reserved_bytes: int
    outside_allocator_bytes: int
    device_used_bytes: int
    fits: bool
    notes: tuple[str, ...]


@functools.lru_cache(maxsize=1)
def _default_steps() -> int:
    """``trial.warmup_steps + trial.measure_steps`` of the default config (conf/config.yaml): the
    steps ``oomtune plan`` captures (:func:`oomtune.plan.predictor.trial_steps`)."""
    from oomtune.config import compose
    from oomtune.plan.predictor import trial_steps

    return trial_steps(compose([]).trial)


def predict(entry: str | Callable[..., Any], batch_size: int, *, gpu: str = "A100-SXM4-40GB",
            alloc_conf: str = "", steps: int | None = None, cudnn: bool = False,
            lazy_loading: bool = True) -> Prediction:
    """Predict one training configuration's memory on ``gpu``, as ``oomtune plan`` does.

    Args:
        entry: the ``make_workload(batch_size, device)`` function itself, or ``"file.py:function"`` /
            ``"package.module:function"`` (the ``target=python`` protocol,
            :mod:`oomtune.targets.python_entry`).
        batch_size: samples per step (>= 1).
        gpu: a card of the device catalogue with a memory figure, by its catalogue name (``l4``,
            ``h100-80gb``, the MIG slice ``a100-40gb-1g.5gb``) or the name torch reports
            (``A100-SXM4-40GB``, ``NVIDIA H100 80GB HBM3``; :mod:`oomtune.gpu.catalogue`): its
            compute capability and SM count pick the kernels (attention backends, cuBLAS workspace
            size) and its memory (``cudaDeviceProp::totalGlobalMem``) is the budget.
        alloc_conf: a ``PYTORCH_CUDA_ALLOC_CONF`` value (native backend only).
        steps: optimizer steps to capture; None: the default trial's ``warmup_steps +
            measure_steps`` (4), what ``oomtune plan`` captures.
        cudnn: whether the process runs cuDNN (convolutions): the outside part then names cuDNN
            among the components without a published figure (counted as 0).
        lazy_loading: ``CUDA_MODULE_LOADING=LAZY`` (torch's default).

    Returns:
        A frozen :class:`Prediction`.

    Raises:
        ConfigError: an unknown ``gpu``, a bad ``batch_size`` or ``steps``, a bad entry or a
            ``make_workload`` that does not follow the protocol, settings the virtual GPU cannot
            simulate (``backend:cudaMallocAsync``). AllocatorConfigError: a malformed ``alloc_conf``.
    """
    from oomtune.alloc.settings import AllocatorSettings
    from oomtune.device import TargetDevice
    from oomtune.exceptions import ConfigError
    from oomtune.gpu.outside import CARDS, card_of, outside_allocator
    from oomtune.plan.predictor import Predictor, sim_geometry

    card = card_of(gpu) if isinstance(gpu, str) else None
    if card is None:
        raise ConfigError(f"gpu={gpu!r}: unknown card; choose one of the device catalogue's "
                          f"{', '.join(c.name for c in CARDS.values())} (or a display name such as A100-SXM4-40GB)")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size={batch_size!r}: expected an integer >= 1")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ConfigError(f"steps={steps!r}: expected an integer >= 1 (or None for the trial's default)")
    settings = AllocatorSettings.parse(alloc_conf)
    if isinstance(entry, str):
        from oomtune.targets.python_entry import load_entry

        load_entry(entry)   # the caller's own process: its module imported here, as the caller would
    elif not callable(entry):
        raise ConfigError(f"entry={entry!r}: expected make_workload itself or 'file.py:function'")
    steps = _default_steps() if steps is None else steps
    from oomtune.targets.python_entry import entry_label
    from oomtune.workload_spec import WorkloadSpec

    # a function passed itself is no JSON value: the spec names it, the predictor captures the function
    workload = WorkloadSpec(target={"name": "python", "entry": entry if isinstance(entry, str) else entry_label(entry)},
                            gpu=card.gpu_key, gpu_source="model.gpu")
    device = TargetDevice(spec="cuda:0", kind="cuda", index=0, name=card.display_name,
                          total_memory_bytes=card.total_memory_bytes, simulated=False)
    # the outside part decides the card's allocator share
    outside = outside_allocator(lazy_loading=lazy_loading, cudnn=bool(cudnn), capability=card.compute_capability)
    geometry = sim_geometry(device, card.total_memory_bytes, outside_bytes=outside.total_bytes)
    predictor = Predictor(workload, geometry, steps=steps, derive=False,
                          entry=None if isinstance(entry, str) else entry)
    pred = predictor.predict_detail(batch_size, settings)
    notes = [f"simulated on the virtual GPU: {card.display_name} ({card.total_memory_bytes / 2**20:.0f} MiB, "
             f"{card.source}), {steps} steps, alloc_conf={settings.render()!r}", outside.describe()]
    notes.extend(sorted(predictor.fallback_reasons))
    return Prediction(peak_allocated_bytes=int(pred.peak_allocated_bytes),
                      peak_reserved_bytes=int(pred.peak_reserved_bytes),
                      outside_allocator_bytes=outside.total_bytes,
                      device_used_bytes=int(pred.peak_reserved_bytes) + outside.total_bytes,
                      fits=bool(pred.fits), notes=tuple(notes))

