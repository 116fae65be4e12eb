"""GPT-2 124M for ``target=python``, built with Hugging Face transformers from its config (random
weights: nothing is downloaded).

    oomtune plan target=python target.entry=examples/gpt2_workload.py:make_workload budget=24GiB
    oomtune search target=python target.entry=examples/gpt2_workload.py:make_workload budget=24GiB

Needs ``pip install transformers``. Each batch is ``batch_size`` sequences of ``SEQ_LEN`` token ids
(GPT-2's context, 1024); the loss is the language-modelling cross-entropy over the vocabulary (50257).
"""

from __future__ import annotations

import torch
from torch import nn

SEQ_LEN = 1024


def make_workload(batch_size: int, device: torch.device) -> dict:
    """GPT2LMHeadModel(GPT2Config()) (12 layers, d_model 768, 12 heads: 124M parameters) with AdamW."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config()   # the 124M model: n_layer 12, n_embd 768, n_head 12, n_positions 1024
    model = GPT2LMHeadModel(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    vocab = config.vocab_size

    def batches():
        while True:
            tokens = torch.randint(0, vocab, (batch_size, SEQ_LEN), device=device)
            yield tokens, tokens

    def loss_fn(output, targets):
        logits = output.logits
        return nn.functional.cross_entropy(logits.flatten(0, -2), targets.flatten())

    return {"model": model, "optimizer": optimizer, "batches": batches(), "loss_fn": loss_fn}
