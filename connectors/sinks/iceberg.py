"""The Apache Iceberg sink: one table per cell column in a SQL catalog (SQLite or PostgreSQL, pyiceberg's
``SqlCatalog``, the same tables as Iceberg's JDBC catalog), appended once per checkpoint with the
connector's offsets in the snapshot, as the Kafka Connect Iceberg sink does.

Tables: ``<namespace>.cells_<column in lower case>`` (or ``tables: {COLUMN: name}``), partitioned by
``day(created_at)``: row_key, column, ref_key, added_id, shard, created_at (as the Parquet sink's), then the
body's fields flattened (``fare.total``: a top-level column whose name holds a dot).

Exactly-once: a flush appends each column's buffered rows as ONE snapshot (a fast append: one data file per
day partition up to ``write.target-file-size-bytes``, which pyiceberg weighs in Arrow bytes) whose summary
carries ``cellstream.connector`` and ``cellstream.offsets``, JSON ``{partition: last position}`` of every
partition the connector ever committed to the table (the full map, carried forward), and ``cellstream.source``,
what the positions count (``store`` shards or ``kafka`` partitions): a connector of the other source is refused
(ConfigurationError), as the Parquet lake refuses one. The catalog swaps the
table's metadata pointer in one SQL statement, so rows and offsets land together or not at all. After a
restart :meth:`IcebergSink.committed` reads the map from the connector's newest snapshot (the current one or
an ancestor: compaction and other writers commit too) and the base class skips cells at or below it: the
source commits after the sink, and what it hands over again is not written twice.

A commit that loses a race (another process, compaction) fails in pyiceberg; the sink refreshes the table,
re-reads and re-merges the offsets, plans the schema again and retries (pyiceberg deletes the losing
attempt's files). When the refreshed offsets already cover what it was committing, its earlier attempt
landed (an answer lost on the way back) and nothing is written again. A process killed between writing data
files and committing leaves orphan files that no snapshot references: no reader sees them; deleting them is
orphan-file maintenance, with snapshot expiry (which also bounds the metadata, where every snapshot keeps its
summary), part of compaction.

Types and schema evolution: a value's kind maps to an Iceberg type, bool -> boolean, int -> long, float ->
double, str -> string, anything else (a list, an empty object) -> string holding its JSON text. A new field
becomes a new optional column of the first value's type (committed in the same transaction as the rows).
A value whose column has another type goes where Iceberg's rules take it losslessly: a string column takes
anything (as JSON text unless a string), a double column takes ints; anything else (``10.5`` for a long
column, ``"n/a"`` for a double one) goes to the sibling column ``<field>__<its type>`` (``fare__double``,
``fare__string``), added on demand, never a rewrite nor a lost value. Each such conflict is logged once and
kept in :attr:`IcebergSink.conflicts`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import pyarrow as pa
from pyiceberg.catalog.sql import SqlCatalog
from pyiceberg.exceptions import CommitFailedException, NoSuchTableError
from pyiceberg.io.pyarrow import _dataframe_to_data_files, schema_to_pyarrow
from pyiceberg.partitioning import PartitionField, PartitionSpec
from pyiceberg.schema import Schema
from pyiceberg.table import Table
from pyiceberg.table.snapshots import ancestors_of
from pyiceberg.transforms import DayTransform
from pyiceberg.types import (
    BooleanType,
    DoubleType,
    IcebergType,
    IntegerType,
    LongType,
    NestedField,
    PrimitiveType,
    StringType,
    TimestamptzType,
)
from sqlalchemy.exc import SQLAlchemyError

from connectors.config import IcebergSinkConfig
from connectors.errors import ConfigurationError, SinkUnavailableError
from connectors.sinks.base import Position, Sink, json_text, table_fields
from logstore import Cell
from logstore.net import mask_userinfo

if TYPE_CHECKING:
    from pyiceberg.table.metadata import TableMetadata
    from pyiceberg.table.snapshots import Snapshot

logger = logging.getLogger(__name__)

OFFSETS = "cellstream.offsets"  # snapshot summary: JSON {partition: last position}, the connector's full map
CONNECTOR = "cellstream.connector"  # snapshot summary: the connector that wrote the snapshot
SOURCE = "cellstream.source"  # snapshot summary: what the offsets count, "store" shards or "kafka" partitions
TARGET_FILE_BYTES = "write.target-file-size-bytes"
ATTEMPTS = 8  # commits tried per column and flush before SinkUnavailableError (the runtime tries the batch again)

_SCHEMA = Schema(
    NestedField(1, "row_key", StringType(), required=True),
    NestedField(2, "column", StringType(), required=True),
    NestedField(3, "ref_key", LongType(), required=True),
    NestedField(4, "added_id", LongType(), required=True),
    NestedField(5, "shard", IntegerType(), required=True),
    NestedField(6, "created_at", TimestamptzType(), required=True),
)
_SPEC = PartitionSpec(PartitionField(source_id=6, field_id=1000, transform=DayTransform(), name="created_at_day"))
# A body value's Iceberg type by its exact Python type (bodies come from JSON: no subclasses); others are JSON text.
_TYPE_OF: dict[type, PrimitiveType] = {bool: BooleanType(), int: LongType(), float: DoubleType(), str: StringType()}
_JSON = StringType()


class _Rows:
    """One column's buffered rows: the cell columns as lists, the body fields as dicts."""

    __slots__ = ("added_id", "created_at", "fields", "ref_key", "row_key", "shard")

    def __init__(self) -> None:
        self.row_key: list[str] = []
        self.ref_key: list[int] = []
        self.added_id: list[int] = []
        self.shard: list[int] = []
        self.created_at: list[Any] = []
        self.fields: list[dict[str, Any]] = []


class IcebergSink(Sink):
    """The Iceberg tables of one connector process (see the module docstring).

    Args:
        config: the catalog, warehouse, namespace and tables.
        connector: the connector's name, kept with its offsets in each snapshot.
        source: what the connector's positions count, ``store`` shards or ``kafka`` partitions.
    """

    def __init__(self, config: IcebergSinkConfig, connector: str,
                 source: Literal["store", "kafka"] = "store") -> None:
        super().__init__()
        self.config = config
        self.connector = connector
        self.source = source
        self._catalog: SqlCatalog | None = None  # connected on first use
        self._tables: dict[str, Table] = {}
        self._offsets: dict[str, dict[int, int]] = {}  # column -> the connector's committed map (read once)
        self._rows: dict[str, _Rows] = {}
        self._warned: set[tuple[str, str]] = set()
        self.conflicts: list[str] = []
        self.snapshots_committed = 0

    # -- the catalog and its tables ---------------------------------------------------
    @contextmanager
    def _unavailable(self, doing: str) -> Iterator[None]:
        """Catalog and file errors as SinkUnavailableError (retriable), without the catalog URL's password."""
        try:
            yield
        except (SQLAlchemyError, OSError) as exc:
            message = mask_userinfo(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)
            raise SinkUnavailableError(f"iceberg sink: {doing}: {message}") from None

    def catalog(self) -> SqlCatalog:
        """The SQL catalog (its tables are created on the first connection)."""
        if self._catalog is None:
            warehouse = self.config.warehouse
            if "://" not in warehouse:
                warehouse = Path(warehouse).absolute().as_uri()
            with self._unavailable("connecting to the catalog"):
                self._catalog = SqlCatalog(self.config.catalog_name, uri=self.config.catalog.get_secret_value(),
                                           warehouse=warehouse)
        return self._catalog

    def identifier(self, column: str) -> tuple[str, str]:
        """(namespace, table) of ``column``'s table."""
        return self.config.namespace, self.config.table(column)

    def table(self, column: str, *, create: bool = False) -> Table | None:
        """``column``'s table as last loaded (None when it does not exist and ``create`` is False)."""
        found = self._tables.get(column)
        if found is None:
            catalog = self.catalog()
            with self._unavailable(f"loading the table of {column}"):
                try:
                    found = catalog.load_table(self.identifier(column))
                except NoSuchTableError:
                    if not create:
                        return None
                    catalog.create_namespace_if_not_exists(self.config.namespace)
                    found = catalog.create_table_if_not_exists(
                        self.identifier(column), _SCHEMA, partition_spec=_SPEC,
                        properties={TARGET_FILE_BYTES: str(self.config.target_file_bytes)})
                    logger.info("iceberg sink: created table %s.%s", *self.identifier(column))
                if found.properties.get(TARGET_FILE_BYTES) != str(self.config.target_file_bytes):
                    found.transaction().set_properties(
                        {TARGET_FILE_BYTES: str(self.config.target_file_bytes)}).commit_transaction()
            self._offsets[column] = self._offsets_of(column, found.metadata)  # as of the table held
            self._tables[column] = found
        return found

    def check(self, columns: list[str]) -> None:
        """The tables that exist hold positions of this connector's source (an unreachable catalog is left
        to the first flush, which waits it out)."""
        for column in columns:
            try:
                self.table(column)
            except SinkUnavailableError as exc:
                logger.warning("iceberg sink: could not check %s.%s at start: %s", *self.identifier(column), exc)
                return

    def _offsets_of(self, column: str, metadata: TableMetadata) -> dict[int, int]:
        snapshot = offsets_snapshot(metadata, self.connector)
        summary = snapshot.summary if snapshot is not None else None
        found = summary.get(SOURCE) if summary is not None else None
        if found is not None and found != self.source:
            raise ConfigurationError(
                f"iceberg sink: {'.'.join(self.identifier(column))} holds connector {self.connector}'s positions of "
                f"the {found}, this connector reads the {self.source}: give it another table or namespace (its "
                "positions would skip or repeat cells)")
        return _offsets(snapshot)

    def _refresh(self, column: str) -> Table:
        self._tables.pop(column, None)
        table = self.table(column, create=True)
        assert table is not None
        return table

    # -- positions ----------------------------------------------------------------------
    def committed(self, column: str, partition: int) -> int | None:
        """The last position of ``partition`` the connector committed to ``column``'s table (its newest
        snapshot's ``cellstream.offsets``), or None."""
        return self._committed_map(column).get(partition)

    def _committed_map(self, column: str) -> dict[int, int]:
        if column not in self._offsets and self.table(column) is None:
            self._offsets[column] = {}  # no table yet: asked once, not once per partition
        return self._offsets[column]

    # -- buffering ------------------------------------------------------------------------
    def convert(self, cell: Cell) -> dict[str, Any]:
        return table_fields(cell.body)

    def _buffer(self, fields: dict[str, Any], cell: Cell, position: Position) -> None:
        rows = self._rows.get(cell.column)
        if rows is None:
            rows = self._rows[cell.column] = _Rows()
        rows.fields.append(fields)  # first: the only append that could fail (memory) leaves the rest untouched
        rows.row_key.append(str(cell.row_key))
        rows.ref_key.append(cell.ref_key)
        rows.added_id.append(cell.added_id)
        rows.shard.append(cell.shard)
        rows.created_at.append(cell.created_at)

    # -- flush ------------------------------------------------------------------------------
    def flush(self) -> None:
        """Commit each column's buffered rows as one snapshot with the connector's offsets; SinkUnavailableError
        when the catalog or the warehouse cannot be written (what was not committed stays buffered)."""
        uncommitted = self.uncommitted()
        for column in sorted(self._rows):
            positions = {p: o for (c, p), o in uncommitted.items() if c == column}
            self._commit(column, self._rows[column], positions)
            del self._rows[column]
            self._committed_now({(column, p): o for p, o in positions.items()})

    def _commit(self, column: str, rows: _Rows, positions: dict[int, int]) -> None:
        table = self.table(column, create=True)
        assert table is not None
        for attempt in range(1, ATTEMPTS + 1):
            mine = self._committed_map(column)
            if positions and all(mine.get(p, -1) >= o for p, o in positions.items()):
                logger.info("iceberg sink: %s.%s holds these rows already (an earlier commit landed)",
                            *self.identifier(column))
                return
            merged = {**mine, **positions}
            try:
                with self._unavailable(f"committing to {'.'.join(self.identifier(column))}"):
                    self._append(column, table, rows, merged)
            except CommitFailedException as exc:
                logger.warning("iceberg sink: commit %d of %d to %s.%s lost a race (%s); retrying from the "
                               "table as it is now", attempt, ATTEMPTS, *self.identifier(column), exc)
                table = self._refresh(column)
                continue
            except BaseException:
                # the commit may have landed nonetheless: the next flush reads the table again, and finds out
                self._tables.pop(column, None)
                self._offsets.pop(column, None)
                raise
            self._offsets[column] = merged
            self.snapshots_committed += 1
            return
        raise SinkUnavailableError(f"iceberg sink: {ATTEMPTS} commits to {'.'.join(self.identifier(column))} lost "
                                   "a race with other writers")

    def _append(self, column: str, table: Table, rows: _Rows, offsets: dict[int, int]) -> None:
        """One transaction: the new columns, then the rows, with the offsets in the snapshot's summary."""
        # pyiceberg would retry a lost commit on its own with the summary as it was: the loop above re-merges
        table.metadata = table.metadata.model_copy(
            update={"properties": {**table.metadata.properties, "commit.retry.num-retries": "0"}})
        transaction = table.transaction()
        schema = table.schema()
        placed, added = self._place(column, schema, rows.fields)
        if added:
            with transaction.update_schema() as update:
                for name, kind in added.items():
                    update.add_column((name,), kind)
            schema = transaction.table_metadata.schema()
        arrow_schema = schema_to_pyarrow(schema)
        count = len(rows.fields)
        given: dict[str, list[Any]] = {"row_key": rows.row_key, "column": [column] * count, "ref_key": rows.ref_key,
                                       "added_id": rows.added_id, "shard": rows.shard,
                                       "created_at": rows.created_at, **placed}
        arrays = [pa.array(given[field.name], field.type) if field.name in given else pa.nulls(count, field.type)
                  for field in arrow_schema]
        summary = {CONNECTOR: self.connector, SOURCE: self.source,
                   OFFSETS: json.dumps({str(p): o for p, o in sorted(offsets.items())}, separators=(",", ":"))}
        # Transaction.append, with the files in hand: pyiceberg deletes a lost commit's manifests, not its data files
        with transaction.update_snapshot(snapshot_properties=summary).fast_append() as append:
            written = list(_dataframe_to_data_files(table_metadata=transaction.table_metadata, io=table.io,
                                                    df=pa.Table.from_arrays(arrays, schema=arrow_schema),
                                                    write_uuid=append.commit_uuid))
            for data_file in written:
                append.append_data_file(data_file)
        try:
            transaction.commit_transaction()
        except CommitFailedException:
            for data_file in written:  # the commit did not land: no snapshot references them
                table.io.delete(data_file.file_path)
            raise

    def _place(self, column: str, schema: Schema, fields: list[dict[str, Any]]
               ) -> tuple[dict[str, list[Any]], dict[str, PrimitiveType]]:
        """Each field value's column (the module docstring's rule) and value: {column: values, one a row} and
        the columns to add."""
        types: dict[str, IcebergType] = {f.name: f.field_type for f in schema.fields}
        added: dict[str, PrimitiveType] = {}
        out: dict[str, list[Any]] = {}
        # (field, Python type) -> (column, conversion or None): decided once, not per value (comparing
        # Iceberg types is a pydantic comparison, too slow to make per value)
        routes: dict[tuple[str, type], tuple[str, Callable[[Any], Any] | None]] = {}
        count = len(fields)
        for index, row in enumerate(fields):
            for name, value in row.items():
                if value is None:
                    continue
                route = routes.get((name, type(value)))
                if route is None:
                    target, kind = self._route(column, name, type(value), types, added)
                    route = routes[(name, type(value))] = (target, _conversion(kind, type(value)))
                target, convert = route
                values = out.get(target)
                if values is None:
                    values = out[target] = [None] * count
                values[index] = value if convert is None else convert(value)
        return out, added

    def _route(self, column: str, name: str, python: type, types: dict[str, IcebergType],
               added: dict[str, PrimitiveType]) -> tuple[str, IcebergType]:
        """The column a value of type ``python`` in field ``name`` goes to, and that column's type."""
        wanted = _TYPE_OF.get(python, _JSON)
        target = name
        while True:
            kind = types.get(target)
            if kind is None:
                types[target] = added[target] = wanted
                return target, wanted
            if kind == wanted or kind == StringType() or (kind == DoubleType() and python is int):
                return target, kind
            sibling = f"{target}__{wanted}"  # fare__double; if that takes no such value either, fare__double__double
            if (name, sibling) not in self._warned:
                self._warned.add((name, sibling))
                message = (f"column {column}: field {name!r} is {kind} in the table, got {python.__name__} "
                           f"values: they go to {sibling!r}")
                self.conflicts.append(message)
                logger.warning("iceberg sink: %s", message)
            target = sibling

    def close(self) -> None:
        self._rows.clear()
        if self._catalog is not None:
            self._catalog.engine.dispose()
            self._catalog = None
        self._tables.clear()


def connector_offsets(metadata: TableMetadata, connector: str) -> dict[int, int]:
    """{partition: last position} from ``connector``'s newest snapshot on the table's main branch ({} if none).

    Args:
        metadata: the table's metadata.
        connector: the connector's name (``cellstream.connector`` in a snapshot's summary).

    Returns:
        The offsets that snapshot carries (every partition the connector committed to the table).
    """
    return _offsets(offsets_snapshot(metadata, connector))


def offsets_snapshot(metadata: TableMetadata, connector: str | None = None) -> Snapshot | None:
    """The newest snapshot on the main branch carrying ``connector``'s offsets (any connector's when None).

    The current snapshot's ancestors first; then, since snapshot expiry cuts that chain (a snapshot whose parent
    expired has none), the snapshots kept that are older than where the chain ends, newest first (expiry keeps
    each connector's newest one; cellstream writes only to the main branch and never rolls it back).

    Args:
        metadata: the table's metadata.
        connector: the connector's name, or None.

    Returns:
        The snapshot, or None when no snapshot carries the offsets.
    """
    seen: set[int] = set()
    last: Snapshot | None = None
    for snapshot in ancestors_of(metadata.current_snapshot(), metadata):
        if _carries(snapshot, connector):
            return snapshot
        seen.add(snapshot.snapshot_id)
        last = snapshot
    if last is not None:
        kept = [s for s in metadata.snapshots if s.snapshot_id not in seen
                and (s.sequence_number or 0) < (last.sequence_number or 0)]
        for snapshot in sorted(kept, key=lambda s: s.sequence_number or 0, reverse=True):
            if _carries(snapshot, connector):
                return snapshot
    return None


def _carries(snapshot: Snapshot, connector: str | None) -> bool:
    summary = snapshot.summary
    return summary is not None and isinstance(summary.get(OFFSETS), str) and (
        connector is None or summary.get(CONNECTOR) == connector)


def _offsets(snapshot: Snapshot | None) -> dict[int, int]:
    offsets = snapshot.summary.get(OFFSETS) if snapshot is not None and snapshot.summary is not None else None
    return {int(p): int(o) for p, o in json.loads(offsets).items()} if isinstance(offsets, str) else {}


def _conversion(kind: IcebergType, python: type) -> Callable[[Any], Any] | None:
    """How a value of type ``python`` becomes what its column of type ``kind`` stores (the rule in the module
    docstring); None: as it is."""
    if kind == StringType():
        return None if python is str else json_text
    if kind == DoubleType() and python is not float:
        return float
    return None
