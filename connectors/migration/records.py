"""A migration's state, kept in the store it moves the table into: a cell per revision in the reserved column
``_migration`` (the latest revision is the state), changed by compare-and-set as job records are.

The phases run in order (Vitess MoveTables' create -> SwitchTraffic -> Complete, with a way back):
``copying`` (the table copied in key chunks while its changes are captured), ``copied`` (the copy done, the
changes still followed), ``switched`` (writes go to the store; its new cells flow back to the source table),
``completed`` (the flow back and the capture ended). ``migrate reverse`` returns from ``switched`` to ``copied``.
The moves between them pass through a request phase (``switching``, ``reversing``, ``completing``) that the
process following the migration (``migrate start``) carries out (:mod:`connectors.migration.steps`). A step asked
out of order is refused, saying which comes first.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from connectors.errors import MigrationStateError
from connectors.migration.diff import DiffState
from logstore import CellConflictError, Store

MIGRATION_COLUMN = "_migration"
DIFF_COLUMN = "_migration_diff"  # the last diff's state, a revision per chunk: apart, so the record stays small
_NAMESPACE = uuid.UUID("8e1f0c52-7d3b-4a96-b2e5-1f6a9c3d7e40")
_WRITE_TRIES = 16
Phase = Literal["copying", "copied", "switching", "switched", "reversing", "completing", "completed", "cancelled"]
Writes = Literal["source", "store"]
REQUESTS = ("switching", "reversing", "completing")  # the phases a step's command writes, carried out by the mover


class MigrationRecord(BaseModel):
    """What a migration has done: its phase, the copy's cursor and counts, the changes applied."""

    model_config = ConfigDict(extra="forbid")

    name: str
    source: str = Field(description="the source's kind and table, never its URL: postgres:public.trips")
    phase: Phase = "copying"
    copy_cursor: list[Any] | None = Field(None, description="the last key copied (None: from the first row)")
    rows_copied: int = 0
    changes_applied: int = 0
    position: int | None = Field(None, description="the source log position applied last")
    read_percent: int | None = Field(None, ge=0, le=100, description="the read facade's dial (`migrate switch "
                                     "--reads N`): None until switched; readers refresh it from here")
    writes: Writes = Field("source", description="where the write facade sends writes (`migrate switch --writes`)")
    echoes_below: int | None = Field(None, description="the source's log position when writes returned to it "
                                     "(`migrate reverse`): the changes below it are the flow back's own writes")
    flowed_back: int = Field(0, description="cells written back to the source since the writes were switched")
    step_error: str | None = Field(None, description="why the last requested step did not happen")
    started_at: dt.datetime
    copied_at: dt.datetime | None = None
    updated_at: dt.datetime
    revision: int = 0


def now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class MigrationRecords:
    """The migration records of one store."""

    def __init__(self, store: Store) -> None:
        self.store = store

    @staticmethod
    def row_key(name: str) -> uuid.UUID:
        return uuid.uuid5(_NAMESPACE, name)

    def find(self, name: str) -> MigrationRecord | None:
        """The migration's latest record, or None when it never started."""
        cell = self.store.get_cell_latest(self.row_key(name), MIGRATION_COLUMN)
        if cell is None:
            return None
        return MigrationRecord.model_validate({**cell.body, "revision": cell.ref_key})

    def get(self, name: str) -> MigrationRecord:
        """The migration's latest record.

        Raises:
            MigrationStateError: no migration of that name started in this store.
        """
        record = self.find(name)
        if record is None:
            raise MigrationStateError(f"no migration {name!r} in this store: `cellstream migrate start FILE` starts it")
        return record

    def start(self, name: str, source: str) -> MigrationRecord:
        """The migration's record: the one there, or a new one in phase ``copying``.

        Raises:
            MigrationStateError: a migration of that name moves another source.
        """
        record = self.find(name)
        if record is not None:
            if record.source != source:
                raise MigrationStateError(f"migration {name!r} moves {record.source}, not {source}: give this one "
                                          "another name")
            return record
        at = now()
        try:
            return self._write(MigrationRecord(name=name, source=source, started_at=at, updated_at=at), 1)
        except CellConflictError:  # another process started it first
            return self.start(name, source)

    def change(self, name: str, fn: Callable[[MigrationRecord], None]) -> MigrationRecord:
        """Apply ``fn`` to the latest record and write it as the next revision (again, on the newer record,
        when another process wrote first). ``fn`` may raise MigrationStateError to refuse: nothing is written.

        Raises:
            MigrationStateError: no such migration, ``fn`` refused, or the record kept changing.
        """
        for _ in range(_WRITE_TRIES):
            record = self.get(name)
            fn(record)
            record.updated_at = now()
            try:
                return self._write(record, record.revision + 1)
            except CellConflictError:
                continue
        raise MigrationStateError(f"migration {name}: the record changed {_WRITE_TRIES} times while this change "
                                  "was made")

    def last_diff(self, name: str) -> DiffState | None:
        """The state of the migration's last diff (or repair), or None when none ran."""
        cell = self.store.get_cell_latest(self.row_key(name), DIFF_COLUMN)
        return None if cell is None else DiffState.model_validate(cell.body)

    def save_diff(self, name: str, state: DiffState) -> None:
        """Keep a diff's state as the migration's last (one diff at a time: a later save wins)."""
        for _ in range(_WRITE_TRIES):
            latest = self.store.get_cell_latest(self.row_key(name), DIFF_COLUMN)
            try:
                self.store.put_system_cells([(self.row_key(name), DIFF_COLUMN, 1 if latest is None else
                                              latest.ref_key + 1, state.model_dump(mode="json"))])
                return
            except CellConflictError:
                continue
        raise MigrationStateError(f"migration {name}: its diff state changed {_WRITE_TRIES} times while this one "
                                  "was saved (two diffs at once?)")

    def _write(self, record: MigrationRecord, revision: int) -> MigrationRecord:
        body = record.model_dump(mode="json", exclude={"revision"})
        self.store.put_system_cells([(self.row_key(record.name), MIGRATION_COLUMN, revision, body)])
        return record.model_copy(update={"revision": revision})
