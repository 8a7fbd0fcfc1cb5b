"""A shard's secondary index rows moving with it between MySQL storage nodes.

A node keeps, for each index version, the entries whose shard field hashes to a shard (entry table,
keyed by (shard, row_key)), the locators of its shards' rows (locator table, keyed by row_key, with a
``locator_shard`` key), and the appliers' positions in its shards. A move copies all three for the moved
shard (:func:`copy_index_shard`) while the shard is fenced on both nodes and before the switch:

- every index write refuses a shard fenced on its node, reading the fence after its writes and before
  its commit (ShardMovedError; the index store reloads the map and writes on the new holder), so
  nothing new reaches either copy meanwhile;
- the copy's reads are locking reads, so a write that read no fence (it started before the fence) is
  waited for and copied once it commits;
- each chunk of the target is made exactly the source's rows of a row_key range, in one transaction, so
  a copy killed at any point is run again from the start and ends with the same rows.

The source copy stays until :func:`drop_index_shard` (``cellstream shards drop-moved``); queries and
verification read each shard on the node the map gives it, so the two copies are never counted twice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import pymysql

from logstore.backends.mysql.index_tables import MySQLIndexRecorder, ShardRows
from logstore.backends.mysql.recorder import MySQLRecorder
from logstore.errors import InvalidArgumentError
from logstore.index_tables.persistence import IndexSpec

logger = logging.getLogger(__name__)
CHUNK = 2000  # rows of one read and one target transaction
Pace = Callable[[int], None]  # called with a chunk's rows before it is written (or deleted): a throttle
_KINDS: tuple[ShardRows, ...] = ("entries", "locators")


def _tables(node: MySQLRecorder) -> MySQLIndexRecorder:
    tables = node.indexes
    assert isinstance(tables, MySQLIndexRecorder)  # a MySQL node's
    return tables


def _fenced(node: MySQLRecorder, shard: int) -> bool:
    def run(cur: pymysql.cursors.Cursor) -> bool:
        cur.execute("SELECT fence FROM cellstream_shards WHERE shard = %s", (shard,))
        row = cur.fetchone()
        return row is not None and row[0] is not None
    return node.run("read shard fence", run)


def _copy_rows(source: MySQLRecorder, target: MySQLRecorder, spec: IndexSpec, kind: ShardRows, shard: int,
               pace: Pace | None) -> int:
    """Make the target's entries or locators of ``shard`` the source's, one row_key range a transaction."""
    after, copied = b"", 0
    while True:
        columns, rows = _tables(source).read_shard(spec, kind, shard, after, CHUNK)
        if rows:
            if pace is not None:
                pace(len(rows))
            upto = bytes(rows[-1][columns.index("row_key")])
            _tables(target).put_shard(spec, kind, shard, after, upto, columns, rows)
            copied += len(rows)
            after = upto
        if len(rows) < CHUNK:
            # What the target holds past the source's last row (an older copy's rows) goes.
            _tables(target).put_shard(spec, kind, shard, after, None, columns, [])
            return copied


def copy_index_shard(source: MySQLRecorder, target: MySQLRecorder, shard: int, pace: Pace | None = None) -> int:
    """Make ``target``'s index rows of ``shard`` exactly ``source``'s: the entries, locators and positions of
    every index version the source holds (its tables created on the target from the source's specs when
    missing), and none of versions the source does not hold. Idempotent: a copy killed at any point is
    run again whole.

    Args:
        source: the node the shard moves from; the shard must be fenced there (no index write reaches it).
        target: the node it moves to, its shard row fenced towards the source until the switch.
        shard: the shard moving.
        pace: called with each chunk's rows before the chunk is written to the target.

    Returns:
        The rows copied (entries, locators and positions).

    Raises:
        InvalidArgumentError: the shard is not fenced on one of the nodes (index writes could go on).
        ConfigurationError: the target holds an index version of the same table with another definition.
        StorageUnavailableError: a node did not answer within the retry policy (the copy may be run again).
    """
    for node in (source, target):
        if not _fenced(node, shard):
            raise InvalidArgumentError(f"shard {shard} is not fenced on storage node {node.name}: its index rows "
                                       "are copied only while no index write can reach them")
    specs = source.indexes.specs()
    for spec in specs:
        target.indexes.create(spec)
    copied = 0
    for spec in specs:
        for kind in _KINDS:
            copied += _copy_rows(source, target, spec, kind, shard, pace)
        positions = _tables(source).read_shard_positions(spec, shard)
        if pace is not None and positions:
            pace(len(positions))
        _tables(target).put_shard_positions(spec, shard, positions)
        copied += len(positions)
    held = {spec.table for spec in specs}
    for spec in target.indexes.specs():
        if spec.table not in held:
            target.indexes.drop_shard(spec, shard, pace, CHUNK)
    logger.info("copied %d index rows of shard %d from %s to %s (%d index versions)", copied, shard,
                source.name, target.name, len(specs))
    return copied


def drop_index_shard(source: MySQLRecorder, shard: int, pace: Pace | None = None) -> int:
    """Delete the index rows of a shard moved away from ``source`` (every version's entries, locators and
    positions), in chunks of short transactions, calling ``pace`` with each chunk's rows before deleting it.
    Idempotent; what a killed drop left is deleted by the next.

    Args:
        source: the node the shard moved away from.
        shard: the shard.
        pace: a throttle, called with each chunk's rows before it is deleted.

    Returns:
        The rows deleted.

    Raises:
        InvalidArgumentError: ``source`` holds the shard (its row there has no fence): nothing is deleted.
        StorageUnavailableError: the node did not answer within the retry policy.
    """
    dropped = sum(source.indexes.drop_shard(spec, shard, pace, CHUNK) for spec in source.indexes.specs())
    logger.info("dropped %d index rows of moved shard %d on %s", dropped, shard, source.name)
    return dropped
