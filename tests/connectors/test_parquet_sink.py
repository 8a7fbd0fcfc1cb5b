"""The Parquet lake sink, read back with DuckDB (the independent reader): the lake equals the source,
replays of uncommitted cells leave no duplicate, schema evolution, rotation, cells that cannot convert."""

from __future__ import annotations

import datetime as dt
import json
import uuid
from pathlib import Path
from typing import Any

import duckdb
import pytest

import logstore
from connectors.errors import ConversionError
from connectors.sinks.base import Position
from connectors.sinks.parquet import ParquetSink, ParquetSinkConfig

SHARDS = 4


@pytest.fixture
def store(sqlite_url: str) -> logstore.Store:
    return logstore.open(sqlite_url, shards=SHARDS)


def lake(root: Path, column: str) -> list[dict[str, Any]]:
    """Every row of a column's lake, as DuckDB reads it, in (shard, added_id) order."""
    with duckdb.connect() as con:
        result = con.execute(f"SELECT * FROM read_parquet('{root}/{column}/date=*/*.parquet', "
                             "hive_partitioning=true, union_by_name=true) ORDER BY shard, added_id")
        names = [d[0] for d in result.description]
        return [dict(zip(names, row, strict=True)) for row in result.fetchall()]


def count(path: Path) -> int:
    with duckdb.connect() as con:
        return int(con.execute(f"SELECT count(*) FROM read_parquet('{path}')").fetchall()[0][0])


def log(store: logstore.Store, column: str) -> list[logstore.Cell]:
    out = []
    for shard in range(SHARDS):
        out.extend(store.get_cells_for_shard(shard, 0, 10_000, columns=[column])[0])
    return out


def feed(sink: ParquetSink, cells: list[logstore.Cell]) -> None:
    for cell in cells:
        sink.add(cell, Position(cell.shard, cell.added_id))


def test_the_lake_equals_the_source_and_reads_with_duckdb(store: logstore.Store, tmp_path: Path) -> None:
    rows = [uuid.uuid4() for _ in range(40)]
    store.put_cells([(r, "BASE", 1, {"city": f"c{i % 3}", "fare": 10 + i, "trip": {"km": i / 2, "pool": i % 2 == 0}})
                     for i, r in enumerate(rows)])
    store.put_cells([(r, "BASE", 2, {"city": "moved", "fare": 99}) for r in rows[:5]])
    sink = ParquetSink(ParquetSinkConfig(root=tmp_path / "lake"))
    cells = log(store, "BASE")
    feed(sink, cells)
    sink.flush()
    got = lake(tmp_path / "lake", "BASE")
    assert len(got) == len(cells) == 45
    by_key = {(g["row_key"], g["ref_key"]): g for g in got}
    for cell in cells:
        row = by_key[(str(cell.row_key), cell.ref_key)]
        assert (row["shard"], row["added_id"], row["column"]) == (cell.shard, cell.added_id, "BASE")
        assert row["created_at"] == cell.created_at and row["date"] == cell.created_at.date()
        assert row["city"] == cell.body["city"] and row["fare"] == cell.body["fare"]
        trip = cell.body.get("trip")
        assert row["trip.km"] == (trip["km"] if trip else None) and row["trip.pool"] == (trip["pool"] if trip else None)
    files = sink.files("BASE")
    assert all(f.parent.name.startswith("date=") for f in files)
    # One file per column and date for the checkpoint, holding every shard's cells: not one per shard.
    assert len(files) == len({c.created_at.date() for c in cells}) and len({c.shard for c in cells}) == SHARDS


def test_a_replay_after_a_crash_leaves_no_duplicate(store: logstore.Store, tmp_path: Path) -> None:
    """A process flushes batches, commits some, dies; the next one is handed the cells after the commit again,
    cut into different batches: the lake ends with every cell exactly once. The commit falls inside a
    flushed file here (a flush writes cells acknowledged after the commit took its positions): that file is
    rewritten with only its committed rows."""
    store.put_cells([(uuid.uuid4(), col, 1, {"n": i}) for i in range(120) for col in ("BASE", "FARE") if i % 2 or
                     col == "BASE"])
    cells = sorted(log(store, "BASE") + log(store, "FARE"), key=lambda c: (c.shard, c.added_id))
    by_shard: dict[int, list[logstore.Cell]] = {}
    for cell in cells:
        by_shard.setdefault(cell.shard, []).append(cell)
    committed: dict[int, int] = {}
    first = ParquetSink(ParquetSinkConfig(root=tmp_path / "lake"))
    for shard, mine in by_shard.items():  # batches of 7, flushed; the commit ends inside the third one
        starts = range(0, len(mine), 7)
        for n, start in enumerate(starts):
            feed(first, mine[start:start + 7])
            if start != starts[-1]:  # each shard's last batch waits for the next flush
                first.flush()
            if n == 2:
                committed[shard] = mine[start + 3].added_id
    first.close()
    duplicated = len(lake(tmp_path / "lake", "BASE")) + len(lake(tmp_path / "lake", "FARE"))
    last = list(by_shard.values())[-1]
    assert duplicated == len(cells) - len(last[range(0, len(last), 7)[-1]:])  # that batch died unflushed
    second = ParquetSink(ParquetSinkConfig(root=tmp_path / "lake"))
    for shard, mine in by_shard.items():  # the replay, in batches of 11
        rest = [c for c in mine if c.added_id > committed[shard]]
        for column in ("BASE", "FARE"):  # as the runtime does with the first cell of each column it hands over
            second.begin(column, shard, next(c.added_id for c in rest if c.column == column))
        for start in range(0, len(rest), 11):
            feed(second, rest[start:start + 11])
            second.flush()
    for column in ("BASE", "FARE"):
        got = [(r["shard"], r["added_id"]) for r in lake(tmp_path / "lake", column)]
        assert got == [(c.shard, c.added_id) for c in cells if c.column == column]


def test_schema_evolution_new_fields_widening_and_conflicts(store: logstore.Store, tmp_path: Path) -> None:
    key = uuid.uuid4()
    sink = ParquetSink(ParquetSinkConfig(root=tmp_path / "lake"))
    bodies: list[dict[str, Any]] = [{"fare": 10, "code": 7}, {"fare": 10.5, "code": 8, "tip": 1},
                                    {"fare": 11, "code": "A7", "tags": ["x", 1]}, {"fare": None, "code": None}]
    for ref, body in enumerate(bodies, 1):
        feed(sink, [store.put_cell(key, "BASE", ref, body)])
        sink.flush()  # one file each: the schema evolves across files
    restarted = ParquetSink(ParquetSinkConfig(root=tmp_path / "lake"))  # the registry survives a restart
    feed(restarted, [store.put_cell(key, "BASE", 5, {"fare": 12, "code": 9})])
    restarted.flush()
    got = lake(tmp_path / "lake", "BASE")
    assert [r["fare"] for r in got] == [10.0, 10.5, 11.0, None, 12.0]
    assert [r["code"] for r in got] == ["7", "8", "A7", None, "9"]  # int, then a string: a string column
    assert [r["tip"] for r in got] == [None, 1, None, None, None]  # a new field: nullable, absent before
    assert json.loads(got[2]["tags"]) == ["x", 1]
    assert sink.conflicts == ["column BASE: field 'code' was int, got string; it is a string column from now on"]
    schema = json.loads((tmp_path / "lake" / "BASE" / "_schema.json").read_text())
    assert schema == {"code": "string", "fare": "float", "tags": "json", "tip": "int"}


def test_rotation_by_rows_and_by_time(store: logstore.Store, tmp_path: Path) -> None:
    cells = store.put_cells([(uuid.uuid4(), "BASE", 1, {"n": i}) for i in range(60)])
    sink = ParquetSink(ParquetSinkConfig(root=tmp_path / "rows", max_rows=10))
    feed(sink, sorted(cells, key=lambda c: (c.shard, c.added_id)))
    sink.flush()
    assert [count(f) for f in sink.files("BASE")] == [10] * 6  # rotated at 10 rows, across shards
    assert len(lake(tmp_path / "rows", "BASE")) == 60
    now = [0.0]
    timed = ParquetSink(ParquetSinkConfig(root=tmp_path / "time", max_seconds=5), clock=lambda: now[0])
    mine = [c for c in cells if c.shard == cells[0].shard]
    feed(timed, mine[:2])
    now[0] = 6.0
    feed(timed, mine[2:3])  # the buffer is older than 5 s: staged with this cell
    feed(timed, mine[3:4])
    timed.flush()
    assert sorted(count(f) for f in timed.files("BASE")) == [1, 3]


@pytest.mark.parametrize(("body", "message"), [
    ({"row_key": "x"}, "collides with the cell's own column"),
    ({"a": {"b": 1}, "a.b": 2}, "flatten to 'a.b' twice"),
])
def test_a_cell_that_cannot_convert_is_refused_and_nothing_of_it_is_written(
        store: logstore.Store, tmp_path: Path, body: dict[str, Any], message: str) -> None:
    sink = ParquetSink(ParquetSinkConfig(root=tmp_path / "lake"))
    good = store.put_cell(uuid.uuid4(), "BASE", 1, {"n": 1})
    bad = store.put_cell(uuid.uuid4(), "BASE", 1, body)
    feed(sink, [good])
    with pytest.raises(ConversionError, match=message):
        feed(sink, [bad])
    sink.flush()
    assert [r["row_key"] for r in lake(tmp_path / "lake", "BASE")] == [str(good.row_key)]
    assert not (tmp_path / "lake" / "BASE" / "_schema.json").read_text().count("row_key")


def test_a_date_partition_follows_the_cell_time(store: logstore.Store, tmp_path: Path) -> None:
    cell = store.put_cell(uuid.uuid4(), "BASE", 1, {"n": 1})
    older = cell._replace(created_at=cell.created_at - dt.timedelta(days=1), added_id=cell.added_id + 1)
    sink = ParquetSink(ParquetSinkConfig(root=tmp_path / "lake"))
    feed(sink, [cell, older])
    sink.flush()
    assert sorted(p.name for p in (tmp_path / "lake" / "BASE").glob("date=*")) == sorted(
        f"date={c.created_at.date()}" for c in (cell, older))


def test_files_of_interleaved_columns_rotated_apart_all_stay(store: logstore.Store, tmp_path: Path) -> None:
    """Two columns of one row share a shard, so their files' position ranges overlap: a flush replaces only
    what an earlier process left, never this process's own files."""
    key = uuid.uuid4()
    cells = store.put_cells([(key, col, ref, {"ref": ref}) for ref in range(1, 11) for col in ("BASE", "FARE")])
    sink = ParquetSink(ParquetSinkConfig(root=tmp_path / "lake", max_rows=3))
    feed(sink, cells)
    sink.flush()
    assert sink.files_written == 8  # 4 files a column: 3 + 3 + 3 + 1 rows
    for column in ("BASE", "FARE"):
        assert [r["ref"] for r in lake(tmp_path / "lake", column)] == list(range(1, 11))


def test_a_failed_flush_keeps_every_row_for_the_next_one(store: logstore.Store, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The runtime skips the commit when a flush fails and flushes again later: nothing may be dropped."""
    import pyarrow.parquet as pq

    from connectors.errors import SinkUnavailableError

    # 31 cells over 4 shards, 4 rows a file: at least 4 rotations on the way, and rows left for the flush.
    cells = sorted(store.put_cells([(uuid.uuid4(), "BASE", 1, {"n": i}) for i in range(31)]),
                   key=lambda c: (c.shard, c.added_id))
    sink = ParquetSink(ParquetSinkConfig(root=tmp_path / "lake", max_rows=4))
    real, calls, fail = pq.write_table, [], {2}

    def failing(*args: Any, **kwargs: Any) -> None:
        calls.append(1)
        if len(calls) in fail:
            raise OSError(28, "No space left on device")
        real(*args, **kwargs)
    monkeypatch.setattr(pq, "write_table", failing)
    failed_adds = 0
    for cell in cells:  # rotation writes on the way; the second one fails, and the cell's add with it
        try:
            sink.add(cell, Position(cell.shard, cell.added_id))
        except SinkUnavailableError:
            failed_adds += 1
            sink.add(cell, Position(cell.shard, cell.added_id))  # the runtime delivers the batch again
    fail.add(len(calls) + 1)  # the flush's first file
    with pytest.raises(SinkUnavailableError, match="No space left"):
        sink.flush()
    sink.flush()
    assert failed_adds == 1
    assert [(r["shard"], r["added_id"]) for r in lake(tmp_path / "lake", "BASE")] == [
        (c.shard, c.added_id) for c in cells]


def test_a_commit_cut_short_after_its_record_is_rolled_forward(store: logstore.Store, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The record is the commit point: a writer killed between it and its last move has committed, and the
    next one to open the lake finishes the moves before anyone reads its positions (else those cells would
    be skipped as loaded while no file holds them)."""
    from connectors.errors import SinkUnavailableError
    from connectors.sinks import commits

    cells = log_of(store, 30)
    sink = ParquetSink(ParquetSinkConfig(root=tmp_path / "lake", max_rows=7))
    feed(sink, cells)
    real, moves = commits.os.replace, []

    def dying(src: Any, dst: Any) -> None:
        moves.extend([dst] if str(dst).endswith(".parquet") else [])
        if len(moves) > 2:
            raise OSError(5, "Input/output error")  # the process dies here, as far as the lake knows
        real(src, dst)
    monkeypatch.setattr(commits.os, "replace", dying)
    with pytest.raises(SinkUnavailableError):
        sink.flush()
    monkeypatch.setattr(commits.os, "replace", real)
    sink.log._alive.close()  # type: ignore[union-attr]  # killed: its lock goes with its process
    assert 0 < len(lake(tmp_path / "lake", "BASE")) < len(cells)
    restarted = ParquetSink(ParquetSinkConfig(root=tmp_path / "lake"))
    assert len(lake(tmp_path / "lake", "BASE")) == len(cells)
    feed(restarted, cells)  # handed over again from the start: every one is held already
    restarted.flush()
    assert [(r["shard"], r["added_id"]) for r in lake(tmp_path / "lake", "BASE")] == [
        (c.shard, c.added_id) for c in cells]


def test_a_live_writer_that_read_a_cut_short_commit_finishes_it_before_its_own(
        store: logstore.Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second writer already running reads the dead one's record (its positions) before anyone finished
    its moves; its own commit must finish them, not remove them with the dead writer's staging folder."""
    from connectors.errors import SinkUnavailableError
    from connectors.sinks import commits

    cells = log_of(store, 30)
    mine = [c for c in cells if c.shard == 0]
    theirs = [c for c in cells if c.shard != 0]
    live = ParquetSink(ParquetSinkConfig(root=tmp_path / "lake"))
    dying = ParquetSink(ParquetSinkConfig(root=tmp_path / "lake", max_rows=5))
    feed(dying, theirs)
    real = commits.os.replace

    def cut(src: Any, dst: Any) -> None:
        if str(dst).endswith(".parquet"):
            raise OSError(5, "Input/output error")  # killed after its record, before its first move
        real(src, dst)
    monkeypatch.setattr(commits.os, "replace", cut)
    with pytest.raises(SinkUnavailableError):
        dying.flush()
    monkeypatch.setattr(commits.os, "replace", real)
    dying.log._alive.close()  # type: ignore[union-attr]  # SIGKILLed
    assert live.committed("BASE", theirs[0].shard) == max(c.added_id for c in theirs if c.shard == theirs[0].shard)
    feed(live, mine)
    live.flush()
    assert [(r["shard"], r["added_id"]) for r in lake(tmp_path / "lake", "BASE")] == [
        (c.shard, c.added_id) for c in cells]


def test_staged_files_of_a_dead_writer_go_and_a_live_one_keeps_its_own(store: logstore.Store,
                                                                       tmp_path: Path) -> None:
    cells = log_of(store, 20)
    dead = ParquetSink(ParquetSinkConfig(root=tmp_path / "lake", max_rows=5))
    live = ParquetSink(ParquetSinkConfig(root=tmp_path / "lake", max_rows=5))
    feed(dead, cells[:10])  # rotations staged two files, never committed
    feed(live, cells[10:])
    assert len(list(dead.log.staging.iterdir())) == 2 and len(list(live.log.staging.iterdir())) == 2
    dead.log._alive.close()  # type: ignore[union-attr]  # SIGKILLed
    ParquetSink(ParquetSinkConfig(root=tmp_path / "lake")).close()  # the next writer to open the lake
    assert not dead.log.staging.exists()
    live.flush()
    assert [(r["shard"], r["added_id"]) for r in lake(tmp_path / "lake", "BASE")] == [
        (c.shard, c.added_id) for c in cells[10:]]


def log_of(store: logstore.Store, n: int) -> list[logstore.Cell]:
    store.put_cells([(uuid.uuid4(), "BASE", 1, {"n": i}) for i in range(n)])
    return sorted(log(store, "BASE"), key=lambda c: (c.shard, c.added_id))
