"""``target=cmd``: any training command as a trial, its results read from a JSON-lines channel.

The parent runs the command in a new session, under a keeper (:mod:`oomtune.trial.keeper`): every
process the command starts, even one that calls ``setsid()``, is ended with the trial, and the
command dies with the search (a SIGKILLed search leaves no trial running). Its stdout and stderr are
kept bounded (the first 1 MiB and the last 2 MiB each). In the command, ``{batch_size}`` is replaced by
the trial's (micro-)batch size, ``{grad_accum}`` by its micro-batches per optimizer step (1 without
``search.global_batch``), ``{global_batch}`` by batch size x grad_accum (x world size), and
``{activation_checkpointing}`` by ``1`` or ``0``; ``{{name}}`` is a literal ``{name}``; any other
``{name}`` is refused as a probable typo (:func:`substitute`), while braces around anything else
(JSON, awk) are left alone. These variables are in its environment:

- ``PYTORCH_CUDA_ALLOC_CONF`` and ``PYTORCH_ALLOC_CONF``: the trial's allocator string (both names,
  unset when empty; torch reads the first set and which one first differs between versions);
- ``OOMTUNE_BATCH_SIZE``, ``OOMTUNE_DEVICE`` (``cpu`` or ``cuda``: for ``cuda:N`` only device N is
  made visible, field case C10), ``OOMTUNE_BUDGET_BYTES`` (unset without a budget),
  ``OOMTUNE_DEVICE_MEMORY_BYTES`` (CPU: the virtual GPU's size, the budget a fraction of it),
  ``OOMTUNE_WARMUP_STEPS``, ``OOMTUNE_MEASURE_STEPS``, ``OOMTUNE_SEED``, ``OOMTUNE_GPU`` (the
  target GPU, ``model.gpu``, whose kernels :func:`oomtune.capture_hook`'s virtual GPU runs),
  ``OOMTUNE_GPUS`` (``trial.gpus``: the ranks the command should start, e.g. ``torchrun
  --nproc_per_node $OOMTUNE_GPUS``; on CUDA that many GPUs are visible, by UUID);
- ``OOMTUNE_RESULT_FILE``: the results channel, appended to by :func:`oomtune.report` and
  :func:`oomtune.capture_hook` (:mod:`oomtune.script_api`);
- ``OOMTUNE_GRAD_ACCUM``, ``OOMTUNE_GLOBAL_BATCH`` (with ``search.global_batch``),
  ``OOMTUNE_ACTIVATION_CHECKPOINTING`` (``1``/``0``, when searched), read by the integrations
  (:mod:`oomtune.integrations`);
- ``OOMTUNE_EXECUTE`` (a CPU trial): ``meta`` when the trial's steps may run on the meta device
  (``TrialSpec.execute``; an integration does it, :mod:`oomtune.integrations._meta`), else ``cpu``.
  A meta trial whose steps cannot run there writes a ``meta_unsupported`` line and fails; the
  command is then run again with ``cpu`` in the same trial directory, and the record says why in
  ``execution.fallback``; a trial whose steps ran on meta (its report says ``"execute": "meta"``)
  has no throughput (nothing was computed), as a built-in meta trial; an integration that runs its
  steps on the CPU all the same (Lightning; several ranks) says why in ``execution.note``; a meta
  trial that fails before its first report has ``execution.where`` None (nothing says where its steps ran);
- ``OOMTUNE_STREAM_FILE``: where the capture hook writes the allocation stream of the trial's steps
  (``stream.bin`` in the trial directory, with ``stream.bin.json``; rank R of several writes
  ``stream.bin.rank<R>``); when written, the record's ``script.stream_file`` names it (the worst
  rank's: the one whose peak reserved is the trial's) and the search replays it under every allocator
  configuration (:mod:`oomtune.plan.recorded`).

How the record is built (:func:`result_from_channel`):

1. Past ``timeout_s`` the command's process tree gets SIGTERM, then SIGKILL: ``timeout``.
2. An ``oom`` line (the virtual GPU ran out, written before the exception propagated): the
   simulated OOM message is classified (memory outcome), even if the script caught it and exited 0.
3. A non-zero exit: the shared classifier on the exit status and stderr
   (:func:`oomtune.classify.classify_failure`): a CUDA OOM traceback is a memory outcome, SIGKILL
   without a traceback ``host_oom`` when the OOM killer's counters or the kernel log show it
   (:mod:`oomtune.trial.oomkill`), else ``crash``; other signals ``crash``, else ``error``; a launcher's
   failure summary (torchrun's ``ChildFailedError``, DeepSpeed's on stdout, accelerate's) makes the
   first failed rank's exit status or signal decide, and names it (``failed_rank``).
4. Exit 0 with ``report`` lines: ``ok``; throughput = sum(samples) / sum(seconds) over one process's
   lines; with several ranks reporting (lines carry ``rank``), the sum of every rank's samples over
   the slowest rank's seconds (each sample counted once).
5. Exit 0 without any ``report`` line: ``error`` ("the command never called oomtune.report()"). A
   run with no throughput cannot be ranked, and telling it to Optuna as ok would let an unmeasured
   batch win; the advice says how to report.

Memory: the last reported ``memory_stats()`` peaks (``simulated`` from the capture hook, ``device``
when the script's CUDA was initialised); with several ranks, each rank's last reading, the worst
rank's as the trial's (``worst_rank``, every rank's in ``ranks``); an ``oom`` line
names its rank. On a GPU also the NVML peak of the command's process tree on each of its GPUs
(``device_peak_bytes``: the highest) and mean utilisation. Without either, memory figures are None and
``script.memory_unknown`` is True.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import replace
from pathlib import Path
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable

from oomtune.classify import ADVICE, classify_failure, classify_text
from oomtune.exceptions import ConfigError
from oomtune.outcome import Outcome
from oomtune.script_api import (BATCH_SIZE_ENV, BUDGET_ENV, CHECKPOINTING_ENV, DEVICE_ENV, DEVICE_MEMORY_ENV,
                                EXECUTE_ENV, GLOBAL_BATCH_ENV, GPU_ENV, GRAD_ACCUM_ENV, META_UNSUPPORTED_EVENT,
                                RESULT_FILE_ENV, STREAM_FILE_ENV)
from oomtune.trial.keeper import MARKER_ENV, STATUS_FILE, end_kept, keeper_argv, kill_now, read_tail
from oomtune.trial.oomkill import OomKillWatch
from oomtune.trial.record import (MEMORY_SOURCE_DEVICE, MEMORY_SOURCE_SIMULATED, MemoryReadings, ResultDraft,
                                  ScriptReports, TrialResult,
                                  TrialSpec)

if TYPE_CHECKING:
    from oomtune.trial.script_fork import ScriptServers

__all__ = ["run_cmd_trial", "build_command", "substitute", "substitute_batch_size", "PLACEHOLDERS",
           "placeholder_values", "STREAM_FILE", "check_program", "resolve_cwd", "cmd_environment", "read_channel", "result_from_channel",
           "NO_REPORT_MESSAGE", "bad_channel_line", "CmdTarget", "TARGET"]

NO_REPORT_MESSAGE = "the command never called oomtune.report(): no throughput to rank"
_NO_REPORT_ADVICE = ("call oomtune.report(samples=..., seconds=...) after the measured steps "
                     "(import oomtune; see examples/train_cmd.py), or with Lightning or the Hugging Face "
                     "Trainer pass callbacks=[OomtuneCallback()] (from oomtune.integrations.lightning or "
                     "oomtune.integrations.huggingface)")
_SHELL_TOKENS = frozenset({"|", "||", "&", "&&", ";", ";;", "<", ">", ">>", "<<", "(", ")", ">&", "<&"})
_STDERR_TAIL_CHARS = 4000
_STDERR_TAIL_BYTES = 16384   # read from the end of stderr.txt by seeking (it may hold MiBs)
_GRACE_S = 3.0


#: The placeholders a command may hold, in the order the messages list them.
PLACEHOLDERS = ("batch_size", "grad_accum", "global_batch", "activation_checkpointing")
#: The allocation stream a trial's capture hook writes, in its trial directory.
STREAM_FILE = "stream.bin"
_KNOWN = ", ".join("{" + p + "}" for p in PLACEHOLDERS)
# ``{{name}}`` (an escaped placeholder: the literal ``{name}``), or ``{name}`` not preceded by "$"
# (a shell ``${VAR}``), where a name is letters, digits, ``_``, ``.``, ``-``: the only forms the
# command template gives a meaning to. Other braces (JSON, awk programs, brace expansion
# ``{a,b}``/``{1..3}``) are literal text, so nested JSON such as ``{"a": {"b": 1}}`` is untouched.
_NAME = r"[A-Za-z_][A-Za-z0-9_.\-]*"
_TEMPLATE_RE = re.compile(r"\{\{(" + _NAME + r")\}\}|(?<!\$)\{(" + _NAME + r")\}")


def substitute(text: str, values: Mapping[str, Any]) -> str:
    """``text`` with each known placeholder (:data:`PLACEHOLDERS`: ``{batch_size}``, ``{grad_accum}``,
    ``{global_batch}``, ``{activation_checkpointing}``) replaced by ``values[name]``.

    ``{{name}}`` is the escape for a literal ``{name}`` (``{{batch_size}}`` stays ``{batch_size}``).
    Any other placeholder-like ``{name}`` (a bare name in braces, not a shell ``${name}``) is
    refused: a misspelt ``{batchsize}`` would otherwise reach the command unreplaced. Braces that
    do not enclose a bare name (JSON, awk, ``{a,b}``) are left as they are.

    Raises:
        ConfigError: an unknown placeholder, named in the message with the known ones.
    """
    def repl(m: re.Match[str]) -> str:
        if m.group(1) is not None:
            return "{" + m.group(1) + "}"
        name = m.group(2)
        if name in PLACEHOLDERS:
            return str(values.get(name, ""))
        raise ConfigError(f"target.command: unknown placeholder {m.group(0)!r}: the known ones are {_KNOWN} "
                          f"(write {{{{{name}}}}} for a literal {m.group(0)})")

    return _TEMPLATE_RE.sub(repl, text)


def substitute_batch_size(text: str, batch_size: int) -> str:
    """:func:`substitute` with ``batch_size`` and the values of a plain trial (no accumulation)."""
    return substitute(text, placeholder_values(batch_size))


def placeholder_values(batch_size: int, grad_accum: int = 1, activation_checkpointing: bool | None = None,
                       world_size: int = 1) -> dict[str, str]:
    """The placeholders' values of a trial: the micro-batch, micro-batches per optimizer step, the
    global batch (micro-batch x grad_accum x world size) and activation checkpointing as ``1``/``0``."""
    return {"batch_size": str(batch_size), "grad_accum": str(grad_accum),
            "global_batch": str(batch_size * grad_accum * world_size),
            "activation_checkpointing": "1" if activation_checkpointing else "0"}


def build_command(target: dict[str, Any], batch_size: int, *,
                  values: Mapping[str, Any] | None = None) -> tuple[list[str], bool]:
    """The argv for ``target["command"]`` with its placeholders replaced, and whether it needs a shell.

    Substitution (:func:`substitute`): ``{batch_size}`` becomes the batch size, ``{grad_accum}``,
    ``{global_batch}`` and ``{activation_checkpointing}`` the values in ``values`` (default: those of
    a trial without accumulation, :func:`placeholder_values`), ``{{name}}`` a literal ``{name}``; any
    other ``{name}`` is an error; other braces (e.g. JSON) are left alone.
    A command with shell syntax (pipes, ``&&``, ``;``, redirections, ``$VAR``, backquotes) runs as
    ``/bin/sh -c COMMAND``; otherwise it is ``shlex.split`` and run directly. A list command is used
    as argv as is (each element substituted).

    Raises:
        ConfigError: a missing, empty or unparsable command, or an unknown placeholder.
    """
    values = dict(values) if values is not None else placeholder_values(batch_size)
    values["batch_size"] = str(batch_size)
    command = target.get("command")
    if isinstance(command, (list, tuple)) and command and all(isinstance(c, str) for c in command):
        if not command[0].strip():
            raise ConfigError(f"target.command={list(command)!r}: the program (first element) is empty")
        return [substitute(c, values) for c in command], False
    if not isinstance(command, str) or not command.strip() or command.strip() == "???":
        raise ConfigError(f"target.command={command!r}: give the training command, e.g. "
                          "target.command='python train.py --batch-size {batch_size}'")
    text = substitute(command, values)
    try:
        lex = shlex.shlex(text, posix=True, punctuation_chars=True)
        lex.whitespace_split = True
        tokens = list(lex)
        argv = shlex.split(text)
    except ValueError as exc:
        raise ConfigError(f"target.command={command!r}: {exc}") from None
    if not argv:
        raise ConfigError(f"target.command={command!r}: no program to run")
    if any(t in _SHELL_TOKENS for t in tokens) or "$" in text or "`" in text:
        return ["/bin/sh", "-c", text], True
    return argv, False


def check_program(argv: list[str], cwd: str | None) -> None:
    """Check that ``argv[0]`` can be started: a bare name must be on ``PATH`` (``shutil.which``, as
    ``execvp`` searches it), a path (with a ``/``) an executable file, relative to ``cwd`` (where the
    command runs; default ours).

    Raises:
        ConfigError: ``target.command: program 'NAME' not found`` or ``... is not executable``.
    """
    prog = argv[0]
    if "/" not in prog:
        if shutil.which(prog) is None:
            raise ConfigError(f"target.command: program {prog!r} not found")
        return
    path = Path(prog).expanduser()
    if not path.is_absolute():
        path = Path(cwd or os.getcwd()) / path
    if not path.is_file():
        raise ConfigError(f"target.command: program {prog!r} not found")
    if not os.access(path, os.X_OK):
        raise ConfigError(f"target.command: program {prog!r} is not executable (chmod +x, or run it "
                          "through its interpreter, e.g. 'python script.py')")


def cmd_environment(spec: TrialSpec, result_file: Path, env: dict[str, str] | None = None) -> dict[str, str]:
    """The command's environment: ours + ``env`` + the allocator string and device pin of the
    builtin trials (:func:`oomtune.trial.runner.child_environment`) + the ``OOMTUNE_*`` variables
    listed in the module docstring.

    Raises:
        ConfigError: ``cuda:N`` not among our CUDA_VISIBLE_DEVICES, or an unknown device.
    """
    from oomtune.trial.runner import child_environment

    out = child_environment(spec, env)
    out.pop(BUDGET_ENV, None)
    from oomtune.workloads.training import checkpointing_of, grad_accum_of

    accum = grad_accum_of(spec.workload.training)
    out.update({
        RESULT_FILE_ENV: str(result_file),
        BATCH_SIZE_ENV: str(spec.batch_size),
        GRAD_ACCUM_ENV: str(accum),
        DEVICE_ENV: "cuda" if spec.device.startswith("cuda") else "cpu",
        "OOMTUNE_WARMUP_STEPS": str(spec.warmup_steps),
        "OOMTUNE_MEASURE_STEPS": str(spec.measure_steps),
        "OOMTUNE_SEED": str(spec.seed),
        STREAM_FILE_ENV: str(Path(result_file).with_name(STREAM_FILE)),
        "OOMTUNE_GPUS": str(spec.ranks),
    })
    for key in (GLOBAL_BATCH_ENV, CHECKPOINTING_ENV):
        out.pop(key, None)
    if "grad_accum" in spec.workload.training:
        out[GLOBAL_BATCH_ENV] = str(spec.batch_size * accum)
    if "activation_checkpointing" in spec.workload.training:
        out[CHECKPOINTING_ENV] = "1" if checkpointing_of(spec.workload.training) else "0"
    if spec.budget_bytes is not None:
        out[BUDGET_ENV] = str(int(spec.budget_bytes))
    out.pop(GPU_ENV, None)
    gpu = spec.workload.gpu
    if gpu and str(gpu).lower() != "auto":
        out[GPU_ENV] = str(gpu)   # the target GPU whose kernels capture_hook's virtual GPU runs
    out.pop(EXECUTE_ENV, None)
    if not spec.device.startswith("cuda"):
        out[EXECUTE_ENV] = "meta" if spec.execute == "meta" else "cpu"
    out.pop(DEVICE_MEMORY_ENV, None)
    if spec.device_memory_bytes is not None and not spec.device.startswith("cuda"):
        out[DEVICE_MEMORY_ENV] = str(int(spec.device_memory_bytes))  # the virtual GPU's size (capture_hook)
    return out


def resolve_cwd(target: dict[str, Any]) -> str | None:
    """``target["cwd"]`` as an absolute path; None (inherit ours) when unset.

    Raises:
        ConfigError: the directory does not exist.
    """
    cwd = target.get("cwd")
    if cwd in (None, ""):
        return None
    path = Path(str(cwd)).expanduser()
    if not path.is_dir():
        raise ConfigError(f"target.cwd={cwd!r}: directory not found")
    return str(path.resolve())


def _sampler(spec: TrialSpec, pid: int) -> Any:
    """An NVML sampler of the command's process tree on every GPU of a CUDA trial (one per rank,
    :class:`oomtune.gpu.nvml.MultiSampler`); None on CPU or without NVML."""
    if not spec.device.startswith("cuda"):
        return None
    from oomtune.gpu import nvml

    if not nvml.nvml_available():
        return None
    indices = [int(i) for i in (spec.device.partition(":")[2] or "0").split(",")]
    try:
        physical = [nvml.physical_index_for(i) for i in indices]
    except Exception:  # DeviceError: a UUID entry NVML cannot see; memory stays unknown
        return None
    return nvml.MultiSampler(physical, pid=pid)


def run_cmd_trial(spec: TrialSpec, *, workdir: Path, env: dict[str, str] | None = None,
                  grace_s: float = _GRACE_S, on_start: Callable[[int], None] | None = None,
                  forks: ScriptServers | None = None) -> TrialResult:
    """Run one ``target=cmd`` trial and return its record; never raises for a trial failure.

    A trial asked to run its steps on meta (``spec.execute == "meta"``) whose command says they
    cannot (a ``meta_unsupported`` line) is run again with CPU steps; its record's
    ``execution.fallback`` holds the reason and ``execution.where`` where the steps ran.

    Args:
        spec: the trial; ``spec.workload.target`` is ``{"name": "cmd", "command": ..., "cwd": ...}``.
        workdir: created; holds ``results.jsonl`` (the channel), ``stdout.txt``, ``stderr.txt`` and
            ``result.json`` (the record). The command runs in ``target.cwd`` (default: our cwd, so
            relative paths in the command mean what they mean on the user's command line).
        env: extra environment variables for the command.
        grace_s: seconds between SIGTERM and SIGKILL of the command's process tree on timeout.
        on_start: called with the pid (= process group id) right after the start, e.g. so that a
            runner's ``kill_all`` can reach the group on Ctrl-C.
        forks: the runner's script servers (:class:`oomtune.trial.script_fork.ScriptServers`): a
            ``python FILE.py ...`` command is forked from a server that imported the script's
            third-party modules once (the record's ``process.launcher`` is ``cmd-fork``, and
            ``process.launcher_fallback`` says why a command was spawned instead); None: spawned.

    Returns:
        The :class:`TrialResult` (see the module docstring for how the outcome is decided);
        ``process`` holds ``pid`` (= the process group id), ``returncode`` and ``command``;
        ``script.reports`` the number of report lines.

    Raises:
        ConfigError, AllocatorConfigError: a bad command, cwd, device or spec (nothing launched).
    """
    result, fallback = _run_once(spec, workdir=workdir, env=env, grace_s=grace_s, on_start=on_start, forks=forks)
    if fallback is not None:
        result, _ = _run_once(replace(spec, execute="cpu"), workdir=workdir, env=env, grace_s=grace_s,
                              on_start=on_start, forks=forks)
        result = replace(result, execution=replace(result.execution, fallback=fallback))
        result.write(Path(workdir).resolve() / "result.json")
    return result


def _run_once(spec: TrialSpec, *, workdir: Path, env: dict[str, str] | None, grace_s: float,
              on_start: Callable[[int], None] | None,
              forks: ScriptServers | None = None) -> tuple[TrialResult, str | None]:
    """One run of the command (:func:`run_cmd_trial`): its record, and the reason its meta steps
    failed when they did (a ``meta_unsupported`` line; the caller runs it again on the CPU), else None."""
    from oomtune.trial.runner import validate_spec

    from oomtune.workloads.training import checkpointing_of, grad_accum_of

    validate_spec(spec)
    target = dict(spec.workload.target)
    training = spec.workload.training
    ckpt = checkpointing_of(training) if "activation_checkpointing" in training else None
    argv, shell = build_command(target, spec.batch_size, values=placeholder_values(
        spec.batch_size, grad_accum_of(training), ckpt))
    cwd = resolve_cwd(target)
    workdir = Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    channel = workdir / "results.jsonl"
    channel.unlink(missing_ok=True)
    (workdir / STATUS_FILE).unlink(missing_ok=True)
    for old in workdir.glob(STREAM_FILE + "*"):   # a stream left by an earlier run of this directory
        old.unlink(missing_ok=True)
    marker = uuid.uuid4().hex
    child_env = cmd_environment(spec, channel, {**(env or {}), MARKER_ENV: marker})
    _check_startable(argv, cwd, child_env)
    watch = OomKillWatch()   # the OOM killer's counters before the command (SIGKILL evidence)
    started = time.time()
    proc, spawn_reason = None, None
    if forks is not None and not shell:
        proc, spawn_reason = forks.launch(argv, cwd=cwd or os.getcwd(), env=child_env, workdir=workdir,
                                          grace_s=grace_s, status_file=STATUS_FILE)
    if proc is None:
        from oomtune.trial.runner import SpawnedTrial

        with open(workdir / "keeper.log", "wb") as log:
            try:
                proc = SpawnedTrial(subprocess.Popen(keeper_argv(sys.executable, argv, grace_s=grace_s, workdir=workdir),
                                                 cwd=cwd, env=child_env, stdin=subprocess.DEVNULL, stdout=log,
                                                 stderr=log, start_new_session=True))
            except OSError as exc:  # e.g. too many processes
                raise ConfigError(f"target.command: cannot start {argv[0]!r}: {exc.strerror or exc}") from None
    sampler = _sampler(spec, proc.pid)   # the keeper's tree: the command and everything it started
    try:
        if on_start is not None:
            on_start(proc.pid)
        with sampler if sampler is not None else contextlib.nullcontext():
            returncode, timed_out = _wait(proc, spec.timeout_s, grace_s)
    finally:
        if proc.wait(0) is None:   # interrupted while waiting: the keeper kills its tree
            kill_now(proc.pid)
            proc.wait(None)
    from oomtune.trial.runner import leftovers, trial_pids

    stderr = read_tail(workdir / "stderr.txt", _STDERR_TAIL_BYTES)[-_STDERR_TAIL_CHARS:]
    stdout = read_tail(workdir / "stdout.txt", _STDERR_TAIL_BYTES)[-_STDERR_TAIL_CHARS:]
    stderr = _with_launcher_summary(stderr, stdout)
    evidence = reason = None
    killed_rank = _sigkilled_rank_pid(stderr) if returncode not in (0, None) and not timed_out else None
    if (returncode in (-signal.SIGKILL, 128 + signal.SIGKILL) or killed_rank is not None) and not timed_out:
        pids = trial_pids(proc.pid, workdir / STATUS_FILE)
        evidence = watch.evidence(pids | ({killed_rank} if killed_rank else set()))
        reason = None if evidence else watch.sources()
    rec = ResultDraft(result_from_channel(spec, read_channel(channel), returncode=returncode, stderr=stderr,
                                          timed_out=timed_out, oom_kill_evidence=evidence, no_evidence_reason=reason))
    rec.update("process", **leftovers(marker, workdir / STATUS_FILE))
    if sampler is not None:
        res = sampler.result
        _update(rec, "memory", device_peak_bytes=res.peak_used_bytes)
        _update(rec, "throughput", gpu_utilization=res.mean_utilization_percent)
        if len(sampler.results) > 1:   # per GPU, in the trial's (rank) order
            rec.update("budget", device_peaks=tuple(r.peak_used_bytes for r in sampler.results))
        if res.peak_used_bytes is not None:
            rec.update("script", memory_unknown=False)
    rec.set(wall_s=max(0.0, time.time() - started))   # the record refuses a negative time (clock step)
    rec.update("process", pid=proc.pid, returncode=returncode, command=tuple(argv) if not shell else (argv[-1],),
               launcher="cmd" if spawn_reason is not None or forks is None or shell else "cmd-fork")
    if forks is not None and spawn_reason is not None:
        rec.update("process", launcher_fallback=spawn_reason)
    rec.update("script", grad_accum=grad_accum_of(spec.workload.training))
    lines = read_channel(channel)
    unsupported = [ln for ln in lines if isinstance(ln, dict) and ln.get("event") == META_UNSUPPORTED_EVENT]
    fallback = None
    if spec.execute == "meta" and unsupported and rec.result.outcome is not Outcome.OK:
        fallback = str(unsupported[0].get("reason", "?"))
    reported = rec.result.script.reported_values()
    on_meta = any(r.get("execute") == "meta" for r in reported)
    if not spec.device.startswith("cuda"):
        rec.update("execution", where=_steps_ran_on(spec, reported, on_meta))
    notes = [r["meta_note"] for r in reported if r.get("meta_note")]
    if spec.execute == "meta" and not on_meta and notes:   # the integration ran CPU steps, and says why
        rec.update("execution", note=str(notes[0]))
    if on_meta:   # nothing was computed: the meta steps' times are no throughput
        rec.update("throughput", samples_per_s=None, step_time_s=None, data_wait_fraction=None)
    stream = workdir / STREAM_FILE
    if rec.result.worst_rank:   # several ranks: the worst rank's stream (stream.bin.rank<R>) decides, as its peak does
        stream = workdir / f"{STREAM_FILE}.rank{rec.result.worst_rank}"
    if stream.is_file() and rec.result.outcome is Outcome.OK:
        rec.update("script", stream_file=str(stream))   # the step's allocation stream (oomtune.plan.recorded)
    rec.result.write(workdir / "result.json")
    return rec.result, fallback


def _steps_ran_on(spec: TrialSpec, reported: list[dict[str, Any]], on_meta: bool) -> str | None:
    """Where a virtual-GPU trial's steps ran, as far as its command said (``execution.where``):
    ``meta`` when a report says ``"execute": "meta"``, ``cpu`` when it reported otherwise or was not
    allowed meta steps (``OOMTUNE_EXECUTE=cpu``: an integration then runs them for real); None
    (unknown) for a command asked for meta steps that failed before its first report: nothing it
    wrote says where its steps ran (an integration may have been on meta or on the CPU)."""
    if on_meta:
        return "meta"
    if reported or spec.execute != "meta":
        return "cpu"
    return None


def _wait(proc: Any, timeout_s: float, grace_s: float) -> tuple[int | None, bool]:
    """Wait for the keeper ``proc`` (``pid``, ``wait(timeout) -> status | None``); past ``timeout_s``
    the keeper SIGTERMs the command's tree, then SIGKILLs it after ``grace_s``
    (:func:`oomtune.trial.keeper.end_kept`). (returncode, timed_out)."""
    done = proc.wait(max(0.0, timeout_s))
    if done is not None:
        return done, False
    return end_kept(proc.pid, proc.wait, grace_s), True


def _check_startable(argv: list[str], cwd: str | None, env: Mapping[str, str]) -> None:
    """The program ``argv[0]`` exists and may be run (as ``execvp`` will look for it: on the
    command's ``PATH`` for a bare name, relative to ``cwd`` for a path).

    Raises:
        ConfigError: ``target.command: cannot start 'PROG': ...``.
    """
    prog = argv[0]
    if "/" in prog:
        path = Path(prog).expanduser()
        path = path if path.is_absolute() else Path(cwd or os.getcwd()) / path
        problem = (None if path.is_file() and os.access(path, os.X_OK)
                   else "Permission denied" if path.is_file() else "No such file or directory")
    else:
        problem = None if shutil.which(prog, path=env.get("PATH", os.defpath)) else "No such file or directory"
    if problem:
        raise ConfigError(f"target.command: cannot start {prog!r}: {problem}")


def _sigkilled_rank_pid(stderr: str) -> int | None:
    """The pid of the rank a launcher's failure summary says was killed by SIGKILL (torchrun's
    ``exitcode : -9 (pid: P)``), to look for the OOM killer's evidence about it: the launcher itself
    exits 1, so its own exit status says nothing. None: no such summary, or no pid printed."""
    from oomtune.classify._launcher import parse_launcher_summary

    summary = parse_launcher_summary(stderr)
    root = summary.root if summary is not None else None
    if root is None or root.pid is None or root.exitcode not in (-signal.SIGKILL, 128 + signal.SIGKILL):
        return None
    return root.pid


def _with_launcher_summary(stderr: str, stdout: str) -> str:
    """``stderr``, preceded by ``stdout`` when only stdout holds a launcher's failure summary
    (DeepSpeed's launcher logs to stdout: :mod:`oomtune.classify._launcher`)."""
    from oomtune.classify._launcher import parse_launcher_summary

    if parse_launcher_summary(stderr) is None and parse_launcher_summary(stdout) is not None:
        return f"{stdout}\n{stderr}"
    return stderr


def read_channel(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a results channel, in order; a torn or malformed line is skipped (a
    process killed mid-write). Missing file: []."""
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    events = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError, RecursionError):   # RecursionError: a line nested too deeply
            obj = json.loads(line)
            if isinstance(obj, dict):
                events.append(obj)
    return events


def result_from_channel(spec: TrialSpec, events: list[dict[str, Any]], *, returncode: int | None,
                        stderr: str, timed_out: bool, oom_kill_evidence: str | None = None,
                        no_evidence_reason: str | None = None) -> TrialResult:
    """Build the trial record from the channel's events, the exit status and stderr (rules 1-5 of
    the module docstring); ``oom_kill_evidence`` / ``no_evidence_reason``: as for
    :func:`oomtune.classify.classify_failure` (a SIGKILL is ``host_oom`` only with evidence).
    Never raises."""
    cuda = spec.device.startswith("cuda")
    result = ResultDraft(TrialResult(
        outcome=Outcome.ERROR, batch_size=spec.batch_size, alloc_conf=spec.alloc_conf,
        memory=MemoryReadings(source=MEMORY_SOURCE_DEVICE if cuda else MEMORY_SOURCE_SIMULATED)))
    bad = bad_channel_line(events)
    if bad is not None and timed_out:   # the hang decides; the unreadable lines are left out
        events = [e for e in events if bad_channel_line([e]) is None]
    elif bad is not None:   # the script's record is malformed: this trial's failure, never the search's
        _set(result, Outcome.BAD_RECORD, bad, ADVICE[Outcome.BAD_RECORD], _tail(stderr))
        result.update("script", reports=sum(1 for e in events if e.get("event") == "report"), memory_unknown=True)
        return result.result
    reports = [e for e in events if e.get("event") == "report"]
    ooms = sorted((e for e in events if e.get("event") == "oom"), key=lambda e: e.get("time") or 0.0)
    result.update("script", reports=len(reports))
    _fill_throughput(result, reports)
    memories: dict[Any, dict[str, Any]] = {}   # the last memory reading of each rank
    for e in events:
        if isinstance(e.get("memory"), dict):
            memories[_rank_of(e)] = e["memory"]
    if len(memories) == 1:
        _set_memory(result, next(iter(memories.values())))
    elif memories:
        _set_rank_memory(result, memories)
    else:
        result.update("script", memory_unknown=True)
    kw = dict(batch_size=spec.batch_size, smaller_batch_succeeded=spec.smaller_batch_succeeded)
    if timed_out or (returncode != 0 and not ooms):
        cls = classify_failure(returncode=returncode, stderr=stderr, timed_out=timed_out,
                               oom_kill_evidence=oom_kill_evidence, no_evidence_reason=no_evidence_reason, **kw)
        if timed_out:
            cls_message = f"trial exceeded its {spec.timeout_s:g} s limit; process group killed"
        else:
            cls_message = cls.message
        _set(result, cls.outcome, cls_message, cls.advice, cls.traceback_tail)
        if cls.oom is not None:
            _update(result, "memory", oom_requested_bytes=cls.oom.requested_bytes)
        if cls.rank is not None and not timed_out:   # a launcher's summary named the failed rank
            result.set(failed_rank=cls.rank)
    elif ooms:
        cls = classify_text(f"OutOfMemoryError: {ooms[0].get('message', '')}", **kw)
        rank = _rank_of(ooms[0])   # the first rank to run out of memory (by time)
        world = ooms[0].get("world_size")
        who = (None if rank is None else f"rank {rank} of {world}" if isinstance(world, int) and world > 1
               else f"rank {rank}")
        message = cls.message if who is None else f"{who}: {cls.message}"
        if rank is not None:
            result.set(failed_rank=rank)
        _set(result, cls.outcome, message, cls.advice, None)
        _update(result, "memory", oom_requested_bytes=ooms[0].get("requested_bytes")
                or (cls.oom.requested_bytes if cls.oom is not None else None))
        if returncode == 0:
            result.update("script", oom_caught_by_script=True)
    elif not reports:
        _set(result, Outcome.ERROR, NO_REPORT_MESSAGE, _NO_REPORT_ADVICE, _tail(stderr))
        result.update("script", no_report=True)   # every configuration would repeat it (oomtune.search.driver)
    else:
        _set(result, Outcome.OK, None, None, None)
    if result.result.outcome is not Outcome.OK:   # a failed trial has no values (Optuna's rule)
        result.update("throughput", samples_per_s=None, step_time_s=None)
    return result.result


#: The largest figure a channel line may hold (2**63: no count of samples, steps or bytes comes
#: near it; beyond it a float loses the units and a sum may overflow to inf).
_HUGE = float(2 ** 63)
_QUOTE_CHARS = 200


def _number_problem(name: str, value: Any, *, positive: bool = False, integer: bool = False,
                    optional: bool = False) -> str | None:
    """Why ``value`` cannot be the channel field ``name`` (None: it can): a number (not a bool, not
    a string), finite, >= 0 (> 0 when ``positive``), below 2**63, an int when ``integer``; None is
    allowed when ``optional``."""
    if value is None and optional:
        return None
    bound = "> 0" if positive else ">= 0"
    kind = "an integer" if integer else "a finite number"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        return f"{name}={value!r} is not {kind} {bound}"
    try:
        number = float(value)
    except OverflowError:
        return f"{name}={value!r} is too large (at most 2**63)"
    if number != number or number in (float("inf"), float("-inf")):
        return f"{name}={value!r} is not {kind} {bound}"
    if number < 0 or (positive and number == 0):
        return f"{name}={value!r} is not {kind} {bound}"
    if number > _HUGE:
        return f"{name}={value!r} is too large (at most 2**63)"
    return None


def _line_problem(event: dict[str, Any]) -> str | None:
    """Why one channel line cannot be read (None: it can), as :func:`oomtune.report`,
    :func:`oomtune.capture_hook` and the integrations write them (:mod:`oomtune.script_api`): every
    field the record is built from is checked, for its type, NaN/inf, sign and size."""
    kind = event.get("event")
    if kind not in ("report", "oom", "memory"):
        return None   # not a line the record reads
    checks = [_number_problem("time", event.get("time"), optional=True),
              _number_problem("rank", event.get("rank"), integer=True, optional=True),
              _number_problem("world_size", event.get("world_size"), positive=True, integer=True, optional=True)]
    if kind == "report":
        samples, seconds = event.get("samples"), event.get("seconds")
        checks += [_number_problem("samples", samples), _number_problem("seconds", seconds, positive=True),
                   _number_problem("steps", event.get("steps"), integer=True, optional=True),
                   _number_problem("data_wait_seconds", event.get("data_wait_seconds"), optional=True)]
        extra = event.get("extra")
        if extra is not None and not isinstance(extra, dict):
            checks.append(f"extra={extra!r} is not a mapping")
    elif kind == "oom":
        message = event.get("message")
        if message is not None and not isinstance(message, str):
            checks.append(f"message={message!r} is not a string")
        checks.append(_number_problem("requested_bytes", event.get("requested_bytes"), integer=True, optional=True))
    memory = event.get("memory")
    if memory is not None or kind == "memory":
        checks.append(_memory_problem(memory))
    return next((c for c in checks if c is not None), None)


#: The ``memory_stats()`` keys a record reads (torch's ``torch.cuda.memory_stats``; the virtual GPU's same keys).
_STATS_READ = ("allocated_bytes.all.peak", "reserved_bytes.all.peak", "active_bytes.all.peak",
               "num_alloc_retries", "num_ooms")


def _memory_problem(memory: Any) -> str | None:
    """Why a line's ``memory`` (``{"source": ..., "stats": memory_stats()}``) cannot be read."""
    if not isinstance(memory, dict):
        return f"memory={memory!r} is not a mapping"
    source = memory.get("source")
    if source is not None and source not in (MEMORY_SOURCE_DEVICE, MEMORY_SOURCE_SIMULATED):
        return f"memory.source={source!r} is not {MEMORY_SOURCE_DEVICE!r} or {MEMORY_SOURCE_SIMULATED!r}"
    stats = memory.get("stats")
    if stats is None:
        return None
    if not isinstance(stats, dict):
        return f"memory.stats={stats!r} is not a mapping"
    for key in _STATS_READ:
        problem = _number_problem(f"memory.stats[{key!r}]", stats.get(key), integer=True, optional=True)
        if problem:
            return problem
    return None


def bad_channel_line(events: list[dict[str, Any]]) -> str | None:
    """The first channel line whose fields cannot be read, as one line naming the field and quoting
    the line (``malformed result record (record 2 in OOMTUNE_RESULT_FILE): samples='lots' is not a
    finite number >= 0: {"event": ...}``; records count the readable JSON lines); None
    when every line can be read. Also a throughput the lines' figures make infinite (huge samples
    over tiny seconds). Never raises."""
    for i, event in enumerate(events, 1):
        problem = _line_problem(event)
        if problem is None and event.get("event") == "report":
            with contextlib.suppress(TypeError, ValueError, OverflowError, ZeroDivisionError):
                rate = float(event["samples"]) / float(event["seconds"])
                if rate > _HUGE:
                    problem = f"samples/seconds = {rate:g} samples/s is not a throughput"
        if problem is not None:
            text = json.dumps(event, default=repr)
            quoted = text if len(text) <= _QUOTE_CHARS else text[:_QUOTE_CHARS] + "..."
            return f"malformed result record (record {i} in {RESULT_FILE_ENV}): {problem}: {quoted}"
    return None


def _rank_of(event: dict[str, Any]) -> int | None:
    """The rank a channel line names (an int >= 0), None when it names none or not a rank."""
    rank = event.get("rank")
    return rank if isinstance(rank, int) and not isinstance(rank, bool) and rank >= 0 else None


def _update(rec: ResultDraft, section: str, **changes: Any) -> None:
    """Replace fields of the record's ``memory`` or ``throughput`` section. The figures come from the
    user's command (its channel lines): one that the record refuses (a negative or fractional byte
    count, a fraction outside [0, 1]) is left out and named in ``script.rejected_readings``, since
    building the record never raises."""
    try:
        rec.update(section, **changes)
    except ValueError as exc:
        _reject(rec, exc)


def _reject(rec: ResultDraft, exc: BaseException) -> None:
    """Name a refused reading in ``script.rejected_readings``."""
    rec.update("script", rejected_readings=(*rec.result.script.rejected_readings, str(exc)))


def _set(rec: ResultDraft, outcome: Outcome | str, message: str | None, advice: str | None,
         tail: str | None) -> None:
    outcome = Outcome(outcome)
    rec.set(outcome=outcome, message=message, advice=advice)
    if outcome.is_fault:
        rec.set(traceback_tail=tail)


def _tail(stderr: str, lines: int = 20) -> str | None:
    kept = stderr.strip().splitlines()[-lines:]
    return "\n".join(kept) if kept else None


def _fill_throughput(result: ResultDraft, reports: list[dict[str, Any]]) -> None:
    """Per process (``rank``; one group when the lines carry none): samples and seconds summed over
    its reports; throughput = the sum of every rank's samples / the slowest rank's seconds
    (:func:`oomtune.trial.rank_records.global_throughput`: the ranks train at once, each sample is
    counted once), so one process's reports give sum(samples) / sum(seconds). Step time (the slowest
    rank's) and data-wait fraction (the highest) when reported."""
    from oomtune.trial.rank_records import global_throughput

    by_rank: dict[Any, list[dict[str, Any]]] = {}
    for r in reports:
        by_rank.setdefault(r.get("rank"), []).append(r)
    intervals, step_times, waits_ok, fractions, steps_run = [], [], True, [], []
    for lines in by_rank.values():
        samples = sum(float(r.get("samples") or 0) for r in lines)
        seconds = sum(float(r.get("seconds") or 0) for r in lines)
        if seconds <= 0:
            continue
        intervals.append((samples, seconds))
        steps = [r.get("steps") for r in lines]
        if all(isinstance(s, int) and s > 0 for s in steps):
            steps_run.append(sum(steps))
            step_times.append(seconds / sum(steps))
        waits = [r.get("data_wait_seconds") for r in lines]
        if all(isinstance(w, (int, float)) for w in waits):
            fractions.append(min(1.0, max(0.0, sum(waits) / seconds)))
        else:
            waits_ok = False
    if not reports or not intervals:
        return
    changes: dict[str, Any] = {"samples_per_s": global_throughput(intervals)}
    if step_times and len(step_times) == len(intervals):
        changes.update(steps=max(steps_run), step_time_s=max(step_times))
    if waits_ok and fractions:
        changes["data_wait_fraction"] = max(fractions)
    _update(result, "throughput", **changes)
    result.update("script", reported=tuple(ScriptReports.encode(r.get("extra") or {}) for r in reports))
    ranks = sorted(r for r in by_rank if r is not None)
    if ranks:
        result.update("script", reporting_ranks=tuple(ranks))


def _set_rank_memory(result: ResultDraft, memories: dict[Any, dict[str, Any]]) -> None:
    """Several ranks' last memory readings: the worst rank's peaks, each rank's kept
    (:func:`oomtune.trial.rank_records.merge_memory`, ``ranks``)."""
    from oomtune.trial.rank_records import merge_memory, rank_summary

    order = sorted(memories, key=lambda r: (r is None, r if r is not None else 0))
    records = []
    for rank in order:
        rec = ResultDraft(TrialResult(outcome=Outcome.OK))
        _set_memory(rec, memories[rank])
        for line in rec.result.script.rejected_readings:
            _reject(result, ValueError(line))
        records.append(rec.result)
    result.result = merge_memory(result.result, records)
    result.update("memory", source=records[0].memory.source)
    if result.result.worst_rank is not None:
        result.set(worst_rank=order[result.result.worst_rank])   # as the ranks number themselves
    # the lines carry figures, not the ranks' outcomes
    result.set(ranks=tuple(replace(rank_summary(0 if rank is None else rank, rec), outcome=None)
                           for rank, rec in zip(order, records)))


def _set_memory(rec: ResultDraft, memory: dict[str, Any]) -> None:
    """Peaks and counters from a ``memory_stats()`` mapping (torch's keys); absent keys stay None."""
    stats = memory.get("stats") or {}
    if memory.get("source") in (MEMORY_SOURCE_DEVICE, MEMORY_SOURCE_SIMULATED):
        rec.update("memory", source=memory["source"])
    try:
        rec.result = rec.result.fill_memory_stats(stats)
    except (ValueError, TypeError, AttributeError) as exc:   # not torch's memory_stats(): left unknown
        _reject(rec, exc)

