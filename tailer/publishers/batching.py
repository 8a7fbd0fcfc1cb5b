"""Record batches per partition, one in flight at a time: how the Kafka publisher sends cells.

Like the RecordAccumulator of Kafka's producer, a queue of batches per partition: the cells of every shard of a
partition go into its open batch, and a batch is handed to aiokafka (``send_batch``: one future a batch, not one
a message) only when the partition has none in flight, so cells gather meanwhile and the next batch leaves with
all of them. A shard's page is often too small for a batch of its own (a dozen cells at 4096 shards).

Per-partition order holds: a partition's batches leave in order, one at a time, and when one fails, those after
it fail with it before they are handed over (the contract of :class:`~tailer.interfaces.Publisher`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from aiokafka.producer.message_accumulator import BatchBuilder

from tailer.errors import PublishError
from tailer.messages import Message

logger = logging.getLogger(__name__)
# Hands a batch to the producer for (topic, partition), labelling ``future`` (the batch's future for the
# worker) with the producer it went to; returns aiokafka's future of the batch.
Submit = Callable[[BatchBuilder, str, int, "asyncio.Future[Any]"], Awaitable["asyncio.Future[Any]"]]


class _Batch:
    __slots__ = ("builder", "future", "open")

    def __init__(self, builder: BatchBuilder) -> None:
        self.builder = builder
        self.future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.open = True  # takes more messages until it is full or leaves


class _PartitionQueue:
    """A partition's batches waiting to leave (the last may be open) and whether one is in flight."""

    __slots__ = ("batches", "in_flight", "partition", "topic")

    def __init__(self, topic: str, partition: int) -> None:
        self.topic, self.partition = topic, partition
        self.batches: deque[_Batch] = deque()
        self.in_flight = False


class PartitionBatcher:
    """Open batches per (topic, partition) and the task that hands them over (see the module docstring)."""

    def __init__(self, create: Callable[[], BatchBuilder], submit: Submit) -> None:
        self._create = create
        self._submit = submit
        self._queues: dict[tuple[str, int], _PartitionQueue] = {}
        self._due: dict[_PartitionQueue, None] = {}  # with a batch to hand over, none in flight; in turn
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._pump(), name="kafka-batches")

    async def stop(self, error: BaseException) -> None:
        """Stop handing batches over; those not handed over yet fail with ``error``."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        for queue in self._queues.values():
            self._fail_queue(queue, error)
        self._due.clear()

    def add(self, topic: str, partition: int, messages: Sequence[Message]) -> list[tuple[asyncio.Future[Any], int]]:
        """Append ``messages`` to the partition's open batch (and new ones as batches fill up); returns
        (batch future, how many of ``messages`` it carries) pairs in order."""
        queue = self._queues.get((topic, partition))
        if queue is None:
            queue = self._queues[(topic, partition)] = _PartitionQueue(topic, partition)
        batch = queue.batches[-1] if queue.batches and queue.batches[-1].open else self._new(queue)
        out: list[tuple[asyncio.Future[Any], int]] = []
        count = 0
        for m in messages:
            if batch.builder.append(key=m.key, value=m.value, timestamp=None, headers=m.headers) is None:
                batch.open = False  # full
                if count:
                    out.append((batch.future, count))
                batch, count = self._new(queue), 0
                batch.builder.append(key=m.key, value=m.value, timestamp=None, headers=m.headers)  # an empty one fits
            count += 1
        if count:
            out.append((batch.future, count))
        if not queue.in_flight:
            self._due[queue] = None
            self._wake.set()
        return out

    def abandon(self, partition: int) -> None:
        """Cancel the batches of ``partition`` (any topic) not handed over yet."""
        for queue in self._queues.values():
            if queue.partition == partition:
                while queue.batches:
                    queue.batches.popleft().future.cancel()

    def _new(self, queue: _PartitionQueue) -> _Batch:
        batch = _Batch(self._create())
        queue.batches.append(batch)
        return batch

    async def _pump(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._due:
                queue = next(iter(self._due))
                del self._due[queue]
                if queue.in_flight or not queue.batches:
                    continue
                batch = queue.batches.popleft()
                batch.open = False
                # Closed, aiokafka sends it at once: its linger would only delay cells, as everything that
                # could have joined the batch meanwhile gathers in the partition's next one here.
                batch.builder.close()
                if batch.future.done():  # abandoned
                    continue
                queue.in_flight = True
                try:
                    sent = await self._submit(batch.builder, queue.topic, queue.partition, batch.future)
                except Exception as exc:  # refused before it left: the batch and those after it fail
                    self._settle(queue, batch, None, exc)
                    continue
                sent.add_done_callback(functools.partial(self._settle, queue, batch))

    def _settle(self, queue: _PartitionQueue, batch: _Batch, sent: asyncio.Future[Any] | None,
                error: BaseException | None = None) -> None:
        queue.in_flight = False
        if sent is not None:
            error = asyncio.CancelledError() if sent.cancelled() else sent.exception()
        if error is None:
            if not batch.future.done():
                batch.future.set_result(sent.result() if sent is not None else None)
        else:
            if not batch.future.done():
                batch.future.set_exception(error)
            self._fail_queue(queue, PublishError(f"an earlier batch of {queue.topic}[{queue.partition}] failed: "
                                                 f"{type(error).__name__} {error}".rstrip(), retriable=True))
        if queue.batches:
            self._due[queue] = None
            self._wake.set()

    @staticmethod
    def _fail_queue(queue: _PartitionQueue, error: BaseException) -> None:
        while queue.batches:
            future = queue.batches.popleft().future
            if not future.done():
                future.set_exception(error)
