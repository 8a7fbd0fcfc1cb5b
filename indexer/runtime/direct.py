"""Direct mode: the app tails the logstore itself, reusing the tailer's worker.

The tailer worker (:class:`tailer.worker.Tailer`) already reads the shard logs in
order, owns shards through a coordinator (offsets in the store, or shared through
ZooKeeper) and commits only positions whose deliveries were acknowledged. Here its
sink is :class:`HandlerSink`: instead of sending cells to Kafka it queues each run
the worker hands over (consecutive cells of a shard and a column, up to a page) for the
handlers, one queue per shard worked through in order, and acknowledges the run once
every handler succeeded or dead-lettered each of its cells: one future per page, not
per cell. So a shard's cells are never handled concurrently nor out of order, and a
crash re-delivers at most the cells after the last commit.

The queues are worked by a pool of at most ``max_active_shards`` tasks in round robin,
rather than by a task per shard: with 4096 shards a task per shard with cells cost more
than the cells did. The pool grows only while all its tasks wait on handlers, so
handlers that never wait are run by one task. A task takes a batch off the front of the
line: the next cells of one shard and, within ``page_size`` cells, those of the shards
after it, as many as its share of the line (the line over the batches that can run at
once: tasks, or the pool's threads for synchronous handlers), or all of them while the
handlers do not wait (one task runs them one after another anyway). At 4096 shards a page
holds a few cells, and a call of the processor per page (a trip to the thread pool, for a
synchronous handler) cost more than its cells. The shards of a batch wait for each
other as a partition's cells do in Kafka mode: a cell whose handler retries holds up the
cells after it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from indexer.runtime.config import AppConfig
from indexer.runtime.handlers import Processor, tailer_deadletter
from logstore import Cell, Store
from logstore.cell import AnyCell
from logstore.extras import require
from tailer.config import TailerConfig
from tailer.coordinators.store import StoreCoordinator
from tailer.errors import PublishError
from tailer.interfaces import Coordinator, Sink
from tailer.metrics import TailerMetrics
from tailer.worker import Tailer

logger = logging.getLogger(__name__)
_SLICE = 0.002  # seconds a handler worker runs batches that never wait before it lets the loop run


class _Item(NamedTuple):
    """A run of a shard's cells handed over together and acknowledged together, or a dead-letter record."""

    cells: list[Cell] | None
    deadletter: dict[str, Any] | None  # the tailer's dead-letter record of a cell it could not read
    future: asyncio.Future[None]


class HandlerSink(Sink):
    """The tailer's sink in direct mode: hands cells to the processor, in order per shard."""

    def __init__(self, processor: Processor, batch_size: int, max_workers: int = 256) -> None:
        self.processor = processor
        # Consecutive cells of a shard handled together (an index applies them at once); runs are not split.
        self.batch_size = batch_size
        self.max_workers = max_workers
        self._queues: dict[int, deque[_Item]] = {}
        self._runnable: deque[int] = deque()  # shards with cells queued and no worker on them, in turn
        self._scheduled: set[int] = set()  # runnable or being worked on: one worker per shard at a time
        self._workers: set[asyncio.Task[None]] = set()
        self._busy = 0  # workers inside a batch (waiting on its handlers, if they wait)
        # Batches at once that handlers can use: a pool's threads run the synchronous ones.
        self.lanes = min(max_workers, processor.max_parallel_batches or max_workers)
        self._ticks = 0  # loop callbacks run while batches were handled (see _work)
        self._waited = True  # whether the last batch's handlers waited (gave the loop a turn)
        self._running = False

    async def start(self) -> None:
        self._running = True

    async def stop(self) -> None:
        """Abandon what is queued; wait for the handlers under way (the worker's drain already did)."""
        self._running = False
        self.abandon(list(self._queues))
        if self._workers:
            await asyncio.gather(*self._workers, return_exceptions=True)

    def accept(self, cell: AnyCell) -> Cell:
        # The handlers take the cell itself: nothing to encode, nothing too large (and never packed: see
        # packed_bodies).
        return cell if isinstance(cell, Cell) else cell.to_cell()

    async def deliver(self, shard: int, column: str, items: Sequence[Any]) -> list[tuple[asyncio.Future[Any], int]]:
        if not self._running:
            raise PublishError("the app is stopping", retriable=True)
        # The worker's list is the sink's from now on (it builds one per run): not copied.
        cells = items if isinstance(items, list) else list(items)
        item = _Item(cells, None, asyncio.get_running_loop().create_future())
        self._queue(shard).append(item)
        self._kick(shard)
        return [(item.future, len(items))]

    async def deadletter(self, shard: int, record: dict[str, Any]) -> asyncio.Future[Any]:
        """A stored cell the worker could not decode: each handler of its column dead-letters it."""
        if not self._running:
            raise PublishError("the app is stopping", retriable=True)
        item = _Item(None, record, asyncio.get_running_loop().create_future())
        self._queue(shard).append(item)
        self._kick(shard)
        return item.future

    async def before_commit(self) -> None:
        """Flush the handlers that buffer (warehouse sinks) before the worker commits their positions."""
        try:
            await self.processor.checkpoint()
        except Exception as exc:
            retriable = bool(getattr(exc, "retriable", False))
            raise PublishError(f"a handler could not flush: {type(exc).__name__}: {exc}", retriable=retriable) from exc

    def abandon(self, shards: Iterable[int]) -> None:
        """Cancel what is queued; cells being handled (taken off the queue) finish."""
        for shard in shards:
            queue = self._queues.get(shard)
            while queue:
                queue.popleft().future.cancel()

    def _queue(self, shard: int) -> deque[_Item]:
        queue = self._queues.get(shard)  # not setdefault: that builds a deque on every call
        if queue is None:
            queue = self._queues[shard] = deque()
        return queue

    def _kick(self, shard: int) -> None:
        if shard in self._scheduled:  # its worker takes the new cells in turn
            return
        self._scheduled.add(shard)
        self._runnable.append(shard)
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
        """Work the shards in line a batch at a time, each shard of a batch going to the back of the line after it."""
        loop = asyncio.get_running_loop()
        pause_at = loop.time() + _SLICE
        try:
            while self._runnable and self.processor.stalled is None:
                taken = self._take()
                self._busy += 1
                if self._runnable and self._busy == len(self._workers):  # the others wait on handlers too
                    self._spawn()
                again = False
                try:
                    again = await self._work(taken)
                finally:  # a shard is never left scheduled without being in line
                    self._busy -= 1
                    for shard, queue, _items in taken:
                        if again and queue:
                            self._runnable.append(shard)
                        else:
                            self._scheduled.discard(shard)
                            if not queue:  # an idle shard keeps no queue (deliver makes one)
                                del self._queues[shard]
                if loop.time() >= pause_at:  # handlers that never wait must not hold up the worker loop for long
                    await asyncio.sleep(0)
                    pause_at = loop.time() + _SLICE
        finally:
            # At once, not in a done callback: a shard made runnable from now on needs a new worker.
            self._workers.discard(asyncio.current_task())

    def _take(self) -> list[tuple[int, deque[_Item], list[_Item]]]:
        """The next batch, off the front of the line: the first shard's next cells and, within ``batch_size``
        cells, the next shards' too: as many as handlers that do not wait can take (all of them: one task runs
        them one after another either way), or when they wait, a share of the line split over the batches that
        can still start. A dead letter goes alone. (shard, its queue, its items) each."""
        lanes = max(1, self.lanes - self._busy)  # the batches that can still start beside those under way
        most = len(self._runnable) if not self._waited else -(-len(self._runnable) // lanes)
        taken: list[tuple[int, deque[_Item], list[_Item]]] = []
        size = 0
        while self._runnable and len(taken) < most:
            shard = self._runnable[0]
            queue = self._queues[shard]
            while queue and queue[0].future.done():  # abandoned
                queue.popleft()
            head = queue[0].cells if queue else []
            if taken and (head is None or size + len(head) > self.batch_size):
                break
            self._runnable.popleft()
            items = self._items(queue, self.batch_size - size)
            taken.append((shard, queue, items))
            if head is None:
                break
            size += sum(len(item.cells or ()) for item in items)
        return taken

    def _items(self, queue: deque[_Item], room: int) -> list[_Item]:
        """The shard's next items: a dead letter alone, or consecutive runs of cells within ``room`` cells (the
        first run whatever its size: runs are not split)."""
        if not queue:
            return []
        items = [queue.popleft()]
        size = len(items[0].cells or ())
        while (size and queue and queue[0].cells is not None and size + len(queue[0].cells) <= room
               and not queue[0].future.done()):
            size += len(queue[0].cells)
            items.append(queue.popleft())
        return items

    async def _work(self, taken: list[tuple[int, deque[_Item], list[_Item]]]) -> bool:
        """Handle a batch; False when the app stalled (the batch stays queued, in front)."""
        batch = [item for _shard, _queue, items in taken for item in items]
        if not batch:
            return True
        ticks = self._ticks
        asyncio.get_running_loop().call_soon(self._tick)  # runs before the batch ends only if a handler waits
        try:
            done = await self._handle(batch)
        except Exception as exc:  # e.g. the store is down while dead-lettering: redeliver from here
            logger.warning("shards %s: cells not settled (%s); they will be delivered again",
                           ", ".join(str(shard) for shard, _queue, _items in taken), exc)
            error = PublishError(f"not settled: {type(exc).__name__}: {exc}", retriable=True)
            for _shard, queue, items in taken:
                for rest in [*items, *queue]:
                    if not rest.future.done():
                        rest.future.set_exception(error)
                queue.clear()
            return True
        finally:
            self._waited = self._ticks != ticks
        if not done:
            for _shard, queue, items in taken:  # stalled: unacknowledged (abandoned when the app stops)
                queue.extendleft(reversed(items))
            return False
        for item in batch:
            if not item.future.done():
                item.future.set_result(None)
        return True

    def _tick(self) -> None:
        self._ticks += 1

    async def _handle(self, batch: list[_Item]) -> bool:
        first = batch[0]
        if first.cells is not None:
            return await self.processor.process_many(
                [(cell, {"mode": "direct", "shard": cell.shard, "added_id": cell.added_id})
                 for item in batch for cell in item.cells or ()], by_shard=True)
        where, failure = tailer_deadletter(first.deadletter or {})
        source = {"mode": "direct", "shard": where.get("shard"), "added_id": where.get("added_id")}
        return await self.processor.undecodable(where, source, failure)


class DirectRunner:
    """The tailer worker with the handler sink, for one app process."""

    def __init__(self, store: Store, config: AppConfig, processor: Processor, metrics: TailerMetrics) -> None:
        columns = tuple(sorted(processor.by_column))
        consumer = f"app.{config.name}"
        self.tailer_config = TailerConfig(
            name=consumer, columns=columns, start_from=config.start_from, page_size=config.page_size,
            max_in_flight=config.max_in_flight,
            poll_interval=config.poll_interval, idle_poll_interval=config.idle_poll_interval,
            commit_interval=config.commit_every(kafka=False), stop_timeout=config.stop_timeout,
            session_timeout=config.session_timeout, per_shard_metrics=config.per_shard_metrics,
        )
        self.coordinator: Coordinator
        if config.zookeeper:
            require("zookeeper", "an app coordinated through ZooKeeper")
            from tailer.coordinators.zookeeper import ZooKeeperCoordinator

            self.coordinator = ZooKeeperCoordinator(config.zookeeper, consumer, store.shard_count,
                                                    session_timeout=config.session_timeout, auth=config.zookeeper_auth)
        else:
            self.coordinator = StoreCoordinator(store, consumer)
        self.sink = HandlerSink(processor, config.page_size, config.max_active_shards)
        self.tailer = Tailer(store, self.tailer_config, self.coordinator, self.sink, metrics)

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
