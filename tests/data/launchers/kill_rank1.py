import os, signal, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.ones(4)
dist.all_reduce(t)
if rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
dist.all_reduce(t)
time.sleep(2)
