"""``cellstream index``: query, build, switch and inspect secondary indexes.

  cellstream index query NAME key=value ... [--version V] [--scatter] [--limit N] [--order asc|desc]
  cellstream index backfill NAME --version V [--workers N] [--batch N]
  cellstream index activate NAME --version V
  cellstream index drop NAME --version V
  cellstream index status [NAME]
  cellstream index verify NAME [--version V] [--sample RATE] [--repair] [--show N]

In a query, ``key=value`` is equality and ``key=START..END`` a range (START included,
END excluded; either may be empty). Exit codes (:class:`cellstream.cli.exits.Exit`): 0 success
(verify: no mismatch left), 1 no such index or version, 2 bad input, 5 a server unreachable,
6 other failure, 8 verify found mismatches (and did not repair them all), 9 a version in the
wrong state.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING, Any

from cellstream.cli.common import Output
from cellstream.cli.exits import Exit
from cellstream.cli.progress import Bar
from indexer.errors import InvalidQueryError

if TYPE_CHECKING:
    from indexer.indexes.backfill import BackfillProgress
    from indexer.indexes.verify import VerifyProgress
    from logstore import Store


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("index", help="query, backfill, activate, drop and inspect secondary indexes")
    actions = p.add_subparsers(dest="action", required=True, parser_class=type(p))
    a = actions.add_parser("query", parents=[common], help="entries by key: NAME key=value ...")
    a.add_argument("name")
    a.add_argument("keys", nargs="*", metavar="KEY=VALUE", help="equality, or KEY=START..END for a range")
    a.add_argument("--version", type=int, default=None, help="query this version instead of the active one")
    a.add_argument("--scatter", action="store_true", help="allow a query without the shard field (every shard)")
    a.add_argument("--limit", type=int, default=100)
    a.add_argument("--order", choices=["asc", "desc"], default="asc")
    a = actions.add_parser("backfill", parents=[common], help="build a version from the shard logs (resumable)")
    a.add_argument("name")
    a.add_argument("--version", type=int, required=True)
    a.add_argument("--workers", type=int, default=4, help="shards read at once")
    a.add_argument("--batch", type=int, default=1000, help="cells per transaction")
    for action, text in (("activate", "make a backfilled version the one queries read"),
                         ("drop", "remove a version that is not active")):
        a = actions.add_parser(action, parents=[common], help=text)
        a.add_argument("name")
        a.add_argument("--version", type=int, required=True)
    a = actions.add_parser("status", parents=[common], help="versions, states, backfill progress and lag")
    a.add_argument("name", nargs="?")
    a = actions.add_parser("verify", parents=[common], help="compare entries with the cells; --repair fixes them")
    a.add_argument("name")
    a.add_argument("--version", type=int, default=None, help="verify this version instead of the active one")
    a.add_argument("--sample", type=_rate, default=1.0, metavar="RATE", help="the fraction of rows to check")
    a.add_argument("--repair", action="store_true", help="fix the mismatches found")
    a.add_argument("--show", type=int, default=20, metavar="N", help="mismatches to list (default 20)")
    p.set_defaults(run=run)


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a rate in (0, 1]")
    return value


def run(store: Store, args: argparse.Namespace, out: Output) -> int:
    return int(_ACTIONS[args.action](store, args, out))


def _query(store: Store, args: argparse.Namespace, out: Output) -> int:
    fields: dict[str, Any] = {}
    for item in args.keys:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise InvalidQueryError(f"{item!r} is not KEY=VALUE")
        start, dots, end = value.partition("..")
        fields[key] = (start or None, end or None) if dots else value
    from indexer.indexes.applier import Index

    index = Index(store, args.name, version=args.version)
    definition = index.definition
    typed = {k: _typed(definition.field(k).type if k in definition.keys else "str", v) for k, v in fields.items()}
    shard_field = definition.shard_field
    if not args.scatter and set(fields) <= set(definition.keys) and not isinstance(fields.get(shard_field), str):
        # The library's refusal names its argument (scatter=True); a command line's user needs the flag.
        raise InvalidQueryError(f"index {args.name}: a query without {shard_field}=VALUE reads every shard; "
                                "ask for it with --scatter")
    entries = index.query(limit=args.limit, order=args.order, scatter=args.scatter, **typed)
    for entry in entries:
        data = entry.to_json()
        out.emit(data, " ".join(f"{k}={v}" for k, v in data.items()))
    if not out.as_json:
        print(f"-- {len(entries)} entries (version {definition.version})", file=sys.stderr)
    return Exit.OK


def _typed(kind: str, value: Any) -> Any:
    """A command-line value as the JSON value the field's type takes (numbers and booleans parsed)."""
    if isinstance(value, tuple):
        return tuple(None if v is None else _typed(kind, v) for v in value)
    try:
        if kind == "int":
            return int(value)
        if kind == "float" or (kind == "datetime" and value.replace(".", "", 1).lstrip("-").isdigit()):
            return float(value)
    except ValueError:
        raise InvalidQueryError(f"{value!r} is not a number") from None
    if kind == "bool":
        if value not in ("true", "false"):
            raise InvalidQueryError(f"{value!r} is not true or false")
        return value == "true"
    return value


def _backfill(store: Store, args: argparse.Namespace, out: Output) -> int:
    from indexer.indexes.backfill import backfill
    from indexer.indexes.catalog import IndexCatalog

    column = IndexCatalog(store).get(args.name).version(args.version).definition.column
    with Bar(out, "cells", desc=f"{column} cells") as bar:
        def report(p: BackfillProgress) -> None:
            bar.show(p.cells_done, p.cells, f"shards {p.shards_done}/{p.shards}")
        result = backfill(store, args.name, args.version, batch=args.batch, workers=args.workers, progress=report)
    data = {"index": args.name, "version": args.version, "column": column, **result._asdict()}
    out.emit(data, f"index {args.name} version {args.version}: {result.shards} of {store.shard_count} shards done, "
                   f"{result.cells} {column} cells read, {result.applied} applied, {result.superseded} superseded, "
                   f"{result.dead_lettered} dead-lettered in {result.seconds:.1f}s")
    return Exit.OK


def _activate(store: Store, args: argparse.Namespace, out: Output) -> int:
    from indexer.indexes.catalog import IndexCatalog

    record = IndexCatalog(store).activate(args.name, args.version)
    out.emit({"index": args.name, "active": record.active}, f"index {args.name}: version {record.active} is active")
    return Exit.OK


def _drop(store: Store, args: argparse.Namespace, out: Output) -> int:
    from indexer.indexes.catalog import IndexCatalog

    IndexCatalog(store).drop(args.name, args.version)
    out.emit({"index": args.name, "dropped": args.version}, f"index {args.name}: version {args.version} dropped")
    return Exit.OK


def _status(store: Store, args: argparse.Namespace, out: Output) -> int:
    from indexer.indexes.applier import lag
    from indexer.indexes.catalog import IndexCatalog

    catalog = IndexCatalog(store)
    names = [args.name] if args.name else sorted({s.name for s in store.indexes.specs()})
    rows = []
    for name in names:
        record = catalog.get(name)
        for version, found in sorted(record.versions.items()):
            row: dict[str, Any] = {"index": name, "version": version, "state": found.state, "column":
                                   found.definition.column, "app": found.app}
            if found.state != "dropped":
                spec = found.definition.spec
                backfilled = store.indexes.positions(spec, "backfill")
                row["backfill_shards_done"] = sum(1 for p in backfilled.values() if p.location >= (p.target or 0))
                row["shards"] = store.shard_count
                started = time.perf_counter()
                row["lag_cells"], row["lag_seconds"] = lag(store, found.definition)
                row["lag_read_seconds"] = round(time.perf_counter() - started, 3)
            rows.append(row)
    for row in rows:
        out.emit(row, " ".join(f"{k}={v}" for k, v in row.items() if k != "lag_read_seconds"))
    if not rows:
        out.emit([], "no indexes")
    return Exit.OK


def _verify(store: Store, args: argparse.Namespace, out: Output) -> int:
    from indexer.indexes.verify import verify

    with Bar(out, "shards", desc="entries") as bar:
        def report(p: VerifyProgress) -> None:
            bar.show(p.shards_done, p.shards, desc="entries" if p.phase == "entries" else "log")
        result = verify(store, args.name, args.version, sample=args.sample, repair=args.repair, progress=report)
    counts = result.counts()
    left = len({m.row_key for m in result.mismatches}) - result.repaired
    data = {"index": result.name, "version": result.version, "shards": store.shard_count, "sample": result.sample,
            "rows": result.rows,
            "pending": result.pending, "entries": result.entries, "cells": result.cells, "mismatches": counts,
            "repaired": result.repaired, "changed": result.changed, "seconds": round(result.seconds, 3),
            "listed": [m.to_json() for m in result.mismatches[:max(0, args.show)]],
            "strays": [s._asdict() for s in result.strays], "strays_dropped": result.strays_dropped}
    for m in result.mismatches[:max(0, args.show)] if not out.as_json else ():
        print(f"{m.kind:<10} row {m.row_key} shard {m.shard} ref_key {m.ref_key}: {m.detail}")
    for s in result.strays[:max(0, args.show)] if not out.as_json else ():
        print(f"stray      {s.rows} rows of shard {s.shard} on node {s.node}, which does not hold it: "
              + ("the source copy of a move (drop-moved or --repair deletes it)" if s.moved
                 else "a move's copy before its switch (under way, or stopped)"))
    summary = ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items())) or "no mismatches"
    if result.strays:
        summary += f", {sum(s.rows for s in result.strays)} stray rows in {len(result.strays)} shards"
    repaired = f"; {result.repaired} rows repaired, {result.changed} changed meanwhile" if args.repair else ""
    if args.repair and result.strays:
        repaired += f", {result.strays_dropped} stray rows deleted"
    out.emit(data, f"index {result.name} version {result.version}: the entries and logs of {store.shard_count} "
                   f"shards read, {result.rows} rows checked ({result.pending} pending), {summary}{repaired}")
    return Exit.MISMATCH if left > 0 or result.strays_left > 0 else Exit.OK


_ACTIONS = {"query": _query, "backfill": _backfill, "activate": _activate, "drop": _drop, "status": _status,
            "verify": _verify}
