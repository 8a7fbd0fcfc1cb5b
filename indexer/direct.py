"""Direct mode: the app tails the logstore itself, reusing the tailer's worker.

The tailer worker (:class:`tailer.worker.Tailer`) already reads the shard logs in
order, owns shards through a coordinator (offsets in the store, or shared through
ZooKeeper) and commits only positions whose deliveries were acknowledged. Here its
sink is :class:`HandlerPublisher`: instead of sending a cell to Kafka it queues the
cell for the handlers, one queue per shard worked through in order, and acknowledges
the cell once every handler succeeded or dead-lettered it. So a shard's cells are
never handled concurrently nor out of order, and a crash re-delivers at most the
cells after the last commit.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import deque
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

from logstore import Cell, Store
from tailer.config import TailerConfig
from tailer.errors import PublishError
from tailer.interfaces import Coordinator, Publisher
from tailer.messages import Message
from tailer.metrics import TailerMetrics
from tailer.storecoord import StoreCoordinator
from tailer.worker import Tailer

from .config import AppConfig
from .handlers import Processor, tailer_deadletter

logger = logging.getLogger(__name__)
_MAX_PARTITIONS = 10_000  # TailerConfig's limit; shards beyond it share a queue (still in order)


class _Item(NamedTuple):
    cell: Cell | None
    deadletter: dict[str, Any] | None  # the tailer's dead-letter record of a cell it could not read
    future: asyncio.Future[None]


class HandlerPublisher(Publisher):
    """The tailer's sink in direct mode: hands cells to the processor, in order per shard."""

    def __init__(self, processor: Processor, deadletter_topic: str, batch_size: int) -> None:
        self.processor = processor
        self.deadletter_topic = deadletter_topic
        self.batch_size = batch_size  # consecutive cells of a shard handled together (an index applies them at once)
        self._queues: dict[int, deque[_Item]] = {}
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._running = False

    async def start(self) -> None:
        self._running = True

    async def stop(self) -> None:
        """Abandon what is queued; wait for the handlers under way (the worker's drain already did)."""
        self._running = False
        for partition in list(self._queues):
            self.abandon(partition)
        tasks = [t for t in self._tasks.values() if not t.done()]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def prepare_topic(self, topic: str, partitions: int, replication_factor: int) -> None:
        """No topics here: cells go straight to the handlers."""

    def encode(self, cell: Cell, value_format: Literal["json", "msgpack"]) -> Message:
        return Message(b"", b"", [], cell)  # the cell itself, not its bytes

    async def send_many(
        self, topic: str, partition: int, messages: Sequence[Message]
    ) -> list[tuple[asyncio.Future[Any], int]]:
        if not self._running:
            raise PublishError("the app is stopping", retriable=True)
        loop = asyncio.get_running_loop()
        items = [_Item(m.cell, None, loop.create_future()) for m in messages]
        self._queues.setdefault(partition, deque()).extend(items)
        self._kick(partition)
        return [(item.future, 1) for item in items]

    async def send(
        self, topic: str, partition: int, key: bytes, value: bytes, headers: list[tuple[str, bytes]]
    ) -> asyncio.Future[Any]:
        """Only the worker's dead letters come this way: a stored cell that cannot be decoded."""
        if topic != self.deadletter_topic:
            raise PublishError(f"direct mode sends cells with send_many, not to {topic}", retriable=False)
        if not self._running:
            raise PublishError("the app is stopping", retriable=True)
        item = _Item(None, json.loads(value), asyncio.get_running_loop().create_future())
        self._queues.setdefault(partition, deque()).append(item)
        self._kick(partition)
        return item.future

    async def before_commit(self) -> None:
        """Flush the handlers that buffer (warehouse sinks) before the worker commits their positions."""
        try:
            await self.processor.checkpoint()
        except Exception as exc:
            retriable = bool(getattr(exc, "retriable", False))
            raise PublishError(f"a handler could not flush: {type(exc).__name__}: {exc}", retriable=retriable) from exc

    def abandon(self, partition: int) -> None:
        """Cancel what is queued; cells being handled (taken off the queue) finish."""
        queue = self._queues.get(partition)
        while queue:
            queue.popleft().future.cancel()

    def _kick(self, partition: int) -> None:
        task = self._tasks.get(partition)
        if task is None or task.done():
            self._tasks[partition] = asyncio.create_task(self._work(partition), name=f"handlers-{partition}")

    async def _work(self, partition: int) -> None:
        queue = self._queues[partition]
        while queue and self.processor.stalled is None:
            batch = [queue.popleft()]
            if batch[0].future.done():  # abandoned
                continue
            while (batch[0].cell is not None and queue and len(batch) < self.batch_size
                   and queue[0].cell is not None and not queue[0].future.done()):
                batch.append(queue.popleft())
            try:
                done = await self._handle(batch)
            except Exception as exc:  # e.g. the store is down while dead-lettering: redeliver from here
                logger.warning("partition %d: cells not settled (%s); they will be delivered again", partition, exc)
                error = PublishError(f"not settled: {type(exc).__name__}: {exc}", retriable=True)
                for rest in [*batch, *queue]:
                    if not rest.future.done():
                        rest.future.set_exception(error)
                queue.clear()
                return
            if not done:
                queue.extendleft(reversed(batch))  # stalled: unacknowledged (abandoned when the app stops)
                return
            for item in batch:
                if not item.future.done():
                    item.future.set_result(None)

    async def _handle(self, batch: list[_Item]) -> bool:
        first = batch[0]
        if first.cell is not None:
            return await self.processor.process_many(
                [(item.cell, {"mode": "direct", "shard": item.cell.shard, "added_id": item.cell.added_id})
                 for item in batch if item.cell is not None])
        where, failure = tailer_deadletter(first.deadletter or {})
        source = {"mode": "direct", "shard": where.get("shard"), "added_id": where.get("added_id")}
        return await self.processor.undecodable(where, source, failure)


class DirectRunner:
    """The tailer worker with the handler sink, for one app process."""

    def __init__(self, store: Store, config: AppConfig, processor: Processor, metrics: TailerMetrics) -> None:
        columns = tuple(sorted(processor.by_column))
        consumer = f"app.{config.name}"
        self.tailer_config = TailerConfig(
            name=consumer, topic_prefix="app", partitions=min(store.shard_count, _MAX_PARTITIONS), columns=columns,
            start_from=config.start_from, page_size=config.page_size, max_in_flight=config.max_in_flight,
            poll_interval=config.poll_interval, idle_poll_interval=config.idle_poll_interval,
            commit_interval=config.commit_every(kafka=False), stop_timeout=config.stop_timeout,
            session_timeout=config.session_timeout,
        )
        self.coordinator: Coordinator
        if config.zookeeper:
            from tailer.zookeeper import ZooKeeperCoordinator

            self.coordinator = ZooKeeperCoordinator(config.zookeeper, consumer, store.shard_count,
                                                    session_timeout=config.session_timeout)
        else:
            self.coordinator = StoreCoordinator(store, consumer)
        self.publisher = HandlerPublisher(processor, self.tailer_config.deadletter_topic, config.page_size)
        self.tailer = Tailer(store, self.tailer_config, self.coordinator, self.publisher, metrics)

    async def start(self) -> None:
        await self.tailer.start()

    async def stop(self) -> None:
        await self.tailer.stop()

    def lost_shards(self) -> frozenset[int]:
        return self.coordinator.lost if isinstance(self.coordinator, StoreCoordinator) else frozenset()

    def failed(self) -> BaseException | None:
        return self.tailer.error

    def caught_up(self, since: float) -> bool:
        return self.tailer.caught_up(since)
