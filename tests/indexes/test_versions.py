"""Index versions: backfill while live writes go on, activation with queries running throughout, drop,
resumed backfills, and the `cellstream index` commands."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import logstore
from cellstream.cli.main import main
from indexer import App
from indexer.errors import IndexStateError
from indexer.indexes.applier import Index
from indexer.indexes.backfill import BackfillProgress, backfill
from indexer.indexes.catalog import IndexCatalog
from tests.harness.index_support import SEED_YAML, V2_YAML, Background, actual, expected, seed, trip

SHARDS = 8
NAME = "driver_partner_index"


@pytest.fixture
def store(sqlite_url: str) -> Iterator[logstore.Store]:
    with logstore.open(sqlite_url, shards=SHARDS) as store:
        yield store


def drain(store: logstore.Store, yaml_file: Path) -> None:
    with App("trips", store=store, commit_interval=0.05) as app:
        app.index(yaml_file)
        app.drain(timeout=60)


def test_backfill_during_live_writes_then_activate_with_queries_throughout(store: logstore.Store,
                                                                          tmp_path: Path) -> None:
    v1_file, v2_file = tmp_path / "v1.yaml", tmp_path / "v2.yaml"
    v1_file.write_text(SEED_YAML)
    v2_file.write_text(V2_YAML)
    drivers, cities = [uuid.uuid4() for _ in range(5)], [uuid.uuid4() for _ in range(2)]
    watched, city = uuid.uuid4(), cities[0]
    mine = [uuid.uuid4() for _ in range(12)]
    store.put_cells([(r, "BASE", 1, trip(watched, city, i)) for i, r in enumerate(mine)])
    store.put_cells([(uuid.uuid4(), "BASE", 1, trip(drivers[i % 5], cities[i % 2], i)) for i in range(150)])

    # Version 1: kept by the app, backfilled, activated.
    drain(store, v1_file)
    assert backfill(store, NAME, 1).shards == SHARDS
    IndexCatalog(store).activate(NAME, 1)
    index = Index(store, NAME)
    assert {e.row_key for e in index.query(driver_partner_uuid=watched, city_uuid=city)} == set(mine)

    # Version 2 beside it: the app keeps both while cells keep coming; queries run all along.
    app = Background(store, v2_file)
    stop = threading.Event()
    seen: list[tuple[bool, frozenset[uuid.UUID]]] = []
    errors: list[BaseException] = []

    def query() -> None:
        while not stop.is_set():
            try:
                found = index.query(driver_partner_uuid=watched, city_uuid=city, limit=100)
                seen.append(("status" in found[0].fields if found else False, frozenset(e.row_key for e in found)))
            except BaseException as exc:  # reported below
                errors.append(exc)
            time.sleep(0.005)

    def write() -> None:
        n = 0
        while not stop.is_set():
            store.put_cells([(uuid.uuid4(), "BASE", 1, trip(drivers[n % 5], cities[n % 2], n)) for _ in range(5)])
            n += 1
            time.sleep(0.01)

    threads = [threading.Thread(target=query), threading.Thread(target=write)]
    for thread in threads:
        thread.start()
    try:
        deadline = time.monotonic() + 30
        while IndexCatalog(store).get(NAME).versions[2].live_since is None:
            assert time.monotonic() < deadline, "the app never started keeping version 2"
            time.sleep(0.05)
        reports: list[BackfillProgress] = []
        result = backfill(store, NAME, 2, batch=40, workers=3, progress=reports.append)
        assert result.shards == SHARDS and result.dead_lettered == 0 and result.cells >= 162
        assert reports[-1].shards_done == SHARDS and reports[-1].cells_done == reports[-1].cells
        assert IndexCatalog(store).get(NAME).versions[2].state == "ready"
        IndexCatalog(store).activate(NAME, 2)
        time.sleep(1.5)  # queries pick the switch up within a second
        IndexCatalog(store).drop(NAME, 1)  # the running app stops keeping it; nothing is dead-lettered
        time.sleep(0.5)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        app.stop()
    drain(store, v2_file)

    assert errors == []
    assert all(rows == frozenset(mine) for _, rows in seen), "a query saw a gap or extra rows"
    shapes = [v2 for v2, _ in seen]
    assert shapes[0] is False and shapes[-1] is True
    assert shapes == sorted(shapes), "a query went back to version 1 after seeing version 2"
    assert actual(store, seed(2)) == expected(store, seed(2))
    record = IndexCatalog(store).get(NAME)
    assert (record.active, record.versions[1].state, record.versions[2].state) == (2, "dropped", "active")
    assert store.indexes.specs() == [seed(2).spec]
    with App("trips", store=store) as check:
        assert check.dlq.list() == []


def test_a_backfill_needs_an_app_first_and_resumes_after_an_interruption(store: logstore.Store,
                                                                        tmp_path: Path) -> None:
    yaml_file = tmp_path / "v1.yaml"
    yaml_file.write_text(SEED_YAML)
    store.put_cells([(uuid.uuid4(), "BASE", 1, trip(uuid.uuid4(), uuid.uuid4(), i)) for i in range(300)])
    IndexCatalog(store).register(seed(1))
    with pytest.raises(IndexStateError, match="not kept current by any app yet"):
        backfill(store, NAME, 1)
    with App("trips", store=store, start_from="now") as app:  # an app that starts at the head: nothing live
        app.index(yaml_file)
        app.drain(timeout=30)
    assert actual(store, seed(1)) == {}
    halt = threading.Event()

    def interrupt(progress: BackfillProgress) -> None:
        if progress.cells_done >= 100:
            halt.set()
    first = backfill(store, NAME, 1, batch=10, workers=1, progress=interrupt, stop=halt)
    assert first.shards < SHARDS and IndexCatalog(store).get(NAME).versions[1].state == "building"
    second = backfill(store, NAME, 1, batch=10, workers=2)
    assert second.shards == SHARDS and 0 < second.cells < 300  # it went on from where the first stopped
    assert actual(store, seed(1)) == expected(store, seed(1))


def test_the_index_commands(store: logstore.Store, sqlite_url: str, tmp_path: Path,
                            capsys: pytest.CaptureFixture[str]) -> None:
    yaml_file = tmp_path / "v1.yaml"
    yaml_file.write_text(SEED_YAML)
    driver, city = uuid.uuid4(), uuid.uuid4()
    rows = [r.row_key for r in store.put_cells(
        [(uuid.uuid4(), "BASE", 1, trip(driver, city, i, fare=i)) for i in range(6)])]
    drain(store, yaml_file)

    def run(*argv: str) -> tuple[int, Any]:
        code = main([*argv, "--store", sqlite_url, "--json"])
        text = capsys.readouterr().out.strip()
        return code, [json.loads(line) for line in text.splitlines()] if text else []

    assert run("index", "query", NAME, f"driver_partner_uuid={driver}")[0] == 9  # nothing active yet
    code, [done] = run("index", "backfill", NAME, "--version", "1")
    assert code == 0 and done["shards"] == SHARDS
    assert run("index", "activate", NAME, "--version", "1") == (0, [{"index": NAME, "active": 1}])
    code, found = run("index", "query", NAME, f"driver_partner_uuid={driver}", f"city_uuid={city}",
                      "trip_created_at=2026-11-21T08:02:00+00:00..2026-11-21T08:05:00+00:00", "--order", "desc")
    assert code == 0 and [e["row_key"] for e in found] == [str(rows[i]) for i in (4, 3, 2)]
    assert found[0]["fare"] == 4.0 and found[0]["trip_created_at"] == "2026-11-21T08:04:00+00:00"
    code, [status] = run("index", "status", NAME)
    assert code == 0 and status["state"] == "active" and status["lag_cells"] == 0
    assert status["backfill_shards_done"] == SHARDS
    assert run("index", "query", NAME, "fare=1")[0] == 2
    assert run("index", "query", "nope", "a=1")[0] == 1
    assert run("index", "drop", NAME, "--version", "1")[0] == 9  # the active version
    assert run("index", "activate", NAME, "--version", "7")[0] == 1


def test_a_backfill_reads_on_after_a_page_cut_short_by_the_read_budget(sqlite_url: str, tmp_path: Path) -> None:
    """A page cut short by StoreOptions.max_read_bytes is not the end of the column: the backfill had jumped to
    its target after one, leaving the rest of the shard out of the index with nothing said."""
    yaml_file = tmp_path / "v1.yaml"
    yaml_file.write_text(SEED_YAML)
    with logstore.open(sqlite_url, shards=SHARDS, max_read_bytes=2_000) as store:
        store.put_cells([(uuid.uuid4(), "BASE", 1, trip(uuid.uuid4(), uuid.uuid4(), i)) for i in range(120)])
        IndexCatalog(store).register(seed(1))
        with App("trips", store=store, start_from="now") as app:
            app.index(yaml_file)
            app.drain(timeout=30)
        done = backfill(store, NAME, 1, batch=50, workers=1)
        assert done.shards == SHARDS and done.cells == 120
        assert actual(store, seed(1)) == expected(store, seed(1))
