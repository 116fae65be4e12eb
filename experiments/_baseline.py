"""Helpers for the speed benchmarks: an old checkout to compare against, and the results header.

Every speed figure is reported next to the same measurement of the code before the change, taken in
the same run (old and new alternate), so that load from other processes on a shared machine cancels
in the ratio. The old code is extracted with ``git archive REF`` into a temporary directory (no
worktree is registered) and run with ``PYTHONPATH`` pointing there.
"""

from __future__ import annotations

import os
import subprocess
import tarfile
import tempfile
from pathlib import Path

from _provenance import header as provenance_header  # experiments/ is on sys.path (this module is there)

ROOT = Path(__file__).resolve().parents[1]
#: the real GPU traces, copied from ../shared/traces (a clone has them; ../shared is not beside every checkout)
TRACES = ROOT / "tests" / "data"
#: main just before the speed changes (startup, replay, plan): the code they were measured against.
DEFAULT_OLD = "48cfeb3"


#: ``oomtune plan`` in a child process with the time inside ``plan()`` and its map as JSON on the last
#: stdout line (the tree under test is first on sys.path; old trees lack some fields: read with
#: getattr). Arguments: derive (1/0), the overrides as JSON, one process (1/0: one capture worker).
TIMED_PLAN = r"""
import contextlib, io, json, sys, tempfile, time
from pathlib import Path
derive, one_process = sys.argv[1] == "1", len(sys.argv) > 3 and sys.argv[3] == "1"
overrides = json.loads(sys.argv[2])
import oomtune.cli
import oomtune.commands.plan as C
import oomtune.plan.predictor as P
if not derive and "derive" in (P.Predictor.__init__.__kwdefaults__ or {}):
    P.Predictor.__init__.__kwdefaults__["derive"] = False
if one_process:
    import oomtune.plan.parallel as W
    W.default_workers = lambda: 1
inner, out = {}, io.StringIO()
plan = C.plan
def timed_plan(*args, **kwargs):   # the time inside plan() and its map, as the command runs it
    t0 = time.perf_counter()
    inner["fmap"] = plan(*args, **kwargs)
    inner["plan_s"] = time.perf_counter() - t0
    return inner["fmap"]
C.plan = timed_plan
with tempfile.TemporaryDirectory() as tmp:
    with contextlib.redirect_stdout(out):
        rc = oomtune.cli.main(["plan", *overrides, f"hydra.run.dir={tmp}/run", "--out", f"{tmp}/plan.yaml"])
    assert rc == 0, out.getvalue()
fmap = inner["fmap"]
try:
    from oomtune.alloc import _compiled
    core = "compiled" if _compiled.enabled() else "pure Python"
except ImportError:
    core = "pure Python"
print(json.dumps({"core": core, "plan_s": inner["plan_s"], "capture_s": fmap.capture_s, "replay_s": fmap.replay_s,
                  "derive_s": getattr(fmap, "derive_s", 0.0), "captures": fmap.captures,
                  "derived": getattr(fmap, "derived", 0), "cached": getattr(fmap, "cached", 0), "replays": fmap.replays,
                  "soak_s": (getattr(fmap, "shapes", None) or {}).get("soak_s", 0.0),
                  "configurations": fmap.to_dict()["configurations"], "table": out.getvalue()}))
"""


def trace_files(directory: Path, script: str) -> list[Path]:
    """The ``*.pickle`` traces in ``directory``, sorted by name; stops with one line when there are none."""
    found = sorted(Path(directory).glob("*.pickle"))
    if not found:
        raise SystemExit(f"{script}: no *.pickle traces in {directory}: pass --traces DIR")
    return found


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()


def old_tree(ref: str) -> Path:
    """The repository at ``ref``, extracted once into $TMPDIR/oomtune-old-<sha>; returns its root."""
    sha = git("rev-parse", "--short", f"{ref}^{{commit}}")
    dest = Path(tempfile.gettempdir()) / f"oomtune-old-{sha}"
    if not (dest / "oomtune" / "__init__.py").is_file():
        tmp = Path(tempfile.mkdtemp(prefix=f"oomtune-old-{sha}-"))
        archive = subprocess.run(["git", "archive", "--format=tar", sha], cwd=ROOT, check=True,
                                 capture_output=True).stdout
        tar_path = tmp / "src.tar"
        tar_path.write_bytes(archive)
        with tarfile.open(tar_path) as tar:
            tar.extractall(tmp / "tree")
        tar_path.unlink()
        if not dest.exists():
            (tmp / "tree").rename(dest)
    return dest


def child_env(tree: Path) -> dict[str, str]:
    """Environment that runs ``tree``'s oomtune (bytecode caches allowed, one thread for BLAS)."""
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # a user's install has .pyc files; measure that case
    return env


def header(script: str, argv: list[str], old_ref: str) -> list[str]:
    """First lines of a results file: experiments/_provenance.py's five (command, commit, date,
    machine, load; it refuses a tree with uncommitted changes), then the old code compared with.
    Call it when the run starts."""
    lines = provenance_header(argv=[str(ROOT / "experiments" / script), *argv]).splitlines()
    return [*lines, f"# compared with: old = {old_ref} ({git('rev-parse', '--short', f'{old_ref}^{{commit}}')})"]
