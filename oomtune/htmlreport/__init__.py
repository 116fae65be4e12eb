"""The HTML report of a run directory: ``oomtune report RUN_DIR`` and RUN_DIR/report.html after every
``oomtune search`` and ``oomtune plan``.

One self-contained file (plotly.js embedded, works offline) showing the memory frontier, throughput
against batch, the trial timeline, the winner's memory over one step and at its peak, the best.yaml
summary and what to do per failure class. Built only from stored artifacts (see :mod:`._data`).
Named apart from :func:`oomtune.report` (:mod:`oomtune.script_api`, called by a user's script): a subpackage
``oomtune.report`` would replace that function as an attribute of ``oomtune`` once imported.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from oomtune.htmlreport._data import FRONTIER_FILE, PLAN_FILE, STEP_FILE, RunData, gather

__all__ = ["build_report", "write_report", "write_search_report", "REPORT_FILE", "STEP_FILE", "FRONTIER_FILE",
           "PLAN_FILE", "RunData",
           "gather"]

REPORT_FILE = "report.html"


def _step_parts(data: RunData) -> tuple[list[tuple[str, Any, str]], str | None]:
    from oomtune.htmlreport._figures import peak_segments_figure, step_figure
    from oomtune.htmlreport._step import step_series

    if data.step_file is None:
        return [], None
    from oomtune.exceptions import SnapshotError
    from oomtune.trace.snapshot import load_snapshot

    try:
        snap = load_snapshot(data.step_file)
    except SnapshotError as exc:
        data.notes.append(f"{data.step_file.name}: {exc}")
        return [], None
    simulated = (snap.get("oomtune") or {}).get("memory_source") == "simulated"
    source = "simulated on the virtual GPU" if simulated else "measured on the device"
    series = step_series(snap)
    figures = []
    fig = step_figure(series, source)
    if fig is not None:
        figures.append(("step", fig, f"{series['events']} trace events of the winner's training steps (model "
                        "set-up included): allocated = bytes in live tensors' blocks as requested, reserved = "
                        "segments held from the device. Peak allocated "
                        f"{series['peak_allocated_bytes'] / 2**20:.1f} MiB, peak reserved "
                        f"{series['peak_reserved_bytes'] / 2**20:.1f} MiB."))
    fig = peak_segments_figure(series, source)
    if fig is not None:
        figures.append(("peak", fig, "Free bytes inside reserved segments at the peak are what fragmentation "
                        "costs: a request larger than the largest free block needs a new segment."))
    note = (f"<code>{data.step_file.name}</code> in the run directory is the winner's step in "
            "<code>torch.cuda.memory._dump_snapshot()</code> format (" + source + "). Open "
            "<a href='https://pytorch.org/memory_viz'>https://pytorch.org/memory_viz</a> and drag the file onto "
            "the page (it is read in your browser, nothing is uploaded); or replay it under other settings with "
            f"<code>oomtune simulate {data.step_file.name} --conf expandable_segments:True</code>.")
    return figures, note


def build_report(run_dir: str | Path, out: str | Path | None = None, *, say: Any = None) -> Path:
    """Write the HTML report of ``run_dir`` to ``out`` (default ``run_dir/report.html``); ``say``
    gets one line naming the storage the trials were read from (:class:`oomtune.runfile.RunStorage`).

    Returns:
        the path written.

    Raises:
        ConfigError: not a run directory (:func:`gather`), or ``out`` cannot be written.
        DiskFullError: no space left for ``out`` (no temporary file is left behind).
    """
    from oomtune.exceptions import ConfigError
    from oomtune.htmlreport._figures import frontier_figure, throughput_figure, timeline_figure
    from oomtune.htmlreport._page import render_page

    data = gather(run_dir)
    if say is not None and data.storage_line:
        say(data.storage_line)
    figures: list[tuple[str, Any, str]] = []
    fig = frontier_figure(data)
    if fig is not None:
        figures.append(("frontier", fig, "Lines: predicted peak reserved per allocator configuration (filled "
                        "markers fit the limit, open ones complete above it, x: out of memory); stars: each "
                        "configuration's largest fitting batch (found by bisection); the thick line is the "
                        "winner; diamonds: trials that ran."))
    fig = throughput_figure(data)
    if fig is not None:
        figures.append(("throughput", fig, "Filled markers: ran within the limit; open: ran above it. "
                        "Failed trials sit at 0, one symbol per failure class (hover for the message)."))
    elif data.trials:
        data.notes.append("no throughput chart: no trial measured a throughput (on the virtual GPU with "
                          "trial.execute=meta the steps run on the meta device, which times nothing)")
    step_figs, step_note = _step_parts(data)
    figures += step_figs
    fig = timeline_figure(data)
    if fig is not None:
        figures.append(("timeline", fig, "Baseline: torch's default allocator at the largest batch that fits; "
                        "frontier: probes at a configuration's (calibrated) predicted frontier; search: the "
                        "sampler's trials; confirm: the winner re-run in a clean process. "
                        "Zero-length bars were never launched (predicted infeasible or reused)."))
    text = render_page(data, figures, step_note=step_note)
    path = Path(out) if out is not None else Path(run_dir) / REPORT_FILE
    from oomtune.files import write_atomic

    try:
        return write_atomic(path, text)   # DiskFullError passes: resumable, not bad input
    except OSError as exc:
        raise ConfigError(f"cannot write {str(path)!r}: {exc.strerror or exc}") from None


def write_report(run_dir: str | Path, say: Any) -> Path | None:
    """:func:`build_report` for the end of ``search``/``plan``: prints ``wrote ...`` through ``say``,
    or one ``note: report not written: ...`` line (the run's answer is already written; a report
    problem must not turn it into a failure), except a full disk: the run must say so and stop.

    Raises:
        DiskFullError: no space left for report.html (no temporary file is left behind).
    """
    from oomtune.exceptions import DiskFullError

    try:
        path = build_report(run_dir)
    except DiskFullError:
        raise
    except Exception as exc:  # noqa: BLE001 - reported in one line, never fatal for the run
        say(f"note: report not written: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        return None
    say(f"wrote {path} (open it in a browser; rebuild with: oomtune report {run_dir})")
    return path


def write_search_report(run_dir: str | Path, say: Any, *, html: bool = True, **artifacts: Any) -> Path | None:
    """End of ``oomtune search``: the frontier and the winner's step
    (:func:`oomtune.htmlreport._artifacts.write_search_artifacts`, keyword arguments passed on), then
    report.html (not with ``html=False``: a worker job of ``launcher=local|slurm``, whose parent
    writes the report of the run). Each problem is one ``note:`` line through ``say``; nothing here
    fails the search, except a full disk.

    Raises:
        DiskFullError: no space left for frontier.yaml, winner_step.pickle or report.html.
    """
    from oomtune.exceptions import DiskFullError
    from oomtune.htmlreport._artifacts import write_search_artifacts

    try:
        for line in write_search_artifacts(Path(run_dir), **artifacts):
            say(line)
    except DiskFullError:
        raise
    except Exception as exc:  # noqa: BLE001 - the search's answer (best.yaml) is already written
        first = str(exc).splitlines()[0] if str(exc) else ""
        say(f"note: frontier and winner's step not written: {type(exc).__name__}: {first}")
    return write_report(run_dir, say) if html else None
