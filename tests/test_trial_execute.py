"""Where a trial's steps run on the virtual GPU: ``trial.execute=auto|meta|cpu``.

What must hold: a trial on the meta device sees the same request stream as the same trial on the CPU
wherever the kernels allocate alike (the memory figures, the out-of-memory request, the soak), so
the answers do not change; it needs no host memory for its tensors; it measures no throughput; the
search runs one real CPU step first (the smoke test), keeps its clean-process confirmation, and a
CPU trial whose budget the host cannot hold stops with one line before anything runs.

Expected values: the CPU run of the same spec (the behaviour before ``trial.execute``), hand arithmetic for
tensor sizes, and /proc/meminfo-style text written here.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from oomtune.exceptions import ConfigError
from oomtune.search.objectives import objective_for
from oomtune.trial import child
from oomtune.trial.execute import check_host_memory, host_available_bytes, resolve_execute
from oomtune.trial.record import ExecutionInfo, TrialSpec
from oomtune.units import GiB, MiB
from oomtune.workload_spec import WorkloadSpec

sys.path.insert(0, str(Path(__file__).parent))
from shared_runs import TINY_META, one_cpu_thread, tiny_meta_search  # noqa: E402,F401  (a shared search)

ROOT = Path(__file__).resolve().parents[1]
FIELDS = ("outcome", "memory.peak_reserved_bytes", "memory.peak_allocated_bytes", "memory.peak_active_bytes",
          "memory.num_alloc_retries", "memory.num_ooms", "memory.fragmentation", "memory.oom_requested_bytes",
          "throughput.steps", "soak.passed", "soak.steps_run", "soak.failed_step", "soak.peak_reserved_bytes",
          "soak.reserved_bytes", "soak.allocated_bytes")
WORKLOADS = {
    "mlp": {"name": "mlp", "in_features": 64, "hidden": 128, "layers": 2, "num_classes": 10, "optimizer": "sgd"},
    "resnet": {"name": "resnet", "depth": 18, "image_size": 32, "num_classes": 10, "optimizer": "sgd"},
    "resnet-bf16": {"name": "resnet", "depth": 18, "image_size": 32, "num_classes": 10, "optimizer": "sgd",
                    "precision": "bf16"},
    "python": {"target": {"name": "python", "entry": str(ROOT / "examples/my_workload.py") + ":make_workload"}},
}


@pytest.fixture(autouse=True)
def clean_alloc_env(monkeypatch):
    for name in child.ALLOC_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv(child.TEST_HOOK_ENV, raising=False)


@pytest.fixture(autouse=True)
def single_thread():
    """One CPU thread for the steps these tests compute, here and in the processes they start
    (shared_runs.one_cpu_thread: the memory figures compared do not depend on it)."""
    with one_cpu_thread():
        yield


def _spec(workload, execute, **kw) -> TrialSpec:
    base = dict(workload=workload, batch_size=8, device="cpu", budget_bytes=512 * MiB,
                device_memory_bytes=8 * GiB, warmup_steps=1, measure_steps=3, timeout_s=120, execute=execute)
    base.update(kw)
    return TrialSpec(**base)


def _figures(result) -> tuple:
    """The :data:`FIELDS` of a record (``section.field``; a section that is None gives None)."""
    out = []
    for name in FIELDS:
        value = result
        for part in name.split("."):
            value = None if value is None else getattr(value, part)
        out.append(value)
    return tuple(out)


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_a_meta_trial_measures_the_memory_of_the_cpu_trial(name):
    # a warm-up step and one measured step: the second step is the steady state (the optimizer's state
    # exists, the gradients are freed and made again), which every later step of these fixed-shape
    # workloads repeats; a bf16 ResNet step costs seconds of CPU
    # the bf16 ResNet at batch 2: CPU bf16 convolutions are slow, and two samples make the same
    # requests of every tensor (only their sizes scale with the batch)
    batch = 2 if name == "resnet-bf16" else 8
    cpu = child.run_child(_spec(WORKLOADS[name], "cpu", measure_steps=1, batch_size=batch))
    meta = child.run_child(_spec(WORKLOADS[name], "meta", measure_steps=1, batch_size=batch))
    assert cpu.outcome == "ok", cpu.message
    assert _figures(meta) == _figures(cpu)
    assert cpu.execution.where == "cpu" and meta.execution.where == "meta"
    # the meta steps do no arithmetic: no throughput, no step time, no data-wait fraction
    assert cpu.throughput.samples_per_s > 0 and meta.throughput.samples_per_s is None
    assert meta.throughput.step_time_s is None
    assert meta.throughput.data_wait_fraction is None and meta.execution.meta_step_s > 0


def test_a_meta_trial_runs_out_of_memory_at_the_same_request_as_the_cpu_trial():
    # ResNet-18 32x32 at batch 64 needs more than 96 MiB (about 150 MiB at batch 8 x ~1.9): an OOM in the step
    wl = WORKLOADS["resnet"]
    cpu = child.run_child(_spec(wl, "cpu", batch_size=64, budget_bytes=96 * MiB))
    meta = child.run_child(_spec(wl, "meta", batch_size=64, budget_bytes=96 * MiB))
    # The class, by hand: the budget is a memory fraction of the 8 GiB virtual GPU ("96.00 MiB allowed",
    # the card ~8 GiB free), so not a plain "oom". Registering ResNet-18's parameters puts the layer3/
    # layer4 conv weights (1.125, 3 x 2.25 and 4.5 MiB, then 3 x 9 MiB; each < 10 MiB: kLargeBuffer
    # segments) in three 20 MiB segments, leaving free blocks of 7.6, 2 and 11 MiB; the forward's large
    # tensors at 64 x 3 x 32 x 32 (conv1 and bn1 outputs 4 MiB each, max-pool indices 2 MiB) take 10 MiB
    # of them, every other activation is <= 1 MiB (small pool: about 20 MiB of 2 MiB segments), so about
    # 86 MiB is reserved after the forward pass. The first 9 MiB layer4 weight gradient fits no cached
    # block and a new 20 MiB segment passes 96 MiB: the OOM. About 10 MiB stays reserved but unallocated
    # in the parameters' segments, so the request behind "Tried to allocate 20.00 MiB" (at most
    # 10 MiB - 512 B) <= free under the fraction + reserved but unallocated: fragmentation.
    assert cpu.outcome == "oom_fragmentation", cpu.message
    assert _figures(meta) == _figures(cpu) and meta.message == cpu.message


@pytest.mark.usefixtures("no_cublas_workspaces")   # a hand-sized device of a few MiB
def test_a_meta_soak_equals_the_cpu_soak():
    # multi-scale ResNet: three image sizes in the data's seeded order, 40 soak steps after the live ones
    wl = {**WORKLOADS["resnet"], "image_size": {"sizes": [24, 32, 40], "seed": 0}}
    cpu = child.run_child(_spec(wl, "cpu", soak_steps=40, budget_bytes=160 * MiB))
    meta = child.run_child(_spec(wl, "meta", soak_steps=40, budget_bytes=160 * MiB))
    assert cpu.soak.steps_run is not None
    assert _figures(meta) == _figures(cpu)


def test_adams_step_counters_are_the_known_difference_of_a_cpu_trial():
    """Adam keeps one ``step`` counter per parameter on the host (``capturable=False``, torch.optim.adam):
    a CPU trial's virtual GPU counts them, as CPU tensors, a meta trial's does not, as a CUDA run does
    not. MLP 64 -> 128 -> 128 -> 10: 6 parameter tensors; each 4-byte counter is one 512-byte block."""
    wl = {**WORKLOADS["mlp"], "optimizer": "adamw"}
    cpu = child.run_child(_spec(wl, "cpu"))
    meta = child.run_child(_spec(wl, "meta"))
    assert cpu.memory.peak_allocated_bytes - meta.memory.peak_allocated_bytes == 6 * 512


def test_a_meta_trial_needs_no_host_memory_for_a_batch_far_larger_than_the_host():
    # MLP 4096 -> 4096 -> 10 at batch 2,000,000: the input alone is 2e6 x 4096 x 4 bytes = 32.8 GB, more
    # than this machine holds; on meta nothing is materialised and the virtual GPU sees it all
    wl = {"name": "mlp", "in_features": 4096, "hidden": 4096, "layers": 1, "num_classes": 10, "optimizer": "sgd"}
    r = child.run_child(_spec(wl, "meta", batch_size=2_000_000, budget_bytes=400 * GiB,
                              device_memory_bytes=512 * GiB, warmup_steps=0, measure_steps=1))
    assert r.outcome == "ok", r.message
    assert r.memory.peak_allocated_bytes >= 2_000_000 * 4096 * 4


def test_a_meta_trial_whose_code_cannot_run_on_meta_runs_on_the_cpu_and_says_so(tmp_path):
    entry = tmp_path / "wl.py"
    entry.write_text("""import torch
from torch import nn

def make_workload(batch_size, device):
    model = nn.Linear(16, 4).to(device)
    def batches():
        while True:
            x = torch.randn(batch_size, 16, device=device)
            float(x.abs().max())          # reads a value: there is none on meta
            yield x, torch.randint(0, 4, (batch_size,), device=device)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), batches()
""")
    wl = {"target": {"name": "python", "entry": f"{entry}:make_workload"}}
    r = child.run_child(_spec(wl, "meta"))
    assert r.outcome == "ok", r.message
    assert r.execution.where == "cpu" and "ran on the CPU" in r.execution.fallback
    assert r.throughput.samples_per_s > 0


# -- resolving trial.execute -----------------------------------------------------------------------------
BUILTIN = {"name": "resnet", "target": {"name": "builtin"}}


@pytest.mark.parametrize("setting, simulated, objective, workload, mode", [
    ("auto", True, "batch", BUILTIN, "meta"),
    ("auto", True, "throughput", BUILTIN, "cpu"),            # throughput needs real steps
    ("auto", True, "batch", {**BUILTIN, "data": {"source": "imagefolder"}}, "cpu"),   # real files
    ("auto", False, "throughput", BUILTIN, "device"),
    ("meta", False, "throughput", BUILTIN, "device"),        # a GPU trial runs on the GPU
    ("cpu", True, "batch", BUILTIN, "cpu"),
    ("meta", True, "batch", {"target": {"name": "python", "entry": "x.py:f"}}, "meta"),
    # a command is asked for meta steps on the virtual GPU (its integration runs them there, or the CPU)
    ("meta", True, "batch", {"target": {"name": "cmd", "command": "python t.py"}}, "meta"),
    ("auto", True, "batch", {"target": {"name": "cmd", "command": "python t.py"}}, "meta"),
    ("cpu", True, "batch", {"target": {"name": "cmd", "command": "python t.py"}}, "command"),
    ("auto", True, "throughput", {"target": {"name": "cmd", "command": "python t.py"}}, "command"),
    ("auto", False, "batch", {"target": {"name": "cmd", "command": "python t.py"}}, "command"),
    # a command of two ranks (trial.gpus=2): its gloo process group moves real tensors, so CPU steps, no smoke test
    ("auto", True, "batch", {"target": {"name": "cmd", "command": "torchrun t.py"}, "ranks": 2}, "command"),
    ("meta", False, "batch", {"target": {"name": "cmd", "command": "torchrun t.py"}, "ranks": 2}, "command"),
])
def test_resolve_execute(setting, simulated, objective, workload, mode):
    spec = WorkloadSpec.from_dict(workload)   # the flat form a trial's spec.json carries, read once
    assert resolve_execute(setting, simulated=simulated, objective=objective_for(objective), workload=spec)[0] == mode


def test_meta_where_it_cannot_work_is_one_clear_error():
    with pytest.raises(ConfigError, match="trial.execute=meta measures no throughput"):
        resolve_execute("meta", simulated=True, objective=objective_for("throughput"),
                        workload=WorkloadSpec.from_dict(BUILTIN))
    with pytest.raises(ConfigError, match="synthetic data only"):
        resolve_execute("meta", simulated=True, objective=objective_for("batch"),
                        workload=WorkloadSpec.from_dict({**BUILTIN, "data": {"source": "tokens"}}))
    with pytest.raises(ConfigError, match="trial.execute=meta cannot run target=cmd with trial.gpus=2"):
        resolve_execute("meta", simulated=True, objective=objective_for("batch"), workload=WorkloadSpec(
            target={"name": "cmd", "command": "torchrun t.py"}, ranks=2))


def test_host_available_memory_reads_memavailable(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24576000 kB\nMemFree:         1000000 kB\nMemAvailable:   20000000 kB\n")
    assert host_available_bytes(meminfo) == 20_000_000 * 1024
    meminfo.write_text("MemTotal:       24576000 kB\n")     # a kernel before 3.14: unknown
    assert host_available_bytes(meminfo) is None
    assert host_available_bytes(tmp_path / "absent") is None


def test_a_cpu_budget_the_host_cannot_hold_stops_with_one_line():
    with pytest.raises(ConfigError) as err:
        check_host_memory("cpu", 24 * GiB, available_bytes=20 * GiB)
    message = str(err.value)
    assert "\n" not in message
    assert "budget 24.00 GiB cannot fit in this host's available memory (20.00 GiB" in message
    assert "trial.execute=meta" in message
    with pytest.raises(ConfigError, match="2 trials at once x budget 12.00 GiB"):
        check_host_memory("cpu", 12 * GiB, 2, available_bytes=20 * GiB)
    check_host_memory("cpu", 12 * GiB, 1, available_bytes=20 * GiB)      # fits: nothing said
    check_host_memory("meta", 24 * GiB, 1, available_bytes=20 * GiB)     # meta holds no tensors


def test_the_search_refuses_a_cpu_budget_above_the_host_before_any_trial(tmp_path, capsys, monkeypatch):
    from oomtune.cli import main
    from oomtune.trial import execute

    monkeypatch.setattr(execute, "host_available_bytes", lambda meminfo="/proc/meminfo": 2 * GiB)
    run_dir = tmp_path / "run"
    code = main(["search", "model=mlp", "budget=4GiB", "device=cpu", "trial.execute=cpu", f"hydra.run.dir={run_dir}"])
    err = capsys.readouterr().err
    assert code == 2
    assert "budget 4.00 GiB cannot fit in this host's available memory (2.00 GiB" in " ".join(err.split())
    assert not (run_dir / "trials").exists()


# -- the search with meta trials ---------------------------------------------------------------------------
# The meta search is tests/shared_runs.py's tiny_meta_search (shared with tests/test_report_e2e.py); the CPU
# search here runs the same overrides (shared_runs.TINY_META) with trial.execute=cpu.


def _study(run_dir):
    import json

    import optuna

    info = json.loads((run_dir / "run.json").read_text())
    return optuna.load_study(study_name=info["study_name"], storage=info["storage"])


@pytest.mark.slow
def test_a_search_with_meta_trials_gives_the_answer_of_cpu_trials_and_keeps_its_guarantees(tmp_path, tiny_meta_search):
    import oomtune
    from oomtune.cli import main
    from oomtune.study import records as R

    def answer(run_dir):
        best = oomtune.load_best(run_dir / "best.yaml")
        return best, (best.batch_size, best.alloc_conf, best.best.metrics["peak_reserved_bytes"])

    assert tiny_meta_search.code == 0
    run_dir = tiny_meta_search.run
    best, meta_answer = answer(run_dir)
    study = _study(run_dir)
    out = " ".join(tiny_meta_search.err.split())
    assert "smoke test: one real CPU step at batch 2 (default allocator) ran" in out
    assert "trials: their steps on the meta device, memory simulated, throughput not measured" in out
    assert study.user_attrs["smoke_test"]["batch_size"] == 2
    results = [R.result_of(t) for t in study.trials if R.result_of(t) is not None]
    assert results and all(r.execution.where == "meta" and r.throughput.samples_per_s is None for r in results)
    confirm = [t for t in study.trials if t.user_attrs.get(R.ATTR_ROLE) == "confirm"][-1]
    res = R.result_of(confirm)
    # the confirmation is still a fresh interpreter (spawned), runs every step and the soak
    assert res.process.launcher == "spawn" and res.throughput.steps == 1 + 3
    assert res.soak.passed is True and res.soak.steps_run == 20
    assert best.best.confirmed and best.best.metrics["throughput"] is None

    # The reference: the same search with its trials' steps on the CPU. Its answer is what its CPU trials
    # measured; no clean-process confirmation of it (search.confirm=false: the confirmation, asserted above
    # on the meta search, would only run the winner's fixed-shape steady-state step twice more on the CPU
    # in a spawned interpreter). Its peak is then the winning CPU trial's own (steps 1-2), the meta answer's
    # the confirmation's (steps 1-4): equal, as every later step of this fixed-shape workload repeats the
    # second (the steady state; see test_a_meta_trial_measures_the_memory_of_the_cpu_trial).
    cpu_dir = tmp_path / "cpu"
    assert main(["search", *TINY_META, "trial.execute=cpu", "search.confirm=false", f"hydra.run.dir={cpu_dir}"]) == 0
    cpu_best, cpu_answer = answer(cpu_dir)
    assert not cpu_best.best.confirmed and cpu_answer == meta_answer


@pytest.mark.slow
def test_a_workload_that_fails_on_the_cpu_stops_the_search_at_the_smoke_test(tmp_path, capsys):
    from oomtune.cli import main

    entry = tmp_path / "wl.py"
    entry.write_text("""import torch
from torch import nn

def make_workload(batch_size, device):
    model = nn.Linear(16, 4).to(device)
    if device.type == "cpu":
        raise RuntimeError("this code breaks where it computes")
    def batches():
        while True:
            yield torch.randn(batch_size, 16, device=device), torch.randint(0, 4, (batch_size,), device=device)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), batches()
""")
    code = main(["search", "target=python", f"target.entry={entry}:make_workload", "budget=64MiB", "device=cpu",
                 "search.batch_size.low=4", "search.batch_size.high=64", f"hydra.run.dir={tmp_path / 'run'}"])
    captured = capsys.readouterr()
    err = " ".join((captured.out + captured.err).split())
    assert code == 1
    assert "oomtune: the workload fails on the CPU at batch 4 (the smoke test: one real step, default allocator)" in err
    assert "this code breaks where it computes" in err


def test_the_smoke_test_under_a_global_batch_runs_two_micro_batches_not_the_whole_global_batch():
    """Field case: ``examples/global_batch.py`` at global batch 32 from micro-batch 1: the smoke test ran
    micro-batch 1 x 32 accumulation steps (46 s of a 112 s search on 2 CPUs), 32 real forward and
    backward passes where the recordings (search/recordings.py ``record_streams``) run two per step.
    Expected: micro-batch 1 (the smallest), ``grad_accum`` 2 in the trial's workload."""
    from types import SimpleNamespace

    from oomtune.search.smoke import STUDY_ATTR, smoke_test
    from oomtune.space import SearchSpace
    from oomtune.trial.record import TrialResult

    class Study:
        user_attrs: dict = {}

        def set_user_attr(self, key, value):
            self.user_attrs = {**self.user_attrs, key: value}

        def get_trials(self, deepcopy=False):
            return []

    space = SearchSpace(1, 32, {"expandable_segments": [False, True]}, global_batch=32)
    assert space.default(1).grad_accum == 32   # what a candidate of the smallest micro-batch trains
    opt = SimpleNamespace(execute="meta", host_available_bytes=None,
                          workload=WorkloadSpec.from_dict({"target": {"name": "cmd"}}),
                          device="cpu", trial=SimpleNamespace(timeout=60), device_memory_bytes=80 * GiB)
    specs = []

    def run(spec):
        specs.append(spec)
        return TrialResult(outcome="ok", batch_size=spec.batch_size, alloc_conf="", wall_s=1.0)

    study = Study()
    line = smoke_test(study, space, opt, peak=lambda b, p: None, run=run)
    assert len(specs) == 1
    assert specs[0].batch_size == 1 and specs[0].workload.training["grad_accum"] == 2 and specs[0].execute == "cpu"
    assert "one real CPU step at batch 1 x 2 micro-batches (default allocator)" in line
    assert study.user_attrs[STUDY_ATTR]["batch_size"] == 1


def _recorded_trial(number, batch, execute, outcome="ok"):
    """A finished trial as the study holds it: its TrialResult in the ``result`` user attribute."""
    from types import SimpleNamespace

    from oomtune.study import records as R
    from oomtune.trial.record import TrialResult

    res = TrialResult(outcome=outcome, batch_size=batch, alloc_conf="", execution=ExecutionInfo(where=execute))
    return SimpleNamespace(number=number, params={"batch_size": batch}, user_attrs={R.ATTR_RESULT: res.to_dict()})


def test_a_command_whose_trials_computed_on_the_cpu_gets_no_smoke_test_and_no_meta_note():
    """Field case: examples/train_cmd.py (capture_hook, no integration) under trial.execute=auto: every
    trial's record said ``execute: cpu`` (targets/cmd.py: no meta report), yet the search launched the
    smoke test's real CPU step (19.5 s at load 9) and ended with "trials ran their steps on the meta
    device ... throughput was not measured" beside its CPU throughputs. Expected: the smoke test names
    the trial that computed on the CPU and launches nothing; where the steps ran comes from the
    records (cpu; meta; mixed)."""
    from types import SimpleNamespace

    from oomtune.search.smoke import smoke_test
    from oomtune.search.summary import steps_ran_on
    from oomtune.space import SearchSpace

    trials = [_recorded_trial(0, 8, "cpu"), _recorded_trial(1, 16, "cpu")]
    study = SimpleNamespace(user_attrs={}, get_trials=lambda deepcopy=False: trials)
    opt = SimpleNamespace(execute="meta", host_available_bytes=None,
                          workload=WorkloadSpec.from_dict({"target": {"name": "cmd"}}),
                          device="cpu", trial=SimpleNamespace(timeout=60), device_memory_bytes=80 * GiB)
    launched = []
    line = smoke_test(study, SearchSpace(8, 512, {"expandable_segments": [False, True]}), opt,
                      peak=lambda b, p: None, run=launched.append)
    assert launched == []
    assert line.startswith("smoke test: not needed: trial 0 ran the workload's steps on the CPU (batch 8)")
    assert steps_ran_on(trials, "meta") == "cpu"
    assert steps_ran_on([_recorded_trial(0, 8, "meta")], "cpu") == "meta"
    assert steps_ran_on([_recorded_trial(0, 8, "meta"), _recorded_trial(1, 16, "cpu")], "meta") == "mixed"
    assert steps_ran_on([], "meta") == "meta"   # no record says: what was asked
    # a failed CPU run is no smoke test
    from oomtune.trial.record import TrialResult

    study_failed = SimpleNamespace(user_attrs={}, get_trials=lambda deepcopy=False: [_recorded_trial(0, 8, "cpu", "error")],
                                   set_user_attr=lambda k, v: None)
    ran = []

    def run(spec):
        ran.append(spec)
        return TrialResult(outcome="ok", batch_size=spec.batch_size, alloc_conf="", wall_s=1.0)

    smoke_test(study_failed, SearchSpace(8, 512, {"expandable_segments": [False, True]}), opt, peak=lambda b, p: None,
               run=run)
    assert len(ran) == 1


# ----------------------------------------------------------------------------- target=cmd: where its steps ran
def _cmd_spec(args: str, execute: str) -> TrialSpec:
    import shlex
    import sys

    command = f"{shlex.quote(sys.executable)} {shlex.quote(str(ROOT / 'tests/data/fails_before_report.py'))} {args}"
    return TrialSpec(workload={"name": "mlp", "target": {"name": "cmd", "command": command, "cwd": None}},
                     batch_size=4, device="cpu", budget_bytes=64 * MiB, timeout_s=60, execute=execute)


def test_a_command_that_fails_before_reporting_says_nothing_of_where_its_steps_ran(tmp_path):
    from oomtune.outcome import Outcome
    from oomtune.targets.cmd import run_cmd_trial

    # meta steps allowed (OOMTUNE_EXECUTE=meta), failed before any report: where its steps ran is unknown
    res = run_cmd_trial(_cmd_spec("", "meta"), workdir=tmp_path / "meta")
    assert res.outcome is Outcome.ERROR and res.script.reports == 0
    assert res.execution.where is None
    # told to run its steps on the CPU (OOMTUNE_EXECUTE=cpu): cpu, whether it reported or not
    assert run_cmd_trial(_cmd_spec("", "cpu"), workdir=tmp_path / "cpu").execution.where == "cpu"
    # a report without "execute": "meta": its steps computed on the CPU
    done = run_cmd_trial(_cmd_spec("--report", "meta"), workdir=tmp_path / "report")
    assert done.outcome is Outcome.OK and done.execution.where == "cpu"
