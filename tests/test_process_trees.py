"""Every process a trial starts ends with it, and a trial's output stays bounded: the keeper
(oomtune.trial.keeper) under each launcher (spawn, fork server, target=cmd).

Processes are found again by their pid and by a token unique to the test in their command line, so a
recycled pid cannot pass for a dead process. Before the keeper, a grandchild that called setsid()
survived the process-group kill, and a SIGKILLed search left its cmd trial running.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from oomtune.trial import keeper
from oomtune.trial.record import ProcessSeen, TrialSpec
from oomtune.trial.runner import TrialRunner, leftovers
from oomtune.targets.cmd import run_cmd_trial
from oomtune.units import MiB

ROOT = Path(__file__).resolve().parents[1]
PY = shlex.quote(sys.executable)
MLP = {"name": "mlp", "in_features": 64, "hidden": 32, "layers": 1, "num_classes": 10}


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _with_token(token: str) -> list[int]:
    """Live processes whose command line holds ``token``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if token.encode() in cmdline and _alive(int(entry)):
                found.append(int(entry))
    return found


def _wait_for(path: Path, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not (path.exists() and path.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert path.exists(), f"{path} never appeared"


def _gone_within(pids: list[int], token: str, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids) and not _with_token(token):
            return True
        time.sleep(0.05)
    return False


def _cmd_spec(command: str, *, timeout_s: float = 60.0) -> TrialSpec:
    return TrialSpec(workload={"name": "mlp", "target": {"name": "cmd", "command": command, "cwd": None}},
                     batch_size=4, timeout_s=timeout_s)


def _setsid_script(tmp_path: Path, token: str, *, then: str = "time.sleep(120)") -> str:
    """A command whose grandchild leaves the session (setsid) and sleeps; pids into files."""
    script = tmp_path / "tree.py"
    script.write_text(textwrap.dedent(f"""
        import os, subprocess, sys, time
        grand = subprocess.Popen([sys.executable, "-c",
                                  "import os, time; os.setsid(); time.sleep(120)  # {token}"])
        open(sys.argv[1] + ".tmp", "w").write(f"{{os.getpid()}} {{grand.pid}}")
        os.replace(sys.argv[1] + ".tmp", sys.argv[1])
        {then}
    """))
    return f"{PY} {shlex.quote(str(script))} {shlex.quote(str(tmp_path / 'pids'))}"


# ------------------------------------------------------------------ target=cmd
def test_cmd_trial_setsid_grandchild_is_gone_after_the_timeout(tmp_path):
    token = f"oomtune-test-{uuid.uuid4().hex}"
    command = _setsid_script(tmp_path, token)
    # The command starts its grandchild and writes the pids within a second, but a loaded machine can stall
    # it past a short timeout: where no pids were written, the same trial again with a longer one, rather
    # than always waiting the longest.
    for timeout_s in (3.0, 30.0):
        res = run_cmd_trial(_cmd_spec(command, timeout_s=timeout_s), workdir=tmp_path / f"t{int(timeout_s)}",
                            grace_s=1.0)
        assert res.outcome == "timeout", res.message
        if (tmp_path / "pids").exists():
            break
    main, grand = map(int, (tmp_path / "pids").read_text().split())
    # the grandchild ran in its own session: a process-group kill could not have reached it
    assert _gone_within([main, grand], token, 5.0)
    assert not res.process.survivors


def test_cmd_trial_that_exits_leaves_no_setsid_straggler(tmp_path):
    token = f"oomtune-test-{uuid.uuid4().hex}"
    cmd = _setsid_script(tmp_path, token, then="import oomtune; oomtune.report(samples=8, seconds=1.0)")
    res = run_cmd_trial(_cmd_spec(cmd), workdir=tmp_path / "t")
    assert res.outcome == "ok", res.message
    _, grand = map(int, (tmp_path / "pids").read_text().split())
    assert _gone_within([grand], token, 5.0)


# ------------------------------------------------------------------ builtin trials, both launchers
@pytest.fixture(scope="module")
def fork_runner():
    runner = TrialRunner(launcher="fork")
    assert runner.start_fork_server(), runner._server_failed
    yield runner
    runner.close()


def _spec(**kw) -> TrialSpec:
    base = dict(workload=MLP, batch_size=4, device="cpu", budget_bytes=64 * MiB, warmup_steps=1,
                measure_steps=2, timeout_s=120)
    base.update(kw)
    return TrialSpec(**base)


@pytest.mark.parametrize("launcher", ["fork", "spawn"])
def test_builtin_trial_setsid_grandchild_is_gone_after_the_timeout(tmp_path, launcher, fork_runner):
    runner = fork_runner if launcher == "fork" else TrialRunner(launcher="spawn", grace_s=1.0)
    # A spawned child imports torch first (seconds, more on a loaded machine), and a loaded machine can stall
    # even a forked one: the timeout must come after the hook started the grandchild. A short one first;
    # where the machine was too slow to reach the hook (no grandchild.pid, or the hook killed between its
    # open and its write of it), the same trial again with a longer one, rather than always waiting the longest.
    for timeout_s in (4.0, 30.0) if launcher == "fork" else (12.0, 45.0):
        workdir = tmp_path / f"t{int(timeout_s)}"
        r = runner.run(_spec(timeout_s=timeout_s), workdir=workdir, env={"OOMTUNE_TEST_HOOK": "setsid:120"})
        assert r.outcome == "timeout" and r.process.launcher == launcher
        if (workdir / "grandchild.pid").exists() and (workdir / "grandchild.pid").read_text().strip():
            break
    grand = int((workdir / "grandchild.pid").read_text())
    # the grandchild (`sleep 180`) called setsid(): a process-group kill could not reach it
    assert _gone_within([grand], f"oomtune-no-such-token-{uuid.uuid4().hex}", 5.0)


# ------------------------------------------------------------------ the keeper killed, the search killed
def test_a_sigkilled_keeper_leaves_nothing_the_sweep_does_not_kill(tmp_path):
    """The keeper itself SIGKILLed (e.g. by hand): its main process dies with it (PDEATHSIG), and
    the setsid grandchild, re-parented to init, is found by the trial's environment marker."""
    token = f"oomtune-test-{uuid.uuid4().hex}"
    started: list[int] = []

    def on_start(pid: int) -> None:
        started.append(pid)

    import threading

    results = []
    worker = threading.Thread(target=lambda: results.append(run_cmd_trial(
        _cmd_spec(_setsid_script(tmp_path, token)), workdir=tmp_path / "t", on_start=on_start)))
    worker.start()
    _wait_for(tmp_path / "pids")
    main, grand = map(int, (tmp_path / "pids").read_text().split())
    os.kill(started[0], signal.SIGKILL)
    worker.join(60)
    assert not worker.is_alive()
    res = results[0]
    assert _gone_within([main, grand], token, 5.0)
    swept = {p.pid for p in res.process.leftover_processes}
    assert grand in swept, res.process     # the sweep, not the (dead) keeper, ended it
    assert not res.process.survivors


def _search_command(tmp_path: Path, command: str) -> list[str]:
    return [sys.executable, "-m", "oomtune", "search", "target=cmd", f"target.command='{command}'",
            "device=cpu", "budget=1GiB", "search.n_trials=1", "search.batch_size.low=1",
            "search.batch_size.high=2", "trial.timeout=300", f"hydra.run.dir={tmp_path / 'run'}",
            "study_name=killed-search"]


@pytest.mark.slow
def test_sigkill_of_the_search_leaves_no_cmd_trial_running(tmp_path):
    token = f"oomtune-test-{uuid.uuid4().hex}"
    script = tmp_path / "hang.py"
    script.write_text(textwrap.dedent(f"""
        import os, subprocess, sys, time
        grand = subprocess.Popen([sys.executable, "-c",
                                  "import os, time; os.setsid(); time.sleep(300)  # {token}"])
        open(sys.argv[1] + ".tmp", "w").write(f"{{os.getpid()}} {{grand.pid}}")
        os.replace(sys.argv[1] + ".tmp", sys.argv[1])
        time.sleep(300)  # {token}
    """))
    pids = tmp_path / "pids"
    command = f"{sys.executable} {script} {pids} --bs {{batch_size}}"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OOMTUNE_CACHE_DIR="off")
    search = subprocess.Popen(_search_command(tmp_path, command), cwd=tmp_path, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not pids.exists() and time.monotonic() < deadline and search.poll() is None:
            time.sleep(0.1)
        assert pids.exists(), search.stderr.read().decode(errors="replace") if search.poll() is not None else ""
        main, grand = map(int, pids.read_text().split())
        assert _alive(main) and _alive(grand)
        os.kill(search.pid, signal.SIGKILL)
        search.wait(30)
        assert _gone_within([main, grand], token, 10.0), _with_token(token)
    finally:
        if search.poll() is None:
            search.kill()
        for pid in _with_token(token):   # never leave a test's process behind, pass or fail
            os.kill(pid, signal.SIGKILL)


# ------------------------------------------------------------------ survivors are named
def test_survivors_are_named_in_one_line(tmp_path):
    """A process the keeper reported alive after its SIGKILLs (as one in uninterruptible sleep would
    be) and still running is named, with its command, in one line."""
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        status = tmp_path / keeper.STATUS_FILE
        status.write_text('{"returncode": 0, "survivors": [{"pid": %d, "command": "sleep 30", "state": "D"}]}'
                          % sleeper.pid)
        found = leftovers(uuid.uuid4().hex, status)
        assert found == {"survivors": (ProcessSeen(pid=sleeper.pid, command="sleep 30"),)}
        line = keeper.survivor_line("trial 3", found["survivors"])
        assert line == f"trial 3 left 1 process running (could not be killed): pid {sleeper.pid} (sleep 30)"
        assert "\n" not in line
    finally:
        sleeper.kill()
        sleeper.wait()
    # once it is gone, nothing is named
    assert leftovers(uuid.uuid4().hex, status) == {}


def test_descendants_follow_parent_links_through_setsid(tmp_path):
    token = f"oomtune-test-{uuid.uuid4().hex}"
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import subprocess, sys, time
        child = subprocess.Popen(["sleep", "60"], start_new_session=True)
        # Popen returns (vfork) before the kernel has set the new program's arguments: until then
        # /proc/PID/cmdline reads empty (a suite run saw 'sleep', the name, instead of 'sleep 60')
        deadline = time.monotonic() + 30
        while not open(f"/proc/{{child.pid}}/cmdline", "rb").read() and time.monotonic() < deadline:
            time.sleep(0.01)
        print("ready", flush=True)
        time.sleep(60)  # {token}
    """)], stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline().strip() == b"ready"
        below = keeper.descendants(os.getpid())
        mine = [p for p in below if p.ppid == proc.pid]
        assert proc.pid in {p.pid for p in below}
        assert [p.command for p in mine] == ["sleep 60"]
    finally:
        for p in keeper.descendants(proc.pid):
            os.kill(p.pid, signal.SIGKILL)
        proc.kill()
        proc.wait()


# ------------------------------------------------------------------ bounded output
def test_100_mb_of_stderr_leaves_a_bounded_file_and_the_classifier_sees_the_tail(tmp_path):
    script = tmp_path / "noisy.py"
    script.write_text(textwrap.dedent("""
        import sys
        line = ("x" * 1023 + "\\n").encode()
        for _ in range(100 * 1024):            # 100 MiB of noise on stderr
            sys.stderr.buffer.write(line)
        sys.stderr.flush()
        raise RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total capacity; "
                           "14.00 GiB already allocated; 2.00 MiB free; 14.50 GiB reserved in total by PyTorch)")
    """))
    res = run_cmd_trial(_cmd_spec(f"{PY} {shlex.quote(str(script))}"), workdir=tmp_path / "t")
    size = (tmp_path / "t" / "stderr.txt").stat().st_size
    # head 1 MiB + one line + tail 2 MiB, whatever the trial wrote (100 MiB + a traceback)
    assert size <= keeper.HEAD_BYTES + keeper.TAIL_BYTES + 200, size
    assert size >= keeper.HEAD_BYTES + keeper.TAIL_BYTES
    text = keeper.read_tail(tmp_path / "t" / "stderr.txt", 4096)
    assert "CUDA out of memory" in text                       # the traceback at the very end was kept
    assert res.outcome == "oom_fragmentation", res.message    # and classified: 2 MiB free < 20 MiB <= 2 + 512
    head = (tmp_path / "t" / "stderr.txt").open("rb").read(keeper.HEAD_BYTES + 300)
    assert b"bytes of output left out here" in head[keeper.HEAD_BYTES:]


def test_bounded_log_keeps_head_and_tail_exactly(tmp_path):
    log = keeper.BoundedLog(tmp_path / "log", head_bytes=10, tail_bytes=6)
    for chunk in (b"0123456789abc", b"defgh", b"ijklmnop", b"qrstuvwxyz"):
        log.write(chunk)
    log.close()
    data = (tmp_path / "log").read_bytes()
    # 13 + 5 + 8 + 10 = 36 bytes written: head "0123456789", tail "uvwxyz", 36 - 10 - 6 = 20 left out
    assert data.startswith(b"0123456789\n[oomtune: 20 bytes of output left out here;")
    assert data.endswith(b"]\nuvwxyz")
    small = keeper.BoundedLog(tmp_path / "small", head_bytes=10, tail_bytes=6)
    small.write(b"0123456789abcdef")   # 16 = head + tail: nothing left out, no note
    small.close()
    assert (tmp_path / "small").read_bytes() == b"0123456789abcdef"


def test_read_tail_reads_only_the_end(tmp_path, monkeypatch):
    path = tmp_path / "big"
    with path.open("wb") as f:
        f.seek(50 * MiB)
        f.write(b"the end")
    reads = []
    real_open = open

    class Counting:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *a):
            self.f.close()

        def seek(self, *a):
            return self.f.seek(*a)

        def tell(self):
            return self.f.tell()

        def read(self, n=-1):
            data = self.f.read(n)
            reads.append(len(data))
            return data

    monkeypatch.setattr("builtins.open", lambda *a, **k: Counting(real_open(*a, **k)))
    assert keeper.read_tail(path, 100).endswith("the end")
    assert sum(reads) == 100        # 100 bytes read of a 50 MiB file


def test_search_progress_names_survivors_in_one_line():
    import io

    import optuna
    from rich.console import Console

    from oomtune.display import SearchProgress

    study = optuna.create_study(direction="maximize")
    result = {"outcome": "timeout", "batch_size": 8,
              "extra": {"survivors": [{"pid": 4242, "command": "python loader.py"}]}}
    study.add_trial(optuna.trial.create_trial(
        state=optuna.trial.TrialState.FAIL, params={"batch_size": 8},
        distributions={"batch_size": optuna.distributions.IntDistribution(1, 9)},
        user_attrs={"role": "search", "outcome": "timeout", "alloc_conf": "", "result": result}))
    out = io.StringIO()
    progress = SearchProgress(Console(file=out, width=200), 3)
    progress(study.trials[0], "search")
    lines = out.getvalue().splitlines()
    assert lines[-1] == "[trial 0] left 1 process running (could not be killed): pid 4242 (python loader.py)"


@pytest.mark.slow
def test_sigkill_of_a_process_running_forked_trials_leaves_none(tmp_path):
    """The fork server's path: the launcher (a process with a fork-server TrialRunner, as the search
    is) SIGKILLed while a builtin trial with a setsid grandchild runs: the server sees its stdin
    close and has the keeper kill the tree (the keeper also gets SIGHUP if the server dies)."""
    code = textwrap.dedent(f"""
        from pathlib import Path
        from oomtune.trial.record import TrialSpec
        from oomtune.trial.runner import TrialRunner
        runner = TrialRunner(launcher="fork")
        assert runner.start_fork_server()
        spec = TrialSpec(workload={MLP!r}, batch_size=4, device="cpu", budget_bytes=64 << 20,
                         warmup_steps=1, measure_steps=2, timeout_s=300)
        runner.run(spec, workdir=Path({str(tmp_path / 'trial')!r}), env={{"OOMTUNE_TEST_HOOK": "setsid:300"}})
    """)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    launcher = subprocess.Popen([sys.executable, "-c", code], env=env, start_new_session=True)
    grand_file = tmp_path / "trial" / "grandchild.pid"
    try:
        _wait_for(grand_file, 240)
        grand = int(grand_file.read_text())
        assert _alive(grand)
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(30)
        assert _gone_within([grand], f"oomtune-no-such-token-{uuid.uuid4().hex}", 15.0)
    finally:
        if launcher.poll() is None:
            launcher.kill()
