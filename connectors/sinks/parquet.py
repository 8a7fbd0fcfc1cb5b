"""The Parquet lake sink: ``<root>/<column>/date=YYYY-MM-DD/part-<time>-<id>.parquet`` (Hive-style, by the cell's
UTC date), read back with DuckDB's ``read_parquet(..., hive_partitioning=true, union_by_name=true)``.

A file holds the cells of one column and date from every shard a checkpoint covers, up to ``max_rows`` and
``max_bytes``: the file count follows the data, not the shard count. Files are written under the writer's
staging folder and committed with the positions they hold by the lake's commit log
(:mod:`connectors.sinks.commits`), so every cell ends in exactly one file: after a crash the log says what the
lake holds, and the cells the source hands over again are skipped up to there. A field's type conflict widens
or stringifies the column (``<root>/<column>/_schema.json``), never a crash. docs/connectors.md (The Parquet
lake) gives the design.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq

from connectors.config import ParquetSinkConfig
from connectors.errors import ConfigurationError, SinkUnavailableError
from connectors.sinks.base import Position, Sink, json_text, table_fields, utc_date
from connectors.sinks.commits import CommitLog, CommitRecord, Staged
from logstore import Cell
from logstore.files import create_private_file, private_dir, private_opener

logger = logging.getLogger(__name__)
Kind = Literal["bool", "int", "float", "string", "json"]
ARROW_TYPES = {"bool": pa.bool_(), "int": pa.int64(), "float": pa.float64(), "string": pa.string(), "json": pa.string()}
_CELL_SCHEMA = [("row_key", pa.string()), ("column", pa.string()), ("ref_key", pa.int64()),
                ("added_id", pa.int64()), ("shard", pa.int32()), ("created_at", pa.timestamp("us", tz="UTC"))]
SCHEMA_FILE = "_schema.json"


# A body value's kind by its exact type (bodies come from JSON: no subclasses); anything else is json.
_KIND_OF: dict[type, Kind | None] = {bool: "bool", int: "int", float: "float", str: "string", type(None): None}


class _Buffer:
    """The cells of one column and day waiting for a file, and their flattened bodies (kept apart: the cell's
    own columns become arrays straight from the cells)."""

    __slots__ = ("bytes", "cells", "fields", "started")

    def __init__(self, started: float) -> None:
        self.cells: list[Cell] = []
        self.fields: list[dict[str, Any]] = []
        self.bytes = 0
        self.started = started


class ParquetSink(Sink):
    """The lake of one connector process (see the module docstring).

    Args:
        config: the sink's settings.
        clock: seconds, for ``max_seconds`` (tests pass their own).
        source: what the positions count, ``"store"`` (shards) or ``"kafka"`` (topic partitions): a lake
            holds the positions of one source.
        connector: the connector's name, recorded with each commit.

    Raises:
        ConfigurationError: the root cannot be created.
        SinkUnavailableError: its commit log cannot be set up.
    """

    def __init__(self, config: ParquetSinkConfig, clock: Callable[[], float] = time.monotonic, *,
                 source: str = "store", connector: str | None = None) -> None:
        super().__init__()
        self.config = config
        self.root = config.root
        self.source = source
        try:
            private_dir(self.root)  # one that exists, made by its user, keeps its mode
        except OSError as exc:
            raise ConfigurationError(f"parquet sink: cannot create {self.root}: {exc.strerror}") from None
        self.log = CommitLog(self.root, connector)
        self._clock = clock
        self._buffers: dict[tuple[str, str], _Buffer] = {}
        self._latest: tuple[str, str] | None = None  # the buffer the last row went to
        self._staged: list[Staged] = []  # written by rotations, committed by the next flush
        self._schemas: dict[str, dict[str, Kind]] = {}
        self._changed: set[str] = set()  # columns whose registry changed since it was saved
        self.conflicts: list[str] = []
        self.files_written = 0
        self.last_commit: CommitRecord | None = None

    def committed(self, column: str, partition: int) -> int | None:
        return self.log.committed(self.source, column, partition)

    def check(self, columns: list[str]) -> None:
        self.log.check_source(self.source)  # one source a lake, whatever the column

    # -- buffering ------------------------------------------------------------------
    def convert(self, cell: Cell) -> dict[str, Any]:
        return table_fields(cell.body)

    def _buffer(self, fields: dict[str, Any], cell: Cell, position: Position) -> None:
        schema = self._schema(cell.column)
        size = 64
        for name, value in fields.items():
            kind = _KIND_OF.get(type(value), "json")
            if kind is not None and schema.get(name) != kind:
                self._learn(cell.column, schema, name, kind)
            size += len(value) if kind == "string" else 8
        key = (cell.column, utc_date(cell.created_at))
        buffer = self._buffers.get(key)
        if buffer is None:
            buffer = self._buffers[key] = _Buffer(self._clock())
        buffer.cells.append(cell)
        buffer.fields.append(fields)
        buffer.bytes += size
        self._latest = key

    def _rotate(self, cell: Cell) -> None:
        key = self._latest
        buffer = self._buffers.get(key) if key is not None else None
        if buffer is not None and key is not None and (
                len(buffer.cells) >= self.config.max_rows or buffer.bytes >= self.config.max_bytes
                or self._clock() - buffer.started >= self.config.max_seconds):
            self._stage_all({key: buffer})
            del self._buffers[key]  # only once staged: a failed write keeps the rows for the next flush

    def _learn(self, column: str, schema: dict[str, Kind], name: str, kind: Kind | None) -> None:
        if kind is None:
            return
        known = schema.get(name)
        if known is None:
            schema[name] = kind
        elif known == kind or known in ("string", "json") or (known == "float" and kind == "int"):
            return
        elif known == "int" and kind == "float":
            schema[name] = "float"
        else:
            schema[name] = "string"
            message = f"column {column}: field {name!r} was {known}, got {kind}; it is a string column from now on"
            self.conflicts.append(message)
            logger.warning("parquet sink: %s", message)
        self._changed.add(column)

    def _schema(self, column: str) -> dict[str, Kind]:
        found = self._schemas.get(column)
        if found is None:
            path = self.root / column / SCHEMA_FILE
            try:
                found = json.loads(path.read_text()) if path.exists() else {}
            except (OSError, ValueError) as exc:
                raise SinkUnavailableError(f"parquet sink: cannot read {path}: {exc}") from exc
            self._schemas[column] = found
        return found

    # -- flush ----------------------------------------------------------------------
    def flush(self) -> None:
        """Write what is buffered and commit it, with the positions written so far, as one commit."""
        self._stage_all(self._buffers)
        self._buffers = {}  # only once staged: after a failure the next flush writes them all again
        positions = self.uncommitted()
        try:
            for column in sorted(self._changed):  # before the files that need it
                self._save_schema(column)
            self._changed.clear()
        except OSError as exc:
            raise SinkUnavailableError(f"parquet sink: writing under {self.root} failed: {exc}") from exc
        record = self.log.commit(self._staged, positions, self.source)
        self._committed_now(positions)
        self.files_written += len(self._staged)
        self._staged = []
        if record is not None:
            self.last_commit = record

    def _stage_all(self, buffers: dict[tuple[str, str], _Buffer]) -> None:
        staged: list[Staged] = []
        try:
            for (column, date), buffer in buffers.items():
                staged.append(self._stage(column, date, buffer))
        except OSError as exc:
            for done in staged:
                done.path.unlink(missing_ok=True)
            raise SinkUnavailableError(f"parquet sink: writing under {self.root} failed: {exc}") from exc
        self._staged.extend(staged)

    def _stage(self, column: str, date: str, buffer: _Buffer) -> Staged:
        schema = self._schema(column)
        cells, bodies = buffer.cells, buffer.fields
        arrays = [pa.array([str(c.row_key) for c in cells], pa.string()),
                  pa.array([c.column for c in cells], pa.string()), pa.array([c.ref_key for c in cells], pa.int64()),
                  pa.array([c.added_id for c in cells], pa.int64()), pa.array([c.shard for c in cells], pa.int32()),
                  pa.array([c.created_at for c in cells], pa.timestamp("us", tz="UTC"))]
        fields = [pa.field(name, arrow) for name, arrow in _CELL_SCHEMA]
        for name in sorted(set().union(*bodies)):
            kind = schema.get(name, "string")  # "string" when only nulls were seen so far
            arrays.append(_array(kind, [body.get(name) for body in bodies]))
            fields.append(pa.field(name, ARROW_TYPES[kind]))
        table = pa.Table.from_arrays(arrays, schema=pa.schema(fields))
        return write_staged(table, self.log.staging, f"{column}/date={date}", self.config.compression)

    def _save_schema(self, column: str) -> None:
        path = self.root / column / SCHEMA_FILE
        private_dir(path.parent)
        temporary = path.with_name(f".{SCHEMA_FILE}.{uuid.uuid4().hex[:8]}.tmp")
        with open(temporary, "w", opener=private_opener) as fh:
            fh.write(json.dumps(self._schemas[column], sort_keys=True, indent=1))
        os.replace(temporary, path)

    def close(self) -> None:
        self._buffers.clear()
        self._staged = []
        self.log.close()

    def files(self, column: str) -> list[Path]:
        """The column's data files, in name order (for tests and status)."""
        return sorted((self.root / column).glob("date=*/*.parquet"))


def write_staged(table: pa.Table, staging: Path, partition: str, compression: str) -> Staged:
    """Write ``table`` as one Parquet file under ``staging`` (synced: a commit may follow at once), named for
    the lake's ``partition`` folder (``BASE/date=2026-11-26``)."""
    name = f"part-{dt.datetime.now(dt.UTC):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:12]}.parquet"
    path = staging / f"{partition.replace('/', '.')}.{name}"
    create_private_file(path)  # Arrow writes into it, keeping its mode
    pq.write_table(table, path, compression=compression)
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())
        size = os.fstat(handle.fileno()).st_size
    return Staged(path=path, final=f"{partition}/{name}", rows=table.num_rows, bytes=size)


def _array(kind: Kind, values: list[Any]) -> pa.Array:
    """One field's column. The registry only widens, so the values are of its kind (or ints in a float
    column) unless a conflict made it a string column: those values, and json ones, become JSON text."""
    if kind != "json":
        try:
            return pa.array(values, ARROW_TYPES[kind])
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            pass
    return pa.array([_convert(kind, value) for value in values], ARROW_TYPES[kind])


def _convert(kind: Kind, value: Any) -> Any:
    if value is None:
        return None
    if kind == "float":
        return float(value)
    if kind == "json" or (kind == "string" and not isinstance(value, str)):
        return json_text(value)
    return value

