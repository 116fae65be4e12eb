"""The user's code as the study name and the stream cache see it (oomtune.sources), without running it.

The field case: ``N_LAYER=2 SEQ_LEN=128 oomtune plan ...`` then ``N_LAYER=1 SEQ_LEN=32 oomtune search
...`` with the same arguments: the study name ignored the environment the script reads, so the
second search would resume the first's trials. What must hold: a changed environment variable that
the entry (or a command's script, or a module either imports) names, a changed file, starts another
study; the same environment and files name the same study.
"""

from __future__ import annotations

import ast
import hashlib
from pathlib import Path

from oomtune import config as C
from oomtune.sources import environ_names, fingerprint

SCRIPT = '''import os
from os import environ, getenv
import helper_env

N_LAYER = int(os.environ["N_LAYER"])
SEQ = int(os.environ.get("SEQ_LEN", "128"))
width = getenv("WIDTH")
if "USE_BIAS" in os.environ:
    pass
debug = environ.setdefault("DEBUG_X", "0")
dynamic = os.environ[f"X_{N_LAYER}"]        # computed: not seen
other = {"NOT_ENV": 1}["NOT_ENV"]           # a dict, not os.environ
'''


def test_environment_variables_named_literally_are_found():
    assert environ_names(ast.parse(SCRIPT)) == ["DEBUG_X", "N_LAYER", "SEQ_LEN", "USE_BIAS", "WIDTH"]


def test_a_fingerprint_covers_local_imports_their_variables_and_packages(tmp_path, monkeypatch):
    (tmp_path / "train.py").write_text(SCRIPT)
    (tmp_path / "helper_env.py").write_text("import os\nimport yaml\nHIDDEN = os.getenv('HIDDEN')\n")
    monkeypatch.setenv("N_LAYER", "2")
    monkeypatch.delenv("SEQ_LEN", raising=False)
    for name in ("WIDTH", "USE_BIAS", "DEBUG_X", "HIDDEN"):
        monkeypatch.delenv(name, raising=False)
    got = fingerprint(tmp_path / "train.py", environ=True)
    assert got["files"] == {str((tmp_path / p).resolve()): hashlib.sha256((tmp_path / p).read_bytes()).hexdigest()
                            for p in ("helper_env.py", "train.py")}
    assert got["environ"] == {"DEBUG_X": None, "HIDDEN": None, "N_LAYER": "2", "SEQ_LEN": None, "USE_BIAS": None,
                              "WIDTH": None}
    assert got["packages"]["yaml"].startswith("PyYAML==")   # os is the standard library: not listed
    assert set(got["packages"]) == {"yaml"}
    assert "environ" not in fingerprint(tmp_path / "train.py")   # the stream cache's form: files and packages
    assert fingerprint(tmp_path / "absent.py") is None


def _python_name(tmp_path: Path, *extra: str) -> str:
    return C.default_study_name(C.compose(["target=python", f"target.entry={tmp_path / 'wl.py'}:make_workload",
                                           *extra]))


def test_a_python_entrys_study_name_follows_its_environment_and_its_code(tmp_path, monkeypatch):
    (tmp_path / "wl.py").write_text("import os\nN_LAYER = int(os.environ.get('N_LAYER', '1'))\n"
                                    "def make_workload(batch_size, device):\n    pass\n")
    monkeypatch.setenv("N_LAYER", "2")
    first = _python_name(tmp_path)
    assert first.startswith("python-") and _python_name(tmp_path) == first   # same command: same study
    monkeypatch.setenv("N_LAYER", "1")
    assert _python_name(tmp_path) != first
    monkeypatch.setenv("N_LAYER", "2")
    assert _python_name(tmp_path) == first
    monkeypatch.setenv("SOME_OTHER_VARIABLE", "x")   # not named by the code: the same study
    assert _python_name(tmp_path) == first
    (tmp_path / "wl.py").write_text((tmp_path / "wl.py").read_text() + "# edited\n")
    assert _python_name(tmp_path) != first


def test_a_commands_study_name_follows_the_variables_its_script_reads(tmp_path, monkeypatch):
    (tmp_path / "train.py").write_text("import os\nSEQ = int(os.environ['SEQ_LEN'])\n"
                                       "B = int(os.environ['OOMTUNE_BATCH_SIZE'])\n")

    def name() -> str:
        return C.default_study_name(C.compose(["target=cmd", "target.command='python train.py'",
                                               f"target.cwd={tmp_path}"]))

    monkeypatch.setenv("SEQ_LEN", "128")
    monkeypatch.delenv("OOMTUNE_BATCH_SIZE", raising=False)
    first = name()
    assert first.startswith("cmd-") and name() == first
    monkeypatch.setenv("SEQ_LEN", "32")
    assert name() != first


def test_a_command_without_a_script_file_has_no_sources(tmp_path):
    import sys

    from oomtune.targets import get_target

    cmd = get_target("cmd")
    (tmp_path / "train.py").write_text("print(1)\n")
    assert cmd.sources({"name": "cmd", "command": "python train.py --batch-size {batch_size}",
                        "cwd": str(tmp_path)}) == [tmp_path / "train.py"]
    # an interpreter named by its path running a module: the interpreter binary is not the user's code
    assert cmd.sources({"name": "cmd", "command": f"{sys.executable} -m mypkg.train", "cwd": str(tmp_path)}) == []
    assert cmd.sources({"name": "cmd", "command": "python absent.py", "cwd": str(tmp_path)}) == []


def test_a_module_entry_is_found_without_running_its_packages_init(tmp_path, monkeypatch):
    """``target.entry=pkg.mod:fn``: the file is located level by level; importlib.util.find_spec
    would import ``pkg`` and run its ``__init__`` (user code) in the search process."""
    import sys

    from oomtune.targets import get_target

    pkg = tmp_path / "userpkg_src" / "userpkg"
    (pkg / "sub").mkdir(parents=True)
    marker = tmp_path / "init_ran"
    (pkg / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    (pkg / "sub" / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    (pkg / "sub" / "train.py").write_text("def make_workload(batch_size, device):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path / "userpkg_src"))
    python = get_target("python")
    assert python.sources({"name": "python", "entry": "userpkg.sub.train:make_workload"}) == \
        [pkg / "sub" / "train.py"]
    assert not marker.exists() and "userpkg" not in sys.modules
    assert python.sources({"name": "python", "entry": "userpkg.absent:make_workload"}) == []
    assert python.sources({"name": "python", "entry": "no_such_top_pkg.train:make_workload"}) == []
