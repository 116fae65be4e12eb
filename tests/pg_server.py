"""A throwaway PostgreSQL server for tests and benchmarks.

Uses the operating system's PostgreSQL server binaries (Debian/Ubuntu package ``postgresql``, which
``.ci/run`` installs when missing): ``initdb`` creates a cluster in a temporary directory,
``pg_ctl`` starts it on 127.0.0.1 at a free port (trust authentication, fsync off: a test cluster),
and :meth:`PgServer.stop` removes it. PostgreSQL refuses to run as root, so under root the binaries
run as the unprivileged ``postgres`` user (created by the package) through ``runuser``, and the
cluster directory is handed to that user.

URLs are in the README's documented form, ``postgresql://USER@HOST:PORT/DB`` (no driver named:
SQLAlchemy 2.1 opens it with psycopg 3, which the ``postgresql`` and ``dev`` extras install).
:meth:`PgServer.stop_server` and :meth:`PgServer.start_server` take the same cluster down
and up again on the same port and data directory (an outage, for the storage-fault tests).

:func:`start_or_skip` is what tests call: it skips with the reason when no server can be started,
except under CI (``CI=true``), where that is a failure.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path

__all__ = ["PgServer", "PgUnavailable", "find_bin_dir", "start_or_skip", "shared_study"]


class PgUnavailable(RuntimeError):
    """No PostgreSQL server can be started here (the reason is the message)."""


def find_bin_dir() -> Path:
    """The directory holding initdb and pg_ctl: on PATH, else the newest /usr/lib/postgresql/*/bin.

    Raises:
        PgUnavailable: no server binaries.
    """
    initdb = shutil.which("initdb")
    if initdb:
        return Path(initdb).parent
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                   key=lambda p: int(Path(p).parent.parent.name) if Path(p).parent.parent.name.isdigit() else 0)
    if not found:
        raise PgUnavailable("PostgreSQL server binaries (initdb, pg_ctl) not found: apt-get install postgresql")
    return Path(found[-1]).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PgServer:
    """One PostgreSQL cluster on 127.0.0.1:``port`` with superuser ``oomtune`` (trust auth)."""

    def __init__(self) -> None:
        self.bin = find_bin_dir()
        self.port = _free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="oomtune-pg-"))
        self.data = self.dir / "data"
        self._prefix: list[str] = []
        if os.geteuid() == 0:
            try:
                user = pwd.getpwnam("postgres")
            except KeyError:
                raise PgUnavailable("running as root and there is no 'postgres' user to run the server as") from None
            if shutil.which("runuser") is None:
                raise PgUnavailable("running as root and runuser is missing (util-linux)")
            os.chown(self.dir, user.pw_uid, user.pw_gid)
            self._prefix = ["runuser", "-u", "postgres", "--"]

    def _run(self, *argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([*self._prefix, *argv], capture_output=True, text=True, timeout=120)

    def start(self) -> "PgServer":
        """initdb + pg_ctl start (waits until the server accepts connections).

        Raises:
            PgUnavailable: either step failed (its stderr in the message).
        """
        r = self._run(str(self.bin / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "oomtune",
                      "--no-sync", "-E", "UTF8")
        if r.returncode != 0:
            raise PgUnavailable(f"initdb failed: {(r.stderr or r.stdout).strip()[-400:]}")
        self.start_server()
        return self

    def start_server(self) -> None:
        """``pg_ctl start`` on this cluster and port; waits until it accepts connections.

        Raises:
            PgUnavailable: it did not start (its stderr and the log's tail in the message).
        """
        opts = (f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.dir} -c fsync=off "
                "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200")
        r = self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-o", opts, "-l",
                      str(self.dir / "server.log"), "-w", "-t", "60", "start")
        if r.returncode != 0:
            log = (self.dir / "server.log").read_text(errors="replace")[-400:] if (self.dir / "server.log").exists() else ""
            raise PgUnavailable(f"pg_ctl start failed: {(r.stderr or r.stdout).strip()[-300:]} {log}")

    def stop_server(self, mode: str = "fast") -> None:
        """``pg_ctl stop -m MODE`` (fast: connections are terminated, as in a server restart or
        failover), keeping the cluster for :meth:`start_server`."""
        r = self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop")
        if r.returncode != 0:
            raise PgUnavailable(f"pg_ctl stop failed: {(r.stderr or r.stdout).strip()[-300:]}")

    def url(self, database: str = "postgres", driver: str | None = None) -> str:
        """SQLAlchemy URL of ``database`` in the README's form ``postgresql://oomtune@HOST:PORT/DB``,
        or with ``+driver`` when one is named (``psycopg2``)."""
        scheme = "postgresql" if driver is None else f"postgresql+{driver}"
        return f"{scheme}://oomtune@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str | None = None) -> str:
        """``CREATE DATABASE`` (a fresh one per test); returns its URL (:meth:`url`)."""
        name = name or f"t_{uuid.uuid4().hex[:12]}"
        conn = _connect(host="127.0.0.1", port=self.port, user="oomtune", dbname="postgres")
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute(f'CREATE DATABASE "{name}"')
        conn.close()
        return self.url(name)

    def stop(self) -> None:
        """Stop the server (immediate) and delete the cluster."""
        if self.data.exists():
            self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(self.dir, ignore_errors=True)


def _connect(**kwargs: object) -> object:
    """A DB-API connection through psycopg 3 (the documented driver), else psycopg2."""
    try:
        import psycopg
    except ImportError:
        import psycopg2

        return psycopg2.connect(**kwargs)
    return psycopg.connect(**kwargs)


def start_or_skip() -> PgServer:
    """A started :class:`PgServer`; ``pytest.skip`` with the reason when impossible, but
    ``pytest.fail`` under CI (``CI=true``), where the server must start."""
    import pytest

    try:
        import psycopg  # noqa: F401 - what postgresql:// URLs use (SQLAlchemy 2.1)
    except ImportError:
        reason = "psycopg (3) is not installed (pip install -e '.[dev]')"
    else:
        try:
            return PgServer().start()
        except PgUnavailable as exc:
            reason = str(exc)
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"PostgreSQL test server could not start under CI: {reason}")
    pytest.skip(f"no PostgreSQL test server: {reason}")


def shared_study(url: str, name: str) -> object:
    """Study ``name`` of the storage ``url`` as a test reads it while ``oomtune search`` workers may be
    opening the same new database: through oomtune's own open (oomtune.study.storage.make_storage),
    which tries again while another process creates Optuna's tables and enum types. A plain
    ``optuna.load_study(storage=url)`` runs SQLAlchemy's create_all unguarded and failed with
    ``UniqueViolation`` on ``CREATE TYPE studydirection`` when it raced the workers' first open.

    Raises:
        KeyError: no study of that name yet (Optuna's ``load_study``).
    """
    import optuna

    from oomtune.study.storage import make_storage

    return optuna.load_study(study_name=name, storage=make_storage(url))


def sleep_search_overrides(url: str, study: str, run_dir: Path, *extra: str, grace_period_s: int) -> list[str]:
    """``oomtune search`` overrides of the shared-study tests: tests/data/sleep_trial.py as a command
    target (batch 8..64, 4 trials, the throughput objective, so frontier probes, sampled trials and
    repeated confirmations all run), heartbeats every second and a dead worker's trial failed after
    ``grace_period_s`` seconds, on ``url`` (a PostgreSQL or grpc:// storage) as study ``study``.
    Every trial is spawned (``trial.launcher=spawn``): the script imports nothing but oomtune, so a
    spawned trial costs a fraction of a CPU-second, while each search process's script server
    (oomtune.trial.script_fork) would import torch for several; these tests are about the processes
    sharing a study, and the forked trials of a command are tests/test_script_fork.py's."""
    import sys

    script = Path(__file__).resolve().parent / "data" / "sleep_trial.py"
    return ["target=cmd", f"target.command='{sys.executable} {script} {{batch_size}}'", "device=cpu",
            "search.batch_size.low=8", "search.batch_size.high=64", "search.n_trials=4",
            "search.objective=throughput", "search.heartbeat_interval=1", f"search.grace_period={grace_period_s}",
            "trial.timeout=120", "trial.launcher=spawn", f"storage={url}", f"study_name={study}",
            f"hydra.run.dir={run_dir}", *extra]


def start_sleep_search(overrides: list[str], log: Path, sleep_s: float) -> subprocess.Popen:
    """``oomtune search OVERRIDES`` in a session of its own (so a test can signal its whole process
    group), each sleep_trial.py trial sleeping ``sleep_s`` seconds; its stdout and stderr in
    ``log`` with the suffixes .out and .err."""
    import sys

    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "OOMTUNE_TEST_SLEEP_S": str(sleep_s), "PYTHONPATH": str(repo)}
    return subprocess.Popen([sys.executable, "-m", "oomtune", "search", *overrides], cwd=repo, env=env,
                            stdout=open(log.with_suffix(".out"), "wb"), stderr=open(log.with_suffix(".err"), "wb"),
                            start_new_session=True)


#: The line tests/data/sleep_trial.py prints when it holds (its HOLDING; the script cannot be imported).
SLEEP_TRIAL_HOLDING = "sleep_trial: holding"


def held_trial(trial_dir: Path) -> bool:
    """Whether the trial in ``trial_dir`` is held by tests/data/sleep_trial.py: its holding line in its
    stdout.txt and no tell.json yet (still running, waiting for the hold file to go)."""
    out = trial_dir / "stdout.txt"
    return (out.exists() and not (trial_dir / "tell.json").exists()
            and SLEEP_TRIAL_HOLDING in out.read_text(errors="replace"))


def launched_trials(study: object, role: str) -> list:
    """The study's trials of ``role`` that ran a trial process and hold its result (not reused from
    an identical trial, not taken from a recording, not refused by prediction)."""
    from oomtune.study import records as R

    return [t for t in study.get_trials(deepcopy=False) if t.user_attrs.get(R.ATTR_ROLE) == role
            and R.ATTR_RESULT in t.user_attrs and R.ATTR_REUSED not in t.user_attrs
            and R.ATTR_FROM_RECORDING not in t.user_attrs and t.user_attrs.get(R.ATTR_OUTCOME) != "predicted_infeasible"]


def assert_killed_trial_retried(trials: dict, killed_trial: int, finished_before: set[int]) -> None:
    """Assert what a worker killed mid-trial must leave in a shared study (``trials``: number ->
    FrozenTrial, read after the other workers ended): its trial FAIL without a result, a retry
    enqueued, the killed candidate run to a result by another worker after the kill (the retry itself
    or, when a round enqueued the same candidate again between the failure and the retry's enqueue -
    two steps of Optuna's fail_stale_trials - the copy with the same key claimed first, to which the
    other defers as a duplicate: oomtune.search.workers launches no candidate twice; a sampler
    trial's retry carries its parameters), every retry finished, every trial finished before the kill
    still holding its result, and no trial left RUNNING or WAITING."""
    from optuna.trial import TrialState

    from oomtune.search.workers import ATTR_DUPLICATE_OF, ATTR_KEY

    killed = trials[killed_trial]
    assert killed.state is TrialState.FAIL and "result" not in killed.user_attrs
    retries = [t for t in trials.values() if t.system_attrs.get("failed_trial") == killed_trial]
    assert retries                                                           # its retry was enqueued
    key = killed.user_attrs.get(ATTR_KEY)
    same = [t for t in trials.values() if t.number != killed_trial
            and (t in retries or (key is not None and t.user_attrs.get(ATTR_KEY) == key))]
    reran = [t for t in same if "result" in t.user_attrs and t.datetime_start >= killed.datetime_complete]
    assert reran and all(t.params == killed.params for t in reran), "the killed candidate never re-ran"
    assert all(t.state.is_finished() and ("result" in t.user_attrs or ATTR_DUPLICATE_OF in t.user_attrs)
               for t in retries)                                             # no retry left behind
    assert all("result" in trials[n].user_attrs for n in finished_before)     # nothing finished was lost
    assert not [t for t in trials.values() if t.state in (TrialState.RUNNING, TrialState.WAITING)]
