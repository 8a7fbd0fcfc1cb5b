"""A backup's manifest: what it holds and how to check it, written last (a backup without one is unfinished).

A backup ``ID`` at a destination is the objects ``ID/...``: its plan (``ID/plan.json``, the watermarks, written
first so an interrupted backup resumes with the same ones), its cell files (``ID/cells-FIRST-LAST.bin``, one per
range of shards), its state file (``ID/state.bin``: nodes, shard map, consumer offsets, index specs) and
``ID/manifest.json``, which names each file with its size and sha256. An incremental backup names its parent and
holds, per shard, the cells in ``(parent watermark, watermark]``; a restore follows the chain to its full root.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import secrets

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from logstore.backup.storage import BackupStorage
from logstore.errors import BackupNotFoundError, CorruptBackupError

FORMAT_VERSION = 2  # 2: cell files of log blocks, the stored bodies as they are (1: MessagePack rows)
MANIFEST = "manifest.json"
PLAN = "plan.json"
STATE = "state.bin"


class BackupFile(BaseModel):
    """One immutable file of a backup: its name (under the backup's folder), size and sha256."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    size: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    first_shard: int | None = None  # a cell file's range of shards; None for the state file
    last_shard: int | None = None
    cells: int = 0


class Plan(BaseModel):
    """What a backup takes, fixed when it starts: per shard, the cells in ``(bases[s], watermarks[s]]``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format_version: int = FORMAT_VERSION
    backup_id: str
    parent_id: str | None
    started_at: dt.datetime
    shard_count: int = Field(ge=1)
    chunk_shards: int = Field(ge=1)
    bases: list[int]
    watermarks: list[int]

    @model_validator(mode="after")
    def _consistent(self) -> Plan:
        _check_marks(self.shard_count, self.bases, self.watermarks)
        return self


class Manifest(BaseModel):
    """A finished backup (the plan's fields, and its files with their checksums)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format_version: int = FORMAT_VERSION
    backup_id: str
    parent_id: str | None
    created_at: dt.datetime  # when it started: its watermarks are the shards' heads then
    finished_at: dt.datetime
    shard_count: int = Field(ge=1)
    chunk_shards: int = Field(ge=1)
    bases: list[int]
    watermarks: list[int]
    cells: int
    files: list[BackupFile]
    state: BackupFile

    @model_validator(mode="after")
    def _consistent(self) -> Manifest:
        _check_marks(self.shard_count, self.bases, self.watermarks)
        for f in self.files:
            first, last = f.first_shard, f.last_shard
            if first is None or last is None or not 0 <= first <= last < self.shard_count:
                raise ValueError(f"file {f.name}: its shard range is not one of the instance's")
        return self

    @property
    def incremental(self) -> bool:
        return self.parent_id is not None


def _check_marks(shard_count: int, bases: list[int], watermarks: list[int]) -> None:
    if not len(bases) == len(watermarks) == shard_count:
        raise ValueError(f"bases and watermarks must hold {shard_count} shards each")
    if any(not 0 <= b <= w for b, w in zip(bases, watermarks, strict=True)):
        raise ValueError("a base is above its watermark, or below 0")


def new_backup_id(now: dt.datetime) -> str:
    """A backup id that sorts by time, to the microsecond: ``20261127T063500.123456Z-a1b2c3``."""
    return f"{now.astimezone(dt.UTC):%Y%m%dT%H%M%S.%fZ}-{secrets.token_hex(3)}"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def described(name: str, data: bytes, **fields: int | None) -> BackupFile:
    """The manifest's entry of a file about to be stored as ``name``."""
    return BackupFile(name=name, size=len(data), sha256=sha256(data), **fields)


def read_manifest(storage: BackupStorage, backup_id: str) -> Manifest:
    """The manifest of ``backup_id``.

    Raises:
        BackupNotFoundError: no finished backup by that id at the destination.
        CorruptBackupError: the manifest does not parse, or is of an unknown format version.
    """
    name = f"{backup_id}/{MANIFEST}"
    try:
        data = storage.get(name)
    except BackupNotFoundError:
        raise BackupNotFoundError(f"no finished backup {backup_id!r} in {storage.where}") from None
    try:
        manifest = Manifest.model_validate_json(data)
    except ValidationError as exc:
        raise CorruptBackupError(name, f"not a manifest ({exc.errors()[0]['msg']})") from None
    if manifest.format_version != FORMAT_VERSION:
        raise CorruptBackupError(name, f"unknown format version {manifest.format_version}")
    return manifest


def read_plan(storage: BackupStorage, backup_id: str) -> Plan:
    """The plan of a started backup (BackupNotFoundError when none; CorruptBackupError when it does not parse)."""
    name = f"{backup_id}/{PLAN}"
    data = storage.get(name)
    try:
        plan = Plan.model_validate_json(data)
    except ValidationError as exc:
        raise CorruptBackupError(name, f"not a backup plan ({exc.errors()[0]['msg']})") from None
    if plan.format_version != FORMAT_VERSION:
        raise CorruptBackupError(name, f"unknown format version {plan.format_version}: delete the unfinished "
                                 "backup's folder and take a new one")
    return plan


def backup_ids(storage: BackupStorage) -> tuple[list[str], list[str]]:
    """(finished, unfinished) backup ids at the destination, oldest first."""
    finished, started = set(), set()
    for name in storage.names():
        folder, _, leaf = name.partition("/")
        if leaf == MANIFEST:
            finished.add(folder)
        elif leaf == PLAN:
            started.add(folder)
    return sorted(finished), sorted(started - finished)


def newest_id(storage: BackupStorage) -> str:
    """The id of the newest finished backup at the destination.

    Raises:
        BackupNotFoundError: none is finished there.
    """
    finished, _ = backup_ids(storage)
    if not finished:
        raise BackupNotFoundError(f"no finished backup in {storage.where}")
    return finished[-1]


def latest(storage: BackupStorage) -> Manifest | None:
    """The newest finished backup at the destination (the parent of an incremental one), or None."""
    finished, _ = backup_ids(storage)
    return read_manifest(storage, finished[-1]) if finished else None


def chain(storage: BackupStorage, backup_id: str) -> list[Manifest]:
    """The backups a restore of ``backup_id`` reads: its full root first, ``backup_id`` last.

    Raises:
        BackupNotFoundError: the backup, or a parent on its chain, is not at the destination.
        CorruptBackupError: a manifest does not parse, or the chain does not line up (a parent's watermarks are
            not the child's bases, or the shard counts differ).
    """
    out = [read_manifest(storage, backup_id)]
    while (parent_id := out[-1].parent_id) is not None:
        child = out[-1]
        if any(m.backup_id == parent_id for m in out):
            raise CorruptBackupError(f"{child.backup_id}/{MANIFEST}", "its chain of parents loops")
        parent = read_manifest(storage, parent_id)
        if parent.shard_count != child.shard_count or parent.watermarks != child.bases:
            raise CorruptBackupError(f"{child.backup_id}/{MANIFEST}", f"does not continue its parent "
                                     f"{parent.backup_id} (shard count or watermarks differ)")
        out.append(parent)
    return out[::-1]
