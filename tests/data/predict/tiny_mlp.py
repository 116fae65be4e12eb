"""A tiny MLP entry (target=python protocol) for tests/test_predict_api.py."""

import torch
from torch import nn


def make_workload(batch_size, device):
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 16)).to(device)
    optimizer = torch.optim.Adam(model.parameters())
    x = torch.randn(batch_size, 256, device=device)
    y = torch.randint(0, 16, (batch_size,), device=device)
    return {"model": model, "optimizer": optimizer, "batches": [(x, y)]}
