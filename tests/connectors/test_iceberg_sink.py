"""The Apache Iceberg sink on real SQL catalogs (SQLite and PostgreSQL): the table read back by pyiceberg's scan and
by DuckDB over its data files, schema evolution and the sibling-column rule, recovery from the offsets in the
snapshots, a commit that loses a race, and `cellstream connect run` SIGKILLed three times while cells are written."""

from __future__ import annotations

import collections
import datetime as dt
import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import duckdb
import pytest
from pyiceberg.manifest import ManifestEntryStatus
from pyiceberg.schema import make_compatible_name

import logstore
from cellstream.cli.main import main
from connectors.config import IcebergSinkConfig, IcebergSinkSpec, load_connector
from connectors.errors import SinkUnavailableError
from connectors.sinks.base import Position
from connectors.sinks.iceberg import IcebergSink, connector_offsets
from logstore import Cell
from tests.harness import REPO

SHARDS = 8
DAY = dt.datetime(2026, 3, 1, 12, tzinfo=dt.UTC)
# DuckDB's names for the Iceberg types the sink writes
DUCKDB_TYPE = {"string": "VARCHAR", "long": "BIGINT", "int": "INTEGER", "double": "DOUBLE", "boolean": "BOOLEAN",
               "timestamptz": "TIMESTAMP WITH TIME ZONE"}


@pytest.fixture(params=["sqlite", "postgres"])
def catalog(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A SQL catalog's URL: a SQLite file, or a fresh PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'catalog.db'}"
    url: str = request.getfixturevalue("postgres_database")
    return url


def make_sink(catalog: str, tmp_path: Path, connector: str = "lake") -> IcebergSink:
    return IcebergSink(IcebergSinkConfig(catalog=catalog, warehouse=str(tmp_path / "warehouse")), connector)


def cell(added_id: int, body: dict[str, Any], shard: int = 0, column: str = "BASE", days: int = 0) -> Cell:
    return Cell(uuid.uuid4(), column, 1, body, added_id, shard, DAY + dt.timedelta(days=days, seconds=added_id))


def feed(sink: IcebergSink, cells: list[Cell], start: int = 0) -> None:
    """As the runtime hands a batch over: begin per column and shard, then each cell."""
    for c in cells:
        sink.begin(c.column, c.shard, start)
    for c in cells:
        sink.add(c, Position(c.shard, c.added_id))


def scanned(sink: IcebergSink, column: str = "BASE") -> list[dict[str, Any]]:
    """The table's rows by pyiceberg's scan, as loaded now, sorted by (shard, added_id)."""
    sink._tables.clear()  # load it as it is now
    table = sink.table(column)
    assert table is not None
    return sorted(table.scan().to_arrow().to_pylist(), key=lambda r: (r["shard"], r["added_id"]))


def data_files(sink: IcebergSink, column: str = "BASE") -> list[str]:
    table = sink.table(column)
    assert table is not None
    return [task.file.file_path.removeprefix("file://") for task in table.scan().plan_files()]


def test_the_table_is_the_source_by_pyiceberg_and_by_duckdb_over_its_files(catalog: str, tmp_path: Path) -> None:
    sink = make_sink(catalog, tmp_path)
    first = [cell(i, {"n": i, "city": f"c{i % 3}", "fare": {"total": i * 1.5, "paid": i % 2 == 0},
                      "tags": [i, "x"], "empty": {}}, shard=i % SHARDS, days=i % 2) for i in range(1, 41)]
    second = [cell(i, {"n": i, "note": "late"}, shard=i % SHARDS, days=2) for i in range(41, 61)]
    feed(sink, first)
    sink.flush()
    feed(sink, second)
    sink.flush()
    rows = scanned(sink)
    source = sorted(first + second, key=lambda c: (c.shard, c.added_id))
    assert [(r["row_key"], r["shard"], r["added_id"], r["created_at"]) for r in rows] == [
        (str(c.row_key), c.shard, c.added_id, c.created_at) for c in source]
    assert [r["n"] for r in rows] == [c.body["n"] for c in source]
    assert [r["fare.total"] for r in rows] == [c.body.get("fare", {}).get("total") for c in source]
    assert [r["fare.paid"] for r in rows] == [c.body.get("fare", {}).get("paid") for c in source]
    assert {r["tags"] for r in rows} - {None} == {f'[{i},"x"]' for i in range(1, 41)}  # JSON text
    assert {r["empty"] for r in rows} == {"{}", None} and {r["note"] for r in rows} == {"late", None}
    table = sink.table("BASE")
    assert table is not None
    iceberg_schema = [(f.name, DUCKDB_TYPE[str(f.field_type)]) for f in table.schema().fields]
    files = data_files(sink)
    assert len(files) == 3  # a file per day partition and snapshot: 2 days, then 1
    # the files name a column as Avro allows (fare.total is fare_x2Etotal); Iceberg readers map them by field id
    names = {make_compatible_name(name): name for name, _ in iceberg_schema}
    assert "fare_x2Etotal" in names
    with duckdb.connect() as con:
        relation = con.sql(f"SELECT * FROM read_parquet({files!r}, union_by_name=true, hive_partitioning=false)")
        assert sorted((names[c], str(t)) for c, t in zip(relation.columns, relation.types, strict=True)) == sorted(
            iceberg_schema)
        got = relation.order("shard, added_id").fetchall()
        order = [names[c] for c in relation.columns]
    assert got == [tuple(r[n] for n in order) for r in rows]
    assert connector_offsets(table.metadata, "lake") == {s: max(c.added_id for c in source if c.shard == s)
                                                         for s in range(SHARDS)}
    sink.close()


def test_a_new_field_is_a_new_column_and_a_type_clash_goes_to_a_sibling_column(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    sink = make_sink(f"sqlite:///{tmp_path / 'catalog.db'}", tmp_path)
    feed(sink, [cell(1, {"fare": 10, "price": 2.5, "city": "a", "ok": True})])
    sink.flush()
    caplog.set_level(logging.WARNING, "connectors.sinks.iceberg")
    feed(sink, [cell(2, {"fare": 10.5, "price": 3, "city": 7, "ok": 1, "new": "x"}),
                cell(3, {"fare": 11.5, "city": [1, {"a": 2}], "ok": "yes"}),
                cell(4, {"fare": 12, "ok": False})])
    sink.flush()
    table = sink.table("BASE")
    assert table is not None
    types = {f.name: str(f.field_type) for f in table.schema().fields}
    assert {k: v for k, v in types.items() if k not in ("row_key", "column", "ref_key", "added_id", "shard",
                                                        "created_at")} == {
        "fare": "long", "price": "double", "city": "string", "ok": "boolean", "new": "string",
        "fare__double": "double", "ok__long": "long", "ok__string": "string"}
    rows = [{k: v for k, v in r.items() if k in types and k not in ("row_key", "column", "ref_key", "shard",
                                                                        "created_at")} for r in scanned(sink)]
    assert rows == [
        {"added_id": 1, "fare": 10, "price": 2.5, "city": "a", "ok": True, "new": None, "fare__double": None,
         "ok__long": None, "ok__string": None},
        {"added_id": 2, "fare": None, "price": 3.0, "city": "7", "ok": None, "new": "x", "fare__double": 10.5,
         "ok__long": 1, "ok__string": None},
        {"added_id": 3, "fare": None, "price": None, "city": '[1,{"a":2}]', "ok": None, "new": None,
         "fare__double": 11.5, "ok__long": None, "ok__string": "yes"},
        {"added_id": 4, "fare": 12, "price": None, "city": None, "ok": False, "new": None, "fare__double": None,
         "ok__long": None, "ok__string": None}]
    feed(sink, [cell(5, {"fare": 14.5, "ok": 0})])  # the same clashes in the next checkpoint: not logged again
    sink.flush()
    assert len(sink.conflicts) == 3 and all("go to" in c for c in sink.conflicts)  # once each, not per value
    assert len([r for r in caplog.records if "go to" in r.getMessage()]) == 3
    # the sibling's own clash goes one level down, and a sink started afresh routes as the first did
    again = make_sink(f"sqlite:///{tmp_path / 'catalog.db'}", tmp_path)
    feed(again, [cell(6, {"fare__double": "n/a", "fare": 13.5})])
    again.flush()
    last = scanned(again)[-1]
    assert (last["fare__double__string"], last["fare__double"], last["fare"]) == ("n/a", 13.5, None)


def test_a_restarted_sink_handed_committed_cells_again_writes_nothing_twice(catalog: str, tmp_path: Path) -> None:
    """A crash after the sink's commit, before the source's: the source hands over cells the table has."""
    cells = [cell(i, {"n": i}, shard=i % 4) for i in range(1, 61)]
    first = make_sink(catalog, tmp_path)
    feed(first, cells[:30])
    first.flush()  # committed to the table; the source's commit never happens
    feed(first, cells[30:45])  # buffered, never flushed: the process dies
    first.close()
    restarted = make_sink(catalog, tmp_path)
    feed(restarted, cells, start=0)  # the source resumes from its own (older) commit: everything again
    restarted.flush()
    rows = scanned(restarted)
    assert sorted((r["shard"], r["added_id"]) for r in rows) == sorted((c.shard, c.added_id) for c in cells)
    assert sorted(r["row_key"] for r in rows) == sorted(str(c.row_key) for c in cells)
    restarted.close()


def test_a_commit_that_loses_a_race_is_retried_with_the_offsets_merged_again(
        catalog: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Two processes of one connector (Kafka partitions split between them) commit to one table: the one whose
    table is stale loses the race, then refreshes, merges the other's offsets with its own and retries."""
    one, two = make_sink(catalog, tmp_path), make_sink(catalog, tmp_path)
    feed(one, [cell(1, {"n": 1}, shard=0)])
    one.flush()
    feed(two, [cell(1, {"n": 1}, shard=1)])  # two loads the table now...
    feed(one, [cell(2, {"n": 2}, shard=0)])
    one.flush()  # ...and one commits after it did
    caplog.set_level(logging.WARNING, "connectors.sinks.iceberg")
    feed(two, [cell(2, {"f": 2.5}, shard=1)])
    two.flush()
    assert any("lost a race" in r.getMessage() for r in caplog.records), "no race was lost: the test did not test"
    assert sorted((r["shard"], r["added_id"]) for r in scanned(two)) == [(0, 1), (0, 2), (1, 1), (1, 2)]
    table = two.table("BASE")
    assert table is not None and table.current_snapshot() is not None
    assert connector_offsets(table.metadata, "lake") == {0: 2, 1: 2}
    assert "f" in table.schema().column_names
    on_disk = sorted(str(p) for p in (tmp_path / "warehouse").rglob("*.parquet"))
    assert on_disk == sorted(data_files(two)), "the losing attempt's files were left behind"
    for sink in (one, two):
        sink.close()


def test_a_commit_found_in_the_table_after_a_lost_race_is_not_made_twice(tmp_path: Path) -> None:
    """Two processes handed the same cells (one that has not yet learned it lost its partitions): the one
    committing second finds them committed in the refreshed table and writes nothing."""
    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    cells = [cell(i, {"n": i}, shard=i % 2) for i in range(1, 11)]
    one, two = make_sink(url, tmp_path), make_sink(url, tmp_path)
    feed(one, cells)
    feed(two, cells)
    one.flush()
    two.flush()
    assert sorted((r["shard"], r["added_id"]) for r in scanned(two)) == sorted((c.shard, c.added_id) for c in cells)
    assert (one.snapshots_committed, two.snapshots_committed, two.uncommitted()) == (1, 0, {})
    for sink in (one, two):
        sink.close()


def test_a_catalog_that_cannot_be_reached_is_retriable_and_keeps_its_password(tmp_path: Path) -> None:
    sink = make_sink("postgresql://cellstream:s3cret@127.0.0.1:1/nowhere", tmp_path)
    with pytest.raises(SinkUnavailableError) as caught:
        feed(sink, [cell(1, {"n": 1})])
    assert caught.value.retriable and "s3cret" not in str(caught.value) and "connecting to the catalog" in str(
        caught.value)


# -- cellstream connect run, SIGKILLed while cells are written --------------------------------------------
CONFIG = """
name: lake
columns: [BASE, FARE]
checkpoint_interval: {interval}
sink:
  type: iceberg
  catalog: {catalog}
  warehouse: warehouse
"""


def source(store: logstore.Store, column: str) -> list[tuple[int, int, str]]:
    out: list[tuple[int, int, str]] = []
    for shard in range(SHARDS):
        location = 0
        while cells := store.get_cells_for_shard(shard, location, 1000, columns=[column])[0]:
            out.extend((c.shard, c.added_id, str(c.row_key)) for c in cells)
            location = cells[-1].added_id
    return sorted(out)


def trips(store: logstore.Store, n: int) -> None:
    store.put_cells([(uuid.uuid4(), column, 1, {"n": i, "city": f"c{i % 5}", "fare": {"total": i * 1.5}})
                     for i in range(n) for column in ("BASE", "FARE", "OTHER")])


@pytest.fixture
def lake(catalog: str, tmp_path: Path) -> tuple[Path, IcebergSinkSpec]:
    """The connector file (its SQLite catalog given relative to it) and its sink as loaded."""
    path = tmp_path / "sink.yaml"
    relative = "sqlite:///catalog.db" if catalog.startswith("sqlite") else catalog  # relative to the file
    path.write_text(CONFIG.format(interval=0.05, catalog=relative))
    spec = load_connector(path).sink
    assert isinstance(spec, IcebergSinkSpec)
    return path, spec


def held(spec: IcebergSinkSpec, column: str) -> list[tuple[int, int, str]]:
    reader = IcebergSink(spec, "reader")
    try:
        table = reader.table(column)
        if table is None or table.current_snapshot() is None:
            return []
        return sorted((r["shard"], r["added_id"], r["row_key"])
                      for r in table.scan(selected_fields=("shard", "added_id", "row_key")).to_arrow().to_pylist())
    finally:
        reader.close()


def test_sigkilled_three_times_while_cells_are_written_then_drained_loses_and_repeats_nothing(
        sqlite_url: str, lake: tuple[Path, IcebergSinkSpec], capsys: pytest.CaptureFixture[str]) -> None:
    path, spec = lake
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with logstore.open(sqlite_url, shards=SHARDS) as store:
        trips(store, 300)
        stop = threading.Event()

        def write() -> None:
            while not stop.is_set():
                trips(store, 25)
                time.sleep(0.02)
        writer = threading.Thread(target=write)
        writer.start()
        try:
            for kill in range(3):
                worker = subprocess.Popen([sys.executable, "-m", "cellstream", "connect", "run", str(path), "--store",
                                           sqlite_url], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                try:
                    before = len(held(spec, "BASE"))
                    deadline = time.monotonic() + 90
                    while len(held(spec, "BASE")) <= before:  # until this process committed something
                        assert worker.poll() is None, worker.communicate()[1].decode()[-2000:]
                        assert time.monotonic() < deadline, f"kill {kill}: nothing was committed"
                        time.sleep(0.05)
                    time.sleep(random.uniform(0.0, 0.15))  # at any point of a checkpoint
                finally:
                    worker.send_signal(signal.SIGKILL)
                    worker.wait(30)
                    assert worker.stderr is not None
                    worker.stderr.close()
        finally:
            stop.set()
            writer.join(60)
        assert main(["connect", "run", str(path), "--drain", "--store", sqlite_url, "--json"]) == 0
        for column in ("BASE", "FARE"):
            rows = held(spec, column)
            assert len(rows) == len(set(rows)), f"{column}: duplicated rows"
            assert rows == source(store, column), f"{column}: rows lost or added"
        reader = IcebergSink(spec, "reader")
        for column in ("BASE", "FARE"):
            table = reader.table(column)
            assert table is not None
            per_checkpoint = collections.Counter(
                (entry["snapshot_id"], entry["data_file"]["partition"]["created_at_day"])
                for entry in table.inspect.entries().to_pylist()
                if entry["status"] == ManifestEntryStatus.ADDED.value)
            assert per_checkpoint and max(per_checkpoint.values()) == 1  # a file per day partition and checkpoint
        files = sum(len(reader.table(c).inspect.files()) for c in ("BASE", "FARE"))  # type: ignore[union-attr]
        reader.close()
        assert main(["connect", "status", str(path), "--store", sqlite_url, "--json"]) == 0
        status = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert status["lag_cells"] == 0 and status["sink"]["type"] == "iceberg"
        assert status["sink"]["files"] == files and status["sink"]["rows"] == len(source(store, "BASE")) * 2
        assert status["sink"]["last_commit"]["kind"] == "append" and status["sink"]["bytes"] > 0
