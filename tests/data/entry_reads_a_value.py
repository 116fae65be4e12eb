"""A target=python entry whose loss reads a tensor's value (``float(out.abs().max())``): no value on
meta, so its steps are captured on the CPU (tests: the fallback note, the host-memory bound)."""
import torch


def make_workload(batch_size, device):
    model = torch.nn.Linear(64, 64, device=device)

    def batches():
        while True:
            yield torch.randn(batch_size, 64, device=device), torch.randint(0, 64, (batch_size,), device=device)

    def loss_fn(out, y):
        return out.sum() * float(out.abs().max())   # data-dependent: no value on meta

    return {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1), "batches": batches(),
            "loss_fn": loss_fn}
