"""Direct mode: the app tails the logstore itself, reusing the tailer's worker.

The tailer worker (:class:`tailer.worker.Tailer`) already reads the shard logs in
order, owns shards through a coordinator (offsets in the store, or shared through
ZooKeeper) and commits only positions whose deliveries were acknowledged. Here its
sink is :class:`HandlerPublisher`: instead of sending a cell to Kafka it queues the
cell for the handlers, one queue per shard worked through in order, and acknowledges
the cell once every handler succeeded or dead-lettered it. So a shard's cells are
never handled concurrently nor out of order, and a crash re-delivers at most the
cells after the last commit.

The queues are worked by a pool of at most ``max_active_shards`` tasks, a batch of a
shard at a time in round robin, rather than by a task per shard: with 4096 shards a
task per shard with cells cost more than the cells did. The pool grows only while
all its tasks wait on handlers, so handlers that never wait are run by one task.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import deque
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

from indexer.runtime.config import AppConfig
from indexer.runtime.handlers import Processor, tailer_deadletter
from logstore import Cell, Store
from logstore.extras import require
from tailer.config import TailerConfig
from tailer.coordinators.store import StoreCoordinator
from tailer.errors import PublishError
from tailer.interfaces import Coordinator, Publisher
from tailer.messages import Message
from tailer.metrics import TailerMetrics
from tailer.worker import Tailer

logger = logging.getLogger(__name__)
_MAX_PARTITIONS = 10_000  # TailerConfig's limit; shards beyond it share a queue (still in order)
_SLICE = 0.002  # seconds a handler worker runs batches that never wait before it lets the loop run


class _Item(NamedTuple):
    cell: Cell | None
    deadletter: dict[str, Any] | None  # the tailer's dead-letter record of a cell it could not read
    future: asyncio.Future[None]


class HandlerPublisher(Publisher):
    """The tailer's sink in direct mode: hands cells to the processor, in order per shard."""

    def __init__(self, processor: Processor, deadletter_topic: str, batch_size: int, max_workers: int = 256) -> None:
        self.processor = processor
        self.deadletter_topic = deadletter_topic
        self.batch_size = batch_size  # consecutive cells of a shard handled together (an index applies them at once)
        self.max_workers = max_workers
        self._queues: dict[int, deque[_Item]] = {}
        self._runnable: deque[int] = deque()  # partitions with cells queued and no worker on them, in turn
        self._scheduled: set[int] = set()  # runnable or being worked on: one worker per partition at a time
        self._workers: set[asyncio.Task[None]] = set()
        self._busy = 0  # workers inside a batch (waiting on its handlers, if they wait)
        self._running = False

    async def start(self) -> None:
        self._running = True

    async def stop(self) -> None:
        """Abandon what is queued; wait for the handlers under way (the worker's drain already did)."""
        self._running = False
        for partition in list(self._queues):
            self.abandon(partition)
        if self._workers:
            await asyncio.gather(*self._workers, return_exceptions=True)

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
        self._queue(partition).extend(items)
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
        self._queue(partition).append(item)
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

    def _queue(self, partition: int) -> deque[_Item]:
        queue = self._queues.get(partition)  # not setdefault: that builds a deque on every call
        if queue is None:
            queue = self._queues[partition] = deque()
        return queue

    def _kick(self, partition: int) -> None:
        if partition in self._scheduled:  # its worker takes the new cells in turn
            return
        self._scheduled.add(partition)
        self._runnable.append(partition)
        if self._busy == len(self._workers):  # else a worker not waiting on a handler comes back for it
            self._spawn()

    def _spawn(self) -> None:
        """One more worker, within ``max_workers``. Workers are added only while every one waits on a
        handler: a task per kicked shard cost 4096 shards more than their cells when handlers never wait."""
        if len(self._workers) < self.max_workers:
            task = asyncio.create_task(self._worker(), name=f"handlers-{len(self._workers)}")
            self._workers.add(task)
            task.add_done_callback(self._workers.discard)  # also if it never ran

    async def _worker(self) -> None:
        """Work the runnable partitions a batch at a time, each going to the back of the line after its batch."""
        loop = asyncio.get_running_loop()
        pause_at = loop.time() + _SLICE
        try:
            while self._runnable and self.processor.stalled is None:
                partition = self._runnable.popleft()
                queue = self._queues[partition]
                again = False
                self._busy += 1
                if self._runnable and self._busy == len(self._workers):  # the others wait on handlers too
                    self._spawn()
                try:
                    again = await self._work(partition, queue) and bool(queue)
                finally:  # a partition is never left scheduled without being in line
                    self._busy -= 1
                    if again:
                        self._runnable.append(partition)
                    else:
                        self._scheduled.discard(partition)
                        if not queue:  # an idle shard keeps no queue (send_many makes one)
                            del self._queues[partition]
                if loop.time() >= pause_at:  # handlers that never wait must not hold up the worker loop for long
                    await asyncio.sleep(0)
                    pause_at = loop.time() + _SLICE
        finally:
            # At once, not in a done callback: a partition made runnable from now on needs a new worker.
            self._workers.discard(asyncio.current_task())

    async def _work(self, partition: int, queue: deque[_Item]) -> bool:
        """The next batch of the partition's queue; False when the app stalled (the batch stays queued)."""
        while queue and queue[0].future.done():  # abandoned
            queue.popleft()
        if not queue:
            return True
        batch = [queue.popleft()]
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
            return True
        if not done:
            queue.extendleft(reversed(batch))  # stalled: unacknowledged (abandoned when the app stops)
            return False
        for item in batch:
            if not item.future.done():
                item.future.set_result(None)
        return True

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
            session_timeout=config.session_timeout, per_shard_metrics=config.per_shard_metrics,
        )
        self.coordinator: Coordinator
        if config.zookeeper:
            require("zookeeper", "an app coordinated through ZooKeeper")
            from tailer.coordinators.zookeeper import ZooKeeperCoordinator

            self.coordinator = ZooKeeperCoordinator(config.zookeeper, consumer, store.shard_count,
                                                    session_timeout=config.session_timeout)
        else:
            self.coordinator = StoreCoordinator(store, consumer)
        self.publisher = HandlerPublisher(processor, self.tailer_config.deadletter_topic, config.page_size,
                                          config.max_active_shards)
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
