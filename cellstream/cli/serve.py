"""``cellstream serve``: run a worker node, the logstore API over HTTP (:mod:`logstore.node.server`).

  cellstream serve --store CLUSTER [--bind HOST:PORT] [--token-file FILE] [--max-body-bytes N] [--threads N]

The token comes from ``--token-file`` or the CELLSTREAM_TOKEN environment variable,
never from the command line (other users can read it there). Without one the node
listens on loopback only, and says so. The first line printed is the node's URL
(with ``--json``: ``{"url", "token_required"}``); it runs until SIGTERM or SIGINT.
Clients: ``logstore.open("http://HOST:PORT", token=...)``, or any command's
``--store http://HOST:PORT``. Exit codes: 0 stopped by a signal, 2 a bad option,
4 cannot listen there or the store's configuration is wrong, 5 a storage node
unavailable at start.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
from collections.abc import Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cellstream.cli.common import Output
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
    p.add_argument("--max-body-bytes", type=int, default=8 << 20, help="larger request bodies get 413")
    p.add_argument("--threads", type=int, default=8, help="blocking store calls at once")
    p.set_defaults(run=run, creates_store=True)  # a worker node takes writes


def _bind(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535 or not host:
        raise InvalidArgumentError(f"--bind {text!r}: expected HOST:PORT, e.g. 127.0.0.1:8080")
    return host.strip("[]"), int(port)


def _token(args: argparse.Namespace) -> str | None:
    if args.token_file is not None:
        try:
            token = args.token_file.read_text().strip()
        except OSError as exc:
            raise InvalidArgumentError(f"--token-file {args.token_file}: {exc.strerror}") from None
        if not token:
            raise InvalidArgumentError(f"--token-file {args.token_file} is empty")
        return str(token)
    return os.environ.get("CELLSTREAM_TOKEN") or None


def run(store: Store, args: argparse.Namespace, out: Output) -> int:
    from logstore.extras import require

    require("server", "cellstream serve")
    from logstore.node.server import ServerConfig, check_bind

    host, port = _bind(args.bind)
    token = _token(args)
    check_bind(host, token)
    try:
        config = ServerConfig(host=host, port=port, token=token, max_body_bytes=args.max_body_bytes,
                              threads=args.threads)
    except ValueError as exc:  # pydantic's, for --max-body-bytes or --threads
        raise InvalidArgumentError(str(exc).splitlines()[-1].strip()) from None
    return _run(_serve(store, config, out))


def _run(main: Coroutine[Any, Any, int]) -> int:
    """On uvloop where it is installed (Linux, macOS): it halves the event loop's share of a request."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


async def _serve(store: Store, config: ServerConfig, out: Output) -> int:
    from logstore.node.server import WorkerNode

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        async with WorkerNode(store, config) as node:
            required = config.token is not None
            if out.as_json:
                out.emit({"url": node.url, "token_required": required}, "")
            else:
                print(node.url, file=out.out, flush=True)
                if not required:
                    print("cellstream serve: no token configured: listening on loopback only, unauthenticated",
                          file=out.out, flush=True)
            await stop.wait()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(ValueError, RuntimeError):
                loop.remove_signal_handler(sig)
    return Exit.OK
