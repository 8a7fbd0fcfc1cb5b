"""The embedded backend: a directory per storage node, with its cells in ``logstore.db``.

All shards of the node share one ``cells`` table; ``added_id`` is its rowid.
SQLite admits one writer at a time (``BEGIN IMMEDIATE``), so ids are allocated
and committed in the same order: a reader paging ``added_id > location`` cannot
miss a cell. Ids are unique across the node and strictly increasing within each
shard (not dense per shard). WAL mode lets readers run beside the writer. The
index tables live in ``indexes.db`` beside it, with their own write lock.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import operator
import sqlite3
import threading
import uuid
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import TypeVar

from logstore.backends.sqlite.index_tables import SQLiteIndexRecorder
from logstore.backends.sqlite.target import SQLiteTarget
from logstore.cell import AnyCell, Cell, PackedCell
from logstore.config import StoreOptions
from logstore.errors import (
    ConfigurationError,
    CorruptCellError,
    InvalidArgumentError,
    LogstoreError,
    StorageError,
    StorageUnavailableError,
)
from logstore.files import create_private_file, private_dir
from logstore.log_blocks import BlockCell, LogBlock, created_from_micros
from logstore.log_blocks import encode as encode_block
from logstore.offsets import ConsumerOffsets, OffsetRecord, move_old_offsets
from logstore.persistence import (
    FORMAT_VERSION,
    CellRead,
    ChangedCounts,
    Coordinates,
    NodeMeta,
    NodeRecorder,
    PendingCell,
    ReadBudget,
    RestoredCell,
    check_meta,
    concat_counts,
    decode_in_order,
    decode_log,
    decode_pages,
    make_cell,
    make_sized_cell,
    make_sized_packed_cell,
    ordered_result,
    split_existing,
)
from logstore.retry import RetryPolicy

logger = logging.getLogger(__name__)
DB_FILE = "logstore.db"
INDEX_FILE = "indexes.db"
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_BUSY_TIMEOUT = 30  # seconds a writer waits for another's lock
_SQLITE_NEEDED = (3, 35)
_T = TypeVar("_T")
_Row = tuple[int, int, bytes, str, int, bytes, int]

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS cellstream_meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS cellstream_shards (shard INTEGER PRIMARY KEY, cells INTEGER NOT NULL)",
    """CREATE TABLE IF NOT EXISTS cells (
        added_id INTEGER PRIMARY KEY,
        shard INTEGER NOT NULL,
        row_key BLOB NOT NULL,
        column_name TEXT NOT NULL,
        ref_key INTEGER NOT NULL,
        body BLOB NOT NULL,
        created_at INTEGER NOT NULL,
        UNIQUE (row_key, column_name, ref_key)
    )""",
    "CREATE INDEX IF NOT EXISTS cells_log ON cells (shard, added_id)",
    "CREATE INDEX IF NOT EXISTS cells_created ON cells (shard, created_at)",
    # A consumer's offsets of the node's shards as one value (logstore.offsets).
    "CREATE TABLE IF NOT EXISTS cellstream_consumers (consumer TEXT PRIMARY KEY, offsets BLOB NOT NULL)",
)
_COLS = "added_id, shard, row_key, column_name, ref_key, body, created_at"
_SELECT_CELL = f"SELECT {_COLS} FROM cells WHERE row_key = ? AND column_name = ? AND ref_key = ?"
_SELECT_LATEST = (
    f"SELECT {_COLS} FROM cells WHERE row_key = ? AND column_name = ? ORDER BY ref_key DESC LIMIT 1"
)
_SELECT_ROW = f"""SELECT {_COLS} FROM cells c WHERE row_key = ? AND ref_key = (
    SELECT MAX(ref_key) FROM cells m WHERE m.row_key = c.row_key AND m.column_name = c.column_name)
    ORDER BY column_name"""
# As of a time: the versions created by then. Each read goes down the UNIQUE (row_key, column_name, ref_key) index.
_SELECT_LATEST_AS_OF = (f"SELECT {_COLS} FROM cells WHERE row_key = ? AND column_name = ? AND created_at <= ?"
                        " ORDER BY ref_key DESC LIMIT 1")
_SELECT_ROW_AS_OF = f"""SELECT {_COLS} FROM cells c WHERE row_key = ? AND ref_key = (
    SELECT MAX(ref_key) FROM cells m WHERE m.row_key = c.row_key AND m.column_name = c.column_name
    AND m.created_at <= ?) ORDER BY column_name"""
_SELECT_VERSIONS = f"SELECT {_COLS} FROM cells WHERE row_key = ? AND column_name = ?{{}} ORDER BY ref_key DESC LIMIT ?"
_SELECT_LOG = f"SELECT {_COLS} FROM cells WHERE shard = ? AND added_id > ? ORDER BY added_id LIMIT ?"
_SELECT_BLOCK = ("SELECT added_id, created_at, ref_key, column_name, row_key, body FROM cells"
                 " WHERE shard = ? AND added_id > ? AND added_id <= ? ORDER BY added_id")
_INSERT = (
    "INSERT INTO cells (shard, row_key, column_name, ref_key, body, created_at) VALUES (?, ?, ?, ?, ?, ?)"
    " ON CONFLICT DO NOTHING"
)
_COUNT = "UPDATE cellstream_shards SET cells = cells + ? WHERE shard = ?"
_OFFSETS = "SELECT offsets FROM cellstream_consumers WHERE consumer = ?"
_SAVE_OFFSETS = "INSERT OR REPLACE INTO cellstream_consumers (consumer, offsets) VALUES (?, ?)"
# The table of a row per shard, before logstore.offsets: moved over when a node opens.
_OLD_OFFSETS = "SELECT consumer, shard, location, owner, doc FROM cellstream_offsets ORDER BY consumer, shard"

_ADDED_ID = operator.itemgetter(0)  # of a row: its sort key within a shard's page (C, not a call of Python per row)
_SHARDS_A_READ = 500  # shards a statement: at most 1,500 of SQLite's 32,766 variables
# New cells beyond which a partial count would scan more rows than counting every shard reads.
_PARTIAL_CELLS = 4096


def _of(columns: Sequence[str] | None, reserved: bool) -> str:
    """The condition on a count's columns: ``columns`` (its arguments follow the shard's), and without
    cellstream's own (``_``...) unless ``reserved``."""
    of = f" AND column_name IN ({', '.join('?' * len(columns))})" if columns else ""
    return of + ("" if reserved else " AND substr(column_name, 1, 1) <> '_'")


def _chunks(items: Sequence[_T]) -> Iterator[Sequence[_T]]:
    """``items`` (shards, or shard and location pairs) by _SHARDS_A_READ."""
    return (items[i:i + _SHARDS_A_READ] for i in range(0, len(items), _SHARDS_A_READ))


def _pages_sql(shards: int, columns: Sequence[str] | None) -> str:
    """The pages of ``shards`` shards in one statement. A page is bounded by its ``limit``-th id, which a
    correlated subquery finds in the (shard, added_id) index, so a long log is never read past its page."""
    of = f" AND {{0}}.column_name IN ({', '.join('?' * len(columns))})" if columns else ""
    return (f"WITH w(shard, loc) AS (VALUES {', '.join(['(?, ?)'] * shards)})"
            f" SELECT {', '.join('c.' + c for c in _COLS.split(', '))} FROM w JOIN cells c"
            f" ON c.shard = w.shard AND c.added_id > w.loc{of.format('c')} AND c.added_id <= COALESCE(("
            f"SELECT m.added_id FROM cells m WHERE m.shard = w.shard AND m.added_id > w.loc{of.format('m')}"
            " ORDER BY m.added_id LIMIT 1 OFFSET ?), 9223372036854775807)")


class _ThreadConnection:
    """A thread's connection; closed by a finalizer when the thread (and its local) is gone."""

    __slots__ = ("__weakref__", "conn")

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        weakref.finalize(self, conn.close)


def _micros(when: dt.datetime) -> int:
    delta = when - _EPOCH
    return (delta.days * 86400 + delta.seconds) * 1_000_000 + delta.microseconds


def _row_to_cell(row: _Row, max_bytes: int) -> Cell:
    added_id, shard, row_key, column, ref_key, blob, created = row
    return make_cell(shard, added_id, row_key, column, ref_key, blob, _EPOCH + dt.timedelta(microseconds=created),
                     max_bytes)


def _row_to_sized_cell(row: _Row, max_bytes: int) -> tuple[Cell, int]:
    added_id, shard, row_key, column, ref_key, blob, created = row
    return make_sized_cell(shard, added_id, row_key, column, ref_key, blob,
                           _EPOCH + dt.timedelta(microseconds=created), max_bytes)


def _row_to_sized_packed_cell(row: _Row, max_bytes: int) -> tuple[PackedCell, int]:
    added_id, shard, row_key, column, ref_key, blob, created = row
    return make_sized_packed_cell(shard, added_id, row_key, column, ref_key, blob,
                                  _EPOCH + dt.timedelta(microseconds=created), max_bytes)


def _translate(exc: sqlite3.Error, what: str) -> LogstoreError:
    if isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc):
        return StorageUnavailableError(f"sqlite {what}: database is locked by another writer")
    if "unable to open" in str(exc) or "not a database" in str(exc):
        return ConfigurationError(f"sqlite {what}: {exc}")
    return StorageError(f"sqlite {what}: {exc}")


class _Database:
    """One SQLite file: a connection per thread (WAL), read and write-transaction contexts."""

    def __init__(self, path: Path, options: StoreOptions) -> None:
        self.path = path
        self._options = options
        self._local = threading.local()
        self._all: weakref.WeakSet[_ThreadConnection] = weakref.WeakSet()
        self._all_lock = threading.Lock()

    def conn(self) -> sqlite3.Connection:
        holder: _ThreadConnection | None = getattr(self._local, "holder", None)
        if holder is None:
            # Connecting creates a missing file with the umask's mode, and its -wal and -shm take the database
            # file's: made 0600 first, all three are the owner's alone. Where it cannot be made, connect says why.
            with contextlib.suppress(OSError):
                create_private_file(self.path)
            conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=_BUSY_TIMEOUT)
            try:
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute(f"PRAGMA synchronous={self._options.sqlite_synchronous}")
            except BaseException:
                conn.close()
                raise
            holder = _ThreadConnection(conn)
            self._local.holder = holder
            with self._all_lock:
                self._all.add(holder)
        return holder.conn

    @contextmanager
    def read(self) -> Iterator[sqlite3.Connection]:
        try:
            yield self.conn()
        except sqlite3.Error as exc:
            raise _translate(exc, "read") from exc

    @contextmanager
    def write(self, busy_timeout: float | None = None) -> Iterator[sqlite3.Connection]:
        """A write transaction; ``busy_timeout`` seconds (default 30) to wait for another writer's lock."""
        with _errors("write"):
            conn = self.conn()
            if busy_timeout is not None:
                conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout * 1000)}")
            try:
                conn.execute("BEGIN IMMEDIATE")
                try:
                    yield conn
                    conn.execute("COMMIT")
                except BaseException:
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                    raise
            finally:
                if busy_timeout is not None:
                    conn.execute(f"PRAGMA busy_timeout = {_BUSY_TIMEOUT * 1000}")

    def close(self) -> None:
        with self._all_lock:
            holders, self._all = list(self._all), weakref.WeakSet()
        for holder in holders:
            holder.conn.close()
        self._local = threading.local()


@contextmanager
def _errors(what: str) -> Iterator[None]:
    try:
        yield
    except sqlite3.Error as exc:
        raise _translate(exc, what) from exc


class SQLiteRecorder(NodeRecorder):
    """A node's cells and offsets in ``logstore.db``; its index tables in ``indexes.db`` beside it, so
    index writers never wait behind cell writers for SQLite's one write lock (and the reverse)."""

    # Reads run in this process: several at once queue for the GIL between each sqlite3 step and the
    # decoding of its rows, costing more CPU than one after another (docs/logstore.md, "Read concurrency").
    parallel_reads = 1
    parallel_writes = 1  # SQLite's one writer: a second would sleep in its busy handler

    def __init__(self, name: str, target: SQLiteTarget, options: StoreOptions) -> None:
        if sqlite3.sqlite_version_info < _SQLITE_NEEDED:  # as documented (the old offsets table needed RETURNING)
            raise ConfigurationError(f"SQLite {'.'.join(map(str, _SQLITE_NEEDED))} or later is needed; this Python"
                                     f" has {sqlite3.sqlite_version}")
        self.name = name
        self._db = _Database(target.directory / DB_FILE, options)
        self._index_db = _Database(target.directory / INDEX_FILE, options)
        self._conn = self._db.conn
        self._write = self._db.write
        self._errors = _errors
        self.indexes = SQLiteIndexRecorder(name, self._index_db.write, self._index_db.read, options.retry)
        self._directory = target.directory
        self._max_body = options.inflate_limit

    # -- metadata ---------------------------------------------------------
    def read_meta(self, retry: RetryPolicy | None = None) -> NodeMeta | None:
        if not self._db.path.exists():  # connecting would create the file: a read must not
            return None
        with self._errors("read metadata"):
            try:
                rows = dict(self._conn().execute("SELECT name, value FROM cellstream_meta").fetchall())
            except sqlite3.OperationalError as exc:
                if "no such table" in str(exc):
                    return None
                raise
        if not rows:
            return None
        if int(rows.get("format_version", 0)) != FORMAT_VERSION:
            raise ConfigurationError(f"storage node {self.name} has unknown format {rows.get('format_version')}")
        return NodeMeta(int(rows["shard_count"]), int(rows["first"]), int(rows["last"]))

    def initialize(self, meta: NodeMeta, retry: RetryPolicy | None = None) -> None:
        try:
            private_dir(self._directory)
        except OSError as exc:
            raise ConfigurationError(f"cannot create store directory {self._directory}: {exc.strerror}") from None
        with self._write() as conn:
            for statement in _SCHEMA:
                conn.execute(statement)
            self._move_old_offsets(conn)
            found = dict(conn.execute("SELECT name, value FROM cellstream_meta").fetchall())
            if not found:
                conn.executemany(
                    "INSERT INTO cellstream_meta (name, value) VALUES (?, ?)",
                    [("format_version", str(FORMAT_VERSION)), ("shard_count", str(meta.shard_count)),
                     ("first", str(meta.first)), ("last", str(meta.last))],
                )
                conn.executemany(
                    "INSERT INTO cellstream_shards (shard, cells) VALUES (?, 0)",
                    [(s,) for s in range(meta.first, meta.last + 1)],
                )
                logger.info("created storage node %s with shards %d-%d", self.name, meta.first, meta.last)
        stored = self.read_meta()
        assert stored is not None
        check_meta(self.name, stored, meta)

    # -- writes -----------------------------------------------------------
    def insert(self, cells: Sequence[PendingCell], retry: RetryPolicy | None = None) -> list[Cell]:
        stored: dict[Coordinates, Cell] = {}
        with self._write() as conn:
            # created_at is read under the write lock so it never decreases along added_id.
            created = _micros(dt.datetime.now(dt.UTC))
            counts: dict[int, int] = {}
            fresh: list[PendingCell] = []
            for cell in cells:
                cur = conn.execute(
                    _INSERT, (cell.shard, cell.row_key.bytes, cell.column, cell.ref_key, cell.blob, created)
                )
                if cur.rowcount == 1:
                    assert cur.lastrowid is not None
                    stored[cell.coordinates] = Cell(
                        cell.row_key, cell.column, cell.ref_key, cell.body, cur.lastrowid, cell.shard,
                        _EPOCH + dt.timedelta(microseconds=created),
                    )
                    counts[cell.shard] = counts.get(cell.shard, 0) + 1
                    fresh.append(cell)
                else:
                    row = conn.execute(_SELECT_CELL, cell.coordinates).fetchone()
                    existing = _row_to_cell(row, self._max_body)
                    split_existing([cell], {cell.coordinates: existing})
                    stored[cell.coordinates] = existing
            conn.executemany(_COUNT, [(n, shard) for shard, n in counts.items()])
            if self.before_commit is not None:
                self.before_commit(sorted(counts))
        return ordered_result(cells, stored)

    def restore_cells(self, cells: Sequence[RestoredCell]) -> None:
        """The given ids go in as the rowid; the node's later writes take the next rowid, above them all."""
        if not cells:
            return
        with self._write() as conn:
            lowest: dict[int, int] = {}
            for cell in cells:
                lowest[cell.shard] = min(cell.added_id, lowest.get(cell.shard, cell.added_id))
            for shard, first in lowest.items():
                head = int(conn.execute("SELECT COALESCE(MAX(added_id), 0) FROM cells WHERE shard = ?",
                                        (shard,)).fetchone()[0])
                if first <= head:
                    raise StorageError(f"storage node {self.name}: shard {shard} holds cells up to added_id {head};"
                                       f" a restore cannot write added_id {first} there")
            try:
                conn.executemany(
                    f"INSERT INTO cells ({_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?)",
                    [(c.added_id, c.shard, c.row_key.bytes, c.column, c.ref_key, c.blob, _micros(c.created_at))
                     for c in cells])
            except sqlite3.IntegrityError as exc:
                # SQLite's ids are the node's, not a shard's: another shard of the node may hold the id.
                raise StorageError(f"storage node {self.name}: restored cells collide with stored ones ({exc})"
                                   ) from None
            counts: dict[int, int] = {}
            for cell in cells:
                counts[cell.shard] = counts.get(cell.shard, 0) + 1
            conn.executemany(_COUNT, [(n, shard) for shard, n in counts.items()])

    # -- reads ------------------------------------------------------------
    def get_cell(self, shard: int, row_key: uuid.UUID, column: str, ref_key: int) -> Cell | None:
        with self._errors("read"):
            row = self._conn().execute(_SELECT_CELL, (row_key.bytes, column, ref_key)).fetchone()
        return None if row is None else _row_to_cell(row, self._max_body)

    def get_latest(self, shard: int, row_key: uuid.UUID, column: str, as_of: dt.datetime | None = None) -> Cell | None:
        with self._errors("read"):
            row = (self._conn().execute(_SELECT_LATEST, (row_key.bytes, column)) if as_of is None else
                   self._conn().execute(_SELECT_LATEST_AS_OF, (row_key.bytes, column, _micros(as_of)))).fetchone()
        return None if row is None else _row_to_cell(row, self._max_body)

    def read_cells(self, coordinates: Sequence[CellRead], as_of: dt.datetime | None,
                   budget: ReadBudget) -> list[Cell | None]:
        """A statement per 500 coordinates: each found by its rowid, which one lookup in the unique index gives
        (the newest as of ``as_of`` where no ref_key is given)."""
        latest = ("" if as_of is None else "AND created_at <= ? ") + "ORDER BY ref_key DESC LIMIT 1"
        rows: list[_Row | None] = []
        with self._errors("read"):
            conn = self._conn()
            for group in _chunks(coordinates):  # 2,001 of SQLite's 32,766 variables a statement
                sql = (f"WITH w(i, k, c, r) AS (VALUES {', '.join(['(?, ?, ?, ?)'] * len(group))})"
                       f" SELECT w.i, {', '.join('x.' + c for c in _COLS.split(', '))} FROM w JOIN cells x"
                       " ON x.added_id = CASE WHEN w.r IS NOT NULL THEN (SELECT added_id FROM cells"
                       " WHERE row_key = w.k AND column_name = w.c AND ref_key = w.r) ELSE (SELECT added_id FROM cells"
                       f" WHERE row_key = w.k AND column_name = w.c {latest}) END")
                params: list[object] = [a for i, (_, key, column, ref) in enumerate(group)
                                        for a in (i, key.bytes, column, ref)]
                if as_of is not None:
                    params.append(_micros(as_of))
                found = {row[0]: row[1:] for row in conn.execute(sql, params).fetchall()}
                rows += [found.get(i) for i in range(len(group))]
        return decode_in_order(rows, _row_to_sized_cell, self._max_body, budget)

    def get_versions(self, shard: int, row_key: uuid.UUID, column: str, before: int | None, limit: int,
                     budget: ReadBudget) -> list[Cell]:
        """One statement down the unique (row_key, column_name, ref_key) index."""
        sql = _SELECT_VERSIONS.format("" if before is None else " AND ref_key < ?")
        params = (row_key.bytes, column, limit) if before is None else (row_key.bytes, column, before, limit)
        with self._errors("read"):
            rows = self._conn().execute(sql, params).fetchall()
        return decode_log(rows, _row_to_sized_cell, self._max_body, budget)

    def get_row(self, shard: int, row_key: uuid.UUID, as_of: dt.datetime | None = None) -> list[Cell]:
        with self._errors("read"):
            rows = (self._conn().execute(_SELECT_ROW, (row_key.bytes,)) if as_of is None else self._conn().execute(
                _SELECT_ROW_AS_OF, (row_key.bytes, _micros(as_of)))).fetchall()
        return [_row_to_cell(r, self._max_body) for r in rows]

    def read_blocks(self, ranges: Sequence[tuple[int, int, int]]) -> list[LogBlock]:
        """The stored bytes as they are, a statement a range."""
        out = []
        conn = self._conn()
        for shard, after, up_to in ranges:
            with self._errors("read block"):
                rows = conn.execute(_SELECT_BLOCK, (shard, after, up_to)).fetchall()
            out.append(LogBlock(shard, len(rows), encode_block(
                BlockCell(i, created_from_micros(t), r, c, k, b) for i, t, r, c, k, b in rows)))
        return out

    def read_logs(
        self, locations: Sequence[tuple[int, int]], limit: int, columns: Sequence[str] | None, packed: bool,
        budget: ReadBudget,
    ) -> Callable[[], Mapping[int, Sequence[AnyCell] | CorruptCellError]]:
        """One statement per 500 shards (one for a single shard): each statement lets go of the GIL and
        retakes it, which a reader thread beside a busy event loop waits for."""
        to_cell: Callable[[_Row, int], tuple[AnyCell, int]] = (_row_to_sized_packed_cell if packed
                                                               else _row_to_sized_cell)
        if len(locations) == 1:
            [(shard, location)] = locations
            sql, args = _SELECT_LOG, [shard, location, *(columns or ()), limit]
            if columns:
                sql = sql.replace("ORDER BY", f"AND column_name IN ({', '.join('?' * len(columns))}) ORDER BY")
            with self._errors("read log"):
                rows = self._conn().execute(sql, args).fetchall()
            return partial(decode_pages, {shard: rows}, to_cell, _ADDED_ID, self._max_body, budget)
        by_shard: dict[int, list[_Row]] = {s: [] for s, _ in locations}
        for group in _chunks(locations):
            sql = _pages_sql(len(group), columns)
            params: list[int | str] = [a for pair in group for a in pair]
            params += [*(columns or ()), *(columns or ()), limit - 1]
            with self._errors("read log"):
                for row in self._conn().execute(sql, params).fetchall():
                    by_shard[row[1]].append(row)
        return partial(decode_pages, by_shard, to_cell, _ADDED_ID, self._max_body, budget)

    def count_after(self, shard: int, location: int, columns: Sequence[str] | None = None,
                    reserved: bool = True) -> int:
        sql = "SELECT COUNT(*) FROM cells WHERE shard = ? AND added_id > ?" + _of(columns, reserved)
        with self._errors("read log"):
            row = self._conn().execute(sql, (shard, location, *(columns or ()))).fetchone()
        return int(row[0])

    def counts_after(self, locations: Sequence[tuple[int, int]],
                     columns: Sequence[str] | None = None, reserved: bool = True) -> dict[int, int]:
        of = _of(columns, reserved)
        out: dict[int, int] = {}
        with self._errors("read log"):
            conn = self._conn()
            for group in _chunks(locations):
                out.update(conn.execute(
                    f"WITH w(shard, loc) AS (VALUES {', '.join(['(?, ?)'] * len(group))}) SELECT w.shard,"
                    f" (SELECT COUNT(*) FROM cells WHERE shard = w.shard AND added_id > w.loc{of}) FROM w",
                    [*(a for pair in group for a in pair), *(columns or ())]))
        return out

    def first_at(self, shard: int, when: dt.datetime) -> int | None:
        with self._errors("read log"):
            row = self._conn().execute(
                "SELECT MIN(added_id) FROM cells WHERE shard = ? AND created_at >= ?", (shard, _micros(when))
            ).fetchone()
        return None if row[0] is None else int(row[0])

    def shard_weights(self, by: str, window: float) -> dict[int, int] | None:
        args: tuple[int, ...] = ()
        if by == "bytes":
            # The fixed columns (shard, ids, row key, ref key, time) are 44 bytes a cell besides the name.
            sql = "SELECT shard, SUM(LENGTH(body) + LENGTH(column_name) + 44) FROM cells GROUP BY shard"
        elif by == "writes":
            since = _micros(dt.datetime.now(dt.UTC)) - int(window * 1_000_000)
            sql, args = "SELECT shard, COUNT(*) FROM cells WHERE created_at >= ? GROUP BY shard", (since,)
        else:
            raise InvalidArgumentError(f"shards are weighed by cells, bytes or writes, not {by!r}")
        with self._errors("read log"):
            return {int(shard): int(weight) for shard, weight in self._conn().execute(sql, args)}

    def head(self, shard: int) -> int:
        with self._errors("read log"):
            row = self._conn().execute("SELECT MAX(added_id) FROM cells WHERE shard = ?", (shard,)).fetchone()
        return int(row[0] or 0)

    def heads(self, shards: Sequence[int]) -> dict[int, int]:
        # An index probe per shard, 500 shards a statement: a GROUP BY would scan the whole log index.
        out: dict[int, int] = {}
        with self._errors("read log"):
            conn = self._conn()
            for group in _chunks(shards):
                out.update(conn.execute(
                    f"WITH w(shard) AS (VALUES {', '.join(['(?)'] * len(group))}) SELECT w.shard,"
                    " COALESCE((SELECT MAX(added_id) FROM cells WHERE shard = w.shard), 0) FROM w", group))
        return out

    def shard_counts(self) -> dict[int, int]:
        with self._errors("read"):
            return concat_counts(*self._conn().execute(
                "SELECT group_concat(shard), group_concat(cells) FROM cellstream_shards").fetchone())

    def changed_counts(self, since: object | None) -> ChangedCounts:
        """Partial answers are exact here: ids are allocated and committed in one order (one writer at a
        time), so the shards that moved since a mark are those of the cells above it. The mark is the
        highest id, read before the counts: a cell committed between the two is counted again next time."""
        with self._errors("read"):
            conn = self._conn()
            last = int(conn.execute("SELECT MAX(added_id) FROM cells").fetchone()[0] or 0)
            if type(since) is int and 0 <= last - since <= _PARTIAL_CELLS:  # (not a bool, which is an int too)
                # The rowid range, not an index: the rows after the mark are the table's last.
                return ChangedCounts(concat_counts(*conn.execute(
                    "SELECT group_concat(shard), group_concat(cells) FROM cellstream_shards"
                    " WHERE shard IN (SELECT shard FROM cells WHERE added_id > ?)", (since,)).fetchone()),
                    last, complete=False)
            return ChangedCounts(self.shard_counts(), last, complete=True)

    # -- consumer offsets -------------------------------------------------
    def claim_offsets(self, consumer: str, owner: str, shards: Sequence[int]) -> list[OffsetRecord]:
        with self._write() as conn:
            offsets = self._offsets(conn, consumer)
            offsets.claim(owner, shards)
            conn.execute(_SAVE_OFFSETS, (consumer, offsets.encode()))
        return offsets.records(set(shards))

    def commit_offsets(self, consumer: str, owner: str, offsets: dict[int, tuple[int, str]]) -> set[int]:
        with self._write() as conn:
            stored = self._offsets(conn, consumer)
            fenced = stored.commit(owner, offsets)
            if len(fenced) < len(offsets):
                conn.execute(_SAVE_OFFSETS, (consumer, stored.encode()))
        return fenced

    def read_offsets(self, consumer: str) -> list[OffsetRecord]:
        with self._errors("read offsets"):
            return self._offsets(self._conn(), consumer).records()

    def read_marker(self, name: str) -> str | None:
        with self._errors("read metadata"):
            row = self._conn().execute("SELECT value FROM cellstream_meta WHERE name = ?", (f"marker.{name}",)
                                       ).fetchone()
        return None if row is None else str(row[0])

    def write_marker(self, name: str, value: str | None) -> None:
        with self._write() as conn:
            if value is None:
                conn.execute("DELETE FROM cellstream_meta WHERE name = ?", (f"marker.{name}",))
            else:
                conn.execute("INSERT INTO cellstream_meta (name, value) VALUES (?, ?) ON CONFLICT (name) DO UPDATE"
                             " SET value = excluded.value", (f"marker.{name}", value))

    def consumers(self) -> list[str]:
        with self._errors("read offsets"):
            return [str(c) for (c,) in self._conn().execute("SELECT consumer FROM cellstream_consumers"
                                                             " ORDER BY consumer")]

    def _offsets(self, conn: sqlite3.Connection, consumer: str) -> ConsumerOffsets:
        row = conn.execute(_OFFSETS, (consumer,)).fetchone()
        return ConsumerOffsets.decode(None if row is None else row[0], f"{consumer} on storage node {self.name}")

    def _move_old_offsets(self, conn: sqlite3.Connection) -> None:
        """(in the write transaction that opens the node) The offsets of the table a row per shard moved to a row
        per consumer, and that table dropped: a process of an older version still running fails its commits."""
        if conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'cellstream_offsets'").fetchone():
            kept = {consumer for (consumer,) in conn.execute("SELECT consumer FROM cellstream_consumers")}
            moved = move_old_offsets(conn.execute(_OLD_OFFSETS).fetchall(),
                                     lambda consumer, value: conn.execute(_SAVE_OFFSETS, (consumer, value)), kept)
            conn.execute("DROP TABLE cellstream_offsets")
            logger.info("storage node %s: the offsets of %d consumers moved to a row each", self.name, moved)

    def close(self) -> None:
        self._db.close()
        self._index_db.close()
