"""The write facade of a migration: the application writes the table's rows through a :class:`MigrationWriter`,
which sends them to the source table until ``cellstream migrate switch --writes``, to the store after it, and to
the source again after ``migrate reverse``. Vitess denies writes on the side it switches away from; here the
writers are the fence.

A writer reads the migration's record before a write when its copy is more than :data:`LEASE` seconds old.
While a step moves the writes (the record's phase ``switching`` or ``reversing``) a write waits, reading the
record again every few milliseconds, for at most ``fence_wait`` seconds, then raises
:class:`~connectors.errors.MigrationSwitchingError` (retriable). So once a step's request is older than
:data:`LEASE` and a statement's time (:data:`FENCE_GRACE`), no writer writes to the side it leaves, and the
step drains that side before the other takes the writes (:mod:`connectors.migration.steps`).

In the store a row is its cells: each cell column whose fields the write names gets a new version (those fields
over the latest version's); a delete writes a tombstone in each cell column. Versions follow the spec's
ref_key: one above the latest with ``ref_key: log_position``, the version column's value with a version column.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Mapping
from typing import Any, Literal

from connectors.errors import ConversionError, MigrationStateError, MigrationSwitchingError
from connectors.migration.mapping import RowMapper, json_value, tombstone
from connectors.migration.opening import open_source
from connectors.migration.records import MigrationRecord, MigrationRecords
from connectors.migration.source import Key, MigrationSource
from connectors.migration.spec import MigrationSpec
from logstore import CellConflictError, Store
from logstore.cell import is_tombstone
from logstore.errors import InvalidArgumentError

logger = logging.getLogger(__name__)
LEASE = 1.0  # seconds a writer trusts its copy of the record
FENCE_GRACE = 1.0  # seconds a write that began before the fence may still take to commit
FENCE_POLL = 0.05  # seconds between two reads of the record while a write waits for a step
_VERSION_TRIES = 16
Side = Literal["source", "store"]


class MigrationWriter:
    """Writes a migration's rows where its record says writes go (see the module).

    Args:
        spec: the migration.
        store: the store the table moves into.
        source: the source table (None: opened from the spec, rows only; closed by :meth:`close`).
        fence_wait: seconds a write waits for a step moving the writes before it raises.

    Raises:
        MigrationStateError: no such migration in the store.
    """

    def __init__(self, spec: MigrationSpec, store: Store, *, source: MigrationSource | None = None,
                 fence_wait: float = 30.0) -> None:
        self.spec = spec
        self.store = store
        self.fence_wait = fence_wait
        self._own_source = source is None
        self.source = source or open_source(spec, capture=False)
        self._records = MigrationRecords(store)
        self._mapper = RowMapper(spec)
        self._lock = threading.Lock()  # the source: one statement at a time
        self._record: MigrationRecord = self._records.get(spec.name)
        self._read_at = time.monotonic()

    def put(self, values: Mapping[str, Any], *, row_key: uuid.UUID | None = None) -> Side:
        """Write a row: insert it, or set the columns ``values`` names.

        Args:
            values: the row's columns by name, with every primary-key column; the driver's types (a Decimal, a
                datetime...) or their JSON forms.
            row_key: the row's key when the spec's row key is a UUID column not among ``values``.

        Returns:
            Where the write went: ``"source"`` or ``"store"``.

        Raises:
            MigrationSwitchingError: the writes were moving longer than ``fence_wait`` (retriable).
            ConversionError: a key column or the version column is missing, or a value has no JSON form.
            MigrationSourceError, LogstoreError: the side written refused or did not answer.
        """
        key = self._key(values)
        side = self._side()
        if side == "source":
            with self._lock:
                self.source.write_rows([{n: json_value(v) for n, v in values.items()}], [])
            return side
        at = row_key or self._mapper.row_key(key, values)
        given = {n: json_value(v) for n, v in values.items()}
        self._write_versions(at, lambda column, latest: _merged(self.spec.columns[column], given, latest),
                             None if self._mapper.versioned_by_position else self._mapper.version(values))
        return side

    def delete(self, key: Key, *, row_key: uuid.UUID | None = None) -> Side:
        """Delete the row whose primary key is ``key`` (no row: nothing to do on the source; tombstones in the
        store all the same).

        Returns:
            Where the delete went. Raises: as :meth:`put`.
        """
        side = self._side()
        if side == "source":
            with self._lock:
                self.source.write_rows([], [tuple(key)])
            return side
        if row_key is None and self.spec.row_key.uuid5 is None:
            raise InvalidArgumentError(f"migration {self.spec.name} keys rows by the column "
                                       f"{self.spec.row_key.column}: pass delete(key, row_key=...)")
        at = row_key or self._mapper.row_key(tuple(key), None)
        dead = tombstone(tuple(key))
        self._write_versions(at, lambda column, latest: dead, None)
        return side

    def _key(self, values: Mapping[str, Any]) -> Key:
        with self._lock:
            keys = self.source.key_columns()
        if missing := [k for k in keys if k not in values]:
            raise ConversionError(f"migration {self.spec.name}: a row written lacks its key column {missing[0]}")
        return tuple(values[k] for k in keys)

    def _side(self) -> Side:
        """Where writes go now, after waiting for a step that moves them."""
        deadline = time.monotonic() + self.fence_wait
        while True:
            if time.monotonic() - self._read_at > LEASE:
                read_at = time.monotonic()  # the lease counts from before the read
                self._record = self._records.get(self.spec.name)
                self._read_at = read_at
            record = self._record
            if record.phase not in ("switching", "reversing"):
                return record.writes
            if time.monotonic() > deadline:
                raise MigrationSwitchingError(f"migration {self.spec.name}: its writes have been moving for over "
                                              f"{self.fence_wait:g} s ({record.phase}); try again")
            time.sleep(FENCE_POLL)
            self._read_at = -LEASE - 1.0  # read again

    def _write_versions(self, row_key: uuid.UUID, body_of: Any, version: int | None) -> None:
        """Write the next version of each cell column ``body_of(column, latest_body)`` gives a body for (None:
        that column unchanged): at ``version``, or one above each column's latest."""
        for _ in range(_VERSION_TRIES):
            cells = []
            newest = self.store.get_cells_latest([(row_key, column) for column in self.spec.columns])
            for column, latest in zip(self.spec.columns, newest, strict=True):
                live = None if latest is None or is_tombstone(latest.body) else dict(latest.body)
                body = body_of(column, live)
                if body is None:
                    continue
                ref_key = version if version is not None else (latest.ref_key + 1 if latest is not None else 1)
                cells.append((row_key, column, ref_key, body))
            try:
                self.store.put_cells(cells)
                return
            except CellConflictError:
                if version is not None:
                    raise
                continue  # another writer took that version first: above it, then
        raise MigrationStateError(f"migration {self.spec.name}: row {row_key} was written {_VERSION_TRIES} times by "
                                  "other writers while this write was made; try again")

    def close(self) -> None:
        """Close the source this writer opened."""
        if self._own_source:
            self.source.close()

    def __enter__(self) -> MigrationWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _merged(fields: list[str], given: Mapping[str, Any], latest: dict[str, Any] | None) -> dict[str, Any] | None:
    """A cell column's next body: the fields ``given`` names over the latest body (None: it names none)."""
    named = {name: given[name] for name in fields if name in given}
    if not named:
        return None
    return {**(latest or {}), **named}
