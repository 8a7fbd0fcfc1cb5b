"""How a source row becomes cells: its row key, each cell column's body, and the ref_key that versions them.

A row's key is its UUID column, or ``uuid5(namespace, "<table>:<key>")`` where ``<key>`` is the primary key's
values as a compact JSON array (``trips:[42]``, ``legs:[42,"b"]``): the same row always maps to the same key,
so both sides can find a row by the other's id (:func:`uuid5_row_key`). A body holds the spec's source columns
of that cell column, each value as JSON can hold it (:func:`json_value`). A deleted row becomes a tombstone: in
each cell column, a cell whose body is ``{"_deleted": true, "_key": [...]}``, the primary key's values as JSON
(:func:`logstore.cell.is_tombstone` tells one; indexes and the PostgreSQL sink honour it). ``_key`` is absent only
from a tombstone ``migrate repair`` wrote for a row the source never had.
"""

from __future__ import annotations

import base64
import datetime as dt
import decimal
import json
import math
import uuid
from collections.abc import Mapping
from typing import Any, NamedTuple

from connectors.errors import ConversionError
from connectors.migration.source import Key, SourceRow
from connectors.migration.spec import MigrationSpec, VersionColumn
from logstore.cell import TOMBSTONE_FIELD

TOMBSTONE: dict[str, Any] = {TOMBSTONE_FIELD: True}  # the marker every tombstone body holds


def tombstone(key: Key | None) -> dict[str, Any]:
    """A tombstone's body: the marker, and the row's primary key when known."""
    return dict(TOMBSTONE) if key is None else {**TOMBSTONE, "_key": [json_value(v) for v in key]}
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


class MigratedCell(NamedTuple):
    """A cell a source row (or its deletion) becomes."""

    row_key: uuid.UUID
    column: str
    ref_key: int
    body: dict[str, Any]


def uuid5_row_key(namespace: uuid.UUID, table: str, key: Key) -> uuid.UUID:
    """The row key of a source row whose primary key is ``key``, for a spec's ``row_key: {uuid5: namespace}``."""
    return uuid.uuid5(namespace, f"{table}:{json.dumps([json_value(v) for v in key], separators=(',', ':'))}")


def json_value(value: Any) -> Any:
    """A source value as a JSON body holds it: numbers, strings, booleans and null as they are; a Decimal as
    its exact text; times as ISO 8601 (a naive one is UTC); a UUID as text; bytes as base64; JSON as itself.

    Raises:
        ConversionError: a float that is not finite (JSON has none).
    """
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ConversionError(f"the value {value} has no JSON form")
        return value
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, dt.datetime):
        return (value if value.tzinfo is not None else value.replace(tzinfo=dt.UTC)).astimezone(dt.UTC).isoformat()
    if isinstance(value, dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, bytes | bytearray | memoryview):
        return base64.b64encode(bytes(value)).decode("ascii")
    if isinstance(value, Mapping):
        return {str(k): json_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_value(v) for v in value]
    return str(value)


class RowMapper:
    """A spec's mapping of its table's rows to cells."""

    def __init__(self, spec: MigrationSpec) -> None:
        self.spec = spec
        self._namespace = uuid.UUID(spec.row_key.uuid5) if spec.row_key.uuid5 else None
        self._version = spec.ref_key.column if isinstance(spec.ref_key, VersionColumn) else None

    def row_key(self, key: Key, values: Mapping[str, Any] | None) -> uuid.UUID:
        """The row key of the row with primary key ``key`` (its ``values`` needed for a UUID column).

        Raises:
            ConversionError: the UUID column is missing or does not hold a UUID.
        """
        if self._namespace is not None:
            return uuid5_row_key(self._namespace, self.spec.source.table, key)
        column = self.spec.row_key.column
        assert column is not None  # one of the two, by the spec's validation
        raw = None if values is None else values.get(column)
        try:
            if isinstance(raw, uuid.UUID):
                return raw
            if isinstance(raw, bytes | bytearray) and len(raw) == 16:
                return uuid.UUID(bytes=bytes(raw))
            return uuid.UUID(str(raw))
        except ValueError:
            raise ConversionError(f"row {list(key)}: {column} holds {raw!r}, not a UUID") from None

    def version(self, values: Mapping[str, Any]) -> int:
        """A row's ref_key from its version column: an integer as it is, a time in microseconds since the epoch.

        Raises:
            ConversionError: the column is missing, empty, negative or of another type.
        """
        assert self._version is not None
        raw = values.get(self._version)
        if isinstance(raw, dt.datetime):
            when = raw if raw.tzinfo is not None else raw.replace(tzinfo=dt.UTC)
            raw = (when - _EPOCH) // dt.timedelta(microseconds=1)
        if type(raw) is not int or raw < 0:
            raise ConversionError(f"{self._version} holds {raw!r}: a version column holds a time or a number >= 0")
        return raw

    def cells(self, row: SourceRow, position: int) -> list[MigratedCell]:
        """The cells of a row as read at log ``position`` (the ref_key with ``ref_key: log_position``).

        Raises:
            ConversionError: a value has no JSON form, or the key or version column is wrong.
        """
        key = self.row_key(row.key, row.values)
        ref_key = position if self._version is None else self.version(row.values)
        return [MigratedCell(key, column, ref_key, {name: json_value(row.values.get(name)) for name in fields})
                for column, fields in self.spec.columns.items()]

    def tombstones(self, key: Key, values: Mapping[str, Any] | None, ref_key: int) -> list[MigratedCell]:
        """The cells a deletion becomes: a tombstone in each cell column, at ``ref_key``."""
        row_key = self.row_key(key, values)
        return [MigratedCell(row_key, column, ref_key, tombstone(key)) for column in self.spec.columns]

    @property
    def versioned_by_position(self) -> bool:
        """Whether ref_keys are log positions (else a version column's values)."""
        return self._version is None
