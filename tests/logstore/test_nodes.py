"""Storage nodes join and leave a running instance (`cellstream nodes add|remove`, logstore.nodes): the shard
map is recorded on every node, versioned, and every open store follows a change without a restart."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

import logstore
from logstore.backends.mysql.moves import move_shards
from logstore.errors import ConfigurationError, InvalidArgumentError
from logstore.nodes import add_node, list_nodes, remove_node, set_state
from logstore.registry import url_password, without_password
from tests.harness.stores import keys_in_shard, two_nodes

SHARDS = 4096
ON_A = 7


@pytest.fixture
def three(mysql_database_factory: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, str]:
    """A cluster file of nodes a and b, and the URL (no password; CST_NODE_PW holds it) of an empty database."""
    a, b, c = (mysql_database_factory() for _ in range(3))
    monkeypatch.setenv("CST_NODE_PW", url_password(c) or "")
    return two_nodes(tmp_path / "cluster.toml", [a, b], SHARDS), without_password(c)


def test_a_node_joins_and_every_open_store_follows_without_restart(three: tuple[Path, str]) -> None:
    cluster, c_url = three
    with logstore.open(cluster, map_refresh=0.2) as writer, logstore.open(cluster, map_refresh=0.2) as admin:
        key = keys_in_shard(writer, ON_A, 1)[0]
        writer.put_cell(key, "c", 1, {"n": 1})
        add_node(admin, "c", c_url, password_env="CST_NODE_PW")
        assert admin.shard_map.version == 1 and admin.nodes == ["a", "b", "c"]
        for name in admin.nodes:  # every node holds the version, and no password (the file's have theirs)
            recorder = admin.node_recorder(name)
            assert recorder is not None
            version, doc = recorder.read_map() or (0, "")
            assert version == 1 and '"c"' in doc and ":cellstream@" not in doc
        move_shards(admin, [ON_A], "c")
        # The writer opened before the node joined: it learns of c from the map and of the move from a.
        cell = writer.put_cell(key, "c", 2, {"n": 2})
        assert writer.nodes == ["a", "b", "c"] and writer.node_of(ON_A) == "c"
        assert cell.added_id == 2
        assert [c.ref_key for c in writer.get_cells_for_shard(ON_A, 0, 10)[0]] == [1, 2]
    # A process opened later with the same (unchanged) cluster file finds c too.
    with logstore.open(cluster) as later:
        assert later.nodes == ["a", "b", "c"] and later.node_of(ON_A) == "c"
        info = {n.name: n for n in list_nodes(later)}
        assert (info["c"].shards, info["c"].cells, info["c"].health) == (1, 2, "ok")
        assert info["a"].shards == SHARDS // 2 - 1 and "cellstream" not in info["c"].url.split("@")[0].split(":")[-1]


def test_adding_again_changes_nothing_and_bad_nodes_are_refused(three: tuple[Path, str],
                                                                 mysql_database_factory: Any) -> None:
    cluster, c_url = three
    with logstore.open(cluster) as store:
        add_node(store, "c", c_url, password_env="CST_NODE_PW")
        add_node(store, "c", c_url, password_env="CST_NODE_PW")
        assert store.shard_map.version == 1
        with pytest.raises(InvalidArgumentError, match="holds a password"):
            add_node(store, "d", mysql_database_factory(), password_env="CST_NODE_PW")
        with pytest.raises(InvalidArgumentError, match="another URL"):
            add_node(store, "c", without_password(mysql_database_factory()), password_env="CST_NODE_PW")
        b_url = without_password(str(logstore.config.load_cluster_file(cluster).nodes[1].url))
        with pytest.raises(ConfigurationError, match="created with shards 2048-4095"):
            add_node(store, "d", b_url, password_env="CST_NODE_PW")
        assert store.shard_map.version == 1


def test_a_node_leaves_only_when_it_holds_nothing(three: tuple[Path, str]) -> None:
    cluster, c_url = three
    with logstore.open(cluster, map_refresh=0.2) as store, logstore.open(cluster, map_refresh=0.2) as other:
        add_node(store, "c", c_url, password_env="CST_NODE_PW")
        move_shards(store, [ON_A], "c")
        store.put_cell(keys_in_shard(store, ON_A, 1)[0], "c", 1, {})
        with pytest.raises(ConfigurationError, match="holds 1 shards"):
            remove_node(store, "c")
        set_state(store, "c", "draining")
        move_shards(store, [ON_A], "a")
        with pytest.raises(ConfigurationError, match="still holds the cells"):
            remove_node(store, "c")
        from logstore.backends.mysql.moves import drop_moved

        drop_moved(store, [ON_A])
        remove_node(store, "c")
        assert store.nodes == ["a", "b"] and store.shard_map.node("c").state == "removed"  # type: ignore[union-attr]
        deadline = time.monotonic() + 10
        while other.nodes != ["a", "b"] and time.monotonic() < deadline:
            other.head(ON_A)  # reads refresh the map when it is due
            time.sleep(0.1)
        assert other.nodes == ["a", "b"] and other.node_of(ON_A) == "a"
        with pytest.raises(InvalidArgumentError, match="no storage node 'c'"):
            remove_node(store, "c")
    with logstore.open(cluster) as later:
        assert later.nodes == ["a", "b"]


def test_a_single_node_store_keeps_no_map(tmp_path: Path) -> None:
    with logstore.open(f"sqlite:///{tmp_path}/s", shards=8) as store, \
            pytest.raises(ConfigurationError, match="single-node"):
        add_node(store, "c", "mysql://x@127.0.0.1:1/db", password_env="CST_NODE_PW")


def test_a_seed_node_leaves_and_the_cluster_file_still_opens_the_instance(three: tuple[Path, str]) -> None:
    cluster, c_url = three
    small = cluster.with_name("small.toml")
    nodes = logstore.config.load_cluster_file(cluster).nodes
    two_nodes(small, [nodes[0].url, nodes[1].url], 16)
    with logstore.open(small) as store:
        keys = {s: keys_in_shard(store, s, 1)[0] for s in range(8)}
        store.put_cells([(k, "c", 1, {"s": s}) for s, k in keys.items()])
        add_node(store, "c", c_url, password_env="CST_NODE_PW")
        from logstore.backends.mysql.moves import drop_moved

        move_shards(store, list(range(8)), "c")
        drop_moved(store, list(range(8)))
        remove_node(store, "a")
        assert store.nodes == ["b", "c"]
    # The file still names a (where the instance started): it is not opened, even with its database gone.
    import pymysql

    a = nodes[0].target
    with pymysql.connect(host=a.host, port=a.port, user=a.user, password=url_password(nodes[0].url)) as conn:
        conn.cursor().execute(f"DROP DATABASE `{a.database}`")
    with logstore.open(small) as later:
        assert later.nodes == ["b", "c"]
        with pymysql.connect(host=a.host, port=a.port, user=a.user, password=url_password(nodes[0].url)) as conn:
            cur = conn.cursor()
            assert not cur.execute("SHOW DATABASES LIKE %s", (a.database,)), "the removed node was created again"
        assert [later.get_cell(k, "c", 1).body for k in keys.values()] == [{"s": s} for s in keys]  # type: ignore[union-attr]


def test_nodes_commands(three: tuple[Path, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from cellstream.cli.main import main

    cluster, c_url = three
    store = ["--store", str(cluster)]
    assert main(["init", *store]) == 0
    assert main(["nodes", "add", "c", c_url, "--password-env", "CST_NODE_PW", *store]) == 0
    assert "node c joined (shard map version 1)" in capsys.readouterr().out
    assert main(["nodes", "list", "--json", *store]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["version"] == 1
    assert [(n["name"], n["state"], n["shards"], n["health"]) for n in listed["nodes"]] == [
        ("a", "active", SHARDS // 2, "ok"), ("b", "active", SHARDS // 2, "ok"), ("c", "active", 0, "ok")]
    assert "cellstream:" not in capsys.readouterr().out
    with_password = c_url.replace("cellstream@", "cellstream:cellstream@")
    assert main(["nodes", "add", "d", with_password, "--password-env", "CST_NODE_PW", *store]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds a password" in err and ":cellstream@" not in err
    assert main(["nodes", "remove", "a", *store]) == 4
    assert "holds 2048 shards" in capsys.readouterr().err
    assert main(["nodes", "remove", "c", *store]) == 0
    capsys.readouterr()
    sqlite = ["--store", f"sqlite:///{tmp_path}/s"]
    assert main(["init", "--shards", "8", *sqlite]) == 0
    capsys.readouterr()
    assert main(["nodes", "add", "c", c_url, "--password-env", "CST_NODE_PW", *sqlite]) == 4
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "single-node" in err
    assert main(["shards", "rebalance", "--apply", *sqlite]) == 4
    assert "one storage node" in capsys.readouterr().err
