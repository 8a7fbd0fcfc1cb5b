"""Tombstones (``{"_deleted": true}``) in secondary indexes: a tombstone removes its row's entry, whatever the
order of delivery; a newer value brings it back; backfill and verification agree. On SQLite and MariaDB
clusters of two nodes (an entry and its row's locator are often on different nodes)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import logstore
from indexer import App
from indexer.indexes.applier import Index, IndexApplier
from indexer.indexes.backfill import backfill
from indexer.indexes.catalog import IndexCatalog
from indexer.indexes.definitions import IndexDefinition
from indexer.indexes.verify import VerifyProgress, verify
from logstore.index_tables.persistence import NO_ENTRY, ApplyResult, EntryWrite, IndexChange, Locator, plan
from tests.harness.index_support import actual, expected, seed, trip

NAME = "driver_partner_index"
GONE = {"_deleted": True}


def active_index(store: logstore.Store, yaml_file: Path, count: int) -> tuple[uuid.UUID, list[uuid.UUID]]:
    """``count`` rows of one driver's trips, indexed live and by a backfill, the version active: the driver and
    the rows."""
    driver, city = uuid.uuid4(), uuid.uuid4()
    rows = [uuid.uuid4() for _ in range(count)]
    store.put_cells([(r, "BASE", 1, trip(driver, city, n)) for n, r in enumerate(rows)])
    drain(store, yaml_file)
    backfill(store, NAME, 1)
    IndexCatalog(store).activate(NAME, 1)
    return driver, rows


def drain(store: logstore.Store, yaml_file: Path) -> tuple[Any, App]:
    with App("trips", store=store, commit_interval=0.05) as app:
        app.index(yaml_file)
        counts = app.drain(timeout=60)
    return counts, app


def located(store: logstore.Store, row: uuid.UUID) -> Locator | None:
    return store.indexes.locators(seed().spec, [row]).get(row)


def test_a_tombstone_removes_the_entry_and_a_newer_value_brings_it_back(store: logstore.Store,
                                                                        yaml_file: Path) -> None:
    definition = seed()
    drivers, city = [uuid.uuid4(), uuid.uuid4()], uuid.uuid4()
    kept, deleted, never = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    store.put_cells([(kept, "BASE", 1, trip(drivers[0], city, 1)), (deleted, "BASE", 1, trip(drivers[0], city, 2))])
    drain(store, yaml_file)
    index = Index(store, NAME, version=1)
    assert {e.row_key for e in index.query(driver_partner_uuid=drivers[0])} == {kept, deleted}

    # A tombstone of an indexed row, and one of a row never indexed: neither is dead-lettered.
    store.put_cells([(deleted, "BASE", 2, GONE), (never, "BASE", 5, {**GONE, "reason": "migrated"})])
    counts, app = drain(store, yaml_file)
    assert counts.processed == 2 and counts.dead_lettered == 0 and app.dlq.list() == []
    assert [e.row_key for e in index.query(driver_partner_uuid=drivers[0])] == [kept]
    assert located(store, deleted) == Locator(2, NO_ENTRY) and located(store, never) == Locator(5, NO_ENTRY)
    assert actual(store, definition) == expected(store, definition)

    # A newer value re-creates the entry, in the shard of its (new) driver.
    store.put_cells([(deleted, "BASE", 3, trip(drivers[1], city, 3)), (never, "BASE", 6, trip(drivers[0], city, 6))])
    counts, _ = drain(store, yaml_file)
    assert counts.processed == 2 and counts.dead_lettered == 0
    assert [e.row_key for e in index.query(driver_partner_uuid=drivers[1])] == [deleted]
    assert {e.row_key for e in index.query(driver_partner_uuid=drivers[0])} == {kept, never}
    assert located(store, deleted) == Locator(3, store.indexes.entry_shard(definition.spec, drivers[1]))
    assert actual(store, definition) == expected(store, definition)

    backfill(store, NAME, 1)
    IndexCatalog(store).activate(NAME, 1)
    store.put_cells([(kept, "BASE", 2, GONE)])
    drain(store, yaml_file)
    clean = verify(store, NAME)
    assert clean.mismatches == [] and clean.pending == 0 and clean.rows == 3


def test_a_tombstone_delivered_before_an_older_change_still_wins(store: logstore.Store) -> None:
    definition = seed()
    spec = definition.spec
    store.indexes.create(spec)
    applier = IndexApplier(store, definition)
    driver, other, city = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    row, batched = uuid.uuid4(), uuid.uuid4()
    first = store.put_cell(row, "BASE", 1, trip(driver, city, 1))
    tomb = store.put_cell(row, "BASE", 3, GONE)
    late = store.put_cell(row, "BASE", 2, trip(other, city, 2))
    applier.apply_one(first)
    assert store.indexes.apply(spec, [applier.prepare(tomb)], None) == ApplyResult(applied=1)
    assert store.indexes.apply(spec, [applier.prepare(late)], None) == ApplyResult(superseded=1)
    assert actual(store, definition) == {}
    assert located(store, row) == Locator(3, NO_ENTRY)

    # In one batch, in either order: the tombstone is the row's latest, so no entry.
    cells = [store.put_cell(batched, "BASE", 4, GONE), store.put_cell(batched, "BASE", 2, trip(driver, city, 2))]
    store.indexes.apply(spec, [applier.prepare(c) for c in cells], None)
    store.indexes.apply(spec, [applier.prepare(c) for c in reversed(cells)], None)
    assert actual(store, definition) == {} and located(store, batched) == Locator(4, NO_ENTRY)

    newer = store.put_cell(row, "BASE", 7, trip(other, city, 7))
    assert store.indexes.apply(spec, [applier.prepare(newer)], None) == ApplyResult(applied=1)
    assert set(actual(store, definition)) == {row}
    assert located(store, row) == Locator(7, store.indexes.entry_shard(spec, other))


def test_backfill_leaves_no_entry_for_a_tombstoned_row(store: logstore.Store, yaml_file: Path) -> None:
    definition = seed()
    driver, city = uuid.uuid4(), uuid.uuid4()
    rows = [uuid.uuid4() for _ in range(12)]
    store.put_cells([(r, "BASE", 1, trip(driver, city, n)) for n, r in enumerate(rows)])
    store.put_cells([(r, "BASE", 2, GONE) for r in rows[::3]] + [(rows[0], "BASE", 3, trip(driver, city, 30))])
    with App("trips", store=store, commit_interval=0.05) as app:
        app.index(yaml_file)  # registered, not drained: the backfill alone applies the cells
    IndexCatalog(store).mark_live(NAME, 1, "trips")
    result = backfill(store, NAME, 1)
    assert result.cells == 17 and result.dead_lettered == 0
    found = actual(store, definition)
    assert found == expected(store, definition)
    assert set(found) == {rows[0], *(r for n, r in enumerate(rows) if n % 3)}
    IndexCatalog(store).activate(NAME, 1)
    clean = verify(store, NAME)
    assert clean.mismatches == [] and clean.pending == 0 and clean.rows == len(rows)


def test_verify_reports_and_repairs_an_entry_left_for_a_tombstoned_row(store: logstore.Store,
                                                                      yaml_file: Path) -> None:
    definition = seed()
    spec = definition.spec
    driver, rows = active_index(store, yaml_file, 4)
    # A tombstone the live position passed without applying it (as before tombstones were honoured).
    tomb = store.put_cell(rows[0], "BASE", 2, GONE)
    store.indexes.apply(spec, [], "live", through={tomb.shard: tomb.added_id})
    home = store.indexes.entry_shard(spec, driver)

    found = verify(store, NAME)
    assert sorted((m.kind, m.row_key, m.shard) for m in found.mismatches) == [
        ("locator", rows[0], home), ("orphan", rows[0], home)]
    fixed = verify(store, NAME, repair=True)
    assert fixed.repaired == 1 and fixed.changed == 0
    assert verify(store, NAME).mismatches == []
    assert rows[0] not in actual(store, definition) and located(store, rows[0]) == Locator(2, NO_ENTRY)

    # A stray entry of a tombstoned row (no locator change) is an orphan, repaired too; an older cell replayed
    # after the repair stays superseded.
    store.indexes._recorder_of(home).write_entries(spec, [EntryWrite(home, rows[0], 1, actual_fields(
        store, definition, rows[1]), force=True)])
    assert [m.kind for m in verify(store, NAME, repair=True).mismatches] == ["orphan"]
    assert verify(store, NAME).mismatches == []
    IndexApplier(store, definition).apply_one(store.get_cell(rows[0], "BASE", 1))  # type: ignore[arg-type]
    assert rows[0] not in actual(store, definition)


def actual_fields(store: logstore.Store, definition: IndexDefinition, row: uuid.UUID) -> dict[str, Any]:
    return actual(store, definition)[row][1]


def test_a_tombstone_applied_while_verify_runs_is_pending_not_a_mismatch(store: logstore.Store,
                                                                         yaml_file: Path) -> None:
    definition = seed()
    _, rows = active_index(store, yaml_file, 3)

    def tombstone_after_the_log(progress: VerifyProgress) -> None:
        """Once verification read every log, before it reads the locators: a tombstone is written and applied."""
        if progress.phase == "log" and progress.shards_done == progress.shards:
            tomb = store.put_cell(rows[0], "BASE", 2, GONE)
            IndexApplier(store, definition).apply([IndexApplier(store, definition).prepare(tomb)])
    found = verify(store, NAME, progress=tombstone_after_the_log)
    assert found.mismatches == [] and found.pending == 1
    assert verify(store, NAME).mismatches == []


def test_the_change_after_a_tombstone_plans_its_entry_and_deletes_nothing() -> None:
    row, values = uuid.uuid4(), {"k": 1}
    change = IndexChange(0, 9, row, 5, values)
    writes, updated, superseded = plan([change], {row: Locator(3, NO_ENTRY)}, lambda c: (6, [1]))
    assert writes == [EntryWrite(6, row, 5, values, row=[1])] and superseded == 0
    assert updated == {row: (0, Locator(5, 6))}
    removal = change._replace(ref_key=7, values=None)
    writes, updated, _ = plan([change, removal], {row: Locator(3, 2)}, lambda c: (6, [1]))
    assert writes == [EntryWrite(2, row, 5, None), EntryWrite(6, row, 7, None)]  # the put of ref 5 is not made
    assert updated == {row: (0, Locator(7, NO_ENTRY))}
