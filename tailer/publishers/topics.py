"""Cells as messages on topics: the worker's :class:`~tailer.interfaces.Sink` over a message
:class:`~tailer.interfaces.Publisher` (Kafka, or the standalone directory).

A cell goes to the topic ``<prefix>.<column>``, partition ``shard mod P``, encoded as
:mod:`tailer.messages` describes; a dead-letter record to ``<prefix>-deadletter`` on the same
partition, so a shard's cells and dead letters keep one order.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from typing import Any

from logstore.cell import AnyCell
from tailer.config import TailerConfig
from tailer.errors import PublishError
from tailer.interfaces import Publisher, Sink
from tailer.messages import Message, deadletter_message


class TopicSink(Sink):
    """Delivers cells through ``publisher`` to the topics that ``config`` names."""

    # A read of many shards goes over as one delivery: at 4096 shards its pages hold a dozen cells each, and
    # the worker's path for each page (a delivery of its own, a callback on its future) cost about what its
    # cells did. A partition's pages share its record batch, so the worker waits on a few futures a read.
    delivers_groups = True

    def __init__(self, publisher: Publisher, config: TailerConfig) -> None:
        self.publisher = publisher
        self.config = config
        self._topics: set[str] = set()
        self.packed_bodies = config.value_format == "msgpack"  # the stored MessagePack is the message's body

    async def start(self) -> None:
        await self.publisher.start()
        await self._prepare_topic(self.config.deadletter_topic)
        for column in self.config.columns or ():
            await self._prepare_topic(self.config.topic(column))

    async def stop(self) -> None:
        await self.publisher.stop()

    async def prepare(self, column: str) -> None:
        await self._prepare_topic(self.config.topic(column))

    async def _prepare_topic(self, topic: str) -> None:
        if topic not in self._topics:
            await self.publisher.prepare_topic(topic, self.config.partitions, self.config.replication_factor)
            self._topics.add(topic)

    def destination(self, column: str) -> str:
        return self.config.topic(column)

    def accept(self, cell: AnyCell) -> Message:
        message = self.publisher.encode(cell, self.config.value_format)
        refused = self.publisher.refuses(message)
        if refused is not None:
            raise refused
        return message

    async def deliver(self, shard: int, column: str, items: Sequence[Any]) -> list[tuple[asyncio.Future[Any], int]]:
        return await self.publisher.send_many(self.config.topic(column), shard % self.config.partitions, items)

    async def deadletter(self, shard: int, record: dict[str, Any]) -> asyncio.Future[Any]:
        message = deadletter_message(record)
        return await self.publisher.send(self.config.deadletter_topic, shard % self.config.partitions,
                                         message.key, message.value, message.headers)

    def abandon(self, shards: Iterable[int]) -> None:
        # A partition holds the messages of every shard that maps to it: theirs are given up too, and those
        # shards resend them after the failure, as after any failed delivery.
        for partition in {shard % self.config.partitions for shard in shards}:
            self.publisher.abandon(partition)

    async def before_commit(self) -> None:
        await self.publisher.before_commit()

    def translate(self, exc: BaseException) -> PublishError:
        return self.publisher.translate(exc)

    async def after_failure(self, exc: BaseException, future: asyncio.Future[Any]) -> None:
        await self.publisher.after_failure(exc, future)
