"""`cellstream index verify`: every kind of damage found and repaired, no false alarm while live writes
go on, sampling, and the lag gauges. On SQLite and MariaDB clusters of two nodes."""

from __future__ import annotations

import json
import random
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

import logstore
from cellstream.cli.main import main
from indexer import App
from indexer.errors import IndexStateError, InvalidQueryError
from indexer.indexes.backfill import backfill
from indexer.indexes.catalog import IndexCatalog
from indexer.indexes.verify import verify
from logstore.index_tables.persistence import EntryWrite
from tests.harness.index_support import Background, actual, expected, seed, trip
from tests.indexes.conftest import SHARDS

NAME = "driver_partner_index"


def populate(store: logstore.Store, rnd: random.Random, rows: int = 60) -> list[uuid.UUID]:
    """Rows of one to three trips; some change driver (their entry moves); some end with a cell that does not
    fit (the entry keeps the one before)."""
    drivers, cities = [uuid.uuid4() for _ in range(6)], [uuid.uuid4() for _ in range(2)]
    keys = [uuid.uuid4() for _ in range(rows)]
    cells = []
    for n, key in enumerate(keys):
        for ref in range(1, rnd.randint(2, 4)):
            cells.append((key, "BASE", ref, trip(rnd.choice(drivers), rnd.choice(cities), n + ref, fare=n + ref)))
        if n % 10 == 0:
            cells.append((key, "BASE", 9, {**trip(drivers[0], cities[0], n), "trip_created_at": "yesterday"}))
    store.put_cells(cells)
    return keys


def build(store: logstore.Store, yaml_file: Path) -> None:
    """The app keeps version 1 current (and applied every cell so far); it is backfilled and activated."""
    with App("trips", store=store, commit_interval=0.05) as app:
        app.index(yaml_file)
        app.drain(timeout=60)
    backfill(store, NAME, 1)
    IndexCatalog(store).activate(NAME, 1)


def force(store: logstore.Store, write: EntryWrite) -> None:
    """An entry written as a bug or a hand would: no locator, no ref_key guard."""
    store.indexes._recorder_of(write.shard).write_entries(seed().spec, [write._replace(force=True)])


def skip(store: logstore.Store, cell: logstore.Cell) -> None:
    """What a runtime bug would do: move the live position past a cell without applying it."""
    store.indexes.apply(seed().spec, [], "live", through={cell.shard: cell.added_id})


def test_every_kind_of_damage_is_found_and_repaired(store: logstore.Store, cluster: str, yaml_file: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    keys = populate(store, random.Random(7))
    build(store, yaml_file)
    definition = seed()
    clean = verify(store, NAME)
    assert clean.mismatches == [] and clean.pending == 0 and clean.rows == len(keys)
    assert clean.entries == len(keys)
    assert clean.cells == sum(store.count_after(s, 0, columns=["BASE"]) for s in range(SHARDS))

    current = actual(store, definition)
    stale_row, different_row, misplaced_row = keys[1], keys[2], keys[3]
    ref, fields = current[stale_row]
    skip(store, store.put_cell(stale_row, "BASE", ref + 1, trip(fields["driver_partner_uuid"], fields["city_uuid"],
                                                                 7, fare=99.0)))
    missing_row = uuid.uuid4()
    skip(store, store.put_cell(missing_row, "BASE", 1, trip(uuid.uuid4(), uuid.uuid4(), 3)))
    ref, fields = current[different_row]
    home = store.indexes.entry_shard(definition.spec, fields["driver_partner_uuid"])
    force(store, EntryWrite(home, different_row, ref, {**fields, "fare": -1.0}))
    ref, fields = current[misplaced_row]
    elsewhere = (store.indexes.entry_shard(definition.spec, fields["driver_partner_uuid"]) + 1) % SHARDS
    force(store, EntryWrite(elsewhere, misplaced_row, ref - 1, fields))
    orphan_row = uuid.uuid4()
    force(store, EntryWrite(home, orphan_row, 1, {**fields, "driver_partner_uuid": fields["driver_partner_uuid"]}))

    def run(*argv: str) -> tuple[int, dict[str, Any]]:
        code = main(["index", "verify", NAME, *argv, "--store", cluster, "--json"])
        return code, json.loads(capsys.readouterr().out)

    code, found = run("--show", "100")
    assert code == 8
    assert found["mismatches"] == {"stale": 1, "missing": 1, "different": 1, "misplaced": 1, "orphan": 1,
                                   "locator": 2}
    by_kind = {m["kind"]: m for m in found["listed"] if m["kind"] != "locator"}
    assert {k: m["row_key"] for k, m in by_kind.items()} == {
        "stale": str(stale_row), "missing": str(missing_row), "different": str(different_row),
        "misplaced": str(misplaced_row), "orphan": str(orphan_row)}
    assert by_kind["different"]["detail"] == "fields differ from the cell's: fare"
    assert by_kind["misplaced"]["shard"] == elsewhere
    assert {m["row_key"] for m in found["listed"] if m["kind"] == "locator"} == {str(stale_row), str(missing_row)}

    code, fixed = run("--repair")
    assert code == 0 and fixed["repaired"] == 5 and fixed["changed"] == 0
    code, again = run()
    assert code == 0 and again["mismatches"] == {} and again["rows"] == len(keys) + 1
    assert actual(store, definition) == expected(store, definition)


def test_no_false_alarm_while_live_writes_go_on(store: logstore.Store, yaml_file: Path) -> None:
    rnd = random.Random(11)
    keys = populate(store, rnd, rows=40)
    build(store, yaml_file)
    app = Background(store, yaml_file, index_lag_interval=0.1)
    stop = threading.Event()
    drivers = [uuid.uuid4() for _ in range(4)]
    refs = dict.fromkeys(keys, 10)

    def write() -> None:
        n = 0
        while not stop.is_set():  # updates that move entries between shards, and new rows
            batch = []
            for key in rnd.sample(keys, 5):
                refs[key] += 1
                batch.append((key, "BASE", refs[key], trip(drivers[n % 4], drivers[0], n)))
            batch.append((uuid.uuid4(), "BASE", 1, trip(drivers[n % 4], drivers[1], n)))
            store.put_cells(batch)
            n += 1
            time.sleep(0.002)

    writer = threading.Thread(target=write)
    writer.start()
    runs = []
    registry = app.app.metrics.registry
    labels = {"app": "trips", "index": NAME, "version": "1"}
    try:
        for _ in range(6):
            runs.append(verify(store, NAME))
        # The running app measures its lag every 0.1 s once started; the verify runs can end before that.
        deadline = time.monotonic() + 30
        while registry.get_sample_value("cellstream_index_lag_cells", labels) is None:
            assert time.monotonic() < deadline, "the running app never exported its index lag"
            time.sleep(0.05)
    finally:
        stop.set()
        writer.join()
        app.stop()
    assert [m for r in runs for m in r.mismatches] == []
    assert sum(r.pending for r in runs) > 0, "no run met a row being applied: the test did not test"
    with App("trips", store=store) as last:
        last.index(yaml_file)
        last.drain(timeout=60)
        for hook in last.hooks:  # the lag is measured now, not at the next tick
            hook.tick()
        assert last.metrics.registry.get_sample_value("cellstream_index_lag_cells", labels) == 0
        assert last.metrics.registry.get_sample_value("cellstream_index_lag_seconds", labels) == 0
    final = verify(store, NAME)
    assert final.mismatches == [] and final.pending == 0
    assert actual(store, seed()) == expected(store, seed())


def test_lag_gauges_count_the_cells_not_applied(sqlite_url: str, yaml_file: Path) -> None:
    with logstore.open(sqlite_url, shards=SHARDS) as store, App("trips", store=store) as app:
        app.index(yaml_file)
        app.drain(timeout=60)
        store.put_cells([(uuid.uuid4(), "BASE", 1, trip(uuid.uuid4(), uuid.uuid4(), n)) for n in range(30)])
        store.put_cells([(uuid.uuid4(), "OTHER", 1, {"n": n}) for n in range(10)])  # not the index's column
        time.sleep(0.05)
        for hook in app.hooks:
            hook.tick()
        labels = {"app": "trips", "index": NAME, "version": "1"}
        assert app.metrics.registry.get_sample_value("cellstream_index_lag_cells", labels) == 30
        seconds = app.metrics.registry.get_sample_value("cellstream_index_lag_seconds", labels)
        assert seconds is not None and 0.05 <= seconds < 30


def test_a_sample_checks_a_share_of_the_rows(sqlite_url: str, yaml_file: Path) -> None:
    with logstore.open(sqlite_url, shards=SHARDS) as store:
        keys = populate(store, random.Random(3), rows=300)
        build(store, yaml_file)
        spec = seed().spec
        damaged = keys[:100]
        for key, (ref, fields) in actual(store, seed()).items():
            if key in damaged:
                force(store, EntryWrite(store.indexes.entry_shard(spec, fields["driver_partner_uuid"]), key, ref,
                                        {**fields, "fare": -1.0}))
        part = verify(store, NAME, sample=0.2, repair=True)
        assert 20 <= part.rows <= 110, part.rows
        assert {m.kind for m in part.mismatches} == {"different"}
        assert {m.row_key for m in part.mismatches} <= set(damaged) and part.repaired == len(part.mismatches) > 0
        rest = verify(store, NAME)
        assert rest.rows == 300 and len(rest.mismatches) == 100 - part.repaired


def test_verify_refuses_what_it_cannot_check(sqlite_url: str, yaml_file: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    with logstore.open(sqlite_url, shards=SHARDS) as store:
        with App("trips", store=store) as app:
            app.index(yaml_file)
        with pytest.raises(IndexStateError, match="no active version"):
            verify(store, NAME)
        with pytest.raises(IndexStateError, match="version 1 is building"):
            verify(store, NAME, 1)
        with pytest.raises(InvalidQueryError, match="sample must be a rate"):
            verify(store, NAME, 1, sample=1.5)
    assert main(["index", "verify", NAME, "--sample", "0", "--store", sqlite_url]) == 2
    assert "not a rate in (0, 1]" in capsys.readouterr().err
    assert main(["index", "verify", "nope", "--store", sqlite_url]) == 1
