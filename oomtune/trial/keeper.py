"""The keeper: a small process between the launcher and a trial, so that every process the trial
started ends with it, and its output stays bounded.

Why a keeper. Each trial used to be killed as a process group (``killpg``), which misses a
descendant that calls ``setsid()`` (a daemonising helper, a data server) and anything left running
after the launcher itself was SIGKILLed. On Linux the keeper makes both impossible, with two
unprivileged ``prctl`` calls (Linux >= 3.4; cgroups would also do it, but writing a cgroup needs a
delegated cgroup-v2 subtree, which containers and ordinary users mostly do not have):

* ``PR_SET_CHILD_SUBREAPER`` on the keeper: a descendant orphaned anywhere below it (its parent
  died, whatever session or group it moved to) is re-parented to the keeper, never to init, so the
  keeper can always find and kill the whole tree: every process below it in ``/proc``'s parent
  links is the trial's.
* ``PR_SET_PDEATHSIG``: the keeper gets SIGHUP when its launcher dies (the search SIGKILLed, or the
  fork server gone), and the trial's main process gets SIGKILL when the keeper dies. SIGHUP makes
  the keeper kill every descendant and exit.

Lifecycle (:func:`keep`): the keeper (its own session) forks the trial's main process (its own
process group in the keeper's session; the program is ``exec``-ed, or a function runs in it when
the keeper was forked by the fork server), pumps its stdout and stderr into files (bounded, below),
and waits. Signals to the keeper are its protocol (:func:`end_kept`):

* SIGTERM: end the trial gracefully: SIGTERM to every descendant, SIGKILL to those left after
  ``grace_s`` seconds (the runner's timeout).
* SIGHUP: kill every descendant now (Ctrl-C, the launcher's death).

When the main process has exited, every descendant still running is SIGKILLed (stragglers such as
DataLoader workers, or a ``setsid()`` grandchild) and reaped; the keeper then exits with the main
process's status (the same signal, or the same exit code), so launchers read it as before. Processes
still alive after :data:`FINAL_WAIT_S` seconds of SIGKILL (uninterruptible sleep in a driver) are
named in the keeper's status file (:data:`STATUS_FILE`), and the launcher's sweep by environment
marker (:func:`sweep`) names them in one line.

Bounded output: each of stdout and stderr keeps its first :data:`HEAD_BYTES`
bytes and its last :data:`TAIL_BYTES` bytes (1 MiB + 2 MiB: a few MiB per trial whatever the trial
prints), with one line in between saying how many bytes were left out. The tail is rewritten at most
once a second while the trial runs, so a keeper killed mid-way still leaves a recent tail. Readers
take the tail by seeking (:func:`read_tail`), never reading the whole file.

Elsewhere than Linux (no ``prctl``, no ``/proc``) the keeper still bounds the output and ends the
trial's process group, but cannot reach a descendant that left the group.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import json
import os
import select
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

__all__ = ["keep", "keeper_argv", "end_kept", "kill_now", "sweep", "read_tail", "survivor_line",
           "BoundedLog", "ProcessInfo", "HEAD_BYTES", "TAIL_BYTES", "STATUS_FILE", "MARKER_ENV",
           "descendants", "subreaper_available"]

#: Bytes of a trial's stdout/stderr kept from the start of the stream.
HEAD_BYTES = 1 << 20
#: Bytes of a trial's stdout/stderr kept from the end of the stream.
TAIL_BYTES = 2 << 20
#: Written by the keeper next to the trial's output when it exits (JSON: returncode, survivors,
#: stdout/stderr byte counts).
STATUS_FILE = "keeper.json"
#: Environment variable holding a marker unique to one trial launch (inherited by every process
#: the trial starts unless it replaces its environment): how :func:`sweep` recognises leftovers.
MARKER_ENV = "OOMTUNE_TRIAL_MARKER"
#: Seconds the keeper keeps SIGKILLing and reaping the tree after the main process exited.
FINAL_WAIT_S = 5.0
#: Seconds a launcher waits for the keeper beyond the trial's grace before it escalates.
KEEPER_MARGIN_S = 10.0
_FLUSH_EVERY_S = 1.0
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_LINUX = sys.platform.startswith("linux")


# ------------------------------------------------------------------------------------- prctl
def _prctl(option: int, value: int) -> bool:
    """``prctl(option, value)``; False where unavailable (not Linux) or refused."""
    if not _LINUX:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def subreaper_available() -> bool:
    """True where :func:`keep` can keep descendants that leave the trial's process group (Linux)."""
    return _LINUX and os.path.isdir("/proc/self")


# ------------------------------------------------------------------------------- process table
@dataclass(frozen=True)
class ProcessInfo:
    """One process: its pid, its parent's pid, its state letter (``/proc/PID/stat``) and command."""

    pid: int
    ppid: int
    state: str
    command: str

    def describe(self) -> str:
        """``"pid 1234 (python train.py)"``."""
        return f"pid {self.pid} ({self.command})"


def _command(pid: int, comm: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read(4096).split(b"\0")
        text = " ".join(a.decode(errors="replace") for a in args if a)
    except OSError:
        text = ""
    text = text or comm
    return text if len(text) <= 80 else text[:77] + "..."


def _table() -> dict[int, tuple[int, str, str]]:
    """pid -> (ppid, state, comm) of every process in /proc; {} where there is no /proc."""
    out: dict[int, tuple[int, str, str]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                raw = f.read().decode(errors="replace")
        except OSError:
            continue
        head, _, rest = raw.rpartition(")")
        fields = rest.split()
        if len(fields) < 2:
            continue
        out[int(entry)] = (int(fields[1]), fields[0], head.partition("(")[2])
    return out


def descendants(pid: int) -> list[ProcessInfo]:
    """Every live (not zombie) process below ``pid`` in the parent links of /proc, breadth first."""
    table = _table()
    children: dict[int, list[int]] = {}
    for p, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(p)
    out, queue = [], list(children.get(pid, ()))
    while queue:
        p = queue.pop(0)
        ppid, state, comm = table[p]
        queue.extend(children.get(p, ()))
        if state not in ("Z", "X"):
            out.append(ProcessInfo(p, ppid, state, _command(p, comm)))
    return out


def _signal_all(procs: list[ProcessInfo], sig: int) -> None:
    for proc in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(proc.pid, sig)


def sweep(marker: str, *, wait_s: float = 2.0) -> tuple[list[ProcessInfo], list[ProcessInfo]]:
    """Kill every process whose environment holds ``MARKER_ENV=marker`` (a trial's leftovers: the
    keeper was killed, or they outlived its final wait); returns (killed, survivors): those that
    were found, and those still alive after ``wait_s`` seconds of SIGKILL.

    Reads ``/proc/PID/environ`` of the processes this user may read (Linux); elsewhere ([], []).
    """
    needle = f"{MARKER_ENV}={marker}".encode()
    found = []
    me = os.getpid()
    for pid, (ppid, state, comm) in _table().items():
        if pid == me or state in ("Z", "X"):
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if needle in env.split(b"\0"):
            found.append(ProcessInfo(pid, ppid, state, _command(pid, comm)))
    if not found:
        return [], []
    deadline = time.monotonic() + wait_s
    alive = found
    while alive:
        _signal_all(alive, signal.SIGKILL)
        table = _table()
        alive = [p for p in alive if p.pid in table and table[p.pid][1] not in ("Z", "X")]
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    return found, alive


def survivor_line(label: str, survivors: Sequence[Any]) -> str:
    """One line naming processes a trial left running: ``"trial 3 left 2 processes running
    (could not be killed): pid 12 (sleep 99), pid 13 (python w.py)"``. Each survivor is a
    :class:`ProcessInfo`, a trial record's :class:`~oomtune.trial.record.ProcessSeen` (anything with
    ``describe()``) or a ``{"pid", "command"}`` mapping."""
    names = [p.describe() if hasattr(p, "describe") else f"pid {p['pid']} ({p['command']})" for p in survivors]
    n = len(names)
    return (f"{label} left {n} process{'es' if n != 1 else ''} running (could not be killed): "
            + ", ".join(names))


# ------------------------------------------------------------------------------ bounded output
class BoundedLog:
    """A file that keeps the first ``head_bytes`` and the last ``tail_bytes`` of what is written to
    it, with one line in between saying how many bytes were left out (module docstring)."""

    def __init__(self, path: str | os.PathLike, head_bytes: int = HEAD_BYTES, tail_bytes: int = TAIL_BYTES) -> None:
        self.path = str(path)
        self.head_bytes, self.tail_bytes = head_bytes, tail_bytes
        self._f = open(self.path, "wb")
        self.total = 0           # bytes written to the log (all of the stream)
        self._head = 0           # bytes of the head in the file
        self._tail = bytearray()  # the last bytes after the head (at most 2 x tail_bytes)
        self._dirty = False
        self._flushed_at = 0.0

    def fileno(self) -> int:
        return self._f.fileno()

    def write(self, data: bytes) -> None:
        """Append ``data`` to the stream."""
        self.total += len(data)
        if self._head < self.head_bytes:
            part = data[: self.head_bytes - self._head]
            self._f.write(part)
            self._head += len(part)
            data = data[len(part):]
            if not data:
                self._f.flush()
                return
        self._tail += data
        if len(self._tail) > 2 * self.tail_bytes:
            del self._tail[: len(self._tail) - self.tail_bytes]
        self._dirty = True

    @property
    def omitted(self) -> int:
        """Bytes of the stream the file does not hold."""
        return max(0, self.total - self._head - min(len(self._tail), self.tail_bytes))

    def flush(self, *, force: bool = False) -> None:
        """Rewrite the file's tail (at most once a second unless ``force``)."""
        now = time.monotonic()
        if not self._dirty or (not force and now - self._flushed_at < _FLUSH_EVERY_S):
            return
        self._f.seek(self._head)
        omitted = self.omitted
        if omitted:
            self._f.write(f"\n[oomtune: {omitted} bytes of output left out here; the first "
                          f"{self._head} and the last {self.tail_bytes} bytes are kept]\n".encode())
        self._f.write(bytes(self._tail[-self.tail_bytes:]))
        self._f.truncate()
        self._f.flush()
        self._dirty, self._flushed_at = False, now

    def close(self) -> None:
        self.flush(force=True)
        self._f.close()


def read_tail(path: str | os.PathLike, max_bytes: int) -> str:
    """The last ``max_bytes`` bytes of a file as text (undecodable bytes replaced), read by seeking
    to the end: a file of any size costs ``max_bytes``. Missing file: ``""``."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            return f.read(max_bytes).decode(errors="replace")
    except OSError:
        return ""


# ------------------------------------------------------------------------------------ the keeper
class _Keeper:
    """State of one keeper process (see :func:`keep`)."""

    def __init__(self, grace_s: float, logs: dict[int, BoundedLog], parent_pid: int | None) -> None:
        self.grace_s = grace_s
        self.logs = logs                        # read fd -> log
        self.parent_pid = parent_pid
        self.child: int | None = None
        self.status: int | None = None          # the main process's wait status
        self.kill_at: float | None = None       # SIGKILL everything at this time (graceful end)
        self.hangup = False
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        os.set_blocking(self.wake_r, False)

    def install_signals(self) -> None:
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGTERM, self._on_term)
        signal.signal(signal.SIGHUP, self._on_hup)
        signal.signal(signal.SIGINT, signal.SIG_IGN)   # the launcher decides when the trial dies
        signal.signal(signal.SIGCHLD, lambda *_: None)

    def _on_term(self, signum: int, frame: Any) -> None:
        if self.kill_at is None:
            self.kill_at = time.monotonic() + self.grace_s
            _signal_all(self._tree(), signal.SIGTERM)
            if self.child is not None:   # not yet in /proc's table when it has just been forked
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.child, signal.SIGTERM)

    def _on_hup(self, signum: int, frame: Any) -> None:
        self.hangup = True
        self._kill_tree()

    def _tree(self) -> list[ProcessInfo]:
        return descendants(os.getpid()) if _LINUX else []

    def _kill_tree(self) -> list[ProcessInfo]:
        tree = self._tree()
        _signal_all(tree, signal.SIGKILL)
        if self.child is not None and self.status is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.child, signal.SIGKILL)   # elsewhere than Linux: the trial's group
        return tree

    def reap(self) -> None:
        """Reap every exited child (the main process, or orphans re-parented to us)."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid == self.child:
                self.status = status

    def pump(self, timeout: float) -> None:
        """Move what the trial wrote into the logs; wait at most ``timeout`` seconds."""
        fds = [self.wake_r, *self.logs]
        try:
            ready, _, _ = select.select(fds, [], [], max(0.0, timeout))
        except InterruptedError:
            return
        for fd in ready:
            if fd == self.wake_r:
                with contextlib.suppress(BlockingIOError):
                    os.read(self.wake_r, 4096)
                continue
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                continue
            if chunk:
                self.logs[fd].write(chunk)
            else:   # EOF: every writer closed it
                self.logs.pop(fd).flush(force=True)
                os.close(fd)
        for log in self.logs.values():
            log.flush()

    def run(self) -> list[ProcessInfo]:
        """Wait for the main process while pumping its output; then end the whole tree. Returns the
        processes still alive after :data:`FINAL_WAIT_S` seconds of SIGKILL."""
        while self.status is None:
            if self.parent_pid is not None and os.getppid() != self.parent_pid:
                self.hangup = True            # PDEATHSIG missed (not Linux, or a race at start)
            if self.hangup:
                self._kill_tree()
            now = time.monotonic()
            if self.kill_at is not None and now >= self.kill_at:
                self._kill_tree()
            wait = _FLUSH_EVERY_S if self.kill_at is None else min(_FLUSH_EVERY_S, max(0.01, self.kill_at - now))
            self.pump(0.05 if self.hangup else wait)
            self.reap()
        deadline = time.monotonic() + FINAL_WAIT_S
        survivors: list[ProcessInfo] = []
        while True:
            tree = self._kill_tree()
            self.reap()
            if not tree:
                break
            if time.monotonic() > deadline:
                survivors = tree
                break
            self.pump(0.02)
        drain_until = time.monotonic() + 0.5    # writers are gone: the pipes end at once
        while self.logs and time.monotonic() < drain_until:
            self.pump(0.05)
        for fd, log in list(self.logs.items()):
            log.close()
            os.close(fd)
        self.logs.clear()
        return survivors


def keep(main: Callable[[], None], *, grace_s: float, stdout_path: str, stderr_path: str,
         status_path: str | None = None, parent_pid: int | None = None,
         close_fds: tuple[int, ...] = ()) -> None:
    """Become the keeper of a trial whose main process runs ``main`` (in a forked child: ``main``
    either ``exec``s a program or runs the trial and never returns), then exit with that process's
    status. Never returns.

    Args:
        main: called in the forked main process, after its stdio is set up; must not return (it
            execs, or ends with ``os._exit``); if it returns or raises, the process exits 70.
        grace_s: seconds between SIGTERM and SIGKILL when the keeper gets SIGTERM.
        stdout_path / stderr_path: the bounded logs of the main process's stdout and stderr.
        status_path: where to write :data:`STATUS_FILE`'s JSON (None: nowhere).
        parent_pid: the launcher's pid; if it is already gone, the trial is not started.
        close_fds: descriptors of the launcher to close in the keeper (the fork server's protocol).
    """
    code = 70
    try:
        for fd in close_fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        _prctl(_PR_SET_CHILD_SUBREAPER, 1)
        _prctl(_PR_SET_PDEATHSIG, int(signal.SIGHUP))
        if parent_pid is not None and os.getppid() != parent_pid:
            os._exit(code)               # the launcher died before we armed PDEATHSIG
        logs = {}
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        logs[out_r] = BoundedLog(stdout_path)
        logs[err_r] = BoundedLog(stderr_path)
        keeper = _Keeper(grace_s, logs, parent_pid)
        keeper.install_signals()
        me = os.getpid()
        pid = os.fork()
        if pid == 0:
            _main_process(main, me, out_w, err_w, [out_r, err_r, keeper.wake_r, keeper.wake_w,
                                                   *(log.fileno() for log in logs.values())])
        keeper.child = pid
        os.close(out_w)
        os.close(err_w)
        survivors = keeper.run()
        status = keeper.status if keeper.status is not None else 0
        returncode = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        if status_path is not None:
            with contextlib.suppress(OSError):
                Path(status_path).write_text(json.dumps({
                    "returncode": returncode, "main_pid": pid, "hangup": keeper.hangup,
                    "survivors": [{"pid": p.pid, "command": p.command, "state": p.state} for p in survivors],
                }))
        _exit_like(returncode)
    except BaseException:  # noqa: BLE001 - the keeper must never run the launcher's code after fork
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def _main_process(main: Callable[[], None], keeper_pid: int, out_w: int, err_w: int, close: list[int]) -> None:
    """In the forked main process: own process group, die with the keeper, stdio to the pipes."""
    code = 70
    try:
        os.setpgid(0, 0)
        _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
        if os.getppid() != keeper_pid:
            os._exit(code)
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        for fd in {out_w, err_w, *close}:
            with contextlib.suppress(OSError):
                os.close(fd)
        main()
    except BaseException:  # noqa: BLE001
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def _exit_like(returncode: int) -> None:
    """Exit as the main process did: the same signal (no core file) or the same code."""
    if returncode >= 0:
        os._exit(returncode)
    sig = -returncode
    with contextlib.suppress(Exception):
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    with contextlib.suppress(Exception):
        signal.set_wakeup_fd(-1)
    with contextlib.suppress(Exception):   # SIGKILL and SIGSTOP keep their action: nothing to set
        signal.signal(sig, signal.SIG_DFL)
    with contextlib.suppress(Exception):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)
        time.sleep(1.0)
    os._exit(128 + sig)


# ------------------------------------------------------------------------------ launcher's side
def keeper_argv(python: str, argv: list[str], *, grace_s: float, workdir: str | os.PathLike,
                parent_pid: int | None = None) -> list[str]:
    """The command that runs ``argv`` under a keeper (``python -m oomtune.trial.keeper``), its
    output bounded into ``workdir``'s stdout.txt / stderr.txt, its status in :data:`STATUS_FILE`."""
    workdir = Path(workdir)
    return [python, "-m", "oomtune.trial.keeper", "--grace", repr(float(grace_s)),
            "--parent", str(os.getpid() if parent_pid is None else parent_pid),
            "--stdout", str(workdir / "stdout.txt"), "--stderr", str(workdir / "stderr.txt"),
            "--status", str(workdir / STATUS_FILE), "--", *argv]


def kill_now(pid: int) -> None:
    """Ask the keeper ``pid`` to kill its trial's whole tree at once (SIGHUP)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGHUP)


def end_kept(pid: int, wait: Callable[[float], int | None], grace_s: float) -> int | None:
    """End a kept trial that ran past its time: SIGTERM to the keeper (which SIGTERMs the tree and
    SIGKILLs it after ``grace_s``), then SIGHUP, then SIGKILL to the keeper itself, each after
    :data:`KEEPER_MARGIN_S` more seconds without an exit. ``wait(timeout)`` returns the exit status
    or None. Returns the keeper's exit status."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGTERM)
    status = wait(grace_s + KEEPER_MARGIN_S)
    if status is None:
        kill_now(pid)
        status = wait(KEEPER_MARGIN_S)
    if status is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
        status = wait(30.0)
    return status


def _cli(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m oomtune.trial.keeper")
    parser.add_argument("--grace", type=float, required=True)
    parser.add_argument("--parent", type=int, default=None)
    parser.add_argument("--stdout", required=True)
    parser.add_argument("--stderr", required=True)
    parser.add_argument("--status", default=None)
    parser.add_argument("argv", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not command:
        parser.error("no command to keep")

    def run() -> None:
        try:
            os.execvp(command[0], command)
        except OSError as exc:
            print(f"oomtune: cannot start {command[0]!r}: {exc.strerror or exc}", file=sys.stderr)
            os._exit(127 if exc.errno == errno.ENOENT else 126)

    keep(run, grace_s=args.grace, stdout_path=args.stdout, stderr_path=args.stderr,
         status_path=args.status, parent_pid=args.parent)


if __name__ == "__main__":
    _cli()
