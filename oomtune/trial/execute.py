"""Where a trial's training steps execute (``trial.execute=auto|meta|cpu``).

On the virtual GPU (no CUDA device) a trial's memory figures come from the simulator, which sees
the step's request stream; running the step's arithmetic on the CPU adds nothing to them (the CPU's
samples/s decide nothing about a GPU) and costs host memory in proportion to the batch: a GPT-2
124M trial at a 24 GiB budget grew to 20.8 GB RSS in its first step. So:

* ``meta``: the steps run on the ``meta`` device (shapes only: no data, no arithmetic, no host
  memory for tensors) with the virtual GPU recording, exactly as :func:`oomtune.plan.predictor.
  capture_training_stream` captures them: the same request stream as the CPU run wherever the meta
  kernels allocate what the CPU kernels do (tests/test_trial_execute.py compares the two), in
  seconds. Throughput is not measured (None). The search adds one real CPU step at the smallest
  batch, once, as a smoke test of the code (:meth:`oomtune.search.driver.Search.smoke_test`).
* ``cpu``: the steps run on the CPU for real (the only behaviour before this setting): throughput is the
  CPU's, and every tensor lives in host memory.
* ``auto``: ``meta`` on the virtual GPU, unless the objective is throughput (which needs real steps),
  the workload reads real data (the meta device takes synthetic data only) or trains under
  ``model.parallel=ddp|fsdp`` (its ranks' collectives move real tensors through gloo, DDP broadcasts
  the parameters and FSDP2 materialises its shards): then ``cpu``; on a GPU the trial runs
  on the device and this setting does not apply.

``target=cmd`` trials run the user's command. On the virtual GPU with ``auto``/``meta`` (and not the
throughput objective) they are asked for meta steps (``OOMTUNE_EXECUTE=meta``): an integration
(:mod:`oomtune.integrations`) then runs the model's steps on meta, and a step that cannot run there
makes the trial run the command again on the CPU (:func:`oomtune.targets.cmd.run_cmd_trial`); the
search's smoke test runs one real CPU step first, as for built-in workloads. A command of several
ranks (``trial.gpus`` above 1: torchrun, Lightning's DDP launcher) runs its steps on the CPU (``auto``;
``meta`` is refused), as ``model.parallel=ddp|fsdp`` does.

Before a search whose CPU trials (``cpu``, and ``target=cmd`` commands on the virtual GPU, which run
real CPU steps too) cannot fit their budget in the host's available memory (``MemAvailable`` in
/proc/meminfo, the kernel's estimate of memory available without swapping), :func:`check_host_memory`
stops it with one line (a ConfigError, exit 2).
"""

from __future__ import annotations

from pathlib import Path

from typing import Protocol

from oomtune.exceptions import ConfigError
from oomtune.workload_spec import WorkloadSpec

__all__ = ["EXECUTE_SETTINGS", "TimedObjective", "resolve_execute", "host_available_bytes", "check_host_memory"]

#: ``trial.execute`` values.
EXECUTE_SETTINGS = ("auto", "meta", "cpu")


class TimedObjective(Protocol):
    """What :func:`resolve_execute` reads of the search's objective
    (:class:`oomtune.search.objectives.Objective`, a layer above this one): its ``name``
    (``search.objective``, for the messages) and whether it ``measures_time`` (its answer depends on
    the time a step takes, which the meta device does not give)."""

    name: str
    measures_time: bool


def resolve_execute(setting: str, *, simulated: bool, objective: TimedObjective,
                    workload: WorkloadSpec) -> tuple[str, str]:
    """(mode, why) for ``trial.execute``: mode ``meta``, ``cpu`` (virtual GPU), ``device`` (a CUDA
    trial) or ``command`` (``target=cmd``: the command runs as it is). ``workload``'s target decides
    (:class:`oomtune.trial._base.Target`: its own process, files read, data parallelism), with its
    ranks (``trial.gpus``).

    Raises:
        ConfigError: ``meta`` asked where it cannot work: with an objective that times steps (nothing
            to measure), a built-in workload reading real data (the meta device takes synthetic
            data only) or trained by several ranks (``model.parallel=ddp|fsdp``, or a command with
            ``trial.gpus`` above 1: gloo moves real tensors); an unknown setting (the schema
            rejects it first).
    """
    if setting not in EXECUTE_SETTINGS:
        raise ConfigError(f"trial.execute={setting!r}: choose one of {', '.join(EXECUTE_SETTINGS)}")
    from oomtune.trial._base import get_target

    target = get_target(workload.target_name)
    if not simulated:
        return ("command", f"target={target.name} runs its own command") if target.own_process else (
            "device", "trials run on the GPU")
    if target.own_process:
        # an integration (oomtune.integrations) runs the command's steps on meta when asked (OOMTUNE_EXECUTE);
        # a command without one, or a step meta cannot run, runs them on the CPU (said in its record)
        ranks = workload.ranks or 1
        if simulated and ranks > 1:
            # the command's own process group (gloo on the CPU) moves real tensors between its ranks, which
            # meta tensors are not: its integration runs every rank's steps on the CPU
            # (oomtune.integrations._session), so asking for meta would only add a smoke-test launch
            if setting == "meta":
                raise ConfigError(f"trial.execute=meta cannot run target={target.name} with trial.gpus={ranks}: its "
                                  "ranks exchange real tensors (gloo), so use trial.execute=cpu (or auto)")
            return "command", (f"target={target.name} with trial.gpus={ranks}: every rank's steps on the CPU, "
                               "the ranks exchange real tensors (gloo)")
        if setting == "cpu" or objective.measures_time:
            timed = f", search.objective={objective.name}" if objective.measures_time else ""
            return "command", (f"target={target.name} runs its own command, its steps on the CPU (trial.execute="
                               f"{setting}{timed})")
        return "meta", (f"target={target.name} on the virtual GPU: an integration runs the steps on the meta device "
                        "(a command without one, or a step meta cannot run, runs them on the CPU)")
    if setting == "meta":
        if objective.measures_time:
            raise ConfigError(f"trial.execute=meta measures no throughput, and search.objective={objective.name} "
                              "ranks by it: use search.objective=batch (or auto), or trial.execute=cpu")
        if target.reads_files(workload):
            raise ConfigError("trial.execute=meta runs synthetic data only, and model.data.source reads files: "
                              "use trial.execute=cpu, or model.data.source=synthetic")
        if target.distributed(workload):
            raise ConfigError(f"trial.execute=meta cannot run model.parallel={_parallel(workload)}: its ranks exchange "
                              "real tensors (gloo), so use trial.execute=cpu (or auto)")
        return "meta", "trial.execute=meta"
    if setting == "cpu":
        return "cpu", "trial.execute=cpu"
    if objective.measures_time:
        return "cpu", f"trial.execute=auto with search.objective={objective.name}: the steps are timed"
    if target.reads_files(workload):
        return "cpu", "trial.execute=auto with a real data set: the meta device takes synthetic data only"
    if target.distributed(workload):
        return "cpu", (f"trial.execute=auto with model.parallel={_parallel(workload)}: the ranks exchange real "
                       "tensors (gloo)")
    return "meta", "trial.execute=auto on the virtual GPU"


def _parallel(workload: WorkloadSpec) -> object:
    """``model.parallel`` of a built-in workload (None without a model group)."""
    return workload.model.get("parallel") if workload.model is not None else None


def host_available_bytes(meminfo: str | Path = "/proc/meminfo") -> int | None:
    """The host's available memory in bytes (``MemAvailable`` of /proc/meminfo, in kB there); None
    where it cannot be read (not Linux, or a kernel before 3.14)."""
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_host_memory(mode: str, budget_bytes: int, trials_at_once: int = 1, *,
                      available_bytes: int | None = None, simulated: bool = True) -> None:
    """Before CPU trials: stop when ``trials_at_once`` budgets cannot fit in the host's available
    memory (a CPU trial near its frontier holds about its budget in host memory).

    Args:
        mode: the resolved mode (:func:`resolve_execute`): ``cpu`` is checked, and ``command`` (a
            ``target=cmd`` command) on the virtual GPU (``simulated``), whose steps run on the CPU
            for real as well; ``meta`` and ``device`` hold no host memory per tensor.
        trials_at_once: trial processes holding a budget each at once (``search.workers`` x
            ``trial.gpus``: every rank of a distributed trial has its own virtual GPU).
        available_bytes: the host's available memory (default :func:`host_available_bytes`; unknown:
            no check).
        simulated: the trials run on the virtual GPU (device=cpu), not a CUDA device.

    Raises:
        ConfigError: one line naming the figures and the way out.
    """
    from oomtune.units import format_bytes

    command = mode == "command" and simulated
    if mode != "cpu" and not command:
        return
    available = host_available_bytes() if available_bytes is None else available_bytes
    need = budget_bytes * max(1, trials_at_once)
    if available is None or need <= available:
        return
    at_once = f"{trials_at_once} trials at once x " if trials_at_once > 1 else ""
    if command:
        raise ConfigError(f"target=cmd commands on the virtual GPU run real CPU steps, holding their tensors in host "
                          f"memory, and {at_once}budget {format_bytes(budget_bytes)} cannot fit in this host's "
                          f"available memory ({format_bytes(available)}, MemAvailable in /proc/meminfo): give a "
                          "smaller budget, or run the search on the GPU (device=cuda)")
    raise ConfigError(f"CPU trials hold their tensors in host memory, and {at_once}budget {format_bytes(budget_bytes)} "
                      f"cannot fit in this host's available memory ({format_bytes(available)}, MemAvailable in "
                      "/proc/meminfo): use trial.execute=meta (memory simulated, no host memory per tensor), "
                      "or a smaller budget")
