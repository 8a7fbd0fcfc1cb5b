"""The read API of issue 54 (a cell's versions, reads as of a time, batched reads), written once and run against
every backend: SQLite and MariaDB (tests/logstore/test_read_api.py) and a worker node (tests/node/test_read_api.py).

Subclasses provide the ``url`` fixture (a fresh, empty instance location) and ``budget_url`` (a location whose
store reads with ``max_read_bytes`` at ``budget`` bytes: over HTTP, the node's store).
"""

from __future__ import annotations

import datetime as dt
import random
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

import logstore
from logstore import InvalidArgumentError, InvalidCellError
from logstore.persistence import TruncatedPage


def all_versions(store: logstore.Store, key: uuid.UUID, column: str, limit: int) -> list[int]:
    """Every ref_key of the cell, paged ``limit`` at a time as a reader does, newest first."""
    out: list[int] = []
    before: int | None = None
    for _ in range(10_000):  # a pager that does not move on fails here, not by a timeout
        page = store.get_cell_versions(key, column, before=before, limit=limit)
        if not page:
            return out
        out += [c.ref_key for c in page]
        before = page[-1].ref_key
    raise AssertionError(f"paging did not end: {out[:20]}...")


class ReadApiContract:
    shards = 16

    @pytest.fixture
    def store(self, url: str) -> Iterator[logstore.Store]:
        with logstore.open(url, shards=self.shards) as store:
            yield store

    # -- versions ------------------------------------------------------------------------------------
    def test_versions_are_newest_first_and_paging_on_before_gives_each_once(self, store: logstore.Store) -> None:
        key, other = uuid.uuid4(), uuid.uuid4()
        refs = [*random.Random(54).sample(range(1, 10**6), 250), 0, 2**63 - 1]
        store.put_cells([(key, "A", r, {"r": r}) for r in refs])
        store.put_cells([(key, "B", 7, {}), (other, "A", 8, {})])  # not versions of (key, A)
        store.put_system_cells([(key, "_A", 9, {})])
        newest_first = sorted(refs, reverse=True)
        assert all_versions(store, key, "A", 100) == newest_first
        assert all_versions(store, key, "A", 7) == newest_first
        first = store.get_cell_versions(str(key), "A")
        assert len(first) == 100 and not isinstance(first, TruncatedPage)
        assert first[0] == store.get_cell_latest(key, "A") and first[0].body == {"r": 2**63 - 1}
        assert [c.ref_key for c in store.get_cell_versions(key, "A", before=newest_first[10], limit=3)] == \
            newest_first[11:14]
        assert [c.ref_key for c in store.get_cell_versions(key, "A", before=1)] == [0]
        assert store.get_cell_versions(key, "A", before=0) == []
        assert [c.ref_key for c in store.get_cell_versions(key, "_A")] == [9]  # cellstream's own columns too
        assert store.get_cell_versions(uuid.uuid4(), "A") == []
        assert store.get_cell_versions(key, "a") == []  # names are case-sensitive

    @pytest.mark.parametrize(("arguments", "named"), [
        ({"before": -1}, "before"), ({"before": 2**63}, "before"), ({"before": "5"}, "before"),
        ({"before": 5.0}, "before"), ({"before": True}, "before"), ({"limit": 0}, "limit"),
        ({"limit": 100_001}, "limit"), ({"limit": None}, "limit"), ({"limit": True}, "limit"),
    ])
    def test_versions_refuse_bad_arguments_naming_them(self, store: logstore.Store, arguments: dict[str, Any],
                                                       named: str) -> None:
        with pytest.raises(InvalidArgumentError, match=f"^{named} must be") as info:
            store.get_cell_versions(uuid.uuid4(), "A", **arguments)
        assert not isinstance(info.value, InvalidCellError) and not info.value.retriable

    def test_versions_refuse_bad_coordinates_as_cells(self, store: logstore.Store) -> None:
        with pytest.raises(InvalidCellError) as bad_key:
            store.get_cell_versions("not a uuid", "A")
        with pytest.raises(InvalidCellError) as bad_column:
            store.get_cell_versions(uuid.uuid4(), "no such column!")
        assert (bad_key.value.field, bad_column.value.field) == ("row_key", "column")

    def test_a_page_of_versions_holds_to_the_read_budget(self, budget_url: str) -> None:
        """Bodies of 40 KB against a 100 KB budget: pages of 3 (the third spends it), each a TruncatedPage while
        versions follow, and paging on them reads every version once."""
        with logstore.open(budget_url, shards=self.shards) as store:
            key = uuid.uuid4()
            store.put_cells([(key, "A", r, {"s": chr(97 + r) * 40_000}) for r in range(8)])
            page = store.get_cell_versions(key, "A", limit=50)
            assert isinstance(page, TruncatedPage) and [c.ref_key for c in page] == [7, 6, 5]
            assert all_versions(store, key, "A", 50) == list(range(7, -1, -1))
            last = store.get_cell_versions(key, "A", before=2, limit=50)
            assert [c.ref_key for c in last] == [1, 0] and not isinstance(last, TruncatedPage)

    # -- as of a time ----------------------------------------------------------------------------------
    def test_reads_as_of_a_time_see_the_versions_created_by_then(self, store: logstore.Store) -> None:
        key = uuid.uuid4()
        first = store.put_cells([(key, "A", 5, {"v": 5}), (key, "A", 1, {"v": 1}), (key, "B", 1, {"b": 1})])
        second = store.put_cell(key, "A", 2, {"v": 2})  # a lower ref_key, later: the latest stays 5
        third = store.put_cells([(key, "A", 9, {"v": 9}), (key, "C", 1, {"c": 1}), (key, "B", 0, {"b": 0})])
        before_all = first[0].created_at - dt.timedelta(microseconds=1)
        at_first, at_third = first[0].created_at, third[0].created_at
        assert second.created_at < at_third
        assert store.get_cell_latest(key, "A", as_of=before_all) is None
        assert store.get_cell_latest(key, "A", as_of=at_first) == first[0]  # at or before: the cell's own time too
        assert store.get_cell_latest(key, "A", as_of=second.created_at) == first[0]
        assert store.get_cell_latest(key, "A", as_of=at_third - dt.timedelta(microseconds=1)) == first[0]
        assert store.get_cell_latest(key, "A", as_of=at_third) == third[0] == store.get_cell_latest(key, "A")
        in_paris = at_first.astimezone(dt.timezone(dt.timedelta(hours=1)))  # any offset: the same instant
        assert store.get_cell_latest(key, "A", as_of=in_paris) == first[0]
        assert store.get_row(key, as_of=before_all) == {}
        assert store.get_row(key, as_of=at_first) == {"A": first[0], "B": first[2]}
        assert store.get_row(key, as_of=at_third) == store.get_row(key) == {"A": third[0], "B": first[2],
                                                                            "C": third[1]}
        assert store.get_cells_latest([(key, "A"), (key, "C"), (key, "B"), (uuid.uuid4(), "A")], as_of=at_first) \
            == [first[0], None, first[2], None]
        far = dt.datetime(9999, 12, 31, 23, 59, tzinfo=dt.timezone(dt.timedelta(hours=-5)))  # past 9999 in UTC
        assert store.get_cell_latest(key, "A", as_of=far) == third[0]
        assert store.get_cell_latest(key, "A", as_of=dt.datetime(1, 1, 1, tzinfo=dt.UTC)) is None

    @pytest.mark.parametrize("as_of", [dt.datetime(2026, 1, 1), "2026-01-01T00:00:00Z", 1_700_000_000,
                                       dt.date(2026, 1, 1)])
    def test_reads_as_of_refuse_a_time_without_a_zone(self, store: logstore.Store, as_of: Any) -> None:
        key = uuid.uuid4()
        for read in (lambda: store.get_cell_latest(key, "A", as_of=as_of), lambda: store.get_row(key, as_of=as_of),
                     lambda: store.get_cells_latest([(key, "A")], as_of=as_of)):
            with pytest.raises(InvalidArgumentError, match=r"^as_of must be a timezone-aware datetime"):
                read()

    # -- batched reads ---------------------------------------------------------------------------------
    def test_a_batched_read_is_the_reads_one_by_one_in_order(self, store: logstore.Store) -> None:
        """More coordinates than a statement takes (500), repeats, misses, cellstream's own columns."""
        rows = [uuid.uuid4() for _ in range(300)]
        store.put_cells([(r, "A", v, {"i": i, "v": v}) for i, r in enumerate(rows) for v in (1, 3)])
        store.put_system_cells([(rows[0], "_X", 4, {"x": 1})])
        wanted: list[tuple[Any, str, int]] = [(r, "A", v) for r in rows for v in (3, 2, 1)]
        wanted += [(str(rows[5]), "A", 3), (rows[0], "_X", 4), (uuid.uuid4(), "A", 1), (rows[1], "B", 1)]
        got = store.get_cells(wanted)
        assert got == [store.get_cell(r, c, v) for r, c, v in wanted]
        assert [(c.ref_key, c.body) if c else None for c in got[:3]] == [(3, {"i": 0, "v": 3}), None,
                                                                         (1, {"i": 0, "v": 1})]
        assert sum(c is None for c in got) == 300 + 2 and got[-4] == got[15]
        assert got[-3] is not None and got[-3].body == {"x": 1}
        assert store.get_cells([]) == [] and store.get_cells_latest([]) == []

    def test_one_batch_mixes_versions_and_the_latest_of_the_same_cell(self, store: logstore.Store) -> None:
        key = uuid.uuid4()
        cells = store.put_cells([(key, "A", v, {"v": v}) for v in (1, 9, 4)])
        asked: list[tuple[Any, str, int | None]] = [(key, "A", 1), (key, "A", None), (key, "A", 4), (key, "A", None),
                                                    (key, "A", 9)]
        assert store.read_cells(asked) == [cells[0], cells[1], cells[2], cells[1], cells[1]]
        assert store.read_cells(asked, as_of=cells[0].created_at - dt.timedelta(microseconds=1)) == [None] * 5
        later = store.put_cell(key, "A", 7, {"v": 7})  # as of a time, a version written later was not there yet
        assert store.read_cells([*asked, (key, "A", 7)], as_of=cells[0].created_at) == \
            [cells[0], cells[1], cells[2], cells[1], cells[1], None]
        assert store.read_cells([(key, "A", 7)], as_of=later.created_at) == [later]

    def test_a_batched_read_names_the_bad_coordinate(self, store: logstore.Store) -> None:
        key = uuid.uuid4()
        with pytest.raises(InvalidCellError) as column:
            store.get_cells([(key, "A", 1), (key, "A", 2), (key, "no such column!", 3)])
        with pytest.raises(InvalidCellError) as ref_key:
            store.get_cells([(key, "A", -1)])
        with pytest.raises(InvalidCellError) as latest:
            store.get_cells_latest([(key, "A"), ("nope", "A")])
        assert [(e.value.field, e.value.index) for e in (column, ref_key, latest)] == [
            ("column", 2), ("ref_key", 0), ("row_key", 1)]
        with pytest.raises(InvalidArgumentError, match=r"coordinates\[1\] must be a \(row_key, column, ref_key\)"):
            store.get_cells([(key, "A", 1), (key, "A")])  # type: ignore[list-item]
        with pytest.raises(InvalidArgumentError, match=r"^max_bytes must be"):
            store.read_cells([(key, "A", 1)], max_bytes=0)

    def test_a_batched_read_holds_to_max_bytes_and_reads_on(self, store: logstore.Store) -> None:
        """Bodies of 10 KB against 25 KB: the first three cells (the third spends it; a miss spends nothing), a
        TruncatedPage; reading the rest on gives every cell, as an unbounded read does at once."""
        keys = [uuid.uuid4() for _ in range(8)]
        store.put_cells([(k, "A", 1, {"s": chr(97 + i) * 10_000}) for i, k in enumerate(keys)])
        wanted: list[tuple[Any, str, int | None]] = [(k, "A", 1) for k in keys]
        wanted.insert(1, (uuid.uuid4(), "A", None))
        page = store.read_cells(wanted, max_bytes=25_000)
        assert isinstance(page, TruncatedPage) and len(page) == 4 and page[1] is None
        got: list[Any] = []
        while len(got) < len(wanted):
            got += store.read_cells(wanted[len(got):], max_bytes=25_000)
        assert got == store.read_cells(wanted) == store.get_cells(wanted)  # type: ignore[arg-type]
        assert not isinstance(store.read_cells(wanted[:3], max_bytes=25_000), TruncatedPage)
        one = store.read_cells(wanted[:3], max_bytes=1)  # one cell at least, however small the budget
        assert isinstance(one, TruncatedPage) and one == got[:1]
