"""A PostgreSQL table as the source of a migration: chunks read with psycopg 3 in REPEATABLE READ snapshots,
changes decoded from the write-ahead log by the built-in ``pgoutput`` plugin through a logical replication slot
(no extension to install; the server needs ``wal_level=logical``), both on one axis: log sequence numbers.

A position is an LSN as an int (``X/Y`` is ``(X << 32) + Y``). A change's position is its transaction's commit
LSN (the start of the commit record, from the Begin message), the same for every change of a transaction.
Acknowledging a position advances the slot past that commit record, so the slot, not a table, remembers where
the capture resumes, and the server keeps its log from there until acknowledged (or the slot is dropped).

Values come out as the types a cell's body holds, the same from a chunk as from a change (both are loaded by
psycopg's loaders from the text form, by type OID): integers as int, numeric as Decimal, text as str, bool,
float, timestamp and timestamptz as aware UTC datetimes (timestamp is taken to be UTC), date, uuid as UUID,
time, json/jsonb parsed, bytea as bytes; any other type (arrays, inet, enums, domains...) as its text form (its
output function's, which the log carries and a chunk's connection loads verbatim).
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import json
import logging
import struct
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import psycopg
from psycopg import abc, sql
from psycopg.adapt import Transformer
from psycopg.pq import Format
from psycopg.types.string import TextLoader

from connectors.errors import MigrationSourceError, MigrationSourceUnavailableError
from connectors.migration.mapping import json_value
from connectors.migration.source import Change, ChangeLag, Chunk, Key, MigrationSource, SourceLoad, SourceRow

logger = logging.getLogger(__name__)

_PG_EPOCH = dt.datetime(2000, 1, 1, tzinfo=dt.UTC)  # pgoutput's timestamps: microseconds since then
# The types converted (by OID): bool, bytea, name, int8, int2, int4, text, oid, json, float4, float8, bpchar,
# varchar, date, time, timestamp, timestamptz, numeric, uuid, jsonb. Others stay text.
_CONVERTED = frozenset({16, 17, 19, 20, 21, 23, 25, 26, 114, 700, 701, 1042, 1043, 1082, 1083, 1114, 1184, 1700,
                        2950, 3802})
_BYTEA = 17
_INTEGERS = frozenset({20, 21, 23})  # int8, int2, int4
# How long a chunk waits for the transactions committing at its position to end (see _chunk_position).
CHUNK_WAIT_SECONDS = 60.0
SLOT_BUSY_WAIT = 5.0  # seconds a read of the slot waits for another session's read of it


def lsn_to_int(lsn: str) -> int:
    """The int of an LSN in PostgreSQL's text form ``X/Y`` (hexadecimal halves)."""
    high, low = lsn.split("/")
    return (int(high, 16) << 32) + int(low, 16)


def int_to_lsn(position: int) -> str:
    """The text form ``X/Y`` of an int LSN."""
    return f"{position >> 32:X}/{position & 0xFFFFFFFF:X}"


def _normal(value: Any) -> Any:
    """A loaded value as a cell's body holds it: datetimes aware and in UTC (a timestamp without time zone is
    taken to be UTC), the rest as psycopg loads it."""
    if isinstance(value, dt.datetime):
        return value.replace(tzinfo=dt.UTC) if value.tzinfo is None else value.astimezone(dt.UTC)
    return value


def _input_form(value: Any, oid: int) -> Any:
    """A cell's JSON value as ``json_populate_recordset`` takes it for a column of type ``oid``: bytea's base64
    as hex input; everything else as it is (the text forms are the types' input forms)."""
    if oid == _BYTEA and isinstance(value, str):
        return "\\x" + base64.b64decode(value).hex()
    return value


class _Relation(NamedTuple):
    """A pgoutput Relation message: the table it names and its columns' names and type OIDs."""

    schema: str
    name: str
    columns: list[tuple[str, int]]


class _Message:
    """A reader over one pgoutput message (protocol version 1): big-endian ints, NUL-terminated strings."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.at = 1  # after the message type byte

    def unpack(self, fmt: str) -> Any:
        [value] = struct.unpack_from(fmt, self.data, self.at)
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        end = self.data.index(b"\0", self.at)
        text = self.data[self.at:end].decode()
        self.at = end + 1
        return text

    def tuple_data(self) -> list[bytes | bool | None]:
        """A TupleData: each column's text (bytes), None for null, False for an unchanged TOASTed value."""
        values: list[bytes | bool | None] = []
        for _ in range(self.unpack(">h")):
            kind = self.unpack(">c")
            if kind == b"t":
                size = self.unpack(">i")
                values.append(self.data[self.at:self.at + size])
                self.at += size
            else:  # b"n": null; b"u": an unchanged TOASTed value the log does not carry
                values.append(None if kind == b"n" else False)
        return values


class PostgresSource(MigrationSource):
    """One table of a PostgreSQL database as a migration's source.

    Args:
        url: a libpq URL or conninfo (``postgresql://user:password@host:port/database``).
        table: the table's name (unquoted: ``trips``).
        slot: the logical replication slot's name: one per migration, kept between runs until
            :meth:`stop_changes`.
        publication: the publication's name (created ``FOR TABLE`` the table by :meth:`start_changes`).
        schema: the table's schema.
        chunk_wait: how long, in seconds, a chunk waits for the transactions committing when it starts to end
            before it raises MigrationSourceUnavailableError.
    """

    def __init__(self, url: str, table: str, *, slot: str, publication: str, schema: str = "public",
                 chunk_wait: float = CHUNK_WAIT_SECONDS) -> None:
        self._url = url
        self.table = table
        self.schema = schema
        self.slot = slot
        self.publication = publication
        self.chunk_wait = chunk_wait
        self._qualified = sql.Identifier(schema, table)
        self._conn: psycopg.Connection[tuple[Any, ...]] | None = None
        self._transformer: abc.Transformer | None = None
        self._columns: list[tuple[str, int]] | None = None  # (name, type OID), in table order
        self._keys: list[str] | None = None
        self._relid = 0

    # -- connection and the one boundary where driver errors become typed ones ---------------------------
    @contextlib.contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        try:
            yield
        except MigrationSourceError:
            raise
        except psycopg.OperationalError as exc:
            # A connection refused or lost (the message names the host, never the password): a new one next time.
            self._drop_connection()
            raise MigrationSourceUnavailableError(f"PostgreSQL did not answer while {what}: {exc}") from exc
        except psycopg.Error as exc:
            self._rollback()
            raise MigrationSourceError(f"PostgreSQL refused {what} of {self.schema}.{self.table}: {exc}") from exc

    def _connection(self) -> psycopg.Connection[tuple[Any, ...]]:
        if self._conn is None or self._conn.closed:
            # UTC and ISO dates: the text pgoutput writes and psycopg's loaders read are in the session's settings.
            self._conn = psycopg.connect(self._url, autocommit=True, connect_timeout=10)
            self._conn.execute("SET TimeZone TO 'UTC'; SET DateStyle TO 'ISO'")
            self._transformer = Transformer(self._conn)
            self._text_loaders()
        return self._conn

    def _drop_connection(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(psycopg.Error):
                self._conn.close()
        self._conn = None

    def _rollback(self) -> None:
        conn = self._conn
        if conn is not None and not conn.closed and conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            with contextlib.suppress(psycopg.Error):
                conn.execute("ROLLBACK")

    def _query(self, query: sql.Composed | sql.SQL | str, args: Sequence[Any] | None = None) -> list[tuple[Any, ...]]:
        cur = self._connection().execute(query, args)
        return cur.fetchall() if cur.description is not None else []

    def _load(self, text: bytes, oid: int) -> Any:
        assert self._transformer is not None  # set with the connection
        if oid not in _CONVERTED:
            return text.decode()
        return _normal(self._transformer.get_loader(oid, Format.TEXT).load(text))

    # -- the table -----------------------------------------------------------------------------------------
    def _describe(self) -> None:
        if self._columns is not None:
            return
        found = self._query("SELECT c.oid::int FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                            "WHERE n.nspname = %s AND c.relname = %s AND c.relkind IN ('r', 'p')",
                            [self.schema, self.table])
        if not found:
            raise MigrationSourceError(f"no table {self.schema}.{self.table} in the source database")
        relid = self._relid = found[0][0]
        self._columns = [(name, oid) for name, oid in self._query(
            "SELECT attname, atttypid::int FROM pg_attribute WHERE attrelid = %s AND attnum > 0 "
            "AND NOT attisdropped ORDER BY attnum", [relid])]
        self._keys = [name for (name,) in self._query(
            "SELECT a.attname FROM pg_index i CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, n) "
            "JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum "
            "WHERE i.indrelid = %s AND i.indisprimary ORDER BY k.n", [relid])]
        self._text_loaders()

    def _text_loaders(self) -> None:
        """The connection loads the columns of types not converted as their text, as the log gives them."""
        if self._conn is not None:
            for _, oid in self._columns or ():
                if oid not in _CONVERTED:
                    self._conn.adapters.register_loader(oid, TextLoader)

    def key_columns(self) -> list[str]:
        """The primary key's columns, in order.

        Raises:
            MigrationSourceError: no such table, or it has no primary key.
        """
        with self._errors("reading the table's definition"):
            self._describe()
        assert self._keys is not None
        if not self._keys:
            raise MigrationSourceError(f"{self.schema}.{self.table} has no primary key: a migration copies a table "
                                       "in primary-key order and maps each row by its key")
        return list(self._keys)

    def columns(self) -> list[str]:
        """Every column of the table, in table order. Raises MigrationSourceError when there is no such table."""
        with self._errors("reading the table's definition"):
            self._describe()
        assert self._columns is not None
        return [name for name, _ in self._columns]

    def _select(self, where: sql.Composable, limit: int | None) -> sql.Composed:
        keys = sql.SQL(", ").join(map(sql.Identifier, self.key_columns()))
        query = sql.SQL("SELECT {} FROM {} WHERE {} ORDER BY {}").format(
            sql.SQL(", ").join(map(sql.Identifier, self.columns())), self._qualified, where, keys)
        return query + sql.SQL(" LIMIT {}").format(limit) if limit is not None else query

    def _key_bound(self, op: str, key: Key) -> sql.Composed:
        """``(k1, k2) op (%s, %s)``: a row comparison, which the primary key's index serves."""
        keys = self.key_columns()
        if len(key) != len(keys):
            raise MigrationSourceError(f"a key of {len(key)} values for the {len(keys)} columns {keys}")
        return sql.SQL("({}) {} ({})").format(sql.SQL(", ").join(map(sql.Identifier, keys)), sql.SQL(op),
                                              sql.SQL(", ").join(sql.Placeholder() * len(keys)))

    def _rows(self, raw: list[tuple[Any, ...]]) -> list[SourceRow]:
        names, keys = self.columns(), self.key_columns()
        rows = []
        for values in raw:
            row = {name: _normal(value) for name, value in zip(names, values, strict=True)}
            rows.append(SourceRow(tuple(row[k] for k in keys), row))
        return rows

    # -- chunks ----------------------------------------------------------------------------------------------
    def _chunk_position(self) -> int:
        """A position that every change a snapshot taken after this returns does not show commits above.

        Why not simply pg_current_wal_lsn() in the snapshot's transaction: a transaction writes its commit
        record, waits for the log's flush (or a synchronous standby), and only then leaves the set of running
        transactions that snapshots see. A snapshot taken in that window does not show it though its commit
        LSN is below the LSN read then. So: read the LSN P, then wait until every transaction that may be in that
        window and changed the table has ended. Such a transaction wrote its commit record below P, so it still
        holds its xid's lock (released after it leaves the running set) and the table's RowExclusiveLock, and its
        backend is not "idle in transaction" (it runs COMMIT or an autocommitted statement; one idle in a
        transaction has not begun to commit, so its commit comes after P). Once those ended, a snapshot taken
        next shows every commit below P, and P - 1 is below every commit of the table it does not show. Only a
        long statement writing the table (or a prepared transaction that did) when the chunk starts delays it,
        up to ``chunk_wait``.
        """
        [(lsn,)] = self._query("SELECT pg_current_wal_lsn()::text")
        position = lsn_to_int(lsn) - 1
        waiting = sql.SQL(
            "SELECT l.transactionid::text, l.pid FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid "
            "WHERE l.locktype = 'transactionid' AND l.mode = 'ExclusiveLock' AND l.granted "
            "AND l.pid IS DISTINCT FROM pg_backend_pid() "
            "AND a.state IS DISTINCT FROM 'idle in transaction' "
            "AND a.state IS DISTINCT FROM 'idle in transaction (aborted)' "
            # Only writers of the table: its changes are the only ones a chunk's rows could miss.
            "AND EXISTS (SELECT FROM pg_locks t WHERE t.virtualtransaction = l.virtualtransaction "
            "AND t.locktype = 'relation' AND t.relation = {} AND t.granted "
            "AND t.mode IN ('RowExclusiveLock', 'ShareRowExclusiveLock', 'ExclusiveLock', 'AccessExclusiveLock'))"
        ).format(sql.Literal(self._relid))
        running = self._query(waiting)
        deadline, pause = time.monotonic() + self.chunk_wait, 0.002
        while running:
            if time.monotonic() > deadline:
                xid, pid = running[0]
                raise MigrationSourceUnavailableError(
                    f"a chunk of {self.schema}.{self.table} waited {self.chunk_wait:.0f}s for transaction {xid} "
                    f"(backend pid {pid}) to end: a chunk's snapshot must show every commit below its position")
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
            # Only the ones running at P matter: a transaction begun since commits above P.
            running = self._query(waiting + sql.SQL(" AND l.transactionid::text = ANY(%s)"),
                                  [[xid for xid, _ in running]])
        return position

    def read_chunk(self, after: Key | None, limit: int) -> Chunk:
        """Up to ``limit`` rows with a key above ``after`` (None: from the first), in key order, read in one
        REPEATABLE READ, READ ONLY transaction (no lock but the table's ACCESS SHARE for the read).

        Returns:
            The rows; ``position`` is below the commit of every change they do not show (see
            :meth:`_chunk_position`); ``last`` is the last row's key, None when there was no row.

        Raises:
            MigrationSourceError: no such table or no primary key; the server refused the read.
            MigrationSourceUnavailableError: the server did not answer, or a long transaction kept the chunk
                waiting longer than ``chunk_wait``.
        """
        where = sql.SQL("true") if after is None else self._key_bound(">", after)
        with self._errors("reading a chunk"):
            query = self._select(where, limit)
            position = self._chunk_position()
            conn = self._connection()
            conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            try:
                raw = conn.execute(query, None if after is None else list(after)).fetchall()
            finally:
                conn.execute("COMMIT")
        rows = self._rows(raw)
        return Chunk(rows, position, rows[-1].key if rows else None)

    def key_span(self) -> tuple[int, int, int] | None:
        """The integer key's lowest and highest values (the index's ends) and ``reltuples`` (at least 1).

        Raises:
            MigrationSourceError: the server refused. MigrationSourceUnavailableError: it did not answer.
        """
        keys = self.key_columns()
        assert self._columns is not None  # read by key_columns
        if len(keys) != 1 or dict(self._columns)[keys[0]] not in _INTEGERS:
            return None
        key = sql.Identifier(keys[0])
        with self._errors("reading the key's span"):
            [(low, high, estimate)] = self._query(sql.SQL(
                "SELECT min({k}), max({k}), (SELECT reltuples::bigint FROM pg_class WHERE oid = {r}) FROM {t}"
            ).format(k=key, t=self._qualified, r=sql.Literal(self._relid)))
        return None if low is None else (int(low), int(high), max(int(estimate or 0), 1))

    def skip_keys(self, after: Key | None, count: int) -> Key | None:
        """The key ``count`` rows after ``after``: one statement over the primary key's index.

        Raises:
            MigrationSourceError: the server refused. MigrationSourceUnavailableError: it did not answer.
        """
        keys = sql.SQL(", ").join(map(sql.Identifier, self.key_columns()))
        where = sql.SQL("true") if after is None else self._key_bound(">", after)
        query = sql.SQL("SELECT {k} FROM {t} WHERE {w} ORDER BY {k} OFFSET {o} LIMIT 1").format(
            k=keys, t=self._qualified, w=where, o=sql.Literal(max(count, 1) - 1))
        with self._errors("stepping over rows"):
            found = self._query(query, None if after is None else list(after))
        return tuple(_normal(v) for v in found[0]) if found else None

    def read_row(self, key: Key) -> SourceRow | None:
        names = self.key_columns()
        if len(key) != len(names):
            raise MigrationSourceError(f"a key of {len(key)} values for the {len(names)} columns {names}")
        with self._errors("reading a row"):
            found = self._rows(self._query(self._select(self._key_bound("=", key), 1), list(key)))
        return found[0] if found else None

    def rows_between(self, low: Key | None, high: Key | None) -> list[SourceRow]:
        """The rows with ``low < key <= high`` (None: unbounded), in key order, read in one statement.

        Raises:
            MigrationSourceError: the server refused the read. MigrationSourceUnavailableError: it did not answer.
        """
        bounds: list[sql.Composable] = [sql.SQL("true")]
        args: list[Any] = []
        with self._errors("reading rows for a diff"):
            if low is not None:
                bounds.append(self._key_bound(">", low))
                args += list(low)
            if high is not None:
                bounds.append(self._key_bound("<=", high))
                args += list(high)
            raw = self._query(self._select(sql.SQL(" AND ").join(bounds), None), args)
        return self._rows(raw)

    # -- change capture --------------------------------------------------------------------------------------
    def _slot(self) -> tuple[str, str | None] | None:
        """The slot's (plugin, confirmed_flush_lsn), None when there is none."""
        found = self._query("SELECT plugin, confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
                            [self.slot])
        return (found[0][0], found[0][1]) if found else None

    def start_changes(self) -> int:
        """Create the publication (FOR TABLE the table) and the logical replication slot (pgoutput), or find
        them created before: idempotent.

        Returns:
            The slot's confirmed position: every change committed above it will be read.

        Raises:
            MigrationSourceError: the server's ``wal_level`` is not ``logical``; the table has no replica
                identity (no primary key and REPLICA IDENTITY DEFAULT, or NOTHING); a slot of that name uses
                another plugin; a privilege is missing (REPLICATION, or CREATE on the database).
            MigrationSourceUnavailableError: the server did not answer.
        """
        with self._errors("starting the change capture"):
            [(level,)] = self._query("SHOW wal_level")
            if level != "logical":
                raise MigrationSourceError(
                    f"the source server has wal_level={level}: change capture decodes its log, which needs "
                    "wal_level=logical (set it in postgresql.conf, with max_replication_slots and max_wal_senders "
                    "above 0, then restart the server)")
            self.key_columns()
            [(identity,)] = self._query("SELECT relreplident::text FROM pg_class WHERE oid = %s", [self._relid])
            if identity == "n":
                raise MigrationSourceError(f"{self.schema}.{self.table} has REPLICA IDENTITY NOTHING: deletes would "
                                           "not carry their key; ALTER TABLE ... REPLICA IDENTITY DEFAULT")
            published = self._query("SELECT EXISTS (SELECT FROM pg_publication WHERE pubname = %s), EXISTS (SELECT "
                                    "FROM pg_publication_tables WHERE pubname = %s AND schemaname = %s AND tablename = "
                                    "%s)", [self.publication, self.publication, self.schema, self.table])
            exists, has_table = published[0]
            if not exists:
                self._query(sql.SQL("CREATE PUBLICATION {} FOR TABLE {}").format(
                    sql.Identifier(self.publication), self._qualified))
            elif not has_table:
                self._query(sql.SQL("ALTER PUBLICATION {} ADD TABLE {}").format(
                    sql.Identifier(self.publication), self._qualified))
            # After the publication: pgoutput reads it as of each change's commit, so it must predate them all.
            slot = self._slot()
            if slot is None:
                self._query("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", [self.slot])
                slot = self._slot()
                assert slot is not None
                logger.info("created replication slot %s at %s", self.slot, slot[1])
            if slot[0] != "pgoutput":
                raise MigrationSourceError(f"replication slot {self.slot} uses the plugin {slot[0]}, not pgoutput: "
                                           "drop it or name another slot")
            assert slot[1] is not None  # a logical slot has one
            return lsn_to_int(slot[1])

    def _on_slot(self, query: str, args: Sequence[Any]) -> list[tuple[Any, ...]]:
        """A query that takes the slot for its length: tried again while another session has it (a `migrate
        status` peeking while `migrate start` reads, each for milliseconds), for SLOT_BUSY_WAIT seconds."""
        deadline = time.monotonic() + SLOT_BUSY_WAIT
        while True:
            try:
                return self._query(query, args)
            except psycopg.errors.ObjectInUse:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)

    def _peek(self, limit: int) -> list[bytes]:
        try:
            rows = self._on_slot("SELECT data FROM pg_logical_slot_peek_binary_changes(%s, NULL, %s, 'proto_version', "
                                 "'1', 'publication_names', %s)", [self.slot, limit, self.publication])
        except psycopg.errors.UndefinedObject as exc:
            raise MigrationSourceError(f"no replication slot {self.slot} (or publication {self.publication}): "
                                       "start the change capture first") from exc
        return [bytes(data) for (data,) in rows]

    def read_changes(self, limit: int) -> list[Change]:
        """The next changes after the position acknowledged last, in commit order, whole transactions, at most
        about ``limit`` (a transaction larger than ``limit`` comes whole). They come again until acknowledged.

        Raises:
            MigrationSourceError: the table was truncated (its copy must be made again), the capture was not
                started, or the server refused. MigrationSourceUnavailableError: it did not answer.
        """
        with self._errors("reading changes"):
            # A row per pgoutput message; Begin and Commit add 2 per transaction, the server stops after the
            # transaction that reaches the count, so a transaction is never split.
            messages = self._peek(max(limit, 1) + 2)
            changes = self._decode(messages)
            return self._fill_unchanged(changes)

    def _decode(self, messages: list[bytes]) -> list[Change]:
        relations: dict[int, _Relation] = {}
        changes: list[Change] = []
        pending: list[Change] = []
        position: int | None = None
        for data in messages:
            message, kind = _Message(data), data[:1]
            if kind == b"B":
                position, pending = message.unpack(">Q"), []
            elif kind == b"C":
                changes += pending
                position, pending = None, []
            elif kind == b"R":
                relid = message.unpack(">I")
                schema, name = message.string(), message.string()
                message.unpack(">b")  # replica identity setting
                columns = []
                for _ in range(message.unpack(">h")):
                    message.unpack(">b")  # flags: part of the key
                    column = message.string()
                    columns.append((column, message.unpack(">I")))
                    message.unpack(">i")  # type modifier
                relations[relid] = _Relation(schema, name, columns)
            elif kind in (b"I", b"U", b"D"):
                relation = relations[message.unpack(">I")]
                if (relation.schema, relation.name) != (self.schema, self.table) or position is None:
                    continue
                pending += self._row_changes(kind, message, relation, position)
            elif kind == b"T":
                count = message.unpack(">i")
                message.unpack(">b")  # options: CASCADE, RESTART IDENTITY
                if any((relations[relid].schema, relations[relid].name) == (self.schema, self.table)
                       for relid in (message.unpack(">I") for _ in range(count)) if relid in relations):
                    raise MigrationSourceError(
                        f"{self.schema}.{self.table} was truncated at {int_to_lsn(position or 0)}: the changes "
                        "cannot say which rows it removed; cancel the migration and start a new copy")
            # Origin (O), Type (Y) and logical Messages (M) say nothing about the table's rows.
        return changes

    def _row_changes(self, kind: bytes, message: _Message, relation: _Relation, position: int) -> list[Change]:
        keys = self.key_columns()
        names = [name for name, _ in relation.columns]

        def values(texts: list[bytes | bool | None]) -> dict[str, Any]:
            # An unchanged TOASTed value (False) stays False here; _fill_unchanged reads it from the table.
            return {name: (self._load(text, oid) if isinstance(text, bytes) else text)
                    for (name, oid), text in zip(relation.columns, texts, strict=True)}

        def key_of(row: dict[str, Any]) -> Key:
            return tuple(row[k] for k in keys)

        out: list[Change] = []
        tag = message.unpack(">c")
        if kind == b"D":  # K: the key's columns (the rest null); O: the whole old row (REPLICA IDENTITY FULL)
            return [Change("delete", key_of(values(message.tuple_data())), None, position)]
        old: dict[str, Any] | None = None
        if tag in (b"K", b"O"):  # an update that changed the key (or any update, with REPLICA IDENTITY FULL)
            old = values(message.tuple_data())
            message.unpack(">c")  # N
        new = values(message.tuple_data())
        if old is not None:
            if key_of(old) != key_of(new):
                out.append(Change("delete", key_of(old), None, position))
            # With REPLICA IDENTITY FULL the old row holds the unchanged TOASTed values the new one lacks.
            new = {name: old[name] if new[name] is False and old.get(name) is not False else new[name]
                   for name in names}
        out.append(Change("upsert", key_of(new), new, position))
        return out

    def _fill_unchanged(self, changes: list[Change]) -> list[Change]:
        """Changes whose row has an unchanged TOASTed value (the log does not repeat it: REPLICA IDENTITY DEFAULT
        logs only the key) get it from the table now. A later value read so is the row's state at a later
        change, whose own upsert comes with a higher position, so the row's latest version stays exact."""
        filled = []
        for change in changes:
            if change.values is not None and any(v is False for v in change.values.values()):
                missing = [name for name, v in change.values.items() if v is False]
                found = self._query(sql.SQL("SELECT {} FROM {} WHERE {}").format(
                    sql.SQL(", ").join(map(sql.Identifier, missing)), self._qualified,
                    self._key_bound("=", change.key)), list(change.key))
                now = dict(zip(missing, (_normal(v) for v in found[0]), strict=True)) if found else {}
                change = change._replace(values={**change.values, **{n: now.get(n) for n in missing}})
            filled.append(change)
        return filled

    def acknowledge(self, position: int) -> None:
        """The changes up to ``position`` are stored: advance the slot past that commit, so the server may
        free its log up to there. An older position than the slot's is a no-op.

        Raises:
            MigrationSourceError: no slot, or the server refused. MigrationSourceUnavailableError: it did not answer.
        """
        with self._errors("acknowledging changes"):
            slot = self._slot()
            if slot is None or slot[1] is None:
                raise MigrationSourceError(f"no replication slot {self.slot}: start the change capture first")
            # The decoder skips a transaction whose commit record starts below the slot's confirmed position,
            # so one past the commit's start is past the transaction and before the next one's commit.
            target = position + 1
            if target > lsn_to_int(slot[1]):
                self._on_slot("SELECT pg_replication_slot_advance(%s, %s::pg_lsn)", [self.slot, int_to_lsn(target)])

    def change_lag(self) -> ChangeLag:
        """The log between the slot's confirmed position and the server's current one (bytes), and the age of
        the oldest unacknowledged commit (seconds, by the server's clock; 0 when none).

        Raises:
            MigrationSourceError: no slot. MigrationSourceUnavailableError: the server did not answer.
        """
        with self._errors("measuring the change lag"):
            found = self._query("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::bigint, "
                                "clock_timestamp() FROM pg_replication_slots WHERE slot_name = %s", [self.slot])
            if not found:
                raise MigrationSourceError(f"no replication slot {self.slot}: start the change capture first")
            lag, now = found[0]
            seconds = 0.0
            for data in self._peek(1):
                if data[:1] == b"B":
                    message = _Message(data)
                    message.unpack(">Q")
                    committed = _PG_EPOCH + dt.timedelta(microseconds=message.unpack(">q"))
                    seconds = max(0.0, (now - committed).total_seconds())
                    break
            return ChangeLag(max(int(lag), 0), seconds)

    def load(self) -> SourceLoad:
        """Client backends running a statement, and the largest ``replay_lag`` of the server's standbys."""
        with self._errors("measuring the load"):
            [(running, lag)] = self._query(
                "SELECT (SELECT count(*) FROM pg_stat_activity WHERE state = 'active' AND backend_type = "
                "'client backend' AND pid <> pg_backend_pid()), (SELECT extract(epoch FROM max(replay_lag)) FROM "
                "pg_stat_replication)")
        return SourceLoad(int(running), None if lag is None else float(lag))

    def stop_changes(self) -> None:
        """Drop the slot (the server frees the log it held) and the publication; idempotent.

        Raises:
            MigrationSourceError: the slot is in use by another connection, or the server refused.
            MigrationSourceUnavailableError: the server did not answer.
        """
        with self._errors("stopping the change capture"):
            if self._slot() is not None:
                self._query("SELECT pg_drop_replication_slot(%s)", [self.slot])
                logger.info("dropped replication slot %s", self.slot)
            self._query(sql.SQL("DROP PUBLICATION IF EXISTS {}").format(sql.Identifier(self.publication)))

    def log_position(self) -> int:
        """The log's insert position: a commit record written before the call starts below it, one written
        after at or above it (a change's position is its commit record's start).

        Raises:
            MigrationSourceUnavailableError: the server did not answer.
        """
        with self._errors("reading the log position"):
            [(lsn,)] = self._query("SELECT pg_current_wal_insert_lsn()::text")
        return lsn_to_int(lsn)

    def write_rows(self, upserts: Sequence[Mapping[str, Any]], deletes: Sequence[Key]) -> None:
        """Upsert and delete rows in one transaction (see :meth:`MigrationSource.write_rows`). The values go in
        as JSON through ``json_populate_recordset``, so each becomes its column's type by PostgreSQL's own input
        function (the text forms a cell holds are those types' input forms; bytea's base64 is made hex first).

        Raises:
            MigrationSourceError: a row lacks a key column or names one the table has not, or the server refused
                (nothing written); MigrationSourceUnavailableError: the server did not answer.
        """
        keys = self.key_columns()
        assert self._columns is not None  # read by key_columns
        types = dict(self._columns)
        groups: dict[tuple[str, ...], list[dict[str, Any]]] = {}
        for row in upserts:
            if missing := [k for k in keys if k not in row]:
                raise MigrationSourceError(f"a row to write to {self.schema}.{self.table} lacks its key column "
                                           f"{missing[0]}")
            if unknown := [name for name in row if name not in types]:
                raise MigrationSourceError(f"{self.schema}.{self.table} has no column {unknown[0]}")
            groups.setdefault(tuple(row), []).append({n: _input_form(v, types[n]) for n, v in row.items()})
        gone = []
        for key in deletes:
            if len(key) != len(keys):
                raise MigrationSourceError(f"a key of {len(key)} values for the {len(keys)} columns {keys}")
            gone.append({k: _input_form(json_value(v), types[k]) for k, v in zip(keys, key, strict=True)})
        if not groups and not gone:
            return
        table, key_list = self._qualified, sql.SQL(", ").join(map(sql.Identifier, keys))
        with self._errors("writing rows"):
            conn = self._connection()
            with conn.transaction():
                for names, rows in groups.items():
                    listed = sql.SQL(", ").join(map(sql.Identifier, names))
                    sets = [sql.SQL("{} = EXCLUDED.{}").format(sql.Identifier(n), sql.Identifier(n))
                            for n in names if n not in keys]
                    action = sql.SQL("DO UPDATE SET ") + sql.SQL(", ").join(sets) if sets else sql.SQL("DO NOTHING")
                    conn.execute(sql.SQL("INSERT INTO {t} ({c}) SELECT {c} FROM json_populate_recordset(NULL::{t}, "
                                         "%s::json) ON CONFLICT ({k}) {a}").format(t=table, c=listed, k=key_list,
                                                                                     a=action), [json.dumps(rows)])
                if gone:
                    conn.execute(sql.SQL("DELETE FROM {t} WHERE ({k}) IN (SELECT {k} FROM json_populate_recordset("
                                         "NULL::{t}, %s::json))").format(t=table, k=key_list), [json.dumps(gone)])

    def close(self) -> None:
        """Close the connection; the slot and publication stay for the next run."""
        self._drop_connection()
