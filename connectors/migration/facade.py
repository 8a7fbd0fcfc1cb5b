"""The read facade of a migration: an application moves its reads from the source table to the cells a little at
a time, with every answer checked (GitHub Scientist's shadow reads).

A :class:`MigrationReader` answers ``get(key)`` with the row as cells hold it (cell column -> body, or None for
no row) from the source, from the store, or from both, by its *percent*:

- ``0``: the source alone answers (through ``source_reader``, the application's own query of the row);
- ``1`` to ``99``: the source answers, and that share of the reads also reads the store and compares the two in
  the background: a thread pool behind a bounded queue, so the caller never waits for the store; when the queue
  is full the comparison is dropped and counted. A mismatch is counted and logged with the fields that differ
  (their names, never their values);
- ``100``: the store alone answers; the source is not read at all (the dial's last step is the switch itself:
  watch the match rate at 99 first).

The percent is persisted in the migration's record (``cellstream migrate switch FILE --reads N``, refused before
the copy is done) and each reader reads it again every few seconds, so an operator turns the dial without a
restart; :meth:`MigrationReader.set_percent` turns this process's dial until the record's next change.

A row's cells are found by its row key. With ``row_key: {uuid5: ...}`` the reader computes it from the primary
key; with ``row_key: {column: ...}`` it cannot (the key is in the row), and the application passes it:
``get(key, row_key=...)``.

A comparison reads the store after the source: a row changed between the two reads shows as a mismatch until the
change is applied (a few in a busy table are noise; a steady rate is not).
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from connectors.errors import MigrationSourceError, MigrationStateError
from connectors.migration.mapping import RowMapper, json_value
from connectors.migration.records import MigrationRecord, MigrationRecords
from connectors.migration.source import Key, MigrationSource
from connectors.migration.spec import MigrationSpec, url_kind
from logstore.cell import is_tombstone
from logstore.errors import InvalidArgumentError, LogstoreError

if TYPE_CHECKING:
    from logstore import Store

logger = logging.getLogger(__name__)

Row = dict[str, dict[str, Any]]  # cell column -> body
SourceReader = Callable[[Key], Mapping[str, Any] | None]  # the source row's columns by name, or None
RECENT = 100  # mismatches a report lists (the latest); all are counted
_MISSING = object()  # a field one side lacks


class Comparison(NamedTuple):
    """One shadow read compared: the source key, the row key, what was found (``match``; ``missing``: the
    store has no live row the source has; ``extra``: the store has a live row the source lacks; ``different``)
    and the fields that differ, as ``COLUMN.field``."""

    key: Key
    row_key: uuid.UUID
    kind: Literal["match", "missing", "extra", "different"]
    fields: list[str]


class ReadReport(NamedTuple):
    """What a reader compared since it started."""

    compared: int
    mismatched: int
    dropped: int  # comparisons not made: the queue was full, or the store did not answer
    mismatches: list[Comparison]  # the latest RECENT

    @property
    def match_rate(self) -> float:
        """Matches over comparisons (1.0 before any)."""
        return 1.0 if not self.compared else (self.compared - self.mismatched) / self.compared


class MigrationReadMetrics:
    """The read facade's Prometheus series, by migration (one instance may serve several readers):

    - ``cellstream_migration_reads_total{side}``: rows read from the ``source`` and from the ``store``;
    - ``cellstream_migration_read_comparisons_total``, ``cellstream_migration_read_mismatches_total{kind}``;
    - ``cellstream_migration_read_comparisons_dropped_total{reason}``: ``queue_full`` or ``error``;
    - ``cellstream_migration_read_match_ratio``: matches over comparisons since the process started;
    - ``cellstream_migration_read_percent``: the dial as this process has it.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        self.reads = Counter("cellstream_migration_reads", "Rows the read facade read, by side: source, store",
                             ["migration", "side"], registry=r)
        self.comparisons = Counter("cellstream_migration_read_comparisons", "Shadow reads compared (source and "
                                   "store)", ["migration"], registry=r)
        self.mismatches = Counter("cellstream_migration_read_mismatches", "Shadow reads whose store answer differed "
                                  "from the source's, by kind: missing, extra, different", ["migration", "kind"],
                                  registry=r)
        self.dropped = Counter("cellstream_migration_read_comparisons_dropped", "Shadow reads not compared, by "
                               "reason: queue_full (the comparisons fell behind), error (the store did not answer)",
                               ["migration", "reason"], registry=r)
        self.match_ratio = Gauge("cellstream_migration_read_match_ratio", "Matches over comparisons since the "
                                 "process started (no series before the first)", ["migration"], registry=r)
        self.percent = Gauge("cellstream_migration_read_percent", "The read dial: 0 source only, 1-99 the share "
                             "compared, 100 store only", ["migration"], registry=r)

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        start_http_server(port, addr=addr, registry=self.registry)


class MigrationReader:
    """Reads the rows of a migration's table from the source, the store, or both (see the module).

    Args:
        spec: the migration.
        store: the store the table moves into (its record, written by ``cellstream migrate``, holds the dial).
        source_reader: the application's read of a source row by primary key: its columns by name (at least the
            spec's), or None when there is none. Its values must be what the migration's backend reads (the
            driver's types: a Decimal, a datetime...) to compare equal; :func:`sql_row_reader` is one.
        percent: the dial (0..100) until the migration's record holds one.
        metrics: where the series go (None: none exported; :meth:`report` counts anyway).
        compare_workers: threads comparing shadow reads.
        queue_size: shadow reads waiting to be compared at most; beyond, they are dropped.
        refresh_seconds: how often the dial is read again from the record.
        seed: the seed of the draw of which reads are compared (None: random).
        publish: called on a comparing thread with each comparison (a match too), to report them elsewhere.

    Raises:
        InvalidArgumentError: ``percent`` is not in 0..100, or ``compare_workers`` or ``queue_size`` is below 1.
    """

    def __init__(self, spec: MigrationSpec, store: Store, *, source_reader: SourceReader, percent: int = 0,
                 metrics: MigrationReadMetrics | None = None, compare_workers: int = 1, queue_size: int = 1000,
                 refresh_seconds: float = 5.0, seed: int | None = None,
                 publish: Callable[[Comparison], None] | None = None) -> None:
        if compare_workers < 1 or queue_size < 1:
            raise InvalidArgumentError("compare_workers and queue_size must be at least 1")
        self.spec = spec
        self.store = store
        self.source_reader = source_reader
        self.metrics = metrics
        self.publish = publish
        self._mapper = RowMapper(spec)
        self._records = MigrationRecords(store)
        self._rng = random.Random(seed)
        self._queue: queue.Queue[tuple[Key, uuid.UUID, Row | None] | None] = queue.Queue(queue_size)
        self._lock = threading.Lock()
        self._compared = self._mismatched = self._dropped = 0
        self._recent: deque[Comparison] = deque(maxlen=RECENT)
        self._percent = 0
        self._record_percent: int | None = None  # the record's dial when last read
        self._closed = threading.Event()
        self.set_percent(percent)
        self.refresh()
        self._threads = [threading.Thread(target=self._compare_loop, name=f"migration-{spec.name}-compare-{i}",
                                          daemon=True) for i in range(compare_workers)]
        self._threads.append(threading.Thread(target=self._refresh_loop, args=(refresh_seconds,),
                                              name=f"migration-{spec.name}-dial", daemon=True))
        for thread in self._threads:
            thread.start()

    # -- the dial ------------------------------------------------------------------------------------------
    @property
    def percent(self) -> int:
        """The dial now: 0 source only, 1..99 the share of reads compared, 100 store only."""
        return self._percent

    def set_percent(self, percent: int) -> None:
        """Turn this process's dial (until the record's dial next changes).

        Raises:
            InvalidArgumentError: ``percent`` is not in 0..100.
        """
        if not 0 <= percent <= 100:
            raise InvalidArgumentError(f"a read percent is 0..100, not {percent}")
        self._percent = percent
        if self.metrics is not None:
            self.metrics.percent.labels(self.spec.name).set(percent)

    def refresh(self) -> None:
        """Read the dial from the migration's record, and take it when it changed since the last read (a
        record that cannot be read leaves the dial as it is, with a warning)."""
        try:
            record = self._records.find(self.spec.name)
        except LogstoreError as exc:
            logger.warning("migration %s: cannot read the read dial from its record: %s", self.spec.name, exc)
            return
        if record is not None and record.read_percent is not None and record.read_percent != self._record_percent:
            logger.info("migration %s: reads now at %d%% (the record's dial)", self.spec.name, record.read_percent)
            self._record_percent = record.read_percent
            self.set_percent(record.read_percent)

    def _refresh_loop(self, every: float) -> None:
        while not self._closed.wait(every):
            try:
                self.refresh()
            except Exception:  # a record that does not validate: keep the dial, and keep looking
                logger.exception("migration %s: cannot read the read dial from its record", self.spec.name)

    # -- reads ---------------------------------------------------------------------------------------------
    def get(self, key: Key, *, row_key: uuid.UUID | None = None) -> Row | None:
        """The row with primary key ``key``: each cell column's body, or None when there is no such row (in
        the store: no live cell, or tombstones).

        Args:
            key: the primary key's values, in the key's column order.
            row_key: the row's key; needed with ``row_key: {column: ...}`` (computed with ``uuid5``).

        Raises:
            InvalidArgumentError: the spec's row key is a column and ``row_key`` was not given.
            Whatever ``source_reader`` raises (:class:`MigrationSourceError` for :func:`sql_row_reader`),
            and :class:`~logstore.LogstoreError` at 100 (the store is read on the caller's thread then).
        """
        at = self._row_key(key, row_key)
        percent = self._percent
        if percent >= 100:
            return self._read_store(at)
        values = self.source_reader(key)
        self._count_read("source")
        answer = None if values is None else {column: {name: json_value(values.get(name)) for name in fields}
                                              for column, fields in self.spec.columns.items()}
        if percent > 0 and self._rng.random() * 100 < percent:
            try:
                self._queue.put_nowait((key, at, answer))
            except queue.Full:
                self._drop("queue_full")
        return answer

    def _row_key(self, key: Key, row_key: uuid.UUID | None) -> uuid.UUID:
        if row_key is not None:
            return row_key
        if self.spec.row_key.uuid5 is None:
            raise InvalidArgumentError(f"migration {self.spec.name} keys rows by the column "
                                       f"{self.spec.row_key.column}: pass get(key, row_key=...)")
        return self._mapper.row_key(key, None)

    def _read_store(self, row_key: uuid.UUID) -> Row | None:
        row: Row = {}
        columns = list(self.spec.columns)
        for column, cell in zip(columns, self.store.get_cells_latest([(row_key, c) for c in columns]), strict=True):
            if cell is not None and not is_tombstone(cell.body):
                row[column] = dict(cell.body)
        self._count_read("store")
        return row or None

    def _count_read(self, side: str) -> None:
        if self.metrics is not None:
            self.metrics.reads.labels(self.spec.name, side).inc()

    # -- comparisons ---------------------------------------------------------------------------------------
    def _compare_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                key, row_key, source = item
                try:
                    stored = self._read_store(row_key)
                except LogstoreError as exc:
                    logger.warning("migration %s: a shadow read of row %s not compared: %s", self.spec.name,
                                   row_key, exc)
                    self._drop("error")
                    continue
                except Exception:  # a comparing thread that died would leave drain() waiting forever
                    logger.exception("migration %s: a shadow read of row %s not compared", self.spec.name, row_key)
                    self._drop("error")
                    continue
                self._note(Comparison(key, row_key, *compare(source, stored)))
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def _note(self, result: Comparison) -> None:
        with self._lock:
            self._compared += 1
            if result.kind != "match":
                self._mismatched += 1
                self._recent.append(result)
            ratio = (self._compared - self._mismatched) / self._compared
        if self.metrics is not None:
            self.metrics.comparisons.labels(self.spec.name).inc()
            self.metrics.match_ratio.labels(self.spec.name).set(ratio)
            if result.kind != "match":
                self.metrics.mismatches.labels(self.spec.name, result.kind).inc()
        if result.kind != "match":
            # Names only: the values may be anything the table holds.
            logger.warning("migration %s: row %s read from the store is %s: %s", self.spec.name, result.row_key,
                           result.kind, ", ".join(result.fields) or "the whole row")
        if self.publish is not None:
            try:
                self.publish(result)
            except Exception:  # the application's callback must not stop the comparisons
                logger.exception("migration %s: the publish callback failed", self.spec.name)

    def _drop(self, reason: str) -> None:
        with self._lock:
            self._dropped += 1
        if self.metrics is not None:
            self.metrics.dropped.labels(self.spec.name, reason).inc()

    def report(self) -> ReadReport:
        """The comparisons made so far (those still queued not counted: :meth:`drain` first)."""
        with self._lock:
            return ReadReport(self._compared, self._mismatched, self._dropped, list(self._recent))

    def drain(self) -> None:
        """Wait until every shadow read queued so far is compared."""
        self._queue.join()

    def close(self) -> None:
        """Compare what is queued, then stop the threads. Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        for _ in range(len(self._threads) - 1):
            self._queue.put(None)
        for thread in self._threads:
            thread.join()

    def __enter__(self) -> MigrationReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def compare(source: Row | None, stored: Row | None) -> tuple[Literal["match", "missing", "extra", "different"],
                                                             list[str]]:
    """How the store's answer differs from the source's: the kind, and the fields as ``COLUMN.field``."""
    if source == stored:
        return "match", []
    if stored is None:
        return "missing", []
    if source is None:
        return "extra", []
    fields = []
    for column in sorted(source.keys() | stored.keys()):
        ours, theirs = source.get(column, {}), stored.get(column, {})
        fields += [f"{column}.{name}" for name in sorted(ours.keys() | theirs.keys())
                   if ours.get(name, _MISSING) != theirs.get(name, _MISSING)]
    return "different", fields


def switch_reads(store: Store, name: str, percent: int) -> MigrationRecord:
    """Set the read dial of migration ``name`` in its record (``cellstream migrate switch --reads``): every
    :class:`MigrationReader` of it takes the new value at its next refresh.

    Raises:
        InvalidArgumentError: ``percent`` is not in 0..100.
        MigrationStateError: no such migration, or its copy is not done (the store would answer for rows it
            does not hold yet).
    """
    if not 0 <= percent <= 100:
        raise InvalidArgumentError(f"a read percent is 0..100, not {percent}")

    def switch(record: MigrationRecord) -> None:
        if record.phase != "copied":
            raise MigrationStateError(f"migration {name} is {record.phase}: the copy comes first (`cellstream "
                                      "migrate start FILE` until `migrate status` says copied), then the reads")
        record.read_percent = percent
    return MigrationRecords(store).change(name, switch)


def sql_row_reader(url: str, table: str, key_columns: Sequence[str] | None = None, *,
                   schema: str = "public") -> SourceReader:
    """A :data:`SourceReader` that selects the row by its primary key from a PostgreSQL or MySQL/MariaDB table,
    its values converted exactly as the migration's copy converts them (it reads through the same backend).
    One connection, shared by the threads that call it (one query at a time), opened again after a failure.

    Args:
        url: the source's URL (``postgresql://...``, ``mysql://...``).
        table: the table's name.
        key_columns: the primary key's columns, checked against the table's at the first read (None: the
            table's, unchecked).
        schema: PostgreSQL's schema.

    Raises:
        InvalidArgumentError: the URL is neither PostgreSQL's nor MySQL's.
        (the reader) MigrationSourceError: the table cannot be read, or its key is not ``key_columns``;
        MigrationSourceUnavailableError: the server did not answer (retriable).
    """
    kind = url_kind(url)
    if kind is None:
        raise InvalidArgumentError("a source is a postgresql:// or mysql:// URL")
    lock = threading.Lock()
    source: MigrationSource
    if kind == "postgres":
        from connectors.migration.sources.postgres import PostgresSource

        source = PostgresSource(url, table, slot="", publication="", schema=schema)  # no capture: rows only
    else:
        from connectors.migration.sources.mysql import MySQLSource

        source = MySQLSource(url, table)  # rows only: the binlog is not read
    checked = key_columns is None

    def read(key: Key) -> dict[str, Any] | None:
        nonlocal checked
        with lock:
            if not checked:
                if source.key_columns() != list(key_columns or ()):
                    raise MigrationSourceError(f"{table}'s primary key is {source.key_columns()}, not "
                                               f"{list(key_columns or ())}")
                checked = True
            found = source.read_row(tuple(key))
        return None if found is None else found.values
    return read
