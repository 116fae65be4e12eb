"""A Trainer script with ``TrainingArguments(bf16=True)`` (no ``use_cpu``) searched on a machine without a GPU.

transformers checks the hardware when the arguments are built (training_args.py ``_validate_args``:
``is_torch_bf16_gpu_available()``, which is ``torch.cuda.is_bf16_supported()`` when CUDA is available and False
without it). On a virtual-GPU trial the check is answered by the target GPU (``OOMTUNE_GPU``), and the steps then
run under CUDA's autocast policy: what must hold is what a CUDA bf16 run on that card allocates, and the refusal
a card gives when its check says no.

Expected values, by hand, for tests/data/hf_bf16_train.py's GPT-2 (E = 48 wide, 2 layers, vocabulary V = 256,
T = 40 tokens, micro-batch B = 3, 1 warm-up + 1 measured step: 2 steps):

- the attention projection ``c_attn`` is transformers' ``Conv1D``, ``torch.addmm(bias, x.view(-1, E), weight)``
  (transformers/pytorch_utils.py); ``addmm`` and ``linear`` are ``lower_precision_fp`` ops of CUDA autocast
  (``AT_FORALL_LOWER_PRECISION_FP``, aten/src/ATen/autocast_mode.h, registered for ``AutocastCUDA`` in
  autocast_mode.cpp), so its output is bf16: B x T x 3E x 2 bytes = 3 x 40 x 144 x 2 = 34560 bytes, requested
  once in the forward and once in the backward (the gradient flowing into it: ``split``'s backward makes one
  tensor of its shape), per layer and step: 2 x 2 x 2 = 8. Its fp32 form (69120 bytes) is never requested.
- ``cached_cast`` (autocast_mode.cpp) keeps one bf16 copy of each fp32 weight per autocast region: c_attn's
  E x 3E x 2 = 13824 bytes, and addmm's backward makes that copy's gradient in bf16 (13824 bytes): 2 per layer
  and step = 8.
- master weights and AdamW's state stay fp32 (E x 3E x 4 = 27648 bytes for c_attn): the 2 parameters
  (registered), their fp32 gradients (``to``'s backward casts the bf16 gradient back to the leaf's dtype; a new
  one each step after ``zero_grad(set_to_none=True)``): 4, and the fused AdamW's ``exp_avg`` / ``exp_avg_sq``
  (``torch.zeros_like(p)``, torch/optim/adamw.py; transformers' default optimizer is ``adamw_torch_fused``, which
  makes no per-parameter temporaries): 4. 10 in all; bf16 states would be 13824 bytes instead.
- the logits: ``lm_head`` is a Linear (``linear``: lower_precision_fp): B x T x V x 2 = 61440 bytes, once in
  the forward and its gradient once in the backward (the loss upcasts with ``logits.float()``, whose backward
  casts the gradient back to bf16): 2 per step = 4.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from oomtune.alloc.stream import ALLOC
from oomtune.capture.gpu_target import parse_gpu
from oomtune.capture.target_cuda import answering_as, bf16_supported
from oomtune.plan.recorded import load_recording
from oomtune.targets.cmd import read_channel

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "data" / "hf_bf16_train.py"
B, T, E, V, LAYERS, STEPS = 3, 40, 48, 256, 2, 2


def trial(tmp_path: Path, gpu: str | None, *args: str, execute: str = "meta") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OOMTUNE_RESULT_FILE": str(tmp_path / "results.jsonl"),
           "OOMTUNE_STREAM_FILE": str(tmp_path / "stream.bin"), "OOMTUNE_BATCH_SIZE": str(B),
           "OOMTUNE_GRAD_ACCUM": "1", "OOMTUNE_WARMUP_STEPS": "1", "OOMTUNE_MEASURE_STEPS": str(STEPS - 1),
           "OOMTUNE_DEVICE": "cpu", "OOMTUNE_EXECUTE": execute, "OOMTUNE_BUDGET_BYTES": str(1 << 30),
           "OOMTUNE_DEVICE_MEMORY_BYTES": str(80 << 30), "OMP_NUM_THREADS": "1"}
    env.pop("OOMTUNE_GPU", None)
    if gpu is not None:
        env["OOMTUNE_GPU"] = gpu
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)


def report_of(tmp_path: Path) -> dict:
    (rep,) = [e for e in read_channel(tmp_path / "results.jsonl") if e["event"] == "report"]
    return rep


# -- the target's answers ------------------------------------------------------------------------------------
def test_bf16_support_follows_torch_cuda_is_bf16_supported_for_the_target():
    """torch/cuda/__init__.py is_bf16_supported: major >= 8 -> True; below, ``including_emulation`` (a bf16
    tensor can be made on every CUDA card: emulated)."""
    a100, t4, v100 = parse_gpu("a100"), parse_gpu("t4"), parse_gpu("v100")
    assert bf16_supported(a100) and bf16_supported(a100, including_emulation=False)
    assert bf16_supported(t4) and not bf16_supported(t4, including_emulation=False)
    assert bf16_supported(v100) and not bf16_supported(v100, including_emulation=False)


def test_answering_as_the_target_is_one_block_and_restores_torch_cuda():
    import torch

    before = (torch.cuda.is_available, torch.cuda.get_device_properties, torch.cuda.is_bf16_supported)
    with answering_as(parse_gpu("t4")):
        assert torch.cuda.is_available() and torch.cuda.device_count() == 1
        assert torch.cuda.get_device_capability() == (7, 5)       # T4: sm75
        assert torch.cuda.get_device_properties(torch.cuda.current_device()).major == 7
        assert torch.cuda.is_bf16_supported() and not torch.cuda.is_bf16_supported(including_emulation=False)
    assert (torch.cuda.is_available, torch.cuda.get_device_properties, torch.cuda.is_bf16_supported) == before
    with pytest.raises(KeyError):
        with answering_as(parse_gpu("h100")):
            raise KeyError("x")
    assert torch.cuda.is_available is before[0] and not torch.cuda.is_available()


# -- an A100 target: the trial runs, its stream is a CUDA bf16 run's -------------------------------------------
# The meta trial runs under the check that reads the compute capability (``--capability-check``, transformers
# 4.x's), the CPU trial under the installed transformers' own: an A100 passes both (sm80), and each trial
# process (about 7 CPU-s, most of it importing transformers) checks its stream all the same.
@pytest.mark.parametrize("execute, args", [("meta", ("--capability-check",)), ("cpu", ())], ids=["meta", "cpu"])
def test_a_bf16_trainer_trial_on_an_a100_target_records_bf16_activations_and_fp32_state(tmp_path, execute, args):
    done = trial(tmp_path, "a100", *args, execute=execute)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"trained {STEPS} optimizer steps" in done.stdout
    rep = report_of(tmp_path)
    assert rep["extra"]["precision"] == "bf16" and "precision_note" not in rep["extra"]   # native on sm80
    # meta steps ran as asked (a value read inside the autocast region is the framework's, not the mode's)
    assert rep["extra"].get("execute") == ("meta" if execute == "meta" else None)
    stream, _ = load_recording(tmp_path / "stream.bin")
    sizes = Counter(size for action, size in zip(stream.actions, stream.sizes) if action == ALLOC)
    c_attn_out = B * T * 3 * E
    assert sizes[c_attn_out * 2] == 2 * LAYERS * STEPS          # bf16 output of addmm and its gradient
    assert sizes[c_attn_out * 4] == 0                           # never in fp32
    assert sizes[E * 3 * E * 2] == 2 * LAYERS * STEPS           # cached bf16 weight copy and its gradient
    assert sizes[E * 3 * E * 4] == LAYERS * (1 + STEPS + 2)     # fp32 weight, fp32 grads, fp32 AdamW states
    assert sizes[B * T * V * 2] == 2 * STEPS                    # bf16 logits and their gradient


# -- a T4 target: what a real T4 answers ------------------------------------------------------------------------
def test_a_t4_target_accepts_bf16_as_the_installed_transformers_does_on_a_real_t4(tmp_path):
    """The installed transformers asks ``torch.cuda.is_bf16_supported()`` (default ``including_emulation=True``),
    which a T4 answers True (bf16 emulated): the trial trains, and its record says the bf16 is emulated there."""
    done = trial(tmp_path, "t4")
    assert done.returncode == 0, done.stderr[-3000:]
    note = report_of(tmp_path)["extra"]["precision_note"]
    assert "T4 (sm75)" in note and "emulated" in note


# The same capability check on an A100 target passes: the meta trial of
# test_a_bf16_trainer_trial_on_an_a100_target_records_bf16_activations_and_fp32_state runs under it. On a T4
# it refuses: test_a_search_targeting_a_card_that_refuses_bf16_stops_after_the_first_trial, whose one trial
# is that command's trial process.


def test_without_oomtune_the_script_gets_transformers_own_refusal_on_this_cpu():
    """Nothing is answered outside a trial: this machine has no GPU, so transformers refuses bf16 without
    ``use_cpu`` (training_args.py), as before."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OOMTUNE_")}
    done = subprocess.run([sys.executable, str(SCRIPT), "--steps", "1"], cwd=REPO,
                          env={**env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert "Your setup doesn't support bf16/gpu" in done.stderr


# -- the search: one trial, one line, exit status 2 --------------------------------------------------------------
@pytest.mark.slow
def test_a_search_targeting_a_card_that_refuses_bf16_stops_after_the_first_trial(tmp_path, monkeypatch, capsys):
    """transformers 4.x's check (``get_device_properties(...).major < 8`` -> False) refuses bf16 on a T4: the
    trial ends there with one line naming the card and the fix, exit status 2, and the search stops after it."""
    import json

    from oomtune.cli import main

    monkeypatch.chdir(REPO)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")   # the trial's, as trial() sets it
    command = f"{sys.executable} {SCRIPT} --capability-check"
    code = main(["search", "target=cmd", f"target.command='{command}'", "device=cpu", "budget=64MiB",
                 "model.gpu=t4", "trial.timeout=300", f"hydra.run.dir={tmp_path / 'run'}"])
    assert code == 2
    out = capsys.readouterr()
    text = out.out + out.err
    assert "TrainingArguments(bf16=True) is refused on the target GPU T4 (sm75)" in text
    assert not (tmp_path / "run" / "trials" / "trial-0001").exists()
    # the trial process: exit status 2, one line on its stderr, no traceback
    first = tmp_path / "run" / "trials" / "trial-0000"
    stderr = (first / "stderr.txt").read_text()
    assert json.loads((first / "result.json").read_text())["process"]["returncode"] == 2, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.startswith("oomtune:")]
    assert len(lines) == 1
    assert "T4 (sm75)" in lines[0] and "fp16=True" in lines[0] and "model.gpu=a100" in lines[0]
    assert "Traceback" not in stderr
