"""The embedded backend's index tables: one entry table and one locator table per index version.

A node's writes are serialized by SQLite's single writer (``BEGIN IMMEDIATE``), so an
apply's read of the locators and its writes need no row locks. On a cluster of
SQLite nodes, two applies can each hold their own node and want the other's (an entry
moving across): the other node's write waits only briefly, and the apply that gave
up rolls back, waits and starts again, so the other one gets through.
"""

from __future__ import annotations

import sqlite3
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

from logstore.errors import ConfigurationError
from logstore.index_tables.persistence import (
    ApplyResult,
    Entry,
    EntryWrite,
    Fix,
    IndexChange,
    IndexEntry,
    IndexPosition,
    IndexRecorder,
    IndexSpec,
    Locator,
    Order,
    QueryTexts,
    Remote,
    StatementCache,
    Stream,
    entry_decoder,
    plan,
    repair_plan,
    unapplied,
)
from logstore.retry import RetryPolicy, retry_call

Connect = Callable[..., AbstractContextManager[sqlite3.Connection]]
_REMOTE_BUSY = 1.0  # seconds another node's writes wait for its lock while this node's is held
_CHUNK = 500  # host parameters of one IN (...) list
_TYPES = {"uuid": "BLOB", "str": "TEXT", "int": "INTEGER", "float": "REAL", "bool": "INTEGER",
          "datetime": "INTEGER", "json": "TEXT"}
_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS cellstream_index_specs (
        index_table TEXT PRIMARY KEY, spec TEXT NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS cellstream_index_positions (
        index_table TEXT NOT NULL, stream TEXT NOT NULL, shard INTEGER NOT NULL,
        location INTEGER NOT NULL, target INTEGER,
        PRIMARY KEY (index_table, stream, shard))""",
)
_UPSERT_POSITION = (
    "INSERT INTO cellstream_index_positions (index_table, stream, shard, location) VALUES (?, ?, ?, ?)"
    " ON CONFLICT (index_table, stream, shard) DO UPDATE SET location = MAX(location, excluded.location)"
)


def _q(name: str) -> str:
    return f'"{name}"'


class _SQL:
    """Every statement of one index version, built once."""

    def __init__(self, spec: IndexSpec) -> None:
        t, loc = _q(spec.table), _q(spec.locator_table)
        fields = [_q(f.name) for f in spec.fields]
        keys = ", ".join(_q(k) for k in spec.keys)
        columns = ", ".join(f"{_q(f.name)} {_TYPES[f.type]}{' NOT NULL' if f.name in spec.keys else ''}"
                            for f in spec.fields)
        self.create = (
            f"CREATE TABLE IF NOT EXISTS {t} (shard INTEGER NOT NULL, row_key BLOB NOT NULL,"
            f" ref_key INTEGER NOT NULL, {columns}, PRIMARY KEY (shard, row_key)) WITHOUT ROWID",
            f"CREATE INDEX IF NOT EXISTS {_q(spec.table + '_keys')} ON {t} (shard, {keys}, row_key)",
            f"CREATE TABLE IF NOT EXISTS {loc} (row_key BLOB PRIMARY KEY, shard INTEGER NOT NULL,"
            f" ref_key INTEGER NOT NULL, entry_shard INTEGER NOT NULL) WITHOUT ROWID",
        )
        self.drop = (f"DROP TABLE IF EXISTS {t}", f"DROP TABLE IF EXISTS {loc}")
        self.columns = ", ".join(["shard", "row_key", "ref_key", *fields])
        marks = ", ".join("?" * (3 + len(fields)))
        updates = ", ".join(f"{c} = excluded.{c}" for c in ["ref_key", *fields])
        self.put = (f"INSERT INTO {t} ({self.columns}) VALUES ({marks}) ON CONFLICT (shard, row_key)"
                    f" DO UPDATE SET {updates} WHERE excluded.ref_key > {t}.ref_key")
        self.delete = f"DELETE FROM {t} WHERE shard = ? AND row_key = ? AND ref_key < ?"
        self.force_put = f"INSERT OR REPLACE INTO {t} ({self.columns}) VALUES ({marks})"
        self.force_delete = f"DELETE FROM {t} WHERE shard = ? AND row_key = ?"
        self.force_locator = f"INSERT OR REPLACE INTO {loc} (row_key, shard, ref_key, entry_shard) VALUES (?, ?, ?, ?)"
        self.delete_locator = f"DELETE FROM {loc} WHERE row_key = ?"
        self.locators = f"SELECT row_key, ref_key, entry_shard FROM {loc} WHERE row_key IN "
        self.put_locator = (
            f"INSERT INTO {loc} (row_key, shard, ref_key, entry_shard) VALUES (?, ?, ?, ?)"
            f" ON CONFLICT (row_key) DO UPDATE SET ref_key = excluded.ref_key, entry_shard = excluded.entry_shard"
            f" WHERE excluded.ref_key > {loc}.ref_key")
        self.select = f"SELECT {self.columns} FROM {t}"
        self.query = QueryTexts(self.select, spec, _q, "?")
        self.decode = entry_decoder(spec)
        self.scan = f"SELECT {self.columns} FROM {t} WHERE shard = ? AND row_key > ? ORDER BY row_key LIMIT ?"


def _chunks(items: Sequence[Any]) -> Iterator[Sequence[Any]]:
    for start in range(0, len(items), _CHUNK):
        yield items[start:start + _CHUNK]


class SQLiteIndexRecorder(IndexRecorder):
    def __init__(self, name: str, write: Connect, read: Connect, retry: RetryPolicy) -> None:
        self.name = name
        self._write = write
        self._retry = retry
        self._read = read
        self._statements = StatementCache(_SQL)

    @staticmethod
    def _ensure_schema(conn: sqlite3.Connection) -> None:
        for statement in _SCHEMA:
            conn.execute(statement)

    # -- tables ---------------------------------------------------------------------
    def create(self, spec: IndexSpec) -> None:
        sql, wanted = self._statements(spec), spec.storage_json()
        with self._write() as conn:
            self._ensure_schema(conn)
            row = conn.execute("SELECT spec FROM cellstream_index_specs WHERE index_table = ?",
                               (spec.table,)).fetchone()
            if row is not None and row[0] != wanted:
                raise ConfigurationError(
                    f"storage node {self.name} holds index {spec.name} version {spec.version} with another "
                    f"definition ({row[0]}); a changed definition needs a new version")
            for statement in sql.create:
                conn.execute(statement)
            conn.execute("INSERT OR IGNORE INTO cellstream_index_specs (index_table, spec) VALUES (?, ?)",
                         (spec.table, wanted))

    def drop(self, spec: IndexSpec) -> None:
        with self._write() as conn:
            self._ensure_schema(conn)
            for statement in self._statements(spec).drop:
                conn.execute(statement)
            conn.execute("DELETE FROM cellstream_index_specs WHERE index_table = ?", (spec.table,))
            conn.execute("DELETE FROM cellstream_index_positions WHERE index_table = ?", (spec.table,))

    def specs(self) -> list[IndexSpec]:
        with self._read() as conn:
            try:
                rows = conn.execute("SELECT spec FROM cellstream_index_specs ORDER BY index_table").fetchall()
            except sqlite3.OperationalError as exc:
                if "no such table" in str(exc):
                    return []
                raise
        return [IndexSpec.model_validate_json(spec) for (spec,) in rows]

    # -- writes ---------------------------------------------------------------------
    def apply(self, spec: IndexSpec, stream: Stream | None, changes: Sequence[IndexChange],
              positions: Mapping[int, int], entry: Entry, remote: Remote) -> ApplyResult:
        return retry_call(lambda: self._apply(spec, stream, changes, positions, entry, remote), self._retry)

    def _apply(self, spec: IndexSpec, stream: Stream | None, changes: Sequence[IndexChange],
               positions: Mapping[int, int], entry: Entry, remote: Remote) -> ApplyResult:
        sql = self._statements(spec)
        with self._write() as conn:
            todo = list(changes)
            if stream is not None:
                found = self._positions(conn, spec, stream, sorted({c.shard for c in changes}))
                todo = unapplied(changes, {s: p.location for s, p in found.items()})
            locators = self._locators(conn, sql, sorted({c.row_key.bytes for c in todo}))
            writes, updated, superseded = plan(todo, locators, entry)
            self._write_entries(conn, spec, remote(writes))
            conn.executemany(sql.put_locator, [(k.bytes, shard, loc.ref_key, loc.entry_shard)
                                               for k, (shard, loc) in updated.items()])
            if stream is not None:
                conn.executemany(_UPSERT_POSITION, [(spec.table, stream, shard, location)
                                                    for shard, location in positions.items()])
        return ApplyResult(len(todo) - superseded, superseded, len(changes) - len(todo))

    def repair(self, spec: IndexSpec, fixes: Sequence[Fix], keep: Callable[[uuid.UUID, Locator], bool],
               remote: Remote) -> int:
        return retry_call(lambda: self._repair(spec, fixes, keep, remote), self._retry)

    def _repair(self, spec: IndexSpec, fixes: Sequence[Fix], keep: Callable[[uuid.UUID, Locator], bool],
                remote: Remote) -> int:
        sql = self._statements(spec)
        with self._write() as conn:  # the node's write lock stands for the rows' locator locks
            locators = self._locators(conn, sql, sorted({f.row_key.bytes for f in fixes}))
            todo, writes = repair_plan(fixes, locators, keep)
            self._write_entries(conn, spec, remote(writes))
            # A fix with a cell (an entry's, or a tombstone's: entry shard NO_ENTRY) sets the locator.
            conn.executemany(sql.force_locator, [(f.row_key.bytes, f.shard, f.ref_key, f.entry_shard)
                                                 for f in todo if f.ref_key >= 0])
            conn.executemany(sql.delete_locator, [(f.row_key.bytes,) for f in todo if f.ref_key < 0])
        return len(todo)

    def _write_entries(self, conn: sqlite3.Connection, spec: IndexSpec, writes: Sequence[EntryWrite]) -> None:
        sql = self._statements(spec)
        for force in (False, True):
            puts = [(w.shard, w.row_key.bytes, w.ref_key, *w.encoded(spec))
                    for w in writes if w.values is not None and w.force is force]
            conn.executemany(sql.force_put if force else sql.put, puts)
        conn.executemany(sql.delete, [(w.shard, w.row_key.bytes, w.ref_key)
                                      for w in writes if w.values is None and not w.force])
        conn.executemany(sql.force_delete, [(w.shard, w.row_key.bytes) for w in writes if w.values is None and w.force])

    def write_entries(self, spec: IndexSpec, writes: Sequence[EntryWrite]) -> None:
        with self._write(busy_timeout=_REMOTE_BUSY) as conn:
            self._write_entries(conn, spec, writes)

    def set_targets(self, spec: IndexSpec, stream: Stream, targets: Mapping[int, int]) -> None:
        with self._write() as conn:
            self._ensure_schema(conn)
            conn.executemany(
                "INSERT INTO cellstream_index_positions (index_table, stream, shard, location, target)"
                " VALUES (?, ?, ?, 0, ?)"
                " ON CONFLICT (index_table, stream, shard) DO UPDATE SET target = excluded.target",
                [(spec.table, stream, shard, target) for shard, target in targets.items()])

    # -- reads ------------------------------------------------------------------------
    def _positions(self, conn: sqlite3.Connection, spec: IndexSpec, stream: Stream,
                   shards: Sequence[int] | None) -> dict[int, IndexPosition]:
        sql = "SELECT shard, location, target FROM cellstream_index_positions WHERE index_table = ? AND stream = ?"
        args: list[Any] = [spec.table, stream]
        if shards is not None:
            sql += f" AND shard IN ({', '.join('?' * len(shards))})"
            args.extend(shards)
        return {s: IndexPosition(s, loc, target) for s, loc, target in conn.execute(sql, args)}

    def positions(self, spec: IndexSpec, stream: Stream) -> dict[int, IndexPosition]:
        with self._read() as conn:
            try:
                return self._positions(conn, spec, stream, None)
            except sqlite3.OperationalError as exc:
                if "no such table" in str(exc):
                    return {}
                raise

    def query(self, spec: IndexSpec, shards: Sequence[int] | None, conditions: Sequence[tuple[str, str, Any]],
              order: Order, limit: int) -> list[IndexEntry]:
        sql = self._statements(spec)
        text, args = sql.query(shards, conditions, order)
        with self._read() as conn:
            rows = conn.execute(text, [*args, limit]).fetchall()
        return [sql.decode(row) for row in rows]

    def scan(self, spec: IndexSpec, shard: int, after: uuid.UUID | None, limit: int) -> list[IndexEntry]:
        sql = self._statements(spec)
        with self._read() as conn:
            rows = conn.execute(sql.scan, (shard, after.bytes if after else b"", limit)).fetchall()
        return [sql.decode(row) for row in rows]

    def locators(self, spec: IndexSpec, row_keys: Sequence[uuid.UUID]) -> dict[uuid.UUID, Locator]:
        with self._read() as conn:
            return self._locators(conn, self._statements(spec), [k.bytes for k in row_keys])

    @staticmethod
    def _locators(conn: sqlite3.Connection, sql: _SQL, keys: Sequence[bytes]) -> dict[uuid.UUID, Locator]:
        out: dict[uuid.UUID, Locator] = {}
        for chunk in _chunks(keys):
            for raw, ref_key, where in conn.execute(f"{sql.locators}({', '.join('?' * len(chunk))})", chunk):
                out[uuid.UUID(bytes=raw)] = Locator(ref_key, where)
        return out
