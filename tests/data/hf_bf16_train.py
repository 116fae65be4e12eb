"""A ``target=cmd`` Hugging Face Trainer script with ``TrainingArguments(bf16=True)`` and no ``use_cpu``: what a
user who trains on an A100 writes, searched from a machine without a GPU.

The model is GPT-2-shaped and built from its config (no weights downloaded): ``--layers`` blocks of width
``--d-model``, ``--heads`` heads, a vocabulary of ``--vocab``, sequences of ``--seq-len`` random tokens, their own
labels. Without oomtune it trains ``--steps`` optimizer steps of ``--batch-size`` on this machine (bf16 on a CPU
needs ``use_cpu=True`` there: ``--use-cpu``) and prints the mean time of the steps after the first
(``step_time_s``), which experiments/compare_bf16_trial.py compares with a trial's.

Test knob: ``--capability-check`` replaces transformers' ``is_torch_bf16_gpu_available`` (before oomtune's
integration is imported) by a check that reads the compute capability, as transformers' 4.x versions did before
it asked ``torch.cuda.is_bf16_supported()`` (``torch.cuda.get_device_properties(torch.cuda.current_device()).major
< 8`` -> False): the check a card without native bf16 fails.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import torch


def capability_check() -> bool:
    """transformers 4.x's ``is_torch_bf16_gpu_available`` body (its CUDA part): a GPU of compute capability 8.0
    or more, CUDA 11 or more."""
    if not torch.cuda.is_available() or torch.version.cuda is None:
        return False
    if torch.cuda.get_device_properties(torch.cuda.current_device()).major < 8:
        return False
    return int(torch.version.cuda.split(".")[0]) >= 11


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=48)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--use-cpu", action="store_true")
    parser.add_argument("--capability-check", action="store_true")
    args = parser.parse_args()

    if args.capability_check:
        import transformers.training_args
        import transformers.utils
        import transformers.utils.import_utils

        for module in (transformers.utils.import_utils, transformers.utils, transformers.training_args):
            module.is_torch_bf16_gpu_available = capability_check

    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from oomtune.integrations.huggingface import OomtuneCallback

    class StepTimes(TrainerCallback):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_step_begin(self, a, state, control, **kwargs):
            if not self.ends:
                self.ends.append(time.perf_counter())
            return control

        def on_step_end(self, a, state, control, **kwargs):
            self.ends.append(time.perf_counter())
            return control

    torch.manual_seed(0)
    config = GPT2Config(n_layer=args.layers, n_embd=args.d_model, n_head=args.heads, vocab_size=args.vocab,
                        n_positions=args.seq_len)
    model = GPT2LMHeadModel(config)
    ids = torch.randint(0, args.vocab, (max(64, args.batch_size * (args.steps + 1)), args.seq_len),
                        generator=torch.Generator().manual_seed(0))

    class Tokens(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(ids)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"input_ids": ids[i], "labels": ids[i]}

    times = StepTimes()
    with tempfile.TemporaryDirectory() as out:
        training = TrainingArguments(output_dir=out, per_device_train_batch_size=args.batch_size,
                                     max_steps=args.steps, learning_rate=1e-4, bf16=True, use_cpu=args.use_cpu,
                                     report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True,
                                     dataloader_num_workers=0)
        trainer = Trainer(model=model, args=training, train_dataset=Tokens(), callbacks=[times, OomtuneCallback()])
        result = trainer.train()
    steps = [b - a for a, b in zip(times.ends[1:], times.ends[2:])]   # after the first (warm-up) step
    mean = sum(steps) / len(steps) if steps else float("nan")
    print(f"trained {result.global_step} optimizer steps; step_time_s {mean:.6f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
