"""``cellstream restore``: a backup (and the chain of backups it continues) written into an empty instance with
the same shard count and the same added_ids, so consumer offsets, index positions and dead-letter coordinates
stay valid.

Everything is checked before anything is written: the whole chain's files (:mod:`logstore.backup.verify`) and
the target's emptiness. Cells go in shard by shard in id order (:meth:`NodeRecorder.restore_cells
<logstore.persistence.NodeRecorder.restore_cells>`), then the consumers' offsets, then the index versions'
tables (empty: they are rebuilt from the restored cells, see docs/operations.md "Backup and restore").

``until`` keeps exactly the cells created at or before it: ``created_at`` never decreases along a shard's ids,
so what is kept is a prefix of each shard's log, and ids stay dense. An offset beyond what a shard then holds is
brought back to the shard's restored head: the cells above it are new ones, which its consumer must not skip.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

from logstore.backup.chunks import read_cell_file, unpack
from logstore.backup.manifest import Manifest, newest_id
from logstore.backup.state import index_specs
from logstore.backup.storage import BackupStorage
from logstore.backup.verify import verify_chain
from logstore.errors import (
    BackupError,
    CorruptBackupError,
    InvalidArgumentError,
    RestoreTargetNotEmptyError,
)
from logstore.index_tables.persistence import IndexSpec
from logstore.log_blocks import created_text, created_time
from logstore.persistence import RestoredCell
from logstore.store import Store

logger = logging.getLogger(__name__)
BATCH = 5000  # cells a transaction


class RestoreProgress(NamedTuple):
    """Cells restored so far, and the cells of the files read so far (an upper bound of the total)."""

    files_done: int
    files: int
    cells: int


class RestoreReport(NamedTuple):
    """What a restore did."""

    backup_id: str
    chain: list[str]  # the backups read, full root first
    cells: int
    heads: dict[int, int]  # each restored shard's head
    consumers: int
    offsets_lowered: int  # offsets brought back to a shard's restored head (``until``)
    indexes: list[IndexSpec]  # versions whose tables were created, to rebuild


def verified_chain(storage: BackupStorage, backup_id: str | None = None) -> list[Manifest]:
    """The chain a restore of ``backup_id`` (default: the newest finished backup) reads, root first, every file
    of it read and checked: what a restore checks before it opens its target.

    Raises:
        BackupNotFoundError: no such backup, or a parent of it is missing.
        CorruptBackupError: a file of the chain is missing, truncated or damaged (the first one named).
    """
    manifests, problems = verify_chain(storage, backup_id or newest_id(storage))
    if problems:
        more = f" (and {len(problems) - 1} more damaged files: run backup verify)" if len(problems) > 1 else ""
        raise CorruptBackupError(problems[0].name, f"{problems[0].problem}; nothing was restored{more}")
    return manifests


def restore(storage: BackupStorage, target: Store, *, backup_id: str | None = None,
            verified: list[Manifest] | None = None, until: dt.datetime | None = None,
            shards: tuple[int, int] | None = None,
            progress: Callable[[RestoreProgress], None] | None = None) -> RestoreReport:
    """Restore a backup into ``target``.

    Args:
        storage: where the backup is.
        target: an empty instance of the backup's shard count (same added_ids: its cells must be none).
        backup_id: the backup (default: the newest finished one); an incremental one brings its chain.
        verified: the backup's chain as :func:`verified_chain` gave it (its files are then not read twice).
        until: keep only the cells with ``created_at <= until`` (timezone-aware).
        shards: restore only shards ``first``..``last`` (inclusive).
        progress: called after each file.

    Returns:
        The report.

    Raises:
        BackupNotFoundError: no such backup, or a parent of it is missing.
        CorruptBackupError: a file of the chain is missing, truncated or damaged (nothing written).
        RestoreTargetNotEmptyError: the target holds cells in the shards to restore, or offsets (nothing
            written).
        BackupError: the target's shard count is not the backup's (nothing written).
        InvalidArgumentError: a naive ``until``, or a shard range outside the instance.
    """
    if until is not None and (until.tzinfo is None or until.utcoffset() is None):
        raise InvalidArgumentError("until must be a timezone-aware time")
    manifests = verified if verified is not None else verified_chain(storage, backup_id)
    newest = manifests[-1]
    backup_id = newest.backup_id
    n = newest.shard_count
    if target.shard_count != n:
        raise BackupError(f"backup {backup_id} is of {n} shards; the target has {target.shard_count}")
    first, last = shards if shards is not None else (0, n - 1)
    if not 0 <= first <= last < n:
        raise InvalidArgumentError(f"shards {first}-{last} are not a range of the instance's 0-{n - 1}")
    state: dict[str, Any] = unpack(f"{newest.backup_id}/{newest.state.name}",
                                   storage.get(f"{newest.backup_id}/{newest.state.name}"))
    _check_empty(target, first, last, whole=shards is None)

    heads: dict[int, int] = dict.fromkeys(range(first, last + 1), 0)
    wanted = [(m, f) for m in manifests for f in m.files
              if f.first_shard is not None and f.last_shard is not None
              and f.first_shard <= last and f.last_shard >= first]
    restored = 0
    writers = _NodeWriters(target)
    try:
        for done, (manifest, entry) in enumerate(wanted, 1):
            restored += _restore_file(storage, target, writers, manifest, entry.name, first, last, until, heads)
            if progress is not None:
                progress(RestoreProgress(done, len(wanted), restored))
    finally:
        writers.close()
    consumers, lowered = _restore_offsets(target, state, heads)
    specs = index_specs(state)
    for spec in specs:
        target.indexes.create(spec)
    logger.info("restored backup %s (%d in its chain): %d cells in shards %d-%d, %d consumers' offsets, %d index "
                "versions to rebuild", backup_id, len(manifests), restored, first, last, consumers, len(specs))
    return RestoreReport(backup_id, [m.backup_id for m in manifests], restored, heads, consumers, lowered, specs)


def _check_empty(target: Store, first: int, last: int, whole: bool) -> None:
    heads = target.heads(range(first, last + 1))
    full = [s for s, h in heads.items() if h]
    if full:
        raise RestoreTargetNotEmptyError(f"the target holds cells in {len(full)} of the shards to restore (shard "
                                         f"{full[0]} up to added_id {heads[full[0]]}): restore into an empty "
                                         "instance; nothing was written")
    if whole:
        target.check_direct("a restore")
        names = target.consumers()
        if names:
            raise RestoreTargetNotEmptyError(f"the target holds the offsets of {len(names)} consumers (such as "
                                             f"{sorted(names)[0]!r}): restore into an empty instance; nothing was "
                                             "written")


class _NodeWriters:
    """Each node's batches written by ``DEPTH`` threads of the node's own while the next batch is built: the
    server inserts one batch while a thread builds the SQL of another and this process decodes (a thread
    waiting on its socket lets go of the GIL). Batches sharing a shard are written one after the other, in
    order: a shard's ids go in ascending."""

    DEPTH = 2

    def __init__(self, target: Store) -> None:
        self.target = target
        self.threads: dict[str, ThreadPoolExecutor] = {}
        self.in_flight: dict[str, list[tuple[Future[None], set[int]]]] = {}

    def write(self, node: str, batch: list[RestoredCell]) -> None:
        """Queue ``batch`` for ``node``, once no batch in flight shares a shard with it and fewer than ``DEPTH``
        are (raising what a batch waited for raised)."""
        shards = {c.shard for c in batch}
        flying = self.in_flight.setdefault(node, [])
        while flying and (len(flying) >= self.DEPTH or any(shards & s for _, s in flying)):
            flying.pop(0)[0].result()
        recorder = self.target.node_recorder(node)
        if recorder is None:  # the map names it: it is open
            raise BackupError(f"storage node {node} of the target is not open")
        if node not in self.threads:
            self.threads[node] = ThreadPoolExecutor(max_workers=self.DEPTH, thread_name_prefix=f"restore-{node}")
        flying.append((self.threads[node].submit(recorder.restore_cells, batch), shards))

    def close(self) -> None:
        """Wait for every batch in flight; raise the first error any of them met."""
        try:
            for flying in self.in_flight.values():
                for future, _ in flying:
                    future.result()
        finally:
            for thread in self.threads.values():
                thread.shutdown(wait=True)


def _restore_file(storage: BackupStorage, target: Store, writers: _NodeWriters, manifest: Manifest, name: str,
                  first: int, last: int, until: dt.datetime | None, heads: dict[int, int]) -> int:
    where = f"{manifest.backup_id}/{name}"
    blocks = read_cell_file(where, storage.get(where))  # checked whole by the verification: nothing fails here
    cutoff = None if until is None else created_text(until)  # the texts sort as the times
    node_of = target.placement()
    batches: dict[str, list[RestoredCell]] = {}
    written = 0
    for shard, cells in blocks:
        if not first <= shard <= last:
            continue
        node = node_of[shard]
        batch = batches.setdefault(node, [])
        for c in cells:
            if cutoff is not None and c.created > cutoff:
                continue
            batch.append(RestoredCell(shard, c.added_id, uuid.UUID(bytes=c.row_key), c.column, c.ref_key, c.blob,
                                      created_time(c.created)))
            heads[shard] = c.added_id
        if len(batch) >= BATCH:
            writers.write(node, batches.pop(node))
            written += len(batch)
    for node, batch in batches.items():
        if batch:
            writers.write(node, batch)
            written += len(batch)
    return written


def _restore_offsets(target: Store, state: dict[str, Any], heads: dict[int, int]) -> tuple[int, int]:
    """Each consumer's offsets of the restored shards, with their owners and docs; an offset past its shard's
    restored head lowered to it. Returns (consumers, offsets lowered)."""
    consumers = lowered = 0
    for consumer, records in sorted(state.get("consumers", {}).items()):
        by_owner: dict[str, dict[int, tuple[int | None, dict[str, Any]]]] = {}
        for shard, location, owner, doc in records:
            if shard not in heads:
                continue
            if location is not None and location > heads[shard]:
                location, lowered = heads[shard], lowered + 1
            by_owner.setdefault(owner, {})[shard] = (location, json.loads(doc))
        for owner, offsets in sorted(by_owner.items()):
            target.claim_offsets(consumer, owner, sorted(offsets))
            committed = {s: (loc, doc) for s, (loc, doc) in offsets.items() if loc is not None}
            if committed:
                target.commit_offsets(consumer, owner, committed)
        consumers += bool(by_owner)
    return consumers, lowered
