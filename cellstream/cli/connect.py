"""``cellstream connect``: run warehouse connectors and see how far they are.

  cellstream connect run FILE [--drain [--timeout S]] [--metrics-port PORT]
  cellstream connect status FILE

``run`` loads the cells of the file's columns into its sink until SIGTERM or SIGINT;
with ``--drain`` it loads what the log holds now (with a progress bar on a terminal: cells,
cells/s, ETA), checkpoints, prints the counts and exits. ``status`` shows each shard's
committed position and lag in cells (with a Kafka source: each topic partition's
committed offset and lag in messages). Exit codes: 0 success, 2 a bad file or option,
4 a store configuration problem, 5 a server or the sink unavailable, 6 other
failure, 7 the connector stalled (too many open dead letters).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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
    a = actions.add_parser("status", parents=[common], help="each shard's committed position and lag")
    a.add_argument("file", type=Path)
    add_kafka_config(a)
    p.set_defaults(run=run)


def run(store: Store, args: argparse.Namespace, out: Output) -> int:
    from connectors.config import load_connector

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
            "files_written": getattr(applier.sink, "files_written", None)}
    out.emit(data, f"connector {config.name}: loaded {counts.processed} cells, dead-lettered "
                   f"{counts.dead_lettered}, in {seconds:.1f}s")
    return Exit.OK


def _status(store: Store, config: ConnectorConfig, args: argparse.Namespace, out: Output) -> int:
    if config.brokers is not None:
        return _kafka_status(config, out)
    rows = []
    for shard, (location, behind) in _behind(store, config).items():
        if location is None and behind == 0:
            continue
        rows.append({"connector": config.name, "shard": shard, "committed": location, "lag_cells": behind})
    for row in rows:
        out.emit(row, f"shard {row['shard']}: committed {row['committed']}, lag {row['lag_cells']} cells")
    if not rows:
        out.emit([], f"connector {config.name}: nothing to load")
    return Exit.OK


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


def _kafka_status(config: ConnectorConfig, out: Output) -> int:
    """Each partition of the connector's topics: what its consumer group committed, and how far behind it is."""
    found = _kafka_positions(config)
    for topic, partition, committed, end in found:
        row = {"connector": config.name, "topic": topic, "partition": partition, "committed": committed,
               "lag_messages": end - (committed or 0)}
        out.emit(row, f"{topic}[{partition}]: committed {committed}, lag {row['lag_messages']} messages")
    if not found:
        out.emit([], f"connector {config.name}: its topics have no partitions yet")
    return Exit.OK
