"""A small run directory built by hand, as `oomtune search` leaves it (run.json, study.db, best.yaml,
frontier.yaml, winner_step.pickle), for the report's tests: every figure has something to draw, in
seconds, without running trials. Sizes are chosen so the memory figures can be checked by hand
against the caching allocator's rules (allocator-spec: 512-byte rounding, a 2 MiB small-pool segment
for requests <= 1 MiB, a 20 MiB segment for requests between 1 and 10 MiB)."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import optuna
import yaml

MiB = 1 << 20

#: The winner's step: (action, key, size) -> allocated after each event 3 MiB, 3 MiB + 1000 B,
#: 1000 B, 5 MiB + 1000 B (peak), 1000 B; segments: 20 MiB (large) then 2 MiB (small).
STEP = [("alloc", 1, 3 * MiB), ("alloc", 2, 1000), ("free", 1), ("alloc", 3, 5 * MiB), ("free", 3)]

#: (number, role, batch, alloc_conf, outcome, throughput, peak reserved MiB, seconds from start, duration)
TRIALS = [
    (0, "baseline", 64, "", "ok", 100.0, 600, 0, 4),
    (1, "baseline", 128, "", "oom", None, None, 4, 3),
    (2, "search", 96, "expandable_segments:True", "ok", 130.0, 700, 7, 5),
    (3, "search", 160, "expandable_segments:True", "oom_fragmentation", None, None, 12, 2),
    (4, "search", 200, "max_split_size_mb:128", "predicted_infeasible", None, None, 14, 0),
    (5, "confirm", 96, "expandable_segments:True", "ok", 128.0, 700, 14, 6),
]


def _trial(number, role, batch, conf, outcome, thr, peak_mib, start_s, dur_s, t0):
    # the stored record's nested form (TrialResult.to_dict)
    memory = {"source": "simulated", "peak_reserved_bytes": None if peak_mib is None else peak_mib * MiB,
              "peak_allocated_bytes": None if peak_mib is None else (peak_mib - 50) * MiB,
              "fragmentation": None if peak_mib is None else 50 / peak_mib}
    result = {"outcome": outcome, "batch_size": batch, "alloc_conf": conf, "memory": memory,
              "throughput": {"samples_per_s": thr},
              "message": None if outcome == "ok" else f"{outcome} at batch {batch}"}
    ok = outcome == "ok"
    return optuna.trial.FrozenTrial(
        number=number, trial_id=number, state=optuna.trial.TrialState.COMPLETE, value=thr or 0.0,
        datetime_start=t0 + dt.timedelta(seconds=start_s), datetime_complete=t0 + dt.timedelta(seconds=start_s + dur_s),
        params={"batch_size": batch}, distributions={"batch_size": optuna.distributions.IntDistribution(8, 512)},
        user_attrs={"role": role, "alloc_conf": conf, "outcome": outcome, "result": result},
        system_attrs={"constraints:memory": -0.1 if ok else 1.0}, intermediate_values={})


def make_run_dir(root: Path) -> Path:
    """Write the run directory under ``root`` and return it."""
    from oomtune.alloc.stream import AllocationStream
    from oomtune.htmlreport._step import synthesise_snapshot, write_step_snapshot

    run = root / "run"
    run.mkdir(parents=True)
    url = f"sqlite:///{run / 'study.db'}"
    study = optuna.create_study(storage=url, study_name="handmade", direction="maximize")
    t0 = dt.datetime(2026, 1, 1, 12, 0, 0)
    for row in TRIALS:
        study.add_trial(_trial(*row, t0))
    (run / "run.json").write_text(json.dumps({"storage": url, "study_name": "handmade"}))
    best = {"schema_version": 1, "device": {"name": "virtual GPU (CPU)", "budget_bytes": 1024 * MiB, "headroom": 0.05,
                                            "memory_source": "simulated"},
            "best": {"batch_size": 96, "alloc_conf": "expandable_segments:True", "confirmed": True, "trial_number": 2,
                     "metrics": {"throughput": 128.0, "peak_reserved_bytes": 700 * MiB,
                                 "peak_allocated_bytes": 650 * MiB, "fragmentation": 50 / 700,
                                 "memory_source": "simulated"}},
            "baseline": {"batch_size": 64, "alloc_conf": "", "metrics": {"throughput": 100.0,
                                                                        "peak_reserved_bytes": 600 * MiB}},
            "gain": {"throughput_ratio": 1.3, "batch_size_ratio": 1.5, "peak_reserved_ratio": 700 / 600},
            "study": {"storage": url, "study_name": "handmade", "outcomes": {"ok": 3, "oom": 1}},
            "diagnosis": {"input_bound": False, "reason": "data wait 2% of the step", "advice": None}}
    (run / "best.yaml").write_text(yaml.safe_dump(best))
    frontier = {"schema_version": 1, "kind": "plan", "device": {"budget_bytes": 1024 * MiB}, "memory_source": "simulated",
                "batch_sizes": [32, 64, 128], "limit": {"headroom": 0.05, "limit_bytes": 972 * MiB},
                "configurations": [
                    {"alloc_conf": "", "max_batch_size": 64, "at_max": {"peak_reserved_bytes": 600 * MiB},
                     "batches": [{"batch_size": 32, "fits": True, "completes": True, "peak_reserved_bytes": 300 * MiB},
                                 {"batch_size": 64, "fits": True, "completes": True, "peak_reserved_bytes": 600 * MiB},
                                 {"batch_size": 128, "fits": False, "completes": False,
                                  "peak_reserved_bytes": 1200 * MiB}]},
                    {"alloc_conf": "expandable_segments:True", "max_batch_size": 128,
                     "at_max": {"peak_reserved_bytes": 950 * MiB},
                     "batches": [{"batch_size": 32, "fits": True, "completes": True, "peak_reserved_bytes": 250 * MiB},
                                 {"batch_size": 64, "fits": True, "completes": True, "peak_reserved_bytes": 480 * MiB},
                                 {"batch_size": 128, "fits": True, "completes": True,
                                  "peak_reserved_bytes": 950 * MiB}]}]}
    (run / "frontier.yaml").write_text(yaml.safe_dump(frontier))
    snap = synthesise_snapshot(AllocationStream(STEP), "", total_memory_bytes=1024 * MiB)
    write_step_snapshot(run / "winner_step.pickle", snap)
    return run
