"""A migration end to end against real sources (a PostgreSQL with logical decoding, the MariaDB's binlog): the
table copied while a workload of inserts, updates and deletes runs on it, the changes applied, and the diff at 0
once the change lag is 0."""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psycopg
import pymysql
import pytest

import logstore
from connectors.migration import mover as mover_module
from connectors.migration.diff import diff
from connectors.migration.mapping import TOMBSTONE, RowMapper
from connectors.migration.mover import MoveMetrics, Mover
from connectors.migration.opening import open_source
from connectors.migration.records import MigrationRecords
from connectors.migration.spec import MigrationSpec, load_migration

NAMESPACE = "6ba7b811-9dad-11d1-80b4-00c04fd430c8"


def spec_text(url: str, name: str = "trips") -> str:
    """The declaration of the tests' migration of ``trips`` (the text a `cellstream migrate` file holds)."""
    return f"""
name: {name}
source: {{url: "{url}", table: trips}}
row_key: {{uuid5: {NAMESPACE}}}
columns:
  BASE: [rider, fare]
  NOTE: [note]
"""


def spec_for(url: str, name: str = "trips") -> MigrationSpec:
    return load_migration(spec_text(url, name))


class SourceDB:
    """The source table's database, for the test's own statements (autocommit)."""

    def __init__(self, kind: str, url: str) -> None:
        self.kind, self.url = kind, url
        self._pg: psycopg.Connection[tuple[Any, ...]] | None = None
        self._my: pymysql.connections.Connection | None = None
        if kind == "postgres":
            self._pg = psycopg.connect(url, autocommit=True)
        else:
            parts = urlsplit(url)
            self._my = pymysql.connect(host=parts.hostname, port=parts.port or 3306, user=parts.username,
                                       password=parts.password or "", autocommit=True)
            with self._my.cursor() as cur:  # mysql_database names a database the test creates
                cur.execute(f"CREATE DATABASE IF NOT EXISTS `{parts.path.lstrip('/')}`")
                cur.execute(f"USE `{parts.path.lstrip('/')}`")

    def execute(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        if self._pg is not None:
            cur = self._pg.execute(sql, args)
            return cur.fetchall() if cur.description else []
        assert self._my is not None
        with self._my.cursor() as my:
            my.execute(sql, args)
            return list(my.fetchall())

    def upsert(self) -> str:
        if self.kind == "postgres":
            return "INSERT INTO trips VALUES (%s, %s, %s, 'new') ON CONFLICT (id) DO UPDATE SET note = 'again'"
        return "INSERT INTO trips VALUES (%s, %s, %s, 'new') ON DUPLICATE KEY UPDATE note = 'again'"

    def close(self) -> None:
        if self._pg is not None:
            self._pg.close()
        if self._my is not None:
            self._my.close()


def create_table(db: SourceDB) -> None:
    db.execute("CREATE TABLE trips (id bigint PRIMARY KEY, rider text, fare numeric(8, 2), note text)")
    for start in range(1, 2001, 500):
        db.execute("INSERT INTO trips VALUES " + ", ".join(f"({i}, 'r{i}', {i * 1.25}, NULL)"
                                                          for i in range(start, start + 500)))


@pytest.fixture
def table(postgres_source_database: str) -> Iterator[SourceDB]:
    db = SourceDB("postgres", postgres_source_database)
    create_table(db)
    yield db
    db.close()


class Workload(threading.Thread):
    """Inserts, updates and deletes on the source table until stopped, in small transactions."""

    def __init__(self, db: SourceDB) -> None:
        super().__init__(daemon=True)
        self.db = SourceDB(db.kind, db.url)
        self.stop = threading.Event()
        self.done = 0

    def run(self) -> None:
        rng = random.Random(7)
        db = self.db
        try:
            while not self.stop.is_set():
                db.execute("BEGIN")
                for _ in range(rng.randint(1, 4)):
                    key = rng.randint(1, 2600)
                    what = rng.random()
                    if what < 0.4:
                        db.execute(db.upsert(), (key, f"n{key}", key))
                    elif what < 0.8:
                        db.execute("UPDATE trips SET fare = fare + 1, note = %s WHERE id = %s", (f"u{self.done}", key))
                    else:
                        db.execute("DELETE FROM trips WHERE id = %s", (key,))
                db.execute("COMMIT")
                self.done += 1
        finally:
            db.close()


def test_a_table_copied_under_a_workload_diffs_clean_once_caught_up(source_db: SourceDB, tmp_path: Path) -> None:
    spec = spec_for(source_db.url)
    workload = Workload(source_db)
    with logstore.open(f"sqlite:///{tmp_path}/store", shards=16) as store:
        source = open_source(spec)
        try:
            workload.start()
            record = Mover(spec, source, store, chunk_rows=150).run(follow=False)
            assert record.phase == "copied" and record.rows_copied > 1500  # less what the workload deleted first
            workload.stop.set()
            workload.join()
            assert workload.done > 20  # the copy ran beside the workload
            record = Mover(spec, source, store).run(until_caught_up=True)
            assert source.read_changes(100) == [] and record.changes_applied > 0  # none of the table's waits
            report = diff(spec, source, store, chunk_rows=500)
            assert report.clean, report.listed[:5]
            assert report.rows == source_db.execute("SELECT count(*) FROM trips")[0][0]
            present = {k for (k,) in source_db.execute("SELECT id FROM trips")}
            deleted = [k for k in range(1, 2601) if k not in present]
            mapper = RowMapper(spec)
            tombstones = [k for k in deleted if (c := store.get_cell_latest(mapper.row_key((k,), None), "BASE"))
                          is not None and c.body == {**TOMBSTONE, "_key": [k]}]
            assert tombstones  # rows deleted after they were copied end as tombstones
            assert MigrationRecords(store).get("trips").changes_applied == record.changes_applied
        finally:
            workload.stop.set()
            source.stop_changes()
            source.close()


def test_the_diff_names_what_differs(table: SourceDB, postgres_source_database: str, tmp_path: Path) -> None:
    spec = spec_for(postgres_source_database)
    with logstore.open(f"sqlite:///{tmp_path}/store", shards=16) as store:
        source = open_source(spec)
        try:
            Mover(spec, source, store, chunk_rows=500).run(until_caught_up=True)
            source.stop_changes()  # what the source does now is not captured
            table.execute("UPDATE trips SET fare = 0 WHERE id = 5")
            table.execute("DELETE FROM trips WHERE id = 6")
            table.execute("INSERT INTO trips VALUES (5000, 'late', 1, NULL)")
            report = diff(spec, source, store, chunk_rows=700)
            repaired = diff(spec, source, store, chunk_rows=700, repair=True)
            after = diff(spec, source, store, chunk_rows=700)
            deleted = store.get_cell_latest(RowMapper(spec).row_key((6,), None), "NOTE")
        finally:
            source.close()
    assert (report.rows, report.missing, report.different, report.extra) == (2000, 2, 1, 2)
    kinds = {(kind, d.key, d.column, tuple(d.fields)) for kind, d in report.listed}
    assert ("different", (5,), "BASE", ("fare",)) in kinds
    assert {("missing", (5000,), "BASE", ()), ("missing", (5000,), "NOTE", ())} <= kinds
    assert {k for k, d in report.listed if d.key is None} == {"extra"}
    assert repaired == report  # what the repair found, before it wrote
    assert report.ahead == 0
    assert after.clean and after.rows == 2000
    assert deleted is not None and deleted.body == TOMBSTONE


def test_a_migration_sigkilled_mid_copy_goes_on_from_its_record(
        table: SourceDB, postgres_source_database: str, tmp_path: Path) -> None:
    """`cellstream migrate start` killed with SIGKILL while it copies under a workload, then run again: it goes
    on from its cursor (the rows before it are not copied again), and `migrate diff` finds nothing."""
    spec_file = tmp_path / "trips.yaml"
    spec_file.write_text(spec_text(postgres_source_database))
    store_url = f"sqlite:///{tmp_path}/store"
    with logstore.open(store_url, shards=16):
        pass
    workload = Workload(table)
    workload.start()
    cli = [sys.executable, "-m", "cellstream", "migrate"]
    proc = subprocess.Popen([*cli, "start", str(spec_file), "--store", store_url, "--chunk-rows", "20",
                             "--rate", "1000"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        copied = 0
        while copied < 600 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
            with logstore.open(store_url) as store:
                record = MigrationRecords(store).find("trips")
            copied = 0 if record is None else record.rows_copied
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert 600 <= copied < 2000
    finally:
        if proc.poll() is None:
            proc.kill()
        workload.stop.set()
        workload.join()
    done = subprocess.run([*cli, "start", str(spec_file), "--store", store_url, "--until-caught-up", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    # Went on from its cursor: the second run read fewer rows than the table holds (the 600 or more before the
    # cursor were not read again).
    live = table.execute("SELECT count(*) FROM trips")[0][0]
    assert result["phase"] == "copied" and 0 < result["rows_copied"] - copied < live - 300
    status = subprocess.run([*cli, "status", str(spec_file), "--store", store_url, "--json"],
                            capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    shown = json.loads(status.stdout)
    # Caught up: no change waits (the bytes behind count the server's other databases' log too).
    assert (shown["phase"], shown["rows_copied"], shown["lag_seconds"]) == ("copied", result["rows_copied"], 0)
    assert postgres_source_database.split("@")[0].split(":")[-1] not in status.stdout  # no password
    checked = subprocess.run([*cli, "diff", str(spec_file), "--store", store_url, "--json"],
                             capture_output=True, text=True, timeout=120)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert json.loads(checked.stdout)["rows"] > 1500
    table.execute("UPDATE trips SET rider = 'changed' WHERE id = (SELECT min(id) FROM trips)")
    stopped = subprocess.run([*cli, "diff", str(spec_file), "--store", store_url],
                             capture_output=True, text=True, timeout=120)
    assert stopped.returncode == 8 and "1 different" in stopped.stdout and "(rider)" in stopped.stdout
    source = open_source(spec_for(postgres_source_database))
    source.stop_changes()
    source.close()


def test_a_source_not_set_up_for_capture_is_refused_saying_how(postgres_database: str, tmp_path: Path) -> None:
    """The shared PostgreSQL runs with wal_level=replica: `migrate start` exits 4 naming the setting."""
    with psycopg.connect(postgres_database, autocommit=True) as conn:
        conn.execute("CREATE TABLE trips (id bigint PRIMARY KEY, rider text, fare numeric(8, 2), note text)")
    spec_file = tmp_path / "trips.yaml"
    spec_file.write_text(spec_text(postgres_database))
    with logstore.open(f"sqlite:///{tmp_path}/store", shards=16):
        pass
    done = subprocess.run([sys.executable, "-m", "cellstream", "migrate", "start", str(spec_file), "--store",
                           f"sqlite:///{tmp_path}/store", "--no-follow"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 4 and "wal_level=logical" in done.stderr, done.stderr


def test_cells_newer_than_the_diffs_read_are_not_compared(table: SourceDB, postgres_source_database: str,
                                                          tmp_path: Path) -> None:
    """A row changed after its chunk was read, the change applied: its cells are ahead of the read, so the
    diff counts them apart instead of calling the row different (the next diff compares it)."""
    spec = spec_for(postgres_source_database)
    with logstore.open(f"sqlite:///{tmp_path}/store", shards=16) as store:
        source = open_source(spec)
        try:
            Mover(spec, source, store).run(until_caught_up=True)
            row_key = RowMapper(spec).row_key((7,), None)
            store.put_cell(row_key, "BASE", 2**62, {"rider": "later", "fare": "1.00"})  # a change the read missed
            report = diff(spec, source, store)
        finally:
            source.stop_changes()
            source.close()
    assert (report.different, report.ahead) == (0, 1) and report.clean


def test_a_cancelled_migration_leaves_no_slot_and_a_lagging_one_is_reported(
        table: SourceDB, postgres_source_database: str, tmp_path: Path) -> None:
    """The capture is never left to hold the source's log silently: `status` exits 7 once it lags over
    --max-lag (the metric says the same while it runs), and `cancel` drops the slot and publication."""
    spec = spec_for(postgres_source_database)
    spec_file = tmp_path / "trips.yaml"
    spec_file.write_text(spec_text(postgres_source_database))
    store_url = f"sqlite:///{tmp_path}/store"
    metrics = MoveMetrics()
    with logstore.open(store_url, shards=16) as store:
        source = open_source(spec)
        try:
            Mover(spec, source, store, chunk_rows=500, metrics=metrics).run(until_caught_up=True)
        finally:
            source.close()
    assert metrics.registry.get_sample_value("cellstream_migration_rows_copied_total", {"migration": "trips"}) == 2000
    cli = [sys.executable, "-m", "cellstream", "migrate"]
    caught_up = subprocess.run([*cli, "status", str(spec_file), "--store", store_url, "--max-lag", "0"],
                               capture_output=True, text=True, timeout=60)
    assert caught_up.returncode == 0, caught_up.stderr  # nothing waits: 0 s behind
    table.execute("UPDATE trips SET note = 'waits' WHERE id = 1")  # no migration runs to apply it
    lagging = subprocess.run([*cli, "status", str(spec_file), "--store", store_url, "--max-lag", "0"],
                             capture_output=True, text=True, timeout=60)
    assert lagging.returncode == 7 and "migrate cancel" in lagging.stderr, lagging.stderr
    slots = "SELECT count(*) FROM pg_replication_slots WHERE database = current_database()"
    assert table.execute(slots)[0][0] == 1
    done = subprocess.run([*cli, "cancel", str(spec_file), "--store", store_url], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert table.execute(slots)[0][0] == 0
    assert table.execute("SELECT count(*) FROM pg_publication")[0][0] == 0
    again = subprocess.run([*cli, "start", str(spec_file), "--store", store_url, "--no-follow"],
                           capture_output=True, text=True, timeout=60)
    assert again.returncode == 9 and "cancelled" in again.stderr
    status = subprocess.run([*cli, "status", str(spec_file), "--store", store_url, "--json"], capture_output=True,
                            text=True, timeout=60)
    assert status.returncode == 0 and json.loads(status.stdout)["phase"] == "cancelled"


def test_the_copy_waits_while_the_source_is_busy_and_the_changes_go_on(
        table: SourceDB, postgres_source_database: str, tmp_path: Path) -> None:
    """With --max-load 0, a statement running on the source holds the copy (gh-ost's --max-load) while the
    changes logged meanwhile are still applied; once it ends the copy goes on."""
    spec = spec_for(postgres_source_database)
    busy = threading.Thread(target=lambda: SourceDB("postgres", postgres_source_database).execute(
        "SELECT pg_sleep(3)"), daemon=True)
    metrics = MoveMetrics()
    with logstore.open(f"sqlite:///{tmp_path}/store", shards=16) as store:
        source = open_source(spec)
        try:
            source.start_changes()
            busy.start()
            deadline = time.monotonic() + 10
            while source.load().running == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            table.execute("UPDATE trips SET note = 'while busy' WHERE id = 7")
            mover = Mover(spec, source, store, chunk_rows=500, max_running=0, metrics=metrics)
            seen: list[tuple[str, int, int]] = []
            record = mover.run(until_caught_up=True,
                               progress=lambda p: seen.append((p.phase, p.rows_copied, p.changes_applied)))
            busy.join()
        finally:
            source.stop_changes()
            source.close()
        note = store.get_cell_latest(RowMapper(spec).row_key((7,), None), "NOTE")
    assert record.phase == "copied" and record.rows_copied == 2000
    assert ("copying", 0, 1) in seen  # the change applied while the copy waited, before any row was copied
    waited = metrics.registry.get_sample_value("cellstream_migration_copy_throttled_seconds_total",
                                               {"migration": "trips"})
    assert waited is not None and waited > 0
    assert note is not None and note.body == {"note": "while busy"}


def test_a_capture_over_its_lag_warning_is_logged_once(table: SourceDB, postgres_source_database: str,
                                                       tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    spec = spec_for(postgres_source_database)
    monkeypatch.setattr(mover_module, "LAG_CHECK", 0.0)  # the lag read after every chunk: 20 reads
    with logstore.open(f"sqlite:///{tmp_path}/store", shards=16) as store:
        source = open_source(spec)
        try:
            with caplog.at_level(logging.WARNING, logger="connectors.migration.mover"):
                Mover(spec, source, store, chunk_rows=100, lag_warning=-1).run(until_caught_up=True)
        finally:
            source.stop_changes()
            source.close()
    warned = [r.getMessage() for r in caplog.records if "behind the source" in r.getMessage()]
    assert len(warned) == 1 and "above -1 s" in warned[0]  # once while it stays over, not at each read


def test_a_sampled_diff_reads_chunks_from_random_points_of_an_integer_key(
        source_db: SourceDB, tmp_path: Path) -> None:
    """``diff --sample`` on a table keyed by one integer: chunks read from random points of the key (an index
    range read each), about the share asked for, each row compared once; no extra rows looked for."""
    spec = spec_for(source_db.url)
    with logstore.open(f"sqlite:///{tmp_path}/store", shards=16) as store:
        source = open_source(spec)
        try:
            Mover(spec, source, store, chunk_rows=500).run(until_caught_up=True)
            source_db.execute("DELETE FROM trips WHERE MOD(id, 7) = 0")  # keys with gaps: a chunk is not an id range
            source_db.execute("UPDATE trips SET fare = fare + 1")  # every row now differs; nothing applies it
            # The row estimate the sample is sized by.
            source_db.execute("ANALYZE trips" if source_db.kind == "postgres" else "ANALYZE TABLE trips")
            keys = sorted(k for (k,) in source_db.execute("SELECT id FROM trips"))
            full = diff(spec, source, store, chunk_rows=20)
            sampled = diff(spec, source, store, chunk_rows=20, sample=0.04, seed=8)
        finally:
            source.close()
    assert (full.rows, full.different, full.missing) == (len(keys), len(keys), 0)
    assert full.extra == 2000 // 7 * 2  # the deleted rows' cells, still live (BASE and NOTE), are extra...
    assert sampled.extra == 0 and sampled.missing == 0  # ...but a sample does not look for extra rows
    # 3 or 4 probes (the estimate, 1,715 rows x 4% / 20), of 20 rows each, overlapping ones compared once.
    assert 20 <= sampled.rows <= 80 and sampled.different == sampled.rows
    compared = sorted(d.key[0] for kind, d in sampled.listed if kind == "different" and d.key is not None)
    assert len(compared) == len(set(compared)) == sampled.rows
    at = [keys.index(k) for k in compared]
    breaks = [j for j in range(1, len(at)) if at[j] != at[j - 1] + 1]
    starts, ends = [0, *breaks], [*breaks, len(at)]
    assert all(end - start >= 20 for start, end in zip(starts, ends, strict=True))  # a probe: 20 rows in a row
    assert any(at[start] % 20 for start in starts)  # from a random point, not where a walk's chunks begin


def test_a_sampled_diff_of_another_key_steps_over_whole_chunks(source_db: SourceDB, tmp_path: Path) -> None:
    """A key of two columns: the sample steps over the chunks it does not compare by their keys alone, so the
    chunks it compares are those of a full diff (the 20 keys after the last stepped over)."""
    source_db.execute("CREATE TABLE legs (city varchar(20) NOT NULL, n int NOT NULL, v int, PRIMARY KEY (city, n))")
    source_db.execute("INSERT INTO legs VALUES " + ", ".join(f"('c{i % 9}', {i}, {i})" for i in range(1500)))
    spec = load_migration(spec_text(source_db.url).replace("table: trips", "table: legs")
                          .replace("BASE: [rider, fare]\n  NOTE: [note]", "BASE: [v]"))
    with logstore.open(f"sqlite:///{tmp_path}/store", shards=16) as store:
        source = open_source(spec)
        try:
            assert source.key_span() is None
            Mover(spec, source, store, chunk_rows=500).run(until_caught_up=True)
            source_db.execute("UPDATE legs SET v = v + 1")
            keys = [tuple(k) for k in source_db.execute("SELECT city, n FROM legs ORDER BY city, n")]
            chunks = [keys[i:i + 20] for i in range(0, len(keys), 20)]
            sampled = diff(spec, source, store, chunk_rows=20, sample=0.03, seed=8)
            everything = diff(spec, source, store, chunk_rows=20, sample=1.0)
        finally:
            source.close()
            source_db.execute("DROP TABLE legs")
    compared = {d.key for kind, d in sampled.listed if kind == "different"}
    assert 0 < sampled.rows <= 100 and sampled.different == sampled.rows  # every one listed
    assert compared == {k for chunk in chunks if chunk[0] in compared for k in chunk}  # whole chunks
    assert everything.rows == len(keys) and everything.different == len(keys)


def test_the_copy_waits_while_a_mysql_replica_lags(tmp_path: Path) -> None:
    """``source.replicas``: the copy of a MySQL source waits while a replica is more than --max-replica-lag
    behind (gh-ost's throttle-control replicas), the changes going on meanwhile, and goes on once it caught up."""
    from tests.harness.replica_pair import ReplicaPair

    with ReplicaPair(tmp_path / "pair", delay=3) as pair:  # the replica applies each event 3 s late
        url = pair.primary.url("app")
        db = SourceDB("mysql", url)
        try:
            db.execute("SET GLOBAL binlog_row_metadata = FULL")  # the private server's text is not UTF-8
            create_table(db)
            db.execute("CREATE TABLE beat (n int PRIMARY KEY, at double)")
            spec = load_migration(spec_text(url).replace("table: trips}", f'table: trips, replicas: '
                                                         f'["{pair.replica.url("app")}"]}}'))
            stop, beats = threading.Event(), SourceDB("mysql", url)

            def beat() -> None:
                n = 0
                while not stop.wait(0.05):
                    n += 1
                    beats.execute("INSERT INTO beat VALUES (%s, %s)", (n, time.time()))
            beating = threading.Thread(target=beat, daemon=True)
            beating.start()
            metrics = MoveMetrics()
            with logstore.open(f"sqlite:///{tmp_path}/store", shards=16) as store:
                source = open_source(spec)
                try:
                    deadline = time.monotonic() + 30
                    while (lag := source.load().replica_lag) is None or lag < 1.0:
                        assert time.monotonic() < deadline, lag
                        time.sleep(0.2)
                    mover = Mover(spec, source, store, chunk_rows=500, max_replica_lag=0.5, metrics=metrics)
                    copy = threading.Thread(target=mover.run, kwargs={"follow": False}, daemon=True)
                    copy.start()
                    time.sleep(1.5)
                    db.execute("UPDATE trips SET note = 'during' WHERE id = 7")
                    time.sleep(1.5)
                    waiting = MigrationRecords(store).get("trips")
                    assert waiting.rows_copied == 0 and waiting.changes_applied >= 1  # held; the changes go on
                    stop.set()  # the replica catches up 3 s later, then the copy goes on
                    copy.join(timeout=60)
                    assert not copy.is_alive()
                    assert MigrationRecords(store).get("trips").phase == "copied"
                finally:
                    source.stop_changes()
                    source.close()
            waited = metrics.registry.get_sample_value("cellstream_migration_copy_throttled_seconds_total",
                                                       {"migration": "trips"})
            assert waited is not None and waited >= 3.0
        finally:
            stop.set()
            db.close()


def test_a_diff_killed_midway_goes_on_from_its_last_chunk(table: SourceDB, postgres_source_database: str,
                                                         tmp_path: Path) -> None:
    """``migrate diff --resume``: a diff SIGKILLed midway goes on from the last chunk it saved and ends with the
    counts of a diff run whole, the extra rows included; `status` shows the result."""
    spec = spec_for(postgres_source_database)
    spec_file = tmp_path / "trips.yaml"
    spec_file.write_text(spec_text(postgres_source_database))
    store_url = f"sqlite:///{tmp_path}/store"
    with logstore.open(store_url, shards=16) as store:
        source = open_source(spec)
        try:
            Mover(spec, source, store, chunk_rows=500).run(until_caught_up=True)
        finally:
            source.close()
    # No migration runs to apply these: they stay differences.
    table.execute("UPDATE trips SET fare = fare + 1 WHERE MOD(id, 10) = 0")
    table.execute("DELETE FROM trips WHERE id > 1990")
    cli = [sys.executable, "-m", "cellstream", "migrate"]
    run = [str(spec_file), "--store", store_url, "--chunk-rows", "50", "--json"]
    killed = subprocess.Popen([*cli, "diff", *run, "--rate", "500"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    with logstore.open(store_url) as store:
        deadline = time.monotonic() + 60
        while (state := MigrationRecords(store).last_diff("trips")) is None or state.rows < 500:
            assert time.monotonic() < deadline and killed.poll() is None
            time.sleep(0.05)
        killed.send_signal(signal.SIGKILL)
        killed.wait()
        stopped = MigrationRecords(store).last_diff("trips")
    assert stopped is not None and not stopped.done and 500 <= stopped.rows < 1990
    resumed = subprocess.run([*cli, "diff", *run, "--resume"], capture_output=True, text=True, timeout=120)
    with logstore.open(store_url) as store:
        ended = MigrationRecords(store).last_diff("trips")
    assert ended is not None and ended.done and ended.started_at == stopped.started_at  # the same diff, gone on
    whole = subprocess.run([*cli, "diff", *run], capture_output=True, text=True, timeout=120)
    assert resumed.returncode == whole.returncode == 8, resumed.stderr
    counts = [{k: json.loads(r.stdout)[k] for k in ("rows", "missing", "different", "extra")} for r in (resumed, whole)]
    assert counts[0] == counts[1] == {"rows": 1990, "missing": 0, "different": 199, "extra": 20}
    again = subprocess.run([*cli, "diff", *run, "--resume"], capture_output=True, text=True, timeout=60)
    assert again.returncode == 9 and "no diff left unfinished" in again.stderr
    status = subprocess.run([*cli, "status", str(spec_file), "--store", store_url, "--max-lag", "1e9"],
                            capture_output=True, text=True, timeout=60)
    assert "the last diff" in status.stdout and "199 different, 20 extra" in status.stdout, status.stdout
