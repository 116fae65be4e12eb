"""Distributed trials end to end on the CPU (gloo, one virtual GPU per rank): 2-rank DDP and FSDP2
trials of a built-in workload, an out-of-memory on rank 1 only, a SIGKILL of one rank, the same
through torchrun for a ``target=cmd`` command, and a search with ``trial.gpus=2``.

Expected memory figures come from the plan's capture of one rank (torch's fake process group, the
same DDP/FSDP2 code, every collective complete when it returns; on meta). A trial rank measures
exactly that figure (a rank on the CPU plus AdamW's host step counters, which a GPU rank keeps on the
host): under a recording, gloo's worker threads hold no recorded storage
(oomtune/capture/collectives.py), so every buffer dies where the program drops it, as with the fake
group, on every run and on both ranks. No orphan process may survive a trial: the rank processes are
checked after each run.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from oomtune.outcome import Outcome
from oomtune.trial.record import TrialResult, TrialSpec
from oomtune.trial.runner import TrialRunner, group_alive
from oomtune.units import MiB
from oomtune.workload_spec import WorkloadSpec

pytestmark = pytest.mark.slow

LM = {"name": "transformer", "layers": 2, "d_model": 64, "heads": 2, "seq_len": 32, "vocab_size": 512,
      "dropout": 0.0, "optimizer": "adamw", "lr": 1e-3, "precision": "fp32", "data": {"source": "synthetic"}}
HOOK = "OOMTUNE_TEST_HOOK"
DATA = Path(__file__).parent / "data" / "launchers"


@pytest.fixture(scope="module")
def runner():
    r = TrialRunner(launcher="fork")
    assert r.start_fork_server(), r._server_failed
    yield r
    r.close()


def _spec(parallel: str, **kw) -> TrialSpec:
    base = dict(workload={**LM, "parallel": parallel, "ranks": 2}, batch_size=4, device="cpu",
                budget_bytes=256 * MiB, warmup_steps=1, measure_steps=2, timeout_s=240, ranks=2)
    base.update(kw)
    return TrialSpec(**base)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _no_orphans(res) -> None:
    pids = res.distributed.rank_pids or []
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids), pids
    assert not group_alive(res.process.pid)


def _predicted(parallel: str, batch: int, steps: int) -> tuple[int, int]:
    from oomtune.alloc.geometry import budget_geometry
    from oomtune.plan.predictor import Predictor

    p = Predictor(WorkloadSpec.from_dict({**LM, "parallel": parallel, "ranks": 2, "target": {"name": "builtin"}}),
                  budget_geometry(256 * MiB, 80 * 1024 * MiB), steps=steps, derive=False)
    d = p.predict_detail(batch, "")
    return d.peak_reserved_bytes, d.peak_allocated_bytes


def _parameter_tensors() -> int:
    """The parameter tensors of ``LM`` (2 embeddings; per layer the attention's in/out projections,
    two linear layers and two layer norms, each a weight and a bias; the final norm's 2; the head): 29."""
    import torch

    from oomtune.workloads.models import build_model

    return len(list(build_model(LM, torch.device("meta")).module.parameters()))


@pytest.fixture(scope="module")
def two_rank(runner, tmp_path_factory):
    """The 2-rank DDP and the 2-rank FSDP2 trial of ``_spec``, each run once for the tests that read
    them (every rank measured, the plan's bounds, FSDP2 below DDP): {"ddp": result, "fsdp": result}."""
    return {mode: runner.run(_spec(mode), workdir=tmp_path_factory.mktemp(mode)) for mode in ("ddp", "fsdp")}


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_rank_trial_every_rank_measured_and_bounded_by_the_plan(two_rank, parallel):
    res = two_rank[parallel]
    assert res.outcome == "ok", res.message
    ranks = res.ranks
    assert [r.rank for r in ranks] == [0, 1] and res.distributed.world_size == 2
    assert all(r.outcome == "ok" for r in ranks)
    peaks = [r.peak_reserved_bytes for r in ranks]
    assert res.memory.peak_reserved_bytes == max(peaks) and res.worst_rank == peaks.index(max(peaks))
    # One rank's stream, predicted through the fake process group, is what each rank allocates: every
    # buffer of either strategy is the same on both ranks (FSDP2 pads every shard to the same size),
    # and both release each buffer the moment the program drops it. A loaded CI machine once measured
    # rank 1 of an FSDP2 trial 200192 bytes above rank 0 (one layer's all-gather output, released by
    # gloo's worker thread a layer late) and a DDP search's confirmation one 2 MiB segment above its
    # trial: exact equality here is what catches any such release by another thread coming back.
    reserved, allocated = _predicted(parallel, 4, 3)
    # A rank of either strategy is captured on meta: what a GPU rank allocates on its device. A CPU
    # rank's virtual GPU also counts AdamW's host ``step`` counters (one 4-byte tensor per parameter, a
    # 512-byte block each: the known difference of a CPU trial, tests/test_trial_execute.py), alive at
    # the peak and held in the small pool's segment, so the peak reserved is the same.
    assert _parameter_tensors() == 29
    host_counters = 512 * 29
    assert [(r.peak_allocated_bytes, r.peak_reserved_bytes) for r in ranks] == \
        [(allocated + host_counters, reserved)] * 2
    # global samples/s: 2 ranks x 4 samples per step over the slowest rank's step
    assert res.throughput.samples_per_s == pytest.approx(8 / max(r.step_time_s for r in ranks))
    assert res.distributed.parallel == parallel and res.distributed.backend == "gloo"
    _no_orphans(res)


def test_fsdp_rank_holds_less_than_a_ddp_rank(two_rank):
    ddp, fsdp = two_rank["ddp"], two_rank["fsdp"]
    assert ddp.outcome == fsdp.outcome == "ok"
    # parameters + gradients + AdamW states = 4 x the parameter bytes on a DDP rank (plus its buckets,
    # another copy of the gradients, 5 x 670720 bytes); FSDP2 keeps a half of the first three on each of
    # 2 ranks.
    assert fsdp.memory.peak_allocated_bytes < ddp.memory.peak_allocated_bytes


def test_oom_on_rank_1_only_is_infeasible_and_names_it(tmp_path, runner):
    # rank 1 holds 99 MB more than rank 0 on its 100 MiB virtual GPU: only rank 1 runs out of memory
    res = runner.run(_spec("ddp", budget_bytes=100 * MiB), workdir=tmp_path,
                     env={HOOK: "rank1:hold:99000000"})
    assert res.outcome.is_memory, res.message
    assert res.failed_rank == 1 and res.message.startswith("rank 1 of 2:")
    rank0, rank1 = res.ranks
    assert rank1.outcome == res.outcome and not rank1.teardown
    # rank 0 lost its peer inside a collective: a consequence, not a second failure
    assert rank0.outcome == "ok" or rank0.teardown
    assert rank0.peak_reserved_bytes < 100 * MiB
    _no_orphans(res)


def test_sigkill_of_one_rank_is_a_failure_of_that_rank_without_orphans(tmp_path, runner, monkeypatch):
    # The host's OOM-killer evidence (cgroup counters, kernel log) is the machine's, not the trial's:
    # read as none here, so the SIGKILL the hook sends is a crash (no evidence, no host_oom), exactly.
    from oomtune.trial.oomkill import OomKillWatch

    monkeypatch.setattr(OomKillWatch, "evidence", lambda self, pids: None)
    res = runner.run(_spec("ddp"), workdir=tmp_path, env={HOOK: "rank1:signal:9"})
    assert res.failed_rank == 1
    assert res.outcome is Outcome.CRASH, res.message
    assert "SIGKILL" in res.message and res.message.startswith("rank 1 of 2:")
    rank0, rank1 = res.ranks
    assert rank1.exitcode == -9 and not rank1.teardown
    assert rank0.teardown
    _no_orphans(res)


def test_ranks_agree_on_the_steps_of_a_time_window(tmp_path, runner):
    # A time window (measure_seconds, the GPU's search.window) lets each rank decide when to stop; a
    # rank that stops first would leave the other in its next all-reduce. Here rank 1 wants 1 s of
    # measured steps and rank 0 any time at all: both must run rank 1's steps, and the trial is ok. (A
    # step of this model takes tens of milliseconds, 53 ms with the machine loaded, and once 0.52 s on a
    # 2-core machine running three test sessions: 2 measured steps then filled the second and no rank
    # asked for more. One measured step (``measure_steps=1``) fills no second even then, so rank 1 asks
    # for more; a longer window asks for more steps, no other outcome.)
    from oomtune.trial.rank_records import rank_result_path

    res = runner.run(_spec("ddp", measure_seconds=1e-6, measure_steps=1), workdir=tmp_path,
                     env={HOOK: "rank1:window:1"})
    assert res.outcome == "ok", res.message
    steps = [TrialResult.read(rank_result_path(tmp_path / "result.json", r)).throughput.steps for r in (0, 1)]
    assert steps[0] == steps[1] > 1 + 1        # past warm-up + measured steps, the same on both ranks
    _no_orphans(res)


def _cmd_spec(env_kill: bool = False) -> TrialSpec:
    command = (f"{sys.executable} -m torch.distributed.run --nproc_per_node 2 --standalone "
               f"{DATA / 'ddp_cmd_train.py'} {{batch_size}}")
    return TrialSpec(workload={"target": {"name": "cmd", "command": command, "cwd": str(DATA)}}, batch_size=16,
                     device="cpu", budget_bytes=256 * MiB, warmup_steps=1, measure_steps=3, timeout_s=240, ranks=2)


def test_torchrun_command_every_rank_reports_once(tmp_path, runner):
    res = runner.run(_cmd_spec(), workdir=tmp_path, env={"OMP_NUM_THREADS": "1"})
    assert res.outcome == "ok", res.message
    assert res.script.reporting_ranks == (0, 1)
    assert [r.rank for r in res.ranks] == [0, 1]
    # each rank's virtual GPU holds the MLP's parameters, gradients and DDP's bucket (attached before DDP)
    params = (64 * 128 + 128 + 128 * 10 + 10) * 4
    assert all(r.peak_allocated_bytes >= 3 * params for r in res.ranks)
    assert res.memory.source == "simulated"


def test_torchrun_rank_sigkill_named_from_the_launcher_summary(tmp_path, runner):
    res = runner.run(_cmd_spec(), workdir=tmp_path, env={"OMP_NUM_THREADS": "1", "OOMTUNE_TEST_KILL_RANK": "1"})
    assert res.failed_rank == 1, res.message
    # the evidence is read inside the trial process (oomtune.targets.cmd), on this machine's counters:
    # a crash unless the host's OOM killer fired during the trial
    assert res.outcome in (Outcome.CRASH, Outcome.HOST_OOM)
    assert "rank 1" in res.message and "SIGKILL" in res.message
    assert not group_alive(res.process.pid)


def test_search_with_two_gpus_per_trial_records_every_rank(tmp_path, capsys):
    import oomtune
    from oomtune.cli import main

    run_dir = tmp_path / "run"
    args = ["search", "model=transformer", "model.layers=1", "model.d_model=32", "model.heads=2",
            "model.seq_len=16", "model.vocab_size=256", "model.parallel=fsdp", "trial.gpus=2", "device=cpu",
            "budget=64MiB", "search.batch_size.low=2", "search.batch_size.high=8", "search.objective=batch",
            "search.frontier_configs=1", "trial.warmup_steps=1", "trial.measure_steps=1",
            "trial.confirm_steps=2", "trial.timeout=240", f"hydra.run.dir={run_dir}"]
    assert main(args) == 0
    out = capsys.readouterr().out
    best = oomtune.load_best(run_dir / "best.yaml")
    assert best.workload["ranks"] == 2 and best.workload["model"]["parallel"] == "fsdp"
    metrics = best.best.metrics
    assert metrics["world_size"] == 2 and [r["rank"] for r in metrics["ranks"]] == [0, 1]
    assert metrics["peak_reserved_bytes"] == max(r["peak_reserved_bytes"] for r in metrics["ranks"])
    assert f"r{metrics['worst_rank']}" in out   # the trial table names the worst rank


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_plan_with_workers_forks_and_derives_captures_on_meta(monkeypatch, mode):
    # A DDP or FSDP2 rank is captured on meta (workloads/_meta_rank.py, workloads/_meta_fsdp.py), so
    # the batch sizes between its captures are derived; DDP's captures spread over forked workers (no
    # CPU kernel runs, as for one rank), FSDP2's stay in this process (an FSDP2 capture leaves autograd
    # unable to fork); the answer is the one process's, which captures every size
    from oomtune.alloc.geometry import budget_geometry
    from oomtune.plan import parallel
    from oomtune.plan.predictor import Predictor

    forked = []
    original = parallel.fork_map

    def counting(fn, items, workers):
        forked.append(list(items))
        return original(fn, items, workers)

    cfg = {**LM, "parallel": mode, "ranks": 2, "target": {"name": "builtin"}}
    geometry = budget_geometry(256 * MiB, 80 * 1024 * MiB)
    # batch sizes 2..10: the deriver's first round captures 2, 3, the median and 10 (plan/derive.py
    # StreamDeriver.wanted); sizes between captures are derived from them
    sizes = list(range(2, 11))
    every = Predictor(WorkloadSpec.from_dict(cfg), geometry, workers=1, derive=False)
    monkeypatch.setattr(parallel, "fork_map", counting)
    many = Predictor(WorkloadSpec.from_dict(cfg), geometry, workers=2)
    many.prepare(sizes)
    # FSDP2 captures stay in this process (predictor.py _forks_after_capture), derived all the same
    assert many.workers == (2 if mode == "ddp" else 1) and bool(forked) == (mode == "ddp")
    assert many.captured_on == {"meta"}
    assert many.derived_batches == [] and many.captures < len(sizes)
    got = [(many.predict_detail(b, "").peak_reserved_bytes, many.predict_detail(b, "").peak_allocated_bytes)
           for b in sizes]
    assert len(many.derived_batches) == len(sizes) - many.captures > 0
    assert got == [(every.predict_detail(b, "").peak_reserved_bytes, every.predict_detail(b, "").peak_allocated_bytes)
                   for b in sizes]
