"""The report's plotly figures. Each takes :class:`oomtune.htmlreport._data.RunData` (or a series) and
returns a ``plotly.graph_objects.Figure``, or None when the run has nothing to draw. Memory is
displayed in MiB (bytes internally); every title says where its figures came from: simulated on the
virtual GPU, or measured on the device. SVG traces only (no WebGL), so charts render headless.
"""

from __future__ import annotations

from typing import Any

from oomtune.display import recommended_configuration, short_conf
from oomtune.outcome import Outcome
from oomtune.units import MiB

__all__ = ["frontier_figure", "throughput_figure", "timeline_figure", "step_figure", "peak_segments_figure",
           "source_label"]

#: The outcome of a trial that ran (report rows hold a trial's outcome as stored: its string value).
OK = Outcome.OK.value

#: Frontier lines drawn at most (a 24-configuration space would be unreadable; the table has all).
MAX_LINES = 8
_PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22",
            "#7f7f7f", "#d62728"]
_FAIL_SYMBOLS = {"oom": "x", "oom_fragmentation": "x-open", "fraction_cap": "square-x", "oom_outside_allocator":
                 "diamond-x", "host_oom": "hourglass", "limit": "triangle-down", "timeout": "hexagon",
                 "crash": "star-triangle-down", "error": "cross", "bad_record": "cross-open", "predicted_infeasible": "circle-x-open",
                 "ok >limit": "circle-open"}


def source_label(memory_source: str | None) -> str:
    """``"simulated on the virtual GPU"`` or ``"measured on the device"`` (``"source unknown"``)."""
    return {"simulated": "simulated on the virtual GPU", "device": "measured on the device"}.get(
        memory_source or "", "source unknown")


def _layout(fig: Any, title: str, x: str, y: str, *, height: int = 460, subtitle: str = "") -> Any:
    fig.update_layout(title={"text": title, "x": 0.01, "font": {"size": 16},
                             "subtitle": {"text": subtitle, "font": {"size": 12, "color": "#555"}}},
                      height=height, margin={"l": 70, "r": 20, "t": 78, "b": 55}, template="none",
                      paper_bgcolor="white", plot_bgcolor="white", font={"family": "Arial, sans-serif"},
                      legend={"font": {"size": 11}}, hoverlabel={"namelength": -1})
    axis = {"gridcolor": "#e5e5e5", "zerolinecolor": "#bbb", "linecolor": "#999", "automargin": True}
    fig.update_xaxes(title_text=x, **axis)
    fig.update_yaxes(title_text=y, **axis)
    return fig


def _colors(confs: list[str]) -> dict[str, str]:
    return {c: _PALETTE[i % len(_PALETTE)] for i, c in enumerate(confs)}


def frontier_figure(data: Any) -> Any:
    """Predicted peak reserved against batch, one line per configuration (plan.yaml / frontier.yaml),
    measured trials as markers, the budget and the limit as lines, each configuration's largest
    fitting batch as a star and the winner drawn thick. None without a plan or frontier."""
    import plotly.graph_objects as go

    plan = data.plan or {}
    rows = [r for r in plan.get("configurations") or [] if r.get("batches")]
    if not rows:
        return None
    winner = ((data.best or {}).get("best") or {}).get("alloc_conf")
    tag = " (winner)" if winner is not None else " (recommended)"
    if winner is None:
        pick = recommended_configuration(rows)
        winner = None if pick is None else pick.get("alloc_conf") or ""
    total = len(rows)
    rows = _drawn(rows, winner)
    colors = _colors([r.get("alloc_conf") or "" for r in rows])
    fig = go.Figure()
    budget = (plan.get("device") or {}).get("budget_bytes")
    limit = (plan.get("limit") or {}).get("limit_bytes")
    cap = 1.6 * budget / MiB if budget else None
    for r in sorted(rows, key=lambda r: (r.get("alloc_conf") or "") == winner):  # the winner on top
        conf = r.get("alloc_conf") or ""
        win = conf == winner
        cells = sorted((c for c in r["batches"] if c.get("predicted", True)), key=lambda c: c["batch_size"])
        xs = [c["batch_size"] for c in cells]
        ys = [c["peak_reserved_bytes"] / MiB for c in cells]
        symbols = ["circle" if c.get("fits") else ("x" if not c.get("completes", True) else "circle-open")
                   for c in cells]
        fig.add_trace(go.Scatter(
            x=xs, y=ys, mode="lines+markers", name=short_conf(conf) + (tag if win else ""),
            line={"width": 4 if win else 1.5, "color": colors[conf]}, opacity=1.0 if win else 0.75,
            marker={"symbol": symbols, "size": 8 if win else 6}, legendgroup=conf,
            hovertemplate=f"{conf or '(default)'}<br>batch %{{x}}<br>predicted peak reserved %{{y:.1f}} MiB"
                          "<extra>predicted (simulated)</extra>"))
        at = r.get("at_max") or {}
        if r.get("max_batch_size") and at.get("peak_reserved_bytes") is not None:
            fig.add_trace(go.Scatter(
                x=[r["max_batch_size"]], y=[at["peak_reserved_bytes"] / MiB], mode="markers",
                marker={"symbol": "star", "size": 16 if win else 12, "color": colors[conf],
                        "line": {"width": 1, "color": "black"}},
                name=f"largest batch {r['max_batch_size']}", legendgroup=conf, showlegend=False,
                hovertemplate=f"{conf or '(default)'}<br>largest fitting batch %{{x}}<br>%{{y:.1f}} MiB"
                              "<extra>simulated</extra>"))
    measured = [t for t in data.trials if t.get("peak_reserved_bytes") and t.get("outcome") == OK]
    if measured:
        src = data.memory_source
        fig.add_trace(go.Scatter(
            x=[t["batch_size"] for t in measured], y=[t["peak_reserved_bytes"] / MiB for t in measured],
            mode="markers", name=f"trials ({'device' if src == 'device' else 'virtual GPU'})",
            marker={"symbol": "diamond-open", "size": 10, "color": "black", "line": {"width": 1.5}},
            text=[f"#{t['number']} {t['alloc_conf'] or '(default)'}" for t in measured],
            hovertemplate="%{text}<br>batch %{x}<br>peak reserved %{y:.1f} MiB<extra>" + source_label(src)
                          + "</extra>"))
    xs_all = [c["batch_size"] for r in rows for c in r["batches"]]
    for value, label, dash, color in ((budget, "budget", "dash", "#d62728"), (limit, "limit", "dot", "#ff7f0e")):
        if value:
            fig.add_hline(y=value / MiB, line={"dash": dash, "color": color, "width": 2},
                          annotation_text=f"{label} {value / MiB:.0f} MiB", annotation_font_color=color,
                          annotation_position="top left" if label == "budget" else "bottom left")
    kind = "lines: predicted on the virtual GPU (simulated)"
    if measured:
        kind += f"; diamonds: trials that ran, {source_label(data.memory_source)}"
    if total > len(rows):
        kind += (f"; {len(rows)} of {total} configurations drawn (the largest batches, identical predictions once; "
                 "all in the feasibility map)")
    fig = _layout(fig, "Memory frontier: peak reserved vs batch size", "batch size", "peak reserved (MiB)",
                  height=520, subtitle=kind)
    if cap:
        top = max([y for tr in fig.data for y in (tr.y or []) if y is not None and y <= cap] + [budget / MiB])
        fig.update_yaxes(range=[0, top * 1.08])
    if xs_all and max(xs_all) / max(1, min(xs_all)) >= 16:
        ticks = sorted(set(plan.get("batch_sizes") or xs_all))
        fig.update_xaxes(type="log", tickvals=ticks, ticktext=[str(t) for t in ticks])
    return fig


def _drawn(rows: list[dict[str, Any]], winner: str | None, limit: int = MAX_LINES) -> list[dict[str, Any]]:
    """At most ``limit`` configurations to draw: the default, the winner, then the largest fitting
    batches; a configuration whose predicted curve equals one already drawn (a twin) is skipped."""
    def curve(r: dict[str, Any]) -> tuple:
        return tuple((c["batch_size"], c.get("peak_reserved_bytes")) for c in r["batches"])

    first = [r for r in rows if (r.get("alloc_conf") or "") in ("", winner or "")]
    rest = sorted((r for r in rows if r not in first), key=lambda r: -(r.get("max_batch_size") or 0))
    out, seen = list(first), {curve(r) for r in first}
    for r in rest:
        if len(out) < limit and curve(r) not in seen:
            out.append(r)
            seen.add(curve(r))
    return out


def throughput_figure(data: Any) -> Any:
    """Measured throughput against batch per configuration (search and baseline trials); failed
    trials at 0 with one marker symbol per failure class. None when no trial measured a throughput
    (none ran, or their steps ran on the meta device: ``trial.execute=meta``)."""
    import plotly.graph_objects as go

    # confirmations repeat candidates; recordings (role record) train another accumulation than the candidates
    trials = [t for t in data.trials if t.get("batch_size") is not None and t.get("role") not in ("confirm", "record")]
    if not any(t["outcome"] == OK and t.get("throughput") for t in trials):
        return None   # nothing measured (trial.execute=meta times nothing): no chart of zeros
    confs = sorted({t["alloc_conf"] for t in trials}, key=lambda c: (c != "", c))
    colors = _colors(confs)
    fig = go.Figure()
    for conf in confs:
        ok = sorted((t for t in trials if t["alloc_conf"] == conf and t["outcome"] == OK and t["throughput"]),
                    key=lambda t: t["batch_size"])
        if ok:
            fig.add_trace(go.Scatter(
                x=[t["batch_size"] for t in ok], y=[t["throughput"] for t in ok], mode="markers",
                name=short_conf(conf), marker={"color": colors[conf], "size": 9,
                                               "symbol": ["circle" if t["feasible"] else "circle-open" for t in ok]},
                text=[f"#{t['number']} {t['role']}" + ("" if t["feasible"] else " (above the limit)") for t in ok],
                hovertemplate=f"{conf or '(default)'}<br>%{{text}}<br>batch %{{x}}<br>%{{y:.1f}} samples/s<extra></extra>"))
    failures: dict[str, list[dict[str, Any]]] = {}
    for t in trials:
        if t["outcome"] != OK:
            failures.setdefault(t["outcome"], []).append(t)
    for outcome, group in sorted(failures.items()):
        fig.add_trace(go.Scatter(
            x=[t["batch_size"] for t in group], y=[0] * len(group), mode="markers", name=f"failed: {outcome}",
            marker={"symbol": _FAIL_SYMBOLS.get(outcome, "x"), "size": 11, "color": "#d62728",
                    "line": {"width": 1.5, "color": "#d62728"}},
            text=[f"#{t['number']} {t['alloc_conf'] or '(default)'}<br>{(t['message'] or '')[:120]}" for t in group],
            hovertemplate="%{text}<br>batch %{x}<extra>" + outcome + "</extra>"))
    where = "measured on the device" if data.memory_source == "device" else \
        "measured on this machine's CPU (memory simulated on the virtual GPU; CPU speed, not a GPU's)"
    return _layout(fig, "Throughput vs batch size; failed trials at 0, one symbol per class", "batch size",
                   "samples/s", subtitle=where)


def timeline_figure(data: Any) -> Any:
    """One bar per trial from its start to its end (seconds since the first trial), coloured by
    outcome and labelled with its role. None without timed trials."""
    import plotly.graph_objects as go

    timed = [t for t in data.trials if t.get("start") is not None]
    if not timed:
        return None
    t0 = min(t["start"] for t in timed)
    outcomes = sorted({t["outcome"] for t in timed}, key=lambda o: (o != OK, o))
    others = ["#d62728", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#7f7f7f", "#17becf", "#bcbd22", "#1f77b4"]
    colors = {o: ("#2ca02c" if o == OK else others[i % len(others)]) for i, o in enumerate(o for o in outcomes
                                                                                              if o != OK)}
    colors.setdefault(OK, "#2ca02c")
    fig = go.Figure()
    for o in outcomes:
        group = [t for t in timed if t["outcome"] == o]
        fig.add_trace(go.Bar(
            y=[f"#{t['number']} {t['role']}" for t in group], x=[max(t["duration_s"] or 0.0, 0.05) for t in group],
            base=[(t["start"] - t0).total_seconds() for t in group], orientation="h", name=o,
            marker={"color": colors[o]},
            text=[f"bs={t['batch_size']} {short_conf(t['alloc_conf'])}" for t in group], textposition="none",
            hovertemplate="%{y}<br>%{text}<br>start %{base:.1f} s, %{x:.1f} s<extra>" + o + "</extra>"))
    height = max(300, min(1400, 26 * len(timed) + 120))
    fig = _layout(fig, "Trial timeline: role, outcome and duration", "seconds since the first trial started", "",
                  height=height, subtitle="wall clock of this run's trial processes")
    fig.update_yaxes(autorange="reversed", type="category")
    fig.update_layout(barmode="overlay")
    return fig


def step_figure(series: dict[str, Any], source: str) -> Any:
    """Allocated and reserved MiB after each allocation event of the winner's step."""
    import plotly.graph_objects as go

    if not series.get("x"):
        return None
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=series["x"], y=[v / MiB for v in series["reserved"]], mode="lines",
                             name="reserved", line={"color": "#ff7f0e", "width": 2, "shape": "hv"}, fill="tozeroy",
                             fillcolor="rgba(255,127,14,0.15)"))
    fig.add_trace(go.Scatter(x=series["x"], y=[v / MiB for v in series["allocated"]], mode="lines",
                             name="allocated", line={"color": "#1f77b4", "width": 2}))
    fig.add_vline(x=series["peak_index"], line={"dash": "dot", "color": "#555"},
                  annotation_text="peak allocated", annotation_position="top")
    return _layout(fig, "The winner's step: memory over allocation events",
                   "trace event (allocations, frees and segment events, in order)", "MiB", height=420,
                   subtitle=source + "; allocated counts requested bytes, as memory_viz does")


def peak_segments_figure(series: dict[str, Any], source: str) -> Any:
    """At the moment of peak allocated: each segment's allocated and free MiB, and its largest free
    block. Free bytes inside reserved segments are the fragmentation at the peak."""
    import plotly.graph_objects as go

    segs = series.get("at_peak") or []
    if not segs:
        return None
    names = [f"{i}: {s['size'] / MiB:.0f} MiB" for i, s in enumerate(segs)]
    alloc = [s["allocated"] / MiB for s in segs]
    free = [max(0, s["size"] - s["allocated"]) / MiB for s in segs]
    fig = go.Figure()
    fig.add_trace(go.Bar(x=names, y=alloc, name="allocated", marker={"color": "#1f77b4"}))
    fig.add_trace(go.Bar(x=names, y=free, name="free (cached, fragmentation)", marker={"color": "#ff7f0e"}))
    fig.add_trace(go.Scatter(x=names, y=[s["largest_free"] / MiB for s in segs], mode="markers",
                             name="largest free block", marker={"symbol": "line-ew-open", "size": 14, "color": "black",
                                                                "line": {"width": 2}}))
    reserved = sum(s["size"] for s in segs)
    used = sum(s["allocated"] for s in segs)
    frac = 1 - used / reserved if reserved else 0.0
    fig = _layout(fig, f"Fragmentation at the peak: {used / MiB:.0f} of {reserved / MiB:.0f} MiB reserved in use, "
                       f"{frac:.1%} free inside segments", "segment (by address)", "MiB", height=400,
                  subtitle=source + "; the moment of peak allocated")
    fig.update_layout(barmode="stack")
    if len(segs) > 30:
        fig.update_xaxes(showticklabels=False)
    return fig
