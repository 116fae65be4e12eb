"""Assembling report.html: one self-contained file (plotly.js embedded once, no network), the
summary tables as HTML and the figures as plotly divs."""

from __future__ import annotations

import html
from typing import Any

from oomtune.best import trials_text
from oomtune.display import conf_legend, plan_recommendation
from oomtune.htmlreport._advice import advice_for
from oomtune.outcome import Outcome
from oomtune.units import format_bytes

__all__ = ["render_page"]

#: The outcome of a trial that ran (report rows hold a trial's outcome as stored: its string value).
OK = Outcome.OK.value

_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;color:#222;background:#fafafa}
header{background:#263238;color:#fff;padding:14px 28px}header h1{margin:0;font-size:22px}
header p{margin:4px 0 0;color:#cfd8dc;font-size:14px}
main{max-width:1200px;margin:0 auto;padding:8px 24px 40px}
section{background:#fff;border:1px solid #e0e0e0;border-radius:6px;margin:16px 0;padding:12px 18px}
h2{font-size:18px;margin:6px 0 10px}table{border-collapse:collapse;font-size:13px;margin:6px 0}
td,th{border-bottom:1px solid #eee;padding:3px 10px;text-align:left;vertical-align:top}
th{background:#f5f5f5;white-space:nowrap}td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
.rec{font-size:17px;font-weight:600;color:#1b5e20}.note{color:#666;font-size:13px}
.src{display:inline-block;font-size:12px;padding:1px 7px;border-radius:9px;background:#fff3e0;color:#e65100}
.src.device{background:#e8f5e9;color:#1b5e20}code{background:#f3f3f3;padding:1px 4px;border-radius:3px}
.fits{color:#1b5e20}.over{color:#e65100}.oom{color:#b71c1c}.scroll{overflow-x:auto}
"""


def _e(value: Any) -> str:
    return html.escape("-" if value is None else str(value))


def _table(header: list[str], rows: list[list[Any]], *, num: set[int] = frozenset()) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td class='num'>{c}</td>" if i in num else f"<td>{c}</td>"
                                    for i, c in enumerate(r)) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _conf(conf: str | None) -> str:
    """An alloc_conf string as HTML code that may wrap after each comma."""
    return "<code>" + ",<wbr>".join(_e(part) for part in (conf or "(default)").split(",")) + "</code>"


def _src(source: str | None) -> str:
    text = {"device": "measured on the device", "simulated": "simulated (virtual GPU)"}.get(source or "", "source unknown")
    return f"<span class='src {_e(source)}'>{text}</span>"


def _pct(v: Any) -> str:
    return "-" if v is None else f"{v:.1%}"


def _summary(data: Any) -> str:
    best = data.best
    if not best:
        return ""
    b = best.get("best") or {}
    m = b.get("metrics") or {}
    dev = best.get("device") or {}
    where = "CPU" if m.get("memory_source") == "simulated" else "device"   # a virtual-GPU trial ran on the CPU
    rows = [["batch size", _e(b.get("batch_size"))],
            ["PYTORCH_CUDA_ALLOC_CONF", f"<code>{_e(b.get('alloc_conf') or '(default)')}</code>"],
            ["throughput", _e(None if m.get("throughput") is None else f"{m['throughput']:.1f} samples/s ({where})")
             + (" (confirmed in a clean process)" if b.get("confirmed") else "")],
            ["peak reserved / allocated", f"{format_bytes(m.get('peak_reserved_bytes'))} / "
             f"{format_bytes(m.get('peak_allocated_bytes'))} {_src(m.get('memory_source'))}"],
            ["fragmentation (1 - peak active / peak reserved)", _pct(m.get("fragmentation"))],
            ["device, budget", f"{_e(dev.get('name'))}, budget {format_bytes(dev.get('budget_bytes'))}, "
             f"headroom {_pct(dev.get('headroom'))}"]]
    trials = trials_text(b)
    if trials:
        rows.insert(2, ["from the study's trials", _e(trials)])
    base, gain = best.get("baseline") or {}, best.get("gain") or {}
    if base:
        bm = base.get("metrics") or {}
        rows.append(["baseline (default allocator, largest batch)",
                     f"batch {_e(base.get('batch_size'))}, "
                     f"{_e(None if bm.get('throughput') is None else round(bm['throughput'], 1))} "
                     f"samples/s ({where}), peak reserved {format_bytes(bm.get('peak_reserved_bytes'))} "
                     f"{_src(bm.get('memory_source'))}" + (f"; {_e(trials_text(base))}" if trials_text(base) else "")])
    if gain:
        rows.append(["gain over the baseline", ", ".join(
            f"{label} x{gain[k]:.2f}" for k, label in (("throughput_ratio", "throughput"), ("batch_size_ratio", "batch"),
                                                      ("peak_reserved_ratio", "peak reserved")) if gain.get(k))])
    diag = best.get("diagnosis")
    if diag:
        verdict = "input-bound" if diag.get("input_bound") else "not input-bound"
        rows.append(["input-bound verdict", f"<b>{verdict}</b>: {_e(diag.get('reason'))}"
                     + (f"<br>advice: {_e(diag.get('advice'))}" if diag.get("input_bound") else "")])
    study = best.get("study") or {}
    if study.get("outcomes"):
        rows.append(["trials by outcome", _e(", ".join(f"{k} {v}" for k, v in study["outcomes"].items()))])
    line = (f"<p class='rec'>Recommended: batch {_e(b.get('batch_size'))} with "
            f"<code>{_e(b.get('alloc_conf') or '(default allocator)')}</code></p>")
    return f"<section id='summary'><h2>best.yaml</h2>{line}{_table(['', ''], rows)}</section>"


def _failures(data: Any) -> str:
    from optuna.trial import TrialState

    counts: dict[str, int] = {}
    for t in data.trials:
        label = t["outcome"] if t["outcome"] != OK or t["feasible"] or t["state"] != TrialState.COMPLETE.name else "ok >limit"
        if label != OK:
            counts[label] = counts.get(label, 0) + 1
    if not counts:
        return ""
    rows = [[f"<b>{_e(k)}</b>", str(v), _e(advice_for(k))] for k, v in sorted(counts.items())]
    return ("<section id='failures'><h2>Failures and what to do</h2>"
            + _table(["class", "trials", "what to do"], rows, num={1}) + "</section>")


def _trials_table(data: Any) -> str:
    if not data.trials:
        return ""
    rows = []
    for t in data.trials:
        rows.append([str(t["number"]), _e(t["role"]), _e(t["batch_size"]), _conf(t['alloc_conf']),
                     _e(t["outcome"] + ("" if t["feasible"] or t["outcome"] != OK else " >limit")),
                     _e(None if t["throughput"] is None else f"{t['throughput']:.1f}"),
                     _e(format_bytes(t["peak_reserved_bytes"]) if t["peak_reserved_bytes"] else None),
                     _e(_pct(t["fragmentation"])), _e(t["memory_source"]),
                     _e(None if t["duration_s"] is None else f"{t['duration_s']:.1f}")])
    header = ["#", "role", "batch", "alloc_conf", "outcome", "samples/s", "peak reserved", "frag", "memory", "s"]
    return ("<section id='trials'><h2>Trials</h2><div class='scroll'>" + _table(header, rows, num={0, 2, 5, 6, 7, 9})
            + "</div></section>")


def _cell(c: dict[str, Any]) -> str:
    size = format_bytes(c.get("peak_reserved_bytes"))
    if not c.get("completes", True):
        return f"<span class='oom'>OOM {size}</span>"
    if not c.get("fits"):
        return f"<span class='over'>&gt;limit {size}</span>"
    return f"<span class='fits'>{size} {_pct(c.get('fragmentation'))}</span>"


def _plan_table(data: Any) -> str:
    plan = data.plan or {}
    confs = plan.get("configurations") or []
    if not confs:
        return ""
    batches = plan.get("batch_sizes") or sorted({c["batch_size"] for r in confs for c in r.get("batches") or []})
    rows = []
    for r in confs:
        by_b = {c["batch_size"]: c for c in r.get("batches") or []}
        rows.append([_conf(r.get('alloc_conf')), _e(r.get("max_batch_size") or "none"),
                     *(_cell(by_b[b]) if b in by_b else "-" for b in batches)])
    head = ""  # a plan's recommendation has its own section above
    what = "oomtune plan" if data.plan_file == "plan.yaml" else "the search's predicted frontier"
    return (f"<section id='plan'><h2>Feasibility map {_src('simulated')}</h2>{head}<p class='note'>From {_e(what)}, "
            f"{_e(data.plan_file)}: per batch the predicted peak reserved and fragmentation; &gt;limit: completes "
            "but above budget minus headroom; OOM: does not fit the budget.</p><div class='scroll'>"
            + _table(["alloc_conf", "max batch", *(f"b={b}" for b in batches)], rows,
                     num=set(range(1, len(batches) + 2))) + "</div></section>")


def _figure_html(fig: Any, div_id: str) -> str:
    return fig.to_html(full_html=False, include_plotlyjs=False, div_id=div_id,
                       config={"displaylogo": False, "responsive": True})


def render_page(data: Any, figures: list[tuple[str, Any, str]], *, step_note: str | None) -> str:
    """The whole report.html. ``figures``: (section id, plotly Figure, explanation line)."""
    from plotly.offline import get_plotlyjs

    title = data.study_name or data.run_dir.name
    sub = [f"run directory {data.run_dir}"]
    if data.storage:
        from oomtune.runfile import redact

        sub.append(f"study {data.study_name} in {redact(data.storage)}")
    confs = sorted({t["alloc_conf"] for t in data.trials} | {r.get("alloc_conf") or "" for r in
                                                              (data.plan or {}).get("configurations") or []})
    legend = conf_legend(confs)
    parts = [_summary(data)]
    if data.plan_file == "plan.yaml" and not data.best:
        rec = plan_recommendation((data.plan or {}).get("configurations") or [])
        if rec:
            parts.append(f"<section id='recommendation'><h2>Recommendation {_src('simulated')}</h2>"
                         f"<p class='rec'>{_e(rec)}</p></section>")
    for div_id, fig, note in figures:
        parts.append(f"<section id='{div_id}'>{_figure_html(fig, 'fig-' + div_id)}"
                     f"<p class='note'>{note}</p></section>")
    if step_note:
        parts.append(f"<section id='memory_viz'><h2>Open the winner's step in PyTorch's memory viewer</h2>"
                     f"<p>{step_note}</p></section>")
    parts += [_failures(data), _plan_table(data), _trials_table(data)]
    if legend:
        parts.append(f"<section id='legend'><h2>Abbreviations in the charts</h2><p>{_e(legend)}; "
                     "default = torch's default allocator settings</p></section>")
    if data.storage:
        parts.append("<section id='dashboard'><h2>The study in optuna-dashboard</h2><p><code>pip install "
                     f"'oomtune[dashboard]' &amp;&amp; optuna-dashboard {_e(data.storage)} --host 127.0.0.1</code>"
                     "</p></section>")
    for note in data.notes:
        parts.append(f"<p class='note'>note: {_e(note)}</p>")
    return (f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>oomtune report: {_e(title)}</title>"
            f"<style>{_CSS}</style><script type='text/javascript'>{get_plotlyjs()}</script></head><body>"
            f"<header><h1>oomtune report: {_e(title)}</h1><p>{_e(' · '.join(sub))}</p></header><main>"
            + "".join(p for p in parts if p) + "</main></body></html>")
