"""The store commands: ``init``, ``put``, ``get``, ``row``, ``log``, ``shards`` (``move``, ``drop-moved``,
``moving``, ``abort-move``, ``rebalance --plan|--apply``) and ``pending``. Each runs on the store of ``--store``."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TextIO

from cellstream.cli.common import Output, Parser, json_arg, poll_arg, time_arg
from cellstream.cli.exits import Exit
from cellstream.cli.nodes import job_options, weigh_options
from cellstream.errors import UsageError

if TYPE_CHECKING:
    from logstore import Store


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("init", parents=[common], help="create the instance (or check an existing one)")
    p.add_argument("--shards", type=int, default=None, help="shard count, fixed at creation (default 4096)")
    p.set_defaults(run=cmd_init, creates_store=True)

    p = sub.add_parser("put", parents=[common], help="write a cell (or --batch a JSON-lines file)")
    p.add_argument("row_key", nargs="?")
    p.add_argument("column", nargs="?")
    p.add_argument("ref_key", nargs="?")
    p.add_argument("body", nargs="?", help="JSON object; - reads it from stdin")
    p.add_argument("--batch", metavar="FILE", help="JSON lines of {row_key, column, ref_key, body}; - for stdin")
    p.set_defaults(run=cmd_put, creates_store=True)

    p = sub.add_parser("get", parents=[common], help="read a cell: the latest, or --ref REF")
    p.add_argument("row_key")
    p.add_argument("column")
    p.add_argument("--ref", type=int, default=None)
    p.set_defaults(run=cmd_get)

    p = sub.add_parser("row", parents=[common], help="the latest cell of every column of a row")
    p.add_argument("row_key")
    p.set_defaults(run=cmd_row)

    p = sub.add_parser("log", parents=[common], help="page through a shard's log")
    p.add_argument("shard", type=int)
    start = p.add_mutually_exclusive_group()
    start.add_argument("--from", dest="start", type=int, default=0, metavar="LOCATION",
                       help="print cells after this location (added_id)")
    start.add_argument("--since", type=time_arg, default=None, metavar="TIME",
                       help="print cells created at or after this ISO-8601 time")
    p.add_argument("--limit", type=int, default=None, help="stop after this many cells")
    p.add_argument("--columns", type=lambda s: s.split(","), default=None, help="comma-separated columns")
    p.add_argument("--follow", "-f", action="store_true", help="keep polling for new cells")
    p.add_argument("--poll", type=poll_arg, default=0.5, help="seconds between polls with --follow")
    p.set_defaults(run=cmd_log)

    p = sub.add_parser("shards", parents=[common], help="cells per storage node (and per shard); move shards")
    p.add_argument("--per-shard", action="store_true", help="after the totals, list the shards holding cells")
    p.add_argument("--all", action="store_true", help="after the totals, list every shard, empty ones too")
    p.set_defaults(run=cmd_shards)
    actions = p.add_subparsers(dest="action", required=False, parser_class=Parser)
    a = actions.add_parser("move", parents=[common], help="move shards to another MySQL node, online")
    a.add_argument("shard", type=int, nargs="+")
    a.add_argument("--to", required=True, metavar="NODE", help="the storage node (its name in the cluster file)")
    a.set_defaults(run=cmd_shards_move)
    a = actions.add_parser("drop-moved", parents=[common], help="drop the source copies of moved shards")
    a.add_argument("shard", type=int, nargs="+")
    a.set_defaults(run=cmd_shards_drop)
    a = actions.add_parser("moving", parents=[common], help="moves found half done on the nodes (a process died)")
    a.set_defaults(run=cmd_shards_moving)
    a = actions.add_parser("abort-move", parents=[common],
                           help="undo a half-done move before its switch (`shards move` finishes one instead)")
    a.add_argument("shard", type=int, nargs="+")
    a.set_defaults(run=cmd_shards_abort)
    a = actions.add_parser("rebalance", parents=[common], help="the shard moves that even out the storage nodes")
    how = a.add_mutually_exclusive_group(required=True)
    how.add_argument("--plan", action="store_true", help="print the moves, fewest first; nothing is moved")
    how.add_argument("--apply", action="store_true", help="run the moves as a resumable job (or resume the "
                                                          "rebalance job left unfinished)")
    a.add_argument("--drain", action="append", default=[], metavar="NODE",
                   help="plan moving every shard off NODE (repeatable)")
    a.add_argument("--max-moves", type=int, default=None, metavar="N", help="at most N moves")
    weigh_options(a)
    job_options(a)
    a.set_defaults(run=cmd_shards_rebalance)

    p = sub.add_parser("pending", parents=[common],
                       help="writes buffered while a primary was down, by the node they belong to and where they wait")
    p.add_argument("--replay", action="store_true", help="write them home now (a worker node does it every second)")
    p.add_argument("--wait", type=float, default=0.0, help="with --replay: keep trying this many seconds")
    p.set_defaults(run=cmd_pending)


# -- commands -------------------------------------------------------------------
def cmd_init(store: Store, args: argparse.Namespace, out: Output) -> int:
    out.emit({"shards": store.shard_count, "nodes": store.nodes},
             f"logstore ready: {store.shard_count} shards on {', '.join(store.nodes)}")
    return Exit.OK


def _batch_lines(stream: TextIO) -> Iterator[tuple[Any, Any, Any, Any]]:
    for number, line in enumerate(stream, 1):
        if not line.strip():
            continue
        item = json_arg(line, f"line {number}")
        if not isinstance(item, dict) or set(item) != {"row_key", "column", "ref_key", "body"}:
            raise UsageError(f"line {number}: expected an object with row_key, column, ref_key and body")
        yield item["row_key"], item["column"], item["ref_key"], item["body"]


def cmd_put(store: Store, args: argparse.Namespace, out: Output) -> int:
    if args.batch is not None:
        with (sys.stdin if args.batch == "-" else open(args.batch, encoding="utf-8")) as stream:
            cells = store.put_cells(list(_batch_lines(stream)))
        for cell in cells:
            out.cell(cell)
        return Exit.OK
    if args.row_key is None or args.column is None or args.ref_key is None or args.body is None:
        raise UsageError("put needs ROW_KEY COLUMN REF_KEY BODY (BODY is JSON, - reads stdin), or --batch FILE")
    try:
        ref_key = int(args.ref_key)
    except ValueError:
        raise UsageError(f"REF_KEY {args.ref_key!r} is not an integer") from None
    text = sys.stdin.read() if args.body == "-" else args.body
    out.cell(store.put_cell(args.row_key, args.column, ref_key, json_arg(text, "BODY")))
    return Exit.OK


def cmd_get(store: Store, args: argparse.Namespace, out: Output) -> int:
    if args.ref is None:
        cell = store.get_cell_latest(args.row_key, args.column)
    else:
        cell = store.get_cell(args.row_key, args.column, args.ref)
    if cell is None:
        where = f"{args.row_key} {args.column}" + ("" if args.ref is None else f"@{args.ref}")
        out.emit(None, f"no cell {where}")
        return Exit.NOT_FOUND
    out.cell(cell)
    return Exit.OK


def cmd_row(store: Store, args: argparse.Namespace, out: Output) -> int:
    row = store.get_row(args.row_key)
    if out.as_json:
        out.emit({column: cell.to_json() for column, cell in row.items()}, "")
    elif not row:
        out.emit(None, f"no cells for row {args.row_key}")
    for cell in [] if out.as_json else row.values():
        out.cell(cell)
    return Exit.OK if row else Exit.NOT_FOUND


def cmd_log(store: Store, args: argparse.Namespace, out: Output, sleep: Callable[[float], None] = time.sleep) -> int:
    location = args.start
    if args.since is not None:
        location = store.location_at(args.shard, args.since)
    printed = 0
    while args.limit is None or printed < args.limit:
        page_size = 1000 if args.limit is None else min(1000, args.limit - printed)
        cells, location = store.get_cells_for_shard(args.shard, location, page_size, columns=args.columns)
        for cell in cells:
            out.cell(cell)
        printed += len(cells)
        if not cells:
            if not args.follow:
                break
            sleep(args.poll)
    if not out.as_json and not args.follow:
        print(f"-- {printed} cells; next location {location}", file=sys.stderr)
    return Exit.OK


def cmd_shards(store: Store, args: argparse.Namespace, out: Output) -> int:
    """The totals, then each storage node's shards and cells; with --per-shard (or --all) the shards after
    them, as ``kafka-topics --describe`` gives a topic's line before its partitions'."""
    stats = store.shard_stats()
    nodes: dict[str, dict[str, Any]] = {}
    for s in stats:
        node = nodes.setdefault(s.node, {"node": s.node, "shards": 0, "cells": 0})
        node["shards"] += 1
        node["cells"] += s.cells
    cells = sum(s.cells for s in stats)
    listed = stats if args.all else [s for s in stats if s.cells] if args.per_shard else []
    if out.as_json:
        doc: dict[str, Any] = {"shards": len(stats), "cells": cells, "nodes": list(nodes.values())}
        if args.per_shard or args.all:
            doc["per_shard"] = [s._asdict() for s in listed]
        out.emit(doc, "")
        return Exit.OK
    width = max([4, *(len(name) for name in nodes)])
    lines = [f"{len(stats)} shards, {cells} cells on {len(nodes)} storage node{'s' if len(nodes) != 1 else ''}",
             f"{'node':<{width}} {'shards':>6} {'cells':>10}"]
    lines += [f"{n['node']:<{width}} {n['shards']:>6} {n['cells']:>10}" for n in nodes.values()]
    if args.per_shard or args.all:
        lines += ["", f"{'shard':>6} {'node':<{width}} {'cells':>10}"]
        lines += [f"{s.shard:>6} {s.node:<{width}} {s.cells:>10}" for s in listed]
    out.emit(None, "\n".join(lines))
    return Exit.OK


def cmd_shards_move(store: Store, args: argparse.Namespace, out: Output) -> int:
    from cellstream.cli.progress import Bar
    from logstore.extras import require

    require("mysql", "moving shards")
    from logstore.backends.mysql.moves import move_shards

    bars: dict[int, Bar] = {}

    def progress(shard: int, copied: int) -> None:
        bar = bars.get(shard)
        if bar is None:
            bar = bars[shard] = Bar(out, "cells", desc=f"shard {shard}", leave=False)
        bar.show(copied)

    try:
        reports = move_shards(store, args.shard, args.to, progress)
    finally:
        for bar in bars.values():
            bar.close()
    for r in reports:
        out.emit(r._asdict(), f"shard {r.shard}: moved from {r.source} to {r.target}, {r.cells} cells up to added_id "
                              f"{r.head}; writes fenced {r.fenced_seconds * 1000:.0f} ms; the source copy stays "
                              f"until `cellstream shards drop-moved {r.shard}`")
    return Exit.OK


def cmd_shards_rebalance(store: Store, args: argparse.Namespace, out: Output) -> int:
    """The moves that even out the nodes by cells, bytes or recent writes (logstore.rebalance): --plan prints
    them, --apply runs them as a job."""
    from cellstream.cli.nodes import _unfinished, launch
    from logstore.rebalance import rebalance_moves

    if args.max_moves is not None and args.max_moves < 1:
        raise UsageError("--max-moves must be at least 1")
    if args.apply and (unfinished := _unfinished(store, out)) is not None:
        return unfinished
    plan = rebalance_moves(store, away=args.drain, max_moves=args.max_moves, by=args.by, window=args.window)
    if args.apply:
        return launch(store, plan, "rebalance", args, out)
    unit = {"cells": "cells", "bytes": "bytes", "writes": "recent writes"}[plan.by]
    total = sum(plan.before.values())
    nodes = sorted(plan.before)
    weights = {n: {"before": plan.before.get(n, 0), "after": plan.after.get(n, 0)} for n in nodes}
    doc = {"by": plan.by, "moves": [{**m._asdict(), "cells": plan.cells.get(m.shard, 0)} for m in plan.moves],
           "weight_moved": sum(m.weight for m in plan.moves), "weight": total,
           "cells_moved": sum(plan.cells.values()), "nodes": weights, "applied": False}
    width = max([4, *(len(n) for n in nodes)])
    lines = [f"{len(plan.moves)} moves, {doc['weight_moved']} of {total} {unit}, {doc['cells_moved']} cells "
             "(nothing moved: --plan; --apply runs them)",
             f"{'node':<{width}} {'before':>10} {'after':>10}   ({unit})"]
    lines += [f"{n:<{width}} {v['before']:>10} {v['after']:>10}" for n, v in weights.items()]
    lines += [f"cellstream shards move {m.shard} --to {m.target}   # {m.weight} {unit}, "
              f"{plan.cells.get(m.shard, 0)} cells, from {m.source}" for m in plan.moves]
    out.emit(doc, "\n".join(lines))
    return Exit.OK


def cmd_shards_drop(store: Store, args: argparse.Namespace, out: Output) -> int:
    from logstore.extras import require

    require("mysql", "dropping moved shards")
    from logstore.backends.mysql.moves import drop_moved

    for shard, node in drop_moved(store, args.shard):
        out.emit({"shard": shard, "dropped_from": node}, f"shard {shard}: the copy on node {node} is dropped")
    return Exit.OK


def cmd_shards_moving(store: Store, args: argparse.Namespace, out: Output) -> int:
    from logstore.extras import require

    require("mysql", "shard moves")
    from logstore.backends.mysql.moves import pending_moves

    found = pending_moves(store)
    lines = [f"shard {m.shard}: {m.source} -> {m.target}, {m.phase} (finish: cellstream shards move {m.shard} --to "
             f"{m.target}" + ("" if m.phase == "switched" else f"; undo: cellstream shards abort-move {m.shard}") + ")"
             for m in found]
    out.emit([m._asdict() for m in found], "\n".join(lines) or "no move is half done")
    return Exit.OK


def cmd_shards_abort(store: Store, args: argparse.Namespace, out: Output) -> int:
    from logstore.extras import require

    require("mysql", "shard moves")
    from logstore.backends.mysql.moves import abort_move

    for shard in args.shard:
        move = abort_move(store, shard)
        out.emit(move._asdict(), f"shard {shard}: its move from {move.source} to {move.target} is undone; it stays "
                                 f"on {move.source}")
    return Exit.OK


def cmd_pending(store: Store, args: argparse.Namespace, out: Output) -> int:
    """Buffered writes per node; with --replay, write them home (until none waits, or --wait runs out).
    Exit UNAVAILABLE while cells wait or a node that may hold some does not answer, OK when none waits
    (cells kept as failed wait for no one: they are listed for triage). Through a worker node (``--store
    http://...``) the node answers for the storage nodes behind it, and runs the replay passes."""
    if args.replay:
        deadline = time.monotonic() + args.wait
        while True:
            report = store.replay_pending()
            out.emit(report._asdict(), f"replayed {report.replayed}, failed {report.failed}, waiting "
                                       f"{report.waiting}" + (f", unreachable: {', '.join(report.unreachable)}"
                                                              if report.unreachable else ""))
            if not (report.waiting or report.unreachable) or time.monotonic() >= deadline:
                break
            time.sleep(0.5)
        if report.waiting or report.unreachable:
            return Exit.UNAVAILABLE
    counts = store.pending_counts()
    homes: dict[str, Any] = {}
    lines = []
    for home, (waiting, failed) in sorted(counts.by_home().items()):
        holders = sorted(counts.held[home].items())
        homes[home] = {"waiting": waiting, "failed": failed,
                       "held_on": {holder: {"waiting": w, "failed": f} for holder, (w, f) in holders}}
        where = ", ".join(f"{holder}: {w} waiting, {f} failed" for holder, (w, f) in holders)
        lines.append(f"node {home}: {waiting} buffered cells waiting to go home, {failed} failed (held on {where})")
    lines += [f"node {node} does not answer: the cells it holds for other nodes are not counted"
              for node in counts.unreachable]
    out.emit({"homes": homes, "unreachable": counts.unreachable}, "\n".join(lines) or "no buffered cells")
    waiting = any(w for holders in counts.held.values() for w, _ in holders.values())
    return Exit.UNAVAILABLE if waiting or counts.unreachable else Exit.OK
