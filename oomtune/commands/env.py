"""``oomtune env best.yaml``: print the export line (eval it in a shell or a CI job). When the answer
needs a per-process memory fraction (best.yaml ``best.memory_fraction``), the line carries it as
``per_process_memory_fraction:F`` where the installed torch accepts that key; otherwise a comment line
says to call ``torch.cuda.set_per_process_memory_fraction(F)`` (a comment, so eval still works).
``oomtune env`` without a best.yaml: print this installation's environment (versions, the replay
core in use, the allocator variables set), torch not imported.

Warns on stderr when PYTORCH_NO_CUDA_MEMORY_CACHING is set: the exported settings would do nothing
(:mod:`oomtune.alloc.caching_env`); and, in one line, when the memory fraction was computed on the
virtual GPU's size rather than a real device's (:func:`oomtune.best.virtual_fraction_note`).
"""

from __future__ import annotations

import argparse

__all__ = ["register", "run", "replay_core_status"]

#: Environment variables that change what the caching allocator (or oomtune's replay) does.
ALLOCATOR_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_NO_CUDA_MEMORY_CACHING",
                       "OOMTUNE_PURE_PYTHON")


def register(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("env", help="print the export line of a best.yaml (no argument: this installation)",
                       description="Print `export PYTORCH_CUDA_ALLOC_CONF=... PYTORCH_ALLOC_CONF=...`; "
                       "use as: eval \"$(oomtune env runs/NAME/best.yaml)\". Without a best.yaml: print "
                       "oomtune's environment (versions, whether the compiled replay core is in use, the "
                       "allocator variables set).")
    p.add_argument("best", nargs="?", default=None, help="best.yaml or a run directory")
    p.add_argument("--batch-size", action="store_true", help="also export OOMTUNE_BATCH_SIZE")
    p.set_defaults(func=run)
    return p


def replay_core_status() -> str:
    """Which simulator replays traces here (:mod:`oomtune.alloc._compiled`), in words."""
    from oomtune.alloc import _compiled

    if _compiled.enabled():
        return "compiled (oomtune.alloc._fastcore), in use"
    if _compiled.available():
        return "compiled, but disabled by OOMTUNE_PURE_PYTHON=1: the pure-Python simulator runs (slower)"
    return ("not built: the pure-Python simulator runs (slower); build it with a C++ compiler and Cython "
            "installed: pip install . (or python setup.py build_ext --inplace in a checkout)")


def _environment_lines() -> list[str]:
    """``name: value`` lines of this installation, without importing torch (its version comes from
    the installed package's metadata)."""
    import os
    import platform

    from oomtune import __version__
    from oomtune.packages import installed_version

    def installed(name: str) -> str:
        return installed_version(name) or "not installed"

    lines = [f"oomtune: {__version__} ({os.path.dirname(os.path.dirname(os.path.abspath(__file__)))})",
             f"python: {platform.python_version()} ({platform.python_implementation()})",
             f"torch: {installed('torch')} (not imported)",
             f"replay core: {replay_core_status()}"]
    set_here = [f"{k}={os.environ[k]}" for k in ALLOCATOR_VARIABLES if k in os.environ]
    lines.append("allocator variables: " + (" ".join(set_here) if set_here else "none set"))
    from oomtune.best import FRACTION_KEY, fraction_key_supported

    lines.append(f"memory fraction in PYTORCH_CUDA_ALLOC_CONF ({FRACTION_KEY}): "
                 + ("accepted by the installed torch" if fraction_key_supported() else
                    "not accepted by the installed torch (apply_best returns it; call "
                    "torch.cuda.set_per_process_memory_fraction)"))
    return lines


def run(args: argparse.Namespace) -> int:
    import sys

    from oomtune.alloc.caching_env import caching_disabled_reason
    from oomtune.display import wrapped

    if args.best is None:
        if args.batch_size:
            from oomtune.exceptions import ConfigError

            raise ConfigError("--batch-size needs a best.yaml (oomtune env BEST.yaml --batch-size)")
        for line in _environment_lines():
            print("\n".join(wrapped(line)))
        return 0
    from oomtune.best import load_best

    best = load_best(args.best)
    reason = caching_disabled_reason()
    if reason is not None:  # stderr, so that eval "$(oomtune env ...)" still gets only the exports
        print(f"oomtune: warning: {reason}", file=sys.stderr)
    from oomtune.best import fraction_key_supported, virtual_fraction_note

    supported = fraction_key_supported()
    note = virtual_fraction_note(best)
    if note is not None:   # stderr, one line: the fraction printed below is of the virtual GPU's size
        print(f"oomtune: warning: {note}", file=sys.stderr)
    mismatch = best.workspace_mismatch()
    if mismatch is not None:   # stderr, so that eval gets only the exports
        print(f"oomtune: warning: {mismatch}", file=sys.stderr)
    print(best.export_line(fraction_key=supported))
    if best.memory_fraction is not None and not supported:
        print(f"# {best.fraction_advice()}")
    if args.batch_size:
        print(f"export OOMTUNE_BATCH_SIZE={best.batch_size}")
    return 0
