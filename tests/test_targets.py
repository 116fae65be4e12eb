"""target=cmd (any command + the results channel), target=python (make_workload), and the image-folder
data path of the built-in workloads."""

from __future__ import annotations

import shlex
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from oomtune.exceptions import ConfigError
from oomtune.outcome import Outcome
from oomtune.targets import build_trial_workload, validate_target
from oomtune.targets.cmd import NO_REPORT_MESSAGE, build_command, result_from_channel, run_cmd_trial
from oomtune.targets.python_entry import UserWorkload, build_user_workload, load_entry
from oomtune.trial.record import TrialSpec
from oomtune.trial.runner import group_alive
from oomtune.workloads import Workload, build_workload
from oomtune.workload_spec import WorkloadSpec

REPO = Path(__file__).resolve().parents[1]
PY = shlex.quote(sys.executable)
MIB = 1 << 20


# ----------------------------------------------------------------------------- target=cmd
def _cmd_spec(command: str, *, batch_size: int = 4, timeout_s: float = 60.0, **kw) -> TrialSpec:
    target = {"name": "cmd", "command": command, "cwd": None}
    return TrialSpec(workload={"name": "mlp", "target": target}, batch_size=batch_size,
                     timeout_s=timeout_s, **kw)


def _script(tmp_path: Path, body: str) -> str:
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(body))
    return f"{PY} {shlex.quote(str(path))}"


def test_build_command_substitutes_the_batch_and_picks_a_shell_only_when_needed():
    assert build_command({"command": "python train.py --bs {batch_size}"}, 16) == (
        ["python", "train.py", "--bs", "16"], False)
    assert build_command({"command": "python t.py --cfg '{\"a\": 1}'"}, 2)[0][-1] == '{"a": 1}'
    argv, shell = build_command({"command": "cd x && python t.py {batch_size} | tee log"}, 8)
    assert shell and argv == ["/bin/sh", "-c", "cd x && python t.py 8 | tee log"]
    assert build_command({"command": "echo $HOME"}, 1)[1] is True
    assert build_command({"command": ["python", "t.py", "{batch_size}"]}, 3) == (["python", "t.py", "3"], False)


@pytest.mark.parametrize("command", [None, "", "???", "python 'unclosed"])
def test_bad_commands_are_config_errors(command):
    with pytest.raises(ConfigError, match="target.command"):
        build_command({"command": command}, 1)


def test_missing_cwd_and_missing_program_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="target.cwd"):
        validate_target({"name": "cmd", "command": "python x.py", "cwd": str(tmp_path / "nope")})
    with pytest.raises(ConfigError, match="cannot start"):
        run_cmd_trial(_cmd_spec("no-such-program-oomtune {batch_size}"), workdir=tmp_path / "t")


def test_good_command_reports_throughput_and_sees_the_trial_environment(tmp_path):
    cmd = _script(tmp_path, """
        import os, sys, oomtune
        env = {k: os.environ.get(k) for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF",
               "OOMTUNE_BATCH_SIZE", "OOMTUNE_BUDGET_BYTES", "OOMTUNE_DEVICE")}
        bs = int(sys.argv[1])
        oomtune.report(samples=3 * bs, seconds=0.5, steps=3, data_wait_seconds=0.1, env=env)
    """) + " {batch_size}"
    spec = _cmd_spec(cmd, batch_size=7, alloc_conf="expandable_segments:True", budget_bytes=64 * MIB)
    started = []
    res = run_cmd_trial(spec, workdir=tmp_path / "t", on_start=started.append)
    assert res.outcome is Outcome.OK, res.message
    assert started == [res.process.pid]
    assert res.throughput.samples_per_s == pytest.approx(3 * 7 / 0.5)        # 42 samples/s
    assert res.throughput.step_time_s == pytest.approx(0.5 / 3)
    assert res.throughput.data_wait_fraction == pytest.approx(0.1 / 0.5)
    assert res.script.reported_values()[0]["env"] == {
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "PYTORCH_ALLOC_CONF": "expandable_segments:True",
        "OOMTUNE_BATCH_SIZE": "7", "OOMTUNE_BUDGET_BYTES": str(64 * MIB), "OOMTUNE_DEVICE": "cpu"}
    assert res.memory.peak_reserved_bytes is None and res.script.memory_unknown is True  # no capture hook


def test_shell_command_runs_through_sh(tmp_path):
    cmd = "true && " + _script(tmp_path, "import oomtune; oomtune.report(samples=10, seconds=2.0)\n")
    res = run_cmd_trial(_cmd_spec(cmd), workdir=tmp_path / "t")
    assert (res.outcome, res.throughput.samples_per_s) == (Outcome.OK, 5.0)


def test_command_that_never_reports_is_an_error(tmp_path):
    res = run_cmd_trial(_cmd_spec(_script(tmp_path, "print('trained, but said nothing')\n")),
                        workdir=tmp_path / "t")
    assert res.outcome is Outcome.ERROR
    assert res.message == NO_REPORT_MESSAGE
    assert res.throughput.samples_per_s is None and res.process.returncode == 0


def test_sigkill_without_evidence_of_the_oom_killer_is_a_crash(tmp_path):
    # a kill -9 leaves the cgroup's oom_kill counter and the kernel log unchanged
    res = run_cmd_trial(_cmd_spec(_script(tmp_path, "import os\nos.kill(os.getpid(), 9)\n")),
                        workdir=tmp_path / "t")
    assert res.outcome is Outcome.CRASH, res.message
    assert "no evidence of the OOM killer" in res.message
    assert res.process.returncode == -9


def test_sigkill_with_a_grown_oom_kill_counter_is_host_oom(tmp_path, monkeypatch):
    from oomtune.trial import oomkill

    counts = iter([{"/cg/memory.events": 3}, {"/cg/memory.events": 4}])   # before, after the command
    monkeypatch.setattr(oomkill, "read_oom_kill_counters", lambda **kw: next(counts))
    res = run_cmd_trial(_cmd_spec(_script(tmp_path, "import os\nos.kill(os.getpid(), 9)\n")),
                        workdir=tmp_path / "t")
    assert res.outcome is Outcome.HOST_OOM
    assert "/cg/memory.events: oom_kill 3 -> 4" in res.message


def test_traceback_is_an_error_with_its_tail(tmp_path):
    res = run_cmd_trial(_cmd_spec(_script(tmp_path, "raise ValueError('boom in the script')\n")),
                        workdir=tmp_path / "t")
    assert res.outcome is Outcome.ERROR
    assert "boom in the script" in res.traceback_tail


def test_hanging_command_times_out_and_its_process_group_is_gone(tmp_path):
    cmd = _script(tmp_path, """
        import subprocess, time
        subprocess.Popen(["sleep", "120"])   # a grandchild in the same process group
        time.sleep(120)
    """)
    res = run_cmd_trial(_cmd_spec(cmd, timeout_s=2.0), workdir=tmp_path / "t", grace_s=1.0)
    assert res.outcome is Outcome.TIMEOUT
    # only the timeout's kill ends the trial before the script's own 120 s sleep: a bound set by the
    # script, not by how fast a loaded machine starts and kills processes
    assert res.wall_s < 120
    assert not group_alive(res.process.pid)


def test_channel_oom_wins_even_when_the_script_caught_it():
    message = ("[virtual GPU, simulated] CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total "
               "capacity of 4.00 MiB of which 2.00 MiB is free. Of the allocated memory 256.00 KiB is "
               "allocated by PyTorch, and 1.75 MiB is reserved by PyTorch but unallocated.")
    events = [{"event": "oom", "message": message, "requested_bytes": 20 * MIB},
              {"event": "report", "samples": 8, "seconds": 1.0}]
    res = result_from_channel(_cmd_spec("x"), events, returncode=0, stderr="", timed_out=False)
    assert res.outcome is Outcome.OOM          # 1.75 MiB cached < 20 MiB asked: not fragmentation
    assert res.memory.oom_requested_bytes == 20 * MIB and res.throughput.samples_per_s is None
    assert res.script.oom_caught_by_script is True


def test_real_cuda_oom_traceback_in_stderr_is_a_memory_outcome():
    stderr = ("Traceback (most recent call last):\n  File \"train.py\", line 3, in <module>\n"
              "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
              "capacity of 79.19 GiB of which 1.00 GiB is free. Including non-PyTorch memory, this process "
              "has 78.18 GiB memory in use. Of the allocated memory 76.00 GiB is allocated by PyTorch, and "
              "1.50 GiB is reserved by PyTorch but unallocated.\n")
    res = result_from_channel(_cmd_spec("x"), [], returncode=1, stderr=stderr, timed_out=False)
    # 1.50 GiB cached < 2.00 GiB asked, but 1.00 GiB free + 1.50 GiB trapped in split segments >= 2.00
    # GiB: the C8 kind of fragmentation (the allocator had already released its whole free segments).
    assert res.outcome is Outcome.OOM_FRAGMENTATION
    assert res.memory.oom_requested_bytes == 2 << 30


@pytest.mark.parametrize("budget, expected", [(1 * MIB, Outcome.OOM), (1 << 30, Outcome.OK)])
def test_example_script_on_the_virtual_gpu(tmp_path, budget, expected):
    cmd = f"{PY} {shlex.quote(str(REPO / 'examples' / 'train_cmd.py'))} --batch-size {{batch_size}}"
    res = run_cmd_trial(_cmd_spec(cmd, batch_size=16, budget_bytes=budget, timeout_s=120), workdir=tmp_path / "t")
    assert res.outcome == expected.value, (res.message, res.traceback_tail)
    assert res.memory.source == "simulated"
    if expected is Outcome.OOM:
        # The first parameter (<= 1 MiB) needs a 2 MiB small-pool segment: more than the 1 MiB device.
        assert res.memory.oom_requested_bytes == 2 * MIB
        assert res.throughput.samples_per_s is None
    else:
        # Linear(128, 256) + Linear(256, 10): 131072 + 1024 + 10240 + 40->512 B (512 B rounding);
        # parameters, gradients and Adam's exp_avg / exp_avg_sq are four copies alive at once.
        assert res.memory.peak_allocated_bytes >= 4 * (131072 + 1024 + 10240 + 512)
        assert res.memory.peak_reserved_bytes >= res.memory.peak_allocated_bytes
        assert res.throughput.samples_per_s > 0


# ----------------------------------------------------------------------------- target=python
EXAMPLE_ENTRY = f"{REPO / 'examples' / 'my_workload.py'}:make_workload"


@pytest.fixture
def user_pkg(tmp_path, monkeypatch):
    pkg = tmp_path / "oomt_user_pkg_t"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_text(textwrap.dedent("""
        import torch
        from torch import nn
        SEEN = {}
        def tuple_no_device(batch_size):
            model = nn.Linear(8, 3)
            batches = [(torch.randn(batch_size, 8), torch.randint(0, 3, (batch_size,)))]   # one batch, reused
            return model, torch.optim.SGD(model.parameters(), lr=0.1), batches
        def with_device(batch_size, device):
            SEEN["device"] = device
            return tuple_no_device(batch_size)
        def empty(batch_size):
            model = nn.Linear(8, 3)
            return {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1), "batches": []}
        def no_optimizer(batch_size):
            return {"model": nn.Linear(8, 3), "batches": []}
        def wrong_model(batch_size):
            return ("model", None, [])
        NOT_CALLABLE = 3
    """))
    (pkg / "broken.py").write_text("import oomtune_dependency_that_is_missing\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "oomt_user_pkg_t"


@pytest.mark.parametrize("entry, fragment", [
    ("no_colon_here", "expected 'package.module:function'"),
    ("", "expected"),
    ("???", "expected"),
    ("oomtune_no_such_module_xyz:make", "no module named 'oomtune_no_such_module_xyz'"),
    ("os:no_such_function_here", "has no function 'no_such_function_here'"),
    # a near miss names the closest function (difflib's ratio 2M/T: getcwd 12/13 beats getcwdb 12/14)
    ("os:getcwdd", "has no function 'getcwdd' (did you mean os:getcwd?)"),
    ("os:sep", "not a function"),
    ("missing_dir/missing_file.py:make", "not found"),
])
def test_bad_entries_are_one_line_config_errors(entry, fragment):
    with pytest.raises(ConfigError) as info:
        load_entry(entry)
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_entry_whose_own_import_fails_names_the_missing_dependency(user_pkg):
    with pytest.raises(ConfigError, match="oomtune_dependency_that_is_missing"):
        load_entry(f"{user_pkg}.broken:make")


def test_module_entry_without_device_parameter_trains(user_pkg):
    wl = build_user_workload({"name": "python", "entry": f"{user_pkg}.mod:tuple_no_device"}, 5, "cpu")
    assert isinstance(wl, Workload) and wl.samples_per_step == 5
    before = wl.model.weight.detach().clone()
    timings = wl.run_steps(3)   # the one-batch list is iterated again for each step
    assert len(timings.step_s) == 3
    assert not torch.equal(before, wl.model.weight)


def test_device_is_passed_when_the_function_takes_it(user_pkg):
    import importlib

    build_user_workload({"name": "python", "entry": f"{user_pkg}.mod:with_device"}, 2, "cpu")
    assert importlib.import_module(f"{user_pkg}.mod").SEEN["device"] == torch.device("cpu")


@pytest.mark.parametrize("fn, fragment", [("no_optimizer", "lacks optimizer"),
                                          ("wrong_model", "not a torch.nn.Module")])
def test_return_values_off_protocol_are_config_errors(user_pkg, fn, fragment):
    with pytest.raises(ConfigError, match=fragment):
        build_user_workload({"name": "python", "entry": f"{user_pkg}.mod:{fn}"}, 2, "cpu")


def test_empty_batches_are_a_config_error_at_the_first_step(user_pkg):
    wl = build_user_workload({"name": "python", "entry": f"{user_pkg}.mod:empty"}, 2, "cpu")
    with pytest.raises(ConfigError, match="batches is empty"):
        wl.run_steps(1)


def test_example_file_entry_runs_in_the_trial_path_under_the_virtual_gpu():
    from oomtune.alloc.sim import CachingAllocatorSim
    from oomtune.capture.virtual_gpu import VirtualGPU

    workload = WorkloadSpec.from_dict({"name": "mlp", "target": {"name": "python", "entry": EXAMPLE_ENTRY}})
    wl = build_trial_workload(workload, 4, torch.device("cpu"))
    assert isinstance(wl, UserWorkload)
    sim = CachingAllocatorSim(None, total_memory_bytes=1 << 30)
    with VirtualGPU(sim, device="cpu") as vgpu:
        vgpu.register(wl.tensors_before_step())
        timings = wl.run_steps(2)
    assert timings.samples_per_s > 0
    # Linear(64, 128) + Linear(128, 10): 32768 + 512 + 5120 + 40->512 B stay allocated (params).
    assert sim.memory_stats()["allocated_bytes.all.peak"] >= 32768 + 512 + 5120 + 512
    # A 1 MiB device cannot hold the first 2 MiB small-pool segment: OOM at registration.
    wl = build_trial_workload(workload, 4, "cpu")
    with pytest.raises(torch.OutOfMemoryError):
        with VirtualGPU(CachingAllocatorSim(None, total_memory_bytes=MIB), device="cpu") as vgpu:
            vgpu.register(wl.tensors_before_step())


def test_build_trial_workload_dispatches_on_the_target():
    mlp = {"name": "mlp", "in_features": 8, "hidden": 8, "layers": 1, "num_classes": 2}
    wl = build_trial_workload(WorkloadSpec.from_dict(mlp), 2, "cpu")   # no target group: builtin
    assert type(wl) is Workload
    with pytest.raises(ConfigError, match="target=cmd"):
        build_trial_workload(WorkloadSpec(target={"name": "cmd", "command": "x"}), 2, "cpu")
    with pytest.raises(ConfigError, match="choose one of"):
        validate_target({"name": "shell"})


# ----------------------------------------------------------------------------- real image data
def test_image_folder_feeds_the_builtin_resnet(tmp_path):
    from PIL import Image

    for cls, colour in (("cats", (200, 30, 30)), ("dogs", (30, 30, 200))):
        (tmp_path / cls).mkdir()
        for i in range(4):
            Image.new("RGB", (40 + 4 * i, 30), colour).save(tmp_path / cls / f"{i}.png")
    cfg = {"name": "resnet", "depth": 18, "image_size": 32, "num_classes": 2,
           "data": {"source": "imagefolder", "path": str(tmp_path), "num_workers": 0}}
    wl = build_workload(cfg, 4, "cpu")
    x, y = next(wl.batches())
    assert x.shape == (4, 3, 32, 32) and x.dtype == torch.float32   # Resize + CenterCrop to 32
    assert set(y.tolist()) <= {0, 1}                                  # ImageFolder: sorted class dirs
    timings = wl.run_steps(1)
    assert timings.data_wait_fraction is not None and 0.0 <= timings.data_wait_fraction <= 1.0


# ----------------------------------------------------------------------------- resolve_target and
# validate_target for cmd: paths that survive the trial's own working directory, placeholders, programs
def test_resolve_target_makes_a_relative_file_entry_absolute_from_cwd(tmp_path):
    from oomtune.targets import resolve_target

    got = resolve_target({"name": "python", "entry": "examples/my_workload.py:make_workload"}, cwd=tmp_path)
    assert got == {"name": "python", "entry": f"{tmp_path / 'examples' / 'my_workload.py'}:make_workload"}
    # module entries name no file; absolute files stay as they are
    assert resolve_target({"name": "python", "entry": "pkg.mod:make"}, cwd=tmp_path)["entry"] == "pkg.mod:make"
    assert resolve_target({"name": "python", "entry": EXAMPLE_ENTRY}, cwd=tmp_path)["entry"] == EXAMPLE_ENTRY


def test_resolve_target_defaults_to_the_current_directory_and_leaves_the_input_alone(tmp_path, monkeypatch):
    from oomtune.targets import resolve_target

    monkeypatch.chdir(tmp_path)
    given = {"name": "cmd", "command": "python train.py {batch_size}", "cwd": None}
    assert resolve_target(given) == {"name": "cmd", "command": "python train.py {batch_size}", "cwd": str(tmp_path)}
    assert given["cwd"] is None
    assert resolve_target({"name": "cmd", "command": "x", "cwd": "sub"})["cwd"] == str(tmp_path / "sub")
    assert resolve_target({"name": "cmd", "command": "x", "cwd": "/abs"}, cwd=tmp_path)["cwd"] == "/abs"
    assert resolve_target({"name": "builtin"}) == {"name": "builtin"}


def test_resolved_file_entry_still_loads_from_another_working_directory(tmp_path, monkeypatch):
    """The tester's bug: the entry was checked from the project directory, the trial ran in its own."""
    from oomtune.targets import resolve_target

    monkeypatch.chdir(REPO)
    relative = {"name": "python", "entry": "examples/my_workload.py:make_workload"}
    validate_target(relative)
    resolved = resolve_target(relative)
    trial_dir = tmp_path / "trials" / "0"
    trial_dir.mkdir(parents=True)
    monkeypatch.chdir(trial_dir)
    with pytest.raises(ConfigError, match="not found"):
        build_trial_workload(WorkloadSpec(target=relative), 2, "cpu")
    assert isinstance(build_trial_workload(WorkloadSpec(target=resolved), 2, "cpu"), UserWorkload)


def test_resolved_entry_runs_in_a_real_trial_process(tmp_path, monkeypatch):
    from oomtune.targets import resolve_target
    from oomtune.trial.runner import TrialRunner

    monkeypatch.chdir(REPO)
    target = resolve_target({"name": "python", "entry": "examples/my_workload.py:make_workload"})
    spec = TrialSpec(workload={"name": "mlp", "target": target}, batch_size=4, device="cpu",
                     budget_bytes=1 << 30, warmup_steps=1, measure_steps=1, timeout_s=120)
    with TrialRunner() as runner:
        res = runner.run(spec, workdir=tmp_path / "trial")   # the child's cwd is tmp_path/trial
    assert res.outcome is Outcome.OK, res.message


def test_cmd_with_a_relative_script_runs_from_the_resolved_cwd(tmp_path, monkeypatch):
    from oomtune.targets import resolve_target

    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text("import oomtune\noomtune.report(samples=8, seconds=2.0)\n")
    monkeypatch.chdir(project)
    target = resolve_target({"name": "cmd", "command": f"{PY} train.py {{batch_size}}", "cwd": None})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    spec = TrialSpec(workload={"name": "mlp", "target": target}, batch_size=2, timeout_s=60)
    res = run_cmd_trial(spec, workdir=tmp_path / "t")
    assert (res.outcome, res.throughput.samples_per_s) == (Outcome.OK, 4.0), res.message


def test_resolve_workload_also_resolves_the_data_path(tmp_path):
    from oomtune.targets import resolve_workload

    got = resolve_workload({"name": "transformer", "data": {"source": "tokens", "path": "data/train.bin"},
                            "target": {"name": "builtin"}}, cwd=tmp_path)
    assert got["data"] == {"source": "tokens", "path": str(tmp_path / "data" / "train.bin")}


def test_missing_program_is_named_before_anything_runs(tmp_path):
    with pytest.raises(ConfigError) as info:
        validate_target({"name": "cmd", "command": "nonexistent_cmd_xyz --bs {batch_size}", "cwd": None})
    assert str(info.value) == "target.command: program 'nonexistent_cmd_xyz' not found"
    with pytest.raises(ConfigError, match="program 'nonexistent_cmd_xyz' not found"):
        validate_target({"name": "cmd", "command": ["nonexistent_cmd_xyz", "{batch_size}"]})


def test_program_given_as_a_path_is_looked_up_in_the_target_cwd(tmp_path):
    script = tmp_path / "run.sh"
    script.write_text("#!/bin/sh\nexit 0\n")
    target = {"name": "cmd", "command": "./run.sh {batch_size}", "cwd": str(tmp_path)}
    with pytest.raises(ConfigError, match="program './run.sh' is not executable"):
        validate_target(target)
    script.chmod(0o755)
    validate_target(target)
    with pytest.raises(ConfigError, match="program './other.sh' not found"):
        validate_target({**target, "command": "./other.sh"})


def test_shell_commands_are_not_checked_for_a_program():
    # the first word of a shell command may be a builtin (cd, export): /bin/sh decides at run time
    validate_target({"name": "cmd", "command": f"cd / && {PY} -c pass {{batch_size}}"})


@pytest.mark.parametrize("command, placeholder", [
    ("python train.py --bs {bs}", "{bs}"),
    ("python train.py --bs {batchsize}", "{batchsize}"),
    ("python train.py --bs {batch_size} --lr {lr}", "{lr}"),
])
def test_unknown_placeholders_are_config_errors_naming_them(command, placeholder):
    with pytest.raises(ConfigError) as info:
        validate_target({"name": "cmd", "command": command})
    message = str(info.value)
    assert message.startswith("target.command: unknown placeholder ") and repr(placeholder) in message
    assert "\n" not in message


def test_escaped_braces_and_non_placeholder_braces_are_literal():
    argv, _ = build_command({"command": "python t.py {batch_size} {{batch_size}} {{lr}}"}, 8)
    assert argv == ["python", "t.py", "8", "{batch_size}", "{lr}"]
    nested = """python t.py --cfg '{"a": {"b": 1}}' --bs {batch_size}"""
    assert build_command({"command": nested}, 4)[0][-3:] == ['{"a": {"b": 1}}', "--bs", "4"]
    argv, shell = build_command({"command": "echo ${HOME} {batch_size}"}, 2)
    assert shell and argv[-1] == "echo ${HOME} 2"
