"""examples/train_cmd.py's model, optimizer and step written as a ``target=python`` entry (a test
fixture): the same layers, Adam, and a step that draws its batch inside it, so that ``oomtune plan``
of this entry predicts what a ``target=cmd`` search of examples/train_cmd.py records."""

from __future__ import annotations

import torch
from torch import nn


def make_workload(batch_size: int, device: torch.device, hidden: int = 1024) -> dict:
    model = nn.Sequential(nn.Linear(128, hidden), nn.ReLU(), nn.Linear(hidden, 10)).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step_fn(model: nn.Module, _batch: object) -> torch.Tensor:
        x = torch.randn(batch_size, 128, device=device)
        y = torch.randint(0, 10, (batch_size,), device=device)
        return nn.functional.cross_entropy(model(x), y)

    return {"model": model, "optimizer": optimizer, "batches": iter(lambda: (), None), "step_fn": step_fn}
