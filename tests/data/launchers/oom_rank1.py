import os, signal, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.ones(4)
dist.all_reduce(t)
if rank == 1:
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.02 GiB is free. Including non-PyTorch memory, this process has 78.16 GiB memory in use. Of the allocated memory 75.20 GiB is allocated by PyTorch, and 1.47 GiB is reserved by PyTorch but unallocated.")
dist.all_reduce(t)
time.sleep(2)
