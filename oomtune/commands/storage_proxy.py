"""``oomtune storage-proxy``: Optuna's gRPC storage proxy in front of the study's database, for many
workers (``storage=grpc://HOST:PORT``; see :mod:`oomtune.study.grpc_proxy`).

    oomtune storage-proxy --storage postgresql://USER@DBHOST/DB [--host H] [--port P] [--threads N]

Runs in the foreground until Ctrl-C or SIGTERM. The channel is not encrypted or authenticated (as
Optuna's proxy): listen on an address only the workers reach.
"""

from __future__ import annotations

import argparse

__all__ = ["register", "run"]


def register(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "storage-proxy",
        help="serve a study database to many workers through Optuna's gRPC storage proxy",
        description="Serve the database at --storage through Optuna's gRPC storage proxy; searches then use "
        "storage=grpc://HOST:PORT (docs/scale-out.md). Runs until Ctrl-C or SIGTERM.",
    )
    p.add_argument("--storage", required=True, help="the database behind the proxy, e.g. postgresql://user@host/db")
    p.add_argument("--host", default="localhost",
                   help="address to listen on (default localhost; 0.0.0.0 for workers on other machines)")
    p.add_argument("--port", type=int, default=13000, help="port to listen on (default 13000, Optuna's)")
    p.add_argument("--threads", type=int, default=32,
                   help="server threads, each serving one call at a time (default 32; Optuna's own: 10)")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    import os
    import signal
    import sys

    # gRPC's core logs its own errors to stderr (a failed bind as an "E1204 ... add_port.cc" line) beside
    # oomtune's one line: quiet unless asked for (GRPC_VERBOSITY=debug|info|error)
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")

    from oomtune.exceptions import ConfigError
    from oomtune import interrupts
    from oomtune.study.grpc_server import serve

    if not 0 < args.port < 65536:
        raise ConfigError(f"--port {args.port}: give a port in 1..65535")
    if args.threads < 1:
        raise ConfigError(f"--threads {args.threads}: give at least 1")
    signal.signal(signal.SIGTERM, interrupts.handler)   # a clean stop: the CLI exits 143

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    serve(args.storage, host=args.host, port=args.port, threads=args.threads, say=say)
    return 0
