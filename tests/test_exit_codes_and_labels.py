"""Labels and exit codes: a deduplicated probe is a duplicate of the trial that
ran it, with its batch, never "interrupted" with batch None; SIGTERM exits 143 and Ctrl-C 130
(128 + the signal number, as a shell reports a process killed by that signal)."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import optuna
import pytest
from rich.console import Console

from oomtune.cli import main
from oomtune.display import trial_rows, trial_table
from oomtune.exceptions import Interrupted
from oomtune.search.claims import ATTR_DUPLICATE_OF
from oomtune.trial.runner import _pid_running

ROOT = Path(__file__).resolve().parents[1]


def _study_with_a_duplicate() -> optuna.Study:
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    study = optuna.create_study(direction="maximize")
    dist = {"batch_size": optuna.distributions.IntDistribution(1, 512)}
    study.add_trial(optuna.trial.create_trial(
        value=10.0, params={"batch_size": 352}, distributions=dist,
        user_attrs={"role": "frontier", "outcome": "ok", "alloc_conf": "",
                    "result": {"outcome": "ok", "batch_size": 352, "throughput": {"samples_per_s": 10.0}}}))
    # the same probe enqueued again (another worker or process), then claimed: the worker finds
    # trial 0 already ran it and finishes it as FAIL without launching (search.workers)
    study.enqueue_trial({"batch_size": 352}, user_attrs={"role": "frontier", "alloc_conf": ""})
    trial = study.ask()
    trial.set_user_attr(ATTR_DUPLICATE_OF, 0)
    study.tell(trial, state=optuna.trial.TrialState.FAIL)
    return study


def test_a_deduplicated_probe_is_a_duplicate_with_its_batch():
    rows = trial_rows(_study_with_a_duplicate().trials)
    dup = rows[1]
    assert dup["outcome"] == "duplicate" and dup["outcome_label"] == "duplicate =#0"
    assert dup["batch_size"] == 352                 # the batch it was enqueued with, not None
    out = io.StringIO()
    Console(file=out, width=100).print(trial_table(rows))
    line = next(ln for ln in out.getvalue().splitlines() if ln.strip().startswith("1 "))
    assert "352" in line and "duplicate" in line and "interrupted" not in line and "None" not in line


def test_the_html_report_calls_it_a_duplicate_too():
    from oomtune.htmlreport._data import trial_records

    rec = trial_records(_study_with_a_duplicate().trials)[1]
    assert (rec["outcome"], rec["batch_size"], rec["reused_from"]) == ("duplicate", 352, 0)


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_the_cli_exits_128_plus_the_signal(monkeypatch, capsys, signum, code):
    import oomtune.search.entry as entry

    def stopped(*a, **k):
        raise Interrupted(signum)

    monkeypatch.setattr(entry, "search", stopped)
    assert main(["search", "model=mlp"]) == code
    err = capsys.readouterr().err.strip()
    assert err == ("oomtune: interrupted" if signum == signal.SIGINT else "oomtune: terminated (SIGTERM)")


@pytest.mark.slow
@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_search_stopped_by_a_signal_exits_128_plus_it_and_ends_its_trial(tmp_path, signum, code):
    script = tmp_path / "hang.py"
    script.write_text(textwrap.dedent("""
        import os, sys, time
        open(sys.argv[1] + ".tmp", "w").write(str(os.getpid()))
        os.replace(sys.argv[1] + ".tmp", sys.argv[1])
        time.sleep(300)
    """))
    pid_file = tmp_path / "pid"
    command = f"{sys.executable} {script} {pid_file} --bs {{batch_size}}"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OOMTUNE_CACHE_DIR="off")
    search = subprocess.Popen(
        [sys.executable, "-m", "oomtune", "search", "target=cmd", f"target.command='{command}'", "device=cpu",
         "budget=1GiB", "search.n_trials=1", "search.batch_size.low=1", "search.batch_size.high=2",
         f"hydra.run.dir={tmp_path / 'run'}", "study_name=stopped"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not pid_file.exists() and search.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pid_file.exists(), search.communicate()[1].decode(errors="replace")
        trial = int(pid_file.read_text())
        search.send_signal(signum)
        try:
            _, err = search.communicate(timeout=60)
        except subprocess.TimeoutExpired:   # say what the search was doing, not only that it did not stop
            search.kill()
            pytest.fail(f"the search did not stop within 60 s of signal {signum}; its stderr:\n"
                        + search.communicate()[1].decode(errors="replace")[-4000:])
        assert search.returncode == code, err.decode(errors="replace")
        assert "run the same command to resume" in err.decode(errors="replace")
        deadline = time.monotonic() + 60
        # a zombie (Z, or X while reaped) has ended, whoever is left to reap it (an orphan waits for its new
        # parent, which in a container need not be a reaping init): the runner's own liveness check
        while _pid_running(trial) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _pid_running(trial)
    finally:
        if search.poll() is None:
            search.kill()
