"""The dead-letter store: an app's entries as cells in the logstore itself, written and counted by the runtime
(triage, replay and discard are :mod:`indexer.runtime.dlq_triage`'s).

An entry is the cell ``(id, "_dlq", version)``; every change of status writes the
next version with the whole entry and its history, so the versions are the audit
trail and a concurrent change shows up as a CellConflictError (compare-and-set).

All entries of one app live in one shard (the app's *DLQ shard*, chosen by hashing
its name), so listing them reads one shard's log, filtered to ``_dlq``, instead of
every shard. The id of an entry is derived from the app, the handler and the cell's
coordinates, so dead-lettering the same cell again (after a crash before the offset
commit, or in another run) updates its entry instead of adding a second one.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import uuid
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

from indexer.errors import EntryNotFoundError, IndexerError
from indexer.runtime.clock import SYSTEM_CLOCK, Clock
from indexer.runtime.policy import Outcome
from logstore import CellConflictError, InvalidCellError, Store, TruncatedPage
from logstore.cell import key_in_shard, shard_of

logger = logging.getLogger(__name__)
DLQ_COLUMN = "_dlq"
_NAMESPACE = uuid.UUID("6f3c1e0a-7d3b-4c59-9a51-5f0c8f1b2d11")
_PAGE = 1000
_WRITE_TRIES = 8
_SHORT_TRACEBACK = 4000
Status = Literal["open", "replayed", "resolved", "discarded"]
STATUSES: tuple[str, ...] = get_args(Status)
OPEN_STATES: frozenset[str] = frozenset({"open", "replayed"})


class Event(BaseModel):
    """One change of an entry's status."""

    model_config = ConfigDict(extra="forbid")

    status: Status
    at: dt.datetime
    note: str | None = None
    error: str | None = None
    attempts: int | None = None
    actor: str | None = Field(None, description="who made the change: `cli:<user>`, `console:<name>`, `policy` (a "
                                                "redrive policy's redrive); None for the app's own handling")


class DeadLetter(BaseModel):
    """A cell one handler could not process, with what is needed to understand and replay it."""

    model_config = ConfigDict(extra="forbid")

    id: str
    version: int = Field(0, description="the ref_key of the cell holding this state (not in the body)")
    app: str
    handler: str
    column: str
    source: dict[str, Any] = Field(description="shard and added_id (direct) or topic, partition and offset (Kafka)")
    cell: dict[str, Any] = Field(description="row_key, column, ref_key, added_id, shard, created_at")
    body: dict[str, Any] | None = Field(None, description="None when the stored cell could not be decoded")
    error_type: str
    message: str
    traceback: str
    fingerprint: str
    attempts: int
    first_failure: dt.datetime
    last_failure: dt.datetime
    status: Status = "open"
    history: list[Event] = Field(default_factory=list)
    retriable: bool | None = Field(None, description="whether the last error said a retry may help (None: entries "
                                                     "recorded before this was kept)")
    redrives: int = Field(0, ge=0, description="redrives a redrive policy made (indexer.runtime.redrive): kept "
                                               "in the entry, so a restarted app goes on counting")

    def summary(self) -> dict[str, Any]:
        """The fields ``dlq list`` shows."""
        return {"id": self.id, "handler": self.handler, "status": self.status, "error_type": self.error_type,
                "message": self.message[:200], "attempts": self.attempts, "row_key": self.cell.get("row_key"),
                "ref_key": self.cell.get("ref_key"), "source": self.source,
                "last_failure": self.last_failure.isoformat()}


class DeadLetterStore:
    """The entries of one app, read and written through a :class:`logstore.Store`."""

    def __init__(self, store: Store, app: str, clock: Clock = SYSTEM_CLOCK) -> None:
        self.store = store
        self.app = app
        self.clock = clock  # dates the entries' events
        self.shard = shard_of(uuid.uuid5(_NAMESPACE, f"dlq:{app}"), store.shard_count)

    def entry_id(self, handler: str, cell: dict[str, Any], source: dict[str, Any]) -> str:
        """The id of ``handler``'s entry for the cell: deterministic, and in the app's DLQ shard. A message
        that names no cell (not written by a tailer) is known by its source position instead."""
        if all(cell.get(name) not in (None, "") for name in ("row_key", "column", "ref_key")):
            base = f"{self.app}\x00{handler}\x00{cell['row_key']}\x00{cell['column']}\x00{cell['ref_key']}"
        else:
            base = f"{self.app}\x00{handler}\x00" + ",".join(f"{k}={source[k]}" for k in sorted(source))
        return str(key_in_shard(_NAMESPACE, base, self.shard, self.store.shard_count))

    def get(self, entry_id: str) -> DeadLetter:
        try:
            key = uuid.UUID(str(entry_id))
        except ValueError:
            raise EntryNotFoundError(f"{entry_id!r} is not a dead-letter id (a UUID)") from None
        found = self.store.get_cell_latest(key, DLQ_COLUMN)
        if found is None or found.body.get("app") != self.app:
            raise EntryNotFoundError(f"app {self.app} has no dead letter {entry_id}")
        return DeadLetter.model_validate({**found.body, "version": found.ref_key})

    def entries(self) -> list[DeadLetter]:
        """The latest version of every entry of the app, oldest first."""
        latest: dict[str, tuple[int, dict[str, Any]]] = {}
        location = 0
        while True:
            page, location = self.store.get_cells_for_shard(self.shard, location, _PAGE, columns=[DLQ_COLUMN])
            for cell in page:
                if cell.body.get("app") == self.app and cell.ref_key > latest.get(str(cell.row_key), (0, {}))[0]:
                    latest[str(cell.row_key)] = (cell.ref_key, cell.body)
            if len(page) < _PAGE and not isinstance(page, TruncatedPage):
                break
        out = [DeadLetter.model_validate({**body, "version": version}) for version, body in latest.values()]
        return sorted(out, key=lambda e: (e.first_failure, e.id))

    def open_counts(self) -> OpenCounts:
        """A follower of this app's entries that counts the open ones per handler (see :class:`OpenCounts`)."""
        return OpenCounts(self)

    def record(self, handler: str, column: str, source: dict[str, Any], cell: dict[str, Any],
               body: dict[str, Any] | None, outcome: Outcome) -> DeadLetter:
        """Dead-letter the cell for ``handler``: a new open entry, or the next version of its existing one."""
        failure = outcome.failure
        assert failure is not None and outcome.first_failure and outcome.last_failure
        entry_id = self.entry_id(handler, cell, source)
        for _ in range(_WRITE_TRIES):
            try:
                current = self.get(entry_id)
            except EntryNotFoundError:
                current = None
            now = self.clock.now()
            event = Event(status="open", at=now, error=f"{failure.error_type}: {failure.message}"[:500],
                          attempts=outcome.attempts,
                          note=None if current is None else f"failed again (was {current.status})")
            entry = DeadLetter(
                id=entry_id, app=self.app, handler=handler, column=column, source=source, cell=cell, body=body,
                error_type=failure.error_type, message=failure.message, traceback=failure.traceback,
                fingerprint=failure.fingerprint,
                attempts=outcome.attempts + (current.attempts if current else 0),
                first_failure=current.first_failure if current else outcome.first_failure,
                last_failure=outcome.last_failure, status="open",
                history=[*(current.history if current else []), event],
                retriable=failure.retriable, redrives=current.redrives if current else 0,
            )
            try:
                return self._write(entry, (current.version if current else 0) + 1)
            except CellConflictError:
                continue  # another process changed the entry meanwhile: read it again
        raise IndexerError(f"dead letter {entry_id} keeps changing under this process; not recorded")

    def change(self, entry: DeadLetter, status: Status, *, note: str | None = None,
               outcome: Outcome | None = None, actor: str | None = None, redrive: bool = False) -> DeadLetter:
        """Write the entry's next version with ``status``; CellConflictError if another process got there first.
        ``redrive``: this change starts a redrive of a redrive policy (counted in ``redrives``)."""
        now = self.clock.now()
        update: dict[str, Any] = {"status": status}
        if redrive:
            update["redrives"] = entry.redrives + 1
        event = Event(status=status, at=now, note=note, actor=actor)
        if outcome is not None and outcome.failure is not None:
            failure = outcome.failure
            update.update(error_type=failure.error_type, message=failure.message, traceback=failure.traceback,
                          fingerprint=failure.fingerprint, attempts=entry.attempts + outcome.attempts,
                          last_failure=outcome.last_failure or now, retriable=failure.retriable)
            event = Event(status=status, at=now, note=note, attempts=outcome.attempts, actor=actor,
                          error=f"{failure.error_type}: {failure.message}"[:500])
        elif outcome is not None:
            event.attempts = outcome.attempts
        changed = entry.model_copy(update={**update, "history": [*entry.history, event]})
        return self._write(changed, entry.version + 1)

    def _write(self, entry: DeadLetter, version: int) -> DeadLetter:
        try:
            self.store.put_system_cells([(entry.id, DLQ_COLUMN, version, entry.model_dump(mode="json",
                                                                                          exclude={"version"}))])
        except InvalidCellError as exc:
            if entry.body is None and len(entry.traceback) <= _SHORT_TRACEBACK:
                raise
            # Too big with the cell's body in it: keep the coordinates (replay reads the cell from the store).
            logger.warning("dead letter %s: %s; storing it without the cell body", entry.id, exc)
            entry = entry.model_copy(update={"body": None, "traceback": entry.traceback[-_SHORT_TRACEBACK:]})
            self.store.put_system_cells([(entry.id, DLQ_COLUMN, version, entry.model_dump(mode="json",
                                                                                          exclude={"version"}))])
        return entry.model_copy(update={"version": version})


class OpenCounts:
    """The open entries of each handler of one app, as the store has them: whoever changed them (this process,
    another one of the app, ``cellstream dlq``, the console).

    :meth:`read` reads the app's DLQ shard from where its last read ended, so after the first read it costs one
    query that finds the versions written since (none, mostly); it keeps the latest version's handler and
    status of every entry seen.
    """

    def __init__(self, deadletters: DeadLetterStore) -> None:
        self._deadletters = deadletters
        self._location = 0
        self._latest: dict[str, tuple[int, str, bool]] = {}  # entry id -> (version, handler, open)
        self._lock = threading.Lock()  # a read abandoned by a stopping app may still run when the next starts

    def read(self) -> dict[str, int]:
        """(blocking) The number of open (or replayed) entries per handler; a handler with none is absent."""
        with self._lock:
            return self._read()

    def _read(self) -> dict[str, int]:
        store, app = self._deadletters.store, self._deadletters.app
        while True:
            page, self._location = store.get_cells_for_shard(self._deadletters.shard, self._location, _PAGE,
                                                             columns=[DLQ_COLUMN])
            for cell in page:
                key = str(cell.row_key)
                if cell.body.get("app") == app and cell.ref_key > self._latest.get(key, (0, "", False))[0]:
                    self._latest[key] = (cell.ref_key, str(cell.body.get("handler")),
                                         cell.body.get("status") in OPEN_STATES)
            if len(page) < _PAGE and not isinstance(page, TruncatedPage):
                break
        counts: dict[str, int] = {}
        for _version, handler, is_open in self._latest.values():
            if is_open:
                counts[handler] = counts.get(handler, 0) + 1
        return counts
