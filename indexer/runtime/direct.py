"""Direct mode: the app tails the logstore itself, reusing the tailer's worker (:class:`tailer.worker.Tailer`).

The worker's sink here is :class:`HandlerSink`: what the worker hands over (a run, or a delivery batch of
several shards' runs) becomes a *job*, handed to the handlers and acknowledged by one future once every handler
succeeded or dead-lettered each of its cells. A job runs only after every earlier job with one of its shards has
settled, and a failed or abandoned job fails those waiting for it: a shard's cells are never handled concurrently
nor out of order, and a crash re-delivers at most the cells after the last commit. A pool of at most
``max_active_shards`` tasks works the runnable jobs, a handler batch (jobs within ``page_size`` cells) at a time.
docs/indexer.md (Direct mode) gives the design.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

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
# Seconds of handling below which a read's shards are not split over the pool's threads: a split into a batch
# per thread saves at most the handling time, and each trip to the pool costs the loop time too.
_SPLIT_WORTH = 0.001


class _Job:
    """Cells handed over together and acknowledged together (a shard's run, or the runs of a delivery batch),
    or a dead-letter record. It runs once every job handed over before it with one of its shards has
    settled: so a shard's cells are handled in order, never two at once."""

    __slots__ = ("cells", "deadletter", "future", "shards", "taken", "then", "waits")

    def __init__(self, shards: tuple[int, ...], cells: list[Cell] | None, deadletter: dict[str, Any] | None) -> None:
        self.shards = shards
        self.cells = cells
        self.deadletter = deadletter  # the tailer's dead-letter record of a cell it could not read
        self.future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waits = 0  # jobs before it, with one of its shards, not settled yet
        self.then: list[_Job] | None = None  # jobs waiting for this one
        self.taken = False  # under way: a worker is handling it


class HandlerSink(Sink):
    """The tailer's sink in direct mode: hands cells to the processor, in order per shard."""

    delivers_batches = True

    def __init__(self, processor: Processor, batch_size: int, max_workers: int = 256, *,
                 source: Mapping[str, Any] | None = None) -> None:
        self.processor = processor
        # What a dead letter says of where its cell came from, beside its shard and added_id (a replay job
        # names itself: indexer.runtime.replay); None: direct mode.
        self.source = dict(source) if source is not None else None
        # Cells handled together by a worker (an index applies them at once); a job is never split.
        self.batch_size = batch_size
        self.max_workers = max_workers
        self._last: dict[int, _Job] = {}  # per shard, its last job not settled: the next one waits for it
        self._unsettled: dict[_Job, None] = {}  # in the order handed over
        self._runnable: deque[_Job] = deque()  # jobs nothing waits for, not under way, in turn
        self._workers: set[asyncio.Task[None]] = set()
        self._busy = 0  # workers inside a batch (waiting on its handlers, if they wait)
        # Batches at once that handlers can use: a pool's threads run the synchronous ones.
        self.parallel_batches = min(max_workers, processor.max_parallel_batches or max_workers)
        self._ticks = 0  # loop callbacks run while batches were handled (see _work)
        self._waited = True  # whether the last batch's handlers waited (gave the loop a turn)
        self._running = False

    async def start(self) -> None:
        self._running = True

    async def stop(self) -> None:
        """Abandon what is not under way; wait for the handlers under way (the worker's drain already did)."""
        self._running = False
        self.abandon(list(self._last))
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
        job = _Job((shard,), items if isinstance(items, list) else list(items), None)
        self._add(job)
        return [(job.future, len(items))]

    async def deliver_batch(
        self, runs: Sequence[tuple[int, str, Sequence[Any]]]
    ) -> list[list[tuple[asyncio.Future[Any], int]]]:
        if not self._running:
            raise PublishError("the app is stopping", retriable=True)
        if not self._waited or not self._worth_splitting(runs):
            # Handlers that never wait, or whose cells take less than a few trips to the pool cost, take the
            # delivery batch as one job: one handler batch runs it all.
            job = _Job(tuple(dict.fromkeys(shard for shard, _column, _items in runs)),
                       [cell for _shard, _column, items in runs for cell in items], None)
            self._add(job)
            return [[(job.future, len(items))] for _shard, _column, items in runs]
        # Handlers that wait run shards side by side: a job per shard, shared out over the handler batches as
        # the line is.
        by_shard: dict[int, list[Cell]] = {}  # a shard's runs come one after another: kept in order
        for shard, _column, items in runs:
            by_shard.setdefault(shard, []).extend(items)
        jobs = {shard: _Job((shard,), cells, None) for shard, cells in by_shard.items()}
        for job in jobs.values():
            self._add(job)
        return [[(jobs[shard].future, len(items))] for shard, _column, items in runs]

    def _worth_splitting(self, runs: Sequence[tuple[int, str, Sequence[Any]]]) -> bool:
        """Whether the delivery batch's cells, handled one after another, would take long enough (by what cells
        recently took) that running its shards side by side gains more than the trips to the pool cost: a read
        of many shards of a few cells each is not worth a handler batch per thread."""
        per_cell = self.processor.cell_seconds
        return per_cell is None or per_cell * sum(len(items) for _shard, _column, items in runs) >= _SPLIT_WORTH

    async def deadletter(self, shard: int, record: dict[str, Any]) -> asyncio.Future[Any]:
        """A stored cell the worker could not decode: each handler of its column dead-letters it."""
        if not self._running:
            raise PublishError("the app is stopping", retriable=True)
        job = _Job((shard,), None, record)
        self._add(job)
        return job.future

    async def before_commit(self) -> None:
        """Flush the handlers that buffer (warehouse sinks) before the worker commits their positions."""
        try:
            await self.processor.checkpoint()
        except Exception as exc:
            retriable = bool(getattr(exc, "retriable", False))
            raise PublishError(f"a handler could not flush: {type(exc).__name__}: {exc}", retriable=retriable) from exc

    def abandon(self, shards: Iterable[int]) -> None:
        """Cancel the jobs of ``shards`` not under way, and with them those waiting for them (the cells of
        other shards in them too: they are delivered again). Jobs under way finish."""
        leaving = set(shards)
        for job in list(self._unsettled):
            if not job.taken and not job.future.done() and not leaving.isdisjoint(job.shards):
                self._settle(job, asyncio.CancelledError())

    def _add(self, job: _Job) -> None:
        last = self._last
        for shard in job.shards:
            before = last.get(shard)
            if before is not None:
                if before.then is None:
                    before.then = []
                before.then.append(job)
                job.waits += 1
            last[shard] = job
        self._unsettled[job] = None
        if not job.waits:
            self._runnable.append(job)
            if self._busy == len(self._workers):  # else a worker not waiting on a handler comes back for it
                self._spawn()

    def _settle(self, job: _Job, error: BaseException | None) -> None:
        """Acknowledge ``job`` (``error`` None) or fail it, and with it every job waiting for it: a shard's
        later cells must not be handled before the worker has resent the failed ones."""
        failed = [job]
        while failed:
            job = failed.pop()
            if job.future.done():  # failed already, through another of its shards
                continue
            if error is None:
                job.future.set_result(None)
            elif isinstance(error, asyncio.CancelledError):
                job.future.cancel()
            else:
                job.future.set_exception(error)
            del self._unsettled[job]
            for shard in job.shards:
                if self._last.get(shard) is job:
                    del self._last[shard]
            for later in job.then or ():
                later.waits -= 1
                if error is not None:
                    failed.append(later)
                elif not later.waits:
                    self._runnable.append(later)
            if error is None and self._runnable and self._busy == len(self._workers):
                self._spawn()

    def _spawn(self) -> None:
        """One more worker, within ``max_workers``. Workers are added only while every one waits on a
        handler: handlers that never wait are run by one task, as a task per job would cost more than the cells."""
        if len(self._workers) < self.max_workers:
            task = asyncio.create_task(self._worker(), name=f"handlers-{len(self._workers)}")
            self._workers.add(task)
            task.add_done_callback(self._workers.discard)  # also if it never ran

    async def _worker(self) -> None:
        """Work the jobs in line a handler batch at a time."""
        loop = asyncio.get_running_loop()
        pause_at = loop.time() + _SLICE
        try:
            while self._runnable and self.processor.stalled is None:
                taken = self._take()
                if not taken:
                    continue
                self._busy += 1
                if self._runnable and self._busy == len(self._workers):  # the others wait on handlers too
                    self._spawn()
                try:
                    await self._work(taken)
                finally:
                    self._busy -= 1
                if loop.time() >= pause_at:  # handlers that never wait must not hold up the worker loop for long
                    await asyncio.sleep(0)
                    pause_at = loop.time() + _SLICE
        finally:
            # At once, not in a done callback: a job made runnable from now on needs a new worker.
            self._workers.discard(asyncio.current_task())

    def _take(self) -> list[_Job]:
        """The next handler batch, off the front of the line: jobs within ``batch_size`` cells (the first whatever its
        size), as many as handlers that do not wait can take (all of them: one task runs them one after another
        either way), or when they wait, a share of the line split over the batches that can still start. A
        dead letter goes alone."""
        starts = max(1, self.parallel_batches - self._busy)  # the batches that can start beside those under way
        most = len(self._runnable) if not self._waited else -(-len(self._runnable) // starts)
        taken: list[_Job] = []
        size = 0
        while self._runnable and len(taken) < most:
            job = self._runnable[0]
            if job.future.done():  # abandoned
                self._runnable.popleft()
                continue
            if taken and (job.cells is None or size + len(job.cells) > self.batch_size):
                break
            self._runnable.popleft()
            job.taken = True
            taken.append(job)
            if job.cells is None:
                break
            size += len(job.cells)
        return taken

    async def _work(self, taken: list[_Job]) -> None:
        """Handle a handler batch and settle its jobs; when the app stalled, they stay unsettled, in front."""
        ticks = self._ticks
        asyncio.get_running_loop().call_soon(self._tick)  # runs before the batch ends only if a handler waits
        try:
            done = await self._handle(taken)
        except Exception as exc:  # e.g. the store is down while dead-lettering: redeliver from here
            logger.warning("shards %s: cells not settled (%s); they will be delivered again",
                           ", ".join(str(shard) for job in taken for shard in job.shards), exc)
            error = PublishError(f"not settled: {type(exc).__name__}: {exc}", retriable=True)
            for job in taken:
                self._settle(job, error)
            return
        finally:
            self._waited = self._ticks != ticks
        if not done:  # stalled: unacknowledged (abandoned when the app stops)
            for job in reversed(taken):
                job.taken = False
                self._runnable.appendleft(job)
            return
        for job in taken:
            self._settle(job, None)

    def _tick(self) -> None:
        self._ticks += 1

    async def _handle(self, batch: list[_Job]) -> bool:
        first = batch[0]
        if first.cells is not None:
            extra = self.source
            return await self.processor.process_many(
                [(cell, {"mode": "direct", "shard": cell.shard, "added_id": cell.added_id})
                 for job in batch for cell in job.cells or ()] if extra is None else
                [(cell, {**extra, "shard": cell.shard, "added_id": cell.added_id})
                 for job in batch for cell in job.cells or ()], by_shard=True)
        where, failure = tailer_deadletter(first.deadletter or {})
        source = {**(self.source or {"mode": "direct"}), "shard": where.get("shard"), "added_id": where.get("added_id")}
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
                                                    session_timeout=config.session_timeout, auth=config.zookeeper_auth,
                                                    columns=columns)
        else:
            self.coordinator = StoreCoordinator(store, consumer, columns=columns)
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
