"""``target=builtin``: a built-in workload from the ``model`` group (:mod:`oomtune.workloads`)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from oomtune.exceptions import ConfigError
from oomtune.trial._base import Target, register_target
from oomtune.workload_spec import WorkloadSpec

__all__ = ["BuiltinTarget", "TARGET"]


class BuiltinTarget(Target):
    """Built-in workloads, trained inside oomtune's trial process
    (:func:`oomtune.workloads.build_workload`). The ``model`` keys are validated by the search
    (:func:`oomtune.workloads.validate_workload_config`), the group itself has nothing to check."""

    name = "builtin"
    own_process = False
    capturable = True
    uses_model_group = True

    def reads_files(self, workload: WorkloadSpec) -> bool:
        """``model.data.source`` reads a data set (:mod:`oomtune.workloads.data`), not synthetic."""
        data = workload.data
        return data is not None and data.get("source", "synthetic") != "synthetic"

    def can_soak(self, workload: WorkloadSpec) -> bool:
        """One process trains it: a rank's shapes would need the other ranks' collectives."""
        return not self.distributed(workload)

    def for_capture(self, workload: WorkloadSpec) -> dict[str, Any]:
        """The flat workload without its ``target`` (the ``model`` keys, the target GPU, the ranks,
        the training settings) on synthetic data (a capture's shapes come from the config, the
        content does not matter)."""
        cfg = {k: v for k, v in workload.to_dict().items() if k != "target"}
        cfg["data"] = {"source": "synthetic"}
        return cfg

    def worst_shape(self, workload: WorkloadSpec) -> Any:
        from oomtune.workloads.shapes import shape_distribution, worst_shapes

        model = workload.model or {}
        return None if shape_distribution(model).is_fixed else worst_shapes(model)[0]

    def shapes(self, workload: WorkloadSpec) -> Any:
        """The ``model`` group's distribution (``seq_len`` / ``image_size``:
        :func:`oomtune.workloads.shapes.shape_distribution`)."""
        from oomtune.workloads.shapes import shape_distribution

        return shape_distribution(workload.model or {})

    def at_shape(self, workload: WorkloadSpec, shape: Any) -> WorkloadSpec:
        """The ``model`` group at ``shape`` (:func:`oomtune.workloads.shapes.at_shape`); ``workload``
        itself without a model group."""
        from dataclasses import replace

        from oomtune.workloads.shapes import at_shape

        return workload if workload.model is None else replace(workload, model=at_shape(workload.model, shape))

    def model_keys(self, model_cfg: Mapping[str, Any] | None) -> dict[str, Any] | None:
        """The ``model`` group is the workload: its keys but the target GPU's.

        Raises:
            ConfigError: no model group, or one without a ``name``.
        """
        if not isinstance(model_cfg, Mapping) or not isinstance(model_cfg.get("name"), str):
            raise ConfigError(f"model must be a mapping with a 'name', got {model_cfg!r}")
        return {k: v for k, v in model_cfg.items() if k not in ("gpu", "gpu_source")}

    def workload_spec(self, target_cfg: Mapping[str, Any], model_cfg: Mapping[str, Any], *, gpus: int = 1,
                      base: Path | None = None) -> WorkloadSpec:
        """The model keys' paths (``data.path``, ``seq_len.tokens``) made absolute too when ``base`` is
        given; the ranks those of ``model.parallel`` (:func:`oomtune.workloads.parallel.with_ranks`:
        ``parallel`` and ``ranks`` kept when distributed, dropped when not).

        Raises:
            ConfigError: several GPUs per trial without a parallel strategy, an unknown
                ``model.parallel``, a model group without a ``name``.
        """
        from oomtune.targets import resolve_workload
        from oomtune.workloads.parallel import with_ranks

        model = self.model_keys(model_cfg) or {}
        if base is not None:
            model = resolve_workload(model, cwd=base)
        model = with_ranks(model, gpus)
        ranks = model.pop("ranks", None)
        target = self.resolve_paths(target_cfg, base) if base is not None else dict(target_cfg)
        return WorkloadSpec(target=target, model=model, gpu=str(model_cfg.get("gpu", "auto")), ranks=ranks)

    def label(self, workload: WorkloadSpec) -> str:
        return str((workload.model or {}).get("name", "builtin"))

    def check_training(self, workload: WorkloadSpec, *, accumulates: bool, checkpointing: bool) -> None:
        """Activation checkpointing needs a model that has it (transformer, resnet; not mlp)."""
        if checkpointing:
            from oomtune.workloads import validate_workload_config

            validate_workload_config({k: v for k, v in workload.to_dict().items() if k != "target"}
                                     | {"activation_checkpointing": True})

    def distributed(self, workload: WorkloadSpec) -> bool:
        """``model.parallel`` is ddp or fsdp (:mod:`oomtune.workloads.parallel`)."""
        from oomtune.workloads.parallel import is_distributed

        return is_distributed(workload.model or {})

    def build_workload(self, workload: WorkloadSpec, batch_size: int, device: Any) -> Any:
        """:func:`oomtune.workloads.build_workload` of the flat form (:meth:`WorkloadSpec.to_dict`:
        the model keys, ranks and training settings it reads)."""
        from oomtune.workloads import build_workload

        return build_workload(workload.to_dict(), batch_size, device)


TARGET = register_target(BuiltinTarget())
