"""Human output: the per-trial progress line and the trial table (rich). Numbers stay numbers in the
records; formatting happens only here. Every memory figure names its source: device or simulated."""

from __future__ import annotations

from typing import Any

from oomtune.outcome import Outcome
from oomtune.study import records as R
from oomtune.units import format_bytes

__all__ = ["output_console", "starting", "device_words", "wrapped", "trial_rows", "planned_batch", "fit_table", "trial_table", "progress_line", "describe", "outcome_label", "short_conf",
           "SearchProgress", "running_description",
           "plan_recommendation", "recommended_configuration", "plan_compact_table",
           "CONF_ABBREVIATIONS", "conf_legend", "SEARCH_LEGEND", "trial_table_legend", "throughput_label",
           "fold_note", "FOLD_LEGEND", "legend_lines"]

#: Abbreviations of PYTORCH_CUDA_ALLOC_CONF keys and values for narrow tables and chart legends.
CONF_ABBREVIATIONS = {
    "expandable_segments": "es", "garbage_collection_threshold": "gc", "roundup_power2_divisions": "r2",
    "max_split_size_mb": "ms", "backend": "be", "cudaMallocAsync": "async", "True": "T", "False": "F",
    "large_segment_size_mb": "ls", "max_non_split_rounding_mb": "nsr",
}

#: The legend of the search's per-trial lines, one line each (fits 100 columns; labels out of
#: the rows, into these lines).
SEARCH_LEGEND = (
    "legend: [trial n] role  bs=batch  allocator settings  outcome  peak reserved  samples/s  best #n",
    "  peak reserved: torch.cuda.max_memory_reserved; (sim) simulated on the virtual GPU, (dev) device",
    "  N/s: samples per second; (CPU) this CPU's throughput, not a GPU's; (dev) measured on the device",
    "  ok >limit: ran, but peaked above the limit = budget x (1 - headroom); =#n: reused from trial n",
    "  >limit@n: stopped after step n, the first above the limit (peaks can only grow)",
    "  best #n: the trial leading so far (under the objective)",
)

#: Short source labels of measured figures: memory (``TrialResult.memory.source``) and throughput
#: (a trial on the virtual GPU trains on the CPU: its samples/s are the CPU's).
MEMORY_LABEL = {"simulated": "sim", "device": "dev"}


#: What ``+N`` means where configurations with identical predictions are folded (plan's map, the
#: search's frontier table): the same wording in both.
FOLD_LEGEND = "+N: N more configurations with the same prediction at every batch, folded into this row"


def fold_note(configurations: list[dict[str, Any]]) -> str | None:
    """One line naming the folded configurations of a plan (plan.yaml ``configurations`` with
    ``twin_of``), abbreviated: ``"folded: es:T gc:0.8 = es:T; r2:4 ms:64 = ms:64"``; None when none
    was folded."""
    pairs = [f"{short_conf(c.get('alloc_conf'))} = {short_conf(c['twin_of'])}"
             for c in configurations if c.get("twin_of") is not None]
    return ("folded: " + "; ".join(pairs)) if pairs else None


def legend_lines(prefix: str, text: str, width: int = 100) -> list[str]:
    """``prefix + text`` wrapped at word boundaries into lines of at most ``width`` columns, the
    continuation lines indented by two spaces (:func:`wrapped`)."""
    return wrapped(prefix + text, width)


#: Stands for a space that must not become a line break while :func:`wrapped` wraps (never in its output).
_BOUND = "\x00"


def _numeric(word: str) -> bool:
    """Whether ``word`` is a figure (``352``, ``(10``, ``1.40x``, ``972.00``, ``2000-step``)."""
    return word.lstrip("(")[:1].isdigit()


def wrapped(text: str, width: int = 100) -> list[str]:
    """``text`` wrapped at spaces into lines of at most ``width`` columns (characters), the
    continuation lines indented by two spaces. Nothing is lost but the spaces at the breaks: a
    word longer than the line (a path, a URL) stays whole on a line of its own, and words are not
    split at hyphens. A figure stays on the line of the words beside it ("batch 512", "(10 steps)",
    "972.00 MiB"): a line is not broken at a space next to a word that starts with a digit, unless the
    word before the space ends a clause or a list item (``,`` ``;`` ``:``); a run of words bound so
    that is longer than the line stands whole on a line of its own."""
    import textwrap

    words = text.split(" ")
    joined = words[0] if words else ""
    for before, word in zip(words, words[1:]):
        bound = before and word and not before.endswith((",", ";", ":")) and (_numeric(before) or _numeric(word))
        joined += (_BOUND if bound else " ") + word
    lines = textwrap.wrap(joined, width=width, subsequent_indent="  ", break_long_words=False,
                          break_on_hyphens=False)
    return [line.replace(_BOUND, " ") for line in lines] or [text]


def device_words(device: Any) -> str:
    """A :class:`oomtune.device.TargetDevice` in words for the opening lines: ``"virtual GPU on the
    CPU (memory simulated)"`` or ``"NVIDIA H200 on cuda:0 (memory measured)"``."""
    if device.simulated:
        return "virtual GPU on the CPU (memory simulated)"
    return f"{device.name} on {device.spec} (memory measured)"


def throughput_label(memory_source: str | None) -> str:
    """``"CPU"`` for a trial on the virtual GPU (simulated memory: it trained on the CPU), else
    ``"dev"`` (measured on the device)."""
    return "CPU" if memory_source == "simulated" else "dev"


def short_conf(alloc_conf: str | None) -> str:
    """A PYTORCH_CUDA_ALLOC_CONF string abbreviated for display (:data:`CONF_ABBREVIATIONS`):
    ``"expandable_segments:True,garbage_collection_threshold:0.8"`` -> ``"es:T gc:0.8"``; ``""`` ->
    ``"default"``. Keys not in the table stay as they are."""
    if not alloc_conf or alloc_conf == "(default)":
        return "default"
    parts = []
    for item in alloc_conf.split(","):
        key, sep, value = item.partition(":")
        parts.append(CONF_ABBREVIATIONS.get(key, key) + sep + CONF_ABBREVIATIONS.get(value, value))
    return " ".join(parts)


def conf_legend(confs: list[str]) -> str:
    """The legend line for the abbreviations used in ``confs`` (alloc_conf strings)."""
    used = []
    for conf in confs:
        for item in (conf or "").split(","):
            key, _, value = item.partition(":")
            for word in (key, value):
                if word in CONF_ABBREVIATIONS and word not in used:
                    used.append(word)
    return ", ".join(f"{CONF_ABBREVIATIONS[w]}={w}" for w in used)


def trial_rows(trials: list[Any]) -> list[dict[str, Any]]:
    """One plain dict per trial with a stored result (bytes and floats, no formatting)."""
    from optuna.trial import TrialState

    rows = []
    for t in trials:
        res = R.result_of(t)
        if res is None:
            if t.state in (TrialState.FAIL, TrialState.RUNNING) and R.ATTR_ROLE in t.user_attrs:
                rows.append(_unfinished_row(t))
            continue
        predicted = t.user_attrs.get(R.ATTR_PREDICTED)
        error = None
        if predicted and res.memory.peak_reserved_bytes and res.outcome is Outcome.OK:
            error = (predicted - res.memory.peak_reserved_bytes) / res.memory.peak_reserved_bytes
        rows.append({
            "number": t.number, "state": t.state.name, "role": t.user_attrs.get(R.ATTR_ROLE, ""),
            "batch_size": t.params.get("batch_size", res.batch_size),
            "alloc_conf": describe(t), "outcome": res.outcome.value, "outcome_label": outcome_label(t, res),
            "throughput": res.throughput.samples_per_s, "step_time_s": res.throughput.step_time_s,
            "peak_allocated_bytes": res.memory.peak_allocated_bytes,
            "peak_reserved_bytes": res.memory.peak_reserved_bytes,
            "device_peak_bytes": res.memory.device_peak_bytes, "fragmentation": res.memory.fragmentation,
            "memory_source": res.memory.source, "predicted_peak_reserved_bytes": predicted,
            "prediction_error": error, "feasible": R.is_feasible_ok(t),
            "reused_from": t.user_attrs.get(R.ATTR_REUSED), "from_recording": t.user_attrs.get(R.ATTR_FROM_RECORDING),
            "message": res.message,
            "data_wait_fraction": res.throughput.data_wait_fraction, **rank_fields(res),
        })
    return rows


def planned_batch(t: Any) -> int | None:
    """The batch size of a trial: its parameter, or, for an enqueued probe that never asked for its
    parameters (interrupted, or finished as a duplicate), the fixed parameter it was enqueued with
    (``system_attrs["fixed_params"]``, :meth:`optuna.Study.enqueue_trial`)."""
    if "batch_size" in t.params:
        return t.params["batch_size"]
    fixed = (getattr(t, "system_attrs", None) or {}).get("fixed_params") or {}
    return fixed.get("batch_size")


def rank_fields(res: Any) -> dict[str, Any]:
    """A distributed trial's ranks (:mod:`oomtune.trial.rank_records`): ``world_size``, ``worst_rank``
    (the rank whose peak reserved is the trial's), ``failed_rank`` and ``rank_peaks`` (each rank's
    peak reserved, bytes, in rank order); empty for a single-process trial."""
    ranks = res.ranks
    if not ranks:
        return {}
    return {"world_size": res.distributed.world_size or len(ranks), "worst_rank": res.worst_rank,
            "failed_rank": res.failed_rank, "rank_peaks": [r.peak_reserved_bytes for r in ranks]}


def _rank_tag(rank: Any) -> str:
    """`` r1``: the rank whose peak a distributed trial's memory figures are."""
    return "" if rank is None else f" r{rank}"


def _unfinished_row(t: Any) -> dict[str, Any]:
    """A trial without a result: a duplicate (a probe another trial already ran, finished without
    launching anything: ``duplicate =#n``), interrupted (FAIL: Ctrl-C/SIGTERM; a resumed search
    re-runs it) or still running (another worker, or a process that was killed)."""
    from optuna.trial import TrialState

    from oomtune.study.records import ATTR_DUPLICATE_OF

    original = t.user_attrs.get(ATTR_DUPLICATE_OF)
    outcome = ("duplicate" if original is not None else "interrupted" if t.state is TrialState.FAIL else "running")
    label = outcome if original is None else f"duplicate =#{original}"
    return {"number": t.number, "state": t.state.name, "role": t.user_attrs.get(R.ATTR_ROLE, ""),
            "batch_size": planned_batch(t), "alloc_conf": describe(t),
            "outcome": outcome, "outcome_label": label, "throughput": None, "step_time_s": None, "peak_allocated_bytes": None,
            "peak_reserved_bytes": None, "device_peak_bytes": None, "fragmentation": None,
            "memory_source": "simulated", "predicted_peak_reserved_bytes": None, "prediction_error": None,
            "feasible": False, "reused_from": None, "from_recording": None, "message": None,
            "data_wait_fraction": None}


#: Outcomes of rows without a result (:func:`_unfinished_row`).
_UNFINISHED = ("interrupted", "running", "duplicate")


def _fmt(v: Any, spec: str = "") -> str:
    if v is None:
        return "-"
    return format(v, spec) if spec else str(v)


def _mib(n: int | None) -> str:
    """Bytes as MiB with one decimal for the trial table (its header names the unit)."""
    return "-" if n is None else f"{n / 2**20:.1f}"


def trial_table(rows: list[dict[str, Any]], *, title: str = "trials", best_number: int | None = None) -> Any:
    """A rich Table of :func:`trial_rows` that fits 100 columns: allocator settings abbreviated
    (:func:`short_conf`; :func:`trial_table_legend` names the abbreviations), memory in MiB.
    Every measured column names its source in the header when all rows share it (``(sim)``:
    simulated on the virtual GPU, ``(dev)``: the device; samples/s ``(CPU)`` on the virtual GPU),
    else per cell. ``best_number``: the chosen trial, in bold."""
    from rich import box
    from rich.table import Table

    table = Table(title=title, header_style="bold", box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False,
                  collapse_padding=True, show_edge=False)
    sources = {r["memory_source"] for r in rows if r["outcome"] not in _UNFINISHED}
    shared = None  # when every row has the same source, say it once in the header
    if len(sources) == 1:
        shared = next(iter(sources))
    mem = f" ({MEMORY_LABEL.get(shared, shared)})" if shared else ""
    speed = f" ({throughput_label(shared)})" if shared else ""
    for name, justify in (("#", "right"), ("role", "left"), ("batch", "right"), ("config", "left"),
                          ("outcome", "left"), (f"peak resv\nMiB{mem}", "right"), (f"peak alloc\nMiB{mem}", "right"),
                          (f"frag\n{mem.strip()}", "right"), ("pred\nerr", "right"), (f"samples/s\n{speed.strip()}", "right")):
        table.add_column(name, justify=justify, overflow="fold", no_wrap=name not in ("config", "outcome"),
                         max_width={"config": 12, "outcome": 13}.get(name))  # "es:T gc:0.8" per line
    for r in rows:
        conf = short_conf(r["alloc_conf"].split(" ")[0]) + "".join(" " + x for x in r["alloc_conf"].split(" ")[1:])
        if r["outcome"] in _UNFINISHED:
            table.add_row(str(r["number"]), r["role"], _fmt(r["batch_size"]), conf, r["outcome_label"],
                          "-", "-", "-", "-", "-", style="dim")
            continue
        m = "" if shared else f" {MEMORY_LABEL.get(r['memory_source'], r['memory_source'])}"
        t = "" if shared else f" {throughput_label(r['memory_source'])}"
        table.add_row(  # outcomes wrap between words: "predicted_infeasible" reads "predicted infeasible"
            str(r["number"]), r["role"], str(r["batch_size"]), conf, r["outcome_label"].replace("_", " "),
            _mib(r["peak_reserved_bytes"]) + (m if r["peak_reserved_bytes"] is not None else "")
            + (_rank_tag(r.get("worst_rank")) if r["peak_reserved_bytes"] is not None else ""),
            _mib(r["peak_allocated_bytes"]) + (m if r["peak_allocated_bytes"] is not None else ""),
            _fmt(r["fragmentation"], ".1%") + (m if r["fragmentation"] is not None else ""),
            _fmt(r["prediction_error"], "+.1%"),
            _fmt(r["throughput"], ".1f") + (t if r["throughput"] is not None else ""),
            style="bold green" if r["number"] == best_number else None,
        )
    return table


def _longest_word(value: Any, *, whole_lines: bool = False) -> int:
    """The longest word of a cell (its longest line when the column does not wrap)."""
    text = value.plain if hasattr(value, "plain") else str(value)
    parts = text.splitlines() if whole_lines else text.split()
    return max((len(part) for part in parts), default=0)


def fit_table(table: Any, width: int, *, key_columns: int = 1) -> Any:
    """``table`` laid out for ``width`` columns without ever breaking a word inside a cell (rich
    folds a word that does not fit its column: "defau/lt", ">limi/t@1").

    Each column gets its longest word (header or cell) as its minimum width, so rich wraps cells only
    between words. When even those minimums do not fit ``width``, the columns are split into
    several tables printed one under the other, each repeating the first ``key_columns`` columns
    (the trial number) and fitting ``width``: whole cells move, none is cut. Returns ``table``
    itself when it fits, else a ``rich.console.Group`` of the parts.
    """
    from rich.console import Group
    from rich.table import Table

    columns = table.columns
    if not columns:
        return table
    need = [max([_longest_word(c.header, whole_lines=c.no_wrap)]
                + [_longest_word(v, whole_lines=c.no_wrap) for v in c._cells]) for c in columns]
    for column, n in zip(columns, need):
        column.min_width = max(column.min_width or 0, n)
        if column.max_width is not None and column.max_width < n:
            column.max_width = n
    import io

    from rich.console import Console

    def part(idx: list[int], title: Any) -> Any:
        sub = Table(title=title, title_justify=table.title_justify, box=table.box, header_style=table.header_style,
                    padding=table.padding, pad_edge=table.pad_edge, collapse_padding=table.collapse_padding,
                    show_edge=table.show_edge)
        for i in idx:
            c = columns[i]
            sub.add_column(c.header, justify=c.justify, no_wrap=c.no_wrap, min_width=need[i],
                           max_width=max(need[i], c.max_width or 0) if c.max_width else None, overflow="fold")
        for r, row in enumerate(table.rows):
            sub.add_row(*(columns[i]._cells[r] for i in idx), style=row.style)
        return sub

    def fits(idx: list[int]) -> bool:
        # rich's own layout at ``width``, uncropped: its measured minimum can be narrower than what it
        # then draws (a 7-column table measured 79 was drawn 86 wide at 80 columns, or cropped to 80)
        out = io.StringIO()
        Console(file=out, width=max(width, 1)).print(part(idx, None), crop=False)
        return max((len(line) for line in out.getvalue().splitlines()), default=0) <= width

    every = list(range(len(columns)))
    if fits(every):
        return table
    keys, rest = every[:key_columns], every[key_columns:]
    groups: list[list[int]] = []
    for i in rest:
        if groups and fits(keys + groups[-1] + [i]):
            groups[-1].append(i)
        else:
            groups.append([i])
    return Group(*(part(keys + g, f"{table.title} ({n}/{len(groups)})" if table.title else None)
                   for n, g in enumerate(groups, 1)))


def trial_table_legend(rows: list[dict[str, Any]]) -> list[str]:
    """The lines under :func:`trial_table`: what its columns and source labels mean, and the
    abbreviations its config column uses (each line under 100 columns)."""
    confs = [r["alloc_conf"].split(" ")[0] for r in rows]
    lines = ["peak resv / alloc: peak reserved / allocated; frag: 1 - peak active / peak reserved",
             "pred err: (predicted - measured) / measured peak reserved; ok >limit: ran, above the limit",
             ">limit@n: stopped after step n, the first above the limit: peaks and frag of n steps",
             "(sim): simulated on the virtual GPU; (dev): measured on the device; "
             "(CPU): this CPU's samples/s"]
    if any(r.get("world_size") for r in rows):
        lines.append("rN: several ranks per trial: the worst rank's peak (rank N); each rank's in "
                     "oomtune show --json")
    used = conf_legend(confs)
    if used:
        lines += legend_lines("config: ", used + "; default = torch's defaults")
    return lines


def describe(trial: Any) -> str:
    """The configuration of a trial in one string: the exact PYTORCH_CUDA_ALLOC_CONF ("(default)"
    for torch's defaults) plus any searched data-loader settings (``num_workers=2``) and ``+ckpt``
    for activation checkpointing on (when searched)."""
    conf = trial.user_attrs.get(R.ATTR_CONF) or "(default)"
    loader = [f"{k[len('data.'):]}={v}" for k, v in sorted(trial.params.items()) if k.startswith("data.")]
    ckpt = ["+ckpt"] if trial.params.get("activation_checkpointing") is True else []
    return " ".join([conf, *loader, *ckpt])


def outcome_label(trial: Any, res: Any) -> str:
    """``ok``, ``ok >limit`` (ran but its peak exceeded budget x (1 - headroom); ``ok >limit@n``: it
    stopped after step n, the first above the limit, so its figures are those of n steps), or the
    outcome; ``=#n`` marks a measurement reused from trial n (an identical earlier trial, or the
    recording of the same candidate: ``from_recording``)."""
    label = res.outcome.value
    if res.outcome is Outcome.OK and not R.is_feasible_ok(trial):
        label = "ok >limit"
        stopped = res.stopped_over_limit
        if stopped is not None:   # the trial stopped after this step (TrialSpec.limit_bytes): figures of that many steps
            label += f"@{stopped.step}"
    reused = trial.user_attrs.get(R.ATTR_REUSED, trial.user_attrs.get(R.ATTR_FROM_RECORDING))
    return label if reused is None else f"{label} =#{reused}"


def progress_line(trial: Any, role: str, index: int | None, total: int | None, best: float | str | None) -> str:
    """``[trial 7] search 3/12  bs=128  es:T  ok  1.21 GiB (sim)  812.3/s (CPU)  best #7``: one
    line per finished trial, under 100 columns for the usual settings (allocator settings
    abbreviated: :func:`short_conf`; the labels are explained once by :data:`SEARCH_LEGEND`). A failed
    trial's message follows on a second, indented line."""
    res = R.result_of(trial)
    where = f"[trial {trial.number}] {role}" + (f" {index}/{total}" if index is not None and total else "")
    if res is None:
        return f"{where}  {trial.state.name.lower()}"
    conf = short_conf(trial.user_attrs.get(R.ATTR_CONF))
    loader = [f"{k[len('data.'):]}={v}" for k, v in sorted(trial.params.items()) if k.startswith("data.")]
    conf = " ".join([conf, *loader])
    parts = [f"{where:<23} bs={res.batch_size:<5} {conf:<11} {outcome_label(trial, res):<9}"]
    if res.memory.peak_reserved_bytes is not None:
        src = res.memory.source
        parts.append(f"{format_bytes(res.memory.peak_reserved_bytes)} ({MEMORY_LABEL.get(src, src)})"
                     + _rank_tag(rank_fields(res).get("worst_rank")))
    if res.throughput.samples_per_s is not None:
        parts.append(f"{res.throughput.samples_per_s:.1f}/s ({throughput_label(res.memory.source)})")
    if best is not None:  # the leader under the final ranking rule (a trial number, or a description)
        parts.append(f"best {best}" if isinstance(best, str) else f"best {best:.1f}")
    line = "  ".join(parts)
    if res.outcome is not Outcome.OK and res.message:
        line += "\n    " + " ".join(res.message.split())
    return line


def recommended_configuration(configurations: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The plan's pick: the configuration with the largest fitting batch, ties broken by the smaller
    predicted peak reserved there (twins folded into another, ``twin_of``, are never picked: their
    representative is); None when none fits any batch."""
    fitting = [c for c in configurations if c.get("max_batch_size") and c.get("twin_of") is None]
    if not fitting:
        return None

    def key(c: dict[str, Any]) -> tuple[int, int]:
        peak = (c.get("at_max") or {}).get("peak_reserved_bytes") or 0
        return (c["max_batch_size"], -peak)

    return max(fitting, key=key)


def plan_recommendation(configurations: list[dict[str, Any]]) -> str | None:
    """One line from a plan's configurations (plan.yaml ``configurations``: ``alloc_conf``,
    ``max_batch_size``, ``at_max``): the configuration with the largest fitting batch (ties: the
    smaller predicted peak reserved) against torch's default allocator, e.g.
    ``"expandable_segments:True: batch 185 vs 155 with the default allocator, +19%"``. None when
    no configuration fits any batch."""
    best = recommended_configuration(configurations)
    if best is None:
        return None
    default = next((c for c in configurations if not c.get("alloc_conf")), None)
    name = best.get("alloc_conf") or "the default allocator"
    if default is None:
        return f"{name}: batch {best['max_batch_size']} (the default allocator was not in the space)"
    base = default.get("max_batch_size")
    if not base:
        return f"{name}: batch {best['max_batch_size']}; the default allocator fits no batch of the grid"
    if best is default or best["max_batch_size"] <= base:
        return f"the default allocator: batch {base}; no allocator setting fits a larger batch"
    gain = best["max_batch_size"] / base - 1
    return f"{name}: batch {best['max_batch_size']} vs {base} with the default allocator, {gain:+.0%}"


class SearchProgress:
    """The search's progress: a live rich bar (spinner, the running trial, search trials done of
    ``n_trials`` + confirmation, elapsed time and an estimate to the end) on a terminal, and one
    line per finished trial (:func:`progress_line`) above it; when the console is not a terminal
    (CI logs) only the per-trial lines. Call :meth:`wrap` on the trial runner to show which trial
    runs, and :meth:`close` at the end.

    The running trial reads as its role, batch and settings, and, from the progress record its
    process rewrites after each step (:data:`oomtune.trial.record.PROGRESS_FILE`), its step and an
    estimate of the rest from the mean time of the steps done: ``confirm bs=493 es:T 6/10 steps ~8s
    left`` (refreshed twice a second by a thread while the bar is live).

    Args:
        console: a rich Console (its ``is_terminal`` picks the mode).
        n_trials: the sampler's trials (``search.n_trials``).
        study: a resumed study: finished search trials and the best so far count from the start.
    """

    def __init__(self, console: Any, n_trials: int, *, study: Any = None):
        import threading

        self.console, self.n_trials, self.count = console, n_trials, 0
        #: a callable returning the leading FrozenTrial under the final ranking rule (set by the search)
        self.leader: Any = lambda: None
        #: a callable returning the role of the trial the calling thread runs (set by the search)
        self.role_of: Any = lambda: None
        for t in study.get_trials(deepcopy=False) if study is not None else ():  # resumed study
            if t.user_attrs.get(R.ATTR_ROLE) == "search" and R.ATTR_RESULT in t.user_attrs:
                self.count += 1
        self._bar = self._task = None
        self._running: dict[Any, tuple[str, int, str]] = {}   # workdir -> (role, batch, settings)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._poller: Any = None
        if getattr(console, "is_terminal", False):
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn,
                                       TimeElapsedColumn, TimeRemainingColumn)

            self._bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(bar_width=24),
                                 MofNCompleteColumn(), TextColumn("elapsed"), TimeElapsedColumn(),
                                 TextColumn("eta"), TimeRemainingColumn(), console=console, transient=True)
            total = n_trials + 1 if n_trials else None  # the sampler's trials + the confirmation
            self._task = self._bar.add_task("preparing", total=total, completed=min(self.count, n_trials))
            self._bar.start()
            self._poller = threading.Thread(target=self._poll, name="oomtune-progress", daemon=True)
            self._poller.start()

    def legend(self, *, simulated: bool, confs: list[str] = (), execute: str = "cpu",
               own_process: bool = False) -> None:
        """Print the legend of the per-trial lines (:data:`SEARCH_LEGEND`), the abbreviations of the
        allocator settings ``confs`` (alloc_conf strings) and, on the virtual GPU, where the trials'
        steps run (``execute``: ``meta``, no throughput; ``cpu``, this CPU's throughput). With
        ``own_process`` (the target runs its own command: ``Target.own_process``) ``meta`` is asked
        of the command, whose integration runs its steps there, while a command without one runs
        them on the CPU (:func:`oomtune.trial.execute.resolve_execute`): both are said."""
        for line in SEARCH_LEGEND:
            self._say(line)
        used = conf_legend(list(confs))
        for line in legend_lines("  settings: ", used) if used else ():
            self._say(line)
        if simulated and execute == "meta" and own_process:
            self._say("note: virtual GPU: memory figures are simulated; a command with an oomtune integration "
                      "runs its steps on the meta device (throughput not measured), one without runs them on the "
                      "CPU (throughput this CPU's, not a GPU's)")
        elif simulated and execute == "meta":
            self._say("note: virtual GPU: memory figures are simulated; the steps run on the meta device, so "
                      "throughput is not measured")
        elif simulated:
            self._say("note: virtual GPU: memory figures are simulated; throughput is this CPU's, not a GPU's")

    def running(self, batch_size: int, alloc_conf: str, *, role: str | None = None, workdir: Any = None) -> None:
        """Show the trial that is starting (live bar only); ``workdir``: where its progress record is."""
        if self._bar is None:
            return
        with self._lock:
            self._running[workdir] = (role or "trial", batch_size, short_conf(alloc_conf))
        self._refresh()

    def finished(self, workdir: Any) -> None:
        """The trial running in ``workdir`` ended (its line comes through :meth:`__call__`)."""
        with self._lock:
            self._running.pop(workdir, None)

    def describe_running(self) -> str:
        """The bar's description: each running trial's role, batch, settings, steps and estimate."""
        with self._lock:
            running = list(self._running.items())
        return "; ".join(running_description(role, batch, conf, _progress_of(workdir))
                         for workdir, (role, batch, conf) in running) or "between trials"

    def _refresh(self) -> None:
        if self._bar is not None:
            self._bar.update(self._task, description=self.describe_running())

    def _poll(self) -> None:
        while not self._stop.wait(0.5):
            if self._running:
                try:
                    self._refresh()
                except Exception:  # noqa: BLE001 - a display refresh must never stop the search
                    pass

    def wrap(self, runner: Any) -> Any:
        """``runner`` whose ``run(spec, ...)`` first calls :meth:`running` (other attributes pass through)."""
        return _ShowingRunner(runner, self)

    def __call__(self, trial: Any, role: str) -> None:
        """A trial finished (the search's ``on_trial`` callback): print its line with the leader so
        far, advance the bar."""
        index = None
        if role == "search":
            self.count += 1
            index = self.count
        lead = self.leader()
        best = None if lead is None else f"#{lead.number}"
        self._say(progress_line(trial, role, index, self.n_trials if index else None, best))
        res = R.result_of(trial)
        survivors = res.process.survivors if res is not None else ()
        if survivors:   # processes the trial left that could not be killed: named, one line
            from oomtune.trial.keeper import survivor_line

            self._say(survivor_line(f"[trial {trial.number}]", survivors))
        if self._bar is not None and (not self.n_trials or role in ("search", "confirm")):
            self._bar.update(self._task, advance=1)  # no total: count every trial

    def close(self) -> None:
        """Stop the live bar (idempotent)."""
        self._stop.set()
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def _say(self, text: str) -> None:
        self.console.print(text, highlight=False, markup=False, soft_wrap=True)


def _progress_of(workdir: Any) -> dict[str, Any] | None:
    if workdir is None:
        return None
    from pathlib import Path

    from oomtune.trial.record import PROGRESS_FILE, read_progress_record

    return read_progress_record(Path(workdir) / PROGRESS_FILE)


def running_description(role: str, batch_size: int, conf: str, progress: dict[str, Any] | None) -> str:
    """One running trial for the progress bar: ``confirm bs=493 es:T 6/10 steps ~8s left`` (the
    estimate: the mean time of the steps done times the steps left), ``... starting`` before its
    first step, ``... soak`` once its steps are done and the virtual-GPU soak runs."""
    head = f"{role} bs={batch_size} {conf}"
    if progress is None:
        return f"{head} starting"
    if progress.get("phase") == "soak":
        return f"{head} soak"
    done, total, step_s = progress["steps_done"], progress["steps_total"], progress.get("step_s")
    text = f"{head} {done}/{total} steps"
    if step_s is not None and done < total:
        text += f" ~{_seconds(step_s * (total - done))} left"
    return text


def _seconds(s: float) -> str:
    """``8s``, ``2m05s``, ``1h02m``."""
    s = max(0, int(round(s)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class _ShowingRunner:
    """A trial runner that tells a :class:`SearchProgress` which trial starts, and where its progress
    record is."""

    def __init__(self, runner: Any, progress: SearchProgress):
        self._runner, self._progress = runner, progress

    def run(self, spec: Any, *args: Any, **kwargs: Any) -> Any:
        workdir = kwargs.get("workdir", args[0] if args else None)
        self._progress.running(spec.batch_size, spec.alloc_conf, role=self._progress.role_of(), workdir=workdir)
        try:
            return self._runner.run(spec, *args, **kwargs)
        finally:
            self._progress.finished(workdir)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)


def _compact_mib(n: int | None) -> str:
    """Bytes as a short MiB figure for narrow tables: ``"966"``; from 10 GiB on ``"12.3G"``."""
    if n is None:
        return "-"
    mib = n / 2**20
    return f"{mib / 1024:.1f}G" if mib >= 10240 else f"{mib:.0f}"


def plan_compact_table(plan: dict[str, Any], *, width: int = 120) -> tuple[Any, str]:
    """A plan (plan.yaml mapping) as a rich Table that fits ``width`` columns, and its legend line.

    Rows: configurations abbreviated (:func:`short_conf`), twins folded (a configuration with
    ``twin_of`` is left out; its representative reads ``es:T +1``, :data:`FOLD_LEGEND`); columns: the
    largest fitting batch, its predicted peak reserved, and as many grid batches as fit (every other
    one dropped until they do; report.html has them all). Cells: predicted peak reserved in MiB
    (simulated), ``>N`` above the limit, ``OOM`` when the replay ran out of memory.
    """
    from rich import box
    from rich.table import Table

    every = plan.get("configurations") or []
    confs = [c for c in every if c.get("twin_of") is None]

    def name(c: dict[str, Any]) -> str:
        return short_conf(c.get("alloc_conf")) + (f" +{len(c['twins'])}" if c.get("twins") else "")
    batches = list(plan.get("batch_sizes") or [])
    name_w = max([len(name(c)) for c in confs] + [7])
    fixed = name_w + 2 + 7 + 10
    while batches and fixed + 8 * len(batches) > width:
        batches = batches[::2] if len(batches) > 2 else batches[:1]
        if len(batches) == 1:
            break
    table = Table(box=box.SIMPLE_HEAD, padding=(0, 1), header_style="bold", pad_edge=False,
                  title="predicted peak reserved, MiB (simulated)")
    table.add_column("config", no_wrap=True)
    table.add_column("max bs", justify="right", no_wrap=True)
    table.add_column("MiB@max", justify="right", no_wrap=True)
    for b in batches:
        table.add_column(f"b={b}", justify="right", no_wrap=True)
    for c in confs:
        cells = {x["batch_size"]: x for x in c.get("batches") or []}
        at = (c.get("at_max") or {}).get("peak_reserved_bytes")
        row = [name(c), str(c.get("max_batch_size") or "none"), _compact_mib(at)]
        for b in batches:
            x = cells.get(b)
            if x is None:
                row.append("-")
            elif not x.get("completes", True):
                row.append("OOM")
            elif not x.get("fits"):
                row.append(">" + _compact_mib(x.get("peak_reserved_bytes")))
            else:
                row.append(_compact_mib(x.get("peak_reserved_bytes")))
        table.add_row(*row)
    legend = conf_legend([c.get("alloc_conf") or "" for c in every])
    legend = (("legend: " + legend + "\n" if legend else "") + "cells: MiB (G: GiB); >N: completes above the limit "
              "(budget - headroom); OOM: does not fit; default = torch's defaults; full table: report.html")
    folded = fold_note(every)
    if folded:
        legend += "\n" + FOLD_LEGEND + "\n" + folded
    return table, legend


def output_console(*, stderr: bool = False, **kwargs: Any) -> Any:
    """The rich Console of a command's human output.

    On a terminal: rich's own (the terminal's width). Piped, redirected or captured (a log, CI, a test):
    ``COLUMNS`` columns when set, else 200 (rather than rich's 80), and ``soft_wrap`` so that a text line
    stays one line (greppable, never broken where a long storage URL or path happens to push it past the
    width). Tables are laid out for the width by :func:`fit_table`, which moves whole cells and cuts none.

    Args:
        stderr: write to stderr (progress) instead of stdout (results).
        kwargs: passed to ``rich.console.Console`` (``highlight=False`` ...).
    """
    import os

    from rich.console import Console

    console = Console(stderr=stderr, **kwargs)
    if console.is_terminal:
        return console
    columns = os.environ.get("COLUMNS", "")
    return Console(stderr=stderr, width=int(columns) if columns.isdigit() and int(columns) > 0 else 200, soft_wrap=True, **kwargs)


def starting(console: Any, text: str = "starting: checking the config, importing torch ...") -> Any:
    """A context manager: a rich spinner with ``text`` on a terminal (the seconds before the first
    line are not silent), nothing otherwise."""
    import contextlib

    if getattr(console, "is_terminal", False):
        return console.status(text)
    return contextlib.nullcontext()
