"""``oomtune check``: predict and run modes, exact tolerance boundaries, a workload change caught by
--mode predict, JUnit XML, and bad input (exit 2). Recorded figures are hand-made."""

from __future__ import annotations

import importlib
import sys
import textwrap
import xml.etree.ElementTree as ET

import pytest
import yaml

from oomtune.best import load_best
from oomtune.regression import evaluate_run, within_drop, within_limit
from oomtune.cli import main
from oomtune.trial.record import MemoryReadings, Throughput, TrialResult
from oomtune.units import GiB, MiB

# The tiny MLP: every tensor is below 1 MiB, and all live tensors together well below 2 MiB, so the
# caching allocator holds exactly one small-pool segment of kSmallBuffer = 2 MiB (hand calculation).
MLP = {"name": "mlp", "in_features": 64, "hidden": 128, "layers": 1, "num_classes": 10, "optimizer": "sgd",
       "lr": 0.1, "precision": "fp32", "data": {"source": "synthetic"}}
TWO_MIB = 2 * MiB


def write_best(path, *, model=None, target=None, batch=8, alloc_conf="", predicted=TWO_MIB, metrics=None,
               kind="cpu", budget=1 * GiB, source="simulated"):
    data = {
        "schema_version": 1,
        "workload": {"model": model or MLP, "target": target or {"name": "builtin"}},
        "device": {"kind": kind, "name": "virtual GPU (CPU)", "total_memory_bytes": 80 * GiB,
                   "budget_bytes": budget, "memory_source": source},
        "best": {"batch_size": batch, "alloc_conf": alloc_conf, "settings": {},
                 "metrics": metrics or {"throughput": 100.0, "peak_reserved_bytes": TWO_MIB,
                                        "memory_source": source},
                 "predicted_peak_reserved_bytes": predicted},
    }
    path.write_text(yaml.safe_dump(data))
    return path


# -- exact limit arithmetic ------------------------------------------------------------------------
def test_within_limit_is_inclusive_and_exact():
    assert within_limit(1_005_000_000, 1_000_000_000, 0.005)        # exactly +0.5%
    assert not within_limit(1_005_000_001, 1_000_000_000, 0.005)    # one byte more
    assert within_limit(900, 1000, 0.0)                             # shrinking always passes


def test_within_drop_is_inclusive_and_exact():
    assert within_drop(90.0, 100.0, 0.10)      # exactly -10%
    assert not within_drop(89.99, 100.0, 0.10)
    assert within_drop(150.0, 100.0, 0.0)      # faster always passes


# -- predict mode -----------------------------------------------------------------------------------
@pytest.mark.usefixtures("no_cublas_workspaces")   # a hand-sized device of a few MiB
def test_predict_passes_when_the_recorded_prediction_matches(tmp_path, capsys):
    code = main(["check", str(write_best(tmp_path / "best.yaml")), "--mode", "predict"])
    out = capsys.readouterr().out.strip().splitlines()[-1]
    assert code == 0, out
    assert out == ("oomtune check: PASS predicted peak reserved 2.00 MiB (simulated) vs recorded "
                   "2.00 MiB (+0.00%, tolerance 0.50%)")


@pytest.mark.parametrize("recorded, tolerance, code", [
    (2_000_000, "0.048576", 0),   # (2,097,152 - 2,000,000) / 2,000,000 = 0.048576 exactly: passes
    (2_000_000, "0.048575", 1),   # just below the growth: fails
    (2_086_719, None, 0),         # +0.4999...% under the default 0.5%
    (2_086_718, None, 1),         # +0.50001%
])
@pytest.mark.usefixtures("no_cublas_workspaces")   # a hand-sized device of a few MiB
def test_predict_tolerance_boundaries(recorded, tolerance, code, tmp_path, capsys):
    path = write_best(tmp_path / "best.yaml", predicted=recorded)
    args = ["check", str(path), "--mode", "predict"] + (["--tolerance", tolerance] if tolerance else [])
    assert main(args) == code, capsys.readouterr()
    assert ("PASS" if code == 0 else "FAIL") in capsys.readouterr().out


def test_predict_fails_when_the_batch_no_longer_fits_the_budget(tmp_path, capsys):
    # 1 MiB budget < the one 2 MiB segment the MLP needs
    path = write_best(tmp_path / "best.yaml", budget=1 * MiB, predicted=TWO_MIB)
    assert main(["check", str(path), "--mode", "predict"]) == 1
    assert "does not fit" in capsys.readouterr().out


_FACTORY = """
import itertools
import torch
from torch import nn

def make_workload(batch_size):
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    {extra}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(batch_size, 64), torch.randint(0, 10, (batch_size,))
    return model, opt, itertools.repeat((x, y))
"""


def _write_factory(tmp_path, monkeypatch, *, extra_buffer: bool):
    extra = 'model.register_buffer("extra", torch.zeros(16 * 2**20))  # 64 MiB of fp32' if extra_buffer else ""
    (tmp_path / "oomtune_test_factory.py").write_text(textwrap.dedent(_FACTORY).replace("{extra}", extra))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "oomtune_test_factory", raising=False)
    importlib.invalidate_caches()


@pytest.mark.parametrize("extra_buffer, code", [(False, 0), (True, 1)])
@pytest.mark.usefixtures("no_cublas_workspaces")   # a hand-sized device of a few MiB
def test_a_workload_change_that_adds_a_64_mib_buffer_fails_predict(extra_buffer, code, tmp_path, monkeypatch,
                                                                    capsys):
    """best.yaml was tuned on the factory without the buffer: all of its tensors are small, so the
    recorded prediction is one 2 MiB small-pool segment. The changed code adds a 64 MiB buffer: a
    large-pool request rounded to a multiple of 2 MiB (kRoundLarge) = one more 64 MiB segment, so
    the current prediction is 66 MiB (+3200%); the unchanged code still predicts 2 MiB."""
    _write_factory(tmp_path, monkeypatch, extra_buffer=extra_buffer)
    target = {"name": "python", "entry": "oomtune_test_factory:make_workload"}
    path = write_best(tmp_path / "best.yaml", model={"name": "custom"}, target=target, predicted=TWO_MIB)
    assert main(["check", str(path), "--mode", "predict"]) == code
    last = capsys.readouterr().out.strip().splitlines()[-1]
    expected = "66.00 MiB" if extra_buffer else "2.00 MiB"
    assert f"predicted peak reserved {expected} (simulated) vs recorded 2.00 MiB" in last


# -- run mode ---------------------------------------------------------------------------------------
def _result(outcome="ok", message=None, memory_source="simulated", throughput=100.0, **memory):
    """A finished check trial at batch 8, 11 steps; ``memory``: MemoryReadings fields (peak reserved
    1e9 bytes unless given)."""
    return TrialResult(outcome=outcome, batch_size=8, message=message,
                       memory=MemoryReadings(source=memory_source, **{"peak_reserved_bytes": 1_000_000_000, **memory}),
                       throughput=Throughput(samples_per_s=throughput, steps=11))


@pytest.mark.parametrize("peak, throughput, passed", [
    (1_050_000_000, 90.0, True),       # +5% memory, -10% throughput: both exactly at the limits
    (1_050_000_001, 90.0, False),      # one byte over
    (1_050_000_000, 89.99, False),     # a little slower than allowed
])
def test_run_mode_limits_are_inclusive(peak, throughput, passed, tmp_path):
    best = load_best(write_best(tmp_path / "best.yaml", metrics={
        "throughput": 100.0, "peak_reserved_bytes": 1_000_000_000, "memory_source": "simulated"}))
    report = evaluate_run(best, _result(peak_reserved_bytes=peak, throughput=throughput),
                          max_memory_growth=0.05, max_slowdown=0.10)
    assert report.passed is passed
    assert report.summary.startswith("oomtune check: " + ("PASS" if passed else "FAIL"))


def test_run_mode_out_of_memory_fails(tmp_path):
    best = load_best(write_best(tmp_path / "best.yaml"))
    report = evaluate_run(best, _result(outcome="oom", message="CUDA out of memory."),
                          max_memory_growth=0.05, max_slowdown=0.10)
    assert not report.passed and report.cases[0].name == "oom" and report.cases[0].passed is False
    assert "out of memory at batch 8" in report.summary


@pytest.mark.usefixtures("no_cublas_workspaces")   # a hand-sized device of a few MiB
def test_run_mode_on_the_virtual_gpu(tmp_path, capsys):
    """A spawned virtual-GPU trial of the tiny MLP reserves one 2 MiB segment (hand calculation): equal
    to the recorded 2 MiB passes; a recorded 1 MiB is +100%, beyond the 5% limit."""
    slow = {"throughput": 1e-3, "peak_reserved_bytes": TWO_MIB, "memory_source": "simulated"}
    assert main(["check", str(write_best(tmp_path / "a.yaml", metrics=slow)), "--mode", "run", "--steps", "2"]) == 0
    assert "peak reserved 2.00 MiB (simulated) vs recorded 2.00 MiB (+0.00%" in capsys.readouterr().out


def test_run_mode_refuses_to_compare_device_figures_with_the_virtual_gpu(tmp_path, capsys):
    path = write_best(tmp_path / "best.yaml", source="device", kind="cuda")
    assert main(["check", str(path), "--mode", "run", "--device", "cpu"]) == 2
    assert "not comparable" in capsys.readouterr().err


# -- JUnit ------------------------------------------------------------------------------------------
@pytest.mark.usefixtures("no_cublas_workspaces")   # a hand-sized device of a few MiB
def test_junit_report_has_a_failure_element_on_regression(tmp_path, capsys):
    path = write_best(tmp_path / "best.yaml", predicted=1 * MiB)  # current 2 MiB: +100%
    junit = tmp_path / "reports" / "check.xml"
    assert main(["check", str(path), "--mode", "predict", "--junit", str(junit)]) == 1
    suite = ET.parse(junit).getroot()
    assert suite.tag == "testsuite" and suite.get("tests") == "3" and suite.get("failures") == "1"
    cases = {c.get("name"): c for c in suite.iter("testcase")}
    assert set(cases) == {"fits budget (predicted)", "prediction", "memory fraction"}
    failure = cases["prediction"].find("failure")
    assert failure is not None and "+100.00%" in failure.get("message")
    assert cases["fits budget (predicted)"].find("failure") is None


@pytest.mark.usefixtures("no_cublas_workspaces")   # a hand-sized device of a few MiB
def test_junit_report_without_failures_on_pass(tmp_path):
    junit = tmp_path / "check.xml"
    assert main(["check", str(write_best(tmp_path / "best.yaml")), "--mode", "predict", "--junit", str(junit)]) == 0
    suite = ET.parse(junit).getroot()
    assert suite.get("failures") == "0" and not list(suite.iter("failure"))


# -- bad input --------------------------------------------------------------------------------------
def test_missing_best_yaml_exits_2(tmp_path, capsys):
    assert main(["check", str(tmp_path / "nope.yaml")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_corrupt_best_yaml_exits_2(tmp_path, capsys):
    path = tmp_path / "best.yaml"
    path.write_text("schema_version: 1\nbest: [unclosed\n")
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "not valid YAML" in err and len(err.splitlines()) == 1


def test_unknown_mode_exits_2(tmp_path):
    with pytest.raises(SystemExit) as exc:
        main(["check", str(write_best(tmp_path / "best.yaml")), "--mode", "guess"])
    assert exc.value.code == 2


def test_predict_without_a_recorded_prediction_exits_2(tmp_path, capsys):
    path = write_best(tmp_path / "best.yaml", predicted=None)
    assert main(["check", str(path), "--mode", "predict"]) == 2
    err = capsys.readouterr().err
    assert "no best.predicted_peak_reserved_bytes" in err and "--mode run" in err


@pytest.mark.parametrize("flag", [["--tolerance", "-0.1"], ["--max-memory-growth", "-1", "--mode", "run"]])
def test_negative_limits_exit_2(flag, tmp_path, capsys):
    assert main(["check", str(write_best(tmp_path / "best.yaml")), "--mode", "predict", *flag]) == 2


@pytest.mark.parametrize("kind, cuda, mode", [("cuda", True, "run"), ("cuda", False, "predict"),
                                              ("cpu", True, "predict"), ("cpu", False, "predict")])
def test_default_mode(kind, cuda, mode, tmp_path):
    from oomtune.regression import default_mode

    best = load_best(write_best(tmp_path / "best.yaml", kind=kind))
    assert default_mode(best, cuda) == mode


# -- limits validated before anything runs (rule: one line, exit 2) --------------------------------------
@pytest.mark.parametrize("flag, needle", [
    (["--max-slowdown", "2"], "--max-slowdown=2.0"),       # was reported as "limit -200%"
    (["--max-slowdown", "1"], "--max-slowdown=1.0"),       # a 100% loss cannot be a limit: [0, 1)
    (["--max-slowdown", "-0.1"], "--max-slowdown=-0.1"),
    (["--max-memory-growth", "nan"], "--max-memory-growth=nan"),
    (["--tolerance", "inf"], "--tolerance=inf"),
])
def test_out_of_range_limits_exit_2_with_one_line(flag, needle, tmp_path, capsys, monkeypatch):
    import oomtune.regression as check

    monkeypatch.setattr(check, "check_predict", _must_not_run)
    monkeypatch.setattr(check, "check_run", _must_not_run)
    assert main(["check", str(write_best(tmp_path / "best.yaml")), "--mode", "predict", *flag]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"oomtune: error: {needle}: expected a fraction") and len(err.splitlines()) == 1


def test_limits_at_the_edges_of_their_ranges_are_accepted(tmp_path):
    from oomtune.regression import validate_limits

    validate_limits(max_slowdown=0.0, max_memory_growth=0.0, tolerance=0.0)
    validate_limits(max_slowdown=0.99, max_memory_growth=3.0, tolerance=10.0)


def _must_not_run(*a, **k):
    raise AssertionError("the check ran although its input is bad")


@pytest.mark.parametrize("where", ["/proc/x/j.xml", "FILE/j.xml", "DIR"])
def test_unwritable_junit_path_exits_2_before_the_check_runs(where, tmp_path, capsys, monkeypatch):
    import oomtune.regression as check

    (tmp_path / "file").write_text("")
    where = where.replace("FILE", str(tmp_path / "file")).replace("DIR", str(tmp_path))
    monkeypatch.setattr(check, "check_predict", _must_not_run)
    assert main(["check", str(write_best(tmp_path / "best.yaml")), "--mode", "predict", "--junit", where]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"oomtune: error: --junit {where!r}") and len(err.splitlines()) == 1


# -- run mode on the virtual GPU: slowdown not checked unless asked for ------------------------------------
class _FakeRunner:
    """Returns a finished trial with the given figures (no process)."""

    def __init__(self, **figures):
        self.figures = figures

    def run(self, spec, workdir):
        return _result(**self.figures)


def test_run_mode_on_a_simulated_best_skips_the_slowdown_by_default(tmp_path):
    from oomtune.regression import SIMULATED_SLOWDOWN_NOTE, check_run

    best = load_best(write_best(tmp_path / "best.yaml", metrics={
        "throughput": 100.0, "peak_reserved_bytes": 1_000_000_000, "memory_source": "simulated"}))
    slow = _FakeRunner(throughput=30.0, peak_reserved_bytes=1_000_000_000)   # -70%: CPU noise
    report = check_run(best, runner=slow)
    speed = next(c for c in report.cases if c.name == "slowdown")
    assert report.passed and speed.passed is None and speed.message == SIMULATED_SLOWDOWN_NOTE
    assert report.figures["notes"] == [SIMULATED_SLOWDOWN_NOTE]
    # memory still checked: +5% + 1 byte fails
    grown = _FakeRunner(throughput=100.0, peak_reserved_bytes=1_050_000_001)
    assert not check_run(best, runner=grown).passed
    # an explicit limit checks the slowdown again
    assert not check_run(best, runner=slow, max_slowdown=0.10).passed


def test_run_mode_on_a_cuda_best_keeps_the_10_percent_default(tmp_path):
    from oomtune.regression import default_max_slowdown

    assert default_max_slowdown(load_best(write_best(tmp_path / "a.yaml", kind="cuda", source="device"))) == 0.10
    assert default_max_slowdown(load_best(write_best(tmp_path / "b.yaml"))) is None


def test_run_mode_cli_prints_the_note(tmp_path, capsys, monkeypatch):
    import oomtune.trial.runner as runner_mod

    monkeypatch.setattr(runner_mod, "TrialRunner",
                        lambda **k: _FakeRunner(throughput=1.0, peak_reserved_bytes=TWO_MIB))
    assert main(["check", str(write_best(tmp_path / "best.yaml")), "--mode", "run"]) == 0
    out = capsys.readouterr().out
    assert "note: slowdown not checked: best.yaml was measured on the virtual GPU (CPU)" in out
    assert "throughput" not in out.splitlines()[-1]   # the summary reports what was checked


class _SteppingRunner(_FakeRunner):
    """A finished trial as :class:`_FakeRunner`, leaving the progress record a real child leaves
    after its last step (1 warm-up + 10 measured steps, oomtune.trial.child)."""

    def run(self, spec, workdir):
        from oomtune.trial.record import PROGRESS_FILE, write_progress

        write_progress(workdir / PROGRESS_FILE, 11, 11)
        return super().run(spec, workdir)


def test_run_mode_cli_shows_progress_on_stderr(tmp_path, capsys, monkeypatch):
    import oomtune.trial.runner as runner_mod

    monkeypatch.setattr(runner_mod, "TrialRunner",
                        lambda **k: _SteppingRunner(throughput=1.0, peak_reserved_bytes=TWO_MIB))
    assert main(["check", str(write_best(tmp_path / "best.yaml")), "--mode", "run"]) == 0
    captured = capsys.readouterr()
    err = captured.err.replace("\n  ", " ").splitlines()   # wrapped lines joined again
    assert err[0] == ("running batch 8, the default allocator on cpu in a clean process: 1 warm-up + 10 "
                      "measured steps (timeout 600 s); starting: importing torch ...")
    assert err[1].startswith("step 11/11 done, ") and err[2].startswith("trial finished after ")
    assert err[2].endswith(" s: ok") and len(err) == 3
    assert "step 11/11" not in captured.out and "running batch" not in captured.out  # stdout: notes, summary


def test_step_watcher_says_each_step_once(tmp_path):
    import time

    from oomtune.regression import _watch_steps
    from oomtune.trial.record import PROGRESS_FILE, write_progress

    lines = []

    def wait_for(n):   # the watcher thread may wait seconds for a core on a loaded machine
        deadline = time.monotonic() + 60
        while len(lines) < n and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(lines) >= n, f"the watcher said {lines} in 60 s, not {n} lines"

    with _watch_steps(tmp_path, 1, time.monotonic(), lines.append, interval_s=0.01):
        wait_for(0)
        time.sleep(0.05)                     # no record yet: nothing said
        assert lines == []
        for done, n in ((0, 1), (1, 2), (2, 3)):
            write_progress(tmp_path / PROGRESS_FILE, done, 3)
            wait_for(n)
        time.sleep(0.05)                     # the same record again: nothing new
    assert [line.rsplit(", ", 1)[0] if line.startswith("step") else line.split(" after")[0] for line in lines] == [
        "ready", "step 1/3 done, warm-up", "step 2/3 done"]
    assert lines[0].endswith(": 3 steps to run") and lines[2].endswith(" s")


def test_predict_mode_refuses_cuda_malloc_async_with_advice(tmp_path, capsys):
    path = write_best(tmp_path / "best.yaml", alloc_conf="backend:cudaMallocAsync")
    assert main(["check", str(path), "--mode", "predict"]) == 2
    err = capsys.readouterr().err.strip()
    assert "cannot simulate" in err and "--mode run" in err and len(err.splitlines()) == 1


# -- no memory reading is never a PASS ----------------------------------------------------------------
def test_run_without_any_memory_reading_is_an_explicit_skip_not_a_pass(tmp_path):
    best = load_best(write_best(tmp_path / "best.yaml", metrics={"throughput": 100.0, "memory_source": "simulated"}))
    report = evaluate_run(best, _result(peak_reserved_bytes=None), max_memory_growth=0.05, max_slowdown=None)
    memory = next(c for c in report.cases if c.name == "memory growth")
    assert memory.passed is None and "memory not checked: neither best.yaml nor the run" in memory.message
    assert report.summary.startswith("oomtune check: SKIP memory not checked")
    assert "PASS" not in report.summary


def test_run_that_loses_its_memory_reading_fails(tmp_path):
    best = load_best(write_best(tmp_path / "best.yaml"))   # records a 2 MiB peak reserved
    report = evaluate_run(best, _result(peak_reserved_bytes=None), max_memory_growth=0.05, max_slowdown=None)
    assert not report.passed and report.exit_code == 1
    assert report.summary.startswith("oomtune check: FAIL memory not checked: best.yaml records a peak reserved")


def test_run_of_a_command_compares_the_device_peak_when_there_is_no_allocator_reading(tmp_path):
    # a target=cmd run on a GPU: NVML's device peak only; +10% over the recorded 1000 MB fails the 5% limit
    best = load_best(write_best(tmp_path / "best.yaml", kind="cuda", source="device", metrics={
        "throughput": 100.0, "device_peak_bytes": 1_000_000_000, "memory_source": "device"}))
    res = _result(memory_source="device", peak_reserved_bytes=None, device_peak_bytes=1_100_000_000)
    report = evaluate_run(best, res, max_memory_growth=0.05, max_slowdown=None)
    memory = next(c for c in report.cases if c.name == "memory growth")
    assert memory.passed is False and "device peak (NVML) 1.02 GiB (device) vs recorded 953.67 MiB (+10.00%" in memory.message


# -- the memory fraction travels with the answer -------------------------------------------------------
GC = "garbage_collection_threshold:0.8"


def _with(path, **best_fields):
    data = yaml.safe_load(path.read_text())
    for key, value in best_fields.items():
        if key.startswith("device_"):
            data["device"][key[len("device_"):]] = value
        else:
            data["best"][key] = value
    path.write_text(yaml.safe_dump(data))
    return path


def test_predict_fails_an_answer_whose_threshold_relied_on_an_unrecorded_fraction(tmp_path, capsys):
    # A best.yaml from before the fraction was recorded: its trials ran under 1 GiB / 80 GiB = 0.0125,
    # where the threshold acts; applied without a fraction it is inert (seen with GPT-2 at 8 GiB).
    path = write_best(tmp_path / "best.yaml", alloc_conf=GC)
    assert main(["check", str(path), "--mode", "predict"]) == 1
    out = capsys.readouterr().out
    assert "memory fraction: garbage_collection_threshold:0.8: the garbage_collection_threshold acted in the " \
           "trials under a memory fraction of 0.0125, which best.yaml does not record" in out


@pytest.mark.usefixtures("no_cublas_workspaces")   # a hand-sized device of a few MiB
def test_predict_passes_the_same_answer_when_best_yaml_carries_the_fraction(tmp_path, capsys):
    path = _with(write_best(tmp_path / "best.yaml", alloc_conf=GC), memory_fraction=0.0125,
                 device_memory_fraction="auto")
    assert main(["check", str(path), "--mode", "predict"]) == 0
    report_case = __import__("oomtune.regression", fromlist=["fraction_case"]).fraction_case(load_best(path))
    assert report_case.passed and report_case.message.startswith("0.0125 of 80.00 GiB recorded and applied")


def test_run_mode_checks_the_applied_fraction_and_the_device_size(tmp_path):
    from oomtune.regression import fraction_case

    best = load_best(_with(write_best(tmp_path / "best.yaml", alloc_conf=GC, kind="cuda", source="device"),
                           memory_fraction=0.0125, device_memory_fraction="auto"))
    assert fraction_case(best, applied=0.0125, device_total=80 * GiB, ran=True).passed
    assert fraction_case(best, applied=0.0124, device_total=80 * GiB, ran=True).passed        # within 1%
    assert not fraction_case(best, applied=0.012, device_total=80 * GiB, ran=True).passed     # -4%
    other = fraction_case(best, applied=0.0125, device_total=24 * GiB, ran=True)
    assert not other.passed and "allows 307.20 MiB, not the 1.00 GiB" in other.message     # 0.0125 x 24 GiB
    plain = load_best(write_best(tmp_path / "plain.yaml"))
    assert fraction_case(plain).passed and fraction_case(plain).message.startswith("not needed")


# -- best.yaml read once ----------------------------------------------------------------------------
def test_prepare_check_reads_the_workload_geometry_and_limit_once(tmp_path):
    from oomtune.regression import prepare_check

    path = write_best(tmp_path / "best.yaml", budget=1 * GiB)
    data = yaml.safe_load(path.read_text())
    data["device"]["headroom"] = 0.05
    data["workload"]["ranks"] = 2
    path.write_text(yaml.safe_dump(data))
    run = prepare_check(load_best(path))
    assert run.budget_bytes == GiB
    assert run.limit_bytes == int(GiB * 0.95)           # budget x (1 - headroom), whole bytes
    # the virtual GPU of the trials: the recorded 80 GiB device under a fraction of 1/80
    assert run.geometry == {"total_memory_bytes": 80 * GiB, "memory_fraction": 1 / 80}
    assert run.ranks == 2 and run.workload.ranks == 2 and run.workload.to_dict()["ranks"] == 2
    assert run.target.name == "builtin" and run.target.capturable


def test_run_mode_refuses_a_malformed_headroom_before_running(tmp_path):
    from oomtune.exceptions import BestFileError
    from oomtune.regression import check_run

    path = write_best(tmp_path / "best.yaml")
    data = yaml.safe_load(path.read_text())
    data["device"]["headroom"] = 1.5
    path.write_text(yaml.safe_dump(data))

    class NoRun:
        def run(self, *a, **k):
            raise AssertionError("a trial started")

    with pytest.raises(BestFileError, match="headroom=1.5"):
        check_run(load_best(path), runner=NoRun())


@pytest.mark.slow
@pytest.mark.usefixtures("no_cublas_workspaces")   # a hand-sized device of a few MiB
def test_a_search_under_lengths_records_the_worst_length_prediction_and_check_reproduces_it(tmp_path, capsys):
    """One predictor per search: under a shape distribution best.yaml records the prediction at the
    largest length (the frontier's), marked predicted_at_worst_shape; check --mode predict predicts the
    same shape (PASS), and the figure is the plan's at that fixed length for the same batch and
    allocator (a separate command)."""
    lm = ["model=transformer", "model.layers=1", "model.d_model=64", "model.heads=2", "model.vocab_size=512",
          "budget=32MiB", "device=cpu", "search.batch_size.low=1", "search.batch_size.high=64",
          "search.space.max_split_size_mb=[null]", "search.space.roundup_power2_divisions=[null]",
          "search.space.garbage_collection_threshold=[null]"]
    run = tmp_path / "run"
    # the prediction best.yaml records is the subject: no clean-process confirmation of the winner (a
    # spawned interpreter less; under a shape distribution every search trial is soaked already)
    assert main(["search", *lm, "model.seq_len={low:16,high:128,pad_multiple:16,seed:0}", "trial.soak_steps=100",
                 "search.objective=batch", "search.confirm=false", f"hydra.run.dir={run}"]) == 0
    best = load_best(run / "best.yaml")
    assert best.device["cublas_workspace_config"] == ":0:0"   # the trials' workspaces travel with the answer
    assert best.best.predicted_at_worst_shape is True and best.best.predicted_peak_reserved_bytes
    capsys.readouterr()
    assert main(["check", str(run / "best.yaml"), "--mode", "predict"]) == 0
    assert "PASS" in capsys.readouterr().out
    assert main(["plan", *lm, "model.seq_len=128", f"hydra.run.dir={tmp_path / 'plan'}",
                 "--out", str(tmp_path / "plan.yaml")]) == 0
    rows = {c["alloc_conf"]: c for c in yaml.safe_load((tmp_path / "plan.yaml").read_text())["configurations"]}
    row = rows[best.best.alloc_conf]
    assert row["max_batch_size"] == best.best.batch_size
    assert row["at_max"]["peak_reserved_bytes"] == best.best.predicted_peak_reserved_bytes
