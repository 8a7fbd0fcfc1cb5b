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
import dataclasses
import datetime as dt
import logging
import time
from collections import deque
from collections.abc import Iterator
from typing import Any, NamedTuple

from logstore import CorruptCellError, LogstoreError, Store
from logstore.cell import Cell
from logstore.retry import RetryPolicy

from .config import TailerConfig
from .errors import FencedError, PublishError, TailerError
from .interfaces import Claim, Coordinator, Offset, Publisher
from .messages import coordinates, encode_cell, encode_deadletter
from .metrics import TailerMetrics

logger = logging.getLogger(__name__)
_BACKOFF = RetryPolicy(initial=0.1, maximum=5.0, deadline=None)
_CLAIM_RETRY = 0.5


class _Pending(NamedTuple):
    added_id: int
    future: asyncio.Future[Any]
    source: Cell | dict[str, Any]  # the cell, or a dead letter's coordinates
    topic: str
    deadletter: bool

    @property
    def where(self) -> dict[str, Any]:
        return coordinates(self.source) if isinstance(self.source, Cell) else self.source


@dataclasses.dataclass
class _Shard:
    claim: Claim
    position: int
    acked: int
    committed: int
    deadlettered: int
    inflight: deque[_Pending] = dataclasses.field(default_factory=deque)
    last_error: dict[str, Any] | None = None
    retry_at: float = 0.0
    backoff: Iterator[float] | None = None
    singles_until: int = 0  # after a refused batch: one message at a time until this is acked
    count_seen: int | None = None
    drained: bool = False
    lag_cells: int = 0
    lag_seconds: float = 0.0
    reading: asyncio.Future[tuple[list[Cell], BaseException | None]] | None = None
    read_from: int = 0
    read_limit: int = 0

    @property
    def shard(self) -> int:
        return self.claim.shard


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
        self._shards: dict[int, _Shard] = {}
        self._generation: int | None = None
        self._claim_after: dict[int, float] = {}
        self._counts: dict[int, int] = {}
        self._counts_at = 0.0
        self._wakeup = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._lag_task: asyncio.Task[None] | None = None
        self._stopping = False
        self._state = "new"
        self._paused = False
        self._topics: set[str] = set()
        self._reads = 0  # page reads under way, and messages in flight or about to be (this pass)
        self._in_flight = 0
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
        if self._lag_task is not None:
            await asyncio.gather(self._lag_task, return_exceptions=True)
        if was_running:
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
                if now >= next_commit:
                    await self._commit()
                    next_commit = now + self.config.commit_interval
                if now >= next_lag and (self._lag_task is None or self._lag_task.done()):
                    self._lag_task = asyncio.create_task(self._measure_lag())
                    next_lag = now + self.config.lag_interval
                if not busy:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wakeup.wait(), self.config.poll_interval)
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
        self._shards[claim.shard] = _Shard(claim, claim.location, claim.location, claim.location, claim.deadlettered)
        logger.info("shard %d claimed at location %d", claim.shard, claim.location)

    def _forget(self, shard: int) -> None:
        self._shards.pop(shard, None)
        self.metrics.forget_shard(shard)

    async def _release(self, shard: int) -> None:
        """Hand the shard over: wait for its acknowledgements, commit, drop the claim."""
        st = self._shards[shard]
        await self._drain(self.config.stop_timeout, only=st)
        if st.shard in self._shards:
            await asyncio.to_thread(self.coordinator.release, st.claim)
            self._forget(shard)
            logger.info("shard %d released at location %d", shard, st.committed)

    async def _drain(self, timeout: float, only: _Shard | None = None) -> None:
        states = [only] if only is not None else list(self._shards.values())
        deadline = self._clock() + timeout
        while any(st.inflight for st in states) and self._clock() < deadline:
            futures = [p.future for st in states for p in st.inflight]
            await asyncio.wait(futures, timeout=max(0.01, deadline - self._clock()))
            await self._collect()  # nothing new is read while draining; a failure just rewinds
        await self._commit(states)

    # -- reading and sending --------------------------------------------------
    async def _topic(self, topic: str) -> None:
        if topic not in self._topics:
            await self.publisher.prepare_topic(topic, self.config.partitions, self.config.replication_factor)
            self._topics.add(topic)

    async def _refresh_counts(self) -> None:
        if self._clock() - self._counts_at < self.config.poll_interval:
            return
        try:
            stats = await asyncio.to_thread(self.store.shard_stats)
        except LogstoreError as exc:
            logger.warning("cannot read shard counts: %s", exc)
            return
        self._counts_at = self._clock()
        self._counts = {info.shard: info.cells for info in stats}

    async def _read_and_send(self) -> bool:
        """Start page reads (several shards at once, off the event loop) and send the pages that arrived."""
        if not self._shards:
            return False
        await self._refresh_counts()
        busy = False
        now = self._clock()
        self._reads = sum(1 for s in self._shards.values() if s.reading is not None)
        self._in_flight = sum(len(s.inflight) for s in self._shards.values())
        for st in list(self._shards.values()):
            if st.reading is not None and st.reading.done():
                self._reads -= 1
                task, st.reading = st.reading, None
                if st.read_from == st.position and st.shard in self._shards:  # else a rewind made it stale
                    busy = await self._send_page(st, *task.result()) or busy
            self._maybe_read(st, now)
        return busy

    def _maybe_read(self, st: _Shard, now: float) -> None:
        if st.reading is not None or st.retry_at > now or self._stopping:
            return
        in_flight = self._in_flight
        if self._reads >= self.config.read_ahead or in_flight >= self.config.max_in_flight:
            return
        count = self._counts.get(st.shard)
        if st.drained and count == st.count_seen:
            return
        if st.drained:  # new cells committed since the last drain
            st.drained, st.count_seen = False, count
        elif st.count_seen is None:
            st.count_seen = count
            if count == 0:  # an empty shard: nothing to read until its count moves
                st.drained = True
                return
        limit = min(self.config.page_size, self.config.max_in_flight - in_flight)
        if st.acked < st.singles_until:  # isolating a refused cell: one message at a time
            if st.inflight:
                return
            limit = 1
        st.read_from, st.read_limit = st.position, limit
        self._reads += 1
        self._in_flight += limit
        st.reading = asyncio.ensure_future(asyncio.to_thread(self._fetch, st.shard, st.position, limit))
        st.reading.add_done_callback(lambda _t: self._wakeup.set())

    def _fetch(self, shard: int, location: int, limit: int) -> tuple[list[Cell], BaseException | None]:
        """A page of the shard's log (in a worker thread); a damaged cell or a read error comes back, not raised."""
        try:
            cells, _ = self.store.get_cells_for_shard(shard, location, limit, columns=self.config.columns)
        except CorruptCellError as exc:
            return exc.cells_before, exc
        except LogstoreError as exc:
            return [], exc
        return cells, None

    async def _send_page(self, st: _Shard, cells: list[Cell], problem: BaseException | None) -> bool:
        if problem is not None and not isinstance(problem, CorruptCellError):
            self._failed(st, problem, "read")
            return False
        if not cells and problem is None:
            st.drained = True
            return False
        for cell in cells:
            if not await self._send_cell(st, cell):
                return True
        if isinstance(problem, CorruptCellError):
            where = {"row_key": str(problem.row_key), "column": problem.column, "ref_key": problem.ref_key,
                     "added_id": problem.added_id, "shard": st.shard,
                     "created_at": problem.created_at.isoformat() if problem.created_at else None}
            logger.error("shard %d: %s; dead-lettered", st.shard, problem)
            await self._send_deadletter(st, where, self.config.topic(problem.column or "unknown"), problem, "decode")
        elif len(cells) < st.read_limit:
            st.drained = True
        else:
            self._maybe_read(st, self._clock())  # more is waiting: read ahead while this page goes out
        return True

    async def _send_cell(self, st: _Shard, cell: Cell) -> bool:
        topic = self.config.topic(cell.column)
        try:
            if topic not in self._topics:
                await self._topic(topic)
            message = encode_cell(cell, self.config.value_format)
        except TailerError as exc:
            self._failed(st, exc, "topic")
            return False
        except (TypeError, ValueError) as exc:
            return await self._send_deadletter(st, coordinates(cell), topic, exc, "encode")
        try:
            future = await self.publisher.send(
                topic, cell.shard % self.config.partitions, message.key, message.value, message.headers
            )
        except PublishError as exc:
            if exc.retriable:
                self._failed(st, exc, "publish")
                return False
            logger.error("shard %d: cell at added_id %d rejected (%s); dead-lettered", st.shard, cell.added_id, exc)
            return await self._send_deadletter(st, coordinates(cell), topic, exc, "publish")
        self._track(st, _Pending(cell.added_id, future, cell, topic, False))
        return True

    async def _send_deadletter(
        self, st: _Shard, where: dict[str, Any], topic: str, error: BaseException, stage: str
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
        self._track(st, _Pending(int(where["added_id"]), future, where, topic, True))
        return True

    def _track(self, st: _Shard, pending: _Pending) -> None:
        st.inflight.append(pending)
        st.position = pending.added_id
        pending.future.add_done_callback(self._settled)

    def _settled(self, future: asyncio.Future[Any]) -> None:
        if not future.cancelled():
            future.exception()  # retrieved here: a rewind may drop the future unread
        self._wakeup.set()

    def _failed(self, st: _Shard, exc: BaseException, stage: str) -> None:
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
                        published += 1
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

    async def _commit(self, states: list[_Shard] | None = None) -> None:
        todo = {st.shard: (st.claim, Offset(st.acked, st.deadlettered, st.last_error))
                for st in (states if states is not None else self._shards.values())
                if st.acked > st.committed or st.deadlettered != st.claim.deadlettered}
        if not todo:
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


def lag_of(store: Store, shard: int, location: int) -> tuple[int, float]:
    """(cells after ``location``, seconds since the first of them was created) of a shard."""
    behind = store.count_after(shard, location)
    if not behind:
        return 0, 0.0
    try:
        cells, _ = store.get_cells_for_shard(shard, location, 1)
        created = cells[0].created_at if cells else None
    except CorruptCellError as exc:
        created = exc.created_at
    if created is None:
        return behind, 0.0
    return behind, max(0.0, (dt.datetime.now(dt.UTC) - created).total_seconds())
