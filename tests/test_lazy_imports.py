"""Commands that do not run a model start without importing torch.

Each check runs in a fresh interpreter (a subprocess), because other tests in this session import
torch, and reads ``sys.modules`` after the command finished. The speed these imports cost is
measured by experiments/bench_startup.py, not here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "tests" / "data" / "cnn-small-default.pickle"
HEAVY = ("torch", "hydra", "omegaconf")


def _modules_after(code: str) -> dict:
    """Run ``code`` in a fresh interpreter; return {"out": its stdout, "loaded": heavy modules}."""
    probe = (f"import sys, json, io, contextlib\nbuf = io.StringIO()\n"
             f"with contextlib.redirect_stdout(buf):\n"
             + "".join(f"    {line}\n" for line in code.strip().splitlines())
             + f"print(json.dumps({{'out': buf.getvalue(), "
             f"'loaded': sorted(m for m in {HEAVY!r} if m in sys.modules)}}))\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env,
                          timeout=300, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _best_yaml(tmp_path: Path) -> Path:
    path = tmp_path / "best.yaml"
    path.write_text("schema_version: 1\nworkload: {model: {name: mlp}}\ndevice: {kind: cpu}\n"
                    "best: {batch_size: 32, alloc_conf: 'expandable_segments:True,max_split_size_mb:256'}\n"
                    "study: {storage: 'sqlite:///%s', study_name: s}\n" % (tmp_path / "s.db"))
    return path


def test_help_imports_no_torch():
    r = _modules_after("from oomtune.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass")
    assert "simulate" in r["out"] and "plan" in r["out"]
    assert r["loaded"] == []


def test_simulate_imports_no_torch():
    r = _modules_after(f"from oomtune.cli import main\nmain(['simulate', {str(TRACE)!r}, '--json'])")
    assert json.loads(r["out"])["events_replayed"] > 0
    assert r["loaded"] == []


def test_simulate_with_an_oom_imports_no_torch():
    # A budget below the trace's starting state: the simulated OOM is raised and caught torch-free.
    r = _modules_after(f"from oomtune.cli import main\nmain(['simulate', {str(TRACE)!r}, '--json', "
                       f"'--budget', '1MiB'])")
    assert json.loads(r["out"])["simulated_oom"] is True
    assert r["loaded"] == []


def test_env_and_load_best_import_no_torch(tmp_path):
    best = _best_yaml(tmp_path)
    r = _modules_after(f"from oomtune.cli import main\nmain(['env', {str(best)!r}, '--batch-size'])")
    assert r["out"].splitlines() == [
        "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True,max_split_size_mb:256 "
        "PYTORCH_ALLOC_CONF=expandable_segments:True,max_split_size_mb:256",
        "export OOMTUNE_BATCH_SIZE=32"]
    assert r["loaded"] == []
    r = _modules_after(f"import oomtune\nprint(oomtune.load_best({str(best)!r}).batch_size)")
    assert r["out"].strip() == "32" and r["loaded"] == []
    # without a best.yaml: the installation, the replay core in use; torch's version from its metadata
    r = _modules_after("from oomtune.cli import main\nmain(['env'])")
    assert "replay core: " in r["out"] and "torch: " in r["out"] and "(not imported)" in r["out"]
    assert r["loaded"] == []


def test_show_imports_no_torch(tmp_path):
    pytest.importorskip("optuna")
    from oomtune.study.records import ATTR_ROLE  # a trial still running, as `show` lists it
    best = _best_yaml(tmp_path)
    setup = (f"import optuna\noptuna.logging.set_verbosity(optuna.logging.WARNING)\n"
             f"st = optuna.create_study(study_name='s', storage='sqlite:///{tmp_path / 's.db'}')\n"
             f"t = st.ask()\nt.suggest_int('batch_size', 8, 8)\nt.set_user_attr({ATTR_ROLE!r}, 'baseline')")
    subprocess.run([sys.executable, "-c", setup], check=True, timeout=300)
    r = _modules_after(f"from oomtune.cli import main\nmain(['show', {str(best)!r}, '--json'])")
    rows = json.loads(r["out"])
    assert [(row["batch_size"], row["role"], row["outcome"]) for row in rows] == [(8, "baseline", "running")]
    assert r["loaded"] == []


@pytest.mark.parametrize("cuda_line, cuda", [("cuda: Optional[str] = '12.4'", "12.4"),
                                              ("cuda: Optional[str] = None", None)])
def test_torch_build_reads_the_installed_version_file_and_never_runs_torchs_init(tmp_path, cuda_line, cuda):
    """torch's build (``__version__`` and ``torch.version.cuda``, as best.yaml records them) from the
    installed ``torch/version.py``, the file torch's build writes (the shape of torch 2.14.1's, a CUDA
    and a CPU build): a package whose ``__init__`` raises stands in for torch, so reading it must not
    import it."""
    fake = tmp_path / "site" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise RuntimeError('torch imported')\n")
    (fake / "version.py").write_text("from typing import Optional\n\n__all__ = ['__version__', 'cuda']\n"
                                     f"__version__ = '9.9.9+x'\ndebug = False\n{cuda_line}\n"
                                     "git_version = 'abc'\nhip: Optional[str] = None\n")
    code = (f"import sys\nsys.path.insert(0, {str(fake.parent)!r})\n"
            "import json\nfrom oomtune.packages import torch_build\nprint(json.dumps(list(torch_build())))")
    r = _modules_after(code)
    assert json.loads(r["out"]) == ["9.9.9+x", cuda] and r["loaded"] == []


def test_a_search_of_a_script_writes_its_answer_without_importing_torch(tmp_path):
    """A ``target=cmd`` search's own process needs no torch: the trials are the script's processes and
    best.yaml's torch and CUDA versions are read from the installed files (here a script that reports
    its figures by hand, importing nothing of torch)."""
    script = tmp_path / "train.py"
    script.write_text("import json, os, sys, time\nb = int(sys.argv[1])\n"
                      "stats = {'reserved_bytes.all.peak': b << 20, 'allocated_bytes.all.peak': b << 20}\n"
                      "line = {'event': 'report', 'time': time.time(), 'samples': b * 4, 'seconds': 0.5,\n"
                      "        'memory': {'source': 'simulated', 'stats': stats}}\n"
                      "open(os.environ['OOMTUNE_RESULT_FILE'], 'a').write(json.dumps(line) + '\\n')\n")
    run = tmp_path / "run"
    args = ["search", "target=cmd", "trial.launcher=spawn", "device=cpu", "budget=256MiB",
            "search.objective=throughput", "search.n_trials=1", "search.baseline=false", "search.confirm=false",
            "search.prune=off", "trial.soak_steps=0", f"target.command='{sys.executable} {script} {{batch_size}}'",
            f"hydra.run.dir={run}"]
    r = _modules_after(f"from oomtune.cli import main\nassert main({args!r}) == 0")
    assert "torch" not in r["loaded"]
    import oomtune
    import torch   # this test process's own (other tests import it): the versions best.yaml must carry

    versions = oomtune.load_best(run / "best.yaml").versions
    assert (versions["torch"], versions["cuda"]) == (str(torch.__version__), torch.version.cuda)


def test_settings_validation_imports_no_torch():
    r = _modules_after("from oomtune.alloc import validate_alloc_conf, AllocatorSettings, supported_keys\n"
                       "s = validate_alloc_conf('max_split_size_mb:256,expandable_segments:True')\n"
                       "print(s.max_split_size_bytes, 'expandable_segments' in supported_keys())\n"
                       "try:\n    AllocatorSettings.parse('max_split_size_mb:10')\n"
                       "except Exception as e:\n    print(type(e).__name__)")
    assert r["out"].split() == [str(256 << 20), "True", "AllocatorConfigError"]
    assert r["loaded"] == []


def test_simulator_oom_is_torch_oom_once_torch_is_imported():
    # The same simulator raises a torch.OutOfMemoryError when torch is in the process.
    r = _modules_after("from oomtune.alloc.sim import CachingAllocatorSim\n"
                       "from oomtune.alloc.oom_message import SimulatedOutOfMemoryError\n"
                       "def oom():\n"
                       "    try:\n        CachingAllocatorSim(total_memory_bytes=1 << 20).malloc(4 << 20)\n"
                       "    except SimulatedOutOfMemoryError as e:\n        return e\n"
                       "e = oom()\nprint(isinstance(e, RuntimeError))\nimport torch\n"
                       "print(isinstance(e, torch.OutOfMemoryError), isinstance(oom(), torch.OutOfMemoryError))")
    assert r["out"].split() == ["True", "False", "True"]
    assert r["loaded"] == ["torch"]


@pytest.mark.parametrize("command", ["search", "plan"])
@pytest.mark.parametrize("override, says", [
    ("budget=abc", "invalid size 'abc'"),
    ("budget=2.5", "is ambiguous"),                 # neither a fraction in (0, 1] nor a byte count
    ("device=tpu", "invalid device 'tpu'"),
    ("virtual_device_memory=0GiB", "must be > 0"),
])
def test_bad_budget_or_device_exits_2_before_torch(command, override, says):
    # The fresh-user pass: `oomtune search budget=abc` imported torch (seconds) before its one-line
    # error. Syntax is checked first now: exit 2, one line, torch never imported (no trial, no study).
    code = ("import sys\nfrom oomtune.cli import main\n"
            f"print('rc', main([{command!r}, {override!r}]))\n"
            "print('torch' in sys.modules)")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=300, cwd=str(ROOT))
    assert proc.stdout.split() == ["rc", "2", "False"], proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("oomtune: error: ") and says in proc.stderr
