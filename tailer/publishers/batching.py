"""Record batches per partition, one in flight at a time: how the Kafka publisher sends cells.

aiokafka's ``send_batch`` costs a future per batch where ``send`` costs one (and about 14 µs of
Python) per message, but a batch handed over while the partition's previous one has not left yet
blocks the caller until it has; and with 4096 shards a shard's page is often a dozen cells. So the
cells of every shard of a partition go into the partition's open batch, and a batch is handed to
aiokafka only when the partition has none in flight: at once (once the loop's turn is over, so that
the pages of that turn join it), or, while one is in flight, as soon as it is acknowledged. Cells
gather meanwhile, as they would in aiokafka's accumulator with ``send``, and the next batch leaves
with all of them.

Per-partition order holds: a partition's batches leave in order, one at a time, and when one fails,
those after it fail with it before they are handed over, so nothing added later is delivered before
the failed cells are sent again (the contract of :class:`~tailer.interfaces.Publisher`).
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


class _Lane:
    """A partition's batches waiting to leave (the last may be open) and whether one is in flight."""

    __slots__ = ("in_flight", "partition", "queue", "topic")

    def __init__(self, topic: str, partition: int) -> None:
        self.topic, self.partition = topic, partition
        self.queue: deque[_Batch] = deque()
        self.in_flight = False


class PartitionBatcher:
    """Open batches per (topic, partition) and the task that hands them over (see the module docstring)."""

    def __init__(self, create: Callable[[], BatchBuilder], submit: Submit) -> None:
        self._create = create
        self._submit = submit
        self._lanes: dict[tuple[str, int], _Lane] = {}
        self._due: dict[_Lane, None] = {}  # lanes with a batch to hand over and none in flight, in turn
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
        for lane in self._lanes.values():
            self._fail_queue(lane, error)
        self._due.clear()

    def add(self, topic: str, partition: int, messages: Sequence[Message]) -> list[tuple[asyncio.Future[Any], int]]:
        """Append ``messages`` to the partition's open batch (and new ones as batches fill up); returns
        (batch future, how many of ``messages`` it carries) pairs in order."""
        lane = self._lanes.get((topic, partition))
        if lane is None:
            lane = self._lanes[(topic, partition)] = _Lane(topic, partition)
        batch = lane.queue[-1] if lane.queue and lane.queue[-1].open else self._new(lane)
        out: list[tuple[asyncio.Future[Any], int]] = []
        count = 0
        for m in messages:
            if batch.builder.append(key=m.key, value=m.value, timestamp=None, headers=m.headers) is None:
                batch.open = False  # full
                if count:
                    out.append((batch.future, count))
                batch, count = self._new(lane), 0
                batch.builder.append(key=m.key, value=m.value, timestamp=None, headers=m.headers)  # an empty one fits
            count += 1
        if count:
            out.append((batch.future, count))
        if not lane.in_flight:
            self._due[lane] = None
            self._wake.set()
        return out

    def abandon(self, partition: int) -> None:
        """Cancel the batches of ``partition`` (any topic) not handed over yet."""
        for lane in self._lanes.values():
            if lane.partition == partition:
                while lane.queue:
                    lane.queue.popleft().future.cancel()

    def _new(self, lane: _Lane) -> _Batch:
        batch = _Batch(self._create())
        lane.queue.append(batch)
        return batch

    async def _pump(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._due:
                lane = next(iter(self._due))
                del self._due[lane]
                if lane.in_flight or not lane.queue:
                    continue
                batch = lane.queue.popleft()
                batch.open = False
                # Closed, aiokafka sends it at once: its linger would only delay cells, as everything that
                # could have joined the batch meanwhile gathers in the partition's next one here.
                batch.builder.close()
                if batch.future.done():  # abandoned
                    continue
                lane.in_flight = True
                try:
                    sent = await self._submit(batch.builder, lane.topic, lane.partition, batch.future)
                except Exception as exc:  # refused before it left: the batch and those after it fail
                    self._settle(lane, batch, None, exc)
                    continue
                sent.add_done_callback(functools.partial(self._settle, lane, batch))

    def _settle(self, lane: _Lane, batch: _Batch, sent: asyncio.Future[Any] | None,
                error: BaseException | None = None) -> None:
        lane.in_flight = False
        if sent is not None:
            error = asyncio.CancelledError() if sent.cancelled() else sent.exception()
        if error is None:
            if not batch.future.done():
                batch.future.set_result(sent.result() if sent is not None else None)
        else:
            if not batch.future.done():
                batch.future.set_exception(error)
            self._fail_queue(lane, PublishError(f"an earlier batch of {lane.topic}[{lane.partition}] failed: "
                                                f"{type(error).__name__} {error}".rstrip(), retriable=True))
        if lane.queue:
            self._due[lane] = None
            self._wake.set()

    @staticmethod
    def _fail_queue(lane: _Lane, error: BaseException) -> None:
        while lane.queue:
            future = lane.queue.popleft().future
            if not future.done():
                future.set_exception(error)
