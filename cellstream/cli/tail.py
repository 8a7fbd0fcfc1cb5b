"""``cellstream tail``: run a tailer worker, or show a tailer's status.

  cellstream tail --store URL --brokers HOST:PORT --zookeeper HOST:PORT[/chroot] --name NAME
                  [--columns A,B] [--from beginning|now|TIME] [--partitions P] [--format json|msgpack]
                  [--metrics-port PORT [--per-shard-metrics]]
  cellstream tail --store URL --out DIR --offsets FILE --name NAME ...      (standalone, no servers)
  cellstream tail status NAME --store URL (--zookeeper HOST:PORT | --offsets FILE) [--all] [--json]
                  (totals, then the lagging or failing shards and the re-publish jobs; --all: every shard, every job)
  cellstream tail republish NAME --store URL [--columns A,B] [--shards RANGE] [--from POSITION]
                  [--until POSITION] [--rate N]   (a job the running tailer NAME takes; see docs/tailer.md)

Exit codes of ``tail``: 0 after a graceful stop (SIGTERM/SIGINT), 4 configuration
error, 5 Kafka, ZooKeeper or the store unreachable, 6 other failure.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from typing import TYPE_CHECKING, Any

from cellstream.cli import logsetup
from cellstream.cli.common import (
    Output,
    Parser,
    add_kafka_config,
    add_zookeeper_auth,
    columns_arg,
    tune_for_streaming,
    zookeeper_auth,
)
from cellstream.cli.exits import Exit
from cellstream.errors import UsageError
from logstore.extras import require

if TYPE_CHECKING:
    from logstore import Store
    from tailer.config import TailerConfig
    from tailer.interfaces import Coordinator, Publisher
    from tailer.offsets import OffsetsPlace
    from tailer.worker import Tailer

logger = logging.getLogger(__name__)


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("tail", parents=[common], help="publish shard logs to Kafka (or `tail status NAME`)")
    p.add_argument("--name", help="the tailer's name; workers with the same name share the shards")
    p.add_argument("--brokers", default=os.environ.get("CELLSTREAM_BROKERS"), help="Kafka bootstrap servers")
    add_kafka_config(p)
    p.add_argument("--zookeeper", default=os.environ.get("CELLSTREAM_ZOOKEEPER"), help="host:port[/chroot]")
    add_zookeeper_auth(p)
    p.add_argument("--out", metavar="DIR", help="standalone: write topics as files under DIR instead of Kafka")
    p.add_argument("--offsets", metavar="FILE", help="standalone: keep offsets in FILE instead of ZooKeeper")
    p.add_argument("--columns", type=columns_arg, default=None,
                   help="comma-separated (default: every column but the reserved _ ones, published only when named)")
    p.add_argument("--from", dest="start", default=None,
                   help="beginning (default), now or an ISO-8601 time: where shards without committed offsets "
                        "start (the others resume from their offsets; `cellstream offsets reset` moves those)")
    p.add_argument("--prefix", default="cells", help="topic prefix (topics are PREFIX.COLUMN)")
    p.add_argument("--partitions", type=int, default=16, help="partitions per topic; shard s -> s mod P")
    p.add_argument("--replication-factor", type=int, default=1)
    p.add_argument("--format", choices=["json", "msgpack"], default="json", help="message value format")
    p.add_argument("--poll", type=float, default=0.005,
                   help="seconds between count polls of the shards while cells arrive (idle: up to 0.05 s)")
    p.add_argument("--session-timeout", type=float, default=10.0, help="ZooKeeper session timeout (s)")
    p.add_argument("--max-request-size", type=int, default=1_000_000, help="larger messages are dead-lettered")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")
    p.add_argument("--per-shard-metrics", action="store_true",
                   help="export lag series for every owned shard (default: totals and the most lagging shards)")
    p.set_defaults(run=cmd_tail)
    # `tail status` has a parser of its own: its --help shows its options, not the worker's. The options it
    # shares with the worker's parser default to SUPPRESS there, so that one given before `status` stays.
    actions = p.add_subparsers(dest="action", required=False, parser_class=Parser, metavar="{status,republish}",
                               help="`tail status NAME --help` and `tail republish NAME --help` show their options")
    a = actions.add_parser("status", parents=[common], help="show a tailer's workers, totals and lagging shards")
    a.add_argument("status_name", metavar="NAME", help="the tailer to show")
    a.add_argument("--zookeeper", default=argparse.SUPPRESS,
                   help="host:port[/chroot] of a tailer coordinated through ZooKeeper (env CELLSTREAM_ZOOKEEPER)")
    a.add_argument("--zookeeper-auth-file", metavar="FILE", default=argparse.SUPPRESS,
                   help="file holding user:password for ZooKeeper's digest authentication (env "
                        "CELLSTREAM_ZOOKEEPER_AUTH)")
    a.add_argument("--offsets", metavar="FILE", default=argparse.SUPPRESS,
                   help="the offsets file of a standalone tailer")
    a.add_argument("--all", action="store_true", help="list every shard, not only the lagging or failing ones")
    a.set_defaults(run=cmd_tail_status)
    # Its own dests (republish_*): the worker's --columns and --from stay the worker's.
    a = actions.add_parser("republish", parents=[common], help="re-publish a range to a tailer's topics while it "
                           "goes on tailing (a job its running tailer takes)")
    a.add_argument("republish_name", metavar="NAME", help="the tailer whose topics get the range")
    a.add_argument("--columns", dest="republish_columns", type=columns_arg, default=None, metavar="A,B",
                   help="comma-separated (default: the columns the tailer publishes)")
    a.add_argument("--shards", dest="republish_shards", metavar="RANGE", default=None,
                   help="e.g. 0-99,200 (default: every shard)")
    a.add_argument("--from", dest="republish_from", metavar="POSITION", default="beginning",
                   help="beginning, end, an ISO-8601 time or SHARD:LOCATION,... (default: beginning)")
    a.add_argument("--until", dest="republish_until", metavar="POSITION", default="end",
                   help="as --from; default end: each shard's head now, so cells written later are the live "
                        "stream's")
    a.add_argument("--rate", dest="republish_rate", type=float, default=None, metavar="N",
                   help="cells a second (default: unlimited; `cellstream jobs throttle ID` changes it)")
    a.set_defaults(run=cmd_tail_republish)


def cmd_tail(store: Store, args: argparse.Namespace, out: Output) -> int:
    return _run(store, args)


def cmd_tail_status(store: Store, args: argparse.Namespace, out: Output) -> int:
    return _status(store, args, out)


def cmd_tail_republish(store: Store, args: argparse.Namespace, out: Output) -> int:
    """Record a re-publish job for the tailer (:func:`tailer.republish.submit`) and say how its progress is seen."""
    from logstore.positions import parse_position, parse_shards
    from tailer.republish import submit

    if args.republish_rate is not None and not args.republish_rate > 0:
        raise UsageError(f"--rate must be above 0, got {args.republish_rate:g}")
    shards = parse_shards(args.republish_shards, store.shard_count) if args.republish_shards else None
    record = submit(store, args.republish_name, columns=args.republish_columns, shards=shards,
                    start=parse_position(args.republish_from), until=parse_position(args.republish_until),
                    rate=args.republish_rate,
                    texts={"shards": args.republish_shards, "from": args.republish_from,
                           "until": args.republish_until})
    total = "?" if record.total is None else str(record.total)
    shards = record.params["shards_in_range"]
    out.emit(record.summary(),
             f"job {record.id}: re-publish about {total} cells of {shards} shard{'' if shards == 1 else 's'} to "
             f"tailer {args.republish_name}'s topics. Its tailer takes it while it runs, or when it starts (a "
             f"tailer of another name never does: `cellstream jobs cancel {record.id}` withdraws it); "
             f"`cellstream tail status {args.republish_name}` and `cellstream jobs show {record.id}` show its "
             "progress")
    return Exit.OK


def _config(args: argparse.Namespace) -> TailerConfig:
    if not args.name:
        raise UsageError("tail needs --name NAME")
    from pydantic import ValidationError

    from tailer.config import TailerConfig, parse_start

    try:
        start = parse_start(args.start or "beginning")
        return TailerConfig(
            name=args.name, topic_prefix=args.prefix, partitions=args.partitions,
            replication_factor=args.replication_factor, columns=args.columns, start_from=start,
            value_format=args.format, session_timeout=args.session_timeout, poll_interval=args.poll,
            idle_poll_interval=max(args.poll, 0.05), per_shard_metrics=args.per_shard_metrics,
        )
    except ValidationError as exc:
        problem = exc.errors()[0]
        where = ".".join(str(part) for part in problem["loc"])
        raise UsageError(f"--{where.replace('_', '-')}: {problem['msg'].removeprefix('Value error, ')}") from None
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _parts(store: Store, args: argparse.Namespace, config: TailerConfig) -> tuple[Coordinator, Publisher]:
    if bool(args.brokers) == bool(args.out):
        raise UsageError("give exactly one of --brokers (Kafka) and --out DIR (standalone files)")
    if bool(args.zookeeper) == bool(args.offsets):
        raise UsageError("give exactly one of --zookeeper (shared workers) and --offsets FILE (standalone)")
    coordinator: Coordinator
    publisher: Publisher
    if args.zookeeper:
        require("zookeeper", "a tailer coordinated through ZooKeeper")
        from tailer.coordinators.zookeeper import ZooKeeperCoordinator
        coordinator = ZooKeeperCoordinator(args.zookeeper, config.name, store.shard_count,
                                           session_timeout=config.session_timeout,
                                           lease_fraction=config.lease_fraction,
                                           auth=zookeeper_auth(args.zookeeper_auth_file))
    else:
        from tailer.coordinators.local import LocalCoordinator
        coordinator = LocalCoordinator(args.offsets, store.shard_count)
    if args.brokers:
        require("kafka", "a tailer publishing to Kafka")
        from tailer.config import KafkaOptions
        from tailer.publishers.kafka import KafkaPublisher
        from tailer.security import resolve_kafka_config
        publisher = KafkaPublisher(KafkaOptions(brokers=args.brokers, max_request_size=args.max_request_size,
                                                security=resolve_kafka_config(args.kafka_config)))
    else:
        if args.kafka_config:
            raise UsageError("--kafka-config is for --brokers (Kafka); --out writes files")
        from tailer.publishers.directory import DirectoryPublisher
        publisher = DirectoryPublisher(args.out, max_message_bytes=args.max_request_size)
    return coordinator, publisher


def _run(store: Store, args: argparse.Namespace) -> int:
    config = _config(args)
    coordinator, publisher = _parts(store, args, config)
    kafka = None
    if args.brokers:
        from tailer.security import resolve_kafka_config

        security = resolve_kafka_config(args.kafka_config)
        kafka = security.masked() if security is not None else None
    logsetup.starting("tail", args, tailer=config.model_dump(mode="json"), kafka_security=kafka)
    if args.start is not None:
        _say_where_it_starts(store, args, config.name)
    from tailer.metrics import TailerMetrics
    from tailer.worker import Tailer

    metrics = TailerMetrics(config.name)
    if args.metrics_port is not None:
        metrics.serve(args.metrics_port)
    tune_for_streaming()
    # republish: this process runs the tailer's re-publish jobs (`tail republish`) while it leads.
    return asyncio.run(_serve(Tailer(store, config, coordinator, publisher, metrics, republish=True)))


def _say_where_it_starts(store: Store, args: argparse.Namespace, name: str) -> None:
    """``--from`` applies to shards without committed offsets only: say so when some have them, rather than
    leave an operator believing the tailer starts from there."""
    place: OffsetsPlace
    if args.zookeeper:
        from tailer.offsets.zookeeper import ZooKeeperOffsets

        place = ZooKeeperOffsets(store, args.zookeeper, auth=zookeeper_auth(args.zookeeper_auth_file))
        consumer, where = name, f"--zookeeper {args.zookeeper}"
    else:
        from tailer.offsets.file import FileOffsets

        place = FileOffsets(store, args.offsets)
        consumer, where = str(args.offsets), f"--offsets-file {args.offsets}"
    if consumer not in place.consumers():
        return
    committed = sum(1 for row in place.positions(consumer).rows if row.location is not None)
    named = "" if consumer == str(args.offsets) else f"{consumer} "  # an offsets file names its consumer itself
    if committed:
        logger.warning("--from %s: tailer %s resumes from its committed offsets in %d of %d shards; --from applies "
                       "to the other %d only. To start every shard there: stop the tailer, then `cellstream offsets "
                       "reset %s%s --to %s --execute`", args.start, name, committed, store.shard_count,
                       store.shard_count - committed, named, where, args.start)


async def _serve(tailer: Tailer) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await tailer.start()
    logger.info("tailer %s worker %s running", tailer.config.name, tailer.coordinator.worker_id)
    waiter = asyncio.create_task(tailer.wait())
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait([waiter, stopper], return_when=asyncio.FIRST_COMPLETED)
    stopper.cancel()
    await tailer.stop()  # flushes, commits and releases the shards
    if waiter.done() and waiter.exception() is not None:
        raise waiter.exception()  # type: ignore[misc]
    return Exit.OK


def _status(store: Store, args: argparse.Namespace, out: Output) -> int:
    name = args.status_name
    from tailer import status

    if args.offsets:
        report = status.standalone_status(store, args.offsets, name)
    elif args.zookeeper:
        report = status.zookeeper_status(store, args.zookeeper, name, auth=zookeeper_auth(args.zookeeper_auth_file))
    else:
        raise UsageError("tail status needs --zookeeper HOST:PORT or --offsets FILE")
    shards = report["shards"]
    totals = {"shards": len(shards), "lagging_shards": sum(1 for r in shards if r["lag_cells"]),
              "lag_cells": sum(r["lag_cells"] for r in shards),
              "max_lag_seconds": max((r["lag_seconds"] for r in shards), default=0.0),
              "failing_shards": sum(1 for r in shards if r["last_error"]),
              "deadlettered": sum(r["deadlettered"] for r in shards)}
    # The shards worth a look (lagging or failing), as `kafka-consumer-groups --describe` is read for its
    # lagging partitions; every shard with --all.
    listed = [r for r in shards if r["lag_cells"] or r["last_error"] or args.all]
    # Its re-publish jobs: those not over and the last few over (--all: every one).
    republishing = status.republish_jobs(store, name, every=args.all)
    if out.as_json:
        out.emit({**{k: v for k, v in report.items() if k != "shards"}, "totals": totals, "shards": listed,
                  "republish": republishing}, "")
        return Exit.OK
    lines = [f"tailer {name}: assignment epoch {report['epoch']}, {len(report['workers'])} workers",
             f"  {totals['shards']} shards: {totals['lagging_shards']} lagging, {totals['lag_cells']} cells behind "
             f"(up to {totals['max_lag_seconds']}s), {totals['failing_shards']} failing, "
             f"{totals['deadlettered']} dead-lettered"]
    lines += [f"  worker {w.get('member', w['worker'])}{' (leader)' if w['leader'] else ''}"
              for w in report["workers"]]
    for r in listed:
        error = f" last_error={r['last_error']['error']!r}" if r["last_error"] else ""
        lines.append(f"  shard {r['shard']}: location={r['location']} head={r['head']} lag={r['lag_cells']} cells "
                     f"{r['lag_seconds']}s owner={r['claimed_by'] or r['assigned_to']} "
                     f"deadlettered={r['deadlettered']}{error}")
    for job in republishing:
        total = "?" if job["total"] is None else job["total"]
        owner = f" owner={job['owner']}" if job["owner"] else ""
        error = f" error={job['error']!r}" if job["error"] and job["state"] in ("failed", "running") else ""
        lines.append(f"  republish {job['id']}: {job['state']} {job['done']}/{total} cells ({job['published']} "
                     f"published, {job['skipped']} skipped) columns={','.join(job['columns'] or []) or 'all'} "
                     f"shards={job['shards']} from={job['from']} until={job['until']}{owner}{error}")
    out.emit(None, "\n".join(lines))
    return Exit.OK


__all__ = ["register"]
