"""``cellstream serve``: run a worker node, the logstore API over HTTP (:mod:`logstore.node.server`).

  cellstream serve --store CLUSTER [--bind HOST:PORT] [--token-file FILE] [--admin-token-file FILE]
                   [--tls-cert PEM --tls-key PEM] [--max-body-bytes N] [--threads N]
                   [--max-connections N] [--max-connections-per-client N] [--header-timeout S]
                   [--body-timeout S] [--allow-host NAME ...]

The token comes from ``--token-file`` or the CELLSTREAM_TOKEN environment variable,
never from the command line (other users can read it there). Without one the node
listens on loopback only, and says so. The admin token (``--admin-token-file`` or
CELLSTREAM_ADMIN_TOKEN) is the only one that may write cellstream's own ``_`` columns
(an app whose dead letters go through the node uses it), and the only one that may claim
or commit a consumer's positions. Tokens have at least 16 characters. ``--allow-host``
names the Host names the node answers besides IP addresses and localhost (``*``: any;
the default with a token, none without). The first line printed is the
node's URL (with ``--json``: ``{"url", "token_required", "admin_token"}``); it runs until SIGTERM or SIGINT.
Clients: ``logstore.open("http://HOST:PORT", token=...)``, or any command's
``--store http://HOST:PORT``. Exit codes: 0 stopped by a signal, 2 a bad option,
4 cannot listen there or the store's configuration is wrong, 5 a storage node
unavailable at start.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cellstream.cli import logsetup
from cellstream.cli.common import Output, option_problem, parse_bind, stop_signals, strong_token
from cellstream.cli.exits import Exit
from logstore.errors import InvalidArgumentError

if TYPE_CHECKING:
    from logstore import Store
    from logstore.node.server import ServerConfig


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("serve", parents=[common], help="run a worker node: the logstore API over HTTP")
    p.add_argument("--bind", default="127.0.0.1:8080", metavar="HOST:PORT", help="where to listen")
    p.add_argument("--token-file", type=Path, default=None,
                   help="file holding the Bearer token every request must carry (default: env CELLSTREAM_TOKEN)")
    p.add_argument("--admin-token-file", type=Path, default=None,
                   help="file holding the token that may also write cellstream's own _ columns "
                        "(default: env CELLSTREAM_ADMIN_TOKEN)")
    p.add_argument("--tls-cert", type=Path, default=None, help="PEM certificate (chain): serve HTTPS")
    p.add_argument("--tls-key", type=Path, default=None, help="PEM private key of --tls-cert")
    p.add_argument("--max-body-bytes", type=int, default=8 << 20, help="larger request bodies get 413")
    p.add_argument("--threads", type=int, default=8, help="blocking store calls at once")
    p.add_argument("--max-connections", type=int, default=1024, help="connections at once; more get 503")
    p.add_argument("--max-connections-per-client", type=int, default=64,
                   help="connections at once from one client address; more get 503")
    p.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds for a request's head and a TLS handshake; slower clients get 408")
    p.add_argument("--body-timeout", type=float, default=30.0, help="seconds for a request's body")
    p.add_argument("--allow-host", action="append", default=None, metavar="NAME",
                   help="a Host name the node answers besides IP addresses and localhost (repeatable; '*': any; "
                        "default: any with a token, none without)")
    p.set_defaults(run=run, creates_store=True)  # a worker node takes writes


def run(store: Store, args: argparse.Namespace, out: Output) -> int:
    from logstore.extras import require

    require("server", "cellstream serve")
    from pydantic import ValidationError

    from logstore.node.server import ServerConfig, check_bind

    host, port = parse_bind(args.bind)
    token = strong_token(args.token_file, "--token-file", "CELLSTREAM_TOKEN")
    admin = strong_token(args.admin_token_file, "--admin-token-file", "CELLSTREAM_ADMIN_TOKEN")
    check_bind(host, token)
    try:
        config = ServerConfig(host=host, port=port, token=token, admin_token=admin, tls_cert=args.tls_cert,
                              tls_key=args.tls_key, max_body_bytes=args.max_body_bytes, threads=args.threads,
                              max_connections=args.max_connections,
                              max_connections_per_client=args.max_connections_per_client,
                              header_timeout=args.header_timeout,
                              body_timeout=args.body_timeout,
                              allowed_hosts=tuple(args.allow_host) if args.allow_host is not None else None)
    except ValueError as exc:  # pydantic's: the option's name and the problem
        if not isinstance(exc, ValidationError):
            raise InvalidArgumentError(str(exc)) from None
        raise InvalidArgumentError(option_problem(exc)) from None
    return _run(_serve(store, config, out, args))


def _run(main: Coroutine[Any, Any, int]) -> int:
    """On uvloop where it is installed (Linux, macOS): it halves the event loop's share of a request."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


async def _serve(store: Store, config: ServerConfig, out: Output, args: argparse.Namespace) -> int:
    from logstore.node.server import WorkerNode

    async with stop_signals() as stop, WorkerNode(store, config) as node:
        logsetup.starting("serve", args, url=node.url, token_required=config.token is not None,
                      admin_token=config.admin_token is not None)
        required = config.token is not None
        if out.as_json:
            out.emit({"url": node.url, "token_required": required, "admin_token": config.admin_token is not None},
                     "")
        else:
            print(node.url, file=out.out, flush=True)
            if not required:
                print("cellstream serve: no token configured: listening on loopback only, unauthenticated",
                      file=out.out, flush=True)
        await stop.wait()
    return Exit.OK
