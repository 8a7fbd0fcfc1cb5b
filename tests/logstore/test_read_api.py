"""The read API contract (tests/contracts/read_api_contract.py) on SQLite and MariaDB, and what each backend
promises of its statements: one indexed SELECT a page of versions, a statement per 500 coordinates of a batched
read (EXPLAIN on MariaDB, EXPLAIN QUERY PLAN on SQLite)."""

from __future__ import annotations

import datetime as dt
import sqlite3
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pymysql
import pytest

import logstore
from logstore.backends.mysql.recorder import MySQLRecorder
from logstore.backends.mysql.target import MySQLTarget
from logstore.backends.sqlite.recorder import SQLiteRecorder
from logstore.config import parse_node_url
from logstore.persistence import TruncatedPage
from tests.contracts.logstore_contract import store_recorders
from tests.contracts.read_api_contract import ReadApiContract
from tests.harness.stores import sqlite_file, two_nodes

BUDGET = 100_000  # the read budget of ``budget_url``'s store (bodies of 40 KB: pages of 3)


class TestSQLiteReadApi(ReadApiContract):
    @pytest.fixture
    def url(self, sqlite_url: str) -> str:
        return sqlite_url

    @pytest.fixture
    def budget_url(self, sqlite_url: str, monkeypatch: pytest.MonkeyPatch) -> str:
        _small_budget(monkeypatch)
        return sqlite_url


class TestMySQLReadApi(ReadApiContract):
    @pytest.fixture
    def url(self, mysql_database: str) -> str:
        return mysql_database

    @pytest.fixture
    def budget_url(self, mysql_database: str, monkeypatch: pytest.MonkeyPatch) -> str:
        _small_budget(monkeypatch)
        return mysql_database


def _small_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stores opened from now on read with ``max_read_bytes`` at BUDGET (the contract opens its own)."""
    opened = logstore.open

    def small(url: str, **options: Any) -> logstore.Store:
        return opened(url, **{"max_read_bytes": BUDGET, **options})

    monkeypatch.setattr(logstore, "open", small)


def _statements(monkeypatch: pytest.MonkeyPatch, recorder: MySQLRecorder) -> list[tuple[str, Sequence[Any]]]:
    """The statements the recorder reads with from now on."""
    seen: list[tuple[str, Sequence[Any]]] = []
    read = recorder._read

    def counted(sql: str, args: Sequence[Any]) -> Any:
        seen.append((sql, args))
        return read(sql, args)

    monkeypatch.setattr(recorder, "_read", counted)
    return seen


def _connect(url: str) -> pymysql.connections.Connection:
    t = parse_node_url(url)
    assert isinstance(t, MySQLTarget)
    return pymysql.connect(host=t.host, port=t.port, user=t.user, password=t.password, database=t.database)


def test_mariadb_reads_versions_and_batches_through_the_cell_key(mysql_database: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """EXPLAIN of the very statements the recorder runs: a page of versions is a range of the ``cell`` unique key
    read backwards (no filesort), as of a time too; a batch's exact coordinates are point ranges of the same key
    (of 50 among 1,400 rows: MariaDB scans a table this small for hundreds), the latest found through it; a batch
    of 800 coordinates is two statements."""
    with logstore.open(mysql_database, shards=64) as store:
        [recorder] = store_recorders(store)
        key = uuid.uuid4()
        cells = store.put_cells([(key, "A", v, {"v": v}) for v in range(1000)])
        others = [uuid.uuid4() for _ in range(400)]
        store.put_cells([(k, "A", 1, {}) for k in others])
        seen = _statements(monkeypatch, recorder)
        assert len(store.get_cell_versions(key, "A", before=500, limit=100)) == 100
        assert store.get_cell_latest(key, "A", as_of=cells[0].created_at) is not None
        got = store.get_cells([(k, "A", 1) for k in others] + [(k, "A", 2) for k in others])
        assert len(got) == 800 and sum(c is None for c in got) == 400 and len(seen) == 2 + 2
        assert store.get_cells([(k, "A", 1) for k in others[:50]]) == got[:50]
        assert store.get_cells_latest([(k, "A") for k in others[:50]]) == got[:50]
        assert len(seen) == 2 + 2 + 2
        del seen[2:4]
        with _connect(mysql_database) as conn, conn.cursor(pymysql.cursors.DictCursor) as cur:
            plans = []
            for sql, args in seen:
                cur.execute("EXPLAIN " + sql, args)
                plans.append(cur.fetchall())
    versions, as_of, batch = plans[0], plans[1], plans[2]
    for plan in (versions, as_of):
        [step] = plan
        assert (step["type"], step["key"]) == ("range", "cell") or (step["type"], step["key"]) == ("ref", "cell")
        assert "filesort" not in (step["Extra"] or "")
    assert [(s["type"], s["key"]) for s in batch if s["table"] == "cells"] == [("range", "cell")]
    latest = [s for s in plans[3] if s["table"] in ("c", "cells")]
    assert latest and all(s["key"] in ("cell", "PRIMARY") for s in latest)


def test_sqlite_reads_versions_and_batches_through_the_unique_index(sqlite_url: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    with logstore.open(sqlite_url, shards=64) as store:
        [recorder] = store_recorders(store)
        assert isinstance(recorder, SQLiteRecorder)
        key = uuid.uuid4()
        store.put_cells([(key, "A", v, {"v": v}) for v in range(10)])
        executed: list[tuple[str, Any]] = []
        conn_of = recorder._conn

        class Counting:
            def __init__(self, conn: sqlite3.Connection) -> None:
                self.conn = conn

            def execute(self, sql: str, params: Any = ()) -> sqlite3.Cursor:
                executed.append((sql, params))
                return self.conn.execute(sql, params)

        monkeypatch.setattr(recorder, "_conn", lambda: Counting(conn_of()))
        store.get_cell_versions(key, "A", before=5, limit=3)
        store.get_cell_latest(key, "A", as_of=dt.datetime.now(dt.UTC))
        assert len(store.get_cells([(uuid.uuid4(), "A", 1)] * 800 + [(key, "A", 1)])) == 801
        assert [len(p) for _, p in executed] == [4, 3, 4 * 500, 4 * 301]  # two statements for 801 coordinates
    with sqlite3.connect(sqlite_file(sqlite_url)) as conn:
        for sql, params in executed[:2]:
            [plan] = conn.execute("EXPLAIN QUERY PLAN " + sql, params).fetchall()
            assert "INDEX sqlite_autoindex_cells_1 (row_key=? AND column_name=?" in plan[3]
        plans = [p[3] for p in conn.execute("EXPLAIN QUERY PLAN " + executed[2][0], executed[2][1]).fetchall()]
        assert any("USING INTEGER PRIMARY KEY (rowid=?)" in p for p in plans)
        assert sum("INDEX sqlite_autoindex_cells_1 (row_key=? AND column_name=?" in p for p in plans) == 2
        assert not any(p.startswith("SCAN x") or p.startswith("SCAN cells") for p in plans)


def test_a_batched_read_over_two_nodes_answers_in_order_and_reads_on(tmp_path: Path) -> None:
    """A statement or two a node, the answers put back in the order asked; a budget spent on the first node's
    cells ends the answer before the first coordinate not read, whichever node holds it."""
    cluster = two_nodes(tmp_path / "cluster.toml", [f"sqlite:///{tmp_path}/a", f"sqlite:///{tmp_path}/b"], 16)
    with logstore.open(cluster) as store:
        keys = [uuid.uuid4() for _ in range(60)]
        cells = store.put_cells([(k, "A", 1, {"s": str(i) * 1000}) for i, k in enumerate(keys)])
        assert {store.node_of(c.shard) for c in cells} == {"a", "b"}
        wanted: list[tuple[Any, str, int | None]] = [(k, "A", None if i % 2 else 1) for i, k in enumerate(keys)]
        assert store.read_cells(wanted) == cells
        page = store.read_cells(wanted, max_bytes=1)  # the first node's first cell spends it
        assert isinstance(page, TruncatedPage) and page == cells[:1]
        got: list[Any] = []
        while len(got) < len(wanted):
            got += store.read_cells(wanted[len(got):], max_bytes=5_000)
        assert got == cells
