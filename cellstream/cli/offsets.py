"""``cellstream offsets``: every consumer of a store, where its offsets live, how far behind it is; a reset
planned with ``--dry-run`` and carried out with ``--execute``; the history of resets.

    cellstream offsets list [--zookeeper Z] [--offsets-file F] [--brokers B]
    cellstream offsets show NAME [--all]
    cellstream offsets reset NAME --to beginning|end|TIME|SHARD:LOCATION,... [--shards RANGE]
                             (--dry-run | --execute) [--reason TEXT] [--place store|zookeeper|file|kafka]
    cellstream offsets history [NAME]

The store's consumers and its index appliers are always looked at; ZooKeeper, a standalone tailer's offsets
file and Kafka's consumer groups when their option is given. A reset of a consumer whose running processes
its place cannot coordinate with (ZooKeeper, an offsets file, a Kafka group) is refused, naming them (exit
9); in the store it is handed to them through their fencing. Every reset carried out is recorded in the store.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from cellstream.cli.common import Output, add_kafka_config, add_zookeeper_auth, zookeeper_auth
from cellstream.cli.exits import Exit
from cellstream.errors import UsageError

if TYPE_CHECKING:
    from logstore import Store
    from tailer.offsets import ConsumerPositions, OffsetsPlace

_SHOWN = 20  # lagging shards `show` lists without --all


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("offsets", help="every consumer's offsets and lag; reset them (--dry-run, --execute)")
    actions = p.add_subparsers(dest="action", required=True, parser_class=type(p))
    a = actions.add_parser("list", parents=[common], help="every consumer, its offsets' place, its lag (totals first)")
    _places(a)
    a = actions.add_parser("show", parents=[common], help="a consumer's positions, holders and lag by shard")
    a.add_argument("name", nargs="?", default=None, help="the consumer (an app's is app.NAME); with --offsets-file: "
                                                         "the file")
    a.add_argument("--all", action="store_true", help="every position, not only the most lagging")
    _places(a)
    a = actions.add_parser("reset", parents=[common], help="move a consumer's offsets (--dry-run first)")
    a.add_argument("name", nargs="?", default=None, help="the consumer; with --offsets-file: the file")
    a.add_argument("--to", required=True, metavar="POSITION",
                   help="beginning, end, an ISO-8601 time with a zone, or SHARD:LOCATION[,SHARD:LOCATION...]")
    a.add_argument("--shards", dest="shard_set", default=None, metavar="RANGE",
                   help="only these shards, e.g. 0-99,200")
    mode = a.add_mutually_exclusive_group(required=True)
    mode.add_argument("--dry-run", action="store_true", help="print what would change; change nothing")
    mode.add_argument("--execute", action="store_true", help="carry the reset out and record it")
    a.add_argument("--reason", default="", help="recorded with the reset")
    _places(a)
    a = actions.add_parser("history", parents=[common], help="the resets carried out, oldest first")
    a.add_argument("name", nargs="?", default=None, help="only this consumer's")
    p.set_defaults(run=run)


def _places(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--zookeeper", default=None, metavar="HOSTS[/CHROOT]",
                        help="also the tailers and apps coordinated through this ZooKeeper")
    parser.add_argument("--offsets-file", default=None, metavar="PATH", help="also this standalone tailer's offsets")
    parser.add_argument("--brokers", default=None, help="also the Kafka-mode apps' consumer groups at these brokers")
    parser.add_argument("--topic-prefix", default="cells", metavar="PREFIX",
                        help="with --brokers: only the groups on this tailer's topics, PREFIX.* (default cells; "
                             "'' for every app.* group)")
    parser.add_argument("--place", choices=("store", "index", "zookeeper", "file", "kafka"), default=None,
                        help="the place of NAME when several hold a consumer of that name")
    add_kafka_config(parser)
    add_zookeeper_auth(parser)


def run(store: Store, args: argparse.Namespace, out: Output) -> int:
    if args.action == "history":
        return _history(store, args, out)
    places = _open_places(store, args)
    if args.action == "list":
        left_out = [_THROUGH_NODE] if store.index_queries_remote and args.place in (None, "index") else []
        return _list(places, out, left_out)
    if args.name is None:
        if not args.offsets_file:
            raise UsageError(f"offsets {args.action}: name the consumer (see `cellstream offsets list`)")
        args.name = args.offsets_file
    place = _place_of(places, args.name, args.place)
    if args.action == "show":
        return _show(place.positions(args.name), args.all, out)
    return _reset(store, place, args, out)


_THROUGH_NODE = ("index appliers are left out: their positions are in the worker node's index tables (run "
                 "`cellstream offsets` with the node's cluster file, or `cellstream index status` on it)")


def _open_places(store: Store, args: argparse.Namespace) -> list[OffsetsPlace]:
    from tailer.offsets.indexes import IndexOffsets
    from tailer.offsets.store import StoreOffsets

    places: list[OffsetsPlace] = [StoreOffsets(store)]
    if not store.index_queries_remote:  # a worker node's client: the index tables are the node's
        places.append(IndexOffsets(store))
    if args.zookeeper:
        from logstore.extras import require

        require("zookeeper", "offsets kept in ZooKeeper")
        from tailer.offsets.zookeeper import ZooKeeperOffsets

        places.append(ZooKeeperOffsets(store, args.zookeeper, auth=zookeeper_auth(args.zookeeper_auth_file)))
    if args.offsets_file:
        from tailer.offsets.file import FileOffsets

        places.append(FileOffsets(store, args.offsets_file))
    if args.brokers:
        from cellstream.cli.common import kafka_override
        from tailer.offsets.kafka import KafkaGroupOffsets
        from tailer.security import PLAINTEXT

        security = kafka_override(args.kafka_config, args.brokers, "offsets") or PLAINTEXT
        places.append(KafkaGroupOffsets(args.brokers, topic_prefix=args.topic_prefix or None, security=security))
    if args.place is not None:
        places = [p for p in places if p.kind == args.place]
        if not places and args.place == "index":
            raise UsageError(f"--place index: {_THROUGH_NODE}")
        if not places:
            raise UsageError(f"--place {args.place}: give its option too (--zookeeper, --offsets-file, --brokers)")
    return places


def _place_of(places: list[OffsetsPlace], name: str, chosen: str | None) -> OffsetsPlace:
    from tailer.errors import ConsumerNotFoundError

    holding = [place for place in places if place.holds(name)]
    if not holding:
        looked = ", ".join(place.where for place in places)
        raise ConsumerNotFoundError(f"no consumer named {name!r} in {looked} (see `cellstream offsets list`)")
    if len(holding) > 1:
        kinds = ", ".join(place.kind for place in holding)
        raise UsageError(f"{name} keeps offsets in {kinds}: choose one with --place")
    return holding[0]


def _list(places: list[OffsetsPlace], out: Output, left_out: list[str]) -> int:
    found: list[ConsumerPositions] = []
    for place in places:
        found.extend(place.positions(name) for name in place.consumers())
    found.sort(key=lambda c: (-c.lag, c.place, c.name))
    total = sum(c.lag for c in found)
    behind = sum(1 for c in found if c.lag)
    if out.as_json:
        out.emit({"total_lag": total, "consumers_behind": behind, "consumers": [c.summary() for c in found],
                  "left_out": left_out}, "")
        return Exit.OK
    _say(out, f"{len(found)} consumers, {behind} behind, {total} cells (messages) to deliver in all")
    for note in left_out:
        _say(out, f"note: {note}")
    if found:
        width = max(len(c.name) for c in found)
        _say(out, f"{'NAME':<{width}}  {'PLACE':<9}  {'LAG':>10}  {'SHARDS BEHIND':>13}  HOLDERS")
        for c in found:
            holders = ", ".join(c.holders) or "-"
            _say(out, f"{c.name:<{width}}  {c.place:<9}  {c.lag:>10}  {c.lagging:>13}  {holders}")
    return Exit.OK


def _show(positions: ConsumerPositions, every: bool, out: Output) -> int:
    if out.as_json:
        out.emit(positions.to_json(), "")
        return Exit.OK
    _say(out, f"{positions.name} ({positions.place}: {positions.where}): {positions.lag} to deliver, "
          f"{positions.lagging} of {len(positions.rows)} positions behind")
    _say(out, f"holders: {', '.join(positions.holders) or 'none'}")
    if positions.note:
        _say(out, f"note: {positions.note}")
    rows = positions.rows if every else sorted((r for r in positions.rows if r.lag), key=lambda r: -r.lag)[:_SHOWN]
    if rows:
        _say(out, f"{'POSITION':<24}  {'COMMITTED':>10}  {'PUBLISHED':>10}  {'END':>10}  {'LAG':>8}  OWNER")
        for r in rows:
            committed = "-" if r.location is None else str(r.location)
            published = "-" if r.published is None else str(r.published)
            _say(out, f"{r.key:<24}  {committed:>10}  {published:>10}  {r.end:>10}  {r.lag:>8}  {r.owner or '-'}")
        if not every and positions.lagging > len(rows):
            _say(out, f"... {positions.lagging - len(rows)} more behind (--all shows every position)")
    return Exit.OK


def _reset(store: Store, place: OffsetsPlace, args: argparse.Namespace, out: Output) -> int:
    from logstore.positions import parse_position, parse_shards
    from tailer.offsets import ResetHistory

    position = parse_position(args.to)
    shards = parse_shards(args.shard_set, store.shard_count) if args.shard_set is not None else None
    plan = place.plan_reset(args.name, position, shards)
    if args.execute:
        plan = place.execute(plan)
        ResetHistory(store).record_plan(plan, args.reason)
    doc = plan.to_json()
    if out.as_json:
        out.emit({**doc, "executed": bool(args.execute)}, "")
        return Exit.OK
    verb = f"reset {plan.reset_id}: moved" if args.execute else "dry run: would move"
    _say(out, f"{plan.name} ({plan.place}: {plan.where}) to {plan.target}: {verb} {doc['moved']} of "
          f"{doc['positions']} positions")
    for change in doc["changes"][:_SHOWN]:
        if change["from"] != change["to"]:
            _say(out, f"  {change['key']:<24} {'-' if change['from'] is None else change['from']} -> {change['to']}")
    if doc["moved"] > _SHOWN:
        _say(out, "  ... (--json lists every position)")
    if plan.holders and plan.coordinated:  # the store keeps the last holders, not whether they still run
        _say(out, f"last held by {', '.join(plan.holders)}: " + (
            "one still running takes the new positions up through its fencing within seconds"
            if args.execute else "--execute hands the new positions to one still running through its fencing"))
    elif plan.holders:
        _say(out, f"running: {', '.join(plan.holders)}: --execute is refused until they stop")
    return Exit.OK


def _say(out: Output, text: str) -> None:
    print(text, file=out.out, flush=True)


def _history(store: Store, args: argparse.Namespace, out: Output) -> int:
    from tailer.offsets import ResetHistory

    resets = ResetHistory(store).resets(args.name)
    if out.as_json:
        out.emit({"resets": [r.to_json() for r in resets]}, "")
        return Exit.OK
    if not resets:
        _say(out, "no offsets reset recorded" + (f" for {args.name}" if args.name else ""))
    for r in resets:
        reason = f" ({r.reason})" if r.reason else ""
        _say(out, f"{r.id}  {r.at.isoformat(timespec='seconds')}  {r.by}  {r.consumer} ({r.place}) to {r.to}: "
              f"{len(r.changes)} positions moved{reason}")
    return Exit.OK
