"""Publishing to Kafka with aiokafka: idempotent, acks=all, per-partition order.

aiokafka errors are translated here and nowhere else: a message the broker can
never take (larger than allowed) becomes CellRejectedError, anything else a
PublishError the worker answers by resending from the last acknowledged cell.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Sequence
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import (
    KafkaError,
    MessageSizeTooLargeError,
    OutOfOrderSequenceNumber,
    ProducerClosed,
    ProducerFenced,
    RecordTooLargeError,
)
from aiokafka.producer.message_accumulator import BatchBuilder
from aiokafka.record.default_records import DefaultRecordBatchBuilder

from tailer.config import KafkaOptions
from tailer.errors import ConfigurationError, PublishError, TopicPartitionsError
from tailer.interfaces import Publisher
from tailer.messages import Message
from tailer.publishers.batching import PartitionBatcher
from tailer.security import diagnose

logger = logging.getLogger(__name__)
_TOPIC_EXISTS = 36
# More than a record batch's header and a record's length varints ever add to key, value and headers.
_RECORD_OVERHEAD = 1024
REJECTED = (MessageSizeTooLargeError, RecordTooLargeError)
# Errors after which the idempotent producer's sequence numbers are out of step with the
# broker (a refused batch used numbers the broker never accepted), so every later batch
# of that partition would fail with OutOfOrderSequenceNumber: start a new producer.
_RESTART = (OutOfOrderSequenceNumber, ProducerFenced, ProducerClosed, *REJECTED)


def _translate(exc: BaseException) -> PublishError:
    """The tailer's error for an aiokafka failure (already-translated errors pass through)."""
    if isinstance(exc, PublishError):
        return exc
    if isinstance(exc, REJECTED):
        return PublishError(f"the broker refuses the message: {type(exc).__name__} {exc}", retriable=False)
    return PublishError(f"Kafka delivery failed: {type(exc).__name__} {exc}".rstrip(), retriable=True)


class KafkaPublisher(Publisher):
    """One idempotent producer shared by every shard of the worker."""

    def __init__(self, options: KafkaOptions | None = None) -> None:
        self.options = options or KafkaOptions()
        self._producer: AIOKafkaProducer | None = None
        self._topics: dict[str, int] = {}
        self._mismatched: set[str] = set()  # topics found with another partition count, checked again when asked
        self._started = False
        self._restart_lock = asyncio.Lock()
        self._generation = 0
        self._born: weakref.WeakKeyDictionary[asyncio.Future[Any], int] = weakref.WeakKeyDictionary()
        self._batches: PartitionBatcher | None = None

    def _new_producer(self) -> AIOKafkaProducer:
        o = self.options
        return AIOKafkaProducer(
            bootstrap_servers=o.brokers, client_id=o.client_id, acks="all", enable_idempotence=True,
            linger_ms=o.linger_ms, max_batch_size=o.max_batch_size, max_request_size=o.max_request_size,
            request_timeout_ms=o.request_timeout_ms,
            compression_type=None if o.compression == "none" else o.compression, **o.security.client_options(),
        )

    async def start(self) -> None:
        if self._started:
            return
        self._producer = self._new_producer()
        try:
            await self._producer.start()
        except KafkaError as exc:
            await self._producer.stop()
            self._producer = None
            cause = await diagnose(self.options.brokers, self.options.security)
            if cause is not None:
                raise cause from None
            raise PublishError(f"cannot reach Kafka at {self.options.brokers}: {exc}", retriable=True) from None
        self._batches = PartitionBatcher(self._create_batch, self._submit)
        self._batches.start()
        self._started = True

    async def stop(self) -> None:
        if not self._started:
            return
        self._started = False
        if self._batches is not None:  # what the worker's drain left unsent is sent again by the next worker
            await self._batches.stop(PublishError("the Kafka publisher stopped", retriable=True))
            self._batches = None
        if self._producer is not None:
            await self._producer.stop()  # flushes what was sent
            self._producer = None

    async def __aenter__(self) -> KafkaPublisher:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def restart(self, generation: int | None = None) -> None:
        """A fresh producer (new producer id, sequences from 0) after a fatal producer error.

        With ``generation``, only if the producer is still that one (many failed futures
        of one broken producer restart it once).
        """
        async with self._restart_lock:
            if generation is not None and generation != self._generation:
                return
            self._generation += 1
            old, self._producer = self._producer, None
            if old is not None:
                try:
                    await old.stop()
                except KafkaError as exc:
                    logger.debug("stopping the old producer: %s", exc)
            producer = self._new_producer()
            await producer.start()
            self._producer = producer
            logger.warning("Kafka producer restarted")

    async def prepare_topic(self, topic: str, partitions: int, replication_factor: int) -> None:
        if topic in self._topics:
            return
        admin = AIOKafkaAdminClient(bootstrap_servers=self.options.brokers,
                                    request_timeout_ms=self.options.request_timeout_ms,
                                    **self.options.security.client_options())
        try:
            await admin.start()
            response = await admin.create_topics([NewTopic(topic, partitions, replication_factor)])
            for name, code, *detail in response.topic_errors:
                if code not in (0, _TOPIC_EXISTS):
                    raise ConfigurationError(f"cannot create topic {name}: error {code} {detail}")
        except KafkaError as exc:
            raise PublishError(f"cannot create topic {topic}: {exc}", retriable=True) from None
        finally:
            await admin.close()
        assert self._producer is not None
        if topic in self._mismatched:  # the producer's metadata may predate the operator's fix
            await self._producer.client.force_metadata_update()
        found = len(await self._producer.partitions_for(topic))
        if found != partitions:
            self._mismatched.add(topic)
            raise TopicPartitionsError(topic, found, partitions, self._fix(topic, found, partitions))
        self._mismatched.discard(topic)
        self._topics[topic] = partitions

    def _fix(self, topic: str, found: int, needed: int) -> str:
        """How an operator makes ``topic`` fit: the commands, for the refusal's message."""
        tool = f"kafka-topics.sh --bootstrap-server {self.options.brokers.split(',')[0]}"
        if found < needed:
            how = (f"Once what it holds is consumed (an auto-created topic is empty), add partitions: {tool} --alter "
                   f"--topic {topic} --partitions {needed}; or delete it ({tool} --delete --topic {topic}) and the "
                   f"tailer creates it with {needed}.")
        else:
            how = (f"Partitions cannot be removed: once what it holds is consumed, delete it ({tool} --delete "
                   f"--topic {topic}) and the tailer creates it with {needed}; or run the tailer with --partitions "
                   f"{found} if every topic of its prefix has {found}.")
        return (f"{how} A broker with auto.create.topics.enable=true creates a topic with its num.partitions when a "
                "client names it before the tailer created it; set it to false.")

    async def send(
        self, topic: str, partition: int, key: bytes, value: bytes, headers: list[tuple[str, bytes]]
    ) -> asyncio.Future[Any]:
        # The producer and its generation as the call starts: a restart while it waits (for metadata, or
        # room in a batch) must neither label the old producer's future as the new one's nor restart the new one.
        producer, generation = self._producer, self._generation
        if producer is None:
            raise PublishError("the Kafka publisher is not started", retriable=True)
        try:
            inner = await producer.send(topic, value=value, key=key, partition=partition, headers=headers)
        except REJECTED as exc:  # refused by the client before sending: the producer is fine
            raise _translate(exc) from None
        except _RESTART as exc:
            await self.restart(generation)
            raise _translate(exc) from None
        except KafkaError as exc:
            raise _translate(exc) from None
        future: asyncio.Future[Any] = inner
        self._born[future] = generation
        return future

    async def send_many(
        self, topic: str, partition: int, messages: Sequence[Message]
    ) -> list[tuple[asyncio.Future[Any], int]]:
        """Into the partition's open record batch (:mod:`tailer.publishers.batching`): one future per batch."""
        if self._batches is None:
            raise PublishError("the Kafka publisher is not started", retriable=True)
        return self._batches.add(topic, partition, messages)

    def abandon(self, partition: int) -> None:
        if self._batches is not None:
            self._batches.abandon(partition)

    def refuses(self, message: Message) -> PublishError | None:
        raw = len(message.key) + len(message.value)
        for name, value in message.headers:  # a loop: a third cheaper than sum() over a generator, per cell
            raw += len(name) + len(value)
        if raw + _RECORD_OVERHEAD <= self.options.max_request_size:  # clearly fits: skip the exact estimate
            return None
        size = DefaultRecordBatchBuilder.estimate_size_in_bytes(message.key, message.value, message.headers)
        if size > self.options.max_request_size:  # what aiokafka's send() refuses before sending
            return PublishError(f"the broker refuses the message: MessageSizeTooLargeError: it is {size} bytes, "
                                f"over max_request_size {self.options.max_request_size}", retriable=False)
        return None

    def _create_batch(self) -> BatchBuilder:
        if self._producer is None:  # restarting
            raise PublishError("the Kafka producer is restarting", retriable=True)
        return self._producer.create_batch()

    async def _submit(self, batch: BatchBuilder, topic: str, partition: int, future: asyncio.Future[Any]
                      ) -> asyncio.Future[Any]:
        """Hand ``batch`` to the producer; ``future`` (the worker's) is labelled with the producer it went to."""
        producer, generation = self._producer, self._generation
        if producer is None:
            raise PublishError("the Kafka producer is restarting", retriable=True)
        self._born[future] = generation
        sent: asyncio.Future[Any] = await producer.send_batch(batch, topic, partition=partition)
        return sent

    def translate(self, exc: BaseException) -> PublishError:
        return _translate(exc)

    async def after_failure(self, exc: BaseException, future: asyncio.Future[Any]) -> None:
        if isinstance(exc, _RESTART):
            await self.restart(self._born.get(future, self._generation))
