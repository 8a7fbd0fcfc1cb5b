"""Online shard moves between MySQL storage nodes (``cellstream shards move SHARD... --to NODE``).

A shard is copied with its added_ids while writers go on, fenced on the source, copied to the end and
checked, then switched; a tailer's location stays valid on the target, and a failed check lifts the fence
and records nothing. The source copy stays (fenced, readable) until :func:`drop_moved`. A shard of a node
holding secondary indexes is not moved. The protocol step by step: docs/logstore.md, "Online shard moves".
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import pymysql

from logstore.backends.mysql.recorder import CELL_COLUMNS, MySQLRecorder
from logstore.errors import ConfigurationError, InvalidArgumentError, StorageError
from logstore.store import Store

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
    recorder = store.node_recorder(name)
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
        cur.execute("SELECT COUNT(*), COALESCE(MAX(added_id), 0) FROM cells WHERE shard = %s", (shard,))
        found = cur.fetchone()
        return (int(found[0]), int(found[1])) if found else (0, 0)
    return node.run("count shard", run)


def _prepare(source: MySQLRecorder, target: MySQLRecorder, shard: int) -> None:
    def run(cur: pymysql.cursors.Cursor) -> None:
        cur.execute("SELECT 1 FROM cells WHERE shard = %s LIMIT 1", (shard,))
        if cur.fetchone():
            raise ConfigurationError(f"node {target.name} still holds an old copy of shard {shard}: drop it first "
                                     f"(cellstream shards drop-moved {shard})")
        # Fenced towards the source until the switch. Its moved_to stays: if the shard left this node once,
        # the map goes on following that record until the switch clears it.
        cur.execute("INSERT INTO cellstream_shards (shard, last_id, fence) VALUES (%s, 0, %s)"
                    " ON DUPLICATE KEY UPDATE last_id = 0, fence = VALUES(fence)", (shard, source.name))
    target.run("prepare shard", run)


def _copy(source: MySQLRecorder, target: MySQLRecorder, shard: int, after: int) -> tuple[int, int]:
    """Copy the cells past ``after``; return how many and the last added_id copied."""
    copied = 0
    while True:
        def read(cur: pymysql.cursors.Cursor, after: int = after) -> tuple[tuple[Any, ...], ...]:
            cur.execute(f"SELECT {CELL_COLUMNS} FROM cells WHERE shard = %s AND added_id > %s"
                        " ORDER BY added_id LIMIT %s", (shard, after, PAGE))
            return tuple(cur.fetchall())
        rows = source.run("copy shard", read)
        if not rows:
            return copied, after

        def write(cur: pymysql.cursors.Cursor, rows: tuple[tuple[Any, ...], ...] = rows) -> None:
            # IGNORE: a page copied before a failed attempt is copied again harmlessly (same ids, same cells).
            cur.executemany(f"INSERT IGNORE INTO cells ({CELL_COLUMNS}) VALUES (%s, %s, %s, %s, %s, %s, %s)",
                            [(*row[:6], row[6].replace(tzinfo=None)) for row in rows])
        target.run("copy shard", write)
        copied += len(rows)
        after = int(rows[-1][1])


def _set_fence(node: MySQLRecorder, shard: int, fence: str | None) -> None:
    node.run("fence shard", lambda cur: cur.execute("UPDATE cellstream_shards SET fence = %s WHERE shard = %s",
                                                    (fence, shard)))


def move_shards(store: Store, shards: list[int], target_name: str,
                progress: Progress | None = None) -> list[MoveReport]:
    """Move ``shards`` to storage node ``target_name`` online (see the module docstring)."""
    target = _node(store, target_name)
    reports = []
    for shard in shards:
        store.check_shard(shard)
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
    _prepare(source, target, shard)
    total, last = 0, 0
    while True:  # copy, then catch up while writers go on
        copied, last = _copy(source, target, shard, last)
        total += copied
        if progress is not None:
            progress(shard, total)
        if copied < CAUGHT_UP:
            break
    fenced_at = time.monotonic()
    _set_fence(source, shard, target.name)
    try:
        copied, last = _copy(source, target, shard, last)
        total += copied
        have, want = _summary(target, shard), _summary(source, shard)
        if have != want:
            raise StorageError(f"shard {shard}: the copy on {target.name} holds {have[0]} cells up to added_id "
                               f"{have[1]}, the source {want[0]} up to {want[1]}; nothing was switched")
        target.run("switch shard", lambda cur: cur.execute(
            "UPDATE cellstream_shards SET last_id = %s, fence = NULL, moved_to = NULL, moved_at = NULL"
            " WHERE shard = %s", (have[1], shard)))
        source.run("record move", lambda cur: cur.execute(
            "UPDATE cellstream_shards SET moved_to = %s, moved_at = CURRENT_TIMESTAMP(6) WHERE shard = %s",
            (target.name, shard)))
    except BaseException:
        _set_fence(target, shard, source.name)
        _set_fence(source, shard, None)
        raise
    fenced = time.monotonic() - fenced_at
    store.refresh_map()
    if progress is not None:
        progress(shard, total)
    logger.info("moved shard %d from %s to %s: %d cells up to added_id %d, writes fenced %.3f s",
                shard, source.name, target.name, have[0], have[1], fenced)
    return MoveReport(shard, source.name, target.name, have[0], have[1], round(fenced, 3))


def drop_moved(store: Store, shards: list[int]) -> list[tuple[int, str]]:
    """Delete the source copies of moved shards, in chunks; returns (shard, node dropped from).

    The shard's row stays on the source with its fence and move record, so a process that has not
    read the move yet still meets the fence.
    """
    store.refresh_map()
    dropped = []
    for shard in shards:
        store.check_shard(shard)
        holder = next((name for name in sorted(store.nodes)
                       if isinstance(r := store.node_recorder(name), MySQLRecorder) and shard in r.moves()
                       and store.node_of(shard) != name), None)
        if holder is None:
            raise InvalidArgumentError(f"shard {shard} was not moved: there is no source copy to drop")
        source = _node(store, holder)

        def chunk(cur: pymysql.cursors.Cursor, shard: int = shard) -> int:
            # Chunks keep each transaction (and the replicas' apply of it) short.
            return int(cur.execute("DELETE FROM cells WHERE shard = %s ORDER BY added_id LIMIT %s", (shard, PAGE)))
        while source.run("drop moved shard", chunk):
            pass
        dropped.append((shard, holder))
    return dropped
