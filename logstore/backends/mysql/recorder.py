"""The MySQL/MariaDB recorder: one database per storage node, one ``cells`` table for all its shards
(layout 2, clustered by ``(shard, added_id)``).

A write locks its shards' rows in ``cellstream_shards`` (ascending, so writers never deadlock) and allocates
ids from their ``last_id``, so a shard's ids commit in order and are dense: a reader paging ``added_id >
location`` never misses a cell, and a page after ``location`` is the id range ``(location, location +
limit]``. The row also carries the shard-move fence (:mod:`logstore.backends.mysql.moves`). Design notes:
docs/logstore.md, "The log never skips a committed cell" and "MySQL/MariaDB".
"""

from __future__ import annotations

import datetime as dt
import logging
import operator
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from decimal import Decimal
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import pymysql
from pymysql.constants import CLIENT, FIELD_TYPE
from pymysql.converters import conversions

from logstore.backends.mysql import durable as mysql_durable
from logstore.backends.mysql import pending as mysql_pending
from logstore.backends.mysql import shard_map as mysql_map
from logstore.backends.mysql.errors import (
    BAD_FIELD,
    DUPLICATE,
    DUPLICATE_COLUMN,
    NO_TABLE,
    NULL_COLUMN,
    SSL_REQUIRED_UNSUPPORTED,
    UNKNOWN_DATABASE,
    code,
    retry_here,
    translate,
)
from logstore.backends.mysql.index_tables import MySQLIndexRecorder, add_locator_shard_keys
from logstore.backends.mysql.pool import Connection, Pool, ReadFallback, Statement, run_script
from logstore.backends.mysql.target import MySQLTarget
from logstore.cell import AnyCell, Cell, PackedCell, check_column
from logstore.config import StoreOptions
from logstore.errors import (
    ConfigurationError,
    CorruptCellError,
    InvalidArgumentError,
    ShardMovedError,
    StorageError,
    StoreNotFoundError,
)
from logstore.log_blocks import BlockCell, LogBlock
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
    PendingRecord,
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
    split_existing,
)
from logstore.retry import RetryPolicy, retry_call

if TYPE_CHECKING:
    from logstore.backends.mysql.heartbeat import MySQLHeartbeat

logger = logging.getLogger(__name__)
T = TypeVar("T")
C = TypeVar("C", bound=AnyCell)
Rows = tuple[tuple[Any, ...], ...]
Weighed = tuple[Statement, int]  # a statement and its size on the wire, known beforehand

LAYOUT = 2  # the version of the table layout above; layout 1 had a table per shard
# When each shard's row last changed (by the server's clock, whatever writes it), indexed with the counter: a
# reader's count poll at 4096 shards reads the rows changed lately instead of every row (``changed_counts``).
# Added to layout 2 in place: a node created before it gets the column at its next open.
_TOUCHED_COLUMN = "touched TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6) ON UPDATE CURRENT_TIMESTAMP(6)"
_TOUCHED_KEY = "KEY shards_touched (touched, last_id)"
# The ids below it are burnt (a promotion: the lost primary may have shown them to consumers, see
# logstore.backends.mysql.promotion): a shard's next id is above both it and last_id. Added in place.
_FLOOR_COLUMN = "id_floor BIGINT NOT NULL DEFAULT 0"
# Each held shard's next ids skip the given count (its floor raised above its head; a no-op when it is).
BURN_IDS = ("UPDATE cellstream_shards SET id_floor = GREATEST(id_floor, last_id + %s)"
            " WHERE fence IS NULL AND id_floor < last_id + %s")
# A row's ``touched`` is its writing statement's start; the transaction commits later. A count poll reads the
# rows touched since the previous poll's start less this margin, so a counter committed up to this long
# after it was moved is still seen; one committed later is left to the reader's next complete count. The
# rows read grow with the margin and the write rate, and so does the poll's cost.
TOUCH_MARGIN = 0.2
_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS cellstream_meta ("
    " name VARCHAR(64) CHARACTER SET ascii NOT NULL PRIMARY KEY,"
    " value VARCHAR(255) NOT NULL) ENGINE=InnoDB",
    # fence: writes refused, naming the node the shard went to; moved_to: the move as the map reads it.
    "CREATE TABLE IF NOT EXISTS cellstream_shards ("
    " shard INT NOT NULL PRIMARY KEY, last_id BIGINT NOT NULL DEFAULT 0,"
    " fence VARCHAR(64) CHARACTER SET ascii NULL, moved_to VARCHAR(64) CHARACTER SET ascii NULL,"
    f" moved_at DATETIME(6) NULL, {_TOUCHED_COLUMN}, {_FLOOR_COLUMN}, {_TOUCHED_KEY}) ENGINE=InnoDB",
    "CREATE TABLE IF NOT EXISTS cells ("
    " shard INT NOT NULL,"
    " added_id BIGINT NOT NULL,"
    " row_key BINARY(16) NOT NULL,"
    " column_name VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,"
    " ref_key BIGINT NOT NULL,"
    " body LONGBLOB NOT NULL,"
    " created_at DATETIME(6) NOT NULL,"
    " PRIMARY KEY (shard, added_id),"
    " UNIQUE KEY cell (row_key, column_name, ref_key),"
    " KEY created (shard, created_at)"
    ") ENGINE=InnoDB",
    # A consumer's offsets of the node's shards as one value (logstore.offsets).
    "CREATE TABLE IF NOT EXISTS cellstream_consumers ("
    " consumer VARCHAR(200) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL PRIMARY KEY,"
    " offsets LONGBLOB NOT NULL) ENGINE=InnoDB",
)
# The row is created apart, in a statement of its own: two claims creating it at once inside their
# transactions would each take a shared lock on it and then wait for the other's to write it.
_NEW_CONSUMER = "INSERT IGNORE INTO cellstream_consumers (consumer, offsets) VALUES (%s, '')"
_OFFSETS = "SELECT offsets FROM cellstream_consumers WHERE consumer = %s"
_SAVE_OFFSETS = "UPDATE cellstream_consumers SET offsets = X'{}' WHERE consumer = %s"
# The node's fenced shards, with the node each fence names (a scan of the shard rows: at most thousands).
_FENCES = "SELECT GROUP_CONCAT(CONCAT(shard, ' ', fence)) FROM cellstream_shards WHERE fence IS NOT NULL"
# The table of a row per shard, before logstore.offsets: moved over when a node opens.
_OLD_OFFSETS = "SELECT consumer, shard, location, owner, doc FROM cellstream_offsets ORDER BY consumer, shard"
CELL_COLUMNS = "shard, added_id, row_key, column_name, ref_key, body, created_at"
_QUALIFIED_CELL_COLUMNS = ", ".join(f"c.{name}" for name in CELL_COLUMNS.split(", "))
_LATEST_BATCH = 500  # coordinates a statement of read_cells
# A log row as three fields: pymysql spends more on each field of a row than on its bytes, so a page of
# cells comes back with the key, time, ref_key, column and body packed in one (see _log_row_to_cell).
LOG_COLUMNS = "shard, added_id, CONCAT(row_key, CAST(created_at AS CHAR), ref_key, ' ', column_name, ' ', body)"
_INSERT = f"INSERT INTO cells ({CELL_COLUMNS}) VALUES "
# Taken once all shard locks of a write are held, so created_at never decreases along a shard's ids.
_TIMESTAMP = "CAST(@cs_t := UTC_TIMESTAMP(6) AS DATETIME(6))"
_SAME_CELL = "(row_key = %s AND column_name = %s AND ref_key = %s)"
_HEADS_PAST = ("SELECT COUNT(*), GROUP_CONCAT(shard), GROUP_CONCAT(last_id) FROM cellstream_shards"
               " WHERE last_id > %s")
# A read of up to so many shards names them (a lookup each); of more, it takes the shard rows between its least
# and greatest shard, where a list of thousands would cost MariaDB a join (its IN lists of 1,000 values or more
# become tables).
_HEADS_NAMED = 512


def _escaped_size(value: object) -> int:
    """An upper bound of the value's size once escaped into SQL text."""
    if isinstance(value, bytes | str):
        return 2 * len(value.encode() if isinstance(value, str) else value) + 16
    return 24


def _after(columns: Sequence[str] | None, reserved: bool = True) -> tuple[str, list[str]]:
    """The condition on a shard's cells after a location (shard and location are its first two
    arguments), of ``columns`` if given, and without cellstream's own (``_``...) unless ``reserved``."""
    return ("shard = %s AND added_id > %s" + (f" AND column_name IN ({', '.join(['%s'] * len(columns))})"
                                              if columns else "")
            + ("" if reserved else " AND LEFT(column_name, 1) <> '_'"), list(columns or ()))


def _dense_pages(locations: Sequence[tuple[int, int]], limit: int,
                 columns: Sequence[str] | None = None) -> tuple[str, list[Any]]:
    """One query of the pages of many shards, relying on dense ids: a shard's page after location L is the
    id range (L, L + limit]. Shards at the same location share one index range (``shard IN (...) AND
    added_id BETWEEN ...``), so a scan from one location is a single range, and every range is exact: no
    row outside a page is sent (a shared range over nearby locations re-sent rows already read, which the
    driver parsed at great cost), and the query never evaluates a long OR for each row (which cost MariaDB
    quadratic time).

    With ``columns`` a range holds that many ids of any column: its cells of the columns are the whole page
    only where they are ``limit`` or the shard's head is within the range (see ``read_logs``)."""
    groups: dict[int, list[int]] = {}
    for shard, location in locations:
        groups.setdefault(location, []).append(shard)
    named = f" AND column_name IN ({', '.join(['%s'] * len(columns))})" if columns else ""
    parts, args = [], []
    for location, shards in groups.items():
        parts.append(f"(SELECT {LOG_COLUMNS} FROM cells WHERE shard IN ({', '.join(['%s'] * len(shards))})"
                     f" AND added_id BETWEEN %s AND %s{named})")
        args += [*shards, location + 1, location + limit, *(columns or ())]
    return " UNION ALL ".join(parts), args


def _limited_pages(locations: Sequence[tuple[int, int]], limit: int,
                   columns: Sequence[str] | None) -> tuple[str, list[Any]]:
    """One query of the pages of many shards, a ``LIMIT``ed part each: exact whatever the ids' holes, and a
    part to plan and run for every shard."""
    where, extra = _after(columns)
    sql = " UNION ALL ".join([f"(SELECT {LOG_COLUMNS} FROM cells WHERE {where} ORDER BY added_id LIMIT %s)"]
                             * len(locations))
    return sql, [a for shard, location in locations for a in (shard, location, *extra, limit)]


# A cell of a log block (logstore.log_blocks): its ASCII head, row key and stored body.
_BLOCK_CELL = ("CONCAT(CONCAT_WS(',', c.added_id, c.created_at, c.ref_key, c.column_name, LENGTH(c.body), ''),"
               " c.row_key, c.body)")
_BLOCK_RANGES = 256  # ranges a block query joins
_BLOCK_POINTS = 64  # a range of at most so many ids is read as its ids
_BLOCK_POINTS_A_QUERY = 20_000
_BLOCK_ROOM = 1 << 26  # the longest block a server builds (its max_allowed_packet if smaller)


def _block_rows(shard: int, after: int, up_to: int, cur: pymysql.cursors.Cursor) -> Rows:
    cur.execute("SELECT added_id, CAST(created_at AS CHAR), ref_key, column_name, row_key, body FROM cells"
                " WHERE shard = %s AND added_id > %s AND added_id <= %s ORDER BY added_id", (shard, after, up_to))
    return tuple(cur.fetchall())


def _utc_datetime(value: str | bytes) -> dt.datetime:
    # Every DATETIME column of ours holds UTC: build aware datetimes in one C call.
    text = value.decode("ascii") if isinstance(value, bytes | bytearray) else value
    return dt.datetime.fromisoformat(text + "+00:00")


_CONVERSIONS: dict[Any, Any] = {**conversions, FIELD_TYPE.DATETIME: _utc_datetime}


def _values(shard: int, added_id: str, cell: PendingCell) -> str:
    """A cell's VALUES tuple as SQL text. Its parts need no escaping: numbers, hex literals, and a column
    name that validation held to [A-Za-z0-9_]. Writing them so costs a fraction of the driver's escaping,
    which was the largest client cost of a batch."""
    return (f"({shard}, {added_id}, X'{cell.row_key.bytes.hex()}', '{cell.column}', {cell.ref_key},"
            f" X'{cell.blob.hex()}', @cs_t)")


def _shard_of_cell(cell: PendingCell) -> int:
    return cell.shard


def _increments(counts: Mapping[int, int]) -> str:
    """The counter increment of each row of an UPDATE over the shards of ``counts`` (shard -> cells), as SQL:
    the commonest count by default, the others by constant ``shard IN`` lists, which MySQL searches, not scans.
    One statement with no arguments: the counters moved by an ``ON DUPLICATE KEY UPDATE`` of (shard, last_id)
    pairs cost more on the server, and their escaping in pymysql more than the rest of a batch's SQL."""
    by_count: dict[int, list[int]] = {}
    for shard, n in counts.items():
        by_count.setdefault(n, []).append(shard)
    default = max(by_count, key=lambda n: len(by_count[n]))
    cases = " ".join(f"WHEN shard IN ({', '.join(map(str, sorted(shards)))}) THEN {n}"
                     for n, shards in sorted(by_count.items()) if n != default)
    return f"CASE {cases} ELSE {default} END" if cases else str(default)


def _row_to_cell(row: tuple[Any, ...], max_bytes: int) -> Cell:
    shard, added_id, row_key, column, ref_key, blob, created = row
    return make_cell(shard, added_id, row_key, column, ref_key, blob, created, max_bytes)


def _row_to_sized_cell(row: tuple[Any, ...], max_bytes: int) -> tuple[Cell, int]:
    shard, added_id, row_key, column, ref_key, blob, created = row
    return make_sized_cell(shard, added_id, row_key, column, ref_key, blob, created, max_bytes)


def _datetime_text(when: dt.datetime) -> str:
    """A UTC time as a DATETIME(6) literal (``created_at`` holds UTC)."""
    return when.astimezone(dt.UTC).replace(tzinfo=None).isoformat(" ", "microseconds")


# Time texts parsed by _log_row, and their datetimes. A transaction's cells share their time, and a page of a
# backlog holds, for each shard, cells of many writers' batches: pages of thousands of shards need the times of
# a few batches, each many times, which a memo of the last time alone misses. Cleared when full; other threads
# share it, and a dict's get, set and clear are each atomic under the GIL.
_times: dict[bytes, dt.datetime] = {}
_TIMES_KEPT = 4096

_ADDED_ID = operator.itemgetter(1)  # of a log row: its sort key within a shard's page (C, not a call of Python per row)


def _log_row(row: tuple[int, int, bytes], max_bytes: int,
             make: Callable[[int, int, bytes, str, int, bytes, dt.datetime, int], tuple[C, int]]) -> tuple[C, int]:
    """A row of LOG_COLUMNS: the 16-byte key, the 26-character time, then "ref_key column body"
    (neither a number nor a column name holds a space)."""
    shard, added_id, packed = row
    ref_end = packed.index(32, 42)
    column_end = packed.index(32, ref_end + 1)
    text = packed[16:42]
    created = _times.get(text)
    if created is None:
        if len(_times) >= _TIMES_KEPT:
            _times.clear()
        created = _times[text] = _utc_datetime(text)
    return make(shard, added_id, packed[:16], packed[ref_end + 1:column_end].decode(), int(packed[42:ref_end]),
                packed[column_end + 1:], created, max_bytes)


def _log_row_to_cell(row: tuple[int, int, bytes], max_bytes: int) -> tuple[Cell, int]:
    return _log_row(row, max_bytes, make_sized_cell)


def _log_row_to_packed_cell(row: tuple[int, int, bytes], max_bytes: int) -> tuple[PackedCell, int]:
    return _log_row(row, max_bytes, make_sized_packed_cell)


_MARGIN = Decimal(str(TOUCH_MARGIN))


def _counts_of(row: tuple[Any, ...], complete: bool) -> ChangedCounts:
    shards, last, now, server = row
    # The time as text, exact and JSON's: a worker node hands the mark to its clients and takes it back.
    return ChangedCounts(concat_counts(shards, last), (int(server), str(now)), complete)


def _mark_of(since: object) -> tuple[int, Decimal] | None:
    """(server id, UNIX time) of a mark this backend gave, or None for anything else."""
    if not (isinstance(since, tuple) and len(since) == 2 and type(since[0]) is int and isinstance(since[1], str)):
        return None
    try:
        at = Decimal(since[1])
    except ArithmeticError:
        return None
    return (since[0], at) if at.is_finite() and 0 <= at < 1 << 40 else None


def _add_touched(cur: pymysql.cursors.Cursor) -> None:
    """Give a node created before ``touched`` or ``id_floor`` the column (MySQL has no ADD COLUMN IF NOT
    EXISTS). Of two processes opening the node at once, the second is told the column exists."""
    for column, alter in (("touched", f"ADD COLUMN {_TOUCHED_COLUMN}, ADD {_TOUCHED_KEY}"),
                          ("id_floor", f"ADD COLUMN {_FLOOR_COLUMN}")):
        cur.execute("SELECT COUNT(*) FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = DATABASE()"
                    " AND TABLE_NAME = 'cellstream_shards' AND COLUMN_NAME = %s", (column,))
        [[present]] = cur.fetchall()
        if present:
            continue
        try:
            cur.execute(f"ALTER TABLE cellstream_shards {alter}")
        except pymysql.err.OperationalError as exc:
            if code(exc) != DUPLICATE_COLUMN:
                raise
        logger.info("added the %s column to cellstream_shards", column)


def _check_layout(node: str, meta: dict[str, str]) -> None:
    if meta and meta.get("layout", "1") != str(LAYOUT):
        raise ConfigurationError(
            f"storage node {node} was written with storage layout {meta.get('layout', '1')}"
            f"{' (a table per shard)' if meta.get('layout', '1') == '1' else ''}; this cellstream reads layout "
            f"{LAYOUT} (one cells table per node) and does not convert: write the cells into a new database")
    if meta and int(meta.get("format_version", 0)) != FORMAT_VERSION:
        raise ConfigurationError(f"storage node {node} has unknown format {meta.get('format_version')}")


def _read_meta(cur: pymysql.cursors.Cursor) -> dict[str, str] | None:
    try:
        cur.execute("SELECT name, value FROM cellstream_meta")
    except pymysql.err.ProgrammingError as exc:
        if code(exc) == NO_TABLE:
            return None
        raise
    return dict(cur.fetchall())


class MySQLRecorder(NodeRecorder):
    def __init__(self, name: str, target: MySQLTarget, options: StoreOptions,
                 replicas: Sequence[MySQLTarget] = ()) -> None:
        self.name = name
        self._target = target
        self._options = options
        self._without_tls: set[MySQLTarget] = set()  # PREFERRED nodes found to offer no TLS
        wait = options.connect_timeout + options.read_timeout
        self._pool = Pool(self._connect, options.pool_size, wait)
        # An apply holds its node's connection while it writes another node's entries on one of that node's.
        self.parallel_writes = min(self.parallel_writes, options.pool_size)
        self._replicas = [Pool(partial(self._replica_connect, r), options.pool_size, wait) for r in replicas]
        self._replica_targets = list(replicas)
        self.fallback = ReadFallback(name)
        # Calls made because some node is down (buffering, the map's refresh) give up on this one quickly.
        self._quick_retry = options.retry.model_copy(update={"deadline": options.buffer_after or 2.0})
        # The shard map's reads, every map_refresh seconds: one attempt, as a node that does not answer keeps its
        # last known map and moves, and the reader (maybe a write that found the map due) should not wait.
        self._glance = options.retry.model_copy(update={"deadline": 0.01})
        # The count of buffered cells: `cellstream pending`, and the probe of a node known down. A few tries in a
        # quarter second (an idle connection the server closed meanwhile is one), never buffer_after's wait: a
        # node that refuses connections is reported unreachable at once.
        self._look = options.retry.model_copy(update={"deadline": min(0.25, options.buffer_after or 2.0)})
        # The deferred initialization, inside a statement's attempt: one try, as that statement retries under
        # its own policy (a glance of the shard map stays a glance).
        self._one_try = options.retry.model_copy(update={"max_attempts": 1})
        self._deferred: NodeMeta | None = None
        self._deferred_lock = threading.Lock()
        self._creating = False  # set by initialize(): only then may a connection create the database
        self._initializing: int | None = None  # the thread running the deferred initialization
        self.indexes = MySQLIndexRecorder(name, self._call, run_script, options.max_statement_bytes)
        self._max_body = options.inflate_limit
        # Shards whose ids have holes below a floor (a promotion's burnt ids, cells restored with gaps): read
        # with a LIMIT below it, not as a dense id range. Read again every map_refresh (a move carries floors).
        self._floors: dict[int, int] = {}
        self._floors_at = float("-inf")
        self._floors_lock = threading.Lock()

    # -- connections and errors -----------------------------------------------------
    def _raw_connect(self, database: str | None, target: MySQLTarget | None = None,
                     timeout: float | None = None) -> Connection:
        t, o = target or self._target, self._options
        connect = partial(
            pymysql.connect, host=t.host, port=t.port, user=t.user, password=t.password, database=database,
            autocommit=True, client_flag=CLIENT.MULTI_STATEMENTS, charset="utf8mb4",
            binary_prefix=True, conv=_CONVERSIONS, connect_timeout=timeout or o.connect_timeout,
            read_timeout=timeout or o.read_timeout, write_timeout=timeout or o.read_timeout,
        )
        if t.ssl_mode == "PREFERRED" and t in self._without_tls:
            return connect(ssl_disabled=True)
        try:
            return connect(**t.ssl_options())
        except pymysql.err.OperationalError as exc:
            if t.ssl_mode != "PREFERRED" or code(exc) != SSL_REQUIRED_UNSUPPORTED:
                raise
        # PREFERRED and the server offers no TLS: in clear from now on (one refused attempt per store opened).
        self._without_tls.add(t)
        return connect(ssl_disabled=True)

    def _connect(self) -> Connection:
        try:
            conn = self._raw_connect(self._target.database)
        except pymysql.err.OperationalError as exc:
            if code(exc) != UNKNOWN_DATABASE or not self._creating:
                raise
            # Unknown database: initialize() creates the node, and the database with it.
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

    def load_probe(self, timeout: float) -> MySQLHeartbeat:
        """A probe of the node's write latency and its replicas' lag for a job's throttle
        (:mod:`logstore.backends.mysql.heartbeat`), on connections of its own whose waits ``timeout`` bounds."""
        from logstore.backends.mysql.heartbeat import MySQLHeartbeat  # only jobs need it (and logstore.jobs)

        return MySQLHeartbeat(self.name, self._target, self._replica_targets,
                              lambda target: self._raw_connect(target.database, target, timeout), timeout=timeout)

    def _session(self, conn: Connection) -> Connection:
        try:
            with conn.cursor() as cur:
                # READ COMMITTED: every statement sees the latest commits (and takes no gap locks).
                cur.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
                # A write's counters come back as one GROUP_CONCAT: room for every shard of a node.
                cur.execute("SET SESSION group_concat_max_len = 4194304")
                # Strict for every table and statement: a write to a fenced shard finds no counter, and its
                # NULL ids must fail the INSERT, never be stored as 0 with a warning.
                cur.execute("SET SESSION sql_mode = IF(@@sql_mode = '', 'STRICT_ALL_TABLES',"
                            " CONCAT(@@sql_mode, ',STRICT_ALL_TABLES'))")
        except BaseException:
            Pool.discard(conn)
            raise
        return conn

    def _call(self, what: str, fn: Callable[[pymysql.cursors.Cursor], T], *, read: bool = False,
              policy: RetryPolicy | None = None, on_replica: Callable[[pymysql.cursors.Cursor], T] | None = None) -> T:
        """Run ``fn`` on a pooled connection; translate driver errors; retry retriable ones. A ``read`` falls
        back to the node's replicas while its primary is unavailable (:class:`ReadFallback`), running
        ``on_replica`` there if given."""
        def attempt() -> T:
            if not read or not self._replicas:
                return self._on(self._pool, self.name, what, fn)
            there = on_replica or fn
            return self.fallback.read(partial(self._on, self._pool, self.name, what, fn), [
                partial(self._on, pool, f"{self.name} replica {i}", what, there)
                for i, pool in enumerate(self._replicas)])
        return retry_call(attempt, policy or self._options.retry, retriable=retry_here)

    def _on(self, pool: Pool, where: str, what: str, fn: Callable[[pymysql.cursors.Cursor], T]) -> T:
        if pool is self._pool and self._deferred is not None and what != "initialize":
            self._initialize_deferred()
        try:
            with pool.connection() as conn, conn.cursor() as cur:
                return fn(cur)
        except pymysql.Error as exc:
            error = translate(exc, where)
            # Raised to the caller, who reports what finally failed: a retried attempt is said at INFO (at
            # WARNING, a command waiting on a down node printed it once per attempt), any other at DEBUG.
            logger.log(logging.INFO if error.retriable else logging.DEBUG, "%s on %s failed: %s", what, where,
                       error)
            raise error from exc
        except UnicodeError:
            # pymysql encodes host names (IDNA) and passwords (latin-1) itself.
            raise ConfigurationError(f"storage node {where}: host name or credentials cannot be encoded") from None

    def _read(self, sql: str, args: Sequence[Any]) -> Rows:
        def run(cur: pymysql.cursors.Cursor) -> Rows:
            cur.execute(sql, args)
            return tuple(cur.fetchall())
        return self._call("read", run, read=True)

    def _ranges_and_heads(self, locations: Sequence[tuple[int, int]], limit: int,
                          columns: Sequence[str]) -> tuple[Rows, dict[int, int] | None]:
        """The columns' cells of each shard's range of ``limit`` ids (:func:`_dense_pages`), then, in the same
        round trip, the head of every shard that goes on past the nearest range's end (None: not known, every
        short range is read again). The heads are read after the cells: a cell the ranges did not see past a
        range's end has a head past it.

        On a replica (its primary down) the pages come whole from a ``LIMIT`` each, with no heads: a shard
        moved in shows its copied cells there before the head its switch gives it."""
        sql, args = _dense_pages(locations, limit, columns)
        end = min(location for _, location in locations) + limit
        shards = [shard for shard, _ in locations]
        past: Statement = (
            (f"{_HEADS_PAST} AND shard IN ({', '.join(['%s'] * len(shards))})", (end, *shards))
            if len(shards) <= _HEADS_NAMED else
            (f"{_HEADS_PAST} AND shard BETWEEN %s AND %s", (end, min(shards), max(shards))))

        def run(cur: pymysql.cursors.Cursor) -> tuple[Rows, dict[int, int] | None]:
            cells, heads = run_script(cur, [(sql, args), past])
            [(count, named, last)] = heads.rows or [(0, None, None)]
            try:
                found = concat_counts(named, last)
            except ValueError:  # lists cut short by group_concat_max_len
                found = {}
            return cells.rows or (), found if len(found) == count else None

        def on_replica(cur: pymysql.cursors.Cursor) -> tuple[Rows, dict[int, int] | None]:
            cur.execute(*_limited_pages(locations, limit, columns))
            return tuple(cur.fetchall()), {}
        return self._call("read", run, read=True, on_replica=on_replica)

    # -- metadata -------------------------------------------------------------------
    def read_meta(self, retry: RetryPolicy | None = None) -> NodeMeta | None:
        try:
            rows = self._call("read metadata", _read_meta, read=True, policy=retry)
        except StoreNotFoundError:
            return None
        if not rows:
            return None
        _check_layout(self.name, rows)
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
                # Raises StorageUnavailableError while the primary is still down: at once, as the statement
                # that brought it here retries under its own policy (a policy of its own here would make each
                # of that statement's attempts wait buffer_after).
                self.initialize(meta, self._one_try)
            finally:
                self._initializing = None
            self._deferred = None
            logger.info("storage node %s answers again: initialized", self.name)

    def initialize(self, meta: NodeMeta, retry: RetryPolicy | None = None) -> None:
        self._creating = True
        def run(cur: pymysql.cursors.Cursor) -> None:
            # A node of another layout is refused before anything is created in it.
            _check_layout(self.name, _read_meta(cur) or {})
            for statement in (*_SCHEMA, mysql_pending.SCHEMA, mysql_map.SCHEMA, mysql_durable.SCHEMA):
                cur.execute(statement)
            _add_touched(cur)
            add_locator_shard_keys(cur)
            self._move_old_offsets(cur)
            values = [("format_version", str(FORMAT_VERSION)), ("layout", str(LAYOUT)),
                      ("shard_count", str(meta.shard_count)), ("first", str(meta.first)), ("last", str(meta.last))]
            # INSERT IGNORE: of two processes creating the node at once, the first wins
            # and the second then checks its metadata against the winner's.
            cur.execute("START TRANSACTION")
            cur.executemany("INSERT IGNORE INTO cellstream_meta (name, value) VALUES (%s, %s)", values)
            if cur.rowcount:
                cur.executemany("INSERT IGNORE INTO cellstream_shards (shard) VALUES (%s)",
                                [(s,) for s in range(meta.first, meta.last + 1)])
                logger.info("created storage node %s with shards %d-%d", self.name, meta.first, meta.last)
            cur.execute("COMMIT")
        self._call("initialize", run, policy=retry)
        stored = self.read_meta(retry)
        assert stored is not None
        check_meta(self.name, stored, meta)

    def _move_old_offsets(self, cur: pymysql.cursors.Cursor) -> None:
        """The offsets of the table a row per shard moved to a row per consumer, and that table dropped: a process
        of an older version still running fails its commits. Two processes opening the node at once both copy
        the same rows (INSERT IGNORE), and the table is dropped once."""
        cur.execute("SHOW TABLES LIKE 'cellstream\\_offsets'")
        if not cur.fetchall():
            return
        cur.execute("START TRANSACTION")
        try:
            cur.execute("SELECT consumer FROM cellstream_consumers")
            kept = {str(consumer) for (consumer,) in cur.fetchall()}
            cur.execute(_OLD_OFFSETS)
            moved = move_old_offsets(cur.fetchall(), lambda consumer, value: cur.execute(
                f"INSERT IGNORE INTO cellstream_consumers (consumer, offsets) VALUES (%s, X'{value.hex()}')",
                (consumer,)), kept)
            cur.execute("COMMIT")
        except BaseException:
            with suppress(pymysql.Error, OSError):
                cur.execute("ROLLBACK")
            raise
        cur.execute("DROP TABLE IF EXISTS cellstream_offsets")
        logger.info("storage node %s: the offsets of %d consumers moved to a row each", self.name, moved)

    # -- writes ---------------------------------------------------------------------
    def _inserts(self, rows: list[str]) -> list[Weighed]:
        """Multi-row INSERTs of cell ``rows`` (each the text of its VALUES tuple), none over half a packet."""
        budget = self._options.max_statement_bytes // 2
        out: list[Weighed] = []
        start = 0
        while start < len(rows):
            size, end = 0, start
            while end < len(rows) and (end == start or size + len(rows[end]) + 2 < budget):
                size, end = size + len(rows[end]) + 2, end + 1
            out.append(((_INSERT + ", ".join(rows[start:end]), ()), size + len(_INSERT)))
            start = end
        return out

    def _packets(self, statements: Sequence[Statement | Weighed]) -> Iterator[list[Statement]]:
        """``statements`` grouped into packets within ``max_statement_bytes`` (a Weighed one brings its size)."""
        packet: list[Statement] = []
        size = 0
        for item in statements:
            if isinstance(item[1], int):
                statement, weight = item
            else:
                statement, weight = item, len(item[0]) + sum(_escaped_size(a) for a in item[1])
            if packet and size + weight > self._options.max_statement_bytes:
                yield packet
                packet, size = [], 0
            packet.append(statement)
            size += weight
        if packet:
            yield packet

    def _run_write(self, cur: pymysql.cursors.Cursor, statements: Sequence[Statement | Weighed],
                   shards: Sequence[int]) -> list[Any]:
        """Run a write's ``statements`` in as few packets as fit, then COMMIT (after the test hook, if set);
        return the results of the first packet."""
        hook = self.before_commit
        if hook is None:
            statements = [*statements, ("COMMIT", ())]
        first: list[Any] | None = None
        for packet in self._packets(statements):
            results = run_script(cur, packet)
            first = results if first is None else first
        if hook is not None:
            hook(shards)
            cur.execute("COMMIT")
        return first or []

    def _write_one_shard(self, cur: pymysql.cursors.Cursor, cells: Sequence[PendingCell]) -> list[Cell]:
        """One round trip: lock the shard's row and take its ids, insert, COMMIT. A fenced shard (or one
        this node does not hold) leaves @cs_b NULL, so the INSERT fails (1048) and nothing is written."""
        shard = cells[0].shard
        rows = [_values(shard, f"@cs_b + {i}", c) for i, c in enumerate(cells, 1)]
        results = self._run_write(cur, [
            ("SET @cs_b = NULL", ()), ("START TRANSACTION", ()),
            ("UPDATE cellstream_shards SET last_id = (@cs_b := GREATEST(last_id, id_floor)) + %s"
             " WHERE shard = %s AND fence IS NULL",
             (len(cells), shard)),
            (f"SELECT @cs_b, {_TIMESTAMP}", ()),
            *self._inserts(rows)], [shard])
        base, created = results[3].rows[0]
        return [Cell(c.row_key, c.column, c.ref_key, c.body, base + i, shard, created) for i, c in enumerate(cells, 1)]

    def _existing(self, cur: pymysql.cursors.Cursor, cells: Sequence[PendingCell]) -> dict[Coordinates, Cell]:
        """The stored cells at these coordinates (at most 500 looked up a statement)."""
        statements: list[Statement] = [
            (f"SELECT {CELL_COLUMNS} FROM cells WHERE " + " OR ".join([_SAME_CELL] * len(chunk)),
             [a for c in chunk for a in c.coordinates])
            for chunk in (cells[i:i + 500] for i in range(0, len(cells), 500))]
        found: dict[Coordinates, Cell] = {}
        for packet in self._packets(statements):
            for result in run_script(cur, packet):
                for cell in (_row_to_cell(row, self._max_body) for row in result.rows or ()):
                    found[(cell.row_key.bytes, cell.column, cell.ref_key)] = cell
        return found

    def _write_fresh(self, cur: pymysql.cursors.Cursor, cells: Sequence[PendingCell]) -> list[Cell] | None:
        """Cells of many shards, taken for new: two round trips. One UPDATE locks the shards' rows (ascending,
        as every writer does) and moves their counters by the cells of each, skipping a fenced row, so the
        fence refuses the write atomically; the counters are read back with the time (taken once every lock is
        held). Then the cells are inserted with their ids and the transaction COMMITs.

        Returns None, with nothing written and no lock held, when a shard is fenced or not held by this node
        (the locked path then says which), or when the cells need more than one INSERT: ``touched`` moves
        here, before the INSERT, and a count poll's margin (TOUCH_MARGIN) must cover the time from there to
        the COMMIT; a larger batch goes the locked way, which moves the counters last. A cell stored already
        makes the INSERT fail (IntegrityError, DUPLICATE)."""
        # An upper bound of each cell's VALUES text (_values: the hex body, the hex key, the numbers).
        if sum(2 * len(c.blob) + len(c.column) + 120 for c in cells) >= self._options.max_statement_bytes // 2:
            return None
        counts: dict[int, int] = {}
        for cell in cells:
            counts[cell.shard] = counts.get(cell.shard, 0) + 1
        shards = sorted(counts)
        listed = ", ".join(map(str, shards))
        moved = run_script(cur, [
            ("START TRANSACTION", ()),
            (f"UPDATE cellstream_shards SET last_id = GREATEST(last_id, id_floor) + {_increments(counts)}"
             f" WHERE shard IN ({listed}) AND fence IS NULL", ()),
            # ROW_COUNT(): the rows the UPDATE moved; every row it matched moved (by one cell at least).
            (f"SELECT ROW_COUNT(), GROUP_CONCAT(last_id ORDER BY shard), {_TIMESTAMP}"
             f" FROM cellstream_shards WHERE shard IN ({listed})", ())])
        [[updated, counters, created]] = moved[2].rows or ()
        if updated != len(shards):
            cur.execute("ROLLBACK")
            return None
        # Each shard's counter before this write: its first id is one above.
        last = {s: int(n) - counts[s] for s, n in zip(shards, counters.split(","), strict=True)}
        ids = [0] * len(cells)
        rows = []
        for i in sorted(range(len(cells)), key=lambda i: cells[i].shard):  # ascending keys, as _write_locked
            cell = cells[i]
            ids[i] = last[cell.shard] = last[cell.shard] + 1
            rows.append(_values(cell.shard, str(ids[i]), cell))
        self._run_write(cur, self._inserts(rows), shards)
        return [Cell(c.row_key, c.column, c.ref_key, c.body, ids[i], c.shard, created) for i, c in enumerate(cells)]

    def _write_locked(self, cur: pymysql.cursors.Cursor, cells: Sequence[PendingCell],
                      check_existing: bool) -> list[Cell]:
        """Two round trips: lock the shards' rows (ascending) and read their counters and fences; then insert
        every cell with its id, move the counters and COMMIT. With ``check_existing``, cells stored already
        are compared (CellConflictError on another body) and not written again. The way of batches that
        :meth:`_write_fresh` does not take, and the one that reports a fence (ShardMovedError)."""
        shards = sorted({c.shard for c in cells})
        # The rows are locked in index order; their counters come back as one string, which costs a
        # fraction of a row per shard to fetch.
        locked = run_script(cur, [
            ("START TRANSACTION", ()),
            ("SELECT COUNT(*), GROUP_CONCAT(GREATEST(last_id, id_floor) ORDER BY shard),"
             " GROUP_CONCAT(CONCAT(shard, ' ', fence))"
             f" FROM cellstream_shards WHERE shard IN ({', '.join(map(str, shards))}) FOR UPDATE", ()),
            (f"SELECT {_TIMESTAMP}", ())])
        [[count, counters, fences]] = locked[1].rows or ()
        if fences:
            cur.execute("ROLLBACK")
            shard, node = fences.split(",")[0].split(" ")
            raise ShardMovedError(int(shard), node)
        if count != len(shards):
            cur.execute("ROLLBACK")
            raise StorageError(f"storage node {self.name} does not hold all of shards {shards[:10]}...")
        last = dict(zip(shards, map(int, counters.split(",")), strict=True))
        [[created]] = locked[2].rows or ()
        existing = self._existing(cur, cells) if check_existing else {}
        fresh = split_existing(cells, existing) if check_existing else cells
        rows, ids = [], {}
        for cell in sorted(fresh, key=_shard_of_cell):  # ascending keys: appends to each shard's range
            added_id = last[cell.shard] = last[cell.shard] + 1
            rows.append(_values(cell.shard, str(added_id), cell))
            ids[cell.row_key.bytes, cell.column, cell.ref_key] = added_id
        counts: dict[int, int] = {}
        for cell in fresh:
            counts[cell.shard] = counts.get(cell.shard, 0) + 1
        written = sorted(counts)
        statements = self._inserts(rows)
        if written:  # the rows are locked: the counters move by the cells written
            counter = (f"UPDATE cellstream_shards SET last_id = GREATEST(last_id, id_floor) + {_increments(counts)}"
                       f" WHERE shard IN ({', '.join(map(str, written))})")
            statements.append(((counter, ()), len(counter)))
        self._run_write(cur, statements, written)
        # Every cell carries the body given (equal to a stored one by same_json): nothing is decoded again.
        out = []
        for c in cells:
            key = (c.row_key.bytes, c.column, c.ref_key)
            new_id = ids.get(key)
            out.append(existing[key]._replace(body=c.body) if new_id is None
                       else Cell(c.row_key, c.column, c.ref_key, c.body, new_id, c.shard, created))
        return out

    def insert(self, cells: Sequence[PendingCell], retry: RetryPolicy | None = None) -> list[Cell]:
        one_shard = len({c.shard for c in cells}) == 1

        def run(cur: pymysql.cursors.Cursor) -> list[Cell]:
            try:
                try:
                    if one_shard:
                        return self._write_one_shard(cur, cells)
                    # None: a shard refused it (the locked way says which), or it is too large for one INSERT.
                    written = self._write_fresh(cur, cells)
                    return written if written is not None else self._write_locked(cur, cells, check_existing=False)
                except pymysql.err.IntegrityError as exc:
                    if code(exc) not in (DUPLICATE, NULL_COLUMN):
                        raise
                    cur.execute("ROLLBACK")
                # Some cells exist already, or the one-shard write found no counter: lock, look, write the rest.
                return self._write_locked(cur, cells, check_existing=True)
            except BaseException:
                # Never leave a transaction open: it would hold shard locks (the pool also
                # refuses to reuse a connection that is still inside one).
                with suppress(pymysql.Error, OSError):
                    cur.execute("ROLLBACK")
                raise

        return self._call("write", run, policy=retry)

    def restore_cells(self, cells: Sequence[RestoredCell]) -> None:
        """As a move's copy writes them (:mod:`logstore.backends.mysql.moves`), in one transaction holding the
        shards' counter rows, each counter then set to its shard's highest restored id (ids stay dense when
        the restored ids are, as a backup's are)."""
        if not cells:
            return
        highest: dict[int, tuple[int, int]] = {}  # shard -> (lowest, highest) id restored
        for cell in cells:
            low, high = highest.get(cell.shard, (cell.added_id, cell.added_id))
            highest[cell.shard] = (min(low, cell.added_id), max(high, cell.added_id))
        shards = sorted(highest)

        def run(cur: pymysql.cursors.Cursor) -> None:
            cur.execute("START TRANSACTION")
            try:
                # Ascending, as writers lock them: no deadlock with a writer.
                cur.execute(f"SELECT shard, last_id, fence FROM cellstream_shards WHERE shard IN"
                            f" ({', '.join(['%s'] * len(shards))}) ORDER BY shard FOR UPDATE", shards)
                rows = {int(shard): (int(last), fence) for shard, last, fence in cur.fetchall()}
                for shard in shards:
                    last, fence = rows.get(shard, (None, None))
                    if last is None or fence is not None:
                        raise StorageError(f"storage node {self.name} does not hold shard {shard}")
                    if highest[shard][0] <= last:
                        raise StorageError(f"storage node {self.name}: shard {shard} holds cells up to added_id "
                                           f"{last}; a restore cannot write added_id {highest[shard][0]} there")
                # As a write's SQL is built (_values): hex literals, no escaping by the driver, which cost
                # several times the server's work. The column is checked here, where it becomes SQL text.
                for statement, _ in self._inserts([
                        f"({c.shard}, {c.added_id}, X'{c.row_key.bytes.hex()}', "
                        f"'{check_column(c.column, allow_reserved=True)}', {c.ref_key}, X'{c.blob.hex()}', "
                        f"'{c.created_at.astimezone(dt.UTC).replace(tzinfo=None).isoformat(sep=' ')}')"
                        for c in cells]):
                    cur.execute(statement[0])
                # Ids restored with holes (copies of a lost primary's acknowledged cells, a source's burnt
                # ids) are read with a LIMIT up to the highest of them: the shard's floor.
                count = {s: 0 for s in shards}
                for c in cells:
                    count[c.shard] += 1
                cur.executemany("UPDATE cellstream_shards SET last_id = %s, id_floor = GREATEST(id_floor, %s)"
                                " WHERE shard = %s",
                                [(highest[s][1], highest[s][1] if (highest[s][0] != rows[s][0] + 1 or highest[s][1]
                                  - highest[s][0] + 1 != count[s]) else 0, s) for s in shards])
                cur.execute("COMMIT")
            except BaseException:
                with suppress(pymysql.Error, OSError):
                    cur.execute("ROLLBACK")
                raise
        self._call("restore", run)  # a duplicate key (coordinates stored already) is a StorageError

    # -- reads ----------------------------------------------------------------------
    def get_cell(self, shard: int, row_key: uuid.UUID, column: str, ref_key: int) -> Cell | None:
        rows = self._read(f"SELECT {CELL_COLUMNS} FROM cells WHERE row_key = %s AND column_name = %s AND ref_key = %s",
                          (row_key.bytes, column, ref_key))
        return _row_to_cell(rows[0], self._max_body) if rows else None

    def get_latest(self, shard: int, row_key: uuid.UUID, column: str, as_of: dt.datetime | None = None) -> Cell | None:
        if as_of is None:
            rows = self._read(f"SELECT {CELL_COLUMNS} FROM cells WHERE row_key = %s AND column_name = %s"
                              " ORDER BY ref_key DESC LIMIT 1", (row_key.bytes, column))
        else:  # down the ``cell`` key from the highest ref_key, to the first version created by then
            rows = self._read(f"SELECT {CELL_COLUMNS} FROM cells WHERE row_key = %s AND column_name = %s"
                              " AND created_at <= %s ORDER BY ref_key DESC LIMIT 1",
                              (row_key.bytes, column, _datetime_text(as_of)))
        return _row_to_cell(rows[0], self._max_body) if rows else None

    def read_cells(self, coordinates: Sequence[CellRead], as_of: dt.datetime | None,
                   budget: ReadBudget) -> list[Cell | None]:
        """A statement a few hundred coordinates: those with a ref_key as point ranges of the ``cell`` unique
        key, the others through it too, the newest ref_key of each (row key, column) joined back to its cell."""
        rows: list[tuple[Any, ...] | None] = []
        for start in range(0, len(coordinates), _LATEST_BATCH):
            part = coordinates[start:start + _LATEST_BATCH]
            exact = [(key.bytes, column, ref) for _, key, column, ref in part if ref is not None]
            latest = [(key.bytes, column) for _, key, column, ref in part if ref is None]
            parts, args = [], []
            if exact:
                parts.append(f"(SELECT 0, {CELL_COLUMNS} FROM cells WHERE {' OR '.join([_SAME_CELL] * len(exact))})")
                args += [a for triple in exact for a in triple]
            if latest:
                keys, columns = list({k for k, _ in latest}), list({c for _, c in latest})
                parts.append(
                    f"(SELECT 1, {_QUALIFIED_CELL_COLUMNS} FROM cells c JOIN (SELECT row_key, column_name, "
                    f"MAX(ref_key) AS top FROM cells WHERE row_key IN ({', '.join(['%s'] * len(keys))}) AND "
                    f"column_name IN ({', '.join(['%s'] * len(columns))})"
                    f"{'' if as_of is None else ' AND created_at <= %s'} GROUP BY"
                    " row_key, column_name) m ON c.row_key = m.row_key AND c.column_name = m.column_name"
                    " AND c.ref_key = m.top)")
                args += [*keys, *columns, *([] if as_of is None else [_datetime_text(as_of)])]
            found_exact: dict[tuple[bytes, str, int], tuple[Any, ...]] = {}
            found_latest: dict[tuple[bytes, str], tuple[Any, ...]] = {}
            for newest, *row in self._read(" UNION ALL ".join(parts), args):
                if newest:  # one a (row key, column)
                    found_latest[(row[2], row[3])] = tuple(row)
                else:
                    found_exact[(row[2], row[3], row[4])] = tuple(row)
            rows += [found_exact.get((key.bytes, column, ref)) if ref is not None
                     else found_latest.get((key.bytes, column)) for _, key, column, ref in part]
        return decode_in_order(rows, _row_to_sized_cell, self._max_body, budget)

    def get_versions(self, shard: int, row_key: uuid.UUID, column: str, before: int | None, limit: int,
                     budget: ReadBudget) -> list[Cell]:
        """One statement, a range of the ``cell`` unique key read backwards."""
        below = "" if before is None else " AND ref_key < %s"
        rows = self._read(f"SELECT {CELL_COLUMNS} FROM cells WHERE row_key = %s AND column_name = %s{below}"
                          " ORDER BY ref_key DESC LIMIT %s",
                          (row_key.bytes, column, *(() if before is None else (before,)), limit))
        return decode_log(rows, _row_to_sized_cell, self._max_body, budget)

    def get_row(self, shard: int, row_key: uuid.UUID, as_of: dt.datetime | None = None) -> list[Cell]:
        if as_of is None:
            rows = self._read(
                f"SELECT {CELL_COLUMNS} FROM cells c WHERE row_key = %s AND ref_key = ("
                " SELECT MAX(ref_key) FROM cells m WHERE m.row_key = c.row_key AND m.column_name = c.column_name)"
                " ORDER BY column_name", (row_key.bytes,))
        else:
            rows = self._read(
                f"SELECT {CELL_COLUMNS} FROM cells c WHERE row_key = %s AND ref_key = ("
                " SELECT MAX(ref_key) FROM cells m WHERE m.row_key = c.row_key AND m.column_name = c.column_name"
                " AND m.created_at <= %s) ORDER BY column_name", (row_key.bytes, _datetime_text(as_of)))
        return [_row_to_cell(r, self._max_body) for r in rows]

    def _gappy(self, locations: Sequence[tuple[int, int]]) -> set[int]:
        """The shards of ``locations`` read from below their floor: ids there may have holes."""
        now = time.monotonic()
        if now - self._floors_at > self._options.map_refresh:
            with self._floors_lock:
                if now - self._floors_at > self._options.map_refresh:
                    def run(cur: pymysql.cursors.Cursor) -> dict[int, int]:
                        try:
                            cur.execute("SELECT shard, id_floor FROM cellstream_shards WHERE id_floor > 0")
                        except pymysql.Error as exc:
                            if code(exc) != BAD_FIELD:  # a replica behind the column's creation
                                raise
                            return {}
                        return {int(shard): int(floor) for shard, floor in cur.fetchall()}
                    self._floors = self._call("read id floors", run, read=True)
                    self._floors_at = now
        floors = self._floors
        return {shard for shard, location in locations if location < floors.get(shard, 0)} if floors else set()

    def _log_rows(self, shard: int, location: int, limit: int, columns: Sequence[str] | None) -> list[Any]:
        return list(self._read(*_limited_pages([(shard, location)], limit, columns)))

    def read_logs(
        self, locations: Sequence[tuple[int, int]], limit: int, columns: Sequence[str] | None, packed: bool,
        budget: ReadBudget,
    ) -> Callable[[], Mapping[int, Sequence[AnyCell] | CorruptCellError]]:
        """One query for all the pages by ranges of ids (:func:`_dense_pages`), a ``LIMIT``ed part for a shard
        read from below its floor. With ``columns`` the ranges come with the shards' heads, and the shards whose
        range fell short of a page while their head is past it are read again with a ``LIMIT`` each."""
        to_cell: Callable[[Any, int], tuple[AnyCell, int]] = (_log_row_to_packed_cell if packed
                                                              else _log_row_to_cell)
        if len(locations) < 2:  # one shard: its own page query
            rows = {shard: self._log_rows(shard, location, limit, columns) for shard, location in locations}
            return partial(decode_pages, rows, to_cell, _ADDED_ID, self._max_body, budget)
        by_shard: dict[int, list[tuple[Any, ...]]] = {shard: [] for shard, _ in locations}
        if columns:
            found, heads = self._ranges_and_heads(locations, limit, columns)
            for row in found:
                by_shard[row[0]].append(row)
            # A range that held fewer than a page of the columns' cells while the shard goes on past it (cells
            # of other columns, or ids lost with a primary): the page is read again with a LIMIT.
            if short := [(shard, location) for shard, location in locations if len(by_shard[shard]) < limit
                         and (heads is None or heads.get(shard, 0) > location + limit)]:
                by_shard.update((shard, []) for shard, _ in short)
                for row in self._read(*_limited_pages(short, limit, columns)):
                    by_shard[row[0]].append(row)
            return partial(decode_pages, by_shard, to_cell, _ADDED_ID, self._max_body, budget)
        # Shards read from below their floor may have holes in their ids: a LIMIT each; the others by ranges.
        gappy = self._gappy(locations)
        parts, args = [], []
        if limited := [(s, loc) for s, loc in locations if s in gappy]:
            sql, more_args = _limited_pages(limited, limit, None)
            parts.append(sql)
            args += more_args
        if dense := [(s, loc) for s, loc in locations if s not in gappy]:
            sql, more_args = _dense_pages(dense, limit)
            parts.append(sql)
            args += more_args
        for row in self._read(" UNION ALL ".join(parts), args):
            by_shard[row[0]].append(row)
        return partial(decode_pages, by_shard, to_cell, _ADDED_ID, self._max_body, budget)

    def read_blocks(self, ranges: Sequence[tuple[int, int, int]]) -> list[LogBlock]:
        """Each range's block built by the server in one ``GROUP_CONCAT``, so the driver parses a row per shard,
        not per cell: short ranges by their ids, longer ones joined to their bounds, 256 a query (an ``OR`` of
        ranges would cost MariaDB every term for every row). A block that reaches ``group_concat_max_len`` was
        cut short by the server: that range is read again row by row."""
        if not ranges:
            return []

        def run(cur: pymysql.cursors.Cursor) -> tuple[int, dict[int, tuple[int, bytes]]]:
            cur.execute("SET SESSION group_concat_max_len = LEAST(@@max_allowed_packet, %s)", (_BLOCK_ROOM,))
            cur.execute("SELECT @@group_concat_max_len")
            room = int(cur.fetchall()[0][0])
            found: dict[int, tuple[int, bytes]] = {}
            # A short range (an incremental backup's) as its ids, looked up by key; from a shard's start, the
            # shard's rows by its key (ref); after a place in it, a range per shard (without the equality the
            # optimizer checks the range of each: "Range checked for each record").
            short = [r for r in ranges if r[2] - r[1] <= _BLOCK_POINTS]
            starts = [r for r in ranges if r[1] == 0 and r[2] - r[1] > _BLOCK_POINTS]
            rest = [r for r in ranges if r[1] != 0 and r[2] - r[1] > _BLOCK_POINTS]
            group_concat = f"SELECT c.shard, COUNT(*), GROUP_CONCAT({_BLOCK_CELL} ORDER BY c.added_id SEPARATOR '')"
            points: list[str] = []
            for shard, after, up_to in short:
                points += [f"({shard},{i})" for i in range(after + 1, up_to + 1)]  # ints: no escaping needed
            for at in range(0, len(points), _BLOCK_POINTS_A_QUERY):
                cur.execute(f"{group_concat} FROM cells c WHERE (c.shard, c.added_id) IN"
                            f" ({','.join(points[at:at + _BLOCK_POINTS_A_QUERY])}) GROUP BY c.shard")
                for shard, count, data in cur.fetchall():
                    had = found.get(int(shard), (0, b""))
                    found[int(shard)] = (had[0] + int(count), had[1] + bytes(data))
            for part, on in ((starts, "c.shard = m.shard"), (rest, "c.shard >= m.shard AND c.shard <= m.shard")):
                for at in range(0, len(part), _BLOCK_RANGES):
                    group = part[at:at + _BLOCK_RANGES]
                    bounds = " UNION ALL ".join(["SELECT %s AS shard, %s AS lo, %s AS hi"] * len(group))
                    cur.execute(f"{group_concat} FROM ({bounds}) m JOIN cells c ON {on} AND c.added_id > m.lo"
                                " AND c.added_id <= m.hi GROUP BY c.shard", [a for r in group for a in r])
                    found.update((int(shard), (int(count), bytes(data))) for shard, count, data in cur.fetchall())
            return room, found

        room, found = self._call("read blocks", run)
        out = []
        for shard, after, up_to in ranges:
            count, data = found.get(shard, (0, b""))
            if len(data) >= room:
                rows = self._call("read block rows", partial(_block_rows, shard, after, up_to))
                data = encode_block(BlockCell(int(i), str(t), int(r), str(c), bytes(k), bytes(b))
                                    for i, t, r, c, k, b in rows)
                count = len(rows)
            out.append(LogBlock(shard, count, data))
        return out

    def count_after(self, shard: int, location: int, columns: Sequence[str] | None = None,
                    reserved: bool = True) -> int:
        if not columns and reserved and not self._gappy([(shard, location)]):  # dense ids: the ids up to the head
            return max(0, self.head(shard) - location)
        where, extra = _after(columns, reserved)
        rows = self._read(f"SELECT COUNT(*) FROM cells WHERE {where}", [shard, location, *extra])
        return int(rows[0][0])

    def counts_after(self, locations: Sequence[tuple[int, int]],
                     columns: Sequence[str] | None = None, reserved: bool = True) -> dict[int, int]:
        dense = not columns and reserved
        gappy = self._gappy(locations) if dense else set()
        out: dict[int, int] = {}
        if dense:  # dense ids: the heads tell, but below a floor
            heads = self.heads([shard for shard, _ in locations])
            out = {shard: max(0, heads.get(shard, 0) - location) for shard, location in locations
                   if shard not in gappy}
            locations = [(shard, location) for shard, location in locations if shard in gappy]
        where, extra = _after(columns, reserved)
        for start in range(0, len(locations), 500):  # a UNION of 500 counts a statement
            group = locations[start:start + 500]
            sql = " UNION ALL ".join([f"SELECT %s, COUNT(*) FROM cells WHERE {where}"] * len(group))
            out.update((int(s), int(n)) for s, n in self._read(
                sql, [a for shard, location in group for a in (shard, shard, location, *extra)]))
        return out

    def first_at(self, shard: int, when: dt.datetime) -> int | None:
        rows = self._read("SELECT MIN(added_id) FROM cells WHERE shard = %s AND created_at >= %s",
                          (shard, when.astimezone(dt.UTC).replace(tzinfo=None)))
        return int(rows[0][0]) if rows and rows[0][0] is not None else None

    def firsts_at(self, shards: Sequence[int], when: dt.datetime) -> dict[int, int]:
        utc = when.astimezone(dt.UTC).replace(tzinfo=None)
        out: dict[int, int] = {}
        for start in range(0, len(shards), 500):  # a UNION of 500 ranges of the (shard, created_at) key
            group = shards[start:start + 500]
            sql = " UNION ALL ".join(["SELECT %s, MIN(added_id) FROM cells WHERE shard = %s AND created_at >= %s"]
                                     * len(group))
            out.update((int(s), int(first)) for s, first in self._read(
                sql, [a for shard in group for a in (shard, shard, utc)]) if first is not None)
        return out

    def head(self, shard: int) -> int:
        rows = self._read("SELECT last_id FROM cellstream_shards WHERE shard = %s", (shard,))
        return int(rows[0][0]) if rows else 0

    def heads(self, shards: Sequence[int]) -> dict[int, int]:
        wanted = set(shards)
        return {s: n for s, n in self.shard_counts().items() if s in wanted}  # dense ids: the count is the head

    def shard_counts(self) -> dict[int, int]:
        return self.changed_counts(None).counts

    def changed_counts(self, since: object | None) -> ChangedCounts:
        """Partial answers come from the primary only, marked with its server id and clock: a replica applies
        rows later than they were touched, and another server's clock is not the mark's."""
        def count(cur: pymysql.cursors.Cursor, where: str = "", args: Sequence[Any] = ()) -> tuple[Any, ...]:
            cur.execute("SELECT GROUP_CONCAT(shard), GROUP_CONCAT(last_id), UNIX_TIMESTAMP(NOW(6)), @@server_id"
                        f" FROM cellstream_shards{where}", args)
            [row] = cur.fetchall()
            return tuple(row)

        def on_primary(cur: pymysql.cursors.Cursor) -> ChangedCounts:
            mark = _mark_of(since)
            if mark is not None:
                row = count(cur, " WHERE touched >= FROM_UNIXTIME(%s)", (mark[1] - _MARGIN,))
                if row[3] == mark[0]:
                    return _counts_of(row, complete=False)
            return _counts_of(count(cur), complete=True)

        def on_replica(cur: pymysql.cursors.Cursor) -> ChangedCounts:
            return _counts_of(count(cur), complete=True)._replace(mark=None)
        return self._call("count cells", on_primary, read=True, on_replica=on_replica)

    # -- consumer offsets -----------------------------------------------------------
    def claim_offsets(self, consumer: str, owner: str, shards: Sequence[int]) -> list[OffsetRecord]:
        """ShardMovedError (nothing claimed) when one of ``shards`` is fenced by a move: its offsets go with it,
        and the store claims it again where the map then puts it."""
        def change(offsets: ConsumerOffsets, fences: dict[int, str]) -> bool:
            for shard in shards if fences else ():
                if shard in fences:
                    raise ShardMovedError(shard, fences[shard])
            offsets.claim(owner, shards)
            return True
        return self._change_offsets("claim offsets", consumer, change).records(set(shards))

    def commit_offsets(self, consumer: str, owner: str, offsets: dict[int, tuple[int, str]]) -> set[int]:
        """Two round trips whatever the number of shards: lock and read the consumer's row, then write it and
        COMMIT. A shard fenced by a move is refused (returned) as a lost one is: its offsets went with it."""
        fenced: set[int] = set()

        def change(stored: ConsumerOffsets, fences: dict[int, str]) -> bool:
            fenced.clear()
            moving = fences.keys() & offsets.keys()
            fenced.update(stored.commit(owner, {s: o for s, o in offsets.items() if s not in moving}
                                        if moving else offsets), moving)
            return len(fenced) < len(offsets)
        if offsets:
            self._change_offsets("commit offsets", consumer, change, create=False)
        return fenced

    def carry_offsets(self, consumer: str, source: ConsumerOffsets, shard: int) -> bool:
        """Take ``source``'s record of ``shard`` (another node's offsets of ``consumer``) in place of this node's:
        a shard move carries it (:mod:`logstore.backends.mysql.moves`). False when ``source`` has none."""
        if shard not in source:
            return False
        self._change_offsets("carry offsets", consumer, lambda offsets, _fences: offsets.carry(source, shard))
        return True

    def _change_offsets(self, what: str, consumer: str, change: Callable[[ConsumerOffsets, dict[int, str]], bool],
                        create: bool = True) -> ConsumerOffsets:
        """The consumer's offsets, read under a lock, changed by ``change`` and written back if it says so.
        ``change`` is given the node's fenced shards too (shard -> the node named by its fence)."""
        where = f"{consumer} on storage node {self.name}"

        def run(cur: pymysql.cursors.Cursor) -> ConsumerOffsets:
            try:
                # The fences are read after the row is locked: a move that fences a shard, then reads the
                # offsets under a shared lock to carry them, sees every change made before this one met its
                # fence (logstore.backends.mysql.moves).
                results = run_script(cur, [*([(_NEW_CONSUMER, [consumer])] if create else []),
                                           ("START TRANSACTION", ()), (_OFFSETS + " FOR UPDATE", [consumer]),
                                           (_FENCES, ())])
                rows = results[-2].rows or ()
                offsets = ConsumerOffsets.decode(rows[0][0] if rows else None, where)
                [[fenced]] = results[-1].rows or ((None,),)
                fences = {int(s): node for s, node in (f.split(" ") for f in fenced.split(","))} if fenced else {}
                if change(offsets, fences) and rows:
                    run_script(cur, [(_SAVE_OFFSETS.format(offsets.encode().hex()), [consumer]), ("COMMIT", ())])
                else:
                    cur.execute("COMMIT")
                return offsets
            except BaseException:
                with suppress(pymysql.Error, OSError):
                    cur.execute("ROLLBACK")
                raise
        return self._call(what, run)

    def consumers(self) -> list[str]:
        return [str(c) for (c,) in self._read("SELECT consumer FROM cellstream_consumers ORDER BY consumer", ())]

    def burn_ids(self, burn: int) -> int:
        return int(self._call("burn ids", lambda cur: cur.execute(BURN_IDS, (burn, burn))))

    def read_marker(self, name: str) -> str | None:
        def run(cur: pymysql.cursors.Cursor) -> str | None:
            cur.execute("SELECT value FROM cellstream_meta WHERE name = %s", (f"marker.{name}",))
            row = cur.fetchone()
            return None if row is None else str(row[0])
        # Read with the map, every map_refresh: a node that does not answer at once is passed over.
        return self._call("read marker", run, read=True, policy=self._glance)

    def write_marker(self, name: str, value: str | None) -> None:
        if value is None:
            self._call("write marker", lambda cur: cur.execute("DELETE FROM cellstream_meta WHERE name = %s",
                                                               (f"marker.{name}",)))
        else:
            self._call("write marker", lambda cur: cur.execute(
                "INSERT INTO cellstream_meta (name, value) VALUES (%s, %s) ON DUPLICATE KEY UPDATE value = %s",
                (f"marker.{name}", value[:255], value[:255])))

    def read_offsets(self, consumer: str) -> list[OffsetRecord]:
        def run(cur: pymysql.cursors.Cursor) -> list[OffsetRecord]:
            cur.execute(_OFFSETS, (consumer,))
            row = cur.fetchone()
            return ConsumerOffsets.decode(None if row is None else row[0], f"{consumer} on storage node "
                                          f"{self.name}").records()
        return self._call("read offsets", run, read=True)

    def run(self, what: str, fn: Callable[[pymysql.cursors.Cursor], T], policy: RetryPolicy | None = None) -> T:
        """``fn`` on a connection to the primary, driver errors translated and retried (used by moves)."""
        return self._call(what, fn, policy=policy)

    @property
    def replica_targets(self) -> list[MySQLTarget]:
        """Where its replicas are (with their passwords: never to be logged)."""
        return list(self._replica_targets)

    def on_server(self, target: MySQLTarget, what: str, fn: Callable[[pymysql.cursors.Cursor], T],
                  timeout: float | None = None) -> T:
        """``fn`` once, on a connection of its own to ``target`` (this node's primary or one of its replicas),
        outside the pool; driver errors translated (used by promotions, which stop a replica's replication)."""
        try:
            conn = self._raw_connect(target.database, target, timeout)
        except pymysql.Error as exc:
            raise translate(exc, f"{self.name} ({target.host}:{target.port})") from exc
        try:
            with conn.cursor() as cur:
                return fn(cur)
        except pymysql.Error as exc:
            raise translate(exc, f"{self.name} ({target.host}:{target.port})") from exc
        finally:
            Pool.discard(conn)

    @contextmanager
    def named_lock(self, name: str) -> Iterator[bool]:
        """Hold the server's named lock ``name`` (``GET_LOCK``, qualified by this node's database) while the
        block runs, on a connection of its own outside the pool; yields False, holding nothing, when another
        session holds it. A process that dies loses the lock with its connection (used by moves: one process
        at a time moves a shard)."""
        try:
            conn = self._raw_connect(self._target.database)
        except pymysql.Error as exc:
            raise translate(exc, self.name) from exc
        try:
            with conn.cursor() as cur:
                cur.execute("SELECT GET_LOCK(CONCAT(%s, '.', LEFT(SHA1(DATABASE()), 16)), 0)", (name,))
                [[held]] = cur.fetchall()
            yield held == 1
        except pymysql.Error as exc:
            raise translate(exc, self.name) from exc
        finally:
            Pool.discard(conn)  # the lock goes with the session

    supports_moves = True

    def moves(self) -> dict[int, str]:
        def run(cur: pymysql.cursors.Cursor) -> dict[int, str]:
            try:
                cur.execute("SELECT shard, moved_to FROM cellstream_shards WHERE moved_to IS NOT NULL")
            except pymysql.err.ProgrammingError as exc:
                if code(exc) == NO_TABLE:  # a replica that has not caught up with the node's creation
                    return {}
                raise
            return {int(shard): str(node) for shard, node in cur.fetchall()}
        # Read every map_refresh seconds: a node that does not answer at once keeps its last known moves.
        return self._call("read moves", run, read=True, policy=self._glance)

    def stored_bytes(self) -> int | None:
        rows = self._read("SELECT COALESCE(SUM(data_length + index_length), 0) FROM information_schema.TABLES"
                          " WHERE table_schema = DATABASE()", ())
        return int(rows[0][0]) if rows else None

    def shard_weights(self, by: str, window: float) -> dict[int, int] | None:
        args: tuple[int, ...] = ()
        if by == "bytes":
            # The fixed columns (shard, ids, row key, ref key, time) are 44 bytes a cell besides the name.
            sql = "SELECT shard, SUM(LENGTH(body) + LENGTH(column_name) + 44) FROM cells GROUP BY shard"
        elif by == "writes":
            sql = ("SELECT shard, COUNT(*) FROM cells WHERE created_at >= UTC_TIMESTAMP(6) - INTERVAL %s"
                   " MICROSECOND GROUP BY shard")
            args = (int(window * 1_000_000),)
        else:
            raise InvalidArgumentError(f"shards are weighed by cells, bytes or writes, not {by!r}")
        return {int(shard): int(weight) for shard, weight in self._read(sql, args)}

    def read_map(self) -> tuple[int, str] | None:
        return self._call("read shard map", mysql_map.read_newest, read=True, policy=self._glance)

    def write_map(self, version: int, doc: str) -> bool:
        return self._call("write shard map", lambda cur: mysql_map.write_version(cur, version, doc),
                          policy=self._quick_retry)

    # -- buffered writes (logstore.backends.mysql.pending) -------------------------------------
    supports_pending = True

    def _quick(self, what: str, fn: Callable[[pymysql.cursors.Cursor], T]) -> T:
        """Buffering is for when another node is down: this one answers at once or is skipped."""
        return self._call(what, fn, policy=self._quick_retry)

    def buffer(self, node: str, cells: Sequence[PendingCell]) -> None:
        mysql_pending.buffer(self._quick, node, cells, self._max_body)

    def pending(self, limit: int) -> list[PendingRecord]:
        return mysql_pending.pending(self._quick, limit, self._max_body)

    def drop_pending(self, ids: Sequence[int]) -> None:
        mysql_pending.drop(self._quick, ids)

    def fail_pending(self, pid: int, reason: str) -> None:
        mysql_pending.fail(self._quick, pid, reason)

    def pending_counts(self) -> dict[str, tuple[int, int]]:
        return mysql_pending.counts(partial(self._call, policy=self._look))

    # -- durable copies (logstore.backends.mysql.durable) ---------------------------------------
    @property
    def replicated(self) -> bool:
        return bool(self._replicas)

    def hold_copies(self, home: str, cells: Sequence[RestoredCell]) -> None:
        mysql_durable.hold(self._quick, home, cells)

    def trim_copies(self, home: str, heads: Mapping[int, int]) -> int:
        return mysql_durable.trim(self._quick, home, heads)

    def copies_above(self, home: str, heads: Mapping[int, int]) -> list[RestoredCell]:
        return mysql_durable.above(self._quick, home, heads)

    def copy_counts(self) -> dict[str, int]:
        return mysql_durable.counts(self._quick)

    def replica_heads(self) -> dict[int, int] | None:
        if not self._replicas:
            return None

        def run(cur: pymysql.cursors.Cursor) -> dict[int, int]:
            cur.execute("SELECT shard, last_id FROM cellstream_shards WHERE fence IS NULL")
            return {int(shard): int(last) for shard, last in cur.fetchall()}
        found = [self._on(pool, f"{self.name} replica {i}", "read replica heads", run)
                 for i, pool in enumerate(self._replicas)]
        return {s: min(heads.get(s, 0) for heads in found) for s in found[0]}

    def close(self) -> None:
        self._pool.close()
        for pool in self._replicas:
            pool.close()
