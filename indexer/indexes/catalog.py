"""The index catalog: every index's versions, their states and which one is active.

An index's catalog record is the cell ``(uuid5(name), "_index", revision)``; each
change writes the next revision with the whole record, so a change is atomic (one
cell) and two concurrent changes meet as a CellConflictError, after which the loser
reads the new record and tries again (compare-and-set). Activating a version is one
such write: a query reads the record once and then one version's table, so it sees
either the old version or the new one, never a mix.

States of a version: ``building`` (registered by an app, which keeps it current from
then on; a backfill fills in the past), ``ready`` (backfilled), ``active`` (what
queries read), ``retired`` (was active; still kept current until dropped, so it can
be activated again) and ``dropped`` (tables removed).
"""

from __future__ import annotations

import datetime as dt
import logging
import uuid
from collections.abc import Callable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from indexer.errors import ConfigurationError, IndexNotFoundError, IndexStateError
from indexer.indexes.definitions import IndexDefinition
from logstore import CellConflictError, Store
from logstore.index_tables.query import CATALOG_COLUMN, catalog_row_key

logger = logging.getLogger(__name__)
_WRITE_TRIES = 16
State = Literal["building", "ready", "active", "retired", "dropped"]
MAINTAINED: frozenset[str] = frozenset({"building", "ready", "active", "retired"})


class VersionRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    definition: IndexDefinition
    state: State = "building"
    created_at: dt.datetime
    live_since: dt.datetime | None = Field(None, description="when an app first kept this version current")
    app: str | None = Field(None, description="that app: a backfill's dead letters go to its DLQ")
    backfill_started: dt.datetime | None = None
    backfill_finished: dt.datetime | None = None
    activated_at: dt.datetime | None = None


class IndexRecord(BaseModel):
    """One index in the catalog (the body of its latest catalog cell)."""

    model_config = ConfigDict(extra="forbid")

    name: str
    revision: int = Field(0, description="the ref_key of the cell holding this record (not in the body)")
    active: int | None = None
    versions: dict[int, VersionRecord] = Field(default_factory=dict)

    def version(self, version: int) -> VersionRecord:
        found = self.versions.get(version)
        if found is None or found.state == "dropped":
            known = ", ".join(str(v) for v, r in sorted(self.versions.items()) if r.state != "dropped") or "none"
            raise IndexNotFoundError(f"index {self.name} has no version {version} (versions: {known})")
        return found

    def maintained(self) -> list[IndexDefinition]:
        """The versions an app keeps current."""
        return [r.definition for _, r in sorted(self.versions.items()) if r.state in MAINTAINED]


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class IndexCatalog:
    """The catalog records of one store."""

    def __init__(self, store: Store) -> None:
        self.store = store

    @staticmethod
    def row_key(name: str) -> uuid.UUID:
        return catalog_row_key(name)

    def get(self, name: str) -> IndexRecord:
        cell = self.store.get_cell_latest(self.row_key(name), CATALOG_COLUMN)
        if cell is None:
            raise IndexNotFoundError(f"no index named {name!r} (an app registers it with app.index(...))")
        return IndexRecord.model_validate({**cell.body, "revision": cell.ref_key})

    def find(self, name: str) -> IndexRecord | None:
        try:
            return self.get(name)
        except IndexNotFoundError:
            return None

    def change(self, name: str, fn: Callable[[IndexRecord], None]) -> IndexRecord:
        """Apply ``fn`` to the latest record (a new one if none) and write it as the next revision."""
        for _ in range(_WRITE_TRIES):
            record = self.find(name) or IndexRecord(name=name)
            fn(record)
            revision = record.revision + 1
            body = record.model_dump(mode="json", exclude={"revision"})
            try:
                self.store.put_system_cells([(self.row_key(name), CATALOG_COLUMN, revision, body)])
            except CellConflictError:
                continue  # another process changed it first: again, on its record
            record.revision = revision
            return record
        raise IndexStateError(f"index {name}: the catalog changed {_WRITE_TRIES} times while this change was made")

    # -- the steps of an index's life --------------------------------------------------------
    def register(self, definition: IndexDefinition) -> IndexRecord:
        """Record the version (state building) and create its tables; a version that exists must have
        the same definition (a changed definition needs a new version)."""
        def add(record: IndexRecord) -> None:
            found = record.versions.get(definition.version)
            if found is None:
                record.versions[definition.version] = VersionRecord(definition=definition, created_at=_now())
            elif found.definition != definition:
                raise ConfigurationError(
                    f"index {definition.name} version {definition.version} exists with another definition; "
                    "give the changed definition a new version")
        current = self.find(definition.name)
        found = current.versions.get(definition.version) if current is not None else None
        if current is not None and found is not None:
            if found.state == "dropped":  # version numbers are not reused: a file may still list it
                logger.warning("index %s version %d was dropped; it is not kept (remove it from the file)",
                               definition.name, definition.version)
                return current
            add(current)  # refuses a changed definition; an unchanged one needs no write
            self.store.indexes.create(definition.spec)
            return current
        self.store.indexes.create(definition.spec)
        logger.info("index %s version %d registered", definition.name, definition.version)
        return self.change(definition.name, add)

    def mark_live(self, name: str, version: int, app: str) -> None:
        """An app keeps the version current from now on: a backfill may start."""
        record = self.get(name)
        if record.version(version).live_since is not None:
            return

        def mark(record: IndexRecord) -> None:
            found = record.version(version)
            if found.live_since is None:
                found.live_since, found.app = _now(), app
        self.change(name, mark)

    def backfill_started(self, name: str, version: int) -> IndexRecord:
        def start(record: IndexRecord) -> None:
            found = record.version(version)
            if found.live_since is None:
                raise IndexStateError(
                    f"index {name} version {version} is not kept current by any app yet: start the app with "
                    "this version first, then backfill (the backfill covers the log up to now, the app the rest)")
            found.backfill_started = found.backfill_started or _now()
        return self.change(name, start)

    def backfill_finished(self, name: str, version: int) -> IndexRecord:
        def finish(record: IndexRecord) -> None:
            found = record.version(version)
            found.backfill_finished = _now()
            if found.state == "building":
                found.state = "ready"
        return self.change(name, finish)

    def activate(self, name: str, version: int) -> IndexRecord:
        """Make ``version`` the one queries read, in one catalog write; the previous one is retired."""
        def switch(record: IndexRecord) -> None:
            found = record.version(version)
            if found.state == "active":
                return
            if found.state == "building":
                raise IndexStateError(f"index {name} version {version} is not backfilled yet: run "
                                      f"`cellstream index backfill {name} --version {version}` first")
            if record.active is not None and record.active in record.versions:
                record.versions[record.active].state = "retired"
            found.state, found.activated_at, record.active = "active", _now(), version
        return self.change(name, switch)

    def drop(self, name: str, version: int) -> IndexRecord:
        """Remove a version that is not active: its tables go, apps stop keeping it current."""
        definition = self.get(name).version(version).definition

        def mark(record: IndexRecord) -> None:
            found = record.version(version)
            if record.active == version:
                raise IndexStateError(f"index {name} version {version} is active; activate another version first")
            found.state = "dropped"
        record = self.change(name, mark)
        self.store.indexes.drop(definition.spec)
        logger.info("index %s version %d dropped", name, version)
        return record
