"""Durable copies on a MySQL storage node (durable buffered writes, :attr:`StoreOptions.durable_writes`): the
``cellstream_copies`` table holding, for another node (``home``), the cells its primary acknowledged and its
replicas may not hold yet, each with its added_id and time.

Schemaless's buffered writes: a write is acknowledged once the home's primary and a second node both hold it,
so a primary lost before its asynchronous replica has the cell loses nothing: the promotion writes the copies
the promoted replica lacks, with their ids (:func:`logstore.nodes.promote_node`). A copy is trimmed once every
replica of its home holds its shard up to its id (a shard's ids commit in order: a replica's counter past an id
has the cell). Unlike ``cellstream_pending``'s cells, these are home already; they are never replayed.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import pymysql

from logstore.backends.mysql.errors import NO_TABLE, code
from logstore.persistence import RestoredCell, uuid_from_bytes

T = TypeVar("T")
Call = Callable[[str, Callable[[pymysql.cursors.Cursor], T]], T]

SCHEMA = (
    "CREATE TABLE IF NOT EXISTS cellstream_copies ("
    " home VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,"
    " shard INT NOT NULL,"
    " added_id BIGINT NOT NULL,"
    " row_key BINARY(16) NOT NULL,"
    " column_name VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,"
    " ref_key BIGINT NOT NULL,"
    " body LONGBLOB NOT NULL,"
    " created_at DATETIME(6) NOT NULL,"
    " PRIMARY KEY (home, shard, added_id)) ENGINE=InnoDB"
)
_COLS = "shard, added_id, row_key, column_name, ref_key, body, created_at"


def hold(call: Call[Any], home: str, cells: Sequence[RestoredCell]) -> None:
    """Keep copies of ``cells`` of node ``home`` (again: a copy held already is kept as it is)."""
    if not cells:
        return
    rows = [(home, c.shard, c.added_id, c.row_key.bytes, c.column, c.ref_key, c.blob,
             c.created_at.replace(tzinfo=None)) for c in cells]
    call("hold copies", lambda cur: cur.executemany(
        f"INSERT IGNORE INTO cellstream_copies (home, {_COLS}) VALUES (%s, %s, %s, %s, %s, %s, %s, %s)", rows))


def trim(call: Call[Any], home: str, heads: Mapping[int, int]) -> int:
    """Drop the copies of ``home``'s cells up to ``heads`` (shard -> id every replica holds); the count."""
    if not heads:
        return 0

    def run(cur: pymysql.cursors.Cursor) -> int:
        dropped = 0
        items = sorted(heads.items())
        for i in range(0, len(items), 500):
            part = items[i:i + 500]
            where = " OR ".join(["(shard = %s AND added_id <= %s)"] * len(part))
            try:
                dropped += int(cur.execute(f"DELETE FROM cellstream_copies WHERE home = %s AND ({where})",
                                           [home, *(v for pair in part for v in pair)]))
            except pymysql.err.ProgrammingError as exc:
                if code(exc) == NO_TABLE:
                    return 0
                raise
        return dropped
    result: int = call("trim copies", run)
    return result


def above(call: Call[Any], home: str, heads: Mapping[int, int]) -> list[RestoredCell]:
    """The copies of ``home``'s cells above ``heads`` (a shard missing: all of it), by shard and id."""
    def run(cur: pymysql.cursors.Cursor) -> list[RestoredCell]:
        try:
            cur.execute(f"SELECT {_COLS} FROM cellstream_copies WHERE home = %s ORDER BY shard, added_id", (home,))
        except pymysql.err.ProgrammingError as exc:
            if code(exc) == NO_TABLE:
                return []
            raise
        out = []
        for shard, added_id, row_key, column, ref_key, body, created in cur.fetchall():
            if added_id > heads.get(int(shard), 0):
                out.append(RestoredCell(int(shard), int(added_id), uuid_from_bytes(row_key), str(column),
                                        int(ref_key), bytes(body), created.replace(tzinfo=dt.UTC)))
        return out
    result: list[RestoredCell] = call("read copies", run)
    return result


def counts(call: Call[Any]) -> dict[str, int]:
    """Copies held, by home node."""
    def run(cur: pymysql.cursors.Cursor) -> dict[str, int]:
        try:
            cur.execute("SELECT home, COUNT(*) FROM cellstream_copies GROUP BY home")
        except pymysql.err.ProgrammingError as exc:
            if code(exc) == NO_TABLE:
                return {}
            raise
        return {str(home): int(n) for home, n in cur.fetchall()}
    result: dict[str, int] = call("count copies", run)
    return result
