"""Online shard moves between two MariaDB storage nodes (`cellstream shards move`), under concurrent writes
from two stores (two worker nodes): no acknowledged cell is lost, added_ids are kept (a tailer's location stays
valid), every store follows the move, the source copy stays until dropped, and a store that has not read the
move yet meets the fence and goes where the shard went."""

from __future__ import annotations

import itertools
import json
import threading
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pymysql
import pytest

import logstore
from cellstream.cli.main import main
from tests.harness.stores import two_nodes

SHARDS = 4096  # the default: moves, fences and maps at the shard count users get
ON_B = SHARDS - 1  # a shard node b holds from the start


def cluster_file(tmp_path: Path, a: str, b: str) -> Path:
    return two_nodes(tmp_path / "cluster.toml", [a, b], SHARDS)


def scalar(url: str, sql: str) -> int:
    parts = urlsplit(url)
    conn = pymysql.connect(host=parts.hostname, port=parts.port, user=parts.username, password=parts.password,
                           database=parts.path.lstrip("/"))
    try:
        with conn.cursor() as cur:
            cur.execute(sql)
            return int(cur.fetchone()[0])
    finally:
        conn.close()


def rows_in(url: str, shard: int) -> int:
    return scalar(url, f"SELECT COUNT(*) FROM cells WHERE shard = {shard}")


def max_id(url: str, shard: int) -> int:
    return scalar(url, f"SELECT COALESCE(MAX(added_id), 0) FROM cells WHERE shard = {shard}")


def keys_in(store: logstore.Store, shard: int) -> Any:
    return (k for k in iter(uuid.uuid4, None) if store.shard_of(k) == shard)


def full_log(store: logstore.Store, shard: int) -> list[logstore.Cell]:
    cells, location = [], 0
    while page := store.get_cells_for_shard(shard, location, 500)[0]:
        cells.extend(page)
        location = page[-1].added_id
    return cells


def test_shards_move_online_under_writes_and_every_store_follows(
        mysql_database_factory: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = mysql_database_factory(), mysql_database_factory()
    cluster = cluster_file(tmp_path, a, b)
    mover = logstore.open(cluster, map_refresh=0.5)
    other = logstore.open(cluster, map_refresh=0.5)  # a second worker node
    stale = logstore.open(cluster, map_refresh=3600)  # one that will not read the move by itself
    try:
        first = mover.put_cells([(k, "BASE", 1, {"before": n}) for n, k in
                                 enumerate(itertools.islice(keys_in(mover, 1), 150))])
        before = full_log(mover, 1)
        assert [c.added_id for c in before] == [c.added_id for c in first]

        acked: list[logstore.Cell] = []
        errors: list[BaseException] = []
        writing = threading.Event()
        writing.set()

        def write(store: logstore.Store, shard: int) -> None:
            for n, key in enumerate(keys_in(store, shard)):
                if not writing.is_set():
                    return
                try:
                    acked.append(store.put_cell(key, "BASE", 1, {"during": n}))
                except logstore.LogstoreError as exc:
                    errors.append(exc)

        writers = [threading.Thread(target=write, args=(s, shard)) for s in (mover, other) for shard in (1, 2, ON_B)]
        for writer in writers:
            writer.start()
        time.sleep(0.5)
        capsys.readouterr()
        assert main(["shards", "move", "1", "2", "--to", "b", "--store", str(cluster), "--json"]) == 0
        reports = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        time.sleep(0.8)
        writing.clear()
        for writer in writers:
            writer.join(60)
        assert not errors, errors[:3]
        assert [(r["shard"], r["source"], r["target"]) for r in reports] == [(1, "a", "b"), (2, "a", "b")]
        assert all(r["fenced_seconds"] < 5 for r in reports)

        with logstore.open(cluster) as fresh:
            assert (fresh.node_of(1), fresh.node_of(2), fresh.node_of(ON_B)) == ("b", "b", "b")
            assert fresh.node_of(0) == "a"
            for cell in [*first, *acked]:  # every acknowledged cell is there
                stored = fresh.get_cell(cell.row_key, "BASE", 1)
                assert stored is not None and stored.body == cell.body
            for shard in (1, 2):
                log = full_log(fresh, shard)
                ids = [c.added_id for c in log]
                assert ids == sorted(set(ids))  # one log, increasing
                assert {c.row_key for c in log} == {c.row_key for c in [*first, *acked] if c.shard == shard}
                for cell in acked:  # what writers saw acknowledged, they see at the same place
                    if cell.shard == shard:
                        assert cell in log
            assert full_log(fresh, 1)[:len(before)] == before  # same added_ids: tailer locations stay valid
            assert mover.node_of(1) == other.node_of(1) == "b"
            assert any(c.shard in (1, 2) and c.added_id > before[-1].added_id for c in acked)

        kept = rows_in(a, 1)  # the source copy stays, fenced, until dropped
        assert kept >= len(before) and kept == len([c for c in full_log(mover, 1) if c.added_id <= max_id(a, 1)])
        assert main(["shards", "drop-moved", "1", "--store", str(cluster)]) == 0
        assert rows_in(a, 1) == 0

        # The stale store still routes shard 1 to node a: the fence sends its write where the shard went.
        key = next(keys_in(stale, 1))
        late = stale.put_cell(key, "BASE", 1, {"from": "a stale map"})
        assert stale.node_of(1) == "b" and rows_in(a, 1) == 0
        with logstore.open(cluster) as fresh:
            assert fresh.get_cell(key, "BASE", 1) == late
    finally:
        for store in (mover, other, stale):
            store.close()



@pytest.mark.parametrize(("argv", "message"), [
    (["shards", "move", "1", "--to", "nowhere"], "no storage node 'nowhere'"),
    (["shards", "move", str(ON_B), "--to", "b"], f"shard {ON_B} is on node b already"),
    (["shards", "move", "4096", "--to", "b"], "shard must be an integer in [0, 4096)"),
    (["shards", "drop-moved", "1"], "shard 1 was not moved"),
])
def test_bad_moves_are_refused_with_one_line(mysql_database_factory: Any, tmp_path: Path, argv: list[str],
                                             message: str, capsys: pytest.CaptureFixture[str]) -> None:
    cluster = cluster_file(tmp_path, mysql_database_factory(), mysql_database_factory())
    with logstore.open(cluster):
        pass
    capsys.readouterr()
    assert main([*argv, "--store", str(cluster)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
