"""The logstore contract, written once and run against every backend.

Subclasses provide the ``url`` fixture (a fresh, empty instance location) and
``corrupt_body`` (overwrite a stored body with bytes that cannot be decoded).
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
import math
import random
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import pytest

import logstore
from logstore import CellConflictError, ConfigurationError, InvalidArgumentError, InvalidCellError
from logstore.cell import decode_body
from logstore.log_blocks import created_text, decode
from tests.harness.stores import key_per_shard, keys_in_shard


def _read_all(store: logstore.Store, shard: int) -> list[logstore.Cell]:
    cells, location = [], 0
    while True:
        page, location = store.get_cells_for_shard(shard, location, limit=7)
        if not page:
            return cells
        cells.extend(page)


# The offsets of the table a row per shard that older versions kept (consumer, shard, owner, location, doc).
OLD_OFFSETS = [("billing", 0, "worker-a", 17, '{"deadlettered":2}'), ("billing", 1, "worker-a", None, "{}"),
               ("billing", 2, "worker-b", 5, '{"lag":NaN}'), ("kept", 0, "worker-old", 1, "{}"),
               ("other", 3, "worker-x", 4, '{"e":"caf\\u00e9"}')]


def check_old_offsets_move(url: str, write_old: Callable[[], None], old_table_exists: Callable[[], bool]) -> None:
    """A store whose node still has the offsets table a row per shard moves them to a row per consumer when it
    opens: locations, owners (fencing) and docs intact; a consumer already in the new table keeps its own."""
    with logstore.open(url, shards=4) as store:
        store.claim_offsets("kept", "worker-new")
        store.commit_offsets("kept", "worker-new", {0: (9, {})})
    write_old()
    with logstore.open(url) as store:
        found = store.read_offsets("billing")
        assert {s: (r.location, r.owner) for s, r in found.items()} == {
            0: (17, "worker-a"), 1: (None, "worker-a"), 2: (5, "worker-b")}
        assert found[0].doc == {"deadlettered": 2} and math.isnan(found[2].doc["lag"])
        assert store.read_offsets("other")[3].doc == {"e": "caf\u00e9"}
        kept = store.read_offsets("kept")
        assert (kept[0].location, kept[0].owner, len(kept)) == (9, "worker-new", 4)
        assert store.commit_offsets("billing", "worker-a", {0: (20, {}), 2: (6, {})}) == {2}
    assert not old_table_exists()
    with logstore.open(url) as store:  # opening again moves nothing again
        assert {s: r.location for s, r in store.read_offsets("billing").items()} == {0: 20, 1: None, 2: 5}


class StoreContract:
    url: str
    #: The instance's shard count; a backend runs the contract again at the default, 4096.
    shards = 8
    #: A float far outside 64-bit integers; over HTTP numbers stay inside them (logstore.node.models).
    far_float = -1.5e300
    #: Whether ``changed_counts`` answers a mark with the shards written since it, not with every shard's.
    partial_counts = True
    #: Whether the backend weighs its shards by bytes and recent writes (for rebalance plans).
    weighs_shards = True

    def corrupt_body(self, url: str, cell: logstore.Cell) -> None:
        raise AssertionError("backend test classes implement corrupt_body")

    def shard_storage(self, url: str) -> set[int]:
        """The shards that have storage allocated (tables or rows) on the backend."""
        raise AssertionError("backend test classes implement shard_storage")

    @pytest.fixture
    def store(self, url: str) -> Any:
        with logstore.open(url, shards=self.shards) as store:
            yield store

    # -- cells ------------------------------------------------------------
    def test_put_and_get_round_trip_every_json_type(self, store: logstore.Store) -> None:
        key = uuid.uuid4()
        body = {
            "s": "Århus ✓ 🚕", "empty": "", "i": -(2**63), "u": 2**64 - 1, "f": 0.1, "neg": self.far_float,
            "t": True, "fl": False, "n": None, "list": [1, "x", [2.5, {"deep": None}]], "obj": {"a": {"b": {}}},
        }
        cell = store.put_cell(key, "BASE", 7, body)
        assert (cell.row_key, cell.column, cell.ref_key, cell.body) == (key, "BASE", 7, body)
        assert cell.shard == store.shard_of(key) == store.shard_of(str(key))
        assert cell.added_id > 0
        assert cell.created_at.tzinfo is not None and cell.created_at.utcoffset() == dt.timedelta(0)
        assert abs(cell.created_at - dt.datetime.now(dt.UTC)) < dt.timedelta(seconds=30)
        got = store.get_cell(str(key), "BASE", 7)
        assert got == cell
        assert type(got.body["i"]) is int and type(got.body["f"]) is float and type(got.body["t"]) is bool
        assert store.get_cell(key, "BASE", 8) is None
        assert store.get_cell(key, "base", 7) is None  # column names are case-sensitive

    def test_identical_put_is_a_no_op_returning_the_stored_cell(self, store: logstore.Store) -> None:
        key = uuid.uuid4()
        first = store.put_cell(key, "BASE", 1, {"a": 1, "b": [1, 2]})
        again = store.put_cell(key, "BASE", 1, {"b": [1, 2], "a": 1})
        assert again == first
        assert _read_all(store, first.shard) == [first]

    @pytest.mark.parametrize("other", [{"a": 2}, {"a": 1.0}, {"a": True}, {"a": 1, "b": None}, {}])
    def test_different_body_conflicts_and_changes_nothing(self, store: logstore.Store, other: dict[str, Any]) -> None:
        key = uuid.uuid4()
        first = store.put_cell(key, "BASE", 1, {"a": 1})
        with pytest.raises(CellConflictError) as info:
            store.put_cell(key, "BASE", 1, other)
        assert info.value.column == "BASE" and info.value.ref_key == 1 and not info.value.retriable
        assert store.get_cell(key, "BASE", 1) == first
        assert _read_all(store, first.shard) == [first]

    def test_latest_is_highest_ref_key_not_last_written(self, store: logstore.Store) -> None:
        key = uuid.uuid4()
        store.put_cell(key, "STATUS", 5, {"v": 5})
        store.put_cell(key, "STATUS", 3, {"v": 3})
        store.put_cell(key, "STATUS", 2**63 - 1, {"v": "max"})
        store.put_cell(key, "BASE", 0, {"v": 0})
        assert store.get_cell_latest(key, "STATUS").body == {"v": "max"}
        assert store.get_cell_latest(key, "NOTES") is None
        row = store.get_row(key)
        assert {c: cell.ref_key for c, cell in row.items()} == {"BASE": 0, "STATUS": 2**63 - 1}
        assert store.get_row(uuid.uuid4()) == {}

    def test_reserved_columns_are_refused_by_the_public_api(self, store: logstore.Store) -> None:
        key = uuid.uuid4()
        with pytest.raises(InvalidCellError, match="reserved") as info:
            store.put_cell(key, "_offsets", 1, {})
        assert info.value.field == "column"
        with pytest.raises(InvalidCellError, match="reserved"):
            store.put_cells([(key, "_dlq", 1, {})])
        [cell] = store.put_system_cells([(key, "_offsets", 1, {"location": 10})])
        assert store.get_cell_latest(key, "_offsets") == cell

    @pytest.mark.parametrize(
        ("args", "field", "problem"),
        [
            (("not-a-uuid", "C", 1, {}), "row_key", "not a UUID"),
            ((12345, "C", 1, {}), "row_key", "expected a UUID"),
            ((None, "1abc", 1, {}), "column", "must match"),
            ((None, "a-b", 1, {}), "column", "must match"),
            ((None, "x" * 65, 1, {}), "column", "must match"),
            ((None, "", 1, {}), "column", "must match"),
            ((None, "C", -1, {}), "ref_key", "outside"),
            ((None, "C", 2**63, {}), "ref_key", "outside"),
            ((None, "C", True, {}), "ref_key", "expected an integer"),
            ((None, "C", 1.0, {}), "ref_key", "expected an integer"),
            ((None, "C", 1, [1]), "body", "expected a dict"),
            ((None, "C", 1, {1: "x"}), "body", "not a string"),
            ((None, "C", 1, {"a": {"b": [0, float("nan")]}}), "body.a.b[1]", "NaN"),
            ((None, "C", 1, {"x": float("inf")}), "body.x", "NaN and Infinity"),
            ((None, "C", 1, {"x": (1, 2)}), "body.x", "tuple is not a JSON type"),
            ((None, "C", 1, {"x": {1, 2}}), "body.x", "set is not a JSON type"),
            ((None, "C", 1, {"x": b"raw"}), "body.x", "bytes is not a JSON type"),
            ((None, "C", 1, {"x": 2**64}), "body.x", "64 bits"),
            ((None, "C", 1, {"x": "\ud800"}), "body", "UTF-8"),
        ],
    )
    def test_bad_input_names_the_field_and_writes_nothing(
        self, store: logstore.Store, args: tuple[Any, ...], field: str, problem: str
    ) -> None:
        row_key = args[0] if args[0] is not None else uuid.uuid4()
        with pytest.raises(InvalidCellError) as info:
            store.put_cell(row_key, *args[1:])
        assert info.value.field == field
        assert problem in str(info.value)
        assert isinstance(info.value, ValueError) and not info.value.retriable
        assert sum(s.cells for s in store.shard_stats()) == 0

    def test_too_deep_and_too_big_bodies_are_refused(self, url: str) -> None:
        with logstore.open(url, shards=self.shards, max_body_bytes=1000) as store:
            deep: dict[str, Any] = {}
            node = deep
            for _ in range(70):
                node["d"] = {}
                node = node["d"]
            with pytest.raises(InvalidCellError, match="deeper than 64"):
                store.put_cell(uuid.uuid4(), "C", 1, deep)
            with pytest.raises(InvalidCellError, match="over the 1000-byte limit") as info:
                store.put_cell(uuid.uuid4(), "C", 1, {"x": "y" * 1000})
            assert info.value.field == "body"
            store.put_cell(uuid.uuid4(), "C", 1, {"x": "y" * 900})

    # -- batches ----------------------------------------------------------
    def test_read_blocks_hold_each_range_of_stored_cells(self, store: logstore.Store) -> None:
        keys = keys_in_shard(store, 1, 6)
        written = store.put_cells([(k, col, ref, {"i": i, "s": "Århus ✓" * i})
                                   for i, (k, col, ref) in enumerate(
                                       [(keys[0], "BASE", 3), (keys[1], "a_b9", 2**63 - 1), (keys[2], "BASE", 0),
                                        (keys[3], "X", 7), (keys[4], "BASE", 1), (keys[5], "y_", 5)])])
        other = store.put_cell(key_per_shard(store, [2])[2], "BASE", 1, {"other": True})
        ids = [c.added_id for c in written]
        blocks = store.read_blocks({1: (ids[1], ids[4]), 2: (0, other.added_id), 3: (0, 10)})
        assert sorted(blocks) == [1, 2, 3]
        assert (blocks[3].cells, blocks[3].data) == (0, b"")
        for shard, want in ((1, written[2:5]), (2, [other])):
            block = blocks[shard]
            assert block.shard == shard and block.cells == len(want)
            cells = decode(block.data)
            assert [(c.added_id, c.created, c.ref_key, c.column, c.row_key) for c in cells] == [
                (w.added_id, created_text(w.created_at), w.ref_key, w.column, w.row_key.bytes) for w in want]
            assert [decode_body(c.blob) for c in cells] == [w.body for w in want]
        with pytest.raises(InvalidArgumentError):
            store.read_blocks({store.shard_count: (0, 1)})

    @pytest.mark.parametrize("start", [0, 10], ids=["from-the-start", "after-a-place"])
    def test_read_blocks_of_a_long_range(self, store: logstore.Store, start: int) -> None:
        written = store.put_cells([(k, "BASE", 1, {"i": i}) for i, k in enumerate(keys_in_shard(store, 1, 150))])
        store.put_cells([(k, "BASE", 1, {"neighbour": True}) for k in keys_in_shard(store, 2, 150)])
        ids = [c.added_id for c in written]
        after = 0 if start == 0 else ids[start - 1]
        block = store.read_blocks({1: (after, ids[139])})[1]
        assert block.cells == 140 - start
        assert [(c.added_id, decode_body(c.blob)) for c in decode(block.data)] == [
            (w.added_id, w.body) for w in written[start:140]]

    def test_put_cells_returns_cells_in_input_order(self, store: logstore.Store) -> None:
        items = [(uuid.uuid4(), "BASE", i, {"i": i}) for i in range(60)]
        cells = store.put_cells(items)
        assert [(c.row_key, c.ref_key, c.body) for c in cells] == [(k, r, b) for k, _, r, b in items]
        assert all(store.get_cell(c.row_key, "BASE", c.ref_key) == c for c in cells)
        assert store.put_cells([]) == []

    def test_put_cells_validates_everything_before_writing(self, store: logstore.Store) -> None:
        items: list[Any] = [(uuid.uuid4(), "BASE", i, {"i": i}) for i in range(20)]
        items.append((uuid.uuid4(), "BASE", 1, {"bad": float("nan")}))
        with pytest.raises(InvalidCellError) as info:
            store.put_cells(items)
        assert info.value.field == "body.bad" and "cell #20" in str(info.value)
        with pytest.raises(InvalidArgumentError, match="cell #1"):
            store.put_cells([items[0], ("only", "three", 1)])
        assert sum(s.cells for s in store.shard_stats()) == 0

    def test_put_cells_conflict_writes_nothing_of_the_batch(self, store: logstore.Store) -> None:
        key = uuid.uuid4()
        existing = store.put_cell(key, "BASE", 1, {"v": 1})
        items = [(uuid.uuid4(), "BASE", 1, {"i": i}) for i in range(30)] + [(key, "BASE", 1, {"v": 2})]
        with pytest.raises(CellConflictError):
            store.put_cells(items)
        assert sum(s.cells for s in store.shard_stats()) == 1
        assert store.get_cell(items[0][0], "BASE", 1) is None
        assert store.get_cell(key, "BASE", 1) == existing

    def test_put_cells_is_safe_to_retry_whole(self, store: logstore.Store) -> None:
        items = [(uuid.uuid4(), "BASE", 1, {"i": i}) for i in range(40)]
        first = store.put_cells(items[:25])
        again = store.put_cells(items)
        assert again[:25] == first
        assert store.put_cells(items) == again
        assert sum(s.cells for s in store.shard_stats()) == 40

    def test_duplicates_inside_one_batch(self, store: logstore.Store) -> None:
        key = uuid.uuid4()
        a, b = store.put_cells([(key, "BASE", 1, {"v": 1}), (key, "BASE", 1, {"v": 1})])
        assert a == b
        with pytest.raises(CellConflictError):
            store.put_cells([(uuid.uuid4(), "BASE", 1, {}), (key, "BASE", 2, {"v": 1}), (key, "BASE", 2, {"v": 2})])
        assert sum(s.cells for s in store.shard_stats()) == 1

    # -- the log ----------------------------------------------------------
    def test_shard_log_pages_in_added_id_order(self, store: logstore.Store) -> None:
        keys = keys_in_shard(store, 3, 5)
        written = [store.put_cell(random.choice(keys), random.choice(["BASE", "STATUS"]), i, {"i": i})
                   for i in range(40)]
        cells = _read_all(store, 3)
        assert cells == written
        ids = [c.added_id for c in cells]
        assert ids == sorted(ids) and len(set(ids)) == len(ids)
        assert [c.created_at for c in cells] == sorted(c.created_at for c in cells)
        page, nxt = store.get_cells_for_shard(3, 0, limit=10)
        assert page == written[:10] and nxt == written[9].added_id
        tail, end = store.get_cells_for_shard(3, written[-1].added_id)
        assert tail == [] and end == written[-1].added_id
        only, _ = store.get_cells_for_shard(3, 0, limit=1000, columns=["STATUS"])
        assert only == [c for c in written if c.column == "STATUS"]
        assert store.head(3) == written[-1].added_id
        assert store.get_cells_for_shard(4) == ([], 0) and store.head(4) == 0

    @pytest.mark.parametrize(
        ("call", "message"),
        [
            (lambda s: s.get_cells_for_shard(s.shard_count), "shard must be"),
            (lambda s: s.get_cells_for_shard(-1), "shard must be"),
            (lambda s: s.get_cells_for_shard(0, -5), "location"),
            (lambda s: s.get_cells_for_shard(0, 0, 0), "limit"),
            (lambda s: s.location_at(0, dt.datetime(2020, 1, 1)), "timezone-aware"),
            (lambda s: s.head(s.shard_count), "shard must be"),
        ],
    )
    def test_bad_log_arguments_are_typed_errors(self, store: logstore.Store, call: Any, message: str) -> None:
        with pytest.raises(InvalidArgumentError, match=message):
            call(store)

    def test_location_at_starts_tailing_at_a_time(self, store: logstore.Store) -> None:
        [key] = keys_in_shard(store, 1, 1)
        before = [store.put_cell(key, "BASE", i, {"i": i}) for i in range(3)]
        time.sleep(0.05)
        middle = dt.datetime.now(dt.UTC)
        time.sleep(0.05)
        after = [store.put_cell(key, "BASE", i, {"i": i}) for i in range(3, 6)]
        assert store.location_at(1, middle - dt.timedelta(days=1)) == before[0].added_id - 1
        location = store.location_at(1, middle.astimezone(dt.timezone(dt.timedelta(hours=5))))
        assert store.get_cells_for_shard(1, location)[0] == after
        assert store.location_at(1, middle + dt.timedelta(days=1)) == after[-1].added_id
        assert store.location_at(2, middle) == 0

    def test_location_at_never_skips_a_cell_committed_while_it_runs(self, store: logstore.Store) -> None:
        [key] = keys_in_shard(store, 5, 1)
        store.put_cell(key, "BASE", 1, {"old": True})
        when = dt.datetime.now(dt.UTC) + dt.timedelta(milliseconds=1)
        time.sleep(0.01)
        [recorder] = {id(r): r for r in store_recorders(store)}.values()
        original = recorder.first_at
        raced: list[logstore.Cell] = []

        def first_at_with_a_racing_commit(shard: int, at: dt.datetime) -> int | None:
            found = original(shard, at)  # nothing created since `when` yet...
            raced.append(store.put_cell(key, "BASE", 2, {"raced": True}))  # ...then a commit lands
            return found

        recorder.first_at = first_at_with_a_racing_commit
        try:
            location = store.location_at(5, when)
        finally:
            recorder.first_at = original
        assert raced and store.get_cells_for_shard(5, location)[0] == raced

    def test_log_arguments_out_of_range(self, store: logstore.Store) -> None:
        with pytest.raises(InvalidArgumentError, match="location"):
            store.get_cells_for_shard(0, 2**63)
        with pytest.raises(InvalidArgumentError, match="not one string"):
            store.get_cells_for_shard(0, columns="BASE")  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentError, match="out of range"):
            store.location_at(0, dt.datetime(1, 1, 1, tzinfo=dt.timezone(dt.timedelta(hours=5))))

    # -- the instance -----------------------------------------------------
    def test_shard_count_is_fixed_at_creation(self, url: str) -> None:
        logstore.open(url, shards=self.shards).close()
        with logstore.open(url) as store:
            assert store.shard_count == self.shards
        with pytest.raises(ConfigurationError, match=f"created with {self.shards} shards, opened with 16"):
            logstore.open(url, shards=16)
        with pytest.raises(InvalidArgumentError):
            logstore.open(url, shards=0)

    def test_default_is_4096_shards_and_creation_is_lazy(self, url: str) -> None:
        with logstore.open(url) as store:
            assert store.shard_count == 4096
            stats = store.shard_stats()
            assert len(stats) == 4096 and all(s.cells == 0 for s in stats)
            cell = store.put_cell(uuid.uuid4(), "BASE", 1, {})
        assert self.shard_storage(url) == {cell.shard}

    def test_cells_survive_reopening(self, url: str) -> None:
        with logstore.open(url, shards=self.shards) as store:
            cells = store.put_cells([(uuid.uuid4(), "BASE", 1, {"i": i}) for i in range(10)])
        with logstore.open(url) as store:
            assert [store.get_cell(c.row_key, "BASE", 1) for c in cells] == cells

    def test_shard_stats_count_cells_per_shard(self, store: logstore.Store) -> None:
        cells = store.put_cells([(uuid.uuid4(), "BASE", 1, {"i": i}) for i in range(50)])
        stats = store.shard_stats()
        assert [s.shard for s in stats] == list(range(self.shards))
        for s in stats:
            assert s.cells == sum(1 for c in cells if c.shard == s.shard)
            assert s.node == store.node_of(s.shard)
        assert store.cell_counts() == {s.shard: s.cells for s in stats}

    def test_changed_counts_since_a_mark_hold_every_shard_written_after_it(self, store: logstore.Store) -> None:
        first = store.changed_counts()
        assert first.complete and first.counts == dict.fromkeys(range(self.shards), 0)
        cells = store.put_cells([(uuid.uuid4(), "BASE", 1, {"i": i}) for i in range(20)])
        written = Counter(c.shard for c in cells)
        answer = store.changed_counts(first.mark)
        assert answer.complete is not self.partial_counts
        assert {s: answer.counts.get(s) for s in written} == written
        assert all(n == written[s] for s, n in answer.counts.items())  # others it holds (a margin's) are right too
        more = store.put_cells([(uuid.uuid4(), "BASE", 1, {"i": i}) for i in range(5)])
        written.update(c.shard for c in more)
        later = store.changed_counts(answer.mark)
        assert {s: later.counts.get(s) for s in {c.shard for c in more}} == {c.shard: written[c.shard] for c in more}
        assert store.changed_counts(object()).counts == {s: written[s] for s in range(self.shards)}  # not a mark

    def test_close_is_safe_twice_and_final(self, url: str) -> None:
        store = logstore.open(url, shards=self.shards)
        store.close()
        store.close()
        with pytest.raises(logstore.StorageError, match="closed"):
            store.get_cell_latest(uuid.uuid4(), "BASE")

    def test_corrupt_body_is_a_typed_error(self, store: logstore.Store, url: str) -> None:
        cell = store.put_cell(uuid.uuid4(), "BASE", 1, {"a": 1})
        self.corrupt_body(url, cell)
        with pytest.raises(logstore.CorruptCellError, match="format version") as caught:
            store.get_cell(cell.row_key, "BASE", 1)
        assert (caught.value.row_key, caught.value.column, caught.value.ref_key) == (cell.row_key, "BASE", 1)
        assert (caught.value.shard, caught.value.added_id) == (cell.shard, cell.added_id)

    def test_a_damaged_cell_in_a_log_page_names_itself_and_carries_the_good_cells_before_it(
        self, store: logstore.Store, url: str
    ) -> None:
        key = uuid.uuid4()
        cells = [store.put_cell(key, "BASE", ref, {"ref": ref}) for ref in range(1, 6)]
        self.corrupt_body(url, cells[2])
        with pytest.raises(logstore.CorruptCellError) as caught:
            store.get_cells_for_shard(cells[0].shard, 0, 100)
        error = caught.value
        assert error.added_id == cells[2].added_id and error.ref_key == 3
        assert str(cells[2].row_key) in str(error) and f"added_id {cells[2].added_id}" in str(error)
        assert [c.ref_key for c in error.cells_before] == [1, 2]
        after, _ = store.get_cells_for_shard(cells[0].shard, cells[2].added_id, 100)
        assert [c.ref_key for c in after] == [4, 5]

    def test_many_shard_pages_in_one_read_match_single_reads(self, store: logstore.Store) -> None:
        for i in range(120):
            store.put_cell(uuid.uuid4(), random.choice(["BASE", "STATUS"]), i, {"i": i})
        locations = {shard: random.choice([0, 0, store.head(shard) // 2, store.head(shard)])
                     for shard in range(self.shards)}
        for limit, columns in ((1000, None), (3, None), (1000, ["STATUS"]), (2, ["BASE"])):
            pages = store.get_cells_for_shards(locations, limit, columns=columns)
            assert set(pages) == set(locations)
            for shard, location in locations.items():
                assert pages[shard] == store.get_cells_for_shard(shard, location, limit, columns=columns)[0]
        assert store.get_cells_for_shards({}) == {}
        with pytest.raises(InvalidArgumentError, match="shard must be"):
            store.get_cells_for_shards({0: 0, self.shards: 0})
        with pytest.raises(InvalidArgumentError, match="limit"):
            store.get_cells_for_shards({0: 0, 1: 0}, 0)

    def test_a_many_shard_read_of_some_columns_reaches_past_the_other_columns_cells(
        self, store: logstore.Store
    ) -> None:
        """A page of some columns holds the next ``limit`` of their cells, however many cells of other columns
        come first (a read by ranges of ids sees only ``limit`` ids of a shard at a time)."""
        layouts = {0: "SSSSSBBB", 1: "BB", 2: "BBBBBB", 3: "BSBSBB", 4: "SSSS", 5: "SSSSB"}
        for shard, layout in layouts.items():
            key = keys_in_shard(store, shard, 1)[0]
            for ref, column in enumerate(layout, 1):
                store.put_cell(key, "BASE" if column == "B" else "STATUS", ref, {"ref": ref})
        pages = store.get_cells_for_shards(dict.fromkeys(layouts, 0), 4, columns=["BASE"])
        assert {shard: [c.ref_key for c in page] for shard, page in pages.items()} == {
            0: [6, 7, 8], 1: [1, 2], 2: [1, 2, 3, 4], 3: [1, 3, 5, 6], 4: [], 5: [5]}
        packed = store.get_packed_cells_for_shards(dict.fromkeys(layouts, 0), 4, columns=["BASE"])
        assert {shard: [c.to_cell() for c in page] for shard, page in packed.items()} == pages

    def test_packed_pages_hold_the_same_cells_with_the_stored_messagepack_of_each_body(
        self, store: logstore.Store
    ) -> None:
        bodies = [{"i": 1}, {"s": "ünïcode ✓", "f": 0.1, "big": 2**64 - 1, "neg": -(2**63)},
                  {"nested": {"list": [1, [2, {"x": None}], True]}, "empty": {}}, {}, {"long": "x" * 5000}]
        for i in range(60):
            store.put_cell(uuid.uuid4(), random.choice(["BASE", "STATUS"]), i, bodies[i % len(bodies)])
        locations = {shard: random.choice([0, 0, store.head(shard) // 2]) for shard in range(self.shards)}
        one = next(iter(locations))
        for where, limit, columns in ((locations, 1000, None), (locations, 3, None), (locations, 1000, ["STATUS"]),
                                      ({one: 0}, 1000, None), ({one: 0}, 2, ["BASE"])):
            packed = store.get_packed_cells_for_shards(where, limit, columns=columns)
            decoded = store.get_cells_for_shards(where, limit, columns=columns)
            assert set(packed) == set(decoded) == set(where)
            for shard, page in packed.items():
                assert isinstance(page, list) and all(isinstance(c, logstore.PackedCell) for c in page)
                assert [c.to_cell() for c in page] == decoded[shard]
                assert [c.packed for c in page] == [msgpack.packb(c.body, use_bin_type=True)
                                                    for c in decoded[shard]]  # type: ignore[union-attr]

    @pytest.mark.parametrize("packed", [False, True], ids=["decoded", "packed"])
    def test_pages_read_apart_from_their_decoding_are_those_of_a_read_at_that_moment(
        self, store: logstore.Store, packed: bool
    ) -> None:
        """Store.read_pages reads when called and decodes when asked (on the caller's thread): the cells are
        those get_cells_for_shards (packed: get_packed_cells_for_shards) read then, whatever came after."""
        for i in range(60):
            store.put_cell(uuid.uuid4(), random.choice(["BASE", "STATUS"]), i, {"i": i})
        locations = {shard: random.choice([0, 0, store.head(shard) // 2]) for shard in range(self.shards)}
        one = next(iter(locations))
        read = store.get_packed_cells_for_shards if packed else store.get_cells_for_shards
        for where, limit, columns in ((locations, 1000, None), (locations, 3, None), (locations, 1000, ["STATUS"]),
                                      ({one: 0}, 1000, None)):
            now = read(where, limit, columns=columns)
            undecoded = store.read_pages(where, limit, columns=columns, packed=packed)
            keys = key_per_shard(store, where)
            store.put_cells([(keys[shard], "STATUS", 100 + limit, {"later": True}) for shard in where])
            assert undecoded.decode() == now
            if limit == 1000:
                assert read(where, limit, columns=columns) != now  # the later cells are there to be read
        with pytest.raises(InvalidArgumentError, match="shard must be"):
            store.read_pages({0: 0, self.shards: 0})

    def test_many_shard_read_reaches_shards_never_written(self, url: str) -> None:
        # Shards without storage yet (no table on MySQL) read as empty, beside shards with cells.
        with logstore.open(url, shards=self.shards) as store:
            key = uuid.uuid4()
            cell = store.put_cell(key, "BASE", 1, {})
            pages = store.get_cells_for_shards({shard: 0 for shard in range(self.shards)})
            assert pages[cell.shard] == [cell]
            assert all(page == [] for shard, page in pages.items() if shard != cell.shard)

    @pytest.mark.parametrize(("packed", "apart"), [(False, False), (True, False), (False, True), (True, True)],
                             ids=["decoded", "packed", "decoded apart", "packed apart"])
    def test_a_damaged_cell_spoils_only_its_own_shard_page_of_a_many_shard_read(
        self, store: logstore.Store, url: str, packed: bool, apart: bool
    ) -> None:
        [bad_key] = keys_in_shard(store, 2, 1)
        [good_key] = keys_in_shard(store, 5, 1)
        bad = [store.put_cell(bad_key, "BASE", ref, {"ref": ref}) for ref in range(1, 4)]
        good = [store.put_cell(good_key, "BASE", ref, {"ref": ref}) for ref in range(1, 4)]
        self.corrupt_body(url, bad[1])
        if apart:
            pages: Any = store.read_pages({2: 0, 5: 0}, packed=packed).decode()
        else:
            pages = (store.get_packed_cells_for_shards if packed else store.get_cells_for_shards)({2: 0, 5: 0})

        def cells(page: Any) -> list[logstore.Cell]:
            return [c.to_cell() if packed else c for c in page]
        assert cells(pages[5]) == good
        error = pages[2]
        assert isinstance(error, logstore.CorruptCellError) and error.added_id == bad[1].added_id
        assert "format version" in str(error)
        assert cells(error.cells_before) == bad[:1]

    def test_heads_of_many_shards_are_the_single_heads(self, store: logstore.Store) -> None:
        cells = store.put_cells([(uuid.uuid4(), "BASE", 1, {"i": i}) for i in range(40)])
        heads = store.heads()
        assert sorted(heads) == list(range(self.shards))
        assert all(heads[s] == store.head(s) for s in {c.shard for c in cells} | {0, self.shards - 1})
        assert all(heads[c.shard] >= c.added_id for c in cells)
        some = sorted({c.shard for c in cells})[:3]
        assert store.heads(some) == {s: heads[s] for s in some}
        with pytest.raises(InvalidArgumentError, match="shard must be"):
            store.heads([self.shards])

    def test_count_after_counts_the_cells_a_reader_has_not_seen(self, store: logstore.Store) -> None:
        key = uuid.uuid4()
        cells = [store.put_cell(key, "BASE", ref, {}) for ref in range(1, 8)]
        shard = cells[0].shard
        assert store.count_after(shard, 0) == 7
        assert store.count_after(shard, cells[3].added_id) == 3
        assert store.count_after(shard, store.head(shard)) == 0
        assert store.count_after((shard + 1) % self.shards, 0) == 0
        store.put_cells([(key, "OTHER", 1, {}), (key, "THIRD", 1, {})])
        assert store.count_after(shard, 0) == 9
        assert store.count_after(shard, cells[3].added_id, columns=["BASE"]) == 3
        assert store.count_after(shard, 0, columns=["BASE", "THIRD"]) == 8
        with pytest.raises(logstore.InvalidArgumentError, match="location"):
            store.count_after(shard, -1)
        with pytest.raises(logstore.InvalidArgumentError, match="list of column names"):
            store.count_after(shard, 0, columns="BASE")

    def test_counts_after_of_many_shards_equal_each_count_after(self, store: logstore.Store) -> None:
        keys = list(key_per_shard(store, range(self.shards)).values())
        store.put_cells([(k, column, ref, {}) for i, k in enumerate(keys) for column in ("BASE", "OTHER")
                         for ref in range(1, 2 + i % 4)])
        locations = {s: (store.head(s) // 3 if s % 2 else 0) for s in range(self.shards)}
        for columns in (None, ["BASE"]):
            expected = {s: store.count_after(s, loc, columns=columns) for s, loc in locations.items()}
            assert store.counts_after(locations, columns=columns) == expected
            assert any(expected.values())
        assert store.counts_after({}) == {}
        with pytest.raises(logstore.InvalidArgumentError, match="location"):
            store.counts_after({0: -1})

    # -- consumer offsets -------------------------------------------------
    def test_consumer_offsets_are_claimed_committed_and_read_back(self, store: logstore.Store) -> None:
        claimed = store.claim_offsets("billing", "worker-a")
        assert sorted(claimed) == list(range(self.shards))
        assert all(r.location is None and r.owner == "worker-a" and r.doc == {} for r in claimed.values())
        assert store.commit_offsets("billing", "worker-a", {0: (17, {"deadlettered": 2}), 3: (5, {})}) == set()
        assert store.commit_offsets("billing", "worker-a", {0: (17, {"deadlettered": 2})}) == set()  # unchanged
        found = store.read_offsets("billing")
        assert (found[0].location, found[0].doc) == (17, {"deadlettered": 2})
        assert found[3].location == 5 and found[1].location is None
        assert store.read_offsets("other") == {}

    def test_a_claim_reads_back_each_shards_own_location_and_doc(self, store: logstore.Store) -> None:
        store.claim_offsets("billing", "worker-a")
        docs = {0: (5, {"e": "A"}), 1: (6, {"e": "a"}), 2: (7, {"e": "a "}), 3: (8, {"e": "a"})}  # case, spaces
        assert store.commit_offsets("billing", "worker-a", docs) == set()
        claimed = store.claim_offsets("billing", "worker-b")
        assert list(claimed) == list(range(self.shards))
        assert {s: (r.location, r.doc) for s, r in claimed.items() if s in docs} == docs
        assert all(r.owner == "worker-b" for r in claimed.values())
        assert all((r.location, r.doc) == (None, {}) for s, r in claimed.items() if s not in docs)

    def test_a_commit_of_every_shard_keeps_each_doc(self, store: logstore.Store) -> None:
        store.claim_offsets("billing", "worker-a")
        docs = {s: (s + 1, {"note": f"100% ✓ {s}", "quote": "it's"}) for s in range(self.shards)}
        assert store.commit_offsets("billing", "worker-a", docs) == set()
        found = store.read_offsets("billing")
        assert {s: (r.location, r.doc) for s, r in found.items()} == docs

    def test_offset_docs_read_back_as_json_writes_them(self, store: logstore.Store) -> None:
        store.claim_offsets("billing", "worker-a", [0, 1, 2])
        docs = {0: {"at": dt.datetime(2026, 1, 2, 3, 4, 5), "id": uuid.UUID(int=7),
                    "nested": {"ok": [True, None, 1.5]}},
                1: {1: "an int key, which orjson refuses", "n": 2**63 - 1},
                2: {"note": "100% \u2713", "at": dt.datetime(2026, 1, 2)}}
        assert store.commit_offsets("billing", "worker-a", {s: (1, doc) for s, doc in docs.items()}) == set()
        found = store.read_offsets("billing")
        assert {s: found[s].doc for s in docs} == {s: json.loads(json.dumps(doc, default=str))
                                                    for s, doc in docs.items()}

    def test_a_commit_of_an_unclaimed_shard_is_refused_and_writes_nothing(self, store: logstore.Store) -> None:
        store.claim_offsets("billing", "worker-a", [0])
        assert store.commit_offsets("billing", "worker-a", {0: (3, {}), 1: (4, {})}) == {1}
        assert {s: r.location for s, r in store.read_offsets("billing").items()} == {0: 3}

    def test_a_new_owner_fences_the_old_ones_commits(self, store: logstore.Store) -> None:
        store.claim_offsets("billing", "worker-a")
        store.commit_offsets("billing", "worker-a", {1: (10, {})})
        again = store.claim_offsets("billing", "worker-b", [1, 2])
        assert again[1].location == 10 and again[1].owner == "worker-b" and sorted(again) == [1, 2]
        assert store.commit_offsets("billing", "worker-a", {1: (99, {}), 3: (4, {})}) == {1}
        assert store.read_offsets("billing")[1].location == 10
        assert store.read_offsets("billing")[3].location == 4  # worker-a still holds shard 3

    def test_owners_committing_at_once_lose_none_of_each_others_commits(self, store: logstore.Store) -> None:
        """A node keeps a consumer's offsets in one row, which every commit rewrites: two owners committing
        their own shards at the same time must each find the other's last commit there."""
        evens, odds = list(range(0, self.shards, 2)), list(range(1, self.shards, 2))
        store.claim_offsets("billing", "worker-a", evens)
        store.claim_offsets("billing", "worker-b", odds)
        errors: list[BaseException] = []

        def commit(owner: str, shards: list[int]) -> None:
            try:
                for location in range(1, 41):
                    assert store.commit_offsets("billing", owner, {s: (location, {"n": location}) for s in shards}) \
                        == set()
            except BaseException as exc:
                errors.append(exc)
        threads = [threading.Thread(target=commit, args=args) for args in (("worker-a", evens), ("worker-b", odds))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == []
        found = store.read_offsets("billing")
        assert {s: (r.location, r.owner, r.doc) for s, r in found.items()} == {
            s: (40, "worker-a" if s % 2 == 0 else "worker-b", {"n": 40}) for s in range(self.shards)}

    # -- weights of a rebalance plan ---------------------------------------
    def test_shards_are_weighed_by_cells_bytes_and_recent_writes(self, store: logstore.Store) -> None:
        keys = key_per_shard(store, range(3))
        noise = random.Random(7)
        big = "".join(noise.choice("abcdefghij") for _ in range(3000))  # random: zlib cannot shrink it away
        store.put_cells([(keys[0], "BASE", ref, {"t": big}) for ref in range(1, 4)])
        store.put_cells([(keys[1], "BASE", ref, {"t": ""}) for ref in range(1, 4)])
        if not self.weighs_shards:
            with pytest.raises(ConfigurationError, match="cannot weigh its shards by bytes"):
                store.shard_weights("bytes")
            return
        assert store.shard_weights("cells") == {0: 3, 1: 3, **{s: 0 for s in range(2, self.shards)}}
        size = store.shard_weights("bytes")
        assert size[0] > 3 * 3000 // 2 and 3 * 44 < size[1] < 3 * 100 and size[2] == 0
        time.sleep(1.5)  # the cells above fall out of a 1 s window
        store.put_cells([(keys[2], "BASE", 1, {"t": "late"}), (keys[1], "BASE", 9, {"t": "late"})])
        recent = store.shard_weights("writes", window=1.0)
        assert (recent[0], recent[1], recent[2]) == (0, 1, 1)
        assert store.shard_weights("writes", window=3600)[1] == 4
        with pytest.raises(InvalidArgumentError, match="cells, bytes or writes"):
            store.shard_weights("rows")
        with pytest.raises(InvalidArgumentError, match="positive"):
            store.shard_weights("writes", window=0)

    def test_offset_arguments_are_checked(self, store: logstore.Store) -> None:
        with pytest.raises(logstore.InvalidArgumentError, match="consumer"):
            store.claim_offsets("", "w")
        with pytest.raises(logstore.InvalidArgumentError, match="shard"):
            store.claim_offsets("c", "w", [self.shards])
        with pytest.raises(logstore.InvalidArgumentError, match="location"):
            store.commit_offsets("c", "w", {0: (-1, {})})
        for shard in (self.shards, -1, "0"):
            with pytest.raises(logstore.InvalidArgumentError, match="shard"):
                store.commit_offsets("c", "w", {shard: (1, {})})  # type: ignore[dict-item]

    # -- concurrency and the no-skip guarantee ----------------------------
    def test_threads_share_one_store(self, store: logstore.Store) -> None:
        keys = keys_in_shard(store, 0, 4)
        errors: list[BaseException] = []

        def writer(n: int) -> None:
            try:
                for i in range(25):
                    store.put_cell(keys[i % 4], "BASE", n * 1000 + i, {"n": n, "i": i})
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=writer, args=(n,)) for n in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        cells = _read_all(store, 0)
        assert len(cells) == 200
        assert [c.added_id for c in cells] == sorted({c.added_id for c in cells})

    def test_tailing_reader_never_skips_when_commits_are_delayed_out_of_order(self, url: str) -> None:
        """Writers sleep a random time between INSERT and COMMIT while a reader tails.

        Every cell the writers saw committed must reach the reader, and the reader
        must never be handed an added_id at or below a location it already passed.
        """
        with logstore.open(url, shards=self.shards) as store:
            # Few shards, whatever the count, so that writers contend and commit out of id order.
            hot = sorted({0, 1, self.shards - 1})
            assert_no_skip(store, store_recorders(store), keys=[k for s in hot for k in keys_in_shard(store, s, 2)])


def store_recorders(store: logstore.Store) -> Sequence[Any]:
    return list(store._recorders.values())


def assert_no_skip(store: logstore.Store, recorders: Sequence[Any], writers: int = 12, per_writer: int = 15,
                   keys: Sequence[uuid.UUID] = ()) -> None:
    """``keys``: the rows to write (cells differ by ref_key); new random rows when empty. The reader tails
    the shards written, alternating single-shard pages and many-shard reads."""
    rng = random.Random(7)

    def delay(shards: Sequence[int]) -> None:
        time.sleep(rng.random() * 0.03)

    for recorder in recorders:
        recorder.before_commit = delay
    committed: list[logstore.Cell] = []
    lock = threading.Lock()
    done = threading.Event()
    errors: list[BaseException] = []

    def writer(n: int) -> None:
        try:
            for i in range(per_writer):
                batch = [(keys[(n + i + j) % len(keys)] if keys else uuid.uuid4(), "BASE", n * 10_000 + i * 10 + j,
                          {"w": n, "i": i, "j": j}) for j in range(1 + i % 3)]
                cells = store.put_cells(batch)
                with lock:
                    committed.extend(cells)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    shards = sorted({store.shard_of(k) for k in keys}) if keys else range(store.shard_count)
    seen: dict[int, list[logstore.Cell]] = {s: [] for s in shards}

    def reader() -> None:
        locations = dict.fromkeys(seen, 0)
        try:
            for turn in itertools.count():
                finished = done.is_set()
                progressed = False
                if turn % 2:
                    pages = {shard: store.get_cells_for_shard(shard, locations[shard], limit=5) for shard in seen}
                else:
                    many = store.get_cells_for_shards(locations, limit=5)
                    pages = {}
                    for shard, page in many.items():
                        assert isinstance(page, list)
                        pages[shard] = (page, page[-1].added_id if page else locations[shard])
                for shard, (page, nxt) in pages.items():
                    for cell in page:
                        assert cell.added_id > locations[shard]
                    seen[shard].extend(page)
                    progressed |= bool(page)
                    locations[shard] = nxt
                if finished and not progressed:
                    return
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    tail = threading.Thread(target=reader)
    tail.start()
    threads = [threading.Thread(target=writer, args=(n,)) for n in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    tail.join()
    for recorder in recorders:
        recorder.before_commit = None
    assert errors == []
    delivered = {(c.row_key, c.column, c.ref_key): c for cells in seen.values() for c in cells}
    assert len(delivered) == sum(len(v) for v in seen.values()), "a cell was delivered twice"
    missing = [c for c in committed if (c.row_key, c.column, c.ref_key) not in delivered]
    assert missing == [], f"{len(missing)} committed cells were skipped by the tailing reader"
    assert len(committed) == writers * sum(1 + i % 3 for i in range(per_writer))
