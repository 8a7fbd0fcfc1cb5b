"""The MySQL/MariaDB backend's index tables: one entry table and one locator table per index version.

Two appliers of the same row (live processing and a backfill) must take turns on
its locator. Sessions run READ COMMITTED (see :mod:`logstore.backends.mysql.recorder`), where a
locking read locks the rows that exist and nothing for a missing one. So an apply
locks and reads the existing locators (``SELECT ... FOR UPDATE``), plans, and then
inserts the locators of its new rows before writing anything else: an insert of a
row another applier is inserting waits for it, and fails once it commits; the apply
then rolls back and starts again, finding the row. Rows are locked and inserted in
row_key order, so appliers of different rows do not deadlock on each other.

A repair locks rows differently, with placeholder upserts (ref_key -1) that create
or lock each row: it writes every locked row's locator, so none stays behind.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import suppress
from typing import Any, Protocol, TypeVar

import pymysql

from logstore.errors import ConfigurationError, StorageUnavailableError
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

T = TypeVar("T")
Cursor = pymysql.cursors.Cursor


class Call(Protocol):
    """The node recorder's ``_call``: run on a pooled connection, errors translated, retriable ones retried."""

    def __call__(self, what: str, fn: Callable[[Cursor], T], /) -> T: ...


Statement = tuple[str, list[Any]]
_CHUNK = 500
_NO_TABLE = 1146
_DUPLICATE = 1062
_KEY_STR = "VARCHAR(128) CHARACTER SET utf8mb4 COLLATE utf8mb4_nopad_bin"  # no PAD SPACE: 'a' != 'a '
_TYPES = {"uuid": "BINARY(16)", "str": "MEDIUMTEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin", "int": "BIGINT",
          "float": "DOUBLE", "bool": "TINYINT(1)", "datetime": "BIGINT",
          "json": "LONGTEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin"}
_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS cellstream_index_specs ("
    " index_table VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL PRIMARY KEY,"
    " spec TEXT NOT NULL) ENGINE=InnoDB",
    "CREATE TABLE IF NOT EXISTS cellstream_index_positions ("
    " index_table VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,"
    " stream VARCHAR(16) CHARACTER SET ascii COLLATE ascii_bin NOT NULL, shard INT NOT NULL,"
    " location BIGINT NOT NULL, target BIGINT NULL, PRIMARY KEY (index_table, stream, shard)) ENGINE=InnoDB",
)
_POSITIONS = "SELECT shard, location, target FROM cellstream_index_positions WHERE index_table = %s AND stream = %s"


def _q(name: str) -> str:
    return f"`{name}`"


def _marks(n: int) -> str:
    return ", ".join(["%s"] * n)


class _SQL:
    """Every statement of one index version, built once."""

    def __init__(self, spec: IndexSpec) -> None:
        t, loc = _q(spec.table), _q(spec.locator_table)
        fields = [_q(f.name) for f in spec.fields]
        keys = ", ".join(_q(k) for k in spec.keys)
        columns = ", ".join(
            f"{_q(f.name)} {_KEY_STR if f.type == 'str' and f.name in spec.keys else _TYPES[f.type]}"
            f"{' NOT NULL' if f.name in spec.keys else ' NULL'}" for f in spec.fields)
        self.create = (
            f"CREATE TABLE IF NOT EXISTS {t} (shard INT NOT NULL, row_key BINARY(16) NOT NULL,"
            f" ref_key BIGINT NOT NULL, {columns}, PRIMARY KEY (shard, row_key),"
            f" KEY query_keys (shard, {keys}, row_key)) ENGINE=InnoDB",
            f"CREATE TABLE IF NOT EXISTS {loc} (row_key BINARY(16) NOT NULL PRIMARY KEY, shard INT NOT NULL,"
            f" ref_key BIGINT NOT NULL, entry_shard INT NOT NULL) ENGINE=InnoDB",
        )
        self.drop = f"DROP TABLE IF EXISTS {t}, {loc}"
        self.columns = ", ".join(["shard", "row_key", "ref_key", *fields])
        # Assignments run left to right and later ones see earlier results: ref_key goes last.
        updates = ", ".join(f"{c} = IF(VALUES(ref_key) > ref_key, VALUES({c}), {c})" for c in fields)
        self.put = (f"INSERT INTO {t} ({self.columns}) VALUES {{rows}} ON DUPLICATE KEY UPDATE {updates},"
                    f" ref_key = GREATEST(ref_key, VALUES(ref_key))")
        self.delete = f"DELETE FROM {t} WHERE shard = %s AND row_key = %s AND ref_key < %s"
        self.force_put = f"REPLACE INTO {t} ({self.columns}) VALUES {{rows}}"
        self.force_delete = f"DELETE FROM {t} WHERE shard = %s AND row_key = %s"
        self.force_locator = f"REPLACE INTO {loc} (row_key, shard, ref_key, entry_shard) VALUES (%s, %s, %s, %s)"
        self.delete_locator = f"DELETE FROM {loc} WHERE row_key = %s"
        self.lock = (f"INSERT INTO {loc} (row_key, shard, ref_key, entry_shard) VALUES {{rows}}"
                     f" ON DUPLICATE KEY UPDATE row_key = row_key")
        self.locators = f"SELECT row_key, ref_key, entry_shard FROM {loc} WHERE row_key IN ({{marks}})"
        self.lock_locators = self.locators + " FOR UPDATE"
        self.create_locators = f"INSERT INTO {loc} (row_key, shard, ref_key, entry_shard) VALUES {{rows}}"
        self.put_locators = (
            f"INSERT INTO {loc} (row_key, shard, ref_key, entry_shard) VALUES {{rows}} ON DUPLICATE KEY UPDATE"
            f" entry_shard = IF(VALUES(ref_key) > ref_key, VALUES(entry_shard), entry_shard),"
            f" ref_key = GREATEST(ref_key, VALUES(ref_key))")
        self.select = f"SELECT {self.columns} FROM {t}"
        self.query = QueryTexts(self.select, spec, _q, "%s")
        self.decode = entry_decoder(spec)
        self.scan = f"SELECT {self.columns} FROM {t} WHERE shard = %s AND row_key > %s ORDER BY row_key LIMIT %s"


def _chunks(items: Sequence[T]) -> Iterator[Sequence[T]]:
    for start in range(0, len(items), _CHUNK):
        yield items[start:start + _CHUNK]


def _values(rows: Sequence[Sequence[Any]]) -> tuple[str, list[Any]]:
    """Rows as the text of a VALUES list: integers, floats, bytes and NULL written as literals (cheaper than
    the driver's escaping, which showed as the apply's largest cost), strings left as parameters."""
    args: list[Any] = []
    parts = []
    for row in rows:
        items = []
        for value in row:
            kind = type(value)
            if kind is int:
                items.append(str(value))
            elif kind is bytes:
                items.append(f"X'{value.hex()}'")
            elif value is None:
                items.append("NULL")
            elif kind is float:  # finite: the index refuses others
                items.append(repr(value))
            else:
                items.append("%s")
                args.append(value)
        parts.append(f"({', '.join(items)})")
    return ", ".join(parts), args


def _size(statement: Statement) -> int:
    return len(statement[0]) + sum(2 * len(a) + 16 if isinstance(a, str | bytes) else 24 for a in statement[1])


class MySQLIndexRecorder(IndexRecorder):
    def __init__(self, name: str, call: Call, run_script: Callable[[Cursor, Sequence[Statement]], Any],
                 max_statement_bytes: int) -> None:
        self.name = name
        self._call = call
        self._run_script = run_script
        self._budget = max_statement_bytes // 2
        self._statements = StatementCache(_SQL)

    def _script(self, cur: Cursor, statements: Sequence[Statement]) -> None:
        """Run ``statements`` in as few round trips as the packet budget allows."""
        packet: list[Statement] = []
        size = 0
        for statement in statements:
            weight = _size(statement)
            if packet and size + weight > self._budget:
                self._run_script(cur, packet)
                packet, size = [], 0
            packet.append(statement)
            size += weight
        if packet:
            self._run_script(cur, packet)

    def _transaction(self, what: str, fn: Callable[[Cursor], T]) -> T:
        def run(cur: Cursor) -> T:
            cur.execute("START TRANSACTION")
            try:
                result = fn(cur)
                cur.execute("COMMIT")
                return result
            except BaseException:
                # Never hand a connection back inside a transaction: it would keep the row locks.
                with suppress(pymysql.Error, OSError):
                    cur.execute("ROLLBACK")
                raise
        return self._call(what, run)

    # -- tables ---------------------------------------------------------------------
    def create(self, spec: IndexSpec) -> None:
        sql, wanted = self._statements(spec), spec.storage_json()

        def run(cur: Cursor) -> None:
            for statement in _SCHEMA:
                cur.execute(statement)
            cur.execute("SELECT spec FROM cellstream_index_specs WHERE index_table = %s", (spec.table,))
            row = cur.fetchone()
            if row is not None and row[0] != wanted:
                raise ConfigurationError(
                    f"storage node {self.name} holds index {spec.name} version {spec.version} with another "
                    f"definition ({row[0]}); a changed definition needs a new version")
            for statement in sql.create:
                cur.execute(statement)
            cur.execute("INSERT IGNORE INTO cellstream_index_specs (index_table, spec) VALUES (%s, %s)",
                        (spec.table, wanted))
        self._call("create index", run)

    def drop(self, spec: IndexSpec) -> None:
        def run(cur: Cursor) -> None:
            for statement in _SCHEMA:
                cur.execute(statement)
            cur.execute(self._statements(spec).drop)
            cur.execute("DELETE FROM cellstream_index_specs WHERE index_table = %s", (spec.table,))
            cur.execute("DELETE FROM cellstream_index_positions WHERE index_table = %s", (spec.table,))
        self._call("drop index", run)

    def specs(self) -> list[IndexSpec]:
        def run(cur: Cursor) -> list[IndexSpec]:
            try:
                cur.execute("SELECT spec FROM cellstream_index_specs ORDER BY index_table")
            except pymysql.err.ProgrammingError as exc:
                if exc.args and exc.args[0] == _NO_TABLE:
                    return []
                raise
            return [IndexSpec.model_validate_json(spec) for (spec,) in cur.fetchall()]
        return self._call("read index specs", run)

    # -- writes ---------------------------------------------------------------------
    def apply(self, spec: IndexSpec, stream: Stream | None, changes: Sequence[IndexChange],
              positions: Mapping[int, int], entry: Entry, remote: Remote) -> ApplyResult:
        sql = self._statements(spec)

        def run(cur: Cursor) -> ApplyResult:
            shards = sorted({c.shard for c in changes})
            keys = sorted({c.row_key.bytes for c in changes})
            # One round trip: the stream's positions and the rows' existing locators, locked.
            reads: list[Statement] = []
            if stream is not None and shards:
                reads.append((f"{_POSITIONS} AND shard IN ({_marks(len(shards))}) FOR UPDATE",
                              [spec.table, stream, *shards]))
            reads.extend((sql.lock_locators.format(marks=", ".join(f"X'{k.hex()}'" for k in chunk)), [])
                         for chunk in _chunks(keys))
            results = [r.rows or () for r in self._run_script(cur, reads)] if reads else []
            todo = list(changes)
            if stream is not None and shards:
                todo = unapplied(changes, {int(s): int(loc) for s, loc, _ in results.pop(0)})
            locators = {uuid.UUID(bytes=raw): Locator(int(ref), int(where))
                        for rows in results for raw, ref, where in rows}
            writes, updated, superseded = plan(todo, locators, entry)
            created = [(k.bytes, shard, loc.ref_key, loc.entry_shard)
                       for k, (shard, loc) in updated.items() if k not in locators]
            if created:
                self._create_locators(cur, sql, created)
            statements = self._entry_statements(spec, remote(writes))
            located = [(k.bytes, shard, loc.ref_key, loc.entry_shard)
                       for k, (shard, loc) in updated.items() if k in locators]
            for part in _chunks(located):
                text, args = _values(part)
                statements.append((sql.put_locators.format(rows=text), args))
            if stream is not None and positions:
                statements.append((
                    "INSERT INTO cellstream_index_positions (index_table, stream, shard, location) VALUES "
                    + ", ".join(["(%s, %s, %s, %s)"] * len(positions))
                    + " ON DUPLICATE KEY UPDATE location = GREATEST(location, VALUES(location))",
                    [a for shard, location in positions.items() for a in (spec.table, stream, shard, location)]))
            self._script(cur, statements)
            return ApplyResult(len(todo) - superseded, superseded, len(changes) - len(todo))
        return self._transaction("apply index", run)

    def _create_locators(self, cur: Cursor, sql: _SQL, rows: Sequence[tuple[bytes, int, int, int]]) -> None:
        """Insert the locators of rows that had none, before anything else is written: if another applier
        created one meanwhile, the insert waits for its commit, fails, and the apply starts again (from
        reading the locators) before its plan reached any node."""
        try:
            self._script(cur, [(sql.create_locators.format(rows=_values(part)[0]), [])
                               for part in _chunks(sorted(rows))])
        except pymysql.err.IntegrityError as exc:
            if not exc.args or exc.args[0] != _DUPLICATE:
                raise
            raise StorageUnavailableError(f"storage node {self.name}: another applier created a locator of the "
                                          "same row first; the batch is planned again") from exc

    def _lock(self, cur: Cursor, sql: _SQL, rows: Mapping[bytes, int]) -> dict[uuid.UUID, Locator]:
        """Lock the locators of rows (row_key: its shard), in row_key order, and read them."""
        locators: dict[uuid.UUID, Locator] = {}
        for chunk in _chunks(sorted(rows.items())):
            self._run_script(cur, [(sql.lock.format(rows=", ".join(["(%s, %s, -1, -1)"] * len(chunk))),
                                    [a for row in chunk for a in row])])
            cur.execute(sql.locators.format(marks=_marks(len(chunk))), [key for key, _ in chunk])
            for raw, ref_key, where in cur.fetchall():
                locators[uuid.UUID(bytes=raw)] = Locator(int(ref_key), int(where))
        return locators

    def repair(self, spec: IndexSpec, fixes: Sequence[Fix], keep: Callable[[uuid.UUID, Locator], bool],
               remote: Remote) -> int:
        sql = self._statements(spec)

        def run(cur: Cursor) -> int:
            locators = self._lock(cur, sql, {f.row_key.bytes: f.shard for f in fixes})
            todo, writes = repair_plan(fixes, locators, keep)
            statements = self._entry_statements(spec, remote(writes))
            # Every locked row gets its locator set or deleted: no placeholder (ref_key -1) stays behind.
            statements.extend((sql.force_locator, [f.row_key.bytes, f.shard, f.ref_key, f.entry_shard])
                              for f in todo if f.values is not None)
            statements.extend((sql.delete_locator, [f.row_key.bytes]) for f in todo if f.values is None)
            self._script(cur, statements)
            return len(todo)
        return self._transaction("repair index", run)

    def _entry_statements(self, spec: IndexSpec, writes: Sequence[EntryWrite]) -> list[Statement]:
        sql = self._statements(spec)
        out: list[Statement] = []
        for force in (False, True):
            puts = [(w.shard, w.row_key.bytes, w.ref_key, *w.encoded(spec))
                    for w in writes if w.values is not None and w.force is force]
            for chunk in _chunks(puts):
                text, args = _values(chunk)
                out.append(((sql.force_put if force else sql.put).format(rows=text), args))
        out.extend((sql.delete, [w.shard, w.row_key.bytes, w.ref_key])
                   for w in writes if w.values is None and not w.force)
        out.extend((sql.force_delete, [w.shard, w.row_key.bytes]) for w in writes if w.values is None and w.force)
        return out

    def write_entries(self, spec: IndexSpec, writes: Sequence[EntryWrite]) -> None:
        statements = self._entry_statements(spec, writes)
        if statements:
            self._transaction("write index entries", lambda cur: self._script(cur, statements))

    def set_targets(self, spec: IndexSpec, stream: Stream, targets: Mapping[int, int]) -> None:
        rows = [(spec.table, stream, shard, target) for shard, target in targets.items()]

        def run(cur: Cursor) -> None:
            for statement in _SCHEMA:
                cur.execute(statement)
            cur.executemany("INSERT INTO cellstream_index_positions (index_table, stream, shard, location, target)"
                            " VALUES (%s, %s, %s, 0, %s) ON DUPLICATE KEY UPDATE target = VALUES(target)", rows)
        self._call("set index targets", run)

    # -- reads ------------------------------------------------------------------------
    def positions(self, spec: IndexSpec, stream: Stream) -> dict[int, IndexPosition]:
        def run(cur: Cursor) -> dict[int, IndexPosition]:
            try:
                cur.execute(_POSITIONS, (spec.table, stream))
            except pymysql.err.ProgrammingError as exc:
                if exc.args and exc.args[0] == _NO_TABLE:
                    return {}
                raise
            return {int(s): IndexPosition(int(s), int(loc), None if t is None else int(t)) for s, loc, t in cur}
        return self._call("read index positions", run)

    def query(self, spec: IndexSpec, shards: Sequence[int] | None, conditions: Sequence[tuple[str, str, Any]],
              order: Order, limit: int) -> list[IndexEntry]:
        sql = self._statements(spec)
        text, args = sql.query(shards, conditions, order)

        def run(cur: Cursor) -> list[IndexEntry]:
            cur.execute(text, [*args, limit])
            return [sql.decode(row) for row in cur.fetchall()]
        return self._call("query index", run)

    def scan(self, spec: IndexSpec, shard: int, after: uuid.UUID | None, limit: int) -> list[IndexEntry]:
        sql = self._statements(spec)

        def run(cur: Cursor) -> list[IndexEntry]:
            cur.execute(sql.scan, (shard, after.bytes if after else b"", limit))
            return [sql.decode(row) for row in cur.fetchall()]
        return self._call("scan index", run)

    def locators(self, spec: IndexSpec, row_keys: Sequence[uuid.UUID]) -> dict[uuid.UUID, Locator]:
        sql = self._statements(spec)

        def run(cur: Cursor) -> dict[uuid.UUID, Locator]:
            out: dict[uuid.UUID, Locator] = {}
            for chunk in _chunks([k.bytes for k in row_keys]):
                cur.execute(sql.locators.format(marks=_marks(len(chunk))), list(chunk))
                out.update((uuid.UUID(bytes=raw), Locator(int(ref), int(where)))
                           for raw, ref, where in cur.fetchall() if ref >= 0)
            return out
        return self._call("read index locators", run)
