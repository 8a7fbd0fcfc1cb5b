"""The PostgreSQL source of a migration (connectors/migration/sources/postgres.py) against real servers: the one
with wal_level=logical on 5433 (``postgres_source_database``), the shared one on 5432 (wal_level=replica), and a
private one whose commits wait for a synchronous standby that never comes (a commit stuck between its commit
record and becoming visible)."""

from __future__ import annotations

import contextlib
import datetime as dt
import decimal
import random
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from connectors.errors import MigrationSourceError, MigrationSourceUnavailableError
from connectors.migration.mapping import json_value
from connectors.migration.source import Change, Chunk, Key
from connectors.migration.sources.postgres import PostgresSource, int_to_lsn, lsn_to_int
from tests.harness.private_postgres import PrivatePostgreSQL, scratch_dir


def source(url: str, table: str = "trips", **options: Any) -> PostgresSource:
    return PostgresSource(url, table, slot=f"s_{uuid.uuid4().hex[:10]}", publication="pub_mig", **options)


@pytest.fixture
def db(postgres_source_database: str) -> Iterator[psycopg.Connection[tuple[Any, ...]]]:
    with psycopg.connect(postgres_source_database, autocommit=True) as conn:
        conn.execute("CREATE TABLE trips (city text, id int, fare numeric(8, 2), note text, PRIMARY KEY (city, id))")
        yield conn


@pytest.fixture
def src(db: psycopg.Connection[tuple[Any, ...]], postgres_source_database: str) -> Iterator[PostgresSource]:
    s = source(postgres_source_database)
    try:
        yield s
    finally:
        s.close()


def all_changes(src: PostgresSource, limit: int = 100) -> list[Change]:
    """Every change not yet acknowledged, acknowledging as it reads."""
    out: list[Change] = []
    while batch := src.read_changes(limit):
        out += batch
        src.acknowledge(batch[-1].position)
    return out


def test_lsn_text_round_trips() -> None:
    assert lsn_to_int("16/B374D848") == (0x16 << 32) + 0xB374D848
    assert int_to_lsn(lsn_to_int("16/B374D848")) == "16/B374D848"


def test_chunks_cover_the_table_once_in_key_order(db: psycopg.Connection[tuple[Any, ...]],
                                                  src: PostgresSource) -> None:
    rows = [(city, i) for city in ("b", "a", "c") for i in range(20, 0, -1)]
    random.shuffle(rows)
    with db.cursor() as cur:
        cur.executemany("INSERT INTO trips VALUES (%s, %s, %s, 'n')", [(c, i, i) for c, i in rows])
    assert src.key_columns() == ["city", "id"] and src.columns() == ["city", "id", "fare", "note"]
    seen: list[Key] = []
    after: Key | None = None
    while (chunk := src.read_chunk(after, 7)).rows:
        assert chunk.last == chunk.rows[-1].key and len(chunk.rows) <= 7
        seen += [row.key for row in chunk.rows]
        assert len(seen) <= len(rows), "a row came twice"
        assert all(row.values["fare"] == decimal.Decimal(row.key[1]) for row in chunk.rows)
        after = chunk.last
    assert chunk.last is None
    assert seen == sorted(rows)
    assert [r.key for r in src.rows_between(("a", 18), ("b", 2))] == [("a", 19), ("a", 20), ("b", 1), ("b", 2)]
    assert [r.key for r in src.rows_between(None, ("a", 2))] == [("a", 1), ("a", 2)]
    assert len(src.rows_between(("c", 19), None)) == 1


def test_changes_after_a_chunk_commit_above_its_position(db: psycopg.Connection[tuple[Any, ...]],
                                                        src: PostgresSource) -> None:
    db.execute("INSERT INTO trips SELECT 'a', g, g, 'old' FROM generate_series(1, 5) g")
    start = src.start_changes()
    all_changes(src)
    chunk = src.read_chunk(None, 100)
    assert chunk.position >= start - 1 and [r.key for r in chunk.rows] == [("a", i) for i in range(1, 6)]
    db.execute("INSERT INTO trips VALUES ('a', 6, 6, 'new')")
    db.execute("UPDATE trips SET note = 'upd' WHERE id = 2")
    db.execute("DELETE FROM trips WHERE id = 3")
    changes = all_changes(src)
    assert [(c.op, c.key) for c in changes] == [("upsert", ("a", 6)), ("upsert", ("a", 2)), ("delete", ("a", 3))]
    assert all(c.position > chunk.position for c in changes)
    assert changes[0].position < changes[1].position < changes[2].position
    assert changes[1].values == {"city": "a", "id": 2, "fare": decimal.Decimal("2.00"), "note": "upd"}
    assert changes[2].values is None


def test_a_chunk_waits_for_no_transaction_that_cannot_be_committing_to_the_table(
        db: psycopg.Connection[tuple[Any, ...]], postgres_source_database: str) -> None:
    db.execute("CREATE TABLE other (id int PRIMARY KEY)")
    db.execute("INSERT INTO trips VALUES ('a', 1, 1, 'before')")
    src = source(postgres_source_database, chunk_wait=0.5)
    src.start_changes()
    idle = psycopg.connect(postgres_source_database)  # a transaction that wrote the table, idle: not committing
    busy = psycopg.connect(postgres_source_database)  # a statement running in one that wrote another table

    def sleep() -> None:
        with contextlib.suppress(psycopg.errors.QueryCanceled):  # cancelled at the end
            busy.execute("SELECT pg_sleep(60)")
    sleeper = threading.Thread(target=sleep)
    try:
        idle.execute("UPDATE trips SET note = 'after' WHERE id = 1")
        busy.execute("INSERT INTO other VALUES (1)")
        sleeper.start()
        while db.execute("SELECT count(*) FROM pg_stat_activity WHERE query = 'SELECT pg_sleep(60)' "
                         "AND state = 'active'").fetchone() != (1,):
            time.sleep(0.01)
        chunk = src.read_chunk(None, 10)  # neither may hold it (chunk_wait is short)
        assert chunk.rows[0].values["note"] == "before"
        idle.commit()
        [change] = src.read_changes(10)
        assert change.position > chunk.position
    finally:
        busy.cancel_safe()
        sleeper.join()
        idle.close()
        busy.close()
        src.stop_changes()
        src.close()


def test_changes_come_again_until_acknowledged_and_transactions_are_whole(db: psycopg.Connection[tuple[Any, ...]],
                                                                         src: PostgresSource) -> None:
    src.start_changes()
    with db.transaction():
        for i in range(5):
            db.execute("INSERT INTO trips VALUES ('t', %s, 1, 'x')", [i])
    db.execute("UPDATE trips SET note = 'y' WHERE id = 0")
    db.execute("DELETE FROM trips WHERE id = 1")
    first = src.read_changes(1)  # a limit below the transaction's size: the transaction comes whole
    assert [c.key for c in first] == [("t", i) for i in range(5)]
    assert len({c.position for c in first}) == 1
    assert src.read_changes(1) == first  # not acknowledged: again
    everything = src.read_changes(100)
    assert everything[:5] == first and len(everything) == 7
    assert everything[5].position > first[0].position and everything[6].position > everything[5].position
    src.acknowledge(first[0].position)
    assert src.read_changes(100) == everything[5:]
    src.acknowledge(first[0].position)  # an older position: nothing moves back
    src.acknowledge(everything[-1].position)
    assert src.read_changes(100) == []


def test_deletes_and_key_changes_carry_the_key(db: psycopg.Connection[tuple[Any, ...]], src: PostgresSource) -> None:
    db.execute("INSERT INTO trips VALUES ('a', 1, 1, 'x'), ('a', 2, 2, 'y')")
    src.start_changes()
    db.execute("DELETE FROM trips WHERE id = 1")
    db.execute("UPDATE trips SET city = 'b' WHERE id = 2")
    changes = all_changes(src)
    assert [(c.op, c.key, c.values) for c in changes] == [
        ("delete", ("a", 1), None), ("delete", ("a", 2), None),
        ("upsert", ("b", 2), {"city": "b", "id": 2, "fare": decimal.Decimal("2.00"), "note": "y"})]
    assert changes[1].position == changes[2].position


def test_types_convert_alike_in_chunks_and_changes(db: psycopg.Connection[tuple[Any, ...]],
                                                   postgres_source_database: str) -> None:
    db.execute("CREATE TABLE typed (id bigint PRIMARY KEY, s smallint, i int, n numeric, t text, v varchar(9), "
               "b bool, f4 real, f8 float8, ts timestamp, tz timestamptz, d date, u uuid, j json, jb jsonb, "
               "by bytea, arr int[], big text, other inet)")
    s = source(postgres_source_database, "typed")
    try:
        s.start_changes()
        row_id = uuid.uuid4()
        big = "".join(random.choice("abcdef0123") for _ in range(200_000))  # stored out of line (TOAST)
        db.execute("SET TimeZone TO 'America/New_York'")  # the writer's zone does not matter
        db.execute("INSERT INTO typed VALUES (1, 2, 3, 4.50, 'te''xt', 'v', true, 1.5, 2.25, '2024-01-02 03:04:05.5', "
                   "'2024-01-02 03:04:05+02', '2024-02-29', %s, '{\"a\": [1, 2]}', '{\"b\": null}', '\\x00ff', "
                   "'{1,2}', %s, '10.0.0.1')", [row_id, big])
        db.execute("UPDATE typed SET s = 7 WHERE id = 1")  # big unchanged: the log does not repeat it
        expected = {"id": 1, "s": 2, "i": 3, "n": decimal.Decimal("4.50"), "t": "te'xt", "v": "v", "b": True,
                    "f4": 1.5, "f8": 2.25, "ts": dt.datetime(2024, 1, 2, 3, 4, 5, 500000, tzinfo=dt.UTC),
                    "tz": dt.datetime(2024, 1, 2, 1, 4, 5, tzinfo=dt.UTC), "d": dt.date(2024, 2, 29), "u": row_id,
                    "j": {"a": [1, 2]}, "jb": {"b": None}, "by": b"\x00\xff", "arr": "{1,2}", "big": big,
                    "other": "10.0.0.1"}
        inserted, updated = all_changes(s)
        assert inserted.values == expected
        assert updated.values == {**expected, "s": 7}
        [row] = s.read_chunk(None, 10).rows
        assert row.values == {**expected, "s": 7} and row.key == (1,)
        assert all(type(row.values[k]) is type(v) for k, v in expected.items())
    finally:
        s.close()


def test_truncate_is_an_error_naming_it(db: psycopg.Connection[tuple[Any, ...]], src: PostgresSource) -> None:
    src.start_changes()
    db.execute("INSERT INTO trips VALUES ('a', 1, 1, 'x')")
    db.execute("TRUNCATE trips")
    with pytest.raises(MigrationSourceError, match="truncated"):
        src.read_changes(100)


def test_stop_changes_leaves_no_slot_nor_publication(db: psycopg.Connection[tuple[Any, ...]],
                                                     src: PostgresSource) -> None:
    def present() -> tuple[bool, bool]:
        [(slot, pub)] = db.execute(
            "SELECT EXISTS (SELECT FROM pg_replication_slots WHERE slot_name = %s), "
            "EXISTS (SELECT FROM pg_publication WHERE pubname = %s)", [src.slot, src.publication]).fetchall()
        return slot, pub
    first = src.start_changes()
    assert src.start_changes() == first  # idempotent: the same slot
    assert present() == (True, True)
    db.execute("INSERT INTO trips VALUES ('a', 1, 1, 'x')")
    lag = src.change_lag()
    assert lag.bytes > 0 and lag.seconds > 0  # its commit is older than the server's clock now
    all_changes(src)
    assert src.change_lag().seconds == 0
    src.stop_changes()
    assert present() == (False, False)
    src.stop_changes()  # idempotent
    with pytest.raises(MigrationSourceError, match="no replication slot"):
        src.read_changes(10)


def test_a_server_without_logical_wal_is_refused_naming_it(postgres_database: str) -> None:
    with psycopg.connect(postgres_database, autocommit=True) as conn:
        # The harness keeps the shared PostgreSQL at wal_level=replica for this (tests/harness/servers.py).
        assert conn.execute("SHOW wal_level").fetchone() != ("logical",), "the shared PostgreSQL must not be logical"
        conn.execute("CREATE TABLE trips (id int PRIMARY KEY)")
    s = source(postgres_database)
    try:
        with pytest.raises(MigrationSourceError, match="wal_level=logical"):
            s.start_changes()
    finally:
        s.close()


def test_no_table_and_no_key_are_errors(db: psycopg.Connection[tuple[Any, ...]], postgres_source_database: str) -> None:
    db.execute("CREATE TABLE loose (a int)")
    for table, message in (("missing", "no table"), ("loose", "no primary key")):
        s = source(postgres_source_database, table)
        with pytest.raises(MigrationSourceError, match=message):
            s.key_columns()
        s.close()
    with pytest.raises(MigrationSourceUnavailableError) as refused:
        source("postgresql://cellstream:wrong-secret@127.0.0.1:1/x").columns()
    assert "wrong-secret" not in str(refused.value)


def merge(state: dict[Key, tuple[int, dict[str, Any] | None]], key: Key, position: int,
          values: dict[str, Any] | None) -> None:
    """The latest version by position wins (what the cells' ref_key does)."""
    if key not in state or state[key][0] <= position:
        state[key] = (position, values)


def test_chunks_and_changes_merged_equal_the_table_under_a_workload(db: psycopg.Connection[tuple[Any, ...]],
                                                                   src: PostgresSource,
                                                                   postgres_source_database: str) -> None:
    db.execute("INSERT INTO trips SELECT 'a', g, g, 'v0' FROM generate_series(1, 300) g")
    src.start_changes()
    stop = threading.Event()
    errors: list[BaseException] = []

    def workload() -> None:
        rng = random.Random(53)
        try:
            with psycopg.connect(postgres_source_database, autocommit=True) as conn:
                for n in range(100_000):
                    if stop.is_set() and n > 300:
                        return
                    i = rng.randint(1, 400)
                    op = rng.random()
                    with conn.transaction():  # transactions of one to three statements
                        for _ in range(rng.randint(1, 3)):
                            if op < 0.4:
                                conn.execute("INSERT INTO trips VALUES ('a', %s, %s, %s) ON CONFLICT (city, id) DO "
                                             "UPDATE SET note = excluded.note", [i, n, f"v{n}"])
                            elif op < 0.8:
                                conn.execute("UPDATE trips SET note = %s, fare = %s WHERE id = %s", [f"u{n}", n, i])
                            else:
                                conn.execute("DELETE FROM trips WHERE id = %s", [i])
                            i = rng.randint(1, 400)
        except BaseException as exc:
            errors.append(exc)

    writer = threading.Thread(target=workload)
    writer.start()
    state: dict[Key, tuple[int, dict[str, Any] | None]] = {}
    try:
        after: Key | None = None
        chunks: list[Chunk] = []
        while (chunk := src.read_chunk(after, 9)).rows:
            chunks.append(chunk)
            for row in chunk.rows:
                merge(state, row.key, chunk.position, row.values)
            after = chunk.last
            for change in src.read_changes(50):  # interleaved, without acknowledging: they come again
                merge(state, change.key, change.position, change.values)
    finally:
        stop.set()
        writer.join()
    assert not errors
    assert len(chunks) > 20
    for change in all_changes(src, 200):
        merge(state, change.key, change.position, change.values)
    merged = {key: values for key, (_, values) in state.items() if values is not None}
    table = {row.key: row.values for row in src.rows_between(None, None)}
    assert merged == table


# -- a commit between its commit record and its visibility -------------------------------------------------------
@pytest.fixture(scope="module")
def waiting_server() -> Iterator[PrivatePostgreSQL]:
    """A server whose commits (with synchronous_commit=on) wait, after writing their commit record, for a standby
    that never comes: until cancelled, such a commit is in the log and invisible to snapshots."""
    workdir = scratch_dir("pg-syncrep")
    pg = PrivatePostgreSQL(workdir, options=["wal_level=logical", "max_replication_slots=4", "max_wal_senders=4",
                                             "synchronous_standby_names=ghost"])
    try:
        pg.start()
        yield pg
    finally:
        pg.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def test_a_chunk_waits_for_a_commit_already_in_the_log(waiting_server: PrivatePostgreSQL) -> None:
    local = "?options=-c%20synchronous_commit%3Dlocal"  # these sessions' commits do not wait
    name = f"w_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(waiting_server.url("postgres") + local, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name}")
    url = waiting_server.url(name)
    with psycopg.connect(url + local, autocommit=True) as setup:
        setup.execute("CREATE TABLE trips (city text, id int, fare numeric, note text, PRIMARY KEY (city, id))")
        setup.execute("INSERT INTO trips VALUES ('a', 1, 1, 'before')")
    s = source(url + local, chunk_wait=1.0)
    s.start_changes()
    writer = psycopg.connect(url, autocommit=True)  # its commit waits for the standby
    done = threading.Thread(target=lambda: writer.execute("UPDATE trips SET note = 'after' WHERE id = 1"))
    try:
        done.start()
        with psycopg.connect(url + local, autocommit=True) as watch:
            stuck = "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'"
            while watch.execute(stuck).fetchone() != (1,):
                assert done.is_alive(), "the update did not wait for the standby"
                time.sleep(0.01)
            chunk: Chunk | None = None
            with pytest.raises(MigrationSourceUnavailableError, match="waited"):
                chunk = s.read_chunk(None, 10)  # the update is in the log: the chunk waits for it to show
            watch.execute("SELECT pg_cancel_backend(pid) FROM pg_stat_activity WHERE wait_event = 'SyncRep'")
        done.join()
        [change] = s.read_changes(10)
        assert change.values is not None and change.values["note"] == "after"
        if chunk is not None:  # read anyway: it must show the update or be below its commit
            assert chunk.rows[0].values["note"] == "after" or chunk.position < change.position
        after = s.read_chunk(None, 10)
        assert after.rows[0].values["note"] == "after"
    finally:
        writer.close()
        s.stop_changes()
        s.close()


# -- the flow back: log_position and write_rows -------------------------------------------------------------------
def test_log_position_parts_the_commits_before_it_from_those_after(db: psycopg.Connection[tuple[Any, ...]],
                                                                   src: PostgresSource,
                                                                   postgres_source_database: str) -> None:
    src.start_changes()
    db.execute("INSERT INTO trips VALUES ('a', 1, 1, 'before')")
    with psycopg.connect(postgres_source_database) as open_one:  # wrote before the position, commits after it
        open_one.execute("INSERT INTO trips VALUES ('a', 3, 3, 'open')")
        position = src.log_position()
        open_one.commit()
    db.execute("INSERT INTO trips VALUES ('a', 2, 2, 'after')")
    before, committed_after, after = all_changes(src)
    assert [c.key for c in (before, committed_after, after)] == [("a", 1), ("a", 3), ("a", 2)]
    assert before.position < position <= committed_after.position < after.position


def test_write_rows_takes_back_every_type_as_read(db: psycopg.Connection[tuple[Any, ...]],
                                                  postgres_source_database: str) -> None:
    db.execute("CREATE TABLE kinds (id bigint PRIMARY KEY, t text, n numeric(8, 2), tz timestamptz, ts timestamp, "
               "d date, tm time, iv interval, u uuid, b bool, by bytea, j json, jb jsonb, arr int[], f8 float8)")
    db.execute("SET TimeZone TO 'Asia/Kolkata'")  # the writer's zone does not matter
    db.execute("INSERT INTO kinds VALUES (1, 'it''s \u00e9\u2603 \"q\"', -123456.78, '2024-02-29 23:04:05.123456-05', "
               "'2024-02-29 03:04:05.5', '0001-01-01', '23:59:59.999999', '1 year 2 days 03:04:05.5', %s, false, "
               "'\\x00ff80275c', '{\"a\": [1, 2.5, \"x\"], \"n\": null}', '{\"k\": {\"z\": true}}', '{1,NULL,3}', "
               "0.1)", [uuid.uuid4()])
    db.execute("INSERT INTO kinds (id) VALUES (2)")  # every other column NULL
    s = source(postgres_source_database, "kinds")
    try:
        for key in (1, 2):
            read = s.read_row((key,))
            assert read is not None
            s.write_rows([{**{k: json_value(v) for k, v in read.values.items()}, "id": key + 10}], [])
            again = s.read_row((key + 10,))
            assert again is not None and again.key == (key + 10,)
            assert {**again.values, "id": key} == read.values
            assert all(type(again.values[k]) is type(v) for k, v in read.values.items() if k != "id")
            if key == 1:
                assert None not in read.values.values() and read.values["by"] == b"\x00\xff\x80'\\"
            else:
                assert [v for k, v in read.values.items() if k != "id"] == [None] * 14
    finally:
        s.close()


def test_write_rows_writes_all_or_nothing(db: psycopg.Connection[tuple[Any, ...]], src: PostgresSource) -> None:
    db.execute("ALTER TABLE trips ALTER note SET NOT NULL")
    db.execute("INSERT INTO trips VALUES ('a', 1, 1, 'x')")

    def table() -> list[tuple[Any, ...]]:
        return db.execute("SELECT * FROM trips ORDER BY city, id").fetchall()
    start = table()
    good = {"city": "b", "id": 1, "fare": "2.50", "note": "n"}
    # The second row (another statement: other columns) breaks NOT NULL: the first is not written either.
    with pytest.raises(MigrationSourceError, match="note"):
        src.write_rows([good, {"city": "b", "id": 2, "fare": "3"}], [("a", 1)])
    with pytest.raises(MigrationSourceError, match="not a number"):
        src.write_rows([good, {"city": "b", "id": 3, "fare": "not a number", "note": "n"}], [])
    refused: list[tuple[list[dict[str, Any]], list[Key], str]] = [
        ([good, {"city": "b", "fare": "1", "note": "n"}], [], "lacks its key column id"),
        ([good], [("a", 1), ("a",)], "a key of 1 values for the 2 columns"),
        ([good, {"city": "b", "id": 4, "colour": "red"}], [], "has no column colour")]
    for upserts, deletes, message in refused:
        with pytest.raises(MigrationSourceError, match=message):
            src.write_rows(upserts, deletes)
    assert table() == start
    src.write_rows([], [])  # nothing to do
    src.write_rows([good], [])  # the connection is usable after a refusal
    assert table() == [*start, ("b", 1, decimal.Decimal("2.50"), "n")]


def test_write_rows_upserts_and_deletes_by_a_composite_key_as_the_capture_sees(
        db: psycopg.Connection[tuple[Any, ...]], src: PostgresSource) -> None:
    db.execute("INSERT INTO trips VALUES ('a', 1, 1, 'x'), ('a', 2, 2, 'y'), ('b', 1, 3, 'z'), ('b', 2, 4, 'w')")
    src.start_changes()
    src.write_rows([{"city": "a", "id": 1, "note": "new"},  # only some columns: fare kept
                    {"city": "c", "id": 5, "fare": "7.50", "note": "n"},  # new: the others take their defaults
                    {"city": "b", "id": 1}],  # only the key, of a row that exists: unchanged
                   [("a", 2), ("b", 9)])  # a key the table does not hold: nothing
    assert db.execute("SELECT * FROM trips ORDER BY city, id").fetchall() == [
        ("a", 1, decimal.Decimal("1.00"), "new"), ("b", 1, decimal.Decimal("3.00"), "z"),
        ("b", 2, decimal.Decimal("4.00"), "w"), ("c", 5, decimal.Decimal("7.50"), "n")]
    changes = all_changes(src)
    assert len({c.position for c in changes}) == 1  # one transaction
    assert [(c.op, c.key, c.values) for c in changes] == [
        ("upsert", ("a", 1), {"city": "a", "id": 1, "fare": decimal.Decimal("1.00"), "note": "new"}),
        ("upsert", ("c", 5), {"city": "c", "id": 5, "fare": decimal.Decimal("7.50"), "note": "n"}),
        ("delete", ("a", 2), None)]
