"""Online shard moves between MySQL storage nodes (``cellstream shards move SHARD... --to NODE``).

For each shard, while writers go on:

1. the target gets the shard's table and its row in ``cellstream_shards`` (the writers' lock);
2. copy: the source's cells are copied in added_id order, **with their added_ids**, page by page,
   and again until a pass finds few new ones (catch-up);
3. fence: a trigger on the source's table refuses every later insert with "shard S moved to node T".
   Creating it waits for the writes under way, so every write either committed on the source
   before it or fails after it; a failed write is retried by its store on the new map;
4. the last cells are copied, and the counts and highest added_id of both copies compared;
5. switch: the move is recorded on the source (``cellstream_moves``). Every store reads these
   records at open, every ``map_refresh`` seconds, and at once when a write meets the fence.

Because the added_ids are kept, a tailer's location in the shard stays valid on the target,
and the target's AUTO_INCREMENT goes on above them: the log neither skips nor repeats. The
source copy stays (readable, fenced) until :func:`drop_moved` removes it. A verification that
fails lifts the fence and records nothing. A shard of a node holding secondary indexes is not
moved: their entries would stay behind.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import pymysql

from .errors import ConfigurationError, InvalidArgumentError, StorageError
from .mysql import _SHARD_TABLE, MySQLRecorder, table
from .store import Store

logger = logging.getLogger(__name__)
PAGE = 5000
CAUGHT_UP = 200  # a copy pass that finds fewer new cells than this ends the catch-up
Progress = Callable[[int, int], None]  # (shard, cells copied so far)


class MoveReport(NamedTuple):
    shard: int
    source: str
    target: str
    cells: int
    head: int
    fenced_seconds: float  # how long writes to the shard were refused


def _node(store: Store, name: str) -> MySQLRecorder:
    recorder = store._recorders.get(name)
    if recorder is None:
        raise InvalidArgumentError(f"no storage node {name!r} in the cluster map (nodes: {', '.join(store.nodes)})")
    if not isinstance(recorder, MySQLRecorder):
        raise ConfigurationError(f"storage node {name} is not a MySQL node: shards move only between MySQL nodes")
    return recorder


def _has_indexes(node: MySQLRecorder) -> bool:
    def run(cur: pymysql.cursors.Cursor) -> bool:
        try:
            cur.execute("SELECT 1 FROM cellstream_index_specs LIMIT 1")
        except pymysql.err.ProgrammingError:
            return False
        return cur.fetchone() is not None
    return node.run("check indexes", run)


def _summary(node: MySQLRecorder, shard: int) -> tuple[int, int]:
    def run(cur: pymysql.cursors.Cursor) -> tuple[int, int]:
        try:
            cur.execute(f"SELECT COUNT(*), COALESCE(MAX(added_id), 0) FROM {table(shard)}")
        except pymysql.err.ProgrammingError:
            return 0, 0
        found = cur.fetchone()
        return (int(found[0]), int(found[1])) if found else (0, 0)
    return node.run("count shard", run)


def _prepare(target: MySQLRecorder, shard: int) -> None:
    def run(cur: pymysql.cursors.Cursor) -> None:
        cur.execute(_SHARD_TABLE.format(t=table(shard)))
        cur.execute(f"SELECT COUNT(*) FROM {table(shard)}")
        found = cur.fetchone()
        if found and found[0]:
            raise ConfigurationError(f"node {target.name} still holds an old copy of shard {shard}: drop it first "
                                     f"(cellstream shards drop-moved {shard})")
        # The empty table of a shard that moved away and was dropped carries the fence: the shard comes back.
        cur.execute(f"DROP TRIGGER IF EXISTS {table(shard)}_moved")
        cur.execute(f"DROP TRIGGER IF EXISTS {table(shard)}_fence_moved")
        cur.execute("INSERT IGNORE INTO cellstream_shards (shard) VALUES (%s)", (shard,))
        cur.execute("DELETE FROM cellstream_moves WHERE shard = %s", (shard,))
    target.run("prepare shard", run)


def _copy(source: MySQLRecorder, target: MySQLRecorder, shard: int, after: int) -> tuple[int, int]:
    """Copy the cells past ``after``; return how many and the last added_id copied."""
    copied = 0
    while True:
        def read(cur: pymysql.cursors.Cursor, after: int = after) -> tuple[tuple[Any, ...], ...]:
            cur.execute(f"SELECT added_id, row_key, column_name, ref_key, body, created_at FROM {table(shard)} "
                        "WHERE added_id > %s ORDER BY added_id LIMIT %s", (after, PAGE))
            return tuple(cur.fetchall())
        rows = source.run("copy shard", read)
        if not rows:
            return copied, after

        def write(cur: pymysql.cursors.Cursor, rows: tuple[tuple[Any, ...], ...] = rows) -> None:
            # IGNORE: a page copied before a failed attempt is copied again harmlessly (same ids, same cells).
            cur.executemany(f"INSERT IGNORE INTO {table(shard)} (added_id, row_key, column_name, ref_key, body,"
                            " created_at) VALUES (%s, %s, %s, %s, %s, %s)",
                            [(a, k, c, r, b, t.replace(tzinfo=None)) for a, k, c, r, b, t in rows])
        target.run("copy shard", write)
        copied += len(rows)
        after = int(rows[-1][0])


def _fence_sql(shard: int, table_name: str, trigger: str, target: str) -> str:
    return (f"CREATE TRIGGER {trigger} BEFORE INSERT ON {table_name} FOR EACH ROW "
            f"SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'cellstream: shard {shard} moved to node {target}'")


def _fence(source: MySQLRecorder, shard: int, target: str) -> None:
    source.run("fence shard", lambda cur: cur.execute(_fence_sql(shard, table(shard), f"{table(shard)}_moved",
                                                                 target)))


def _unfence(source: MySQLRecorder, shard: int) -> None:
    source.run("lift fence", lambda cur: cur.execute(f"DROP TRIGGER IF EXISTS {table(shard)}_moved"))


def move_shards(store: Store, shards: list[int], target_name: str,
                progress: Progress | None = None) -> list[MoveReport]:
    """Move ``shards`` to storage node ``target_name`` online (see the module docstring)."""
    target = _node(store, target_name)
    reports = []
    for shard in shards:
        store._check_shard(shard)
        store.refresh_map()
        source_name = store.node_of(shard)
        if source_name == target_name:
            raise InvalidArgumentError(f"shard {shard} is on node {target_name} already")
        source = _node(store, source_name)
        if _has_indexes(source):
            raise ConfigurationError(f"node {source_name} holds secondary indexes: moving its shards would leave "
                                     "their entries behind")
        reports.append(_move(store, source, target, shard, progress))
    return reports


def _move(store: Store, source: MySQLRecorder, target: MySQLRecorder, shard: int,
          progress: Progress | None) -> MoveReport:
    _prepare(target, shard)
    total, last = 0, 0
    while True:  # copy, then catch up while writers go on
        copied, last = _copy(source, target, shard, last)
        total += copied
        if progress is not None:
            progress(shard, total)
        if copied < CAUGHT_UP:
            break
    fenced_at = time.monotonic()
    _fence(source, shard, target.name)
    try:
        copied, last = _copy(source, target, shard, last)
        total += copied
        have, want = _summary(target, shard), _summary(source, shard)
        if have != want:
            raise StorageError(f"shard {shard}: the copy on {target.name} holds {have[0]} cells up to added_id "
                               f"{have[1]}, the source {want[0]} up to {want[1]}; nothing was switched")

        def switch(cur: pymysql.cursors.Cursor) -> None:
            cur.execute("UPDATE cellstream_shards SET cells = %s WHERE shard = %s", (have[0], shard))
        target.run("count shard", switch)
        source.run("record move", lambda cur: cur.execute(
            "INSERT INTO cellstream_moves (shard, moved_to) VALUES (%s, %s) "
            "ON DUPLICATE KEY UPDATE moved_to = VALUES(moved_to), moved_at = CURRENT_TIMESTAMP(6)",
            (shard, target.name)))
    except BaseException:
        _unfence(source, shard)
        raise
    fenced = time.monotonic() - fenced_at
    store.refresh_map()
    if progress is not None:
        progress(shard, total)
    logger.info("moved shard %d from %s to %s: %d cells up to added_id %d, writes fenced %.3f s",
                shard, source.name, target.name, have[0], have[1], fenced)
    return MoveReport(shard, source.name, target.name, have[0], have[1], round(fenced, 3))


def drop_moved(store: Store, shards: list[int]) -> list[tuple[int, str]]:
    """Drop the source copies of moved shards; returns (shard, node dropped from).

    The copy is swapped for an empty table that carries the fence (one RENAME), so a process that
    has not read the move yet still meets the fence rather than a missing table it would create.
    """
    store.refresh_map()
    dropped = []
    for shard in shards:
        store._check_shard(shard)
        holder = next((name for name, r in sorted(store._recorders.items())
                       if isinstance(r, MySQLRecorder) and shard in r.moves() and store.node_of(shard) != name), None)
        if holder is None:
            raise InvalidArgumentError(f"shard {shard} was not moved: there is no source copy to drop")
        source = _node(store, holder)
        moved_to = source.moves()[shard]
        t = table(shard)

        def swap(cur: pymysql.cursors.Cursor, t: str = t, shard: int = shard, moved_to: str = moved_to) -> None:
            cur.execute(f"DROP TABLE IF EXISTS {t}_fence")
            cur.execute(f"CREATE TABLE {t}_fence LIKE {t}")
            cur.execute(_fence_sql(shard, f"{t}_fence", f"{t}_fence_moved", moved_to))
            cur.execute(f"RENAME TABLE {t} TO {t}_dropped, {t}_fence TO {t}")
            cur.execute(f"DROP TABLE {t}_dropped")
        source.run("drop moved shard", swap)
        dropped.append((shard, holder))
    return dropped
