"""A fork server for trial processes: pay ``import torch`` once, fork one process per trial.

A fresh ``python -m oomtune.trial.child`` re-imports torch, torchvision and oomtune for every trial
(about 2-3 s on a small CPU). The server is a long-lived process that imported all of that but never
ran a torch operation and never touched CUDA; for each trial it forks, and the forked process sets
the trial's environment (``PYTORCH_CUDA_ALLOC_CONF``/``PYTORCH_ALLOC_CONF``,
``CUDA_VISIBLE_DEVICES``, anything else the runner passes) before any CUDA call, runs
:func:`oomtune.trial.child.main`, and leaves with ``os._exit``.

Why this is correct, and where it is not (the runner falls back to a fresh spawn):

* Allocator settings. torch reads ``backend`` when libc10_cuda loads (``import torch``); every other
  key is parsed when the allocator config is first used (``AcceleratorAllocatorConfig::instance()``,
  reached at the first CUDA allocation or ``torch._C._accelerator_getAllocatorSettings()``). Checked
  on torch 2.14.1: after ``import torch``, changing ``os.environ`` and then calling the getter
  returns the new string. The server starts with both variables unset (backend native) and never
  calls the getter, so a forked trial may set any key except ``backend``: trials with
  ``backend:cudaMallocAsync`` are spawned. The child verifies what took effect either way.
* CUDA. A process that initialised CUDA cannot use it after fork (torch marks it "bad fork"), and
  ``torch.cuda.is_available()``/``device_count()`` initialise the driver unless
  PYTORCH_NVML_BASED_CUDA_CHECK=1, while ``torch.cuda.is_initialized()`` stays False (it tracks
  torch's lazy init only): a forked child is then a bad fork although the flag says otherwise. The
  server never calls them, and refuses to fork once the CUDA driver library is mapped into it
  (``libcuda.so`` in ``/proc/self/maps``: anything that loaded it may have initialised it) or torch
  reports CUDA initialised; the runner then spawns. A trial that still fails with torch's "Cannot
  re-initialize CUDA in forked subprocess" is run again by spawn (:class:`oomtune.trial.runner.
  TrialRunner`). CUDA_VISIBLE_DEVICES is honoured because the driver is first initialised in the
  forked child.
* Threads. fork copies only the calling thread, so a lock held by another thread stays locked
  forever in the child. The server runs no torch operation, hence neither torch's intra-op pool nor
  OpenMP's exists when it forks (each trial creates its own, with torch's default thread count, as a
  spawned child would); the server uses no Python threads (checked: ``threading.active_count() ==
  1`` is reported). numpy's OpenBLAS starts its worker threads at import; OpenBLAS registers a
  ``pthread_atfork`` handler that shuts its pool down around fork, so this is safe. The native
  thread count after the imports is the baseline (``native_threads`` in the hello message); a
  launch is refused (the runner then spawns) if it ever grows, or Python threads appear.
* Where ``os.fork`` does not exist (Windows) or is unsafe (macOS system frameworks) the runner
  spawns.

Protocol (one JSON object per line): the runner writes ``{"id", "argv": [spec, result], "cwd",
"stdout", "stderr", "env"}`` to the server's stdin; the server answers ``{"id", "pid",
"cuda_initialized"}`` (or ``{"id", "error"}``) and, once the trial process has been reaped,
``{"id", "returncode"}`` (negative signal number as in :mod:`subprocess`). Each forked process calls
``setsid()`` and becomes the trial's keeper (:func:`oomtune.trial.keeper.keep`): it forks the trial's
main process, which runs :func:`oomtune.trial.child.main`, keeps every process the trial starts below
itself and exits with the main process's status; ``pid`` is the keeper's. On EOF (the runner closed
the server, or died) the server has the keepers of its live trials kill their trees (SIGHUP), waits
for them and exits; a keeper whose server dies gets SIGHUP from the kernel (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import json
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import traceback
from typing import Any

__all__ = ["serve", "ForkServerClient", "ForkedTrial", "ForkServerError", "PRELOAD_MODULES", "TRAINING_PRELOADS",
           "backend_refusal", "ALLOC_ENV_VARS"]

#: What every training loop imports on first use: torch's optimizers run ``add_param_group`` (from
#: their ``__init__``) and ``zero_grad`` under ``torch._disable_dynamo``, which imports
#: ``torch._dynamo`` on its first call (torch/_compile.py), and their ``step`` under
#: ``_use_grad_for_differentiable``, which imports it too (torch/optim/optimizer.py): about 2 CPU-s.
#: A server imports it once (it starts no thread) instead of every trial forked from it.
TRAINING_PRELOADS = ("torch._dynamo",)

#: Imported by the server before it announces itself ready (import only: nothing is executed).
PRELOAD_MODULES = (
    "torch",
    *TRAINING_PRELOADS,
    "torchvision.models",
    "oomtune.trial.child",
    "oomtune.alloc.sim",
    "oomtune.capture.virtual_gpu",
    "oomtune.workloads.loop",
    "oomtune.workloads.models",
    "oomtune.classify",
)


#: The allocator string's variables (torch reads either): no server is started with them (backend native).
ALLOC_ENV_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
_BASELINE_THREADS: list[int] = []  # native thread count once the server is ready (set in serve())


def _native_threads() -> int | None:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return None


#: True in a trial process forked from the server (read by the child's test hook ``bad_fork``).
IN_FORKED_TRIAL = False


def backend_refusal(backend: str | None) -> str | None:
    """Why a trial whose allocator string sets ``backend`` cannot be forked from a server, or None:
    torch reads ``backend`` when ``import torch`` loads libc10_cuda, and every server imported torch
    with the allocator variables unset (backend native)."""
    if backend in (None, "native"):
        return None
    return f"backend:{backend} is read at import; the fork server runs backend native"


def libcuda_loaded(maps_path: str = "/proc/self/maps") -> bool:
    """Whether the CUDA driver library (``libcuda.so``) is mapped into this process (Linux
    ``/proc/self/maps``); False where the file cannot be read."""
    try:
        with open(maps_path, "rb") as f:
            return b"libcuda.so" in f.read()
    except OSError:
        return False


def _send(out: Any, message: dict[str, Any]) -> None:
    out.write(json.dumps(message) + "\n")
    out.flush()


def _returncode(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _run_forked(request: dict[str, Any], close_fds: list[int], server_pid: int) -> None:
    """In the forked process: own session, directory and environment; become the trial's keeper,
    whose main process runs the child (:func:`oomtune.trial.keeper.keep`); never returns."""
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])  # putenv: visible to torch's getenv before CUDA starts
        import oomtune.trial.forkserver as this   # the server runs as __main__: set the importable module's flag

        this.IN_FORKED_TRIAL = True   # inherited by the keeper's main process (the trial)
        from oomtune.trial import keeper

        def main() -> None:
            if request.get("script"):   # a target=cmd script, run as ``python SCRIPT ARGS`` would
                from oomtune.trial.script_main import run_script

                code = run_script(list(request["script"]))
            else:
                from oomtune.trial import child

                code = child.main(list(request["argv"]))
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            os._exit(code)

        keeper.keep(main, grace_s=float(request.get("grace_s", 3.0)), stdout_path=request["stdout"],
                    stderr_path=request["stderr"], status_path=request.get("status"), parent_pid=server_pid,
                    close_fds=tuple(close_fds))
    except BaseException:  # noqa: BLE001 - report anything, then leave without running atexit
        traceback.print_exc()
    finally:
        os._exit(70)


def serve(modules: tuple[str, ...] | None = None) -> int:
    """Run the server loop on stdin/stdout until stdin closes. Returns the exit status (0).

    Args:
        modules: what to import before announcing readiness: None for :data:`PRELOAD_MODULES` (the
            trials of built-in and python targets); else a ``target=cmd`` script's
            (:func:`oomtune.trial.script_fork.server_modules`: ``module`` or ``module:name``), each
            imported as the script's own import statement would; one that fails is left out (the
            script then imports it itself, and fails there if it must) and the hello message lists
            those that loaded (``preloaded``). torch itself only where they name it: a script
            server of a script that never imports torch does not import it.
    """
    proto_in = sys.stdin.buffer
    proto_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # stray prints from imports or trials must not corrupt the protocol
    preloaded = _preload(PRELOAD_MODULES if modules is None else modules, strict=modules is None)

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the runner decides when trials die
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    live: dict[int, Any] = {}  # pid -> request id
    _BASELINE_THREADS.append(_native_threads() or 0)  # after imports: main + OpenBLAS workers
    _send(proto_out, {
        "ready": True, "pid": os.getpid(), "python_threads": threading.active_count(),
        "native_threads": _native_threads(), "cuda_initialized": _cuda_initialized(),
        "libcuda_loaded": libcuda_loaded(), "preloaded": preloaded,
    })
    in_fd = proto_in.fileno()
    buf = b""
    while True:
        ready, _, _ = select.select([in_fd, wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
        _reap(live, proto_out)
        if in_fd not in ready:
            continue
        chunk = os.read(in_fd, 65536)
        if not chunk:
            break
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            _launch(json.loads(line), live, proto_out, [in_fd, wake_r, wake_w, proto_out.fileno()])
    _end_live(live)
    return 0


def _preload(items: tuple[str, ...], *, strict: bool) -> list[str]:
    """Import each ``module`` or ``module:name`` (``from module import name``: the attribute, else
    the submodule); the items that loaded. ``strict``: a failure raises (the server's own modules)."""
    import importlib

    done = []
    for item in items:
        module, _, name = item.partition(":")
        try:
            mod = importlib.import_module(module)
            if name and not hasattr(mod, name):   # getattr runs a lazy module's import, as `from` does
                importlib.import_module(f"{module}.{name}")
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - a script's import may fail any way
            if strict:
                raise
            print(f"oomtune fork server: not preloaded: {item}: {type(exc).__name__}: {exc}", file=sys.stderr)
            continue
        done.append(item)
    return done


def _end_live(live: dict[int, Any], wait_s: float = 15.0) -> None:
    """Have every live trial's keeper kill its tree (SIGHUP), and reap them (at most ``wait_s``)."""
    import time

    for pid in list(live):
        try:
            os.kill(pid, signal.SIGHUP)
        except OSError:
            live.pop(pid, None)
    deadline = time.monotonic() + wait_s
    while live and time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.02)
            continue
        live.pop(pid, None)


def _cuda_initialized() -> bool:
    """``torch.cuda.is_initialized()`` where torch is imported in this process; False where it is
    not (nothing here can have initialised CUDA through torch)."""
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def _launch(request: dict[str, Any], live: dict[int, Any], out: Any, close_fds: list[int]) -> None:
    threads = _native_threads()
    if libcuda_loaded():
        _send(out, {"id": request["id"], "error": "server is no longer fork-safe: the CUDA driver library "
                    "(libcuda.so) is loaded in it, so a forked trial could not use CUDA"})
        return
    if threading.active_count() != 1 or _cuda_initialized() or (
            threads is not None and _BASELINE_THREADS and threads > _BASELINE_THREADS[0]):
        _send(out, {"id": request["id"], "error": "server is no longer fork-safe (a thread pool started "
                    "or CUDA was initialised)"})
        return
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    server_pid = os.getpid()
    try:
        pid = os.fork()
    except OSError as exc:
        _send(out, {"id": request["id"], "error": f"fork failed: {exc}"})
        return
    if pid == 0:
        _run_forked(request, close_fds, server_pid)
    live[pid] = request["id"]
    _send(out, {"id": request["id"], "pid": pid, "cuda_initialized": _cuda_initialized()})


def _reap(live: dict[int, Any], out: Any) -> None:
    while live:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if pid in live:
            _send(out, {"id": live.pop(pid), "returncode": _returncode(status)})


class ForkServerError(RuntimeError):
    """The fork server could not start, died, or refused a launch (the runner then spawns)."""


class ForkedTrial:
    """A trial forked by the server: ``pid`` is its keeper's (:mod:`oomtune.trial.keeper`), which
    exits with the trial's main process's status."""

    def __init__(self, pid: int, done: "queue.Queue[int | None]") -> None:
        self.pid = pid
        self._done = done
        self.returncode: int | None = None

    def wait(self, timeout: float | None) -> int | None:
        """Wait up to ``timeout`` seconds for the exit status; None while still running. After the
        server died the status is unknown and -SIGKILL is not assumed: returns 1 once gone."""
        if self.returncode is None:
            try:
                self.returncode = self._done.get(timeout=timeout)
            except queue.Empty:
                return None
        return self.returncode


class ForkServerClient:
    """The runner's side of the fork server: starts it, sends launches, collects exit statuses.

    Thread-safe: several threads may launch and wait at once (one reader thread dispatches the
    server's answers). The server process runs in its own session, so a Ctrl-C in the terminal
    does not reach it; :meth:`close` (or the parent's exit, which closes its stdin) stops it.
    """

    def __init__(self, python: str = sys.executable, *, log_path: str | None = None,
                 modules: tuple[str, ...] | None = None, env: dict[str, str] | None = None,
                 cwd: str | None = None) -> None:
        self.python = python
        self.log_path = log_path
        self.modules = modules   # None: the trial server (PRELOAD_MODULES); else a script's preloads
        self.env = env           # the server's environment (None: ours), less the allocator variables
        self.cwd = cwd
        self.info: dict[str, Any] = {}
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._pending: dict[int, queue.Queue] = {}
        self._next_id = 0
        self._ready: queue.Queue = queue.Queue()
        self._up = False   # the server said it is ready (its imports are done)
        self._closed = False   # close() was called: a start() under way kills what it started

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def unsafe_reason(self) -> str | None:
        """Why the started server must not fork (its hello message, or a launch's answer, said CUDA
        is initialised or the CUDA driver library is mapped into it), or None."""
        if self.info.get("cuda_initialized"):
            return "the fork server's torch has initialised CUDA"
        if self.info.get("libcuda_loaded"):
            return "the fork server has the CUDA driver library (libcuda.so) loaded"
        return None

    def start(self, timeout_s: float = 120.0) -> dict[str, Any]:
        """Start the server and wait until it has imported everything (its hello message).

        Raises:
            ForkServerError: it did not come up within ``timeout_s`` seconds.
        """
        env = {k: v for k, v in (os.environ if self.env is None else self.env).items()
               if k not in ALLOC_ENV_VARS}  # backend: native
        argv = [self.python, "-m", "oomtune.trial.forkserver"]
        if self.modules is not None:
            argv += ["--modules", ",".join(self.modules)]
        try:
            with open(self.log_path or os.devnull, "ab") as log:
                self._proc = subprocess.Popen(
                    argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env,
                    start_new_session=True, cwd=self.cwd,
                )
        except OSError as exc:
            raise ForkServerError(f"cannot start the fork server: {exc}") from None
        if self._closed:   # close() ran in another thread before the process existed (set, then read)
            proc, self._proc = self._proc, None
            if proc is not None:   # else close() took it and killed it
                proc.kill()
                proc.wait()
            raise ForkServerError("the fork server was closed while it started")
        # the reader gets the process itself: close() may clear self._proc before the thread first runs
        threading.Thread(target=self._read, args=(self._proc,), name="oomtune-forkserver-reader", daemon=True).start()
        try:
            self.info = self._ready.get(timeout=timeout_s)
        except queue.Empty:
            self.close()
            raise ForkServerError(f"fork server did not start within {timeout_s:.0f} s") from None
        if not self.info.get("ready"):
            self.close()
            raise ForkServerError("fork server exited during start-up")
        return self.info

    def launch(self, *, argv: list[str], cwd: str, stdout: str, stderr: str,
               env: dict[str, str], timeout_s: float = 30.0, grace_s: float = 3.0,
               status: str | None = None, script: list[str] | None = None) -> ForkedTrial:
        """Ask the server to fork one trial process (its keeper: ``grace_s`` between SIGTERM and
        SIGKILL, its status file ``status``; :mod:`oomtune.trial.keeper`). ``script``: the main
        process runs ``python SCRIPT ARGS`` (``[SCRIPT, *ARGS]``, or ``["-m", MODULE, *ARGS]``,
        :func:`oomtune.trial.script_main.run_script`) instead of the trial child on ``argv``.

        Raises:
            ForkServerError: the server is gone, refused (not fork-safe) or did not answer.
        """
        if not self.alive:
            raise ForkServerError("fork server is not running")
        answer: queue.Queue = queue.Queue()
        with self._lock:
            self._next_id += 1
            rid = self._next_id
            self._pending[rid] = answer
            request = {"id": rid, "argv": argv, "cwd": cwd, "stdout": stdout, "stderr": stderr, "env": env,
                       "grace_s": grace_s, "status": status, "script": script}
            try:
                self._proc.stdin.write((json.dumps(request) + "\n").encode())
                self._proc.stdin.flush()
            except OSError as exc:
                raise ForkServerError(f"fork server is gone: {exc}") from None
        try:
            first = answer.get(timeout=timeout_s)
        except queue.Empty:
            raise ForkServerError("fork server did not answer a launch") from None
        if first is None or "pid" not in first:
            self._pending.pop(rid, None)
            raise ForkServerError((first or {}).get("error", "fork server died"))
        if first.get("cuda_initialized"):
            self.info["cuda_initialized"] = True
        done: queue.Queue = queue.Queue()
        threading.Thread(target=self._relay, args=(answer, done, first["pid"]), daemon=True).start()
        return ForkedTrial(first["pid"], done)

    def _relay(self, answer: queue.Queue, done: queue.Queue, pid: int) -> None:
        message = answer.get()
        if message is None:  # server died: the status is unknown; wait until the process is gone
            while _pid_running(pid):
                threading.Event().wait(0.1)
            done.put(1)
        else:
            done.put(message["returncode"])

    def _read(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            message = json.loads(line)
            if "ready" in message:
                self._up = bool(message.get("ready"))
                self._ready.put(message)
                continue
            with self._lock:
                target = self._pending.get(message["id"])
                if "returncode" in message or "error" in message:
                    self._pending.pop(message["id"], None)
            if target is not None:
                target.put(message)
        self._ready.put({})
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
        for target in pending:
            target.put(None)

    def close(self) -> None:
        """Stop the server (closing its stdin; it kills its live trials' groups) and wait for it. A
        server still starting (importing torch: seconds) has no trials and reads its stdin only
        once started: it is killed at once (a search stopped by Ctrl-C during its frontier
        predictions waited for the import to end)."""
        self._closed = True   # before the process is read: start() checks it after setting it
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            if not self._up:
                proc.kill()
            proc.stdin.close()
            proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()


def _pid_running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (zombies are dead, only unreaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


if __name__ == "__main__":
    from oomtune.exiting import exit_now   # no teardown of the preloaded torch (oomtune.exiting)

    # ``--modules a,b:c``: a target=cmd script's server (ForkServerClient(modules=...)); the server's
    # own directory entry (``-m`` puts the cwd first on sys.path) must not shadow what the script imports
    if sys.argv[1:2] == ["--modules"]:
        if sys.path and sys.path[0] in ("", os.getcwd()):
            del sys.path[0]
        exit_now(serve(tuple(m for m in sys.argv[2].split(",") if m)))
    exit_now(serve())
