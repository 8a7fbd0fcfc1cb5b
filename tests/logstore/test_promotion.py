"""Promoting a replica (``cellstream nodes promote``, logstore.nodes.promote_node) on real MariaDB servers: a
node's primary SIGKILLed while its replica is behind. The replica applies what it received, the cells only the
lost primary held are gone (the default mode: a durable one keeps them, issue 52), their ids are never given
to another cell, every process follows the new primary, and the former one refuses writes when it returns."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest

import logstore
from cellstream.cli.main import main
from logstore.backends.mysql.moves import move_shard
from logstore.errors import InvalidArgumentError
from logstore.nodes import list_nodes, promote_node
from tests.harness.replica_pair import ReplicaPair, sql
from tests.harness.stores import keys_in_shard

SHARDS = 64
BURN = 1000
DELAY = 2  # the replica applies what it receives 2 s later: a replica behind


def cluster_file(path: Path, pair: ReplicaPair, other: str) -> Path:
    path.write_text(f'shards = {SHARDS}\n[[nodes]]\nname = "a"\nurl = "{pair.primary.url("cells")}"\n'
                    f'replicas = ["{pair.replica.url("cells")}"]\nshards = "0-{SHARDS // 2 - 1}"\n'
                    f'[[nodes]]\nname = "b"\nurl = "{other}"\nshards = "{SHARDS // 2}-{SHARDS - 1}"\n')
    return path


def put(store: logstore.Store, keys: list[uuid.UUID], column: str) -> list[logstore.Cell]:
    return [store.put_cell(key, column, 1, {"k": str(key)}) for key in keys]


def unfenced_rows(port: int) -> int:
    [row] = sql(port, "SELECT COUNT(*) AS n FROM cells.cellstream_shards WHERE fence IS NULL")
    return int(row["n"])


@pytest.fixture
def pair(tmp_path: Path) -> Any:
    with ReplicaPair(tmp_path / "pair", delay=DELAY) as pair:
        yield pair


def test_a_replica_behind_is_promoted_and_no_id_is_reused(pair: ReplicaPair, mysql_database: str,
                                                          tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cluster = cluster_file(tmp_path / "cluster.toml", pair, mysql_database)
    with logstore.open(cluster, map_refresh=0.2, connect_timeout=1.0) as store:
        shard = 3  # on node a
        keys = keys_in_shard(store, shard, 30)
        replicated = put(store, keys[:10], "replicated")
        pair.wait_caught_up()
        received = put(store, keys[10:20], "received")  # received, not applied yet: the promotion waits for them
        pair.wait_received()
        pair.cut()  # from now on only the primary has them; a tailer may have seen them
        lost = put(store, keys[20:], "lost")
        seen = max(c.added_id for c in lost)
        pair.primary.kill()

        with pytest.raises(InvalidArgumentError, match="no replica"):
            promote_node(store, "a", "127.0.0.1:1")
        done = promote_node(store, "a", f"127.0.0.1:{pair.replica.port}", burn=BURN)
        assert done.primary.endswith(f":{pair.replica.port}/cells") and not done.former_fenced
        assert done.burnt_shards == SHARDS // 2
        for cell in [*replicated, *received]:
            assert store.get_cell(cell.row_key, cell.column, 1) == cell
        assert all(store.get_cell(c.row_key, c.column, 1) is None for c in lost)  # only the lost primary had them
        after = store.put_cell(keys[0], "after", 1, {"n": 1})
        assert after.shard == shard and after.added_id > seen  # the ids the lost primary gave stay burnt
        assert after.added_id == max(c.added_id for c in received) + BURN + 1
        other = store.put_cell(keys_in_shard(store, 5, 1)[0], "after", 1, {"n": 2})  # a shard with no loss
        assert other.added_id > BURN

    # A process opened from the cluster file, which names the lost primary, follows the map to the new one.
    with logstore.open(cluster, map_refresh=0.2, connect_timeout=1.0, read_timeout=5.0) as fresh:
        again = fresh.put_cell(keys[1], "after", 1, {"n": 3})
        assert again.added_id == after.added_id + 1
        assert fresh.get_cell(after.row_key, "after", 1) == after

        # The former primary comes back: never written again, fenced by `nodes list` (and reported).
        pair.primary.start()
        assert unfenced_rows(pair.primary.port) > 0
        [a, _] = list_nodes(fresh)
        assert "former primary" in a.health and "fenced" in a.health
        assert unfenced_rows(pair.primary.port) == 0
        assert fresh.put_cell(keys[2], "after", 1, {"n": 4}).added_id == again.added_id + 1
    assert main(["nodes", "list", "--store", str(cluster), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["nodes"][0]["url"].endswith(f":{pair.replica.port}/cells")


def test_promoting_again_changes_nothing_and_sqlite_is_refused(pair: ReplicaPair, mysql_database: str,
                                                               tmp_path: Path, sqlite_url: str,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    cluster = cluster_file(tmp_path / "cluster.toml", pair, mysql_database)
    with logstore.open(cluster, map_refresh=0.2) as store:
        cell = store.put_cell(keys_in_shard(store, 1, 1)[0], "c", 1, {})
        pair.wait_caught_up()
    args = ["nodes", "promote", "a", "--replica", f"127.0.0.1:{pair.replica.port}", "--burn", "10", "--json",
            "--store", str(cluster)]
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["former_fenced"] is True and first["burnt_shards"] == SHARDS // 2
    assert unfenced_rows(pair.primary.port) == 0  # it answered: fenced at once
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["burnt_shards"] == 0  # promoted already: nothing done
    assert sql(pair.replica.port, "SELECT @@read_only AS ro") == [{"ro": 0}]
    with logstore.open(cluster, map_refresh=0.2) as store:
        assert store.get_cell(cell.row_key, "c", 1) == cell
        assert store.put_cell(keys_in_shard(store, 1, 1)[0], "c", 1, {}).added_id == cell.added_id + 10 + 1
        move_shard(store, 2, "b")  # a shard's burnt ids go with it when it moves
        assert store.put_cell(keys_in_shard(store, 2, 1)[0], "c", 1, {}).added_id == 10 + 1
    logstore.open(sqlite_url, shards=4).close()
    assert main(["nodes", "promote", "a", "--replica", "x:1", "--store", sqlite_url]) == 4
