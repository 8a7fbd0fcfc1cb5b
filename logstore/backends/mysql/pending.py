"""Buffered writes on a MySQL storage node: the ``cellstream_pending`` table holding other nodes' cells
while their primary is unavailable (:meth:`logstore.store.Store.replay_pending` writes them home).

A row is one cell of node ``node``: its coordinates, shard and stored bytes, unique
per (node, coordinates), so buffering the same cell twice keeps one row; the same
coordinates with a different body are a CellConflictError, as on the primary. A
row the replayer cannot write home for good (a conflicting cell got there first)
keeps its reason in ``failed`` and stays for triage: an acknowledged write is never
dropped silently.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import pymysql

from logstore.cell import decode_body, same_json
from logstore.errors import CellConflictError
from logstore.persistence import PendingCell, PendingRecord, uuid_from_bytes

T = TypeVar("T")
Call = Callable[[str, Callable[[pymysql.cursors.Cursor], T]], T]

SCHEMA = (
    "CREATE TABLE IF NOT EXISTS cellstream_pending ("
    " id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,"
    " node VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,"
    " shard INT NOT NULL,"
    " row_key BINARY(16) NOT NULL,"
    " column_name VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,"
    " ref_key BIGINT NOT NULL,"
    " body LONGBLOB NOT NULL,"
    " buffered_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),"
    " failed TEXT NULL,"
    " UNIQUE KEY cell (node, row_key, column_name, ref_key)) ENGINE=InnoDB"
)
_COLS = "id, node, shard, row_key, column_name, ref_key, body, failed"


def _record(row: tuple[Any, ...], max_bytes: int) -> PendingRecord:
    pid, node, shard, row_key, column, ref_key, blob, failed = row
    cell = PendingCell(int(shard), uuid_from_bytes(row_key), column, int(ref_key), decode_body(blob, max_bytes),
                       bytes(blob))
    return PendingRecord(int(pid), node, cell, failed)


def buffer(call: Call[Any], node: str, cells: Sequence[PendingCell], max_bytes: int) -> None:
    def run(cur: pymysql.cursors.Cursor) -> None:
        cur.execute("START TRANSACTION")
        cur.executemany(
            "INSERT IGNORE INTO cellstream_pending (node, shard, row_key, column_name, ref_key, body)"
            " VALUES (%s, %s, %s, %s, %s, %s)",
            [(node, c.shard, c.row_key.bytes, c.column, c.ref_key, c.blob) for c in cells])
        if cur.rowcount != len(cells):  # some were buffered already: the same cells, or a conflict
            wanted = {c.coordinates: c for c in cells}
            cur.execute(f"SELECT {_COLS} FROM cellstream_pending WHERE node = %s AND ("
                        + " OR ".join(["(row_key = %s AND column_name = %s AND ref_key = %s)"] * len(cells)) + ")",
                        [node, *(v for c in cells for v in c.coordinates)])
            for found in (_record(row, max_bytes) for row in cur.fetchall()):
                mine = wanted.get(found.cell.coordinates)
                if mine is not None and not same_json(mine.body, found.cell.body):
                    cur.execute("ROLLBACK")
                    raise CellConflictError(mine.row_key, mine.column, mine.ref_key)
        cur.execute("COMMIT")
    call("buffer writes", run)


def pending(call: Call[Any], limit: int, max_bytes: int) -> list[PendingRecord]:
    def run(cur: pymysql.cursors.Cursor) -> list[PendingRecord]:
        try:
            cur.execute(f"SELECT {_COLS} FROM cellstream_pending WHERE failed IS NULL ORDER BY id LIMIT %s", (limit,))
        except pymysql.err.ProgrammingError:
            return []  # a node opened before buffering existed has no table until its next open
        return [_record(row, max_bytes) for row in cur.fetchall()]
    result: list[PendingRecord] = call("read pending", run)
    return result


def drop(call: Call[Any], ids: Sequence[int]) -> None:
    if ids:
        call("drop pending", lambda cur: cur.execute(
            f"DELETE FROM cellstream_pending WHERE id IN ({', '.join(['%s'] * len(ids))})", list(ids)))


def fail(call: Call[Any], pid: int, reason: str) -> None:
    call("fail pending", lambda cur: cur.execute("UPDATE cellstream_pending SET failed = %s WHERE id = %s",
                                                 (reason[:2000], pid)))


def counts(call: Call[Any]) -> dict[str, tuple[int, int]]:
    def run(cur: pymysql.cursors.Cursor) -> dict[str, tuple[int, int]]:
        cur.execute("SELECT node, SUM(failed IS NULL), SUM(failed IS NOT NULL) FROM cellstream_pending GROUP BY node")
        return {node: (int(waiting), int(failed)) for node, waiting, failed in cur.fetchall()}
    result: dict[str, tuple[int, int]] = call("count pending", run)
    return result
