"""``target=cmd``: any training command, the trial process itself (:mod:`oomtune.targets.cmd`,
imported when a command is checked or run: this module, registered when :mod:`oomtune.targets` is
imported, imports nothing of it)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

from oomtune.trial._base import Target, register_target
from oomtune.workload_spec import WorkloadSpec

__all__ = ["CmdTarget", "TARGET"]

#: Seconds between SIGTERM and SIGKILL when a command is stopped (as :data:`oomtune.targets.cmd._GRACE_S`).
_GRACE_S = 3.0


class CmdTarget(Target):
    """``target=cmd``: the user's command is the trial process (:func:`oomtune.targets.cmd.run_cmd_trial`).
    It cannot be captured without running it; its trials record their allocation streams
    (:func:`oomtune.capture_hook`), and a launcher in the command (``torchrun``) starts its ranks."""

    name = "cmd"
    own_process = True
    starts_ranks = True
    records_streams = True

    def sources(self, target_cfg: Mapping[str, Any]) -> list[Path]:
        """The script the command runs (``python train.py``, ``torchrun ... train.py``; or the program
        itself when it is a script named by its path, ``./train.sh``), relative to ``target.cwd``;
        [] when there is none (a shell command line, ``python -m pkg``, a binary)."""
        from oomtune.exceptions import ConfigError
        from oomtune.targets._cmd_checks import _SCRIPT_SUFFIXES, _script_file
        from oomtune.targets.cmd import build_command, resolve_cwd

        target = dict(target_cfg)
        try:
            argv, shell = build_command(target, 1)
            cwd = resolve_cwd(target)
        except ConfigError:
            return []
        path = None if shell else _script_file(argv, cwd)
        # a script, not a program binary (an interpreter named by its path, e.g. `/usr/bin/python -m pkg`)
        if path is None or not path.is_file() or not path.name.endswith(_SCRIPT_SUFFIXES):
            return []
        return [path]

    def validate(self, target_cfg: Mapping[str, Any]) -> None:
        from oomtune.targets._cmd_checks import check_command
        from oomtune.targets.cmd import build_command, check_program, resolve_cwd

        target = dict(target_cfg)
        argv, shell = build_command(target, 1)
        cwd = resolve_cwd(target)
        if not shell:
            check_program(argv, cwd)
        check_command(target.get("command"), argv, shell, cwd)

    def resolve_paths(self, target_cfg: Mapping[str, Any], base: Path) -> dict[str, Any]:
        """``cwd`` made absolute; unset means ``base`` itself (the directory the command inherits
        when ``target.cwd`` is null), so relative paths in the command keep their meaning."""
        from oomtune.targets import _absolute

        out = dict(target_cfg)
        given = out.get("cwd")
        out["cwd"] = str(base.resolve()) if given in (None, "") else _absolute(str(given), base)
        return out

    def label(self, workload: WorkloadSpec) -> str:
        command = workload.target.get("command")
        text = " ".join(command) if isinstance(command, (list, tuple)) else str(command)
        return f"command {text!r}"

    def check_training(self, workload: WorkloadSpec, *, accumulates: bool, checkpointing: bool) -> None:
        from oomtune.targets._cmd_checks import check_training_reaches_command
        from oomtune.targets.cmd import build_command, resolve_cwd

        target = dict(workload.target)
        argv, shell = build_command(target, 1)
        check_training_reaches_command(target.get("command"), [] if shell else argv, resolve_cwd(target),
                                       accumulates=accumulates, checkpointing=checkpointing)

    def run(self, spec: Any, *, workdir: Path, env: dict[str, str] | None = None,
            grace_s: float = _GRACE_S, on_start: Callable[[int], None] | None = None, forks: Any = None) -> Any:
        from oomtune.targets.cmd import run_cmd_trial

        return run_cmd_trial(spec, workdir=workdir, env=env, grace_s=grace_s, on_start=on_start, forks=forks)


TARGET = register_target(CmdTarget())
