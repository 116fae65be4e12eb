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

    def reads_files(self, workload: Mapping[str, Any]) -> bool:
        """``model.data.source`` reads a data set (:mod:`oomtune.workloads.data`), not synthetic."""
        data = workload.get("data")
        return isinstance(data, Mapping) and data.get("source", "synthetic") != "synthetic"

    def can_soak(self, workload: Mapping[str, Any]) -> bool:
        """One process trains it: a rank's shapes would need the other ranks' collectives."""
        return not self.distributed(workload)

    def for_capture(self, workload: Mapping[str, Any]) -> dict[str, Any]:
        """The ``model`` keys on synthetic data (a capture's shapes come from the config, the
        content does not matter)."""
        cfg = {k: v for k, v in workload.items() if k != "target"}
        cfg["data"] = {"source": "synthetic"}
        return cfg

    def worst_shape(self, workload: Mapping[str, Any]) -> Any:
        from oomtune.workloads.shapes import shape_distribution, worst_shapes

        cfg = {k: v for k, v in workload.items() if k != "target"}
        return None if shape_distribution(cfg).is_fixed else worst_shapes(cfg)[0]

    def shapes(self, workload: Mapping[str, Any]) -> Any:
        from oomtune.workloads.shapes import shape_distribution

        return shape_distribution({k: v for k, v in workload.items() if k != "target"})

    def at_shape(self, workload: Mapping[str, Any], shape: Any) -> dict[str, Any]:
        from oomtune.workloads.shapes import at_shape

        out = at_shape({k: v for k, v in workload.items() if k != "target"}, shape)
        if "target" in workload:
            out["target"] = workload["target"]
        return out

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

    def label(self, workload: Mapping[str, Any]) -> str:
        return str(workload.get("name", "builtin"))

    def check_training(self, workload: Mapping[str, Any], *, accumulates: bool, checkpointing: bool) -> None:
        """Activation checkpointing needs a model that has it (transformer, resnet; not mlp)."""
        if checkpointing:
            from oomtune.workloads import validate_workload_config

            validate_workload_config({k: v for k, v in workload.items() if k != "target"}
                                     | {"activation_checkpointing": True})

    def distributed(self, workload: Mapping[str, Any]) -> bool:
        """``model.parallel`` is ddp or fsdp (:mod:`oomtune.workloads.parallel`)."""
        from oomtune.workloads.parallel import is_distributed

        return is_distributed(workload)

    def build_workload(self, workload: Mapping[str, Any], batch_size: int, device: Any) -> Any:
        from oomtune.workloads import build_workload

        return build_workload(dict(workload), batch_size, device)


TARGET = register_target(BuiltinTarget())
