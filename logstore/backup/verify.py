"""``cellstream backup verify``: every file of a backup read again and checked against its manifest.

A file is checked for presence, size and sha256, then read whole: a cell file's cells must lie in its shard
range, each shard's ids in ``(base, watermark]``, increasing. A restore runs the same check over the whole
chain before it writes anything.
"""

from __future__ import annotations

import logging

from logstore.backup.chunks import read_cell_file, unpack
from logstore.backup.manifest import BackupFile, Manifest, chain, sha256
from logstore.backup.storage import BackupStorage
from logstore.errors import BackupNotFoundError, CorruptBackupError

logger = logging.getLogger(__name__)


def verify_backup(storage: BackupStorage, manifest: Manifest) -> list[CorruptBackupError]:
    """The problems of one backup's files (empty: every file is whole and matches the manifest).

    Args:
        storage: the destination.
        manifest: the backup's manifest (:func:`logstore.backup.manifest.read_manifest`).

    Returns:
        One CorruptBackupError per damaged or missing file, naming it.
    """
    problems: list[CorruptBackupError] = []
    for entry in [manifest.state, *manifest.files]:
        try:
            _check_file(storage, manifest, entry)
        except CorruptBackupError as exc:
            logger.debug("%s", exc)
            problems.append(exc)
    return problems


def verify_chain(storage: BackupStorage, backup_id: str) -> tuple[list[Manifest], list[CorruptBackupError]]:
    """The chain a restore of ``backup_id`` reads (root first) and the problems of all its files.

    Raises:
        BackupNotFoundError: the backup or a parent is missing.
        CorruptBackupError: a manifest is damaged, or the chain does not line up.
    """
    manifests = chain(storage, backup_id)
    return manifests, [p for m in manifests for p in verify_backup(storage, m)]


def _check_file(storage: BackupStorage, manifest: Manifest, entry: BackupFile) -> None:
    name = f"{manifest.backup_id}/{entry.name}"
    try:
        data = storage.get(name)
    except BackupNotFoundError:
        raise CorruptBackupError(name, "missing") from None
    if len(data) != entry.size:
        raise CorruptBackupError(name, f"{len(data)} bytes, the manifest says {entry.size} (truncated?)")
    if sha256(data) != entry.sha256:
        raise CorruptBackupError(name, "its sha256 does not match the manifest's")
    if entry.first_shard is None or entry.last_shard is None:
        unpack(name, data)
        return
    blocks = read_cell_file(name, data)
    cells = sum(len(block) for _, block in blocks)
    if cells != entry.cells:
        raise CorruptBackupError(name, f"holds {cells} cells, the manifest says {entry.cells}")
    previous: tuple[int, int] = (-1, 0)
    bases, watermarks = manifest.bases, manifest.watermarks
    for shard, block in blocks:
        if not entry.first_shard <= shard <= entry.last_shard:
            raise CorruptBackupError(name, f"holds a cell of shard {shard}, outside its range")
        for cell in block:
            added_id = cell.added_id
            if not bases[shard] < added_id <= watermarks[shard]:
                raise CorruptBackupError(name, f"holds added_id {added_id} of shard {shard}, outside "
                                         f"({bases[shard]}, {watermarks[shard]}]")
            if (shard, added_id) <= previous:
                raise CorruptBackupError(name, f"its cells are out of order at shard {shard} added_id {added_id}")
            previous = (shard, added_id)
