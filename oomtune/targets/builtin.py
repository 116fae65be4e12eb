"""``target=builtin``: a built-in workload from the ``model`` group (:mod:`oomtune.workloads`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from oomtune.trial._base import Target

__all__ = ["BuiltinTarget", "TARGET"]


class BuiltinTarget(Target):
    """Built-in workloads, trained inside oomtune's trial process
    (:func:`oomtune.workloads.build_workload`). The ``model`` keys are validated by the search
    (:func:`oomtune.workloads.validate_workload_config`), the group itself has nothing to check."""

    name = "builtin"
    own_process = False

    def build_workload(self, workload: Mapping[str, Any], batch_size: int, device: Any) -> Any:
        from oomtune.workloads import build_workload

        return build_workload(dict(workload), batch_size, device)


TARGET = BuiltinTarget()
