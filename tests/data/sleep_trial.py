"""A ``target=cmd`` training stand-in for the workers tests and ``experiments/bench_workers.py``.

Sleeps ``OOMTUNE_TEST_SLEEP_S`` seconds (default 2: "training", no CPU used), then either fails like
PyTorch does when the batch is above ``OOMTUNE_TEST_MAX_BATCH`` (default 48: torch's CUDA OOM
message on stderr, exit 1) or reports ``samples = batch, seconds = 1`` (throughput = the batch size,
so the best answer is known: the largest batch that "fits", under the default allocator since no
setting changes the throughput). Usage: ``python sleep_trial.py BATCH``.
"""

import os
import sys
import time

batch = int(sys.argv[1])
time.sleep(float(os.environ.get("OOMTUNE_TEST_SLEEP_S", "2")))
if batch > int(os.environ.get("OOMTUNE_TEST_MAX_BATCH", "48")):
    sys.stderr.write(
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 64.00 MiB. GPU 0 has a total "
        "capacity of 15.77 GiB of which 12.00 MiB is free. Including non-PyTorch memory, this process "
        "has 15.75 GiB memory in use. Of the allocated memory 15.20 GiB is allocated by PyTorch, and "
        "300.00 MiB is reserved by PyTorch but unallocated.\n")
    sys.exit(1)
import oomtune  # noqa: E402

oomtune.report(samples=batch, seconds=1.0)
