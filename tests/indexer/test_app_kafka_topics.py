"""Kafka mode never creates the tailer's topics: against a private broker that creates any topic a client names
(auto.create.topics.enable=true) with 3 partitions, where the tailer makes 4. The shared broker of `make test`
creates none, which would hide the side effect."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiokafka.admin import AIOKafkaAdminClient

import logstore
from indexer import App
from indexer.runtime.kafka import group_positions
from tests.harness.app_thread import app_in_thread
from tests.harness.kafka_support import publish
from tests.harness.services import PrivateKafka

P = 4  # the tailer's partitions; the broker's num.partitions is 3


@pytest.fixture(scope="module")
def creating_kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The bootstrap address of a broker that auto-creates topics with 3 partitions."""
    with PrivateKafka(tmp_path_factory.mktemp("kafka"),
                      properties={"auto.create.topics.enable": "true", "num.partitions": "3"}) as kafka:
        yield kafka.bootstrap


def partitions_of(brokers: str, prefix: str) -> dict[str, int]:
    """The topics named ``<prefix>...`` and their partition counts (asking for every topic, so none is created)."""
    async def run() -> dict[str, int]:
        admin = AIOKafkaAdminClient(bootstrap_servers=brokers)
        await admin.start()
        try:
            return {d["topic"]: len(d["partitions"]) for d in await admin.describe_topics()
                    if d["topic"].startswith(prefix)}
        finally:
            await admin.close()
    return asyncio.run(run())


def test_an_app_started_before_the_tailer_creates_no_topic_and_consumes_them_once_the_tailer_has(
        creating_kafka: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The app subscribes before any cell was published; its consumer group, and ``status``'s positions of it,
    name no topic the broker would create with its own partition count (the tailer then refused to publish
    the column). The app waits, says so once, and consumes the topics once the tailer created them."""
    prefix = f"k{uuid.uuid4().hex[:8]}"
    handled: list[logstore.Cell] = []
    with logstore.open(f"sqlite:///{tmp_path / 'store'}", shards=8) as store:
        cells = store.put_cells([(uuid.uuid4(), "BASE", 1, {"n": n}) for n in range(40)])
        app = App(f"{prefix}-app", store=store, brokers=creating_kafka, topic_prefix=prefix)
        app.trigger("BASE")(handled.append)
        caplog.set_level("INFO", logger="indexer.runtime.kafka")
        try:
            with app_in_thread(app, "early-app", join=60) as early:
                time.sleep(8)  # the consumer's metadata is refreshed every 3 s
                assert not early.failed, early.failed
                assert asyncio.run(group_positions(creating_kafka, app.name, [f"{prefix}.BASE"])) == []
                assert partitions_of(creating_kafka, prefix) == {f"{prefix}-app.dlq": 1}  # the app's own, on purpose
                waiting = [r.getMessage() for r in caplog.records if "does not exist yet" in r.getMessage()]
                assert sorted(waiting) == sorted(
                    f"app.{prefix}-app: topic {topic} does not exist yet; waiting for the tailer to create it (as it "
                    "publishes the column's first cell)" for topic in (f"{prefix}.BASE", f"{prefix}-deadletter"))

                publish(store, prefix, partitions=P, brokers=creating_kafka)
                deadline = time.monotonic() + 60
                while len(handled) < len(cells):
                    assert not early.failed, early.failed
                    assert time.monotonic() < deadline, f"{len(handled)} of {len(cells)} cells handled"
                    time.sleep(0.1)
        finally:
            app.close()
        assert not early.failed, early.failed
        assert sorted(c.body["n"] for c in handled) == list(range(len(cells)))
        assert partitions_of(creating_kafka, prefix) == {f"{prefix}.BASE": P, f"{prefix}-deadletter": P,
                                                         f"{prefix}-app.dlq": 1}
