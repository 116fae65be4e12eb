"""A plain training loop with gradient accumulation and a fixed global batch, tuned by oomtune.

    python examples/global_batch.py --micro-batch 8 --grad-accum 4            # trains on its own
    oomtune search target=cmd search.global_batch=32 search.batch_size.low=1 budget=96MiB \
        "target.command='python examples/global_batch.py --micro-batch {batch_size} --grad-accum {grad_accum}'"

The global batch (here 32 sequences per optimizer step) decides convergence; oomtune searches the
micro-batch among its divisors, with ``grad_accum = 32 / micro-batch``, and the allocator settings.
A GPT-2-shaped model built from its config (``GPT2Config``; no weights are downloaded), tiny by
default; ``--layers 12 --d-model 768 --heads 12 --vocab 50257 --seq-len 1024`` is GPT-2 124M.
The one added line is ``steps(...)`` around the loop (:mod:`oomtune.integrations.loop`).
"""

from __future__ import annotations

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from oomtune.integrations.loop import steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--grad-accum", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--seq-len", type=int, default=64)
    # under oomtune the loop ends after the trial's steps; it must hold the longest of them, the
    # confirmation's 1 warm-up + 10 steps (trial.warmup_steps + trial.confirm_steps)
    parser.add_argument("--steps", type=int, default=11)
    parser.add_argument("--checkpointing", type=int, default=0, help="1: activation checkpointing")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    config = GPT2Config(n_layer=args.layers, n_embd=args.d_model, n_head=args.heads, vocab_size=args.vocab,
                        n_positions=args.seq_len)
    model = GPT2LMHeadModel(config).to(device)
    if args.checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    for _ in steps(range(args.steps), model=model, optimizer=optimizer):   # the one line oomtune needs
        for _micro in range(args.grad_accum):
            ids = torch.randint(0, args.vocab, (args.micro_batch, args.seq_len), device=device)
            loss = model(input_ids=ids, labels=ids).loss / args.grad_accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    print(f"global batch {args.micro_batch * args.grad_accum}: micro-batch {args.micro_batch} x {args.grad_accum}")


if __name__ == "__main__":
    main()
