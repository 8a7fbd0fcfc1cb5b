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
import time
from collections.abc import Callable
from typing import NamedTuple

from logstore.backup.chunks import pack, pack_cells, unpack, unpack_rows
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
from logstore.cell import PackedCell
from logstore.errors import BackupError, BackupNotFoundError, CorruptCellError, InvalidArgumentError
from logstore.store import Store

logger = logging.getLogger(__name__)
CHUNK_SHARDS = 256
PAGE = 5000


class BackupProgress(NamedTuple):
    """How far a backup is: shards written of the shard count, and cells written so far."""

    backup_id: str
    shards_done: int
    shard_count: int
    cells: int


def create_backup(store: Store, storage: BackupStorage, *, incremental: bool = False,
                  chunk_shards: int = CHUNK_SHARDS, rate: float | None = None,
                  progress: Callable[[BackupProgress], None] | None = None) -> Manifest:
    """Back ``store`` up to ``storage`` while writers go on (or finish the unfinished backup found there).

    Args:
        store: the instance.
        storage: the destination (:func:`logstore.backup.storage.open_storage`).
        incremental: only the cells above the newest finished backup's watermarks.
        chunk_shards: shards a cell file (a new backup's; a resumed one keeps its plan's).
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
    if chunk_shards < 1:
        raise InvalidArgumentError(f"chunk_shards must be at least 1, got {chunk_shards}")
    plan = _resumed(storage, incremental) or start_backup(store, storage, incremental=incremental,
                                                          chunk_shards=chunk_shards)
    if plan.shard_count != store.shard_count:
        raise BackupError(f"backup {plan.backup_id} is of an instance of {plan.shard_count} shards, not "
                          f"{store.shard_count}")
    files: list[BackupFile] = []
    pace = _Pace(rate)
    for first, last in file_ranges(plan):
        files.append(write_cell_file(store, storage, plan, first, last, pace))
        if progress is not None:
            progress(BackupProgress(plan.backup_id, last + 1, plan.shard_count, sum(f.cells for f in files)))
    return finish_backup(storage, plan, files)


def file_ranges(plan: Plan) -> list[tuple[int, int]]:
    """The shard range of each cell file of the backup, in order."""
    n, size = plan.shard_count, plan.chunk_shards
    return [(first, min(first + size, n) - 1) for first in range(0, n, size)]


def cell_file_name(first: int, last: int) -> str:
    return f"cells-{first:05d}-{last:05d}.bin"


def write_cell_file(store: Store, storage: BackupStorage, plan: Plan, first: int, last: int,
                    pace: Callable[[int], None] | None = None) -> BackupFile:
    """Write the cell file of shards ``first``..``last`` (kept as it is when a run before wrote it: the same
    watermarks make the same cells); return its manifest entry.

    Args:
        pace: called with the cells of each page read (a throttle, a progress report).

    Raises:
        CorruptCellError: a cell cannot be read. StorageUnavailableError: a node did not answer (retriable).
        CorruptBackupError: the file a run before wrote does not read.
    """
    name = cell_file_name(first, last)
    where = f"{plan.backup_id}/{name}"
    if storage.exists(where):  # written before the backup was interrupted
        data = storage.get(where)
        count = len(unpack_rows(where, data))
    else:
        cells = _read_range(store, plan, first, last, pace or (lambda n: None))
        data, count = pack_cells(cells), len(cells)
        storage.put(where, data)
    return described(name, data, first_shard=first, last_shard=last, cells=count)


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
                                   cells=len(unpack_rows(f"{bid}/{name}", data))))
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


def start_backup(store: Store, storage: BackupStorage, *, incremental: bool, chunk_shards: int,
                 backup_id: str | None = None) -> Plan:
    """The plan of a new backup, stored with its state file (or, when ``backup_id``'s plan is stored already,
    that plan: a job's first step run again).

    Args:
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
    bid = backup_id or new_backup_id(started)
    plan = Plan(backup_id=bid, parent_id=parent.backup_id if parent else None, started_at=started,
                shard_count=n, chunk_shards=chunk_shards, bases=bases, watermarks=watermarks)
    storage.put(f"{bid}/{STATE}", pack(state))
    storage.put(f"{bid}/{PLAN}", plan.model_dump_json().encode())  # last: a plan's state file is there
    logger.info("backup %s started in %s (%s)", bid, storage.where,
                f"incremental over {plan.parent_id}" if plan.parent_id else "full")
    return plan


class _Pace:
    """Sleeps to keep the cells read at ``rate`` a second at most."""

    def __init__(self, rate: float | None) -> None:
        self.rate = rate
        self.start = time.monotonic()
        self.cells = 0

    def __call__(self, cells: int) -> None:
        if not self.rate:
            return
        self.cells += cells
        ahead = self.cells / self.rate - (time.monotonic() - self.start)
        if ahead > 0:
            time.sleep(ahead)


def _read_range(store: Store, plan: Plan, first: int, last: int,
                pace: Callable[[int], None]) -> list[PackedCell]:
    """The cells of shards ``first``..``last`` in ``(base, watermark]``, by shard then added_id, read a page
    of every shard at a time through the store's paged reads."""
    todo = {s: plan.bases[s] for s in range(first, last + 1) if plan.watermarks[s] > plan.bases[s]}
    out: dict[int, list[PackedCell]] = {s: [] for s in todo}
    while todo:
        pages = store.read_pages(todo, PAGE, packed=True).decode()
        for shard in list(todo):
            page = pages.get(shard, [])
            if isinstance(page, CorruptCellError):
                raise page
            mark = plan.watermarks[shard]
            cells = [c for c in page if c.added_id <= mark]
            out[shard] += cells  # type: ignore[arg-type]
            pace(len(cells))
            if not page or page[-1].added_id >= mark:
                del todo[shard]
            else:
                todo[shard] = page[-1].added_id
    return [c for s in sorted(out) for c in out[s]]
