"""A ``target=cmd`` training stand-in for the workers tests and ``experiments/bench_workers.py``.

Sleeps ``OOMTUNE_TEST_SLEEP_S`` seconds (default 2: "training", no CPU used), then either fails like
PyTorch does when the batch is above ``OOMTUNE_TEST_MAX_BATCH`` (default 48: torch's CUDA OOM
message on stderr, exit 1) or reports ``samples = batch, seconds = 1`` (throughput = the batch size,
so the best answer is known: the largest batch that "fits", under the default allocator since no
setting changes the throughput). Usage: ``python sleep_trial.py BATCH``.

Hold (optional): when ``OOMTUNE_TEST_HOLD_FILE`` names a file that exists once the sleep is over,
the trial prints the line :data:`HOLDING` on stdout (flushed: it is in the trial's stdout.txt at
once) and waits, neither failing nor reporting, until that file is removed. A test that must act
while a trial is still running (signal the search, stop the storage server) creates the file, waits
for a trial's HOLDING line, acts, and removes the file: no race with the trial's end, however
loaded the machine.
"""

import os
import sys
import time

#: The line a held trial prints before it waits for the hold file to go.
HOLDING = "sleep_trial: holding"

batch = int(sys.argv[1])
time.sleep(float(os.environ.get("OOMTUNE_TEST_SLEEP_S", "2")))
hold = os.environ.get("OOMTUNE_TEST_HOLD_FILE")
if hold and os.path.exists(hold):
    print(HOLDING, flush=True)
    while os.path.exists(hold):
        time.sleep(0.05)
if batch > int(os.environ.get("OOMTUNE_TEST_MAX_BATCH", "48")):
    sys.stderr.write(
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 64.00 MiB. GPU 0 has a total "
        "capacity of 15.77 GiB of which 12.00 MiB is free. Including non-PyTorch memory, this process "
        "has 15.75 GiB memory in use. Of the allocated memory 15.20 GiB is allocated by PyTorch, and "
        "300.00 MiB is reserved by PyTorch but unallocated.\n")
    sys.exit(1)
import oomtune  # noqa: E402

oomtune.report(samples=batch, seconds=1.0)
