"""Shards move with their secondary index rows (logstore/backends/mysql/index_moves.py), on two MariaDB nodes:
the copy and the drop are exact and resumable after an interruption at any chunk, an index write refuses a
shard fenced on its node (whole) and the index store sends it where the shard went, scatter queries count
each entry once before, during and after a move, and `index verify` finds and deletes a moved shard's
source copy. The locator tables get their shard key at open."""

from __future__ import annotations

import json
import random
import threading
import time
import tomllib
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pymysql
import pytest

import logstore
from cellstream.cli.main import main
from indexer import Index
from indexer.indexes.applier import IndexApplier
from indexer.indexes.backfill import backfill
from indexer.indexes.catalog import IndexCatalog
from indexer.indexes.verify import verify
from logstore.backends.mysql import index_moves, moves
from logstore.backends.mysql.index_tables import MySQLIndexRecorder
from logstore.backends.mysql.recorder import MySQLRecorder
from logstore.index_tables.persistence import EntryWrite, Fix, IndexChange, StrayRows, encode_row
from tests.harness.index_support import seed, trip
from tests.harness.stores import keys_in_shard, two_nodes

NAME = "driver_partner_index"
SPEC = seed().spec
T0 = 1000  # a first added_id for changes made up here


class Interrupted(Exception):
    """A copy or drop stopped between two chunks, as a kill would stop it."""


def node(store: logstore.Store, name: str) -> MySQLRecorder:
    recorder = store.node_recorder(name)
    assert isinstance(recorder, MySQLRecorder)
    return recorder


def tables(recorder: MySQLRecorder) -> MySQLIndexRecorder:
    assert isinstance(recorder.indexes, MySQLIndexRecorder)
    return recorder.indexes


def sql(recorder: MySQLRecorder, statement: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    def run(cur: pymysql.cursors.Cursor) -> list[tuple[Any, ...]]:
        cur.execute(statement, args)
        return list(cur.fetchall()) if cur.description else []
    return recorder.run("test", run)


def shard_rows(recorder: MySQLRecorder, shard: int) -> dict[str, set[tuple[Any, ...]]]:
    """Every index row of ``shard`` on the node, by table."""
    return {
        "entries": set(sql(recorder, f"SELECT * FROM {SPEC.table} WHERE shard = %s", (shard,))),
        "locators": set(sql(recorder, f"SELECT * FROM {SPEC.locator_table} WHERE shard = %s", (shard,))),
        "positions": set(sql(recorder, "SELECT * FROM cellstream_index_positions WHERE shard = %s", (shard,))),
    }


def count(rows: dict[str, set[tuple[Any, ...]]]) -> int:
    return sum(len(r) for r in rows.values())


def driver_in(store: logstore.Store, shard: int) -> uuid.UUID:
    """A driver whose entries live in ``shard``."""
    while store.indexes.entry_shard(SPEC, driver := uuid.uuid4()) != shard:
        pass
    return driver


def values(driver: uuid.UUID, minute: int) -> dict[str, Any]:
    return seed().entry(trip(driver, uuid.UUID(int=7), minute))


def fill(store: logstore.Store, source: str, target: str, shard: int) -> None:
    """The target's row of a move being copied: fenced towards the source (moves.py's *filling*)."""
    sql(node(store, target), "INSERT INTO cellstream_shards (shard, last_id, fence, moved_to) VALUES (%s, 0, %s, %s)",
        (shard, source, source))


def fence_source(store: logstore.Store, source: str, target: str, shard: int) -> None:
    sql(node(store, source), "UPDATE cellstream_shards SET fence = %s WHERE shard = %s", (target, shard))


def fence(store: logstore.Store, source: str, target: str, shard: int) -> None:
    """The rows of a move after its fence, before its switch: both fenced, each towards the other."""
    fill(store, source, target, shard)
    fence_source(store, source, target, shard)


# -- copy and drop, chunk by chunk -----------------------------------------------------------------
SMALL = 8  # shards of the store of the copy tests: 0-3 on a, 4-7 on b
MOVING = 1


@pytest.fixture
def small_cluster(mysql_database_factory: Callable[[], str], tmp_path: Path) -> Path:
    return two_nodes(tmp_path / "small.toml", [mysql_database_factory(), mysql_database_factory()], SMALL)


@pytest.fixture
def small(small_cluster: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[logstore.Store]:
    monkeypatch.setattr(index_moves, "CHUNK", 4)
    with logstore.open(small_cluster) as store:
        store.indexes.create(SPEC)
        yield store


def index_a_shard(store: logstore.Store) -> None:
    """Entries, locators and positions in every shard, 23 rows of each in MOVING; a few rows in MOVING whose
    entries live elsewhere, and entries in MOVING of rows of other shards."""
    rnd = random.Random(5)
    changes: list[IndexChange] = []
    heads: dict[int, int] = {}

    def change(row: uuid.UUID, driver: uuid.UUID) -> None:
        shard = store.shard_of(row)
        heads[shard] = heads.get(shard, T0) + 1
        changes.append(IndexChange(shard, heads[shard], row, 1, values(driver, rnd.randint(0, 500))))
    for row in keys_in_shard(store, MOVING, 23):
        change(row, driver_in(store, MOVING))
    for row in keys_in_shard(store, MOVING, 3):
        change(row, driver_in(store, 5))
    for shard in range(SMALL):
        for row in keys_in_shard(store, shard, 3):
            change(row, driver_in(store, MOVING if shard == 6 else shard))
    store.indexes.apply(SPEC, changes, "live")


def older_copy(b: MySQLRecorder, entry: tuple[Any, ...]) -> None:
    """Rows an older copy left on the target, before the source's first and after its last row_key, and a
    position of a stream the source has none of."""
    for row in (uuid.UUID(int=1), uuid.UUID(int=(1 << 128) - 1)):
        sql(b, f"INSERT IGNORE INTO {SPEC.table} VALUES ({', '.join(['%s'] * len(entry))})",
            (entry[0], row.bytes, *entry[2:]))
        sql(b, f"INSERT IGNORE INTO {SPEC.locator_table} (row_key, shard, ref_key, entry_shard)"
               " VALUES (%s, %s, 9, %s)", (row.bytes, MOVING, MOVING))
    sql(b, "INSERT IGNORE INTO cellstream_index_positions VALUES (%s, 'backfill', %s, 5, 5)", (SPEC.table, MOVING))


def test_a_copy_interrupted_at_any_chunk_runs_again_to_the_same_rows(small: logstore.Store) -> None:
    index_a_shard(small)
    a, b = node(small, "a"), node(small, "b")
    others = {s: shard_rows(b, s) for s in range(4, SMALL)}
    fence(small, "a", "b", MOVING)
    source = shard_rows(a, MOVING)
    assert [len(source[t]) for t in ("entries", "locators", "positions")] == [29, 29, 1]
    stale_entry = next(iter(source["entries"]))

    paced: list[int] = []
    older_copy(b, stale_entry)
    assert index_moves.copy_index_shard(a, b, MOVING, paced.append) == count(source)
    assert shard_rows(b, MOVING) == source
    chunks = len(paced)
    assert chunks == 8 + 8 + 1 and sum(paced) == count(source)
    for stop in range(chunks):
        older_copy(b, stale_entry)
        sql(b, f"DELETE FROM {SPEC.table} WHERE shard = %s AND ref_key = 1 LIMIT 10", (MOVING,))  # a part copied
        calls = iter(range(chunks))

        def pace(rows: int, stop: int = stop, calls: Iterator[int] = calls) -> None:
            if next(calls) == stop:
                raise Interrupted
        with pytest.raises(Interrupted):
            index_moves.copy_index_shard(a, b, MOVING, pace)
        assert index_moves.copy_index_shard(a, b, MOVING) == count(source)
        assert shard_rows(b, MOVING) == source, f"interrupted at chunk {stop}"
    assert {s: shard_rows(b, s) for s in range(4, SMALL)} == others  # no other shard touched
    assert shard_rows(a, MOVING) == source


def test_a_copy_waits_for_an_index_write_under_way_and_copies_it(small: logstore.Store,
                                                                 small_cluster: Path) -> None:
    index_a_shard(small)
    a, b = node(small, "a"), node(small, "b")
    entry = next(iter(shard_rows(a, MOVING)["entries"]))
    late = uuid.UUID(int=(1 << 127))
    # An apply that read no fence (it started before the move's) and has not committed yet.
    url = urlsplit(tomllib.loads(small_cluster.read_text())["nodes"][0]["url"])
    writer = pymysql.connect(host=url.hostname, port=url.port, user=url.username, password=url.password,
                             database=url.path.lstrip("/"), autocommit=True)
    try:
        with writer.cursor() as cur:
            cur.execute("START TRANSACTION")
            cur.execute(f"INSERT INTO {SPEC.table} VALUES ({', '.join(['%s'] * len(entry))})",
                        (entry[0], late.bytes, *entry[2:]))
            fence(small, "a", "b", MOVING)
            copying = threading.Thread(target=index_moves.copy_index_shard, args=(a, b, MOVING))
            copying.start()
            while copying.is_alive() and not sql(b, "SELECT 1 FROM information_schema.PROCESSLIST WHERE INFO"
                                                   f" LIKE '%%FROM `{SPEC.table}`%%LOCK IN SHARE MODE'"):
                time.sleep(0.01)
            cur.execute("COMMIT")
        copying.join(60)
    finally:
        writer.close()
    assert late.bytes in {row[1] for row in shard_rows(b, MOVING)["entries"]}
    assert shard_rows(b, MOVING) == shard_rows(a, MOVING)


def test_a_copy_creates_the_index_tables_a_target_lacks_and_needs_both_fences(small: logstore.Store) -> None:
    index_a_shard(small)
    a, b = node(small, "a"), node(small, "b")
    sql(b, f"DROP TABLE {SPEC.table}, {SPEC.locator_table}")
    sql(b, "DELETE FROM cellstream_index_specs")
    with pytest.raises(logstore.InvalidArgumentError, match="not fenced on storage node a"):
        index_moves.copy_index_shard(a, b, MOVING)
    fill(small, "a", "b", MOVING)
    with pytest.raises(logstore.InvalidArgumentError, match="not fenced on storage node a"):
        index_moves.copy_index_shard(a, b, MOVING)
    fence_source(small, "a", "b", MOVING)
    index_moves.copy_index_shard(a, b, MOVING)
    assert b.indexes.specs() == [SPEC] and shard_rows(b, MOVING) == shard_rows(a, MOVING)


def test_a_drop_interrupted_at_any_chunk_deletes_the_rest_next_time(small: logstore.Store) -> None:
    index_a_shard(small)
    a = node(small, "a")
    total = count(shard_rows(a, MOVING))
    others = {s: shard_rows(a, s) for s in range(4) if s != MOVING}
    with pytest.raises(logstore.InvalidArgumentError, match="holds shard 1"):
        index_moves.drop_index_shard(a, MOVING)  # not fenced: the node holds it
    assert count(shard_rows(a, MOVING)) == total
    fence_source(small, "a", "b", MOVING)
    saved = {"entries": SPEC.table, "locators": SPEC.locator_table, "positions": "cellstream_index_positions"}
    for name, table in saved.items():
        sql(a, f"CREATE TABLE saved_{name} AS SELECT * FROM {table} WHERE shard = %s", (MOVING,))
    paced: list[int] = []
    assert index_moves.drop_index_shard(a, MOVING, paced.append) == total == sum(paced)
    assert len(paced) == 8 + 8 + 1 and count(shard_rows(a, MOVING)) == 0
    for stop in range(len(paced)):
        for name, table in saved.items():  # the shard's rows as they were
            sql(a, f"INSERT INTO {table} SELECT * FROM saved_{name}")
        calls = iter(range(len(paced)))
        done: list[int] = []

        def pace(rows: int, stop: int = stop, calls: Iterator[int] = calls, done: list[int] = done) -> None:
            if next(calls) == stop:
                raise Interrupted
            done.append(rows)
        with pytest.raises(Interrupted):
            index_moves.drop_index_shard(a, MOVING, pace)
        # Each chunk is deleted after its pace, and only it: what is left is what was not paced.
        assert count(shard_rows(a, MOVING)) == total - sum(done), f"interrupted at chunk {stop}"
        assert index_moves.drop_index_shard(a, MOVING) == total - sum(done)
        assert count(shard_rows(a, MOVING)) == 0
    assert {s: shard_rows(a, s) for s in range(4) if s != MOVING} == others


# -- the fence -----------------------------------------------------------------------------------
def test_index_writes_of_a_fenced_shard_are_refused_whole(small: logstore.Store) -> None:
    a = node(small, "a")
    store = small
    rows = {s: keys_in_shard(store, s, 2) for s in (0, MOVING)}
    changes = [IndexChange(s, T0 + n, row, 1, values(driver_in(store, 2), n))
               for s in rows for n, row in enumerate(rows[s], 1)]
    store.indexes.apply(SPEC, [changes[0]], "live")
    before = {s: shard_rows(a, s) for s in range(4)}
    fence(store, "a", "b", MOVING)
    spec, write = SPEC, EntryWrite(MOVING, uuid.uuid4(), 1, values(driver_in(store, MOVING), 1))
    refused: list[Callable[[], object]] = [
        # changes of shards 0 and 1 (fenced), their entries in shard 2: nothing of any is written
        lambda: a.indexes.apply(spec, "live", changes, {0: T0 + 9, MOVING: T0 + 9},
                                lambda c: (2, encode_row(spec, c.values)), lambda w: w),
        lambda: a.indexes.write_entries(spec, [write]),  # another node's apply, writing an entry in shard 1
        lambda: a.indexes.set_targets(spec, "backfill", {0: 5, MOVING: 5}),
        lambda: a.indexes.repair(spec, [Fix(MOVING, rows[MOVING][0], -1, -1, None)], lambda k, loc: False,
                                 lambda w: w),
    ]
    for call in refused:
        with pytest.raises(logstore.ShardMovedError) as caught:
            call()
        assert (caught.value.shard, caught.value.node) == (MOVING, "b")
        assert {s: shard_rows(a, s) for s in range(4)} == before


# -- a move: queries, an apply sent on, verification ----------------------------------------------
SHARDS = 64  # 0-31 on a, 32-63 on b: more than a few shards a node, as a scatter query lists them
S = 5


@pytest.fixture
def cluster(mysql_database_factory: Callable[[], str], tmp_path: Path) -> Path:
    return two_nodes(tmp_path / "cluster.toml", [mysql_database_factory(), mysql_database_factory()], SHARDS)


def everything(store: logstore.Store) -> list[uuid.UUID]:
    """The row keys of every entry a scatter query returns."""
    return [e.row_key for e in Index(store, NAME).query(scatter=True, limit=10_000)]


def test_a_move_carries_the_index_queries_count_once_and_verify_finds_the_source_copy(
        cluster: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    mover = logstore.open(cluster, map_refresh=0.2)
    stale = logstore.open(cluster, map_refresh=3600)  # reads the move only when a node refuses it something
    try:
        definition = seed()
        catalog = IndexCatalog(mover)
        catalog.register(definition)
        catalog.mark_live(NAME, 1, "test")
        rnd = random.Random(3)
        cells = [(row, "BASE", 1, trip(driver_in(mover, S) if n % 2 else uuid.uuid4(), uuid.uuid4(), n))
                 for n, row in enumerate(keys_in_shard(mover, S, 30))]
        cells += [(uuid.uuid4(), "BASE", 1, trip(driver_in(mover, S) if n % 3 else uuid.uuid4(), uuid.uuid4(), n))
                  for n in range(60)]
        rnd.shuffle(cells)
        mover.put_cells(cells)
        backfill(mover, NAME, 1)
        catalog.activate(NAME, 1)
        late = mover.put_cell(keys_in_shard(mover, S, 1)[0], "BASE", 1, trip(driver_in(mover, S), uuid.uuid4(), 99))
        before = everything(mover)
        assert len(before) == len(set(before)) == len(cells)
        assert verify(mover, NAME).mismatches == []

        refused = threading.Event()
        router = stale.indexes._store
        reload = router.refresh_map

        def refresh_map() -> None:  # the index store met a fenced shard
            refused.set()
            reload()
        monkeypatch.setattr(router, "refresh_map", refresh_map)
        applied: list[BaseException | None] = []
        applier = IndexApplier(stale, definition)

        def apply_late() -> None:
            try:
                applier.apply([applier.prepare(late)], [late])
                applied.append(None)
            except BaseException as exc:  # the test's assertions report it
                applied.append(exc)
        during: list[list[uuid.UUID]] = []
        applying = threading.Thread(target=apply_late)

        def step(name: str) -> None:
            if name == "carried":  # fenced on both nodes, the index rows copied; the switch comes next
                during.append(everything(mover))
                # The target's copy is stray until the switch, and no repair deletes it.
                [filling] = mover.indexes.strays(SPEC)
                assert (filling.node, filling.shard, filling.moved) == ("b", S, False)
                assert mover.indexes.drop_strays(SPEC, [filling]) == 0
                applying.start()
                assert refused.wait(60), "the apply of a fenced shard was not refused"
        monkeypatch.setattr(moves, "step_hook", step)
        [report] = moves.move_shards(mover, [S], "b")
        applying.join(60)
        assert report.target == "b" and applied == [None]
        # During the fence both nodes hold the shard's rows; the map's holder alone answers for them.
        assert sorted(during[0]) == sorted(before)

        after = everything(mover)
        assert sorted(after) == sorted([*before, late.row_key])
        on_b = [e.row_key for e in mover.indexes.scan(SPEC, S, None, 1000)]
        assert late.row_key in on_b  # applied on the shard's new node, after the stale map was read again
        assert late.row_key not in {row[1] for row in sql(node(mover, "a"), f"SELECT * FROM {SPEC.table}")}
        assert mover.indexes.positions(SPEC)[S].location == late.added_id

        # The source copy is stray until dropped: verify lists it (exit 8) and --repair deletes it.
        source_rows = count(shard_rows(node(mover, "a"), S))
        assert source_rows > 30
        found = verify(mover, NAME)
        assert found.mismatches == [] and found.pending == 0
        assert found.strays == (StrayRows("a", S, source_rows, True),)
        capsys.readouterr()
        assert main(["index", "verify", NAME, "--store", str(cluster), "--json"]) == 8
        listed = json.loads(capsys.readouterr().out)
        assert listed["strays"] == [{"node": "a", "shard": S, "rows": source_rows, "moved": True}]
        repaired = verify(mover, NAME, repair=True)
        assert repaired.strays_dropped == source_rows and repaired.strays_left == 0
        assert count(shard_rows(node(mover, "a"), S)) == 0
        assert main(["index", "verify", NAME, "--store", str(cluster), "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["strays"] == []
        assert sorted(everything(mover)) == sorted(after)
        assert sorted(everything(stale)) == sorted(after)
    finally:
        mover.close()
        stale.close()


def test_locator_tables_get_their_shard_key_at_open(small: logstore.Store, small_cluster: Path) -> None:
    a = node(small, "a")
    sql(a, f"ALTER TABLE {SPEC.locator_table} DROP KEY locator_shard")  # a table made before the key
    keys = ("SELECT COUNT(*) FROM information_schema.STATISTICS WHERE TABLE_SCHEMA = DATABASE()"
            f" AND TABLE_NAME = '{SPEC.locator_table}' AND INDEX_NAME = 'locator_shard'")
    assert sql(a, keys) == [(0,)]
    with logstore.open(small_cluster) as again:
        assert sql(node(again, "a"), keys) == [(1,)]
        plan = sql(node(again, "a"), f"EXPLAIN SELECT * FROM {SPEC.locator_table} WHERE shard = 1"
                                     " AND row_key > '' ORDER BY row_key LIMIT 10")
        assert "locator_shard" in str(plan)
