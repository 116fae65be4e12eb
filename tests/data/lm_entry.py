"""A tiny language model as a ``target=python`` entry whose sequence length varies by step (a test
fixture): it declares no lengths itself; ``target.seq_len`` does, and ``make_batch(seq_len)`` makes one
batch of that length."""

from __future__ import annotations

import torch
from torch import nn

VOCAB, D_MODEL, MAX_LEN = 256, 32, 128


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D_MODEL)
        self.pos = nn.Embedding(MAX_LEN, D_MODEL)
        self.mix = nn.Linear(D_MODEL, D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        scores = torch.softmax(h @ h.transpose(1, 2), dim=-1)    # batch x T x T: memory grows with T^2
        return self.head(torch.relu(self.mix(scores @ h)))


def make_workload(batch_size: int, device: torch.device) -> dict:
    model = TinyLM().to(device)

    def make_batch(seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(0, VOCAB, (batch_size, seq_len), device=device)
        return ids, ids

    return {"model": model, "optimizer": torch.optim.AdamW(model.parameters()), "make_batch": make_batch}
