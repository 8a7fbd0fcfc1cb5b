"""``cellstream console``: the dead-letter console in the browser (:mod:`cellstream.console`).

  cellstream console --app MODULE:APP [--app CONNECTOR.yaml ...] [--store URL] [--bind HOST:PORT]
                     [--token-file FILE] [--tls-cert PEM --tls-key PEM] [--page-size N] [--allow-host NAME ...]
                     [--max-connections N] [--max-connections-per-client N] [--header-timeout S] [--body-timeout S]

Each ``--app`` is an app (``MODULE:APP``) or a connector's YAML file (then ``--store`` is needed, and an
app given with ``--store`` must use that store). The token people log in with comes from ``--token-file``
or CELLSTREAM_CONSOLE_TOKEN, never from the command line; without one the console listens on loopback
only and asks only for a name. A token has at least 16 characters; wrong ones are rate-limited per client
address. ``--allow-host`` and the connection limits as for ``cellstream serve``. The first line printed is
the console's URL (with ``--json``: ``{"url", "token_required", "apps"}``); it runs until SIGTERM or SIGINT,
and a replay under way stops after the entry it is on. Exit codes: 0 stopped by a signal, 2 a bad option,
4 an app, connector or store that cannot be loaded, or an address it cannot listen on, 5 the store unavailable.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cellstream.cli import logsetup
from cellstream.cli.common import Output, option_problem, parse_bind, stop_signals, strong_token
from cellstream.cli.exits import Exit
from cellstream.errors import UsageError

if TYPE_CHECKING:
    from cellstream.console import Console


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("console", parents=[common], help="the dead-letter console: a web page to triage dead letters")
    p.add_argument("--app", action="append", default=[], metavar="MODULE:APP|CONNECTOR.yaml",
                   help="an app or a connector whose dead letters to show (repeat for several)")
    p.add_argument("--bind", default="127.0.0.1:8090", metavar="HOST:PORT", help="where to listen")
    p.add_argument("--token-file", type=Path, default=None,
                   help="file holding the token people log in with (default: env CELLSTREAM_CONSOLE_TOKEN)")
    p.add_argument("--tls-cert", type=Path, default=None, help="PEM certificate (chain): serve HTTPS")
    p.add_argument("--tls-key", type=Path, default=None, help="PEM private key of --tls-cert")
    p.add_argument("--page-size", type=int, default=50, help="entries per page of the list")
    p.add_argument("--max-connections", type=int, default=1024, help="connections at once; more get 503")
    p.add_argument("--max-connections-per-client", type=int, default=64,
                   help="connections at once from one client address; more get 503")
    p.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds for a request's head and a TLS handshake; slower clients get 408")
    p.add_argument("--body-timeout", type=float, default=30.0, help="seconds for a request's body (a form)")
    p.add_argument("--allow-host", action="append", default=None, metavar="NAME",
                   help="a Host name the console answers besides IP addresses and localhost (repeatable; '*': "
                        "any; default: any with a token, none without)")
    p.set_defaults(run=run, with_store=False)


def run(args: argparse.Namespace, out: Output) -> int:
    from logstore.extras import require

    require("console", "cellstream console")
    from pydantic import SecretStr, ValidationError

    from cellstream.cli.apps import open_dlq_app
    from cellstream.console import Console, ConsoleConfig
    from logstore.config import parse_node_url

    if not args.app:
        raise UsageError("console needs at least one --app MODULE:APP (or a connector's YAML file with --store)")
    host, port = parse_bind(args.bind)
    token = strong_token(args.token_file, "--token-file", "CELLSTREAM_CONSOLE_TOKEN")
    try:
        config = ConsoleConfig(host=host, port=port, token=SecretStr(token) if token else None,
                               tls_cert=args.tls_cert, tls_key=args.tls_key, page_size=args.page_size,
                               max_connections=args.max_connections,
                               max_connections_per_client=args.max_connections_per_client,
                               header_timeout=args.header_timeout, body_timeout=args.body_timeout,
                               allowed_hosts=tuple(args.allow_host) if args.allow_host is not None else None)
    except ValidationError as exc:
        raise UsageError(option_problem(exc)) from None
    queues, stores = {}, []
    for spec in args.app:
        app = open_dlq_app(spec, args.store)
        if app.name in queues:
            raise UsageError(f"--app {spec}: an app named {app.name} is given twice")
        queues[app.name] = app.dlq
        target = app.store_target
        shown = parse_node_url(target).redacted() if isinstance(target, str) and "://" in target else str(target)
        if isinstance(target, str) and shown not in stores:
            stores.append(shown)
    console = Console(queues, config, store_label=", ".join(stores))
    return asyncio.run(_serve(console, out, args))


async def _serve(console: Console, out: Output, args: argparse.Namespace) -> int:
    async with stop_signals() as stop, console:
        required = console.sessions.token_required
        logsetup.starting("console", args, url=console.url, token_required=required, apps=console.catalog.apps)
        if out.as_json:
            out.emit({"url": console.url, "token_required": required, "apps": console.catalog.apps}, "")
        else:
            print(console.url, file=out.out, flush=True)
            if not required:
                print("cellstream console: no token configured: listening on loopback only", file=out.out,
                      flush=True)
        await stop.wait()
    return Exit.OK
