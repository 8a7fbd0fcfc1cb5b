"""The ``cellstream`` command: builds the parser from every command module's ``register`` and runs
the chosen command.

A command module registers its parsers with ``register(subparsers, common)`` and sets
``run`` (and ``with_store=False`` when it opens no store itself) on each; it imports
what it needs when it runs, so ``--help`` and ``--version`` load no driver. Errors
are reported in one line and mapped to exit codes by one table,
:func:`cellstream.cli.exits.exit_code` (also in the docs).
"""

from __future__ import annotations

import argparse
import io
import os
import sys
from collections.abc import Sequence

from cellstream import __version__
from cellstream.cli import (
    apps,
    backup,
    cells,
    connect,
    console,
    demo,
    indexes,
    jobs,
    logsetup,
    migrate,
    mirror,
    nodes,
    offsets,
    replay,
    serve,
    tail,
)
from cellstream.cli.common import Output, Parser, common_options, store_with_password
from cellstream.cli.exits import Exit, fail
from cellstream.errors import UsageError
from logstore.errors import CellstreamError

COMMANDS = (cells, nodes, tail, apps, indexes, connect, jobs, serve, console, demo, backup, mirror, migrate,
            offsets, replay)


def build_parser() -> argparse.ArgumentParser:
    common = common_options()
    parser = Parser(prog="cellstream", description="cellstream: log streaming over a sharded cell store")
    parser.add_argument("--version", action="version", version=f"cellstream {__version__}")
    common_options(parser)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for command in COMMANDS:
        command.register(sub, common)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        logsetup.configure(args.log_format, args.verbose)
        out = Output(args.json, sys.stdout)
        # Every command's store, the demo's too: a password kept off the command line filled in.
        args.store = store_with_password(args.store, getattr(args, "store_password_file", None), sys.argv)
        if getattr(args, "limit", None) is not None and args.limit < 1:
            raise UsageError("--limit must be at least 1")
        if not getattr(args, "with_store", True):
            return int(args.run(args, out))
        if not args.store:
            raise UsageError("no store given: pass --store URL or set CELLSTREAM_STORE")
        import logstore

        # Only commands that write create a store; a read of a missing one is StoreNotFoundError (exit 4).
        with logstore.open(args.store, shards=getattr(args, "shards", None),
                           create=getattr(args, "creates_store", False)) as store:
            return int(args.run(store, args, out))
    except BrokenPipeError:
        # The reader of stdout went away (`cellstream log 1 | head`): nothing to tell it. The Python docs'
        # recipe: point stdout at devnull, so that the interpreter's last flush at exit does not fail again.
        _drop_stdout()
        return Exit.BROKEN_PIPE
    except (CellstreamError, OSError, UnicodeDecodeError) as exc:
        return fail(exc)
    except KeyboardInterrupt:
        return Exit.INTERRUPTED


def _drop_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, io.UnsupportedOperation):
        pass  # stdout is no file (a test's capture): nothing will flush into a closed pipe
