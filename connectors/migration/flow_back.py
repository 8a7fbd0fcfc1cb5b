"""The flow back of a migration whose writes go to the store: the rows its cells hold now are written to the
source table, so the source stays a way back (``migrate reverse``) that loses nothing (Vitess's reverse workflow
after SwitchTraffic).

A consumer of the store's shard logs, ``migration.<name>.flow-back``, with its positions in the store as any
consumer's (claimed by one process at a time, fenced from the others). It starts at the shards' heads when the
writes switch (the write facade holds every write meanwhile, so those heads are exact), reads the cells of the
migration's columns after its positions, and makes each row they touch in the source what its latest cells say:
upserted with their fields, or deleted when they are tombstones, all in one transaction a batch. Then it commits
the positions. A process killed in between writes the same rows again: the same values, at least once. Writing
the latest state rather than each version keeps the source equal to the cells, however far behind it was.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from typing import Any

from connectors.errors import ConversionError, MigrationStateError
from connectors.migration.source import Key, MigrationSource
from connectors.migration.spec import MigrationSpec
from logstore import Store
from logstore.cell import Cell, is_tombstone

logger = logging.getLogger(__name__)
PAGE = 1000  # cells a shard's read at most


def consumer_name(spec: MigrationSpec) -> str:
    return f"migration.{spec.name}.flow-back"


class FlowBack:
    """The flow back of one migration, in one process (see the module).

    Args:
        spec: the migration.
        source: its source table (written).
        store: the store the cells are read from.
        page: cells read a shard at a time, at most.
    """

    def __init__(self, spec: MigrationSpec, source: MigrationSource, store: Store, *, page: int = PAGE) -> None:
        self.spec = spec
        self.source = source
        self.store = store
        self.page = page
        self.consumer = consumer_name(spec)
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._columns = list(spec.columns)
        self._claimed = False

    def begin(self) -> dict[int, int]:
        """Start the flow back at every shard's head now (the writes are held, so nothing is written after these
        and before the store takes the writes). Returns the heads."""
        heads = self.store.heads()
        self._claim()
        self._commit({shard: head for shard, head in heads.items()})
        return heads

    def behind(self) -> int:
        """Cells of the migration's columns not flowed back yet."""
        return sum(self.store.counts_after(self._positions(), columns=self._columns).values())

    def run_once(self) -> int:
        """Flow back one batch: at most ``page`` cells of each shard with some after its position.

        Returns:
            The cells read (0: none left).

        Raises:
            MigrationStateError: another process took the flow back over.
            ConversionError: a cell that cannot become the source's row (its key missing).
            MigrationSourceError: the source refused or did not answer (nothing written there: the batch comes
                again).
        """
        self._claim()
        positions = self._positions()
        behind = self.store.counts_after(positions, columns=self._columns)
        todo = {shard: positions[shard] for shard, count in behind.items() if count}
        if not todo:
            return 0
        read: dict[int, int] = {}
        rows: dict[Any, None] = {}
        count = 0
        for shard, page in self.store.get_cells_for_shards(todo, self.page, columns=self._columns).items():
            if not isinstance(page, list):
                raise page  # a corrupt cell: nothing after it is written back until it is dealt with
            for cell in page:
                rows[cell.row_key] = None
                count += 1
            if page:
                read[shard] = page[-1].added_id
        upserts: list[dict[str, Any]] = []
        deletes: list[Key] = []
        columns = self._columns
        latest = self.store.get_cells_latest([(row_key, column) for row_key in rows for column in columns])
        for i, row_key in enumerate(rows):
            state = self._state(row_key, latest[i * len(columns):(i + 1) * len(columns)])
            if isinstance(state, dict):
                upserts.append(state)
            elif state is not None:
                deletes.append(state)
        self.source.write_rows(upserts, deletes)
        self._commit(read)
        return count

    def _state(self, row_key: Any, latest: list[Cell | None]) -> dict[str, Any] | Key | None:
        """The source row a row key's ``latest`` cells (one per column, in the spec's order) say: its values (an
        upsert), its key (a delete), or None (a deleted row whose key no tombstone holds: ``migrate repair``'s,
        of a row the source never had)."""
        values: dict[str, Any] = {}
        key: Key | None = None
        live = False
        for column, cell in zip(self._columns, latest, strict=True):
            if cell is None:
                continue
            if is_tombstone(cell.body):
                found = cell.body.get("_key")
                key = tuple(found) if isinstance(found, list) else key
                continue
            live = True
            values.update({name: cell.body[name] for name in self.spec.columns[column] if name in cell.body})
        if not live:
            return key
        uuid_column = self.spec.row_key.column
        if uuid_column is not None and uuid_column not in values:
            values[uuid_column] = str(row_key)
        if missing := [k for k in self.source.key_columns() if k not in values]:
            raise ConversionError(f"migration {self.spec.name}: row {row_key}'s cells hold no {missing[0]}, a key "
                                  "column of the source: it cannot be written back")
        return values

    def _claim(self) -> None:
        if not self._claimed:
            self.store.claim_offsets(self.consumer, self.owner)
            self._claimed = True

    def _positions(self) -> dict[int, int]:
        return {shard: record.location or 0 for shard, record in self.store.read_offsets(self.consumer).items()}

    def _commit(self, positions: dict[int, int]) -> None:
        if not positions:
            return
        fenced = self.store.commit_offsets(self.consumer, self.owner, {s: (p, {}) for s, p in positions.items()})
        if fenced:
            self._claimed = False
            raise MigrationStateError(f"migration {self.spec.name}: another process took its flow back over "
                                      f"({len(fenced)} shards)")


def key_columns_held(spec: MigrationSpec, key_columns: list[str]) -> list[str]:
    """The source's key columns the migration's cells do not hold (the row key's column counts): the flow back
    needs every one to name a row."""
    held = set(spec.source_columns) | ({spec.row_key.column} if spec.row_key.column else set())
    return [k for k in key_columns if k not in held]
