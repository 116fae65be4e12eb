"""Session-wide test settings.

The stream cache (oomtune.plan.stream_cache) is off for every test and every process a test starts
(the environment is inherited): a plan or search in one test must capture what it asserts about,
not read what another test left, and nothing is written to the user's ~/.cache. The cache's own
tests (tests/test_stream_cache.py) point OOMTUNE_CACHE_DIR at a temporary directory.

Tests run the experiment scripts (tests/test_gpu_scripts.py) in a checkout that may have uncommitted
changes: OOMTUNE_ALLOW_DIRTY=1 lets experiments/_provenance.py write their header, marked
"(uncommitted changes: yes)"; tests/test_experiments_results.py checks the refusal without it.

A suite started in the background (``pytest ... &`` in a non-interactive shell, ``nohup``) inherits
SIGINT ignored, as does every process it starts: oomtune rightly leaves an ignored SIGINT alone
(oomtune.interrupts.stopping_on), so the tests of Ctrl-C would see a search that cannot be stopped by it.
Python's own handler is installed here, as in a terminal; each process a test starts then gets SIGINT's
default disposition at exec (a caught signal is reset, an ignored one stays ignored).

``-n auto`` (pytest-xdist) starts one worker more than the cores this process may run on
(:func:`pytest_xdist_auto_num_workers`): many tests wait on processes they started (a search, its trials, a
server), and a worker waiting leaves its core idle. Measured on the 2-core development machine, the
same tree (CHANGELOG, 2026-12-05): 2 workers kept the cores 82% busy (1428 s), 3 workers 97% (1199 s and
1258 s); experiments/bench_suite.py measures the command as it is.

One CPU thread per process (``OMP_NUM_THREADS=1``, read by torch's OpenMP pool when torch is first
imported, here and in every process a test starts): the suite's processes outnumber the cores, and an
OpenMP pool of one thread per core spends its waiting threads' time spinning. Measured on the 2-core
development machine beside the suite's other work: a plain run of examples/global_batch.py took 13.3 CPU-s
with torch's default pool and 7.1 with one thread (CHANGELOG, 2026-12-06). No figure a test asserts
depends on it: the virtual GPU's memory does not, and no test compares CPU throughputs.

Bytecode: a shell with ``PYTHONDONTWRITEBYTECODE`` set makes every process the suite starts compile
oomtune's modules again (about 0.2 CPU-s each, over a thousand processes); the variable is dropped for the
session, so Python caches them in ``__pycache__`` (ignored by git) as it does by default.

``pg``: a throwaway PostgreSQL server per test module that asks for it (tests/pg_server.py: skipped
where the OS package is missing, a failure under CI).

cuBLAS workspaces: every virtual-GPU figure holds the target GPU's two cuBLAS workspaces (8 MiB + 128 KiB
each on the default A100, one 20 MiB segment: oomtune.capture.blas_workspace), sized by
``CUBLAS_WORKSPACE_CONFIG``, which is therefore unset for the session (torch's default, whatever the
developer's shell says). ``no_cublas_workspaces`` sets ``:0:0`` (torch then allocates none) for a test whose
hand calculation is about other requests on a device of a few MiB; tests/test_non_allocator.py and
tests/test_cublas_workspaces.py check the workspaces themselves.
"""

import json
import os
import signal
import sys
from pathlib import Path

import pytest

os.environ["OOMTUNE_CACHE_DIR"] = "off"
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
os.environ["OOMTUNE_ALLOW_DIRTY"] = "1"
os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
os.environ["OMP_NUM_THREADS"] = "1"
if os.environ.pop("PYTHONDONTWRITEBYTECODE", None) is not None:
    sys.dont_write_bytecode = False


@pytest.fixture
def no_cublas_workspaces(monkeypatch):
    """``CUBLAS_WORKSPACE_CONFIG=:0:0`` for this test and the processes it starts: torch's
    ``getNewWorkspace`` asks the allocator for 0 bytes, which allocates nothing, so the virtual GPU holds
    only the step's own requests (see the module docstring)."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")


def pytest_collection_modifyitems(session, config, items):
    """Order the tests so that each xdist worker starts with long files; which tests run is unchanged.
    Seconds per file from tests/data/suite_durations.json (a run's per-file sums, written by
    ``experiments/bench_suite.py --durations``); a file not listed counts as 0.

    Why: ``--dist worksteal`` hands the workers contiguous shares of this order, equal in count
    (xdist/scheduler/worksteal.py, ``check_schedule``: ``len(pending) // nodes_remaining`` each, in
    order), each worker runs its share in order, and an idle worker takes the second half of the
    longest queue (by count). Sorting the whole list longest first gave the first worker every long
    file, and the run ended with it alone on them (the last ~40 s at 11-25% CPU). :func:`share_order`
    spreads the files over the shares instead."""
    try:
        seconds = json.loads((Path(__file__).parent / "data" / "suite_durations.json").read_text())
    except (OSError, ValueError):
        return
    workers = int(getattr(config, "workerinput", {}).get("workercount", 1))
    items[:] = share_order(items, lambda item: item.nodeid.split("::")[0], seconds, workers)


def share_order(items, file_of, seconds, workers):
    """``items`` reordered as ``workers`` contiguous shares of the sizes xdist's worksteal hands out
    (``remaining // shares_left``, in order), each file's items together and in their order: files
    are taken longest first and each goes to the share with the fewest seconds so far that has room
    (split over shares only when it does not fit whole), so every share starts with long files and
    ends with short ones (the ones another worker steals)."""
    files: dict = {}
    for item in items:
        files.setdefault(file_of(item), []).append(item)
    sizes, left = [], len(items)
    for i in range(max(1, workers)):
        sizes.append(left // (max(1, workers) - i))
        left -= sizes[-1]
    shares: list[list] = [[] for _ in sizes]
    load = [0.0] * len(sizes)
    for name in sorted(files, key=lambda f: -float(seconds.get(f, 0.0))):   # stable: collection order
        rest, each = files[name], float(seconds.get(name, 0.0)) / len(files[name])
        while rest:
            k = min((k for k in range(len(sizes)) if len(shares[k]) < sizes[k]), key=lambda k: (load[k], k))
            take = rest[:sizes[k] - len(shares[k])]
            shares[k].extend(take)
            load[k] += each * len(take)
            rest = rest[len(take):]
    return [item for share in shares for item in share]


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: the cores this process may run on, plus one (see the module docstring)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:   # not on Linux
        cores = os.cpu_count() or 1
    return cores + 1


@pytest.fixture(scope="module")
def pg():
    from pg_server import start_or_skip

    server = start_or_skip()
    yield server
    server.stop()


# ``oomtune search`` of examples/global_batch.py (target=cmd) under tests/shared_runs.py's
# GLOBAL_BATCH_OVERRIDES (a global batch of 16 at 44 MiB). Two tests assert on this same command:
# tests/test_integrations.py::test_a_search_of_the_integration_keeps_the_global_batch[loop-...] (every
# trial trained the global batch) and tests/test_recording_reuse.py::
# test_a_global_batch_search_reuses_its_recordings_as_the_baselines_probes (the recordings stand for the
# baseline's probes). The search runs once per test session, shared by the xdist workers.
GLOBAL_BATCH_LOOP_COMMAND = "{py} examples/global_batch.py --micro-batch {{batch_size}} --grad-accum {{grad_accum}}"


@pytest.fixture(scope="session")
def global_batch_loop_search(tmp_path_factory):
    """(``oomtune search``'s exit status, its run directory) for the search above, run from the
    repository root (the command's relative path) by whichever worker asks first; the others wait for
    it and read the same run (tests/shared_runs.py's ``cmd_search``). A run that raised in one worker
    fails the tests of every worker, with its error."""
    import sys

    from shared_runs import GLOBAL_BATCH_OVERRIDES, cmd_search

    return cmd_search(tmp_path_factory, "global-batch-loop-search", GLOBAL_BATCH_LOOP_COMMAND.format(py=sys.executable),
                      GLOBAL_BATCH_OVERRIDES)
