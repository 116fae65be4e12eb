"""What a search is asked to do: :class:`SearchOptions`, the config's typed sections and what the
search resolved from them, handed to :class:`oomtune.search.driver.Search` and the modules it uses
(the smoke test, the frontier)."""

from __future__ import annotations

from dataclasses import dataclass, field

from oomtune.schema import SearchConf, TrialConf
from oomtune.workload_spec import WorkloadSpec

__all__ = ["SearchOptions"]


@dataclass(frozen=True)
class SearchOptions:
    """Everything :class:`Search` needs: the config's typed sections as the schema made them and what
    the search resolved from them (bytes, seconds).

    Attributes:
        workload: the :class:`oomtune.workload_spec.WorkloadSpec` every trial trains (each candidate's
            settings applied to its flat form, :meth:`WorkloadSpec.to_dict`, in its TrialSpec).
        device: the device spec trials run on (``cuda:0``, ``cpu``: the virtual GPU).
        budget_bytes: the memory budget, bytes.
        search: ``search.*`` (:class:`oomtune.schema.SearchConf`): ``n_trials``, ``timeout`` (s),
            ``headroom``, ``baseline``, ``confirm``, ``min_gain``, ``frontier_configs``, ``repeats``,
            ``finalists``, ``memory_fraction``.
        trial: ``trial.*`` (:class:`oomtune.schema.TrialConf`): ``warmup_steps``, ``measure_steps``,
            ``confirm_steps``, ``timeout`` (s), ``soak_steps``, ``gpus`` (ranks of every trial).
        objective: the resolved ``search.objective`` (a name of :data:`oomtune.search.objectives.OBJECTIVES`).
        objective_reason: why that objective (one phrase, shown by the search).
        window_s: throughput confirmation: each run measured at least this long, seconds (the
            resolved ``search.window``).
        execute: the resolved ``trial.execute``: ``meta`` | ``cpu`` (virtual GPU), ``device``, ``command``.
        device_memory_bytes: the virtual GPU's capacity, bytes (CPU trials); None on a device.
        torch_threads: torch threads per CPU trial (``OOMTUNE_TORCH_THREADS``,
            :data:`oomtune.trial.record.TORCH_THREADS_ENV`) when workers share the CPU; None: torch's
            default.
        host_available_bytes: ``/proc/meminfo`` MemAvailable, bytes (the smoke test's check); None on
            a device.
        variable_shapes: the workload has a shape distribution (:mod:`oomtune.workloads.shapes`).
        probe_unpredicted: without predictions, try every configuration (the batch objective).
        baseline_precision: without predictions, the baseline bisects until
            ``(fail - ok) <= precision * ok``.
    """

    workload: WorkloadSpec
    device: str
    budget_bytes: int
    search: SearchConf = field(default_factory=SearchConf)
    trial: TrialConf = field(default_factory=TrialConf)
    objective: str = "throughput"
    objective_reason: str = ""
    window_s: float = 0.0
    execute: str = "cpu"
    device_memory_bytes: int | None = None
    torch_threads: int | None = None
    host_available_bytes: int | None = None
    variable_shapes: bool = False
    probe_unpredicted: bool = False
    baseline_precision: float = 0.1
