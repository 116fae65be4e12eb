"""A Hugging Face Trainer script with oomtune's one added line (``callbacks=[OomtuneCallback()]``).

    python examples/hf_trainer.py                                   # trains on its own (tiny GPT-2)
    oomtune search target=cmd "target.command='python examples/hf_trainer.py'" budget=256MiB \
        search.global_batch=32 search.batch_size.low=1

A GPT-2-shaped model built from its config (no weights are downloaded: ``GPT2Config`` ->
``GPT2LMHeadModel``), trained on random token sequences. The defaults are tiny so that it runs in
seconds on a CPU; ``--layers 12 --d-model 768 --heads 12 --vocab 50257 --seq-len 1024`` is GPT-2 124M.
Under oomtune the callback sets the micro-batch and gradient accumulation the trial asks for, runs
the steps on the virtual GPU when there is no CUDA device and reports the throughput.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from oomtune.integrations.huggingface import OomtuneCallback


class RandomTokens(torch.utils.data.Dataset):
    """``n`` sequences of ``seq_len`` random token ids (their own labels: language modelling)."""

    def __init__(self, n: int, seq_len: int, vocab: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, seq_len), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8, help="per-device micro-batch")
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--auto-find-batch-size", action="store_true",
                        help="the Trainer's own batch finder (accelerate's find_executable_batch_size: "
                             "x0.9 on out-of-memory)")
    args = parser.parse_args()

    torch.manual_seed(0)
    config = GPT2Config(n_layer=args.layers, n_embd=args.d_model, n_head=args.heads, vocab_size=args.vocab,
                        n_positions=args.seq_len)
    model = GPT2LMHeadModel(config)
    data = RandomTokens(args.samples, args.seq_len, args.vocab)
    # Several ranks on a machine without CUDA (torchrun on a laptop, a CPU trial with trial.gpus=2): transformers
    # joins them in DistributedDataParallel over gloo only with use_cpu=True (else each rank trains alone). One
    # process keeps the default, so that bf16=True is checked against the GPU, as on the card.
    use_cpu = not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1
    with tempfile.TemporaryDirectory() as out:
        training = TrainingArguments(
            output_dir=out, per_device_train_batch_size=args.batch_size,
            gradient_accumulation_steps=args.grad_accum, max_steps=args.steps, learning_rate=1e-4,
            bf16=args.bf16, report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True,
            dataloader_num_workers=0, auto_find_batch_size=args.auto_find_batch_size, use_cpu=use_cpu)
        trainer = Trainer(model=model, args=training, train_dataset=data,
                          callbacks=[OomtuneCallback()])   # the one line oomtune needs
        result = trainer.train()
    print(f"trained {result.global_step} optimizer steps")


if __name__ == "__main__":
    main()
