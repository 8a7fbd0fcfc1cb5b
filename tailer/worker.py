"""The tailer worker: reads the shard logs it owns and publishes them, at least once, in order.

Per shard it keeps three added_ids: ``position`` (read and handed to the sink), ``acked`` (every cell up to
it acknowledged, or dead-lettered and the dead letter acknowledged) and ``committed`` (stored by the
coordinator). Only ``acked`` is committed, so a crash replays at most the cells after the last commit. A
failed delivery rewinds ``position`` to ``acked``, and nothing more of the shard goes to the sink until
then (the failure may have replaced the sink's client): a replay repeats a suffix, never reorders. A cell
that can never be delivered goes to the sink as a dead-letter record; nothing is skipped without one.
Which shards to read next is the :class:`~tailer.reads.ReadScheduler`'s; the sink
(:class:`~tailer.interfaces.Sink`) is Kafka's topics or, in an app's direct mode, its handlers.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import datetime as dt
import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from logstore import CorruptCellError, LogstoreError, Store, TruncatedPage
from logstore.cell import AnyCell
from logstore.retry import RetryPolicy
from tailer.config import TailerConfig
from tailer.errors import ConfigurationError, FencedError, PublishError, TailerError, TopicPartitionsError
from tailer.interfaces import Claim, Coordinator, Offset, Publisher, Sink
from tailer.lag import LagMeter
from tailer.messages import deadletter_record
from tailer.metrics import TailerMetrics
from tailer.publishers.topics import TopicSink
from tailer.reads import ReadScheduler
from tailer.republish import Republisher
from tailer.shardstate import CountPoll, Pending, Read, ShardState, decoded, page_of

logger = logging.getLogger(__name__)
_BACKOFF = RetryPolicy(initial=0.1, maximum=5.0, deadline=None)
_CLAIM_RETRY = 0.5
_REPORT_EVERY = 1.0  # seconds between two reports of the deliveries past the commits (report_published)
# A page's runs of one column: (the cells, the sink's form of each).
_Runs = list[tuple[list[AnyCell], list[Any]]]
_T = TypeVar("_T")
_R = TypeVar("_R")


def _in_thread(fn: Callable[..., _R], *args: Any) -> asyncio.Future[_R]:
    """``fn(*args)`` in the default executor, handed to it now: ``ensure_future(to_thread(...))`` hands it
    over only once the loop has finished its current turn, while the read could be waiting on the database."""
    return asyncio.get_running_loop().run_in_executor(None, fn, *args)


class Tailer:
    """One worker of the tailer ``config.name``. ``async with Tailer(...)`` or start()/stop().

    ``sink`` is where the cells go; a message :class:`~tailer.interfaces.Publisher` (Kafka, a
    directory) is taken as the :class:`~tailer.publishers.topics.TopicSink` of the topics ``config``
    names. With such a sink and ``republish`` (``cellstream tail`` sets it; off by default, as it reads the
    store's jobs every 2 s), the worker also runs its tailer's re-publish jobs while it leads
    (:mod:`tailer.republish`).
    """

    def __init__(
        self,
        store: Store,
        config: TailerConfig,
        coordinator: Coordinator,
        sink: Sink | Publisher,
        metrics: TailerMetrics | None = None,
        clock: Any = time.monotonic,
        republish: bool = False,
    ) -> None:
        self.store = store
        self.config = config
        self.coordinator = coordinator
        self.sink = sink if isinstance(sink, Sink) else TopicSink(sink, config)
        self.metrics = metrics or TailerMetrics(config.name)
        self._clock = clock
        self._shards: dict[int, ShardState] = {}
        self._generation: int | None = None
        self._desired: frozenset[int] | None = None  # the assignment ownership was last synced with
        self._unclaimed: set[int] = set()  # assigned to this worker and not owned yet
        self._claim_after: dict[int, float] = {}
        self._next_claim = 0.0  # no unclaimed shard is due before this
        self._reads = ReadScheduler(config, config.read_ahead or store.parallel_reads)
        self._lag = LagMeter(store, self.metrics, config.lag_interval, config.top_lagging_shards, clock)
        self._acked: set[int] = set()  # whose deliveries settled since _collect last ran
        self._failing: set[int] = set()  # with a delivery that failed since _collect last rewound them
        # The acknowledgement callbacks' context, one for all: asyncio copies the current one per callback
        # otherwise, an object per page that the collector walks (_settled reads no context variable).
        self._callback_context = contextvars.Context()
        self._running: dict[asyncio.Future[Read], tuple[tuple[int, ...], int]] = {}  # reads: (shards, cells reserved)
        self._unsettled = 0  # deliveries handed to the sink whose futures have not settled
        self._to_commit: set[int] = set()  # acknowledged since their last commit: what a commit looks at
        if config.per_shard_metrics:
            self.metrics.enable_per_shard()
        self._lease_gauge = self.metrics.lease_valid.labels(config.name)
        self._leader_gauge = self.metrics.leader.labels(config.name)
        self._owned_gauge = self.metrics.owned_shards.labels(config.name)
        self._wakeup = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._commit_task: asyncio.Task[None] | None = None
        self._report_task: asyncio.Future[None] | None = None
        self._reported: dict[int, int] = {}
        self._next_report = 0.0
        self._stopping = False
        self._state = "new"
        self._paused = False
        self._prepared: set[str] = set()  # columns whose destination the sink has made ready
        self.error: BaseException | None = None
        # Re-publishes of ranges to the topics (tailer/republish.py), run beside the live tailing by a worker whose
        # sink is the topics'; off for other sinks (an app's handlers).
        self._republisher: Republisher | None = None
        if republish and isinstance(self.sink, TopicSink):
            self._republisher = Republisher(store, config, self.sink, self.coordinator.is_leader)

    # -- lifecycle ------------------------------------------------------------
    async def start(self) -> None:
        if self._state != "new":
            return
        self._state = "starting"
        self._loop = asyncio.get_running_loop()
        await self.sink.start()
        self.coordinator.start(self._changed)
        self._task = asyncio.create_task(self._run(), name=f"tailer-{self.config.name}")
        if self._republisher is not None:
            self._republisher.start()
        self._state = "running"

    async def stop(self) -> None:
        """Stop reading, wait for acknowledgements, commit, release the shards. Safe twice."""
        if self._state in ("stopping", "stopped"):
            return
        was_running = self._state == "running"
        self._state = "stopping"
        if self._republisher is not None:  # first: its last chunk is acknowledged before the shards are let go
            await self._republisher.stop()
        self._stopping = True
        self._reads.stop()
        self._wakeup.set()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        await self._lag.stop()
        if self._commit_task is not None:
            await asyncio.gather(self._commit_task, return_exceptions=True)
        if was_running:
            self.sink.abandon(self._shards)
            await self._drain(self.config.stop_timeout)
            claims = [st.claim for st in self._shards.values()]
            await self._in_threads(self._release_all, claims)
            self.metrics.forget_shards(self._shards)
            self._shards.clear()
            self._reads.clear()
            if claims:
                logger.info("%s: stopped; released %d shards", self.config.name, len(claims))
        await asyncio.to_thread(self.coordinator.stop)
        await self.sink.stop()
        self._state = "stopped"

    async def __aenter__(self) -> Tailer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def wait(self) -> None:
        """Until the worker stops; re-raises the error that stopped it, if any."""
        if self._task is not None:
            await asyncio.shield(self._task)

    def _changed(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wakeup.set)

    @property
    def owned(self) -> frozenset[int]:
        return frozenset(self._shards)

    def caught_up(self, since: float) -> bool:
        """True when every assigned shard is owned and acknowledged up to the end of its log as
        counted by a count poll that started at or after ``since`` (a ``clock()`` reading)."""
        # A count poll that found every owned shard idle proves them caught up at its start, and any shard
        # that took cells or was adopted since is live until it has drained them. The assignment as the loop
        # last took it: asking the coordinator here would take a change meant for the loop (a reset's shards).
        desired = self._desired if self._desired is not None else self.coordinator.assignment()[2]
        reads = self._reads
        if reads.quiet_at < since and self._shards and not reads.live and not reads.poll_requested:
            reads.request_poll()
            self._changed()  # wake the loop (thread-safe): the poll is what the caller waits for
        return (reads.quiet_at >= since and not reads.live and len(desired) == len(self._shards)
                and desired == self._shards.keys())

    def positions(self) -> dict[int, tuple[int, int, int]]:
        """(position, acked, committed) of every owned shard."""
        return {s: (st.position, st.acked, st.committed) for s, st in self._shards.items()}

    # -- the loop -------------------------------------------------------------
    async def _run(self) -> None:
        next_commit = self._clock() + self.config.commit_interval
        try:
            while not self._stopping:
                self._wakeup.clear()
                await self._sync_ownership()
                busy = False
                lease = self.coordinator.lease_valid()
                self._lease_gauge.set(int(lease))
                self._leader_gauge.set(int(self.coordinator.is_leader()))
                if lease:
                    if self._paused:
                        logger.info("lease regained: publishing resumes")
                        self._paused = False
                    busy = await self._read_and_send()
                elif self._shards and not self._paused:
                    logger.warning("no answer from ZooKeeper within the lease: publishing paused")
                    self._paused = True
                busy = await self._collect() or busy
                now = self._clock()
                if now >= next_commit and (self._commit_task is None or self._commit_task.done()):
                    # In the background: a slow or unreachable ZooKeeper must not hold up publishing.
                    self._commit_task = asyncio.create_task(self._commit())
                    next_commit = now + self.config.commit_interval
                if now >= self._next_report:
                    self._report_published(now)
                shards = self._shards
                self._lag.maybe_start(now, (shards[s] for s in self._reads.live if s in shards), shards.keys())
                if not busy:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wakeup.wait(), self._reads.pause(now, bool(self._shards)))
        except Exception as exc:
            self.error = exc
            logger.exception("tailer worker failed")
            raise

    def _report_published(self, now: float) -> None:
        """Tell the coordinator where deliveries stand past the commits, when that changed (in a thread)."""
        self._next_report = now + _REPORT_EVERY
        if self._report_task is not None and not self._report_task.done():
            return
        ahead = {st.shard: st.acked for st in self._shards.values() if st.acked > st.committed}
        if ahead != self._reported:
            self._reported = ahead
            self._report_task = _in_thread(self.coordinator.report_published, ahead)

    # -- ownership ------------------------------------------------------------
    async def _sync_ownership(self) -> None:
        generation, _epoch, desired = self.coordinator.assignment()
        if generation != self._generation:
            if self._shards:
                logger.warning("session changed: dropping %d shards (their claims are gone)", len(self._shards))
            for shard in list(self._shards):
                self._forget(shard)
            self._generation, self._desired = generation, None
        if desired is not self._desired:
            # Coordinators hand out the same set until the assignment changes: compared by identity, an
            # iteration costs nothing here, whatever the number of shards.
            changed = desired != self._desired
            self._desired = desired
            if changed:
                self._unclaimed = set(desired.difference(self._shards))
                self._next_claim = 0.0
                leaving = [s for s in self._shards if s not in desired]
                if leaving:
                    await self._release(leaving)
        now = self._clock()
        if self._unclaimed and self._next_claim <= now and self.coordinator.lease_valid() and not self._stopping:
            await self._claim(now)
        self._owned_gauge.set(len(self._shards))

    async def _claim(self, now: float) -> None:
        """Claim the assigned shards not owned yet whose retry time has come; one summary line."""
        wanted = sorted(s for s in self._unclaimed if self._claim_after.get(s, 0.0) <= now)
        if wanted and not self._shards and not self._reads.counts and not self._reads.polling:
            # A new worker's first count poll runs beside its claims: its shards are then read as they are
            # adopted, not after a poll of their own.
            self._poll_counts(now)
        results = await self._in_threads(self._claim_all, wanted)
        adopted: list[Claim] = []
        detail = logger.isEnabledFor(logging.DEBUG)  # asked once, not for each of thousands of shards
        for shard, claim in zip(wanted, results, strict=True):
            if isinstance(claim, Claim):
                adopted.append(claim)
                if detail:
                    logger.debug("shard %d claimed at location %d", shard, claim.location)
            else:
                if isinstance(claim, BaseException):
                    logger.debug("claim of shard %d failed: %s", shard, claim)
                self._claim_after[shard] = self._clock() + _CLAIM_RETRY
        self._adopt(adopted)
        self._next_claim = min((self._claim_after.get(s, 0.0) for s in self._unclaimed), default=0.0)
        if adopted:
            locations = [claim.location for claim in adopted]
            logger.info("%s: claimed %d shards at locations %d to %d; %d owned, %d assigned not claimed yet",
                        self.config.name, len(adopted), min(locations), max(locations), len(self._shards),
                        len(self._unclaimed))
        elif wanted:
            logger.debug("%s: none of %d shards could be claimed yet", self.config.name, len(wanted))

    def _claim_all(self, shards: list[int]) -> list[Claim | BaseException | None]:
        """(in a worker thread) Claims in order; a claim that fails is tried again later, as a refused one."""
        heads: dict[int, int] = {}  # start_from "now": the heads of all these shards in one read, if needed
        return self.coordinator.claim_many([(shard, self._initial_for(shard, shards, heads)) for shard in shards])

    def _release_all(self, claims: list[Claim]) -> list[None]:
        """(in a worker thread)"""
        self.coordinator.release_many(claims)
        return []

    async def _in_threads(self, work: Callable[[list[_T]], list[_R]], items: list[_T]) -> list[_R]:
        """``work`` over ``items`` in the coordinator's :attr:`~Coordinator.coordination_threads` chunks run in
        threads, results in order: a thread per item costs a hop per shard."""
        if not items:
            return []
        size = -(-len(items) // self.coordinator.coordination_threads)
        chunks = await asyncio.gather(*(asyncio.to_thread(work, items[i:i + size])
                                        for i in range(0, len(items), size)))
        return [result for chunk in chunks for result in chunk]

    def _initial_for(self, shard: int, claiming: list[int], heads: dict[int, int]) -> Callable[[], int]:
        """Where the shard starts when it has no committed offset (``initial`` of a claim)."""
        start = self.config.start_from

        def initial() -> int:
            if start == "beginning":
                return 0
            if start == "now":
                if shard not in heads:  # read once for every shard claimed with it, not once per shard
                    heads.update(self.store.heads(claiming))
                return heads[shard]
            assert isinstance(start, dt.datetime)
            return self.store.location_at(shard, start)
        return initial

    def _adopt(self, claims: list[Claim]) -> None:
        """Own the claimed shards, each from its claim's location (at 4096 shards, in one pass)."""
        now, shards, requeue = self._clock(), self._shards, self._reads.requeue
        for claim in claims:
            at = claim.location
            st = shards[claim.shard] = ShardState(claim, at, at, at, claim.deadlettered)
            requeue(st, now)
        taken = [claim.shard for claim in claims]
        self._unclaimed.difference_update(taken)
        if self._claim_after:
            for shard in taken:
                self._claim_after.pop(shard, None)
        self.metrics.add_shards(taken)

    def _forget(self, shard: int) -> None:
        self._shards.pop(shard, None)
        self._reads.forget(shard)
        if self._desired is not None and shard in self._desired and not self._stopping:
            self._unclaimed.add(shard)  # still assigned (e.g. a fenced commit): claimed again
            self._next_claim = 0.0
        self.metrics.forget_shard(shard)

    async def _release(self, shards: list[int]) -> None:
        """Hand shards over: wait for their acknowledgements, commit, drop the claims."""
        states = [self._shards[shard] for shard in shards]
        self.sink.abandon(shards)
        await self._drain(self.config.stop_timeout, states)
        kept = [st for st in states if self._shards.get(st.shard) is st]  # a fenced commit drops a shard
        await self._in_threads(self._release_all, [st.claim for st in kept])
        for st in kept:
            self._forget(st.shard)
            logger.debug("shard %d released at location %d", st.shard, st.committed)
        logger.info("%s: released %d shards (reassigned); %d owned", self.config.name, len(kept), len(self._shards))

    async def _drain(self, timeout: float, only: list[ShardState] | None = None) -> None:
        states = only if only is not None else list(self._shards.values())
        deadline = self._clock() + timeout
        while any(st.inflight for st in states) and self._clock() < deadline:
            futures = [p.future for st in states for p in st.inflight]
            await asyncio.wait(futures, timeout=max(0.01, deadline - self._clock()))
            await self._collect()  # nothing new is read while draining; a failure just rewinds
        if self._commit_task is not None:
            await asyncio.gather(self._commit_task, return_exceptions=True)  # one commit at a time
        await self._commit(states)

    # -- reading and sending --------------------------------------------------
    async def _read_and_send(self) -> bool:
        """Send the pages that arrived, then start the reads and the count poll that are due."""
        if not self._shards:
            return False
        busy = False
        for future in [f for f in self._running if f.done()]:
            shards, _reserved = self._running.pop(future)
            pages = decoded(future.result())
            # A read of many shards goes to a sink that takes delivery batches as one: a read of many shards
            # holds many pages of a few cells each, and a delivery per page would cost more than its cells.
            batch: list[tuple[ShardState, _Runs]] | None = (
                [] if self.sink.delivers_batches and len(shards) > 1 else None)
            touched: list[int] = []
            for shard in shards:
                st = self._shards.get(shard)
                if st is None or st.reading is not future:  # released meanwhile
                    continue
                st.reading = None
                touched.append(shard)
                if shard in pages and st.read_from == st.position:  # else a rewind made it stale
                    if batch is not None and (runs := self._plain_runs(st, pages[shard])) is not None:
                        batch.append((st, runs))
                    else:
                        busy = await self._send_page(st, *page_of(pages, shard)) or busy
            self._reads.touch(touched)
            if batch:
                busy = await self._send_batch(batch) or busy
        now = self._clock()
        running = sum(1 for future in self._running if not future.done())
        in_flight = self._unsettled + sum(reserved for _shards, reserved in self._running.values())
        for positions, limit in self._reads.next_reads(self._shards, now, running, in_flight):
            self._launch(positions, limit)
        if self._reads.poll_due(now, self._unsettled):
            self._poll_counts(now)
        return busy

    def _poll_counts(self, now: float) -> None:
        """Count the shards' cells and, in the same trip to a thread, read the new cells of each drained shard
        whose count moved: idle ones, and those whose last cells are still being acknowledged (under load an
        acknowledgement can take longer than a poll interval, and a cell landing meanwhile waited for it)."""
        all_idle = bool(self._shards) and not self._reads.live  # then a poll finding none moved proves them caught up
        acking, mark = self._reads.start_poll(now, self._unsettled)
        poll = _in_thread(self._counts_and_pages, acking, mark)
        poll.add_done_callback(lambda done: self._polled(done, all_idle, now))

    def _polled(self, done: asyncio.Future[CountPoll], all_idle: bool, started: float) -> None:
        self._wakeup.set()
        pages: asyncio.Future[Read] = asyncio.get_running_loop().create_future()
        if done.cancelled() or done.exception() is not None:  # a bug, not a store error: stop the worker
            pages.set_exception(done.exception() or asyncio.CancelledError())
            self._running[pages] = ((), 0)
            return
        answer, compared, read, cost = done.result()
        found = decoded(read)
        moved = self._reads.polled(answer, compared, found, cost, started, all_idle)
        counts, page_size = self._reads.counts, self.config.page_size
        for shard in moved:
            st = self._shards[shard]
            st.drained, st.count_seen = False, counts.get(shard)
            st.reading, st.read_from, st.read_limit, st.read_reserved = pages, compared[shard][1], page_size, 0
        pages.set_result(found)
        self._running[pages] = (tuple(moved), 0)

    def _counts_and_pages(self, acking: bool, mark: object | None) -> CountPoll:
        """(in a worker thread) The cell counts (every shard's without a ``mark``, else those that may have
        moved since it); the drained shards whose count moved, as this thread saw them
        (:meth:`ReadScheduler.moved`); their pages; and how long the counting took.

        The drained shards are compared here, after the count: a shard drained after the count compares its
        count then with this one's, and cells after this count are in the next poll's."""
        started = self._clock()
        try:
            answer = self.store.changed_counts(mark)
        except LogstoreError as exc:
            logger.warning("cannot read shard counts: %s", exc)
            return None, {}, {}, self._clock() - started
        moved = self._reads.moved(answer, acking)
        cost = self._clock() - started
        if not moved:
            return answer, moved, {}, cost
        positions = {shard: entry[1] for shard, entry in moved.items()}
        return answer, moved, self._fetch(positions, self.config.page_size), cost

    def _launch(self, positions: dict[int, int], limit: int) -> None:
        future = _in_thread(self._fetch, positions, limit)
        future.add_done_callback(lambda _f: self._wakeup.set())
        reserved = 0
        for shard, position in positions.items():
            st = self._shards[shard]
            st.reading, st.read_from, st.read_limit = future, position, limit
            if limit == 1:
                st.read_reserved = 1
            reserved += st.read_reserved
        self._running[future] = (tuple(positions), reserved)

    def _fetch(self, positions: dict[int, int], limit: int) -> Read:
        """(in a worker thread) Pages of several shards, read and not decoded (the loop decodes them: see
        :class:`logstore.UndecodedPages`); a failed read comes back as each shard's error."""
        try:
            # With packed_bodies the bodies go on as MessagePack: decompressed, never decoded.
            return self.store.read_pages(positions, limit, columns=self.config.columns,
                                         packed=self.sink.packed_bodies)
        except LogstoreError as exc:
            return dict.fromkeys(positions, exc)

    async def _send_page(self, st: ShardState, cells: Sequence[AnyCell], problem: BaseException | None) -> bool:
        if problem is not None and not isinstance(problem, CorruptCellError):
            self._failed(st, problem, "read")
            return False
        if not cells and problem is None:
            st.drained = True
            return False
        if not await self._send_cells(st, cells):
            return True
        if isinstance(problem, CorruptCellError):
            where = {"row_key": str(problem.row_key), "column": problem.column, "ref_key": problem.ref_key,
                     "added_id": problem.added_id, "shard": st.shard,
                     "created_at": problem.created_at.isoformat() if problem.created_at else None}
            logger.error("shard %d: %s; dead-lettered", st.shard, problem)
            await self._send_deadletter(st, where, self.sink.destination(problem.column or "unknown"), problem,
                                        "decode")
        elif len(cells) < st.read_limit and not isinstance(cells, TruncatedPage):
            st.drained = True
        return True

    def _plain_runs(self, st: ShardState, page: Sequence[AnyCell] | LogstoreError) -> _Runs | None:
        """A page's runs of one column as (cells, what the sink accepted), when nothing in it needs more than a
        delivery: no read error, no cell to pass over or dead-letter, no column new to the sink, no failed
        delivery or refused cell in the shard. None sends the page alone (:meth:`_send_page`), as it does a page
        cut short by the read's byte budget (rare: a read of over 16 MiB), which alone tells it from the log's end."""
        if (isinstance(page, LogstoreError | TruncatedPage) or not page or st.shard in self._failing
                or st.acked < st.singles_until):
            return None
        runs: _Runs = []
        column = ""
        accept, prepared, everything = self.sink.accept, self._prepared, self.config.columns is None
        try:
            for cell in page:
                if cell.column != column:
                    column = cell.column
                    if (everything and column[0] == "_") or column not in prepared:
                        return None
                    cells: list[AnyCell] = []
                    items: list[Any] = []
                    runs.append((cells, items))
                items.append(accept(cell))
                cells.append(cell)
        except (TypeError, ValueError, PublishError):
            return None  # sent alone, which dead-letters the cell
        return runs

    async def _send_batch(self, batch: list[tuple[ShardState, _Runs]]) -> bool:
        """Deliver the plain pages of several shards as one delivery batch, with a callback for each distinct
        future (a record batch holds the pages of many shards), not one for each page."""
        try:
            sent = await self.sink.deliver_batch(
                [(st.shard, cells[0].column, items) for st, runs in batch for cells, items in runs])
        except PublishError as exc:
            for st, runs in batch:
                if not exc.retriable:  # refused as a whole: each shard finds the culprit alone
                    st.singles_until = max(st.singles_until, runs[-1][0][-1].added_id)
                self._failed(st, exc, "publish")
            return False
        # Each distinct future: the shards it covers and its messages. Runs in a row mostly share one (a
        # partition's record batch, a handler job): the last one is kept at hand.
        waiters: dict[asyncio.Future[Any], list[Any]] = {}
        last: asyncio.Future[Any] | None = None
        waiter: list[Any] = []
        topics: dict[str, str] = {}
        per_run = iter(sent)
        for st, runs in batch:
            read = 0
            for cells, _items in runs:
                column = cells[0].column
                if (topic := topics.get(column)) is None:
                    topic = topics[column] = self.sink.destination(column)
                at = 0
                for future, count in next(per_run):
                    st.inflight.append(Pending(cells[at + count - 1].added_id, future, cells[at], topic, False, count))
                    at += count
                    if future is not last:
                        if (found := waiters.get(future)) is None:
                            found = waiters[future] = [{}, 0]
                        waiter, last = found, future
                    waiter[0][st.shard] = None
                    waiter[1] += count
                read += at
            st.position = st.inflight[-1].added_id
            if read < st.read_limit:
                st.drained = True
        for future, (shards, messages) in waiters.items():
            self._unsettled += messages
            future.add_done_callback(functools.partial(self._settled, tuple(shards), messages),
                                     context=self._callback_context)
        return True

    async def _send_cells(self, st: ShardState, cells: Sequence[AnyCell]) -> bool:
        """Deliver cells in order: each run of cells of one column together, and a cell the sink does
        not accept as a dead letter in its place. False once the shard failed."""
        run: list[tuple[AnyCell, Any]] = []
        for cell in cells:
            if cell.column[0] == "_" and self.config.columns is None:
                if not await self._send_run(st, run):
                    return False
                run = []
                self._pass_over(st, cell)
                continue
            if run and run[0][0].column != cell.column:
                if not await self._send_run(st, run):
                    return False
                run = []
            if cell.column not in self._prepared:
                try:
                    await self.sink.prepare(cell.column)
                except (TailerError, ConfigurationError) as exc:
                    self._failed(st, exc, "topic")
                    return False
                self._prepared.add(cell.column)
            try:
                run.append((cell, self.sink.accept(cell)))
                continue
            except (TypeError, ValueError, PublishError) as exc:
                problem: BaseException = exc
            if not await self._send_run(st, run):
                return False
            run = []
            stage = "publish" if isinstance(problem, PublishError) else "encode"
            logger.error("shard %d: cell at added_id %d cannot be delivered (%s); dead-lettered",
                         st.shard, cell.added_id, problem)
            if not await self._send_deadletter(st, cell.coordinates(), self.sink.destination(cell.column), problem,
                                               stage):
                return False
        return await self._send_run(st, run)

    def _pass_over(self, st: ShardState, cell: AnyCell) -> None:
        """Acknowledge a cell of a reserved column without delivering it: cellstream's own data (dead-letter
        entries with their bodies and tracebacks, catalogs, offsets) reaches a sink only when its column is
        named in ``columns``. Consecutive ones share one acknowledgement, in the shard's order."""
        last = st.inflight[-1] if st.inflight else None
        if last is not None and last.messages == 0:  # passing over already: move it past this cell too
            st.inflight[-1] = last._replace(added_id=cell.added_id)
            st.position = cell.added_id
            return
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        future.set_result(None)
        self._track(st, Pending(cell.added_id, future, cell, cell.column, False, 0))

    async def _send_run(self, st: ShardState, run: list[tuple[AnyCell, Any]]) -> bool:
        if not run:
            return True
        if self._broken(st) is not None:  # _collect rewinds the shard next; the page is read again from there
            logger.debug("shard %d: a delivery failed; cells from added_id %d wait for the rewind", st.shard,
                         run[0][0].added_id)
            return False
        first = run[0][0]
        topic = self.sink.destination(first.column)
        try:
            sent = await self.sink.deliver(st.shard, first.column, [item for _, item in run])
        except PublishError as exc:
            if exc.retriable:
                self._failed(st, exc, "publish")
                return False
            if len(run) == 1:
                logger.error("shard %d: cell at added_id %d rejected (%s); dead-lettered", st.shard,
                             first.added_id, exc)
                return await self._send_deadletter(st, first.coordinates(), topic, exc, "publish")
            st.singles_until = max(st.singles_until, run[-1][0].added_id)  # find the culprit alone
            self._failed(st, exc, "publish")
            return False
        at = 0
        for future, count in sent:
            self._track(st, Pending(run[at + count - 1][0].added_id, future, run[at][0], topic, False, count))
            at += count
        return True

    async def _send_deadletter(
        self, st: ShardState, where: dict[str, Any], topic: str, error: BaseException, stage: str
    ) -> bool:
        if self._broken(st) is not None:
            return False
        record = deadletter_record(where, topic=topic, error=error, stage=stage, tailer=self.config.name,
                                   worker=self.coordinator.worker_id)
        try:
            future = await self.sink.deadletter(st.shard, record)
        except PublishError as exc:
            self._failed(st, exc, "dead-letter")
            return False
        st.last_error = {"added_id": where["added_id"], "stage": stage, "error": f"{type(error).__name__}: {error}",
                         "at": dt.datetime.now(dt.UTC).isoformat()}
        self._track(st, Pending(int(where["added_id"]), future, where, topic, True))
        return True

    def _track(self, st: ShardState, pending: Pending) -> None:
        st.inflight.append(pending)
        st.position = pending.added_id
        self._unsettled += pending.messages
        pending.future.add_done_callback(functools.partial(self._settled, (st.shard,), pending.messages),
                                         context=self._callback_context)

    def _settled(self, shards: tuple[int, ...], messages: int, future: asyncio.Future[Any]) -> None:
        # The exception is retrieved here (a rewind may drop the future unread) and marks the shards for _broken.
        if future.cancelled() or future.exception() is not None:
            self._failing.update(shards)
        self._unsettled -= messages
        self._acked.update(shards)  # _collect looks at the shards whose deliveries settled, not at every shard
        self._wakeup.set()

    def _take_acked(self) -> list[ShardState]:
        """The owned shards whose deliveries settled since the last call; they are placed again after."""
        acked, self._acked = self._acked, set()
        self._reads.touch(acked)
        self._to_commit |= acked
        return [st for shard in acked if (st := self._shards.get(shard)) is not None]

    def _broken(self, st: ShardState) -> Pending | None:
        """The shard's first in-flight delivery that has failed already, if any.

        Until _collect has rewound the shard past it, no more of the shard may go to the sink:
        failures are collected in order and only after the loop's sends, and one of them may have
        restarted the sink's client (KafkaPublisher: a new producer id, sequence numbers from 0),
        which delivers a later page at once while the failed cells are still to be resent.
        """
        if st.shard not in self._failing:  # the common case, without a walk through what is in flight
            return None
        return next((p for p in st.inflight
                     if p.future.done() and (p.future.cancelled() or p.future.exception() is not None)), None)

    def _failed(self, st: ShardState, exc: BaseException, stage: str) -> None:
        """Back off and resend this shard from its last acknowledged cell."""
        if st.backoff is None:
            st.backoff = _BACKOFF.delays()
        delay = next(st.backoff)
        st.retry_at = self._clock() + delay
        if stage != "read":  # a failed read sent nothing: what is in flight stays valid
            self._reads.rewound(st.shard)  # no longer drained at that position: no count poll may read it
            st.position = st.acked
            st.inflight.clear()
            st.drained = False
        st.last_error = {"added_id": st.acked + 1 if stage != "read" else None, "stage": stage,
                         "error": f"{type(exc).__name__}: {exc}", "at": dt.datetime.now(dt.UTC).isoformat()}
        self.metrics.delivery_failures.labels(self.config.name).inc()
        # A refusal the sink has logged for its whole topic (every shard of the column meets it) is not repeated.
        level = logging.DEBUG if isinstance(exc, TopicPartitionsError) and exc.logged else logging.WARNING
        logger.log(level, "shard %d: %s failed (%s); resending from %d in %.2fs", st.shard, stage, exc, st.acked, delay)

    # -- acknowledgements -----------------------------------------------------
    async def _collect(self) -> bool:
        progressed = False
        published = 0
        for st in self._take_acked():
            while st.inflight:
                pending = st.inflight[0]
                if not pending.future.done():
                    # A later delivery failed while earlier ones are under way: the shard rewinds now, as
                    # if they had failed too, instead of refusing its pages (_broken) until they settle.
                    failed = self._broken(st)
                    if failed is None:
                        break
                    pending = failed
                st.inflight.remove(pending)
                future = pending.future
                exc = future.exception() if not future.cancelled() else asyncio.CancelledError()
                if exc is None:
                    st.acked = pending.added_id
                    st.backoff = None
                    progressed = True
                    if pending.deadletter:
                        st.deadlettered += 1
                        self.metrics.deadlettered.labels(self.config.name).inc()
                    else:
                        published += pending.messages
                    continue
                await self.sink.after_failure(exc, future)
                error = self.sink.translate(exc)
                if not error.retriable and not pending.deadletter:
                    if st.acked < st.singles_until and not st.inflight:
                        # Alone in its request and still refused: this cell is the problem.
                        logger.error("shard %d: cell at added_id %d refused by the broker (%s); dead-lettered",
                                     st.shard, pending.added_id, error)
                        st.position = st.acked
                        await self._send_deadletter(st, pending.where, pending.topic, error, "publish")
                        break
                    # The refused batch may hold several of this shard's cells: resend each alone.
                    last = st.inflight[-1].added_id if st.inflight else pending.added_id
                    st.singles_until = max(st.singles_until, last)
                self._failed(st, error, "publish")
                break
            self._failing.discard(st.shard)  # no failed delivery is left in flight: rewound past, or none
        if published:
            self.metrics.published.labels(self.config.name).inc(published)
        return progressed

    async def _commit(self, states: list[ShardState] | None = None) -> None:
        if states is None:  # the shards acknowledged since their last commit, not every owned shard
            candidates, self._to_commit = self._to_commit, set()
            states = [st for shard in candidates if (st := self._shards.get(shard)) is not None]
        todo = {st.shard: (st.claim, Offset(st.acked, st.deadlettered, st.last_error)) for st in states
                if st.acked > st.committed or st.deadlettered != st.claim.deadlettered}
        if not todo:
            return
        committed = 0
        try:
            committed = await self._commit_todo(todo)
        finally:
            if committed < len(todo):  # whatever did not commit (deferred, skipped, failed): at the next commit
                self._to_commit.update(
                    s for s, (_claim, offset) in todo.items() if (st := self._shards.get(s)) is not None
                    and (st.committed < offset.location or st.claim.deadlettered != offset.deadlettered))

    async def _commit_todo(self, todo: dict[int, tuple[Claim, Offset]]) -> int:
        """Commit ``todo``; return how many of its shards committed."""
        try:
            await self.sink.before_commit()
        except PublishError as exc:
            if not exc.retriable:
                logger.error("%s: the sink cannot make acknowledged cells durable (%s); stopping", self.config.name,
                             exc)
                self.error = exc
                self._wakeup.set()
                return 0
            logger.warning("%s: commit skipped, the sink did not flush: %s", self.config.name, exc)
            return 0
        results = await asyncio.to_thread(self.coordinator.commit, todo)
        committed, fenced, deferred = 0, [], []
        for shard, result in results.items():
            st = self._shards.get(shard)
            if st is None or st.claim is not todo[shard][0]:
                continue  # dropped, or claimed afresh (an offsets reset) while this commit was under way
            if isinstance(result, Claim):
                st.claim, st.committed = result, todo[shard][1].location
                committed += 1
            elif isinstance(result, FencedError):
                logger.debug("%s: stopping it", result)
                fenced.append(result)
                self._forget(shard)
            else:
                logger.debug("commit of shard %d deferred: %s", shard, result)
                deferred.append(result)
        # One line per outcome, not per shard: a takeover or an outage concerns thousands at once.
        if committed:
            self.metrics.commits.labels(self.config.name).inc(committed)
        if fenced:
            logger.error("%s: %d shards fenced, no longer published by this worker (e.g. %s)", self.config.name,
                         len(fenced), fenced[0])
        if deferred:
            logger.info("%s: commits of %d shards deferred (e.g. %s)", self.config.name, len(deferred), deferred[0])
        return committed
