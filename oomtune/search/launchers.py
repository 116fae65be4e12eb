"""Where a search's workers run: ``launcher=inprocess`` (worker threads of this process, the default),
``launcher=local`` or ``launcher=slurm`` (``search.workers`` worker jobs through submitit).

This module turns the ``launcher`` config group (``conf/launcher/*.yaml``) into what submitit is given
-- the executor's parameters (:func:`slurm_parameters`, :func:`local_parameters`) and each job's own
overrides (:func:`job_overrides`) -- and refuses, in one line before anything is submitted, what
cannot work (:func:`check_launcher`). It imports neither submitit nor torch: the job construction is
checked without a cluster (tests/test_launchers.py). Submitting, waiting and the job's entry point
are :mod:`oomtune.search.jobs`.
"""

from __future__ import annotations

import abc
import importlib.util
import os
import re
import shutil
import signal
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

from oomtune.exceptions import ConfigError
from oomtune.trial.record import TORCH_THREADS_ENV

__all__ = ["LAUNCHERS", "JobLauncher", "LocalJobs", "SlurmJobs", "job_launcher", "launcher_name", "launched",
           "check_launcher", "check_slurm_storage", "slurm_parameters", "local_parameters", "job_overrides",
           "workers_per_job", "local_gpu_sets", "jobs_folder", "quoted_override", "local_torch_threads", "JOB_KEYS"]

#: The options of the ``launcher`` group; ``inprocess`` is the default (no jobs).
LAUNCHERS = ("inprocess", "local", "slurm")

#: Override keys the parent decides for every job (and so drops from the user's overrides): the
#: launcher group itself, the workers (a job's own), the resolved storage and study name, the job's
#: own run directory.
JOB_KEYS = ("launcher", "search.workers", "storage", "study_name", "hydra.run.dir")


def launcher_name(cfg: Any) -> str:
    """``cfg.launcher.name`` (``inprocess`` when the config has no launcher group)."""
    launcher = cfg.get("launcher") if hasattr(cfg, "get") else None
    return str(launcher.get("name", "inprocess")) if launcher is not None else "inprocess"


def launched(cfg: Any) -> bool:
    """Whether the search runs as worker jobs (``launcher=local|slurm``) instead of in this process."""
    return launcher_name(cfg) != "inprocess"


def _is_sqlite(storage: Any) -> bool:
    return storage in (None, "", "null") or str(storage).startswith("sqlite")


def check_slurm_storage(storage: Any) -> None:
    """Refuse a storage worker jobs on other machines cannot share: SQLite (``storage=null``, the
    default, is a SQLite file in the run directory). A SQLite file is one machine's: its locks do not
    hold over a network file system (SQLite's own documentation, "How To Corrupt An SQLite Database
    File", section 2.1), and jobs on other nodes would each need to reach the same file.

    Raises:
        ConfigError: one line naming the storage and what to give instead.
    """
    if _is_sqlite(storage):
        given = "storage=null (a SQLite file in the run directory)" if storage in (None, "", "null") \
            else f"storage={storage}"
        raise ConfigError(f"launcher=slurm needs a database server every node reaches, but {given} is a file of "
                          "this machine that workers on other machines cannot share: give "
                          "storage=postgresql://USER@HOST/DB (docs/scale-out.md)")


def _check(ok: bool, key: str, value: Any, rule: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r}: {rule}")


def _int_or_none(value: Any) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool))


def check_launcher(cfg: Any, *, which: Any = shutil.which, find_spec: Any = importlib.util.find_spec) -> None:
    """The ``launcher`` group's values, before anything is opened, written or submitted.

    ``launcher=local|slurm``: submitit must be installed; every key in range (``gpus_per_job`` >= 0,
    ``timeout_min`` > 0, ``cpus_per_job`` / ``array_parallelism`` >= 1 or null, ``mem_gb`` > 0 or
    null, ``setup`` a list of shell lines); with ``launcher=slurm`` also a storage every node
    reaches (:func:`check_slurm_storage`), jobs of at least one trial's GPUs (``gpus_per_job >=
    trial.gpus`` unless ``device=cpu``), and SLURM's ``sbatch`` on this machine's PATH.
    ``which``/``find_spec``: :func:`shutil.which` and :func:`importlib.util.find_spec` (tests
    replace them).

    Raises:
        ConfigError: the first problem, in one line with what to do.
    """
    name = launcher_name(cfg)
    _check(name in LAUNCHERS, "launcher.name", name, f"choose one of {', '.join(LAUNCHERS)}")
    if name == "inprocess":
        return
    launcher = cfg.launcher
    if find_spec("submitit") is None:
        raise ConfigError(f"launcher={name} starts its worker jobs through submitit, which is not installed: "
                          "pip install 'oomtune[cluster]' (or pip install submitit)")
    gpus = launcher.get("gpus_per_job", 0)
    _check(_int_or_none(gpus) and gpus is not None and gpus >= 0, "launcher.gpus_per_job", gpus,
           "must be an integer >= 0 (GPUs each worker job holds)")
    minutes = launcher.get("timeout_min")
    _check(isinstance(minutes, (int, float)) and not isinstance(minutes, bool) and minutes > 0,
           "launcher.timeout_min", minutes, "must be > 0 minutes (a job's time limit)")
    if name == "local":
        return
    for key in ("cpus_per_job", "array_parallelism"):
        value = launcher.get(key)
        _check(_int_or_none(value) and (value is None or value >= 1), f"launcher.{key}", value,
               "must be an integer >= 1, or null")
    mem = launcher.get("mem_gb")
    _check(mem is None or (isinstance(mem, (int, float)) and not isinstance(mem, bool) and mem > 0),
           "launcher.mem_gb", mem, "must be > 0 GB, or null (the cluster's default)")
    setup = launcher.get("setup") or []
    _check(not isinstance(setup, str) and all(isinstance(line, str) for line in setup), "launcher.setup",
           setup, "must be a list of shell lines, e.g. launcher.setup='[\"module load cuda\"]'")
    extra = launcher.get("sbatch") or {}
    _check(hasattr(extra, "items"), "launcher.sbatch", extra, "must be a mapping of sbatch options")
    for key in extra:
        _check(re.fullmatch(r"[a-z][a-z0-9_-]*", str(key)) is not None, f"launcher.sbatch.{key}", extra[key],
               "an sbatch option is a long option's name without dashes, e.g. +launcher.sbatch.reservation=NAME")
    check_slurm_storage(cfg.get("storage"))
    ranks = int(cfg.trial.get("gpus", 1) or 1)
    if str(cfg.device) != "cpu" and gpus < ranks:
        raise ConfigError(f"launcher.gpus_per_job={gpus} but trial.gpus={ranks}: a worker job must hold at least one "
                          f"trial's GPUs; set launcher.gpus_per_job={ranks} (or a multiple of it)")
    if which("sbatch") is None or which("srun") is None:
        raise ConfigError("launcher=slurm: SLURM's sbatch/srun are not on this machine's PATH: run the search from a "
                          "SLURM login node (or launcher=local to run the worker jobs on this machine)")


def workers_per_job(cfg: Any, *, simulated: bool) -> int:
    """Trials one worker job runs at once (its ``search.workers``): ``gpus_per_job // trial.gpus``
    on GPUs (each trial owns ``trial.gpus`` of the job's GPUs), one on the virtual GPU (a CPU trial
    per job: ``search.workers`` jobs are ``search.workers`` trials at once)."""
    if simulated:
        return 1
    gpus = int(cfg.launcher.get("gpus_per_job", 1) or 0)
    return max(1, gpus // max(1, int(cfg.trial.get("gpus", 1) or 1)))


def jobs_folder(cfg: Any, run_dir: Path) -> Path:
    """submitit's folder (the jobs' pickles and logs): ``launcher.folder``, else ``<run dir>/workers``.
    For SLURM it must be on a file system the nodes share (submitit's documented requirement)."""
    folder = cfg.launcher.get("folder")
    return Path(str(folder)).expanduser().resolve() if folder not in (None, "") else (run_dir / "workers").resolve()


def _mem(mem_gb: float) -> str:
    """``--mem`` as submitit writes ``mem_gb`` (``submitit/slurm/slurm.py::_convert_mem``): whole GB as
    ``16GB``, else MB (``1.5`` -> ``1536MB``)."""
    return f"{int(mem_gb)}GB" if mem_gb == int(mem_gb) else f"{int(mem_gb * 1024)}MB"


def slurm_parameters(cfg: Any, n_jobs: int) -> dict[str, Any]:
    """The parameters of submitit's ``SlurmExecutor.update_parameters`` for ``n_jobs`` worker jobs
    (one job array: submitit writes ``--array=0-(n-1)%P``), from the ``launcher`` group; keys left
    null are not passed (the cluster's defaults apply). Each job writes one log (stderr with stdout:
    ``stderr_to_stdout``) in :func:`jobs_folder`.

    Names are SLURM's as submitit spells them (``submitit/slurm/slurm.py::_make_sbatch_string``):
    ``time`` in minutes, ``gpus_per_node``, ``cpus_per_task``, ``mem``; ``additional_parameters``
    carries ``launcher.sbatch``."""
    launcher = cfg.launcher
    params: dict[str, Any] = {
        "job_name": str(launcher.get("job_name") or "oomtune"),
        "time": int(launcher.timeout_min) if float(launcher.timeout_min).is_integer() else float(launcher.timeout_min),
        "array_parallelism": int(launcher.get("array_parallelism") or n_jobs),
        "stderr_to_stdout": True,
    }
    for key, name in (("partition", "partition"), ("account", "account"), ("qos", "qos"),
                      ("constraint", "constraint")):
        if launcher.get(key) not in (None, ""):
            params[name] = str(launcher.get(key))
    if int(launcher.get("gpus_per_job") or 0) > 0:
        params["gpus_per_node"] = int(launcher.gpus_per_job)
    if launcher.get("cpus_per_job") is not None:
        params["cpus_per_task"] = int(launcher.cpus_per_job)
    if launcher.get("mem_gb") is not None:
        params["mem"] = _mem(float(launcher.mem_gb))
    setup = [str(line) for line in (launcher.get("setup") or [])]
    if setup:
        params["setup"] = setup
    extra = {str(k): v for k, v in (launcher.get("sbatch") or {}).items()}
    if extra:
        params["additional_parameters"] = extra
    return params


def local_gpu_sets(n_jobs: int, gpus_per_job: int, visible: Sequence[str]) -> list[str | None]:
    """Each local job's ``CUDA_VISIBLE_DEVICES``: consecutive entries of this machine's visible GPUs
    ``visible`` (this process's ``CUDA_VISIBLE_DEVICES`` entries, indices or UUIDs as given, else
    ``0 .. count-1``), ``gpus_per_job`` each: ``"0,1"``, ``"2,3"``, ... None each when
    ``gpus_per_job`` is 0 (the virtual GPU: the job sees no GPU).

    Raises:
        ConfigError: the jobs need more GPUs than are visible.
    """
    if gpus_per_job <= 0:
        return [None] * n_jobs
    if n_jobs * gpus_per_job > len(visible):
        raise ConfigError(f"launcher=local: search.workers={n_jobs} jobs x launcher.gpus_per_job={gpus_per_job} "
                          f"need {n_jobs * gpus_per_job} GPUs but {len(visible)} are visible: lower search.workers "
                          "or launcher.gpus_per_job")
    return [",".join(visible[i * gpus_per_job:(i + 1) * gpus_per_job]) for i in range(n_jobs)]


def local_parameters(cfg: Any) -> dict[str, Any]:
    """The parameters of submitit's ``LocalExecutor.update_parameters`` for the local jobs: the time
    limit (``timeout_min``) and one log per job (``stderr_to_stdout``). No GPU is given through
    submitit (it would set ``CUDA_VISIBLE_DEVICES`` to indices of its own: ``submitit/local/
    local.py::start_controller``); each job sets its own from :func:`local_gpu_sets` before torch is
    imported (:func:`oomtune.search.jobs.run_worker`)."""
    return {"timeout_min": float(cfg.launcher.timeout_min), "stderr_to_stdout": True}


_PLAIN = re.compile(r"[A-Za-z0-9_./:@%+=,-]*")


def quoted_override(key: str, value: Any) -> str:
    """``key=value`` as a Hydra override that reads back as the string ``value``: plain when it holds
    only characters Hydra's grammar takes unquoted in a value, else single-quoted with ``\\`` and
    ``'`` escaped (Hydra's quoted values: "Escaping in quoted values")."""
    text = str(value)
    if _PLAIN.fullmatch(text) and text and "=" not in text and "," not in text:
        return f"{key}={text}"
    return f"{key}='" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _key_of(override: str) -> str:
    return str(override).lstrip("+~").split("=", 1)[0].strip()


def job_overrides(overrides: Sequence[str], *, storage: str, study_name: str, run_dir: Path,
                  workers: int) -> list[str]:
    """One worker job's overrides: the user's (and ``OOMTUNE_OVERRIDES``'s, folded in by the caller)
    without those of :data:`JOB_KEYS`, then the job's own: ``launcher=inprocess`` (a job runs its
    workers in its own process and launches no jobs), its ``search.workers``, the storage and study
    name the parent resolved (the default SQLite file is the parent's run directory's, and a derived
    study name must not be derived again elsewhere), and its run directory."""
    kept = [o for o in overrides if not any(_key_of(o) == k or _key_of(o).startswith(k + ".") for k in JOB_KEYS)]
    return [*kept, "launcher=inprocess", f"search.workers={int(workers)}", quoted_override("storage", storage),
            quoted_override("study_name", study_name), quoted_override("hydra.run.dir", str(run_dir))]


def local_torch_threads(n_jobs: int, ranks: int, cores: int | None = None) -> int | None:
    """torch threads per CPU trial process when ``n_jobs`` local jobs, one trial of ``ranks`` ranks
    each, share this machine's ``cores`` (default ``os.cpu_count()``), as the in-process workers
    split them (:func:`oomtune.search.run._torch_threads`); None for one process."""
    total = n_jobs * max(1, ranks)
    if total <= 1:
        return None
    return max(1, (cores if cores is not None else (os.cpu_count() or 1)) // total)


class JobLauncher(abc.ABC):
    """How one kind of worker job (``launcher=local|slurm``) is started, followed and stopped:
    :mod:`oomtune.search.jobs` asks the launcher and never compares its name (as Optuna's study
    asks its storage). Stateless; submitit is handed in by the caller (this module does not import it).

    Class attributes:
        name: the ``launcher`` group's option (``launcher.name``), also in jobs.json and messages.
        job_word: what a job's id is called in the search's lines (``pid``, ``job``).
        poll_s: seconds between two looks at the jobs and the study.
    """

    name: ClassVar[str]
    job_word: ClassVar[str]
    poll_s: ClassVar[float]

    @abc.abstractmethod
    def where(self, cfg: Any) -> str:
        """Where the jobs run, for the search's line about them."""

    def job_envs(self, cfg: Any, n_jobs: int, *, simulated: bool,
                 visible_gpus: Callable[[], list[str]]) -> list[dict[str, str]]:
        """Each job's own environment variables (index order); none by default."""
        return [{} for _ in range(n_jobs)]

    @abc.abstractmethod
    def submit(self, submitit: Any, folder: Path, cfg: Any, fn: Callable[..., Any], args: list[Any],
               envs: list[dict[str, str]]) -> list[Any]:
        """Submit ``fn(args[i], i, envs[i])`` for every job through ``submitit``; submitit's jobs, index
        order. Raises what submitit raises (the caller words it)."""

    @abc.abstractmethod
    def cancel(self, job: Any) -> None:
        """Ask one running job to stop (its search then tells its running trial FAIL and ends its
        trial processes). Raises OSError/ValueError for a job that ended meanwhile."""


class LocalJobs(JobLauncher):
    """``launcher=local``: worker jobs on this machine (submitit's ``LocalExecutor``)."""

    name = "local"
    job_word = "pid"
    poll_s = 1.0

    def where(self, cfg: Any) -> str:
        return "this machine, submitit's LocalExecutor"

    def job_envs(self, cfg: Any, n_jobs: int, *, simulated: bool,
                 visible_gpus: Callable[[], list[str]]) -> list[dict[str, str]]:
        """Each job's ``CUDA_VISIBLE_DEVICES`` (its share of this machine's GPUs:
        :func:`local_gpu_sets`; none on the virtual GPU) and, on the virtual GPU, its torch threads
        (``OOMTUNE_TORCH_THREADS``: :func:`local_torch_threads`, the cores shared by the jobs)."""
        gpus = 0 if simulated else int(cfg.launcher.get("gpus_per_job", 1) or 0)
        sets = local_gpu_sets(n_jobs, gpus, visible_gpus() if gpus else [])
        threads = local_torch_threads(n_jobs, int(cfg.trial.gpus)) if simulated else None
        envs = []
        for devices in sets:
            env = {}
            if devices is not None:
                env["CUDA_VISIBLE_DEVICES"] = devices
            if threads is not None:
                env[TORCH_THREADS_ENV] = str(threads)
            envs.append(env)
        return envs

    def submit(self, submitit: Any, folder: Path, cfg: Any, fn: Callable[..., Any], args: list[Any],
               envs: list[dict[str, str]]) -> list[Any]:
        executor = submitit.LocalExecutor(folder=folder)
        executor.update_parameters(**local_parameters(cfg))
        return [executor.submit(fn, args[i], i, envs[i]) for i in range(len(args))]

    def cancel(self, job: Any) -> None:
        """SIGTERM to the job's controller process (its job id), which forwards it to the job
        (submitit's ``Controller._forward_signal``); submitit's own ``LocalJob.cancel`` sends SIGINT,
        which a process started in the background ignores."""
        os.kill(int(job.job_id), signal.SIGTERM)


class SlurmJobs(JobLauncher):
    """``launcher=slurm``: one SLURM job array (submitit's ``SlurmExecutor``)."""

    name = "slurm"
    job_word = "job"
    poll_s = 5.0

    def where(self, cfg: Any) -> str:
        partition = cfg.launcher.get("partition")
        return "SLURM" + (f" partition {partition}" if partition else "")

    def submit(self, submitit: Any, folder: Path, cfg: Any, fn: Callable[..., Any], args: list[Any],
               envs: list[dict[str, str]]) -> list[Any]:
        executor = submitit.SlurmExecutor(folder=folder)
        executor.update_parameters(**slurm_parameters(cfg, len(args)))
        return executor.map_array(fn, args, list(range(len(args))), envs)

    def cancel(self, job: Any) -> None:
        """``scancel`` (submitit's ``Job.cancel``), which sends the job SIGTERM."""
        job.cancel(check=False)


_JOB_LAUNCHERS: dict[str, JobLauncher] = {cls.name: cls() for cls in (LocalJobs, SlurmJobs)}


def job_launcher(cfg: Any) -> JobLauncher:
    """The :class:`JobLauncher` of ``cfg``'s ``launcher`` group (:func:`check_launcher` has checked it).

    Raises:
        ConfigError: ``launcher=inprocess`` (no jobs) or an unknown launcher.
    """
    name = launcher_name(cfg)
    if name not in _JOB_LAUNCHERS:
        raise ConfigError(f"launcher={name} starts no worker jobs: choose one of {', '.join(_JOB_LAUNCHERS)}")
    return _JOB_LAUNCHERS[name]
