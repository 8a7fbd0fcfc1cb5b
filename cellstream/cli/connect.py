"""``cellstream connect``: run warehouse connectors and see how far they are.

  cellstream connect run FILE [--drain [--timeout S]] [--metrics-port PORT]
  cellstream connect status FILE [--shards]
  cellstream connect compact FILE [--target-bytes N] [--before DATE] [--rate FILES/S] [--detach]
                                 [--expire-older-than AGE]

``run`` loads the cells of the file's columns into its sink until SIGTERM or SIGINT;
with ``--drain`` it loads what the log holds now (with a progress bar on a terminal: cells,
cells/s, ETA), checkpoints, prints the counts and exits. ``status`` gives the totals first
(cells behind, shards behind, what the sink holds: files, bytes, the last commit), then with
``--shards`` each shard's committed position and lag in cells (with a Kafka source: each
topic partition's committed offset and lag in messages). ``compact`` rewrites the small
files of the lake's closed day partitions into files of about ``--target-bytes`` as a job
(``cellstream jobs``), run here with a progress bar unless ``--detach``. Exit codes: 0 success, 2 a bad file or option,
4 a store configuration problem, 5 a server or the sink unavailable, 6 other
failure, 7 the connector stalled (too many open dead letters).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cellstream.cli import logsetup
from cellstream.cli.common import Output, add_kafka_config, kafka_override
from cellstream.cli.exits import Exit
from cellstream.cli.progress import Bar

if TYPE_CHECKING:
    import indexer
    from connectors.config import ConnectorConfig
    from logstore import Store


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("connect", help="load the cell stream into a warehouse (Parquet lake)")
    actions = p.add_subparsers(dest="action", required=True, parser_class=type(p))
    a = actions.add_parser("run", parents=[common], help="run a connector (sink.yaml)")
    a.add_argument("file", type=Path)
    add_kafka_config(a)
    a.add_argument("--drain", action="store_true", help="load what the log holds now, then exit")
    a.add_argument("--timeout", type=float, default=3600.0, help="with --drain: give up after this many seconds")
    a.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")
    a = actions.add_parser("status", parents=[common], help="how far behind it is and what its sink holds")
    a.add_argument("file", type=Path)
    a.add_argument("--shards", "--per-shard", action="store_true", dest="per_shard",
                   help="each shard's (Kafka partition's) committed position and lag too, after the totals")
    add_kafka_config(a)
    a = actions.add_parser("compact", parents=[common], help="merge the lake's small files (a resumable job)")
    a.add_argument("file", type=Path)
    a.add_argument("--target-bytes", type=_size, default=None, metavar="N",
                   help="about this many bytes a file (default 128 MiB; 64M, 1G accepted)")
    a.add_argument("--before", type=_date, default=None, metavar="YYYY-MM-DD",
                   help="compact the partitions of days before this one (default: today, UTC)")
    a.add_argument("--rate", type=float, default=None, metavar="FILES/S", help="files read a second at most")
    a.add_argument("--expire-older-than", type=_duration, default=None, metavar="AGE",
                   help="Iceberg: then expire snapshots older than this (default 7d; 36h, 90m, 0 accepted)")
    a.add_argument("--detach", action="store_true", help="record the job and exit (`cellstream jobs resume "
                                                          "ID --run` runs it)")
    a.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")
    p.set_defaults(run=run)


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    try:
        value = int(float(text[:-1]) * units[text[-1].upper()]) if text[-1:].upper() in units else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (bytes, or 64M, 1G)") from None
    if value < 1024:
        raise argparse.ArgumentTypeError(f"{text!r} is below 1 KiB")
    return value


def _duration(text: str) -> dt.timedelta:
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    try:
        seconds = float(text[:-1]) * units[text[-1].lower()] if text[-1:].lower() in units else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an age (seconds, or 90m, 36h, 7d)") from None
    if seconds < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is negative")
    return dt.timedelta(seconds=seconds)


def _date(text: str) -> dt.date:
    try:
        return dt.date.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a date (YYYY-MM-DD)") from None


def run(store: Store, args: argparse.Namespace, out: Output) -> int:
    from connectors.config import load_connector

    if args.action == "compact":
        return _compact(store, args, out)
    config = load_connector(args.file)
    security = kafka_override(args.kafka_config, config.brokers, f"connector {config.name}")
    if security is not None:
        config = config.model_copy(update={"kafka": security})
    return int((_run if args.action == "run" else _status)(store, config, args, out))


def _behind(store: Store, config: ConnectorConfig) -> dict[int, tuple[int | None, int]]:
    """shard: (committed position or None, cells of the columns after it)."""
    offsets = store.read_offsets(f"app.{config.name}")
    out = {}
    for shard in range(store.shard_count):
        found = offsets.get(shard)
        location = found.location if found is not None else None
        out[shard] = (location, store.count_after(shard, location or 0, columns=config.columns))
    return out


def _run(store: Store, config: ConnectorConfig, args: argparse.Namespace, out: Output) -> int:
    from connectors.errors import SinkUnavailableError
    from connectors.runtime import connector_app

    app, applier = connector_app(config, store)
    logsetup.starting("connect run", args, connector=config.name, columns=config.columns, sink=config.sink.type,
                  brokers=config.brokers)  # the sink's URL may hold a password: not shown
    try:
        if not args.drain:
            app.run(metrics_port=args.metrics_port)
            return Exit.OK
        total = _kafka_lag(config) if config.brokers is not None else sum(
            cells for _, cells in _behind(store, config).values())
        bar = Bar(out, "cells", total=total)

        async def load() -> indexer.Counts:
            task = asyncio.ensure_future(app.drain_async(args.timeout))
            while not task.done():
                counts = app.processor.counts
                bar.show(min(total, counts.processed + counts.dead_lettered))
                await asyncio.wait([task], timeout=0.25)
            return task.result()
        started = time.monotonic()
        with bar:
            counts = asyncio.run(load())
        # The stop's checkpoint may have failed to flush (it then commits nothing): say so, not success.
        applier.flush()
        behind = _kafka_lag(config) if config.brokers is not None else sum(
            cells for _, cells in _behind(store, config).values())
        if behind:
            raise SinkUnavailableError(f"connector {config.name}: {behind} cells loaded but their positions not "
                                       "committed (the last checkpoint failed); run it again, the sink takes "
                                       "them again harmlessly")
    finally:
        with contextlib.suppress(Exception):
            applier.sink.close()
        app.close()
    seconds = time.monotonic() - started
    data = {"connector": config.name, **counts._asdict(), "seconds": round(seconds, 3),
            "files_written": getattr(applier.sink, "files_written", None),
            "snapshots_committed": getattr(applier.sink, "snapshots_committed", None)}
    out.emit(data, f"connector {config.name}: loaded {counts.processed} cells, dead-lettered "
                   f"{counts.dead_lettered}, in {seconds:.1f}s")
    return Exit.OK


def _status(store: Store, config: ConnectorConfig, args: argparse.Namespace, out: Output) -> int:
    from connectors.status import sink_summary

    rows: list[dict[str, Any]]
    if config.brokers is not None:
        unit, rows = "messages", [
            {"topic": topic, "partition": partition, "committed": committed, "lag_messages": end - (committed or 0)}
            for topic, partition, committed, end in _kafka_positions(config)]
    else:
        unit, rows = "cells", [{"shard": shard, "committed": location, "lag_cells": behind}
                               for shard, (location, behind) in _behind(store, config).items()
                               if location is not None or behind]
    lag = sum(row[f"lag_{unit}"] for row in rows)
    where = "partitions" if config.brokers is not None else "shards"
    sink = sink_summary(config)
    data: dict[str, Any] = {
        "connector": config.name, f"lag_{unit}": lag, f"{where}_behind": sum(1 for r in rows if r[f"lag_{unit}"]),
        f"{where}_committed": sum(1 for r in rows if r["committed"] is not None), "sink": sink}
    if args.per_shard:
        data[where] = rows
    human = [f"connector {config.name}: {lag} {unit} behind in {data[f'{where}_behind']} {where} "
             f"({data[f'{where}_committed']} {where} committed)", _sink_line(sink)]
    for row in rows if args.per_shard else []:
        at = f"{row['topic']}[{row['partition']}]" if "topic" in row else f"shard {row['shard']}"
        human.append(f"  {at}: committed {row['committed']}, lag {row[f'lag_{unit}']} {unit}")
    out.emit(data, "\n".join(human))
    return Exit.OK


def _sink_line(sink: dict[str, Any]) -> str:
    if "files" not in sink:
        return f"sink: {sink['type']}"
    last = sink["last_commit"]
    what = (f"{last['partitions_compacted']} partitions compacted" if last and last["kind"] == "compact"
            else f"{last['files']} files, {last['rows']} rows" if last else "")
    committed = "nothing committed yet" if last is None else f"last commit #{last['seq']} at {last['at']}: {what}"
    return f"sink: {sink['type']}, {sink['files']} files, {sink['bytes']:,} bytes; {committed}"


def _compact(store: Store, args: argparse.Namespace, out: Output) -> int:
    from cellstream.cli.jobs import known_kinds, run_here
    from connectors.compaction import DEFAULT_TARGET_BYTES, compaction_params
    from logstore.jobs import JobRunner, ThrottleSettings

    params = compaction_params(args.file, target_bytes=args.target_bytes or DEFAULT_TARGET_BYTES,
                               before=args.before, expire_older_than=args.expire_older_than)
    kinds = known_kinds(store)
    if not kinds.get("compact").plan(params):
        out.emit({"id": None, "kind": "compact", "state": "done", "steps": 0},
                 f"nothing to compact: no partition before {params['before']} has small files to merge")
        return Exit.OK
    runner = JobRunner(store, kinds)
    record = runner.submit("compact", params, throttle=ThrottleSettings(rate=args.rate))
    if args.detach:
        out.emit(record.summary(), f"job {record.id} planned: {len(record.steps)} partitions, {record.total} "
                                   f"files (`cellstream jobs resume {record.id} --run` runs it)")
        return Exit.OK
    args.run_here = True
    return int(run_here(store, record, args, out))


def _kafka_positions(config: ConnectorConfig) -> list[tuple[str, int, int | None, int]]:
    from logstore.extras import require

    require("kafka", "a connector reading Kafka")
    from indexer.runtime.kafka import group_positions

    assert config.brokers is not None
    return asyncio.run(group_positions(config.brokers, config.name,
                                       [f"{config.topic_prefix}.{column}" for column in config.columns],
                                       config.kafka_security))


def _kafka_lag(config: ConnectorConfig) -> int:
    return sum(end - (committed or 0) for _, _, committed, end in _kafka_positions(config))
