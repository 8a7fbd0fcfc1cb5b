"""Handlers and the processor that runs them: retries, dead letters and the stall threshold.

The processor is the same for both modes and for replays; the modes only differ in
where cells come from and how a position is acknowledged. It takes a batch of cells (a
partition's, or the pages of one or several shards) and runs each handler of their
columns over them in order (each with its own retries and dead letters), and returns
only when each handler has either succeeded or dead-lettered every cell: only then may
the source advance past them. The one exception is a stall, which leaves the cells
unacknowledged and stops the app.

A handler runs over the batch cell after cell (a synchronous one in one trip to the
thread pool) until a cell fails; that cell then gets the retry policy (the failure
counts as its first attempt) and the next run goes on after it. A batch handler
(:meth:`~indexer.App.batch_trigger`) takes the cells of its column in one call (a
partition's, or a shard's at a time); when the call still fails after its attempts, the
cells are handled one by one, so only the cells that fail are dead-lettered.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import inspect
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

from indexer.errors import HandlerStalledError, RetriableError
from indexer.runtime.combine import Combiner
from indexer.runtime.config import AppConfig
from indexer.runtime.dlq_store import OPEN_STATES, DeadLetter, DeadLetterStore
from indexer.runtime.hooks import Hook
from indexer.runtime.metrics import AppMetrics
from indexer.runtime.policy import Failure, Outcome, deliver, describe, qualified_name
from logstore import Cell

logger = logging.getLogger(__name__)
Handler = Callable[[Cell], Any]
BatchHandler = Callable[[list[Cell]], Any]  # sync, or async
_MEAN_WEIGHT = 0.2  # of a batch's mean in Processor.cell_seconds


def tailer_deadletter(record: dict[str, Any]) -> tuple[dict[str, Any], Failure]:
    """The cell coordinates and the failure in the tailer's dead-letter record of a cell it could not
    read or publish (:func:`tailer.messages.deadletter_record`): such a cell reaches no handler, so each
    handler of its column dead-letters it without an attempt."""
    where, error = record.get("cell") or {}, record.get("error") or {}
    stage, kind, message = record.get("stage"), error.get("type"), error.get("message")
    return where, Failure(str(kind), str(message), f"{stage} failed in the tailer worker: {kind}: {message}",
                          f"{stage}:{kind}", False)


def _shard_runs(items: Sequence[tuple[Cell, dict[str, Any]]]) -> list[list[tuple[Cell, dict[str, Any]]]]:
    """``items`` cut where the shard changes."""
    return [list(run) for _shard, run in itertools.groupby(items, key=_shard_of)]


def _shard_of(item: tuple[Cell, dict[str, Any]]) -> int:
    return item[0].shard


class BatchApplier(Protocol):
    """A handler that takes a whole batch of a column's cells at once (an index version, a sink). One that
    only buffers what it applied also has ``flush()`` (blocking), which :meth:`Processor.checkpoint` calls
    before the source commits positions. The batches of a column go to ``apply`` one call at a time, or up to
    ``calls_at_once`` calls at once (batches of different shards) where the applier has that attribute; the
    cell-by-cell fallback and redrives may call it from other threads meanwhile. One that records a stream's
    positions is also a :class:`PositionedApplier`."""

    name: str

    def prepare(self, cell: Cell) -> Any:
        """What the cell becomes; raising dead-letters the cell (non-retriable errors say why)."""

    def apply(self, prepared: Sequence[Any], batch: Sequence[Cell]) -> Any:
        """(blocking) Apply the prepared cells in order; idempotent, so a batch may be applied again.
        ``batch`` is every cell of the batch, those dead-lettered already included (positions pass them)."""


@runtime_checkable
class PositionedApplier(Protocol):
    """A batch applier that records a stream's positions with its batches (an index version): ``stream`` names
    it, and None records none (what a replay sets while it runs)."""

    stream: str | None


@dataclasses.dataclass(frozen=True)
class Trigger:
    """A handler subscribed to one column; with an ``applier`` or a ``batch`` function, batches go to it and
    ``fn`` takes one cell (replays, and the cells of a batch that failed, one by one)."""

    name: str
    column: str
    fn: Handler
    max_attempts: int
    applier: BatchApplier | None = None
    batch: BatchHandler | None = None

    @functools.cached_property
    def is_async(self) -> bool:  # cached: asked for every page, and inspect's answer is not cheap
        return inspect.iscoroutinefunction(self.fn)


class Counts(NamedTuple):
    """What a run did: cells handled successfully, failed attempts retried, cells dead-lettered."""

    processed: int = 0
    retried: int = 0
    dead_lettered: int = 0

    def __sub__(self, other: tuple[int, ...]) -> Counts:
        return Counts(*(a - b for a, b in zip(self, other, strict=True)))


class Processor:
    """Runs an app's handlers on cells (see the module docstring). Use from one event loop."""

    def __init__(self, config: AppConfig, triggers: list[Trigger], deadletters: DeadLetterStore,
                 metrics: AppMetrics, hooks: Sequence[Hook] = ()) -> None:
        self.config = config
        self.triggers = triggers
        # The appliers (indexes, sinks) first on a page: what they applied a re-delivery skips (their positions
        # say so) even when a handler after them fails or the process dies there.
        self._in_turn = sorted(triggers, key=lambda t: t.applier is None)
        self.by_column: dict[str, list[Trigger]] = {}
        for trigger in triggers:
            self.by_column.setdefault(trigger.column, []).append(trigger)
        self.deadletters = deadletters
        self.clock = deadletters.clock  # the backoff waits on it, the failures and the entries are dated by it
        self._timing: dict[str, Any] = {"sleep": self.clock.sleep, "now": self.clock.now}  # deliver()'s, per cell
        self.metrics = metrics
        self.hooks = list(hooks)
        self.counts = Counts()
        self.stalled: HandlerStalledError | None = None
        self.open: dict[str, int] = {}  # open dead letters per handler, as last counted (and changed here since)
        self._open_counts = deadletters.open_counts()
        # Dead letters being written here, and changes of ``open`` made here: a recount whose read overlapped one
        # may lack it, so it is dropped (the next one counts it).
        self._writing = 0
        self._changes = 0
        # Kafka mode mirrors each recorded entry to the app's DLQ topic before the cell is acknowledged.
        self.on_deadletter: Callable[[DeadLetter], Awaitable[None]] | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(config.concurrency, thread_name_prefix="handler")
        self._combiners: dict[str, Combiner] = {}  # batch handlers: the batches of many shards in one call
        # Each handler's labelled children of processed and seconds, kept: a labels() lookup per page would be a
        # cost per shard when shards hold a few cells each.
        self._meters: dict[str, tuple[Any, Any]] = {}
        # What a cell recently cost the handlers that take a cell at a time (a moving mean of their own time,
        # trips to the pool aside); None until measured, and for apps with batch handlers or appliers, whose
        # batches are timed with their trips. Direct mode splits a read's shards over the pool only when their
        # cells take long enough to be worth the trips (see indexer.runtime.direct).
        self.cell_seconds: float | None = None
        self._per_cell_only = all(t.applier is None and t.batch is None for t in triggers)

    @property
    def max_parallel_batches(self) -> int | None:
        """How many batches can be handled at once: ``concurrency`` when a handler runs in the thread pool (a
        synchronous handler or batch handler, an applier), else no bound (None)."""
        in_pool = any(t.applier is not None or (not inspect.iscoroutinefunction(t.batch) if t.batch is not None
                                                  else not t.is_async) for t in self.triggers)
        return self.config.concurrency if in_pool else None

    def load_open_counts(self) -> None:
        """(blocking) Count the open dead letters per handler in the store, for the stall threshold and the
        ``cellstream_app_dlq_open`` metric."""
        self._set_open(self._open_counts.read())

    async def recount_open(self) -> bool:
        """Count the open dead letters again (a read of the entries changed since the last count), so that the
        stall threshold and the metric follow triage done elsewhere: ``cellstream dlq``, the console, another
        process of the app. False when a dead letter of this process was written meanwhile: the counts stay
        as they are, for the next recount."""
        if self._writing:
            return False
        changes = self._changes
        counts = await asyncio.to_thread(self._open_counts.read)
        if self._writing or changes != self._changes:
            return False
        self._set_open(counts)
        return True

    def _set_open(self, counts: dict[str, int]) -> None:
        self.open = {**dict.fromkeys([*self.open, *(t.name for t in self.triggers)], 0), **counts}
        for handler, count in self.open.items():
            self.metrics.dlq_open.labels(self.config.name, handler).set(count)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- cells ------------------------------------------------------------------
    async def process(self, cell: Cell, source: dict[str, Any]) -> bool:
        """Run the column's handlers on ``cell``; False when a handler stalled (do not acknowledge)."""
        return await self.process_many([(cell, source)])

    async def process_many(self, items: Sequence[tuple[Cell, dict[str, Any]]], *, by_shard: bool = False) -> bool:
        """Run the handlers on consecutive cells of one source partition (Kafka mode), or of several shards one
        after another (direct mode, ``by_shard``): batch handlers take them at once (a shard's at a time with
        ``by_shard``), the others one cell after another. True when every handler succeeded or dead-lettered
        every cell; False when one stalled; a RetriableError when a batch could not be settled (handle it
        again)."""
        for trigger in self._in_turn:
            mine = [(c, s) for c, s in items if c.column == trigger.column]
            if not mine:
                continue
            if trigger.applier is not None:
                settled = await self._apply_batch(trigger, trigger.applier, mine)
            elif trigger.batch is not None:
                settled = True
                for part in _shard_runs(mine) if by_shard else (mine,):
                    settled = await self._run_batch(trigger, trigger.batch, part)
                    if not settled:
                        break
            else:
                settled = await self._run_cells(trigger, mine)
            if not settled:
                return False
        return True

    async def _run_cells(self, trigger: Trigger, items: Sequence[tuple[Cell, dict[str, Any]]]) -> bool:
        """``trigger`` on each cell in order; a synchronous handler a run of cells per trip to the pool."""
        at = 0
        while at < len(items):
            if self.stalled is not None:
                return False
            done, failed = await self._fast_run(trigger, [cell for cell, _ in items[at:]])
            at += done
            if failed is None:
                return True
            cell, source = items[at]
            at += 1
            outcome = await self.run(trigger, cell, failed)
            if not outcome.ok and not await self._deadletter(trigger, source, cell.coordinates(), cell.body, outcome):
                return False
        return True

    async def _fast_run(self, trigger: Trigger, cells: list[Cell]) -> tuple[int, BaseException | None]:
        """``trigger.fn`` on each cell until one raises, without the retry policy's bookkeeping per cell (a
        sync handler in one trip to the pool). (cells done, what the next one raised: its first attempt)."""
        def work() -> tuple[list[float], BaseException | None]:
            took: list[float] = []
            for cell in cells:
                started = time.perf_counter()
                try:
                    trigger.fn(cell)
                except Exception as exc:
                    return took, exc
                took.append(time.perf_counter() - started)
            return took, None

        async def work_async() -> tuple[list[float], BaseException | None]:
            took: list[float] = []
            for cell in cells:
                started = time.perf_counter()
                try:
                    await trigger.fn(cell)
                except Exception as exc:
                    return took, exc
                took.append(time.perf_counter() - started)
            return took, None

        if trigger.is_async:
            took, failed = await work_async()
        else:
            took, failed = await asyncio.get_running_loop().run_in_executor(self._pool, work)
        if took:
            if self._per_cell_only:
                mean = sum(took) / len(took)
                last = self.cell_seconds
                self.cell_seconds = mean if last is None else last + (mean - last) * _MEAN_WEIGHT
            self.counts = self.counts._replace(processed=self.counts.processed + len(took))
            processed, seconds = self._meters_of(trigger.name)
            processed.inc(len(took))
            for one in took:
                seconds.observe(one)
        return len(took), failed

    def _meters_of(self, handler: str) -> tuple[Any, Any]:
        """The handler's processed counter and seconds histogram (labelled children)."""
        meters = self._meters.get(handler)
        if meters is None:
            labels = (self.config.name, handler)
            meters = self._meters[handler] = (self.metrics.processed.labels(*labels),
                                              self.metrics.seconds.labels(*labels))
        return meters

    async def _run_batch(self, trigger: Trigger, batch: BatchHandler,
                         items: Sequence[tuple[Cell, dict[str, Any]]]) -> bool:
        """The cells in one call of ``batch``, under the retry policy; past it, one by one."""
        cells = [cell for cell, _ in items]

        async def call() -> None:
            if inspect.iscoroutinefunction(batch):
                await batch(cells)
            else:
                await asyncio.get_running_loop().run_in_executor(self._pool, batch, cells)

        started = time.perf_counter()
        outcome = await deliver(call, trigger.max_attempts, self.config.backoff,
                                on_retry=functools.partial(self._retrying, trigger, cells), **self._timing)
        if outcome.ok:
            self._processed(trigger.name, len(cells), time.perf_counter() - started)
            return True
        assert outcome.failure is not None
        logger.warning("%s: a batch of %d cells failed (%s: %s); handling its cells one by one", trigger.name,
                       len(cells), outcome.failure.error_type, outcome.failure.message)
        for cell, source in items:
            if self.stalled is not None:
                return False
            one = await self.run(trigger, cell)
            if not one.ok and not await self._deadletter(trigger, source, cell.coordinates(), cell.body, one):
                return False
        return True

    async def _apply_batch(self, trigger: Trigger, applier: BatchApplier,
                           items: list[tuple[Cell, dict[str, Any]]]) -> bool:
        """Cells that cannot be prepared are dead-lettered first (so the batch's recorded position never
        passes a cell that was neither applied nor dead-lettered); the rest are applied at once (with the
        batches of other shards waiting at the time: :mod:`indexer.runtime.combine`), retried while the error is
        retriable. A batch still failing with a retriable error is not settled; one
        failing otherwise is applied cell by cell, so only the cells that fail are dead-lettered."""
        prepared, kept = [], []
        for cell, source in items:
            try:
                prepared.append(applier.prepare(cell))
                kept.append((cell, source))
            except Exception as exc:
                now = self.clock.now()
                if not await self._deadletter(trigger, source, cell.coordinates(), cell.body,
                                              Outcome(False, 1, describe(exc), now, now)):
                    return False
        batch = [cell for cell, _ in items]
        retrying = functools.partial(self._retrying, trigger, [cell for cell, _ in kept])
        started = time.perf_counter()
        combiner = self._combiners.get(trigger.name)
        if combiner is None:
            calls = min(getattr(applier, "calls_at_once", 1), self.config.concurrency)  # the pool's threads
            combiner = self._combiners[trigger.name] = Combiner(applier, self._pool, calls)
        outcome = await deliver(lambda: combiner.apply(prepared, batch), trigger.max_attempts, self.config.backoff,
                                on_retry=retrying, **self._timing)
        if outcome.ok:
            self._processed(trigger.name, len(prepared), time.perf_counter() - started)
            return True
        assert outcome.failure is not None
        if outcome.failure.retriable:
            raise RetriableError(f"{trigger.name}: a batch of {len(prepared)} cells not applied: "
                                 f"{outcome.failure.error_type}: {outcome.failure.message}")
        logger.warning("%s: a batch failed (%s: %s); applying its cells one by one", trigger.name,
                       outcome.failure.error_type, outcome.failure.message)
        for cell, source in kept:
            one = await self.run(trigger, cell)
            if one.ok:
                continue
            assert one.failure is not None
            if one.failure.retriable:
                raise RetriableError(f"{trigger.name}: cell not applied: {one.failure.message}")
            if not await self._deadletter(trigger, source, cell.coordinates(), cell.body, one):
                return False
        return True

    def _retrying(self, trigger: Trigger, cells: Sequence[Cell], exc: BaseException, attempt: int,
                  delay: float) -> None:
        """Attempt ``attempt`` of ``trigger`` at ``cells`` raised ``exc``; the next comes after ``delay`` seconds."""
        self.counts = self.counts._replace(retried=self.counts.retried + 1)
        self.metrics.retried.labels(self.config.name, trigger.name).inc()
        if len(cells) == 1:
            cell = cells[0]
            logger.warning("%s: attempt %d at %s/%s/%d failed (%s: %s); retrying in %.2fs", trigger.name, attempt,
                           cell.row_key, cell.column, cell.ref_key, qualified_name(type(exc)), exc, delay)
        else:
            logger.warning("%s: attempt %d at a batch of %d cells failed (%s: %s); retrying in %.2fs", trigger.name,
                           attempt, len(cells), qualified_name(type(exc)), exc, delay)
        for hook in self.hooks:
            try:
                hook.retrying(trigger.name, cells, attempt, exc, delay)
            except Exception:  # a hook's bookkeeping must not turn a retry into a lost cell
                logger.exception("hook %s: retrying failed; the retry goes on", type(hook).__name__)

    def _processed(self, handler: str, cells: int, seconds: float) -> None:
        """A batch call of ``seconds`` handled ``cells``."""
        self.counts = self.counts._replace(processed=self.counts.processed + cells)
        processed, observed = self._meters_of(handler)
        processed.inc(cells)
        observed.observe(seconds)

    async def checkpoint(self) -> None:
        """Before the source commits positions: flush every buffering handler (raises what a flush raised)."""
        loop = asyncio.get_running_loop()
        appliers = {id(t.applier): t.applier for t in self.triggers if hasattr(t.applier, "flush")}
        for applier in appliers.values():  # one handler may serve several columns
            await loop.run_in_executor(self._pool, applier.flush)  # type: ignore[union-attr]

    async def undecodable(self, where: dict[str, Any], source: dict[str, Any], error: Failure) -> bool:
        """A cell that cannot be decoded goes to the DLQ of every handler of its column, with no attempt."""
        now = self.clock.now()
        outcome = Outcome(False, 1, error, now, now)
        for trigger in self.by_column.get(str(where.get("column")), ()):
            if not await self._deadletter(trigger, source, where, None, outcome):
                return False
        return True

    async def run(self, trigger: Trigger, cell: Cell, failed: BaseException | None = None) -> Outcome:
        """The handler's attempts at ``cell`` under the retry policy (``failed``: its first attempt, made
        already, raised this)."""
        started = time.perf_counter()
        outcome = await deliver(functools.partial(self._call, trigger, cell), trigger.max_attempts,
                                self.config.backoff, on_retry=functools.partial(self._retrying, trigger, [cell]),
                                failed=failed, **self._timing)
        if outcome.ok:
            self._processed(trigger.name, 1, time.perf_counter() - started)
        return outcome

    async def _call(self, trigger: Trigger, cell: Cell) -> None:
        if trigger.is_async:
            await trigger.fn(cell)
        else:
            await asyncio.get_running_loop().run_in_executor(self._pool, trigger.fn, cell)

    async def _deadletter(self, trigger: Trigger, source: dict[str, Any], where: dict[str, Any],
                          body: dict[str, Any] | None, outcome: Outcome) -> bool:
        assert outcome.failure is not None
        labels = (self.config.name, trigger.name)
        opened = self.open.get(trigger.name, 0)
        if opened + 1 > self.config.stall_threshold:
            self.stalled = HandlerStalledError(self.config.name, trigger.name, opened, self.config.stall_threshold,
                                               f"{outcome.failure.error_type}: {outcome.failure.message}")
            self.metrics.stalled.labels(*labels).set(1)
            logger.error("%s", self.stalled)
            return False
        # Count the entry before the write: handlers of other shards check the threshold meanwhile.
        self.open[trigger.name] = opened + 1
        self._writing += 1
        self._changes += 1
        try:
            entry: DeadLetter = await asyncio.to_thread(
                self.deadletters.record, trigger.name, trigger.column, source, where, body, outcome)
        except BaseException:
            self.open[trigger.name] -= 1
            raise
        finally:
            self._writing -= 1
        if len(entry.history) > 1 and entry.history[-2].status in OPEN_STATES:
            self.open[trigger.name] -= 1  # another failure of an entry that was open already
        self.metrics.dlq_open.labels(*labels).set(self.open[trigger.name])
        if self.on_deadletter is not None:
            await self.on_deadletter(entry)
        self.counts = self.counts._replace(dead_lettered=self.counts.dead_lettered + 1)
        self.metrics.deadlettered.labels(*labels).inc()
        logger.error("%s: cell %s/%s/%s dead-lettered after %d attempts (%s: %s) as %s", trigger.name,
                     where.get("row_key"), where.get("column"), where.get("ref_key"), outcome.attempts,
                     outcome.failure.error_type, outcome.failure.message, entry.id)
        return True

    def entry_closed(self, handler: str) -> None:
        """An open entry of ``handler`` was resolved or discarded (by a replay or triage in this process): counted
        at once; triage elsewhere is counted by :meth:`recount_open`."""
        self._changes += 1
        self.open[handler] = max(0, self.open.get(handler, 0) - 1)
        self.metrics.dlq_open.labels(self.config.name, handler).set(self.open[handler])

