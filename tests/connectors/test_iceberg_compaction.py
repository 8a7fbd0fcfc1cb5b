"""Compaction and snapshot expiry of the Iceberg tables (`cellstream connect compact` of a `type: iceberg` sink, a
job): small files of closed partitions merged into target-sized ones in one snapshot, the rows the same by pyiceberg's
scan and by DuckDB over the data files; a reader never sees a row twice or misses one; a connector appending
meanwhile loses nothing; the connector's offsets survive compaction and expiry; expiry removes old snapshots,
the files only they referenced and old orphans, and keeps what the table needs; a SIGKILLed compaction resumes as a
job; a connector of the other source is refused."""

from __future__ import annotations

import datetime as dt
import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pyiceberg.schema import make_compatible_name

import logstore
from cellstream.cli.main import main
from connectors import compaction, iceberg_compaction
from connectors.config import IcebergSinkSpec, load_connector
from connectors.errors import ConfigurationError
from connectors.sinks.base import Position
from connectors.sinks.iceberg import IcebergSink, connector_offsets
from logstore import Cell
from logstore.jobs import JobRunner, JobStore, KindRegistry, RunnerConfig
from tests.harness import REPO

DAY = dt.datetime(2026, 3, 1, 12, tzinfo=dt.UTC)  # a closed day: before today's
CONFIG = """
name: lake
columns: [BASE, FARE]
sink:
  type: iceberg
  catalog: {catalog}
  warehouse: warehouse
"""


@pytest.fixture(params=["sqlite", "postgres"])
def catalog(request: pytest.FixtureRequest) -> str:
    """A catalog URL as the connector file gives it: a SQLite file beside it, or a fresh PostgreSQL database."""
    if request.param == "sqlite":
        return "sqlite:///catalog.db"
    url: str = request.getfixturevalue("postgres_database")
    return url


def connector_file(tmp_path: Path, catalog: str = "sqlite:///catalog.db") -> tuple[Path, IcebergSinkSpec]:
    path = tmp_path / "sink.yaml"
    path.write_text(CONFIG.format(catalog=catalog))
    spec = load_connector(path).sink
    assert isinstance(spec, IcebergSinkSpec)
    return path, spec


def cell(added_id: int, body: dict[str, Any], shard: int = 0, column: str = "BASE", days: int = 0,
         at: dt.datetime = DAY) -> Cell:
    return Cell(uuid.uuid4(), column, 1, body, added_id, shard, at + dt.timedelta(days=days, seconds=added_id))


def load(sink: IcebergSink, cells: list[Cell]) -> None:
    """One checkpoint: the cells handed over as the runtime does, then flushed (a snapshot per column)."""
    for c in cells:
        sink.begin(c.column, c.shard, 0)
    for c in cells:
        sink.add(c, Position(c.shard, c.added_id))
    sink.flush()


def checkpoints(spec: IcebergSinkSpec, n: int, per: int = 10, column: str = "BASE", first: int = 1,
                sink: IcebergSink | None = None) -> list[Cell]:
    """``n`` checkpoints of ``per`` cells over 2 closed days and 4 shards; the later ones add a field."""
    own = sink is None
    sink = sink or IcebergSink(spec, "lake")
    out = []
    for k in range(n):
        cells = [cell(i, {"n": i, **({"fare": {"total": i * 1.5}} if k >= n // 2 else {})}, shard=i % 4,
                      column=column, days=i % 2) for i in range(first + k * per, first + (k + 1) * per)]
        load(sink, cells)
        out.extend(cells)
    if own:
        sink.close()
    return out


def table_of(spec: IcebergSinkSpec, column: str = "BASE") -> Any:
    reader = IcebergSink(spec, "reader")
    try:
        return reader.table(column)
    finally:
        reader.close()


def scan(spec: IcebergSinkSpec, column: str = "BASE") -> list[dict[str, Any]]:
    return sorted(table_of(spec, column).scan().to_arrow().to_pylist(), key=lambda r: (r["shard"], r["added_id"]))


def live_files(spec: IcebergSinkSpec, column: str = "BASE") -> list[Any]:
    return [task.file for task in table_of(spec, column).scan().plan_files()]


def duck(spec: IcebergSinkSpec, column: str = "BASE") -> list[dict[str, Any]]:
    """The current data files read by DuckDB, columns named as the table names them."""
    table = table_of(spec, column)
    names = {make_compatible_name(f.name): f.name for f in table.schema().fields}
    files = [f.file_path.removeprefix("file://") for f in live_files(spec, column)]
    with duckdb.connect() as con:
        relation = con.sql(f"SELECT * FROM read_parquet({files!r}, union_by_name=true, hive_partitioning=false)")
        columns = [names[c] for c in relation.columns]
        return [dict(zip(columns, row, strict=True)) for row in relation.order("shard, added_id").fetchall()]


@pytest.fixture
def store(tmp_path: Path) -> Any:
    """The store holding the job records (a few shards: the jobs live in one)."""
    with logstore.open(f"sqlite:///{tmp_path / 'store'}", shards=4) as opened:
        yield opened


def runner_of(store: logstore.Store) -> JobRunner:
    return JobRunner(store, KindRegistry([compaction.LakeCompaction()]))


def test_small_files_of_closed_partitions_become_one_and_every_row_stays(
        catalog: str, tmp_path: Path, store: logstore.Store, capsys: pytest.CaptureFixture[str]) -> None:
    path, spec = connector_file(tmp_path, catalog)
    cells = checkpoints(spec, 6)
    sink = IcebergSink(spec, "lake")
    today = dt.datetime.now(dt.UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    for k in range(2):  # today's partition is open: left as it is
        load(sink, [cell(1000 + k, {"n": k}, at=today)])
    sink.close()
    before, files = scan(spec), live_files(spec)
    assert len(files) == 14 and duck(spec) == before  # 6 checkpoints x 2 days, and today's 2
    capsys.readouterr()
    store_url = f"sqlite:///{tmp_path / 'store'}"
    assert main(["connect", "compact", str(path), "--store", store_url, "--json", "--target-bytes", "1M"]) == 0
    job = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert job["state"] == "done" and job["done"] == 12 + 1  # 12 files merged, 1 table expired (FARE has none)
    after = live_files(spec)
    days = sorted(iceberg_compaction._day(f) for f in after)
    assert days == ["2026-03-01", "2026-03-02", today.date().isoformat(), today.date().isoformat()]
    rows = scan(spec)
    assert rows == before and duck(spec) == rows  # same rows, same schema, by pyiceberg and by DuckDB
    assert [r["fare.total"] for r in rows if r["added_id"] < 1000] == [
        c.body.get("fare", {}).get("total") for c in sorted(cells, key=lambda c: (c.shard, c.added_id))]
    table = table_of(spec)
    assert connector_offsets(table.metadata, "lake") == {s: max([1001] * (s == 0) + [c.added_id for c in cells
                                                                                       if c.shard == s])
                                                         for s in range(4)}
    assert table.current_snapshot().summary.get("cellstream.compacted") is not None
    [record] = JobStore(store).jobs()
    assert [s.name for s in record.steps] == ["BASE/created_at_day=2026-03-01", "BASE/created_at_day=2026-03-02",
                                              "expire snapshots"]


def test_a_reader_scanning_during_compaction_never_sees_a_row_twice_or_misses_one(
        tmp_path: Path, store: logstore.Store) -> None:
    """A reader scans the table over and over while checkpoints add small files and compactions replace them:
    each scan plans from one snapshot, so its count never drops and never holds a position twice."""
    path, spec = connector_file(tmp_path)
    writer = IcebergSink(spec, "lake")
    checkpoints(spec, 2, sink=writer)
    stop, seen = threading.Event(), []

    def read() -> None:
        reader = IcebergSink(spec, "reader")
        while not stop.is_set():
            reader._tables.clear()
            table = reader.table("BASE")
            assert table is not None
            got = table.scan(selected_fields=("shard", "added_id")).to_arrow()
            seen.append((got.num_rows, len(set(zip(got["shard"].to_pylist(), got["added_id"].to_pylist(),
                                                     strict=True)))))
        reader.close()
    thread = threading.Thread(target=read)
    thread.start()
    runner = runner_of(store)
    try:
        for round_ in range(4):
            checkpoints(spec, 3, first=1000 * (round_ + 1), sink=writer)
            job = runner.submit("compact", compaction.compaction_params(path, target_bytes=1 << 20))
            assert runner.run(job.id).state == "done"
    finally:
        stop.set()
        thread.join(60)
        writer.close()
    assert len(seen) > 10, "the reader hardly read: the test did not test"
    assert all(n == distinct for n, distinct in seen), "a row was seen twice"
    assert all(a[0] <= b[0] for a, b in itertools.pairwise(seen)), "rows went missing"
    assert seen[-1][0] == 20 + 4 * 30 and len(live_files(spec)) == 2


def test_a_connector_appending_while_a_partition_is_compacted_loses_nothing(
        tmp_path: Path, store: logstore.Store, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The live connector commits between the compaction's read and its commit (forced): the compaction's commit
    fails, and it commits its files on top of the new head; the appended rows and offsets stay."""
    path, spec = connector_file(tmp_path)
    live = IcebergSink(spec, "lake")
    cells = checkpoints(spec, 4, sink=live)
    late = [cell(i, {"n": i}, shard=i % 4, days=i % 2) for i in range(500, 510)]  # into the partitions compacted
    real = iceberg_compaction._write

    def write_then_the_connector_commits(*args: Any) -> Any:
        written = real(*args)
        if not getattr(write_then_the_connector_commits, "done", False):
            write_then_the_connector_commits.done = True  # type: ignore[attr-defined]
            load(live, late)
        return written
    monkeypatch.setattr(iceberg_compaction, "_write", write_then_the_connector_commits)
    caplog.set_level(logging.INFO, "connectors.iceberg_compaction")
    runner = runner_of(store)
    job = runner.submit("compact", compaction.compaction_params(path, target_bytes=1 << 20))
    assert runner.run(job.id).state == "done"
    assert any("committing on top" in r.getMessage() for r in caplog.records), "no race: the test did not test"
    got = [(r["shard"], r["added_id"]) for r in scan(spec)]
    assert sorted(got) == sorted((c.shard, c.added_id) for c in cells + late) and len(got) == len(set(got))
    # the late file of the day being merged stays beside the merged one; the next day's step merged its own
    assert len(live_files(spec)) == 3
    # the compaction carried the newest offsets (the late checkpoint's): a restarted connector skips them
    restarted = IcebergSink(spec, "lake")
    load(restarted, cells + late)
    assert restarted.snapshots_committed == 0 and len(scan(spec)) == len(got)
    for sink in (live, restarted):
        sink.close()


def test_offsets_survive_compaction_and_expiry(
        tmp_path: Path, store: logstore.Store) -> None:
    """Two connectors load one table; compaction and expiry of everything they can expire later, each
    restarted connector still finds its offsets and writes nothing again."""
    path, spec = connector_file(tmp_path)
    other = IcebergSink(spec, "other")
    theirs = [cell(i, {"n": i}, shard=7) for i in range(1, 6)]
    load(other, theirs)  # the other connector's last commit: the oldest snapshot
    other.close()
    mine = checkpoints(spec, 4)
    runner = runner_of(store)
    params = compaction.compaction_params(path, target_bytes=1 << 20, expire_older_than=dt.timedelta(0))
    assert runner.run(runner.submit("compact", params).id).state == "done"
    table = table_of(spec)
    assert len(table.metadata.snapshots) == 2  # the current one (the compaction's), and the other's newest
    assert connector_offsets(table.metadata, "lake") == {s: max(c.added_id for c in mine if c.shard == s)
                                                         for s in range(4)}
    assert connector_offsets(table.metadata, "other") == {7: 5}
    for name, cells in (("lake", mine), ("other", theirs)):
        restarted = IcebergSink(spec, name)
        load(restarted, cells)
        assert restarted.snapshots_committed == 0, f"{name} wrote its cells again"
        restarted.close()
    assert len(scan(spec)) == len(mine) + len(theirs)


def test_expiry_removes_old_snapshots_and_unreferenced_files_and_keeps_what_the_table_needs(
        tmp_path: Path, store: logstore.Store) -> None:
    path, spec = connector_file(tmp_path)
    checkpoints(spec, 4)
    rows, small = scan(spec), {f.file_path.removeprefix("file://") for f in live_files(spec)}
    data = Path(table_of(spec).location().removeprefix("file://")) / "data"
    old_orphan, new_orphan = data / "killed-writer-old.parquet", data / "killed-writer-new.parquet"
    for orphan in (old_orphan, new_orphan):  # files a SIGKILLed writer left, never committed
        pq.write_table(pa.table({"n": [1]}), orphan)
    two_days_ago = time.time() - 2 * 86400
    os.utime(old_orphan, (two_days_ago, two_days_ago))
    runner = runner_of(store)
    # the default retention (7 days): the replaced files stay for the snapshots that still hold them
    assert runner.run(runner.submit("compact", compaction.compaction_params(
        path, target_bytes=1 << 20)).id).state == "done"
    assert all(Path(p).exists() for p in small) and len(table_of(spec).metadata.snapshots) == 4 + 2
    assert not old_orphan.exists() and new_orphan.exists()  # the old orphan goes; a young one may be in flight
    current = {f.file_path.removeprefix("file://") for f in live_files(spec)}
    assert len(current) == 2 and not current & small
    assert runner.run(runner.submit("compact", compaction.compaction_params(
        path, target_bytes=1 << 20, expire_older_than=dt.timedelta(0))).id).state == "done"
    table = table_of(spec)
    assert [s.snapshot_id for s in table.metadata.snapshots] == [table.current_snapshot().snapshot_id]
    assert not any(Path(p).exists() for p in small), "the replaced files stayed"
    assert all(Path(p).exists() for p in current) and new_orphan.exists()
    on_disk = {str(p) for p in data.rglob("*.parquet")}
    assert on_disk == current | {str(new_orphan)}
    metadata = Path(table.location().removeprefix("file://")) / "metadata"
    manifests = {str(p) for p in metadata.glob("*.avro")}
    assert manifests == {table.current_snapshot().manifest_list.removeprefix("file://")} | {
        m.manifest_path.removeprefix("file://") for m in table.current_snapshot().manifests(table.io)}
    assert scan(spec) == rows and duck(spec) == rows


SCRIPT = """
import sys
import logstore
from connectors.compaction import LakeCompaction, compaction_params
from logstore.jobs import JobRunner, KindRegistry, RunnerConfig, ThrottleSettings
from pathlib import Path
store = logstore.open(sys.argv[1])
runner = JobRunner(store, KindRegistry([LakeCompaction()]), RunnerConfig(lease_seconds=1, progress_seconds=0))
params = compaction_params(Path(sys.argv[2]), target_bytes=1 << 20)
record = runner.submit("compact", params, throttle=ThrottleSettings(rate=8))
print(record.id, flush=True)
runner.run(record.id)
"""


def test_a_compaction_sigkilled_mid_way_resumes_and_the_table_stays_exact(
        tmp_path: Path, store: logstore.Store) -> None:
    path, spec = connector_file(tmp_path)
    checkpoints(spec, 8)
    checkpoints(spec, 8, column="FARE")
    expected = {column: scan(spec, column) for column in ("BASE", "FARE")}
    store_url = f"sqlite:///{tmp_path / 'store'}"
    worker = subprocess.Popen([sys.executable, "-c", SCRIPT, store_url, str(path)], stdout=subprocess.PIPE,
                              env={**os.environ, "PYTHONPATH": str(REPO)}, text=True, cwd=tmp_path)
    try:
        assert worker.stdout is not None
        job_id = worker.stdout.readline().strip()
        deadline = time.monotonic() + 90
        while JobStore(store).get(job_id).steps[0].state != "done":  # BASE's first day merged, the rest under way
            assert worker.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.3)
    finally:
        worker.send_signal(signal.SIGKILL)
        worker.wait(30)
    record = JobStore(store).get(job_id)
    assert record.state == "running" and [s.state for s in record.steps][-2:] != ["done", "done"]
    assert len(record.steps) == 5  # BASE and FARE, 2 days each, then the expiry
    for column in ("BASE", "FARE"):  # between two steps each table is whole
        assert scan(spec, column) == expected[column]
    time.sleep(1.2)  # the dead runner's lease runs out
    final = JobRunner(store, KindRegistry([compaction.LakeCompaction()]), RunnerConfig(lease_seconds=1)).run(job_id)
    assert final.state == "done"
    for column in ("BASE", "FARE"):
        assert scan(spec, column) == expected[column] and duck(spec, column) == expected[column]
        assert len(live_files(spec, column)) == 2


def test_a_connector_of_the_other_source_is_refused(
        tmp_path: Path, store: logstore.Store) -> None:
    """Positions of store shards and of Kafka partitions cannot be compared: a connector reading the other
    source is refused, also once a compaction carried the offsets forward."""
    path, spec = connector_file(tmp_path)
    checkpoints(spec, 2)
    kafka = IcebergSink(spec, "lake", source="kafka")
    with pytest.raises(ConfigurationError, match="positions of the store, this connector reads the kafka"):
        kafka.committed("BASE", 0)
    kafka.close()
    runner = runner_of(store)
    assert runner.run(runner.submit("compact", compaction.compaction_params(path, target_bytes=1 << 20)).id
                      ).state == "done"
    assert table_of(spec).current_snapshot().summary.get("cellstream.compacted") is not None
    kafka = IcebergSink(spec, "lake", source="kafka")
    with pytest.raises(ConfigurationError):
        load(kafka, [cell(100, {"n": 1})])
    kafka.close()
    again = IcebergSink(spec, "lake", source="store")
    assert again.committed("BASE", 0) == 20
    again.close()
