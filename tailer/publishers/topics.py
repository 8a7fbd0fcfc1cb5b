"""Cells as messages on topics: the worker's :class:`~tailer.interfaces.Sink` over a message
:class:`~tailer.interfaces.Publisher` (Kafka, or the standalone directory).

A cell goes to the topic ``<prefix>.<column>``, partition ``shard mod P``, encoded as
:mod:`tailer.messages` describes; a dead-letter record to ``<prefix>-deadletter`` on the same
partition, so a shard's cells and dead letters keep one order.

A topic that exists with another partition count is refused (TopicPartitionsError, which says how to fix
it): logged once, then raised again from memory to each shard that asks, and asked of the broker again
every ``RECHECK_SECONDS``, so a fixed topic is published within that time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

from logstore.cell import AnyCell
from tailer.config import TailerConfig
from tailer.errors import PublishError, TopicPartitionsError
from tailer.interfaces import Publisher, Sink
from tailer.messages import Message, deadletter_message

logger = logging.getLogger(__name__)
RECHECK_SECONDS = 10.0


class TopicSink(Sink):
    """Delivers cells through ``publisher`` to the topics that ``config`` names."""

    # A read of many shards goes over as one delivery batch: a partition's pages share its record batch, so the
    # worker waits on a few futures a read rather than paying a delivery and a callback per page of a few cells.
    delivers_batches = True

    def __init__(self, publisher: Publisher, config: TailerConfig) -> None:
        self.publisher = publisher
        self.config = config
        self._topics: set[str] = set()
        self._refused: dict[str, tuple[TopicPartitionsError, float]] = {}  # topic -> (refusal, when to ask again)
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
        if topic in self._topics:
            return
        refused = self._refused.get(topic)
        now = time.monotonic()
        if refused is not None and now < refused[1]:
            # Every shard with a cell of the column asks: the broker is asked once a while. (A fresh traceback:
            # raising one instance again would add to the one it has.)
            raise refused[0].with_traceback(None)
        if refused is not None:
            self._refused[topic] = (refused[0], now + RECHECK_SECONDS)  # the shards asking meanwhile get it too
        try:
            await self.publisher.prepare_topic(topic, self.config.partitions, self.config.replication_factor)
        except TopicPartitionsError as exc:
            exc.logged = True
            if refused is None or str(refused[0]) != str(exc):
                logger.error("%s The topic is checked again every %gs.", exc, RECHECK_SECONDS)
            self._refused[topic] = (exc, time.monotonic() + RECHECK_SECONDS)
            raise
        if refused is not None:
            del self._refused[topic]
            logger.info("topic %s has %d partitions now: its column is published", topic, self.config.partitions)
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
