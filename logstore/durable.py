"""Durable buffered writes (``durable_writes``): every write acknowledged once its home node's primary and a
second node both hold it, so a primary lost before its asynchronous replicas have a cell loses nothing (the
seed's buffered writes, Schemaless part 2). The second node keeps a copy with the cell's id and time
(:mod:`logstore.backends.mysql.durable`) until every replica of the home holds it (:func:`trim_copies`); a
promotion writes the copies its new primary lacks, with their ids (:func:`restore_copies`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from logstore.cell import Cell
from logstore.errors import StorageUnavailableError
from logstore.persistence import NodeRecorder, PendingCell, RestoredCell

if TYPE_CHECKING:  # the store calls this module's functions: no import of it at run time
    from logstore.store import Store

logger = logging.getLogger(__name__)


def copies_of(cells: Sequence[PendingCell], stored: Sequence[Cell]) -> list[RestoredCell]:
    """The copies to hold of a write: each cell's stored bytes with the id and time its primary gave it (cells
    found stored already included: their copy may be missing, and holding it again changes nothing)."""
    return [RestoredCell(c.shard, s.added_id, c.row_key, c.column, c.ref_key, c.blob, s.created_at)
            for c, s in zip(cells, stored, strict=True) if s.added_id > 0]


def trim_copies(store: Store) -> int:
    """Drop the copies every replica of their home holds now; the count dropped. A home without replicas keeps
    nothing to wait for: its copies go at once. A node that does not answer is passed over (tried next time)."""
    dropped = 0
    holders = [(name, r) for name in store.nodes if (r := store.node_recorder(name)) is not None]
    counts: dict[str, dict[str, int]] = {}
    for name, recorder in holders:
        try:
            counts[name] = recorder.copy_counts()
        except StorageUnavailableError as exc:
            logger.info("copies on node %s not counted: it does not answer (%s)", name, exc)
    for home, home_recorder in holders:
        held = {name: found.get(home, 0) for name, found in counts.items() if name != home}
        if not any(held.values()):
            continue
        try:
            heads = home_recorder.replica_heads()
            if heads is None:  # no replica: nothing to wait for
                heads = home_recorder.heads(range(store.shard_count))
        except StorageUnavailableError as exc:
            logger.info("copies of node %s kept: it or a replica does not answer (%s)", home, exc)
            continue
        for name, recorder in holders:
            if held.get(name):
                try:
                    dropped += recorder.trim_copies(home, heads)
                except StorageUnavailableError as exc:
                    logger.info("copies on node %s kept: it does not answer (%s)", name, exc)
    return dropped


def restore_copies(store: Store, home: str, recorder: NodeRecorder) -> int:
    """Write into ``recorder``, node ``home``'s new primary, the copies it lacks, with their ids: in a promotion,
    before anything else writes there (a new cell's id would pass them, and a reader with it). Returns the cells
    written.

    Raises:
        StorageUnavailableError: the new primary or a node holding copies does not answer.
    """
    heads = recorder.heads(range(store.shard_count))
    missing: list[RestoredCell] = []
    for name in store.nodes:
        holder = store.node_recorder(name)
        if name != home and holder is not None:
            missing += holder.copies_above(home, heads)
    by_key = {(c.shard, c.added_id): c for c in missing}  # two holders may keep the same copy
    cells = sorted(by_key.values(), key=lambda c: (c.shard, c.added_id))
    if cells:
        recorder.restore_cells(cells)
        logger.warning("node %s: %d acknowledged cells its new primary lacked written from their copies", home,
                       len(cells))
    return len(cells)
