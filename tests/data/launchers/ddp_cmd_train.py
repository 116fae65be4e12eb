"""A ``target=cmd`` training script for the distributed tests, started by torchrun
(``python -m torch.distributed.run --nproc_per_node 2 --standalone ddp_cmd_train.py BATCH``): each
rank builds a small MLP, attaches oomtune's capture hook *before* wrapping it in DDP (so the
gradient buckets DDP allocates are on its virtual GPU), trains 1 warm-up + 3 measured steps on
gloo and reports its own samples. ``OOMTUNE_TEST_KILL_RANK=R`` makes rank R kill itself with SIGKILL
after the first step."""

import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import oomtune

batch = int(sys.argv[1])
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
hook = oomtune.capture_hook(model)   # before DDP: its buckets are allocated in DistributedDataParallel()
model = nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(batch, 64), torch.randint(0, 10, (batch,))


def step():
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


step()
if os.environ.get("OOMTUNE_TEST_KILL_RANK") == str(rank):
    os.kill(os.getpid(), signal.SIGKILL)
t0 = time.perf_counter()
for _ in range(3):
    step()
oomtune.report(samples=3 * batch, seconds=time.perf_counter() - t0, steps=3)
hook.stop()
dist.destroy_process_group()
