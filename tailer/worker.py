"""The tailer worker: reads the shard logs it owns and publishes them, at least once, in order.

Per shard the worker keeps three positions (added_ids): ``position`` (read and
handed to the publisher), ``acked`` (every cell up to it acknowledged, or
dead-lettered and the dead letter acknowledged) and ``committed`` (stored by the
coordinator). Only ``acked`` is ever committed, so a crash replays at most the
cells after the last commit. A failed delivery rewinds ``position`` to ``acked``
and resends from there, so a shard's cells reach the topic in added_id order
(a replay repeats a suffix, never reorders). A cell that can never be published
(too large, undecodable) goes to the dead-letter topic and is counted in the
committed offset; nothing is skipped without a record.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import time
from typing import Any

from logstore import CorruptCellError, LogstoreError, Store
from logstore.cell import Cell
from logstore.retry import RetryPolicy

from .config import TailerConfig
from .errors import FencedError, PublishError, TailerError
from .interfaces import Claim, Coordinator, Offset, Publisher
from .messages import Message, coordinates, encode_deadletter
from .metrics import TailerMetrics
from .shardstate import Look, Pages, Pending, ShardState, page_of
from .status import lag_of

logger = logging.getLogger(__name__)
_BACKOFF = RetryPolicy(initial=0.1, maximum=5.0, deadline=None)
_CLAIM_RETRY = 0.5


class Tailer:
    """One worker of the tailer ``config.name``. ``async with Tailer(...)`` or start()/stop()."""

    def __init__(
        self,
        store: Store,
        config: TailerConfig,
        coordinator: Coordinator,
        publisher: Publisher,
        metrics: TailerMetrics | None = None,
        clock: Any = time.monotonic,
    ) -> None:
        self.store = store
        self.config = config
        self.coordinator = coordinator
        self.publisher = publisher
        self.metrics = metrics or TailerMetrics(config.name)
        self._clock = clock
        self._shards: dict[int, ShardState] = {}
        self._generation: int | None = None
        self._claim_after: dict[int, float] = {}
        self._counts: dict[int, int] = {}
        self._looked_at = -1e9
        self._counts_at = -1e9  # when the look that read self._counts started
        self._looking: asyncio.Future[Look] | None = None
        self._wakeup = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._lag_task: asyncio.Task[None] | None = None
        self._commit_task: asyncio.Task[None] | None = None
        self._batches: set[asyncio.Future[Pages]] = set()
        self._read_turn = 0
        self._poll = config.poll_interval
        self._stopping = False
        self._state = "new"
        self._paused = False
        self._topics: set[str] = set()
        self.error: BaseException | None = None

    # -- lifecycle ------------------------------------------------------------
    async def start(self) -> None:
        if self._state != "new":
            return
        self._state = "starting"
        self._loop = asyncio.get_running_loop()
        await self.publisher.start()
        await self._topic(self.config.deadletter_topic)
        for column in self.config.columns or ():
            await self._topic(self.config.topic(column))
        self.coordinator.start(self._changed)
        self._task = asyncio.create_task(self._run(), name=f"tailer-{self.config.name}")
        self._state = "running"

    async def stop(self) -> None:
        """Stop reading, wait for acknowledgements, commit, release the shards. Safe twice."""
        if self._state in ("stopping", "stopped"):
            return
        was_running = self._state == "running"
        self._state = "stopping"
        self._stopping = True
        self._wakeup.set()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        for task in (self._lag_task, self._commit_task):
            if task is not None:
                await asyncio.gather(task, return_exceptions=True)
        if was_running:
            for shard in self._shards:
                self.publisher.abandon(shard % self.config.partitions)
            await self._drain(self.config.stop_timeout)
            for shard in list(self._shards):
                await asyncio.to_thread(self.coordinator.release, self._shards.pop(shard).claim)
        await asyncio.to_thread(self.coordinator.stop)
        await self.publisher.stop()
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
        counted by a look that started at or after ``since`` (a ``clock()`` reading)."""
        _generation, _epoch, desired = self.coordinator.assignment()
        if self._counts_at < since or set(desired) != set(self._shards):
            return False
        return all(st.drained and not st.inflight and st.reading is None and st.acked == st.position
                   and st.count_seen == self._counts.get(shard) for shard, st in self._shards.items())

    def positions(self) -> dict[int, tuple[int, int, int]]:
        """(position, acked, committed) of every owned shard."""
        return {s: (st.position, st.acked, st.committed) for s, st in self._shards.items()}

    # -- the loop -------------------------------------------------------------
    async def _run(self) -> None:
        now = self._clock()
        next_commit, next_lag = now + self.config.commit_interval, now
        try:
            while not self._stopping:
                self._wakeup.clear()
                await self._sync_ownership()
                busy = False
                lease = self.coordinator.lease_valid()
                self.metrics.lease_valid.labels(self.config.name).set(int(lease))
                self.metrics.leader.labels(self.config.name).set(int(self.coordinator.is_leader()))
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
                if now >= next_lag and (self._lag_task is None or self._lag_task.done()):
                    self._lag_task = asyncio.create_task(self._measure_lag())
                    next_lag = now + self.config.lag_interval
                if not busy:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wakeup.wait(), self._poll)
        except Exception as exc:
            self.error = exc
            logger.exception("tailer worker failed")
            raise

    # -- ownership ------------------------------------------------------------
    async def _sync_ownership(self) -> None:
        generation, _epoch, desired = self.coordinator.assignment()
        if generation != self._generation:
            if self._shards:
                logger.warning("session changed: dropping %d shards (their claims are gone)", len(self._shards))
            for shard in list(self._shards):
                self._forget(shard)
            self._generation = generation
        for shard in [s for s in self._shards if s not in desired]:
            if shard in self._shards:  # a fenced commit may drop it while another shard is released
                await self._release(shard)
        wanted = [s for s in sorted(desired) if s not in self._shards
                  and self._claim_after.get(s, 0.0) <= self._clock()]
        if wanted and self.coordinator.lease_valid() and not self._stopping:
            claims = await asyncio.gather(*(asyncio.to_thread(self.coordinator.claim, s, self._initial_for(s))
                                            for s in wanted), return_exceptions=True)
            for shard, claim in zip(wanted, claims, strict=True):
                if isinstance(claim, Claim):
                    self._adopt(claim)
                else:
                    if isinstance(claim, BaseException):
                        logger.debug("claim of shard %d failed: %s", shard, claim)
                    self._claim_after[shard] = self._clock() + _CLAIM_RETRY
        self.metrics.owned_shards.labels(self.config.name).set(len(self._shards))

    def _initial_for(self, shard: int) -> Any:
        start = self.config.start_from

        def initial() -> int:
            if start == "beginning":
                return 0
            if start == "now":
                return self.store.head(shard)
            assert isinstance(start, dt.datetime)
            return self.store.location_at(shard, start)
        return initial

    def _adopt(self, claim: Claim) -> None:
        self._claim_after.pop(claim.shard, None)
        at = claim.location
        self._shards[claim.shard] = ShardState(claim, at, at, at, claim.deadlettered)
        logger.info("shard %d claimed at location %d", claim.shard, claim.location)

    def _forget(self, shard: int) -> None:
        self._shards.pop(shard, None)
        self.metrics.forget_shard(shard)

    async def _release(self, shard: int) -> None:
        """Hand the shard over: wait for its acknowledgements, commit, drop the claim."""
        st = self._shards[shard]
        self.publisher.abandon(shard % self.config.partitions)
        await self._drain(self.config.stop_timeout, only=st)
        if st.shard in self._shards:
            await asyncio.to_thread(self.coordinator.release, st.claim)
            self._forget(shard)
            logger.info("shard %d released at location %d", shard, st.committed)

    async def _drain(self, timeout: float, only: ShardState | None = None) -> None:
        states = [only] if only is not None else list(self._shards.values())
        deadline = self._clock() + timeout
        while any(st.inflight for st in states) and self._clock() < deadline:
            futures = [p.future for st in states for p in st.inflight]
            await asyncio.wait(futures, timeout=max(0.01, deadline - self._clock()))
            await self._collect()  # nothing new is read while draining; a failure just rewinds
        if self._commit_task is not None:
            await asyncio.gather(self._commit_task, return_exceptions=True)  # one commit at a time
        await self._commit(states)

    # -- reading and sending --------------------------------------------------
    async def _topic(self, topic: str) -> None:
        if topic not in self._topics:
            await self.publisher.prepare_topic(topic, self.config.partitions, self.config.replication_factor)
            self._topics.add(topic)

    async def _read_and_send(self) -> bool:
        """Send the pages that arrived, then start the reads and the look at idle shards that are due."""
        if not self._shards:
            return False
        busy = False
        for st in list(self._shards.values()):
            if st.reading is not None and st.reading.done():
                pages, st.reading = st.reading.result(), None
                if st.shard not in pages:  # a look that found nothing new: still drained
                    continue
                if st.drained:  # its count moved: the look read its new cells
                    st.drained, st.count_seen = False, self._counts.get(st.shard)
                if st.read_from == st.position and st.shard in self._shards:  # else a rewind made it stale
                    busy = await self._send_page(st, *page_of(pages, st.shard)) or busy
        now = self._clock()
        self._start_reads(now)
        if now - self._looked_at >= self._poll and (self._looking is None or self._looking.done()):
            self._look(now)
        return busy

    def _look(self, now: float) -> None:
        """Read the shard counts and, in the same trip, the new cells of every drained shard whose count moved."""
        idle = {st.shard: (st.count_seen, st.position) for st in self._shards.values()
                if st.drained and st.reading is None and st.retry_at <= now}
        self._looked_at = now
        self._looking = asyncio.ensure_future(asyncio.to_thread(self._counts_and_pages, idle))
        pages: asyncio.Future[Pages] = asyncio.get_running_loop().create_future()
        self._looking.add_done_callback(lambda done: self._looked(done, pages, now))
        for shard, (_seen, position) in idle.items():
            st = self._shards[shard]
            st.reading, st.read_from, st.read_limit, st.read_reserved = pages, position, self.config.page_size, 0

    def _looked(self, done: asyncio.Future[Look], pages: asyncio.Future[Pages], started: float) -> None:
        self._wakeup.set()
        if done.cancelled() or done.exception() is not None:  # a bug, not a store error: stop the worker
            pages.set_exception(done.exception() or asyncio.CancelledError())
            return
        counts, found = done.result()
        if counts is not None:
            self._counts, self._counts_at = counts, started
        busy = bool(found) or any(not st.drained or st.inflight for st in self._shards.values())
        self._poll = self.config.poll_interval if busy else min(self._poll * 2, self.config.idle_poll_interval)
        pages.set_result(found)

    def _counts_and_pages(self, idle: dict[int, tuple[int | None, int]]) -> Look:
        """(in a worker thread) The cell count of every shard, and pages of the idle shards whose count moved."""
        try:
            counts = {info.shard: info.cells for info in self.store.shard_stats()}
        except LogstoreError as exc:
            logger.warning("cannot read shard counts: %s", exc)
            return None, {}
        moved = {shard: position for shard, (seen, position) in idle.items() if counts.get(shard) != seen}
        return counts, (self._fetch(moved, self.config.page_size) if moved else {})

    def _start_reads(self, now: float) -> None:
        """Read the next page of every shard that is not drained, several shards per query.

        A shard reserves a page (at its first read, no more than its cell count), and
        shards are grouped until a query reserves about a page: a busy shard is read
        alone, many small ones together. At most ``read_ahead`` queries run at once,
        within ``max_in_flight`` messages. Drained shards are left to ``_look``.
        """
        self._batches = {b for b in self._batches if not b.done()}
        in_flight = sum(len(st.inflight) + (st.read_reserved if st.reading else 0) for st in self._shards.values())
        batch: dict[int, int] = {}
        singles: dict[int, int] = {}
        reserved = 0
        states = list(self._shards.values())
        first = self._read_turn % len(states)  # round robin: busy shards early in the map must not starve the rest
        for turn, st in enumerate(states[first:] + states[:first], start=first + 1):
            if len(self._batches) >= self.config.read_ahead or in_flight >= self.config.max_in_flight:
                break
            expected = self._next_read(st, now)
            if expected is None:
                continue
            if st.acked < st.singles_until:  # isolating a refused cell: one message at a time
                if not st.inflight:
                    singles[st.shard] = st.position
                continue
            batch[st.shard] = st.position
            self._read_turn = turn
            st.read_reserved = min(expected, self.config.page_size)
            reserved += st.read_reserved
            in_flight += st.read_reserved
            if reserved >= self.config.page_size:
                self._launch(batch, self.config.page_size)
                batch, reserved = {}, 0
        if batch:
            self._launch(batch, self.config.page_size)
        if singles:
            self._launch(singles, 1)

    def _next_read(self, st: ShardState, now: float) -> int | None:
        """How many cells a read of the shard may bring (None: not now)."""
        if st.reading is not None or st.drained or st.retry_at > now or self._stopping:
            return None
        if st.count_seen is None:  # its first read, once the first look has counted the shards
            if st.shard not in self._counts:
                return None
            count = st.count_seen = self._counts[st.shard]
            if count == 0:  # an empty shard: nothing to read until its count moves
                st.drained = True
                return None
            return count
        return self.config.page_size

    def _launch(self, positions: dict[int, int], limit: int) -> None:
        future = asyncio.ensure_future(asyncio.to_thread(self._fetch, positions, limit))
        future.add_done_callback(lambda _f: self._wakeup.set())
        self._batches.add(future)
        for shard, position in positions.items():
            st = self._shards[shard]
            st.reading, st.read_from, st.read_limit = future, position, limit
            if limit == 1:
                st.read_reserved = 1

    def _fetch(self, positions: dict[int, int], limit: int) -> Pages:
        """(in a worker thread) Pages of several shards; a failed read comes back as each shard's error."""
        try:
            return dict(self.store.get_cells_for_shards(positions, limit, columns=self.config.columns))
        except LogstoreError as exc:
            return dict.fromkeys(positions, exc)

    async def _send_page(self, st: ShardState, cells: list[Cell], problem: BaseException | None) -> bool:
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
            await self._send_deadletter(st, where, self.config.topic(problem.column or "unknown"), problem, "decode")
        elif len(cells) < st.read_limit:
            st.drained = True
        return True

    async def _send_cells(self, st: ShardState, cells: list[Cell]) -> bool:
        """Publish cells in order: each run of cells for one topic as record batches, and a cell
        that cannot be encoded or sent as a dead letter in its place. False once the shard failed."""
        run: list[tuple[Cell, Message]] = []
        for cell in cells:
            topic = self.config.topic(cell.column)
            if run and run[0][0].column != cell.column:
                if not await self._send_run(st, run):
                    return False
                run = []
            problem: BaseException | None = None
            try:
                if topic not in self._topics:
                    await self._topic(topic)
                message = self.publisher.encode(cell, self.config.value_format)
                problem = self.publisher.refuses(message)
            except TailerError as exc:
                self._failed(st, exc, "topic")
                return False
            except (TypeError, ValueError) as exc:
                problem = exc
            if problem is None:
                run.append((cell, message))
                continue
            if not await self._send_run(st, run):
                return False
            run = []
            stage = "publish" if isinstance(problem, PublishError) else "encode"
            logger.error("shard %d: cell at added_id %d cannot be published (%s); dead-lettered",
                         st.shard, cell.added_id, problem)
            if not await self._send_deadletter(st, coordinates(cell), topic, problem, stage):
                return False
        return await self._send_run(st, run)

    async def _send_run(self, st: ShardState, run: list[tuple[Cell, Message]]) -> bool:
        if not run:
            return True
        first, topic = run[0][0], self.config.topic(run[0][0].column)
        try:
            sent = await self.publisher.send_many(topic, st.shard % self.config.partitions, [m for _, m in run])
        except PublishError as exc:
            if exc.retriable:
                self._failed(st, exc, "publish")
                return False
            if len(run) == 1:
                logger.error("shard %d: cell at added_id %d rejected (%s); dead-lettered", st.shard,
                             first.added_id, exc)
                return await self._send_deadletter(st, coordinates(first), topic, exc, "publish")
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
        message = encode_deadletter(where, topic=topic, error=error, stage=stage, tailer=self.config.name,
                                    worker=self.coordinator.worker_id)
        try:
            future = await self.publisher.send(self.config.deadletter_topic, st.shard % self.config.partitions,
                                               message.key, message.value, message.headers)
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
        pending.future.add_done_callback(self._settled)

    def _settled(self, future: asyncio.Future[Any]) -> None:
        if not future.cancelled():
            future.exception()  # retrieved here: a rewind may drop the future unread
        self._wakeup.set()

    def _failed(self, st: ShardState, exc: BaseException, stage: str) -> None:
        """Back off and resend this shard from its last acknowledged cell."""
        if st.backoff is None:
            st.backoff = _BACKOFF.delays()
        delay = next(st.backoff)
        st.retry_at = self._clock() + delay
        if stage != "read":  # a failed read sent nothing: what is in flight stays valid
            st.position = st.acked
            st.inflight.clear()
            st.drained = False
        st.last_error = {"added_id": st.acked + 1 if stage != "read" else None, "stage": stage,
                         "error": f"{type(exc).__name__}: {exc}", "at": dt.datetime.now(dt.UTC).isoformat()}
        self.metrics.delivery_failures.labels(self.config.name).inc()
        logger.warning("shard %d: %s failed (%s); resending from %d in %.2fs",
                       st.shard, stage, exc, st.acked, delay)

    # -- acknowledgements -----------------------------------------------------
    async def _collect(self) -> bool:
        progressed = False
        published = 0
        for st in list(self._shards.values()):
            while st.inflight and st.inflight[0].future.done():
                pending = st.inflight.popleft()
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
                await self.publisher.after_failure(exc, future)
                error = self.publisher.translate(exc)
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
        if published:
            self.metrics.published.labels(self.config.name).inc(published)
        return progressed

    async def _commit(self, states: list[ShardState] | None = None) -> None:
        todo = {st.shard: (st.claim, Offset(st.acked, st.deadlettered, st.last_error))
                for st in (states if states is not None else self._shards.values())
                if st.acked > st.committed or st.deadlettered != st.claim.deadlettered}
        if not todo:
            return
        try:
            await self.publisher.before_commit()
        except PublishError as exc:
            if not exc.retriable:
                logger.error("%s: the sink cannot make acknowledged cells durable (%s); stopping", self.config.name,
                             exc)
                self.error = exc
                self._wakeup.set()
                return
            logger.warning("%s: commit skipped, the sink did not flush: %s", self.config.name, exc)
            return
        results = await asyncio.to_thread(self.coordinator.commit, todo)
        for shard, result in results.items():
            st = self._shards.get(shard)
            if st is None:
                continue
            if isinstance(result, Claim):
                st.claim, st.committed = result, todo[shard][1].location
                self.metrics.commits.labels(self.config.name).inc()
            elif isinstance(result, FencedError):
                logger.error("%s: stopping it", result)
                self._forget(shard)
            else:
                logger.info("commit of shard %d deferred: %s", shard, result)

    # -- lag ------------------------------------------------------------------
    async def _measure_lag(self) -> None:
        for st in list(self._shards.values()):
            if st.drained and not st.inflight and st.count_seen == self._counts.get(st.shard):
                st.lag_cells, st.lag_seconds = 0, 0.0
            else:
                try:
                    st.lag_cells, st.lag_seconds = await asyncio.to_thread(lag_of, self.store, st.shard, st.acked)
                except LogstoreError as exc:
                    logger.debug("lag of shard %d unknown: %s", st.shard, exc)
                    continue
            self.metrics.lag_cells.labels(self.config.name, str(st.shard)).set(st.lag_cells)
            self.metrics.lag_seconds.labels(self.config.name, str(st.shard)).set(st.lag_seconds)

