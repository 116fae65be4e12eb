"""target=cmd scripts forked from a warm interpreter (oomtune/trial/script_fork.py).

The expected behaviour of a forked script is CPython's own: each semantic check runs the same file
with ``python FILE ARGS`` (a fresh interpreter, the oracle) and compares. The measured memory of a
forked trial is compared with the same spec's spawned trial (the virtual GPU is deterministic).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from oomtune.trial.record import TrialSpec
from oomtune.trial.runner import TrialRunner
from oomtune.trial.script_fork import ScriptServers, preloads_of, script_of

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="script servers fork (Linux)")

REPO = Path(__file__).resolve().parents[1]


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


# -- which commands are forked -------------------------------------------------------------------------
def test_only_this_interpreter_running_a_py_file_is_a_script(tmp_path):
    script = _write(tmp_path / "train.py", "print('x')\n")
    env = dict(os.environ)
    assert script_of([sys.executable, "train.py", "--lr", "3"], cwd=str(tmp_path), env=env) == script
    assert script_of([sys.executable, str(script)], cwd="/", env=env) == script
    # -m: a module of the working directory (-m puts it first on sys.path), a module or a package's __main__
    _write(tmp_path / "pkg" / "__init__.py", "")
    main = _write(tmp_path / "pkg" / "__main__.py", "print('pkg')\n")
    assert script_of([sys.executable, "-m", "train", "--lr", "3"], cwd=str(tmp_path), env=env) == script
    assert script_of([sys.executable, "-m", "pkg"], cwd=str(tmp_path), env=env) == main
    for argv in ([sys.executable, "-u", "train.py"],            # interpreter flags change its behaviour
                 [sys.executable, "-m", "torch.distributed.run", "train.py"],   # installed: torchrun's launcher
                 [sys.executable, "-m", "missing"],
                 [sys.executable, "-m", "not a name"],
                 [sys.executable, "-m"],
                 [sys.executable, "missing.py"],                 # no such file
                 [sys.executable, "notes.txt"],                  # not a .py file
                 ["bash", "train.py"],                           # another program
                 [sys.executable]):
        assert script_of(argv, cwd=str(tmp_path), env=env) is None, argv


def test_another_environments_interpreter_is_not_forked_from_ours(tmp_path):
    # a virtual environment's bin/python is a symlink to the same binary, but its site-packages differ:
    # the same real file is not enough, the directory must be ours too
    script = _write(tmp_path / "train.py", "print('x')\n")
    venv_bin = tmp_path / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    for name in ("python", "python3"):
        (venv_bin / name).symlink_to(os.path.realpath(sys.executable))
    env = dict(os.environ, PATH=str(venv_bin))
    assert script_of(["python3", "train.py"], cwd=str(tmp_path), env=env) is None
    # ... while that environment's own python and python3 are one interpreter
    assert script_of(["python3", "train.py"], cwd=str(tmp_path), env=env, python=str(venv_bin / "python")) == script


def test_a_script_server_imports_torch_only_for_a_script_that_imports_a_package(tmp_path):
    """A script server imports torch and what a first optimizer imports (torch._dynamo) before the
    script's own module-level imports, when the script or a local module it imports imports any
    package outside the standard library and oomtune; a stand-in of the standard library and oomtune
    alone never imports torch, and its server does not either."""
    from oomtune.trial.script_fork import server_modules

    stdlib = _write(tmp_path / "sleep.py", "import os, sys, time\nimport oomtune\nfrom helper import X\n")
    _write(tmp_path / "helper.py", "import json\nX = 1\n")
    assert server_modules(stdlib, cwd=str(tmp_path)) == ()
    direct = _write(tmp_path / "train.py", "import torch\nfrom torch import nn\n")
    assert server_modules(direct, cwd=str(tmp_path)) == ("torch", "torch._dynamo", "torch:nn")
    # torch imported by a local module only (inside a function even): the server still imports it
    _write(tmp_path / "model.py", "def make():\n    import torch\n    return torch.nn.Linear(2, 2)\n")
    indirect = _write(tmp_path / "run.py", "import sys\nimport model\n")
    assert server_modules(indirect, cwd=str(tmp_path)) == ("torch", "torch._dynamo")
    assert server_modules(tmp_path / "missing.py", cwd=str(tmp_path)) == ("torch", "torch._dynamo")


def test_a_trial_with_another_backend_is_spawned_before_any_server_starts(tmp_path):
    # torch reads backend when it is imported, and every server imported torch with backend native
    script = _write(tmp_path / "train.py", "print('x')\n")
    servers = ScriptServers()
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="backend:cudaMallocAsync",
               PYTORCH_ALLOC_CONF="backend:cudaMallocAsync")
    handle, why = servers.launch([sys.executable, str(script)], cwd=str(tmp_path), env=env, workdir=tmp_path,
                                 grace_s=3.0, status_file="keeper.json")
    assert handle is None and why == "backend:cudaMallocAsync is read at import; the fork server runs backend native"
    assert servers._servers == {}


def test_preloads_are_the_scripts_module_level_third_party_imports(tmp_path):
    _write(tmp_path / "helper.py", "X = 1\n")   # the script's own module: never preloaded
    script = _write(tmp_path / "train.py", """\
        import json, os
        import torch
        from torch import nn
        import helper
        import oomtune
        from oomtune.integrations.lightning import OomtuneCallback
        try:
            import lightning.pytorch as pl
        except ImportError:
            pl = None

        def main():
            import transformers            # inside a function: depends on the run
        if __name__ == "__main__":
            from torch.utils import data   # inside an if: depends on the run
        """)
    assert preloads_of(script, cwd=str(tmp_path)) == ("torch", "torch:nn", "lightning.pytorch")
    assert preloads_of(_write(tmp_path / "bad.py", "import torch\ndef (:\n"), cwd=str(tmp_path)) == ()


# -- a forked script behaves as `python FILE ARGS` -----------------------------------------------------------
SEMANTICS = """\
    import atexit, os, sys, threading, time
    atexit.register(lambda: print("atexit", flush=True))
    printed = threading.Event()
    def late():
        printed.wait()                             # after the main thread's lines, however late they come
        time.sleep(0.3)                            # mostly still running when the main thread ends
        print("thread done", flush=True)
    threading.Thread(target=late).start()          # non-daemon: joined before atexit handlers run
    print("name", __name__, "file", os.path.basename(__file__))
    print("argv", sys.argv, "file", __file__, "path0", sys.path[0])
    print("env", os.environ.get("OOMTUNE_SCRIPT_FORK_VALUE"), "cwd", os.getcwd() == os.environ["EXPECT_CWD"])
    printed.set()
    mode = sys.argv[1]
    if mode == "raise":
        raise ValueError("boom")
    if mode == "text":
        sys.exit("stopped: text")
    sys.exit(int(mode))
    """


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One working directory, environment and script server for every forked script and module below.
    A script server is shared on its preloads, working directory and environment less the per-trial
    ``OOMTUNE_*`` variables (oomtune/trial/script_fork.py ``server_key``), as a study's trials share
    it; none of these files imports a third-party module (no preloads, and no torch: ``server_modules``),
    so one server forks them all. What differs per case, ``OOMTUNE_SCRIPT_FORK_VALUE``,
    is a per-trial variable: it reaches each script through its own launch, not the server's
    environment."""
    root = tmp_path_factory.mktemp("scripts")
    run_dir = root / "run"
    _write(root / "code" / "semantics.py", SEMANTICS)
    _write(run_dir / "trainpkg" / "__init__.py", "")
    _write(run_dir / "trainpkg" / "semantics.py", SEMANTICS)
    env = dict(os.environ, EXPECT_CWD=str(run_dir), PYTHONPATH=str(REPO))
    servers = ScriptServers()
    try:
        yield root, run_dir, env, servers
    finally:
        servers.close()


def _forked(servers: ScriptServers, argv: list[str], cwd: Path, env: dict[str, str], workdir: Path):
    workdir.mkdir(parents=True, exist_ok=True)
    handle, why = servers.launch(argv, cwd=str(cwd), env=env, workdir=workdir, grace_s=3.0,
                                 status_file="keeper.json")
    assert why is None, why
    code = handle.wait(120)
    return code, (workdir / "stdout.txt").read_text(), (workdir / "stderr.txt").read_text()


@pytest.mark.parametrize("mode, relative", [("0", False), ("3", True), ("raise", False), ("text", True)])
def test_a_forked_script_exits_prints_and_cleans_up_as_python_runs_it(mode, relative, tmp_path, shared):
    root, run_dir, env, servers = shared
    script = root / "code" / "semantics.py"
    env = dict(env, OOMTUNE_SCRIPT_FORK_VALUE="v-" + mode)
    # sys.argv[0] is the path as typed (relative to the working directory), __file__ and sys.path[0] absolute
    argv = [sys.executable, os.path.join("..", "code", "semantics.py") if relative else str(script), mode]
    fresh = subprocess.run(argv, cwd=run_dir, env=env, capture_output=True, text=True, timeout=120)
    code, out, err = _forked(servers, argv, run_dir, env, tmp_path / "trial")
    assert f"env v-{mode} cwd True" in fresh.stdout   # this case's value, in the directory it was run from
    assert (code, out) == (fresh.returncode, fresh.stdout)
    assert err == fresh.stderr   # the traceback starts at the script's frame, as python prints it
    assert fresh.stdout.splitlines()[-2:] == ["thread done", "atexit"]


@pytest.mark.parametrize("argv", [["-m", "trainpkg.semantics", "3"], ["-m", "trainpkg.semantics", "raise"],
                                  ["-m", "trainpkg.missing"]])
def test_a_forked_module_runs_as_python_dash_m_runs_it(argv, tmp_path, shared):
    # the module's tracebacks keep runpy's frames, as CPython's do; a missing module is one line, exit 1
    _, run_dir, env, servers = shared     # run_dir holds trainpkg
    env = dict(env, OOMTUNE_SCRIPT_FORK_VALUE="m")
    command = [sys.executable, *argv]
    fresh = subprocess.run(command, cwd=run_dir, env=env, capture_output=True, text=True, timeout=120)
    workdir = tmp_path / "trial"
    workdir.mkdir()
    handle, why = servers.launch(command, cwd=str(run_dir), env=env, workdir=workdir, grace_s=3.0,
                                 status_file="keeper.json")
    if argv[1] == "trainpkg.missing":   # nothing to fork: the interpreter itself says so
        assert handle is None and "python -m MODULE" in why
        assert fresh.returncode == 1 and "No module named trainpkg.missing" in fresh.stderr
        return
    got = (handle.wait(120), (workdir / "stdout.txt").read_text(), (workdir / "stderr.txt").read_text())
    assert got == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert "env m cwd True" in fresh.stdout
    assert fresh.stdout.startswith("name __main__ file semantics.py\nargv ['" + str(run_dir / "trainpkg"))


@pytest.mark.parametrize("name, text", [
    # a spawn-context pool: the child imports the main module again from __main__.__file__
    ("pool.py", """\
        import multiprocessing as mp
        def square(x):
            return x * x
        if __name__ == "__main__":
            with mp.get_context("spawn").Pool(1) as pool:
                print(pool.map(square, [2, 3]))
        """),
    ("syntax.py", "print('before')\ndef broken(:\n    pass\n"),   # never runs: the error and its line only
])
def test_a_forked_script_that_spawns_or_does_not_compile_does_what_python_does(name, text, tmp_path, shared):
    _, run_dir, env, servers = shared
    script = _write(run_dir / name, text)
    argv = [sys.executable, name]
    fresh = subprocess.run(argv, cwd=run_dir, env=env, capture_output=True, text=True, timeout=120)
    got = _forked(servers, argv, run_dir, env, tmp_path / "trial")
    assert got == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert fresh.returncode == (0 if name == "pool.py" else 1) and script.is_file()


def test_a_forked_training_script_finds_what_its_optimizer_imports_already_imported(tmp_path, shared):
    """torch's optimizers import torch._dynamo on their first call (add_param_group and zero_grad run
    under torch._disable_dynamo, torch/_compile.py; step under _use_grad_for_differentiable,
    torch/optim/optimizer.py): a script server imports it once, so a forked trial does not pay it,
    while a fresh ``python`` process does; the training step itself runs the same in both."""
    _, run_dir, env, servers = shared
    _write(run_dir / "optim_step.py", """\
        import sys
        before = "torch._dynamo" in sys.modules
        import torch
        model = torch.nn.Linear(4, 2)
        torch.nn.init.zeros_(model.weight)
        torch.nn.init.zeros_(model.bias)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        print("imported by the optimizer", "torch._dynamo" in sys.modules)
        model(torch.ones(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        print("dynamo before the script", before)
        print("bias after one step", [round(v, 4) for v in model.bias.tolist()])
        """)
    argv = [sys.executable, "optim_step.py"]
    fresh = subprocess.run(argv, cwd=run_dir, env=env, capture_output=True, text=True, timeout=120)
    code, out, err = _forked(servers, argv, run_dir, env, tmp_path / "trial")
    assert fresh.returncode == 0 and code == 0, (fresh.stderr, err)
    assert "imported by the optimizer True" in fresh.stdout   # torch's own behaviour, in a fresh process
    assert "dynamo before the script False" in fresh.stdout
    assert "dynamo before the script True" in out              # the server had imported it
    # the loss sums 3 rows of 2 outputs, so d(loss)/d(bias_j) = 3 and SGD (lr 0.5) moves each bias from 0
    # to 0 - 0.5 * 3 = -1.5, in both processes
    assert "bias after one step [-1.5, -1.5]" in fresh.stdout and "bias after one step [-1.5, -1.5]" in out


# -- through the cmd target ----------------------------------------------------------------------------
def _cmd_spec(batch: int) -> TrialSpec:
    command = f"{sys.executable} {REPO / 'examples' / 'train_cmd.py'} --batch-size {{batch_size}} --hidden 64"
    return TrialSpec(workload={"target": {"name": "cmd", "command": command, "cwd": str(REPO)}}, batch_size=batch,
                     device="cpu", budget_bytes=64 << 20, warmup_steps=1, measure_steps=2, timeout_s=240)


def test_a_forked_cmd_trial_measures_what_the_spawned_one_does_and_keeps_its_server(tmp_path):
    forked = TrialRunner()   # auto: python FILE.py commands are forked
    try:
        first = forked.run(_cmd_spec(64), workdir=tmp_path / "f1")
        second = forked.run(_cmd_spec(128), workdir=tmp_path / "f2")
        servers = list(forked._scripts._servers.values())
        # one server for both trials, alive after them: the sweep for a trial's leftovers (by its
        # environment marker) must not take the server for one of them
        assert len(servers) == 1 and servers[0].alive
    finally:
        forked.close()
    spawned = TrialRunner(launcher="spawn").run(_cmd_spec(128), workdir=tmp_path / "s")
    for res in (first, second, spawned):
        assert res.outcome == "ok", res.message
        assert not res.process.leftover_processes
    assert (first.process.launcher, second.process.launcher, spawned.process.launcher) == ("cmd-fork",) * 2 + ("cmd",)
    assert second.memory.peak_allocated_bytes == spawned.memory.peak_allocated_bytes
    assert second.memory.peak_reserved_bytes == spawned.memory.peak_reserved_bytes
    assert first.memory.peak_allocated_bytes < second.memory.peak_allocated_bytes   # the batch reached the script


def test_a_server_its_imports_make_unsafe_is_given_up_and_the_trial_spawned(tmp_path, monkeypatch):
    # a third-party module (in a site-packages directory) that starts a Python thread when imported:
    # forking then would copy one thread of two, so the server refuses and the trial is spawned
    site = tmp_path / "lib" / "site-packages"   # not below the script's directory (that is the script's own)
    _write(site / "threads_at_import.py", """\
        import threading, time
        threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
        """)
    script = _write(tmp_path / "proj" / "train.py", """\
        import threads_at_import
        print("ran")
        """)
    monkeypatch.syspath_prepend(str(site))
    assert preloads_of(script, cwd=str(script.parent)) == ("threads_at_import",)
    spec = TrialSpec(workload={"target": {"name": "cmd", "command": f"{sys.executable} {script}",
                                          "cwd": str(script.parent)}},
                     batch_size=1, device="cpu", timeout_s=120)
    runner = TrialRunner()
    try:
        res = runner.run(spec, workdir=tmp_path / "trial", env={"PYTHONPATH": f"{site}{os.pathsep}{REPO}"})
    finally:
        runner.close()
    assert res.process.launcher == "cmd"
    assert "fork-safe" in res.process.launcher_fallback
    assert (tmp_path / "trial" / "stdout.txt").read_text() == "ran\n"
