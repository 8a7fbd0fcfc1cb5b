"""What an operator and the writers see while a storage node's primary is down (mariadbd SIGKILLed: connections
refused at once), on two MariaDB nodes: `cellstream pending`, on the cluster file or through a worker node, lists
the cells buffered for it and exits non-zero until none waits (its speed: bench/pending_bench.py); once the node
is known down its writes are buffered at once (before: every one paid ``buffer_after`` again); writes to the
healthy node never stall behind it (before: about 2 s every few seconds). Latencies are asserted with a wide
margin: "at once" is < 1 s against the 2 s of ``buffer_after``."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import logstore
from cellstream.cli.main import main
from logstore.retry import RetryPolicy
from tests.harness.private_mariadb import PrivateMariaDB
from tests.harness.stores import two_nodes
from tests.harness.worker_support import NodeThread

SHARDS = 64
HALF = SHARDS // 2  # node a holds shards 0-31, node b 32-63
AT_ONCE = 1.0  # seconds: the bound of a write that is buffered at once, or that goes to the healthy node
BUFFER_AFTER = 2.0  # the default


def open_store(cluster: Path, **options: Any) -> logstore.Store:
    return logstore.open(cluster, retry=RetryPolicy(initial=0.05, maximum=0.3, deadline=5.0),
                         buffer_after=BUFFER_AFTER, connect_timeout=1.0, read_timeout=5.0, **options)


def keys(store: logstore.Store, on_a: bool) -> Iterator[uuid.UUID]:
    """New row keys of node a's shards (or of node b's)."""
    return (k for k in iter(uuid.uuid4, None) if (store.shard_of(k) < HALF) == on_a)


def eventually(what: str, check: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def timed_put(store: logstore.Store, key: uuid.UUID, body: dict[str, object]) -> tuple[logstore.Cell, float]:
    started = time.monotonic()
    cell = store.put_cell(key, "BASE", 1, body)
    return cell, time.monotonic() - started


def test_pending_lists_the_cells_waiting_for_a_down_node_and_exits_non_zero(
        mysql_database: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with PrivateMariaDB(tmp_path / "node-a") as db:
        cluster = two_nodes(tmp_path / "cluster.toml", [db.url("cells"), mysql_database], SHARDS)
        with open_store(cluster) as store:
            assert main(["pending", "--store", str(cluster), "--json"]) == 0  # nothing waits
            assert json.loads(capsys.readouterr().out) == {"homes": {}, "unreachable": []}
            node = NodeThread(store, replay_interval=3600).start()  # the replayer is not what this is about
            try:
                db.kill()
                with logstore.open(node.url) as client:  # the writers go through a worker node, as in the issue
                    on_a = keys(store, True)
                    acked = [client.put_cell(next(on_a), "BASE", 1, {"n": i}) for i in range(3)]
                assert [c.added_id for c in acked] == [0, 0, 0]
                # The operator, during the outage: every buffered cell, by home and holder; exit 5 (unavailable).
                assert main(["pending", "--store", str(cluster), "--json"]) == 5
                assert json.loads(capsys.readouterr().out) == {
                    "homes": {"a": {"waiting": 3, "failed": 0, "held_on": {"b": {"waiting": 3, "failed": 0}}}},
                    "unreachable": ["a"]}
                assert main(["pending", "--store", str(cluster)]) == 5
                assert "node a: 3 buffered cells waiting to go home" in capsys.readouterr().out
            finally:
                node.stop()
            db.start()
            # Home again but not yet replayed: the cells still wait.
            assert main(["pending", "--store", str(cluster), "--json"]) == 5
            assert json.loads(capsys.readouterr().out)["unreachable"] == []
            assert main(["pending", "--store", str(cluster), "--replay", "--wait", "30"]) == 0
            capsys.readouterr()
            assert main(["pending", "--store", str(cluster), "--json"]) == 0
            assert json.loads(capsys.readouterr().out) == {"homes": {}, "unreachable": []}


def test_pending_through_a_worker_node_lists_what_its_storage_nodes_hold(
        mysql_database: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The operator at 3 a.m. knows the worker node's URL, not the cluster file: `cellstream pending --store
    http://...` answers what the node's store holds (before: refused), and --replay runs its passes there."""
    with PrivateMariaDB(tmp_path / "node-a") as db:
        cluster = two_nodes(tmp_path / "cluster.toml", [db.url("cells"), mysql_database], SHARDS)
        with open_store(cluster) as store:
            node = NodeThread(store, replay_interval=3600).start()  # replayed only when asked, below
            try:
                assert main(["pending", "--store", node.url, "--json"]) == 0
                assert json.loads(capsys.readouterr().out) == {"homes": {}, "unreachable": []}
                db.kill()
                with logstore.open(node.url) as client:
                    on_a = keys(store, True)
                    acked = [client.put_cell(next(on_a), "BASE", 1, {"n": i}) for i in range(4)]
                assert [c.added_id for c in acked] == [0, 0, 0, 0]
                waiting = {"homes": {"a": {"waiting": 4, "failed": 0, "held_on": {"b": {"waiting": 4, "failed": 0}}}},
                           "unreachable": ["a"]}
                assert main(["pending", "--store", node.url, "--json"]) == 5
                assert json.loads(capsys.readouterr().out) == waiting
                assert main(["pending", "--store", node.url]) == 5
                out = capsys.readouterr().out
                assert "node a: 4 buffered cells waiting to go home, 0 failed (held on b: 4 waiting" in out
                assert "node a does not answer" in out
                # A replay pass through the node while a is down: nothing goes home, the cells still wait.
                assert main(["pending", "--store", node.url, "--replay", "--json"]) == 5
                first = json.loads(capsys.readouterr().out.splitlines()[0])
                assert first == {"replayed": 0, "failed": 0, "waiting": 4, "unreachable": ["a"]}
                db.start()
                assert main(["pending", "--store", node.url, "--replay", "--wait", "30", "--json"]) == 0
                passes = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
                assert sum(p["replayed"] for p in passes[:-1]) == 4
                assert passes[-1] == {"homes": {}, "unreachable": []}
                assert main(["pending", "--store", node.url, "--json"]) == 0
                assert json.loads(capsys.readouterr().out) == {"homes": {}, "unreachable": []}
                home = [store.get_cell(c.row_key, "BASE", 1) for c in acked]
                assert all(c is not None and c.added_id > 0 for c in home)
            finally:
                node.stop()


def test_once_a_node_is_known_down_its_writes_are_buffered_at_once(mysql_database: str, tmp_path: Path) -> None:
    with PrivateMariaDB(tmp_path / "node-a") as db:
        cluster = two_nodes(tmp_path / "cluster.toml", [db.url("cells"), mysql_database], SHARDS)
        with open_store(cluster) as store:
            on_a = keys(store, True)
            db.kill()
            first, _ = timed_put(store, next(on_a), {"n": 0})  # finds it down: buffer_after
            assert first.added_id == 0 and list(store.known_down()) == ["a"]
            for n in range(1, 6):  # each at once, not after buffer_after again
                cell, took = timed_put(store, next(on_a), {"n": n})
                assert cell.added_id == 0 and took < AT_ONCE, f"write {n} to the down node took {took:.1f} s"
            assert store.pending_stats() == {"a": (6, 0)}
            db.start()
            # The background check finds it answering, with no write needed to find out.
            eventually("node a was never found answering again", lambda: not store.known_down())
            cell, took = timed_put(store, next(on_a), {"n": "home"})
            assert cell.added_id > 0 and took < AT_ONCE
            assert store.replay_pending().replayed == 6


def test_writes_to_the_healthy_node_never_stall_behind_the_down_one(mysql_database_factory: Callable[[], str],
                                                                    tmp_path: Path) -> None:
    """Through a worker node (8 request threads), with writers of the down node's shards busy beside the one
    writing to the healthy node; then a store opened while the node is down (its map refreshed every second)."""
    with PrivateMariaDB(tmp_path / "node-a") as db:
        cluster = two_nodes(tmp_path / "cluster.toml", [db.url("cells"), mysql_database_factory()], SHARDS)
        with open_store(cluster) as store:
            node = NodeThread(store, replay_interval=0.2).start()
            try:
                db.kill()
                with logstore.open(node.url) as client:  # the write that finds it down (and pays buffer_after)
                    assert client.put_cell(next(keys(store, True)), "BASE", 1, {}).added_id == 0
                stop = threading.Event()
                latencies: list[float] = []

                def write(on_a: bool) -> None:
                    with logstore.open(node.url) as client:
                        for key in keys(store, on_a):
                            if stop.is_set():
                                return
                            started = time.monotonic()
                            client.put_cell(key, "BASE", 1, {"on_a": on_a})
                            if not on_a:
                                latencies.append(time.monotonic() - started)
                            time.sleep(0.01)
                writers = [threading.Thread(target=write, args=(on_a,)) for on_a in [True] * 12 + [False]]
                for writer in writers:
                    writer.start()
                time.sleep(6.0)
                stop.set()
                for writer in writers:
                    writer.join(60)
                assert len(latencies) > 50 and max(latencies) < AT_ONCE, \
                    f"writes to the healthy node stalled: {sorted(latencies)[-5:]}"
            finally:
                node.stop()
        with open_store(cluster, map_refresh=1.0) as store:  # node a is still down: opened without it
            latencies = []
            on_b = keys(store, False)
            for n in range(300):  # 6 s and more: map refreshes that ask node a
                latencies.append(timed_put(store, next(on_b), {"n": n})[1])
                time.sleep(0.02)
            assert max(latencies) < AT_ONCE, f"writes to the healthy node stalled: {sorted(latencies)[-5:]}"
