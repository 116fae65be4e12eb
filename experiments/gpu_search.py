"""Run ``oomtune search`` on a real GPU and check that the allocator settings took effect in the trials.

GPU run (about 3-4 minutes on an H200; ``--timeout`` bounds the search command)::

    PYTHONPATH=$PWD python experiments/gpu_search.py

searches ResNet-50 at 224x224 (1000 classes, SGD) under budget=16GiB on cuda:0 (8 sampler trials,
batch 16..512, 5 measured steps, 120 s per trial), with ``search.timeout`` set so the sampler stops
in time for the confirmation run. Then copies best.yaml and the trial table (``oomtune show --json``)
into experiments/results/ (gpu_search_best.yaml, gpu_search_trials.json) and writes
gpu_search.json: the command, its exit status, the trial rows, and the settings check.

Settings check: every trial process records the string torch parsed (``allocator.torch_alloc_conf``,
from ``torch._C._accelerator_getAllocatorSettings``) and, on CUDA, what the allocator reports in
effect (``settings_effective``: the snapshot's ``allocator_settings``); oomtune/trial/child.py already
turns a mismatch into an ``error`` record. Here each trial that ran a process is checked again from
the stored record, and the verdict says whether forked trials (``process.launcher == "fork"``, the
fork server whose torch was imported before the settings were set) with non-default settings were
among them: PASS, FAIL, or INCONCLUSIVE when none ran.

Dry run on CPU (``--device cpu``): a tiny ResNet-18 on the virtual GPU, 2 sampler trials.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))  # experiments/_provenance.py
from _provenance import provenance  # noqa: E402  (command + commit of every results file)
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "experiments" / "results"
GPU_OVERRIDES = ["model=resnet", "model.depth=50", "model.image_size=224", "model.num_classes=1000",
                 "model.optimizer=sgd", "budget=16GiB", "device=cuda:0", "search.n_trials=8",
                 "search.batch_size.low=16", "search.batch_size.high=512", "trial.measure_steps=5",
                 "trial.timeout=120", "trial.confirm_steps=5"]
CPU_OVERRIDES = ["model=resnet", "model.depth=18", "model.image_size=32", "model.num_classes=10",
                 "budget=192MiB", "device=cpu", "search.n_trials=2", "search.batch_size.low=2",
                 "search.batch_size.high=64", "trial.warmup_steps=1", "trial.measure_steps=1",
                 "trial.confirm_steps=1", "trial.timeout=60"]
_MISMATCH = "did not take effect"


def search_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment of the search command: the repo (absolute: trial processes run in other
    directories) first on PYTHONPATH, unbuffered output, and no inherited allocator settings."""
    env = dict(os.environ if base is None else base)
    paths = [str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != "."]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env["PYTHONUNBUFFERED"] = "1"
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        env.pop(name, None)
    return env


def check_record(rec: dict[str, Any], *, cuda: bool) -> dict[str, Any] | None:
    """The settings check of one stored TrialResult dict; None when no trial process ran
    (predicted infeasible, or a measurement reused from another trial).

    ok: no "did not take effect" message, torch parsed exactly ``alloc_conf``, and on CUDA the
    allocator's reported settings carry the same PYTORCH_CUDA_ALLOC_CONF string.
    """
    from oomtune.trial.record import TrialResult

    res = TrialResult.from_dict(rec)   # the current shape, or an earlier one in its documented reading
    launcher = res.process.launcher
    if launcher is None and res.process.pid is None:
        return None
    conf = res.alloc_conf
    torch_conf = res.allocator.torch_alloc_conf
    effective = res.settings_effective
    problems = []
    if _MISMATCH in (res.message or ""):
        problems.append(res.message[:200])
    if torch_conf != conf:
        problems.append(f"torch parsed {torch_conf!r}, expected {conf!r}")
    if cuda:
        seen = None if effective is None else effective.get("PYTORCH_CUDA_ALLOC_CONF")
        if effective is None:
            problems.append("no settings_effective reported by the CUDA allocator")
        elif seen is not None and seen != conf:
            problems.append(f"allocator reports PYTORCH_CUDA_ALLOC_CONF={seen!r}")
        else:
            ok, detail = _settings_match()(conf, None, effective)  # the keys, in torch's units
            if not ok:
                problems.append(f"allocator reports {detail}")
    return {"alloc_conf": conf, "batch_size": res.batch_size, "outcome": res.outcome.value,
            "launcher": launcher, "torch_alloc_conf": torch_conf, "ok": not problems,
            "problems": problems}


def _settings_match() -> Any:
    """gpu_validate.settings_match (one copy of the key-by-key comparison)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_validate import settings_match

    return settings_match


def settings_check(records: list[dict[str, Any]], *, cuda: bool) -> dict[str, Any]:
    """Aggregate :func:`check_record` over trial records: counts and the verdict (see module doc)."""
    checked = [c for c in (check_record(r, cuda=cuda) for r in records) if c is not None]
    forked_custom = [c for c in checked if c["launcher"] == "fork" and c["alloc_conf"]]
    bad = [c for c in checked if not c["ok"]]
    if bad:
        verdict = "FAIL"
    elif not forked_custom:
        verdict = "INCONCLUSIVE"
    else:
        verdict = "PASS"
    return {"verdict": verdict, "trials_checked": len(checked), "failed": len(bad),
            "forked": sum(c["launcher"] == "fork" for c in checked),
            "spawned": sum(c["launcher"] == "spawn" for c in checked),
            "forked_with_non_default_settings": len(forked_custom), "trials": checked}


def run_search(overrides: list[str], log_path: Path, timeout_s: float, head: str = "") -> dict[str, Any]:
    """``python -m oomtune search OVERRIDES`` with its output in ``log_path`` (after ``head``, the
    provenance header); on timeout SIGTERM (the search kills its trials and keeps finished ones), then
    SIGKILL after 15 s."""
    cmd = [sys.executable, "-m", "oomtune", "search", *overrides]
    t0 = time.perf_counter()
    timed_out = False
    with open(log_path, "w") as log:
        log.write(head)
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=search_env(), cwd=REPO,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                rc = proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                rc = proc.wait()
    return {"command": cmd, "rc": rc, "timed_out": timed_out, "elapsed_s": time.perf_counter() - t0}


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # the search's own session (start_new_session): only what we started
    except ProcessLookupError:
        pass


def show_rows(run_dir: Path) -> tuple[list[dict[str, Any]] | None, str | None]:
    """``oomtune show RUN_DIR --json`` rows, or (None, why)."""
    cmd = [sys.executable, "-m", "oomtune", "show", str(run_dir), "--json"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=search_env(), cwd=REPO, timeout=90)
    except subprocess.TimeoutExpired:
        return None, "oomtune show timed out"
    if proc.returncode != 0:
        return None, f"oomtune show exited {proc.returncode}: {proc.stderr.strip()[-300:]}"
    try:
        return json.loads(proc.stdout), None
    except ValueError as exc:
        return None, f"oomtune show printed no JSON: {exc}"


def stored_records(run_dir: Path) -> tuple[list[dict[str, Any]], str | None]:
    """The TrialResult dicts stored on the study's trials (user attr ``result``)."""
    info_path = run_dir / "run.json"
    if not info_path.is_file():
        return [], f"{info_path} missing (the search did not start its study)"
    sys.path.insert(0, str(REPO))
    from oomtune.study import records as R
    from oomtune.study.storage import load_study

    info = json.loads(info_path.read_text())
    study = load_study(info["storage"], info["study_name"])
    return [t.user_attrs[R.ATTR_RESULT] for t in study.get_trials(deepcopy=False)
            if R.ATTR_RESULT in t.user_attrs], None


def outcome_counts(rows: list[dict[str, Any]] | None) -> dict[str, int]:
    """{outcome: number of trials} of ``oomtune show --json`` rows."""
    counts: dict[str, int] = {}
    for r in rows or []:
        counts[r.get("outcome") or "?"] = counts.get(r.get("outcome") or "?", 0) + 1
    return dict(sorted(counts.items()))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: tiny dry run")
    p.add_argument("--timeout", type=float, default=210.0, help="limit for the search command, seconds")
    p.add_argument("--search-timeout", type=float, default=None,
                   help="search.timeout (sampler phase); default: 45 %% of --timeout (baseline probes run before it, the confirmation after)")
    p.add_argument("--out-dir", default=None, help="results directory (default experiments/results)")
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides, appended last")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the search, collect its outputs and check the settings; 0 when best.yaml was written and
    the settings check did not FAIL, else 1."""
    args = _parser().parse_args(argv)
    prov = provenance(None if argv is None else [__file__, *argv])   # at the start: refuses a dirty tree
    head = "".join(f"# {k}: {v}\n" for k, v in prov.items())        # experiments/_provenance.py's header
    cuda = args.device == "cuda"
    out = Path(args.out_dir).resolve() if args.out_dir else RESULTS
    run_dir = out / "gpu_search"
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh study (the same config would resume one)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    sampler_s = args.search_timeout if args.search_timeout is not None else max(30.0, 0.45 * args.timeout)
    overrides = [*(GPU_OVERRIDES if cuda else CPU_OVERRIDES), f"search.timeout={sampler_s:.0f}",
                 f"hydra.run.dir={run_dir}", *args.overrides]
    print(f"gpu_search: oomtune search {' '.join(overrides)}", flush=True)
    run = run_search(overrides, out / "gpu_search_search.log", args.timeout, head)
    print((out / "gpu_search_search.log").read_text()[-6000:], flush=True)
    doc: dict[str, Any] = {**prov, "overrides": overrides, **run, "notes": []}
    rows, why = show_rows(run_dir) if (run_dir / "run.json").is_file() else (None, "no run.json")
    if why:
        doc["notes"].append(why)
    doc["trials"], doc["outcomes"] = rows, outcome_counts(rows)
    if rows is not None:
        (out / "gpu_search_trials.json").write_text(json.dumps({**prov, "trials": rows}, indent=1,
                                                               default=str))
    best = run_dir / "best.yaml"
    doc["best_yaml"] = best.read_text() if best.is_file() else None
    if best.is_file():
        (out / "gpu_search_best.yaml").write_text(head + best.read_text())
    try:
        records, why = stored_records(run_dir)
    except Exception as exc:  # a broken study is reported, not raised
        records, why = [], f"{type(exc).__name__}: {exc}"
    if why:
        doc["notes"].append(why)
    doc["settings_check"] = settings_check(records, cuda=cuda)
    (out / "gpu_search.json").write_text(json.dumps(doc, indent=1, default=str))
    check = doc["settings_check"]
    print(f"gpu_search: rc={run['rc']} timed_out={run['timed_out']} {run['elapsed_s']:.0f} s; outcomes "
          f"{doc['outcomes']}; best.yaml {'written' if best.is_file() else 'MISSING'}; settings check "
          f"{check['verdict']} ({check['trials_checked']} trial processes, {check['forked']} forked, "
          f"{check['forked_with_non_default_settings']} forked with non-default settings, "
          f"{check['failed']} failed)", flush=True)
    return 0 if best.is_file() and check["verdict"] != "FAIL" else 1


if __name__ == "__main__":
    sys.exit(main())
