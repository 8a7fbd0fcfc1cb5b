"""Backfill: build an index version from the shard logs while an app keeps it current.

The backfill reads every shard's log from location 0 to the shard's head as it was
when the backfill first started (its *target*), and applies the cells of the index's
column as the ``backfill`` stream: each batch records the stream's position in the
same transaction as its entries, so an interrupted backfill resumes where it was.
Cells after the targets are the app's (it was keeping the version current before
the backfill started, which the catalog checks), and live and backfill applies of
the same row take turns on its locator, so together they cover the whole log
exactly once in effect. A tombstone removes the row's entry, as live processing's
does. A cell whose body does not fit the definition goes to the
DLQ of the app that keeps the version current (replayable there); past
``max_dead_letters`` of them the backfill stops: the definition is likely wrong.
"""

from __future__ import annotations

import concurrent.futures
import datetime as dt
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from indexer.errors import IndexStateError
from indexer.indexes.applier import change_of, handler_name
from indexer.indexes.catalog import IndexCatalog
from indexer.indexes.definitions import IndexDefinition
from indexer.runtime.dlq_store import DeadLetterStore
from indexer.runtime.policy import Outcome, describe
from logstore import Cell, CorruptCellError, Store, TruncatedPage
from logstore.index_tables.persistence import IndexChange, IndexPosition

logger = logging.getLogger(__name__)


class BackfillProgress(NamedTuple):
    """How far a backfill is: ``cells_done`` of ``cells`` counts the cells of the index's column, the ones
    :attr:`BackfillResult.cells` reports when it ends."""

    shards_done: int
    shards: int
    cells_done: int
    cells: int  # of the index's column, after the positions and up to the targets when the backfill (re)started
    seconds: float

    @property
    def rate(self) -> float:
        return self.cells_done / self.seconds if self.seconds > 0 else 0.0

    @property
    def eta(self) -> float | None:
        return (self.cells - self.cells_done) / self.rate if self.rate > 0 else None


class BackfillResult(NamedTuple):
    shards: int  # shards done: every shard of the store once the backfill finished
    cells: int  # cells of the index's column read (an undecodable one included: it is dead-lettered)
    applied: int
    superseded: int
    dead_lettered: int
    seconds: float


class _Run:
    """One backfill's shared state (threads work on different shards)."""

    def __init__(self, store: Store, definition: IndexDefinition, app: str | None, total: int, shards: int,
                 max_dead_letters: int, progress: Callable[[BackfillProgress], None] | None) -> None:
        self.store, self.definition, self.spec = store, definition, definition.spec
        self.deadletters = DeadLetterStore(store, app) if app else None
        self.total, self.shards, self.max_dead_letters = total, shards, max_dead_letters
        self.progress = progress
        self.lock = threading.Lock()
        self.started = time.monotonic()
        self.read = self.applied = self.superseded = self.dead = self.done = 0

    def report(self) -> None:
        if self.progress is not None:
            self.progress(BackfillProgress(self.done, self.shards, self.read, self.total,
                                           time.monotonic() - self.started))

    def deadletter(self, source: dict[str, Any], where: dict[str, Any], body: dict[str, Any] | None,
                   exc: BaseException) -> None:
        now = dt.datetime.now(dt.UTC)
        if self.deadletters is None:
            raise IndexStateError(f"backfill of {self.definition.name}: cell {where} does not fit ({exc}) and no "
                                  "app keeps this version, so there is no DLQ for it") from exc
        self.deadletters.record(handler_name(self.definition), self.definition.column, source, dict(where), body,
                                Outcome(False, 1, describe(exc), now, now))
        with self.lock:
            self.dead += 1
            if self.dead > self.max_dead_letters:
                raise IndexStateError(
                    f"backfill of {self.definition.name} version {self.definition.version} stopped: more than "
                    f"{self.max_dead_letters} cells do not fit the definition (last: {exc}); see `cellstream dlq "
                    f"--app {self.deadletters.app} stats`, fix the definition in a new version") from exc

    def shard(self, position: IndexPosition, batch: int, stop: threading.Event) -> None:
        shard, location, target = position.shard, position.location, position.target or 0
        column = [self.definition.column]
        while location < target and not stop.is_set():
            try:
                cells, _ = self.store.get_cells_for_shard(shard, location, batch, columns=column)
                damaged = None
            except CorruptCellError as exc:
                cells, damaged = exc.cells_before, exc
            cut = isinstance(cells, TruncatedPage)  # short for the read's byte budget, not at the log's end
            cells = [c for c in cells if c.added_id <= target]
            # A damaged cell past the target is the app's: the page before it holds the rest of the column.
            inside = damaged if damaged is not None and (damaged.added_id or 0) <= target else None
            through = cells[-1].added_id if cells else location
            if inside is not None:
                through = inside.added_id or location
            elif damaged is not None or (len(cells) < batch and not cut):
                through = target  # nothing more of the column up to the target
            changes = self.prepare(cells)
            dead = inside is not None and through > location
            if inside is not None and dead:
                where = {"row_key": str(inside.row_key), "column": inside.column, "ref_key": inside.ref_key,
                         "shard": shard, "added_id": through}
                self.deadletter({"mode": "backfill", "shard": shard, "added_id": through}, where, None, inside)
            result = self.store.indexes.apply(self.spec, changes, "backfill", through={shard: through})
            with self.lock:
                # The column's cells in (location, through]: the page's, and the damaged one it ends at.
                self.read += len(cells) + dead
                self.applied += result.applied
                self.superseded += result.superseded
            location = through
            self.report()
        if location >= target:
            with self.lock:
                self.done += 1
            self.report()

    def prepare(self, cells: list[Cell]) -> list[IndexChange]:
        changes = []
        for cell in cells:
            try:
                changes.append(change_of(self.definition, cell))  # a tombstone removes the entry, as live
            except Exception as exc:
                self.deadletter({"mode": "backfill", "shard": cell.shard, "added_id": cell.added_id},
                                cell.coordinates(), cell.body, exc)
        return changes


def backfill(store: Store, name: str, version: int, *, batch: int = 1000, workers: int = 4,
             max_dead_letters: int = 1000, progress: Callable[[BackfillProgress], None] | None = None,
             stop: threading.Event | None = None) -> BackfillResult:
    """Build ``version`` of index ``name`` from the shard logs up to their heads (resumable); mark it ready
    when every shard is done. ``stop`` ends it early (resume by calling again)."""
    catalog = IndexCatalog(store)
    record = catalog.backfill_started(name, version)
    found = record.version(version)
    definition, spec = found.definition, found.definition.spec
    positions = store.indexes.positions(spec, "backfill")
    unset = [s for s in range(store.shard_count) if s not in positions or positions[s].target is None]
    if unset:
        store.indexes.set_targets(spec, "backfill", {s: store.head(s) for s in unset})
        positions = store.indexes.positions(spec, "backfill")
    todo = [p for _, p in sorted(positions.items()) if p.location < (p.target or 0)]
    column = [definition.column]
    after = store.counts_after({p.shard: p.location for p in todo}, columns=column)
    beyond = store.counts_after({p.shard: p.target or 0 for p in todo}, columns=column)
    total = sum(after[p.shard] - beyond[p.shard] for p in todo)
    run = _Run(store, definition, found.app, total, store.shard_count, max_dead_letters, progress)
    run.done = store.shard_count - len(todo)
    run.report()
    halt = stop or threading.Event()
    with concurrent.futures.ThreadPoolExecutor(max(1, workers), thread_name_prefix="backfill") as pool:
        futures = [pool.submit(run.shard, p, batch, halt) for p in todo]
        try:
            for future in concurrent.futures.as_completed(futures):
                future.result()
        except BaseException:
            halt.set()  # the other shards stop after their page; their positions keep what they did
            raise
    if run.done == store.shard_count:
        catalog.backfill_finished(name, version)
        logger.info("index %s version %d backfilled: %d cells read, %d applied, %d superseded, %d dead-lettered",
                    name, version, run.read, run.applied, run.superseded, run.dead)
    return BackfillResult(run.done, run.read, run.applied, run.superseded, run.dead,
                          time.monotonic() - run.started)
