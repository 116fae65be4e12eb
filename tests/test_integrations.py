"""The one-line integrations: Hugging Face Trainer, Lightning and a plain
loop, on the virtual GPU: the script runs unchanged without oomtune; under oomtune the trial's
micro-batch and accumulation are applied, the steps stop after warm-up + measured, the global samples
are counted once (accumulation and ranks included), the allocation stream is recorded; an oomtune
search keeps the global batch."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import oomtune
from oomtune.cli import main
from oomtune.plan.recorded import load_recording
from oomtune.targets.cmd import read_channel, result_from_channel
from oomtune.trial.record import TrialResult, TrialSpec

from shared_runs import GLOBAL_BATCH_OVERRIDES, lightning_example_search  # noqa: F401  (a session's shared search)

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = {"hf": "examples/hf_trainer.py", "lightning": "examples/lightning_module.py",
            "loop": "examples/global_batch.py"}


# OMP_NUM_THREADS=1 for every process a test here starts (scripts, searches' trials): one small process on
# cores the other tests' processes share, where an OpenMP pool of one thread per core spends its idle
# threads' time spinning; the virtual GPU's figures and the counts asserted do not depend on the threads.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def _script_env(env: dict[str, str] | None) -> dict[str, str]:
    # less pytest's name of the running test: it changes from test to test, and a script server is shared
    # on the whole environment less the per-trial OOMTUNE_* variables; no script reads it
    full = {**os.environ, "PYTHONPATH": str(REPO), **ONE_THREAD, **(env or {})}
    full.pop("PYTEST_CURRENT_TEST", None)
    return full


def run_script(args: list[str], env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, env=_script_env(env), capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def forks():
    """The module's script servers (oomtune.trial.script_fork.ScriptServers), as a search's runner has: a
    ``python FILE.py`` run below is forked from a server that imported the file's third-party modules
    (transformers' Trainer, lightning.pytorch) once for the module, not once per process (7-8 CPU-s each,
    more than the steps). The forked process runs the file as python would (oomtune.trial.script_main:
    its argv, environment, working directory, exit status, stdout and stderr; tests/test_script_fork.py
    compares them with a spawned run's); where a server cannot start or fork, the script is spawned."""
    from oomtune.trial.script_fork import ScriptServers

    servers = ScriptServers()
    yield servers
    servers.close()


def run_file(forks, tmp_path: Path, args: list[str], env: dict[str, str] | None = None,
             timeout: float = 300) -> subprocess.CompletedProcess:
    """``python FILE.py ARGS`` (``args``: the file, then its arguments) from the repository root, forked
    from ``forks`` (spawned when it cannot be): its exit status, stdout and stderr."""
    from oomtune.trial.keeper import STATUS_FILE

    argv, full = [sys.executable, *args], _script_env(env)
    workdir = tmp_path / "forked"
    workdir.mkdir()
    handle, _why = forks.launch(argv, cwd=str(REPO), env=full, workdir=workdir, grace_s=3.0, status_file=STATUS_FILE)
    if handle is None:
        return subprocess.run(argv, cwd=REPO, env=full, capture_output=True, text=True, timeout=timeout)
    code = handle.wait(timeout)
    return subprocess.CompletedProcess(argv, code, (workdir / "stdout.txt").read_text(),
                                       (workdir / "stderr.txt").read_text())


def trial_env(tmp_path: Path, *, batch: int, accum: int, warmup: int = 1, measure: int = 2) -> dict[str, str]:
    return {"OOMTUNE_RESULT_FILE": str(tmp_path / "results.jsonl"), "OOMTUNE_STREAM_FILE": str(tmp_path / "stream.bin"),
            "OOMTUNE_BATCH_SIZE": str(batch), "OOMTUNE_GRAD_ACCUM": str(accum), "OOMTUNE_WARMUP_STEPS": str(warmup),
            "OOMTUNE_MEASURE_STEPS": str(measure), "OOMTUNE_DEVICE": "cpu", "OOMTUNE_BUDGET_BYTES": str(1 << 30),
            "OOMTUNE_DEVICE_MEMORY_BYTES": str(80 << 30)}


# -- the examples run unchanged without oomtune (CI runs them at their tiny default sizes) ------------------
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_the_example_runs_unchanged_without_oomtune(name, forks, tmp_path):
    env = {k: "" for k in ("OOMTUNE_RESULT_FILE", "OOMTUNE_BATCH_SIZE")}
    done = run_file(forks, tmp_path, [EXAMPLES[name]], env)
    assert done.returncode == 0, done.stderr[-2000:]
    expected = "global batch 32: micro-batch 8 x 4" if name == "loop" else "trained 4 optimizer steps"
    assert expected in done.stdout


# -- under oomtune: the trial's settings, the steps, the samples -------------------------------------------
@pytest.mark.parametrize("name", ["hf", "lightning"])
def test_the_framework_trains_the_trials_micro_batch_and_accumulation(name, tmp_path, forks):
    done = run_file(forks, tmp_path, [EXAMPLES[name]], trial_env(tmp_path, batch=4, accum=3, warmup=1, measure=2))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "trained 3 optimizer steps" in done.stdout           # warm-up 1 + measured 2, not the script's 4
    events = read_channel(tmp_path / "results.jsonl")
    (rep,) = [e for e in events if e["event"] == "report"]
    # global samples: micro-batch 4 x 3 micro-batches x 1 rank x 2 measured steps
    assert (rep["samples"], rep["steps"], rep["world_size"]) == (24, 2, 1)
    assert rep["extra"]["micro_batch"] == 4 and rep["extra"]["grad_accum"] == 3
    assert rep["memory"]["source"] == "simulated" and rep["memory"]["stats"]["reserved_bytes.all.peak"] > 0
    stream, meta = load_recording(tmp_path / "stream.bin")
    assert len(stream) == meta["events"] > 0
    assert meta["precision"] == {"hf": "fp32", "lightning": "32-true"}[name]   # the framework's own setting
    spec = TrialSpec(workload={"target": {"name": "cmd"}, "grad_accum": 3}, batch_size=4)
    result = result_from_channel(spec, events, returncode=0, stderr="", timed_out=False)
    assert result.outcome == "ok" and result.throughput.samples_per_s == pytest.approx(24 / rep["seconds"])


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def test_samples_are_counted_once_over_two_ranks(tmp_path):
    done = run_script(["tests/data/two_rank_loop.py", "3", "2", _free_port()],
                      trial_env(tmp_path, batch=3, accum=2, warmup=1, measure=2))
    assert done.returncode == 0, done.stderr[-3000:]
    events = read_channel(tmp_path / "results.jsonl")
    reports = [e for e in events if e["event"] == "report"]
    assert len(reports) == 1 and reports[0]["rank"] == 0        # rank 0 reports for both
    # micro-batch 3 x 2 micro-batches x 2 ranks x 2 measured steps
    assert (reports[0]["samples"], reports[0]["world_size"], reports[0]["steps"]) == (24, 2, 2)
    assert sorted(e["rank"] for e in events if e["event"] == "memory") == [0, 1]   # each rank's memory
    assert (tmp_path / "stream.bin").is_file() and (tmp_path / "stream.bin.rank1").is_file()
    spec = TrialSpec(workload={"target": {"name": "cmd"}, "grad_accum": 2}, batch_size=3)
    result = result_from_channel(spec, events, returncode=0, stderr="", timed_out=False)
    assert result.throughput.samples_per_s == pytest.approx(24 / reports[0]["seconds"])


@pytest.mark.slow
def test_a_trainer_under_torchrun_counts_samples_once_over_two_ranks(tmp_path):
    # the Hugging Face example under torchrun, 2 CPU processes (gloo): rank 0 reports micro-batch 3 x 2
    # micro-batches x 2 ranks x 2 measured steps; every rank writes its memory and its stream. The callback
    # refuses a Trainer that is not distributed (the test above), so exit 0 also says the example joined
    # its ranks in DDP over gloo (its use_cpu=True for several ranks without CUDA)
    done = run_script(["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", _free_port(),
                       EXAMPLES["hf"]], trial_env(tmp_path, batch=3, accum=2, warmup=1, measure=2))
    assert done.returncode == 0, done.stderr[-3000:]
    events = read_channel(tmp_path / "results.jsonl")
    reports = [e for e in events if e["event"] == "report"]
    assert len(reports) == 1 and reports[0]["rank"] == 0
    assert (reports[0]["samples"], reports[0]["world_size"], reports[0]["steps"]) == (24, 2, 2)
    assert sorted(e["rank"] for e in events if e["event"] == "memory") == [0, 1]
    assert (tmp_path / "stream.bin").is_file() and (tmp_path / "stream.bin.rank1").is_file()


# -- bad input: one line, exit status 2 ---------------------------------------------------------------------
def test_a_callback_on_a_trainer_without_an_optimizer_exits_2_with_one_line(tmp_path):
    code = ("from oomtune.integrations.huggingface import OomtuneCallback\n"
            "from transformers import TrainingArguments, TrainerState, TrainerControl\n"
            "cb = OomtuneCallback()\n"
            "cb.on_train_begin(None, TrainerState(), TrainerControl(), model=None, optimizer=None)\n")
    done = run_script(["-c", code], trial_env(tmp_path, batch=2, accum=1))
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert lines == ["oomtune: Hugging Face Trainer: the trainer has no optimizer when training starts, so oomtune "
                     "cannot count optimizer steps or its state; create it before training (or let the trainer "
                     "create it)"]


def test_a_trainer_launched_as_two_ranks_but_not_distributed_exits_2_with_one_line(tmp_path):
    """Field case: examples/hf_trainer.py under torchrun on a machine without CUDA (transformers 5.25) built
    TrainingArguments without use_cpu=True; accelerate's state was then not distributed
    (``parallel_mode`` "not_parallel", transformers/training_args.py ``_setup_devices``), the Trainer did
    not wrap the model in DDP and each rank trained alone, while the trial counted micro-batch x
    accumulation x 2 ranks as one step's global batch. The arguments here carry that parallel mode
    (transformers' own enum) under a launcher's RANK/WORLD_SIZE of 2."""
    code = ("from types import SimpleNamespace\n"
            "from transformers import TrainerState, TrainerControl\n"
            "from transformers.training_args import ParallelMode\n"
            "from oomtune.integrations.huggingface import OomtuneCallback\n"
            "args = SimpleNamespace(parallel_mode=ParallelMode.NOT_PARALLEL)\n"
            "OomtuneCallback().on_init_end(args, TrainerState(), TrainerControl())\n")
    done = run_script(["-c", code], {**trial_env(tmp_path, batch=2, accum=1), "RANK": "0", "WORLD_SIZE": "2"})
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines() == [
        "oomtune: Hugging Face Trainer: launched as 2 ranks, but the Trainer trains each rank alone "
        "(TrainingArguments.parallel_mode=not_parallel: no DistributedDataParallel, so the global batch would not "
        "be micro-batch x accumulation x ranks); on a machine without CUDA pass TrainingArguments(use_cpu=True), "
        "which joins the ranks over gloo"]


def test_a_lightning_module_without_a_batch_size_exits_2_with_one_line(tmp_path, forks):
    # the Lightning example's module-level imports (examples/lightning_module.py): forked from its server
    script = tmp_path / "no_batch_size.py"
    script.write_text("import lightning.pytorch as pl\n"
                      "import torch\n"
                      "from torch import nn\n"
                      "from oomtune.integrations.lightning import OomtuneCallback\n"
                      "class M(pl.LightningModule):\n"
                      "    def __init__(self):\n"
                      "        super().__init__(); self.l = nn.Linear(2, 2)\n"
                      "cb = OomtuneCallback()\n"
                      "cb.setup(pl.Trainer(logger=False, enable_progress_bar=False), M(), 'fit')\n")
    done = run_file(forks, tmp_path, [str(script)], trial_env(tmp_path, batch=2, accum=1))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith("oomtune: Lightning: the LightningModule (or its hparams "
                                                           "or datamodule) has no batch_size attribute")


def test_a_loop_that_ends_before_the_trials_steps_exits_2_with_one_line(tmp_path):
    code = ("from oomtune.integrations.loop import steps\n"
            "for _ in steps(range(2)):\n"
            "    pass\n")
    done = run_script(["-c", code], trial_env(tmp_path, batch=2, accum=1, warmup=1, measure=3))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "oomtune: loop: training ended after 2 optimizer step(s), before the 4 the trial needs (1 warm-up + 3 "
        "measured); give it more data or steps"]


def test_oomtune_launched_is_exported():
    assert oomtune.launched is oomtune.script_api.launched and "launched" in oomtune.__all__


# -- end to end: oomtune searches each integration under a fixed global batch --------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("name, command", [
    ("hf", "{py} examples/hf_trainer.py"),
    ("lightning", "{py} examples/lightning_module.py"),
    ("loop", "{py} examples/global_batch.py --micro-batch {{batch_size}} --grad-accum {{grad_accum}}"),
])
def test_a_search_of_the_integration_keeps_the_global_batch(name, command, tmp_path, monkeypatch, request):
    if name == "loop":
        # the same command as tests/test_recording_reuse.py's search (conftest.py): one run for both
        code, run = request.getfixturevalue("global_batch_loop_search")
    elif name == "lightning":
        # the same command as tests/test_meta_steps.py's meta trial of the example (tests/shared_runs.py)
        code, run = request.getfixturevalue("lightning_example_search")
    else:
        monkeypatch.chdir(REPO)
        monkeypatch.setenv("OMP_NUM_THREADS", "1")   # the trials' (ONE_THREAD)
        run = tmp_path / name
        cmd = command.format(py=sys.executable)
        code = main(["search", "target=cmd", f"target.command='{cmd}'", *GLOBAL_BATCH_OVERRIDES,
                     f"hydra.run.dir={run}"])
    assert code == 0
    best = oomtune.load_best(run / "best.yaml")
    assert best.batch_size * best.grad_accum == 16 and best.best.global_batch == 16
    rows = json.loads((run / "trials.json").read_text())
    assert rows[0]["role"] == "record"                      # recordings of two micro-batches per step first
    for row in rows:   # every trial that measured a candidate trained the global batch
        if row.get("from_recording") is not None:
            # answered by a recording of the same micro-batch (two micro-batches: the accumulation's
            # repeating step, whose peak more micro-batches repeat), not launched: no result of its own
            source = next(r for r in rows if r["number"] == row["from_recording"])
            assert source["role"] == "record" and source["batch_size"] == row["batch_size"]
            assert not (run / "trials" / f"trial-{row['number']:04d}" / "result.json").exists()
            continue
        record = TrialResult.read(run / "trials" / f"trial-{row['number']:04d}" / "result.json")
        accum = record.script.grad_accum or 1
        assert (accum == 2) if row["role"] == "record" else (row["batch_size"] * accum == 16)


# -- Lightning's DDP script under torchrun, 2 CPU ranks, as a target=cmd trial ------------------------------
# The script runs Trainer(accelerator="cpu", devices=2, strategy="ddp"); under torchrun Lightning finds
# torchelastic's environment and starts no process of its own, and joins both ranks in a gloo process group.
# Each rank has its own virtual GPU of the trial's budget. The same script under Lightning's own launcher
# (Lightning starts rank 1 itself: a subprocess running the script again, with LOCAL_RANK and WORLD_SIZE but
# no RANK) is tests/test_search_two_ranks_e2e.py's [lightning-ddp] search, whose two trials assert what a
# trial of it must show: the second process, the samples counted once, each rank's peak, the rank-1-only
# out-of-memory, no rank process left.
LIGHTNING_DDP = REPO / "tests" / "data" / "launchers" / "lightning_ddp_train.py"


def _lightning_ddp_torchrun_trial(tmp_path: Path, *, rank1_hold: int, budget: int):
    from oomtune.trial.runner import TrialRunner

    pids = tmp_path / "pids"
    pids.mkdir()
    command = (f"{sys.executable} -m torch.distributed.run --nproc_per_node 2 --standalone {LIGHTNING_DDP} "
               f"--pid-dir {pids} --rank1-hold {rank1_hold}")
    spec = TrialSpec(workload={"target": {"name": "cmd", "command": command}, "grad_accum": 2}, batch_size=3,
                     device="cpu", budget_bytes=budget, warmup_steps=1, measure_steps=2, timeout_s=240, ranks=2)
    runner = TrialRunner()
    try:
        res = runner.run(spec, workdir=tmp_path / "trial", env=ONE_THREAD)
    finally:
        runner.close()
    rank_pids = {int(p.stem[len("rank"):]): int(p.read_text()) for p in pids.glob("rank*.pid")}
    return res, rank_pids, read_channel(tmp_path / "trial" / "results.jsonl")


def _gone(pids) -> bool:
    from oomtune.trial.runner import group_alive

    def alive(pid: int) -> bool:   # a zombie has exited (its parent, the launcher, is gone: init reaps it)
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    return not any(alive(p) for p in pids)


@pytest.mark.slow
def test_lightning_ddp_under_torchrun_oom_on_rank_1_only_is_infeasible_and_names_rank_1(tmp_path):
    from oomtune.trial.runner import group_alive
    from oomtune.units import MiB

    # rank 1 asks for 80 MiB at once on its 64 MiB virtual GPU; rank 0 needs well under 1 MiB
    res, pids, events = _lightning_ddp_torchrun_trial(tmp_path, rank1_hold=80 * MiB, budget=64 * MiB)
    assert res.outcome.is_memory, (res.outcome, res.message)
    assert res.failed_rank == 1 and res.message.startswith("rank 1 of 2:"), res.message
    assert res.memory.oom_requested_bytes == 80 * MiB
    (oom,) = [e for e in events if e["event"] == "oom"]
    assert (oom["rank"], oom["world_size"]) == (1, 2)
    # rank 0 lost its peer inside the gradient all-reduce (gloo: connection closed): not a second failure.
    # Its memory line comes only when it gets to write it before the launcher stops it (torchrun stops
    # the other ranks as soon as one fails: a full suite once saw no rank's memory line at all); when
    # written, rank 0's peak is well under the budget
    assert {r.rank for r in res.ranks} <= {0, 1}
    assert all(r.peak_reserved_bytes < 64 * MiB for r in res.ranks if r.rank == 0)
    assert sorted(pids) == [0, 1]
    assert _gone(pids.values()) and not group_alive(res.process.pid)


# -- the examples hold every step a search asks of them --------------------------------------------------
def test_the_lightning_examples_loader_yields_whole_micro_batches_at_any_searched_batch():
    """Field case: ``oomtune search`` of examples/lightning_module.py at 128 MiB probed batch 85, whose
    loader over 256 sequences yielded 85, 85, 85 and 1: the last step's requests differed from the
    stream derived for 85 and the search stopped its predictions. Expected (hand arithmetic): the
    loader of 512 sequences with drop_last yields 512 // 85 = 6 batches of 85, and one of 512."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("lightning_example", REPO / EXAMPLES["lightning"])
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    for batch, n in ((85, 6), (512, 1)):
        module = example.TinyLM(batch_size=batch)
        sizes = [len(b) for b in module.train_dataloader()]
        assert sizes == [batch] * n


def test_the_loop_example_runs_the_confirmation_s_steps(tmp_path, forks):
    """Field case: examples/global_batch.py trained 4 optimizer steps, so every probe passed (1 warm-up
    + 3 measured) and the confirmation (1 warm-up + 10: conf/config.yaml's trial.warmup_steps and
    trial.confirm_steps) ended with "training ended after 4 optimizer step(s)", exit status 2, failing
    the search after all its probes."""
    done = run_file(forks, tmp_path, [EXAMPLES["loop"], "--micro-batch", "1", "--grad-accum", "1"],
                    trial_env(tmp_path, batch=1, accum=1, warmup=1, measure=10))
    assert done.returncode == 0, done.stderr[-2000:]
    (rep,) = [e for e in read_channel(tmp_path / "results.jsonl") if e["event"] == "report"]
    assert rep["steps"] == 10 and rep["samples"] == 10   # micro-batch 1 x 1 micro-batch x 10 measured steps
