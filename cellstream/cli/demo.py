"""``cellstream demo``: the pipeline on a throwaway embedded store (see :mod:`cellstream.demo`)."""

from __future__ import annotations

import argparse
from typing import Any

from cellstream.cli.common import Output


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    # The demo ignores CELLSTREAM_STORE: it writes demo data, so only an explicit --store is used.
    p = sub.add_parser("demo", help="run the pipeline demo (a throwaway embedded store by default)")
    p.add_argument("--store", default=None, help="run against this store instead (it receives demo cells)")
    p.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("-v", "--verbose", action="store_true", help="log to stderr")
    p.set_defaults(run=run, with_store=False)


def run(args: argparse.Namespace, out: Output) -> int:
    from cellstream.demo import run_demo

    return run_demo(args.store, out.out)
