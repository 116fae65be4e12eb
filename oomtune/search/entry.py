"""``oomtune search``: where a search starts. The config is composed and checked here; the trials run
in this process (:func:`oomtune.search.run.search_here`) or, with ``launcher=local|slurm``, on
worker jobs that this process submits and follows (:func:`oomtune.search.jobs.launch`). The CLI
module only parses arguments and calls :func:`search`; tests call :func:`search` with overrides, as
with Hydra's compose API."""

from __future__ import annotations

import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from oomtune import interrupts
from oomtune.search.jobs import launch
from oomtune.search.run import _say, compose_search, prepare_search, search_here, write_search_outputs

__all__ = ["search"]


def search(overrides: Sequence[str] = (), *, console: Any = None) -> Path:
    """Run the whole search; returns the path of the written best.yaml.

    With ``launcher=inprocess`` (the default) the trials run on ``search.workers`` worker threads of
    this process; with ``launcher=local|slurm`` on ``search.workers`` worker jobs, which this process
    submits, follows and whose answer it writes (:func:`oomtune.search.jobs.launch`).

    Raises:
        ConfigError / DeviceError / AllocatorConfigError: bad input, before any trial starts and
            before anything is written.
        SetupFault: the workload fails at the smallest batch with the default allocator.
        KeyboardInterrupt: Ctrl-C/SIGTERM; finished trials stay in storage, running ones are killed.
    """
    import optuna

    optuna.logging.set_verbosity(optuna.logging.ERROR)  # trial failures are reported by oomtune
    from oomtune.display import output_console, starting

    console = console or output_console(stderr=True)
    out = output_console(stderr=False) if console.stderr else console
    from oomtune.search.launchers import launched, launcher_name

    with starting(console):  # a spinner on a terminal while the config is checked and torch imported
        cfg = compose_search(overrides)
        # a SLURM job's device is its node's: this machine (a login node) resolves none of it
        p = None if launcher_name(cfg) == "slurm" else prepare_search(overrides, cfg=cfg)
    if launched(cfg):
        return launch(overrides, cfg, p, console=console, out=out)
    # a stop signal while the outputs are written (after the last trial) stops the command as during
    # the trials, with the same line (found by a new user: SIGTERM there ended the process silently,
    # and a Ctrl-C whose raise CPython dropped let it exit 0)
    with interrupts.stopping_on((signal.SIGTERM, signal.SIGINT)):
        searched = search_here(p, overrides, console=console)
        try:
            written = write_search_outputs(searched, out=out)
            interrupts.raise_if_pending()
        except KeyboardInterrupt:
            _say(console, f"interrupted: finished trials are saved in {searched.url}; run the same command to "
                          "resume (it writes best.yaml and the report from them)")
            raise
    return written
