"""connectors.migration.sources.mysql against real MariaDB: the shared server (row-based binlog) and, for the
server settings it refuses, a private one."""

from __future__ import annotations

import functools
import random
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import pymysql
import pytest

from connectors.errors import MigrationSourceError, MigrationSourceUnavailableError
from connectors.migration.mapping import json_value
from connectors.migration.source import Change, Key, SourceRow
from connectors.migration.sources.mysql import MySQLSource
from tests.harness.private_mariadb import PrivateMariaDB
from tests.harness.services import free_port


def connect(url: str) -> pymysql.connections.Connection:
    """A connection to the test's database (created when missing), autocommit."""
    rest, database = url.removeprefix("mysql://").rsplit("/", 1)
    credentials, address = rest.split("@")
    user, password = credentials.split(":")
    host, port = address.split(":")
    conn = pymysql.connect(host=host, port=int(port), user=user, password=password, autocommit=True)
    with conn.cursor() as cur:
        cur.execute(f"CREATE DATABASE IF NOT EXISTS `{database}`")
    conn.select_db(database)
    return conn


def execute(conn: pymysql.connections.Connection, *statements: str) -> None:
    with conn.cursor() as cur:
        for statement in statements:
            cur.execute(statement)


@pytest.fixture
def db(mysql_database: str) -> Iterator[tuple[str, pymysql.connections.Connection]]:
    """A database on the shared server with a table ``t`` of a composite key (a, b)."""
    conn = connect(mysql_database)
    execute(conn, "CREATE TABLE t (a INT NOT NULL, b VARCHAR(20) NOT NULL, v INT, note TEXT, "
                  "PRIMARY KEY (a, b)) ENGINE=InnoDB")
    yield mysql_database, conn
    conn.close()


@pytest.fixture
def source(db: tuple[str, pymysql.connections.Connection]) -> Iterator[MySQLSource]:
    made = MySQLSource(db[0], "t")
    yield made
    made.close()


def drain(source: MySQLSource, limit: int = 1000) -> list[Change]:
    """Every change until the binlog's end, acknowledged as read."""
    found: list[Change] = []
    while batch := source.read_changes(limit):
        found.extend(batch)
        source.acknowledge(batch[-1].position)
    return found


def test_chunks_cover_a_composite_key_table_once_in_key_order(
    db: tuple[str, pymysql.connections.Connection], source: MySQLSource
) -> None:
    rows = [(a, b) for a in range(1, 8) for b in ("x", "y", "z", "ab")]
    random.shuffle(rows)
    execute(db[1], "INSERT INTO t (a, b, v) VALUES " + ", ".join(f"({a}, '{b}', {a})" for a, b in rows))
    assert source.key_columns() == ["a", "b"]
    assert source.columns() == ["a", "b", "v", "note"]
    keys: list[Key] = []
    after: Key | None = None
    for _ in range(len(rows)):  # bounded: chunks that never advance fail the test instead of hanging it
        chunk = source.read_chunk(after, 5)
        if chunk.last is None:
            assert chunk.rows == []
            break
        assert len(chunk.rows) <= 5 and chunk.last == chunk.rows[-1].key
        keys.extend(row.key for row in chunk.rows)
        after = chunk.last
    assert keys == sorted(rows)
    assert [r.key for r in source.rows_between((2, "z"), (4, "x"))] == [(3, "ab"), (3, "x"), (3, "y"), (3, "z"),
                                                                        (4, "ab"), (4, "x")]
    assert [r.key for r in source.rows_between(None, (1, "x"))] == [(1, "ab"), (1, "x")]


def test_a_chunks_position_is_below_every_change_it_does_not_show(
    db: tuple[str, pymysql.connections.Connection], source: MySQLSource
) -> None:
    start = source.start_changes()
    execute(db[1], "INSERT INTO t (a, b, v) VALUES (1, 'x', 1)")
    chunk = source.read_chunk(None, 10)
    execute(db[1], "UPDATE t SET v = 2 WHERE a = 1")
    shown, hidden = drain(source)
    assert [r.values["v"] for r in chunk.rows] == [1]
    assert (shown.values or {})["v"] == 1 and (hidden.values or {})["v"] == 2
    assert start < shown.position <= chunk.position < hidden.position


class WritingDuringSnapshots(MySQLSource):
    """A source that has a write committed right after each chunk's snapshot begins, before the chunk is read."""

    def __init__(self, url: str, write: str) -> None:
        super().__init__(url, "t")
        self.writer, self.write = connect(url), write

    def _query(self, sql: str, args: Any = None) -> list[tuple[Any, ...]]:
        found = super()._query(sql, args)
        if sql.startswith("START TRANSACTION"):
            execute(self.writer, self.write)
        return found


def test_a_write_committed_during_a_chunks_snapshot_lies_above_its_position(
    db: tuple[str, pymysql.connections.Connection]
) -> None:
    execute(db[1], "INSERT INTO t (a, b, v) VALUES (1, 'x', 1)")
    source = WritingDuringSnapshots(db[0], "UPDATE t SET v = v + 1")
    try:
        source.start_changes()
        chunk = source.read_chunk(None, 10)
        [change] = source.read_changes(10)
    finally:
        source.close()
        source.writer.close()
    assert [r.values["v"] for r in chunk.rows] == [1]  # the snapshot began before the write
    assert (change.values or {})["v"] == 2 and change.position > chunk.position


def test_changes_come_again_until_acknowledged_and_a_restart_resumes_from_there(
    db: tuple[str, pymysql.connections.Connection]
) -> None:
    url, conn = db
    first = MySQLSource(url, "t")
    start = first.start_changes()
    assert first.start_changes() == start  # idempotent
    execute(conn, "INSERT INTO t (a, b, v) VALUES (1, 'x', 1)", "INSERT INTO t (a, b, v) VALUES (2, 'x', 2)")
    once = first.read_changes(1)
    assert [c.key for c in once] == [(1, "x")]
    assert first.read_changes(1) == once  # not acknowledged: the same again
    first.acknowledge(once[0].position)
    first.close()
    restarted = MySQLSource(url, "t")
    assert restarted.start_changes() == once[0].position  # the acknowledged position, not the binlog's end
    assert [c.key for c in restarted.read_changes(10)] == [(2, "x")]
    restarted.stop_changes()
    restarted.stop_changes()  # idempotent
    with pytest.raises(MigrationSourceError, match="start_changes"):
        restarted.read_changes(10)
    restarted.close()


def test_a_reader_is_not_cut_off_by_another_reading_the_same_capture(
    db: tuple[str, pymysql.connections.Connection]
) -> None:
    """`migrate status` (a lag probe) while the process following the migration reads: MariaDB ends an older
    binlog dump of the same replica id with error 4052, so neither may end the other's."""
    url, conn = db
    follower, prober = MySQLSource(url, "t"), MySQLSource(url, "t")
    try:
        follower.start_changes()
        for batch in range(40):  # some MB: the follower's dump is still streaming while the probes start
            execute(conn, "INSERT INTO t (a, b, note) VALUES "
                          + ", ".join(f"({batch * 100 + i}, 'x', REPEAT('n', 1000))" for i in range(100)))
        read: list[list[Change]] = []
        failed: list[BaseException] = []

        def follow() -> None:
            try:
                read.append(follower.read_changes(10**6))
            except BaseException as exc:
                failed.append(exc)

        reading = threading.Thread(target=follow)
        reading.start()
        probes_during_read = 0
        while reading.is_alive():
            assert prober.change_lag().bytes > 0
            probes_during_read += reading.is_alive()
        reading.join()
        assert not failed, failed
        assert probes_during_read > 0
        assert len(read[0]) == 4000
    finally:
        follower.close()
        prober.close()


def test_transactions_are_whole_share_a_position_and_positions_increase_across_a_rotation(
    db: tuple[str, pymysql.connections.Connection], source: MySQLSource
) -> None:
    conn = db[1]
    source.start_changes()
    execute(conn, "BEGIN", *(f"INSERT INTO t (a, b, v) VALUES ({i}, 'x', {i})" for i in range(5)), "COMMIT")
    execute(conn, "FLUSH BINARY LOGS")
    execute(conn, "BEGIN", "UPDATE t SET v = v + 10 WHERE a < 3", "DELETE FROM t WHERE a = 4", "COMMIT")
    first = source.read_changes(2)  # a limit inside the transaction: the transaction is whole all the same
    assert [c.key for c in first] == [(i, "x") for i in range(5)]
    assert len({c.position for c in first}) == 1
    source.acknowledge(first[0].position)
    second = source.read_changes(100)
    assert [(c.op, c.key) for c in second] == [*(("upsert", (i, "x")) for i in range(3)), ("delete", (4, "x"))]
    assert len({c.position for c in second}) == 1
    assert second[0].position >> 32 > first[0].position >> 32  # the next binlog file
    assert second[0].position > first[0].position
    assert second[-1].values is None  # a delete carries the key only


def test_a_workload_during_the_copy_merges_into_the_table(
    db: tuple[str, pymysql.connections.Connection], source: MySQLSource
) -> None:
    url, conn = db
    execute(conn, "INSERT INTO t (a, b, v) VALUES " + ", ".join(f"({a}, 'k', 0)" for a in range(300)))
    source.start_changes()
    stop = threading.Event()
    progress = threading.Condition()
    steps = [0]
    writer = connect(url)

    errors: list[BaseException] = []

    def workload() -> None:
        try:
            writes()
        except BaseException as exc:  # seen by the test, not lost in the thread
            errors.append(exc)
            raise

    def writes() -> None:
        rng = random.Random(53)
        step = 0
        while not stop.is_set():
            step += 1
            with progress:
                steps[0] = step
                progress.notify_all()
            a = rng.randrange(400)
            op = rng.random()
            if op < 0.5:
                execute(writer, f"INSERT INTO t (a, b, v) VALUES ({a}, 'k', {step}) "
                                f"ON DUPLICATE KEY UPDATE v = {step}")
            elif op < 0.8:
                execute(writer, "BEGIN", f"UPDATE t SET v = {step} WHERE a BETWEEN {a} AND {a + 5}", "COMMIT")
            else:
                execute(writer, f"DELETE FROM t WHERE a = {a}")

    def wrote(target: int) -> bool:
        return steps[0] >= target or not thread.is_alive()

    thread = threading.Thread(target=workload)
    thread.start()
    merged: dict[Key, tuple[int, dict[str, Any] | None]] = {}

    def merge(key: Key, position: int, values: dict[str, Any] | None) -> None:
        if key not in merged or merged[key][0] <= position:  # a change wins over a chunk at its position
            merged[key] = (position, values)

    try:
        after: Key | None = None
        for _ in range(100):  # bounded, as above
            chunk = source.read_chunk(after, 20)
            for row in chunk.rows:
                merge(row.key, chunk.position, row.values)
            for change in source.read_changes(50):
                merge(change.key, change.position, change.values)
            if chunk.last is None:
                break
            after = chunk.last
            with progress:  # a few writes between two chunks, whatever the threads' pace
                assert progress.wait_for(functools.partial(wrote, steps[0] + 5), timeout=60)
    finally:
        stop.set()
        thread.join()
        writer.close()
    assert errors == []
    for change in drain(source):
        merge(change.key, change.position, change.values)
    table = {row.key: row.values for row in source.rows_between(None, None)}
    assert {key: values for key, (_, values) in merged.items() if values is not None} == table


def test_values_convert_to_what_a_body_holds(mysql_database: str) -> None:
    conn = connect(mysql_database)
    execute(conn, "CREATE TABLE ty (id BIGINT PRIMARY KEY, d DATETIME(6), ts TIMESTAMP NULL, n DECIMAL(12,4), "
                  "j JSON, s VARCHAR(10), bits BIT(5))")
    source = MySQLSource(mysql_database, "ty")
    try:
        source.start_changes()
        execute(conn, "INSERT INTO ty VALUES (1, '2024-02-03 04:05:06.789', '2024-02-03 04:05:06', 12.5, "
                      "'{\"k\": [1, \"é\"]}', 'héllo', b'10101')")
        [change] = source.read_changes(10)
        [row] = source.read_chunk(None, 10).rows
    finally:
        source.close()
        conn.close()
    expected = {"id": 1, "d": datetime(2024, 2, 3, 4, 5, 6, 789000, tzinfo=UTC),
                "ts": datetime(2024, 2, 3, 4, 5, 6, tzinfo=UTC), "n": Decimal("12.5000"),
                "j": {"k": [1, "é"]}, "s": "héllo", "bits": 21}
    assert change.values == expected
    assert row.values == expected


def test_missing_replication_privileges_are_named(db: tuple[str, pymysql.connections.Connection]) -> None:
    url, conn = db
    database = url.rsplit("/", 1)[1]
    user = f"cst_{uuid.uuid4().hex[:8]}"
    execute(conn, f"CREATE USER '{user}'@'%' IDENTIFIED BY 'pw'", f"GRANT ALL ON `{database}`.* TO '{user}'@'%'")
    try:
        limited = MySQLSource(url.replace("cellstream:cellstream@", f"{user}:pw@"), "t")
        with pytest.raises(MigrationSourceError, match=r"REPLICATION CLIENT.* and REPLICATION SLAVE"):
            limited.start_changes()
        limited.close()
        execute(conn, f"GRANT BINLOG MONITOR ON *.* TO '{user}'@'%'")
        limited = MySQLSource(url.replace("cellstream:cellstream@", f"{user}:pw@"), "t")
        with pytest.raises(MigrationSourceError, match=r"lacks the privilege REPLICATION SLAVE ON"):
            limited.start_changes()
        limited.close()
    finally:
        execute(conn, f"DROP USER '{user}'@'%'")


def checkpointed(conn: pymysql.connections.Connection) -> None:
    """Wait until the new binlog has the Binlog_checkpoint event naming itself, which MariaDB writes after a
    rotation in the background (the binlog's end moves by it)."""
    with conn.cursor() as cur:
        for _ in range(200):
            cur.execute("SHOW MASTER STATUS")
            [(current, *_)] = cur.fetchall()
            cur.execute(f"SHOW BINLOG EVENTS IN '{current}'")
            if any(event[2] == "Binlog_checkpoint" and event[5] == current for event in cur.fetchall()):
                return
            time.sleep(0.05)
    raise AssertionError("no Binlog_checkpoint event after FLUSH BINARY LOGS")


@pytest.fixture(scope="module")
def statement_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateMariaDB]:
    """A private MariaDB writing a statement-based binlog, whose global settings the tests may change."""
    with PrivateMariaDB(tmp_path_factory.mktemp("mariadb"), options=[
            "--server-id=1", "--log-bin=mysql-bin", "--binlog-format=STATEMENT", "--binlog-row-metadata=FULL"]) as db:
        yield db


def test_settings_the_capture_needs_are_named(statement_server: PrivateMariaDB) -> None:
    url = statement_server.url("src")
    conn = connect(url)
    execute(conn, "CREATE TABLE b (id INT PRIMARY KEY, raw VARBINARY(16), st SET('a','b','c'), e ENUM('x','y'))")
    source = MySQLSource(url, "b")
    try:
        with pytest.raises(MigrationSourceError, match="binlog_format is STATEMENT"):
            source.start_changes()
        execute(conn, "SET GLOBAL binlog_format = ROW", "SET GLOBAL binlog_row_metadata = NO_LOG")
        with pytest.raises(MigrationSourceError, match="binlog_row_metadata is NO_LOG: columns raw, st, e"):
            source.start_changes()
        execute(conn, "SET GLOBAL binlog_row_metadata = FULL")
        conn.close()
        conn = connect(url)  # a global binlog_format holds for the sessions begun after it
        source.start_changes()
        raw = bytes([0, 255, 128, 10])  # not UTF-8: the binlog's metadata says it is binary
        execute(conn, f"INSERT INTO b VALUES (1, x'{raw.hex()}', 'c,a', 'y')")
        [change] = source.read_changes(10)
        assert change.values == {"id": 1, "raw": raw, "st": ["a", "c"], "e": "y"}
        assert source.read_chunk(None, 1).rows[0].values == change.values
        assert source.change_lag().bytes > 0
        source.acknowledge(change.position)
        assert source.read_changes(10) == []
        assert source.change_lag() == (0, 0.0)
        # Other tables' transactions and a rotation: nothing of the table's, the capture moves past them.
        execute(conn, "CREATE TABLE other (id INT PRIMARY KEY)", "INSERT INTO other VALUES (1)", "FLUSH BINARY LOGS")
        checkpointed(conn)
        lag = source.change_lag()
        assert lag.bytes > 0 and lag.seconds > 0
        assert source.read_changes(10) == []
        assert source.change_lag() == (0, 0.0)
    finally:
        source.close()
        conn.close()


def test_a_table_without_a_primary_key_is_refused(db: tuple[str, pymysql.connections.Connection]) -> None:
    execute(db[1], "CREATE TABLE nokey (v INT)")
    source = MySQLSource(db[0], "nokey")
    with pytest.raises(MigrationSourceError, match="no primary key"):
        source.key_columns()
    with pytest.raises(MigrationSourceError, match="no such table"):
        MySQLSource(db[0], "absent").columns()
    source.close()


def test_an_unanswering_server_is_unavailable() -> None:
    source = MySQLSource(f"mysql://u:secret@127.0.0.1:{free_port()}/x", "t")
    with pytest.raises(MigrationSourceUnavailableError) as raised:
        source.columns()
    assert "secret" not in str(raised.value)


def test_the_load_counts_the_statements_running_but_its_own(mysql_database: str) -> None:
    """What the copy's --max-load reads: Threads_running less the source's own connection."""
    conn = connect(mysql_database)
    execute(conn, "CREATE TABLE trips (id INT PRIMARY KEY)")
    src = MySQLSource(mysql_database, "trips")
    busy = threading.Thread(target=lambda: connect(mysql_database).cursor().execute("SELECT SLEEP(2)"), daemon=True)
    try:
        # The server's other statements (another test's, the replica's threads) come and go: the quietest of a
        # few looks is the baseline, and the look that saw the sleep is the one asserted (a look again races it).
        idle = min(src.load().running for _ in range(20))
        busy.start()
        deadline = time.monotonic() + 10
        seen = src.load()
        while seen.running <= idle and time.monotonic() < deadline:
            time.sleep(0.01)
            seen = src.load()
        assert seen.running > idle and seen.replica_lag is None
    finally:
        busy.join()
        src.close()
        conn.close()


def test_the_log_position_lies_between_the_changes_committed_before_and_after_it(
    db: tuple[str, pymysql.connections.Connection], source: MySQLSource
) -> None:
    source.start_changes()
    execute(db[1], "INSERT INTO t (a, b, v) VALUES (1, 'x', 1)")
    boundary = source.log_position()
    execute(db[1], "INSERT INTO t (a, b, v) VALUES (2, 'x', 2)")
    before, after = drain(source)
    assert (before.key, after.key) == ((1, "x"), (2, "x"))
    assert before.position < boundary <= after.position


def test_written_rows_go_to_the_binlog_in_one_transaction(
    db: tuple[str, pymysql.connections.Connection], source: MySQLSource
) -> None:
    """The capture (and so the source's replicas) sees write_rows' writes, though the source's own session
    keeps its bookkeeping out of the binlog; a row given some columns keeps the others."""
    execute(db[1], "INSERT INTO t (a, b, v, note) VALUES (1, 'x', 1, 'keep'), (3, 'z', 3, NULL), (4, 'w', 4, NULL)")
    source.start_changes()
    source.write_rows([{"a": 1, "b": "x", "v": 5}, {"a": 2, "b": "y", "v": 2, "note": "new"}], [(3, "z"), (4, "w")])
    changes = drain(source)
    assert [(c.op, c.key, c.values) for c in changes] == [
        ("upsert", (1, "x"), {"a": 1, "b": "x", "v": 5, "note": "keep"}),
        ("upsert", (2, "y"), {"a": 2, "b": "y", "v": 2, "note": "new"}),
        ("delete", (3, "z"), None), ("delete", (4, "w"), None)]
    assert len({c.position for c in changes}) == 1  # one transaction
    assert [r.key for r in source.rows_between(None, None)] == [(1, "x"), (2, "y")]


def test_a_refused_batch_writes_nothing(db: tuple[str, pymysql.connections.Connection]) -> None:
    execute(db[1], "CREATE TABLE nn (id INT PRIMARY KEY, v INT NOT NULL, note TEXT)")
    source = MySQLSource(db[0], "nn")
    try:
        # Two column sets, two statements: the second one's refusal undoes the first's row.
        with pytest.raises(MigrationSourceError, match="cannot be null"):
            source.write_rows([{"id": 1, "v": 1, "note": "a"}, {"id": 2, "v": None}], [])
        source.write_rows([{"id": 3, "v": 3}], [])  # a later commit on the same session commits only its own
        assert [r.key for r in source.rows_between(None, None)] == [(3,)]
        with pytest.raises(MigrationSourceError, match="lacks the primary-key column id"):
            source.write_rows([{"id": 4, "v": 4}, {"v": 5}], [])
        with pytest.raises(MigrationSourceError, match="a key of 2 values"):
            source.write_rows([{"id": 4, "v": 4}], [(3, 1)])
        with pytest.raises(MigrationSourceError, match="names w, not a column"):
            source.write_rows([{"id": 4, "v": 4, "w": 1}], [])
        assert [r.key for r in source.rows_between(None, None)] == [(3,)]
    finally:
        source.close()


def test_no_rows_to_write_send_nothing() -> None:
    source = MySQLSource(f"mysql://u:secret@127.0.0.1:{free_port()}/x", "t")
    source.write_rows([], [])  # not even a connection: the server is not there
    source.close()


def test_values_read_back_equal_after_their_body_forms_are_written(mysql_database: str) -> None:
    """A row read, turned into a body's values (json_value), written to another key and read again is the same
    row: write_rows converts each form back by the column's type."""
    conn = connect(mysql_database)
    execute(conn, "CREATE TABLE rt (id BIGINT PRIMARY KEY, d DATETIME(6), ts TIMESTAMP(6) NULL, dd DATE, "
                  "tm TIME(6), neg TIME, n DECIMAL(12,4), j JSON, s VARCHAR(10), raw VARBINARY(16), bl BLOB, "
                  "bits BIT(5), st SET('a','b','c'), e ENUM('x','y'), f DOUBLE, flag TINYINT(1), y YEAR)",
            "INSERT INTO rt VALUES (1, '2024-02-03 04:05:06.789', '2024-02-03 04:05:06.5', '2024-02-29', "
            "'12:34:56.789', '-01:02:03', 12.5, '{\"k\": [1, \"é\", null]}', 'héllo', x'00ff800a', x'c3', "
            "b'10101', 'c,a', 'y', 1.25, 1, 2024)",
            "INSERT INTO rt (id) VALUES (3)")
    source = MySQLSource(mysql_database, "rt")
    try:
        for read, written in ((1, 2), (3, 4)):
            row = source.read_row((read,))
            assert row is not None
            body = {name: json_value(value) for name, value in row.values.items()}
            source.write_rows([{**body, "id": written}], [])
            assert source.read_row((written,)) == SourceRow((written,), {**row.values, "id": written})
        # An offset other than UTC is the same instant in UTC.
        source.write_rows([{"id": 2, "d": "2024-02-03T06:05:06+02:00"}], [])
        again = source.read_row((2,))
        assert again is not None and again.values["d"] == datetime(2024, 2, 3, 4, 5, 6, tzinfo=UTC)
        source.write_rows([], [(2,), (4,)])
        assert [r.key for r in source.rows_between(None, None)] == [(1,), (3,)]
    finally:
        source.close()
        conn.close()
