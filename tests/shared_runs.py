"""Runs shared by several test modules, and the one-thread setting of the tests' CPU arithmetic.

A shared run is an expensive command (an ``oomtune search``) whose result several tests assert
different things on: it runs once per test session, by whichever pytest-xdist worker asks first; the
others wait for it (an exclusive lock on a file in the session's shared temporary folder) and read the
same run directory and the same captured output, as conftest.py's ``global_batch_loop_search`` does.
Import the fixture into each module that uses it: ``from shared_runs import tiny_meta_search  # noqa: F401``.

One CPU thread: tests/conftest.py sets ``OMP_NUM_THREADS=1`` for the whole session (why, measured, is
said there); :func:`one_cpu_thread` also holds it for the processes a shared run starts and
``torch.set_num_threads(1)`` in this one, whatever a test changed before (the virtual GPU's figures do
not depend on the thread count, and the tests ask of a CPU throughput only that it was measured).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
from pathlib import Path
from typing import Callable, Iterator

import pytest

REPO = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def one_cpu_thread() -> Iterator[None]:
    """``OMP_NUM_THREADS=1`` for the processes started inside, and one torch thread in this process;
    both restored on the way out."""
    import torch

    saved_env, saved_threads = os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads()
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved_threads)
        if saved_env is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved_env


class SharedRun:
    """What a shared run left: ``code`` (``oomtune.cli.main``'s exit status), ``run`` (its run
    directory), ``out`` and ``err`` (what it printed to stdout and stderr)."""

    def __init__(self, code: int, run: Path, out: str, err: str) -> None:
        self.code, self.run, self.out, self.err = code, run, out, err


def shared_run(tmp_path_factory: pytest.TempPathFactory, name: str, argv: Callable[[Path], list[str]]) -> SharedRun:
    """``oomtune.cli.main(argv(run))`` run once per session from the repository root, in
    ``<session basetemp>/<name>/run``, its stdout and stderr kept in files beside it."""
    from oomtune.cli import main

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):   # each worker's basetemp is a folder of the session's
        root = root.parent
    folder = root / name
    folder.mkdir(exist_ok=True)
    run, status = folder / "run", folder / "status.json"
    out_path, err_path = folder / "stdout.txt", folder / "stderr.txt"
    with open(folder / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not status.exists():
                cwd = os.getcwd()
                os.chdir(REPO)
                try:
                    with open(out_path, "w") as out_f, open(err_path, "w") as err_f, \
                            contextlib.redirect_stdout(out_f), contextlib.redirect_stderr(err_f), one_cpu_thread():
                        code = main(argv(run))
                except BaseException as exc:
                    status.write_text(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
                    raise
                finally:
                    os.chdir(cwd)
                status.write_text(json.dumps({"code": code}))
            done = json.loads(status.read_text())
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    if "error" in done:
        pytest.fail(f"the shared run {name!r} raised in another worker: {done['error']}")
    return SharedRun(done["code"], run, out_path.read_text(), err_path.read_text())


# ``oomtune search`` of a tiny torchvision ResNet-18 (32 x 32 images, 10 classes) on the virtual GPU at
# 192 MiB, the batch objective (auto on the virtual GPU), its trials' steps on the meta device
# (trial.execute=meta: what auto gives for this objective), a 20-step soak. Asserted on by
# tests/test_trial_execute.py::test_a_search_with_meta_trials_gives_the_answer_of_cpu_trials_and_keeps_its_guarantees
# (the smoke test, where every trial's steps ran, the spawned confirmation with its steps and soak, and the
# same answer as the CPU-trial search of the same overrides) and every test of tests/test_report_e2e.py that
# reads a search (report.html, frontier.yaml, the winner's step pickle, optuna-dashboard, headless Chromium).
TINY_META = ["model=resnet", "model.image_size=32", "model.num_classes=10", "budget=192MiB", "device=cpu",
             "search.batch_size.low=2", "search.batch_size.high=256", "trial.warmup_steps=1",
             "trial.measure_steps=1", "trial.confirm_steps=3", "trial.soak_steps=20", "trial.timeout=120"]


@pytest.fixture(scope="session")
def tiny_meta_search(tmp_path_factory) -> SharedRun:
    """The search above, with ``trial.execute=meta``."""
    return shared_run(tmp_path_factory, "tiny-meta-search",
                      lambda run: ["search", *TINY_META, "trial.execute=meta", f"hydra.run.dir={run}"])


# ``oomtune search`` of examples/train_cmd.py (hidden 1024, target=cmd) on the virtual GPU at 64 MiB, the
# whole default allocator space, batch sizes 4 to 4096. Asserted on by tests/test_recorded.py::
# test_cmd_search_predicts_and_probes_the_allocator_and_agrees_with_plan (the recordings, the predicted
# frontiers, plan's agreement), tests/test_recorded.py::
# test_the_example_scripts_recordings_derive_its_stream_at_any_batch (its recordings at 4, 8 and 16 derive
# the script's stream at 1000) and tests/test_check_recorded.py::
# test_a_cmd_search_writes_a_stream_that_check_predict_replays (best.yaml's predicted stream, replayed by
# ``oomtune check --mode predict``).
TRAIN_CMD_COMMON = ["budget=64MiB", "device=cpu", "search.batch_size.low=4", "search.batch_size.high=4096"]


def cmd_search(tmp_path_factory, name: str, command: str, overrides: list[str]) -> tuple[int, Path]:
    """(exit status, run directory) of ``oomtune search target=cmd`` of ``command`` under ``overrides``,
    run once per session under ``name`` (:func:`shared_run`)."""
    r = shared_run(tmp_path_factory, name, lambda run: ["search", "target=cmd", f"target.command='{command}'",
                                                        *overrides, f"hydra.run.dir={run}"])
    return r.code, r.run


@pytest.fixture(scope="session")
def train_cmd_search(tmp_path_factory):
    """(exit status, run directory) of the search above."""
    return cmd_search(tmp_path_factory, "train-cmd-search",
                      f"{sys.executable} examples/train_cmd.py --hidden 1024 --batch-size {{batch_size}}",
                      TRAIN_CMD_COMMON)


# The overrides of the two global-batch searches of a ``target=cmd`` script (conftest.py's
# ``global_batch_loop_search`` of examples/global_batch.py and ``lightning_example_search`` below): a global
# batch of 16 at 44 MiB, only the default allocator and expandable_segments searched, one measured step.
GLOBAL_BATCH_OVERRIDES = [
    "device=cpu", "budget=44MiB", "search.global_batch=16", "search.batch_size.low=1",
    "search.space.max_split_size_mb=[null]", "search.space.roundup_power2_divisions=[null]",
    "search.space.garbage_collection_threshold=[null]", "trial.measure_steps=1", "trial.confirm_steps=2",
    "trial.timeout=600"]


# ``oomtune search`` of examples/lightning_module.py (target=cmd) under GLOBAL_BATCH_OVERRIDES. Asserted on
# by tests/test_integrations.py::test_a_search_of_the_integration_keeps_the_global_batch
# [lightning-...] (every trial trained the global batch, on meta) and tests/test_meta_steps.py::
# test_the_lightning_example_runs_its_trial_on_meta (its recording of micro-batch 4 x 2 ran on meta).


@pytest.fixture(scope="session")
def lightning_example_search(tmp_path_factory):
    """(exit status, run directory) of the search above."""
    return cmd_search(tmp_path_factory, "lightning-example-search", f"{sys.executable} examples/lightning_module.py",
                      GLOBAL_BATCH_OVERRIDES)
