"""A tiny workload for ``target=python``: oomtune calls ``make_workload(batch_size, device)``.

    oomtune search target=python target.entry=examples/my_workload.py:make_workload

Returns the model, its optimizer and an endless stream of ``(inputs, targets)`` batches; oomtune
runs forward, loss (cross-entropy by default, or ``loss_fn``), backward and the optimizer step.
"""

from __future__ import annotations

import torch
from torch import nn

IN_FEATURES, HIDDEN, CLASSES = 64, 128, 10


def make_workload(batch_size: int, device: torch.device) -> dict:
    """A 2-layer MLP on random features: ``batch_size`` x 64 floats -> 10 classes."""
    model = nn.Sequential(nn.Linear(IN_FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def batches():
        while True:  # endless; a DataLoader or a list works too
            x = torch.randn(batch_size, IN_FEATURES, device=device)
            y = torch.randint(0, CLASSES, (batch_size,), device=device)
            yield x, y

    return {"model": model, "optimizer": optimizer, "batches": batches(),
            "loss_fn": nn.functional.cross_entropy}
