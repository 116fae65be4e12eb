"""``oomtune simulate TRACE.pickle``: replay a real memory snapshot under allocator settings.

The trace is a ``torch.cuda.memory._dump_snapshot`` pickle, loaded with the restricted unpickler
(:func:`oomtune.trace.load_snapshot`). By default the replay uses the settings the snapshot records
(``allocator_settings``) and, when the trace shows the device running short, the device limit it
implies; each ``--conf`` is one PYTORCH_CUDA_ALLOC_CONF string to replay under instead (``""``:
torch's defaults), ``--budget`` a capacity. Output labels every figure ``(simulated)`` or
``(recorded on device)`` and says which rule decided who made each recorded release.

Without ``--device`` every device holding memory (trace entries or segments) is replayed, one after
the other; ``--device N`` replays one. ``--json`` prints one JSON object for one device and one
``--conf`` (or none), and a JSON list of such objects otherwise, device by device and in ``--conf``
order within a device (:func:`json_record`; each object names its ``device``). Its keys say where each figure comes from:
``simulated_*`` from the virtual GPU's replay (``simulated_peak_allocated_bytes``,
``simulated_peak_reserved_bytes``, ``simulated_peak_active_bytes``, ``simulated_final_reserved_bytes``,
``simulated_fragmentation``, ``simulated_num_alloc_retries``, ``simulated_oom``, ``simulated_oom_at``,
``simulated_segment_events`` / ``_allocs`` / ``_frees``, ``simulated_ooms``), ``recorded_*`` from the
snapshot, i.e. what the device did (``recorded_peak_reserved_bytes``,
``recorded_final_reserved_bytes``, ``recorded_initial_reserved_bytes``, ``recorded_initial_live_bytes``:
the state when recording began, rebuilt from the snapshot; ``recorded_segment_*``, ``recorded_ooms``,
``recorded_allocator_settings``); the other keys describe the replay (``settings``,
``settings_source``, ``budget_bytes``, ``total_memory_bytes``, ``budget_source``, ``device_limit``,
``events_replayed``, ``first_divergence``, ``divergence``, ``exact``, ``releases``, ``notes``, ...).
Sizes in bytes.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from oomtune.exceptions import ConfigError
from oomtune.units import format_bytes

__all__ = ["register", "run", "json_record", "JSON_RENAMED"]


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``simulate`` parser to the dispatcher's sub-parsers (sets ``func=run``)."""
    p = subparsers.add_parser(
        "simulate",
        help="replay a torch.cuda.memory._snapshot() pickle under allocator settings",
        description="Replay a real GPU memory snapshot (torch.cuda.memory._dump_snapshot) through the "
        "virtual GPU under one or more allocator settings, and compare with what the device did.",
    )
    p.add_argument("trace", metavar="TRACE.pickle", help="snapshot pickle (loaded without executing code)")
    p.add_argument("--conf", action="append", default=None, metavar="SETTINGS",
                   help="PYTORCH_CUDA_ALLOC_CONF string; repeat to compare several (default: the settings "
                   "recorded in the snapshot; \"\" for torch's defaults)")
    p.add_argument("--budget", default=None, metavar="SIZE",
                   help="virtual GPU capacity, e.g. 16GiB (default: the device limit the trace implies when "
                   "it ran short, else 1 TiB, nothing runs out)")
    p.add_argument("--memory-fraction", type=float, default=None, metavar="F",
                   help="the program's torch.cuda.set_per_process_memory_fraction(F) (needs --budget, the "
                   "device's capacity); garbage_collection_threshold acts only under a fraction")
    p.add_argument("--device", type=int, default=None, metavar="N",
                   help="replay only this device's trace (default: every device holding trace entries or "
                   "segments, one after the other)")
    p.add_argument("--max-size", default=None, metavar="SIZE",
                   help="read a snapshot file up to this size, e.g. 4GiB (default 1GiB: unpickled, a snapshot "
                   "takes 5-10x its file size in memory)")
    p.add_argument("--releases", choices=("auto", "all", "none"), default="auto",
                   help="which recorded segment releases become empty_cache() in the replay: auto (those the "
                   "program made, told apart from the allocator's own release-and-retry), all, none")
    p.add_argument("--json", action="store_true", help="print JSON (an object; a list for several --conf)")
    p.set_defaults(func=run)
    return p


#: :class:`oomtune.trace.SnapshotReplay` fields renamed in ``--json`` so that every figure names its
#: source (the other fields keep their names, already ``simulated_*``, ``recorded_*`` or neither).
JSON_RENAMED = {
    "peak_allocated_bytes": "simulated_peak_allocated_bytes",
    "peak_reserved_bytes": "simulated_peak_reserved_bytes",
    "peak_active_bytes": "simulated_peak_active_bytes",
    "fragmentation": "simulated_fragmentation",
    "num_alloc_retries": "simulated_num_alloc_retries",
    "oom": "simulated_oom",
    "oom_at": "simulated_oom_at",
    "initial_reserved_bytes": "recorded_initial_reserved_bytes",
    "initial_live_bytes": "recorded_initial_live_bytes",
}


def json_record(result: Any, *, budget_bytes: int | None, trace: str) -> dict[str, Any]:
    """One replay as ``--json`` prints it: :meth:`SnapshotReplay.to_dict` with the keys of
    :data:`JSON_RENAMED` renamed (``simulated_`` / ``recorded_`` say where a figure comes from; see
    the module docstring), plus ``budget_bytes`` (``--budget``, None when not given) and ``trace``
    (the path)."""
    out = {JSON_RENAMED.get(k, k): v for k, v in result.to_dict().items()}
    return dict(out, budget_bytes=budget_bytes, trace=trace)


def _size(text: str | None, flag: str) -> int | None:
    """A size flag's value in bytes (a unit is required: ``1024`` alone is refused as ambiguous, as
    ``budget=1024`` is for ``oomtune search``), or None when the flag was not given.

    Raises:
        ConfigError: an unparsable or ambiguous size, or one <= 0.
    """
    if text is None:
        return None
    from oomtune.units import parse_size_with_unit

    size = parse_size_with_unit(text, what=flag)
    if size <= 0:
        raise ConfigError(f"invalid {flag} {text!r}: must be greater than 0")
    return size


def _budget(text: str | None) -> int | None:
    return _size(text, "--budget")


def run(args: argparse.Namespace) -> int:
    """Run ``oomtune simulate``; returns 0 (the replay's OOM is a result, not an error).

    Raises:
        SnapshotError: missing, hostile or malformed trace file; no trace for ``--device``.
        AllocatorConfigError: a malformed ``--conf``.
        ConfigError: a malformed ``--budget``.
    """
    from oomtune.alloc.settings import AllocatorSettings
    from oomtune.trace import load_snapshot, replay_snapshot
    from oomtune.trace.snapshot import DEFAULT_MAX_BYTES

    budget = _budget(args.budget)
    max_size = _size(getattr(args, "max_size", None), "--max-size") or DEFAULT_MAX_BYTES
    fraction = args.memory_fraction
    if fraction is not None and not (0 < fraction <= 1):
        raise ConfigError(f"invalid --memory-fraction {fraction}: must be in (0, 1]")
    if fraction is not None and budget is None:
        raise ConfigError("--memory-fraction needs --budget (the device's capacity the fraction is of)")
    from oomtune.trace import RECORDED, default_device, devices_with_data

    settings = [AllocatorSettings.parse(c) for c in args.conf] if args.conf else [RECORDED]
    if fraction is None and any(getattr(x, "garbage_collection_threshold", 0) > 0 for x in settings):
        # torch collects garbage only under a per-process memory fraction (garbage_collect_cached_blocks
        # runs when set_fraction is true): without one the threshold does nothing, so say so
        from oomtune.display import wrapped

        for part in wrapped("oomtune: note: garbage_collection_threshold does nothing without a memory fraction "
                            "(torch reclaims cached blocks only when set_per_process_memory_fraction was "
                            "called): add --memory-fraction F --budget SIZE"):
            print(part, file=sys.stderr)
    snapshot = load_snapshot(args.trace, max_bytes=max_size)
    held = devices_with_data(snapshot)
    if args.device is not None:
        devices = [args.device]
    else:   # every device holding memory; an empty snapshot: device 0, noted as holding nothing
        devices = held or [default_device(snapshot)]
    by_device = {
        device: [replay_snapshot(snapshot, s, total_memory_bytes=budget, device=device, releases=args.releases,
                                 memory_fraction=fraction)
                 for s in settings]
        for device in devices
    }
    if args.json:
        objs = [json_record(r, budget_bytes=budget, trace=str(args.trace))
                for results in by_device.values() for r in results]
        print(json.dumps(objs[0] if len(objs) == 1 else objs, indent=2, sort_keys=True))
        return 0
    from oomtune.display import output_console

    console = output_console(highlight=False)
    traces = snapshot["device_traces"]

    def entries(device: int) -> int:
        return len(traces[device]) if 0 <= device < len(traces) else 0

    where = f"Trace {args.trace}: devices with data: {', '.join(map(str, held)) or 'none'}; "
    if len(devices) == 1:
        _say(console, where + f"replaying device {devices[0]} ({entries(devices[0]):,} entries)")
    else:
        _say(console, where + "replaying each, one after the other (--device N for one)")
    oom_devices = [d for d, t in enumerate(traces) if d not in devices and any(e.get("action") == "oom" for e in t)]
    if oom_devices:
        others = ", ".join(map(str, oom_devices))
        _say(console, f"Note: device {others} recorded an out-of-memory error that this replay does not show: "
                      f"add --device {oom_devices[0]} to replay it")
    for device, results in by_device.items():
        if len(devices) > 1:
            _say(console, f"== Device {device} ({entries(device):,} entries, "
                          f"{sum(1 for x in snapshot['segments'] if x.get('device', 0) == device)} segments at the end)")
        r0 = results[0]
        _say(console, f"Budget: {_budget_text(r0)}"
                      + (f", memory fraction {fraction} (limit {format_bytes(round(fraction * r0.total_memory_bytes))})"
                         if fraction is not None else ""))
        if r0.releases:
            _say(console, f"Recorded releases: {_releases_text(r0.releases)}")
        if len(results) == 1:
            _print_one(console, results[0], _recorded_on(snapshot))
        else:
            _print_table(console, results, _recorded_on(snapshot))
    return 0


def _budget_text(r: Any) -> str:
    lim = r.device_limit
    if r.budget_source == "given":
        text = f"{format_bytes(r.total_memory_bytes)} (given)"
    elif r.budget_source == "inferred from the trace":
        high = "?" if lim["high_bytes"] is None else format_bytes(lim["high_bytes"])
        return (f"{format_bytes(r.total_memory_bytes)}: the device limit inferred from the trace, between "
                f"{format_bytes(lim['low_bytes'])} and {high} ({'; '.join(lim['sources'])}); --budget overrides")
    else:
        text = "1 TiB (default: the trace never ran short, nothing runs out)"
    if lim is not None:
        high = "?" if lim["high_bytes"] is None else format_bytes(lim["high_bytes"])
        text += f"; the trace implies a device limit between {format_bytes(lim['low_bytes'])} and {high}"
    return text


def _releases_text(releases: list[dict]) -> str:
    explicit = [g for g in releases if g["explicit"]]
    own = [g for g in releases if not g["explicit"]]
    parts = []
    for label, groups in (("the program's empty_cache(), replayed as such", explicit),
                          ("the allocator's own release-and-retry, left to the simulator", own)):
        if groups:
            rules = sorted({g["rule"] for g in groups})
            parts.append(f"{len(groups)} run(s) of {sum(g['count'] for g in groups)} release(s): {label} "
                         f"(decided by: {', '.join(rules)})")
    return "; ".join(parts)


def _settings_label(text: str) -> str:
    return text if text else "(torch defaults)"


#: Where the replay's settings came from (``SnapshotReplay.settings_source``), in words.
_SETTINGS_SOURCES = {"recorded": "recorded in the snapshot", "given": "given with --conf"}


def _settings_line(r: Any) -> str:
    """``Settings: expandable_segments:True (recorded in the snapshot)``; torch's defaults are named
    once: ``Settings: torch defaults (the snapshot records no allocator settings)``."""
    name = r.settings or "torch defaults"
    source = _SETTINGS_SOURCES.get(r.settings_source)
    if source is None:  # "torch defaults (none recorded)": none recorded, or unusable (a Notice says why)
        unusable = any(n.startswith("the recorded allocator_settings cannot be used") for n in r.notes)
        source = ("the snapshot records no allocator settings" if not unusable
                  else "the snapshot's allocator settings cannot be used: see the Notice below")
    return f"Settings: {name} ({source})"


def _mib_list(sizes: list[int], show: int = 24) -> str:
    if not sizes:
        return "none"
    more = f", ... ({len(sizes) - show} more)" if len(sizes) > show else ""
    return ", ".join(f"{s / (1 << 20):g}" for s in sizes[:show]) + more + " MiB"


def _oom_text(r: Any) -> str:
    if not r.oom:
        if r.recorded_ooms and r.simulated_ooms == r.recorded_ooms:
            return (f"no OOM the device did not have; the device's {r.recorded_ooms} out-of-memory "
                    "error(s) reproduced (OOM entries below)")
        return "no"
    at = r.oom_at or {}
    where = ("while rebuilding the starting state" if at.get("phase") == "initial_state"
             else f"at trace entry {at.get('event_index')}")
    return f"yes, {where} (request of {format_bytes(at.get('requested_bytes'))}; the device did not)"


def _reserved_diff(r: Any) -> str:
    diff = r.peak_reserved_bytes - r.recorded_peak_reserved_bytes
    pct = 100.0 * diff / r.recorded_peak_reserved_bytes if r.recorded_peak_reserved_bytes else None
    sign = "+" if diff >= 0 else ""
    return f"{sign}{format_bytes(diff)}" + (f" ({sign}{pct:.2f}%)" if pct is not None else "")


def _event_text(ev: list | None) -> str:
    if ev is None:
        return "nothing (the list ended)"
    action, size, pos = ev
    return f"{action} {format_bytes(size)} at request #{pos}"


def _recorded_on(snapshot: dict[str, Any]) -> str:
    """Where the snapshot's own figures come from: a device, or oomtune's virtual GPU (a
    ``winner_step.pickle`` carries ``oomtune: {memory_source: simulated}``)."""
    meta = snapshot.get("oomtune")
    simulated = isinstance(meta, dict) and meta.get("memory_source") == "simulated"
    return "recorded on the virtual GPU" if simulated else "recorded on device"


def _divergence_text(r: Any, rec: str = "recorded on device") -> str:
    d = r.divergence
    if d is None:
        return (f"none: all {len(r.recorded_segment_events)} segment events (alloc/free/map/unmap, oom) "
                "identical in order, size and request")
    return (f"segment event #{d['index']}: {rec} {_event_text(d['recorded'])}, "
            f"simulated {_event_text(d['simulated'])}")


def _print_one(console: Any, r: Any, rec: str = "recorded on device") -> None:
    frag = "-" if r.fragmentation is None else f"{100 * r.fragmentation:.2f}%"
    lines = [
        _settings_line(r),
        f"Starting state ({rec}): {format_bytes(r.initial_reserved_bytes)} reserved, "
        f"{format_bytes(r.initial_live_bytes)} live" + ("" if r.initial_state_exact else " (rebuilt approximately)"),
        f"Events replayed: {r.events_replayed:,} in {r.replay_seconds:.3f} s",
        f"Peak allocated (simulated): {format_bytes(r.peak_allocated_bytes)}",
        f"Peak reserved (simulated): {format_bytes(r.peak_reserved_bytes)}; ({rec}): "
        f"{format_bytes(r.recorded_peak_reserved_bytes)}; difference {_reserved_diff(r)}",
        f"Final reserved (simulated): {format_bytes(r.simulated_final_reserved_bytes)}; ({rec}): "
        f"{format_bytes(r.recorded_final_reserved_bytes)}",
        f"Fragmentation (simulated, 1 - peak active / peak reserved): {frag}",
        f"Alloc retries (simulated): {r.num_alloc_retries}",
        f"OOM (simulated): {_oom_text(r)}",
    ]
    if r.recorded_segment_events or r.simulated_segment_events:
        lines += [
            f"Segment allocs ({rec}): {len(r.recorded_segment_allocs)}: {_mib_list(r.recorded_segment_allocs)}",
            f"Segment allocs (simulated): {len(r.simulated_segment_allocs)}: {_mib_list(r.simulated_segment_allocs)}",
            f"Segment releases: ({rec}) {r.recorded_segment_frees}, (simulated) {r.simulated_segment_frees}",
            f"OOM entries: ({rec}) {r.recorded_ooms}, (simulated) {r.simulated_ooms}",
            f"First difference: {_divergence_text(r, rec)}",
        ]
    for line in lines + [f"Notice: {note}" for note in r.notes]:
        _say(console, line)


def _print_table(console: Any, results: list[Any], rec: str = "recorded on device") -> None:
    """One row per setting, within 100 columns: settings abbreviated (:func:`oomtune.display.short_conf`),
    two-line headers, legend lines below; an OOM is ``yes`` in the row and described on a line of
    its own under the table (so is a reproduced recorded OOM)."""
    from rich import box
    from rich.table import Table

    from oomtune.display import conf_legend, short_conf

    table = Table(title=f"Replay under each setting (simulated; {rec} where marked)", header_style="bold",
                  box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False, collapse_padding=True, show_edge=False)
    for name in ("config", "peak alloc\n(sim)", "peak resv\n(sim)", "resv vs\nrecorded", "frag\n(sim)",
                 "retries\n(sim)", "segments\nsim / rec", "first\ndiff", "OOM\n(sim)"):
        table.add_column(name, justify="left" if name == "config" else "right", overflow="fold",
                         no_wrap=name != "config")
    for r in results:
        table.add_row(
            short_conf(r.settings), format_bytes(r.peak_allocated_bytes), format_bytes(r.peak_reserved_bytes),
            _reserved_diff(r), "-" if r.fragmentation is None else f"{100 * r.fragmentation:.2f}%",
            str(r.num_alloc_retries), f"{len(r.simulated_segment_allocs)} / {len(r.recorded_segment_allocs)}",
            "none" if r.first_divergence is None else f"#{r.first_divergence}", "yes" if r.oom else "no",
        )
    from oomtune.display import fit_table

    console.print(fit_table(table, console.width))
    lines = ["peak alloc / resv: peak allocated / reserved; resv vs recorded: simulated - recorded peak reserved",
             "frag: 1 - peak active / peak reserved; retries: cudaMalloc retries after freeing the cache",
             "segments: segment allocations, simulated / recorded; first diff: first segment event that "
             "differs (none: all identical)"]
    used = conf_legend([r.settings for r in results])
    lines.append("config: " + (used + "; " if used else "") + "default = torch's defaults")
    lines += [f"OOM (sim), {short_conf(r.settings)}: {_oom_text(r)}" for r in results
              if r.oom or r.recorded_ooms]
    lines.append(f"{rec[0].upper()}{rec[1:]}: peak reserved {format_bytes(results[0].recorded_peak_reserved_bytes)}, "
                 f"final reserved {format_bytes(results[0].recorded_final_reserved_bytes)}")
    lines += [f"Notice ({r.settings or 'torch defaults'}): {note}" for r in results for note in r.notes]
    for line in lines:
        _say(console, line)


def _say(console: Any, text: str) -> None:
    """Print ``text`` wrapped at spaces to 100 columns (:func:`oomtune.display.wrapped`)."""
    from oomtune.display import wrapped

    for part in wrapped(text):
        console.print(part)
