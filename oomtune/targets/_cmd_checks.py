"""Checks of a ``target=cmd`` command before any trial runs.

- The script an interpreter is given must exist (``python trian.py`` would otherwise run a trial
  that dies with "can't open file" and exit status 2 without a result record).
- The trial's batch size must reach the command: ``{batch_size}`` in it, ``$OOMTUNE_BATCH_SIZE`` in
  a shell command, or a script that reads ``OOMTUNE_BATCH_SIZE``. Otherwise every trial would run at
  the script's own default while the trial table shows 8, 16, ..., 512.
- The command must not set ``PYTORCH_NO_CUDA_MEMORY_CACHING`` (:mod:`oomtune.alloc.caching_env`).

Each problem is a :class:`ConfigError` of one line (exit status 2).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from oomtune.exceptions import ConfigError

__all__ = ["check_command", "script_of", "check_script_exists", "check_batch_size_reaches_command",
           "check_no_caching_off", "check_training_reaches_command", "INTEGRATION_MARK"]

#: Text whose presence in a script means it uses one of oomtune's integrations
#: (:mod:`oomtune.integrations`), which read the trial's settings from the environment themselves.
INTEGRATION_MARK = "oomtune.integrations"

# Programs whose first positional argument is a script file (python, python3.12, bash, ...).
_INTERPRETER_RE = re.compile(r"^(?:python[\d.]*|pypy[\d.]*|bash|sh|zsh|dash|ksh|node|perl|ruby|Rscript|julia)$")
# Launchers whose script is the first argument that looks like a file (after their own options).
_LAUNCHERS = frozenset({"torchrun", "accelerate", "deepspeed", "horovodrun", "mpirun", "srun", "uv", "poetry"})
# Launcher modules run as ``python -m MODULE ... train.py``: torch's docs give ``python -m
# torch.distributed.run`` as the same as ``torchrun`` (torch/distributed/run.py; ``launch`` is its
# deprecated predecessor, which takes the same script argument).
_LAUNCHER_MODULES = frozenset({"torch.distributed.run", "torch.distributed.launch"})
_SCRIPT_SUFFIXES = (".py", ".sh", ".bash", ".js", ".pl", ".rb", ".R", ".jl")
# python options that take a value in the next argument; -c/-m end the interpreter's options.
_PY_OPTS_WITH_VALUE = frozenset({"-W", "-X", "--check-hash-based-pycs"})
_BATCH_ENV = "OOMTUNE_BATCH_SIZE"
_NO_CACHING = "PYTORCH_NO_CUDA_MEMORY_CACHING"


def script_of(argv: list[str]) -> str | None:
    """The script file argument of an interpreter or launcher command line, as written; None when
    there is none (``python -c ...``, ``python -m pkg``, a program that is not an interpreter).

    ``python [options] SCRIPT ...``: the first positional argument. ``torchrun ... train.py``,
    ``python -m torch.distributed.run ... train.py``, ``accelerate launch ... train.py``: the first
    argument ending in a script suffix (.py, .sh, ...).
    """
    if not argv:
        return None
    prog = os.path.basename(argv[0])
    if _INTERPRETER_RE.match(prog):
        i = 1
        while i < len(argv):
            arg = argv[i]
            if arg == "-m" or (prog.startswith(("python", "pypy")) and arg.startswith("-m") and len(arg) > 2):
                module = argv[i + 1] if arg == "-m" and i + 1 < len(argv) else arg[2:]
                rest = argv[i + (2 if arg == "-m" else 1):]
                if module in _LAUNCHER_MODULES:
                    return next((a for a in rest if not a.startswith("-") and a.endswith(_SCRIPT_SUFFIXES)), None)
                return None
            if arg == "-c" or (prog.startswith(("python", "pypy")) and arg.startswith("-c") and len(arg) > 2):
                return None
            if arg == "--":
                return argv[i + 1] if i + 1 < len(argv) else None
            if arg.startswith("-"):
                i += 2 if arg in _PY_OPTS_WITH_VALUE else 1
                continue
            return arg
        return None
    if prog in _LAUNCHERS:
        return next((a for a in argv[1:] if not a.startswith("-") and a.endswith(_SCRIPT_SUFFIXES)), None)
    return None


def _script_path(argv: list[str], cwd: str | None) -> tuple[str, Path] | None:
    script = script_of(argv)
    if script is None:
        return None
    path = Path(script).expanduser()
    return script, (path if path.is_absolute() else Path(cwd or os.getcwd()) / path)


def check_script_exists(argv: list[str], cwd: str | None) -> None:
    """Refuse an interpreter (or launcher) whose script file does not exist, relative to ``cwd``.

    Raises:
        ConfigError: ``target.command: script 'trian.py' not found in /dir``.
    """
    found = _script_path(argv, cwd)
    if found is None:
        return
    script, path = found
    if not path.is_file():
        where = cwd or os.getcwd()
        raise ConfigError(f"target.command: script {script!r} not found in {where} ({os.path.basename(argv[0])} "
                          "would exit with status 2 in every trial); fix the path or set target.cwd")


def _script_mentions(path: Path, *words: str) -> bool:
    """Whether the file's first 4 MiB contain any of ``words``."""
    try:
        with open(path, "rb") as f:
            head = f.read(4 << 20)
    except OSError:
        return False
    return any(w.encode() in head for w in words)


def _reads_batch_env(path: Path) -> bool:
    return _script_mentions(path, _BATCH_ENV, INTEGRATION_MARK)


def _script_file(argv: list[str], cwd: str | None) -> Path | None:
    found = _script_path(argv, cwd)
    if found is None and argv and "/" in argv[0]:
        prog = Path(argv[0]).expanduser()
        return prog if prog.is_absolute() else Path(cwd or os.getcwd()) / prog
    return None if found is None else found[1]


def check_training_reaches_command(command: object, argv: list[str], cwd: str | None, *,
                                   accumulates: bool, checkpointing: bool) -> None:
    """Refuse a search whose training settings would not reach the command:

    - with ``search.global_batch`` the micro-batches per optimizer step vary by trial: the command
      needs ``{grad_accum}`` (or ``{global_batch}``, from which the script divides), or a script
      that reads ``OOMTUNE_GRAD_ACCUM`` or uses an integration (``oomtune.integrations``);
    - with ``search.space.activation_checkpointing``: ``{activation_checkpointing}``, or a script that
      reads ``OOMTUNE_ACTIVATION_CHECKPOINTING`` or uses the Hugging Face or Lightning integration
      (each sets the trial's value: the Trainer's ``gradient_checkpointing``, the LightningModule's
      ``activation_checkpointing`` attribute).

    Otherwise every trial would train the same step while the table shows different ones.

    Raises:
        ConfigError: one line naming the missing placeholder and how to pass it.
    """
    text = " ".join(command) if isinstance(command, (list, tuple)) else str(command)
    text = text.replace("{{", "").replace("}}", "")
    script = _script_file(argv, cwd)
    if accumulates and "{grad_accum}" not in text and "{global_batch}" not in text \
            and "OOMTUNE_GRAD_ACCUM" not in text \
            and not (script is not None and _script_mentions(script, "OOMTUNE_GRAD_ACCUM", INTEGRATION_MARK)):
        raise ConfigError("search.global_batch is set but target.command has no {grad_accum} placeholder: every "
                          "trial would run the script's own accumulation; pass it, e.g. target.command='python "
                          "train.py --batch-size {batch_size} --grad-accum {grad_accum}', or use an integration "
                          "(oomtune.integrations)")
    if checkpointing and "{activation_checkpointing}" not in text and "OOMTUNE_ACTIVATION_CHECKPOINTING" not in text \
            and not (script is not None and _script_mentions(script, "OOMTUNE_ACTIVATION_CHECKPOINTING",
                                                             INTEGRATION_MARK + ".huggingface",
                                                             INTEGRATION_MARK + ".lightning")):
        raise ConfigError("search.space.activation_checkpointing is searched but target.command has no "
                          "{activation_checkpointing} placeholder (1 or 0): pass it, e.g. target.command='python "
                          "train.py --batch-size {batch_size} --checkpointing {activation_checkpointing}'")


def check_batch_size_reaches_command(command: object, argv: list[str], cwd: str | None) -> None:
    """Refuse a command that never receives the trial's batch size.

    Accepted: ``{batch_size}`` in the command; ``OOMTUNE_BATCH_SIZE`` named in it (``$OOMTUNE_BATCH_SIZE``
    in a shell command); or its script (see :func:`script_of`; an executable program given as a path
    counts as its own script) contains the text ``OOMTUNE_BATCH_SIZE`` or uses an integration
    (``oomtune.integrations``, which sets the batch size itself).

    Raises:
        ConfigError: none of these holds; the message gives the fix.
    """
    text = " ".join(command) if isinstance(command, (list, tuple)) else str(command)
    if "{batch_size}" in text.replace("{{batch_size}}", "") or _BATCH_ENV in text:
        return
    found = _script_path(argv, cwd)
    if found is None and argv and "/" in argv[0]:
        prog = Path(argv[0]).expanduser()
        found = argv[0], (prog if prog.is_absolute() else Path(cwd or os.getcwd()) / prog)
    if found is not None and _reads_batch_env(found[1]):
        return
    reader = f"{found[0]!r} never reads {_BATCH_ENV}" if found is not None else f"it does not read {_BATCH_ENV}"
    raise ConfigError(f"target.command has no {{batch_size}} and {reader}: every trial would run at the "
                      f"script's own batch size; pass it, e.g. target.command='python train.py --batch-size "
                      f"{{batch_size}}', or read os.environ['{_BATCH_ENV}'] in the script")


def check_no_caching_off(command: object) -> None:
    """Refuse a command that sets PYTORCH_NO_CUDA_MEMORY_CACHING (any value turns the caching
    allocator off, pytorch#145661: every allocator setting would be a no-op).

    Raises:
        ConfigError: the command text names the variable.
    """
    text = " ".join(command) if isinstance(command, (list, tuple)) else str(command)
    if _NO_CACHING in text:
        raise ConfigError(f"target.command sets {_NO_CACHING}: torch turns its caching allocator off whenever "
                          "it exists, whatever its value (pytorch#145661), so every allocator setting would be a "
                          "no-op; remove it from the command")


def check_command(command: object, argv: list[str], shell: bool, cwd: str | None) -> None:
    """All checks of this module, in order: the script exists (not for ``/bin/sh`` commands, whose
    words the shell decides), the command does not turn the caching allocator off, the batch size
    reaches the command.

    Args:
        command: ``target.command`` as configured (a string or a list).
        argv: the command line :func:`oomtune.targets.cmd.build_command` made of it.
        shell: whether it runs through ``/bin/sh -c``.
        cwd: where it runs (None: our working directory).

    Raises:
        ConfigError: the first problem, in one line.
    """
    if not shell:
        check_script_exists(argv, cwd)
    check_no_caching_off(command)
    check_batch_size_reaches_command(command, [] if shell else argv, cwd)
