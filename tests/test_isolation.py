"""A user's code cannot take the search down: the captures that predict a ``target=python`` entry run
in a forked process of their own (oomtune/plan/isolation.py over plan/parallel.fork_each), under
``trial.timeout``; and prediction captures nothing past the first batch size over the limit.

Field reports, each a test: an entry that raises (one line naming its file:line and exception, exit 2,
no trial), one that hangs (stopped at trial.timeout, one line, exit 2, its processes ended), one that
calls ``os._exit(3)`` (one line with the status), one killed by SIGKILL; the same through ``plan``;
and a DDP search whose batch range tops out far beyond what the host could capture (no refusal).

Expected values come from the fixture files in tests/data/isolation/ (the line of their ``raise``, the
status 3 they exit with, the SIGKILL they send), from POSIX wait statuses (a process killed by signal
N reports -N as ``subprocess.Popen.returncode`` does), and from the bound's definition: reserved >=
allocated >= live requested bytes under every allocator setting, so a batch whose live requests exceed
the limit cannot fit, nor can a larger one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from oomtune.exceptions import UserCodeError
from oomtune.plan.parallel import ChildFailed, fork_each
from oomtune.units import MiB
from oomtune.workload_spec import WorkloadSpec

DATA = Path(__file__).parent / "data" / "isolation"


def _entry(name: str) -> str:
    return f"target.entry={DATA / name}:make_workload"


@pytest.fixture
def cli(monkeypatch, capfd):
    """``oomtune ARGS`` run in this process (oomtune.cli.main, what ``python -m oomtune`` runs) from
    ``cwd``, with ``env`` added to the environment: (a CompletedProcess of its exit status and of
    everything written to the file descriptors 1 and 2, its own and its forked processes', seconds
    taken). The captures these tests are about run in processes of their own either way."""

    def run(args: list[str], cwd: Path, *,
            env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, float]:
        from oomtune.cli import main

        for key, value in {"OOMTUNE_CACHE_DIR": str(cwd / "cache"), **(env or {})}.items():
            monkeypatch.setenv(key, value)
        monkeypatch.chdir(cwd)
        capfd.readouterr()   # what came before is not this command's
        t0 = time.monotonic()
        code = main(list(args))
        took = time.monotonic() - t0
        out = capfd.readouterr()
        return subprocess.CompletedProcess([sys.executable, "-m", "oomtune", *args], code, out.out, out.err), took

    return run


def _error_line(proc: subprocess.CompletedProcess) -> str:
    """The one error line on stderr (and no traceback anywhere)."""
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("oomtune: error:")]
    assert len(errors) == 1, proc.stderr
    return errors[0]


def _line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


# ------------------------------------------------------------------ fork_each itself
def test_fork_each_returns_results_in_order_and_raises_what_the_item_raised():
    assert fork_each(lambda x: x * x, [3, 1, 2], 2, timeout_s=60) == [9, 1, 4]
    with pytest.raises(ZeroDivisionError):
        fork_each(lambda x: 1 // x, [1, 0], 1, timeout_s=60)


def test_fork_each_reports_an_exit_status_a_signal_and_a_timeout():
    with pytest.raises(ChildFailed) as info:
        fork_each(lambda x: os._exit(x), [3], 1, timeout_s=60)
    assert info.value.returncode == 3 and not info.value.timed_out
    with pytest.raises(ChildFailed) as info:
        fork_each(lambda x: os.kill(os.getpid(), 9), [0], 1, timeout_s=60)
    assert info.value.returncode == -9
    t0 = time.monotonic()
    with pytest.raises(ChildFailed) as info:
        fork_each(lambda x: time.sleep(3600), [0], 1, timeout_s=1.0)
    assert info.value.timed_out and info.value.returncode is None
    assert time.monotonic() - t0 < 30   # stopped at its limit, not after the hour


def _fail_late_or_early(x: int) -> int:
    # item 0 fails after a while, item 3 at once: the one that fails first in time is item 3
    if x == 0:
        time.sleep(1.0)
        raise ValueError("item 0")
    if x == 3:
        raise ValueError("item 3")
    time.sleep(0.2)
    return x


def test_fork_each_raises_the_earliest_items_failure_not_the_first_in_time():
    # items start in order, so the earliest failing item is the same whatever the processes' timing;
    # a run's message naming another batch each time would be an answer that changes from run to run
    for _ in range(3):
        with pytest.raises(ValueError, match="item 0"):
            fork_each(_fail_late_or_early, [0, 1, 2, 3], 4, timeout_s=60)
    # a hang of an earlier item is waited for to its limit and reported, not a later item's raise
    with pytest.raises(ChildFailed) as info:
        fork_each(lambda x: time.sleep(3600) if x == 0 else 1 // 0, [0, 1], 2, timeout_s=1.0)
    assert info.value.item == 0 and info.value.timed_out


# ------------------------------------------------------------------ search: the field reports
# trial.launcher=spawn: no trial runs in these field reports (each ends at the entry's check, before the
# first trial), so the fork server the default launcher starts beside the frontier predictions (a
# process importing torch, about 4.5 CPU-s) would only be started to be ended; what is checked (the
# one line, exit 2, no trial, the capture's processes gone) is the entry check's, whatever the launcher.
SEARCH = ["search", "target=python", "budget=256MiB", "search.batch_size.low=2", "search.batch_size.high=8",
          "trial.launcher=spawn"]


@pytest.mark.slow
def test_search_an_entry_that_raises_is_one_line_with_its_file_line_and_exception_exit_2_before_any_trial(tmp_path, cli):
    run = tmp_path / "run"
    proc, _ = cli([*SEARCH, _entry("entry_raises.py"), f"hydra.run.dir={run}"], tmp_path)
    assert proc.returncode == 2, proc.stderr
    line = _error_line(proc)
    where = f"{DATA / 'entry_raises.py'}:{_line_of(DATA / 'entry_raises.py', 'raise RuntimeError')}"
    assert f"raised RuntimeError at {where}" in line, line
    assert "no training data at /data/train (fixture)" in line
    assert "cannot be built on meta" not in proc.stderr   # no misleading fallback note before the error
    assert not (run / "trials").exists()                   # no trial ran


@pytest.mark.slow
def test_search_an_entry_that_hangs_is_stopped_at_trial_timeout_in_one_line(tmp_path, cli):
    run, pidfile = tmp_path / "run", tmp_path / "pids"
    proc, took = cli([*SEARCH, _entry("entry_hangs.py"), "trial.timeout=3", f"hydra.run.dir={run}"], tmp_path,
                     env={"OOMTUNE_TEST_PIDFILE": str(pidfile)})
    assert proc.returncode == 2, proc.stderr
    line = _error_line(proc)
    assert "still running after trial.timeout=3 s: stopped" in line, line
    assert not (run / "trials").exists()
    # the capture process and the process it started are gone (its process group was killed)
    pids = [int(p) for p in pidfile.read_text().split()]
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids), pids


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_search_an_entry_that_calls_os_exit_is_one_line_with_the_status(tmp_path, cli):
    run = tmp_path / "run"
    proc, _ = cli([*SEARCH, _entry("entry_exits.py"), f"hydra.run.dir={run}"], tmp_path)
    assert proc.returncode == 2, proc.stderr   # not the entry's 3: the search ended it, not the entry
    line = _error_line(proc)
    assert "exited with status 3 without a result" in line, line
    assert not (run / "trials").exists()


# ------------------------------------------------------------------ plan: the same
@pytest.mark.slow
def test_plan_an_entry_that_raises_is_the_same_one_line_exit_2_and_no_plan_file(tmp_path, cli):
    out = tmp_path / "plan.yaml"
    proc, _ = cli(["plan", "target=python", _entry("entry_raises.py"), "budget=256MiB", "search.batch_size.low=2",
                   "search.batch_size.high=8", f"hydra.run.dir={tmp_path / 'run'}", "--out", str(out)], tmp_path)
    assert proc.returncode == 2, proc.stderr
    line = _error_line(proc)
    where = f"{DATA / 'entry_raises.py'}:{_line_of(DATA / 'entry_raises.py', 'raise RuntimeError')}"
    assert f"raised RuntimeError at {where}" in line, line
    assert not out.exists()


@pytest.mark.slow
def test_plan_an_entry_that_hangs_is_stopped_at_trial_timeout(tmp_path, cli):
    proc, _ = cli(["plan", "target=python", _entry("entry_hangs.py"), "budget=256MiB", "trial.timeout=3",
                   "search.batch_size.low=2", "search.batch_size.high=8", f"hydra.run.dir={tmp_path / 'run'}",
                   "--out", str(tmp_path / "plan.yaml")], tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "still running after trial.timeout=3 s: stopped" in _error_line(proc)


# ------------------------------------------------------------------ the predictor (check --mode predict's too)
def _predictor(name: str, timeout_s: float = 60):
    from oomtune.alloc.geometry import budget_geometry
    from oomtune.plan.predictor import Predictor

    workload = {"target": {"name": "python", "entry": f"{DATA / name}:make_workload"}}
    return Predictor(WorkloadSpec.from_dict(workload), budget_geometry(256 * MiB, 80 * 1024 * MiB), timeout_s=timeout_s)


def test_predictor_an_entry_killed_by_sigkill_is_one_line_naming_the_signal():
    with pytest.raises(UserCodeError) as info:
        _predictor("entry_killed.py").predict_detail(4, "")
    text = str(info.value)
    assert "\n" not in text and "batch 4" in text and "killed by SIGKILL" in text, text


def test_predictor_each_failure_names_the_entry_and_the_batch():
    for name, words in (("entry_raises.py", "raised RuntimeError"), ("entry_exits.py", "exited with status 3")):
        with pytest.raises(UserCodeError) as info:
            _predictor(name).predict_detail(5, "")
        assert f"target.entry={DATA / name}:make_workload" in str(info.value)
        assert "batch 5" in str(info.value) and words in str(info.value)
    with pytest.raises(UserCodeError, match=r"still running after trial.timeout=1 s"):
        _predictor("entry_hangs.py", timeout_s=1).predict_detail(5, "")


# ------------------------------------------------------------------ a wide range under data parallelism
# A small transformer under DDP: captured on meta (rank 0 with torch's fake process group) and derived
# across batch sizes like one rank; a capture at the top of a wide range would still be 64 GiB of
# requests to replay: at batch 2**20 the logits alone are 2**20 x 32 x 512 x 4 bytes (batch x seq_len x
# vocab_size x fp32).
LM = {"name": "transformer", "layers": 2, "d_model": 64, "heads": 2, "seq_len": 32, "vocab_size": 512,
      "dropout": 0.0, "optimizer": "adamw", "lr": 1e-3, "precision": "fp32", "data": {"source": "synthetic"},
      "parallel": "ddp", "ranks": 2, "target": {"name": "builtin"}}


def _ddp_predictor():
    from oomtune.alloc.geometry import budget_geometry
    from oomtune.plan.predictor import Predictor

    return Predictor(WorkloadSpec.from_dict(dict(LM)), budget_geometry(64 * MiB, 80 * 1024 * MiB), steps=2)


@pytest.mark.slow
def test_a_wide_ddp_range_is_captured_only_up_to_the_first_batch_over_the_limit():
    from oomtune.search.frontier import predicted_frontiers

    p = _ddp_predictor()
    limit = 5 * MiB
    frontiers = predicted_frontiers(p, [{}, {"expandable_segments": True}], 4, 1 << 20, limit)
    captured = sorted(p._captured)
    # a handful of small sizes, none near the top: the first over the limit bounds what is captured
    assert captured[-1] < 1 << 10
    over = p.over_limit_at
    assert over in captured and p._captured[over].peak_live_bytes() > limit
    assert all(p._captured[b].peak_live_bytes() <= limit for b in captured if b < over)
    assert p.known_over_limit(1 << 20) and not p.can_predict(1 << 20)
    # the frontier is still known (no batch above the over-limit one can fit): covered, not a guess
    assert all(f.covered for f in frontiers)
    assert all(f.predicted is None or f.predicted < captured[-1] for f in frontiers)


@pytest.mark.slow
def test_a_capture_the_host_cannot_hold_bounds_the_sizes_with_a_note_instead_of_ending_the_run(tmp_path, monkeypatch,
                                                                                                capsys):
    from oomtune.alloc.geometry import budget_geometry
    from oomtune.plan import predictor as P

    cfg = {"target": {"name": "python", "entry": f"{DATA.parent / 'entry_reads_a_value.py'}:make_workload"}}

    def predictor():
        return P.Predictor(WorkloadSpec.from_dict(dict(cfg)), budget_geometry(64 * MiB, 80 * 1024 * MiB), steps=1, workers=1)

    monkeypatch.setattr(P, "cpu_capture_limit_bytes", lambda: 400_000)   # the host holds 400 kB of tensors
    p = predictor()
    p.prepare([4, 8, 16, 1 << 12])   # no limit given: only the host bounds the captures
    # batch 4096's input alone is 4096 x 64 x 4 bytes = 1 MiB > 400 kB; batch 16's tensors are a few kB
    assert p.host_refused_at == 1 << 12
    assert not p.can_predict(1 << 12) and p.can_predict(16)
    assert len(p.bound_notes) == 1 and "batch 4096 and above not predicted" in p.bound_notes[0]
    assert "batch 4096 and above not predicted" in capsys.readouterr().err
    # the smallest size refused: nothing can be predicted, so the refusal is the error
    monkeypatch.setattr(P, "cpu_capture_limit_bytes", lambda: 1024)
    with pytest.raises(P.HostMemoryRefused):
        predictor().prepare([4, 8, 16, 1 << 12])


@pytest.mark.slow
def test_a_ddp_search_over_a_range_far_beyond_the_host_starts_its_trials(tmp_path, cli):
    run = tmp_path / "run"
    # its trials starting is the subject: no clean-process confirmation run of the winner (one 2-rank
    # trial less; a two-rank search's confirmation: tests/test_distributed_trials.py's search test)
    proc, _ = cli(["search", "model=transformer", "model.layers=2", "model.d_model=64", "model.heads=2",
                   "model.seq_len=32", "model.vocab_size=512", "budget=28MiB", "search.batch_size.low=4",
                   f"search.batch_size.high={1 << 20}", "trial.gpus=2", "model.parallel=ddp", "search.confirm=false",
                   f"hydra.run.dir={run}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "refused" not in proc.stderr + proc.stdout
    assert (run / "trials").is_dir() and any((run / "trials").iterdir())   # trials ran
    assert (run / "best.yaml").exists()


# ------------------------------------------------------------------ check --mode predict: the same
def _best_yaml(path: Path, entry: str) -> Path:
    """A hand-made best.yaml of a python entry on the virtual GPU (the fields check --mode predict reads)."""
    import yaml

    path.write_text(yaml.safe_dump({
        "schema_version": 1,
        "workload": {"model": {"name": "custom"}, "target": {"name": "python", "entry": f"{DATA / entry}:make_workload"}},
        "device": {"kind": "cpu", "name": "virtual GPU (CPU)", "total_memory_bytes": 80 << 30,
                   "budget_bytes": 1 << 30, "memory_source": "simulated"},
        "best": {"batch_size": 8, "alloc_conf": "", "settings": {},
                 "metrics": {"throughput": 100.0, "peak_reserved_bytes": 2 * MiB, "memory_source": "simulated"},
                 "predicted_peak_reserved_bytes": 2 * MiB}}))
    return path


@pytest.mark.parametrize("entry, flags, words", [
    ("entry_raises.py", [], "raised RuntimeError at"),
    ("entry_hangs.py", ["--timeout", "2"], "still running after --timeout=2 s"),
    ("entry_exits.py", [], "exited with status 3"),
])
def test_check_predict_of_a_failing_entry_is_one_line_exit_2(entry, flags, words, tmp_path, capsys):
    from oomtune.cli import main

    assert main(["check", str(_best_yaml(tmp_path / "best.yaml", entry)), "--mode", "predict", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err and "batch 8" in err, err


# ------------------------------------------------------------------ the plan's cells past the bound
class _Bounded:
    """A predictor whose batch 16 was captured over the limit (``over_limit_at``): peaks of b MiB at
    batch b (hand-made), every call recorded."""

    def __init__(self) -> None:
        self.asked: list[int] = []

    def can_predict(self, b: int, **_) -> bool:
        return b <= 16

    def known_over_limit(self, b: int, **_) -> bool:
        return b > 16

    def predict_detail(self, b: int, settings, **_):
        from oomtune.plan.predictor import Prediction

        self.asked.append(b)
        return Prediction(batch_size=b, alloc_conf="", peak_reserved_bytes=b * MiB, peak_allocated_bytes=b * MiB,
                          fragmentation=0.0, fits=True, num_alloc_retries=0, calibrated_peak_reserved_bytes=b * MiB)


def test_plan_cells_past_the_first_batch_over_the_limit_are_not_predicted_and_the_frontier_is_unchanged():
    from oomtune.plan.feasibility import _cell_text, frontier_row

    p = _Bounded()
    row = frontier_row(p, {}, [4, 8, 16, 32, 64], 10 * MiB)
    assert max(p.asked) == 16                                  # nothing asked past the bound
    assert [c.predicted for c in row.cells] == [True, True, True, False, False]
    assert not any(c.fits for c in row.cells[3:])
    assert row.max_batch_size == 10                            # b MiB <= 10 MiB: bisection between 8 and 16
    assert "not captured" in _cell_text(row.cells[4]) and "not captured" not in _cell_text(row.cells[0])


# ------------------------------------------------------------------ the entry's import, before any trial
# The check of an entry (does it exist, is it a function, does it take device / activation_checkpointing)
# imports its module, which runs the module's own code: in a process of its own under trial.timeout
# (oomtune/plan/entry_check.py). Fixtures: import_raises.py raises at its line 4, import_exits.py calls
# os._exit(3), import_hangs.py sleeps 10**6 s at module level.
IMPORT_STAGE = "its module imported to check the function before any trial"


def _import_case(name: str) -> tuple[list[str], str]:
    if name == "import_raises.py":
        where = f"{DATA / name}:{_line_of(DATA / name, 'raise RuntimeError')}"
        return [], f"raised RuntimeError at {where}: no config at /etc/fixture.yaml (fixture, module level)"
    if name == "import_exits.py":
        return [], "its process exited with status 3 without a result"
    return ["trial.timeout=3"], "still running after trial.timeout=3 s: stopped"


@pytest.mark.slow
@pytest.mark.parametrize("command", ["search", "plan"])
@pytest.mark.parametrize("name", ["import_raises.py", "import_exits.py", "import_hangs.py"])
def test_an_entry_whose_import_fails_is_one_line_exit_2_before_any_trial(command, name, tmp_path, cli):
    run, out, pidfile = tmp_path / "run", tmp_path / "plan.yaml", tmp_path / "pids"
    flags, words = _import_case(name)
    extra = ["--out", str(out)] if command == "plan" else []
    proc, took = cli([command, "target=python", _entry(name), "budget=256MiB", "search.batch_size.low=2",
                      "search.batch_size.high=8", *flags, f"hydra.run.dir={run}", *extra], tmp_path,
                     env={"OOMTUNE_TEST_PIDFILE": str(pidfile)})
    assert proc.returncode == 2, proc.stderr   # not the entry's 3: oomtune ended, not the entry's process
    line = _error_line(proc)
    assert f"target.entry={DATA / name}:make_workload, {IMPORT_STAGE}: {words}" in line, line
    assert not (run / "trials").exists() and not out.exists()   # no trial ran, no plan written
    if name == "import_hangs.py":   # the importing process was a child, and it is gone
        pids = [int(p) for p in pidfile.read_text().split()]
        assert pids and os.getpid() not in pids
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in pids), pids


def _user_modules(name: str) -> list[str]:
    """Modules of this process loaded from ``DATA / name`` (load_entry names a file's module
    oomtune_user_<stem>_<digest>)."""
    path = str((DATA / name).resolve())
    return [m for m, mod in list(sys.modules.items()) if getattr(mod, "__file__", None) == path]


def test_check_user_code_never_imports_the_module_here_and_keeps_the_functions_parameters():
    from oomtune.plan.entry_check import check_user_code
    from oomtune.targets.python_target import known_parameters

    # entry_raises.py's make_workload(batch_size, device): importing it is harmless, calling it raises
    entry = f"{DATA / 'entry_raises.py'}:make_workload"
    check_user_code(WorkloadSpec(target={"name": "python", "entry": entry}), timeout_s=60)
    assert known_parameters(entry) == frozenset({"batch_size", "device"})
    assert _user_modules("entry_raises.py") == []
    with pytest.raises(UserCodeError) as info:
        check_user_code(WorkloadSpec(target={"name": "python", "entry": f"{DATA / 'import_hangs.py'}:make_workload"}),
                        timeout_s=1.0)
    assert "still running after trial.timeout=1 s" in str(info.value) and "\n" not in str(info.value)
    assert _user_modules("import_hangs.py") == []


def test_checkpointing_is_refused_from_the_checked_parameters_without_importing_here():
    from oomtune.exceptions import ConfigError
    from oomtune.plan.entry_check import check_user_code
    from oomtune.targets.python_entry import check_checkpointing_argument

    # entry_raises.py's make_workload takes no activation_checkpointing parameter
    target = {"name": "python", "entry": f"{DATA / 'entry_raises.py'}:make_workload"}
    check_user_code(WorkloadSpec(target=target), timeout_s=60)
    with pytest.raises(ConfigError, match="needs the function to take an activation_checkpointing argument"):
        check_checkpointing_argument(target, True)
    assert _user_modules("entry_raises.py") == []


# ------------------------------------------------------------------ the plan's soak under a shape distribution
def _soak_rows(name: str, timeout_s: float):
    from types import SimpleNamespace

    from oomtune.plan.soak_frontier import soak_rows

    row = SimpleNamespace(max_batch_size=4, alloc_conf="", soak=None, at_max=None, worst_shape_max_batch_size=None)
    workload = {"target": {"name": "python", "entry": f"{DATA / name}:make_workload",
                           "seq_len": {"low": 8, "high": 32, "pad_multiple": 8, "seed": 3}}}
    geometry = {"total_memory_bytes": 1 << 30, "memory_fraction": 1.0, "non_allocator_bytes": 0}
    return soak_rows([row], workload, geometry, steps=20, low=1, cell=lambda b, s: None, timeout_s=timeout_s)


def test_a_soak_capture_of_an_entry_that_raises_is_one_line_and_ran_in_another_process():
    with pytest.raises(UserCodeError) as info:
        _soak_rows("entry_raises.py", 60)
    text = str(info.value)
    where = f"{DATA / 'entry_raises.py'}:{_line_of(DATA / 'entry_raises.py', 'raise RuntimeError')}"
    assert "\n" not in text and "captured at batch 4" in text and f"raised RuntimeError at {where}" in text, text
    assert _user_modules("entry_raises.py") == []   # the capture ran in a forked process, not here


def test_a_soak_capture_of_an_entry_that_hangs_is_stopped_at_its_limit():
    t0 = time.monotonic()
    with pytest.raises(UserCodeError) as info:
        _soak_rows("entry_hangs.py", 2.0)
    assert "still running after trial.timeout=2 s: stopped" in str(info.value)
    assert time.monotonic() - t0 < 60
