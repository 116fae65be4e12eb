"""Two data-parallel ranks (gloo on the CPU) training with oomtune's loop helper (a test fixture for
tests/test_integrations.py): each rank builds a model, wraps it in DistributedDataParallel after
``steps`` attached the virtual GPU, and trains micro-batch x grad_accum samples per optimizer step."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from oomtune.integrations.loop import steps


def rank_main(rank: int, world: int, port: str, micro: int, accum: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(rank)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ddp = None
    for _ in steps(range(100), model=model, optimizer=optimizer):
        if ddp is None:
            ddp = nn.parallel.DistributedDataParallel(model)   # after the hook: its buckets are counted
        for _micro in range(accum):
            x, y = torch.randn(micro, 16), torch.randint(0, 4, (micro,))
            (nn.functional.cross_entropy(ddp(x), y) / accum).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    micro, accum, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    # forked, not spawned: a spawned rank imports torch again (seconds of CPU); this process has run no
    # torch op and started no thread yet, and each rank builds its group, model and virtual GPU itself
    mp.start_processes(rank_main, args=(2, port, micro, accum), nprocs=2, start_method="fork")
