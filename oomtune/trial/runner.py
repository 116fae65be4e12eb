"""Launching trial processes: validate, start, time out, clean up, read back the record.

:func:`run_trial` / :meth:`TrialRunner.run` never raise for a trial failure: every way a trial can
end (ok, out-of-memory, timeout, signal, traceback, missing record) comes back as a
:class:`TrialResult`. They raise only for bad input, before anything is launched:
:class:`oomtune.exceptions.AllocatorConfigError` for an allocator string torch would reject (a
malformed one can abort ``import torch`` with an INTERNAL ASSERT, pytorch#186453, so it must never
reach a child) and :class:`oomtune.exceptions.ConfigError` for an impossible spec.

Each trial runs under a keeper (:mod:`oomtune.trial.keeper`) in a new session: on Linux every process
the trial starts stays below the keeper (a child subreaper), even one that calls ``setsid()``, so a
timeout ends the trial *and* everything it started (DataLoader workers, daemonised helpers): SIGTERM
to the tree, then SIGKILL after a grace period; when the trial's main process exits, whatever it
left running is killed. The keeper dies with the launcher (``PR_SET_PDEATHSIG``), so a SIGKILLed
search leaves no trial behind. After each trial a sweep by an environment marker unique to the trial
(:func:`oomtune.trial.keeper.sweep`) kills anything that escaped anyway and names survivors in
``process.survivors``. The trial's stdout/stderr are kept bounded (head and tail, a few MiB) and
read back by seeking to their tail. A terminal Ctrl-C reaches only the parent;
:meth:`TrialRunner.kill_all` (installed as a SIGINT / SIGTERM handler by
:meth:`TrialRunner.handle_signals`) has the live trials' keepers kill their trees.

Launchers: ``spawn`` (a fresh interpreter, ``python -m oomtune.trial.child``), ``fork`` (forked from
:mod:`oomtune.trial.forkserver`, which has torch already imported) and ``auto`` (fork on Linux,
else spawn). Trials the fork server cannot run correctly (``backend`` other than native, which torch
reads at import) are spawned, as is everything when the server is unavailable; the launcher used is
recorded in ``process.launcher``. An own-process target (``target=cmd``) gets the runner's script
servers unless the launcher is ``spawn``: a ``python FILE.py`` command is then forked from a server
that imported the script's third-party modules once (:mod:`oomtune.trial.script_fork`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator

from oomtune.alloc.settings import AllocatorSettings
from oomtune.classify import classify_failure
from oomtune.exceptions import ConfigError
from oomtune.interrupts import pending, raise_if_pending
from oomtune.outcome import Outcome
from oomtune.trial._base import Target, get_target
from oomtune.trial.forkserver import ALLOC_ENV_VARS, ForkServerClient, ForkServerError, backend_refusal
from oomtune.trial.keeper import MARKER_ENV, STATUS_FILE, end_kept, keeper_argv, kill_now, read_tail, sweep
from oomtune.trial.oomkill import OomKillWatch
from oomtune.trial.record import (EXECUTE_MODES, MEMORY_SOURCE_DEVICE, MEMORY_SOURCE_SIMULATED, PROGRESS_FILE,
                                  BadFork, MemoryReadings, ProcessSeen, ResultDraft, TrialResult, TrialSpec)
from oomtune.trial.procwait import exited_within
from oomtune.trial.script_fork import ScriptServers

__all__ = ["run_trial", "TrialRunner", "validate_spec", "child_environment", "group_alive", "leftovers", "LAUNCHERS",
           "ALLOC_ENV_VARS", "SpawnedTrial"]

LAUNCHERS = ("auto", "fork", "spawn")
_STDERR_TAIL_CHARS = 4000
#: Bytes read from the end of a trial's stderr for the classifier (by seeking: the file may be MiBs).
_STDERR_TAIL_BYTES = 16384


def validate_spec(spec: TrialSpec) -> AllocatorSettings:
    """Check a spec before launching; returns the parsed allocator settings.

    Raises:
        AllocatorConfigError: ``spec.alloc_conf`` is malformed or rejected by torch's rules.
        ConfigError: batch size < 1, measure steps < 1, warm-up steps < 0, timeout <= 0, a negative
            budget, soak steps < 0, shapes other than data/worst, execute other than cpu/meta, ranks < 1,
            an unknown device string, or a CUDA device list whose length is not the number of ranks.
    """
    settings = AllocatorSettings.parse(spec.alloc_conf)
    checks = (
        (spec.batch_size >= 1, f"batch size must be >= 1, got {spec.batch_size}"),
        (spec.measure_steps >= 1, f"measure_steps must be >= 1, got {spec.measure_steps}"),
        (spec.warmup_steps >= 0, f"warmup_steps must be >= 0, got {spec.warmup_steps}"),
        (spec.timeout_s > 0, f"trial timeout must be > 0 s, got {spec.timeout_s}"),
        (spec.budget_bytes is None or spec.budget_bytes > 0,
         f"memory budget must be > 0 bytes, got {spec.budget_bytes}"),
        (spec.soak_steps >= 0, f"soak_steps must be >= 0, got {spec.soak_steps}"),
        (spec.shapes in ("data", "worst"), f"shapes must be 'data' or 'worst', got {spec.shapes!r}"),
        (spec.execute in EXECUTE_MODES, f"execute must be one of {', '.join(EXECUTE_MODES)}, got {spec.execute!r}"),
        (isinstance(spec.ranks, int) and spec.ranks >= 1, f"ranks must be >= 1, got {spec.ranks!r}"),
    )
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    indices = _cuda_indices(spec.device)
    if indices is not None and len(indices) != spec.ranks:
        raise ConfigError(f"device {spec.device!r} names {len(indices)} GPU(s) for {spec.ranks} rank(s): "
                          "a trial runs one rank per GPU")
    return settings


def _cuda_indices(device: str) -> list[int] | None:
    """``"cpu"`` -> None, ``"cuda"`` -> [0], ``"cuda:N"`` -> [N], ``"cuda:0,1"`` -> [0, 1] (the GPUs of
    a multi-GPU trial, visible indices); raises ConfigError otherwise."""
    if device == "cpu":
        return None
    kind, _, index = device.partition(":")
    parts = index.split(",") if index else ["0"]
    if kind != "cuda" or not all(p.isdigit() for p in parts) or len(set(parts)) != len(parts):
        raise ConfigError(f"unknown device {device!r}: expected cpu, cuda, cuda:N or cuda:N,M,...")
    return [int(p) for p in parts]


def _by_uuid(entries: list[str]) -> list[str]:
    """CUDA_VISIBLE_DEVICES entries as GPU UUIDs where NVML knows them (an integer entry is an NVML
    index, as :func:`oomtune.gpu.nvml.physical_index_for` reads it): a UUID names the same GPU
    whatever CUDA_DEVICE_ORDER is. Entries NVML cannot resolve (no NVML, a MIG or unknown entry)
    are kept as they are."""
    from oomtune.gpu import nvml

    if not any(e.isdigit() for e in entries) or not nvml.nvml_available():
        return entries
    out = []
    for entry in entries:
        info = nvml.device_identity(int(entry)) if entry.isdigit() else None
        out.append(info.uuid if info is not None and info.uuid else entry)
    return out


def child_environment(spec: TrialSpec, env: dict[str, str] | None = None) -> dict[str, str]:
    """The trial process's environment: ours, plus ``env``, plus the allocator string under both
    variable names (unset when empty) and, for ``cuda:N``, CUDA_VISIBLE_DEVICES naming only that
    device (the N-th entry of our own CUDA_VISIBLE_DEVICES when set, else N; field case C10); for
    a multi-GPU trial (``cuda:0,1``) every GPU named, in order. Entries are written as GPU UUIDs
    where NVML resolves them (:func:`_by_uuid`).

    Raises:
        ConfigError: ``cuda:N`` not visible, or PYTORCH_NO_CUDA_MEMORY_CACHING in the result
            (:mod:`oomtune.alloc.caching_env`).
    """
    out = dict(os.environ)
    out.update(env or {})
    for name in ALLOC_ENV_VARS:
        out.pop(name, None)
        if spec.alloc_conf:
            out[name] = spec.alloc_conf
    indices = _cuda_indices(spec.device)
    if indices is not None:
        visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        if "CUDA_VISIBLE_DEVICES" in os.environ and max(indices) >= len(visible):
            raise ConfigError(f"{spec.device} is not among CUDA_VISIBLE_DEVICES={visible}")
        entries = [visible[i] if visible else str(i) for i in indices]
        out["CUDA_VISIBLE_DEVICES"] = ",".join(_by_uuid(entries))
    from oomtune.alloc.caching_env import check_caching_enabled

    check_caching_enabled(out, where="the trial environment")  # caching off: settings do nothing
    return out


class SpawnedTrial:
    """A spawned keeper process (same interface as :class:`oomtune.trial.forkserver.ForkedTrial`):
    ``pid``, and ``wait(timeout)``, the exit status (negative: the signal) or None while it runs
    after ``timeout`` seconds (None: wait until it exits)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.pid = proc.pid
        self._proc = proc

    def wait(self, timeout: float | None) -> int | None:
        if timeout is not None and not exited_within(self._proc, timeout):  # no polling (procwait)
            return None
        return self._proc.wait()


#: A trial killed by :meth:`TrialRunner.kill_all` (a stop signal): its record's message and advice.
INTERRUPTED_MESSAGE = "interrupted: trial killed by the runner (kill_all)"
INTERRUPTED_ADVICE = "the run was interrupted; this trial says nothing about the configuration"


class TrialRunner:
    """Runs trials as processes and keeps track of the live ones.

    Args:
        launcher: ``"auto"`` (fork server on Linux, else spawn), ``"fork"`` or ``"spawn"``.
        python: the interpreter for spawned children and the fork server.
        grace_s: seconds between SIGTERM and SIGKILL when a trial is killed.

    Thread-safe: several threads may call :meth:`run` at once.

    Raises:
        ConfigError: an unknown launcher.
    """

    def __init__(self, *, launcher: str = "auto", python: str = sys.executable, grace_s: float = 3.0) -> None:
        if launcher not in LAUNCHERS:
            raise ConfigError(f"unknown launcher {launcher!r}: expected one of {', '.join(LAUNCHERS)}")
        self.launcher = launcher
        self.python = python
        self.grace_s = grace_s
        self._live: dict[int, Any] = {}
        self._killed: set[int] = set()   # pids killed by kill_all (interrupted, not failed)
        self._lock = threading.Lock()
        self._server: ForkServerClient | None = None
        self._server_failed: str | None = None
        self._scripts: ScriptServers | None = None   # target=cmd scripts' servers (script_fork)
        self._closed = False

    # -- launching ---------------------------------------------------------------------------
    def _wants_fork(self, settings: AllocatorSettings) -> str | None:
        """None if this trial may be forked, else why it is spawned."""
        if self.launcher == "spawn":
            return "spawn requested"
        if not hasattr(os, "fork") or (self.launcher == "auto" and not sys.platform.startswith("linux")):
            return "fork unavailable on this platform"
        return backend_refusal(settings.as_mapping().get("backend")) or self._server_failed

    def _fork_server(self) -> ForkServerClient:
        with self._lock:
            if self._server is None or not self._server.alive:
                self._server = ForkServerClient(self.python)
                if self._closed:   # close() ran meanwhile (a stop while a thread started the server)
                    self._server = None
                    raise ForkServerError("the runner is closed")
                try:
                    self._server.start()
                except ForkServerError as exc:
                    self._server, self._server_failed = None, str(exc)
                    raise
            return self._server

    def start_fork_server(self) -> bool:
        """Start the fork server now (else on the first forked trial); False if it cannot run."""
        if self._wants_fork(AllocatorSettings.parse("")) is not None:
            return False
        try:
            self._fork_server()
        except ForkServerError:
            return False
        return True

    def _launch(self, spec: TrialSpec, settings: AllocatorSettings, paths: dict[str, Path],
                env: dict[str, str]) -> tuple[Any, str, str | None]:
        argv = [str(paths["spec"]), str(paths["result"])]
        why = self._wants_fork(settings)
        if why is None:
            try:
                server = self._fork_server()
                unsafe = server.unsafe_reason()
                if unsafe:
                    raise ForkServerError(unsafe)
                handle = server.launch(argv=argv, cwd=str(paths["dir"]), stdout=str(paths["stdout"]),
                                       stderr=str(paths["stderr"]), env=env, grace_s=self.grace_s,
                                       status=str(paths["dir"] / STATUS_FILE))
                return handle, "fork", None
            except ForkServerError as exc:
                self._server_failed = why = str(exc)
        command = keeper_argv(self.python, [self.python, "-m", "oomtune.trial.child", *argv],
                              grace_s=self.grace_s, workdir=paths["dir"])
        with open(paths["dir"] / "keeper.log", "wb") as log:
            proc = subprocess.Popen(command, cwd=paths["dir"], env=env, stdin=subprocess.DEVNULL,
                                    stdout=log, stderr=log, start_new_session=True)
        return SpawnedTrial(proc), "spawn", why

    def run(self, spec: TrialSpec, *, workdir: Path, env: dict[str, str] | None = None) -> TrialResult:
        """Run one trial in its own process and return its record (see the module docstring).

        Args:
            spec: the trial.
            workdir: a directory for spec.json, result.json, stdout.txt, stderr.txt (created; the
                trial's working directory).
            env: extra environment variables for the trial, added to ours.

        No trial starts after a stop signal (:mod:`oomtune.interrupts`): one received before the
        launch is raised here (its first raise may have been dropped), and a trial whose process was
        being started when it came (after the handler's :meth:`kill_all`) is killed as soon as it is
        registered; its record says "interrupted".

        Raises:
            AllocatorConfigError, ConfigError: invalid spec (nothing was launched).
            Interrupted: a stop signal was received before the launch (nothing was launched).
        """
        raise_if_pending()   # field case: a dropped raise, and the search went on to its next trial
        settings = validate_spec(spec)
        target = get_target(spec.workload.target_name)
        if target.own_process:
            return self._run_own_process(target, spec, workdir=Path(workdir), env=env)
        marker = uuid.uuid4().hex
        env_child = child_environment(spec, {**(env or {}), MARKER_ENV: marker})
        workdir = Path(workdir).resolve()
        workdir.mkdir(parents=True, exist_ok=True)
        paths = {"dir": workdir, "spec": workdir / "spec.json", "result": workdir / "result.json",
                 "stdout": workdir / "stdout.txt", "stderr": workdir / "stderr.txt"}
        paths["result"].unlink(missing_ok=True)
        for stale in workdir.glob("result.rank*.json"):   # a previous attempt's ranks are not this one's
            stale.unlink(missing_ok=True)
        (workdir / PROGRESS_FILE).unlink(missing_ok=True)   # a previous trial's steps are not this one's
        (workdir / STATUS_FILE).unlink(missing_ok=True)
        paths["spec"].write_text(spec.to_json())
        watch = OomKillWatch()   # the OOM killer's counters before the trial (SIGKILL evidence)
        launched_at = time.time()
        try:
            handle, launcher, fallback = self._launch(spec, settings, paths, env_child)
        except OSError as exc:  # e.g. no such interpreter, too many processes
            return TrialResult(outcome=Outcome.ERROR, batch_size=spec.batch_size,
                               alloc_conf=spec.alloc_conf, message=f"could not start the trial process: {exc}",
                               advice="check the Python interpreter and process limits")
        with self._lock:
            self._live[handle.pid] = handle
        self._kill_if_stopping(handle.pid)
        try:
            returncode, timed_out = self._wait(handle, spec.timeout_s)  # from the process's start
        finally:
            if handle.wait(0) is None:   # interrupted while waiting: the keeper kills its tree
                kill_now(handle.pid)
                handle.wait(30.0)
            with self._lock:
                self._live.pop(handle.pid, None)
        result = _read_result(spec, paths, returncode, timed_out, watch, trial_pids(handle.pid, workdir / STATUS_FILE))
        if not timed_out:   # a rank the OOM killer took: the trial process wrote the record without evidence
            from oomtune.trial.rank_records import rank_oom_kill

            result = rank_oom_kill(result, watch.evidence)
        rec = ResultDraft(result)
        rec.update("process", **leftovers(marker, workdir / STATUS_FILE))
        if launcher == "fork" and handle.pid not in self._killed and _bad_fork(rec.result, paths):
            # torch refused CUDA in the forked child (the server had initialised the driver after all):
            # never fork again from this server, and run the trial afresh in a spawned process
            self._server_failed = f"a forked trial could not use CUDA ({BAD_FORK_TEXT})"
            again = self.run(spec, workdir=workdir, env=env)
            return replace(again, process=replace(again.process, bad_fork=BadFork(pid=handle.pid,
                                                                                  message=rec.result.message)))
        if handle.pid in self._killed:
            self._killed.discard(handle.pid)
            rec.set(outcome=Outcome.ERROR, message=INTERRUPTED_MESSAGE, advice=INTERRUPTED_ADVICE)
        rec.update("process", launcher=launcher, pid=handle.pid, returncode=returncode)
        if fallback and launcher == "spawn" and self.launcher != "spawn":
            rec.update("process", launcher_fallback=fallback)
        first = rec.result.process.first_step_at
        if first is not None:
            rec.update("process", launch_to_first_step_s=first - launched_at)
        if rec.result.wall_s is None:
            rec.set(wall_s=max(0.0, time.time() - launched_at))
        return rec.result

    def _run_own_process(self, target: Target, spec: TrialSpec, *, workdir: Path,
                         env: dict[str, str] | None) -> TrialResult:
        """An own-process target (``target=cmd``): its program is the trial process
        (:meth:`oomtune.trial._base.Target.run`); its group is tracked for :meth:`kill_all`."""
        started: list[int] = []

        def register(pid: int) -> None:
            started.append(pid)
            with self._lock:
                self._live[pid] = pid
            self._kill_if_stopping(pid)

        forks = None
        if self.launcher != "spawn" and hasattr(os, "fork") and (self.launcher == "fork"
                                                                 or sys.platform.startswith("linux")):
            with self._lock:
                if self._scripts is None:
                    self._scripts = ScriptServers(self.python)
                forks = self._scripts
        try:
            result = target.run(spec, workdir=workdir, env=env, grace_s=self.grace_s, on_start=register, forks=forks)
        finally:
            with self._lock:
                for pid in started:
                    self._live.pop(pid, None)
        if any(pid in self._killed for pid in started):
            self._killed.difference_update(started)
            rec = ResultDraft(result)
            rec.set(outcome=Outcome.ERROR, message=INTERRUPTED_MESSAGE, advice=INTERRUPTED_ADVICE)
            return rec.result
        return result

    def _wait(self, handle: Any, timeout_s: float) -> tuple[int | None, bool]:
        """Wait for the trial; on timeout its keeper SIGTERMs the tree, then SIGKILLs it after
        ``grace_s`` (:func:`oomtune.trial.keeper.end_kept`)."""
        returncode = handle.wait(max(0.0, timeout_s))
        if returncode is not None:
            return returncode, False
        return end_kept(handle.pid, handle.wait, self.grace_s), True

    # -- stopping ----------------------------------------------------------------------------
    def _kill_if_stopping(self, pid: int) -> None:
        """A stop signal came while the trial ``pid`` was being started: the handler's
        :meth:`kill_all` ran before it was registered, so it is killed now (else the run waits for
        a trial nobody reads, up to its timeout: a suite run's Ctrl-C test did not stop in 60 s)."""
        if pending() is not None:
            self._killed.add(pid)
            kill_now(pid)

    def kill_all(self) -> int:
        """Have the keepers of all live trials kill their trees now (safe in a signal handler).
        Returns how many."""
        live = list(self._live)  # no lock: may run in a signal handler while run() holds it
        for pid in live:
            self._killed.add(pid)
            kill_now(pid)
        return len(live)

    def close(self) -> None:
        """Kill live trials and stop the fork server, also one that another thread is starting
        (:meth:`start_fork_server`: a stop during the frontier predictions left the server importing
        torch, in a session of its own, for seconds after the search had exited)."""
        self._closed = True   # before the server is read: _fork_server checks it after setting it
        self.kill_all()
        server = self._server
        if server is not None:
            server.close()
            self._server = None
        if self._scripts is not None:
            self._scripts.close()
            self._scripts = None

    def __enter__(self) -> "TrialRunner":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextlib.contextmanager
    def handle_signals(self) -> Iterator[None]:
        """Within the block, SIGINT/SIGTERM first kill the live trials, then act as before (Ctrl-C
        still raises KeyboardInterrupt). Main thread only."""
        previous = {}

        def handler(signum: int, frame: Any) -> None:
            self.kill_all()
            old = previous[signum]
            if callable(old):
                old(signum, frame)
            elif old == signal.SIG_DFL:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)

        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, handler)
        try:
            yield
        finally:
            for sig, old in previous.items():
                signal.signal(sig, old)


def leftovers(marker: str, status_path: Path) -> dict[str, Any]:
    """What a finished trial left running: the keeper's survivors (still alive after its SIGKILLs,
    :data:`oomtune.trial.keeper.STATUS_FILE`) and the processes found by the trial's environment
    marker (:func:`oomtune.trial.keeper.sweep`: the keeper was killed, or they outlived it), killed.
    Returns :class:`~oomtune.trial.record.ProcessInfo` fields: ``leftover_processes`` (found by the
    sweep and killed) and ``survivors`` (still running: pid and command), each present only when not
    empty."""
    import json

    killed, alive = sweep(marker)
    out: dict[str, Any] = {}
    if killed:
        out["leftover_processes"] = tuple(ProcessSeen(pid=p.pid, command=p.command) for p in killed)
    survivors = {p.pid: ProcessSeen(pid=p.pid, command=p.command) for p in alive}
    with contextlib.suppress(OSError, ValueError, TypeError):
        for p in json.loads(Path(status_path).read_text()).get("survivors") or ():
            if _pid_running(int(p["pid"])):
                survivors.setdefault(int(p["pid"]), ProcessSeen(pid=int(p["pid"]), command=str(p.get("command", ""))))
    if survivors:
        out["survivors"] = tuple(survivors.values())
    return out


def trial_pids(launched_pid: int, status_path: Path) -> set[int]:
    """The pids a SIGKILL of the trial may have hit: the process the runner launched (the keeper)
    and the trial's main process as the keeper wrote it in its status file
    (:data:`oomtune.trial.keeper.STATUS_FILE`, ``main_pid``) when there is one."""
    import json

    pids = {launched_pid}
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
        pids.add(int(json.loads(Path(status_path).read_text())["main_pid"]))
    return pids


#: torch's error in a forked child of a process that initialised CUDA (torch/cuda/__init__.py _lazy_init)
BAD_FORK_TEXT = "Cannot re-initialize CUDA in forked subprocess"


def _bad_fork(result: TrialResult, paths: dict[str, Path]) -> bool:
    """Whether a forked trial failed because CUDA cannot be used after fork (:data:`BAD_FORK_TEXT` in
    its record or its stderr)."""
    if result.outcome is Outcome.OK:
        return False
    text = " ".join(filter(None, (result.message, result.traceback_tail)))
    if BAD_FORK_TEXT in text:
        return True
    return BAD_FORK_TEXT in read_tail(paths["stderr"], _STDERR_TAIL_BYTES)[-_STDERR_TAIL_CHARS:]


def _pid_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _read_result(spec: TrialSpec, paths: dict[str, Path], returncode: int | None, timed_out: bool,
                 watch: OomKillWatch | None = None, pids: set[int] | None = None) -> TrialResult:
    """The child's record, or the ranks' records merged (a distributed trial whose process left
    none: :func:`oomtune.trial.rank_records.merge_rank_files`), or a classified failure built from
    the exit status and stderr; a SIGKILL is the host OOM killer's only with ``watch``'s evidence
    (:mod:`oomtune.trial.oomkill`)."""
    try:
        result = TrialResult.read(paths["result"])
    except OSError:
        pass   # no record: the trial process died before writing one
    except (ValueError, TypeError, KeyError, AttributeError) as exc:   # written whole (atomically), but malformed
        if not timed_out:
            return _bad_record(spec, paths["result"], exc)
    else:
        if timed_out:  # the record was complete; only the exit hung (e.g. a non-daemon thread)
            result = replace(result, process=replace(result.process, hung_after_record=True))
        return result
    from oomtune.trial.rank_records import merge_rank_files

    merged = merge_rank_files(spec, paths["result"], timed_out=timed_out)
    if merged is not None:
        return merged
    stderr = read_tail(paths["stderr"], _STDERR_TAIL_BYTES)[-_STDERR_TAIL_CHARS:]
    code = returncode if returncode is not None else -signal.SIGKILL
    evidence = reason = None
    if watch is not None and pids and not timed_out and code in (-signal.SIGKILL, 128 + signal.SIGKILL):
        evidence = watch.evidence(pids)
        reason = None if evidence else watch.sources()
    cls = classify_failure(
        returncode=code, stderr=stderr, timed_out=timed_out, batch_size=spec.batch_size,
        smaller_batch_succeeded=spec.smaller_batch_succeeded, oom_kill_evidence=evidence,
        no_evidence_reason=reason,
    )
    outcome = Outcome(cls.outcome)
    if timed_out and outcome is not Outcome.TIMEOUT:
        outcome = Outcome.TIMEOUT
    requested = getattr(cls.oom, "requested_bytes", None) if cls.oom is not None else None
    result = TrialResult(
        outcome=outcome, batch_size=spec.batch_size, alloc_conf=spec.alloc_conf,
        memory=MemoryReadings(
            source=MEMORY_SOURCE_DEVICE if spec.device.startswith("cuda") else MEMORY_SOURCE_SIMULATED,
            oom_requested_bytes=requested),
        message=cls.message if not timed_out else f"trial exceeded its {spec.timeout_s:g} s limit; process group killed",
        advice=cls.advice,
    )
    if outcome in (Outcome.ERROR, Outcome.CRASH) and stderr.strip():
        result = replace(result, traceback_tail="\n".join(stderr.strip().splitlines()[-20:]))
    return result


def _bad_record(spec: TrialSpec, path: Path, exc: BaseException) -> TrialResult:
    """``bad_record``: the trial process wrote a record that cannot be read (a field of the wrong
    type, NaN, a negative count: :class:`TrialResult`'s checks), with its first line quoted."""
    from oomtune.classify import ADVICE

    try:
        text = path.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        text = ""
    quoted = text if len(text) <= 200 else text[:200] + "..."
    return TrialResult(outcome=Outcome.BAD_RECORD, batch_size=spec.batch_size, alloc_conf=spec.alloc_conf,
                       message=f"malformed result record ({path.name}): {exc}: {quoted}",
                       advice=ADVICE[Outcome.BAD_RECORD],
                       memory=MemoryReadings(source=MEMORY_SOURCE_DEVICE if spec.device.startswith("cuda")
                                             else MEMORY_SOURCE_SIMULATED))


_DEFAULT_RUNNER = TrialRunner(launcher="spawn")


def run_trial(spec: TrialSpec, *, workdir: Path, env: dict[str, str] | None = None) -> TrialResult:
    """Run one trial in a freshly spawned process (see :meth:`TrialRunner.run`); live trials of this
    function are killed by ``run_trial.kill_all()``.

    Raises:
        AllocatorConfigError, ConfigError: invalid spec (nothing was launched).
    """
    return _DEFAULT_RUNNER.run(spec, workdir=workdir, env=env)


run_trial.kill_all = _DEFAULT_RUNNER.kill_all  # type: ignore[attr-defined]


def group_alive(pgid: int) -> bool:
    """True while any non-zombie process of process group ``pgid`` exists (Linux /proc)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False
