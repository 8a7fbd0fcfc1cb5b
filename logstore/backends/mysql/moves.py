"""Online shard moves between MySQL storage nodes (``cellstream shards move SHARD... --to NODE``, and the
rebalance jobs of :mod:`logstore.rebalance`), resumable from what the two nodes record.

A shard is copied with its added_ids while writers go on and checked; it is then fenced on the source, copied
to the end, checked again (only the part copied after the first check), its consumers' offsets carried, and
switched. Nothing but the shard's row on each node is needed to go on after the process running a move died:
:func:`move_shard` reads the rows and resumes, :func:`pending_moves` lists the moves found half done, and
:func:`abort_move` undoes one not switched yet. The shard's secondary index rows go with it, copied while it
is fenced (:mod:`logstore.backends.mysql.index_moves`). The source copy stays (fenced, readable) until
:func:`drop_moved`. The protocol step by step: docs/logstore.md, "Online shard moves".

The shard's row (``cellstream_shards``) on a node, as a move reads it:

=========  =============================================  ===================================================
holds      fence NULL                                     the node holds the shard: writes are accepted
filling    fence = S, moved_to = S, moved_at NULL         a target filled from S: writes are refused, and the
                                                          map, if it reaches this node, goes on to S
fenced     fence = T, moved_to NULL                       a source fenced towards T, its move not recorded
moved      fence = T, moved_to = T, moved_at set          the shard left for T
=========  =============================================  ===================================================

A move from S to T is, by the pair of rows: *copying* (S holds, T filling), *fenced* (S fenced, T filling),
*switched* (S fenced, T holds), then done (S moved, T holds). While filling, T's ``last_id`` keeps the
highest added_id of the part checked before the fence, so a move resumed while fenced checks only the rest.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from typing import Any, NamedTuple

import pymysql

from logstore.backends.mysql.index_moves import copy_index_shard, drop_index_shard
from logstore.backends.mysql.recorder import CELL_COLUMNS, MySQLRecorder
from logstore.errors import (
    ConfigurationError,
    InvalidArgumentError,
    LogstoreError,
    StorageError,
    StorageUnavailableError,
)
from logstore.offsets import ConsumerOffsets
from logstore.retry import RetryPolicy
from logstore.store import Store

logger = logging.getLogger(__name__)
PAGE = 5000
CAUGHT_UP = 200  # a copy pass that finds fewer new cells than this ends the catch-up
Progress = Callable[[int, int], None]  # (shard, cells copied so far by this call)
Pace = Callable[[int], None]  # given the rows of a page before it is copied or deleted; may block (a throttle)
_QUICK = RetryPolicy(deadline=2.0)  # for nodes a move only looks at: one that does not answer is passed over
_ROW = "SELECT last_id, fence, moved_to, moved_at, id_floor FROM cellstream_shards WHERE shard = %s"
# Tests only: called with the name of each step a move or an abort has just taken.
step_hook: Callable[[str], None] | None = None


class MoveReport(NamedTuple):
    shard: int
    source: str
    target: str
    cells: int
    head: int
    fenced_seconds: float  # how long writes to the shard were refused (by this call, for a resumed move)
    found: str = "new"  # the phase the move was found in: new, copying, fenced, switched or moved (done)


class PendingMove(NamedTuple):
    """A move found half done on the nodes: ``phase`` is copying, fenced or switched (or unknown, when one of
    its nodes did not answer)."""

    shard: int
    source: str
    target: str
    phase: str


class _Row(NamedTuple):
    last_id: int
    fence: str | None
    moved_to: str | None
    moved_at: dt.datetime | None
    id_floor: int = 0  # ids below it are burnt (a promotion): the shard's next id is above it

    def holds(self) -> bool:
        return self.fence is None

    def filling(self, source: str | None = None) -> bool:
        return (self.fence is not None and self.moved_to == self.fence and self.moved_at is None
                and source in (None, self.fence))

    def fenced(self, target: str | None = None) -> bool:
        return self.fence is not None and self.moved_to is None and target in (None, self.fence)

    def moved(self, target: str | None = None) -> bool:
        return (self.fence is not None and self.moved_to is not None and self.moved_at is not None
                and target in (None, self.moved_to))


def _at(step: str) -> None:
    if step_hook is not None:
        step_hook(step)


def _node(store: Store, name: str) -> MySQLRecorder:
    recorder = store.node_recorder(name)
    if recorder is None:
        raise InvalidArgumentError(f"no storage node {name!r} in the cluster map (nodes: {', '.join(store.nodes)})")
    if not isinstance(recorder, MySQLRecorder):
        raise ConfigurationError(f"storage node {name} is not a MySQL node: shards move only between MySQL nodes")
    return recorder


def _mysql_nodes(store: Store) -> list[MySQLRecorder]:
    return [r for name in store.nodes if isinstance(r := store.node_recorder(name), MySQLRecorder)]


def _carry_indexes(source: MySQLRecorder, target: MySQLRecorder, shard: int, pace: Pace | None) -> int:
    """The shard's secondary index entries, copied to the target while the source is fenced, before the switch;
    returns how many."""
    # Not paced: every moment here is a moment the shard's writes wait.
    return copy_index_shard(source, target, shard)


def _row(node: MySQLRecorder, shard: int, policy: RetryPolicy | None = None) -> _Row | None:
    def run(cur: pymysql.cursors.Cursor) -> _Row | None:
        cur.execute(_ROW, (shard,))
        found = cur.fetchone()
        return None if found is None else _Row(int(found[0]), *found[1:])
    return node.run("read shard row", run, policy)


def _max_id(node: MySQLRecorder, shard: int) -> int:
    return _summary(node, shard, 0)[1]


def _summary(node: MySQLRecorder, shard: int, after: int, upto: int | None = None) -> tuple[int, int]:
    """(count, highest added_id) of the shard's cells in (after, upto]."""
    def run(cur: pymysql.cursors.Cursor) -> tuple[int, int]:
        cur.execute("SELECT COUNT(*), COALESCE(MAX(added_id), 0) FROM cells WHERE shard = %s AND added_id > %s"
                    + ("" if upto is None else " AND added_id <= %s"),
                    (shard, after) if upto is None else (shard, after, upto))
        found = cur.fetchone()
        return (int(found[0]), int(found[1])) if found else (0, 0)
    return node.run("count shard", run)


def _update(node: MySQLRecorder, what: str, sql: str, args: Sequence[Any]) -> int:
    """Run one guarded UPDATE; return the rows it changed."""
    return node.run(what, lambda cur: int(cur.execute(sql, args)))


@contextmanager
def _move_lock(source: MySQLRecorder, shard: int) -> Iterator[None]:
    """One process at a time moves or aborts a shard: a lock on the source's server, lost with its process."""
    with source.named_lock(f"cellstream_move_{shard}") as held:
        if not held:
            # Retriable: the process holding it may be finishing the move, or on its way out.
            raise StorageUnavailableError(f"shard {shard}: another process is moving it (it holds the move's lock "
                                          f"on node {source.name})")
        yield


def _copy(source: MySQLRecorder, target: MySQLRecorder, shard: int, after: int,
          pace: Pace | None) -> tuple[int, int]:
    """Copy the cells past ``after`` in added_id order, a page a transaction, so the copy is always the
    source's cells up to its highest id; return how many and the last added_id copied."""
    copied = 0
    while True:
        def read(cur: pymysql.cursors.Cursor, after: int = after) -> tuple[tuple[Any, ...], ...]:
            cur.execute(f"SELECT {CELL_COLUMNS} FROM cells WHERE shard = %s AND added_id > %s"
                        " ORDER BY added_id LIMIT %s", (shard, after, PAGE))
            return tuple(cur.fetchall())
        rows = source.run("copy shard", read)
        if not rows:
            return copied, after
        if pace is not None:
            pace(len(rows))

        def write(cur: pymysql.cursors.Cursor, rows: tuple[tuple[Any, ...], ...] = rows) -> None:
            # IGNORE: a page copied before a failed attempt is copied again harmlessly (same ids, same cells).
            cur.executemany(f"INSERT IGNORE INTO cells ({CELL_COLUMNS}) VALUES (%s, %s, %s, %s, %s, %s, %s)",
                            [(*row[:6], row[6].replace(tzinfo=None)) for row in rows])
        target.run("copy shard", write)
        copied += len(rows)
        after = int(rows[-1][1])
        _at("page")


def _delete_cells(node: MySQLRecorder, shard: int, pace: Pace | None) -> int:
    """Delete the shard's cells on ``node``, a page at a time from the highest added_id down (short
    transactions, for the replicas too; what stays is always a copy up to some id, which a move can go on
    from); return how many."""
    deleted = 0
    while True:
        def page(cur: pymysql.cursors.Cursor) -> tuple[int, int]:
            cur.execute("SELECT COUNT(*), COALESCE(MIN(added_id), 0) FROM (SELECT added_id FROM cells"
                        " WHERE shard = %s ORDER BY added_id DESC LIMIT %s) page", (shard, PAGE))
            found = cur.fetchone()
            return (int(found[0]), int(found[1])) if found else (0, 0)
        rows, lowest = node.run("delete shard", page)
        if not rows:
            return deleted
        if pace is not None:
            pace(rows)

        def delete(cur: pymysql.cursors.Cursor, lowest: int = lowest) -> int:
            return int(cur.execute("DELETE FROM cells WHERE shard = %s AND added_id >= %s", (shard, lowest)))
        deleted += node.run("delete shard", delete)


def _read_consumers(cur: pymysql.cursors.Cursor) -> list[tuple[str, bytes]]:
    cur.execute("START TRANSACTION")
    try:
        # Shared locks wait for the offset commits under way, which hold their rows' write locks: a commit
        # that read no fence (it reads them once its row is locked) is seen here, and every later one meets
        # the fence and changes nothing of this shard.
        cur.execute("SELECT consumer, offsets FROM cellstream_consumers LOCK IN SHARE MODE")
        rows = [(str(consumer), bytes(value)) for consumer, value in cur.fetchall()]
        cur.execute("COMMIT")
    except BaseException:
        with suppress(pymysql.Error, OSError):
            cur.execute("ROLLBACK")
        raise
    return rows


def _carry_offsets(source: MySQLRecorder, target: MySQLRecorder, shard: int) -> int:
    """Carry each consumer's record of the shard to the target (while the source is fenced: the records are
    final); return how many consumers had one."""
    carried = 0
    for consumer, value in source.run("read offsets to carry", _read_consumers):
        offsets = ConsumerOffsets.decode(value, f"{consumer} on storage node {source.name}")
        carried += target.carry_offsets(consumer, offsets, shard)
    return carried


def _locate(store: Store, shard: int, target: MySQLRecorder) -> tuple[str, str]:
    """(source, phase) of a move of ``shard`` to ``target``, from the rows of the nodes: phase new, copying,
    fenced, switched or moved. Raises when the shard is on the target already (not by a move), or another
    move of it is under way."""
    t = _row(target, shard)
    if t is not None and t.filling():
        assert t.fence is not None
        source = _node(store, t.fence)
        s = _row(source, shard)
        if s is not None and s.fenced(target.name):
            return source.name, "fenced"
        if s is not None and s.holds():
            return source.name, "copying"
        raise StorageError(f"node {target.name} is being filled with shard {shard} from node {source.name}, which "
                           "does not hold it: abort that move (abort_move)")
    holder = store.node_of(shard)
    if holder != target.name:
        s = _row(_node(store, holder), shard)
        if s is None or s.moved() or s.filling():
            raise StorageError(f"the shard map puts shard {shard} on node {holder}, whose row says otherwise "
                               f"({s}): refresh the map and try again")
        if s.fenced() and s.fence != target.name:
            raise InvalidArgumentError(f"shard {shard} is being moved to node {s.fence}: finish that move (move it "
                                       f"to {s.fence}) or abort it first")
        if s.fenced():
            return holder, "switched" if t is not None and t.holds() else "fenced"
        if t is not None and (t.holds() or t.fenced()):
            raise StorageError(f"shard {shard}: node {target.name} holds it too, beside node {holder}")
        return holder, "new"
    if t is not None and t.fenced():
        raise InvalidArgumentError(f"shard {shard} is being moved to node {t.fence}: finish that move (move it to "
                                   f"{t.fence}) or abort it first")
    # On the target by the map: a move switched there (its source perhaps not recorded yet: the map stops at
    # the target first when the shard comes back to a node it left), or done, or no move at all.
    done: list[tuple[dt.datetime, str]] = []
    for node in _mysql_nodes(store):
        if node.name == target.name:
            continue
        try:
            r = _row(node, shard, _QUICK)
        except StorageUnavailableError as exc:
            logger.warning("shard %d: node %s does not answer (%s); passed over", shard, node.name, exc)
            continue
        if r is not None and r.fenced(target.name):
            return node.name, "switched"
        if r is not None and r.moved(target.name):
            assert r.moved_at is not None
            done.append((r.moved_at, node.name))
    if done:
        return max(done)[1], "moved"
    raise InvalidArgumentError(f"shard {shard} is on node {target.name} already")


def move_shard(store: Store, shard: int, target_name: str, *, pace: Pace | None = None,
               progress: Progress | None = None) -> MoveReport:
    """Move ``shard`` to storage node ``target_name`` online, or go on with its move from where the nodes
    say it stopped (idempotent: a move found done returns its report).

    Args:
        store: the store whose map names both nodes.
        shard: the shard to move.
        target_name: the MySQL node it goes to.
        pace: called with the rows of each page before it is copied (a throttle blocks in it); not while
            the shard is fenced, where every moment is a moment writes wait.
        progress: called with (shard, cells copied so far by this call) after each copy pass.

    Returns:
        The move's report (cells and head of the shard moved, how long writes were fenced by this call, the
        phase the move was found in).

    Raises:
        InvalidArgumentError: an unknown node or shard, the shard on the target already, or being moved
            elsewhere.
        ConfigurationError: a node that is not MySQL's, or the target holds an old copy of the shard
            (``drop_moved`` it first).
        StorageUnavailableError: a node of the move does not answer, or another process is moving the shard
            (retriable: the move goes on from where it stopped).
        StorageError: the copy does not match the source (the fence is lifted and nothing recorded: abort
            the move, :func:`abort_move`, and move it again).
    """
    store.check_shard(shard)
    target = _node(store, target_name)
    for _ in range(3):
        store.refresh_map()
        source_name, phase = _locate(store, shard, target)
        source = _node(store, source_name)
        with _move_lock(source, shard):
            if _locate(store, shard, target) != (source_name, phase):
                continue  # changed before the lock was ours: read again
            return _Move(store, source, target, shard, pace, progress).run(phase)
    raise StorageError(f"shard {shard}: its move kept changing while it was read; try again")


def move_shards(store: Store, shards: list[int], target_name: str, progress: Progress | None = None, *,
                pace: Pace | None = None) -> list[MoveReport]:
    """:func:`move_shard` of each of ``shards`` in turn (``cellstream shards move``); its errors."""
    _node(store, target_name)  # an unknown node before any shard
    return [move_shard(store, shard, target_name, pace=pace, progress=progress) for shard in shards]


class _Move:
    """One move under its lock, from the phase it was found in."""

    def __init__(self, store: Store, source: MySQLRecorder, target: MySQLRecorder, shard: int,
                 pace: Pace | None, progress: Progress | None) -> None:
        self.store, self.source, self.target, self.shard = store, source, target, shard
        self.pace, self.progress = pace, progress
        self.copied = 0

    def run(self, phase: str) -> MoveReport:
        if phase == "moved":
            return self._done(phase, None, None)
        if phase == "switched":
            started = time.monotonic()
            self._record()
            return self._done(phase, started, None)
        if phase == "fenced":
            started = time.monotonic()
            t = _row(self.target, self.shard)
            if t is not None and t.filling(self.source.name):
                return self._fenced(phase, started, t.last_id, None)
            # Fenced towards a target that is not being filled (its row was changed by hand): lift the
            # fence, which nothing can get past meanwhile, and move from the start.
            self._lift_fence()
            phase = "new"
        if phase == "new":
            self._prepare()
        boundary, before = self._copy_and_check()
        started = time.monotonic()
        self._fence()
        return self._fenced(phase, started, boundary, before)

    # -- copying ----------------------------------------------------------------------------
    def _prepare(self) -> None:
        """Make the target's row ``filling``; refuse a target with cells of the shard (an old copy)."""
        source, shard = self.source.name, self.shard

        def run(cur: pymysql.cursors.Cursor) -> None:
            cur.execute("START TRANSACTION")
            try:
                cur.execute("SELECT 1 FROM cells WHERE shard = %s LIMIT 1", (shard,))
                if cur.fetchone():
                    raise ConfigurationError(f"node {self.target.name} still holds an old copy of shard {shard}: "
                                             f"drop it first (cellstream shards drop-moved {shard})")
                # moved_to = the source: a map that reaches this node (the shard comes back to a node it left)
                # goes on to the source until the switch.
                cur.execute("INSERT INTO cellstream_shards (shard, last_id, fence, moved_to, moved_at)"
                            " VALUES (%s, 0, %s, %s, NULL) ON DUPLICATE KEY UPDATE last_id = 0,"
                            " fence = VALUES(fence), moved_to = VALUES(moved_to), moved_at = NULL",
                            (shard, source, source))
                cur.execute("COMMIT")
            except BaseException:
                with suppress(pymysql.Error, OSError):
                    cur.execute("ROLLBACK")
                raise
        self.target.run("prepare shard", run)
        _at("prepared")

    def _copy_and_check(self) -> tuple[int, int]:
        """Copy (from what the target has) until a pass finds few new cells or no fewer than the last one
        (writers as fast as the copy); check the copy; return its highest added_id and its count."""
        last = _max_id(self.target, self.shard)
        previous: int | None = None
        while True:
            copied, last = _copy(self.source, self.target, self.shard, last, self.pace)
            self.copied += copied
            if self.progress is not None:
                self.progress(self.shard, self.copied)
            if copied < CAUGHT_UP or (previous is not None and copied >= previous):
                break
            previous = copied
        have, want = _summary(self.target, self.shard, 0, last), _summary(self.source, self.shard, 0, last)
        if have != want:
            raise StorageError(f"shard {self.shard}: the copy on {self.target.name} holds {have[0]} cells up to "
                               f"added_id {have[1]}, the source {want[0]}; nothing was fenced. Abort the move "
                               "(abort_move) and move the shard again")
        # The boundary of what is checked, kept on the target's row: a move resumed while fenced checks the
        # rest only.
        if not _update(self.target, "record checked copy", "UPDATE cellstream_shards SET last_id = %s WHERE"
                       " shard = %s AND fence = %s AND moved_to = fence AND moved_at IS NULL",
                       (last, self.shard, self.source.name)) and (_row(self.target, self.shard) or ())[:4] != (
                           last, self.source.name, self.source.name, None):
            raise StorageError(f"shard {self.shard}: node {self.target.name} is no longer being filled")
        _at("prechecked")
        return last, have[0]

    def _fence(self) -> None:
        # Waits for the writes under way (they hold the row's lock); every later one meets the fence.
        if not _update(self.source, "fence shard", "UPDATE cellstream_shards SET fence = %s WHERE shard = %s"
                       " AND fence IS NULL AND moved_to IS NULL", (self.target.name, self.shard)):
            found = _row(self.source, self.shard)
            if found is None or not found.fenced(self.target.name):
                raise StorageError(f"shard {self.shard}: node {self.source.name} no longer holds it ({found})")
        _at("fenced")

    # -- fenced ---------------------------------------------------------------------------------
    def _fenced(self, found: str, started: float, boundary: int, before: int | None) -> MoveReport:
        """Copy the rest, check it, carry the offsets (and indexes), switch; on any failure before the switch,
        lift the fence (the move can go on later from the copy)."""
        source, target, shard = self.source, self.target, self.shard
        try:
            copied, _ = _copy(source, target, shard, _max_id(target, shard), None)
            self.copied += copied
            _at("copied")
            have, want = _summary(target, shard, boundary), _summary(source, shard, boundary)
            if have != want:
                raise StorageError(f"shard {shard}: past added_id {boundary}, the copy on {target.name} holds "
                                   f"{have[0]} cells up to {have[1]}, the source {want[0]} up to {want[1]}; "
                                   "nothing was switched. Abort the move (abort_move) and move the shard again")
            s = _row(source, shard)
            head = max(s.last_id if s is not None else 0, want[1], boundary)
            floor = s.id_floor if s is not None else 0
            _at("checked")
            consumers = _carry_offsets(source, target, shard)
            entries = _carry_indexes(source, target, shard, self.pace)
            _at("carried")
            self._switch(head, floor)
        except BaseException:
            self._back_to_copying()
            raise
        _at("switched")
        self._record()
        logger.info("shard %d: %d consumers' offsets and %d index entries carried", shard, consumers, entries)
        cells = None if before is None else before + have[0]
        return self._done(found, started, cells)

    def _switch(self, head: int, floor: int = 0) -> None:
        """The target takes the shard's counter (and its floor of burnt ids) and loses its fence: writes land
        there from now on.

        The target is switched before the source records the move, so every state between holds: until the
        record, the map still sends writes to the source, whose fence refuses them (a write waits and
        retries: nothing acknowledged is lost, none is accepted by two nodes); a shard coming back to a node
        it left is sent to that node at once (its row no longer leads the map on), and the source's fence
        refuses stale writers. The other order would point the map at a target that still refuses writes, or
        in a loop (T to S to T) when the shard comes back. A move killed between the two writes is found
        *switched* and only the record is left to write.
        """
        if not _update(self.target, "switch shard", "UPDATE cellstream_shards SET last_id = %s, id_floor ="
                       " GREATEST(id_floor, %s), fence = NULL, moved_to = NULL, moved_at = NULL WHERE shard = %s"
                       " AND fence = %s AND moved_to = fence AND moved_at IS NULL",
                       (head, floor, self.shard, self.source.name)):
            found = _row(self.target, self.shard)
            if found is None or not found.holds():
                raise StorageError(f"shard {self.shard}: node {self.target.name} is no longer being filled")

    def _record(self) -> None:
        if not _update(self.source, "record move", "UPDATE cellstream_shards SET moved_to = %s, moved_at ="
                       " CURRENT_TIMESTAMP(6) WHERE shard = %s AND fence = %s AND moved_to IS NULL",
                       (self.target.name, self.shard, self.target.name)):
            found = _row(self.source, self.shard)
            if found is None or not found.moved(self.target.name):
                raise StorageError(f"shard {self.shard}: node {self.source.name} is not fenced towards "
                                   f"{self.target.name} ({found})")
        _at("recorded")

    def _lift_fence(self) -> None:
        _update(self.source, "lift fence", "UPDATE cellstream_shards SET fence = NULL WHERE shard = %s AND"
                " fence = %s AND moved_to IS NULL", (self.shard, self.target.name))

    def _back_to_copying(self) -> None:
        """Lift the source's fence after a failure, if the target is still being filled (never once switched:
        the shard would take writes on two nodes). A fence that cannot be lifted waits for a resume or an
        abort."""
        try:
            t = _row(self.target, self.shard)
            if t is not None and t.filling(self.source.name):
                self._lift_fence()
                logger.warning("shard %d: its move to %s stopped while fenced: the fence is lifted, writes go on",
                               self.shard, self.target.name)
                return
        except LogstoreError as exc:
            logger.error("shard %d: cannot tell whether its move to %s switched (%s)", self.shard,
                         self.target.name, exc)
        logger.error("shard %d stays fenced on node %s: move it again (move_shard) or abort the move "
                     "(abort_move)", self.shard, self.source.name)

    def _done(self, found: str, started: float | None, cells: int | None) -> MoveReport:
        fenced = 0.0 if started is None else time.monotonic() - started
        s = _row(self.source, self.shard)
        head = s.last_id if s is not None else 0
        if cells is None:  # resumed past the first check: counted now, unfenced
            cells = _summary(self.target, self.shard, 0, head)[0]
        self.store.refresh_map()
        if self.progress is not None:
            self.progress(self.shard, self.copied)
        logger.info("moved shard %d from %s to %s (found %s): %d cells up to added_id %d, writes fenced %.3f s",
                    self.shard, self.source.name, self.target.name, found, cells, head, fenced)
        return MoveReport(self.shard, self.source.name, self.target.name, cells, head, round(fenced, 3), found)


# -- half-done moves -----------------------------------------------------------------------------
def _half_done(store: Store, shard: int | None) -> list[PendingMove]:
    """The moves found half done (of ``shard``, or all): from each node's rows that are filling or fenced."""
    nodes = {node.name: node for node in _mysql_nodes(store)}
    rows: dict[str, dict[int, _Row]] = {}
    for name, node in nodes.items():
        def run(cur: pymysql.cursors.Cursor) -> dict[int, _Row]:
            cur.execute("SELECT shard, last_id, fence, moved_to, moved_at FROM cellstream_shards WHERE fence IS"
                        " NOT NULL AND moved_at IS NULL" + ("" if shard is None else " AND shard = %s"),
                        () if shard is None else (shard,))
            return {int(r[0]): _Row(int(r[1]), *r[2:]) for r in cur.fetchall()}
        try:
            rows[name] = node.run("read half-done moves", run, _QUICK)
        except StorageUnavailableError as exc:
            logger.warning("node %s does not answer (%s): the moves it takes part in are not listed", name, exc)
    out: dict[tuple[int, str, str], PendingMove] = {}
    for name, found in rows.items():
        for s, row in found.items():
            if row.filling():
                assert row.fence is not None
                source = rows.get(row.fence)
                phase = ("unknown" if source is None else "fenced" if (r := source.get(s)) and r.fenced(name)
                         else "copying")
                out[s, row.fence, name] = PendingMove(s, row.fence, name, phase)
    for name, found in rows.items():
        for s, row in found.items():
            if row.fenced() and (s, name, row.fence) not in out:
                assert row.fence is not None
                phase = "unknown"
                if (target := nodes.get(row.fence)) is not None:
                    with suppress(StorageUnavailableError):
                        t = _row(target, s, _QUICK)
                        phase = "switched" if t is not None and t.holds() else "fenced"
                out[s, name, row.fence] = PendingMove(s, name, row.fence, phase)
    return sorted(out.values())


def pending_moves(store: Store) -> list[PendingMove]:
    """The moves found half done on the nodes, by shard: each can be finished (:func:`move_shard` to its
    target) or, before its switch, undone (:func:`abort_move`). A node that does not answer is passed over
    (logged): a move it takes part in may be missing, or listed with phase ``unknown``."""
    return _half_done(store, None)


def abort_move(store: Store, shard: int, *, pace: Pace | None = None) -> PendingMove:
    """Undo the half-done move of ``shard`` (copying or fenced): lift the source's fence, delete the partial
    copy on the target (``pace`` called before each page) and leave the target's row as a move away from it.

    Returns:
        The move undone, as found.

    Raises:
        InvalidArgumentError: no move of the shard is under way, or it is switched already (finish it:
            :func:`move_shard`).
        StorageUnavailableError: a node of the move does not answer, or another process is moving the shard.
    """
    store.check_shard(shard)
    store.refresh_map()
    found = _half_done(store, shard)
    if not found:
        raise InvalidArgumentError(f"no move of shard {shard} is under way")
    move = found[0]
    if move.phase == "switched":
        raise InvalidArgumentError(f"the move of shard {shard} from {move.source} to {move.target} is switched "
                                   f"already: finish it (move the shard to {move.target})")
    source, target = _node(store, move.source), _node(store, move.target)
    with _move_lock(source, shard):
        t = _row(target, shard)
        if t is not None and t.holds():
            raise InvalidArgumentError(f"the move of shard {shard} to {target.name} is switched already: finish it")
        s = _row(source, shard)
        if s is not None and s.fenced(target.name):
            # First, so writes go on whatever happens next; the target takes none while it fills.
            _update(source, "lift fence", "UPDATE cellstream_shards SET fence = NULL WHERE shard = %s AND"
                    " fence = %s AND moved_to IS NULL", (shard, target.name))
            _at("lifted")
        if t is not None and t.filling(source.name):
            deleted = _delete_cells(target, shard, pace)
            drop_index_shard(target, shard, pace)
            # Left as moved towards the source, not deleted: the map may reach the shard through this node
            # (a shard that was coming back to it), and goes on to the source.
            _update(target, "end filling", "UPDATE cellstream_shards SET last_id = 0, moved_at ="
                    " CURRENT_TIMESTAMP(6) WHERE shard = %s AND fence = %s AND moved_to = fence AND moved_at IS"
                    " NULL", (shard, source.name))
            logger.info("shard %d: its move from %s to %s is undone (%d copied cells deleted)", shard, source.name,
                        target.name, deleted)
    store.refresh_map()
    return move


def drop_moved(store: Store, shards: Sequence[int], *, pace: Pace | None = None) -> list[tuple[int, str]]:
    """Delete the source copies of moved shards a page at a time (``pace`` called before each);
    returns (shard, node dropped from).

    The shard's row stays on the source with its fence and move record, so a process that has not read the
    move yet still meets the fence.

    Raises:
        InvalidArgumentError: a shard with no source copy (never moved, or dropped already).
        StorageUnavailableError: no copy found, and some node that might hold one does not answer.
    """
    store.refresh_map()
    dropped = []
    for shard in shards:
        store.check_shard(shard)
        holder = store.node_of(shard)
        copies, silent = [], []
        for node in _mysql_nodes(store):
            if node.name == holder:
                continue
            try:
                row = _row(node, shard, _QUICK)
            except StorageUnavailableError:
                silent.append(node.name)
                continue
            if row is not None and row.moved():
                copies.append(node)
        if not copies and silent:
            raise StorageUnavailableError(f"shard {shard}: nodes {', '.join(silent)} do not answer; one of them "
                                          "may hold its source copy")
        if not copies:
            raise InvalidArgumentError(f"shard {shard} was not moved: there is no source copy to drop")
        for node in copies:
            _delete_cells(node, shard, pace)
            drop_index_shard(node, shard, pace)
            dropped.append((shard, node.name))
    return dropped
