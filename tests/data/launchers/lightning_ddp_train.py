"""A ``target=cmd`` Lightning script for the distributed tests, run as users run Lightning's DDP on
CPU: ``python lightning_ddp_train.py`` with ``Trainer(accelerator="cpu", devices=2, strategy="ddp")``
(Lightning starts rank 1 itself, as a subprocess running this script again) and oomtune's one line,
``callbacks=[OomtuneCallback()]``.

The module is a small MLP (64 -> 128 -> 10, SGD) on random samples built before ``fit`` (not on the
virtual GPU); its DataLoader's micro-batch is ``self.batch_size`` (oomtune sets it).

Test knobs (arguments): ``--rank1-hold BYTES`` makes rank 1 allocate a float32 tensor of that many
bytes at its first training step and keep it (rank 1 holds more than rank 0, e.g. an uneven
shard); ``--rank1-hold-per-sample BYTES`` adds BYTES x the micro-batch to it (rank 1's excess grows
with the batch); ``--pid-dir DIR`` makes every rank write its pid to ``DIR/rank<R>.pid`` at ``setup``
(``DIR`` created when missing: a search's command may name one per trial, ``--pid-dir pids/b{batch_size}``).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import nn

from oomtune.integrations.lightning import OomtuneCallback


class MLP(pl.LightningModule):
    def __init__(self, batch_size: int = 8, rank1_hold: int = 0, pid_dir: str | None = None,
                 rank1_hold_per_sample: int = 0) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.rank1_hold = rank1_hold
        self.rank1_hold_per_sample = rank1_hold_per_sample
        self.pid_dir = pid_dir
        self.held: torch.Tensor | None = None
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(512, 64, generator=g)
        self.y = torch.randint(0, 10, (512,), generator=g)

    def setup(self, stage: str) -> None:
        if self.pid_dir:
            Path(self.pid_dir).mkdir(parents=True, exist_ok=True)
            Path(self.pid_dir, f"rank{self.global_rank}.pid").write_text(str(os.getpid()))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        hold = self.rank1_hold + self.rank1_hold_per_sample * self.batch_size
        if self.global_rank == 1 and hold and self.held is None:
            self.held = torch.ones(hold // 4)   # rank 1 only: kept until the end
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        ds = torch.utils.data.TensorDataset(self.x, self.y)
        return torch.utils.data.DataLoader(ds, batch_size=self.batch_size, shuffle=False)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank1-hold", type=int, default=0)
    parser.add_argument("--rank1-hold-per-sample", type=int, default=0)
    parser.add_argument("--pid-dir", default=None)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = MLP(rank1_hold=args.rank1_hold, pid_dir=args.pid_dir, rank1_hold_per_sample=args.rank1_hold_per_sample)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=args.steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[OomtuneCallback()])
    trainer.fit(model)
    if trainer.global_rank == 0:
        print(f"trained {trainer.global_step} optimizer steps on {trainer.world_size} ranks")


if __name__ == "__main__":
    main()
