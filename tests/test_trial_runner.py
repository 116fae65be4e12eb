"""The trial runner (oomtune.trial.runner) and the fork server, with real child processes.

Misbehaving children use the documented test hook ``OOMTUNE_TEST_HOOK`` (oomtune.trial.child):
``sleep:S``, ``signal:N``, ``raise:ValueError``, ``echo_env``. Workloads are a tiny MLP on CPU.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from oomtune.exceptions import AllocatorConfigError, ConfigError
from oomtune.trial.record import PROGRESS_FILE, TrialSpec, read_progress
from oomtune.trial.runner import TrialRunner, child_environment, group_alive, run_trial
from oomtune.units import MiB

MLP = {"name": "mlp", "in_features": 64, "hidden": 32, "layers": 1, "num_classes": 10}
HOOK = "OOMTUNE_TEST_HOOK"


def _spec(**kw) -> TrialSpec:
    base = dict(workload=MLP, batch_size=4, device="cpu", budget_bytes=64 * MiB,
                warmup_steps=1, measure_steps=2, timeout_s=120)
    base.update(kw)
    return TrialSpec(**base)


@pytest.fixture(scope="module")
def fork_runner():
    runner = TrialRunner(launcher="fork")
    assert runner.start_fork_server(), runner._server_failed
    yield runner
    runner.close()


def _pid_running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# ------------------------------------------------------------------ validation before launching
@pytest.mark.parametrize("conf", ["max_split_size_mb:", "max_split_size_mb:128,,", "roundup_power2_divisions:[256:1",
                                  "expandable_segments:true", "no_such_key:1"])
def test_invalid_alloc_string_is_rejected_before_launching(tmp_path, conf):
    with pytest.raises(AllocatorConfigError):
        run_trial(_spec(alloc_conf=conf), workdir=tmp_path)
    assert not (tmp_path / "spec.json").exists()   # nothing was written, nothing launched


@pytest.mark.parametrize("bad", [dict(batch_size=0), dict(measure_steps=0), dict(timeout_s=0),
                                 dict(device="gpu:1"), dict(budget_bytes=-1)])
def test_impossible_spec_is_a_config_error(tmp_path, bad):
    with pytest.raises(ConfigError):
        run_trial(_spec(**bad), workdir=tmp_path)


def test_unknown_launcher_is_a_config_error():
    with pytest.raises(ConfigError, match="launcher"):
        TrialRunner(launcher="thread")


def test_child_environment_sets_both_alloc_variables_and_pins_the_device(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    env = child_environment(_spec(alloc_conf="expandable_segments:True", device="cuda:1"))
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == env["PYTORCH_ALLOC_CONF"] == "expandable_segments:True"
    assert env["CUDA_VISIBLE_DEVICES"] == "5"      # torch's cuda:1 under "4,5,6" is physical 5 (C10)
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:64")
    env = child_environment(_spec(alloc_conf=""))
    assert "PYTORCH_ALLOC_CONF" not in env and "PYTORCH_CUDA_ALLOC_CONF" not in env
    with pytest.raises(ConfigError):
        child_environment(_spec(device="cuda:3"))


# ------------------------------------------------------------------ real children (spawn)
# Two settings at once (a size and a boolean), in the environment of a spawned and of a forked child
BOTH = "expandable_segments:True,max_split_size_mb:128"


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """The spawned trial of ``_spec(alloc_conf=BOTH, seed=3)`` with its environment echoed, run once for
    the tests that read it (the spawned child's record; the fork server's twin of it)."""
    spec = _spec(alloc_conf=BOTH, seed=3)
    workdir = tmp_path_factory.mktemp("spawn")
    return spec, workdir, TrialRunner(launcher="spawn").run(spec, workdir=workdir, env={HOOK: "echo_env"})


def test_spawned_cpu_trial_ok_with_settings_in_its_environment(spawned):
    _, _, r = spawned
    assert r.outcome == "ok", (r.message, r.traceback_tail)
    assert r.process.launcher == "spawn"
    assert r.memory.source == "simulated"
    assert r.throughput.samples_per_s > 0
    assert r.memory.peak_reserved_bytes >= r.memory.peak_allocated_bytes > 0
    assert r.allocator.env("PYTORCH_CUDA_ALLOC_CONF") == BOTH
    assert r.allocator.env("PYTORCH_ALLOC_CONF") == BOTH
    assert r.allocator.torch_alloc_conf == BOTH          # what torch's own parser read
    # the non-default settings in torch's keys and units (AllocatorSettings.as_mapping): MiB as an int
    assert r.settings_effective == {"expandable_segments": True, "max_split_size_mb": 128}


def test_timeout_kills_the_whole_process_group(tmp_path):
    t0 = time.monotonic()
    r = run_trial(_spec(timeout_s=2.0), workdir=tmp_path, env={HOOK: "sleep:60"})
    assert r.outcome == "timeout"
    # not the 60 s the child wanted: only the timeout's kill ends it sooner (a bound set by the hook,
    # not by how fast a loaded machine spawns and kills processes)
    assert time.monotonic() - t0 < 60
    assert not group_alive(r.process.pid)
    # A spawned child may still be importing torch at 2 s; the forked variant below (which starts in
    # milliseconds) checks that a grandchild started by the trial dies with it.


def _no_host_oom_evidence(monkeypatch) -> None:
    """The host's OOM-killer evidence (cgroup counters, kernel log) is the machine's, not the trial's:
    read as none, so that a SIGKILL the hook sends is a crash whatever else the machine's OOM killer
    did meanwhile (a loaded machine running the suite beside other jobs)."""
    from oomtune.trial.oomkill import OomKillWatch

    monkeypatch.setattr(OomKillWatch, "evidence", lambda self, pids: None)


def test_sigkill_without_evidence_is_a_crash(tmp_path, monkeypatch):
    # SIGKILL is the OOM killer's only with evidence; a kill from inside is not
    _no_host_oom_evidence(monkeypatch)
    r = run_trial(_spec(), workdir=tmp_path, env={HOOK: f"signal:{int(signal.SIGKILL)}"})
    assert r.outcome == "crash", r.message
    assert "no evidence of the OOM killer" in r.message
    assert r.process.returncode == -signal.SIGKILL


def test_value_error_is_error_with_traceback_tail(tmp_path, fork_runner):
    r = fork_runner.run(_spec(), workdir=tmp_path, env={HOOK: "raise:ValueError"})
    assert r.outcome == "error"
    assert "ValueError" in r.message
    assert "raised by the test hook" in r.traceback_tail
    assert r.process.returncode == 0                 # a record was written: the child exited 0


def test_tiny_budget_gives_a_memory_outcome_from_the_child(tmp_path, fork_runner):
    r = fork_runner.run(_spec(budget_bytes=1 * MiB), workdir=tmp_path)
    # a 1 MiB virtual GPU (fraction 1.0): the first parameter's 2 MiB small-pool segment cannot be had
    # with nothing reserved, so neither fragmentation nor a fraction cap (tests/test_trial.py, same case)
    assert r.outcome == "oom", r.message
    assert r.memory.source == "simulated"


# ------------------------------------------------------------------ fork server
def test_fork_and_spawn_agree_on_a_tiny_trial(tmp_path, fork_runner, spawned):
    spec, spawn_dir, spawned = spawned
    forked = fork_runner.run(spec, workdir=tmp_path / "fork", env={HOOK: "echo_env"})
    assert forked.process.launcher == "fork" and spawned.process.launcher == "spawn"
    assert forked.outcome == spawned.outcome == "ok"
    assert forked.memory.peak_reserved_bytes == spawned.memory.peak_reserved_bytes
    assert forked.memory.peak_allocated_bytes == spawned.memory.peak_allocated_bytes
    # the forked child set the variables itself, after the server imported torch without them
    assert forked.allocator.env("PYTORCH_CUDA_ALLOC_CONF") == BOTH
    assert forked.allocator.torch_alloc_conf == BOTH
    # both launchers leave the progress record: 1 warm-up + 2 measured steps, all done
    assert read_progress(tmp_path / "fork" / PROGRESS_FILE) == read_progress(spawn_dir / PROGRESS_FILE) == (3, 3)


def test_fork_server_is_fork_safe(fork_runner):
    info = fork_runner._server.info
    assert info["python_threads"] == 1
    assert info["cuda_initialized"] is False


def test_forked_timeout_sigkill_and_crash(tmp_path, fork_runner, monkeypatch):
    # A forked child reaches the hook (which starts the grandchild) in milliseconds, but a loaded machine
    # can stall it past a short timeout: where no grandchild.pid was written, the same trial again with a
    # longer one, rather than always waiting the longest.
    for timeout_s in (2.0, 30.0):
        workdir = tmp_path / f"t{int(timeout_s)}"
        r = fork_runner.run(_spec(timeout_s=timeout_s), workdir=workdir, env={HOOK: "sleep:60"})
        assert r.outcome == "timeout" and r.process.launcher == "fork"
        assert not group_alive(r.process.pid)
        if (workdir / "grandchild.pid").exists() and (workdir / "grandchild.pid").read_text().strip():
            break   # (the hook writes the file in two steps: a kill between them leaves it empty)
    assert not _pid_running(int((workdir / "grandchild.pid").read_text()))
    _no_host_oom_evidence(monkeypatch)
    r = fork_runner.run(_spec(), workdir=tmp_path / "k", env={HOOK: f"signal:{int(signal.SIGKILL)}"})
    assert r.outcome == "crash" and r.process.returncode == -signal.SIGKILL   # no OOM-killer evidence
    # any other signal without a record is a crash (SIGUSR1's default action terminates)
    r = fork_runner.run(_spec(), workdir=tmp_path / "u", env={HOOK: f"signal:{int(signal.SIGUSR1)}"})
    assert r.outcome == "crash" and r.process.returncode == -signal.SIGUSR1


def test_async_backend_falls_back_to_spawn(tmp_path, fork_runner, monkeypatch):
    # backend is read at import: the fork server (native) cannot serve it. Stop before launching
    # anything real: only the launcher choice is checked.
    from oomtune.alloc.settings import AllocatorSettings

    why = fork_runner._wants_fork(AllocatorSettings.parse("backend:cudaMallocAsync"))
    assert why is not None and "backend" in why
    assert fork_runner._wants_fork(AllocatorSettings.parse("expandable_segments:True")) is None


def test_fork_server_failure_falls_back_to_spawn(tmp_path, monkeypatch):
    from oomtune.trial import forkserver

    def broken_start(self, timeout_s=120.0):
        raise forkserver.ForkServerError("cannot start the fork server: simulated")

    monkeypatch.setattr(forkserver.ForkServerClient, "start", broken_start)
    runner = TrialRunner(launcher="auto")
    assert runner.start_fork_server() is False
    r = runner.run(_spec(), workdir=tmp_path)
    assert r.outcome == "ok", r.message
    assert r.process.launcher == "spawn"
    assert "simulated" in r.process.launcher_fallback
    runner.close()


# ------------------------------------------------------------------ Ctrl-C
def test_ctrl_c_handler_kills_running_trials(tmp_path):
    runner = TrialRunner(launcher="spawn")
    results = []
    worker = threading.Thread(target=lambda: results.append(
        runner.run(_spec(timeout_s=120), workdir=tmp_path, env={HOOK: "sleep:120"})))
    with runner.handle_signals():
        worker.start()
        deadline = time.monotonic() + 60
        while not (tmp_path / "grandchild.pid").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (tmp_path / "grandchild.pid").exists()
        with pytest.raises(KeyboardInterrupt):
            signal.getsignal(signal.SIGINT)(signal.SIGINT, None)   # what a Ctrl-C would run
    worker.join(timeout=30)
    assert not worker.is_alive()
    assert results[0].outcome == "error" and "interrupted" in results[0].message
    assert not group_alive(results[0].process.pid)
    assert not _pid_running(int((tmp_path / "grandchild.pid").read_text()))


# ------------------------------------------------------------------ CUDA (skipped without a GPU)
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("launcher", ["spawn", "fork"])
def test_cuda_trial_applies_the_budget_and_verifies_settings(tmp_path, launcher):
    budget = 2048 * MiB
    spec = _spec(device="cuda:0", alloc_conf="expandable_segments:True", budget_bytes=budget)
    with TrialRunner(launcher=launcher) as runner:
        r = runner.run(spec, workdir=tmp_path)
    assert r.outcome == "ok", (r.message, r.traceback_tail)
    assert r.process.launcher == launcher
    assert r.memory.source == "device"
    assert r.settings_effective["expandable_segments"] is True
    assert r.settings_effective["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert r.memory.non_allocator_bytes is not None and r.memory.non_allocator_bytes > 0   # CUDA context (C9)
    assert r.memory.peak_reserved_bytes + r.memory.non_allocator_bytes <= budget
    assert r.device.kind == "cuda" and r.device.index == 0
    if r.budget.device_peak_source == "process":   # C9: the device-level peak obeys the budget
        assert r.memory.device_peak_bytes <= budget


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_trial_over_budget_is_a_memory_outcome(tmp_path):
    # 1 GiB budget; the MLP's first layer alone (2^15 x 2^14 fp32 = 2 GiB) cannot fit.
    spec = _spec(device="cuda:0", budget_bytes=1024 * MiB,
                 workload={"name": "mlp", "in_features": 1 << 15, "hidden": 1 << 14, "layers": 1,
                           "num_classes": 10})
    r = run_trial(spec, workdir=tmp_path)
    # a real device: fraction cap or plain OOM depends on the card's size and what other processes
    # hold (the fraction is applied only when the budget is below the card), so any memory class
    assert r.outcome.is_memory, (r.outcome, r.message)


def test_a_fork_server_closed_before_its_reader_thread_runs_leaves_no_thread_error(monkeypatch, tmp_path):
    """``close()`` clears the client's process; a reader thread that had not yet run then read the
    cleared attribute and died with an AssertionError (seen as pytest's unhandled-thread warning when
    a search's start-up timed out). The reader is held here until the client has given up and closed
    the server: it must still end cleanly, at the closed pipe's end of file.

    The race is the client's alone, so the server is a stand-in that costs no CPU (the real one
    imports torch and more first, seconds of CPU for nothing here): an executable given as the
    client's ``python`` that, as a real server still importing, says nothing until its stdin ends
    (``close()`` kills a server that has not said hello: it has no trials)."""
    from oomtune.trial import forkserver

    stand_in = tmp_path / "python"
    stand_in.write_text('#!/bin/sh\ncat > /dev/null\necho \'{"ready": true, "pid": \'$$\'}\'\n')
    stand_in.chmod(0o755)

    gate, errors = threading.Event(), []
    original = forkserver.ForkServerClient._read

    def held_reader(self, *args):
        gate.wait(30)
        return original(self, *args)

    monkeypatch.setattr(forkserver.ForkServerClient, "_read", held_reader)
    monkeypatch.setattr(threading, "excepthook", lambda info: errors.append(info.exc_value))
    before = set(threading.enumerate())   # an earlier test's server may still have its reader running
    client = forkserver.ForkServerClient(str(stand_in), log_path=str(tmp_path / "server.log"))
    with pytest.raises(forkserver.ForkServerError, match="did not start within"):
        client.start(timeout_s=0.01)   # the reader is held: no hello can arrive, the client closes the server
    [reader] = [t for t in threading.enumerate() if t.name == "oomtune-forkserver-reader" and t not in before]
    gate.set()
    reader.join(30)
    assert not reader.is_alive() and errors == []
    assert client._ready.get_nowait() == {}   # the reader did read the pipe to its end (no hello: killed)


def test_a_fork_server_still_starting_is_killed_by_close_not_waited_for(tmp_path):
    # A search stopped by SIGTERM during its frontier predictions waited in close() for the server's
    # torch import to end (seconds on a loaded machine) before it could exit: a server that has not
    # said it is ready has no trials, so close() kills it at once.
    import os

    from oomtune.trial.forkserver import ForkServerClient, ForkServerError

    (tmp_path / "slow_import_mod.py").write_text("import time\ntime.sleep(3)\n")
    client = ForkServerClient(modules=("slow_import_mod",), env={**os.environ, "PYTHONPATH": str(tmp_path)},
                              cwd=str(tmp_path))

    def start():
        try:
            client.start()
        except ForkServerError:   # closed while it started: what this test does
            pass

    threading.Thread(target=start, daemon=True).start()
    while client._proc is None:
        time.sleep(0.01)
    proc = client._proc
    client.close()
    # killed while it imported, rather than left to finish the import, read the end of its input, and exit 0
    assert proc.returncode == -signal.SIGKILL


def test_a_runner_closed_while_a_thread_starts_its_fork_server_starts_none(monkeypatch):
    # Found by a new user: a search stopped during its frontier predictions left a fork server (in a
    # session of its own) importing torch for about 5 s after the search had exited. The search starts
    # the server in a thread; close() ran before that thread had made the server, found none to stop,
    # and the thread then started it. A closed runner starts no server.
    from oomtune.trial import forkserver
    from oomtune.trial.runner import TrialRunner

    runner = TrialRunner(launcher="fork")
    checking, go = threading.Event(), threading.Event()
    wants = TrialRunner._wants_fork

    def slow_check(self, settings):   # the thread is still deciding when the search closes the runner
        checking.set()
        go.wait(30)
        return wants(self, settings)

    started = []
    monkeypatch.setattr(TrialRunner, "_wants_fork", slow_check)
    monkeypatch.setattr(forkserver.ForkServerClient, "start", lambda self, timeout_s=120.0: started.append(self))
    got = []
    thread = threading.Thread(target=lambda: got.append(runner.start_fork_server()))
    thread.start()
    assert checking.wait(30)
    runner.close()
    go.set()
    thread.join(30)
    assert got == [False] and started == [] and runner._server is None


def test_a_fork_server_client_closed_before_its_start_kills_the_process_it_starts():
    # the same race one level down: close() ran before start() had a process to stop
    from oomtune.trial.forkserver import ForkServerClient, ForkServerError

    client = ForkServerClient()
    client.close()
    with pytest.raises(ForkServerError, match="closed while it started"):
        client.start()
    assert client._proc is None
