"""Human output: the per-trial progress line and the trial table (rich). Numbers stay numbers in the
records; formatting happens only here. Every memory figure names its source: device or simulated."""

from __future__ import annotations

from typing import Any

from oomtune.search import records as R
from oomtune.units import format_bytes

__all__ = ["trial_rows", "trial_table", "progress_line", "describe", "outcome_label"]


def trial_rows(trials: list[Any]) -> list[dict[str, Any]]:
    """One plain dict per trial with a stored result (bytes and floats, no formatting)."""
    rows = []
    for t in trials:
        res = R.result_of(t)
        if res is None:
            if t.state.name in ("FAIL", "RUNNING") and R.ATTR_ROLE in t.user_attrs:
                rows.append(_unfinished_row(t))
            continue
        predicted = t.user_attrs.get(R.ATTR_PREDICTED)
        error = None
        if predicted and res.peak_reserved_bytes and res.outcome == "ok":
            error = (predicted - res.peak_reserved_bytes) / res.peak_reserved_bytes
        rows.append({
            "number": t.number, "state": t.state.name, "role": t.user_attrs.get(R.ATTR_ROLE, ""),
            "batch_size": t.params.get("batch_size", res.batch_size),
            "alloc_conf": describe(t), "outcome": res.outcome, "outcome_label": outcome_label(t, res),
            "throughput": res.throughput, "step_time_s": res.step_time_s,
            "peak_allocated_bytes": res.peak_allocated_bytes, "peak_reserved_bytes": res.peak_reserved_bytes,
            "device_peak_bytes": res.device_peak_bytes, "fragmentation": res.fragmentation,
            "memory_source": res.memory_source, "predicted_peak_reserved_bytes": predicted,
            "prediction_error": error, "feasible": R.is_feasible_ok(t),
            "reused_from": t.user_attrs.get(R.ATTR_REUSED), "message": res.message,
            "data_wait_fraction": res.data_wait_fraction,
        })
    return rows


def _unfinished_row(t: Any) -> dict[str, Any]:
    """A trial without a result: interrupted (FAIL: Ctrl-C/SIGTERM; a resumed search re-runs it) or
    still running (another worker, or a process that was killed)."""
    outcome = "interrupted" if t.state.name == "FAIL" else "running"
    return {"number": t.number, "state": t.state.name, "role": t.user_attrs.get(R.ATTR_ROLE, ""),
            "batch_size": t.params.get("batch_size"), "alloc_conf": describe(t),
            "outcome": outcome, "outcome_label": outcome, "throughput": None, "step_time_s": None, "peak_allocated_bytes": None,
            "peak_reserved_bytes": None, "device_peak_bytes": None, "fragmentation": None,
            "memory_source": "simulated", "predicted_peak_reserved_bytes": None, "prediction_error": None,
            "feasible": False, "reused_from": None, "message": None, "data_wait_fraction": None}


def _fmt(v: Any, spec: str = "") -> str:
    if v is None:
        return "-"
    return format(v, spec) if spec else str(v)


def trial_table(rows: list[dict[str, Any]], *, title: str = "trials", best_number: int | None = None) -> Any:
    """A rich Table of :func:`trial_rows`. Memory columns carry (sim)/(dev) per row."""
    from rich.table import Table

    table = Table(title=title, show_lines=False, header_style="bold")
    sources = {r["memory_source"] for r in rows if r["outcome"] not in ("interrupted", "running")}
    shared = ""  # when every row has the same source, say it once in the header
    if len(sources) == 1:
        shared = " (sim)" if sources == {"simulated"} else " (dev)"
    for name, justify in (("#", "right"), ("role", "left"), ("batch", "right"), ("alloc_conf", "left"),
                          ("outcome", "left"), ("samples/s", "right"), ("peak alloc" + shared, "right"),
                          ("peak resv" + shared, "right"), ("frag", "right"), ("pred err", "right")):
        table.add_column(name, justify=justify, overflow="fold",
                         no_wrap=name not in ("alloc_conf", "outcome"), min_width=4 if name == "role" else None)
    for r in rows:
        src = "" if shared else (" (sim)" if r["memory_source"] == "simulated" else " (dev)")
        if r["outcome"] in ("interrupted", "running"):
            table.add_row(str(r["number"]), r["role"], str(r["batch_size"]), r["alloc_conf"] or "(default)",
                          r["outcome"], "-", "-", "-", "-", "-", style="dim")
            continue
        outcome = r["outcome_label"]
        style = "bold green" if r["number"] == best_number else None
        table.add_row(
            str(r["number"]), r["role"], str(r["batch_size"]), r["alloc_conf"] or "(default)", outcome,
            _fmt(r["throughput"], ".1f"),
            f"{format_bytes(r['peak_allocated_bytes'])}{src}" if r["peak_allocated_bytes"] is not None else "-",
            f"{format_bytes(r['peak_reserved_bytes'])}{src}" if r["peak_reserved_bytes"] is not None else "-",
            _fmt(r["fragmentation"], ".1%"), _fmt(r["prediction_error"], "+.1%"), style=style,
        )
    return table


def describe(trial: Any) -> str:
    """The configuration of a trial in one string: the exact PYTORCH_CUDA_ALLOC_CONF ("(default)"
    for torch's defaults) plus any searched data-loader settings (``num_workers=2``)."""
    conf = trial.user_attrs.get(R.ATTR_CONF) or "(default)"
    loader = [f"{k[len('data.'):]}={v}" for k, v in sorted(trial.params.items()) if k.startswith("data.")]
    return " ".join([conf, *loader])


def outcome_label(trial: Any, res: Any) -> str:
    """``ok``, ``ok >limit`` (ran but its peak exceeded budget x (1 - headroom)), or the outcome;
    ``=#n`` marks a measurement reused from trial n."""
    label = res.outcome
    if res.outcome == "ok" and not R.is_feasible_ok(trial):
        label = "ok >limit"
    reused = trial.user_attrs.get(R.ATTR_REUSED)
    return label if reused is None else f"{label} =#{reused}"


def progress_line(trial: Any, role: str, index: int | None, total: int | None, best: float | str | None) -> str:
    """``[trial 7] search 3/12  bs=128  expandable_segments:True  ok  812.3 samples/s  peak reserved
    1.21 GiB (simulated)  best 812.3``: one line per finished trial (never wrapped)."""
    res = R.result_of(trial)
    where = f"[trial {trial.number}] {role}" + (f" {index}/{total}" if index is not None and total else "")
    if res is None:
        return f"{where}  {trial.state.name.lower()}"
    parts = [f"{where:<24} bs={res.batch_size:<5} {describe(trial):<40} {outcome_label(trial, res)}"]
    if res.throughput is not None:
        parts.append(f"{res.throughput:.1f} samples/s")
    if res.peak_reserved_bytes is not None:
        parts.append(f"peak reserved {format_bytes(res.peak_reserved_bytes)} ({res.memory_source})")
    if res.outcome != "ok" and res.message:
        parts.append(" ".join(res.message.split()))
    if best is not None:  # the leader under the final ranking rule (a description, or a throughput)
        parts.append(f"best {best}" if isinstance(best, str) else f"best {best:.1f}")
    return "  ".join(parts)
