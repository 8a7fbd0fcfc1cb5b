"""The MySQL/MariaDB backend: one database per storage node, one table per shard.

Each shard's table follows the Schemaless design (``added_id`` AUTO_INCREMENT
primary key, unique ``(row_key, column_name, ref_key)``). Shard tables are created
on first write, so opening an instance of 4096 shards creates three small tables.

No-skip guarantee: every write transaction first locks its shards' rows in
``cellstream_shards`` (in ascending shard order, so writers never deadlock), and
only then inserts. AUTO_INCREMENT ids of a shard are therefore allocated and
committed by one transaction at a time, and a reader paging ``added_id > location``
never sees a higher id commit before a lower one. The whole transaction - lock,
inserts, id read-back and COMMIT - goes to the server as one multi-statement
packet, so the lock costs no extra round trip; writers to the *same* shard queue
behind each other (measured in bench/logstore_bench.py).
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import suppress
from functools import partial
from operator import itemgetter
from typing import Any, TypeVar

import pymysql
from pymysql.constants import CLIENT, FIELD_TYPE
from pymysql.converters import conversions

from . import mysql_pending
from .cell import Cell
from .config import MySQLTarget, StoreOptions
from .errors import (
    ConfigurationError,
    CorruptCellError,
    ShardMovedError,
)
from .mysql_errors import DUPLICATE, NO_TABLE, code, retry_here, translate
from .mysql_pool import Connection, Pool, ReadFallback, Statement, run_script
from .persistence import (
    FORMAT_VERSION,
    Coordinates,
    NodeMeta,
    NodeRecorder,
    OffsetRecord,
    PendingCell,
    PendingRecord,
    check_meta,
    decode_log,
    make_cell,
    offset_record,
    ordered_result,
    split_existing,
)
from .retry import RetryPolicy, retry_call

logger = logging.getLogger(__name__)
T = TypeVar("T")
# A statement tagged with (shard, rows) when it is an INSERT of that many rows.
Tagged = tuple[Statement, tuple[int, int] | None]


_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS cellstream_meta ("
    " name VARCHAR(64) CHARACTER SET ascii NOT NULL PRIMARY KEY,"
    " value VARCHAR(255) NOT NULL) ENGINE=InnoDB",
    "CREATE TABLE IF NOT EXISTS cellstream_shards ("
    " shard INT NOT NULL PRIMARY KEY, cells BIGINT NOT NULL DEFAULT 0) ENGINE=InnoDB",
    "CREATE TABLE IF NOT EXISTS cellstream_moves ("
    " shard INT NOT NULL PRIMARY KEY, moved_to VARCHAR(64) CHARACTER SET ascii NOT NULL,"
    " moved_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)) ENGINE=InnoDB",
    "CREATE TABLE IF NOT EXISTS cellstream_offsets ("
    " consumer VARCHAR(200) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL, shard INT NOT NULL,"
    " owner VARCHAR(200) NOT NULL, location BIGINT NULL, doc TEXT NOT NULL,"
    " commits BIGINT NOT NULL DEFAULT 0, PRIMARY KEY (consumer, shard)) ENGINE=InnoDB",
)
_CLAIM = ("INSERT INTO cellstream_offsets (consumer, shard, owner, doc) VALUES (%s, %s, %s, '{}')"
          " ON DUPLICATE KEY UPDATE owner = VALUES(owner)")
# commits + 1 makes every matched row "affected", so rowcount tells a fenced shard from an unchanged one.
_COMMIT = ("UPDATE cellstream_offsets SET location = %s, doc = %s, commits = commits + 1"
           " WHERE consumer = %s AND shard = %s AND owner = %s")
_OFFSETS = "SELECT shard, location, owner, doc FROM cellstream_offsets WHERE consumer = %s ORDER BY shard"
_SHARD_TABLE = (
    "CREATE TABLE IF NOT EXISTS {t} ("
    " added_id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,"
    " row_key BINARY(16) NOT NULL,"
    " column_name VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,"
    " ref_key BIGINT NOT NULL,"
    " body LONGBLOB NOT NULL,"
    " created_at DATETIME(6) NOT NULL,"
    " UNIQUE KEY cell (row_key, column_name, ref_key),"
    " KEY created (created_at)"
    ") ENGINE=InnoDB"
)
_COLS = "added_id, row_key, column_name, ref_key, body, created_at"
_VALUES_ROW = "(%s, %s, %s, %s, @cs_t)"
# Taken once all shard locks of a write are held; every row of the write gets it as created_at.
_TIMESTAMP = "SELECT CAST(@cs_t := UTC_TIMESTAMP(6) AS DATETIME(6))"


def _escaped_size(value: object) -> int:
    """An upper bound of the value's size once escaped into SQL text."""
    if isinstance(value, bytes | str):
        return 2 * len(value.encode() if isinstance(value, str) else value) + 16
    return 24


def _row_args(cell: PendingCell) -> tuple[bytes, str, int, bytes]:
    return (cell.row_key.bytes, cell.column, cell.ref_key, cell.blob)


def _row_size(cell: PendingCell) -> int:
    """The row's share of an INSERT packet, by the same measure _packets uses."""
    return len(_VALUES_ROW) + 2 + sum(_escaped_size(a) for a in _row_args(cell))


def _after(columns: Sequence[str] | None) -> tuple[str, list[str]]:
    """The WHERE clause of the cells after a location (its one argument first), of ``columns`` if given."""
    return ("added_id > %s" + (f" AND column_name IN ({', '.join(['%s'] * len(columns))})" if columns else ""),
            list(columns or ()))


def table(shard: int) -> str:
    return f"cells_{shard:04d}"


def _utc_datetime(value: str | bytes) -> dt.datetime:
    # Every DATETIME column of ours holds UTC: build aware datetimes in one C call.
    text = value.decode("ascii") if isinstance(value, bytes | bytearray) else value
    return dt.datetime.fromisoformat(text + "+00:00")


_CONVERSIONS: dict[Any, Any] = {**conversions, FIELD_TYPE.DATETIME: _utc_datetime}


def _row_to_cell(shard: int, row: tuple[Any, ...]) -> Cell:
    added_id, row_key, column, ref_key, blob, created = row
    return make_cell(shard, added_id, row_key, column, ref_key, blob, created)


class MySQLRecorder(NodeRecorder):
    def __init__(self, name: str, target: MySQLTarget, options: StoreOptions,
                 replicas: Sequence[MySQLTarget] = ()) -> None:
        self.name = name
        self._target = target
        self._options = options
        wait = options.connect_timeout + options.read_timeout
        self._pool = Pool(self._connect, options.pool_size, wait)
        self._replicas = [Pool(partial(self._replica_connect, r), options.pool_size, wait) for r in replicas]
        self.fallback = ReadFallback(name)
        # Calls made because some node is down (buffering, the map's refresh) give up on this one quickly.
        self._quick_retry = options.retry.model_copy(update={"deadline": options.buffer_after or 2.0})
        self._deferred: NodeMeta | None = None
        self._deferred_lock = threading.Lock()
        self._initializing: int | None = None  # the thread running the deferred initialization
        self._tables: set[int] = set()
        self._tables_lock = threading.Lock()
        from .mysql_index import MySQLIndexRecorder  # it uses this module's connections and scripts

        self.indexes = MySQLIndexRecorder(name, self._call, run_script, options.max_statement_bytes)

    # -- connections and errors -----------------------------------------------------
    def _raw_connect(self, database: str | None, target: MySQLTarget | None = None) -> Connection:
        t, o = target or self._target, self._options
        return pymysql.connect(
            host=t.host, port=t.port, user=t.user, password=t.password, database=database,
            autocommit=True, client_flag=CLIENT.MULTI_STATEMENTS, charset="utf8mb4",
            binary_prefix=True, conv=_CONVERSIONS, connect_timeout=o.connect_timeout,
            read_timeout=o.read_timeout, write_timeout=o.read_timeout,
        )

    def _connect(self) -> Connection:
        try:
            conn = self._raw_connect(self._target.database)
        except pymysql.err.OperationalError as exc:
            if code(exc) != 1049:
                raise
            # Unknown database: "creates if missing" covers the database too.
            admin = self._raw_connect(None)
            try:
                with admin.cursor() as cur:
                    cur.execute(f"CREATE DATABASE IF NOT EXISTS `{self._target.database}` CHARACTER SET utf8mb4")
            finally:
                admin.close()
            conn = self._raw_connect(self._target.database)
        return self._session(conn)

    def _replica_connect(self, target: MySQLTarget) -> Connection:
        return self._session(self._raw_connect(target.database, target))

    def _session(self, conn: Connection) -> Connection:
        try:
            with conn.cursor() as cur:
                # READ COMMITTED: every statement sees the latest commits (and takes no gap locks).
                # Increment 1: the ids of one multi-row INSERT are consecutive (see _insert_statements).
                cur.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
                cur.execute("SET SESSION auto_increment_increment = 1, auto_increment_offset = 1")
        except BaseException:
            Pool.discard(conn)
            raise
        return conn

    def _call(self, what: str, fn: Callable[[pymysql.cursors.Cursor], T], *, read: bool = False,
              policy: RetryPolicy | None = None) -> T:
        """Run ``fn`` on a pooled connection; translate driver errors; retry retriable ones. A ``read`` falls
        back to the node's replicas while its primary is unavailable (:class:`ReadFallback`)."""
        def attempt() -> T:
            if not read or not self._replicas:
                return self._on(self._pool, self.name, what, fn)
            return self.fallback.read(partial(self._on, self._pool, self.name, what, fn), [
                partial(self._on, pool, f"{self.name} replica {i}", what, fn) for i, pool in enumerate(self._replicas)])
        return retry_call(attempt, policy or self._options.retry, retriable=retry_here)

    def _on(self, pool: Pool, where: str, what: str, fn: Callable[[pymysql.cursors.Cursor], T]) -> T:
        if pool is self._pool and self._deferred is not None and what != "initialize":
            self._initialize_deferred()
        try:
            with pool.connection() as conn, conn.cursor() as cur:
                return fn(cur)
        except pymysql.Error as exc:
            error = translate(exc, where)
            level = logging.INFO if isinstance(error, ShardMovedError) else (
                logging.WARNING if error.retriable else logging.ERROR)
            logger.log(level, "%s on %s failed: %s", what, where, error)
            raise error from exc
        except UnicodeError:
            # pymysql encodes host names (IDNA) and passwords (latin-1) itself.
            raise ConfigurationError(f"storage node {where}: host name or credentials cannot be encoded") from None

    def _read_shard(self, shard: int, sql: str, args: Sequence[Any]) -> tuple[tuple[Any, ...], ...]:
        def run(cur: pymysql.cursors.Cursor) -> tuple[tuple[Any, ...], ...]:
            try:
                cur.execute(sql.format(t=table(shard)), args)
            except pymysql.err.ProgrammingError as exc:
                if code(exc) == NO_TABLE:  # nobody wrote to this shard yet
                    return ()
                raise
            return tuple(cur.fetchall())
        return self._call("read", run, read=True)

    # -- metadata -------------------------------------------------------------------
    def read_meta(self) -> NodeMeta | None:
        def run(cur: pymysql.cursors.Cursor) -> dict[str, str] | None:
            try:
                cur.execute("SELECT name, value FROM cellstream_meta")
            except pymysql.err.ProgrammingError as exc:
                if code(exc) == NO_TABLE:
                    return None
                raise
            return dict(cur.fetchall())
        rows = self._call("read metadata", run, read=True)
        if not rows:
            return None
        if int(rows.get("format_version", 0)) != FORMAT_VERSION:
            raise ConfigurationError(f"storage node {self.name} has unknown format {rows.get('format_version')}")
        return NodeMeta(int(rows["shard_count"]), int(rows["first"]), int(rows["last"]))

    def defer_initialize(self, meta: NodeMeta) -> None:
        """The primary did not answer at open: it is initialized (and its metadata checked) before the first
        statement that reaches it. Reads from replicas do not wait for that."""
        self._deferred = meta

    def _initialize_deferred(self) -> None:
        if self._initializing == threading.get_ident():
            return  # a statement of that initialization itself
        with self._deferred_lock:  # other threads wait: no write before the shard rows exist
            meta = self._deferred
            if meta is None:
                return
            self._initializing = threading.get_ident()
            try:
                self.initialize(meta)  # raises StorageUnavailableError while the primary is still down
            finally:
                self._initializing = None
            self._deferred = None
            logger.info("storage node %s answers again: initialized", self.name)

    def initialize(self, meta: NodeMeta) -> None:
        def run(cur: pymysql.cursors.Cursor) -> None:
            for statement in (*_SCHEMA, mysql_pending.SCHEMA):
                cur.execute(statement)
            values = [("format_version", str(FORMAT_VERSION)), ("shard_count", str(meta.shard_count)),
                      ("first", str(meta.first)), ("last", str(meta.last))]
            # INSERT IGNORE: of two processes creating the node at once, the first wins
            # and the second then checks its metadata against the winner's.
            cur.execute("START TRANSACTION")
            cur.executemany("INSERT IGNORE INTO cellstream_meta (name, value) VALUES (%s, %s)", values)
            if cur.rowcount:
                cur.executemany("INSERT IGNORE INTO cellstream_shards (shard) VALUES (%s)",
                                [(s,) for s in range(meta.first, meta.last + 1)])
                logger.info("created storage node %s with shards %d-%d", self.name, meta.first, meta.last)
            cur.execute("COMMIT")
            cur.execute("SELECT table_name FROM information_schema.tables"
                        " WHERE table_schema = DATABASE() AND table_name LIKE 'cells\\_%'")
            with self._tables_lock:
                self._tables.update(int(name.split("_")[1]) for (name,) in cur.fetchall())
        self._call("initialize", run)
        stored = self.read_meta()
        assert stored is not None
        check_meta(self.name, stored, meta)

    def _ensure_tables(self, cur: pymysql.cursors.Cursor, shards: Sequence[int]) -> None:
        with self._tables_lock:
            missing = [s for s in shards if s not in self._tables]
        if missing:
            run_script(cur, [(_SHARD_TABLE.format(t=table(s)), ()) for s in missing])
            with self._tables_lock:
                self._tables.update(missing)

    # -- writes ---------------------------------------------------------------------
    def _insert_statements(self, by_shard: dict[int, list[PendingCell]]) -> list[Tagged]:
        """Lock-and-count every shard (ascending), take the timestamp, then the chunked INSERTs.

        Each INSERT is tagged with its shard and row count. Its OK packet carries the
        first id; under the shard lock nobody else inserts into that table and the
        session pins ``auto_increment_increment = 1``, so the chunk's ids are consecutive.
        The timestamp is taken once all locks are held, so created_at never decreases
        along a shard's added_ids.
        """
        out: list[Tagged] = [
            (("UPDATE cellstream_shards SET cells = cells + %s WHERE shard = %s", (len(by_shard[s]), s)), None)
            for s in sorted(by_shard)
        ]
        out.append(((_TIMESTAMP, ()), None))
        budget = self._options.max_statement_bytes // 2
        for shard in sorted(by_shard):
            cells = by_shard[shard]
            start = 0
            while start < len(cells):
                size, end = 0, start
                while end < len(cells) and (end == start or size + _row_size(cells[end]) < budget):
                    size += _row_size(cells[end])
                    end += 1
                values = ", ".join([_VALUES_ROW] * (end - start))
                args = [a for c in cells[start:end] for a in _row_args(c)]
                out.append(((f"INSERT INTO {table(shard)} (row_key, column_name, ref_key, body, created_at)"
                             f" VALUES {values}", args), (shard, end - start)))
                start = end
        return out

    def _packets(
        self, statements: list[Tagged]
    ) -> Iterator[list[Tagged]]:
        packet: list[Tagged] = []
        size = 0
        for item in statements:
            (sql, args), _ = item
            weight = len(sql) + sum(_escaped_size(a) for a in args)
            if packet and size + weight > self._options.max_statement_bytes:
                yield packet
                packet, size = [], 0
            packet.append(item)
            size += weight
        if packet:
            yield packet

    def _write_all(self, cur: pymysql.cursors.Cursor, fresh: list[PendingCell],
                   stored: dict[Coordinates, Cell], prefix: list[Statement]) -> None:
        """Run ``prefix`` + the inserts of ``fresh`` + COMMIT; fill ``stored`` with the new cells."""
        by_shard: dict[int, list[PendingCell]] = {}
        for cell in fresh:
            by_shard.setdefault(cell.shard, []).append(cell)
        statements: list[Tagged] = [(s, None) for s in prefix]
        if by_shard:
            statements += self._insert_statements(by_shard)
        hook = self.before_commit
        if hook is None:
            statements.append((("COMMIT", ()), None))
        cursors = {shard: iter(cells) for shard, cells in by_shard.items()}
        created: dt.datetime | None = None
        for packet in self._packets(statements):
            results = run_script(cur, [s for s, _ in packet])
            for ((sql, _), tag), result in zip(packet, results, strict=True):
                if sql == _TIMESTAMP and result.rows:
                    created = result.rows[0][0]
                if tag is None:
                    continue
                assert created is not None
                shard, count = tag
                for added_id in range(result.insert_id, result.insert_id + count):
                    cell = next(cursors[shard])
                    stored[cell.coordinates] = Cell(cell.row_key, cell.column, cell.ref_key, cell.body,
                                                    added_id, shard, created)
        if hook is not None:
            hook(sorted(by_shard))
            cur.execute("COMMIT")

    def _select_existing(self, cells: Sequence[PendingCell]) -> list[Tagged]:
        """SELECTs of the stored cells at these coordinates, at most 500 a statement, tagged by shard."""
        by_shard: dict[int, list[PendingCell]] = {}
        for cell in cells:
            by_shard.setdefault(cell.shard, []).append(cell)
        out: list[Tagged] = []
        for shard in sorted(by_shard):
            group = by_shard[shard]
            for start in range(0, len(group), 500):
                chunk = group[start:start + 500]
                where = " OR ".join(["(row_key = %s AND column_name = %s AND ref_key = %s)"] * len(chunk))
                out.append(((f"SELECT {_COLS} FROM {table(shard)} WHERE {where}",
                             [a for c in chunk for a in c.coordinates]), (shard, len(chunk))))
        return out

    def insert(self, cells: Sequence[PendingCell], retry: RetryPolicy | None = None) -> list[Cell]:
        shards = sorted({c.shard for c in cells})

        def run(cur: pymysql.cursors.Cursor) -> list[Cell]:
            self._ensure_tables(cur, shards)
            stored: dict[Coordinates, Cell] = {}
            try:
                try:
                    self._write_all(cur, list(cells), stored, [("START TRANSACTION", ())])
                    return ordered_result(cells, stored)
                except pymysql.err.IntegrityError as exc:
                    if code(exc) != DUPLICATE:
                        raise
                    cur.execute("ROLLBACK")
                # Some cells exist already: lock the shards, compare, insert only the rest.
                stored.clear()
                marks = ", ".join(["%s"] * len(shards))
                run_script(cur, [("START TRANSACTION", ()),
                                 (f"SELECT shard FROM cellstream_shards WHERE shard IN ({marks})"
                                  " ORDER BY shard FOR UPDATE", shards)])
                existing: dict[Coordinates, Cell] = {}
                for packet in self._packets(self._select_existing(cells)):
                    for (_, tag), result in zip(packet, run_script(cur, [s for s, _ in packet]), strict=True):
                        assert tag is not None
                        for row in result.rows or ():
                            cell = _row_to_cell(tag[0], row)
                            existing[(cell.row_key.bytes, cell.column, cell.ref_key)] = cell
                fresh = split_existing(cells, existing)
                stored.update(existing)
                self._write_all(cur, fresh, stored, [])
                return ordered_result(cells, stored)
            except BaseException:
                # Never leave a transaction open: it would hold shard locks (the pool also
                # refuses to reuse a connection that is still inside one).
                with suppress(pymysql.Error, OSError):
                    cur.execute("ROLLBACK")
                raise

        return self._call("write", run, policy=retry)

    # -- reads ----------------------------------------------------------------------
    def get_cell(self, shard: int, row_key: uuid.UUID, column: str, ref_key: int) -> Cell | None:
        rows = self._read_shard(
            shard, f"SELECT {_COLS} FROM {{t}} WHERE row_key = %s AND column_name = %s AND ref_key = %s",
            (row_key.bytes, column, ref_key))
        return _row_to_cell(shard, rows[0]) if rows else None

    def get_latest(self, shard: int, row_key: uuid.UUID, column: str) -> Cell | None:
        rows = self._read_shard(
            shard, f"SELECT {_COLS} FROM {{t}} WHERE row_key = %s AND column_name = %s"
            " ORDER BY ref_key DESC LIMIT 1", (row_key.bytes, column))
        return _row_to_cell(shard, rows[0]) if rows else None

    def get_row(self, shard: int, row_key: uuid.UUID) -> list[Cell]:
        rows = self._read_shard(
            shard, f"SELECT {_COLS} FROM {{t}} c WHERE row_key = %s AND ref_key = ("
            " SELECT MAX(ref_key) FROM {t} m WHERE m.row_key = c.row_key AND m.column_name = c.column_name)"
            " ORDER BY column_name", (row_key.bytes,))
        return [_row_to_cell(shard, r) for r in rows]

    def get_log(self, shard: int, location: int, limit: int, columns: Sequence[str] | None) -> list[Cell]:
        where, extra = _after(columns)
        rows = self._read_shard(shard, f"SELECT {_COLS} FROM {{t}} WHERE {where} ORDER BY added_id LIMIT %s",
                                [location, *extra, limit])
        return decode_log(rows, lambda row: _row_to_cell(shard, row))

    def get_logs(
        self, locations: Sequence[tuple[int, int]], limit: int, columns: Sequence[str] | None
    ) -> dict[int, list[Cell] | CorruptCellError]:
        if len(locations) < 2:
            return super().get_logs(locations, limit, columns)
        where, extra = _after(columns)
        parts, args = [], []
        for shard, location in locations:
            parts.append(f"(SELECT {shard}, {_COLS} FROM {table(shard)} WHERE {where} ORDER BY added_id LIMIT %s)")
            args.extend([location, *extra, limit])

        def run(cur: pymysql.cursors.Cursor) -> tuple[tuple[Any, ...], ...] | None:
            try:
                cur.execute(" UNION ALL ".join(parts), args)
            except pymysql.err.ProgrammingError as exc:
                if code(exc) == NO_TABLE:  # a shard nobody wrote to yet: read them one by one
                    return None
                raise
            return tuple(cur.fetchall())
        rows = self._call("read", run, read=True)
        if rows is None:
            return super().get_logs(locations, limit, columns)
        by_shard: dict[int, list[tuple[Any, ...]]] = {shard: [] for shard, _ in locations}
        for row in rows:
            by_shard[row[0]].append(row[1:])
        out: dict[int, list[Cell] | CorruptCellError] = {}
        for shard, page in by_shard.items():
            page.sort(key=itemgetter(0))  # UNION ALL keeps each part's order in practice, not by contract
            try:
                out[shard] = decode_log(page, partial(_row_to_cell, shard))
            except CorruptCellError as exc:
                out[shard] = exc
        return out

    def count_after(self, shard: int, location: int, columns: Sequence[str] | None = None) -> int:
        where, extra = _after(columns)
        rows = self._read_shard(shard, f"SELECT COUNT(*) FROM {{t}} WHERE {where}", [location, *extra])
        return int(rows[0][0]) if rows else 0

    def first_at(self, shard: int, when: dt.datetime) -> int | None:
        rows = self._read_shard(shard, "SELECT MIN(added_id) FROM {t} WHERE created_at >= %s",
                                (when.astimezone(dt.UTC).replace(tzinfo=None),))
        return int(rows[0][0]) if rows and rows[0][0] is not None else None

    def head(self, shard: int) -> int:
        rows = self._read_shard(shard, "SELECT MAX(added_id) FROM {t}", ())
        return int(rows[0][0] or 0) if rows else 0

    def shard_counts(self) -> dict[int, int]:
        def run(cur: pymysql.cursors.Cursor) -> dict[int, int]:
            cur.execute("SELECT shard, cells FROM cellstream_shards")
            return {int(s): int(n) for s, n in cur.fetchall()}
        return self._call("read", run, read=True)

    # -- consumer offsets -----------------------------------------------------------
    def claim_offsets(self, consumer: str, owner: str, shards: Sequence[int]) -> list[OffsetRecord]:
        wanted = set(shards)

        def run(cur: pymysql.cursors.Cursor) -> list[OffsetRecord]:
            cur.executemany(_CLAIM, [(consumer, shard, owner) for shard in shards])
            cur.execute(_OFFSETS, (consumer,))
            return [offset_record(*row) for row in cur.fetchall() if row[0] in wanted]
        return self._call("claim offsets", run)

    def commit_offsets(self, consumer: str, owner: str, offsets: dict[int, tuple[int, str]]) -> set[int]:
        def run(cur: pymysql.cursors.Cursor) -> set[int]:
            fenced = set()
            cur.execute("START TRANSACTION")
            for shard, (location, doc) in offsets.items():
                if cur.execute(_COMMIT, (location, doc, consumer, shard, owner)) != 1:
                    fenced.add(shard)
            cur.execute("COMMIT")
            return fenced
        return self._call("commit offsets", run)

    def read_offsets(self, consumer: str) -> list[OffsetRecord]:
        def run(cur: pymysql.cursors.Cursor) -> list[OffsetRecord]:
            cur.execute(_OFFSETS, (consumer,))
            return [offset_record(*row) for row in cur.fetchall()]
        return self._call("read offsets", run, read=True)

    def run(self, what: str, fn: Callable[[pymysql.cursors.Cursor], T]) -> T:
        """``fn`` on a connection to the primary, driver errors translated and retried (logstore.moves)."""
        return self._call(what, fn)

    supports_moves = True

    def moves(self) -> dict[int, str]:
        def run(cur: pymysql.cursors.Cursor) -> dict[int, str]:
            try:
                cur.execute("SELECT shard, moved_to FROM cellstream_moves")
            except pymysql.err.ProgrammingError as exc:
                if code(exc) == NO_TABLE:  # a replica that has not caught up with the node's creation
                    return {}
                raise
            return {int(shard): str(node) for shard, node in cur.fetchall()}
        # Read every map_refresh seconds: a node that does not answer at once keeps its last known moves.
        return self._call("read moves", run, read=True, policy=self._quick_retry)

    # -- buffered writes (logstore.mysql_pending) -------------------------------------
    supports_pending = True

    def _quick(self, what: str, fn: Callable[[pymysql.cursors.Cursor], T]) -> T:
        """Buffering is for when another node is down: this one answers at once or is skipped."""
        return self._call(what, fn, policy=self._quick_retry)

    def buffer(self, node: str, cells: Sequence[PendingCell]) -> None:
        mysql_pending.buffer(self._quick, node, cells)

    def pending(self, limit: int) -> list[PendingRecord]:
        return mysql_pending.pending(self._quick, limit)

    def drop_pending(self, ids: Sequence[int]) -> None:
        mysql_pending.drop(self._quick, ids)

    def fail_pending(self, pid: int, reason: str) -> None:
        mysql_pending.fail(self._quick, pid, reason)

    def pending_counts(self) -> dict[str, tuple[int, int]]:
        return mysql_pending.counts(self._quick)

    def close(self) -> None:
        self._pool.close()
        for pool in self._replicas:
            pool.close()
