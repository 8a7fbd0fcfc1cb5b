"""The Sink contract (tests/contracts/sink_contract.py) run against every sink the worker delivers to: topics
through the directory publisher, topics on the real Kafka (read back with kcat), and direct mode's handlers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import logstore
from indexer import App
from indexer.runtime.direct import HandlerSink
from indexer.runtime.dlq_store import DeadLetterStore
from tailer.config import KafkaOptions, TailerConfig
from tailer.interfaces import Sink
from tailer.publishers.directory import DirectoryPublisher, read_topic
from tailer.publishers.kafka import KafkaPublisher
from tailer.publishers.topics import TopicSink
from tests.contracts.sink_contract import SHARD, SinkContract
from tests.harness.kafka_support import kcat_read
from tests.harness.shared_servers import KAFKA

PARTITIONS = 4


def _order(cells: list[int], deadletters: list[int]) -> list[tuple[str, int]]:
    """One list in added_id order: topics keep each topic's order, not one across topics (the contract's
    order within each kind is checked by its position in this list all the same)."""
    return sorted([("cell", i) for i in cells] + [("deadletter", i) for i in deadletters], key=lambda e: e[1])


class TestDirectoryTopics(SinkContract):
    @pytest.fixture
    def sink(self, tmp_path: Path) -> Iterator[Sink]:
        self.root = tmp_path / "topics"
        config = TailerConfig(name="contract", partitions=PARTITIONS)
        yield TopicSink(DirectoryPublisher(self.root, linger=0.001), config)

    def received(self, sink: Sink) -> list[tuple[str, int]]:
        def ids(topic: str) -> list[int]:
            return [int(r["headers"]["added_id"]) for p, r in read_topic(self.root, topic)
                    if p == SHARD % PARTITIONS]
        cells, deadletters = ids("cells.BASE"), ids("cells-deadletter")
        assert cells == sorted(cells) and deadletters == sorted(deadletters)
        return _order(cells, deadletters)


class TestKafkaTopics(SinkContract):
    @pytest.fixture
    def sink(self, topic_prefix: str) -> Iterator[Sink]:
        self.prefix = topic_prefix
        config = TailerConfig(name=f"{topic_prefix}-contract", topic_prefix=topic_prefix, partitions=PARTITIONS)
        yield TopicSink(KafkaPublisher(KafkaOptions(brokers=KAFKA)), config)

    def received(self, sink: Sink) -> list[tuple[str, int]]:
        def ids(topic: str) -> list[int]:
            return [int(m.headers["added_id"]) for m in kcat_read(KAFKA, topic) if m.partition == SHARD % PARTITIONS]
        cells, deadletters = ids(f"{self.prefix}.BASE"), ids(f"{self.prefix}-deadletter")
        assert cells == sorted(cells) and deadletters == sorted(deadletters)
        return _order(cells, deadletters)


class TestHandlers(SinkContract):
    """Direct mode: a shard's deliveries run in the order handed over, so cells and dead letters keep one order."""

    @pytest.fixture
    def sink(self, sqlite_url: str) -> Iterator[Sink]:
        with logstore.open(sqlite_url, shards=8) as store:
            self.app = App("contract", store=store)
            self.arrived: list[tuple[str, int]] = []

            def handler(cell: logstore.Cell) -> None:
                self.arrived.append(("cell", cell.added_id))
            self.app.trigger("BASE")(handler)

            async def deadlettered(entry: Any) -> None:
                self.arrived.append(("deadletter", entry.cell["added_id"]))
            self.app.processor.on_deadletter = deadlettered
            self.store = store
            yield HandlerSink(self.app.processor, batch_size=3)
            self.app.close()

    def received(self, sink: Sink) -> list[tuple[str, int]]:
        [entry] = DeadLetterStore(self.store, "contract").entries() or [None]
        assert entry is None or entry.body is None  # an undecodable cell's entry holds no body
        return self.arrived
