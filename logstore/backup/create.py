"""``cellstream backup create``: an online backup, consistent per shard up to its watermark.

Each shard's watermark is its head when the backup starts; the backup holds every cell of the shard (every
column: dead letters and the index catalog are cells too) in ``(base, watermark]``, where the base is 0 for a
full backup and the previous backup's watermark for an incremental one (the log is append-only: exact). Writers
go on meanwhile: their cells land above the watermarks, for the next incremental backup.

The loop is resumable: the plan (watermarks) and the state file are stored first, then one cell file per range
of ``chunk_shards`` shards, then the manifest. A backup killed half-way is found unfinished by the next
``create`` at the destination, which writes only the cell files still missing, with the same watermarks.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

from logstore.backup.chunks import cell_file, count_cells, pack, unpack
from logstore.backup.manifest import (
    MANIFEST,
    PLAN,
    STATE,
    BackupFile,
    Manifest,
    Plan,
    backup_ids,
    described,
    latest,
    new_backup_id,
    read_plan,
)
from logstore.backup.state import collect_state
from logstore.backup.storage import BackupStorage
from logstore.errors import BackupError, BackupNotFoundError, InvalidArgumentError
from logstore.jobs import Throttle, ThrottleSettings
from logstore.log_blocks import LogBlock
from logstore.store import Store

logger = logging.getLogger(__name__)
CELLS_A_FILE = 100_000  # what a cell file holds about, when its shards are not given: files of a few MB to
# a few hundred, each a step of the job (a record written), and held whole in memory while written
BLOCK_IDS = 4096  # ids of a shard read at a time: a block of them stays well under the server's packet


class BackupProgress(NamedTuple):
    """How far a backup is: shards written of the shard count, and cells written so far."""

    backup_id: str
    shards_done: int
    shard_count: int
    cells: int


def create_backup(store: Store, storage: BackupStorage, *, incremental: bool = False,
                  chunk_shards: int | None = None, rate: float | None = None,
                  progress: Callable[[BackupProgress], None] | None = None) -> Manifest:
    """Back ``store`` up to ``storage`` while writers go on (or finish the unfinished backup found there).

    Args:
        store: the instance.
        storage: the destination (:func:`logstore.backup.storage.open_storage`).
        incremental: only the cells above the newest finished backup's watermarks.
        chunk_shards: shards a cell file (a new backup's; a resumed one keeps its plan's); None: as many as
            make files of about ``CELLS_A_FILE`` cells (:func:`chunk_shards_for`).
        rate: cells read a second at most (None: as fast as the nodes answer).
        progress: called after each cell file.

    Returns:
        The manifest, stored last.

    Raises:
        BackupNotFoundError: ``incremental`` without a finished backup at the destination.
        BackupError: an unfinished backup of the other kind is there, or the store's shard count is not the
            backup's.
        CorruptCellError: a cell of the store cannot be read (the backup stops; resume once it is repaired).
        StorageUnavailableError: a storage node did not answer (retriable: run the command again to resume).
    """
    if chunk_shards is not None and chunk_shards < 1:
        raise InvalidArgumentError(f"chunk_shards must be at least 1, got {chunk_shards}")
    plan = _resumed(storage, incremental) or start_backup(store, storage, incremental=incremental,
                                                          chunk_shards=chunk_shards)
    if plan.shard_count != store.shard_count:
        raise BackupError(f"backup {plan.backup_id} is of an instance of {plan.shard_count} shards, not "
                          f"{store.shard_count}")
    files: list[BackupFile] = []
    pace = Throttle(ThrottleSettings(rate=rate or None)).wait  # the jobs' token bucket (None: unlimited)
    ahead = None if rate else ReadAhead(store)
    try:
        for first, last in file_ranges(plan):
            files.append(write_cell_file(store, storage, plan, first, last, pace, ahead))
            if progress is not None:
                progress(BackupProgress(plan.backup_id, last + 1, plan.shard_count, sum(f.cells for f in files)))
    finally:
        if ahead is not None:
            ahead.close()
    return finish_backup(storage, plan, files)


def chunk_shards_for(store: Store, storage: BackupStorage, incremental: bool) -> int:
    """The shards a cell file of a new backup of ``store`` to take about ``CELLS_A_FILE`` cells (ids are dense
    but for burnt ones: an estimate from the heads, and the newest backup's watermarks for an incremental one).
    An incremental backup of a few cells is then one file, not one a fixed range of shards."""
    n = store.shard_count
    heads = store.heads()
    parent = latest(storage) if incremental else None
    bases = parent.watermarks if parent is not None and parent.shard_count == n else [0] * n
    return _shards_a_file(n, sum(max(0, heads[s] - bases[s]) for s in range(n)))


def _shards_a_file(shard_count: int, cells: int) -> int:
    return max(1, min(shard_count, shard_count * CELLS_A_FILE // max(cells, 1)))


def file_ranges(plan: Plan) -> list[tuple[int, int]]:
    """The shard range of each cell file of the backup, in order."""
    n, size = plan.shard_count, plan.chunk_shards
    return [(first, min(first + size, n) - 1) for first in range(0, n, size)]


def cell_file_name(first: int, last: int) -> str:
    return f"cells-{first:05d}-{last:05d}.bin"


def write_cell_file(store: Store, storage: BackupStorage, plan: Plan, first: int, last: int,
                    pace: Callable[[int], None] | None = None, ahead: ReadAhead | None = None) -> BackupFile:
    """Write the cell file of shards ``first``..``last`` (kept as it is when a run before wrote it: the same
    watermarks make the same cells); return its manifest entry.

    Args:
        pace: called with the cells of each round of blocks read (a throttle, a progress report).
        ahead: reads the next file's blocks while this one is stored (and gives this one's, when it read them).

    Raises:
        CorruptCellError: a cell cannot be read. StorageUnavailableError: a node did not answer (retriable).
        CorruptBackupError: the file a run before wrote does not read.
    """
    name = cell_file_name(first, last)
    where = f"{plan.backup_id}/{name}"
    if storage.exists(where):  # written before the backup was interrupted
        data = storage.get(where)
        count = count_cells(where, data)
    else:
        pace = pace or _no_pace
        blocks = ahead.take(plan, first, last) if ahead is not None else None
        if blocks is None:
            blocks = _read_range(store, plan, first, last, pace)
        else:
            pace(sum(b.cells for b in blocks))  # the throttle waits now, before the next read starts
        following = [r for r in file_ranges(plan) if r[0] == last + 1]
        if ahead is not None and following and not storage.exists(f"{plan.backup_id}/"
                                                                   f"{cell_file_name(*following[0])}"):
            ahead.start(plan, *following[0])
        data, count = cell_file(blocks), sum(b.cells for b in blocks)
        storage.put(where, data)
    return described(name, data, first_shard=first, last_shard=last, cells=count)


class ReadAhead:
    """Reads a backup's next cell file while the one before is written: the server builds the next blocks while
    this process writes, hashes and syncs a file. One file ahead at most; a read no step takes is dropped.
    Not for a throttled rate: the read ahead starts once the throttle has waited for the file before."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="backup-read-ahead")
        self._ahead: tuple[tuple[str, int, int], Future[list[LogBlock]]] | None = None

    def start(self, plan: Plan, first: int, last: int) -> None:
        """Read the blocks of shards ``first``..``last`` of ``plan`` on the read-ahead thread."""
        self._drop()
        self._ahead = ((plan.backup_id, first, last),
                       self._thread.submit(_read_range, self.store, plan, first, last, _no_pace))

    def take(self, plan: Plan, first: int, last: int) -> list[LogBlock] | None:
        """The blocks read ahead for that file (raising what their read raised), or None when none were."""
        if self._ahead is None or self._ahead[0] != (plan.backup_id, first, last):
            self._drop()
            return None
        future, self._ahead = self._ahead[1], None
        return future.result()

    def close(self) -> None:
        self._drop()
        self._thread.shutdown(wait=True)

    def _drop(self) -> None:
        if self._ahead is not None:
            future, self._ahead = self._ahead[1], None
            if not future.cancel():
                future.add_done_callback(lambda f: f.exception())  # a read no one takes: its error is not news


def _no_pace(cells: int) -> None:
    pass


def finish_backup(storage: BackupStorage, plan: Plan, files: list[BackupFile] | None = None) -> Manifest:
    """Write the manifest of a backup whose cell files are all written: ``files``, their entries, or (None)
    each file read back to describe it. Returns the manifest.

    Raises:
        BackupNotFoundError: a cell file is missing. CorruptBackupError: a file does not read.
    """
    bid = plan.backup_id
    if files is None:
        files = []
        for first, last in file_ranges(plan):
            name = cell_file_name(first, last)
            data = storage.get(f"{bid}/{name}")
            files.append(described(name, data, first_shard=first, last_shard=last,
                                   cells=count_cells(f"{bid}/{name}", data)))
    state = storage.get(f"{bid}/{STATE}")
    unpack(f"{bid}/{STATE}", state)  # a damaged state file is found now, not at restore
    total = sum(f.cells for f in files)
    manifest = Manifest(backup_id=bid, parent_id=plan.parent_id, created_at=plan.started_at,
                        finished_at=dt.datetime.now(dt.UTC), shard_count=plan.shard_count,
                        chunk_shards=plan.chunk_shards, bases=plan.bases, watermarks=plan.watermarks, cells=total,
                        files=files, state=described(STATE, state))
    storage.put(f"{bid}/{MANIFEST}", manifest.model_dump_json(indent=1).encode())
    logger.info("backup %s finished in %s: %d cells (%s)", bid, storage.where, total,
                f"incremental over {plan.parent_id}" if plan.parent_id else "full")
    return manifest


def _resumed(storage: BackupStorage, incremental: bool) -> Plan | None:
    _, unfinished = backup_ids(storage)
    if not unfinished:
        return None
    plan = read_plan(storage, unfinished[-1])
    if (plan.parent_id is not None) != incremental:
        raise BackupError(f"backup {plan.backup_id} in {storage.where} is unfinished and "
                          f"{'incremental' if plan.parent_id else 'full'}: run the same command "
                          f"{'with' if plan.parent_id else 'without'} --incremental to finish it, or delete its "
                          "folder")
    logger.info("resuming the unfinished backup %s in %s", plan.backup_id, storage.where)
    return plan


def start_backup(store: Store, storage: BackupStorage, *, incremental: bool, chunk_shards: int | None,
                 backup_id: str | None = None) -> Plan:
    """The plan of a new backup, stored with its state file (or, when ``backup_id``'s plan is stored already,
    that plan: a job's first step run again).

    Args:
        chunk_shards: shards a cell file; None: files of about ``CELLS_A_FILE`` cells.
        backup_id: the new backup's id (default: made from the time now).

    Raises:
        BackupNotFoundError: ``incremental`` without a finished backup at the destination.
        BackupError: the destination's backups are of another instance.
    """
    if backup_id is not None and storage.exists(f"{backup_id}/{PLAN}"):
        return read_plan(storage, backup_id)
    parent = latest(storage) if incremental else None
    if incremental and parent is None:
        raise BackupNotFoundError(f"no finished backup in {storage.where} to take an incremental one over: "
                                  "take a full one first")
    n = store.shard_count
    if parent is not None and parent.shard_count != n:
        raise BackupError(f"the backups in {storage.where} are of an instance of {parent.shard_count} shards, "
                          f"not {n}")
    started = dt.datetime.now(dt.UTC)
    state = collect_state(store)  # before the heads: every offset and position is then at or below them
    heads = store.heads()
    watermarks = [heads[s] for s in range(n)]
    bases = parent.watermarks if parent is not None else [0] * n
    behind = [s for s in range(n) if watermarks[s] < bases[s]]
    if behind:
        raise BackupError(f"shard {behind[0]}'s head {watermarks[behind[0]]} is below the previous backup's "
                          f"watermark {bases[behind[0]]}: these backups are of another instance")
    if chunk_shards is None:
        chunk_shards = _shards_a_file(n, sum(w - b for w, b in zip(watermarks, bases, strict=True)))
    bid = backup_id or new_backup_id(started)
    plan = Plan(backup_id=bid, parent_id=parent.backup_id if parent else None, started_at=started,
                shard_count=n, chunk_shards=chunk_shards, bases=bases, watermarks=watermarks)
    storage.put(f"{bid}/{STATE}", pack(state))
    storage.put(f"{bid}/{PLAN}", plan.model_dump_json().encode())  # last: a plan's state file is there
    logger.info("backup %s started in %s (%s)", bid, storage.where,
                f"incremental over {plan.parent_id}" if plan.parent_id else "full")
    return plan


def _read_range(store: Store, plan: Plan, first: int, last: int,
                pace: Callable[[int], None]) -> list[LogBlock]:
    """The blocks of shards ``first``..``last`` in ``(base, watermark]``, by shard then added_id, read
    ``BLOCK_IDS`` ids of every shard at a time."""
    todo = {s: plan.bases[s] for s in range(first, last + 1) if plan.watermarks[s] > plan.bases[s]}
    out: dict[int, list[LogBlock]] = {s: [] for s in todo}
    while todo:
        ranges = {s: (after, min(plan.watermarks[s], after + BLOCK_IDS)) for s, after in todo.items()}
        blocks = store.read_blocks(ranges)
        for shard, block in blocks.items():
            out[shard].append(block)
        pace(sum(b.cells for b in blocks.values()))  # once a round, not once a shard: each call asks the throttle
        todo = {s: up_to for s, (_, up_to) in ranges.items() if up_to < plan.watermarks[s]}
    return [b for s in sorted(out) for b in out[s]]
