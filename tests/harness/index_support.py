"""Shared parts of the index tests: the seed's index, trip cells, and the brute-force expectation."""

from __future__ import annotations

import asyncio
import datetime as dt
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import logstore
from indexer import App
from indexer.errors import EntryFieldError
from indexer.indexes.definitions import IndexDefinition, load_indexes
from logstore.cell import is_tombstone
from logstore.index_tables.persistence import IndexEntry

SEED_YAML = """
indexes:
  - name: driver_partner_index
    column: BASE
    version: 1
    shard_field: driver_partner_uuid
    fields:
      - {name: driver_partner_uuid, type: uuid, key: true}
      - {name: city_uuid, type: uuid, key: true}
      - {name: trip_created_at, type: datetime, key: true}
      - {name: fare, type: float}
"""
# Version 2 copies one more field: a new definition, built beside version 1 and switched to.
V2_YAML = (SEED_YAML + SEED_YAML.split("indexes:\n", 1)[1].replace("version: 1", "version: 2")
           + "      - {name: status, type: str}\n")
T0 = dt.datetime(2026, 11, 21, 8, 0, tzinfo=dt.UTC)


def seed(version: int = 1) -> IndexDefinition:
    return next(d for d in load_indexes(V2_YAML) if d.version == version)


def trip(driver: uuid.UUID, city: uuid.UUID, minute: int, fare: float = 10.0, status: str = "done") -> dict[str, Any]:
    return {"driver_partner_uuid": str(driver), "city_uuid": str(city),
            "trip_created_at": (T0 + dt.timedelta(minutes=minute)).isoformat(), "fare": fare, "status": status}


def expected(store: logstore.Store, definition: IndexDefinition) -> dict[uuid.UUID, tuple[int, dict[str, Any]]]:
    """What the index must hold, by brute force: for every row, its highest-ref_key cell of the column
    whose body fits the definition (a cell that does not fit is dead-lettered, never indexed) or is a
    tombstone (then the row has no entry)."""
    best: dict[uuid.UUID, tuple[int, dict[str, Any] | None]] = {}
    for shard in range(store.shard_count):
        location = 0
        while True:
            cells, location = store.get_cells_for_shard(shard, location, 1000, columns=[definition.column])
            for cell in cells:
                try:
                    entry = None if is_tombstone(cell.body) else definition.entry(cell.body)
                except EntryFieldError:
                    continue
                if cell.ref_key > best.get(cell.row_key, (-1, None))[0]:
                    best[cell.row_key] = (cell.ref_key, entry)
            if not cells:
                break
    return {row: (ref_key, entry) for row, (ref_key, entry) in best.items() if entry is not None}


def actual(store: logstore.Store, definition: IndexDefinition) -> dict[uuid.UUID, tuple[int, dict[str, Any]]]:
    """Every entry of the version, each checked to live in its shard field's shard; a row twice fails."""
    spec = definition.spec
    out: dict[uuid.UUID, tuple[int, dict[str, Any]]] = {}
    for shard in range(store.shard_count):
        after = None
        while page := store.indexes.scan(spec, shard, after, limit=500):
            for entry in page:
                assert entry.row_key not in out, f"row {entry.row_key} has two entries"
                assert entry.shard == store.indexes.entry_shard(spec, entry.fields[spec.shard_field])
                out[entry.row_key] = (entry.ref_key, entry.fields)
            after = page[-1].row_key
    return out


def row_keys(entries: list[IndexEntry]) -> list[uuid.UUID]:
    return [e.row_key for e in entries]


class Background:
    """An app running in a thread until stop()."""

    def __init__(self, store: logstore.Store, yaml_file: Path, **options: Any) -> None:
        self.app = App("trips", store=store, **{"commit_interval": 0.05, **options})
        self.app.index(yaml_file)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.event: asyncio.Event | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self) -> None:
        async def serve() -> None:
            self.loop, self.event = asyncio.get_running_loop(), asyncio.Event()
            await self.app.run_async(self.event)
        try:
            asyncio.run(serve())
        except BaseException as exc:  # reported by stop()
            self.error = exc

    def stop(self) -> None:
        while self.loop is None and self.thread.is_alive():
            time.sleep(0.01)
        if self.loop is not None and self.event is not None:
            self.loop.call_soon_threadsafe(self.event.set)
        self.thread.join(60)
        self.app.close()
        assert self.error is None, self.error
