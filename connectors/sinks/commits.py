"""The Parquet lake's commit log: the files a checkpoint adds and the source positions they hold, as one step.

A writer (a connector process, or a compaction) writes its files under its own staging folder
(``<root>/_staging/<writer>/``, outside what a reader's ``<column>/date=*/*.parquet`` sees), then commits:
under the lake's lock it writes the next record ``<root>/_commits/<seq>.json`` (fsynced, renamed into
place: the commit point), then moves the files to their names in the lake. A process that dies after the
record and before the last move is rolled forward by the next one to take the lock; one that dies before the
record leaves only staged files, which go with its staging folder (nobody reads them). So a file is in the
lake exactly when a record names it, and the positions a record carries are the positions its files hold up
to: a restarted connector skips what the log says it has (:meth:`connectors.sinks.base.Sink.begin`) and
nothing is loaded twice, whatever the file names — which is what lets a file hold the cells of many shards.

Like Delta Lake's ``_delta_log``, a record holds what changed (positions moved, files added or removed); every
``STATE_EVERY`` commits a state file ``<seq>.state.json`` holds all positions, and the records before it are
pruned. A compaction commits a whole partition folder at once: its new folder is swapped with the old one by
one ``renameat2(RENAME_EXCHANGE)``, so a reader listing the partition sees the old files or the new ones,
never both (docs/connectors.md, Compaction).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import datetime as dt
import errno
import fcntl
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from connectors.errors import ConfigurationError, SinkUnavailableError
from logstore.files import private_dir, private_opener

logger = logging.getLogger(__name__)
LOG_DIR = "_commits"
STAGING_DIR = "_staging"
STATE_EVERY = 100  # records between state files: a restart reads at most this many records
_LOCK = ".lock"
_MARK = ".cellstream-commit-"  # in a swapped-in partition folder: the record that put it there
Offsets = dict[str, dict[str, int]]  # column: {partition: last position}


class AddedFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    staged: str = Field(description="where the writer wrote it, relative to the root")
    path: str = Field(description="its name in the lake, relative to the root")
    rows: int
    bytes: int


class SwappedPartition(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str = Field(description="the partition folder, relative to the root (BASE/date=2026-11-26)")
    staged: str = Field(description="the folder that replaces it; after the swap it holds the old files")


class CommitRecord(BaseModel):
    """One commit of the lake."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    seq: int
    kind: Literal["append", "compact"]
    at: dt.datetime
    writer: str
    connector: str | None = None
    source: str | None = Field(None, description="what the positions count: 'store' shards, or 'kafka' partitions")
    add: list[AddedFile] = Field(default_factory=list)
    swap: list[SwappedPartition] = Field(default_factory=list)
    offsets: Offsets = Field(default_factory=dict)

    @property
    def rows(self) -> int:
        return sum(f.rows for f in self.add)


class LakeState(BaseModel):
    """Every position committed up to ``seq`` (a state file, or the log read so far)."""

    model_config = ConfigDict(extra="forbid")

    seq: int = 0
    source: str | None = None
    offsets: Offsets = Field(default_factory=dict)
    last: CommitRecord | None = None

    def apply(self, record: CommitRecord) -> None:
        for column, positions in record.offsets.items():
            mine = self.offsets.setdefault(column, {})
            for partition, offset in positions.items():
                mine[partition] = max(offset, mine.get(partition, -1))
        if record.source is not None:
            self.source = record.source
        self.seq, self.last = record.seq, record


@dataclass(frozen=True)
class Staged:
    """A file written under a writer's staging folder, with the name it gets when committed."""

    path: Path
    final: str
    rows: int
    bytes: int


class CommitLog:
    """One writer's view of a lake's commit log: its staging folder (locked while the writer lives), the
    committed positions, and commits.

    Args:
        root: the lake's folder.
        connector: the connector's name, recorded with each commit (for operators).

    Raises:
        SinkUnavailableError: the folders cannot be created.
    """

    def __init__(self, root: Path, connector: str | None = None) -> None:
        self.root = root
        self.connector = connector
        self.writer = uuid.uuid4().hex[:12]
        self._state = LakeState()
        self._seen = -1
        try:
            private_dir(root / LOG_DIR)
            private_dir(root / STAGING_DIR / self.writer)
            # Held while this writer lives: a folder whose lock can be taken belongs to a dead writer.
            self._alive: IO[str] | None = open(  # noqa: SIM115 (held open until close())
                root / STAGING_DIR / f"{self.writer}{_LOCK}", "a", opener=private_opener)
            fcntl.flock(self._alive, fcntl.LOCK_EX | fcntl.LOCK_NB)
            with self.locked():  # what a writer that died mid-commit left is finished before anyone reads
                self._state = self.recover()
        except OSError as exc:
            raise SinkUnavailableError(f"parquet sink: cannot set up {root}: {exc}") from exc

    @property
    def staging(self) -> Path:
        """This writer's staging folder."""
        return self.root / STAGING_DIR / self.writer

    # -- reading ------------------------------------------------------------------------
    def state(self) -> LakeState:
        """The committed positions and the last record, read on from where this writer last read."""
        self._state = read_state(self.root, self._state)
        return self._state

    def committed(self, source: str, column: str, partition: int) -> int | None:
        """The last committed position of ``column`` and ``partition`` (None: none yet).

        Raises:
            ConfigurationError: the lake's positions count another source (a lake loaded from the store
                read from Kafka, or the other way round): they cannot be compared.
        """
        return self.check_source(source).offsets.get(column, {}).get(str(partition))

    def check_source(self, source: str) -> LakeState:
        """The state, read on when the log changed; ConfigurationError when its positions count another
        source than ``source``."""
        state = self.state() if self._log_changed() else self._state
        if state.source is not None and state.source != source:
            raise ConfigurationError(
                f"parquet sink: the lake under {self.root} holds positions of the {state.source}, this connector "
                f"reads the {source}: give it a new root (its positions would skip or repeat cells)")
        return state

    def _log_changed(self) -> bool:
        # A commit renames its record into the log's folder, which changes the folder's mtime: reading the
        # log once per begin() at 4096 shards would cost seconds, a stat costs microseconds.
        try:
            seen = (self.root / LOG_DIR).stat().st_mtime_ns
        except OSError:
            return True
        # A commit in the same tick of the file system's clock leaves the mtime as it was: a recent one is
        # no proof of nothing new.
        changed = seen != self._seen or time.time_ns() - seen < 100_000_000
        self._seen = seen
        return changed

    # -- committing ---------------------------------------------------------------------
    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """The lake's lock, held by one committer at a time (writers and compactions, in any process)."""
        with open(self.root / LOG_DIR / _LOCK, "a", opener=private_opener) as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def commit(self, files: list[Staged], positions: Mapping[tuple[str, int], int], source: str | None,
               *, swaps: Mapping[str, Path] | None = None,
               before_record: Callable[[], None] | None = None) -> CommitRecord | None:
        """Commit staged ``files`` with the ``positions`` they hold up to (and, for a compaction, ``swaps``:
        partition folder -> the staged folder that replaces it). Nothing to commit: None.

        ``before_record`` runs holding the lake's lock, before the record is written (a compaction links in
        the files committed to its partition since it read it).

        Raises:
            SinkUnavailableError: the lake could not be written (nothing was committed unless the record was
                written: then the next committer finishes the moves).
        """
        if not files and not positions and not swaps:
            return None
        offsets: Offsets = {}
        for (column, partition), offset in positions.items():
            offsets.setdefault(column, {})[str(partition)] = offset
        try:
            with self.locked():
                state = self.recover()
                if before_record is not None:
                    before_record()
                record = CommitRecord(
                    seq=state.seq + 1, kind="compact" if swaps else "append", at=dt.datetime.now(dt.UTC),
                    writer=self.writer, connector=self.connector, source=source if positions else None,
                    add=[AddedFile(staged=str(f.path.relative_to(self.root)), path=f.final, rows=f.rows,
                                   bytes=f.bytes) for f in files],
                    swap=[SwappedPartition(path=path, staged=str(staged.relative_to(self.root)))
                          for path, staged in (swaps or {}).items()],
                    offsets=offsets)
                for swap in record.swap:
                    (self.root / swap.staged / f"{_MARK}{record.seq}").touch()
                    _sync_dir(self.root / swap.staged)
                _write_json(self.root / LOG_DIR / f"{record.seq:020d}.json", record.model_dump_json())
                _apply(self.root, record)
                state.apply(record)
                if record.seq % STATE_EVERY == 0:
                    self._save_state(state)
                self._state = state
                return record
        except OSError as exc:
            raise SinkUnavailableError(f"parquet sink: committing under {self.root} failed: {exc}") from exc

    def recover(self) -> LakeState:
        """Roll the log's last records forward (a committer that died mid-way) and remove the staging folders
        of dead writers. Call it holding :meth:`locked`; returns the state it read."""
        state = read_state(self.root, self._state, roll_forward=True)
        staging = self.root / STAGING_DIR
        for lock in staging.glob(f"*{_LOCK}"):
            writer = lock.name[:-len(_LOCK)]
            if writer == self.writer:
                continue
            with open(lock, "a") as handle:
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # alive
                logger.info("parquet sink: removing %s, staged by a writer that stopped", staging / writer)
                shutil.rmtree(staging / writer, ignore_errors=True)
                lock.unlink(missing_ok=True)
        return state

    def _save_state(self, state: LakeState) -> None:
        saved = LakeState(seq=state.seq, source=state.source, offsets=state.offsets, last=state.last)
        _write_json(self.root / LOG_DIR / f"{state.seq:020d}.state.json", saved.model_dump_json())
        for path in (self.root / LOG_DIR).glob("*.json"):
            seq = int(path.name.split(".")[0])
            if seq < state.seq or (seq == state.seq and not path.name.endswith(".state.json")):
                path.unlink(missing_ok=True)

    def close(self) -> None:
        """Give up this writer: its staging folder goes (what it held was never committed)."""
        if self._alive is None:
            return
        shutil.rmtree(self.staging, ignore_errors=True)
        with contextlib.suppress(OSError):
            (self.root / STAGING_DIR / f"{self.writer}{_LOCK}").unlink()
        self._alive.close()
        self._alive = None


def read_state(root: Path, since: LakeState | None = None, *, roll_forward: bool = False) -> LakeState:
    """The lake's committed state: the newest state file (unless ``since`` is newer) and the records after it.

    Args:
        root: the lake's folder.
        since: a state read before; only records after it are read.
        roll_forward: finish the moves and swaps of the newest record (the caller holds the lake's lock).

    Returns:
        The state (``seq`` 0 for a lake nothing was committed to).

    Raises:
        SinkUnavailableError: a record cannot be read.
    """
    state = since.model_copy(deep=True) if since is not None else LakeState()
    log = root / LOG_DIR
    try:
        names = sorted(p.name for p in log.glob("*.json")) if log.is_dir() else []
        states = [n for n in names if n.endswith(".state.json")]
        if states and int(states[-1].split(".")[0]) > state.seq:
            state = LakeState.model_validate_json((log / states[-1]).read_bytes())
        records = [n for n in names if not n.endswith(".state.json") and int(n.split(".")[0]) > state.seq]
        for name in records:
            state.apply(CommitRecord.model_validate_json((log / name).read_bytes()))
        # Only the newest can be unfinished: every committer finishes it first, holding the lock. It may
        # have been read before (``since``) while unfinished: finished whether read now or then.
        if roll_forward and state.last is not None:
            _apply(root, state.last)
    except (OSError, ValidationError, ValueError) as exc:
        raise SinkUnavailableError(f"parquet sink: cannot read the commit log under {log}: {exc}") from exc
    return state


def _apply(root: Path, record: CommitRecord) -> None:
    """Do what ``record`` commits; idempotent (a move done, a swap done, are left as they are)."""
    folders: set[Path] = set()
    for added in record.add:
        staged, final = root / added.staged, root / added.path
        if staged.exists():
            private_dir(final.parent)
            os.replace(staged, final)
            folders.add(final.parent)
        elif not final.exists():
            logger.error("parquet sink: commit %d names %s, which is neither staged nor in the lake",
                         record.seq, added.path)
    for swap in record.swap:
        path, staged = root / swap.path, root / swap.staged
        if staged.exists() and (staged / f"{_MARK}{record.seq}").exists():
            exchange(staged, path)
            folders.add(path.parent)
        with contextlib.suppress(FileNotFoundError):
            (path / f"{_MARK}{record.seq}").unlink()  # done: the marker's work is over
        shutil.rmtree(staged, ignore_errors=True)  # the old files, now at the staged name
    for folder in folders:
        _sync_dir(folder)


_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def exchange(a: Path, b: Path) -> None:
    """Swap two folders atomically (Linux ``renameat2(RENAME_EXCHANGE)``: ext4, xfs, btrfs, tmpfs)."""
    if _libc.renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        code = ctypes.get_errno()
        if code == errno.EINVAL:
            raise OSError(code, "the lake's file system cannot swap two folders atomically "
                                "(renameat2 RENAME_EXCHANGE): compaction needs ext4, xfs, btrfs or tmpfs", str(b))
        raise OSError(code, os.strerror(code), str(b))


def _write_json(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    with open(temporary, "w", opener=private_opener) as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    _sync_dir(path.parent)


def _sync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
