"""Spreading ``oomtune plan``'s work over the CPU cores with forked processes.

The plan's work splits into independent pieces: the anchor captures of the affine model (one per
batch size) and the replays of each allocator configuration (:func:`oomtune.plan.feasibility.
build_plan`). :func:`fork_map` runs such pieces in the calling process and in ``workers - 1``
children forked from it (POSIX ``fork``: the children inherit the imported torch, the captured
streams and the predictor's caches copy-on-write, so nothing is imported twice and only the results
travel back, pickled through a pipe). Each process takes the next piece from a shared counter when
it is done with one. Each piece runs the same code as in one process, so the results are the same:
only where they are computed changes.

Plain ``os.fork`` rather than ``multiprocessing.Pool``: a pool forks every worker and starts three
threads, ~0.1 s per use with torch loaded against ~0.04 s here, and leaves the caller idle.

Off Linux (:func:`default_workers`), with one worker or one piece, everything runs in the calling
process.
"""

from __future__ import annotations

import os
import pickle
import sys
from collections.abc import Callable, Sequence
from typing import Any

from oomtune.interrupts import raise_if_pending

__all__ = ["default_workers", "usable_cores", "fork_map", "fork_each", "ChildFailed", "MAX_WORKERS"]

#: Processes at most, whatever the core count (each child holds a copy-on-write image of the plan).
MAX_WORKERS = 8

_in_child = False   # True in a forked child: a nested fork_map runs in that child
_active = False     # True while this process runs its share: a nested fork_map runs here
_forks_unusable = False   # True once a child could not run autograd: every later fork_map runs here

#: The start of the error torch's autograd engine raises in a child forked after the parent started
#: its device threads (torch/csrc/autograd/engine.cpp, ``forked_autograd_child`` registered by
#: ``track_bad_autograd_forks``; the text is the installed libtorch_cpu's).
BAD_AUTOGRAD_FORK = "Unable to handle autograd's threading in combination with fork-based multiprocessing"


def default_workers() -> int:
    """Processes for the plan: the CPU cores this process may run on (``os.sched_getaffinity``), at
    most :data:`MAX_WORKERS`; 1 off Linux (macOS has ``fork`` but its system libraries are not safe
    to use in a forked child of a process with threads, hence Python's ``spawn`` default there)."""
    if not sys.platform.startswith("linux"):
        return 1
    return max(1, min(usable_cores(), MAX_WORKERS))


def usable_cores() -> int:
    """The CPU cores this process may run on: ``os.sched_getaffinity`` where it exists (a container
    or ``taskset`` may allow fewer than the machine has), else ``os.cpu_count()``."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def fork_map(fn: Callable[[Any], Any], items: Sequence[Any], workers: int,
             on_result: Callable[[int, Any], None] | None = None) -> list[Any]:
    """``[fn(item) for item in items]``, computed by this process and up to ``workers - 1`` forked
    children, each taking the next item from a shared counter.

    ``fn`` and ``items`` reach the children by inheritance (no pickling, so a closure is fine); each
    result must pickle. ``on_result(index, result)`` is called here for each result as it becomes
    known here (this process's own at once, a child's when it has finished). With ``workers <= 1``,
    a single item, or inside another fork_map, everything runs here, in order.

    A child whose autograd cannot run (:data:`BAD_AUTOGRAD_FORK`: anything that started the autograd
    engine's device threads in this process before, which no torch call reports beforehand) fails
    its piece: every piece a child failed or left is computed again here, and every later call runs
    here (the same results: a piece's value does not depend on the process computing it).

    A stop signal (:mod:`oomtune.interrupts`) whose raise was dropped (in a weakref callback of a
    capture) is raised again before the next item is taken here, and before anything is returned
    (the children may have taken every item left meanwhile).

    Raises:
        Interrupted: a stop signal arrived.
        the first exception (in item order) that ``fn`` raised, here or in a child (pickled back);
        RuntimeError when a child died without a result (e.g. killed for memory).
    """
    items = list(items)
    workers = min(int(workers), len(items))
    global _active, _forks_unusable
    if workers <= 1 or _in_child or _active or _forks_unusable or not hasattr(os, "fork"):
        out = []
        for i, x in enumerate(items):
            if not _in_child:
                raise_if_pending()
            out.append(fn(x))
            if on_result is not None:
                on_result(i, out[-1])
        if not _in_child:
            raise_if_pending()
        return out
    import multiprocessing

    counter = multiprocessing.get_context("fork").Value("l", 0)   # the next item to take (shared memory)

    def take() -> int:
        with counter.get_lock():
            i = counter.value
            counter.value = i + 1
        return i

    def run_share() -> dict[int, tuple[bool, Any]]:
        done: dict[int, tuple[bool, Any]] = {}
        while True:
            if not _in_child:   # before taking: the children may take every item left while fn runs here
                raise_if_pending()   # a stop signal whose raise was dropped (a weakref callback of a capture)
            if (i := take()) >= len(items):
                break
            try:
                done[i] = (True, fn(items[i]))
            except Exception as exc:   # noqa: BLE001 - handed to the caller, in item order
                done[i] = (False, exc)
                break
            if not _in_child and on_result is not None:
                on_result(i, done[i][1])
        return done

    sys.stdout.flush()
    sys.stderr.flush()
    children: list[tuple[int, int]] = []
    _active = True
    try:
        for _ in range(workers - 1):
            read_fd, write_fd = os.pipe()
            pid = os.fork()
            if pid == 0:   # the child: compute, send, and leave without running the parent's exit code
                _child(read_fd, write_fd, run_share)
            os.close(write_fd)
            children.append((pid, read_fd))
        results = run_share()
        own = set(results)
        for pid, read_fd in children:
            with os.fdopen(read_fd, "rb") as pipe:
                data = pipe.read()
            os.waitpid(pid, 0)
            if not data:
                raise RuntimeError(f"a plan worker process (pid {pid}) ended without its results")
            results.update(pickle.loads(data))
        children = []
        raise_if_pending()   # a signal that arrived while the children's results were read
    finally:
        _active = False
        for pid, _ in children:   # an exception here: do not leave children behind
            try:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
            except OSError:
                pass
    if any(not ok and i not in own and BAD_AUTOGRAD_FORK in str(value) for i, (ok, value) in results.items()):
        _forks_unusable = True   # this process's children cannot run autograd: the pieces run here
        for i in range(len(items)):
            if i not in own and (i not in results or not results[i][0]):
                try:
                    results[i] = (True, fn(items[i]))
                except Exception as exc:   # noqa: BLE001 - handed to the caller, in item order
                    results[i] = (False, exc)
    out = []
    for i in range(len(items)):
        if i not in results:   # a process stopped at an exception before taking it
            continue
        ok, value = results[i]
        if not ok:
            raise value
        out.append(value)
        if on_result is not None and i not in own:
            on_result(i, value)
    if len(out) != len(items):
        raise RuntimeError("a plan worker process stopped early without an error")
    return out


def _one_cpu_thread() -> None:
    """In a forked worker: torch's CPU kernels on one thread. GNU OpenMP's thread pool does not
    survive ``fork``: a child forked after the parent ran a parallel CPU kernel waits forever in its
    first one (seen: a CPU-fallback capture's convolution in a plan worker); with one thread, torch's
    ``parallel_for`` runs inline and never enters an OpenMP region. The workers are the parallelism.
    Nothing happens when torch is not imported."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)


def _send(write_fd: int, done: Any, instead: Callable[[Exception], Any]) -> None:
    """Write ``done`` pickled to ``write_fd`` (a forked worker's reply to its parent); a result or
    exception that does not pickle is replaced by ``instead(the pickling error)``."""
    try:
        data = pickle.dumps(done)
    except Exception as exc:   # noqa: BLE001 - a result or exception that does not pickle
        data = pickle.dumps(instead(exc))
    with os.fdopen(write_fd, "wb") as pipe:
        pipe.write(data)


def _child(read_fd: int, write_fd: int, run_share: Callable[[], dict[int, tuple[bool, Any]]]) -> None:
    global _in_child
    _in_child = True
    code = 0
    try:
        os.close(read_fd)
        _one_cpu_thread()
        done = run_share()
        _send(write_fd, done, lambda exc: {min(done, default=0): (False, RuntimeError(f"plan worker: {exc}"))})
    except BaseException:   # noqa: BLE001 - never return into the parent's code
        code = 1
    finally:
        os._exit(code)


class ChildFailed(RuntimeError):
    """A process forked by :func:`fork_each` ended without its result: it ran past ``timeout_s``
    (``timed_out``; its process group was killed), exited (``returncode`` >= 0: ``os._exit``), or was
    killed by a signal (``returncode`` = -signal, as ``subprocess.Popen.returncode``).

    Attributes:
        item: the item the process was computing.
        returncode: as above; None when it was stopped at its timeout.
        timed_out: whether it was stopped at ``timeout_s``.
        pid: the process's id (for the OOM killer's evidence: :class:`oomtune.trial.oomkill.OomKillWatch`).
        timeout_s: the limit it ran under (seconds).
    """

    def __init__(self, item: Any, *, returncode: int | None, timed_out: bool, pid: int, timeout_s: float | None):
        self.item, self.returncode, self.timed_out, self.pid, self.timeout_s = item, returncode, timed_out, pid, timeout_s
        how = f"stopped after {timeout_s:g} s" if timed_out else f"ended with status {returncode}"
        super().__init__(f"the process computing {item!r} {how} without a result")


def fork_each(fn: Callable[[Any], Any], items: Sequence[Any], workers: int, *, timeout_s: float | None,
              on_result: Callable[[int, Any], None] | None = None) -> list[Any]:
    """``[fn(item) for item in items]``, each item computed in a process of its own, forked from this
    one (at most ``workers`` at once, at least one), so that nothing ``fn`` does (raise, hang, call
    ``os._exit``, die of a signal) can end or stop this process: isolation for the user's code, which
    :func:`fork_map` runs partly in the calling process and without a limit.

    Each process runs in a process group of its own (``os.setpgid``), so that what it starts is
    killed with it; its stdout/stderr are this process's. ``timeout_s`` (seconds, None: no limit)
    applies to each item from its fork: past it the process group gets SIGKILL. A result or exception
    travels back pickled through a pipe (an exception that does not pickle arrives as a RuntimeError
    with its text). On a failure no further item starts and the processes of later items are killed;
    the earlier items still running are waited for (each within its limit), and the failure of the
    earliest failing item is raised: items start in order, so that is the same failure whatever the
    processes' timing (the first to fail in time would change from run to run).
    ``on_result(index, result)``: called here as each result arrives.

    Raises:
        the exception ``fn`` raised for an item (``BaseException`` too: ``SystemExit`` of ``sys.exit``
        arrives as itself); :class:`ChildFailed` for a process that ended without a result or ran
        past ``timeout_s``.
    """
    import select
    import signal
    import time

    items = list(items)
    workers = max(1, min(int(workers), len(items)))
    results: dict[int, Any] = {}
    running: dict[int, tuple[int, int, float | None, bytearray]] = {}   # read fd -> (index, pid, deadline, data)
    queue = list(range(len(items)))
    sys.stdout.flush()
    sys.stderr.flush()

    def start(i: int) -> None:
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:
            _each_child(read_fd, write_fd, fn, items[i])
        os.close(write_fd)
        try:
            os.setpgid(pid, pid)   # also here: no window in which a kill of the group misses it
        except OSError:
            pass
        deadline = None if timeout_s is None else time.monotonic() + float(timeout_s)
        running[read_fd] = (i, pid, deadline, bytearray())

    def kill(pid: int, *, reaped: bool = False) -> None:
        # the group (what the process started); the process itself only while unreaped (its pid is
        # not reused before then)
        for kill_fn in (os.killpg,) if reaped else (os.killpg, os.kill):
            try:
                kill_fn(pid, signal.SIGKILL)
            except OSError:
                pass

    def reap(pid: int) -> int:
        _, status = os.waitpid(pid, 0)
        return os.waitstatus_to_exitcode(status)

    failed: list[tuple[int, BaseException]] = []   # the earliest failing item so far: (index, exception)

    def fail(i: int, exc: BaseException) -> None:
        if failed and failed[0][0] < i:
            return
        failed[:] = [(i, exc)]
        queue.clear()
        for fd, (j, pid, _, _) in list(running.items()):   # later items: their outcome no longer matters
            if j > i:
                kill(pid)
                os.close(fd)
                del running[fd]
                reap(pid)

    try:
        while queue or running:
            while queue and len(running) < workers:
                start(queue.pop(0))
            now = time.monotonic()
            deadlines = [d for _, _, d, _ in running.values() if d is not None]
            wait = None if not deadlines else max(0.0, min(deadlines) - now)
            ready, _, _ = select.select(list(running), [], [], wait)
            for fd in ready:
                if fd not in running:   # killed above as a later item than a failure
                    continue
                i, pid, deadline, data = running[fd]
                chunk = os.read(fd, 1 << 20)
                if chunk:
                    data.extend(chunk)
                    continue
                os.close(fd)
                del running[fd]
                code = reap(pid)
                kill(pid, reaped=True)   # whatever it started and left behind in its group
                if not data:
                    fail(i, ChildFailed(items[i], returncode=code, timed_out=False, pid=pid, timeout_s=timeout_s))
                    continue
                ok, value = pickle.loads(bytes(data))
                if not ok:
                    fail(i, value)
                    continue
                results[i] = value
                if on_result is not None:
                    on_result(i, value)
            now = time.monotonic()
            for fd, (i, pid, deadline, _) in list(running.items()):
                if fd in running and deadline is not None and now >= deadline:
                    kill(pid)
                    os.close(fd)
                    del running[fd]
                    reap(pid)
                    fail(i, ChildFailed(items[i], returncode=None, timed_out=True, pid=pid, timeout_s=timeout_s))
        if failed:
            raise failed[0][1]
    finally:
        for fd, (_, pid, _, _) in running.items():   # a failure or an interrupt: leave no process behind
            kill(pid)
            os.close(fd)
            try:
                os.waitpid(pid, 0)
            except OSError:
                pass
    return [results[i] for i in range(len(items))]


def _each_child(read_fd: int, write_fd: int, fn: Callable[[Any], Any], item: Any) -> None:
    """A :func:`fork_each` process: its own process group, one CPU thread, ``fn(item)`` pickled to
    ``write_fd``; never returns into the parent's code."""
    global _in_child
    _in_child = True
    code = 0
    try:
        os.close(read_fd)
        try:
            os.setpgid(0, 0)
        except OSError:
            pass
        _one_cpu_thread()
        try:
            done: tuple[bool, Any] = (True, fn(item))
        except BaseException as exc:   # noqa: BLE001 - handed to the caller
            done = (False, exc)
        _send(write_fd, done,
              lambda exc: (False, RuntimeError(f"{type(done[1]).__name__}: {done[1]} (did not pickle: {exc})")))
    except BaseException:   # noqa: BLE001 - never return into the parent's code
        code = 1
    finally:
        os._exit(code)
