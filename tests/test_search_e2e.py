"""End to end on CPU: `oomtune search` on the built-in MLP with real training steps and the
virtual GPU is stopped by SIGTERM, resumed by the same command, and the resumed search's outputs are
read by show/env/load_best. One search serves both: a resumed search must give an answer as complete
as an uninterrupted one, and each search is a minute of a 2-core machine (an uninterrupted search
end to end is also run by tests/test_search_frontier.py and tests/test_report_e2e.py).

The search stopped by SIGTERM is a real process (its signal handling and exit status are under test);
the resume is the same command run in this process (``oomtune.cli.main``: what it reads is the storage
and the run directory, not the process). Both compute on one CPU thread (``OMP_NUM_THREADS=1``,
tests/shared_runs.py): the steps are timed only to have a throughput, which no assertion compares.
Both use one stream cache of their own (``OOMTUNE_CACHE_DIR`` in the test's directory, where the
session turns it off: tests/conftest.py), as a user's resume uses ~/.cache: the resume reads the
captures the stopped search made instead of capturing the workload again (seconds of CPU), and
nothing another test left is read."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from datetime import datetime, timedelta
from pathlib import Path

import optuna
import pytest

import oomtune
from oomtune.cli import main
from oomtune.study import records as R

sys.path.insert(0, str(Path(__file__).parent))
from shared_runs import one_cpu_thread  # noqa: E402

pytestmark = pytest.mark.slow

# The built-in MLP (conf/model/mlp.yaml): the resume is under test, not the model, and its meta captures
# and CPU steps cost a fraction of a ResNet's (no torchvision in any process). At 72 MiB its frontier lies
# inside 2..1024 (a few hundred samples), so the winner's peak against the limit is a real check.
TINY = ["model=mlp", "budget=72MiB", "device=cpu",
        "search.batch_size.low=2", "search.batch_size.high=1024", "trial.warmup_steps=1",
        "trial.measure_steps=1", "trial.confirm_steps=2", "trial.timeout=120",
        "search.objective=throughput",  # the sampler runs for the throughput objective only
        "trial.soak_steps=0"]   # no virtual-GPU soak after each trial's steps (tests/test_soak.py's subject)
N_TRIALS = 3   # sampler trials: the resumed study must hold this many, finished


def _assert_answer_is_its_own_trials(run_dir, capsys) -> None:
    """What a completed search must have written: a best.yaml whose answer is a trial that ran, its
    figures those of the winner's clean-process confirmation, and ``show``/``env`` reading them."""
    best = oomtune.load_best(run_dir / "best.yaml")
    info = json.loads((run_dir / "run.json").read_text())
    study = optuna.load_study(study_name=info["study_name"], storage=info["storage"])
    roles = [t.user_attrs.get(R.ATTR_ROLE) for t in study.trials]
    assert "baseline" in roles and "search" in roles and "confirm" in roles
    # The answer is a configuration that ran, and its numbers are that run's.
    winner = study.trials[best.best.trial_number]
    assert R.is_feasible_ok(winner) and winner.params["batch_size"] == best.batch_size
    confirm = [t for t in study.trials if t.user_attrs.get(R.ATTR_CONFIRMS) == winner.number][-1]
    measured = R.result_of(confirm)
    assert best.best.metrics_trial_number == confirm.number != winner.number   # the figures' own trial
    assert best.best.confirmed and best.best.metrics["throughput"] == measured.throughput.samples_per_s > 0
    assert best.best.metrics["peak_reserved_bytes"] == measured.memory.peak_reserved_bytes
    assert best.best.metrics["memory_source"] == "simulated" and best.device["memory_source"] == "simulated"
    # the kernels the captures and CPU trials ran: model.gpu=auto without a GPU is the default, said so
    assert best.device["target_gpu"] == {"name": "A100", "compute_capability": "8.0", "sm_count": 108,
                                         "key": "a100", "source": "default"}
    assert measured.execution.kernels.gpu.key == "a100"
    assert measured.memory.peak_reserved_bytes <= 0.95 * 72 * 2**20   # the limit: budget x (1 - headroom 5%)
    assert best.best.predicted_peak_reserved_bytes is not None
    assert best.study["outcomes"].get("ok", 0) >= 3
    capsys.readouterr()
    assert main(["show", str(run_dir)]) == 0
    shown = capsys.readouterr().out
    assert "baseline" in shown
    assert f"trial {winner.number}, figures from trial {confirm.number} (its clean-process confirmation)" in shown
    assert main(["env", str(run_dir / "best.yaml")]) == 0
    assert capsys.readouterr().out.startswith("export PYTORCH_CUDA_ALLOC_CONF=")


def _finished(storage: str, name: str) -> list:
    try:
        study = optuna.load_study(study_name=name, storage=storage)
    except KeyError:
        return []
    return study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))


def _running(proc: subprocess.Popen, err_path) -> bool:
    """True while ``proc`` runs; fails the test at once, with its stderr, if it has ended (a search
    that crashes must not look like a hang of the waiting loops below)."""
    if proc.poll() is None:
        return True
    pytest.fail(f"the search exited early with status {proc.returncode}:\n{err_path.read_text()[-4000:]}")


@pytest.mark.timeout(1800)   # the resume runs in this process: a hang fails the test instead of the session
def test_interrupted_search_resumes_from_its_storage_and_writes_a_best_yaml_from_its_own_trials(
        tmp_path, capsys, monkeypatch):
    run_dir = tmp_path / "run"
    monkeypatch.setenv("OOMTUNE_CACHE_DIR", str(tmp_path / "cache"))   # both searches': see the docstring
    # one clean confirmation run per candidate (search.repeats=1): the resume is under test here, and three
    # interleaved repeats of three candidates (spawned processes) take minutes on a loaded 2-core machine
    args = ["search", *TINY, f"search.n_trials={N_TRIALS}", "search.repeats=1", f"hydra.run.dir={run_dir}"]
    out_path, err_path = tmp_path / "first.out", tmp_path / "first.err"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(out_path, "w") as out_f, open(err_path, "w") as err_f:   # files: no pipe to fill while waiting
        proc = subprocess.Popen([sys.executable, "-m", "oomtune", *args], stdout=out_f, stderr=err_f, text=True,
                                env=env)
    deadline = time.time() + 600  # frontier predictions come first: slow on a loaded machine
    while time.time() < deadline and not (run_dir / "run.json").exists() and _running(proc, err_path):
        time.sleep(0.2)
    info = json.loads((run_dir / "run.json").read_text())
    while time.time() < deadline and len(_finished(info["storage"], info["study_name"])) < 3 \
            and _running(proc, err_path):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:   # say what the search was doing, not only that it did not stop
        proc.kill()
        proc.wait()
        pytest.fail("the search did not stop within 60 s of SIGTERM; its stderr:\n" + err_path.read_text()[-4000:])
    err = err_path.read_text()
    assert proc.returncode == 143, err   # 128 + SIGTERM
    assert "resume" in err
    before = {t.number: t.params for t in _finished(info["storage"], info["study_name"])}
    assert len(before) >= 3
    assert not (run_dir / "best.yaml").exists()
    # A process stopped between creating a trial and its first heartbeat leaves it RUNNING without
    # one (Optuna never counts it as stale); one such trial of the sampler phase, started a minute
    # ago, must not make the resume wait for ever (a CI run's resume timed out after 600 s).
    storage = optuna.storages.RDBStorage(info["storage"])
    orphan = optuna.trial.create_trial(state=optuna.trial.TrialState.RUNNING, user_attrs={R.ATTR_ROLE: "search"})
    orphan.datetime_start = datetime.now() - timedelta(seconds=60)
    orphan_id = storage.create_new_trial(
        optuna.load_study(study_name=info["study_name"], storage=storage)._study_id, template_trial=orphan)
    # The same command resumes: earlier trials are kept as they were, and the study completes.
    capsys.readouterr()
    with one_cpu_thread():
        assert main(args) == 0
    # its predictions are the stopped search's captures, every one read back (the same workload)
    resumed = capsys.readouterr()
    assert re.search(r"\b(\d+) of \1 read from the stream cache", resumed.out + resumed.err), resumed.err[-3000:]
    after = {t.number: t for t in optuna.load_study(study_name=info["study_name"], storage=info["storage"]).trials}
    assert all(after[n].params == p for n, p in before.items())
    searched = [t for t in after.values() if t.user_attrs.get(R.ATTR_ROLE) == "search"
                and t.state == optuna.trial.TrialState.COMPLETE]
    assert len(searched) == N_TRIALS
    assert storage.get_trial(orphan_id).state == optuna.trial.TrialState.FAIL   # failed, then retried
    assert any(t.system_attrs.get("failed_trial") == storage.get_trial(orphan_id).number for t in after.values())
    # The resumed search's answer is one of its own trials, as any search's (show and env read it).
    _assert_answer_is_its_own_trials(run_dir, capsys)
