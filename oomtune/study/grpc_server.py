"""``oomtune storage-proxy``: Optuna's gRPC storage proxy in front of the study storage oomtune opens
for a search, so that workers reach it with ``storage=grpc://HOST:PORT``
(:mod:`oomtune.study.grpc_proxy`, the client side)."""

from __future__ import annotations

import threading
from typing import Callable

from oomtune.exceptions import ConfigError
from oomtune.study.grpc_proxy import check_installed, is_grpc_url
from oomtune.study.storage import make_storage

__all__ = ["serve"]


def serve(storage_url: str, *, host: str, port: int, threads: int, say: Callable[[str], None],
          stop: threading.Event | None = None) -> None:
    """Serve the study storage at ``storage_url`` as Optuna's gRPC storage proxy on ``host:port``
    until ``stop`` is set or the process is interrupted: what ``optuna.storages.run_grpc_proxy_server``
    does (``make_server``, ``start``, wait; ``SO_REUSEPORT`` off), with the storage oomtune opens for a search
    (:func:`oomtune.study.storage.make_storage`: calls outlast a restart of the database server) in
    Optuna's per-process cache (``optuna.storages.get_storage``, as that function's documentation
    asks), ``threads`` server threads, and one line once it listens.

    Raises:
        ConfigError: a storage the proxy cannot serve (another proxy, a journal file, one that
            cannot be opened) or an address it cannot listen on; one line.
    """
    from concurrent.futures import ThreadPoolExecutor

    check_installed("oomtune storage-proxy")
    if is_grpc_url(storage_url):
        raise ConfigError(f"--storage {storage_url}: that is a storage proxy itself; give the database behind it "
                          "(--storage postgresql://USER@HOST/DB)")
    if str(storage_url).startswith("journal:"):
        raise ConfigError(f"--storage {storage_url}: Optuna's gRPC proxy does not serve a JournalStorage "
                          "(run_grpc_proxy_server's documentation); give a database URL (postgresql://...)")
    import grpc
    import optuna
    from optuna.storages._grpc.auto_generated import api_pb2_grpc
    from optuna.storages._grpc.servicer import OptunaStorageProxyService

    optuna.logging.set_verbosity(optuna.logging.WARNING)   # not a line per study created
    storage = optuna.storages.get_storage(make_storage(storage_url, say=say))
    # optuna.storages._grpc.server.make_server, without SO_REUSEPORT (gRPC's default on Linux): a second
    # proxy on a port in use must fail, not share the port and answer half the calls
    server = grpc.server(ThreadPoolExecutor(max_workers=threads), options=[("grpc.so_reuseport", 0)])
    api_pb2_grpc.add_StorageServiceServicer_to_server(OptunaStorageProxyService(storage), server)
    try:
        server.add_insecure_port(f"{host}:{port}")
    except RuntimeError as exc:   # grpc: "Failed to bind to address ..."
        raise ConfigError(f"oomtune storage-proxy: cannot listen on {host}:{port}: {str(exc).split(';')[0]} "
                          "(another process on that port? choose --port)") from None
    from oomtune.runfile import redact

    server.start()
    say(f"oomtune storage-proxy: serving {redact(storage_url)} on {host}:{port} ({threads} threads); workers use "
        f"storage=grpc://{host}:{port}; Ctrl-C or SIGTERM stops it")
    try:
        from oomtune.interrupts import raise_if_pending

        # in slices, so that a stop signal whose raise CPython dropped (oomtune.interrupts) still stops it
        if stop is None:
            while server.wait_for_termination(timeout=0.5):   # True: the timeout was reached
                raise_if_pending()
        else:
            while not stop.wait(0.2):
                raise_if_pending()
    finally:
        server.stop(grace=2).wait()
        say("oomtune storage-proxy: stopped")
