"""What every read of the logs holds to, on each backend: a byte budget per read (StoreOptions.max_read_bytes)
that cuts pages short without skipping a cell, and stored bodies inflated within a cap and decoded to JSON
types only, a damaged one spoiling its own cell and no other."""

from __future__ import annotations

import sqlite3
import zlib
from collections.abc import Iterator
from typing import Any

import msgpack
import pymysql
import pytest

import logstore
from logstore.backends.mysql.target import MySQLTarget
from logstore.config import parse_node_url
from logstore.persistence import TruncatedPage
from tests.harness.stores import keys_in_shard, sqlite_file

SHARDS = 4
BUDGET = 300_000


@pytest.fixture(params=["sqlite", "mysql"])
def url(request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue("mysql_database" if request.param == "mysql" else "sqlite_url"))


@pytest.fixture
def store(url: str) -> Iterator[logstore.Store]:
    with logstore.open(url, shards=SHARDS, max_read_bytes=BUDGET) as opened:
        yield opened


def overwrite_body(url: str, cell: logstore.Cell, blob: bytes) -> None:
    """Store ``blob`` as the cell's body, straight into the database (what damage or a hostile writer does)."""
    if url.startswith("sqlite:"):
        with sqlite3.connect(sqlite_file(url)) as conn:
            conn.execute("UPDATE cells SET body = ? WHERE added_id = ?", (blob, cell.added_id))
        return
    target = parse_node_url(url)
    assert isinstance(target, MySQLTarget)
    with pymysql.connect(host=target.host, port=target.port, user=target.user, password=target.password,
                         database=target.database, autocommit=True) as conn, conn.cursor() as cur:
        cur.execute("UPDATE cells SET body = %s WHERE shard = %s AND added_id = %s", (blob, cell.shard, cell.added_id))


def size(cell: logstore.Cell | logstore.PackedCell) -> int:
    return len(cell.packed) if isinstance(cell, logstore.PackedCell) else len(msgpack.packb(cell.body))


def write_big(store: logstore.Store, shard: int, n: int) -> list[logstore.Cell]:
    """``n`` cells in ``shard`` whose bodies are 20-60 KB (compressible: a few hundred bytes stored)."""
    keys = keys_in_shard(store, shard, n)
    return store.put_cells([(key, "BASE", 1, {"i": i, "pad": "x" * (20_000 + 7_919 * i % 40_000)})
                            for i, key in enumerate(keys)])


@pytest.mark.parametrize("packed", [False, True], ids=["decoded", "packed"])
def test_a_read_stays_within_its_budget_and_paging_on_brings_every_cell_in_order(
    store: logstore.Store, packed: bool
) -> None:
    cells = write_big(store, 1, 40)
    largest = max(map(size, cells))
    assert sum(map(size, cells)) > 4 * BUDGET
    got: list[Any] = []
    location, pages = 0, []
    while True:
        if packed:
            page: Any = store.get_packed_cells_for_shards({1: location}, 1000)[1]
            location = page[-1].added_id if page else location
        else:
            page, location = store.get_cells_for_shard(1, location, 1000)
        if not page:
            break
        assert sum(map(size, page)) < BUDGET + largest
        pages.append(page)
        got.extend(page)
    assert all(isinstance(page, TruncatedPage) for page in pages[:-1]) and type(pages[-1]) is list
    assert len(pages) >= 4
    assert [c.to_cell() if packed else c for c in got] == cells  # every cell, once, in order


def test_the_pages_of_a_many_shard_read_share_its_budget_and_each_holds_a_cell(store: logstore.Store) -> None:
    written = {shard: write_big(store, shard, 12) for shard in range(SHARDS)}
    largest = max(size(c) for cells in written.values() for c in cells)
    got: dict[int, list[logstore.Cell]] = {shard: [] for shard in range(SHARDS)}
    locations = dict.fromkeys(range(SHARDS), 0)
    while locations:
        pages = store.get_cells_for_shards(locations, 1000)
        assert sum(size(c) for page in pages.values() for c in page) < BUDGET + len(pages) * largest  # type: ignore[union-attr]
        following = {}
        for shard, page in pages.items():
            assert isinstance(page, list) and page, "a page holds one cell at least"
            got[shard].extend(page)
            if isinstance(page, TruncatedPage):
                following[shard] = page[-1].added_id
            else:
                assert page[-1].added_id == written[shard][-1].added_id  # plain: the end of the log
        locations = following
    assert got == written


def _bomb() -> bytes:
    return b"\x01" + zlib.compress(msgpack.packb({"s": "a" * (32 << 20)}), 9)  # 32 MiB from about 32 KB


POISONS = {
    "bin": lambda: b"\x01" + zlib.compress(msgpack.packb({"a": b"\x00\xff"}, use_bin_type=True)),
    "NaN": lambda: b"\x01" + zlib.compress(msgpack.packb({"a": None, "b": float("nan")})),
    "zlib bomb": _bomb,
}


@pytest.mark.parametrize("poison", POISONS.values(), ids=POISONS.keys())
def test_a_poisoned_body_is_a_corrupt_cell_of_its_own_and_readers_move_past_it(
    store: logstore.Store, url: str, poison: Any
) -> None:
    [key] = keys_in_shard(store, 2, 1)
    [other] = keys_in_shard(store, 3, 1)
    cells = [store.put_cell(key, "BASE", ref, {"ref": ref}) for ref in range(1, 6)]
    beside = store.put_cell(other, "BASE", 1, {"ok": True})
    overwrite_body(url, cells[2], poison())

    with pytest.raises(logstore.CorruptCellError) as caught:
        store.get_cells_for_shard(2, 0, 100)
    assert (caught.value.added_id, caught.value.ref_key) == (cells[2].added_id, 3)
    assert caught.value.cells_before == cells[:2]
    assert store.get_cells_for_shard(2, cells[2].added_id, 100)[0] == cells[3:]
    pages = store.get_cells_for_shards({2: 0, 3: 0})
    assert pages[3] == [beside] and isinstance(pages[2], logstore.CorruptCellError)
    with pytest.raises(logstore.CorruptCellError):
        store.get_cell(key, "BASE", 3)
    packed = store.get_packed_cells_for_shards({2: 0})[2]
    if poison is _bomb:  # the cap holds on the packed path too
        assert isinstance(packed, logstore.CorruptCellError) and packed.added_id == cells[2].added_id
    else:  # bodies there are passed on as MessagePack, never made JSON: the stored map goes on as it is
        assert isinstance(packed, list) and [c.ref_key for c in packed] == [1, 2, 3, 4, 5]
        with pytest.raises(logstore.CorruptCellError):
            packed[2].body  # noqa: B018
