"""A plain training script for ``target=cmd``; it also runs without oomtune.

    oomtune search target=cmd "target.command='python examples/train_cmd.py --batch-size {batch_size}'"

Under oomtune, ``oomtune.capture_hook`` runs it on the virtual GPU when there is no CUDA device (so
it runs out of memory where the budgeted GPU would) and ``oomtune.report`` sends the measured
throughput back; both do nothing when the script is run by hand.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

try:
    import oomtune
except ImportError:  # runs without oomtune installed
    oomtune = None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--warmup-steps", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 10)).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    if oomtune is not None:
        oomtune.capture_hook(model=model, optimizer=optimizer)

    def step() -> None:
        x = torch.randn(args.batch_size, 128, device=device)
        y = torch.randint(0, 10, (args.batch_size,), device=device)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(args.warmup_steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    print(f"{args.batch_size * args.steps / seconds:.1f} samples/s")
    if oomtune is not None:
        oomtune.report(samples=args.batch_size * args.steps, seconds=seconds, steps=args.steps)


if __name__ == "__main__":
    main()
