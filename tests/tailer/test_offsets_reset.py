"""``cellstream offsets``: every place offsets live, read with their lag and reset, against the real services.

The guarantees: after a reset every cell of the range is delivered again, in per-shard order, and the live
consumer skips nothing outside it; a reset never moves the offsets of a running consumer unless coordinated
(the store: through the owners' fencing; ZooKeeper, an offsets file, a Kafka group: refused, naming the
processes); a dry run changes nothing; each reset is recorded.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import logstore
from cellstream.cli.exits import Exit
from cellstream.cli.main import main
from indexer import App
from logstore.positions import parse_position
from tailer.errors import ConsumerRunningError
from tailer.offsets import ResetHistory
from tailer.offsets.store import StoreOffsets
from tests.harness.app_thread import app_in_thread
from tests.harness.shared_servers import KAFKA

SHARDS = 8


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def wait_for(what: str, done: Callable[[], bool], timeout: float = 30.0,
             state: Callable[[], object] = lambda: "") -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what} {state()}")
        time.sleep(0.05)


def store_url(request: pytest.FixtureRequest, backend: str) -> str:
    return str(request.getfixturevalue("sqlite_url" if backend == "sqlite" else "mysql_database"))


class Seen:
    """The cells a handler got, in order, per shard."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_shard: dict[int, list[int]] = defaultdict(list)

    def add(self, shard: int, added_id: int) -> None:
        with self.lock:
            self.by_shard[shard].append(added_id)

    def count(self) -> int:
        with self.lock:
            return sum(len(ids) for ids in self.by_shard.values())

    def copy(self) -> dict[int, list[int]]:
        with self.lock:
            return {shard: list(ids) for shard, ids in self.by_shard.items()}


def counting_app(name: str, url: str, seen: Seen) -> App:
    app = App(name, store=url)

    @app.trigger("BASE")
    def record(cell: Any) -> None:
        seen.add(cell.shard, cell.added_id)

    return app


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("mysql", marks=pytest.mark.mysql)])
def test_a_reset_of_a_running_app_is_taken_up_through_its_fencing(
        backend: str, request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str]) -> None:
    """An idle app, running, is rewound to the beginning: it delivers every cell again in per-shard order, its
    later commits do not move the offsets back, and it goes on with new cells. The dry run before changes
    nothing; the reset is recorded."""
    url = store_url(request, backend)
    with logstore.open(url, shards=SHARDS) as store:
        store.put_cells([(uuid.uuid4(), "BASE", 1, {"n": i}) for i in range(40)])
        heads = store.heads()
    seen = Seen()
    app = counting_app("rewound", url, seen)
    with logstore.open(url) as store, app_in_thread(app, "rewound") as running:
        wait_for("the first delivery", lambda: seen.count() >= 40)
        wait_for("the commits", lambda: {s: r.location or 0 for s, r in store.read_offsets("app.rewound").items()}
                 == heads, state=lambda: (heads, store.read_offsets("app.rewound"), seen.copy(), running.failed))
        first = seen.copy()

        code, out, _ = cli(capsys, "--store", url, "offsets", "reset", "app.rewound", "--to", "beginning",
                           "--dry-run", "--json")
        plan = json.loads(out)
        assert code == 0 and plan["moved"] == SHARDS and not plan["executed"]  # a shard without cells: None to 0
        assert plan["coordinated"] and plan["holders"]  # the running app's process
        time.sleep(0.5)
        assert {s: r.location or 0 for s, r in store.read_offsets("app.rewound").items()} == heads  # a dry run
        assert seen.copy() == first

        code, out, _ = cli(capsys, "--store", url, "offsets", "reset", "app.rewound", "--to", "beginning",
                           "--execute", "--reason", "handler fixed", "--json")
        assert code == 0, out
        reset_id = json.loads(out)["reset"]
        wait_for("the second delivery", lambda: seen.count() >= 80)
        again = seen.copy()
        for shard, ids in again.items():  # per shard: the first run's cells, then all of them again, in order
            assert ids == first[shard] + first[shard], shard

        store.put_cells([(uuid.uuid4(), "BASE", 1, {"n": i}) for i in range(10)])
        wait_for("the live cells", lambda: seen.count() >= 90)
        # Caught up: nothing of its column after its commits (the reset's record, a cell of a column it does
        # not read, is no lag of its own).
        wait_for("the commits after the reset", lambda: StoreOffsets(store).positions("app.rewound").lag == 0,
                 state=lambda: (store.heads(), store.read_offsets("app.rewound"), seen.copy()))
        assert not running.failed and app._runner().lost_shards() == frozenset()

        [record] = ResetHistory(store).resets("app.rewound")
        assert (record.id, record.to, record.reason, record.place) == (reset_id, "beginning", "handler fixed", "store")
        assert sorted((int(k), before, to) for k, before, to in record.changes) == sorted(
            (s, h or None, 0) for s, h in heads.items())  # a shard without cells never committed: from None
        code, out, _ = cli(capsys, "--store", url, "offsets", "history", "app.rewound")
        assert reset_id in out and "handler fixed" in out


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("mysql", marks=pytest.mark.mysql)])
def test_a_reset_by_time_and_by_shard_location_replays_only_its_range(
        backend: str, request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str]) -> None:
    """Stopped, an app is reset to a time: it delivers again exactly the cells created since, nothing before;
    then one shard to an explicit location, the others left where they are."""
    url = store_url(request, backend)
    with logstore.open(url, shards=SHARDS) as store:
        store.put_cells([(uuid.uuid4(), "BASE", 1, {"batch": 1}) for _ in range(30)])
        time.sleep(0.05)
        cut = dt.datetime.now(dt.UTC)
        time.sleep(0.05)
        late = store.put_cells([(uuid.uuid4(), "BASE", 1, {"batch": 2}) for _ in range(30)])
    seen = Seen()
    counting_app("ranged", url, seen).drain()
    assert seen.count() == 60

    code, _, err = cli(capsys, "--store", url, "offsets", "reset", "app.ranged", "--to", cut.isoformat(),
                       "--execute")
    assert code == 0, err
    seen2 = Seen()
    counting_app("ranged", url, seen2).drain()
    assert sorted((s, i) for s, ids in seen2.copy().items() for i in ids) == sorted(
        (c.shard, c.added_id) for c in late)

    shard = late[0].shard
    code, _, err = cli(capsys, "--store", url, "offsets", "reset", "app.ranged", "--to", f"{shard}:1",
                       "--shards", str(shard), "--execute")
    assert code == 0, err
    seen3 = Seen()
    counting_app("ranged", url, seen3).drain()
    with logstore.open(url) as store:
        page, _ = store.get_cells_for_shard(shard, 1, 1000, columns=["BASE"])
        assert seen3.copy() == {shard: [cell.added_id for cell in page]} and len(page) > 1

    code, _, err = cli(capsys, "--store", url, "offsets", "reset", "app.ranged", "--to", f"{shard}:99999",
                       "--execute")
    assert code == Exit.USAGE and "past the shard's head" in err


def test_list_answers_every_consumers_lag_totals_first(sqlite_url: str, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    with logstore.open(sqlite_url, shards=SHARDS) as store:
        store.put_cells([(uuid.uuid4(), "BASE", 1, {}) for _ in range(12)])
    counting_app("caught", sqlite_url, Seen()).drain()
    counting_app("behind", sqlite_url, Seen()).drain()
    with logstore.open(sqlite_url) as store:
        store.put_cells([(uuid.uuid4(), "BASE", 1, {}) for _ in range(5)])
    counting_app("caught", sqlite_url, Seen()).drain()
    with logstore.open(sqlite_url) as store:  # cells of a column neither reads: no lag of theirs
        store.put_system_cells([(uuid.uuid4(), "_note", 1, {}) for _ in range(3)])
        store.put_cells([(uuid.uuid4(), "OTHER", 1, {}) for _ in range(3)])

    code, out, _ = cli(capsys, "--store", sqlite_url, "offsets", "list", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["total_lag"] == 5 and doc["consumers_behind"] == 1
    assert [(c["name"], c["lag"]) for c in doc["consumers"]] == [("app.behind", 5), ("app.caught", 0)]
    code, out, _ = cli(capsys, "--store", sqlite_url, "offsets", "list")
    assert out.splitlines()[0] == "2 consumers, 1 behind, 5 cells (messages) to deliver in all"

    code, _, err = cli(capsys, "--store", sqlite_url, "offsets", "show", "app.nobody")
    assert code == Exit.NOT_FOUND and "app.nobody" in err


@pytest.mark.zookeeper
def test_zookeeper_offsets_are_not_reset_under_running_workers(sqlite_url: str, zk_chroot: str,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    from tailer.coordinators.zookeeper import ZooKeeperCoordinator
    from tailer.interfaces import Claim, Offset
    from tailer.offsets.zookeeper import ZooKeeperOffsets

    with logstore.open(sqlite_url, shards=SHARDS) as store:
        store.put_cells([(uuid.uuid4(), "BASE", 1, {}) for _ in range(40)])
        heads = store.heads()
        worker = ZooKeeperCoordinator(zk_chroot, "zt", SHARDS, session_timeout=6)
        changed = threading.Event()
        worker.start(changed.set)
        try:
            wait_for("the assignment", lambda: len(worker.assignment()[2]) == SHARDS)
            claims = worker.claim_many([(shard, lambda: 0) for shard in range(SHARDS)])
            assert all(not isinstance(c, BaseException) and c is not None for c in claims)
            done = worker.commit({c.shard: (c, Offset(heads[c.shard], 0, None)) for c in claims
                                  if c is not None and not isinstance(c, BaseException)})
            place = ZooKeeperOffsets(store, zk_chroot)
            assert place.consumers() == ["zt"]
            assert place.positions("zt").lag == 0
            back = done[0]
            assert isinstance(back, Claim)
            [committed] = worker.commit({0: (back, Offset(0, 0, None))}).values()  # shard 0's commit behind...
            assert place.positions("zt").lag == store.count_after(0, 0) > 0
            worker.report_published({0: heads[0]})  # ...what its worker had acknowledged: no lag
            wait_for("the report", lambda: place.positions("zt").lag == 0)
            assert [(r.location, r.published) for r in place.positions("zt").rows if r.shard == 0] == [(0, heads[0])]
            assert isinstance(committed, Claim)
            worker.commit({0: (committed, Offset(heads[0], 0, None))})
            plan = place.plan_reset("zt", parse_position("beginning"), None)
            with pytest.raises(ConsumerRunningError) as refused:
                place.execute(plan)
            assert worker.worker_id in str(refused.value) and str(os.getpid()) in str(refused.value)
            code, _, err = cli(capsys, "--store", sqlite_url, "offsets", "reset", "zt", "--zookeeper", zk_chroot,
                               "--to", "beginning", "--execute")
            assert code == Exit.STATE and "running workers" in err
            assert {r.shard: r.location for r in place.positions("zt").rows} == heads  # nothing moved
        finally:
            worker.stop()

        code, _, err = cli(capsys, "--store", sqlite_url, "offsets", "reset", "zt", "--zookeeper", zk_chroot,
                             "--to", "beginning", "--shards", "0-3", "--execute")
        assert code == 0, err
        after = ZooKeeperCoordinator(zk_chroot, "zt", SHARDS, session_timeout=6)
        after.start(lambda: None)
        try:
            wait_for("the assignment", lambda: len(after.assignment()[2]) == SHARDS)
            claims = after.claim_many([(shard, lambda: -1) for shard in range(SHARDS)])
            assert [c.location for c in claims if c is not None and not isinstance(c, BaseException)] == [
                0 if shard <= 3 else heads[shard] for shard in range(SHARDS)]
        finally:
            after.stop()


def test_an_offsets_file_is_not_reset_under_its_running_tailer(sqlite_url: str, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    from tailer.coordinators.local import LocalCoordinator
    from tailer.interfaces import Offset

    path = tmp_path / "tail" / "offsets.json"
    with logstore.open(sqlite_url, shards=SHARDS) as store:
        store.put_cells([(uuid.uuid4(), "BASE", 1, {}) for _ in range(24)])
        heads = store.heads()
        running = LocalCoordinator(path, SHARDS)
        running.start(lambda: None)
        claims = [running.claim(shard, lambda: 0) for shard in range(SHARDS)]
        running.commit({c.shard: (c, Offset(heads[c.shard], 0, None)) for c in claims if c is not None})
        try:
            code, _, err = cli(capsys, "--store", sqlite_url, "offsets", "reset", "--offsets-file", str(path),
                               "--to", "beginning", "--execute")
            assert code == Exit.STATE and f"pid {os.getpid()}" in err
            code, out, _ = cli(capsys, "--store", sqlite_url, "offsets", "reset", "--offsets-file", str(path),
                               "--to", "beginning", "--dry-run", "--json")
            assert code == 0 and json.loads(out)["holders"]
        finally:
            running.stop()
        assert {int(s): d["location"] for s, d in json.loads(path.read_text())["shards"].items()} == heads

        code, _, err = cli(capsys, "--store", sqlite_url, "offsets", "reset", "--offsets-file", str(path),
                           "--to", "beginning", "--execute")
        assert code == 0, err
        again = LocalCoordinator(path, SHARDS)
        again.start(lambda: None)
        try:
            assert [c.location for s in range(SHARDS) if (c := again.claim(s, lambda: -1)) is not None] == \
                [0] * SHARDS
        finally:
            again.stop()


@pytest.mark.kafka
def test_a_kafka_group_is_reset_only_without_members(topic_prefix: str, sqlite_url: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    from tailer.offsets.kafka import KafkaGroupOffsets

    topic, group = f"{topic_prefix}.cells", f"app.{topic_prefix}"
    with logstore.open(sqlite_url, shards=SHARDS):
        pass

    async def scenario() -> None:
        admin = AIOKafkaAdminClient(bootstrap_servers=KAFKA)
        await admin.start()
        try:
            await admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])
        finally:
            await admin.close()
        producer = AIOKafkaProducer(bootstrap_servers=KAFKA)
        await producer.start()
        try:
            for i in range(10):
                await producer.send_and_wait(topic, f"m{i}".encode(), partition=0)
        finally:
            await producer.stop()
        consumer = AIOKafkaConsumer(topic, bootstrap_servers=KAFKA, group_id=group, enable_auto_commit=False,
                                    auto_offset_reset="earliest")
        await consumer.start()
        try:
            got = 0
            while got < 10:
                batch = await consumer.getmany(timeout_ms=1000)
                got += sum(len(v) for v in batch.values())
            await consumer.commit()
            place = KafkaGroupOffsets(KAFKA)
            plan = await asyncio.to_thread(place.plan_reset, group, parse_position("beginning"), None)
            assert plan.changes == [(f"{topic}/0", 10, 0)] and plan.holders
            with pytest.raises(ConsumerRunningError):
                await asyncio.to_thread(place.execute, plan)
        finally:
            await consumer.stop()
        place = KafkaGroupOffsets(KAFKA)
        wait = time.monotonic() + 30
        while True:  # the group empties once the broker has the member's leave
            try:
                await asyncio.to_thread(place.execute, await asyncio.to_thread(
                    place.plan_reset, group, parse_position("beginning"), None))
                break
            except ConsumerRunningError:
                if time.monotonic() > wait:
                    raise
                await asyncio.sleep(0.5)
        positions = await asyncio.to_thread(place.positions, group)
        assert [(r.key, r.location, r.end) for r in positions.rows] == [(f"{topic}/0", 0, 10)]

    asyncio.run(scenario())
    code, out, _ = cli(capsys, "--store", sqlite_url, "offsets", "show", group, "--brokers", KAFKA, "--topic-prefix",
                       topic_prefix, "--json")
    assert code == 0 and json.loads(out)["lag"] == 10
    code, out, _ = cli(capsys, "--store", sqlite_url, "offsets", "list", "--brokers", KAFKA, "--topic-prefix",
                       f"{topic_prefix}x", "--json")  # another tailer's topics: another store's apps
    assert code == 0 and group not in [c["name"] for c in json.loads(out)["consumers"]]
    code, _, err = cli(capsys, "--store", sqlite_url, "offsets", "reset", group, "--brokers", KAFKA,
                       "--topic-prefix", topic_prefix, "--to", "0:1", "--dry-run")
    assert code == Exit.USAGE and "partition offsets" in err


def test_a_tailer_between_two_commits_is_not_reported_behind(sqlite_url: str, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """A standalone tailer that has published everything but not committed yet (a long commit interval) shows
    no lag: its lag counts from what it has had acknowledged, which it reports beside its offsets."""
    from tailer.config import TailerConfig
    from tailer.coordinators.local import LocalCoordinator
    from tailer.publishers.directory import DirectoryPublisher, read_topic
    from tailer.worker import Tailer

    offsets = tmp_path / "offsets.json"
    with logstore.open(sqlite_url, shards=SHARDS) as store:
        store.put_cells([(uuid.uuid4(), "BASE", 1, {}) for _ in range(20)])
        first = Tailer(store, TailerConfig(name="t", partitions=2), LocalCoordinator(offsets, SHARDS),
                       DirectoryPublisher(tmp_path / "topics"))

        async def publish(tailer: Tailer, total: int) -> None:
            async with tailer:
                deadline = time.monotonic() + 30
                while len(list(read_topic(tmp_path / "topics", "cells.BASE"))) < total:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.02)
        asyncio.run(publish(first, 20))  # stops with a commit: every shard committed
        store.put_cells([(uuid.uuid4(), "BASE", 1, {}) for _ in range(20)])
        slow = Tailer(store, TailerConfig(name="t", partitions=2, commit_interval=600),
                      LocalCoordinator(offsets, SHARDS), DirectoryPublisher(tmp_path / "topics"))

        async def between_commits() -> dict[str, Any]:
            async with slow:
                deadline = time.monotonic() + 30
                while len(list(read_topic(tmp_path / "topics", "cells.BASE"))) < 40:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.02)
                deadline = time.monotonic() + 20  # a report is made every second, once the cells are acknowledged
                while True:
                    code, out, _ = await asyncio.to_thread(cli, capsys, "--store", sqlite_url, "offsets", "show",
                                                           "--offsets-file", str(offsets), "--json")
                    assert code == 0
                    status = json.loads(out)
                    if status["lag"] == 0 or time.monotonic() > deadline:
                        break
                    await asyncio.sleep(0.2)
                committed = sum(store.counts_after({r["shard"]: r["location"] or 0 for r in status["rows"]}).values())
                assert committed == 20  # the commit is behind...
                return dict(status)
        status = asyncio.run(between_commits())
        assert status["lag"] == 0 and status["holders"]  # ...what it has published is not


def test_tail_from_a_time_says_the_shards_with_offsets_resume_from_them(sqlite_url: str, tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys

    from tailer.coordinators.local import LocalCoordinator
    from tailer.interfaces import Offset

    offsets = tmp_path / "offsets.json"
    with logstore.open(sqlite_url, shards=SHARDS) as store:
        store.put_cells([(uuid.uuid4(), "BASE", 1, {}) for _ in range(5)])
        earlier = LocalCoordinator(offsets, SHARDS)
        earlier.start(lambda: None)
        claims = [c for s in range(3) if (c := earlier.claim(s, lambda: 0)) is not None]
        earlier.commit({c.shard: (c, Offset(0, 0, None)) for c in claims})
        earlier.stop()
    when = dt.datetime.now(dt.UTC).isoformat()
    proc = subprocess.Popen([sys.executable, "-m", "cellstream", "--store", sqlite_url, "tail", "--name", "t",
                             "--offsets", str(offsets), "--out", str(tmp_path / "topics"), "--from", when],
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if "resumes from its committed offsets" in line or "running" in line:
                break
        said = "".join(lines)
        assert f"resumes from its committed offsets in 3 of {SHARDS} shards" in said, said
        assert f"offsets reset --offsets-file {offsets} --to {when}" in said  # the file names its consumer
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def test_list_leaves_out_the_positions_of_replays_that_are_over(sqlite_url: str,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    from logstore.jobs import JobStore

    with logstore.open(sqlite_url, shards=SHARDS) as store:
        jobs = JobStore(store)
        running, over = (jobs.create("replay", {}, []) for _ in range(2))
        jobs.cancel(over.id)
        for job in (running, over):
            store.claim_offsets(f"replay.{job.id}", "runner")
    code, out, _ = cli(capsys, "--store", sqlite_url, "offsets", "list", "--json")
    assert code == 0 and [c["name"] for c in json.loads(out)["consumers"]] == [f"replay.{running.id}"]
    code, out, _ = cli(capsys, "--store", sqlite_url, "offsets", "show", f"replay.{over.id}", "--json")
    assert code == 0 and json.loads(out)["name"] == f"replay.{over.id}"  # kept for a look


def test_offsets_through_a_worker_node(sqlite_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A store reached through a worker node lists, shows and resets its consumers as the store itself does
    (GET /v1/offsets); a backup through it is still refused, naming the way that works."""
    from logstore.backup.create import create_backup
    from logstore.backup.storage import DirectoryStorage
    from logstore.errors import ConfigurationError
    from tests.harness.worker_support import worker_node

    with worker_node(sqlite_url, SHARDS) as node:
        with logstore.open(node.url) as remote:
            remote.put_cells([(uuid.uuid4(), "BASE", 1, {}) for _ in range(12)])
            remote.claim_offsets("app.remote", "holder")
            assert remote.consumers() == ["app.remote"]
            with pytest.raises(ConfigurationError, match="worker node"):
                create_backup(remote, DirectoryStorage(tmp_path / "backups"))
            heads = remote.heads()
        code, out, _ = cli(capsys, "--store", node.url, "offsets", "list", "--json")
        assert code == 0 and [(c["name"], c["lag"]) for c in json.loads(out)["consumers"]] == [("app.remote", 12)]
        assert "index appliers are left out" in json.loads(out)["left_out"][0]  # the node's tables: said, not hidden
        code, _, err = cli(capsys, "--store", node.url, "offsets", "reset", "app.remote", "--to", "end", "--execute")
        assert code == 0, err
        code, out, _ = cli(capsys, "--store", node.url, "offsets", "show", "app.remote", "--json")
        assert code == 0 and {r["shard"]: r["location"] for r in json.loads(out)["rows"]} == heads


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("mysql", marks=pytest.mark.mysql), "node"])
def test_a_reader_of_every_column_is_not_behind_cellstreams_own_cells(request: pytest.FixtureRequest,
                                                                       backend: str) -> None:
    """A tailer of every column passes over cellstream's own cells (jobs, index catalog, resets): they are no lag of
    it, nor of a consumer that has not committed yet (counted from the beginning); the lag is its columns' cells."""
    from contextlib import nullcontext

    from tests.harness.worker_support import worker_node

    url = store_url(request, "sqlite" if backend == "node" else backend)
    with logstore.open(url, shards=SHARDS):
        pass
    with worker_node(url, SHARDS) if backend == "node" else nullcontext() as node, \
            logstore.open(node.url if node is not None else url) as store:
        store.put_cells([(uuid.uuid4(), "BASE", 1, {}) for _ in range(6)])
        store.claim_offsets("tail.every", "worker")
        store.commit_offsets("tail.every", "worker", {s: (h, {}) for s, h in store.heads().items()})
        with logstore.open(url) as direct:  # system cells are written by the store's own parts, never over HTTP
            direct.put_system_cells([(uuid.uuid4(), "_job", 1, {}) for _ in range(4)])
        store.put_cells([(uuid.uuid4(), "OTHER", 1, {}) for _ in range(3)])
        store.claim_offsets("tail.new", "worker")
        place = StoreOffsets(store)
        assert place.positions("tail.every").lag == 3
        assert place.positions("tail.new").lag == 9


def test_an_index_applier_lags_by_its_column_and_a_backfill_by_its_range(sqlite_url: str,
                                                                         tmp_path: Path) -> None:
    """An index version's applier reads its source column only: the catalog's own cells and other columns are no
    lag of it; a finished backfill is not listed as a consumer behind."""
    from indexer.indexes.backfill import backfill
    from tailer.offsets.indexes import IndexOffsets
    from tests.harness.index_support import SEED_YAML, trip

    yaml_file = tmp_path / "indexes.yaml"
    yaml_file.write_text(SEED_YAML)
    with logstore.open(sqlite_url, shards=SHARDS) as store:
        store.put_cells([(uuid.uuid4(), "BASE", 1, trip(uuid.uuid4(), uuid.uuid4(), i)) for i in range(10)])
        with App("trips", store=store, commit_interval=0.05) as app:
            app.index(yaml_file)
            app.drain(timeout=60)
        name = "index.driver_partner_index.v1"
        place = IndexOffsets(store)
        assert place.positions(name).lag == 0
        assert backfill(store, "driver_partner_index", 1).shards == SHARDS
        store.put_cells([(uuid.uuid4(), "OTHER", 1, {}) for _ in range(4)])
        store.put_cells([(uuid.uuid4(), "BASE", 1, trip(uuid.uuid4(), uuid.uuid4(), i)) for i in range(2)])
        assert place.consumers() == [name]  # the backfill is over
        assert place.positions(name).lag == 2


def test_a_replay_lags_by_its_columns_up_to_its_ends(sqlite_url: str) -> None:
    """A replay's positions count the cells of its columns left before each shard's end, not the log's head."""
    from logstore.jobs import JobStore
    from logstore.jobs.records import StepRecord

    with logstore.open(sqlite_url, shards=SHARDS) as store:
        store.put_cells([(uuid.uuid4(), "BASE", 1, {}) for _ in range(8)])
        heads = store.heads()
        shards = sorted(s for s, h in heads.items() if h)
        job = JobStore(store).create("replay", {"columns": ["BASE"]}, [StepRecord(name="s", params={
            "shards": shards, "start": [0] * len(shards), "end": [heads[s] for s in shards],
            "cells": [heads[s] for s in shards]})])
        store.claim_offsets(f"replay.{job.id}", "runner", shards)
        store.put_cells([(uuid.uuid4(), "BASE", 1, {}) for _ in range(5)])  # after its ends: not its own
        store.put_cells([(uuid.uuid4(), "OTHER", 1, {}) for _ in range(5)])
        assert StoreOffsets(store).positions(f"replay.{job.id}").lag == 8


def test_a_reset_that_moves_nothing_leaves_the_holder_its_shards(sqlite_url: str,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Taking a shard under the reset owner makes its running holder claim it back (a pause): a position that does
    not move is left alone; the reset is still recorded."""
    with logstore.open(sqlite_url, shards=SHARDS) as store:
        store.put_cells([(uuid.uuid4(), "BASE", 1, {}) for _ in range(12)])
        store.claim_offsets("app.steady", "proc-1")
        heads = store.heads()
        store.commit_offsets("app.steady", "proc-1", {s: (h, {}) for s, h in heads.items() if s % 2})
        code, out, err = cli(capsys, "--store", sqlite_url, "offsets", "reset", "app.steady", "--to", "end",
                             "--execute", "--json")
        assert code == 0, err
        moved = {int(c["key"]) for c in json.loads(out)["changes"] if c["from"] != c["to"]}
        assert moved == {s for s in range(SHARDS) if not s % 2}  # never committed: to the head
        owners = {s: r.owner for s, r in store.read_offsets("app.steady").items()}
        assert all(owners[s] == "proc-1" for s in range(SHARDS) if s not in moved)
        assert all(owners[s] != "proc-1" for s in moved)
        assert len(ResetHistory(store).resets("app.steady")) == 1
