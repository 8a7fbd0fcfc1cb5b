"""A standby mirror of the store (``cellstream mirror``, :mod:`logstore.mirror`)::

  cellstream mirror run --store A --to B [--once] [--page N] [--metrics-port PORT]
  cellstream mirror status --store A --to B
  cellstream mirror promote --to B [--burn N]

``run`` keeps B a copy of A with the same added_ids until stopped (Ctrl-C, SIGTERM); ``--once`` copies what A
holds now and exits. B is a store URL (its password as ``--store``'s: ``--store-password-file`` or
CELLSTREAM_STORE_PASSWORD) or a cluster file; it is created with A's shard count when missing.
``status`` prints how far B is behind (shards, cells, the age of the oldest cell not copied). While a mirror,
B refuses every other write (exit 4); ``promote`` makes it writable, its next ids above any A gave since.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from cellstream.cli.common import Output, Parser, store_with_password
from cellstream.cli.exits import Exit

if TYPE_CHECKING:
    from logstore import Store


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("mirror", help="keep another instance a copy of --store with the same added_ids")
    actions = p.add_subparsers(dest="action", required=True, parser_class=Parser)
    for action, text, run in (("run", "copy --store into --to until stopped (--once: what it holds now)", cmd_run),
                              ("status", "how far --to is behind --store", cmd_status)):
        a = actions.add_parser(action, parents=[common], help=text)
        a.add_argument("--to", required=True, metavar="URL|CLUSTER", help="the mirror: a store URL or a cluster file")
        if action == "run":
            a.add_argument("--once", action="store_true", help="copy what --store holds now, then exit")
            a.add_argument("--page", type=int, default=1000, metavar="N", help="cells read from a shard at once")
            a.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")
        a.set_defaults(run=run)
    a = actions.add_parser("promote", parents=[common], help="make the mirror --to writable (a site switchover)")
    a.add_argument("--to", required=True, metavar="URL|CLUSTER", help="the mirror: a store URL or a cluster file")
    a.add_argument("--burn", type=int, default=1_000_000, metavar="N",
                   help="ids each shard skips: more than the cells of one shard the mirror may lack (1,000,000)")
    a.set_defaults(run=cmd_promote, with_store=False)


def _target(args: argparse.Namespace) -> str:
    target = store_with_password(args.to, getattr(args, "store_password_file", None), sys.argv)
    assert target is not None
    return target


def cmd_run(store: Store, args: argparse.Namespace, out: Output) -> int:
    import logstore
    from cellstream.errors import UsageError
    from logstore.mirror import Mirror, MirrorPass, mirror_lag

    if args.page < 1:
        raise UsageError("--page must be at least 1")
    with logstore.open(_target(args), shards=store.shard_count) as target:
        mirror = Mirror(store, target, page_size=args.page, source_name=_shown(args.store))
        gauges = _metrics(args.metrics_port, store, target, mirror) if args.metrics_port is not None else None
        if args.once:
            total = 0
            while (done := mirror.copy()).copied:
                total += done.copied
            consumers = mirror.copy_offsets()
            lag = mirror_lag(store, target)
            out.emit({"copied": total, "consumers": consumers, "stalled": {str(s): w for s, w in done.stalled.items()},
                      "shards_behind": lag.shards_behind},
                     f"copied {total:,} cells and {consumers} consumers' offsets; {lag.shards_behind} shards "
                     "behind" + (f"; {len(done.stalled)} shards stopped on a cell the source cannot decode"
                                 if done.stalled else ""))
            return Exit.OK if not done.stalled else Exit.FAILED
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        last = [time.monotonic()]

        def report(done: MirrorPass) -> None:
            if gauges is not None:
                gauges(done)
            if time.monotonic() - last[0] >= 10:
                last[0] = time.monotonic()
                out.emit({"copied": mirror.copied}, f"mirror: {mirror.copied:,} cells copied")
        out.emit({"running": True}, "mirror: copying until stopped (Ctrl-C)")
        mirror.run(stop, on_pass=report)
        out.emit({"copied": mirror.copied, "stopped": True}, f"mirror stopped: {mirror.copied:,} cells copied")
    return Exit.OK


def _metrics(port: int, source: Store, target: Store, mirror: Any) -> Any:
    """Serve the mirror's metrics; returns what updates them after each pass."""
    from logstore.mirror import MirrorMetrics, MirrorPass, mirror_lag

    metrics = MirrorMetrics()
    metrics.serve(port)
    checked = [0.0]

    def update(done: MirrorPass) -> None:
        metrics.passed(done)
        if time.monotonic() - checked[0] >= 1.0:  # a lag read costs reads of both stores: once a second
            checked[0] = time.monotonic()
            metrics.lagged(mirror_lag(source, target))
    return update


def _shown(store: str) -> str:
    from logstore.registry import is_url, parse_node_url

    return parse_node_url(store).redacted() if is_url(store) else store


def cmd_promote(args: argparse.Namespace, out: Output) -> int:
    import logstore
    from logstore.mirror import promote_mirror

    with logstore.open(_target(args), create=False) as target:
        done = promote_mirror(target, burn=args.burn)
    out.emit(done._asdict(), f"the mirror of {done.was_mirror_of} is writable now; {done.burnt_shards} shards skip "
                             f"{done.burn:,} ids")
    return Exit.OK


def cmd_status(store: Store, args: argparse.Namespace, out: Output) -> int:
    import logstore
    from logstore.mirror import mirror_lag

    with logstore.open(_target(args), create=False) as target:
        lag = mirror_lag(store, target)
    behind = ", ".join(f"shard {s}: {theirs} / {ours}" for s, (theirs, ours) in list(lag.behind.items())[:5])
    out.emit({"shards_behind": lag.shards_behind, "cells": lag.cells, "seconds": lag.seconds,
              "behind": {str(s): {"source": t, "mirror": o} for s, (t, o) in lag.behind.items()}},
             "caught up" if not lag.shards_behind else
             f"{lag.shards_behind} shards behind, {lag.cells:,} cells, the oldest {lag.seconds:.1f} s old "
             f"(head on the source / on the mirror: {behind})")
    return Exit.OK
