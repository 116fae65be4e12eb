"""``storage=grpc://HOST:PORT``: the study through Optuna's gRPC storage proxy
(``optuna.storages.GrpcStorageProxy``, served by ``oomtune storage-proxy``:
:func:`oomtune.study.grpc_server.serve`) in front
of a database server, so that many workers hold one gRPC channel each to the proxy instead of their
own database connections.

What Optuna's proxy does not do, and what oomtune adds on the client side (:func:`grpc_storage_class`):

- **Heartbeats.** ``GrpcStorageProxy`` is a ``BaseStorage`` but not a ``BaseHeartbeat``, and the
  proxy's protocol (``optuna/storages/_grpc/api.proto``) has no heartbeat call: through it
  ``optuna.storages.fail_stale_trials`` does nothing and ``get_heartbeat_thread`` records nothing, so
  a worker killed mid-trial would leave its trial RUNNING for ever and every other worker waiting
  for it (the search drains every running trial before it ranks). oomtune's client records each
  running trial's heartbeat as the trial's system attribute :data:`HEARTBEAT_ATTR` (a value that
  changes with every beat: the writer's token and a count), and a worker judges a RUNNING trial
  stale when that value has not changed for ``grace_period`` seconds *of its own monotonic clock*
  since it first saw it, counted only while that worker itself reached the proxy (no clocks of two
  machines are compared; Optuna's RDB storage uses the database server's clock instead,
  ``current_timestamp``). The stale trial is failed and enqueued
  again by Optuna's own ``RetryHeartbeatStaleTrialCallback``, as on PostgreSQL. A trial is
  therefore failed between ``grace_period`` and ``grace_period + heartbeat_interval`` plus one look
  (the workers look at most once a second) after its worker stopped, counted from the first look of
  a worker that was already running; a trial that never beat (its worker stopped while claiming it)
  after the longest storage retry delay more, since a live worker may wait that long between two
  tries of its claim. A worker starts its trial's heartbeat right after the claim, before any other
  storage call of the trial (oomtune.search.workers).
- **Reconnection.** A call made while the proxy is down fails with gRPC's ``UNAVAILABLE`` (one
  waiting for a handler when the proxy shut down, with ``CANCELLED``: grpc/grpc#41785); every
  storage call is retried with backoff (:func:`oomtune.study.reconnect.retrying`, one line per
  retry), and the channel tries to reconnect at least every :data:`RECONNECT_BACKOFF_MS` ms (gRPC's
  own backoff grows to 120 s), so a restarted proxy is used again within about a second.
- **One writer of best.yaml.** oomtune records the study's answer once with a database INSERT that
  a unique key lets exactly one writer commit (:func:`oomtune.study.storage.record_once`); the proxy
  offers no such call, so the winner is whoever creates the study :data:`LOCK_PREFIX` + name first
  (``create_new_study`` on the proxy's database: a unique study name, ``ALREADY_EXISTS`` for the
  others). These lock studies are left out of oomtune's study listings.

Not supported through the proxy: a JournalStorage behind it (Optuna's own limitation,
``run_grpc_proxy_server``'s documentation), and the batched writes of
:mod:`oomtune.search.trial_writes` (the Trial API's one call per value is used instead).
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
import warnings
from typing import Any, Callable

from oomtune.exceptions import ConfigError
from oomtune.study.lock_study import LOCK_PREFIX, is_lock_study, record_once_by_lock_study

__all__ = ["SCHEME", "HEARTBEAT_ATTR", "LOCK_PREFIX", "RECONNECT_BACKOFF_MS", "is_grpc_url", "parse_grpc_url",
           "grpc_storage_class", "make_grpc_storage", "is_lock_study", "check_installed"]

SCHEME = "grpc://"
#: A running trial's heartbeat through the proxy (a trial system attribute: [writer token, count]).
HEARTBEAT_ATTR = "oomtune:heartbeat"
#: The longest wait of the client's channel between two tries to reach a proxy that went away.
RECONNECT_BACKOFF_MS = 1000
#: Seconds a new client waits for the proxy to answer before the storage counts as unreachable.
READY_TIMEOUT_S = 10.0


def is_grpc_url(url: Any) -> bool:
    """Whether ``url`` names a gRPC storage proxy (``grpc://HOST:PORT``)."""
    return str(url).startswith(SCHEME)


def parse_grpc_url(url: str) -> tuple[str, int]:
    """``grpc://HOST:PORT`` -> ``(HOST, PORT)`` (an IPv6 host in brackets, ``grpc://[::1]:13000``).

    Raises:
        ConfigError: not of that form, or a port outside 1..65535.
    """
    m = re.fullmatch(r"grpc://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})/?", str(url))
    if m is None or not 0 < int(m.group(2)) < 65536:
        raise ConfigError(f"storage={url}: a gRPC storage proxy is named grpc://HOST:PORT (e.g. grpc://dbhost:13000, "
                          "served by: oomtune storage-proxy --storage postgresql://... --port 13000)")
    return m.group(1).strip("[]"), int(m.group(2))


def check_installed(what: str) -> None:
    """Refuse, in one line, where gRPC's Python modules (``grpc``, ``google.protobuf``) are missing.

    Raises:
        ConfigError: naming ``what`` needs them and the install command.
    """
    import importlib.util

    missing = [name for name in ("grpc", "google.protobuf") if _find(importlib.util, name) is None]
    if missing:
        raise ConfigError(f"{what} needs gRPC (Python modules {', '.join(missing)} are not installed): "
                          "pip install 'oomtune[cluster]' (or pip install grpcio protobuf)")


def _find(util: Any, name: str) -> Any:
    try:
        return util.find_spec(name)
    except (ImportError, ValueError):
        return None


_CLASS: list[type] = []


def grpc_storage_class() -> type:
    """Optuna's ``GrpcStorageProxy`` with heartbeats, reconnection and a one-writer record (see the
    module docstring); made on first use (gRPC is an optional dependency).

    Constructor: ``cls(host=..., port=..., heartbeat_interval=S, grace_period=S, say=None,
    stale_callback=None)``; ``say`` prints the retry lines, ``stale_callback`` is Optuna's
    heartbeat-stale callback (``RetryHeartbeatStaleTrialCallback``)."""
    if _CLASS:
        return _CLASS[0]
    import grpc
    from optuna.exceptions import UpdateFinishedTrialError
    from optuna.storages import GrpcStorageProxy
    from optuna.storages._grpc.auto_generated import api_pb2_grpc
    from optuna.storages._grpc.client import GrpcClientCache
    from optuna.storages._heartbeat import BaseHeartbeat
    from optuna.trial import TrialState

    from oomtune.study.reconnect import _METHODS, _first_line, is_connection_error, retrying

    def wrap(name: str) -> Callable[..., Any]:
        what = _METHODS.get(name, name.replace("_", " "))

        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            base = getattr(GrpcStorageProxy, name)
            return retrying(lambda: self._noting_outages(base, *args, **kwargs), what, say=self.say)

        method.__name__, method.__doc__ = name, getattr(GrpcStorageProxy, name).__doc__
        return method

    class HeartbeatGrpcStorageProxy(GrpcStorageProxy, BaseHeartbeat):
        __doc__ = grpc_storage_class.__doc__

        def __init__(self, *, host: str, port: int, heartbeat_interval: int | None = None,
                     grace_period: int | None = None, say: Callable[[str], None] | None = None,
                     stale_callback: Any = None) -> None:
            self.say = say
            self.heartbeat_interval = heartbeat_interval
            self.grace_period = grace_period if grace_period is not None else 2 * (heartbeat_interval or 60)
            self.stale_callback = stale_callback
            self._init_local()
            with warnings.catch_warnings():   # ExperimentalWarning: the proxy exists since Optuna 4.2
                warnings.simplefilter("ignore")
                GrpcStorageProxy.__init__(self, host=host, port=port)

        def _noting_outages(self, base: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            """``base(self, ...)``; a lost connection is noted (:attr:`_outage_at`) and raised on."""
            try:
                return base(self, *args, **kwargs)
            except Exception as exc:
                if is_connection_error(exc):
                    self._outage_at = time.monotonic()
                raise

        def _init_local(self) -> None:
            self._outage_at = float("-inf")          # monotonic s of this process's last lost call
            self._lock = threading.Lock()
            self._token = uuid.uuid4().hex[:12]       # this process's heartbeats differ from any other's
            self._beats: dict[int, int] = {}          # trial id -> beats recorded by this process
            self._seen: dict[int, tuple[str, float]] = {}   # trial id -> (heartbeat, first seen: monotonic s)

        def _setup(self) -> None:
            # GrpcStorageProxy._setup with a bounded reconnect backoff (gRPC's default grows to 120 s)
            self._channel = grpc.insecure_channel(f"{self._host}:{self._port}", options=[
                ("grpc.max_receive_message_length", -1),
                ("grpc.initial_reconnect_backoff_ms", min(500, RECONNECT_BACKOFF_MS)),
                ("grpc.min_reconnect_backoff_ms", min(500, RECONNECT_BACKOFF_MS)),
                ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS)])
            self._stub = api_pb2_grpc.StorageServiceStub(self._channel)
            self._cache = GrpcClientCache(self._stub)

        def __getstate__(self) -> dict[Any, Any]:
            state = GrpcStorageProxy.__getstate__(self)
            for key in ("_lock", "_beats", "_seen", "say"):
                state.pop(key, None)
            return state

        def __setstate__(self, state: dict[Any, Any]) -> None:
            self.say = None
            self._init_local()
            GrpcStorageProxy.__setstate__(self, state)

        # ------------------------------------------------------------ committed before a lost reply
        def set_trial_state_values(self, trial_id: int, state: Any, values: Any = None) -> bool:
            """Optuna's call, retried; a retry that finds the trial already finished in the state
            being set had committed before the reply was lost: success, as on PostgreSQL
            (:func:`oomtune.study.reconnect.reconnecting_storage_class`)."""
            attempts: list[int] = []

            def call() -> bool:
                attempts.append(1)
                try:
                    return self._noting_outages(GrpcStorageProxy.set_trial_state_values, trial_id, state, values)
                except UpdateFinishedTrialError:
                    if len(attempts) > 1 and GrpcStorageProxy.get_trial(self, trial_id).state == state:
                        return True
                    raise

            done = retrying(call, "store a trial's state", say=self.say)
            if state.is_finished():
                with self._lock:
                    self._beats.pop(trial_id, None)
            return done

        # ------------------------------------------------------------ heartbeats (BaseHeartbeat)
        def record_heartbeat(self, trial_id: int) -> None:
            """One beat: the trial's :data:`HEARTBEAT_ATTR` set to ``[token, count]``. Not retried:
            a beat that cannot be written is skipped with one line (the next one tries again), and a
            trial finished meanwhile has nothing to beat for."""
            with self._lock:
                count = self._beats[trial_id] = self._beats.get(trial_id, 0) + 1
            try:
                GrpcStorageProxy.set_trial_system_attr(self, trial_id, HEARTBEAT_ATTR, [self._token, count])
            except UpdateFinishedTrialError:
                return
            except Exception as exc:  # noqa: BLE001 - classified; the heartbeat thread must live on
                if not is_connection_error(exc):
                    raise
                self._outage_at = time.monotonic()
                if self.say is not None:
                    self.say(f"storage connection lost while recording a heartbeat: {_first_line(exc)}; next try "
                             f"in {self.heartbeat_interval} s")

        def _get_stale_trial_ids(self, study_id: int) -> list[int]:
            """RUNNING trials whose heartbeat value this process has seen unchanged for more than
            ``grace_period`` seconds of its monotonic clock, all of them while this process reached
            the proxy (an outage restarts the count: the trial's worker could not beat through it
            either). A trial that never beat (claimed, its heartbeat not started yet) gets the
            longest storage retry delay more (:func:`oomtune.study.reconnect.retry_schedule`, 30 s by
            default): its worker may be waiting that long between two tries of its claim."""
            from oomtune.study.reconnect import retry_schedule

            now = time.monotonic()
            # a trial that never beat is still being claimed: its worker's storage calls may be waiting
            # out an outage between two tries (up to the schedule's longest delay) before its heartbeat
            # thread starts (right after the claim: oomtune.search.workers)
            claiming_s = max(retry_schedule(), default=0.0)
            running = self.get_all_trials(study_id, deepcopy=False, states=(TrialState.RUNNING,))
            stale, alive = [], set()
            with self._lock:
                for trial in running:
                    alive.add(trial._trial_id)
                    beat = json.dumps(trial.system_attrs.get(HEARTBEAT_ATTR))
                    seen = self._seen.get(trial._trial_id)
                    # unchanged while this process itself could not reach the proxy says nothing of the
                    # trial's worker (its beats failed too): its clock restarts after an outage
                    if seen is None or seen[0] != beat or seen[1] <= self._outage_at:
                        self._seen[trial._trial_id] = (beat, now)
                    elif now - seen[1] > self.grace_period + (claiming_s if beat == "null" else 0.0):
                        stale.append(trial._trial_id)
                for trial_id in [t for t in self._seen if t not in alive]:
                    del self._seen[trial_id]
            return stale

        def get_heartbeat_interval(self) -> int | None:
            return self.heartbeat_interval

        def get_heartbeat_stale_trial_callback(self) -> Any:
            return self.stale_callback

        # ------------------------------------------------------------ one writer
        def record_once(self, study_id: int, study_name: str, key: str, value: Any,
                        wait_s: float = 120.0) -> Any:
            """The study system attribute ``key``: ``value`` unless one is stored; the stored one.
            Exactly one writer: the one that creates the study ``LOCK_PREFIX + study_name + ":" + key``
            (unique study names: the others get ``ALREADY_EXISTS``). A loser waits up to ``wait_s``
            for the winner's value; past that (the winner stopped between its lock and its write) it
            stores its own."""
            stored = self.get_study_system_attrs(study_id).get(key)
            if stored is not None:
                return stored
            return record_once_by_lock_study(self, study_id, study_name, key, value, wait_s=wait_s, poll_s=0.5)

    names = ("create_new_study", "delete_study", "set_study_user_attr", "set_study_system_attr",
             "get_study_id_from_name", "get_study_name_from_id", "get_study_directions", "get_study_user_attrs",
             "get_study_system_attrs", "get_all_studies", "create_new_trial", "set_trial_param",
             "set_trial_intermediate_value", "set_trial_user_attr", "set_trial_system_attr",
             "get_trial_id_from_study_id_trial_number", "get_trial", "get_all_trials")
    for name in names:
        setattr(HeartbeatGrpcStorageProxy, name, wrap(name))
    HeartbeatGrpcStorageProxy.__module__ = __name__
    globals()["HeartbeatGrpcStorageProxy"] = HeartbeatGrpcStorageProxy   # picklable by name
    _CLASS.append(HeartbeatGrpcStorageProxy)
    return HeartbeatGrpcStorageProxy


def make_grpc_storage(url: str, *, heartbeat_interval_s: int | None = None, grace_period_s: int | None = None,
                      say: Callable[[str], None] | None = None, stale_callback: Any = None,
                      ready_timeout_s: float = READY_TIMEOUT_S) -> Any:
    """The client of the proxy at ``url`` (:func:`grpc_storage_class`), once the proxy answers.

    Raises:
        ConfigError: a malformed URL, gRPC not installed, or no proxy answering there within
            ``ready_timeout_s`` (one line naming how to start one).
    """
    host, port = parse_grpc_url(url)
    check_installed(f"storage={url}")
    storage = grpc_storage_class()(host=host, port=port, heartbeat_interval=heartbeat_interval_s,
                                   grace_period=grace_period_s, say=say, stale_callback=stale_callback)
    try:
        storage.wait_server_ready(timeout=ready_timeout_s)
    except ConnectionError:
        storage.close()
        raise ConfigError(f"cannot open storage {url!r}: no storage proxy answered at {host}:{port} within "
                          f"{ready_timeout_s:g} s; start one there: oomtune storage-proxy --storage "
                          f"postgresql://USER@DBHOST/DB --host {host} --port {port}") from None
    return storage
