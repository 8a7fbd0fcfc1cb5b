"""Buffered writes: a storage node's primary SIGKILLed during a stream of writes. Writes to its shards are
buffered on the other node and acknowledged; when it restarts the replayer writes them home, every
acknowledged write is there, and the tailer, which ran throughout, delivers every one of them."""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import logstore
from logstore.retry import RetryPolicy
from tailer.config import TailerConfig
from tailer.coordinators.local import LocalCoordinator
from tailer.publishers.directory import DirectoryPublisher, read_topic
from tailer.worker import Tailer
from tests.harness.private_mariadb import PrivateMariaDB
from tests.harness.stores import two_nodes

SHARDS = 4096  # the default


def cluster_file(tmp_path: Path, a: str, b: str) -> Path:
    return two_nodes(tmp_path / "cluster.toml", [a, b], SHARDS)


def open_store(cluster: Path) -> logstore.Store:
    return logstore.open(cluster, retry=RetryPolicy(initial=0.05, maximum=0.3, deadline=5.0), buffer_after=0.5,
                         connect_timeout=1.0, read_timeout=5.0)


def assert_tailed(topics: Path, acked: list[logstore.Cell], background: Background) -> None:
    """Every acknowledged cell published on ``cells.BASE`` (waited for, then the tailer stopped), each shard's
    cells in added_id order: the order held through the crash."""
    wanted = {str(c.row_key) for c in acked}
    deadline = time.monotonic() + 60
    while not wanted <= (published := {r["value"]["row_key"] for _, r in read_topic(topics, "cells.BASE")}):
        assert time.monotonic() < deadline, f"{len(wanted - published)} acknowledged cells never tailed"
        time.sleep(0.2)
    background.close()
    by_shard: dict[int, list[int]] = {}
    for _, record in read_topic(topics, "cells.BASE"):
        by_shard.setdefault(record["value"]["shard"], []).append(record["value"]["added_id"])
    for ids in by_shard.values():
        assert ids == sorted(ids)


class PutWriters:
    """Threads of one store, each putting a new cell at a time until stopped: what was acknowledged (and when),
    and the refusals (StorageUnavailableError: not acknowledged, allowed, but counted)."""

    def __init__(self, store: logstore.Store, n: int = 3, body: Callable[[int], dict[str, Any]] = lambda i: {"n": i},
                 pause: float = 0.0) -> None:
        self.acked: list[tuple[float, logstore.Cell]] = []
        self.refused: list[BaseException] = []
        self._store, self._body, self._pause = store, body, pause
        self._writing = threading.Event()
        self._writing.set()
        self._threads = [threading.Thread(target=self._write) for _ in range(n)]
        for thread in self._threads:
            thread.start()

    def _write(self) -> None:
        n = 0
        while self._writing.is_set():
            try:
                self.acked.append((time.monotonic(), self._store.put_cell(uuid.uuid4(), "BASE", 1, self._body(n))))
            except logstore.StorageUnavailableError as exc:
                self.refused.append(exc)
            n += 1
            if self._pause:
                time.sleep(self._pause)

    def stop(self) -> list[logstore.Cell]:
        """Stop and join them; the cells acknowledged."""
        self._writing.clear()
        for thread in self._threads:
            thread.join(60)
        return self.cells

    @property
    def cells(self) -> list[logstore.Cell]:
        return [cell for _, cell in self.acked]


class Background:
    """The tailer on its own event loop, publishing to topic files, until stopped."""

    def __init__(self, tailer: Tailer) -> None:
        self.tailer = tailer
        self.stop = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self.thread.start()

    async def _run(self) -> None:
        async with self.tailer:
            while not self.stop.is_set():
                await asyncio.sleep(0.05)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(60)


def test_a_primary_sigkilled_during_writes_loses_no_acknowledged_cell(mysql_database: str, tmp_path: Path) -> None:
    with PrivateMariaDB(tmp_path / "node-a") as db:
        store = open_store(cluster_file(tmp_path, db.url("cells"), mysql_database))
        try:
            tailer = Tailer(store, TailerConfig(name="t", partitions=4), LocalCoordinator(
                tmp_path / "offsets.json", SHARDS), DirectoryPublisher(tmp_path / "topics"))
            background = Background(tailer)
            writers = PutWriters(store)
            time.sleep(1.5)
            db.kill()  # SIGKILL mid-stream: what it committed is on disk, the rest never was acknowledged
            time.sleep(3.0)
            db.start()
            time.sleep(1.0)
            acked = writers.stop()

            on_a = [c for c in acked if c.shard < SHARDS // 2]
            buffered = [c for c in acked if c.added_id == 0]
            assert buffered and all(c.shard < SHARDS // 2 for c in buffered), "no write was buffered while a was down"
            assert len(on_a) > len(buffered), "node a took no write directly"
            assert not writers.refused, writers.refused[:3]

            deadline = time.monotonic() + 60
            while (report := store.replay_pending()).waiting or report.unreachable:
                assert time.monotonic() < deadline, f"the replayer did not drain: {report}"
                time.sleep(0.2)
            assert report.failed == 0 and store.pending_stats() == {}

            for cell in acked:  # every acknowledged write is in its shard now
                stored = store.get_cell(cell.row_key, "BASE", 1)
                assert stored is not None and stored.body == cell.body and stored.added_id > 0

            assert_tailed(tmp_path / "topics", acked, background)
        finally:
            store.close()


def test_a_buffered_cell_that_conflicts_at_home_is_kept_failed_not_dropped(mysql_database: str,
                                                                           tmp_path: Path) -> None:
    with PrivateMariaDB(tmp_path / "node-a") as db, open_store(cluster_file(tmp_path, db.url("cells"),
                                                                           mysql_database)) as store:
        key = next(k for k in iter(uuid.uuid4, None) if store.shard_of(k) < SHARDS // 2)
        db.kill()
        buffered = store.put_cell(key, "BASE", 1, {"v": "buffered"})
        assert buffered.added_id == 0 and store.pending_stats() == {"a": (1, 0)}
        db.start()
        deadline = time.monotonic() + 30  # known down until the store's background check finds it answering
        while "a" in store.known_down():
            assert time.monotonic() < deadline, "node a was never found answering again"
            time.sleep(0.1)
        # Before the replayer runs, the same coordinates get another body at home: cells are immutable.
        assert store.put_cell(key, "BASE", 1, {"v": "direct"}).added_id > 0
        report = store.replay_pending()
        assert (report.replayed, report.failed, report.waiting, report.unreachable) == (0, 1, 0, [])
        assert store.pending_stats() == {"a": (0, 1)}  # kept, with the reason, for triage
        with pytest.raises(logstore.CellConflictError):
            store.put_cell(key, "BASE", 1, {"v": "buffered"})


def test_a_worker_node_buffers_and_its_replayer_writes_home(mysql_database: str, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    from cellstream.cli.main import main
    from tests.harness.worker_support import NodeThread

    with PrivateMariaDB(tmp_path / "node-a") as db:
        cluster = cluster_file(tmp_path, db.url("cells"), mysql_database)
        with open_store(cluster) as store:
            keys = list(itertools.islice((k for k in iter(uuid.uuid4, None) if store.shard_of(k) < SHARDS // 2), 5))
            node = NodeThread(store, replay_interval=0.2).start()
            try:
                db.kill()
                with logstore.open(node.url) as client:
                    acked = [client.put_cell(k, "BASE", 1, {"via": "worker node"}) for k in keys[:3]]
                assert [c.added_id for c in acked] == [0, 0, 0]  # buffered, acknowledged over HTTP
                db.start()
                deadline = time.monotonic() + 30
                # The replayer counts its pass after the pass has dropped the cells from the buffer: both are awaited.
                while store.pending_stats() or node.node.metrics.replayed._value.get() < 3:
                    assert time.monotonic() < deadline, "the worker node's replayer did not write them home"
                    time.sleep(0.2)
                assert node.node.metrics.replayed._value.get() == 3
            finally:
                node.stop()
            for key in keys[:3]:
                stored = store.get_cell(key, "BASE", 1)
                assert stored is not None and stored.added_id > 0

            # Without a worker node, `cellstream pending --replay` does the same.
            db.kill()
            assert [store.put_cell(k, "BASE", 1, {"via": "store"}).added_id for k in keys[3:]] == [0, 0]
            capsys.readouterr()
            # While node a is down: what waits for it, where, and that a itself could not be asked.
            assert main(["pending", "--store", str(cluster), "--json"]) == 5  # cells wait: not OK
            assert json.loads(capsys.readouterr().out) == {
                "homes": {"a": {"waiting": 2, "failed": 0, "held_on": {"b": {"waiting": 2, "failed": 0}}}},
                "unreachable": ["a"]}
            db.start()
            assert main(["pending", "--store", str(cluster), "--json"]) == 5
            assert json.loads(capsys.readouterr().out) == {
                "homes": {"a": {"waiting": 2, "failed": 0, "held_on": {"b": {"waiting": 2, "failed": 0}}}},
                "unreachable": []}
            assert main(["pending", "--store", str(cluster), "--replay", "--wait", "30"]) == 0
            assert "replayed 2, failed 0, waiting 0" in capsys.readouterr().out
            assert all(store.get_cell(k, "BASE", 1).added_id > 0 for k in keys[3:])  # type: ignore[union-attr]


def test_a_store_opened_while_a_node_is_down_buffers_and_checks_the_node_when_it_returns(
        mysql_database_factory: Any, tmp_path: Path) -> None:
    with PrivateMariaDB(tmp_path / "node-a") as db:
        cluster = cluster_file(tmp_path, db.url("cells"), mysql_database_factory())
        with open_store(cluster):
            pass  # node a is created
        db.kill()
        with open_store(cluster) as store:  # opens without node a
            key = next(k for k in iter(uuid.uuid4, None) if store.shard_of(k) < SHARDS // 2)
            assert store.put_cell(key, "BASE", 1, {"opened": "during the outage"}).added_id == 0
            with pytest.raises(logstore.StorageUnavailableError):
                store.get_cell(key, "BASE", 1)
            db.start()
            assert store.replay_pending().replayed == 1
            stored = store.get_cell(key, "BASE", 1)
            assert stored is not None and stored.added_id > 0
        bad = tmp_path / "bad.toml"  # node a's shards are 0-2047: a map that says otherwise is refused on return
        bad.write_text(f'shards = {SHARDS}\n[[nodes]]\nname = "a"\nurl = "{db.url("cells")}"\nshards = "0-1023"\n'
                       f'[[nodes]]\nname = "b"\nurl = "{mysql_database_factory()}"\nshards = "1024-{SHARDS - 1}"\n')
        db.kill()
        with open_store(bad) as store:
            db.start()
            with pytest.raises(logstore.ConfigurationError, match="holds shards 0-2047"):
                store.get_cell(next(k for k in iter(uuid.uuid4, None) if store.shard_of(k) < 1024), "BASE", 1)
