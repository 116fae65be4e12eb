"""A distributed trial's ranks, started by the trial process with torch's own launcher.

When a trial trains under a data-parallel strategy (``TrialSpec.ranks`` > 1, or a workload whose
target says it is distributed: ``model.parallel=ddp|fsdp``), the trial process
(:func:`oomtune.trial.child.main`) does not train itself: it starts ``ranks`` processes with
``torch.multiprocessing.start_processes(start_method="fork")`` and waits for them
(``ProcessContext.join``: when one exits abnormally, the others get a grace period, then SIGTERM,
then SIGKILL, and the first observed failure is ``error_index``). Forking is safe here for the
reasons the fork server's are (:mod:`oomtune.trial.forkserver`): the trial process has imported torch
but run no operation and never touched CUDA. The ranks stay in the trial's process group, so the
runner's timeout and Ctrl-C reach them; torch's launcher also sets each rank's parent-death signal.

Each rank (:func:`_rank_main`):

1. writes its standard output and error to ``stdout.rank<R>.txt`` / ``stderr.rank<R>.txt``;
2. sets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE`` as torchrun does; on CUDA
   makes only its own GPU visible (the R-th entry of the trial's ``CUDA_VISIBLE_DEVICES``, which the
   runner set to the slot's GPUs by UUID) before anything touches CUDA;
3. joins the process group (``gloo`` on the CPU, ``nccl`` on CUDA; rendezvous through a
   ``file://`` store in the trial's directory; timeout: the trial's);
4. runs the trial protocol of :func:`oomtune.trial.child.run_child` for itself: its own budget
   (memory fraction, or its own virtual GPU on the CPU), its own steps, its own record
   ``result.rank<R>.json`` with ``distributed.rank``;
5. leaves the process group.

The trial process then merges the records (:func:`oomtune.trial.rank_records.merge_ranks`) into
``result.json``. A rank killed without a record (SIGKILL) is classified from its exit status and
its stderr; the ranks the launcher terminated afterwards are teardown, not causes.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

from oomtune.outcome import Outcome
from oomtune.trial.procwait import process_start_time
from oomtune.trial.rank_records import merge_ranks, rank_result_path, rank_stderr_path, read_rank_results
from oomtune.trial.record import TORCH_THREADS_ENV, TrialResult, TrialSpec

__all__ = ["is_distributed_trial", "run_ranks", "GRACE_S"]

#: Seconds the surviving ranks get, after one rank failed, to notice it (a collective broken by the
#: dead peer) and write their records before torch's launcher terminates them.
GRACE_S = 5.0
_TAIL_CHARS = 4000


def is_distributed_trial(spec: TrialSpec) -> bool:
    """Whether ``spec`` runs ranks: more than one, or a target that calls its workload distributed
    (:meth:`oomtune.trial._base.Target.distributed`)."""
    if spec.ranks > 1:
        return True
    from oomtune.trial._base import target_for

    return target_for(spec.workload).distributed(spec.workload)


def _visible_entries() -> list[str]:
    return [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]


def run_ranks(spec: TrialSpec, result_path: str | Path,
              run_rank: Callable[[TrialSpec, int], TrialResult]) -> TrialResult:
    """Start ``spec.ranks`` rank processes, wait for them, return the merged record (see the module
    docstring). Never raises for a rank's failure.

    Args:
        spec: the trial (``spec.device``: ``cpu``, or ``cuda:i,j,...`` naming ``spec.ranks`` GPUs,
            already made visible by the runner).
        result_path: the trial's ``result.json``; rank records and stderr files go next to it.
        run_rank: the trial protocol for one rank, called in each rank process with the rank's
            spec (one rank on ``cpu`` or ``cuda``) and its rank
            (:func:`oomtune.trial.child.run_child`'s rank form; passed in, so that this module
            does not import the trial process that imports it).
    """
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    started = process_start_time()
    result_path = Path(result_path).resolve()
    workdir = result_path.parent
    n = spec.ranks
    for rank in range(n):
        rank_result_path(result_path, rank).unlink(missing_ok=True)
    store = workdir / f"rendezvous.{os.getpid()}"
    store.unlink(missing_ok=True)
    backend = "nccl" if spec.device.startswith("cuda") else "gloo"
    ctx = mp.start_processes(_rank_main, args=(spec.to_json(), str(result_path), f"file://{store}", backend, run_rank),
                             nprocs=n, join=False, start_method="fork")
    root = None
    try:
        while not ctx.join(grace_period=GRACE_S):
            pass
    except ProcessException as exc:   # a rank exited abnormally: the others were terminated
        root = exc.error_index
    exitcodes = [p.exitcode for p in ctx.processes]
    store.unlink(missing_ok=True)
    tails = []
    for rank in range(n):
        try:
            tails.append(rank_stderr_path(workdir, rank).read_text(errors="replace")[-_TAIL_CHARS:])
        except OSError:
            tails.append("")
    merged = merge_ranks(spec, read_rank_results(result_path, n), exitcodes=exitcodes, root_rank=root,
                         stderr_tails=tails)
    first = merged.process.first_step_at   # the last rank to reach its first step
    return dataclasses.replace(
        merged, distributed=dataclasses.replace(merged.distributed, rank_pids=tuple(p.pid for p in ctx.processes)),
        startup_s=None if first is None else max(0.0, first - started), wall_s=max(0.0, time.time() - started))


def _redirect(fd: int, path: Path) -> None:
    f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(f, fd)
    os.close(f)


def _rank_main(rank: int, spec_json: str, result_path: str, init_method: str, backend: str,
               run_rank: Callable[[TrialSpec, int], TrialResult]) -> None:
    """One rank (steps 1-5 of the module docstring)."""
    import torch.distributed as dist

    from oomtune.workloads.parallel import parallel_mode, strategy_notes

    spec = TrialSpec.from_json(spec_json)
    workdir = Path(result_path).parent
    sys.stdout.flush()
    sys.stderr.flush()
    _redirect(1, workdir / f"stdout.rank{rank}.txt")
    _redirect(2, rank_stderr_path(workdir, rank))
    n = spec.ranks
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n),
                      GROUP_RANK="0")
    device = "cpu"
    if spec.device.startswith("cuda"):
        visible = _visible_entries()
        if len(visible) >= n:        # its own GPU only, before CUDA starts (C10)
            os.environ["CUDA_VISIBLE_DEVICES"] = visible[rank]
        device = "cuda"
    threads = os.environ.get(TORCH_THREADS_ENV, "")
    if device == "cpu" and not threads.isdigit():   # n ranks share the cores
        os.environ[TORCH_THREADS_ENV] = str(max(1, (os.cpu_count() or 1) // n))
    rank_spec = dataclasses.replace(spec, device=device, ranks=1)
    try:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=n,
                                timeout=timedelta(seconds=max(1.0, spec.timeout_s)))
        result = run_rank(rank_spec, rank)
    except Exception as exc:   # the process group could not start: the rank's record says why
        result = TrialResult(outcome=Outcome.ERROR, batch_size=spec.batch_size, alloc_conf=spec.alloc_conf,
                             message=f"rank {rank} could not join the process group ({backend}): {exc}",
                             advice="check that the ranks can reach each other (gloo/nccl)")
    try:
        mode = parallel_mode(spec.workload.model or {})
    except Exception:
        mode = "none"
    notes = strategy_notes(mode, backend)
    result = dataclasses.replace(result, distributed=dataclasses.replace(
        result.distributed, rank=rank, world_size=n, backend=backend, parallel=notes.get("parallel"),
        memory_note=notes.get("memory"), not_modelled=notes.get("not_modelled")))
    result.write(rank_result_path(result_path, rank))
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:   # a broken group (a dead peer) must not turn a written record into a failure
        pass
    sys.stdout.flush()
    sys.stderr.flush()
