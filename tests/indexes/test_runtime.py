"""Secondary indexes kept by an app (direct mode): semantics, the randomized property, restart mid-batch.

Every test compares the index with a brute-force scan of the latest cells (tests/harness/index_support.py)."""

from __future__ import annotations

import json
import random
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import logstore
from indexer import App
from indexer.errors import IndexStateError, InvalidQueryError
from indexer.indexes.applier import Index, IndexApplier, lag
from indexer.indexes.backfill import backfill
from indexer.indexes.catalog import IndexCatalog
from indexer.indexes.verify import verify
from indexer.runtime.replay import Replay, replay_params
from logstore.jobs import JobRunner, KindRegistry, RunnerConfig
from tests.harness.app_worker import kill_mid_handler_then_drain
from tests.harness.index_support import T0, actual, expected, row_keys, seed, trip

SHARDS = 8
FAST_JOBS = RunnerConfig(lease_seconds=5.0, poll_seconds=0.05, progress_seconds=0.1, backoff_seconds=0.05)


@pytest.fixture
def store(sqlite_url: str) -> Iterator[logstore.Store]:
    with logstore.open(sqlite_url, shards=SHARDS) as store:
        yield store


def drain(store: logstore.Store, yaml_file: Path, name: str = "trips") -> tuple[Any, App]:
    with App(name, store=store, commit_interval=0.05) as app:
        app.index(yaml_file)
        counts = app.drain(timeout=60)
    return counts, app


def test_the_app_keeps_the_index_current_and_bad_cells_go_to_the_dlq(store: logstore.Store,
                                                                     yaml_file: Path) -> None:
    drivers, cities = [uuid.uuid4() for _ in range(3)], [uuid.uuid4() for _ in range(2)]
    rows = [uuid.uuid4() for _ in range(40)]
    store.put_cells([(r, "BASE", 1, trip(drivers[i % 3], cities[i % 2], i)) for i, r in enumerate(rows)])
    counts, _ = drain(store, yaml_file)
    definition = seed()
    assert counts.processed == 40 and actual(store, definition) == expected(store, definition)

    index = Index(store, "driver_partner_index", version=1)
    found = index.query(driver_partner_uuid=drivers[0], city_uuid=cities[0],
                        trip_created_at=(T0.replace(minute=5), T0.replace(minute=30)))
    assert row_keys(found) == [rows[i] for i in range(6, 30, 6)]  # minutes 6, 12, 18, 24, in time order
    assert found[0].fields["fare"] == 10.0 and found[0].fields["city_uuid"] == cities[0]
    assert row_keys(index.query(driver_partner_uuid=drivers[0], city_uuid=cities[0], order="desc", limit=2)) == [
        rows[36], rows[30]]

    store.put_cells([
        (rows[0], "BASE", 3, trip(drivers[0], cities[1], 0, fare=11)),  # newer: replaces
        (rows[0], "BASE", 2, trip(drivers[2], cities[1], 0, fare=99)),  # older, delivered after: no effect
        (rows[1], "BASE", 2, trip(drivers[2], cities[1], 1)),  # the shard field changed: the entry moves
        (rows[2], "BASE", 2, {**trip(drivers[0], cities[0], 2), "fare": "twelve"}),  # bad: dead-lettered
        (rows[3], "BASE", 2, {k: v for k, v in trip(drivers[0], cities[0], 3).items() if k != "city_uuid"}),
    ])
    counts, app = drain(store, yaml_file)
    assert counts.dead_lettered == 2 and counts.processed == 3
    now = actual(store, definition)
    assert now == expected(store, definition)
    assert now[rows[0]][0] == 3 and now[rows[0]][1]["fare"] == 11.0
    assert now[rows[1]][1]["driver_partner_uuid"] == drivers[2]
    assert now[rows[2]][0] == 1  # the entry of the last cell that fit
    assert lag(store, definition) == (0, 0.0)  # the positions passed the dead-lettered cells too
    assert rows[1] not in row_keys(index.query(driver_partner_uuid=drivers[1], scatter=False))
    letters = sorted(app.dlq.list(), key=lambda e: e.cell["row_key"] == str(rows[3]))
    assert [(e.handler, e.error_type.rsplit(".", 1)[-1]) for e in letters] == [
        ("index:driver_partner_index.v1", "EntryFieldError")] * 2
    assert "field fare: expected a finite number, got str 'twelve'" in letters[0].message
    assert "field city_uuid: missing from the cell's body" in letters[1].message
    assert drain(store, yaml_file)[0].processed == 0


def test_queries_refuse_what_they_cannot_answer(store: logstore.Store, yaml_file: Path) -> None:
    drain(store, yaml_file)
    index = Index(store, "driver_partner_index")
    with pytest.raises(IndexStateError, match="no active version yet \\(versions: 1 building\\)"):
        index.query(driver_partner_uuid=uuid.uuid4())
    pinned = Index(store, "driver_partner_index", version=1)
    for kwargs, message in [({"fare": 1.0}, "'fare' is not a query key"),
                            ({"city_uuid": uuid.uuid4()}, "reads every shard; ask for it with scatter=True"),
                            ({"driver_partner_uuid": "nope"}, "driver_partner_uuid: expected a UUID string"),
                            ({"driver_partner_uuid": uuid.uuid4(), "trip_created_at": (1, 2, 3)}, "(start, end)"),
                            ({"driver_partner_uuid": uuid.uuid4(), "order": "up"}, "order must be")]:
        with pytest.raises(InvalidQueryError, match=message):
            pinned.query(**kwargs)
    with pytest.raises(IndexStateError, match="not backfilled yet"):
        IndexCatalog(store).activate("driver_partner_index", 1)


def test_a_replay_past_the_live_position_leaves_no_hole_in_the_index(store: logstore.Store, yaml_file: Path) -> None:
    """The live applier has not reached the first cells when a replay of the later ones runs: the replay applies
    its range without moving the live stream's positions, so the live applier still applies the first cells."""
    drivers, cities = [uuid.uuid4() for _ in range(3)], [uuid.uuid4() for _ in range(2)]
    store.put_cells([(uuid.uuid4(), "BASE", 1, trip(drivers[i % 3], cities[i % 2], i)) for i in range(30)])
    after_first = ",".join(f"{shard}:{location}" for shard, location in sorted(store.heads().items()))
    store.put_cells([(uuid.uuid4(), "BASE", 1, trip(drivers[i % 3], cities[i % 2], 100 + i)) for i in range(30)])
    replaying = App("trips", store=store)
    replaying.index(yaml_file)
    runner = JobRunner(store, KindRegistry([Replay(store, lambda _params: (replaying, lambda: None))]), FAST_JOBS)
    job = runner.submit("replay", replay_params(replaying, {"app": "test"}, start=after_first))
    assert job.total == 30 and runner.run(job.id).state == "done"
    replaying.close()
    definition = seed()
    assert len(actual(store, definition)) == 30  # the replay's range, applied
    counts, _ = drain(store, yaml_file)  # the live applier, from the beginning
    assert counts.processed == 60
    assert actual(store, definition) == expected(store, definition) and len(expected(store, definition)) == 60
    assert lag(store, definition) == (0, 0.0)


@pytest.mark.parametrize("backend", ["sqlite", "mysql"])
def test_an_index_applies_two_batches_at_once_on_mariadb_and_one_at_a_time_on_sqlite(
        backend: str, sqlite_url: str, request: pytest.FixtureRequest) -> None:
    """A server overlaps one apply's statements with another's commit; SQLite's second writer would sleep in
    its busy handler (docs/benchmarks.md, secondary indexes)."""
    url = sqlite_url if backend == "sqlite" else request.getfixturevalue("mysql_database_factory")()
    with logstore.open(url, shards=SHARDS) as store:
        assert IndexApplier(store, seed()).calls_at_once == (1 if backend == "sqlite" else 2)


@pytest.mark.parametrize("backend", ["sqlite", "mysql"])
def test_randomized_interleavings_converge_to_the_brute_force_index(
        backend: str, sqlite_url: str, yaml_file: Path, request: pytest.FixtureRequest) -> None:
    """Writes, updates, older versions written late, duplicates, bad cells; drains at random moments,
    redeliveries of old cells in shuffled batches, and offsets reset as after a crash before their commit."""
    seed_value = random.randrange(1 << 30)
    rnd = random.Random(seed_value)
    # MariaDB only for the mysql param, which marks the test (tests/conftest.py): the sqlite one needs no server.
    url = sqlite_url if backend == "sqlite" else request.getfixturevalue("mysql_database_factory")()
    definition = seed()
    with logstore.open(url, shards=SHARDS) as store:
        drivers, cities = [uuid.uuid4() for _ in range(4)], [uuid.uuid4() for _ in range(3)]
        rows: dict[uuid.UUID, list[int]] = {uuid.uuid4(): [] for _ in range(25)}
        written: list[logstore.Cell] = []
        for _step in range(120):
            action = rnd.random()
            row = rnd.choice(list(rows))
            if action < 0.55:
                used = rows[row]
                ref = rnd.choice([r for r in range(1, 40) if r not in used])  # newer or older than the others
                body = trip(rnd.choice(drivers), rnd.choice(cities), rnd.randrange(500), fare=rnd.random() * 50)
                if rnd.random() < 0.1:
                    body = {**body, "trip_created_at": "yesterday"}
                written.extend(store.put_cells([(row, "BASE", ref, body)]))
                used.append(ref)
            elif action < 0.65 and written:
                old = rnd.choice(written)  # a duplicate write: the store returns the stored cell
                assert store.put_cell(old.row_key, "BASE", old.ref_key, old.body).added_id == old.added_id
            elif action < 0.8:
                drain(store, yaml_file)
            elif action < 0.9 and written:
                applier = IndexApplier(store, definition)
                redelivered = rnd.sample(written, min(len(written), rnd.randrange(1, 10)))
                for cell in redelivered:
                    try:
                        applier.apply_one(cell)
                    except Exception as exc:  # the bad cells: they fail here as in the app
                        assert type(exc).__name__ == "EntryFieldError"
            else:
                owner = f"crash-{uuid.uuid4().hex[:6]}"
                store.claim_offsets("app.trips", owner)
                store.commit_offsets("app.trips", owner, {s: (0, {}) for s in range(SHARDS)})
        drain(store, yaml_file)
        assert actual(store, definition) == expected(store, definition), f"seed {seed_value}"
        backfill(store, "driver_partner_index", 1)
        IndexCatalog(store).activate("driver_partner_index", 1)
        checked = verify(store, "driver_partner_index")  # verification agrees with the brute force
        assert checked.mismatches == [] and checked.pending == 0 and checked.rows == len(expected(store, definition))


def test_sigkill_mid_batch_neither_skips_nor_applies_twice(store: logstore.Store, sqlite_url: str,
                                                            yaml_file: Path, tmp_path: Path) -> None:
    """The worker applies a batch to the index, then hangs in a handler of the same batch and is killed
    before its offsets pass it; the next worker gets the batch again and skips what the index has."""
    rows = [uuid.uuid4() for _ in range(30)]
    drivers = [uuid.uuid4() for _ in range(3)]
    store.put_cells([(r, "BASE", 1, {**trip(drivers[i % 3], drivers[0], i), "hang": i == 20})
                     for i, r in enumerate(rows)])
    results = tmp_path / "results.json"
    config = {"name": "trips", "store": sqlite_url, "log": str(tmp_path / "log"), "marker": str(tmp_path / "m"),
              "index": str(yaml_file), "results": str(results), "drain": True}
    kill_mid_handler_then_drain(config)
    assert actual(store, seed()) == expected(store, seed())
    second = json.loads(results.read_text())["index:driver_partner_index.v1"]
    assert second["skipped"] > 0, second  # cells the killed worker applied: not applied again
    positions = store.indexes.positions(seed().spec)
    last = {c.shard: c.added_id for c in sorted(
        (c for s in range(SHARDS) for c in store.get_cells_for_shard(s, 0, 1000, columns=["BASE"])[0]),
        key=lambda c: c.added_id)}
    assert {s: p.location for s, p in positions.items()} == last
