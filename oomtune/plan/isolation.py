"""The user's code, run for prediction in a process of its own: a failure becomes one line.

A ``target=python`` entry (its ``make_workload``, step function, data generator) is captured on the
meta device before any trial (:mod:`oomtune.plan.predictor`). Run in the search's own process, an
entry that raised ended the search with a traceback through oomtune's code, one that slept forever
hung it, one that called ``os._exit`` ended it silently. Each capture of user code therefore runs
in a forked process (:func:`oomtune.plan.parallel.fork_each`) under the trial's limits: the wall
limit ``trial.timeout`` (its process group killed past it) and the capture's host-memory limit
(:func:`oomtune.plan.predictor.cpu_capture_limit_bytes`; a SIGKILL counts as the OOM killer's only
with evidence, :class:`oomtune.trial.oomkill.OomKillWatch`, as for a trial). What comes back is a
stream or one of these failures, as a :class:`oomtune.exceptions.UserCodeError` (one line, exit 2).
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from oomtune.exceptions import OomtuneError, UserCodeError

__all__ = ["run_isolated", "in_child", "user_frame", "raised_error", "ended_error", "IMPORT_STAGE"]

_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the oomtune package


def in_child() -> bool:
    """Whether this process is already a forked worker (:mod:`oomtune.plan.parallel`): its captures
    run in it, isolated by that fork."""
    from oomtune.plan import parallel

    return parallel._in_child


def _library_dirs() -> tuple[str, ...]:
    import sysconfig

    paths = sysconfig.get_paths()
    dirs = {paths.get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    return tuple(os.path.abspath(d) + os.sep for d in dirs if d)


def user_frame(tb: Any) -> tuple[str, int] | None:
    """(file, line) of the innermost traceback frame in the user's code: outside the oomtune package,
    the standard library and site-packages (the user's call into torch, when torch raised); the
    innermost frame outside oomtune when every frame is library code; None without frames."""
    frames = traceback.extract_tb(tb)
    libs = _library_dirs()
    outside = [f for f in frames if not os.path.abspath(f.filename).startswith(_OWN_DIR + os.sep)]
    user = [f for f in outside if not os.path.abspath(f.filename).startswith(libs)]
    pick = (user or outside or frames or [None])[-1]
    return None if pick is None else (pick.filename, int(pick.lineno or 0))


#: ``stage`` of the check of an entry before any trial (:mod:`oomtune.plan.entry_check`): its module
#: imported, its function looked up, in a process of its own.
IMPORT_STAGE = "its module imported to check the function before any trial"


def _what(entry: str, batch_size: int, stage: str | None = None) -> str:
    if stage is not None:
        return f"target.entry={entry}, {stage}"
    return f"target.entry={entry}, captured at batch {batch_size} for prediction before any trial"


def raised_error(exc: BaseException, entry: str, batch_size: int, *, stage: str | None = None) -> OomtuneError:
    """The one-line error of the user's code raising ``exc`` during a capture (or, with ``stage``,
    during that stage: :data:`IMPORT_STAGE`): ``file:line`` (:func:`user_frame`), the exception's
    type and first line. oomtune's own errors (:class:`OomtuneError`: a bad config, the host-memory
    refusal) are returned unchanged."""
    if isinstance(exc, OomtuneError):
        return exc
    what = _what(entry, batch_size, stage)
    if isinstance(exc, SystemExit):
        must = ("the module must define the function, not exit" if stage
                else "make_workload must return the workload, not exit")
        return UserCodeError(f"{what}: the code called sys.exit({exc.code!r}); {must}")
    where = user_frame(exc.__traceback__)
    at = f" at {where[0]}:{where[1]}" if where else ""
    text = str(exc).strip().splitlines()
    detail = f": {text[0][:300]}" if text else ""
    alone = "importing the module alone" if stage else f"make_workload({batch_size}) called alone"
    return UserCodeError(f"{what}: raised {type(exc).__name__}{at}{detail}; fix the entry ({alone} shows the whole "
                         "traceback)")


def ended_error(failed: Any, entry: str, batch_size: int, watch: Any = None, *,
                limit_name: str = "trial.timeout", stage: str | None = None) -> UserCodeError:
    """The one-line error of a capture process that ended without a result
    (:class:`oomtune.plan.parallel.ChildFailed`): stopped at ``trial.timeout``, exited with a status
    (``os._exit``), or killed by a signal (classified as a trial's: :func:`oomtune.classify.
    classify_failure`; a SIGKILL is the OOM killer's only with ``watch``'s evidence). ``limit_name``:
    the setting the time limit came from, as the user spells it; ``stage``: what the process did
    when not a capture (:data:`IMPORT_STAGE`)."""
    what = _what(entry, batch_size, stage)
    if failed.timed_out:
        finish = "make the module's import return" if stage else "make make_workload and the step return"
        return UserCodeError(f"{what}: still running after {limit_name}={failed.timeout_s:g} s: "
                             f"stopped (its process group killed); {finish}, or raise {limit_name}")
    code = failed.returncode
    if code is not None and code >= 0:
        return UserCodeError(f"{what}: its process exited with status {code} without a result "
                             "(os._exit or a library's exit in the entry's code)")
    from oomtune.classify import classify_failure

    evidence = watch.evidence([failed.pid]) if watch is not None else None
    found = classify_failure(returncode=code, stderr="", oom_kill_evidence=evidence)
    return UserCodeError(f"{what}: its process was {found.message}; {found.advice}")


def run_isolated(fn: Callable[[int], Any], batch_sizes: Sequence[int], *, entry: str, workers: int,
                 timeout_s: float | None, limit_name: str = "trial.timeout", stage: str | None = None) -> list[Any]:
    """``[fn(b) for b in batch_sizes]``, each in a forked process of its own
    (:func:`oomtune.plan.parallel.fork_each`, ``workers`` at once), stopped past ``timeout_s``
    seconds (``limit_name``, ``trial.timeout``; None: no limit). ``entry`` names the user's code in the
    messages; ``stage`` what the processes do when they do not capture (:data:`IMPORT_STAGE`).
    In a process that is already a forked worker (:func:`in_child`), ``fn`` runs here.

    Raises:
        UserCodeError: the user's code raised (file:line and exception), exited, was killed or ran
            past the limit; the first failure in the order the processes ended. OomtuneError:
            oomtune's own refusals in the capture (a bad config, host memory), unchanged.
    """
    batch_sizes = list(batch_sizes)
    if in_child():
        return [_call(fn, b, entry, stage) for b in batch_sizes]
    from oomtune.plan.parallel import ChildFailed, fork_each
    from oomtune.trial.oomkill import OomKillWatch

    watch = OomKillWatch()
    try:
        return fork_each(lambda b: _call(fn, b, entry, stage), batch_sizes, workers, timeout_s=timeout_s)
    except ChildFailed as failed:
        raise ended_error(failed, entry, failed.item, watch, limit_name=limit_name, stage=stage) from None


def _call(fn: Callable[[int], Any], batch_size: int, entry: str, stage: str | None = None) -> Any:
    """``fn(batch_size)`` with the user's exception turned into its one-line error (in the child,
    where its traceback still exists: a traceback does not pickle)."""
    try:
        return fn(batch_size)
    except BaseException as exc:   # noqa: BLE001 - SystemExit of the user's sys.exit included
        if isinstance(exc, KeyboardInterrupt):
            raise
        raise raised_error(exc, entry, batch_size, stage=stage) from None

