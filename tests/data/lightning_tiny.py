"""A LightningModule small enough to count its memory by hand (tests/test_meta_steps.py).

One bias-free ``nn.Linear(256, 256)`` (a 256 x 256 float32 weight: 262,144 bytes), the loss the sum
of its outputs, Adam; the data set is 64 rows of 256 float32 (65,536 bytes), made before ``fit``, read
in micro-batches of ``batch_size`` rows (``batch_size x 1024`` bytes each). Lightning's defaults,
less the logger, checkpointing, progress bar and model summary (they write files and print).

    python tests/data/lightning_tiny.py [--log] [--reads]

``--log`` logs the loss (``self.log(..., prog_bar=True)``): Lightning turns it into a number for the
progress bar and the logger. ``--reads`` reads the loss's value in ``training_step`` (``float(loss)``),
which a meta tensor does not have.
"""

from __future__ import annotations

import sys

import lightning.pytorch as pl
import torch
from torch import nn

from oomtune.integrations.lightning import OomtuneCallback

FEATURES = 256
ROWS = 64
READS = "--reads" in sys.argv


class Tiny(pl.LightningModule):
    def __init__(self, log_loss: bool) -> None:
        super().__init__()
        self.batch_size = 4                    # oomtune sets it
        self.log_loss = log_loss
        self.layer = nn.Linear(FEATURES, FEATURES, bias=False)
        self.data = torch.ones(ROWS, FEATURES)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.layer(batch).sum()
        if READS:
            float(loss)
        if self.log_loss:
            self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(self.data, batch_size=self.batch_size)


if __name__ == "__main__":
    torch.manual_seed(0)
    log = "--log" in sys.argv
    trainer = pl.Trainer(max_steps=4, accelerator="cpu", devices=1, logger=log, enable_checkpointing=False,
                         enable_progress_bar=log, enable_model_summary=False, callbacks=[OomtuneCallback()])
    trainer.fit(Tiny(log))
