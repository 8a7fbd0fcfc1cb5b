"""The PostgreSQL sink: one table per column, loaded by COPY (into a staging table, then one upsert per flush).

Each column's table holds the cell's coordinates, the body as JSONB and the configured *promoted* fields as typed
columns; ``history`` keeps a row per cell, ``latest`` a row per row_key replaced only by a higher ref_key. A
tombstone cell (:func:`logstore.cell.is_tombstone`, a migrated row's deletion) is a row with ``deleted`` true and
its promoted columns NULL: in ``latest``, the row's state from then on. A
flush is one transaction and idempotent: writing the same cells twice, in any order, leaves the tables as if
written once. A promoted value that does not fit its type is a ConversionError (dead-lettered); connection errors
are SinkUnavailableError (retried). docs/connectors.md (PostgreSQL) gives the design.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import math
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb

from connectors.config import PostgresSinkConfig, Promoted, table_name
from connectors.errors import ConfigurationError, ConnectorError, ConversionError, SinkUnavailableError
from connectors.sinks.base import Position, Sink
from logstore import Cell
from logstore.cell import is_tombstone
from logstore.errors import AuthenticationError

logger = logging.getLogger(__name__)
_SQL_TYPES = {"text": "text", "bigint": "bigint", "double": "double precision", "boolean": "boolean",
              "timestamptz": "timestamptz", "uuid": "uuid", "jsonb": "jsonb"}
_BINARY_TYPES = {"text": "text", "bigint": "int8", "double": "float8", "boolean": "bool", "timestamptz": "timestamptz",
                 "uuid": "uuid", "jsonb": "jsonb"}


def _value(promoted: Promoted, value: Any) -> Any:
    """A promoted field's value for its column type; ValueError when it does not fit."""
    if value is None:
        return None
    kind = promoted.type
    if kind == "text":
        return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
    if kind == "bigint" and type(value) is int and -(1 << 63) <= value < 1 << 63:
        return value
    if kind == "double" and type(value) in (int, float) and math.isfinite(value):
        return float(value)
    if kind == "boolean" and type(value) is bool:
        return value
    if kind == "timestamptz" and isinstance(value, str):
        when = dt.datetime.fromisoformat(value)
        if when.tzinfo is not None:
            return when
    if kind == "uuid" and isinstance(value, str):
        return uuid.UUID(value)
    if kind == "jsonb":
        return Jsonb(value)
    raise ValueError(f"{type(value).__name__} {value!r:.40}")


def _lookup(body: dict[str, Any], parts: tuple[str, ...]) -> Any:
    value: Any = body
    for part in parts:
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value


class PostgresSink(Sink):
    """The tables of one connector process (see the module docstring)."""

    def __init__(self, config: PostgresSinkConfig) -> None:
        super().__init__()
        self.config = config
        self._rows: dict[str, list[tuple[Any, ...]]] = {}
        self._conn: psycopg.Connection[Any] | None = None
        self._plans = {column: [(tuple(p.field.split(".")), p) for p in spec.promote]
                       for column, spec in config.columns.items()}
        self.flushes = 0
        self.direct = 0  # loads COPYed straight into a history table
        self.staged = 0  # loads through staging and an upsert

    # -- connection -----------------------------------------------------------------
    def _connection(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed:
            with _translated("connecting"):
                self._conn = psycopg.connect(self.config.url.get_secret_value(), connect_timeout=10)
                self._create(self._conn)
        return self._conn

    def _create(self, conn: psycopg.Connection[Any]) -> None:
        schema = sql.Identifier(self.config.db_schema)
        with conn.transaction():
            conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(schema))
            for column, spec in self.config.columns.items():
                table = sql.Identifier(self.config.db_schema, table_name(column, spec))
                key = "row_key" if spec.mode == "latest" else "row_key, ref_key"
                conn.execute(sql.SQL(
                    "CREATE TABLE IF NOT EXISTS {} (row_key uuid NOT NULL, ref_key bigint NOT NULL, added_id bigint "
                    "NOT NULL, shard integer NOT NULL, created_at timestamptz NOT NULL, body jsonb NOT NULL, "
                    "PRIMARY KEY ({}))").format(table, sql.SQL(key)))
                # A tombstone's row (logstore.cell.is_tombstone): kept, flagged, so a older cell delivered later
                # cannot bring the row back (Debezium's `__deleted` in its rewrite mode). Added to older tables too.
                conn.execute(sql.SQL("ALTER TABLE {} ADD COLUMN IF NOT EXISTS deleted boolean NOT NULL DEFAULT false"
                                     ).format(table))
                for promoted in spec.promote:
                    conn.execute(sql.SQL("ALTER TABLE {} ADD COLUMN IF NOT EXISTS {} {}").format(
                        table, sql.Identifier(promoted.name), sql.SQL(_SQL_TYPES[promoted.type])))

    # -- rows -----------------------------------------------------------------------
    def convert(self, cell: Cell) -> tuple[Any, ...]:
        plan = self._plans.get(cell.column)
        if plan is None:
            raise ConversionError(f"postgres sink: column {cell.column} has no table in the configuration")
        body = cell.body
        deleted = is_tombstone(body)
        promoted: list[Any] = []
        for parts, field in plan:
            if deleted:  # no fields: the row has no values from this version on
                promoted.append(None)
                continue
            try:
                promoted.append(_value(field, _lookup(body, parts)))
            except ValueError as exc:
                raise ConversionError(f"body field {field.field!r} does not fit {field.type}: {exc}") from None
        # The body goes as it is: the binary COPY's jsonb dumper serializes it.
        return (cell.row_key, cell.ref_key, cell.added_id, cell.shard, cell.created_at, body, deleted, *promoted)

    def _buffer(self, converted: tuple[Any, ...], cell: Cell, position: Position) -> None:
        self._rows.setdefault(cell.column, []).append(converted)

    def flush(self) -> None:
        if not self._rows:
            return
        conn = self._connection()
        try:
            with _translated("flushing"), conn.transaction():
                for column, rows in self._rows.items():
                    self._load(conn, column, rows)
        except SinkUnavailableError:
            self._drop_connection()
            raise
        self._rows.clear()
        self.flushes += 1

    def _load(self, conn: psycopg.Connection[Any], column: str, rows: list[tuple[Any, ...]]) -> None:
        spec = self.config.columns[column]
        table = sql.Identifier(self.config.db_schema, table_name(column, spec))
        names = ["row_key", "ref_key", "added_id", "shard", "created_at", "body", "deleted",
                 *(p.name for p in spec.promote)]
        columns = sql.SQL(", ").join(sql.Identifier(n) for n in names)
        types = ["uuid", "int8", "int8", "int4", "timestamptz", "jsonb", "bool",
                 *(_BINARY_TYPES[p.type] for p in spec.promote)]
        if spec.mode == "history":
            try:
                with conn.transaction():
                    self._copy(conn, table, columns, types, rows)
                self.direct += 1
                return
            except psycopg.errors.UniqueViolation:
                logger.info("postgres sink: %s already holds some of %d cells; loading them through staging",
                            table.as_string(conn), len(rows))
        self.staged += 1
        # Dropped at the end: the next table's staging has that table's columns.
        conn.execute(sql.SQL("CREATE TEMP TABLE staging_rows (LIKE {}) ON COMMIT DROP").format(table))
        self._copy(conn, sql.Identifier("staging_rows"), columns, types, rows)
        if spec.mode == "history":  # a cell twice in one statement is a conflict like any other: no DISTINCT
            conn.execute(sql.SQL("INSERT INTO {table} ({columns}) SELECT {columns} FROM staging_rows "
                                 "ON CONFLICT (row_key, ref_key) DO NOTHING").format(table=table, columns=columns))
        else:
            updates = sql.SQL(", ").join(sql.SQL("{0} = excluded.{0}").format(sql.Identifier(n)) for n in names[1:])
            conn.execute(sql.SQL("INSERT INTO {table} AS t ({columns}) SELECT DISTINCT ON (row_key) {columns} "
                                 "FROM staging_rows ORDER BY row_key, ref_key DESC ON CONFLICT (row_key) DO UPDATE "
                                 "SET {updates} WHERE t.ref_key < excluded.ref_key").format(
                table=table, columns=columns, updates=updates))
        conn.execute("DROP TABLE staging_rows")

    @staticmethod
    def _copy(conn: psycopg.Connection[Any], table: sql.Identifier, columns: sql.Composable, types: list[str],
              rows: list[tuple[Any, ...]]) -> None:
        with conn.cursor() as cur, cur.copy(sql.SQL("COPY {} ({}) FROM STDIN (FORMAT BINARY)").format(
                table, columns)) as copy:
            copy.set_types(types)
            for row in rows:
                copy.write_row(row)

    def _drop_connection(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(psycopg.Error):
                self._conn.close()
            self._conn = None

    def close(self) -> None:
        self._rows.clear()
        self._drop_connection()


@contextlib.contextmanager
def _translated(what: str) -> Iterator[None]:
    """psycopg's errors as the connectors' (the one place they are translated)."""
    try:
        yield
    except psycopg.OperationalError as exc:
        message = f"postgres sink: {what} failed: {_without_secret(exc)}"
        # libpq gives no SQLSTATE for a refused connection: the server's and libpq's own messages tell.
        if any(sign in message for sign in _REFUSED):
            raise AuthenticationError(message) from None
        if any(sign in message for sign in _TLS_SETUP):
            raise ConfigurationError(f"{message} (TLS: check the URL's sslmode, sslrootcert, sslcert and "
                                     "sslkey)") from None
        raise SinkUnavailableError(message) from None
    except psycopg.Error as exc:
        raise ConnectorError(f"postgres sink: {what} failed: {_without_secret(exc)}") from exc


_REFUSED = ("password authentication failed", "pg_hba.conf rejects", "no pg_hba.conf entry",
            "requires a valid client certificate", "certificate authentication failed")
_TLS_SETUP = ("certificate verify failed", "does not match host name", "root certificate file",
              "certificate file", "private key file", "server does not support SSL")


def _without_secret(exc: BaseException) -> str:
    """psycopg's message names host, port and user, never the password; keep only its first line."""
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__

