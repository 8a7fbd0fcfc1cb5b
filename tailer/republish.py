"""Re-publishing a range of the shard logs to a tailer's topics while it goes on tailing, as Debezium's
incremental snapshots re-read part of a table beside its stream.

``cellstream tail republish NAME [--columns A,B] [--shards RANGE] [--from POSITION] [--until POSITION]`` records
a job of the jobs machinery (:mod:`logstore.jobs`, kind ``republish``) naming the tailer. The range is resolved
when the job is requested: per shard the location after which it starts and the one it ends at, by default each
shard's head then (the log is dense and immutable, so that head is an exact high watermark: cells written later
are the live stream's, never the job's). The steps hold these locations, 256 shards a step.

The running tailer (the ZooKeeper leader, or the standalone process) polls the store's jobs for its own
(:class:`Republisher`), claims one with a :class:`~logstore.jobs.JobRunner` (an owner lease: the job of a
SIGKILLed tailer is taken over by the next runner once the lease lapses, at once on the same host) and runs it
beside the live tailing: many shards a read, each cell through the tailer's own sink (same topics, partitions,
keys and message format as the live messages) with one header more, ``republish`` (the job's id), so a reader
can tell them apart. A shard's place in the step's cursor moves only over cells the publisher acknowledged, so a
job resumed after a crash sends again at most what followed the last recorded cursor (at least once). The
job's throttle (``rate`` in cells a second; ``cellstream jobs throttle``) paces it; pause and cancel are those
of every job (``cellstream jobs pause|cancel ID``).

A cell the live tailer dead-lettered (undecodable, not encodable, larger than the broker takes) is skipped and
counted (``skipped`` in the cursor), not dead-lettered again. Cells of the reserved ``_`` columns are passed
over unless ``columns`` (the job's, else the tailer's) names them, as the live tailer does.

``cellstream jobs resume --run`` cannot run such a job: only a tailer holds its topics and partition mapping.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import datetime as dt
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from logstore import CorruptCellError, LogstoreError, Store, TruncatedPage
from logstore.cell import COLUMN_RE, AnyCell
from logstore.errors import InvalidArgumentError, JobLeaseLostError, JobStateError
from logstore.jobs import JobKind, JobRecord, JobRunner, JobStore, KindRegistry, RunnerConfig, StepContext, StepRecord
from logstore.jobs.records import ACTIVE_STATES, FINAL_STATES, ThrottleSettings
from logstore.positions import Position, check_range, resolve_positions
from tailer.errors import ConfigurationError, PublishError, TailerError
from tailer.messages import Message

if TYPE_CHECKING:
    from tailer.config import TailerConfig
    from tailer.publishers.topics import TopicSink

logger = logging.getLogger(__name__)
KIND = "republish"
#: The header every re-published message carries (its value: the job's id); live messages never have it.
HEADER = "republish"
STEP_SHARDS = 256  # shards a step: a step's cursor holds a location for each
CHUNK_CELLS = 2000  # cells a chunk reads and sends, at most, before it waits for their acknowledgements
ACK_TIMEOUT = 120.0  # a chunk's deliveries not settled by then are sent again (at least once)
STALL_SECONDS = 120.0  # a step that delivers nothing for this long fails its attempt (the runner retries it)
POLL_SECONDS = 2.0  # how often the tailer looks for a job of its own


class _TailerStopping(BaseException):
    """Raised in a step when its tailer stops gracefully: the :class:`Republisher` hands the job back, its cursor
    recorded, for the next runner. A BaseException, so that the runner lets it through (it pauses on Ctrl-C
    and fails on errors, neither of which a tailer's restart is)."""


class Entry(NamedTuple):
    """A cell of a chunk: its added_id, and its message (None: acknowledged at once, passed over or skipped)."""

    added_id: int
    column: str
    message: Message | None
    skipped: bool = False  # it cannot be published (counted once its place is passed)


def _check_columns(columns: Sequence[str] | None) -> list[str] | None:
    if columns is None:
        return None
    names = [c.strip() for c in columns if c.strip()]
    if not names:
        raise InvalidArgumentError("columns: give at least one column, or none for the tailer's own")
    for name in names:
        if not COLUMN_RE.fullmatch(name):
            raise InvalidArgumentError(f"columns: {name!r} is not a column name")
        if name[0] == "_":
            raise InvalidArgumentError(f"columns: {name} is cellstream's own; a tailer publishes its users' columns")
    return names


def plan_ranges(store: Store, shards: Sequence[int] | None, start: Position, until: Position
                ) -> dict[int, tuple[int, int]]:
    """Each shard's range ``(after, up_to]`` for a re-publish, read now: ``up_to`` is at most the shard's head
    now, the job's exact high watermark. Shards with nothing in their range are left out. A ``SHARD:LOCATION``
    start names the shards itself (among ``shards``); such an end leaves the shards it does not name at their
    head.

    Raises:
        InvalidArgumentError: a shard or location that is not valid (:func:`~logstore.positions.resolve_positions`).
        StorageError: a node cannot be read.
    """
    wanted = list(range(store.shard_count)) if shards is None else sorted(set(shards))
    heads = store.heads(wanted)  # first: the watermark; a later read of the start can only be within it
    after = resolve_positions(store, start, wanted)
    ends = heads if until.kind == "end" else {**heads, **resolve_positions(store, until, wanted)}
    return {s: (a, min(ends[s], heads[s])) for s, a in after.items() if a < min(ends[s], heads[s])}


def submit(store: Store, tailer: str, *, columns: Sequence[str] | None = None, shards: Sequence[int] | None = None,
           start: Position | None = None, until: Position | None = None, rate: float | None = None,
           texts: dict[str, str] | None = None) -> JobRecord:
    """Record a re-publish job for the tailer ``tailer`` (state planned: its running tailer takes it).

    Args:
        store: the tailer's store.
        tailer: the tailer's name.
        columns: the columns to re-publish (None: those the tailer publishes).
        shards: the shards (None: every shard).
        start: where each shard's range starts (None: the beginning).
        until: where it ends (None: each shard's head now).
        rate: the job's throttle in cells a second (None: unlimited).
        texts: how the operator wrote the range (``shards``, ``from``, ``until``), kept for ``tail status``.

    Returns:
        The job's record.

    Raises:
        InvalidArgumentError: a column, shard or position that is not valid.
        StorageError: the store cannot be read or written.
    """
    from tailer.config import check_name

    try:
        check_name(tailer)
    except ValueError as exc:
        raise InvalidArgumentError(f"tailer name: {exc}") from None
    names = _check_columns(columns)
    start, until = start or Position("beginning"), until or Position("end")
    check_range(start, until)
    ranges = plan_ranges(store, shards, start, until)
    if names is not None:  # a column with no cell in the range is a typo more often than not
        starts, ends = {s: a for s, (a, _) in ranges.items()}, {s: b for s, (_, b) in ranges.items()}
        for name in names:
            after, beyond = store.counts_after(starts, columns=[name]), store.counts_after(ends, columns=[name])
            if not any(after[s] - beyond[s] for s in ranges):
                raise InvalidArgumentError(f"columns: {name} has no cell in the range, nothing to re-publish")
    params: dict[str, Any] = {
        "tailer": tailer, "columns": names, "shard_count": store.shard_count,
        "requested_at": dt.datetime.now(dt.UTC).isoformat(), **(texts or {}),
        "shards_in_range": len(ranges),
    }
    kind = Republish(store)
    steps = kind.plan({**params, "ranges": ranges})
    record = JobStore(store).create(KIND, params, steps, unit=kind.unit,
                                    throttle=ThrottleSettings(rate=rate, max_lag_seconds=None, max_latency_ms=None))
    logger.info("job %s: re-publish %d shards to tailer %s", record.id, len(ranges), tailer)
    return record


class Republish(JobKind):
    """The ``republish`` kind: a step re-publishes its shards' ranges through ``publishing`` (the running
    tailer's sink); without one (planning in a command) it only plans."""

    name = KIND
    unit = "cells"

    def __init__(self, store: Store, publishing: Publishing | None = None,
                 stopping: threading.Event | None = None) -> None:
        self.store = store
        self.publishing = publishing
        self.stopping = stopping or threading.Event()
        # What the running step has acknowledged: (step name, done, cursor), for a hand-back on a graceful stop.
        self.last: tuple[str, int, dict[str, Any]] | None = None

    def plan(self, params: dict[str, Any]) -> list[StepRecord]:
        """Steps of :data:`STEP_SHARDS` shards; ``params["ranges"]`` (shard -> (after, up_to), as
        :func:`plan_ranges` resolves them) is what they hold, and is not kept in the job's params. A step's total
        is its cells of the columns (of all columns when none is named: reserved ones are passed over and
        counted as done; a tailer publishing some columns only publishes fewer, and the total comes down to
        what was done when the step ends)."""
        ranges: dict[int, tuple[int, int]] = {int(s): (int(a), int(b)) for s, (a, b) in params["ranges"].items()}
        shards = sorted(ranges)
        columns = params.get("columns")
        counts: dict[int, int] = {}
        if shards:  # counted: ids are dense per shard on MySQL, not on SQLite (one sequence for every shard)
            after = self.store.counts_after({s: ranges[s][0] for s in shards}, columns=columns)
            beyond = self.store.counts_after({s: ranges[s][1] for s in shards}, columns=columns)
            counts = {s: max(0, after.get(s, 0) - beyond.get(s, 0)) for s in shards}
        steps = []
        for at in range(0, len(shards), STEP_SHARDS):
            group = shards[at:at + STEP_SHARDS]
            total = sum(counts[s] for s in group)
            steps.append(StepRecord(name=f"shards {group[0]}-{group[-1]}", total=total,
                                    params={"shards": group, "after": [ranges[s][0] for s in group],
                                            "until": [ranges[s][1] for s in group]}))
        return steps

    def describe(self, record: JobRecord) -> str:
        p = record.params
        columns = ",".join(p.get("columns") or []) or "the tailer's columns"
        return (f"re-publish {columns} of shards {p.get('shards') or 'all'} from {p.get('from') or 'beginning'} "
                f"until {p.get('until') or 'end'} to tailer {p.get('tailer')}'s topics")

    def run_step(self, step: StepRecord, context: StepContext) -> None:
        publishing = self.publishing
        if publishing is None:
            raise ConfigurationError("a republish job runs in its tailer (`cellstream tail`), which holds its topics")
        job = context.job
        columns = _check_columns(job.params.get("columns"))
        read_columns = publishing.columns_for(columns)
        shards: list[int] = list(step.params["shards"])
        until: list[int] = list(step.params["until"])
        cursor = dict(context.cursor or {})
        at: list[int] = list(cursor.get("at") or step.params["after"])
        counted = {"done": int(cursor.get("done", 0)), "published": int(cursor.get("published", 0)),
                   "skipped": int(cursor.get("skipped", 0))}
        total = step.total
        singles: dict[int, int] = {}  # index -> until which the shard's cells go one a chunk (a refused batch)
        active = [i for i in range(len(shards)) if at[i] < until[i]]
        last_progress = time.monotonic()
        failures = 0

        def record() -> dict[str, Any]:
            doc = {"at": list(at), **counted}
            self.last = (step.name, counted["done"], doc)
            return doc
        record()
        while active:
            if self.stopping.is_set():
                raise _TailerStopping()
            context.check()
            rate = context.throttle.settings.rate
            budget = CHUNK_CELLS if rate is None else max(1, min(CHUNK_CELLS, int(rate)))
            group = active[:max(1, budget)]
            limit = max(1, min(budget // len(group), 1000))
            try:
                pages = self.store.read_pages({shards[i]: at[i] for i in group}, limit, columns=read_columns,
                                              packed=publishing.packed).decode()
            except LogstoreError as exc:
                failures = self._wait_after(exc, failures, last_progress, context)
                continue
            chunk: dict[int, list[Entry]] = {}
            finished: set[int] = set()
            for i in group:
                entries, done_after = self._entries(job.id, shards[i], pages.get(shards[i], []), until[i], limit,
                                                    columns, publishing, single=i in singles)
                chunk[shards[i]] = entries
                if done_after:
                    finished.add(i)
            results = publishing.send(chunk, ACK_TIMEOUT)
            moved = 0
            failed: BaseException | None = None
            for i in group:
                entries = chunk[shards[i]]
                acked, error = results.get(shards[i], (None, None))
                for entry in entries:
                    if acked is None or entry.added_id > acked:
                        break
                    counted["done"] += 1
                    if entry.message is not None:
                        counted["published"] += 1
                    elif entry.skipped:
                        counted["skipped"] += 1
                    moved += 1
                if acked is not None and acked > at[i]:
                    at[i] = acked
                if error is None:
                    if i in finished:
                        at[i] = max(at[i], until[i])
                    if i in singles and at[i] >= singles[i]:
                        del singles[i]
                    continue
                failed = error
                if isinstance(error, PublishError) and not error.retriable:
                    bad = next((e for e in entries if e.added_id > at[i]), None)
                    if i in singles and bad is not None:
                        # Alone in its request and still refused: the live tailer dead-lettered this cell.
                        logger.error("job %s: shard %d: cell at added_id %d refused (%s); skipped", job.id,
                                     shards[i], bad.added_id, error)
                        at[i] = bad.added_id
                        counted["done"] += 1
                        counted["skipped"] += 1
                        moved += 1
                    else:
                        singles[i] = entries[-1].added_id if entries else at[i]
            active = [i for i in active if at[i] < until[i]]
            if moved:
                last_progress = time.monotonic()
                failures = 0
            if total is not None and counted["done"] > total:
                total = counted["done"]
            context.progress(counted["done"], total, cursor=record())
            if failed is not None and not moved:
                failures = self._wait_after(failed, failures, last_progress, context)
                continue
            if moved:
                context.throttle.wait(moved)
        context.progress(counted["done"], counted["done"], cursor=record())

    def _entries(self, job_id: str, shard: int, page: Sequence[AnyCell] | BaseException, up_to: int, limit: int,
                 columns: list[str] | None, publishing: Publishing, *, single: bool) -> tuple[list[Entry], bool]:
        """The chunk's entries of a shard's page (cells after ``up_to`` left out), and whether the shard's range
        ends with them."""
        problem: CorruptCellError | None = None
        cells: Sequence[AnyCell]
        if isinstance(page, CorruptCellError):
            problem, cells = page, page.cells_before
        elif isinstance(page, BaseException):  # read_pages gives errors per shard only as CorruptCellError
            raise page
        else:
            cells = page
        entries: list[Entry] = []
        for cell in cells:
            if cell.added_id > up_to:
                return entries, True
            if single and any(e.message is not None for e in entries):
                return entries, False
            if columns is None and cell.column[0] == "_" and not publishing.names(cell.column):
                entries.append(Entry(cell.added_id, cell.column, None))  # reserved: passed over, as live
                continue
            try:
                message = publishing.encode(cell, job_id)
            except (TypeError, ValueError, PublishError) as exc:
                logger.error("job %s: shard %d: cell at added_id %d cannot be published (%s); skipped", job_id,
                             shard, cell.added_id, exc)
                entries.append(Entry(cell.added_id, cell.column, None, skipped=True))
                continue
            entries.append(Entry(cell.added_id, cell.column, message))
        if problem is not None:
            if problem.added_id is not None and problem.added_id <= up_to:
                logger.error("job %s: shard %d: %s; skipped", job_id, shard, problem)
                entries.append(Entry(problem.added_id, problem.column or "", None, skipped=True))
            return entries, problem.added_id is not None and problem.added_id >= up_to
        # A page shorter than asked and not cut by the byte budget reached the log's end: no more cells of
        # these columns up to the watermark.
        return entries, len(cells) < limit and not isinstance(cells, TruncatedPage)

    def _wait_after(self, error: BaseException, failures: int, last_progress: float, context: StepContext) -> int:
        """Back off after a chunk that read or delivered nothing; raise once nothing moved for STALL_SECONDS."""
        if time.monotonic() - last_progress > STALL_SECONDS:
            if isinstance(error, PublishError):
                raise error
            raise PublishError(f"re-publish stalled for {STALL_SECONDS:g}s: {error}", retriable=True) from error
        failures += 1
        delay = min(5.0, 0.1 * 2 ** failures)
        logger.warning("job %s: a chunk failed (%s); again in %.1fs", context.job.id, error, delay)
        until = time.monotonic() + delay
        while time.monotonic() < until:
            if self.stopping.is_set():
                raise _TailerStopping()
            context.check()
            time.sleep(min(0.1, max(0.0, until - time.monotonic())))
        return failures


class Publishing:
    """The running tailer's sink as a job's thread uses it: cells are encoded in the job's thread (as the live
    tailer encodes them, plus the :data:`HEADER`) and handed to the sink on the tailer's event loop."""

    def __init__(self, sink: TopicSink, config: TailerConfig, loop: asyncio.AbstractEventLoop) -> None:
        self.sink = sink
        self.config = config
        self.loop = loop
        self.packed = sink.packed_bodies

    def columns_for(self, columns: list[str] | None) -> list[str] | None:
        """The columns a job reads: its own, each one the tailer publishes, else the tailer's.

        Raises:
            ConfigurationError: a column the tailer does not publish (its topic is not the tailer's).
        """
        mine = self.config.columns
        if columns is None:
            return list(mine) if mine is not None else None
        outside = [c for c in columns if (mine is not None and c not in mine) or (mine is None and c[0] == "_")]
        if outside:
            raise ConfigurationError(f"tailer {self.config.name} does not publish column {outside[0]!r} "
                                     f"(its columns: {', '.join(mine) if mine else 'all but the reserved _ ones'})")
        return columns

    def names(self, column: str) -> bool:
        """The tailer's columns name ``column`` (a reserved one is published only then)."""
        return self.config.columns is not None and column in self.config.columns

    def encode(self, cell: AnyCell, job_id: str) -> Message:
        """The live message of ``cell`` with the :data:`HEADER`. Raises as :meth:`TopicSink.accept` does."""
        message: Message = self.sink.accept(cell)
        return Message(message.key, message.value, [*message.headers, (HEADER, job_id.encode())])

    def send(self, chunk: dict[int, list[Entry]], timeout: float) -> dict[int, tuple[int | None, BaseException | None]]:
        """(blocking, from the job's thread) Deliver a chunk; per shard the last added_id up to which every entry
        is acknowledged (None: none) and the error that stopped it (None: all acknowledged)."""
        future = asyncio.run_coroutine_threadsafe(self._deliver(chunk, timeout), self.loop)
        try:
            return future.result(timeout + 30)
        except concurrent.futures.TimeoutError:
            future.cancel()
            error = PublishError("the tailer's loop did not answer", retriable=True)
            return dict.fromkeys(chunk, (None, error))

    async def _deliver(self, chunk: dict[int, list[Entry]], timeout: float
                       ) -> dict[int, tuple[int | None, BaseException | None]]:
        tracked: dict[int, list[tuple[int, asyncio.Future[Any] | None]]] = {}
        refused: dict[int, BaseException] = {}
        for shard, entries in chunk.items():
            marks = tracked[shard] = []
            run: list[Entry] = []
            for entry in [*entries, None]:
                if run and (entry is None or entry.message is None or entry.column != run[0].column):
                    try:
                        await self.sink.prepare(run[0].column)
                        sent = await self.sink.deliver(shard, run[0].column, [e.message for e in run])
                    except (TailerError, ConfigurationError) as exc:
                        refused[shard] = exc
                        break
                    done = 0
                    for batch, count in sent:
                        done += count
                        marks.append((run[done - 1].added_id, batch))
                    run = []
                if entry is None:
                    break
                if entry.message is None:
                    marks.append((entry.added_id, None))
                else:
                    run.append(entry)
        futures = {f for marks in tracked.values() for _, f in marks if f is not None}
        if futures:
            await asyncio.wait(futures, timeout=timeout)
        answered: set[asyncio.Future[Any]] = set()
        out: dict[int, tuple[int | None, BaseException | None]] = {}
        for shard, marks in tracked.items():
            acked: int | None = None
            error: BaseException | None = refused.get(shard)
            for added_id, sent_future in marks:
                if sent_future is None:
                    acked = added_id
                    continue
                if not sent_future.done():
                    sent_future.add_done_callback(_read_outcome)
                    error = PublishError(f"not acknowledged within {timeout:g}s", retriable=True)
                    break
                problem = (asyncio.CancelledError() if sent_future.cancelled() else sent_future.exception())
                if problem is None:
                    acked = added_id
                    continue
                if sent_future not in answered:  # the sink replaces a broken client, once per failed future
                    answered.add(sent_future)
                    await self.sink.after_failure(problem, sent_future)
                error = self.sink.translate(problem)
                break
            out[shard] = (acked, error)
        for other in futures - answered:  # failed after a shard's first failure: read, not left unread
            if other.done():
                _read_outcome(other)
        return out


def _read_outcome(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


class Republisher:
    """The tailer's side: looks for the planned re-publish jobs of its tailer while it is the leader, runs one at
    a time beside the live tailing, and hands the running one back when the tailer stops."""

    def __init__(self, store: Store, config: TailerConfig, sink: TopicSink, is_leader: Callable[[], bool],
                 runner_config: RunnerConfig | None = None, poll: float = POLL_SECONDS) -> None:
        self.store = store
        self.config = config
        self.sink = sink
        self.is_leader = is_leader
        self.runner_config = runner_config or RunnerConfig()
        self.poll = poll
        self.jobs = JobStore(store)
        self.stopping = threading.Event()
        self._wake = asyncio.Event()
        # One thread of its own: a job holds it for as long as it runs, which the worker's reads must not wait on.
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"republish-{config.name}")
        self._task: asyncio.Task[None] | None = None
        self.running: str | None = None  # the id of the job running here

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name=f"republish-{self.config.name}")

    async def stop(self) -> None:
        """Stop the running job after its chunk (acknowledged), record where it got to and release it."""
        self.stopping.set()
        self._wake.set()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        self._thread.shutdown(wait=False)

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while not self.stopping.is_set():
            try:
                if self.is_leader():
                    found = await loop.run_in_executor(self._thread, self._next_job)
                    if found is not None and not self.stopping.is_set():
                        await loop.run_in_executor(self._thread, self._run, found, loop)
                        continue  # another may wait
            except LogstoreError as exc:
                logger.warning("%s: cannot read the re-publish jobs: %s", self.config.name, exc)
            except Exception:
                logger.exception("%s: a re-publish job failed", self.config.name)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.poll)

    def _next_job(self) -> str | None:
        """(in the thread) The oldest job of this tailer that a runner may take now."""
        for record in self.jobs.jobs():
            if (record.kind == KIND and record.params.get("tailer") == self.config.name
                    and record.state in ACTIVE_STATES and (record.claimable() or record.owner_gone())):
                return record.id
        return None

    def _run(self, job_id: str, loop: asyncio.AbstractEventLoop) -> None:
        """(in the thread) Run the job to its end, or until the tailer stops."""
        kind = Republish(self.store, Publishing(self.sink, self.config, loop), self.stopping)
        runner = JobRunner(self.store, KindRegistry([kind]), self.runner_config)
        self.running = job_id
        try:
            final = runner.run(job_id)
            logger.info("%s: re-publish job %s %s: %d cells", self.config.name, job_id, final.state, final.done)
        except _TailerStopping:
            self._hand_back(runner, kind, job_id)
        except JobStateError as exc:
            logger.debug("re-publish job %s not taken: %s", job_id, exc)
        except JobLeaseLostError as exc:
            logger.warning("%s: %s", self.config.name, exc)
        finally:
            self.running = None

    def _hand_back(self, runner: JobRunner, kind: Republish, job_id: str) -> None:
        """Record the running step's acknowledged place and release the job (still running, no owner): the next
        runner takes it at once."""
        last = kind.last

        def release(record: JobRecord) -> None:
            if record.owner != runner.owner:
                raise JobLeaseLostError(f"job {job_id} is owned by {record.owner} now")
            if last is not None:
                name, done, cursor = last
                for step in record.steps:
                    if step.name == name and step.state != "done":
                        step.done, step.cursor, step.state = done, cursor, "planned"
            record.owner, record.lease_expires, record.backoff = None, None, None
        try:
            self.jobs.change(job_id, release)
            logger.info("%s: stopping: re-publish job %s handed back", self.config.name, job_id)
        except (LogstoreError, JobLeaseLostError) as exc:
            logger.warning("%s: re-publish job %s not handed back (%s): it waits for its lease to lapse",
                           self.config.name, job_id, exc)


def republish_jobs(store: Store, tailer: str, *, every: bool = False, recent: int = 3) -> list[dict[str, Any]]:
    """The re-publish jobs of ``tailer`` for ``tail status``: those not over, then the ``recent`` last over (all
    with ``every``), each as its summary and its range.

    Raises:
        StorageError: the store cannot be read.
    """
    mine = [r for r in JobStore(store).jobs() if r.kind == KIND and r.params.get("tailer") == tailer]
    over = [r for r in mine if r.state in FINAL_STATES]
    shown = [r for r in mine if r.state not in FINAL_STATES] + (over if every else over[-recent:] if recent else [])
    out = []
    for record in shown:
        p = record.params
        out.append({**record.summary(), "columns": p.get("columns"), "shards": p.get("shards") or "all",
                    "from": p.get("from") or "beginning", "until": p.get("until") or "end",
                    "shards_in_range": p.get("shards_in_range"), "requested_at": p.get("requested_at"),
                    "published": sum(int((s.cursor or {}).get("published", 0)) for s in record.steps),
                    "skipped": sum(int((s.cursor or {}).get("skipped", 0)) for s in record.steps)})
    return out
