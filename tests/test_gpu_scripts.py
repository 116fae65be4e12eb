"""CPU tests of the GPU validation scripts (experiments/gpu_validate.py, gpu_search.py, gpu_check.sh):
their pure logic with hand-computed values, and the dry-run paths on the simulator."""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from oomtune.alloc.stream import AllocationStream
from oomtune.trace import loads_snapshot

REPO = Path(__file__).resolve().parent.parent
MiB, GiB = 1 << 20, 1 << 30
#: The dry runs' CPU steps on one thread: the machine's cores are shared with the other tests' processes,
#: where an OpenMP pool of one thread per core spends its idle threads' time spinning (CPU seconds, not
#: results: the virtual GPU's figures do not depend on the thread count, and no CPU timing is asserted).
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "experiments" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


gv = _load("gpu_validate")
gs = _load("gpu_search")


# ---------------------------------------------------------------- gpu_validate: pure helpers

def test_error_pct_sign_and_missing_values():
    assert gv.error_pct(102, 100) == pytest.approx(2.0)
    assert gv.error_pct(95, 100) == pytest.approx(-5.0)   # negative = under-prediction
    assert gv.error_pct(None, 100) is None
    assert gv.error_pct(100, None) is None
    assert gv.error_pct(100, 0) is None


def test_summarize_median_and_worst_under_prediction():
    # |errors| sorted: 0.5, 1.0, 2.5, 3.0 -> median (1.0 + 2.5) / 2 = 1.75; worst under = 3.0
    s = gv.summarize([1.0, -3.0, 2.5, -0.5])
    assert s["median_abs_error_pct"] == pytest.approx(1.75)
    assert s["worst_under_prediction_pct"] == pytest.approx(3.0)
    assert s["max_abs_error_pct"] == pytest.approx(3.0)
    assert s["verdict"] == "PASS"


def test_summarize_fails_on_under_prediction_median_or_missing_case():
    under = gv.summarize([0.1, -6.0, 0.2])          # median 0.2 fine, under-prediction 6 % > 5 %
    assert under["verdict"] == "FAIL" and "under-prediction" in under["reason"]
    wide = gv.summarize([3.0, -3.0, 2.1])           # median |err| 3.0 > 2
    assert wide["verdict"] == "FAIL" and "median" in wide["reason"]
    over_only = gv.summarize([4.0, 0.0, 0.0])       # over-predictions never count as under
    assert over_only["worst_under_prediction_pct"] == 0.0 and over_only["verdict"] == "PASS"
    missing = gv.summarize([0.0, None])
    assert missing["verdict"] == "FAIL" and missing["missing"] == 1 and "incomplete" in missing["reason"]
    assert gv.summarize([None])["verdict"] == "FAIL"


def test_gc_fraction_puts_the_threshold_below_the_default_peak():
    # allowed = 1.15 * 8 GiB; 0.8 * allowed = 0.92 * 8 GiB < 8 GiB, so gc acts
    f = gv.gc_fraction(8 * GiB, 140 * GiB)
    assert f == pytest.approx(1.15 * 8 / 140)
    assert 0.8 * f * 140 * GiB < 8 * GiB
    assert gv.gc_fraction(None, 140 * GiB) == 0.5
    assert gv.gc_fraction(100 * GiB, 140 * GiB) == 0.5     # capped


def test_child_env_sets_both_allocator_variables_and_the_repo_path():
    base = {"PATH": "/bin", "PYTHONPATH": "/x", "PYTORCH_ALLOC_CONF": "stale"}
    env = gv.child_env("expandable_segments:True", base)
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == env["PYTORCH_ALLOC_CONF"] == "expandable_segments:True"
    assert env["PYTHONPATH"].split(os.pathsep) == [str(REPO), "/x"]
    assert base["PYTORCH_ALLOC_CONF"] == "stale"          # not mutated
    assert gv.child_env("", base)["PYTORCH_CUDA_ALLOC_CONF"] == ""


def test_settings_match_reads_torch_units():
    ok, _ = gv.settings_match("max_split_size_mb:128", "max_split_size_mb:128", {"max_split_size": 128 * MiB})
    assert ok
    ok, why = gv.settings_match("max_split_size_mb:128", "max_split_size_mb:128", {"max_split_size": -1})
    assert not ok and "max_split_size" in why               # -1 = SIZE_MAX: the default took effect
    assert gv.settings_match("", "", {"max_split_size": -1})[0]
    assert not gv.settings_match("expandable_segments:True", "", None)[0]
    assert not gv.settings_match("expandable_segments:True", None, {"expandable_segments": False})[0]
    divs = {str(1 << i): 4 for i in range(16)}
    assert gv.settings_match("roundup_power2_divisions:4", None, {"roundup_power2_divisions": divs})[0]
    assert gv.settings_match("garbage_collection_threshold:0.8", None, {"garbage_collection_threshold": 0.8})[0]
    assert not gv.settings_match("garbage_collection_threshold:0.8", None,
                                 {"garbage_collection_threshold": 0.5})[0]


def _one_big_alloc_snapshot():
    a = 1 << 32
    return {"segments": [], "device_traces": [[
        {"action": "segment_alloc", "addr": a, "size": 40 * MiB, "stream": 0},
        {"action": "alloc", "addr": a, "size": 40 * MiB, "stream": 0}]]}


def test_replay_case_applies_the_memory_fraction():
    # 40 MiB request: a 40 MiB segment (>= 10 MiB: rounded to 2 MiB). allowed = 0.3 * 100 MiB = 30 MiB.
    capped = gv.replay_case(_one_big_alloc_snapshot(), "", total_memory_bytes=100 * MiB, fraction=0.3)
    assert capped.oom and capped.peak_reserved_bytes == 0
    free = gv.replay_case(_one_big_alloc_snapshot(), "", total_memory_bytes=100 * MiB, fraction=None)
    assert not free.oom and free.peak_reserved_bytes == 40 * MiB


def _small_stream() -> AllocationStream:
    # 512 B -> small pool, new 2 MiB segment; 12 MiB -> large pool, a 12 MiB segment; then free the first
    return AllocationStream([("alloc", 1, 512, 0), ("alloc", 2, 12 * MiB, 0), ("free", 1)])


def test_synthetic_snapshot_has_torch_trace_order_and_replays_exactly():
    snap, stats = gv.synthetic_snapshot(_small_stream(), "", total_memory_bytes=1 * GiB)
    trace = snap["device_traces"][0]
    assert [(e["action"], e["size"]) for e in trace] == [
        ("segment_alloc", 2 * MiB), ("alloc", 512), ("segment_alloc", 12 * MiB), ("alloc", 12 * MiB),
        ("free_requested", 512), ("free_completed", 512)]
    assert stats["reserved_bytes.all.peak"] == 14 * MiB
    snap = loads_snapshot(pickle.dumps(snap))                # passes oomtune's validation
    r = gv.replay_case(snap, "", total_memory_bytes=1 * GiB, fraction=None)
    assert r.peak_reserved_bytes == 14 * MiB and r.first_divergence is None
    assert r.simulated_segment_allocs == [2 * MiB, 12 * MiB]


def test_synthetic_snapshot_late_recording_is_rebuilt_by_replay():
    snap, _ = gv.synthetic_snapshot(_small_stream(), "", total_memory_bytes=1 * GiB, drop_first=2)
    assert snap["device_traces"][0][0] == {"action": "segment_alloc", "addr": snap["device_traces"][0][0]["addr"],
                                           "size": 12 * MiB, "stream": 0}
    r = gv.replay_case(snap, "", total_memory_bytes=1 * GiB, fraction=None)
    assert r.initial_reserved_bytes == 2 * MiB                # the small segment existed before
    assert r.peak_reserved_bytes == 14 * MiB and r.simulated_segment_allocs == [12 * MiB]


def test_build_row_and_markdown():
    case = gv.Case("x", "max_split_size_mb:128")
    rec = {"conf": case.conf, "max_memory_reserved_bytes": 100 * MiB, "max_memory_allocated_bytes": 90 * MiB,
           "torch_alloc_conf": case.conf, "env": {"PYTORCH_CUDA_ALLOC_CONF": case.conf,
                                                  "PYTORCH_ALLOC_CONF": case.conf}}
    replay = SimpleNamespace(peak_reserved_bytes=98 * MiB, peak_allocated_bytes=90 * MiB,
                             recorded_peak_reserved_bytes=100 * MiB, recorded_segment_allocs=[1, 2, 3],
                             simulated_segment_allocs=[1, 2], recorded_segment_frees=0, simulated_segment_frees=0,
                             first_divergence=2, initial_state_exact=True, initial_reserved_bytes=0,
                             replay_seconds=0.5, oom=False, num_alloc_retries=0, notes=[])
    predicted = SimpleNamespace(peak_reserved_bytes=110 * MiB, oom=False)
    row = gv.build_row(case, rec, replay, predicted)
    assert row["replay_error_pct"] == pytest.approx(-2.0) and row["predicted_error_pct"] == pytest.approx(10.0)
    assert row["settings_took_effect"] and (row["recorded_segment_allocs"], row["simulated_segment_allocs"]) == (3, 2)
    bad = gv.build_row(case, {**rec, "env": {"PYTORCH_CUDA_ALLOC_CONF": ""}}, None, None)
    assert bad["settings_took_effect"] is False
    assert gv.build_row(case, {"error": "child timed out"}, None, None)["settings_took_effect"] is None
    text = gv.markdown([row], {k: gv.summarize([row.get(c)]) for k, c in gv.SUMMARIES},
                       {"model": {}, "batch": 1, "steps": 1})
    assert "| x | `max_split_size_mb:128` |" in text and "| 100.0 | 98.0 | -2.00 |" in text and "3/2" in text


@pytest.mark.slow
def test_gpu_validate_dry_run_end_to_end(tmp_path):
    cases = "default,expandable_segments,gc_threshold_0.8_fraction,default_late_recording"
    assert gv.main(["--device", "cpu", "--cases", cases, "--out-dir", str(tmp_path), "--steps", "2"]) == 0
    doc = json.loads((tmp_path / "gpu_validate.json").read_text())
    rows = {r["case"]: r for r in doc["rows"]}
    assert list(rows) == cases.split(",")
    d = rows["default"]
    # the "device" is the simulator itself: a full-history replay must reproduce it exactly
    assert d["replay_error_pct"] == 0.0 and d["first_divergence"] is None and d["settings_took_effect"]
    assert d["initial_reserved_bytes"] == 0
    # an expandable-segments trace recorded from the start rebuilds an empty starting state (its
    # segment_map events are undone) and replays exactly
    es = rows["expandable_segments"]
    assert es["initial_reserved_bytes"] == 0 and es["replay_error_pct"] == 0.0
    gc = rows["gc_threshold_0.8_fraction"]
    assert gc["fraction"] == pytest.approx(1.15 * d["measured_peak_reserved_bytes"] / gv.DRY_RUN_CAPACITY_BYTES)
    late = rows["default_late_recording"]
    assert late["record_late"] and late["initial_reserved_bytes"] > 0
    assert all(r["error"] is None for r in doc["rows"])
    assert set(doc["summary"]) == {"goal", "replay", "predictor"}
    assert "GOAL" in (tmp_path / "gpu_validate.md").read_text()


def test_gpu_validate_rejects_unknown_case(tmp_path, capsys):
    assert gv.main(["--device", "cpu", "--cases", "nope", "--out-dir", str(tmp_path)]) == 2
    assert "nope" in capsys.readouterr().err


# ---------------------------------------------------------------- gpu_search

def _rec(conf: str, launcher: str | None = "fork", torch_conf: str | None = None, **kw):
    extra = {} if launcher is None else {"launcher": launcher, "pid": 1,
                                         "torch_alloc_conf": conf if torch_conf is None else torch_conf}
    return {"alloc_conf": conf, "outcome": kw.pop("outcome", "ok"), "batch_size": 8, "extra": extra, **kw}


def test_settings_check_pass_fail_inconclusive():
    good = [_rec(""), _rec("expandable_segments:True")]
    assert gs.settings_check(good, cuda=False)["verdict"] == "PASS"
    wrong = good + [_rec("max_split_size_mb:64", torch_conf="")]
    res = gs.settings_check(wrong, cuda=False)
    assert res["verdict"] == "FAIL" and res["failed"] == 1
    assert gs.settings_check([_rec(""), _rec("expandable_segments:True", launcher="spawn")],
                             cuda=False)["verdict"] == "INCONCLUSIVE"
    skipped = gs.settings_check([_rec("x:1", launcher=None, outcome="predicted_infeasible")], cuda=False)
    assert skipped["trials_checked"] == 0 and skipped["verdict"] == "INCONCLUSIVE"


def test_settings_check_on_cuda_needs_the_allocators_report():
    conf = "expandable_segments:True"
    assert not gs.check_record(_rec(conf), cuda=True)["ok"]            # settings_effective missing
    eff = {"PYTORCH_CUDA_ALLOC_CONF": conf, "expandable_segments": True}
    assert gs.check_record(_rec(conf, settings_effective=eff), cuda=True)["ok"]
    other = {"PYTORCH_CUDA_ALLOC_CONF": ""}
    assert not gs.check_record(_rec(conf, settings_effective=other), cuda=True)["ok"]
    keys_only = {"expandable_segments": False}                          # string absent, key wrong
    assert not gs.check_record(_rec(conf, settings_effective=keys_only), cuda=True)["ok"]
    msg = _rec(conf, settings_effective=eff, outcome="error",
               message="allocator settings did not take effect: expected ...")
    assert not gs.check_record(msg, cuda=True)["ok"]


def test_search_env_and_outcome_counts():
    env = gs.search_env({"PYTHONPATH": ".:/y", "PYTORCH_CUDA_ALLOC_CONF": "a:1", "PYTORCH_ALLOC_CONF": "a:1"})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(REPO), "/y"]
    assert "PYTORCH_CUDA_ALLOC_CONF" not in env and "PYTORCH_ALLOC_CONF" not in env
    assert gs.outcome_counts([{"outcome": "ok"}, {"outcome": "oom"}, {"outcome": "ok"}]) == {"ok": 2, "oom": 1}
    assert gs.outcome_counts(None) == {}


@pytest.mark.slow
def test_gpu_search_dry_run_end_to_end(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")   # its CPU steps on one thread (see ONE_THREAD)
    # no confirmation run of the winner: a spawned trial process (a torch import) whose record the
    # settings check reads like the baseline's forked one (the spawned launcher's verdict is checked on
    # hand-made records above); the search, `oomtune show` and the check of the stored records all run
    rc = gs.main(["--device", "cpu", "--out-dir", str(tmp_path), "--timeout", "150",
                  "search.n_trials=1", "search.batch_size.high=8", "search.confirm=false"])
    doc = json.loads((tmp_path / "gpu_search.json").read_text())
    assert rc == 0 and doc["rc"] == 0 and not doc["timed_out"]
    assert (tmp_path / "gpu_search_best.yaml").is_file() and doc["best_yaml"]
    assert doc["trials"] and doc["outcomes"].get("ok", 0) >= 1
    check = doc["settings_check"]
    assert check["failed"] == 0 and check["trials_checked"] >= 1


# ---------------------------------------------------------------- gpu_check.sh

@pytest.fixture(scope="module")
def gpu_check_dry_run(tmp_path_factory):
    """(the finished ``bash experiments/gpu_check.sh``, its results directory, its $OUT) of the script's CPU
    dry run of the steps "search async", run once for the module: the environment step (which every run
    makes first: versions, CUDA visibility; about 5 CPU-s of imports) and the two steps' trial records are
    asserted on the same run."""
    script = REPO / "experiments" / "gpu_check.sh"
    root = tmp_path_factory.mktemp("gpu-check")
    out, results = root / "out", root / "results"
    env = {**os.environ, "GPU_CHECK_DEVICE": "cpu", "GPU_CHECK_RESULTS": str(results),
           "GPU_CHECK_STEPS": "search async", "OUT": str(out), "PYTHON": sys.executable, **ONE_THREAD}
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=600)
    return proc, results, out


def test_gpu_check_script_syntax_and_out_files():
    script = REPO / "experiments" / "gpu_check.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    files = re.search(r'^FILES="([^"]*)"', script.read_text(), re.M).group(1).split()
    assert len(files) <= 8 and all(re.fullmatch(r"[A-Za-z0-9._-]+", f) for f in files)


@pytest.mark.slow
def test_gpu_check_dry_run_logs_the_environment_and_its_worst_case(gpu_check_dry_run):
    proc, _, out = gpu_check_dry_run
    assert proc.returncode == 0, proc.stderr
    log = (out / "gpu_check.log").read_text()
    assert "torch 2." in log and "gpu_check done" in log
    # the worst case (every step's limit and kill grace) leaves room for a rerun
    assert int(re.search(r"^== worst case: (\d+) s", log, re.M).group(1)) <= 400
    assert re.search(r"^== step env \(limit \d+ s", log, re.M)


def _limit(text: str, name: str) -> int:
    return int(re.search(rf"^{name}=(\d+)$", text, re.M).group(1))


def test_gpu_check_worst_case_is_the_sum_of_its_limits_and_at_most_400_s():
    """Each step's limit and kill grace, summed by hand from the script's own numbers: env (nvidia-smi
    and the probe, 2 s grace each), outside, pytest, validate, search, async (KILL grace each) and the
    two collections of trial records (1 s grace each): 6 + 2 + 15 + 2 + (40 + 60 + 72 + 120 + 37) +
    5 x 5 + 2 x (5 + 1) = 391 s with the committed numbers."""
    text = (REPO / "experiments" / "gpu_check.sh").read_text()
    kill = _limit(text, "KILL")
    steps = ("OUTSIDE", "PYTEST", "VALIDATE", "SEARCH", "ASYNC")
    total = (_limit(text, "LIMIT_SMI") + 2 + _limit(text, "LIMIT_PROBE") + 2
             + sum(_limit(text, f"LIMIT_{s}") + kill for s in steps)
             + 2 * (_limit(text, "LIMIT_COLLECT") + 1))
    assert total == 391 <= 400
    assert re.search(r"^WORST=\$\(\(.*LIMIT_OUTSIDE \+ KILL", text, re.M)   # the printed worst case counts it
    for step in ("outside", "pytest", "validate", "search", "async"):   # each step prints its limit when it starts
        assert re.search(rf'echo "== step {step}: .*\(limit \$LIMIT_{step.upper()} s \+ \$KILL s\)"', text), step


@pytest.mark.slow
def test_gpu_check_dry_run_copies_every_trial_record_to_out(gpu_check_dry_run):
    """The search (objective throughput, budget=0.99, 2 finalists; on the CPU one clean run of each and no
    confirmation run, the script's CPU dry run) and the async-backend trial on the CPU: every trial directory's result.json
    ends up in $OUT's gpu_trials.json, and $OUT holds at most the 8 files the device tool brings back.
    On a loaded 2-core machine the search may reach its limit; the records it left are copied all the
    same."""
    proc, results, out = gpu_check_dry_run
    assert proc.returncode == 0, proc.stderr
    log = (out / "gpu_check.log").read_text()
    for step in ("search", "async"):
        assert re.search(rf"^== step {step}: .*\(limit \d+ s \+ \d+ s\)", log, re.M), step
    on_disk = {str(p.parent.relative_to(results)) for p in
               list(results.glob("gpu_search/trials/*/result.json")) + list(results.glob("gpu_async/*/result.json"))}
    records = json.loads((out / "gpu_trials.json").read_text())
    assert on_disk and set(records) == on_disk
    assert any(k.startswith("gpu_search/trials/") for k in records) and "gpu_async/trial" in records
    assert all("outcome" in r for r in records.values())
    assert 1 <= len(list(out.iterdir())) <= 8


ga = _load("gpu_async_trial")


def test_async_trial_verdict_needs_the_backend_in_effect_and_a_spawned_process():
    conf = "backend:cudaMallocAsync"
    good = {"outcome": "ok", "extra": {"torch_alloc_conf": conf, "launcher": "spawn"},
            "settings_effective": {"backend": "cudaMallocAsync"}}
    assert ga.verdict(good, conf, cuda=True) == (True, "ran ok with the backend in effect")
    assert not ga.verdict({**good, "settings_effective": {"backend": "native"}}, conf, cuda=True)[0]
    assert not ga.verdict({**good, "extra": {"torch_alloc_conf": conf, "launcher": "fork"}}, conf, cuda=True)[0]
    assert not ga.verdict({**good, "extra": {"torch_alloc_conf": "", "launcher": "spawn"}}, conf, cuda=True)[0]
    failed = ga.verdict({"outcome": "oom", "message": "CUDA out of memory"}, conf, cuda=True)
    assert failed == (False, "outcome oom: CUDA out of memory")
    assert ga.verdict({"outcome": "ok", "extra": {"torch_alloc_conf": ""}}, "", cuda=False)[0]   # the CPU dry run
