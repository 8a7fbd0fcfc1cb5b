"""Replays: an app's handlers (or a connector's sink) run again over a bounded range of the shard logs, as a job
(:mod:`logstore.jobs`), beside the app's live consumer (``cellstream replay``; docs/jobs.md).

**The range** of each shard is fixed when the job is planned: the cells of the app's columns with
``start < added_id <= end``, where ``start`` comes from ``from`` (:func:`logstore.positions.resolve_positions`)
and ``end`` is the shard's head then (a shard's log only grows and its ids never change, so that head is an
exact high watermark), or ``until``'s location when lower. The starts, ends and cell counts are kept in the
steps' parameters, so a resumed job replays the same cells whatever was written since.

**Positions.** The job's own, never the app's: a store consumer named ``replay.<job id>``
(:func:`positions_consumer`), claimed by each runner (a runner that lost the job is fenced off) and committed
after the app's buffering handlers flushed (flush-before-commit, as the live app commits), at most every
``commit_interval`` of the app. A runner killed at any point resumes from the last commit: every cell of the
range is delivered at least once, in per-shard order. The live consumer (``app.<name>``) is never read nor
written, and runs on; nor are the positions an index applier records with its batches (a range beginning past
them would make the live applier skip the cells in between): it applies the replay's without
(:class:`~indexer.runtime.handlers.PositionedApplier`).

**Delivery** is the live app's: reads of many shards at a time (:meth:`logstore.Store.read_pages`, about a page
each, the store's ``parallel_reads`` of them under way within the app's ``max_in_flight`` cells, as the live
app reads) go to the direct mode's :class:`~indexer.runtime.direct.HandlerSink` as they arrive, so handlers get
the same batches, retries, dead letters and stall threshold. A dead letter's ``source`` says ``{"mode":
"replay", "job": <job id>, "shard", "added_id"}``. The job's throttle paces the reads.

**Latest only** (``latest_only``): a cell of the range is delivered only when, as it is read, it is the newest
version of its (row, column) in the store (the highest ref_key, :meth:`logstore.Store.get_cells_latest`). So
each (row, column) touched in the range is delivered at most once (again only after a crash), as its newest
version; one whose newest version lies outside the range (written after the end: the live consumer delivers
it; or, with ref_keys out of order, before the start) is not delivered by the replay. The other cells count
as done without reaching a handler.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, NamedTuple

from indexer.errors import ConfigurationError
from indexer.runtime.app import App
from indexer.runtime.direct import HandlerSink
from indexer.runtime.handlers import PositionedApplier
from logstore import CorruptCellError, LogstoreError, Store, TruncatedPage, UndecodedPages
from logstore.cell import Cell
from logstore.errors import InvalidArgumentError, JobLeaseLostError, JobNotFoundError
from logstore.jobs import JobKind, JobRecord, JobStore, StepContext, StepRecord
from logstore.jobs.runner import owner_name
from logstore.positions import check_range, parse_position, parse_shards, resolve_positions
from tailer.errors import PublishError
from tailer.messages import deadletter_record

logger = logging.getLogger(__name__)
KIND = "replay"
STEP_SHARDS = 4096  # shards a step: one read loop over thousands of shards, a step per 4096 of a larger store
_WAIT = 0.05  # seconds between looks at a stall or a pause while the handlers work
_REPORT = 0.2  # seconds between progress reports (each one a progress bar's refresh)
_DOC: dict[str, Any] = {}  # the positions' doc, one object for every shard (encoded once a commit)

#: ``load(params)``: the app a job's parameters name, and what closes it (its sink, a store it opened).
AppLoader = Callable[[dict[str, Any]], tuple[App, Callable[[], None]]]


class _Delivery(NamedTuple):
    """What one read handed to the sink, by shard: its position once its futures settled, its cells of the range,
    its futures not settled yet."""

    moved: dict[int, int]
    scanned: dict[int, int]
    pending: dict[int, int]


def positions_consumer(job_id: str) -> str:
    """The store consumer holding a replay job's positions (``Store.read_offsets`` reads them)."""
    return f"replay.{job_id}"


def replay_params(app: App, reference: dict[str, Any], *, start: str, until: str | None = None,
                  shards: str | None = None, latest_only: bool = False) -> dict[str, Any]:
    """A replay job's parameters: what the loader needs to load the app again (``reference``: e.g. ``{"app":
    "billing:app"}``, never a secret), its columns and the range as given (checked here).

    Raises:
        InvalidArgumentError: a position or a shard set that does not parse.
        ConfigurationError: the app has no handlers.
    """
    first = parse_position(start)
    if until is not None:
        check_range(first, parse_position(until))
    if shards is not None:
        parse_shards(shards, app.store.shard_count)
    columns = sorted({trigger.column for trigger in app.triggers})
    if not columns:
        raise ConfigurationError(f"app {app.name} has no handlers: nothing to replay")
    return {**reference, "name": app.name, "columns": columns, "from": start, "until": until, "shards": shards,
            "latest_only": latest_only}


def plan_range(store: Store, params: dict[str, Any]) -> dict[int, tuple[int, int, int]]:
    """Each shard's part of the range, now: shard -> (start, end, cells of the columns in it); shards with no
    cell of the columns in range are left out.

    Raises:
        InvalidArgumentError: a position or shard set that does not parse, or names shards outside the range.
        StorageError: the store cannot be read.
    """
    columns = list(params["columns"])
    wanted = parse_shards(params["shards"], store.shard_count) if params.get("shards") else None
    starts = resolve_positions(store, parse_position(params["from"]), wanted)
    heads = store.heads(starts)
    ends = {shard: max(starts[shard], heads[shard]) for shard in starts}
    if params.get("until") is not None:
        until = parse_position(params["until"])
        if until.kind == "locations":  # a location past the head is the head: nothing is there to skip
            outside = sorted(set(until.locations) - set(starts))
            if outside:
                raise InvalidArgumentError(f"--until names shard {outside[0]}, which the range does not hold")
            bounds = {shard: int(location) for shard, location in until.locations.items()}
        else:
            bounds = resolve_positions(store, until, list(starts))
        for shard, bound in bounds.items():
            ends[shard] = max(starts[shard], min(ends[shard], bound))
    moving = {shard: start for shard, start in starts.items() if ends[shard] > start}
    after_start = store.counts_after(moving, columns=columns) if moving else {}
    after_end = store.counts_after({shard: ends[shard] for shard in moving}, columns=columns) if moving else {}
    out: dict[int, tuple[int, int, int]] = {}
    for shard, start in moving.items():
        cells = after_start.get(shard, 0) - after_end.get(shard, 0)
        if cells > 0:
            out[shard] = (start, ends[shard], cells)
    return out


class Replay(JobKind):
    """The ``replay`` job kind (see the module docstring).

    Parameters (:func:`replay_params`): what ``load`` needs (e.g. ``app``), ``name``, ``columns``, ``from``,
    ``until``, ``shards``, ``latest_only``. Each step replays up to :data:`STEP_SHARDS` shards; its
    parameters hold their starts and ends.

    Args:
        store: the store read (the job's).
        load: loads the app of a job's parameters (:data:`AppLoader`).
    """

    name: ClassVar[str] = KIND
    unit: ClassVar[str] = "cells"

    def __init__(self, store: Store, load: AppLoader) -> None:
        self.store = store
        self.load = load

    def plan(self, params: dict[str, Any]) -> list[StepRecord]:
        for key in ("columns", "from"):
            if not params.get(key):
                raise InvalidArgumentError(f"a replay job needs {key!r} in its parameters")
        found = plan_range(self.store, params)
        shards = sorted(found)
        steps = []
        for at in range(0, len(shards), STEP_SHARDS):
            part = shards[at:at + STEP_SHARDS]
            steps.append(StepRecord(
                name=f"shards {part[0]}-{part[-1]}" if len(part) > 1 else f"shard {part[0]}",
                params={"shards": part, "start": [found[s][0] for s in part], "end": [found[s][1] for s in part],
                        "cells": [found[s][2] for s in part]},
                total=sum(found[s][2] for s in part)))
        return steps

    def run_step(self, step: StepRecord, context: StepContext) -> None:
        job = context.job
        app, close = self.load(job.params)
        try:
            if app.store is not self.store:
                try:  # the app names its store itself: it must hold this job
                    JobStore(app.store).get(job.id)
                except JobNotFoundError:
                    raise ConfigurationError(f"app {app.name} uses another store than the one of job {job.id}; "
                                             "run the job on the app's store") from None
            asyncio.run(_StepRun(self.store, app, job, step, context).run())
        finally:
            close()

    def details(self, record: JobRecord) -> list[str]:
        cursors = [step.cursor for step in record.steps if isinstance(step.cursor, dict)]
        handled = sum(int(c.get("handled", 0)) for c in cursors)
        dead = sum(int(c.get("dead_lettered", 0)) for c in cursors)
        passed = sum(int(c.get("done", 0)) for c in cursors)
        older = f", {max(0, passed - handled - dead)} older versions passed over" \
            if record.params.get("latest_only") else ""
        shards = sum(len(step.params.get("shards", [])) for step in record.steps)
        return [f"{shards} shards hold cells of the range",
                f"{passed} cells of the range passed: {handled} handled, {dead} dead-lettered{older}"]

    def describe(self, record: JobRecord) -> str:
        p = record.params
        what = p.get("app") or p.get("connector") or p.get("name")
        until = p.get("until") or "the heads when planned"
        only = ", latest version of each (row, column) only" if p.get("latest_only") else ""
        shards = f" shards {p['shards']}" if p.get("shards") else ""
        return (f"replay {what} ({', '.join(p.get('columns', []))}){shards} from {p.get('from')} until {until}"
                f"{only}; positions in consumer {positions_consumer(record.id)}")



class _StepRun:
    """One run of one step, on its own event loop."""

    def __init__(self, store: Store, app: App, job: JobRecord, step: StepRecord, context: StepContext) -> None:
        self.store = store
        self.app = app
        self.job = job
        self.context = context
        self.shards: list[int] = list(step.params["shards"])
        self.ends: dict[int, int] = dict(zip(self.shards, step.params["end"], strict=True))
        self.starts: dict[int, int] = dict(zip(self.shards, step.params["start"], strict=True))
        self.cells: dict[int, int] = dict(zip(self.shards, step.params["cells"], strict=True))
        self.total = step.total
        earlier = step.cursor if isinstance(step.cursor, dict) else {}
        self._earlier = (int(earlier.get("handled", 0)), int(earlier.get("dead_lettered", 0)))  # runs before
        self._counted_from = app.processor.counts
        self.columns = list(job.params["columns"])
        self.latest_only = bool(job.params.get("latest_only"))
        self.consumer = positions_consumer(job.id)
        self.owner = job.owner or owner_name()
        config = app.config
        # Under a rate a read holds about a second of it at most (the rate when the step starts): the throttle's
        # wait comes before a read, so a whole page at a low rate meant a long silence, then the page at once.
        rate = context.throttle.settings.rate
        self.read_size = config.page_size if rate is None else max(1, min(config.page_size, int(rate)))
        self.budget = config.max_in_flight  # cells read or handed over and not settled, as the live app has
        # A read at a time under a rate: reads waiting together on the throttle's debt would end together.
        self.read_ahead = store.parallel_reads if rate is None else 1
        self.commit_every = config.commit_every(kafka=False)

    async def run(self) -> None:
        # Appliers that record a stream's positions (an index version's) apply without: the live stream's are
        # the live applier's alone, and a range beginning past them would make it skip the cells in between.
        appliers: list[PositionedApplier] = []
        for trigger in self.app.triggers:
            if isinstance(trigger.applier, PositionedApplier):
                appliers.append(trigger.applier)
                trigger.applier.stream = None
        try:
            await self._run()
        finally:
            for applier in appliers:
                applier.stream = "live"

    async def _run(self) -> None:
        processor = self.app.processor
        await asyncio.to_thread(processor.load_open_counts)
        processor.stalled = None
        claimed = await asyncio.to_thread(self.store.claim_offsets, self.consumer, self.owner, self.shards)
        positions = {s: self.starts[s] if (r := claimed.get(s)) is None or r.location is None else r.location
                     for s in self.shards}
        left = await asyncio.to_thread(self._left, positions)
        done = max(0, (self.total or 0) - sum(left.values()))
        self.context.progress(done, self.total, cursor=self._cursor(done))
        config = self.app.config
        sink = HandlerSink(processor, config.page_size, config.max_active_shards,
                           source={"mode": "replay", "job": self.job.id})
        await sink.start()
        try:
            await self._loop(sink, positions, left, done)
        finally:
            await sink.stop()

    def _left(self, positions: dict[int, int]) -> dict[int, int]:
        """(blocking) Cells of the range after each shard's position: counted for the shards a run before this
        one moved (two reads per storage node), as planned for the others."""
        left = {s: self.cells[s] for s, at in positions.items() if at == self.starts[s]}
        moved = {s: at for s, at in positions.items() if self.starts[s] < at < self.ends[s]}
        if moved:
            after = self.store.counts_after(moved, columns=self.columns)
            beyond = self.store.counts_after({s: self.ends[s] for s in moved}, columns=self.columns)
            left.update((s, max(0, after.get(s, 0) - beyond.get(s, 0))) for s in moved)
        return left

    async def _loop(self, sink: HandlerSink, positions: dict[int, int], left: dict[int, int], done: int) -> None:
        """Reads of about a page each, ``parallel_reads`` of them at once within ``max_in_flight`` cells (as the
        live app's reads go), each handed to the sink as it arrives; a shard's position moves once its cells of a
        read, and of every read of it before, settled."""
        processor = self.app.processor
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()
        read_at = dict(positions)
        waiting = deque(s for s in self.shards if positions[s] < self.ends[s])  # shards to read, in turn
        reads: dict[asyncio.Future[UndecodedPages], int] = {}  # running reads: cells reserved
        chains: dict[int, deque[_Delivery]] = {}  # a shard's deliveries not settled yet, in order
        settled: deque[tuple[asyncio.Future[Any], _Delivery, int]] = deque()  # (future, its delivery, its shard)
        unsettled = 0  # futures handed over, not settled yet
        in_flight = 0  # cells reserved by running reads and handed over unsettled
        changed: set[int] = set()
        committed_at = reported_at = time.monotonic()

        def on_settled(future: asyncio.Future[Any], delivery: _Delivery, shard: int) -> None:
            settled.append((future, delivery, shard))
            wake.set()

        def absorb(touched: set[int], strict: bool) -> int:
            """Take in the settled futures; move the positions of the shards whose next deliveries all settled.
            Returns the cells they moved past. ``strict``: a failed future raises (else it holds its shard)."""
            nonlocal unsettled
            while settled:
                future, delivery, shard = settled.popleft()
                unsettled -= 1
                failed = future.cancelled() or future.exception() is not None
                if failed and strict:
                    if future.cancelled():
                        raise PublishError("a batch of the replay was abandoned", retriable=True)
                    raise future.exception() or AssertionError  # the step runs again from its committed positions
                if not failed:
                    delivery.pending[shard] -= 1
                    touched.add(shard)
            moved = 0
            for shard in touched:
                chain = chains.get(shard)
                while chain and not chain[0].pending[shard]:
                    delivery = chain.popleft()
                    positions[shard] = delivery.moved[shard]
                    changed.add(shard)
                    moved += delivery.scanned[shard]
                if not chain:
                    chains.pop(shard, None)
            return moved
        try:
            while True:
                wake.clear()
                while waiting and len(reads) < self.read_ahead and in_flight < self.budget:
                    picked, reserved = self._pick(waiting, read_at, left)
                    future = loop.run_in_executor(None, self._read, picked, reserved)
                    future.add_done_callback(lambda _f: wake.set())
                    reads[future] = reserved
                    in_flight += reserved
                if not reads and not chains:
                    break
                if not settled and not any(f.done() for f in reads):
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(wake.wait(), _WAIT)
                touched: set[int] = set()
                for future in [f for f in reads if f.done()]:
                    in_flight -= reads.pop(future)
                    pages: dict[int, Any] = future.result().decode()
                    newest = await asyncio.to_thread(self._newest, pages) if self.latest_only else {}
                    runs, deadletters, delivery = self._take(pages, newest, read_at, left, waiting)
                    handed = [(f, shard) for (shard, _column, _cells), per_run in
                              zip(runs, await sink.deliver_batch(runs) if runs else [], strict=True)
                              for f, _count in per_run]
                    for shard, record in deadletters:
                        handed.append((await sink.deadletter(shard, record), shard))
                    for shard in delivery.moved:
                        delivery.pending[shard] = 0
                        chains.setdefault(shard, deque()).append(delivery)
                    for f, shard in handed:
                        delivery.pending[shard] += 1
                        f.add_done_callback(functools.partial(on_settled, delivery=delivery, shard=shard))
                    unsettled += len(handed)
                    in_flight += sum(delivery.scanned.values())
                    touched.update(delivery.moved)  # a shard with nothing handed over may move at once
                moved = absorb(touched, strict=True)
                in_flight -= moved
                if processor.stalled is not None:
                    raise processor.stalled
                done += moved
                now = time.monotonic()
                if changed and now - committed_at >= self.commit_every:
                    await self._commit(processor.checkpoint, positions, changed)
                    committed_at = now
                if moved and now - reported_at >= _REPORT:
                    self.context.progress(done, self.total, cursor=self._cursor(done))
                    reported_at = now
                else:
                    self.context.check()
        except BaseException as exc:
            if not isinstance(exc, Exception):  # the runner's stop signal: keep what the handlers finish
                with contextlib.suppress(Exception):
                    await sink.stop()  # what is under way finishes, the rest is abandoned
                    await asyncio.sleep(0)  # the settled futures' callbacks
                    absorb(set(), strict=False)
                    if changed:
                        await self._commit(processor.checkpoint, positions, changed)
            raise
        assert not unsettled
        if changed:
            await self._commit(processor.checkpoint, positions, changed)
        self.context.progress(done, self.total, cursor=self._cursor(done))

    def _cursor(self, done: int) -> dict[str, Any]:
        """The step's cursor: its positions' consumer, the cells of the range passed, and of those the handled
        and dead-lettered ones (a latest-only replay passes over the older versions), over every run."""
        since = self.app.processor.counts - self._counted_from
        return {"consumer": self.consumer, "done": done, "handled": self._earlier[0] + since.processed,
                "dead_lettered": self._earlier[1] + since.dead_lettered}

    def _pick(self, waiting: deque[int], read_at: dict[int, int], left: dict[int, int]) -> tuple[dict[int, int], int]:
        """The next shards in turn for one read of about a page (by what each has left), and the cells reserved."""
        picked: dict[int, int] = {}
        cells = 0
        while waiting and cells < self.read_size:
            shard = waiting.popleft()
            picked[shard] = read_at[shard]
            cells += max(1, min(left.get(shard, 0), self.read_size))
        return picked, cells

    def _read(self, locations: dict[int, int], reserved: int) -> UndecodedPages:
        """(blocking, in a thread) The throttle's wait for the cells about to be read (the job's rate paces its
        reads, and so what it hands over), then the shards' pages, read and not decoded: the loop decodes them
        (a thread decoding beside the loop would queue for the GIL after every cell)."""
        self.context.throttle.wait(reserved)
        return self.store.read_pages(locations, self.read_size, columns=self.columns)

    def _newest(self, pages: dict[int, Any]) -> dict[tuple[Any, str], int]:
        """(blocking) Latest only: the newest ref_key of each (row, column) the pages hold cells of in range."""
        wanted: dict[tuple[Any, str], None] = {}
        for shard, page in pages.items():
            cells = page.cells_before if isinstance(page, CorruptCellError) else page
            if isinstance(cells, list):
                end = self.ends[shard]
                wanted.update(((c.row_key, c.column), None) for c in cells if c.added_id <= end)
        keys = list(wanted)
        return {key: latest.ref_key for key, latest in zip(keys, self.store.get_cells_latest(keys), strict=True)
                if latest is not None}

    def _take(self, pages: dict[int, Any], newest: dict[tuple[Any, str], int], read_at: dict[int, int],
              left: dict[int, int], waiting: deque[int]
              ) -> tuple[list[tuple[int, str, Sequence[Cell]]], list[tuple[int, dict[str, Any]]], _Delivery]:
        """A read's pages cut at each shard's end: the runs to deliver, the dead letters of cells that cannot be
        decoded, each shard's position once they are handled, and the cells of the range they cover. A shard
        not at its end yet goes back in line."""
        runs: list[tuple[int, str, Sequence[Cell]]] = []
        deadletters: list[tuple[int, dict[str, Any]]] = []
        delivery = _Delivery({}, {}, {})
        for shard, page in pages.items():
            end = self.ends[shard]
            problem: CorruptCellError | None = None
            if isinstance(page, CorruptCellError):
                problem, cells = page, list(page.cells_before)
            elif isinstance(page, LogstoreError):
                raise page  # the step is run again from its positions (retriable errors after a back-off)
            else:
                cells = page
            count = len(cells)
            keep = count
            while keep and cells[keep - 1].added_id > end:
                keep -= 1
            finished = keep < count
            if finished:
                cells, problem = cells[:keep], None
            if problem is not None and (problem.added_id is None or problem.added_id > end):
                if problem.added_id is None:
                    raise problem
                finished, problem = True, None
            last = problem.added_id if problem is not None else cells[-1].added_id if cells else read_at[shard]
            assert last is not None
            if problem is None and not finished and count < self.read_size and not isinstance(page, TruncatedPage):
                finished = True  # the log's end: every cell up to the end was there when the job was planned
            if last >= end:
                finished = True
            taken = len(cells) + (problem is not None)
            delivery.scanned[shard] = taken
            left[shard] = max(0, left.get(shard, 0) - taken)
            read_at[shard] = delivery.moved[shard] = end if finished else last
            if self.latest_only:
                cells = [c for c in cells if newest.get((c.row_key, c.column)) == c.ref_key]
            if cells:
                runs.append((shard, cells[0].column, cells))
            if problem is not None:
                where = {"row_key": str(problem.row_key), "column": problem.column, "ref_key": problem.ref_key,
                         "added_id": problem.added_id, "shard": shard,
                         "created_at": problem.created_at.isoformat() if problem.created_at else None}
                logger.error("replay %s: shard %d: %s; dead-lettered", self.job.id, shard, problem)
                deadletters.append((shard, deadletter_record(where, topic=problem.column or "unknown", error=problem,
                                                             stage="decode", tailer=self.consumer,
                                                             worker=self.owner)))
            if not finished:
                waiting.append(shard)
        return runs, deadletters, delivery

    async def _commit(self, flush: Callable[[], Any], positions: dict[int, int], changed: set[int]) -> None:
        """Flush the buffering handlers, then commit the positions that moved (flush-before-commit)."""
        await flush()
        todo = {shard: (positions[shard], _DOC) for shard in changed}
        fenced = await asyncio.to_thread(self.store.commit_offsets, self.consumer, self.owner, todo)
        if fenced:
            raise JobLeaseLostError(f"replay {self.job.id}: another runner holds its positions now "
                                    f"({len(fenced)} shards fenced); this one stops")
        changed.clear()
