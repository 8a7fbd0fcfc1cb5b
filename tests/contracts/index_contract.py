"""The index-table contract (logstore.index_tables.persistence), written once and run on every backend, on one node
and on a cluster of two nodes (where entries move between nodes when their shard field changes).

Backend test classes implement ``open_store(nodes)``: a fresh instance of SHARDS shards on that many nodes.
"""

from __future__ import annotations

import datetime as dt
import itertools
import random
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

import logstore
from logstore import ConfigurationError, InvalidArgumentError
from logstore.index_tables.persistence import Condition, EntryWrite, Fix, IndexChange, IndexEntry, IndexSpec, Locator

SHARDS = 8
SPEC = IndexSpec.model_validate({
    "name": "trips_by_driver", "version": 1, "shard_field": "driver",
    "fields": [
        {"name": "driver", "type": "uuid"},
        {"name": "city", "type": "str", "key": True},
        {"name": "at", "type": "datetime", "key": True},
        {"name": "fare", "type": "float"},
        {"name": "seats", "type": "int"},
        {"name": "pooled", "type": "bool"},
        {"name": "note", "type": "str"},
        {"name": "extra", "type": "json"},
    ],
})
T0 = dt.datetime(2026, 11, 21, 12, 0, tzinfo=dt.UTC)


def values(driver: uuid.UUID, city: str = "aarhus", minutes: int = 0, **more: Any) -> dict[str, Any]:
    out = {"driver": driver, "city": city, "at": T0 + dt.timedelta(minutes=minutes), "fare": 10.5, "seats": 2,
           "pooled": False, "note": None, "extra": {"tags": ["a", 1], "ok": True}}
    out.update(more)
    return out


class Log:
    """Changes with the positions a shard log would give them."""

    def __init__(self, store: logstore.Store) -> None:
        self.store = store
        self.heads: dict[int, int] = {}

    def change(self, row: uuid.UUID, ref_key: int, vals: dict[str, Any]) -> IndexChange:
        shard = self.store.shard_of(row)
        self.heads[shard] = self.heads.get(shard, 0) + 1
        return IndexChange(shard, self.heads[shard], row, ref_key, vals)


def all_entries(store: logstore.Store, spec: IndexSpec = SPEC) -> list[IndexEntry]:
    out: list[IndexEntry] = []
    for shard in range(store.shard_count):
        after = None
        while page := store.indexes.scan(spec, shard, after, limit=3):
            out.extend(page)
            after = page[-1].row_key
    return out


def drivers_on_two_nodes(store: logstore.Store) -> tuple[uuid.UUID, uuid.UUID]:
    """Two driver ids whose entries live on different nodes (or shards, on one node)."""
    first = uuid.uuid4()
    home = store.node_of(store.indexes.entry_shard(SPEC, first))
    shard = store.indexes.entry_shard(SPEC, first)
    while True:
        other = uuid.uuid4()
        there = store.indexes.entry_shard(SPEC, other)
        if (store.node_of(there) != home) if len(store.nodes) > 1 else there != shard:
            return first, other


class IndexContract:
    def open_store(self, nodes: int) -> logstore.Store:
        raise AssertionError("backend test classes implement open_store")

    @pytest.fixture(params=[1, 2], ids=["one-node", "two-nodes"])
    def store(self, request: pytest.FixtureRequest) -> Iterator[logstore.Store]:
        store = self.open_store(request.param)
        store.indexes.create(SPEC)
        try:
            yield store
        finally:
            store.close()

    # -- entries ----------------------------------------------------------------------
    def test_every_type_round_trips_and_a_query_reads_the_driver_shard(self, store: logstore.Store) -> None:
        log, driver, row = Log(store), uuid.uuid4(), uuid.uuid4()
        vals = values(driver, "Zürich ☃", 5, fare=3, seats=-(1 << 63), pooled=True, note="x" * 5000,
                      extra=[None, {"deep": [1.5, "é"]}])
        result = store.indexes.apply(SPEC, [log.change(row, 7, vals)])
        assert result == (1, 0, 0)
        [entry] = store.indexes.query(SPEC, [Condition("driver", "=", driver)])
        assert entry.row_key == row and entry.ref_key == 7
        assert entry.shard == store.indexes.entry_shard(SPEC, driver)
        assert entry.fields == {**vals, "fare": 3.0}
        assert type(entry.fields["fare"]) is float and entry.fields["at"].tzinfo is not None
        assert entry.to_json()["driver"] == str(driver) and entry.to_json()["at"] == vals["at"].isoformat()

    def test_the_highest_ref_key_wins_in_every_delivery_order(self, store: logstore.Store) -> None:
        log, driver = Log(store), uuid.uuid4()
        for order in itertools.permutations([1, 2, 3]):
            row = uuid.uuid4()
            for ref in [*order, order[0]]:  # each order, then a duplicate of the first
                store.indexes.apply(SPEC, [log.change(row, ref, values(driver, f"c{ref}", ref))])
            [entry] = [e for e in all_entries(store) if e.row_key == row]
            assert (entry.ref_key, entry.fields["city"]) == (3, "c3"), order

    def test_one_batch_with_the_same_row_several_times(self, store: logstore.Store) -> None:
        log, row = Log(store), uuid.uuid4()
        a, b = drivers_on_two_nodes(store)
        changes = [log.change(row, 2, values(a, "two")), log.change(row, 5, values(b, "five")),
                   log.change(row, 3, values(a, "three")), log.change(row, 5, values(b, "five"))]
        assert store.indexes.apply(SPEC, changes) == (2, 2, 0)
        assert [(e.ref_key, e.fields["city"]) for e in all_entries(store)] == [(5, "five")]

    def test_a_changed_shard_field_moves_the_entry_and_leaves_no_copy(self, store: logstore.Store) -> None:
        log, row = Log(store), uuid.uuid4()
        a, b = drivers_on_two_nodes(store)
        store.indexes.apply(SPEC, [log.change(row, 1, values(a))])
        store.indexes.apply(SPEC, [log.change(row, 2, values(b))])
        assert store.indexes.query(SPEC, [Condition("driver", "=", a)]) == []
        [entry] = all_entries(store)
        assert entry.fields["driver"] == b and entry.shard == store.indexes.entry_shard(SPEC, b)
        assert store.indexes.locators(SPEC, [row])[row] == (2, entry.shard)
        store.indexes.apply(SPEC, [log.change(row, 1, values(a))])  # the old cell again: no effect
        assert [e.fields["driver"] for e in all_entries(store)] == [b]

    # -- repairs (verification's) ----------------------------------------------------------
    def damage(self, store: logstore.Store, *writes: EntryWrite) -> None:
        """Write entries as a bug or a hand would, bypassing locators and ref_key guards."""
        for w in writes:
            store.indexes._recorder_of(w.shard).write_entries(SPEC, [w._replace(force=True)])

    def test_a_repair_overwrites_the_entry_clears_copies_and_sets_the_locator(self, store: logstore.Store) -> None:
        log, row = Log(store), uuid.uuid4()
        a, b = drivers_on_two_nodes(store)
        home, away = store.indexes.entry_shard(SPEC, a), store.indexes.entry_shard(SPEC, b)
        store.indexes.apply(SPEC, [log.change(row, 3, values(a, "oslo"))])
        self.damage(store, EntryWrite(home, row, 3, values(a, "bergen")), EntryWrite(away, row, 9, values(b)))
        assert sorted(e.shard for e in all_entries(store)) == sorted([home, away])
        fix = Fix(store.shard_of(row), row, 3, home, values(a, "oslo"), (away,))
        assert store.indexes.repair(SPEC, [fix], lambda *_: pytest.fail("no locator is past the fix")) == 1
        [entry] = all_entries(store)
        assert (entry.shard, entry.ref_key, entry.fields["city"]) == (home, 3, "oslo")
        assert store.indexes.locators(SPEC, [row]) == {row: Locator(3, home)}
        store.indexes.apply(SPEC, [log.change(row, 4, values(b))])  # the next cell still moves it
        assert [(e.shard, e.ref_key) for e in all_entries(store)] == [(away, 4)]

    def test_a_repair_leaves_alone_a_row_a_newer_cell_reached(self, store: logstore.Store) -> None:
        log, row, driver = Log(store), uuid.uuid4(), uuid.uuid4()
        shard = store.indexes.entry_shard(SPEC, driver)
        store.indexes.apply(SPEC, [log.change(row, 5, values(driver, "new"))])
        asked: list[tuple[uuid.UUID, Locator]] = []
        fix = Fix(store.shard_of(row), row, 3, shard, values(driver, "old"))
        assert store.indexes.repair(SPEC, [fix], lambda r, loc: asked.append((r, loc)) is None) == 0
        assert asked == [(row, Locator(5, shard))]
        assert [(e.ref_key, e.fields["city"]) for e in all_entries(store)] == [(5, "new")]
        # A locator naming no real cell (keep says False) is overwritten.
        assert store.indexes.repair(SPEC, [fix], lambda *_: False) == 1
        assert [(e.ref_key, e.fields["city"]) for e in all_entries(store)] == [(3, "old")]
        assert store.indexes.locators(SPEC, [row]) == {row: Locator(3, shard)}

    def test_a_repair_without_values_removes_entries_and_locators(self, store: logstore.Store) -> None:
        log, applied, stray, driver = Log(store), uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
        shard = store.indexes.entry_shard(SPEC, driver)
        store.indexes.apply(SPEC, [log.change(applied, 2, values(driver))])
        self.damage(store, EntryWrite(shard, stray, 1, values(driver)))  # no locator at all
        fixes = [Fix(store.shard_of(k), k, -1, -1, None, (shard,)) for k in (applied, stray)]
        assert store.indexes.repair(SPEC, fixes, lambda *_: False) == 2
        assert all_entries(store) == [] and store.indexes.locators(SPEC, [applied, stray]) == {}
        store.indexes.apply(SPEC, [log.change(stray, 1, values(driver))])  # no placeholder left in the way
        assert [e.row_key for e in all_entries(store)] == [stray]

    def test_a_bad_fix_writes_nothing(self, store: logstore.Store) -> None:
        row, driver = uuid.uuid4(), uuid.uuid4()
        shard = store.indexes.entry_shard(SPEC, driver)
        good = Fix(store.shard_of(row), row, 1, shard, values(driver))
        for bad, message in ((good._replace(shard=(good.shard + 1) % SHARDS), "is in shard"),
                             (good._replace(entry_shard=(shard + 1) % SHARDS), "belongs in shard"),
                             (good._replace(values=values(driver, fare="x")), "fare is float")):
            with pytest.raises(InvalidArgumentError, match=message):
                store.indexes.repair(SPEC, [good, bad], lambda *_: False)
        assert all_entries(store) == []

    # -- positions ---------------------------------------------------------------------
    def test_positions_skip_what_was_applied_per_stream(self, store: logstore.Store) -> None:
        log, driver = Log(store), uuid.uuid4()
        rows = [uuid.uuid4() for _ in range(20)]
        batch = [log.change(r, 1, values(driver, minutes=i)) for i, r in enumerate(rows)]
        assert store.indexes.apply(SPEC, batch) == (20, 0, 0)
        assert store.indexes.apply(SPEC, batch) == (0, 0, 20)
        positions = store.indexes.positions(SPEC)
        assert {s: p.location for s, p in positions.items()} == log.heads
        assert store.indexes.positions(SPEC, "backfill") == {}
        assert store.indexes.apply(SPEC, batch, stream="backfill") == (0, 20, 0)  # its own position; no-ops
        store.indexes.set_targets(SPEC, "backfill", {0: 99, 1: 7})
        backfill = store.indexes.positions(SPEC, "backfill")
        assert backfill[0].target == 99 and backfill[1].target == 7
        assert backfill[0].location == log.heads.get(0, 0)

    # -- bad input ------------------------------------------------------------------------
    @pytest.mark.parametrize(("change", "message"), [
        ({"fare": "ten"}, "field fare is float, got str"),
        ({"seats": True}, "field seats is int, got bool"),
        ({"at": dt.datetime(2026, 1, 1)}, "field at is datetime"),
        ({"city": None}, "key field city needs a value"),
        ({"city": "x" * 129}, "longer than 128 characters"),
        ({"extra": {1, 2}}, "not a JSON value"),
    ])
    def test_a_bad_change_writes_nothing(self, store: logstore.Store, change: dict[str, Any], message: str) -> None:
        log, driver = Log(store), uuid.uuid4()
        good = [log.change(uuid.uuid4(), 1, values(driver)) for _ in range(5)]
        bad = log.change(uuid.uuid4(), 1, values(driver, **change))
        with pytest.raises(InvalidArgumentError, match=message):
            store.indexes.apply(SPEC, [*good, bad])
        assert all_entries(store) == [] and store.indexes.positions(SPEC) == {}

    def test_a_missing_field_is_refused(self, store: logstore.Store) -> None:
        vals = values(uuid.uuid4())
        del vals["seats"]
        with pytest.raises(InvalidArgumentError, match="entry lacks seats"):
            store.indexes.apply(SPEC, [Log(store).change(uuid.uuid4(), 1, vals)])

    # -- queries ---------------------------------------------------------------------------
    def test_equality_range_order_and_limit(self, store: logstore.Store) -> None:
        log, driver, other = Log(store), uuid.uuid4(), uuid.uuid4()
        rows = {minute: uuid.uuid4() for minute in range(10)}
        batch = [log.change(r, 1, values(driver, "aarhus" if m % 2 else "oslo", m)) for m, r in rows.items()]
        batch.append(log.change(uuid.uuid4(), 1, values(other, "aarhus", 3)))
        store.indexes.apply(SPEC, batch)
        between = [Condition("driver", "=", driver), Condition("city", "=", "aarhus"),
                   Condition("at", ">=", T0 + dt.timedelta(minutes=2)),
                   Condition("at", "<", T0 + dt.timedelta(minutes=8))]
        assert [e.row_key for e in store.indexes.query(SPEC, between)] == [rows[3], rows[5], rows[7]]
        assert [e.row_key for e in store.indexes.query(SPEC, between, order="desc", limit=2)] == [rows[7], rows[5]]
        everything = store.indexes.query(SPEC, [Condition("driver", "=", driver)])
        assert [e.fields["city"] for e in everything] == ["aarhus"] * 5 + ["oslo"] * 5
        assert store.indexes.query(SPEC, [Condition("driver", "=", driver), Condition("city", "=", "aarhus ")]) == []

    def test_a_query_without_the_shard_field_must_ask_for_scatter(self, store: logstore.Store) -> None:
        log = Log(store)
        drivers = [uuid.uuid4() for _ in range(12)]
        store.indexes.apply(SPEC, [log.change(uuid.uuid4(), 1, values(d, "bergen", i)) for i, d in enumerate(drivers)])
        with pytest.raises(InvalidArgumentError, match="reads every shard; ask for it with scatter"):
            store.indexes.query(SPEC, [Condition("city", "=", "bergen")])
        found = store.indexes.query(SPEC, [Condition("city", "=", "bergen")], scatter=True, order="desc", limit=5)
        assert [e.fields["at"] for e in found] == [T0 + dt.timedelta(minutes=m) for m in (11, 10, 9, 8, 7)]
        assert len({e.shard for e in store.indexes.query(SPEC, [], scatter=True)}) > 1

    @pytest.mark.parametrize(("conditions", "message"), [
        ([Condition("fare", "=", 1.0)], "'fare' is not a query key"),
        ([Condition("city", "LIKE", "a")], "unknown operator 'LIKE'"),
        ([Condition("driver", "=", "not-a-uuid")], "field driver is uuid, got str"),
    ])
    def test_bad_queries_name_the_problem(self, store: logstore.Store, conditions: list[Condition],
                                          message: str) -> None:
        with pytest.raises(InvalidArgumentError, match=message):
            store.indexes.query(SPEC, conditions, scatter=True)

    # -- tables ------------------------------------------------------------------------------
    def test_create_is_idempotent_and_refuses_another_definition(self, store: logstore.Store) -> None:
        store.indexes.create(SPEC)
        assert store.indexes.specs() == [SPEC]
        changed = SPEC.model_copy(update={"shard_field": "city"})
        with pytest.raises(ConfigurationError, match="with another definition"):
            store.indexes.create(IndexSpec.model_validate(changed.model_dump()))
        v2 = IndexSpec.model_validate({**changed.model_dump(), "version": 2})
        store.indexes.create(v2)
        assert [s.version for s in store.indexes.specs()] == [1, 2]

    def test_drop_removes_entries_and_positions(self, store: logstore.Store) -> None:
        store.indexes.apply(SPEC, [Log(store).change(uuid.uuid4(), 1, values(uuid.uuid4()))])
        store.indexes.drop(SPEC)
        assert store.indexes.specs() == []
        store.indexes.create(SPEC)
        assert all_entries(store) == [] and store.indexes.positions(SPEC) == {}

    # -- concurrency -------------------------------------------------------------------------
    def test_live_and_backfill_appliers_of_the_same_rows_converge(self, store: logstore.Store) -> None:
        """Two streams apply the same rows' versions at once, in opposite orders and with moving shard
        fields: the result is each row's highest version, in one place."""
        rnd = random.Random(5)
        drivers = [uuid.uuid4() for _ in range(6)]
        rows = [uuid.uuid4() for _ in range(40)]
        versions = {(r, ref): values(rnd.choice(drivers), f"c{ref}") for r in rows for ref in range(1, 5)}
        live, backfill = Log(store), Log(store)
        ordered = sorted(versions, key=lambda k: rnd.random())
        errors: list[BaseException] = []

        def run(log: Log, keys: list[tuple[uuid.UUID, int]], stream: str) -> None:
            try:
                for start in range(0, len(keys), 7):
                    batch = [log.change(r, ref, versions[(r, ref)]) for r, ref in keys[start:start + 7]]
                    store.indexes.apply(SPEC, batch, stream=stream)  # type: ignore[arg-type]
            except BaseException as exc:  # reported below
                errors.append(exc)
        threads = [threading.Thread(target=run, args=(live, ordered, "live")),
                   threading.Thread(target=run, args=(backfill, ordered[::-1], "backfill"))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == []
        entries = all_entries(store)
        assert sorted((e.row_key, e.ref_key, e.fields["driver"]) for e in entries) == sorted(
            (r, 4, versions[(r, 4)]["driver"]) for r in rows)
        assert all(e.shard == store.indexes.entry_shard(SPEC, e.fields["driver"]) for e in entries)
