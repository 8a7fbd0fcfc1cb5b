"""Running a connector: the stream-processing runtime of :mod:`indexer` with a sink as its batch handler.

The app named like the connector tails the logstore (direct mode: the embedded
default) or, given ``brokers``, consumes the tailer's Kafka topics (Kafka mode: a consumer
group, commits only through the checkpoint). Each column's
cells reach the sink in batches, in per-shard order: ``convert`` on the way in (a
cell that cannot convert goes to the app's dead-letter queue with the reason, like
any handler's; `cellstream dlq` triages it), then ``write``. Before the source
commits positions, its checkpoint flushes the sink
(:meth:`indexer.runtime.handlers.Processor.checkpoint`): flush-before-commit, so a crash
replays only cells after the last commit, and the sinks make replays harmless.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from connectors.config import ConnectorConfig, IcebergSinkSpec, ParquetSinkSpec
from connectors.sinks.base import Position, Sink
from indexer import App
from logstore import Cell, Store
from logstore.extras import require


def position(cell: Cell) -> Position:
    """A cell's source position: its shard and added_id, in whichever mode it was delivered."""
    return Position(cell.shard, cell.added_id)


class SinkApplier:
    """A sink as a batch handler. Its calls come from the runtime's threads, one at a time under a lock."""

    def __init__(self, sink: Sink, name: str) -> None:
        self.sink = sink
        self.name = name
        self._lock = threading.Lock()

    def prepare(self, cell: Cell) -> tuple[Any, Cell]:
        """ConversionError (non-retriable: dead-lettered at once) when the cell cannot become a row."""
        return self.sink.convert(cell), cell

    def apply(self, prepared: Sequence[tuple[Any, Cell]], batch: Sequence[Cell] = ()) -> None:
        starts: dict[tuple[str, int], int] = {}
        for cell in [*batch, *(c for _, c in prepared)]:  # the batch holds the dead-lettered cells too
            at, key = position(cell), (cell.column, cell.shard)
            starts[key] = min(at.offset, starts.get(key, at.offset))
        with self._lock:
            for (column, partition), start in starts.items():
                self.sink.begin(column, partition, start)
            for converted, cell in prepared:
                self.sink.write(converted, cell, position(cell))

    def flush(self) -> None:
        with self._lock:
            self.sink.flush()

    def replay(self, cell: Cell) -> None:
        """One cell on its own (a dead letter replayed): written and flushed at once, since no commit follows."""
        converted = self.sink.convert(cell)
        with self._lock:
            self.sink.flush()  # what live processing buffered goes first: files hold ranges of positions
            self.sink.write(converted, cell, position(cell), replay=True)
            self.sink.flush()


def build_sink(config: ConnectorConfig) -> Sink:
    """The sink ``config`` names; its driver is imported here, so a missing extra is one clear error.

    Args:
        config: the connector's configuration.

    Returns:
        The sink, not yet connected (a PostgreSQL sink connects when it first needs to).

    Raises:
        MissingExtraError: the sink's extra (``parquet``, ``postgres``, ``iceberg``) is not installed.
        ConfigurationError: the sink cannot be set up (a Parquet root that cannot be created).
    """
    if isinstance(config.sink, ParquetSinkSpec):
        require("parquet", "a Parquet sink")
        from connectors.sinks.parquet import ParquetSink

        return ParquetSink(config.sink, source="kafka" if config.brokers is not None else "store",
                           connector=config.name)
    if isinstance(config.sink, IcebergSinkSpec):
        require("iceberg", "an Iceberg sink")
        if config.sink.catalog.get_secret_value().startswith("postgresql"):
            require("postgres", "an Iceberg sink with a PostgreSQL catalog")
        from connectors.sinks.iceberg import IcebergSink

        return IcebergSink(config.sink, connector=config.name,
                           source="kafka" if config.brokers is not None else "store")
    require("postgres", "a PostgreSQL sink")
    from connectors.sinks.postgres import PostgresSink

    return PostgresSink(config.sink)


def connector_app(config: ConnectorConfig, store: str | Store, sink: Sink | None = None) -> tuple[App, SinkApplier]:
    """The app that runs the connector: the sink as the batch handler of each of its columns.

    Args:
        config: the connector's configuration (:func:`connectors.config.load_connector`).
        store: the logstore, as a URL or path, or an open Store.
        sink: the sink to use; None builds the one ``config`` names (:func:`build_sink`).

    Returns:
        The app (run it with ``drain`` or ``run``) and the sink's handler (``applier.sink`` is the sink).

    Raises:
        ConfigurationError: the configuration does not fit the app (as :class:`~indexer.App`), the sink
            cannot be built (as :func:`build_sink`), or it holds positions of another source (a lake loaded
            from the store, read from Kafka).
    """
    security: dict[str, Any] = {"kafka": config.kafka_security} if config.brokers is not None else {}
    applier = SinkApplier(sink or build_sink(config), f"sink:{config.sink.type}")
    try:
        applier.sink.check(config.columns)
        app = App(config.name, store=store, brokers=config.brokers, commit_interval=config.checkpoint_interval,
                  start_from=config.start_from, page_size=config.page_size, topic_prefix=config.topic_prefix,
                  redrive=config.redrive, **security)
    except BaseException:
        applier.sink.close()
        raise
    for column in config.columns:
        app.batch_handler(f"{applier.name}:{column}", column, applier, applier.replay,
                          max_attempts=config.max_attempts)
    return app, applier
