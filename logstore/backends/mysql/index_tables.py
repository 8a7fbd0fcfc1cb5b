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

Every write refuses a shard being moved away or moved (its ``cellstream_shards`` row fenced on this
node): the fence is read after the writes, and ShardMovedError rolls the transaction back whole
(:mod:`logstore.backends.mysql.index_moves` copies a fenced shard's rows with locking reads).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import suppress
from typing import Any, Literal, Protocol, TypeVar

import pymysql

from logstore.backends.mysql.pool import Result
from logstore.errors import ConfigurationError, InvalidArgumentError, ShardMovedError, StorageUnavailableError
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
    StrayRows,
    Stream,
    entry_decoder,
    plan,
    repair_plan,
    unapplied,
)

logger = logging.getLogger(__name__)
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
# The first statement of a transaction's first script (``begin=False``): a round trip less per write.
_BEGIN: Statement = ("START TRANSACTION", [])
# A shard's locators read and deleted by shard when it moves (logstore.backends.mysql.index_moves); added in
# place to the tables made before it (add_locator_shard_keys).
_LOCATOR_SHARD_KEY = "KEY locator_shard (shard)"
_DUPLICATE_KEY_NAME = 1061
ShardRows = Literal["entries", "locators"]


def add_locator_shard_keys(cur: Cursor) -> None:
    """Give the locator tables made before ``locator_shard`` the key, once, at the node's open (MySQL has no
    ADD KEY IF NOT EXISTS). Of two processes opening the node at once, the second is told the key exists."""
    cur.execute("SELECT t.TABLE_NAME FROM information_schema.TABLES t WHERE t.TABLE_SCHEMA = DATABASE()"
                " AND t.TABLE_NAME LIKE 'ixl\\_%' AND NOT EXISTS (SELECT 1 FROM information_schema.STATISTICS i"
                " WHERE i.TABLE_SCHEMA = t.TABLE_SCHEMA AND i.TABLE_NAME = t.TABLE_NAME"
                " AND i.INDEX_NAME = 'locator_shard')")
    for (table,) in cur.fetchall():
        try:
            cur.execute(f"ALTER TABLE {_q(str(table))} ADD {_LOCATOR_SHARD_KEY}")
        except pymysql.err.OperationalError as exc:
            if not exc.args or exc.args[0] != _DUPLICATE_KEY_NAME:
                raise
        logger.info("added the locator_shard key to %s", table)


def _fence_check(shards: Iterable[int]) -> Statement:
    """The last statement of an index write: a shard of it fenced on this node (moving away, or moved) makes
    the write roll back. Read after every write of the transaction: a move fences the shard, then copies
    its rows with locking reads, which wait for a write that read no fence until it commits."""
    return (f"SELECT shard, fence FROM cellstream_shards WHERE shard IN ({', '.join(map(str, sorted(shards)))})"
            " AND fence IS NOT NULL LIMIT 1", [])


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
            f" ref_key BIGINT NOT NULL, entry_shard INT NOT NULL, {_LOCATOR_SHARD_KEY}) ENGINE=InnoDB",
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

    def _script(self, cur: Cursor, statements: Sequence[Statement]) -> list[Result]:
        """Run ``statements`` in as few round trips as the packet budget allows; the last trip's results."""
        packet: list[Statement] = []
        size = 0
        for statement in statements:
            weight = _size(statement)
            if packet and size + weight > self._budget:
                self._run_script(cur, packet)
                packet, size = [], 0
            packet.append(statement)
            size += weight
        return list(self._run_script(cur, packet)) if packet else []

    def _fenced_script(self, cur: Cursor, statements: Sequence[Statement], shards: Iterable[int]) -> None:
        """Run an index write's ``statements``, then refuse it (ShardMovedError: its transaction rolls back)
        if one of ``shards``, those it wrote in, is fenced on this node."""
        written = set(shards)
        if not written:
            self._script(cur, statements)
            return
        results = self._script(cur, [*statements, _fence_check(written)])
        for shard, fence in results[-1].rows or ():
            raise ShardMovedError(int(shard), str(fence))

    def _transaction(self, what: str, fn: Callable[[Cursor], T], *, begin: bool = True) -> T:
        """``fn`` in a transaction, committed when it returns; ``begin=False``: ``fn``'s first script starts
        with :data:`_BEGIN`."""
        def run(cur: Cursor) -> T:
            if begin:
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
            # One round trip: the transaction begun, the stream's positions and the rows' locators, locked.
            reads: list[Statement] = []
            if stream is not None and shards:
                reads.append((f"{_POSITIONS} AND shard IN ({_marks(len(shards))}) FOR UPDATE",
                              [spec.table, stream, *shards]))
            reads.extend((sql.lock_locators.format(marks=", ".join(f"X'{k.hex()}'" for k in chunk)), [])
                         for chunk in _chunks(keys))
            results = [r.rows or () for r in self._run_script(cur, [_BEGIN, *reads])[1:]]
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
            local = remote(writes)
            statements = self._entry_statements(spec, local)
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
            # The locators' and positions' shards (the changes') and the entries' written here.
            self._fenced_script(cur, statements, {*shards, *positions, *(w.shard for w in local)})
            return ApplyResult(len(todo) - superseded, superseded, len(changes) - len(todo))
        return self._transaction("apply index", run, begin=False)

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
            local = remote(writes)
            statements = self._entry_statements(spec, local)
            # Every locked row gets its locator set or deleted: no placeholder (ref_key -1) stays behind. A fix
            # with a cell (an entry's, or a tombstone's: entry shard NO_ENTRY) sets it.
            statements.extend((sql.force_locator, [f.row_key.bytes, f.shard, f.ref_key, f.entry_shard])
                              for f in todo if f.ref_key >= 0)
            statements.extend((sql.delete_locator, [f.row_key.bytes]) for f in todo if f.ref_key < 0)
            self._fenced_script(cur, statements, {*(f.shard for f in fixes), *(w.shard for w in local)})
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
            shards = {w.shard for w in writes}
            self._transaction("write index entries",
                              lambda cur: self._fenced_script(cur, [_BEGIN, *statements], shards), begin=False)

    def set_targets(self, spec: IndexSpec, stream: Stream, targets: Mapping[int, int]) -> None:
        rows = [(spec.table, stream, shard, target) for shard, target in targets.items()]

        def run(cur: Cursor) -> None:
            cur.executemany("INSERT INTO cellstream_index_positions (index_table, stream, shard, location, target)"
                            " VALUES (%s, %s, %s, 0, %s) ON DUPLICATE KEY UPDATE target = VALUES(target)", rows)
            self._fenced_script(cur, [], targets)
        self._call("create index tables", lambda cur: [cur.execute(statement) for statement in _SCHEMA])
        self._transaction("set index targets", run)

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

    # -- a shard's rows, for moves (logstore.backends.mysql.index_moves) ------------------------
    def _rows_table(self, spec: IndexSpec, kind: ShardRows) -> str:
        return _q(spec.table if kind == "entries" else spec.locator_table)

    def read_shard(self, spec: IndexSpec, kind: ShardRows, shard: int, after: bytes,
                   limit: int) -> tuple[list[str], list[tuple[Any, ...]]]:
        """The columns and up to ``limit`` rows of the version's entries or locators in ``shard`` after row_key
        ``after``, in row_key order. A locking read: it waits for the index writes under way on those rows,
        so once the shard is fenced it reads every write that will ever commit there."""
        def run(cur: Cursor) -> tuple[list[str], list[tuple[Any, ...]]]:
            cur.execute(f"SELECT * FROM {self._rows_table(spec, kind)} WHERE shard = %s AND row_key > %s"
                        " ORDER BY row_key LIMIT %s LOCK IN SHARE MODE", (shard, after, limit))
            return [str(d[0]) for d in cur.description or ()], list(cur.fetchall())
        return self._call("read index shard", run)

    def put_shard(self, spec: IndexSpec, kind: ShardRows, shard: int, after: bytes, upto: bytes | None,
                  columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        """Make the version's entries or locators of ``shard`` with a row_key in (``after``, ``upto``] exactly
        ``rows``, in one transaction; with ``upto`` None, delete every row after ``after`` (in chunks)."""
        table = self._rows_table(spec, kind)
        if upto is None:
            def tail(cur: Cursor) -> int:
                return int(cur.execute(f"DELETE FROM {table} WHERE shard = %s AND row_key > %s ORDER BY row_key"
                                       " LIMIT %s", (shard, after, _CHUNK)))
            while self._call("clear index shard", tail):
                pass
            return
        names = ", ".join(_q(c) for c in columns)
        statements: list[Statement] = [(f"DELETE FROM {table} WHERE shard = %s AND row_key > %s AND row_key <= %s",
                                        [shard, after, upto])]
        for chunk in _chunks(rows):
            text, args = _values(chunk)
            statements.append((f"REPLACE INTO {table} ({names}) VALUES {text}", args))
        self._transaction("write index shard", lambda cur: self._script(cur, [_BEGIN, *statements]), begin=False)

    def read_shard_positions(self, spec: IndexSpec, shard: int) -> list[tuple[str, int, int | None]]:
        """The version's positions (stream, location, target) in ``shard``; a locking read like read_shard's."""
        def run(cur: Cursor) -> list[tuple[str, int, int | None]]:
            # Each stream's row by its whole key: a locking read scanning other shards' rows would wait for them.
            cur.execute("SELECT stream, location, target FROM cellstream_index_positions WHERE index_table = %s"
                        " AND stream IN ('live', 'backfill') AND shard = %s LOCK IN SHARE MODE", (spec.table, shard))
            return [(str(s), int(loc), None if t is None else int(t)) for s, loc, t in cur.fetchall()]
        return self._call("read index shard positions", run)

    def put_shard_positions(self, spec: IndexSpec, shard: int, rows: Sequence[tuple[str, int, int | None]]) -> None:
        """Make the version's positions in ``shard`` exactly ``rows``, in one transaction."""
        def run(cur: Cursor) -> None:
            cur.execute("DELETE FROM cellstream_index_positions WHERE index_table = %s AND shard = %s",
                        (spec.table, shard))
            if rows:
                cur.executemany("INSERT INTO cellstream_index_positions (index_table, stream, shard, location, target)"
                                " VALUES (%s, %s, %s, %s, %s)", [(spec.table, s, shard, loc, t) for s, loc, t in rows])
        self._transaction("write index shard positions", run)

    def strays(self, spec: IndexSpec, held: Collection[int]) -> list[StrayRows]:
        mine = set(held)

        def run(cur: Cursor) -> list[StrayRows]:
            found: set[int] = set()
            try:
                # DISTINCT on a key's first column: a skip from shard to shard, not a scan of the rows.
                for table in (spec.table, spec.locator_table):
                    cur.execute(f"SELECT DISTINCT shard FROM {_q(table)}")
                    found.update(int(s) for (s,) in cur.fetchall())
                cur.execute("SELECT DISTINCT shard FROM cellstream_index_positions WHERE index_table = %s",
                            (spec.table,))
                found.update(int(s) for (s,) in cur.fetchall())
            except pymysql.err.ProgrammingError as exc:
                if exc.args and exc.args[0] == _NO_TABLE:
                    return []
                raise
            stray = sorted(found - mine)
            if not stray:
                return []
            # Moved away: recorded (moved_at) as the move's last step, or by an abort on its target. A
            # target being filled (moved_at NULL) is a move under way.
            cur.execute("SELECT shard FROM cellstream_shards WHERE moved_to IS NOT NULL AND moved_at IS NOT NULL"
                        f" AND shard IN ({', '.join(map(str, stray))})")
            moved = {int(s) for (s,) in cur.fetchall()}
            out = []
            for shard in stray:
                cur.execute(f"SELECT (SELECT COUNT(*) FROM {_q(spec.table)} WHERE shard = %s)"
                            f" + (SELECT COUNT(*) FROM {_q(spec.locator_table)} WHERE shard = %s)"
                            " + (SELECT COUNT(*) FROM cellstream_index_positions WHERE index_table = %s"
                            " AND shard = %s)", (shard, shard, spec.table, shard))
                [[rows]] = cur.fetchall()
                out.append(StrayRows(self.name, shard, int(rows), shard in moved))
            return out
        return self._call("find stray index rows", run)

    def drop_shard(self, spec: IndexSpec, shard: int, pace: Callable[[int], None] | None = None,
                   chunk: int = 2000) -> int:
        """Refused (InvalidArgumentError) while the node holds the shard: its row there has no fence."""
        def guard(cur: Cursor) -> None:
            # Locked until the chunk commits: a move switching the shard back here waits for it.
            cur.execute("SELECT fence FROM cellstream_shards WHERE shard = %s LOCK IN SHARE MODE", (shard,))
            row = cur.fetchone()
            if row is not None and row[0] is None:
                raise InvalidArgumentError(f"storage node {self.name} holds shard {shard}: its index rows stay")

        dropped = 0
        for table in (spec.table, spec.locator_table):
            while True:
                def measure(cur: Cursor, table: str = table) -> tuple[int, bytes | None]:
                    try:
                        cur.execute(f"SELECT COUNT(*), MAX(row_key) FROM (SELECT row_key FROM {_q(table)}"
                                    " WHERE shard = %s ORDER BY row_key LIMIT %s) chunk", (shard, chunk))
                    except pymysql.err.ProgrammingError as exc:
                        if exc.args and exc.args[0] == _NO_TABLE:
                            return 0, None
                        raise
                    [[count, last]] = cur.fetchall()
                    return int(count), last
                count, last = self._call("measure index shard", measure)
                if not count:
                    break
                if pace is not None:
                    pace(count)

                def delete(cur: Cursor, table: str = table, last: bytes | None = last) -> int:
                    guard(cur)
                    return int(cur.execute(f"DELETE FROM {_q(table)} WHERE shard = %s AND row_key <= %s",
                                           (shard, last)))
                dropped += self._transaction("drop index shard", delete)

        def positions(cur: Cursor) -> int:
            guard(cur)
            return int(cur.execute("DELETE FROM cellstream_index_positions WHERE index_table = %s AND shard = %s",
                                   (spec.table, shard)))
        count = int(self._call("measure index shard", lambda cur: cur.execute(
            "SELECT 1 FROM cellstream_index_positions WHERE index_table = %s AND shard = %s", (spec.table, shard))))
        if count:
            if pace is not None:
                pace(count)
            dropped += self._transaction("drop index shard", positions)
        return dropped
