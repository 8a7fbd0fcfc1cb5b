"""A MySQL/MariaDB table as the source of a migration: chunks read with pymysql in consistent snapshots, changes
read from the binary log with ``mysql-replication`` (:mod:`pymysqlreplication`), both on one axis of positions.

A position is one int, ``(binlog file's number << 32) + offset``: the server rotates to a file with the next
number, and ``max_binlog_size`` is under 4 GiB, so positions increase across rotations. A change's position is
the end of its transaction's XID (or COMMIT) event: where the log resumes after it, so acknowledging it is
storing the point to read from next.

The acknowledged position lives in a table of the source database, ``cellstream_migration_positions (name,
position)``, so a restart resumes from it (a binlog has no slot: the server purges files after
``expire_logs_days`` whatever a reader needs, and reading from a purged file raises MigrationSourceError).

Values come out as the types a cell's body holds: DATETIME and TIMESTAMP as aware UTC datetimes (DATETIME is
taken to be UTC; the session's time zone is UTC, so TIMESTAMP is too), DECIMAL as Decimal, binary strings as
bytes, JSON columns parsed, SET as a sorted list, BIT as an int. Both readers convert alike, so a row read in a
chunk equals the same row's change.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

import orjson
import pymysql
import pymysql.cursors
from pymysql.connections import Connection
from pymysqlreplication import BinLogStreamReader
from pymysqlreplication.event import GtidEvent, MariadbGtidEvent, QueryEvent, XidEvent
from pymysqlreplication.row_event import DeleteRowsEvent, UpdateRowsEvent, WriteRowsEvent

from connectors.errors import ConfigurationError, MigrationSourceError, MigrationSourceUnavailableError
from connectors.migration.source import Change, ChangeLag, Chunk, Key, MigrationSource, SourceLoad, SourceRow
from logstore.backends.mysql.target import MySQLTarget, parse_url
from logstore.errors import InvalidArgumentError

logger = logging.getLogger(__name__)


class _NoMetadataAdvice(logging.Filter):
    """Drops the reader's warning, at every connection, that binlog_row_metadata is not FULL: start_changes
    checks it for the columns that need it, and a poll would log it every time."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "BINLOG_ROW_METADATA = FULL" not in record.getMessage()


logging.getLogger("pymysqlreplication").addFilter(_NoMetadataAdvice())

POSITIONS_TABLE = "cellstream_migration_positions"
_OFFSET_BITS = 32
# Client errors for a server that did not answer (connect refused, gone away, lost, read timeout).
_UNAVAILABLE = {2002, 2003, 2006, 2013, 2055}
_ACCESS_DENIED = {1045, 1044, 1142, 1227}  # login refused; database, table or global privilege missing
_SSL_UNSUPPORTED = 2026
_PARSE_ERROR = 1064
_BINARY_TYPES = {"binary", "varbinary", "tinyblob", "blob", "mediumblob", "longblob"}
_UTF8 = {None, "utf8", "utf8mb3", "utf8mb4", "ascii"}
_ROW_EVENTS = (WriteRowsEvent, UpdateRowsEvent, DeleteRowsEvent)
_INTEGERS = frozenset({"tinyint", "smallint", "mediumint", "int", "bigint"})
_ROWS_PER_STATEMENT = 500  # write_rows' statements stay well under max_allowed_packet


class _Column(NamedTuple):
    name: str
    data_type: str  # information_schema's DATA_TYPE, lower case ("json" for MariaDB's JSON alias too)
    charset: str | None


def encode_position(log_file: str, offset: int) -> int:
    """The int position of ``offset`` in the binlog file ``log_file`` (``mysql-bin.000060``)."""
    return (int(log_file.rsplit(".", 1)[1]) << _OFFSET_BITS) + offset


def decode_position(position: int, base: str) -> tuple[str, int]:
    """The binlog file (named ``base.NNNNNN``) and offset of an int position."""
    return f"{base}.{position >> _OFFSET_BITS:06d}", position & ((1 << _OFFSET_BITS) - 1)


def _connect(target: MySQLTarget, settings: dict[str, Any]) -> Connection:
    """A connection with the target's TLS settings; with ``PREFERRED``, in the clear when the server has none."""
    try:
        return pymysql.connect(**settings, **target.ssl_options())
    except pymysql.err.OperationalError as exc:
        if target.ssl_mode != "PREFERRED" or exc.args[0] != _SSL_UNSUPPORTED:
            raise
        return pymysql.connect(**settings, ssl_disabled=True)


def _connect_as_reader(**settings: Any) -> Connection:
    """The binlog reader's connections: the library names the database by pymysql's old ``db`` argument, which
    warns at each stream (and a filter for it would be process-wide state shared by threads)."""
    if "db" in settings:
        settings["database"] = settings.pop("db")
    return pymysql.connect(**settings)


@contextlib.contextmanager
def _translated(what: str) -> Iterator[None]:
    """The one boundary where driver errors become the connectors' typed ones (the password never in them)."""
    try:
        yield
    except MigrationSourceError:
        raise
    except pymysql.err.OperationalError as exc:
        code = exc.args[0] if exc.args else None
        if code in _UNAVAILABLE:
            raise MigrationSourceUnavailableError(f"{what}: the source did not answer ({exc})") from exc
        if code in _ACCESS_DENIED:
            raise MigrationSourceError(f"{what}: access denied ({exc})") from exc
        raise MigrationSourceError(f"{what}: {exc}") from exc
    except pymysql.err.Error as exc:
        raise MigrationSourceError(f"{what}: {exc}") from exc
    except (OSError, EOFError) as exc:
        raise MigrationSourceUnavailableError(f"{what}: the source did not answer ({exc!r})") from exc


class MySQLSource(MigrationSource):
    """One table of a MySQL or MariaDB database as a migration's source (see the module's docstring).

    Args:
        url: ``mysql://user:password@host:port/database`` (TLS parameters as a storage node's URL takes them).
        table: the table's name in that database.
        replicas: URLs of the source's replicas whose lag :meth:`load` reports (their database part unused).

    Raises:
        ConfigurationError: the URL cannot be parsed.
    """

    def __init__(self, url: str, table: str, *, replicas: Sequence[str] = ()) -> None:
        try:
            self._target: MySQLTarget = parse_url(url)
            self._replicas = [parse_url(replica) for replica in replicas]
        except InvalidArgumentError as exc:
            raise ConfigurationError(f"migration source: {exc}") from exc
        self._replica_conns: dict[int, Connection] = {}
        self._table = table
        self._where = f"{self._target.redacted()} table {table}"
        self._conn: Connection | None = None
        self._writer: Connection | None = None  # write_rows': its writes go to the binlog
        self._mariadb = False
        self._columns: list[_Column] | None = None
        self._key: list[str] | None = None
        self._log_base: str | None = None
        self._in_clear = False  # PREFERRED and the server offers no TLS

    # -- connections --------------------------------------------------------------------------------------
    def _settings(self) -> dict[str, Any]:
        t = self._target
        # Every session in UTC: TIMESTAMP columns read as UTC, as the binlog holds them.
        return {"host": t.host, "port": t.port, "user": t.user, "password": t.password, "charset": "utf8mb4",
                "connect_timeout": 10, "init_command": "SET time_zone = '+00:00'"}

    def _ssl(self) -> dict[str, Any]:
        return self._target.ssl_options()

    def _connection(self) -> Connection:
        if self._conn is not None:
            return self._conn
        with _translated(f"connecting to {self._where}"):
            conn = _connect(self._target, {**self._settings(), "database": self._target.database,
                                           "autocommit": True})
            self._in_clear = self._target.ssl_mode == "PREFERRED" and not conn.ssl
            with conn.cursor() as cur:
                cur.execute("SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ")  # a snapshot per chunk
                try:
                    # The position rows are bookkeeping: kept out of the binlog, or each acknowledgment would
                    # log a transaction, and the lag would never come down to zero.
                    cur.execute("SET SESSION sql_log_bin = 0")
                except pymysql.err.OperationalError as exc:
                    if exc.args[0] not in _ACCESS_DENIED:
                        raise
                    logger.warning("%s: may not set sql_log_bin (%s): acknowledgments go to the binlog, "
                                   "and the change lag stays a transaction above zero", self._where, exc.args[1])
                cur.execute("SELECT VERSION()")
                [(version,)] = cur.fetchall()
            self._mariadb = "mariadb" in str(version).lower()
        self._conn = conn
        return conn

    def _writer_connection(self) -> Connection:
        """write_rows' session: unlike ``_connection``'s it logs to the binlog (the source's replicas and the
        capture must see the writes), and it commits explicitly (autocommit off: one transaction per call)."""
        if self._writer is not None:
            return self._writer
        self._writer = _connect(self._target, {**self._settings(), "database": self._target.database,
                                                "autocommit": False})
        return self._writer

    def _query(self, sql: str, args: Any = None) -> list[tuple[Any, ...]]:
        with _translated(f"reading {self._where}"):
            try:
                with self._connection().cursor() as cur:
                    cur.execute(sql, args)
                    return list(cur.fetchall())
            except (pymysql.err.OperationalError, pymysql.err.InterfaceError) as exc:
                if isinstance(exc, pymysql.err.InterfaceError) or exc.args[0] in _UNAVAILABLE:
                    self._drop_connection()  # the next call connects again
                raise

    def _drop_connection(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    def _drop_writer(self) -> None:
        conn, self._writer = self._writer, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    # -- the table ----------------------------------------------------------------------------------------
    def _describe(self) -> list[_Column]:
        if self._columns is not None:
            return self._columns
        db = self._target.database
        rows = self._query("SELECT COLUMN_NAME, DATA_TYPE, CHARACTER_SET_NAME FROM information_schema.COLUMNS "
                           "WHERE TABLE_SCHEMA = %s AND TABLE_NAME = %s ORDER BY ORDINAL_POSITION", (db, self._table))
        if not rows:
            raise MigrationSourceError(f"{self._where}: no such table")
        json_columns: set[str] = set()
        if self._mariadb:
            # MariaDB's JSON is LONGTEXT with a json_valid() check: the check says which columns hold JSON.
            checks = self._query("SELECT CHECK_CLAUSE FROM information_schema.CHECK_CONSTRAINTS "
                                 "WHERE CONSTRAINT_SCHEMA = %s AND TABLE_NAME = %s", (db, self._table))
            for (clause,) in checks:
                text = str(clause).strip()
                if text.startswith("json_valid(`") and text.endswith("`)"):
                    json_columns.add(text[len("json_valid(`"):-2])
        self._columns = [_Column(str(name), "json" if name in json_columns else str(kind).lower(),
                                 None if charset is None else str(charset))
                         for name, kind, charset in rows]
        return self._columns

    def key_columns(self) -> list[str]:
        """The primary key's columns, in order.

        Raises:
            MigrationSourceError: no such table, or it has no primary key.
        """
        if self._key is None:
            self._describe()
            rows = self._query("SELECT COLUMN_NAME FROM information_schema.STATISTICS WHERE TABLE_SCHEMA = %s "
                               "AND TABLE_NAME = %s AND INDEX_NAME = 'PRIMARY' ORDER BY SEQ_IN_INDEX",
                               (self._target.database, self._table))
            if not rows:
                raise MigrationSourceError(f"{self._where}: the table has no primary key")
            self._key = [str(name) for (name,) in rows]
        return list(self._key)

    def columns(self) -> list[str]:
        """Every column of the table, in table order. Raises MigrationSourceError when there is no such table."""
        return [c.name for c in self._describe()]

    def _select(self) -> str:
        return "SELECT " + ", ".join(f"`{c.name}`" for c in self._describe()) + f" FROM `{self._table}`"

    def _after(self, key: Key) -> tuple[str, list[Any]]:
        """``key`` < the row's key as an OR of prefixes: (a > x) OR (a = x AND b > y)... which MariaDB's
        optimizer reads as a range of the primary key (a row constructor's comparison may scan)."""
        names = self.key_columns()
        if len(key) != len(names):
            raise InvalidArgumentError(f"a key of {self._table} has {len(names)} values, not {len(key)}")
        terms, args = [], []
        for i, name in enumerate(names):
            terms.append("(" + " AND ".join([*(f"`{n}` = %s" for n in names[:i]), f"`{name}` > %s"]) + ")")
            args.extend([*key[:i], key[i]])
        return "(" + " OR ".join(terms) + ")", args

    def _rows(self, raw: list[tuple[Any, ...]]) -> list[SourceRow]:
        columns, key = self._describe(), self.key_columns()
        rows = []
        for values in raw:
            row = {c.name: _python(value, c) for c, value in zip(columns, values, strict=True)}
            rows.append(SourceRow(tuple(row[k] for k in key), row))
        return rows

    def _order(self) -> str:
        return " ORDER BY " + ", ".join(f"`{k}`" for k in self.key_columns())

    def key_span(self) -> tuple[int, int, int] | None:
        """The integer key's lowest and highest values (the primary key's ends) and TABLE_ROWS (at least 1).

        Raises:
            MigrationSourceError: the server refused; MigrationSourceUnavailableError: no answer.
        """
        keys = self.key_columns()
        kinds = {c.name: c.data_type for c in self._describe()}
        if len(keys) != 1 or kinds[keys[0]] not in _INTEGERS:
            return None
        [(low, high)] = self._query(f"SELECT MIN(`{keys[0]}`), MAX(`{keys[0]}`) FROM `{self._table}`")
        [(estimate,)] = self._query("SELECT TABLE_ROWS FROM information_schema.TABLES WHERE TABLE_SCHEMA = %s "
                                    "AND TABLE_NAME = %s", (self._target.database, self._table))
        return None if low is None else (int(low), int(high), max(int(estimate or 0), 1))

    def skip_keys(self, after: Key | None, count: int) -> Key | None:
        """The key ``count`` rows after ``after``: one statement over the primary key.

        Raises:
            MigrationSourceError: the server refused; MigrationSourceUnavailableError: no answer.
        """
        where, args = self._after(after) if after is not None else ("", [])
        names = self.key_columns()
        sql = ("SELECT " + ", ".join(f"`{k}`" for k in names) + f" FROM `{self._table}`"
               + (f" WHERE {where}" if where else "") + self._order() + " LIMIT 1 OFFSET %s")
        found = self._query(sql, [*args, max(count, 1) - 1])
        if not found:
            return None
        by_name = {c.name: c for c in self._describe()}
        return tuple(_python(value, by_name[name]) for name, value in zip(names, found[0], strict=True))

    def read_chunk(self, after: Key | None, limit: int) -> Chunk:
        """Up to ``limit`` rows with a key above ``after``, in key order, read in one consistent snapshot.

        On MariaDB the chunk's position is the snapshot's own binlog position (``binlog_snapshot_position``):
        every transaction the snapshot shows ends at or below it, every other one above. MySQL lacks it: the
        position is read just before the snapshot starts. A transaction the snapshot does not show commits after
        it started, so after that read, and its commit lands higher in the binlog; one that shows committed
        between the read and the snapshot lies above the chunk's position too, which only means its change,
        coming again from the log, wins over the chunk's copy of the same state. (A transaction written to the
        binlog before that read but committed in InnoDB only after the snapshot began would break this: MySQL's
        ordered commit makes the window a group commit's, and MariaDB has no such window.)

        Raises:
            MigrationSourceError: no such table or no primary key; MigrationSourceUnavailableError: no answer.
        """
        where, args = self._after(after) if after is not None else ("", [])
        sql = self._select() + (f" WHERE {where}" if where else "") + self._order() + " LIMIT %s"
        before = None if self._mariadb else self._status()
        self._query("START TRANSACTION WITH CONSISTENT SNAPSHOT, READ ONLY")
        try:
            if before is None:
                status = dict(self._query("SHOW STATUS LIKE 'binlog_snapshot_%'"))
                position = encode_position(str(status["Binlog_snapshot_file"]),
                                           int(status["Binlog_snapshot_position"]))
            else:
                position = before
            rows = self._rows(self._query(sql, [*args, limit]))
        finally:
            if self._conn is not None:
                with contextlib.suppress(pymysql.err.Error):
                    self._conn.commit()  # ends the snapshot: it holds no lock, but it holds the purge back
        return Chunk(rows, position, rows[-1].key if rows else None)

    def read_row(self, key: Key) -> SourceRow | None:
        names = self.key_columns()
        if len(key) != len(names):
            raise MigrationSourceError(f"a key of {len(key)} values for the {len(names)} columns {names}")
        where = " AND ".join(f"`{name}` = %s" for name in names)
        found = self._rows(self._query(f"{self._select()} WHERE {where}", list(key)))
        return found[0] if found else None

    def rows_between(self, low: Key | None, high: Key | None) -> list[SourceRow]:
        """The rows with ``low < key <= high`` (None: unbounded), in key order.

        Raises:
            MigrationSourceError: no such table or no primary key; MigrationSourceUnavailableError: no answer.
        """
        terms, args = [], []
        if low is not None:
            where, low_args = self._after(low)
            terms.append(where)
            args.extend(low_args)
        if high is not None:
            where, high_args = self._after(high)
            terms.append(f"NOT {where}")
            args.extend(high_args)
        sql = self._select() + (" WHERE " + " AND ".join(terms) if terms else "") + self._order()
        return self._rows(self._query(sql, args))

    # -- writing ------------------------------------------------------------------------------------------
    def write_rows(self, upserts: Sequence[Mapping[str, Any]], deletes: Sequence[Key]) -> None:
        """Make the table hold each row of ``upserts`` and none of ``deletes``, in one transaction that goes to
        the binlog (the source's replicas and a capture see it): ``INSERT ... ON DUPLICATE KEY UPDATE`` of the
        columns given, one statement per column set, then ``DELETE ... WHERE key IN (...)`` (a key in both ends
        deleted). Nothing is sent when both are empty.

        Args:
            upserts: rows by column name, each with every primary-key column, values in the forms a cell's body
                holds (:func:`connectors.migration.mapping.json_value`'s), converted back by the column's type.
            deletes: primary keys in the key's column order, their values in the same forms.

        Raises:
            MigrationSourceError: an upsert lacks a primary-key column or names no column of the table, a key
                has the wrong length, a value is not of its column's form, or the server refused (a constraint):
                nothing was written; MigrationSourceUnavailableError: the server did not answer (nothing was
                written, or all).
        """
        if not upserts and not deletes:
            return
        columns = {c.name: c for c in self._describe()}
        key = self.key_columns()
        groups: dict[tuple[str, ...], list[list[Any]]] = {}
        for row in upserts:
            missing = [name for name in key if name not in row]
            if missing:
                raise MigrationSourceError(f"{self._where}: an upsert lacks the primary-key column {missing[0]}")
            unknown = sorted(set(row) - set(columns))
            if unknown:
                raise MigrationSourceError(f"{self._where}: an upsert names {unknown[0]}, not a column of the table")
            names = tuple(name for name in columns if name in row)  # table order: one statement per column set
            groups.setdefault(names, []).append([self._written(row[name], columns[name]) for name in names])
        keys = []
        for found in deletes:
            if len(found) != len(key):
                raise MigrationSourceError(f"{self._where}: a key of {len(found)} values for the {len(key)} "
                                           f"columns {key}")
            keys.append([self._written(value, columns[name]) for name, value in zip(key, found, strict=True)])
        statements = [statement for names, rows in groups.items() for statement in self._upserts(names, rows)]
        statements.extend(self._deletes(key, keys))
        with _translated(f"writing {self._where}"):
            conn = self._writer_connection()
            try:
                with conn.cursor() as cur:
                    for sql, args in statements:
                        cur.execute(sql, args)
                conn.commit()
            except BaseException:
                try:
                    conn.rollback()
                except Exception:
                    self._drop_writer()  # the connection is gone (its transaction with it): the next call reconnects
                raise

    def _written(self, value: Any, column: _Column) -> Any:
        try:
            return _column_value(value, column)
        except ValueError as exc:
            raise MigrationSourceError(f"{self._where}: column {column.name} ({column.data_type}) cannot take "
                                       f"{value!r}: {exc}") from exc

    def _upserts(self, names: tuple[str, ...], rows: list[list[Any]]) -> Iterator[tuple[str, list[Any]]]:
        key = self.key_columns()
        # A row of key columns only still needs an update clause: the key's first column set to itself.
        updated = [name for name in names if name not in key] or key[:1]
        update = ", ".join(f"`{name}` = VALUES(`{name}`)" for name in updated)
        values = "(" + ", ".join(["%s"] * len(names)) + ")"
        for i in range(0, len(rows), _ROWS_PER_STATEMENT):
            batch = rows[i:i + _ROWS_PER_STATEMENT]
            yield (f"INSERT INTO `{self._table}` ({', '.join(f'`{name}`' for name in names)}) VALUES "
                   f"{', '.join([values] * len(batch))} ON DUPLICATE KEY UPDATE {update}",
                   [value for row in batch for value in row])

    def _deletes(self, key: list[str], keys: list[list[Any]]) -> Iterator[tuple[str, list[Any]]]:
        if len(key) == 1:
            target, one = f"`{key[0]}`", "%s"
        else:
            target, one = "(" + ", ".join(f"`{name}`" for name in key) + ")", "(" + ", ".join(["%s"] * len(key)) + ")"
        for i in range(0, len(keys), _ROWS_PER_STATEMENT):
            batch = keys[i:i + _ROWS_PER_STATEMENT]
            yield (f"DELETE FROM `{self._table}` WHERE {target} IN ({', '.join([one] * len(batch))})",
                   [value for found in batch for value in found])

    # -- the binlog ---------------------------------------------------------------------------------------
    def _status(self) -> int:
        """The binlog's current end (SHOW BINARY LOG STATUS, SHOW MASTER STATUS before MySQL 8.2)."""
        try:
            rows = self._query("SHOW MASTER STATUS" if self._mariadb_now() else "SHOW BINARY LOG STATUS")
        except MigrationSourceError as exc:
            cause = exc.__cause__
            if not isinstance(cause, pymysql.err.ProgrammingError) or cause.args[0] != _PARSE_ERROR:
                raise
            rows = self._query("SHOW MASTER STATUS")
        if not rows:
            raise MigrationSourceError(f"{self._where}: the server writes no binary log: start it with log_bin")
        log_file = str(rows[0][0])
        self._log_base = log_file.rsplit(".", 1)[0]
        return encode_position(log_file, int(rows[0][1]))

    def _mariadb_now(self) -> bool:
        self._connection()
        return self._mariadb

    def _base(self) -> str:
        if self._log_base is None:
            self._status()
        assert self._log_base is not None
        return self._log_base

    def _stored(self) -> int | None:
        try:
            rows = self._query(f"SELECT position FROM `{POSITIONS_TABLE}` WHERE name = %s", (self._table,))
        except MigrationSourceError as exc:
            if isinstance(exc.__cause__, pymysql.err.ProgrammingError) and exc.__cause__.args[0] == 1146:
                return None  # no such table: no capture was ever started here
            raise
        return int(rows[0][0]) if rows else None

    def _acknowledged(self) -> int:
        position = self._stored()
        if position is None:
            raise MigrationSourceError(f"{self._where}: no change capture: call start_changes first")
        return position

    def _store(self, position: int) -> None:
        # GREATEST: an acknowledgment never moves the capture back.
        self._query(f"UPDATE `{POSITIONS_TABLE}` SET position = GREATEST(position, %s) WHERE name = %s",
                    (position, self._table))

    def _check_server(self) -> None:
        [(log_bin, binlog_format, row_image)] = self._query(
            "SELECT @@GLOBAL.log_bin, @@GLOBAL.binlog_format, @@GLOBAL.binlog_row_image")
        if not int(log_bin):
            raise MigrationSourceError(f"{self._where}: the server writes no binary log: set log_bin")
        if str(binlog_format).upper() != "ROW":
            raise MigrationSourceError(f"{self._where}: binlog_format is {binlog_format}: the capture needs "
                                       "binlog_format=ROW (SET GLOBAL binlog_format=ROW, and in the server's config)")
        if str(row_image).upper() != "FULL":
            raise MigrationSourceError(f"{self._where}: binlog_row_image is {row_image}: the capture needs "
                                       "binlog_row_image=FULL (every column of a row, before and after)")
        needs_metadata = [c.name for c in self._describe()
                          if c.data_type in _BINARY_TYPES | {"enum", "set"} or c.charset not in _UTF8]
        if needs_metadata:
            rows = self._query("SHOW GLOBAL VARIABLES LIKE 'binlog_row_metadata'")
            if rows and str(rows[0][1]).upper() != "FULL":
                # Without it the binlog names no character set (the reader would decode bytes as UTF-8) and no
                # ENUM or SET member (it would read None).
                raise MigrationSourceError(
                    f"{self._where}: binlog_row_metadata is {rows[0][1]}: columns {', '.join(needs_metadata)} "
                    "are binary, not UTF-8, ENUM or SET, which the capture reads only with binlog_row_metadata=FULL")

    def _check_privileges(self, position: int) -> None:
        """REPLICATION CLIENT (MariaDB's BINLOG MONITOR) shows the binlog's position, REPLICATION SLAVE
        (REPLICATION REPLICA) reads it: both tried, so the error names exactly what is missing."""
        missing = []
        try:
            self._status()
        except MigrationSourceError as exc:
            if not (isinstance(exc.__cause__, pymysql.err.Error) and exc.__cause__.args[0] in _ACCESS_DENIED):
                raise
            missing.append("REPLICATION CLIENT (BINLOG MONITOR on MariaDB)")
        try:
            with self._stream(position or None) as stream:
                stream.fetchone()
        except MigrationSourceError as exc:
            if not (isinstance(exc.__cause__, pymysql.err.Error) and exc.__cause__.args[0] in _ACCESS_DENIED):
                raise
            missing.append("REPLICATION SLAVE")
        if missing:
            raise MigrationSourceError(f"{self._where}: user {self._target.user} lacks the privilege "
                                       f"{' and '.join(missing)} ON *.* that the capture needs")

    def start_changes(self) -> int:
        """Begin capturing the table's changes from the binlog's current position, or find the capture begun
        before (idempotent): its acknowledged position, kept in ``cellstream_migration_positions``.

        Returns:
            The position after which every committed change will be read.

        Raises:
            MigrationSourceError: binlog off, ``binlog_format`` not ROW, ``binlog_row_image`` not FULL,
                ``binlog_row_metadata`` not FULL for binary or non-UTF-8 columns, a privilege missing (named), the
                capture's binlog file purged; MigrationSourceUnavailableError: the server did not answer.
        """
        self.key_columns()
        self._check_server()
        stored = self._stored()
        try:
            position = self._status() if stored is None else stored
        except MigrationSourceError as exc:
            if not (isinstance(exc.__cause__, pymysql.err.Error) and exc.__cause__.args[0] in _ACCESS_DENIED):
                raise
            position = 0  # _check_privileges names it
        self._check_privileges(position)
        if stored is not None:
            self._check_not_purged(stored)
            return stored
        self._query(f"CREATE TABLE IF NOT EXISTS `{POSITIONS_TABLE}` (name VARCHAR(255) NOT NULL PRIMARY KEY, "
                    "position BIGINT UNSIGNED NOT NULL) ENGINE=InnoDB")
        self._query(f"INSERT IGNORE INTO `{POSITIONS_TABLE}` (name, position) VALUES (%s, %s)",
                    (self._table, position))
        return self._acknowledged()  # another process may have inserted first: its position holds

    def _logs(self) -> list[tuple[str, int]]:
        return [(str(name), int(size)) for name, size, *_ in self._query("SHOW BINARY LOGS")]

    def _check_not_purged(self, position: int) -> None:
        log_file, _ = decode_position(position, self._base())
        if log_file not in {name for name, _ in self._logs()}:
            raise MigrationSourceError(f"{self._where}: binlog {log_file}, where the capture resumes, was purged "
                                       "(expire_logs_days): the changes since are lost; start the migration again")

    @contextlib.contextmanager
    def _stream(self, position: int | None, **options: Any) -> Iterator[BinLogStreamReader]:
        self._connection()  # finds out whether a PREFERRED server offers TLS
        settings = {**self._settings(), **({"ssl_disabled": True} if self._in_clear else self._ssl())}
        # No position: the server's first binlog (an empty name), where reading needs no other privilege.
        log_file, offset = ("", 4) if position is None else decode_position(position, self._base())
        with _translated(f"reading the binlog of {self._where}"):
            # Server id 0, as mysqlbinlog's: MariaDB cuts off an older dump of the same id (4052), so a shared id
            # let `migrate status` cut off the process following the migration. An id matters only to a dump
            # that waits at the binlog's end, and every read here stops there.
            stream = BinLogStreamReader(connection_settings=settings, server_id=0, resume_stream=True,
                                        blocking=False, enable_logging=False, log_file=log_file, log_pos=offset,
                                        pymysql_wrapper=_connect_as_reader,
                                        **options)
            try:
                yield stream
            finally:
                stream.close()

    def read_changes(self, limit: int) -> list[Change]:
        """The table's changes after the acknowledged position, in commit order, whole transactions, until at
        least ``limit`` (or the binlog's end): the same ones until acknowledged. When none is found, the
        position moves on to the last transaction read (nothing of the table lies before it), so changes to
        other tables do not keep the lag up.

        Raises:
            MigrationSourceError: no capture started, its binlog purged, a setting or privilege missing;
                MigrationSourceUnavailableError: the server did not answer.
        """
        acknowledged = self._acknowledged()
        self._check_not_purged(acknowledged)
        columns, key = self._describe(), self.key_columns()
        changes: list[Change] = []
        pending: list[tuple[str, Key, dict[str, Any] | None]] = []
        in_transaction, quiet_end = False, acknowledged
        events = [*_ROW_EVENTS, XidEvent, QueryEvent, MariadbGtidEvent, GtidEvent]
        with self._stream(acknowledged, only_events=events, only_tables=[self._table],
                          only_schemas=[self._target.database]) as stream, \
                _translated(f"reading the binlog of {self._where}"):
            for event in iter(stream.fetchone, None):
                if isinstance(event, _ROW_EVENTS):
                    in_transaction = True
                    for row in event.rows:
                        image = row["after_values"] if isinstance(event, UpdateRowsEvent) else row["values"]
                        values = self._image(image, columns)
                        if isinstance(event, DeleteRowsEvent):
                            pending.append(("delete", tuple(values[k] for k in key), None))
                        else:
                            pending.append(("upsert", tuple(values[k] for k in key), values))
                elif isinstance(event, XidEvent) or (isinstance(event, QueryEvent)
                                                     and event.query.strip().upper() == "COMMIT"):
                    position = encode_position(stream.log_file, stream.log_pos)
                    changes.extend(Change(op, k, v, position) for op, k, v in pending)  # type: ignore[arg-type]
                    pending, in_transaction, quiet_end = [], False, position
                    if len(changes) >= limit:
                        break
                elif isinstance(event, MariadbGtidEvent | GtidEvent):
                    in_transaction = True
                elif isinstance(event, QueryEvent) and event.query.strip().upper() != "BEGIN" and not pending:
                    # DDL: an implicit commit of its own, with no XID
                    in_transaction = False
                    quiet_end = encode_position(stream.log_file, stream.log_pos)
            if not changes and not in_transaction:
                # The binlog's end as read: past every header of a file rotated to since.
                quiet_end = max(quiet_end, encode_position(stream.log_file, stream.log_pos))
        if not changes and quiet_end > acknowledged:
            self._store(quiet_end)
        return changes

    def _image(self, image: dict[str, Any], columns: list[_Column]) -> dict[str, Any]:
        """A row image of the binlog, by the table's columns. Without binlog_row_metadata=FULL the binlog names
        no column (the reader calls them UNKNOWN_COLn), so they are taken in table order."""
        if len(image) != len(columns):
            raise MigrationSourceError(f"{self._where}: a binlog row has {len(image)} columns, the table "
                                       f"{len(columns)}: its schema changed during the capture")
        return {c.name: _python(v, c) for c, v in zip(columns, image.values(), strict=True)}

    def acknowledge(self, position: int) -> None:
        """The changes up to ``position`` are stored: the capture resumes after it, even after a restart.

        Raises:
            MigrationSourceError: no capture started; MigrationSourceUnavailableError: the server did not answer.
        """
        self._acknowledged()
        self._store(position)

    def change_lag(self) -> ChangeLag:
        """The binlog's bytes between the acknowledged position and the current one, and the age of the first
        transaction after the acknowledged position (0 when there is none).

        Raises:
            MigrationSourceError: no capture started; MigrationSourceUnavailableError: the server did not answer.
        """
        acknowledged, current = self._acknowledged(), self._status()
        if current <= acknowledged:
            return ChangeLag(0, 0.0)
        sizes = dict(self._logs())
        base = self._base()
        lag = 0
        for number in range(acknowledged >> _OFFSET_BITS, (current >> _OFFSET_BITS) + 1):
            log_file, _ = decode_position(number << _OFFSET_BITS, base)
            start = acknowledged & 0xFFFFFFFF if number == acknowledged >> _OFFSET_BITS else 0
            end = current & 0xFFFFFFFF if number == current >> _OFFSET_BITS else sizes.get(log_file, 0)
            lag += max(0, end - start)
        oldest = None
        events = [*_ROW_EVENTS, XidEvent, QueryEvent, MariadbGtidEvent, GtidEvent]
        with self._stream(acknowledged, only_events=events) as stream, \
                _translated(f"reading the binlog of {self._where}"):
            for event in iter(stream.fetchone, None):
                if event.timestamp:
                    oldest = event.timestamp
                    break
        return ChangeLag(lag, max(0.0, time.time() - oldest) if oldest else 0.0)

    def log_position(self) -> int:
        """The binlog's current end plus one, as a boundary: a change's position is the end of its transaction's
        commit event, so a transaction committed before the call ends at or below the end read, and one
        committed after it ends strictly above.

        Raises:
            MigrationSourceError: the server writes no binlog, or REPLICATION CLIENT (BINLOG MONITOR) is missing;
                MigrationSourceUnavailableError: the server did not answer.
        """
        return self._status() + 1

    def load(self) -> SourceLoad:
        """``Threads_running`` but this connection's, and the largest lag of the replicas given (a primary does
        not know its replicas' lag): ``Seconds_Behind_Master`` (``_Source`` on MySQL 8), infinite for one whose
        replication is stopped or that does not answer (gh-ost's throttle does the same). None without
        replicas."""
        [(_, running)] = self._query("SHOW GLOBAL STATUS LIKE 'Threads_running'")
        lags = [self._replica_lag(i) for i in range(len(self._replicas))]
        return SourceLoad(max(0, int(running) - 1), max(lags) if lags else None)

    def _replica_lag(self, index: int) -> float:
        target = self._replicas[index]
        try:
            with _translated(f"reading the replication status of {target.redacted()}"):
                conn = self._replica_conns.get(index)
                if conn is None:
                    conn = self._replica_conns[index] = _connect(target, {
                        "host": target.host, "port": target.port, "user": target.user, "password": target.password,
                        "connect_timeout": 5, "autocommit": True, "cursorclass": pymysql.cursors.DictCursor})
                with conn.cursor() as cur:
                    try:
                        cur.execute("SHOW REPLICA STATUS")
                    except pymysql.err.ProgrammingError:  # MariaDB before 10.5, MySQL before 8.0.22
                        cur.execute("SHOW SLAVE STATUS")
                    rows: list[dict[str, Any]] = list(cur.fetchall())  # type: ignore[arg-type]  # a DictCursor
        except MigrationSourceError as exc:
            self._replica_conns.pop(index, None)
            logger.warning("%s: the copy waits: %s", self._where, exc)
            return math.inf
        lag = rows[0].get("Seconds_Behind_Master", rows[0].get("Seconds_Behind_Source")) if rows else None
        if lag is None:
            logger.warning("%s: replica %s does not replicate (stopped, or not a replica): the copy waits",
                           self._where, target.redacted())
            return math.inf
        return float(lag)

    def stop_changes(self) -> None:
        """End the capture: its position row is deleted (idempotent). The binlog itself is the server's, purged
        after ``expire_logs_days`` whatever readers it has.

        Raises:
            MigrationSourceUnavailableError: the server did not answer.
        """
        if self._stored() is not None:
            self._query(f"DELETE FROM `{POSITIONS_TABLE}` WHERE name = %s", (self._table,))

    def close(self) -> None:
        """Close the connections (the capture's position stays for the next run)."""
        self._drop_connection()
        self._drop_writer()
        for conn in self._replica_conns.values():
            with contextlib.suppress(pymysql.err.Error, OSError):
                conn.close()
        self._replica_conns.clear()


def _python(value: Any, column: _Column) -> Any:
    """A value of either reader as the type a cell's body holds (see the module's docstring)."""
    if value is None:
        return None
    kind = column.data_type
    if isinstance(value, datetime):
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
    if kind == "json":
        return orjson.loads(value) if isinstance(value, str | bytes) else value
    if kind == "set":
        return sorted(value.split(",") if isinstance(value, str) else value) if value != "" else []
    if kind == "bit":
        return int.from_bytes(value, "big") if isinstance(value, bytes) else int(value, 2)
    return value


def _column_value(value: Any, column: _Column) -> Any:
    """:func:`_python`'s inverse on a cell body's forms (what ``json_value`` makes of its values), as pymysql
    writes them to the column: a time as a naive UTC datetime (the session is UTC), a TIME's seconds as a
    timedelta, base64 as bytes, JSON as its text, a SET's list joined. Decimal text, a BIT's int, numbers and
    strings go as they are.

    Raises:
        ValueError: text that is not the column's form (ISO 8601 for a time, base64 for a binary string).
    """
    if value is None:
        return None
    kind = column.data_type
    if kind in ("datetime", "timestamp") and isinstance(value, str):
        value = datetime.fromisoformat(value)
    if isinstance(value, datetime):
        return value if value.tzinfo is None else value.astimezone(UTC).replace(tzinfo=None)
    if kind == "time" and isinstance(value, int | float) and not isinstance(value, bool):
        return timedelta(seconds=value)  # the driver reads TIME as a timedelta, json_value gives its seconds
    if kind in _BINARY_TYPES and isinstance(value, str):
        return base64.b64decode(value, validate=True)
    if kind == "json":
        return json.dumps(value, ensure_ascii=False)
    if kind == "set" and isinstance(value, list | tuple):
        return ",".join(value)
    return value
