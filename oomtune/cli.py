"""The ``oomtune`` command line: one sub-command per module in :mod:`oomtune.commands`.

Each command module exposes ``register(subparsers) -> argparse.ArgumentParser`` and
``run(args) -> int``. User-input problems (:class:`oomtune.exceptions.OomtuneError`, bad Hydra
overrides) print one line, ``oomtune: error: ...``, and exit with code 2. A run stopped by its
surroundings (:class:`oomtune.exceptions.ResumableError`: the storage unreachable past every retry,
a full disk) prints one line ending in "run the same command to resume" and exits with code 1.
Ctrl-C exits 130, SIGTERM 143 (128 + the signal number, as a shell reports a
process killed by it), and the process ends then even where a thread that is not a daemon would
keep the interpreter waiting (:func:`console_main`). A reader that went away (``oomtune show
--json | head``) ends the command with exit code 1 and no traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from oomtune import __version__

__all__ = ["main", "console_main", "COMMANDS"]

#: Seconds a stopped run's process waits for its threads that are not daemons before it exits
#: without them (:func:`console_main`).
STOP_JOIN_S = 5.0

#: Sub-command name -> module under oomtune.commands.
COMMANDS = {
    "search": "search",
    "plan": "plan",
    "check": "check",
    "simulate": "simulate",
    "show": "show",
    "env": "env",
    "report": "report",
    "best": "best",
    "storage-proxy": "storage_proxy",
}


class _OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (``oomtune simulate: error: ...``) and exit code 2,
    with a "did you mean" suggestion for a mistyped sub-command or flag (:func:`_did_you_mean`)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}{_did_you_mean(self, message)} (see {self.prog} --help)\n")


def _option_strings(parser: argparse.ArgumentParser) -> list[str]:
    """Every ``--flag`` of ``parser`` and of the sub-command parsers it holds."""
    out = [o for a in parser._actions for o in a.option_strings]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out += [o for a in sub._actions for o in a.option_strings]
    return sorted(set(out))


def _did_you_mean(parser: argparse.ArgumentParser, message: str) -> str:
    """``"; did you mean 'search'?"`` for argparse's invalid-choice and unrecognised-argument
    messages when a close match exists (difflib); for a flag of search/plan that names a config key
    (``--budget 2GiB``, ``--workers=4``), the Hydra override meant (``budget=2GiB``,
    ``search.workers=4``); else ``""``."""
    import difflib
    import re

    m = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
    if m:
        match = difflib.get_close_matches(m[1], re.findall(r"'([^']*)'", m[2]), n=1, cutoff=0.6)
        return f"; did you mean {match[0]!r}?" if match else ""
    m = re.search(r"unrecognized arguments: (.*)", message)
    if m:
        options = _option_strings(parser)
        argv = list(getattr(parser, "argv", []))   # set by main
        config_keys = _config_keys() if _takes_overrides(parser, argv) else {}
        split = _split_value(argv, m[1].split()[0]) if config_keys else None
        if split:
            return split
        for word in m[1].split():
            flag, eq, value = word.partition("=")
            key = config_keys.get(flag[2:].replace("-", "_")) if flag.startswith("--") else None
            if key is not None:
                # search/plan settings are Hydra overrides, key=value without dashes
                if not eq:   # --budget 2GiB: the value is the next word, which argparse took as an override
                    rest = argv[argv.index(flag) + 1:] if flag in argv else []
                    after = rest[0] if rest else ""
                    value = after if after and not after.startswith("-") and "=" not in after else "VALUE"
                return f"; settings are Hydra overrides, written without dashes: {key}={value}"
            if flag.startswith("-"):
                match = difflib.get_close_matches(flag, options, n=1, cutoff=0.6)
                if match:
                    return f"; did you mean {match[0]!r} for {flag!r}?"
                if flag.startswith("--") and "=" in word and len(flag) > 2:
                    # search/plan settings are Hydra overrides, written key=value without dashes
                    return f"; settings are Hydra overrides, written without dashes: {word.lstrip('-')}"
    return ""


def _split_value(argv: Sequence[str], first: str) -> str | None:
    """For ``oomtune search target.command=python train.py --batch-size 8``: the shell split an
    unquoted value with spaces, and argparse refused its ``--flag`` words. When the word before the
    first refused one (``first``) is no ``KEY=VALUE`` or flag, the hint to quote the whole value
    (:func:`oomtune.config.split_value`); else None."""
    from oomtune.config import split_value

    if first not in argv:
        return None
    at = list(argv).index(first)
    if at < 2 or "=" in argv[at - 1] or argv[at - 1].startswith("-"):
        return None
    rejoined = split_value(argv, at)
    return f"; a value with spaces the shell split? quote the whole value inside one argument: {rejoined}" \
        if rejoined else None


def _command_of(argv: Sequence[str]) -> str | None:
    """The sub-command named in ``argv``: its first word that is not a flag (None without one)."""
    return next((a for a in argv if not a.startswith("-")), None)


def _takes_overrides(parser: argparse.ArgumentParser, argv: Sequence[str]) -> bool:
    """Whether the sub-command ``argv`` names takes Hydra overrides (a positional ``overrides``, as
    search and plan do)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            sub = action.choices.get(_command_of(argv))
            return sub is not None and any(a.dest == "overrides" for a in sub._actions)
    return False


def _config_keys() -> dict[str, str]:
    """What a ``--flag`` meant to set, by its name: the top-level keys and config groups of
    conf/config.yaml (``budget`` -> ``budget``, ``model`` -> ``model``) and, where the name is not
    one of those, the keys one level down, in config.yaml's mappings and in each group's files
    (``workers`` -> ``search.workers``). Empty when the conf/ directory is missing or unreadable."""
    from oomtune.config import conf_dir
    from oomtune.exceptions import ConfigError
    from oomtune.safeload import read_yaml

    try:   # size- and depth-limited reads (oomtune.safeload), as every YAML file oomtune reads
        conf = conf_dir()
        top = read_yaml(conf / "config.yaml", what="oomtune's config.yaml") or {}
        groups = {p.name: [read_yaml(f, what="a config group option") or {} for f in sorted(p.glob("*.yaml"))]
                  for p in sorted(conf.iterdir()) if p.is_dir()}
    except (ConfigError, OSError):
        return {}
    keys = {k: k for k in [*top, *groups] if k not in ("defaults", "hydra")}
    nested = [(k, v) for k, v in top.items() if isinstance(v, dict) and k != "hydra"]
    nested += [(g, doc) for g, docs in groups.items() for doc in docs if isinstance(doc, dict)]
    for parent, mapping in nested:
        for child in mapping:
            keys.setdefault(str(child), f"{parent}.{child}")
    return keys


def _build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog="oomtune",
        description="Tune batch size and PyTorch CUDA caching-allocator settings under a memory budget.",
    )
    parser.add_argument("--version", action="version", version=f"oomtune {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_OneLineParser)
    sub.required = True
    for name, module in COMMANDS.items():
        if only is not None and name != only:
            # Keep --help listing every command without importing all of them.
            sub.add_parser(name, help=_HELP.get(name))
            continue
        mod = importlib.import_module(f"oomtune.commands.{module}")
        mod.register(sub)
    return parser


_HELP = {
    "search": "run the tuning study (Hydra overrides, e.g. model=resnet budget=16GiB)",
    "plan": "predict the feasibility map with the virtual GPU, without running trials",
    "check": "CI regression check of a best.yaml (run or predict)",
    "simulate": "replay a torch.cuda.memory._snapshot() pickle under allocator settings",
    "show": "print the trial table of a run directory or a best.yaml",
    "env": "print the export line of a best.yaml",
    "report": "write the HTML report of a run directory (search or plan)",
    "best": "print the best.yaml recorded in a study's storage (any machine)",
    "storage-proxy": "serve a study database to many workers through Optuna's gRPC storage proxy",
}


def _resumable(message: str) -> str:
    """A :class:`oomtune.exceptions.ResumableError`'s line, ending in what to do next."""
    first = message.strip().splitlines()[0] if message.strip() else "stopped"
    return first if "run the same command" in first else f"{first}; then run the same command to resume"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``oomtune`` console script; returns the process exit code."""
    from oomtune.exceptions import OomtuneError, ResumableError

    argv = list(sys.argv[1:] if argv is None else argv)
    command = _command_of(argv)
    parser = _build_parser(command if command in COMMANDS else None)
    parser.argv = argv   # for the "did you mean" of an unrecognised flag (_did_you_mean)
    args = parser.parse_args(argv)  # argparse itself exits 2 on bad flags
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()   # a closed pipe shows here, not in the interpreter's exit flush
        return code
    except OomtuneError as exc:
        print(f"oomtune: error: {exc}", file=sys.stderr)
        return 2
    except ResumableError as exc:
        print(f"oomtune: {_resumable(str(exc))}", file=sys.stderr)
        return 1
    except BrokenPipeError:   # before OSError, its base class
        # the reader went away (``oomtune show --json | head``). Point stdout at devnull so the
        # interpreter's final flush does not raise again, and exit 1 without a traceback, as the
        # Python docs' "Note on SIGPIPE" does and as rich's Console.on_broken_pipe does for the
        # commands that print through rich.
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as exc:
        from oomtune.files import disk_full_error, is_disk_full

        if not is_disk_full(exc):
            raise
        print(f"oomtune: {_resumable(str(disk_full_error(exc.filename or 'a file', exc)))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        import signal

        signum = getattr(exc, "signum", signal.SIGINT)   # oomtune.exceptions.Interrupted
        name = "interrupted" if signum == signal.SIGINT else f"terminated ({signal.Signals(signum).name})"
        print(f"oomtune: {name}", file=sys.stderr)
        return 128 + int(signum)   # as a shell reports death by that signal: 130 Ctrl-C, 143 SIGTERM


def console_main() -> None:
    """The ``oomtune`` console script and ``python -m oomtune``: :func:`main`, then exit with its code
    through :func:`oomtune.exiting.exit_now` (the interpreter's exit without its teardown of every
    module, 1.6-2.8 s of a search's exit: experiments/results/bench_exit.txt).

    A run stopped by a signal (exit 130 or 143) ends even where a thread that is not a daemon (a
    library's, such as Optuna's heartbeat thread, whose ``__exit__`` a signal can skip) is still
    alive: the interpreter would wait for it for ever at exit. Such threads get :data:`STOP_JOIN_S`
    seconds in all; then the output is flushed, one line names them, and the process exits at once
    (``os._exit``, without ``atexit`` handlers, as the signal's default action would have ended it).

    Raises:
        SystemExit: with :func:`main`'s exit code, where ``exit_now`` cannot skip the teardown.
    """
    import os
    import signal
    import threading
    import time

    from oomtune.exiting import exit_now, flush_std_streams

    code = main()
    if code in (128 + signal.SIGINT, 128 + signal.SIGTERM):
        deadline = time.monotonic() + STOP_JOIN_S
        waiting = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
        for t in waiting:
            t.join(max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in waiting if t.is_alive()]
        if alive:
            print(f"oomtune: exiting without waiting for thread(s) {', '.join(alive)} "
                  f"(still running {STOP_JOIN_S:g} s after the stop)", file=sys.stderr)
            flush_std_streams()
            os._exit(code)
    exit_now(code)

