"""The tailer against the real Kafka and ZooKeeper of `make test`, read back with kcat and aiokafka."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from kazoo.client import KazooClient
from prometheus_client import generate_latest

import logstore
from cellstream.cli.main import main
from tailer.config import KafkaOptions, TailerConfig
from tailer.coordinators.zookeeper import ZooKeeperCoordinator, tailer_path
from tailer.errors import FencedError, PublishError
from tailer.interfaces import Offset
from tailer.publishers.kafka import KafkaPublisher
from tailer.worker import Tailer
from tests.harness.kafka_support import Msg, aiokafka_read, assert_shard_order, cell_ids, kcat_read, wait_for
from tests.harness.shared_servers import KAFKA

SHARDS = 16
P = 4


def tailer(store: logstore.Store, zk: str, prefix: str, name: str = "tl", brokers: str = KAFKA,
           **options: Any) -> Tailer:
    config = TailerConfig(name=name, topic_prefix=prefix, partitions=P, session_timeout=options.pop("session", 6),
                          **options)
    coordinator = ZooKeeperCoordinator(zk, name, store.shard_count, session_timeout=config.session_timeout)
    return Tailer(store, config, coordinator, KafkaPublisher(KafkaOptions(brokers=brokers)))


async def until(check: Callable[[], bool], timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def delivered(topic: str, expected: set[tuple[int, int]]) -> list[Msg]:
    """Wait (off the event loop, so the tailer keeps running) until kcat sees every expected cell."""
    return await asyncio.to_thread(wait_for, KAFKA, topic, expected)


def zk_offsets(zk: str, name: str) -> dict[int, dict[str, Any]]:
    hosts, root = tailer_path(zk, name)
    client = KazooClient(hosts=hosts)
    client.start(timeout=15)
    try:
        return {int(s): json.loads(client.get(f"{root}/offsets/{s}")[0])
                for s in client.get_children(f"{root}/offsets")}
    finally:
        client.stop()
        client.close()


def put(store: logstore.Store, n: int, column: str = "BASE") -> list[logstore.Cell]:
    return store.put_cells([(uuid.uuid4(), column, 1, {"i": i, "city": "Aarhus"}) for i in range(n)])


@pytest.fixture
def store(mysql_database: str) -> Any:
    with logstore.open(mysql_database, shards=SHARDS) as s:
        yield s


def test_two_workers_share_the_shards_and_publish_every_cell_as_documented(
    store: logstore.Store, zk_chroot: str, topic_prefix: str
) -> None:
    a, b = tailer(store, zk_chroot, topic_prefix), tailer(store, zk_chroot, topic_prefix)
    by_id: dict[tuple[int, int], logstore.Cell] = {}

    async def scenario() -> None:
        async with a, b:
            await until(lambda: len(a.owned) == len(b.owned) == SHARDS // 2, what="a balanced assignment")
            assert not a.owned & b.owned
            # Written once the shards are shared, so that every cell is delivered exactly once: a worker
            # handing shards over gives up its queued batches of their partitions, and its own shards in
            # them resend from their last acknowledgement (at least once: duplicates are allowed then).
            cells = await asyncio.to_thread(lambda: put(store, 300) + put(store, 60, "FARE"))
            by_id.update({(c.shard, c.added_id): c for c in cells})
            base = await delivered(f"{topic_prefix}.BASE", {k for k, c in by_id.items() if c.column == "BASE"})
            fare = await delivered(f"{topic_prefix}.FARE", {k for k, c in by_id.items() if c.column == "FARE"})
            for m in base + fare:
                cell = by_id[(int(m.headers["shard"]), int(m.headers["added_id"]))]
                assert m.key == str(cell.row_key)
                assert m.value == cell.to_json()
                assert m.headers == {"shard": str(cell.shard), "added_id": str(cell.added_id),
                                     "column": cell.column, "ref_key": "1",
                                     "created_at": cell.created_at.isoformat(), "content-type": "application/json"}
            assert sorted(cell_ids(base)) == sorted(k for k, c in by_id.items() if c.column == "BASE")
            assert_shard_order(base, P)
            read = await aiokafka_read(KAFKA, f"{topic_prefix}.FARE", P, 60)
            assert sorted(cell_ids(read)) == sorted(cell_ids(fare))
            await until(lambda: all(st[2] == store.head(s) for t in (a, b) for s, st in t.positions().items()),
                        what="offsets committed")
            assert "cellstream_tailer_published_total" in generate_latest(a.metrics.registry).decode()
            # A graceful stop hands b's shards to a without repeating a cell.
            await b.stop()
            await until(lambda: len(a.owned) == SHARDS, what="a taking over b's shards")
            more = put(store, 100)
            await delivered(f"{topic_prefix}.BASE", {(c.shard, c.added_id) for c in more})
    asyncio.run(scenario())
    final = kcat_read(KAFKA, f"{topic_prefix}.BASE")
    assert len(final) == len(set(cell_ids(final))) == 400
    offsets = zk_offsets(zk_chroot, "tl")
    assert all(offsets[s]["location"] == store.head(s) for s in range(SHARDS) if store.head(s))


def test_a_worker_that_lost_its_session_is_fenced_and_offsets_never_move_back(
    store: logstore.Store, zk_chroot: str
) -> None:
    a = ZooKeeperCoordinator(zk_chroot, "fence", SHARDS, session_timeout=4)
    b = ZooKeeperCoordinator(zk_chroot, "fence", SHARDS, session_timeout=4)
    a.start(lambda: None)
    try:
        deadline = time.monotonic() + 30
        while len(a.assignment()[2]) < SHARDS:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        claim, other = a.claim(3, lambda: 0), a.claim(4, lambda: 0)
        assert claim is not None and claim.location == 0 and other is not None
        [committed] = a.commit({3: (claim, Offset(40))}).values()
        assert not isinstance(committed, BaseException)
        b.start(lambda: None)
        while b.member is None:
            time.sleep(0.05)
        assert b.claim(3, lambda: 0) is None, "a claim must not be taken while its holder lives"
        # Expire a's session the way ZooKeeper does when a worker is partitioned away.
        generation = a.assignment()[0]
        session_id, password = a._client.client_id
        thief = KazooClient(hosts=zk_chroot.split("/")[0], client_id=(session_id, password))
        thief.start(timeout=15)
        thief.stop()
        thief.close()
        deadline = time.monotonic() + 30
        taken = None
        while taken is None:
            assert time.monotonic() < deadline, "b never got the shard after a's session expired"
            taken = b.claim(3, lambda: 0)
            time.sleep(0.1)
        assert taken.location == 40
        deadline = time.monotonic() + 30
        while not (a.assignment()[0] > generation and a.lease_valid()):  # a re-joins with a new session
            assert time.monotonic() < deadline
            time.sleep(0.05)
        # One transaction carries both; shard 3's refusal must neither lose shard 4's offset nor let 3's through.
        outcome = a.commit({3: (committed, Offset(99)), 4: (other, Offset(7))})
        assert isinstance(outcome[3], FencedError) and not isinstance(outcome[4], BaseException)
        assert zk_offsets(zk_chroot, "fence")[3]["location"] == 40
        assert zk_offsets(zk_chroot, "fence")[4]["location"] == 7
    finally:
        a.stop()
        b.stop()


def test_poison_cells_are_dead_lettered_by_name_and_nothing_is_skipped(
    store: logstore.Store, mysql_database: str, zk_chroot: str, topic_prefix: str
) -> None:
    import pymysql

    key = uuid.uuid4()
    good1 = store.put_cell(key, "BASE", 1, {"n": 1})
    huge = store.put_cell(key, "BASE", 2, {"blob": os.urandom(700_000).hex()})  # ~1.4 MB: over the broker's limit
    broken = store.put_cell(key, "BASE", 3, {"n": 3})
    good2 = store.put_cell(key, "BASE", 4, {"n": 4})
    url = logstore.config.parse_node_url(mysql_database)
    conn = pymysql.connect(host=url.host, port=url.port, user=url.user, password=url.password, database=url.database,
                           autocommit=True)
    with conn.cursor() as cur:
        cur.execute("UPDATE cells SET body = x'7f00' WHERE shard = %s AND added_id = %s",
                    (broken.shard, broken.added_id))
    conn.close()
    t = tailer(store, zk_chroot, topic_prefix, name="poison")

    async def scenario() -> None:
        async with t:
            await delivered(f"{topic_prefix}.BASE", {(good1.shard, good1.added_id), (good2.shard, good2.added_id)})
            dead = await delivered(f"{topic_prefix}-deadletter",
                            {(huge.shard, huge.added_id), (broken.shard, broken.added_id)})
            by_id = {int(m.headers["added_id"]): m.value for m in dead}
            assert by_id[huge.added_id]["stage"] == "publish"
            assert by_id[huge.added_id]["cell"]["row_key"] == str(key)
            assert "too large" in by_id[huge.added_id]["error"]["message"].lower() or \
                "MessageSizeTooLarge" in by_id[huge.added_id]["error"]["message"]
            assert by_id[broken.added_id]["stage"] == "decode"
            assert by_id[broken.added_id]["cell"]["ref_key"] == 3
            await until(lambda: t.positions()[good1.shard][2] == good2.added_id, what="the commit past the poison")
    asyncio.run(scenario())
    published = [m.value["ref_key"] for m in kcat_read(KAFKA, f"{topic_prefix}.BASE")]
    assert published == [1, 4]
    assert zk_offsets(zk_chroot, "poison")[good1.shard]["deadlettered"] == 2


def test_a_message_the_broker_refuses_after_sending_is_dead_lettered_alone(
    store: logstore.Store, zk_chroot: str, topic_prefix: str
) -> None:
    """The topic allows smaller messages than the producer: the broker, not the client, refuses."""
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    async def make_topic() -> None:
        admin = AIOKafkaAdminClient(bootstrap_servers=KAFKA)
        await admin.start()
        try:
            await admin.create_topics([NewTopic(f"{topic_prefix}.BASE", P, 1,
                                                topic_configs={"max.message.bytes": "20000"})])
        finally:
            await admin.close()
    asyncio.run(make_topic())
    key = uuid.uuid4()
    cells = [store.put_cell(key, "BASE", ref, {"blob": os.urandom(15_000 if ref == 3 else 10).hex()})
             for ref in range(1, 6)]
    t = tailer(store, zk_chroot, topic_prefix, name="refused")

    async def scenario() -> None:
        async with t:
            await delivered(f"{topic_prefix}-deadletter", {(cells[2].shard, cells[2].added_id)})
            await delivered(f"{topic_prefix}.BASE", {(c.shard, c.added_id) for c in cells if c is not cells[2]})
    asyncio.run(scenario())
    messages = kcat_read(KAFKA, f"{topic_prefix}.BASE")
    assert_shard_order(messages, P)
    assert {m.value["ref_key"] for m in messages} == {1, 2, 4, 5}


def test_tail_status_shows_workers_offsets_and_lag(
    store: logstore.Store, mysql_database: str, zk_chroot: str, topic_prefix: str,
    capsys: pytest.CaptureFixture[str]
) -> None:
    put(store, 80)
    t = tailer(store, zk_chroot, topic_prefix, name="shown")

    async def scenario() -> None:
        async with t:
            await until(lambda: all(st[2] == store.head(s) for s, st in t.positions().items())
                        and len(t.owned) == SHARDS, what="everything committed")
            assert main(["tail", "status", "shown", "--store", mysql_database, "--zookeeper", zk_chroot,
                         "--json"]) == 0
    asyncio.run(scenario())
    report = json.loads(capsys.readouterr().out)
    assert len(report["workers"]) == 1 and report["workers"][0]["leader"]
    assert sum(r["lag_cells"] for r in report["shards"]) == 0
    assert all(r["location"] == r["head"] for r in report["shards"] if r["head"])
    put(store, 5)
    assert main(["tail", "status", "shown", "--store", mysql_database, "--zookeeper", zk_chroot]) == 0
    text = capsys.readouterr().out
    assert "5 cells behind" in text
    assert main(["tail", "status", "nobody", "--store", mysql_database, "--zookeeper", zk_chroot]) == 4


def test_a_partition_batch_refused_by_the_broker_fails_the_batches_queued_behind_it_unsent(
    topic_prefix: str
) -> None:
    """Cells of a partition leave in record batches one at a time; the broker refuses the first (the
    topic allows 600-byte batches), so the one queued behind it fails too and never reaches the topic:
    nothing added later is delivered before the refused cells are sent again."""
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    from tailer.messages import Message

    topic = f"{topic_prefix}.BASE"

    async def scenario() -> tuple[list[BaseException | None], list[Msg]]:
        admin = AIOKafkaAdminClient(bootstrap_servers=KAFKA)
        await admin.start()
        try:
            await admin.create_topics([NewTopic(topic, 1, 1, topic_configs={"max.message.bytes": "600"})])
        finally:
            await admin.close()
        messages = [Message(f"k{i}".encode(), os.urandom(150).hex().encode(), [("n", str(i).encode())])
                    for i in range(4)]  # 300-byte values: three fill a 1,024-byte batch, the fourth opens the next
        publisher = KafkaPublisher(KafkaOptions(brokers=KAFKA, max_batch_size=1024))
        async with publisher:
            await publisher.prepare_topic(topic, 1, 1)
            sent = await publisher.send_many(topic, 0, messages)
            assert [count for _, count in sent] == [3, 1]
            results = await asyncio.gather(*(future for future, _ in sent), return_exceptions=True)
        return [r if isinstance(r, BaseException) else None for r in results], kcat_read(KAFKA, topic)

    (first, second), on_topic = asyncio.run(scenario())
    assert first is not None and not KafkaPublisher().translate(first).retriable  # refused by the broker
    assert isinstance(second, PublishError) and second.retriable and "an earlier batch" in str(second)
    assert on_topic == []  # the fourth message alone (about 370 bytes) would have been accepted


def test_a_partition_batch_leaves_at_once_whatever_the_producer_linger(topic_prefix: str) -> None:
    """Cells gather in the partition's open batch while one is in flight, so aiokafka's linger would
    only delay them: a batch handed over leaves at once even with a producer linger of 5 s."""
    from tailer.messages import Message

    topic = f"{topic_prefix}.BASE"

    async def scenario() -> float:
        publisher = KafkaPublisher(KafkaOptions(brokers=KAFKA, linger_ms=5000))
        async with publisher:
            await publisher.prepare_topic(topic, 1, 1)
            started = time.monotonic()
            sent = await publisher.send_many(topic, 0, [Message(b"k", b"{}", [])])
            await asyncio.gather(*(future for future, _ in sent))
            return time.monotonic() - started

    assert asyncio.run(scenario()) < 2.5  # one round trip to the local broker; lingering takes 5 s


def test_a_topic_with_another_partition_count_is_refused_once_with_its_fix_and_published_once_fixed(
    store: logstore.Store, zk_chroot: str, topic_prefix: str, caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """A column's topic created before the tailer with another partition count (what a broker with
    auto.create.topics.enable does when a consumer names it first): every shard with a cell of the column is
    refused, again and again, but the sink logs the refusal once for the column, with the commands that fix
    the topic, and asks the broker again only every RECHECK_SECONDS; once fixed, the column is published."""
    from aiokafka.admin import AIOKafkaAdminClient, NewPartitions, NewTopic

    from tailer.publishers import topics

    monkeypatch.setattr(topics, "RECHECK_SECONDS", 1.0)
    caplog.set_level(logging.INFO, logger="tailer.publishers.topics")
    caplog.set_level(logging.INFO, logger="tailer.worker")
    topic = f"{topic_prefix}.BASE"

    async def admin(change: Callable[[AIOKafkaAdminClient], Any]) -> None:
        client = AIOKafkaAdminClient(bootstrap_servers=KAFKA)
        await client.start()
        try:
            await change(client)
        finally:
            await client.close()
    asyncio.run(admin(lambda a: a.create_topics([NewTopic(topic, 3, 1)])))
    checks: list[str] = []
    prepare_topic = KafkaPublisher.prepare_topic

    async def counted(self: KafkaPublisher, name: str, partitions: int, replication_factor: int) -> None:
        checks.append(name)
        await prepare_topic(self, name, partitions, replication_factor)
    monkeypatch.setattr(KafkaPublisher, "prepare_topic", counted)
    cells = put(store, 200)  # in every shard
    t = tailer(store, zk_chroot, topic_prefix, name="partitions")

    def failures() -> float:
        found = t.metrics.registry.get_sample_value("cellstream_tailer_delivery_failures_total",
                                                    {"tailer": "partitions"})
        return found or 0.0

    async def scenario() -> None:
        started = time.monotonic()
        async with t:
            await until(lambda: failures() >= 3 * SHARDS, what="the shards' attempts")
            elapsed = time.monotonic() - started
            refusals = [r for r in caplog.records if r.name == "tailer.publishers.topics"]
            assert [r.levelno for r in refusals] == [logging.ERROR]
            retries = [r for r in caplog.records if r.name == "tailer.worker" and r.levelno >= logging.WARNING]
            assert retries == []  # not a line per shard and attempt: the refusal above says it for the topic
            message = refusals[0].getMessage()
            assert f"topic {topic} has 3 partitions but the tailer maps shards onto {P} (shard mod {P})" in message
            assert f"kafka-topics.sh --bootstrap-server {KAFKA} --alter --topic {topic} --partitions {P}" in message
            assert "auto.create.topics.enable" in message
            assert checks.count(topic) <= 2 + elapsed / topics.RECHECK_SECONDS  # not once an attempt
            await admin(lambda a: a.create_partitions({topic: NewPartitions(P)}))
            await delivered(topic, {(c.shard, c.added_id) for c in cells})
    asyncio.run(scenario())
    assert_shard_order(kcat_read(KAFKA, topic), P)
    assert [r.getMessage() for r in caplog.records if r.name == "tailer.publishers.topics"][1:] == [
        f"topic {topic} has {P} partitions now: its column is published"]
