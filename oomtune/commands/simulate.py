"""``oomtune simulate TRACE.pickle``: replay a real memory snapshot under allocator settings.

The trace is a ``torch.cuda.memory._dump_snapshot`` pickle, loaded with the restricted unpickler
(:func:`oomtune.trace.load_snapshot`). Each ``--conf`` is one PYTORCH_CUDA_ALLOC_CONF string (none:
torch's defaults). Output labels every figure ``(simulated)`` or ``(recorded on device)``.

``--json`` prints one JSON object for one ``--conf`` (or none), and a JSON list of such objects, in
``--conf`` order, for several.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from oomtune.exceptions import ConfigError
from oomtune.units import format_bytes, parse_size

__all__ = ["register", "run"]


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
                   help="PYTORCH_CUDA_ALLOC_CONF string; repeat to compare several (default: torch's defaults)")
    p.add_argument("--budget", default=None, metavar="SIZE",
                   help="virtual GPU capacity, e.g. 16GiB (default: 1 TiB, nothing runs out)")
    p.add_argument("--memory-fraction", type=float, default=None, metavar="F",
                   help="the program's torch.cuda.set_per_process_memory_fraction(F) (needs --budget, the "
                   "device's capacity); garbage_collection_threshold acts only under a fraction")
    p.add_argument("--device", type=int, default=0, metavar="N", help="which device's trace to replay")
    p.add_argument("--apply-recorded-releases", action="store_true",
                   help="call empty_cache() where the trace released segments without a cause in the "
                   "request stream (e.g. the program's torch.cuda.empty_cache())")
    p.add_argument("--json", action="store_true", help="print JSON (an object; a list for several --conf)")
    p.set_defaults(func=run)
    return p


def _budget(text: str | None) -> int | None:
    if text is None:
        return None
    budget = parse_size(text)
    if budget <= 0:
        raise ConfigError(f"invalid --budget {text!r}: must be greater than 0")
    return budget


def run(args: argparse.Namespace) -> int:
    """Run ``oomtune simulate``; returns 0 (the replay's OOM is a result, not an error).

    Raises:
        SnapshotError: missing, hostile or malformed trace file; no trace for ``--device``.
        AllocatorConfigError: a malformed ``--conf``.
        ConfigError: a malformed ``--budget``.
    """
    from oomtune.alloc.settings import AllocatorSettings
    from oomtune.trace import load_snapshot, replay_snapshot

    budget = _budget(args.budget)
    fraction = args.memory_fraction
    if fraction is not None and not (0 < fraction <= 1):
        raise ConfigError(f"invalid --memory-fraction {fraction}: must be in (0, 1]")
    if fraction is not None and budget is None:
        raise ConfigError("--memory-fraction needs --budget (the device's capacity the fraction is of)")
    confs = args.conf if args.conf else [""]
    settings = [AllocatorSettings.parse(c) for c in confs]  # every --conf checked before replaying
    snapshot = load_snapshot(args.trace)
    results = [
        replay_snapshot(snapshot, s, total_memory_bytes=budget, device=args.device,
                        apply_recorded_releases=args.apply_recorded_releases, memory_fraction=fraction)
        for s in settings
    ]
    if args.json:
        objs = [dict(r.to_dict(), budget_bytes=budget, trace=str(args.trace), device=args.device)
                for r in results]
        print(json.dumps(objs[0] if len(objs) == 1 else objs, indent=2, sort_keys=True))
        return 0
    from rich.console import Console

    console = Console(highlight=False, soft_wrap=True)
    if not console.is_terminal:  # piped or captured: do not squeeze the table into 80 columns
        console = Console(highlight=False, soft_wrap=True, width=200)
    entries = len(snapshot["device_traces"][args.device]) if args.device < len(snapshot["device_traces"]) else 0
    console.print(f"Trace {args.trace} (device {args.device}): {entries:,} entries; budget "
                  f"{format_bytes(budget) if budget else '1 TiB (default: nothing runs out)'}"
                  + (f", memory fraction {args.memory_fraction} (limit {format_bytes(int(args.memory_fraction * budget))})"
                     if args.memory_fraction is not None and budget else ""))
    if len(results) == 1:
        _print_one(console, results[0])
    else:
        _print_table(console, results)
    return 0


def _settings_label(text: str) -> str:
    return text if text else "(torch defaults)"


def _mib_list(sizes: list[int]) -> str:
    return ", ".join(f"{s / (1 << 20):g}" for s in sizes) + " MiB" if sizes else "none"


def _oom_text(r: Any) -> str:
    if not r.oom:
        return "no"
    at = r.oom_at or {}
    where = ("while rebuilding the starting state" if at.get("phase") == "initial_state"
             else f"at trace entry {at.get('event_index')}")
    return f"yes, {where} (request of {format_bytes(at.get('requested_bytes'))})"


def _reserved_diff(r: Any) -> str:
    diff = r.peak_reserved_bytes - r.recorded_peak_reserved_bytes
    pct = 100.0 * diff / r.recorded_peak_reserved_bytes if r.recorded_peak_reserved_bytes else None
    sign = "+" if diff >= 0 else ""
    return f"{sign}{format_bytes(diff)}" + (f" ({sign}{pct:.2f}%)" if pct is not None else "")


def _divergence_text(r: Any) -> str:
    k = r.first_divergence
    if k is None:
        return "none: same sizes at the same requests"

    def side(sizes: list[int], pos: list[int]) -> str:
        return f"{format_bytes(sizes[k])} at alloc #{pos[k]}" if k < len(sizes) else "nothing"

    return (f"segment alloc #{k}: recorded on device {side(r.recorded_segment_allocs, r.recorded_segment_alloc_positions)}"
            f", simulated {side(r.simulated_segment_allocs, r.simulated_segment_alloc_positions)}")


def _print_one(console: Any, r: Any) -> None:
    frag = "-" if r.fragmentation is None else f"{100 * r.fragmentation:.2f}%"
    lines = [
        f"Settings: {_settings_label(r.settings)}",
        f"Starting state (recorded on device): {format_bytes(r.initial_reserved_bytes)} reserved, "
        f"{format_bytes(r.initial_live_bytes)} live" + ("" if r.initial_state_exact else " (rebuilt approximately)"),
        f"Events replayed: {r.events_replayed:,} in {r.replay_seconds:.3f} s",
        f"Peak allocated (simulated): {format_bytes(r.peak_allocated_bytes)}",
        f"Peak reserved (simulated): {format_bytes(r.peak_reserved_bytes)}; (recorded on device): "
        f"{format_bytes(r.recorded_peak_reserved_bytes)}; difference {_reserved_diff(r)}",
        f"Final reserved (simulated): {format_bytes(r.simulated_final_reserved_bytes)}; (recorded on device): "
        f"{format_bytes(r.recorded_final_reserved_bytes)}",
        f"Fragmentation (simulated, 1 - peak active / peak reserved): {frag}",
        f"Alloc retries (simulated): {r.num_alloc_retries}",
        f"OOM (simulated): {_oom_text(r)}",
    ]
    if r.recorded_segment_allocs or r.recorded_segment_frees:
        lines += [
            f"Segment allocs (recorded on device): {len(r.recorded_segment_allocs)}: {_mib_list(r.recorded_segment_allocs)}",
            f"Segment allocs (simulated): {len(r.simulated_segment_allocs)}: {_mib_list(r.simulated_segment_allocs)}",
            f"Segment releases: (recorded on device) {r.recorded_segment_frees}, (simulated) {r.simulated_segment_frees}",
            f"First divergence: {_divergence_text(r)}",
        ]
    for line in lines:
        console.print(line)
    for note in r.notes:
        console.print(f"Notice: {note}")


def _print_table(console: Any, results: list[Any]) -> None:
    from rich.table import Table

    table = Table(title="Replay under each setting (simulated; recorded on device where marked)")
    for col in ("settings", "peak allocated (sim)", "peak reserved (sim)", "vs recorded peak reserved",
                "fragmentation (sim)", "retries (sim)", "OOM (sim)", "segment allocs sim / recorded",
                "first divergence"):
        table.add_column(col, no_wrap=(col == "settings"))
    for r in results:
        table.add_row(
            _settings_label(r.settings), format_bytes(r.peak_allocated_bytes),
            format_bytes(r.peak_reserved_bytes), _reserved_diff(r),
            "-" if r.fragmentation is None else f"{100 * r.fragmentation:.2f}%",
            str(r.num_alloc_retries), _oom_text(r),
            f"{len(r.simulated_segment_allocs)} / {len(r.recorded_segment_allocs)}",
            "none" if r.first_divergence is None else f"#{r.first_divergence}",
        )
    console.print(table)
    console.print(f"Recorded on device: peak reserved {format_bytes(results[0].recorded_peak_reserved_bytes)}, "
                  f"final reserved {format_bytes(results[0].recorded_final_reserved_bytes)}")
    for r in results:
        for note in r.notes:
            console.print(f"Notice ({_settings_label(r.settings)}): {note}")
