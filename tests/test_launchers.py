"""``launcher=slurm|local``: the jobs oomtune builds from the overrides, checked without a cluster.

The SLURM job array is built through submitit's own ``SlurmExecutor`` up to the ``sbatch`` call,
which a stand-in on PATH answers as sbatch does ("Submitted batch job N"), so the sbatch script and
the jobs' pickles are submitit's real ones. Expected values are written by hand from the overrides
and SLURM's sbatch options (``--partition``, ``--gpus-per-node``, ``--time`` in minutes, ``--array=
0-(N-1)%P``) as submitit spells them (submitit/slurm/slurm.py::_make_sbatch_string).
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

pytest.importorskip("submitit")

REPO = Path(__file__).resolve().parent.parent
PG = "postgresql://oomtune@db.example:5432/oomtune"
SCRIPT = REPO / "tests" / "data" / "sleep_trial.py"


def _cfg(*overrides: str):
    from oomtune.config import compose

    return compose(list(overrides))


def _fake_slurm(tmp_path: Path, monkeypatch) -> Path:
    """``sbatch`` (prints what sbatch prints, keeps the script it was given) and ``srun`` on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f"#!/bin/sh\ncp \"$1\" {tmp_path}/submitted.sh\necho 'Submitted batch job 4242'\n")
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 1\n")
    for name in ("sbatch", "srun"):
        (bin_dir / name).chmod((bin_dir / name).stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return bin_dir


def test_slurm_parameters_from_the_overrides():
    from oomtune.search.launchers import slurm_parameters

    cfg = _cfg("launcher=slurm", "launcher.partition=gpu", "launcher.gpus_per_job=1", "launcher.account=proj",
               "launcher.timeout_min=90", "launcher.cpus_per_job=8", "launcher.mem_gb=32",
               "+launcher.sbatch.reservation=mine", "search.workers=8", f"storage={PG}")
    assert slurm_parameters(cfg, 8) == {
        "job_name": "oomtune", "time": 90, "array_parallelism": 8, "stderr_to_stdout": True,
        "partition": "gpu", "account": "proj", "gpus_per_node": 1, "cpus_per_task": 8, "mem": "32GB",
        "additional_parameters": {"reservation": "mine"},
    }
    # the defaults: no partition/account/qos/cpus/mem (the cluster's own), 240 minutes, all jobs at once
    assert slurm_parameters(_cfg("launcher=slurm", f"storage={PG}"), 3) == {
        "job_name": "oomtune", "time": 240, "array_parallelism": 3, "stderr_to_stdout": True, "gpus_per_node": 1}
    # 1.5 GB is written in MB as submitit does (_convert_mem: int(1.5 * 1024)); a CPU-only job asks no GPU
    params = slurm_parameters(_cfg("launcher=slurm", "launcher.mem_gb=1.5", "launcher.gpus_per_job=0",
                                   "launcher.array_parallelism=2", "launcher.qos=high",
                                   "launcher.setup=[module load cuda]", f"storage={PG}"), 5)
    assert params["mem"] == "1536MB" and "gpus_per_node" not in params
    assert params["array_parallelism"] == 2 and params["qos"] == "high" and params["setup"] == ["module load cuda"]


def test_the_slurm_job_array_submitit_writes(tmp_path, monkeypatch):
    # the whole submission path (launcher config -> submitit's SlurmExecutor -> sbatch), sbatch stood in for
    import submitit

    from oomtune.search import jobs as J

    _fake_slurm(tmp_path, monkeypatch)
    run_dir = tmp_path / "run"
    overrides = ["target=cmd", f"target.command='python {SCRIPT} {{batch_size}}'", "budget=16GiB",
                 "launcher=slurm", "launcher.partition=gpu", "launcher.gpus_per_job=2", "launcher.account=proj",
                 "launcher.timeout_min=120", "launcher.setup=[source /opt/venv/bin/activate]", "search.workers=8",
                 f"storage={PG}", "study_name=resnet50-16g", f"hydra.run.dir={run_dir}"]
    cfg = _cfg(*overrides)
    plan = J._plan(overrides, cfg, None)
    jobs = J._submit(plan)

    script = (tmp_path / "submitted.sh").read_text()
    folder = run_dir.resolve() / "workers"
    for line in ("#SBATCH --partition=gpu", "#SBATCH --account=proj", "#SBATCH --gpus-per-node=2",
                 "#SBATCH --time=120", "#SBATCH --array=0-7%8", "#SBATCH --job-name=oomtune",
                 f"#SBATCH --output={folder}/%A_%a_0_log.out", "source /opt/venv/bin/activate"):
        assert line in script.splitlines(), line
    assert "#SBATCH --error" not in script                     # one log per job: stderr with stdout
    assert f"-m submitit.core._submit {folder}" in script
    assert [j.job_id for j in jobs] == [f"4242_{i}" for i in range(8)]
    assert [Path(j.paths.stdout) for j in jobs] == [folder / f"4242_{i}_0_log.out" for i in range(8)]

    # each job's pickle: run_worker with the job's own overrides (2 GPUs per job / 1 per trial: 2 trials)
    for i, job in enumerate(jobs):
        sub = submitit.core.utils.DelayedSubmission.load(job.paths.submitted_pickle)
        assert sub.function is J.run_worker
        job_overrides, index, env = sub.args
        assert index == i and env == {}
        assert job_overrides[-5:] == ["launcher=inprocess", "search.workers=2", f"storage={PG}",
                                      "study_name=resnet50-16g", f"hydra.run.dir={folder / f'worker-{i}'}"]
        job_cfg = _cfg(*job_overrides)
        assert job_cfg.launcher.name == "inprocess" and job_cfg.search.workers == 2
        assert (job_cfg.storage, job_cfg.study_name) == (PG, "resnet50-16g")
        assert Path(job_cfg.hydra.run.dir) == folder / f"worker-{i}"
        assert job_cfg.target.command == f"python {SCRIPT} {{batch_size}}"


@pytest.mark.parametrize("storage", [None, "sqlite:///study.db"])
def test_slurm_with_a_sqlite_storage_is_refused_in_one_line(storage, capsys, tmp_path, monkeypatch):
    from oomtune.cli import main

    _fake_slurm(tmp_path, monkeypatch)   # sbatch is there: the storage is what is refused
    argv = ["search", "model=mlp", "launcher=slurm", "search.workers=4", f"hydra.run.dir={tmp_path / 'run'}"]
    if storage is not None:
        argv.append(f"storage={storage}")
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("oomtune: error: launcher=slurm needs a database server")
    assert "storage=postgresql://" in err[0]
    assert not (tmp_path / "run").exists()                     # refused before anything is written


def test_launcher_refusals_are_one_line():
    from oomtune.exceptions import ConfigError
    from oomtune.search.launchers import check_launcher

    which = {"sbatch": "/usr/bin/sbatch", "srun": "/usr/bin/srun"}.get
    check_launcher(_cfg("launcher=slurm", f"storage={PG}"), which=which)          # fine as given
    check_launcher(_cfg("launcher=local"), which=lambda name: None)                 # SQLite is fine locally
    cases = [
        (("launcher=slurm", f"storage={PG}", "launcher.gpus_per_job=1", "trial.gpus=2", "target=cmd"),
         which, r"launcher.gpus_per_job=1 but trial.gpus=2"),
        (("launcher=slurm", f"storage={PG}", "launcher.timeout_min=0"), which, r"launcher.timeout_min=0: must be > 0"),
        (("launcher=slurm", f"storage={PG}", "launcher.mem_gb=-1"), which, r"launcher.mem_gb=-1"),
        (("launcher=local", "launcher.gpus_per_job=-1"), which, r"launcher.gpus_per_job=-1"),
        (("launcher=slurm", f"storage={PG}"), lambda name: None, r"sbatch/srun are not on this machine's PATH"),
    ]
    for overrides, finder, message in cases:
        with pytest.raises(ConfigError, match=message):
            check_launcher(_cfg(*overrides), which=finder)
    with pytest.raises(ConfigError, match=r"^launcher=local starts its worker jobs through submitit, which is not "
                                          r"installed: pip install 'oomtune\[cluster\]'"):
        check_launcher(_cfg("launcher=local"), find_spec=lambda name: None)


def test_unknown_launcher_keys_and_options_are_refused():
    from oomtune.exceptions import ConfigError

    with pytest.raises(ConfigError, match="there is no 'slrum' in the config group 'launcher'.*did you mean launcher=slurm"):
        _cfg("launcher=slrum")
    with pytest.raises(ConfigError, match="launcher.partiton"):
        _cfg("launcher=slurm", "+launcher.partiton=gpu")


def test_the_launcher_does_not_change_the_study_name():
    # the same search launched in-process, locally or on SLURM is one study (resumable by any)
    names = {_cfg("model=mlp", *extra).study_name for extra in
             [(), ("launcher=local", "search.workers=2"), ("launcher=slurm", "launcher.partition=gpu", f"storage={PG}")]}
    assert len(names) == 1


def test_job_overrides_replace_what_the_parent_decides_and_quote_paths(tmp_path):
    from oomtune.search.launchers import job_overrides

    run_dir = tmp_path / "a dir, with=odd 'chars'"
    url = f"sqlite:///{run_dir}/study.db"
    got = job_overrides(["model=mlp", "launcher=local", "launcher.timeout_min=5", "search.workers=3",
                         "storage=x", "study_name=y", "hydra.run.dir=z", "search.n_trials=4"],
                        storage=url, study_name="mlp-1234", run_dir=run_dir / "workers" / "worker-0", workers=1)
    assert got[:2] == ["model=mlp", "search.n_trials=4"]
    cfg = _cfg(*got)
    assert cfg.launcher.name == "inprocess" and cfg.search.workers == 1 and cfg.search.n_trials == 4
    assert cfg.storage == url and cfg.study_name == "mlp-1234"
    assert cfg.hydra.run.dir == str(run_dir / "workers" / "worker-0")


def test_local_jobs_split_the_visible_gpus():
    from oomtune.exceptions import ConfigError
    from oomtune.search.launchers import local_gpu_sets, local_torch_threads

    assert local_gpu_sets(2, 2, ["0", "1", "2", "3"]) == ["0,1", "2,3"]
    assert local_gpu_sets(2, 1, ["GPU-a", "GPU-b", "GPU-c"]) == ["GPU-a", "GPU-b"]   # UUIDs as given
    assert local_gpu_sets(3, 0, []) == [None, None, None]                             # the virtual GPU
    with pytest.raises(ConfigError, match="need 6 GPUs but 4 are visible"):
        local_gpu_sets(3, 2, ["0", "1", "2", "3"])
    # CPU trials of 2 local jobs on 16 cores: 8 torch threads each, as 2 in-process workers get
    assert local_torch_threads(2, 1, cores=16) == 8 and local_torch_threads(1, 1, cores=16) is None
    assert local_torch_threads(3, 2, cores=4) == 1


def test_local_jobs_get_their_gpus_and_threads(tmp_path, monkeypatch):
    from oomtune.search import jobs as J

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    overrides = ["target=cmd", f"target.command='python {SCRIPT} {{batch_size}}'", "launcher=local",
                 "launcher.gpus_per_job=2", "search.workers=2", f"hydra.run.dir={tmp_path / 'run'}"]

    class Run:   # the prepared run of a resolved CUDA device (this machine has none): what _plan reads of it
        run_dir, space = tmp_path / "run", None
        device = type("D", (), {"simulated": False})()

    class Prepared:
        run = Run
        options = type("O", (), {"objective": "throughput", "execute": "cpu"})()

    plan = J._plan(overrides, _cfg(*overrides), Prepared())
    assert plan.envs == [{"CUDA_VISIBLE_DEVICES": "4,5"}, {"CUDA_VISIBLE_DEVICES": "6,7"}]
    assert plan.per_job == 2 and plan.url == f"sqlite:///{(tmp_path / 'run' / 'study.db').resolve()}"
    Run.device.simulated = True
    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    plan = J._plan(overrides, _cfg(*overrides), Prepared())
    assert plan.envs == [{"OOMTUNE_TORCH_THREADS": "3"}] * 2 and plan.per_job == 1


def test_a_submission_sbatch_refuses_is_one_line(tmp_path, monkeypatch, capsys):
    from oomtune.exceptions import ConfigError
    from oomtune.search import jobs as J

    bin_dir = _fake_slurm(tmp_path, monkeypatch)
    (bin_dir / "sbatch").write_text("#!/bin/sh\necho 'sbatch: error: invalid partition specified: gpux' >&2\n"
                                    "echo 'sbatch: error: Batch job submission failed: Invalid partition name "
                                    "specified' >&2\nexit 1\n")
    overrides = ["target=cmd", f"target.command='python {SCRIPT} {{batch_size}}'", "launcher=slurm",
                 "launcher.partition=gpux", "search.workers=2", f"storage={PG}", f"hydra.run.dir={tmp_path / 'run'}"]
    plan = J._plan(overrides, _cfg(*overrides), None)
    with pytest.raises(ConfigError, match=r"^launcher=slurm: the worker jobs could not be submitted: sbatch: error: "
                                          r"Batch job submission failed: Invalid partition name specified$"):
        J._submit(plan)
    assert capsys.readouterr().err == ""          # sbatch's lines are not printed a second time by submitit


def test_the_answer_comes_from_a_job_that_finished_else_one_line():
    from oomtune.exceptions import ConfigError, WorkerJobsFailed
    from oomtune.search.jobs import JobReport, answer_of

    done = JobReport(index=1, exit_code=0, summary="S1")
    nothing_fitted = JobReport(index=2, exit_code=1, line="oomtune: no configuration ran within the budget",
                               summary="S2")
    killed = JobReport(index=0, exit_code=1, line="the job ended without a result (failed): killed")
    assert answer_of([killed, done, nothing_fitted], PG) is done        # a finished job's summary first
    assert answer_of([killed, nothing_fitted], PG) is nothing_fitted    # else one that reached a summary
    refused = [JobReport(index=i, exit_code=2, line="oomtune: error: budget 90GiB exceeds cuda:0 (79.25 GiB)")
               for i in range(3)]
    with pytest.raises(ConfigError, match=r"^budget 90GiB exceeds cuda:0 \(79.25 GiB\)$"):
        answer_of(refused, PG)                                           # bad input on every node: exit 2
    with pytest.raises(WorkerJobsFailed, match=r"^none of the 2 worker jobs reached an answer \(worker job 0: the "
                                               r"job ended without a result \(failed\): killed, log /l0\); finished "
                                               r"trials are kept in postgresql://"):
        answer_of([killed, refused[1]], PG, [Path("/l0"), Path("/l1")])


def test_the_jobs_ask_their_launcher_not_its_name(tmp_path):
    """jobs.py follows and stops worker jobs through their JobLauncher: each launcher group has one,
    with its own words; launcher=inprocess starts no jobs, so it has none."""
    from oomtune.exceptions import ConfigError
    from oomtune.search.launchers import LocalJobs, SlurmJobs, job_launcher

    local = job_launcher(_cfg("launcher=local"))
    slurm = job_launcher(_cfg("launcher=slurm", "launcher.partition=gpu", f"storage={PG}"))
    assert isinstance(local, LocalJobs) and isinstance(slurm, SlurmJobs)
    assert (local.job_word, slurm.job_word) == ("pid", "job")   # a local job's id is its controller's pid (submitit)
    assert slurm.where(_cfg("launcher=slurm", "launcher.partition=gpu", f"storage={PG}")) == "SLURM partition gpu"
    with pytest.raises(ConfigError, match="^launcher=inprocess starts no worker jobs: choose one of local, slurm$"):
        job_launcher(_cfg())
