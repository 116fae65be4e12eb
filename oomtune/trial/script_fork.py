"""``target=cmd`` trials of ``python SCRIPT.py ARGS`` forked from a warm interpreter.

A training script pays its imports in every trial: on a 2-core CPU ``import torch`` takes about 2.5 s
of CPU, ``import lightning.pytorch`` about 9 s and ``from transformers import Trainer`` about 8 s,
more than the steps a trial measures. When a command is exactly this interpreter running a
``.py`` file (``python train.py --lr 3e-4``, ``{sys.executable} train.py``) or a module of its
working directory (``python -m train``, ``python -m pkg.train``), the trial runs it in a
process forked from a fork server (:mod:`oomtune.trial.forkserver`) that imported, once, the
third-party modules the script imports at module level (read from its source, not run), and
torch with what a training loop's first optimizer imports (:func:`server_modules`; none of it for a
script that, with its local modules, imports only the standard library and oomtune). The forked
process is the trial's keeper's main process as a spawned command would be
(:mod:`oomtune.trial.keeper`: same tree kill, timeout, bounded logs and status file); it sets the
trial's environment and directory and runs the file as ``python`` would
(:func:`oomtune.trial.script_main.run_script`).

What a preloaded import could see differently, and why it does not:

* The environment. The server is started with the trial's environment less the variables that
  change from trial to trial (``OOMTUNE_*``, among them the trial's marker, which the sweep for a
  trial's leftover processes looks for, and the allocator string, which torch reads when the
  allocator first runs, not at import: :mod:`oomtune.trial.forkserver`); a trial whose other
  variables differ gets a server of its own (:func:`server_key`). ``backend:cudaMallocAsync`` is read
  at import: those trials are spawned. The forked process's environment is the trial's whole one.
* The script's own modules. Only modules found in a ``site-packages`` (or ``dist-packages``)
  directory are preloaded, never one beside the script or in its working directory, and never
  oomtune's (its integrations read the trial's variables).
* CUDA, threads. The server's checks apply (no CUDA initialised, no libcuda mapped, no thread
  started after its imports: OpenBLAS pools, which scipy's and numpy's imports start, register
  ``pthread_atfork`` handlers); a server that is not fork-safe is given up and the trial is
  spawned, as is any command that is not exactly ``python FILE.py ...`` or ``python -m MODULE ...``
  with the module in the working directory (flags such as ``-u``, an installed module such as
  ``torch.distributed.run``, a shell command, another interpreter or virtual environment, ``torchrun``).
* The answer. The winner is confirmed in a freshly spawned process (the confirmation runner's
  ``launcher="spawn"``), so a configuration is never recommended on the strength of a forked run
  alone; ``trial.launcher=spawn`` spawns every trial.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import shutil
import sys
import threading
from pathlib import Path
from typing import Any

from oomtune.trial.forkserver import (ALLOC_ENV_VARS, TRAINING_PRELOADS, ForkServerClient, ForkServerError,
                                      backend_refusal)

__all__ = ["script_of", "preloads_of", "server_modules", "server_key", "ScriptServers"]

#: Variables that differ between the trials of one search (never part of a server's identity).
_PER_TRIAL_PREFIX = "OOMTUNE_"
#: Top-level packages never preloaded: oomtune's own (its integrations read the trial's variables).
_NEVER = frozenset({"oomtune"})


def script_of(argv: list[str], *, cwd: str, env: dict[str, str], python: str = sys.executable) -> Path | None:
    """The file a command runs when it is exactly ``PYTHON FILE.py [ARGS...]`` or ``PYTHON -m MODULE
    [ARGS...]`` with ``PYTHON`` this interpreter (the same file, or a name in its directory resolving
    to the same binary: ``python`` and ``python3`` of one virtual environment) and ``MODULE`` a module
    of the working directory (``-m`` puts it first on ``sys.path``: ``MODULE.py``, or a package's
    ``__main__.py``); else None (the command is spawned: other flags, an installed module such as
    ``torch.distributed.run``, another program).

    Args:
        argv: the command's words (not a shell command).
        cwd: the command's working directory (relative paths are resolved against it).
        env: the command's environment (``PATH`` finds a bare interpreter name).
    """
    if len(argv) < 2 or not _same_interpreter(argv[0], cwd=cwd, env=env, python=python):
        return None
    if argv[1] == "-m":
        return _module_file(argv[2], cwd) if len(argv) > 2 else None
    if not argv[1].endswith(".py") or argv[1].startswith("-"):
        return None
    script = Path(argv[1]) if os.path.isabs(argv[1]) else Path(cwd) / argv[1]
    return script if script.is_file() else None


def _same_interpreter(prog: str, *, cwd: str, env: dict[str, str], python: str) -> bool:
    """Whether the program ``prog`` is the interpreter ``python``: in its directory (one environment)
    and the same binary."""
    if "/" in prog:
        found: str | None = prog if os.path.isabs(prog) else os.path.join(cwd, prog)
    else:
        found = shutil.which(prog, path=env.get("PATH", os.defpath))
    if not found:
        return False
    ours, found = os.path.abspath(python), os.path.abspath(found)
    return os.path.dirname(found) == os.path.dirname(ours) and os.path.realpath(found) == os.path.realpath(ours)


def _module_file(name: str, cwd: str) -> Path | None:
    """The file ``python -m name`` runs from the directory ``cwd`` (``a/b.py`` or ``a/b/__main__.py``),
    found without importing anything; None when it is not there (an installed module, a bad name)."""
    parts = name.split(".")
    if not all(part.isidentifier() for part in parts):
        return None
    base = Path(cwd).joinpath(*parts)
    for candidate in (base.with_name(parts[-1] + ".py"), base / "__main__.py"):
        if candidate.is_file():
            return candidate
    return None


def _third_party(top: str, local_dirs: tuple[str, ...]) -> bool:
    """Whether the top-level package ``top`` is installed in a site-packages directory (not beside
    the script, not in its working directory, not oomtune's)."""
    if top in _NEVER or top in sys.builtin_module_names:
        return False
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return False
    where = [spec.origin] if spec is not None and spec.origin else list(getattr(spec, "submodule_search_locations", None) or [])
    if not where:
        return False
    for path in where:
        real = os.path.realpath(path)
        parts = Path(real).parts
        if "site-packages" not in parts and "dist-packages" not in parts:
            return False
        if any(real == d or real.startswith(d + os.sep) for d in local_dirs):
            return False
    return True


def preloads_of(script: Path, *, cwd: str) -> tuple[str, ...]:
    """The module-level imports of ``script`` that a fork server may import for it: ``module`` for
    ``import module``, ``module:name`` for ``from module import name``, of installed third-party
    packages only (:func:`_third_party`), in the script's order. Imports inside functions, classes or
    ``if`` blocks are left to the script (they may depend on its arguments); those in a module-level
    ``try`` are kept (the server skips one that fails). A file that does not parse: none."""
    try:
        tree = ast.parse(script.read_text(encoding="utf-8", errors="replace"), filename=str(script))
    except (OSError, SyntaxError, ValueError):
        return ()
    local = tuple(os.path.realpath(d) for d in {str(script.resolve().parent), cwd})
    nodes: list[ast.stmt] = []
    for node in tree.body:
        nodes.extend(node.body if isinstance(node, ast.Try) else [node])
    out: list[str] = []
    for node in nodes:
        if isinstance(node, ast.Import):
            items = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            items = [f"{node.module}:{alias.name}" if alias.name != "*" else node.module for alias in node.names]
        else:
            continue
        for item in items:
            if item not in out and _third_party(item.split(".")[0].split(":")[0], local):
                out.append(item)
    return tuple(out)


def server_modules(script: Path, *, cwd: str) -> tuple[str, ...]:
    """What ``script``'s fork server imports before it forks the script's trials: torch and
    :data:`oomtune.trial.forkserver.TRAINING_PRELOADS` (what its first optimizer imports), then the
    script's own module-level third-party imports (:func:`preloads_of`), when the script or a local
    module it imports imports any package outside the standard library and oomtune
    (:func:`oomtune.sources.imported_packages`: a training script's torch, directly or through
    Lightning or transformers); nothing for a script of the standard library and oomtune alone,
    which would never import torch (importing it would cost each server seconds of CPU for nothing).
    A script that cannot be read: torch and the training preloads (the script may still import
    them)."""
    from oomtune.sources import imported_packages

    packages = imported_packages(script)
    if packages is not None and not (packages - _NEVER):
        return preloads_of(script, cwd=cwd)
    return tuple(dict.fromkeys(("torch", *TRAINING_PRELOADS, *preloads_of(script, cwd=cwd))))


def server_key(env: dict[str, str], cwd: str, preloads: tuple[str, ...]) -> tuple[Any, ...]:
    """What a script server is shared on: its preloads, working directory and the environment less
    the per-trial variables (``OOMTUNE_*``, the allocator string)."""
    fixed = tuple(sorted((k, v) for k, v in env.items()
                         if not k.startswith(_PER_TRIAL_PREFIX) and k not in ALLOC_ENV_VARS))
    return preloads, cwd, fixed


class ScriptServers:
    """The fork servers of one runner's ``target=cmd`` scripts, one per :func:`server_key`, started
    on a script's first trial and kept until :meth:`close`. Thread-safe.

    Args:
        python: the interpreter (the commands it serves are this interpreter's).
    """

    def __init__(self, python: str = sys.executable) -> None:
        self.python = python
        self._servers: dict[tuple[Any, ...], Any] = {}
        self._failed: dict[tuple[Any, ...], str] = {}
        self._lock = threading.Lock()

    def launch(self, argv: list[str], *, cwd: str, env: dict[str, str], workdir: Path, grace_s: float,
               status_file: str) -> tuple[Any | None, str | None]:
        """Fork the command ``argv`` from its script's server: (the keeper's handle, with ``pid`` and
        ``wait(timeout)``, and None), or (None, why it is to be spawned). Never raises.

        ``workdir`` receives ``stdout.txt`` and ``stderr.txt``; ``status_file`` is the keeper's status
        file name in it (:data:`oomtune.trial.keeper.STATUS_FILE`).
        """
        script = script_of(argv, cwd=cwd, env=env, python=self.python)
        if script is None:
            return None, "not a `python FILE.py` or `python -m MODULE` command of this interpreter"
        from oomtune.alloc.settings import AllocatorSettings

        conf = next((env[v] for v in ALLOC_ENV_VARS if env.get(v)), "")   # the trial's string (both hold it)
        refusal = backend_refusal(AllocatorSettings.parse(conf).as_mapping().get("backend"))
        if refusal:
            return None, refusal
        preloads = server_modules(script, cwd=cwd)
        key = server_key(env, cwd, preloads)
        try:
            with self._lock:
                if key in self._failed:
                    return None, self._failed[key]
                server = self._servers.get(key)
                if server is None or not server.alive:
                    server = ForkServerClient(self.python, modules=preloads, env=dict(key[2]), cwd=cwd,
                                              log_path=str(Path(workdir) / "forkserver.log"))
                    try:
                        server.start()
                    except ForkServerError as exc:
                        self._failed[key] = str(exc)
                        raise
                    self._servers[key] = server
                unsafe = server.unsafe_reason()   # the script's imports touched CUDA in the server
                if unsafe:
                    self._failed[key] = unsafe
                    raise ForkServerError(unsafe)
            handle = server.launch(argv=[], cwd=cwd, stdout=str(Path(workdir) / "stdout.txt"),
                                   stderr=str(Path(workdir) / "stderr.txt"), env=env, grace_s=grace_s,
                                   status=str(Path(workdir) / status_file), script=list(argv[1:]))
        except (ForkServerError, OSError, ValueError) as exc:   # the server, its pipe or its answer
            with self._lock:
                self._failed.setdefault(key, str(exc))
            return None, str(exc)
        return handle, None

    def close(self) -> None:
        """Stop every server (each has its live trials' keepers kill their trees)."""
        with self._lock:
            servers, self._servers = list(self._servers.values()), {}
        for server in servers:
            server.close()
