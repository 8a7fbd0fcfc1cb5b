"""The copy of a source table into cells while its changes are applied: ``cellstream migrate start``.

One loop: read a chunk of rows in key order, write its cells (ref_key: the chunk's log position, or the rows'
version column), record the cursor, then apply the changes the source logged meanwhile and acknowledge them.
Once the table is copied the loop only applies changes, until it is stopped. Every write is idempotent (a cell
written again with the same body is a no-op), and the cursor and the acknowledged position advance only after
the cells they cover are stored: a process killed anywhere starts again from its last record and loses nothing,
at the price of writing some cells twice. No lock is taken on the source beyond a chunk's read.
"""

from __future__ import annotations

import datetime as dt
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from connectors.errors import MigrationStateError
from connectors.migration.flow_back import FlowBack
from connectors.migration.mapping import MigratedCell, RowMapper
from connectors.migration.records import REQUESTS, MigrationRecord, MigrationRecords, now
from connectors.migration.source import Change, ChangeLag, MigrationSource, SourceRow
from connectors.migration.spec import MigrationSpec
from connectors.migration.writes import FENCE_GRACE, LEASE
from logstore import Store
from logstore.jobs import Throttle, ThrottleSettings

logger = logging.getLogger(__name__)
LAG_WARNING = 60.0  # seconds of capture lag before a warning
LAG_CHECK = 1.0  # seconds between two reads of the capture lag
THROTTLE_PAUSE = 0.5  # seconds between two looks at the source's load while the copy waits


class MoveProgress(NamedTuple):
    """Where a migration is, after each chunk or batch of changes."""

    phase: str
    rows_copied: int
    changes_applied: int
    lag_bytes: int  # as last measured (once a second at most)


class MoveMetrics:
    """The copy's Prometheus series, by migration (``cellstream migrate start --metrics-port``):

    - ``cellstream_migration_rows_copied_total``, ``cellstream_migration_changes_applied_total``;
    - ``cellstream_migration_capture_lag_seconds``: the age of the oldest change not yet applied (0: none waits);
    - ``cellstream_migration_capture_lag_bytes``: the source's log between the position applied and its own;
    - ``cellstream_migration_copy_throttled_seconds_total``: how long the copy waited for the source's load;
    - ``cellstream_migration_cells_flowed_back_total``: cells written back to the source after the switch.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        self.rows = Counter("cellstream_migration_rows_copied", "Source rows copied into cells", ["migration"],
                            registry=r)
        self.changes = Counter("cellstream_migration_changes_applied", "Source changes applied to the cells",
                               ["migration"], registry=r)
        self.lag_seconds = Gauge("cellstream_migration_capture_lag_seconds", "Age of the oldest source change not "
                                 "yet applied (0: none waits)", ["migration"], registry=r)
        self.lag_bytes = Gauge("cellstream_migration_capture_lag_bytes", "Source log between the position applied "
                               "and the source's own (a slot holds it)", ["migration"], registry=r)
        self.flowed_back = Counter("cellstream_migration_cells_flowed_back", "Cells written back to the source "
                                   "table since the writes switched to the store", ["migration"], registry=r)
        self.throttled = Counter("cellstream_migration_copy_throttled_seconds", "Seconds the copy waited for the "
                                 "source's load or replica lag", ["migration"], registry=r)

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        start_http_server(port, addr=addr, registry=self.registry)


class Mover:
    """Moves one table into a store, following ``spec``."""

    def __init__(self, spec: MigrationSpec, source: MigrationSource, store: Store, *, chunk_rows: int = 1000,
                 change_batch: int = 5000, rate: float | None = None, metrics: MoveMetrics | None = None,
                 lag_warning: float = LAG_WARNING, max_running: int | None = None,
                 max_replica_lag: float | None = None) -> None:
        """Args:
            chunk_rows: rows a chunk (a snapshot's read) at most.
            change_batch: changes read at a time, at most about.
            rate: rows copied a second at most (the jobs' token bucket; None: as fast as both sides go); changes
                are never held back.
            metrics: the series to keep (None: none).
            lag_warning: seconds of capture lag above which a warning is logged (once each time it goes above).
            max_running: the copy waits while more statements than this run on the source (gh-ost's
                ``--max-load Threads_running=N``); the changes are applied meanwhile. None: no limit.
            max_replica_lag: the copy waits while the source's replicas are more seconds behind than this
                (PostgreSQL's ``replay_lag``; a MySQL primary does not report it). None: no limit.
        """
        self.spec = spec
        self.source = source
        self.store = store
        self.mapper = RowMapper(spec)
        self.records = MigrationRecords(store)
        self.chunk_rows = chunk_rows
        self.change_batch = change_batch
        self.rate = rate
        self.metrics = metrics
        self.lag_warning = lag_warning
        self.max_running = max_running
        self.max_replica_lag = max_replica_lag
        self._lag = ChangeLag(0, 0.0)  # as last measured
        self._lag_checked = -math.inf
        self._lagging = False
        self._flow_back_: FlowBack | None = None

    def run(self, *, follow: bool = True, until_caught_up: bool = False, stop: threading.Event | None = None,
            progress: Callable[[MoveProgress], None] | None = None, idle: float = 0.2) -> MigrationRecord:
        """Copy what is left of the table, then (``follow``) apply its changes until ``stop`` is set, or until a
        read finds none left (``until_caught_up``).

        Returns:
            The migration's record when the loop ends.

        Raises:
            MigrationStateError: the name moves another source, or was cancelled. MigrationSourceError: the source
            cannot be read as one (retriable when it is unavailable). ConversionError: a row that cannot become
            cells (the loop stops there: nothing is skipped). StorageUnavailableError: the store did not answer
            (retriable).
        """
        record = self.records.start(self.spec.name, self.spec.source.describe)
        if record.phase in ("cancelled", "completed"):
            raise MigrationStateError(f"migration {self.spec.name} was {record.phase}: its capture is gone, so it "
                                      "cannot go on; a new migration takes another name")
        self.source.start_changes()
        stop = stop or threading.Event()
        throttle = Throttle(ThrottleSettings(rate=self.rate), stopping=stop.is_set)  # None: unlimited
        while record.phase == "copying" and not stop.is_set():
            record = self._wait_for_load(record, stop, progress)
            if stop.is_set():
                break
            chunk = self.source.read_chunk(None if record.copy_cursor is None else tuple(record.copy_cursor),
                                           self.chunk_rows)
            self._put([c for row in chunk.rows for c in self.mapper.cells(row, chunk.position)])
            done = chunk.last is None or len(chunk.rows) < self.chunk_rows
            record = self.records.change(self.spec.name, _advance(len(chunk.rows), chunk.last, done))
            if done:
                logger.info("migration %s: %d rows copied; following the changes", self.spec.name, record.rows_copied)
            record = self._catch_up(record, progress, len(chunk.rows))
            throttle.wait(len(chunk.rows))
        while follow and not stop.is_set():
            record = self.records.get(self.spec.name)  # the steps other processes ask for are in the record
            if record.phase in REQUESTS:
                record = self._carry_out(record, stop, progress)
                continue
            if record.phase in ("cancelled", "completed"):
                logger.info("migration %s is %s: nothing more to follow", self.spec.name, record.phase)
                break
            before = (record.changes_applied, record.flowed_back)
            record = self._catch_up(record, progress)
            if record.phase == "switched":
                record, _ = self._flow_back(record)
            if (record.changes_applied, record.flowed_back) == before:
                if until_caught_up:
                    break
                stop.wait(idle)
        return record

    # -- the steps: switch --writes, reverse, complete (asked for in the record by connectors.migration.steps) --
    def _carry_out(self, record: MigrationRecord, stop: threading.Event,
                   progress: Callable[[MoveProgress], None] | None) -> MigrationRecord:
        """Carry out the step the record asks for: wait out the writers' lease, drain the side the writes leave,
        then record the new phase (unless the step was called off meanwhile: then nothing changes)."""
        asked = record.phase
        logger.info("migration %s: carrying out %s", self.spec.name, asked)
        if asked in ("switching", "reversing"):  # no writer writes to the side left once this has passed
            fenced_at = record.updated_at + dt.timedelta(seconds=LEASE + FENCE_GRACE)
            while (left := (fenced_at - now()).total_seconds()) > 0 and not stop.is_set():
                record = self._catch_up(record, progress)
                stop.wait(min(left, 0.1))
            if stop.is_set():
                return record
        if asked == "switching":
            while True:  # every change the source logged before the fence, applied
                before = record.changes_applied
                record = self._catch_up(record, progress)
                if record.changes_applied == before:
                    break
            heads = self._flow().begin()
            logger.info("migration %s: the flow back starts at the heads of %d shards", self.spec.name, len(heads))
            change, reached = _to_phase("switching", "switched", writes="store", echoes_below=None), "switched"
        else:
            done = -1
            while done and not stop.is_set():  # every cell written before the fence (or this moment), back
                record, done = self._flow_back(record)
            if stop.is_set():
                return record
            if asked == "reversing":
                below = self.source.log_position()  # after the flow back's last write, before any new one
                change, reached = _to_phase("reversing", "copied", writes="source", echoes_below=below,
                                            read_percent=0), "copied"
            else:
                change, reached = _to_phase("completing", "completed"), "completed"
        try:
            record = self.records.change(self.spec.name, change)
        except MigrationStateError as exc:  # called off by the step's command (it waited too long)
            logger.warning("migration %s: %s not recorded: %s", self.spec.name, asked, exc)
            return self.records.get(self.spec.name)
        if reached == "completed":  # once recorded: a step called off must find its capture (`complete` again
            self.source.stop_changes()  # drops it, should this fail)
        logger.info("migration %s: %s", self.spec.name, reached)
        return record

    def _flow(self) -> FlowBack:
        if self._flow_back_ is None:
            self._flow_back_ = FlowBack(self.spec, self.source, self.store)
        return self._flow_back_

    def _flow_back(self, record: MigrationRecord) -> tuple[MigrationRecord, int]:
        """One batch of the cells written since the writes switched, written to the source table: the record
        after it, and the cells read (0: none was left)."""
        done = self._flow().run_once()
        if not done:
            return record, 0
        if self.metrics is not None:
            self.metrics.flowed_back.labels(self.spec.name).inc(done)

        def flowed(r: MigrationRecord) -> None:
            r.flowed_back += done
        return self.records.change(self.spec.name, flowed), done

    def _wait_for_load(self, record: MigrationRecord, stop: threading.Event,
                       progress: Callable[[MoveProgress], None] | None) -> MigrationRecord:
        """Hold the copy while the source is over its limits, applying the changes meanwhile (a capture that
        waited too would only hold more of the source's log)."""
        waited_from, why = None, ""
        while not stop.is_set() and (self.max_running is not None or self.max_replica_lag is not None):
            load = self.source.load()
            if self.max_running is not None and load.running > self.max_running:
                why = f"{load.running} statements running (over {self.max_running})"
            elif (self.max_replica_lag is not None and load.replica_lag is not None
                  and load.replica_lag > self.max_replica_lag):
                why = f"its replicas {load.replica_lag:.1f} s behind (over {self.max_replica_lag:g})"
            else:
                break
            if waited_from is None:
                waited_from = time.monotonic()
                logger.info("migration %s: the copy waits for the source: %s", self.spec.name, why)
            record = self._catch_up(record, progress)
            stop.wait(THROTTLE_PAUSE)
        if waited_from is not None:
            waited = time.monotonic() - waited_from
            if self.metrics is not None:
                self.metrics.throttled.labels(self.spec.name).inc(waited)
            logger.info("migration %s: the copy goes on after waiting %.1f s for the source", self.spec.name, waited)
        return record

    def _catch_up(self, record: MigrationRecord, progress: Callable[[MoveProgress], None] | None,
                  rows_copied: int = 0) -> MigrationRecord:
        """Apply a batch of changes, then report it with the ``rows_copied`` just before."""
        before = record.changes_applied
        record = self._apply_changes(record)
        self._report(progress, record, rows_copied, record.changes_applied - before)
        return record

    def _apply_changes(self, record: MigrationRecord) -> MigrationRecord:
        """One batch of the changes logged since the position acknowledged last: written, then acknowledged."""
        changes = self.source.read_changes(self.change_batch)
        if not changes:
            return record
        position = max(c.position for c in changes)
        if record.phase in ("switched", "reversing", "completing"):
            # The store takes the writes: what the source logs now is the flow back's own writing.
            self.source.acknowledge(position)
            return record
        below = record.echoes_below
        applied_now = [c for c in changes if below is None or c.position >= below]
        cells: list[MigratedCell] = []
        for change in applied_now:
            cells += self._cells_of(change)
        if below is not None and self.mapper.versioned_by_position:
            cells = self._above_latest(cells)
        self._put(cells)
        self.source.acknowledge(position)

        def applied(r: MigrationRecord) -> None:
            r.changes_applied += len(applied_now)
            r.position = max(position, r.position or 0)
        return self.records.change(self.spec.name, applied)

    def _above_latest(self, cells: list[MigratedCell]) -> list[MigratedCell]:
        """After a reverse, each cell above the latest version of its column: the store's writes numbered their
        versions from the copy's positions up, and a source position is not bound to be above them."""
        out = []
        for cell, latest in zip(cells, self.store.get_cells_latest([(c.row_key, c.column) for c in cells]),
                                strict=True):
            if latest is not None and latest.ref_key >= cell.ref_key and latest.body != cell.body:
                cell = cell._replace(ref_key=latest.ref_key + 1)
            out.append(cell)
        return out

    def _cells_of(self, change: Change) -> list[MigratedCell]:
        if change.op == "upsert":
            assert change.values is not None
            return self.mapper.cells(SourceRow(change.key, change.values), change.position)
        if self.mapper.versioned_by_position:
            return self.mapper.tombstones(change.key, change.values, change.position)
        # Versioned by a column the deleted row no longer advances: one above the newest version stored.
        row_key = self.mapper.row_key(change.key, change.values)
        latest = max((cell.ref_key for cell in self.store.get_cells_latest([(row_key, c) for c in self.spec.columns])
                      if cell is not None), default=0)
        return self.mapper.tombstones(change.key, change.values, latest + 1)

    def _put(self, cells: list[MigratedCell]) -> None:
        # A transaction that changed a row twice logged both at its one commit position: the later state wins.
        last = {(c.row_key, c.column, c.ref_key): c for c in cells}
        if last:
            self.store.put_cells([(c.row_key, c.column, c.ref_key, c.body) for c in last.values()])

    def _report(self, progress: Callable[[MoveProgress], None] | None, record: MigrationRecord,
                rows: int = 0, changes: int = 0) -> None:
        if self.metrics is not None:
            self.metrics.rows.labels(self.spec.name).inc(rows)
            self.metrics.changes.labels(self.spec.name).inc(changes)
        if time.monotonic() - self._lag_checked >= LAG_CHECK:  # a query: once a second at most
            self._measure_lag()
        if progress is not None:
            progress(MoveProgress(record.phase, record.rows_copied, record.changes_applied, self._lag.bytes))

    def _measure_lag(self) -> None:
        """Read the capture's lag: into the metrics, and a warning each time it goes over ``lag_warning``."""
        self._lag_checked = time.monotonic()
        self._lag = lag = self.source.change_lag()
        name = self.spec.name
        if self.metrics is not None:
            self.metrics.lag_seconds.labels(name).set(lag.seconds)
            self.metrics.lag_bytes.labels(name).set(lag.bytes)
        lagging = lag.seconds > self.lag_warning
        if lagging and not self._lagging:
            logger.warning("migration %s: the capture is %.0f s (%d bytes of the source's log) behind the source, "
                           "above %.0f s: the source keeps that log until the changes are applied", name,
                           lag.seconds, lag.bytes, self.lag_warning)
        self._lagging = lagging


def _to_phase(asked: str, phase: str, **fields: object) -> Callable[[MigrationRecord], None]:
    """The change that ends a step: refused (MigrationStateError) when the record no longer asks for it."""
    def to_phase(record: MigrationRecord) -> None:
        if record.phase != asked:
            raise MigrationStateError(f"the record is {record.phase} now, no longer {asked}")
        record.phase = phase  # type: ignore[assignment]  # one of Phase's, by the callers
        for name, value in fields.items():
            setattr(record, name, value)
        record.step_error = None
    return to_phase


def _advance(rows: int, last: Sequence[object] | None, done: bool) -> Callable[[MigrationRecord], None]:
    """The change of a record after a chunk of ``rows`` ending at key ``last`` (``done``: the table's last)."""
    def advance(record: MigrationRecord) -> None:
        if last is not None:
            record.copy_cursor = list(last)
        record.rows_copied += rows
        if done:
            record.phase, record.copied_at = "copied", now()
    return advance


def cancel(spec: MigrationSpec, source: MigrationSource, store: Store) -> MigrationRecord:
    """End a migration for good: its capture stopped and freed on the source (the slot and publication dropped,
    the position row deleted), its record marked ``cancelled``. The cells stay. Idempotent.

    Raises:
        MigrationStateError: no migration of that name, or its writes are switched to the store.
        MigrationSourceError: the source refused (retriable when it did not answer: run it again).
    """
    records = MigrationRecords(store)
    record = records.get(spec.name)
    if record.phase not in ("copying", "copied", "cancelled"):
        raise MigrationStateError(f"migration {spec.name} is {record.phase}: the store takes its writes, and the "
                                  "capture is the way back; `migrate reverse` first (or `migrate complete`)")
    source.stop_changes()

    def cancelled(record: MigrationRecord) -> None:
        record.phase = "cancelled"
    record = records.change(spec.name, cancelled)
    logger.info("migration %s cancelled; its capture on the source is dropped", spec.name)
    return record
