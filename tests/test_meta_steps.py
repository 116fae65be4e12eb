"""A user's Hugging Face Trainer script runs its trial's steps on the meta device (``OOMTUNE_EXECUTE=meta``).

What must hold: the meta steps' recorded request stream is the CPU steps' stream, event for event,
except for the host-side requests a CPU recording counts and a CUDA run keeps on the host; a step
that meta cannot run makes the trial run again on the CPU and say why; tied weights stay tied on meta.

Expected values: the CPU run of the same script (the behaviour before meta steps) and hand arithmetic
for the host-side tensors (torch/utils/data/dataloader.py's ``_BaseDataLoaderIter.__init__`` draws its
base seed as ``torch.empty((), dtype=torch.int64).random_()``: 8 bytes; ``RandomSampler.__iter__``
draws ``torch.randperm(n)``: n x 8 bytes, int64).

The batch's tensors (transformers 5.x, accelerate 1.x source): ``default_data_collator``
(transformers/data/data_collator.py ``torch_default_data_collator``) builds each key of a batch of
Python lists with ``torch.tensor([...])`` on the host: here 4 rows x 32 tokens x 8 bytes (int64) =
1024 bytes, two keys (``input_ids``, ``labels``). accelerate's ``DataLoaderShard.__iter__``
(accelerate/data_loader.py) copies the current batch to the device (``send_to_device``), *then*
collates the next one (``next_batch = next(dataloader_iter)``, its one-batch look-ahead), and yields
the current batch; the Trainer's ``get_batch_samples`` (transformers/trainer.py) takes
``gradient_accumulation_steps`` (2) batches before the step's first forward. So before the first
forward a GPU run holds on its device 2 batches x 2 keys = 4 copies of 1024 bytes, and on the host the
collated tensors of batches 0-2 (batch 2 the look-ahead, copied to the device only when it becomes
current, one step later). The CPU recording counts all 6 collated host tensors where they are made
(``send_to_device`` to ``cpu`` is a no-op); the meta recording counts the 4 device copies where the
GPU run makes them (``cpu`` means ``meta`` in ``send_to_device``; the collator's ``torch.tensor``
has no device argument and stays on the host). From the second step on, the CPU's collations of the
next batches stand where the device copies of the current ones stand, same sizes, so the CPU stream
differs from a GPU run's (and from the meta one) only by the look-ahead batch held throughout: its
peak allocated is 2 x 1024 bytes higher.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from shared_runs import lightning_example_search  # noqa: F401  (a session's shared search)

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = '''
import sys, tempfile, torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from oomtune.integrations.huggingface import OomtuneCallback

class Rows(torch.utils.data.Dataset):   # python lists: the collator makes the batch's tensors
    def __init__(self, n, seq):
        self.rows = [[(7 * i + j) % 256 for j in range(seq)] for i in range(n)]
    def __len__(self):
        return len(self.rows)
    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}

class Reads(GPT2LMHeadModel):   # a model that reads a value in its forward: meta has none
    def forward(self, input_ids=None, **kw):
        if READS:
            float(self.transformer.wte.weight.sum())
        return super().forward(input_ids=input_ids, **kw)

READS = "--reads" in sys.argv
torch.manual_seed(0)
model = Reads(GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=2, n_positions=32))
with tempfile.TemporaryDirectory() as out:
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, max_steps=2, report_to=[],
                             save_strategy="no", logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
                             remove_unused_columns=False)
    Trainer(model=model, args=args, train_dataset=Rows(64, 32), callbacks=[OomtuneCallback()]).train()
'''


# OMP_NUM_THREADS=1: one small trial process on cores other tests' processes share, where an OpenMP pool
# of one thread per core spends its idle threads' time spinning; the recorded streams do not depend on it
TRIAL_ENV = {"PYTHONPATH": str(ROOT), "OOMTUNE_CACHE_DIR": "off", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def forks():
    """The module's script servers (oomtune.trial.script_fork.ScriptServers), as a search's runner has:
    the Trainer and Lightning trials below are ``python FILE.py`` commands, forked from a server that
    imported the script's third-party modules (transformers, lightning) once for the module, not once per
    trial process (about 7 CPU-s each, more than the steps). The forked process runs the file as python
    would (oomtune.trial.script_main), with the trial's whole environment, so the recorded streams are a
    spawned process's; where a server cannot start or fork, the trial is spawned (the record's
    ``process.launcher_fallback`` says why) and asserts the same."""
    from oomtune.trial.script_fork import ScriptServers

    servers = ScriptServers()
    yield servers
    servers.close()


def _trial(tmp_path: Path, execute: str, *extra: str, forks=None):
    from oomtune.targets.cmd import run_cmd_trial
    from oomtune.trial.record import TrialSpec
    from oomtune.units import GiB

    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    work = tmp_path / execute
    spec = TrialSpec(workload={"target": {"name": "cmd", "command": [sys.executable, str(script), *extra]},
                               "grad_accum": 2},
                     batch_size=4, device="cpu", budget_bytes=1 * GiB, device_memory_bytes=80 * GiB,
                     warmup_steps=1, measure_steps=1, timeout_s=300, execute=execute)
    return run_cmd_trial(spec, workdir=work, env=TRIAL_ENV, forks=forks), work


def _events(path: Path) -> list[tuple[str, int]]:
    """The stream as (A|F, size in bytes), in order (keys differ between runs, sizes do not)."""
    from oomtune.alloc.stream import AllocationStream

    s = AllocationStream.load(str(path))
    size: dict[int, int] = {}
    out = []
    for action, key, nbytes in zip(s.actions, s.keys, s.sizes):
        if action == 0:
            size[key] = nbytes
        out.append(("A" if action == 0 else "F", size[key]))
    return out


def _search_trial(run: Path, *, role: str, batch: int, grad_accum: int):
    """The result of the first trial of ``role`` at micro-batch ``batch`` in a search's run directory, and
    its directory; its accumulation checked."""
    from oomtune.trial.record import TrialResult

    rows = sorted(json.loads((run / "trials.json").read_text()), key=lambda r: r["number"])
    (number, *_) = [r["number"] for r in rows if r["role"] == role and r["batch_size"] == batch]
    trial = run / "trials" / f"trial-{number:04d}"
    result = TrialResult.read(trial / "result.json")
    assert result.script.grad_accum == grad_accum
    return result, trial


@pytest.mark.slow
def test_meta_steps_record_the_cpu_steps_stream_less_the_host_side_requests(tmp_path, forks):
    cpu, cpu_dir = _trial(tmp_path, "cpu", forks=forks)
    meta, meta_dir = _trial(tmp_path, "meta", forks=forks)
    assert cpu.outcome == "ok" and meta.outcome == "ok", (cpu.message, meta.message)
    assert cpu.execution.where == "cpu" and meta.execution.where == "meta"
    host = [("A", 8), ("F", 8), ("A", 64 * 8), ("F", 64 * 8)]   # the loader's seed, RandomSampler's randperm(64)
    got_cpu, got_meta = _events(cpu_dir / "stream.bin"), _events(meta_dir / "stream.bin")
    # the host-side pairs come before the first batch, once per epoch (one epoch: 2 steps x 2 x 4 < 64 rows)
    first = got_cpu.index(("A", 8))
    assert got_cpu[first:first + 4] == host
    cpu_less_host = got_cpu[:first] + got_cpu[first + 4:]
    batch_tensor = ("A", 4 * 32 * 8)   # one key of one micro-batch: 4 rows x 32 int64 tokens
    # before the first forward: the CPU recording's 3 collated batches (2 for the step + the loader's
    # look-ahead) x 2 keys; a GPU run's device (and meta) holds the 2 batches copied for the step x 2 keys
    assert cpu_less_host[first:first + 6] == [batch_tensor] * 6 and cpu_less_host[first + 6] != batch_tensor
    assert got_meta[first:first + 4] == [batch_tensor] * 4 and got_meta[first + 4] != batch_tensor
    # less the look-ahead batch's two host tensors, the CPU steps made the meta steps' requests, event for event
    assert cpu_less_host[:first + 4] + cpu_less_host[first + 6:] == got_meta
    # the look-ahead batch is held on the host from the first step's collation to the end of the recording
    assert meta.memory.peak_allocated_bytes == cpu.memory.peak_allocated_bytes - 2 * 1024
    assert meta.memory.peak_reserved_bytes == cpu.memory.peak_reserved_bytes
    # nothing was computed on meta: no throughput
    assert cpu.throughput.samples_per_s > 0 and meta.throughput.samples_per_s is None


@pytest.mark.slow
def test_a_step_that_reads_a_value_runs_again_on_the_cpu_and_says_why(tmp_path, forks):
    r, _ = _trial(tmp_path, "meta", "--reads", forks=forks)
    assert r.outcome == "ok", r.message
    assert r.execution.where == "cpu"
    assert "reads a tensor's value (__float__()" in r.execution.fallback
    assert r.throughput.samples_per_s > 0


def test_moving_a_model_to_meta_keeps_tied_weights_one_tensor():
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from oomtune.integrations._meta import move_to_meta

    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=8))
    assert model.lm_head.weight is model.transformer.wte.weight
    n = len(list(model.parameters()))
    move_to_meta(model)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.lm_head.weight.device.type == "meta" and len(list(model.parameters())) == n
    # Module.to would untie them: a cpu -> meta move makes a new Parameter per module
    other = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=8)).to("meta")
    assert other.lm_head.weight is not other.transformer.wte.weight


def test_value_reads_outside_the_frameworks_logging_are_refused_on_meta():
    import torch

    from oomtune.integrations._meta import MetaSteps, MetaStepUnsupported

    x = torch.empty(3, device="meta")
    with MetaSteps(placeholder_reads=("nowhere/",)):
        assert torch.zeros(2, device="cpu").device.type == "meta"         # cpu means meta
        assert torch.ones(2).to("cpu").device.type == "meta"
        assert torch.tensor(1.0, device="cpu").device.type == "meta"
        assert torch.arange(3).device.type == "cpu"                       # no device: the host
        assert x.cpu() is x
        with pytest.raises(MetaStepUnsupported, match="reads a tensor's value"):
            bool(x.sum() > 0)
    with MetaSteps(placeholder_reads=("test_meta_steps.py",)):
        assert bool(x.sum() > 0) is False and x.sum().item() == 0.0


def _loop_trial(tmp_path: Path, execute: str):
    from oomtune.targets.cmd import run_cmd_trial
    from oomtune.trial.record import TrialSpec
    from oomtune.units import GiB

    command = [sys.executable, str(ROOT / "examples" / "global_batch.py"), "--micro-batch", "4", "--grad-accum", "2"]
    spec = TrialSpec(workload={"target": {"name": "cmd", "command": command, "cwd": str(ROOT)}, "grad_accum": 2},
                     batch_size=4, device="cpu", budget_bytes=1 * GiB, device_memory_bytes=80 * GiB,
                     warmup_steps=1, measure_steps=1, timeout_s=300, execute=execute)
    work = tmp_path / execute
    return run_cmd_trial(spec, workdir=work, env=TRIAL_ENV), work


@pytest.mark.slow
def test_a_plain_loops_meta_steps_make_its_cpu_steps_requests_less_adams_host_step_counters(
        tmp_path, global_batch_loop_search):
    # examples/global_batch.py makes its AdamW before steps(): the optimizer must step the meta parameters
    # (stepping the host ones, which get no gradients, would record no exp_avg / exp_avg_sq at all)
    cpu, cpu_dir = _loop_trial(tmp_path, "cpu")
    # the meta trial of the same command (--micro-batch 4 --grad-accum 2, 1 warm-up + 1 measured step): the
    # recording conftest.py's global-batch search makes of micro-batch 4 (its trials on meta: trial.execute=auto
    # on the virtual GPU)
    code, run = global_batch_loop_search
    assert code == 0
    meta, meta_dir = _search_trial(run, role="record", batch=4, grad_accum=2)
    assert cpu.outcome == "ok" and meta.outcome == "ok", (cpu.message, meta.message)
    assert cpu.execution.where == "cpu" and meta.execution.where == "meta"
    got_cpu, got_meta = _events(cpu_dir / "stream.bin"), _events(meta_dir / "stream.bin")
    # torch/optim/adam.py with capturable=False keeps each parameter's step counter on the host
    # (torch.tensor(0.0, dtype=float32): 4 bytes, made in _init_group at the first step) and, in the foreach
    # step a CUDA run takes, adds a host scalar torch.tensor(1.0, device="cpu") to them once per step (4 bytes,
    # freed): the CPU recording counts both, a CUDA run (and meta) neither
    # GPT-2 of 2 layers: wte, wpe, 12 tensors a block (ln_1, c_attn, attn c_proj, ln_2, c_fc, mlp c_proj: weight
    # and bias each), ln_f's 2; lm_head is wte (tied): 2 + 2 x 12 + 2 = 28 counters; 2 steps: 2 host scalars
    counters, scalars = 2 + 2 * 12 + 2, 2
    assert sum(e == ("A", 4) for e in got_cpu) - sum(e == ("A", 4) for e in got_meta) == counters + scalars
    kept, j = [], 0   # the CPU stream, less 4-byte requests where the meta stream has none, is the meta stream
    for e in got_cpu:
        if j < len(got_meta) and e == got_meta[j]:
            kept.append(e)
            j += 1
        else:
            assert e[1] == 4, e
    assert kept == got_meta
    # the counters are held from the first step on (each a 512-byte block, the allocator's smallest); the
    # scalars are freed at once. Without the optimizer repointed, meta would also lack every exp_avg/exp_avg_sq
    assert meta.memory.peak_allocated_bytes == cpu.memory.peak_allocated_bytes - counters * 512
    assert meta.memory.peak_reserved_bytes == cpu.memory.peak_reserved_bytes


# ---------------------------------------------------------------- Lightning
# Lightning 2.6.6's single-device fit, tests/data/lightning_tiny.py (a bias-free Linear(256, 256), the loss
# the sum of its outputs, Adam, 64 rows of 256 float32 made before fit, micro-batch 4, no accumulation).
TINY = ROOT / "tests" / "data" / "lightning_tiny.py"
W = 256 * 256 * 4      # the weight, and each of its gradient, exp_avg, exp_avg_sq: 262,144 bytes (float32)
X = 4 * 256 * 4        # one micro-batch on the device: 4,096 bytes
BLOCK = 512            # the caching allocator's smallest block (kMinBlockSize): any 0-dim tensor
# one cuBLAS workspace of the default target GPU (A100): torch's default ":4096:2:16:8" (CublasHandlePool.cpp)
WS = 4096 * 1024 * 2 + 16 * 1024 * 8
DATASET = 64 * 256 * 4  # the rows, on the host in a GPU run: 65,536 bytes


@pytest.fixture(scope="module")
def lightning_cwd(tmp_path_factory) -> Path:
    """The Lightning trials' working directory (where ``--log``'s logger writes lightning_logs/), one for
    the module: a fork server is shared by the commands of one working directory (script_fork.server_key)."""
    return tmp_path_factory.mktemp("lightning-cwd")


def _lightning_trial(tmp_path: Path, execute: str, script: Path, *extra: str, grad_accum: int = 1,
                     forks=None, cwd: Path | None = None):
    from oomtune.targets.cmd import run_cmd_trial
    from oomtune.trial.record import TrialSpec
    from oomtune.units import GiB

    work = tmp_path / execute
    work.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(script), *extra]
    spec = TrialSpec(workload={"target": {"name": "cmd", "command": command, "cwd": str(cwd or work)},
                               "grad_accum": grad_accum},
                     batch_size=4, device="cpu", budget_bytes=1 * GiB, device_memory_bytes=80 * GiB,
                     warmup_steps=1, measure_steps=1, timeout_s=300, execute=execute)
    return run_cmd_trial(spec, workdir=work / "trial", env=TRIAL_ENV, forks=forks)


def _less(stream: list, extra: list) -> list:
    """``stream`` less the events ``extra`` names (each once, matched in order of the other stream)."""
    left = list(stream)
    for e in extra:
        left.remove(e)
    return left


def _subsequence_rest(longer: list, shorter: list) -> list | None:
    """The events of ``longer`` left over once ``shorter`` is matched in it in order (greedily);
    None when ``shorter`` is not a subsequence of ``longer``."""
    rest, j = [], 0
    for e in longer:
        if j < len(shorter) and e == shorter[j]:
            j += 1
        else:
            rest.append(e)
    return rest if j == len(shorter) else None


@pytest.mark.slow
def test_a_lightning_trial_on_meta_peaks_at_the_bytes_counted_by_hand_and_the_cpu_trial_adds_its_host_tensors(
        tmp_path, forks, lightning_cwd):
    cpu = _lightning_trial(tmp_path, "cpu", TINY, forks=forks, cwd=lightning_cwd)
    meta = _lightning_trial(tmp_path, "meta", TINY, forks=forks, cwd=lightning_cwd)
    assert cpu.outcome == "ok" and meta.outcome == "ok", (cpu.message, meta.message)
    assert cpu.execution.where == "cpu" and meta.execution.where == "meta"
    assert meta.execution.fallback is None and meta.execution.note is None
    # The peak is inside Adam's step (torch/optim/adam.py _multi_tensor_adam, the foreach step a CUDA run
    # takes, non-capturable): the weight, its gradient, exp_avg, exp_avg_sq and the one temporary
    # torch._foreach_sqrt(exp_avg_sqs) (div_/add_/addcdiv_ are in place), plus what Lightning holds then
    # (lightning/pytorch/loops/optimization/automatic.py): the micro-batch (training_epoch_loop.advance's
    # batch, on the device), ClosureResult.closure_loss (training_step's loss / normalize: a new 0-dim
    # tensor even when accumulate_grad_batches is 1) and its loss (closure_loss.detach().clone()). The
    # forward's output (4 x 256) is freed when sum() returns; backward holds the weight-shaped gradient
    # but not yet the sqrt, so it peaks lower. Adam's step counter is on the host (capturable=False).
    # Plus the two cuBLAS workspaces the CUDA run holds by then: the main thread's (from its first forward
    # matmul) and the autograd device thread's (from the first backward matmul).
    peak = 5 * W + X + 2 * BLOCK + 2 * WS
    assert meta.memory.peak_allocated_bytes == peak
    # every other request is under 1 MiB: the small pool, whose segments are 2 MiB (kSmallBuffer,
    # c10/cuda/CUDACachingAllocator.cpp), and 1.3 MB live at most fit one; the workspaces (8.125 MiB each,
    # in (1 MiB, 10 MiB]) share one 20 MiB kLargeBuffer segment: the second is split from the first's rest
    assert meta.memory.peak_reserved_bytes == 2 * 1024 * 1024 + 20 * 1024 * 1024
    # The CPU recording also counts host tensors a GPU run keeps off the device: the rows, counted when the
    # loader first indexes them (oomtune/capture/recorder.py: a storage first seen in an op's output is
    # recorded as new) and held from then on; Adam's host step counter (torch.tensor(0.0): 4 bytes, one
    # 512-byte block, from the first step); freed before the peak: the loader's base seed
    # (torch/utils/data/dataloader.py _BaseDataLoaderIter.__init__: torch.empty((), dtype=torch.int64),
    # 8 bytes; one iterator, made in _FitLoop.setup_data) and the host scalar torch.tensor(1.0,
    # device="cpu") _multi_tensor_adam adds to the counters, once per step (4 bytes, 2 steps).
    assert cpu.memory.peak_allocated_bytes == peak + DATASET + BLOCK
    host = [("A", 8), ("F", 8), ("A", DATASET), ("A", 4), ("A", 4), ("F", 4), ("A", 4), ("F", 4)]
    got_cpu = _events(tmp_path / "cpu" / "trial" / "stream.bin")
    got_meta = _events(tmp_path / "meta" / "trial" / "stream.bin")
    # the meta stream is the CPU stream, in order, with exactly those host events left out; the rest event
    # for event: the batch a GPU run (and meta) copies to the device where strategy.batch_to_device moves it,
    # the CPU recording collates on the host at the same point (the loader has a length, so
    # _PrefetchDataFetcher fetches no batch ahead: lightning/pytorch/loops/fetchers.py)
    rest = _subsequence_rest(got_cpu, got_meta)
    assert rest is not None and sorted(rest) == sorted(host)
    assert meta.throughput.samples_per_s is None and cpu.throughput.samples_per_s > 0


@pytest.mark.slow
def test_lightnings_logged_loss_on_meta_gets_placeholders_and_the_same_peak_as_on_the_cpu(
        tmp_path, forks, lightning_cwd):
    cpu = _lightning_trial(tmp_path, "cpu", TINY, "--log", forks=forks, cwd=lightning_cwd)
    meta = _lightning_trial(tmp_path, "meta", TINY, "--log", forks=forks, cwd=lightning_cwd)
    assert cpu.outcome == "ok" and meta.outcome == "ok", (cpu.message, meta.message)
    assert meta.execution.where == "meta" and meta.execution.fallback is None
    # the logger connector turns the logged loss into a number (convert_tensors_to_scalars' to_item,
    # lightning/fabric/utilities/apply_func.py) for the progress bar and the logger: a placeholder on meta
    assert meta.script.reported_values()[0]["meta_placeholder_reads"] >= 1
    # the same host tensors as without logging, and the logged metric's own: torchmetrics' Metric.add_state
    # keeps a deepcopy of each state's default (value: float32, cumulated_batch_size: int64), and
    # Tensor.__deepcopy__ (torch/_tensor.py) makes it with new_empty([]) (4 and 8 bytes) before set_()
    # gives it the copied storage; on meta (as on a GPU) the states and defaults are made on the host and
    # copied to the device by _ResultCollection.log's .to(value.device) (logger_connector/result.py)
    host = [("A", 8), ("F", 8), ("A", DATASET), ("A", 4), ("A", 4), ("F", 4), ("A", 4), ("F", 4),
            ("A", 4), ("F", 4), ("A", 8), ("F", 8)]
    got_cpu = _events(tmp_path / "cpu" / "trial" / "stream.bin")
    got_meta = _events(tmp_path / "meta" / "trial" / "stream.bin")
    assert sorted(_less(got_cpu, host)) == sorted(got_meta)   # same requests; the states' come where moved
    assert meta.memory.peak_allocated_bytes == cpu.memory.peak_allocated_bytes - DATASET - BLOCK
    assert meta.memory.peak_reserved_bytes == cpu.memory.peak_reserved_bytes


@pytest.mark.slow
def test_a_lightning_step_that_reads_a_value_runs_again_on_the_cpu_and_says_why(tmp_path, forks, lightning_cwd):
    r = _lightning_trial(tmp_path, "meta", TINY, "--reads", forks=forks, cwd=lightning_cwd)
    assert r.outcome == "ok", r.message
    assert r.execution.where == "cpu"
    # the module's float(loss), not Lightning's clean-up: Strategy.teardown calls the module's cpu(),
    # which still runs on meta after the error
    assert "reads a tensor's value (__float__()" in r.execution.fallback
    assert "lightning_tiny.py" in r.execution.fallback
    assert r.throughput.samples_per_s > 0


@pytest.mark.slow
def test_the_lightning_example_runs_its_trial_on_meta(lightning_example_search):
    # the trial of micro-batch 4 x 2 micro-batches (1 warm-up + 1 measured step, trials on meta: the search's
    # trial.execute=auto on the virtual GPU) that tests/shared_runs.py's search of examples/lightning_module.py
    # records first
    code, run = lightning_example_search
    assert code == 0
    r, _ = _search_trial(run, role="record", batch=4, grad_accum=2)
    assert r.outcome == "ok", r.message
    assert r.execution.where == "meta" and r.execution.note is None and r.execution.fallback is None
    assert r.throughput.samples_per_s is None


def test_lightnings_loader_length_check_is_answered_exactly_on_meta():
    # lightning/pytorch/utilities/data.py has_len_all_ranks: the loader's length as a tensor on the root
    # device, reduced over ranks (SingleDeviceStrategy.reduce: the identity), compared with 0 twice
    import torch
    from lightning.pytorch.strategies import SingleDeviceStrategy
    from lightning.pytorch.utilities.data import has_len_all_ranks

    from oomtune.integrations._meta import MetaSteps, MetaStepUnsupported

    strategy = SingleDeviceStrategy(device=torch.device("cpu"))
    with MetaSteps(placeholder_reads=("nowhere/",)) as steps:   # any placeholder would raise
        assert has_len_all_ranks(torch.utils.data.DataLoader(range(8), batch_size=2), strategy) is True
        assert steps.placeholder_count == 0
        n = torch.tensor(3, device="cpu")
        above, zero, value = bool(n > 2), bool(n == 0), int(n)
        assert n.device.type == "meta" and (above, zero, value) == (True, False, 3)
        n.add_(1)                          # changed in place: the value is no longer known
        with pytest.raises(MetaStepUnsupported, match="reads a tensor's value"):
            bool(n == 4)
        m = torch.tensor([1, 2], device="cpu")
        m[0:1].mul_(5)                     # changed through a view: m's value is no longer known either
        with pytest.raises(MetaStepUnsupported, match="reads a tensor's value"):
            m.tolist()
        big = torch.tensor(list(range(65)), device="cpu")   # more than 64 elements: no host copy kept
        with pytest.raises(MetaStepUnsupported):
            big.tolist()
