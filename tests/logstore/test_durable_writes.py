"""Durable buffered writes (``durable_writes``, logstore.durable): a primary SIGKILLed while its replica is behind (its
replication delayed by a second, then cut), during a stream of writes, then its replica promoted. Every acknowledged
cell is there with the id it was acknowledged with, no id names two cells, and a running tailer delivers every one
of them in per-shard order."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import pytest

import logstore
from logstore.durable import trim_copies
from logstore.nodes import promote_node
from logstore.retry import RetryPolicy
from tailer.config import TailerConfig
from tailer.coordinators.local import LocalCoordinator
from tailer.publishers.directory import DirectoryPublisher
from tailer.worker import Tailer
from tests.harness.index_support import trip
from tests.harness.kafka_support import assert_shard_order, wait_for
from tests.harness.replica_pair import ReplicaPair
from tests.harness.shared_servers import KAFKA
from tests.logstore.test_buffered_writes import Background, PutWriters, assert_tailed
from tests.logstore.test_grow_end_to_end import CITIES, DRIVERS, PARTITIONS, Consumers
from tests.logstore.test_grow_end_to_end import consumers as consumers  # a fixture
from tests.logstore.test_promotion import cluster_file

SHARDS = 64


def open_store(cluster: Path, durable: bool = True) -> logstore.Store:
    return logstore.open(cluster, durable_writes=durable, buffer_after=0.5, map_refresh=0.2, connect_timeout=1.0,
                         read_timeout=5.0, retry=RetryPolicy(initial=0.05, maximum=0.3, deadline=5.0))


@pytest.fixture
def pair(tmp_path: Path) -> Any:
    with ReplicaPair(tmp_path / "pair", delay=1) as pair:  # replication delayed on purpose: a replica behind
        yield pair


def test_a_lost_primary_loses_no_acknowledged_cell(pair: ReplicaPair, mysql_database: str, tmp_path: Path) -> None:
    cluster = cluster_file(tmp_path / "cluster.toml", pair, mysql_database)
    store = open_store(cluster)
    try:
        tailer = Tailer(store, TailerConfig(name="t", partitions=4), LocalCoordinator(
            tmp_path / "offsets.json", SHARDS), DirectoryPublisher(tmp_path / "topics"))
        background = Background(tailer)
        writers = PutWriters(store)
        time.sleep(1.0)
        pair.wait_caught_up()
        pair.cut()  # the replica receives nothing more: what node a acknowledges now only it and the copies hold
        time.sleep(1.0)
        cut_at = time.monotonic()
        pair.primary.kill()
        time.sleep(1.0)  # writes to a's shards buffered meanwhile
        promoted_at = time.monotonic()
        done = promote_node(store, "a", f"127.0.0.1:{pair.replica.port}", burn=1000)
        time.sleep(1.0)
        writers.stop()
        acked, refused = writers.acked, writers.refused

        behind = [c for t, c in acked if c.shard < SHARDS // 2 and c.added_id and t < cut_at]
        assert done.restored > 0, "no acknowledged cell was missing on the replica: the test proves nothing"
        assert behind and len(refused) < len(acked) // 10, refused[:3]
        deadline = time.monotonic() + 60
        while (report := store.replay_pending()).waiting or report.unreachable:
            assert time.monotonic() < deadline, f"the replayer did not drain: {report}"
            time.sleep(0.2)

        for _, cell in acked:  # every acknowledged write is there, with the id it was acknowledged with
            stored = store.get_cell(cell.row_key, "BASE", 1)
            assert stored is not None and stored.body == cell.body, cell
            assert cell.added_id in (0, stored.added_id), (cell, stored)
        before = {}
        for t, cell in acked:
            if t < promoted_at and cell.added_id:
                before[cell.shard] = max(before.get(cell.shard, 0), cell.added_id)
        for t, cell in acked:  # a cell acknowledged after the promotion never takes an id given before it
            if t > promoted_at + 0.5 and cell.added_id and cell.shard < SHARDS // 2:
                assert cell.added_id > before.get(cell.shard, 0)

        assert_tailed(tmp_path / "topics", [c for _, c in acked], background)

        # Node a has no replica left and b never had one: every copy can go.
        trim_copies(store)
        assert sum(r.copy_counts().get("a", 0) for r in map(store.node_recorder, store.nodes) if r) == 0
    finally:
        store.close()


def test_without_durable_writes_nothing_is_held(pair: ReplicaPair, mysql_database: str, tmp_path: Path) -> None:
    cluster = cluster_file(tmp_path / "cluster.toml", pair, mysql_database)
    with open_store(cluster, durable=False) as store:
        store.put_cells([(uuid.uuid4(), "BASE", 1, {"n": n}) for n in range(50)])
        assert all(not r.copy_counts() for r in map(store.node_recorder, store.nodes) if r)
    with open_store(cluster) as store:
        cells = store.put_cells([(uuid.uuid4(), "BASE", 1, {"n": n}) for n in range(50)])
        on_a = sum(1 for c in cells if c.shard < SHARDS // 2)
        b = store.node_recorder("b")
        assert b is not None and b.copy_counts() == {"a": on_a}  # only a has a replica to promote
        pair.wait_caught_up()
        assert trim_copies(store) == on_a and b.copy_counts() == {}


def test_separate_tailer_and_app_processes_follow_the_promotion(pair: ReplicaPair, mysql_database: str,
                                                                 zk_chroot: str, topic_prefix: str, tmp_path: Path,
                                                                 consumers: list[Consumers]) -> None:
    """A `cellstream tail` process (to Kafka) and a `cellstream run` app process, started on the cluster file
    that names the lost primary, follow the shard map to the promoted replica without a restart: every
    acknowledged cell is delivered by both, the tailer's first deliveries of a shard in added_id order."""
    cluster = cluster_file(tmp_path / "cluster.toml", pair, mysql_database)
    store = open_store(cluster)
    try:
        running = Consumers(tmp_path, cluster, zk_chroot, topic_prefix)
        consumers.append(running)
        writers = PutWriters(store, 2, body=lambda _: trip(DRIVERS[0], CITIES[0], 1), pause=0.01)
        time.sleep(2.0)
        # The app claimed its offsets on node a and the replica holds the claims: on a loaded machine a process
        # can start after the cut, and its claim, on the lost primary alone, would be lost with it.
        deadline = time.monotonic() + 60
        while not running.handled():
            assert time.monotonic() < deadline, "the app handled nothing" + running.tail("app")
            time.sleep(0.1)
        pair.wait_caught_up()
        pair.cut()
        time.sleep(1.0)
        pair.primary.kill()
        time.sleep(1.0)
        assert promote_node(store, "a", f"127.0.0.1:{pair.replica.port}", burn=1000).restored > 0
        time.sleep(2.0)
        acked = writers.stop()
        deadline = time.monotonic() + 60
        while (report := store.replay_pending()).waiting or report.unreachable:
            assert time.monotonic() < deadline, f"the replayer did not drain: {report}"
            time.sleep(0.2)
        stored = [store.get_cell(c.row_key, "BASE", 1) for c in acked]
        assert all(s is not None for s in stored)
        ids = {(s.shard, s.added_id) for s in stored if s is not None}
        running.check_alive()
        assert_shard_order(wait_for(KAFKA, f"{topic_prefix}.BASE", ids, timeout=120), PARTITIONS)
        deadline = time.monotonic() + 120
        while not ids <= running.handled():
            assert time.monotonic() < deadline, f"{len(ids - running.handled())} cells never handled" + \
                running.tail("app")
            time.sleep(0.5)
        running.check_alive()
    finally:
        store.close()
