"""A Lightning script with oomtune's one added line (``callbacks=[OomtuneCallback()]``).

    python examples/lightning_module.py                             # trains on its own
    oomtune search target=cmd "target.command='python examples/lightning_module.py'" budget=128MiB

A small decoder-only language model (token and position embeddings, pre-norm transformer blocks
under a causal mask, a vocabulary head) on random token sequences. Under oomtune the callback sets
the module's ``batch_size`` (the DataLoader is built from it) and the trainer's
``accumulate_grad_batches`` as the trial asks, runs the steps on the virtual GPU when there is no
CUDA device and reports the throughput; ``activation_checkpointing`` is honoured by ``forward``.
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
from torch import nn

from oomtune.integrations.lightning import OomtuneCallback


class TinyLM(pl.LightningModule):
    """Decoder-only LM: ``layers`` ``nn.TransformerEncoderLayer`` blocks (causal), AdamW."""

    def __init__(self, *, vocab: int = 1024, d_model: int = 64, heads: int = 2, layers: int = 2,
                 seq_len: int = 64, batch_size: int = 8, samples: int = 512) -> None:
        super().__init__()
        self.batch_size = batch_size               # the DataLoader's micro-batch (oomtune sets it)
        self.activation_checkpointing = False      # recompute each block in backward when True
        self.seq_len = seq_len
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, 0.0, batch_first=True,
                                                               norm_first=True) for _ in range(layers))
        self.head = nn.Linear(d_model, vocab, bias=False)
        g = torch.Generator().manual_seed(0)
        self.data = torch.randint(0, vocab, (samples, seq_len + 1), generator=g)   # made before fit()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        h = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=idx.device, dtype=h.dtype)
        for block in self.blocks:
            if self.activation_checkpointing and self.training:
                from torch.utils.checkpoint import checkpoint

                h = checkpoint(block, h, mask, None, True, use_reentrant=False)
            else:
                h = block(h, src_mask=mask, is_causal=True)
        return self.head(h)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        x, y = batch[:, :-1], batch[:, 1:]
        logits = self(x)
        return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        # drop_last: every step trains a whole micro-batch, whatever batch size oomtune tries (up to
        # ``samples``, the default search range's 512); a short last batch would make the step's
        # requests differ from the other batch sizes' and stop the search's predictions
        return torch.utils.data.DataLoader(self.data, batch_size=self.batch_size, shuffle=True, drop_last=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = TinyLM(layers=args.layers, d_model=args.d_model, seq_len=args.seq_len, batch_size=args.batch_size)
    trainer = pl.Trainer(max_steps=args.steps, accumulate_grad_batches=args.grad_accum, accelerator="auto",
                         devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False,
                         callbacks=[OomtuneCallback()])   # the one line oomtune needs
    trainer.fit(model)
    print(f"trained {trainer.global_step} optimizer steps")


if __name__ == "__main__":
    main()
