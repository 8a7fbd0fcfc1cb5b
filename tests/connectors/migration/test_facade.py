"""The read facade (GitHub Scientist) against a real PostgreSQL source and a SQLite store: the dial decides which
side a read touches, shadow reads are compared in the background without ever blocking the caller, a row the
cells lag behind is reported by field, and `migrate switch --reads` turns every reader's dial through the record."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import psycopg
import pytest

import logstore
from connectors.errors import MigrationSourceError
from connectors.migration.facade import Comparison, MigrationReader, MigrationReadMetrics, sql_row_reader
from connectors.migration.mapping import RowMapper
from connectors.migration.mover import Mover
from connectors.migration.opening import open_source
from connectors.migration.records import MigrationRecords
from connectors.migration.source import Key
from connectors.migration.spec import MigrationSpec, load_migration
from logstore import Store
from tests.connectors.migration.test_mover import SourceDB, spec_text

ROWS = 200


class CountingStore:
    """The real store, counting the reads of the migration's rows (not of its record)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.row_reads = 0

    def get_cell_latest(self, row_key: uuid.UUID, column: str) -> Any:
        if column != "_migration":
            self.row_reads += 1
        return self.store.get_cell_latest(row_key, column)

    def get_cells_latest(self, coordinates: Any) -> Any:
        wanted = list(coordinates)
        self.row_reads += sum(column != "_migration" for _, column in wanted)
        return self.store.get_cells_latest(wanted)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


def by_label(metrics: MigrationReadMetrics, name: str, label: str) -> dict[str, float]:
    """The values of a series of ``metrics`` by one of its labels."""
    return {s.labels[label]: s.value for f in metrics.registry.collect() for s in f.samples if s.name == name}


class CountingReader:
    """sql_row_reader, counting its calls."""

    def __init__(self, url: str) -> None:
        self.read = sql_row_reader(url, "trips", ["id"])
        self.calls = 0

    def __call__(self, key: Key) -> dict[str, Any] | None:
        self.calls += 1
        found = self.read(key)
        return None if found is None else dict(found)


Copied = tuple[MigrationSpec, Store, "psycopg.Connection[Any]"]


@pytest.fixture
def copied(postgres_source_database: str, tmp_path: Path) -> Iterator[Copied]:
    """A table of ROWS rows copied into a SQLite store, its change capture then stopped (what the source does
    next is not applied: the cells lag behind it)."""
    db = psycopg.connect(postgres_source_database, autocommit=True)
    db.execute("CREATE TABLE trips (id bigint PRIMARY KEY, rider text, fare numeric(8, 2), note text)")
    db.execute("INSERT INTO trips SELECT i, 'r' || i, i * 1.25, NULL FROM generate_series(1, %s) i", (ROWS,))
    spec = load_migration(spec_text(postgres_source_database))
    with logstore.open(f"sqlite:///{tmp_path}/store", shards=8) as store:
        source = open_source(spec)
        try:
            Mover(spec, source, store).run(until_caught_up=True)
            source.stop_changes()
        finally:
            source.close()
        yield spec, store, db
    db.close()


def row(i: int, fare: str | None = None, note: str | None = None) -> dict[str, dict[str, Any]]:
    return {"BASE": {"rider": f"r{i}", "fare": fare or f"{i * 1.25:.2f}"}, "NOTE": {"note": note}}


def test_reads_at_0_touch_only_the_source_and_at_100_only_the_store(
        copied: Copied, postgres_source_database: str) -> None:
    spec, real, _ = copied
    store, source = CountingStore(real), CountingReader(postgres_source_database)
    metrics = MigrationReadMetrics()
    # Row 9 deleted as the capture records a delete: a tombstone in each column, above its copy.
    real.put_cells([(c.row_key, c.column, c.ref_key, c.body)
                    for c in RowMapper(spec).tombstones((9,), None, 2**62)])
    with MigrationReader(spec, cast(Store, store), source_reader=source, metrics=metrics, seed=1) as reader:
        assert [reader.get((i,)) for i in range(1, 51)] == [row(i) for i in range(1, 51)]
        assert reader.get((ROWS + 1,)) is None
        reader.drain()  # a shadow read would read the store on a comparing thread
        assert (source.calls, store.row_reads) == (51, 0)
        reader.set_percent(100)
        assert [reader.get((i,)) for i in (1, 2, 77)] == [row(1), row(2), row(77)]
        assert reader.get((ROWS + 1,)) is None and reader.get((9,)) is None  # no row; a tombstone
        assert (source.calls, store.row_reads) == (51, 5 * len(spec.columns))
        assert reader.report().compared == 0
    sides = by_label(metrics, "cellstream_migration_reads_total", "side")
    assert sides == {"source": 51, "store": 5}


def test_at_50_about_half_of_the_reads_are_compared_and_the_draw_is_seeded(
        copied: Copied, postgres_source_database: str) -> None:
    spec, store, _ = copied
    compared: list[list[Key]] = []
    for _ in range(2):
        seen: list[Key] = []

        def publish(done: Comparison, seen: list[Key] = seen) -> None:
            seen.append(done.key)
        with MigrationReader(spec, store, source_reader=sql_row_reader(postgres_source_database, "trips"),
                             percent=50, seed=11, publish=publish) as reader:
            answers = [reader.get((i,)) for i in range(1, ROWS + 1)]
            reader.drain()
            report = reader.report()
        assert answers == [row(i) for i in range(1, ROWS + 1)]
        assert report.compared == len(seen) and report.mismatched == 0 and report.match_rate == 1.0
        compared.append(sorted(seen))
    assert compared[0] == compared[1]  # the same seed draws the same reads
    assert 0.35 * ROWS <= len(compared[0]) <= 0.65 * ROWS


def test_a_row_the_cells_lag_behind_is_a_mismatch_naming_its_field(
        copied: Copied, postgres_source_database: str,
        caplog: pytest.LogCaptureFixture) -> None:
    spec, store, db = copied
    db.execute("UPDATE trips SET fare = 4321.5 WHERE id = 5")  # not applied: the capture is stopped
    db.execute("DELETE FROM trips WHERE id = 6")
    metrics = MigrationReadMetrics()
    caplog.set_level(logging.WARNING, "connectors.migration.facade")
    with MigrationReader(spec, store, source_reader=sql_row_reader(postgres_source_database, "trips"), percent=99,
                         seed=0, metrics=metrics) as reader:
        assert reader.get((5,)) == row(5, fare="4321.50")  # the source's answer
        assert reader.get((6,)) is None
        assert reader.get((7,)) == row(7)
        reader.drain()
        report = reader.report()
    mapper = RowMapper(spec)
    assert (report.compared, report.mismatched) == (3, 2)
    assert report.mismatches == [Comparison((5,), mapper.row_key((5,), None), "different", ["BASE.fare"]),
                                 Comparison((6,), mapper.row_key((6,), None), "extra", [])]
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "BASE.fare" in logged and "4321" not in logged and "6.25" not in logged  # names, never values
    kinds = by_label(metrics, "cellstream_migration_read_mismatches_total", "kind")
    assert kinds == {"different": 1, "extra": 1}


def test_a_full_queue_drops_comparisons_without_blocking_the_reads(
        copied: Copied, postgres_source_database: str) -> None:
    spec, store, _ = copied
    comparing, release = threading.Event(), threading.Event()

    def publish(_: Comparison) -> None:  # holds the one comparing thread
        comparing.set()
        release.wait()

    metrics = MigrationReadMetrics()
    reader = MigrationReader(spec, store, source_reader=sql_row_reader(postgres_source_database, "trips"),
                             percent=99, seed=0, queue_size=2, publish=publish, metrics=metrics)
    try:
        reader.get((1,))  # seed 0 draws 0.84 first: compared
        assert comparing.wait(30)
        answers: list[Any] = []
        reads = threading.Thread(target=lambda: answers.extend(reader.get((i,)) for i in range(2, 12)))
        reads.start()
        reads.join(30)  # a liveness guard, not a timing: a blocked put never returns
        assert not reads.is_alive() and answers == [row(i) for i in range(2, 12)]
        dropped = reader.report().dropped
        assert dropped == 10 - 2  # seed 0 draws all ten at 99%: two wait in the queue, the rest are dropped
        release.set()
        reader.drain()
        assert reader.report().compared == 3 and reader.report().dropped == dropped
    finally:
        release.set()
        reader.close()
    value = by_label(metrics, "cellstream_migration_read_comparisons_dropped_total", "reason")
    assert value == {"queue_full": dropped}


def test_switch_reads_is_refused_before_the_copy_then_readers_follow_the_record(
        postgres_source_database: str, tmp_path: Path) -> None:
    db = psycopg.connect(postgres_source_database, autocommit=True)
    db.execute("CREATE TABLE trips (id bigint PRIMARY KEY, rider text, fare numeric(8, 2), note text)")
    db.execute("INSERT INTO trips SELECT i, 'r' || i, i * 1.25, NULL FROM generate_series(1, 50) i")
    db.close()
    spec_file = tmp_path / "trips.yaml"
    spec_file.write_text(spec_text(postgres_source_database))
    spec = load_migration(spec_file)
    store_url = f"sqlite:///{tmp_path}/store"
    switch = [sys.executable, "-m", "cellstream", "migrate", "switch", str(spec_file), "--store", store_url]
    with logstore.open(store_url, shards=8) as store:
        MigrationRecords(store).start(spec.name, spec.source.describe)  # copying
        refused = subprocess.run([*switch, "--reads", "10"], capture_output=True, text=True, timeout=60)
        assert refused.returncode == 9 and "the copy comes first" in refused.stderr, refused.stderr
        beyond = subprocess.run([*switch, "--reads", "101"], capture_output=True, text=True, timeout=60)
        assert beyond.returncode == 2 and "0..100" in beyond.stderr, beyond.stderr
        assert MigrationRecords(store).get(spec.name).read_percent is None
        source = open_source(spec)
        try:
            Mover(spec, source, store).run(until_caught_up=True)
            with psycopg.connect(postgres_source_database, autocommit=True) as db:
                db.execute("UPDATE trips SET note = 'not applied yet' WHERE id = 1")
            lagging = subprocess.run([*switch, "--reads", "10", "--max-lag", "0"], capture_output=True, text=True,
                                     timeout=60)
            assert lagging.returncode == 9 and "behind the source" in lagging.stderr, lagging.stderr
            Mover(spec, source, store).run(until_caught_up=True)
        finally:
            source.close()
        counting = CountingReader(postgres_source_database)
        with MigrationReader(spec, store, source_reader=counting, refresh_seconds=0.05) as reader:
            assert reader.percent == 0
            done = subprocess.run([*switch, "--reads", "100"], capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, done.stderr
            deadline = time.monotonic() + 30
            while reader.percent != 100 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert reader.percent == 100  # taken from the record, no restart
            assert reader.get((3,)) == row(3) and counting.calls == 0
            reader.set_percent(0)  # this process's dial holds until the record changes again
            reader.refresh()
            assert reader.percent == 0
        assert MigrationRecords(store).get(spec.name).read_percent == 100
    source = open_source(spec)
    source.stop_changes()
    source.close()


@pytest.fixture(params=["postgres_source", "mysql"])  # named for their markers (tests/conftest.py)
def typed_table(request: pytest.FixtureRequest) -> Iterator[SourceDB]:
    postgres = request.param == "postgres_source"
    db = SourceDB("postgres" if postgres else "mysql",
                  request.getfixturevalue("postgres_source_database" if postgres else "mysql_database"))
    db.execute("CREATE TABLE trips (id bigint PRIMARY KEY, rider text, fare numeric(8, 2), at timestamp NULL, "
               "doc json)")
    db.execute("INSERT INTO trips VALUES (1, 'a', 1.25, '2024-01-02 03:04:05', '{\"k\": [1, 2]}'), "
               "(2, 'b', 2.5, NULL, 'null'), (3, 'c', NULL, '2025-05-06 07:08:09', '[]')")
    yield db
    db.close()


def test_sql_row_reader_reads_a_row_as_the_migration_copies_it(typed_table: SourceDB) -> None:
    spec = load_migration(spec_text(typed_table.url).replace("BASE: [rider, fare]", "BASE: [rider, fare, at, doc]"))
    source = open_source(spec)
    try:
        copied = {row.key: row.values for row in source.rows_between(None, None)}
    finally:
        source.close()
    read = sql_row_reader(typed_table.url, "trips", ["id"])
    assert [read((k,)) for k in (2, 1, 3)] == [copied[(2,)], copied[(1,)], copied[(3,)]]
    assert read((4,)) is None and read((0,)) is None  # an absent key below the rows too
    with pytest.raises(MigrationSourceError, match="primary key"):
        sql_row_reader(typed_table.url, "trips", ["rider"])((1,))
