"""The Parquet lake sink: ``<root>/<column>/date=YYYY-MM-DD/p<partition>-<first>-<last>.parquet`` (Hive-style,
by the cell's UTC date), read back with DuckDB's ``read_parquet(..., hive_partitioning=true, union_by_name=true)``.

A file holds consecutive cells of one column, date and source partition; it is written under a temporary name,
synced and renamed, so a reader never sees half a file. Every cell ends in exactly one file: rows an earlier
process wrote but never committed are removed when the source resumes (:meth:`ParquetSink.begin`). A field's
type conflict widens or stringifies the column (``<root>/<column>/_schema.json``), never a crash.
docs/connectors.md (The Parquet lake) gives the design.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from connectors.config import ParquetSinkConfig
from connectors.errors import ConfigurationError, ConversionError, SinkUnavailableError
from connectors.sinks.base import CELL_COLUMNS, Position, Sink, flatten, json_text, utc_date
from logstore import Cell
from logstore.files import create_private_file, private_dir, private_opener

logger = logging.getLogger(__name__)
Kind = Literal["bool", "int", "float", "string", "json"]
_ARROW = {"bool": pa.bool_(), "int": pa.int64(), "float": pa.float64(), "string": pa.string(), "json": pa.string()}
_CELL_SCHEMA = [("row_key", pa.string()), ("column", pa.string()), ("ref_key", pa.int64()),
                ("added_id", pa.int64()), ("shard", pa.int32()), ("created_at", pa.timestamp("us", tz="UTC"))]
_NAME = re.compile(r"^p(\d+)-(\d+)-(\d+)\.parquet$")
_SCHEMA_FILE = "_schema.json"
_STALE_TEMPORARY = 600.0  # seconds: a schema file is written and renamed within milliseconds


# A body value's kind by its exact type (bodies come from JSON: no subclasses); anything else is json.
_KIND_OF: dict[type, Kind | None] = {bool: "bool", int: "int", float: "float", str: "string", type(None): None}


class _Buffer:
    __slots__ = ("bytes", "first", "last", "rows", "started")

    def __init__(self, started: float) -> None:
        self.rows: list[dict[str, Any]] = []
        self.first = self.last = -1
        self.bytes = 0
        self.started = started


class ParquetSink(Sink):
    """The lake of one connector process (see the module docstring)."""

    def __init__(self, config: ParquetSinkConfig, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.config = config
        self.root = config.root
        try:
            private_dir(self.root)  # one that exists, made by its user, keeps its mode
        except OSError as exc:
            raise ConfigurationError(f"parquet sink: cannot create {self.root}: {exc.strerror}") from None
        self._clock = clock
        self._buffers: dict[tuple[str, str, int], _Buffer] = {}
        self._latest: tuple[str, str, int] | None = None  # the buffer the last row went to
        self._schemas: dict[str, dict[str, Kind]] = {}
        self._changed: set[str] = set()  # columns whose registry changed since it was saved
        self._begun: set[tuple[str, int]] = set()  # (column, partition)s this process recovered and writes
        self.conflicts: list[str] = []
        self.files_written = 0

    # -- buffering ------------------------------------------------------------------
    def convert(self, cell: Cell) -> dict[str, Any]:
        fields = flatten(cell.body)
        for name, value in fields.items():
            if type(value) is int and not -(1 << 63) <= value < 1 << 63:
                raise ConversionError(f"body field {name!r}: {value} does not fit a 64-bit integer column")
        return fields

    def _buffer(self, fields: dict[str, Any], cell: Cell, position: Position) -> None:
        schema = self._schema(cell.column)
        size = 64
        for name, value in fields.items():
            kind = _KIND_OF.get(type(value), "json")
            if kind is not None and schema.get(name) != kind:
                self._learn(cell.column, schema, name, kind)
            size += len(value) if kind == "string" else 8
        row: dict[str, Any] = {"row_key": str(cell.row_key), "column": cell.column, "ref_key": cell.ref_key,
                               "added_id": cell.added_id, "shard": cell.shard, "created_at": cell.created_at}
        row.update(fields)
        key = (cell.column, utc_date(cell.created_at), position.partition)
        buffer = self._buffers.get(key)
        if buffer is None:
            buffer = self._buffers[key] = _Buffer(self._clock())
            buffer.first = buffer.last = position.offset
        buffer.rows.append(row)
        buffer.first, buffer.last = min(buffer.first, position.offset), max(buffer.last, position.offset)
        buffer.bytes += size
        self._latest = key

    def _rotate(self, cell: Cell) -> None:
        key = self._latest
        buffer = self._buffers.get(key) if key is not None else None
        if buffer is not None and key is not None and (
                len(buffer.rows) >= self.config.max_rows or buffer.bytes >= self.config.max_bytes
                or self._clock() - buffer.started >= self.config.max_seconds):
            self._write({key: buffer})
            del self._buffers[key]  # only once written: a failed write keeps the rows for the next flush

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
            path = self.root / column / _SCHEMA_FILE
            try:
                found = json.loads(path.read_text()) if path.exists() else {}
            except (OSError, ValueError) as exc:
                raise SinkUnavailableError(f"parquet sink: cannot read {path}: {exc}") from exc
            self._schemas[column] = found
        return found

    # -- flush ----------------------------------------------------------------------
    def flush(self) -> None:
        self._write(self._buffers)
        self._buffers = {}  # only once written: after a failure the next flush writes them all again

    def _write(self, buffers: dict[tuple[str, str, int], _Buffer]) -> None:
        if not buffers:
            return
        try:
            staged = [self._stage(column, date, partition, buffer)
                      for (column, date, partition), buffer in buffers.items()]
            for temporary, final in staged:
                os.replace(temporary, final)
                _sync_dir(final.parent)
            for column in sorted(self._changed):
                self._save_schema(column)
            self._changed.clear()
        except OSError as exc:
            raise SinkUnavailableError(f"parquet sink: writing under {self.root} failed: {exc}") from exc
        self.files_written += len(staged)

    def _stage(self, column: str, date: str, partition: int, buffer: _Buffer) -> tuple[Path, Path]:
        schema = self._schema(column)
        names = sorted({name for row in buffer.rows for name in row} - set(CELL_COLUMNS))
        arrays = [pa.array([row[name] for row in buffer.rows], arrow) for name, arrow in _CELL_SCHEMA]
        fields = [pa.field(name, arrow) for name, arrow in _CELL_SCHEMA]
        for name in names:
            kind = schema.get(name, "string")  # "string" when only nulls were seen so far
            arrays.append(_array(kind, [row.get(name) for row in buffer.rows]))
            fields.append(pa.field(name, _ARROW[kind]))
        table = pa.Table.from_arrays(arrays, schema=pa.schema(fields))
        directory = self.root / column / f"date={date}"
        private_dir(directory)
        final = directory / f"p{partition:05d}-{buffer.first:020d}-{buffer.last:020d}.parquet"
        temporary = directory / f".{final.name}.{uuid.uuid4().hex[:8]}.tmp"
        create_private_file(temporary)  # Arrow writes into it, keeping its mode
        pq.write_table(table, temporary, compression=self.config.compression)
        with open(temporary, "rb") as handle:
            os.fsync(handle.fileno())
        return temporary, final

    def begin(self, column: str, partition: int, start: int) -> None:
        """Rows of ``column`` an earlier process wrote for ``partition`` from ``start`` on were never
        committed, and go (they come again): a file holding only such rows is deleted, one that also holds
        committed rows is rewritten without them. The temporary files a killed process left go too: the
        partition's (this process owns it now, nobody else writes them) and the column's schema files older
        than a writer ever keeps one."""
        if (column, partition) in self._begun:
            return
        try:
            for leftover in (self.root / column).glob(f"date=*/.p{partition:05d}-*.parquet.*.tmp"):
                logger.info("parquet sink: deleting %s, left by a process that stopped mid-write", leftover)
                leftover.unlink(missing_ok=True)
            for leftover in (self.root / column).glob(f".{_SCHEMA_FILE}.*.tmp"):
                with contextlib.suppress(FileNotFoundError):
                    if time.time() - leftover.stat().st_mtime > _STALE_TEMPORARY:
                        logger.info("parquet sink: deleting %s, left by a process that stopped mid-write", leftover)
                        leftover.unlink()
            for path in sorted((self.root / column).glob(f"date=*/p{partition:05d}-*.parquet")):
                found = _NAME.match(path.name)
                if found is None:
                    continue
                first, last = int(found.group(2)), int(found.group(3))
                if first >= start:
                    logger.info("parquet sink: deleting %s, written but never committed", path)
                    path.unlink(missing_ok=True)
                elif last >= start:
                    self._trim(path, start)
        except OSError as exc:
            raise SinkUnavailableError(f"parquet sink: recovering {column} of partition {partition} failed: "
                                       f"{exc}") from exc
        self._begun.add((column, partition))

    def _trim(self, path: Path, start: int) -> None:
        table = pq.read_table(path)
        kept = table.filter(pc.less(table["added_id"], start))
        last = max(kept["added_id"].to_pylist())
        found = _NAME.match(path.name)
        assert found is not None
        final = path.with_name(f"p{found.group(1)}-{found.group(2)}-{last:020d}.parquet")
        temporary = path.with_name(f".{final.name}.{uuid.uuid4().hex[:8]}.tmp")
        create_private_file(temporary)
        pq.write_table(kept, temporary, compression=self.config.compression)
        with open(temporary, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(temporary, final)
        if final != path:
            path.unlink()
        _sync_dir(path.parent)
        logger.info("parquet sink: %s keeps its %d committed rows as %s", path, kept.num_rows, final.name)

    def _save_schema(self, column: str) -> None:
        path = self.root / column / _SCHEMA_FILE
        private_dir(path.parent)
        temporary = path.with_name(f".{_SCHEMA_FILE}.{uuid.uuid4().hex[:8]}.tmp")
        with open(temporary, "w", opener=private_opener) as fh:
            fh.write(json.dumps(self._schemas[column], sort_keys=True, indent=1))
        os.replace(temporary, path)

    def close(self) -> None:
        self._buffers.clear()

    def files(self, column: str) -> list[Path]:
        """The column's data files, in name order (for tests and status)."""
        return sorted((self.root / column).glob("date=*/p*.parquet"))


def _array(kind: Kind, values: list[Any]) -> pa.Array:
    """One field's column. The registry only widens, so the values are of its kind (or ints in a float
    column) unless a conflict made it a string column: those values, and json ones, become JSON text."""
    if kind != "json":
        try:
            return pa.array(values, _ARROW[kind])
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            pass
    return pa.array([_convert(kind, value) for value in values], _ARROW[kind])


def _convert(kind: Kind, value: Any) -> Any:
    if value is None:
        return None
    if kind == "float":
        return float(value)
    if kind == "json" or (kind == "string" and not isinstance(value, str)):
        return json_text(value)
    return value


def _sync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

