"""Standalone mode's coordinator: one process owns every shard, offsets in a JSON file.

Like Kafka Connect's standalone mode: :class:`LocalCoordinator` keeps offsets in a
JSON file (replaced atomically, fsynced); an exclusive lock on it fences a second
process. Its publisher is :class:`tailer.publishers.directory.DirectoryPublisher`.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

from logstore.files import private_dir, private_opener
from tailer.errors import ConfigurationError
from tailer.interfaces import Claim, Coordinator, Offset

logger = logging.getLogger(__name__)


class LocalCoordinator(Coordinator):
    """Every shard belongs to this process; offsets live in ``path``."""

    def __init__(self, path: str | os.PathLike[str], shard_count: int) -> None:
        self.path = Path(path)
        self.worker_id = f"local.{os.getpid()}"
        self._shards = frozenset(range(shard_count))
        self._lock_file: IO[bytes] | None = None
        self._offsets: dict[str, dict[str, Any]] = {}

    def start(self, on_change: Callable[[], None]) -> None:
        if self._lock_file is not None:
            return
        private_dir(self.path.parent)
        lock = open(self.path.with_name(self.path.name + ".lock"), "wb",  # noqa: SIM115 - held until stop()
                    opener=private_opener)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            raise ConfigurationError(f"another tailer process is using {self.path}") from None
        self._lock_file = lock
        self._offsets = read_offsets(self.path)
        on_change()

    def stop(self) -> None:
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None

    def assignment(self) -> tuple[int, int, frozenset[int]]:
        return 1, 1, self._shards if self._lock_file is not None else frozenset()

    def lease_valid(self) -> bool:
        return self._lock_file is not None

    def is_leader(self) -> bool:
        return True

    def claim(self, shard: int, initial: Callable[[], int]) -> Claim | None:
        doc = self._offsets.get(str(shard), {})
        location = int(doc["location"]) if "location" in doc else initial()
        return Claim(shard, location, int(doc.get("version", 0)), self.worker_id, int(doc.get("deadlettered", 0)))

    def commit(self, offsets: Mapping[int, tuple[Claim, Offset]]) -> dict[int, Claim | BaseException]:
        out: dict[int, Claim | BaseException] = {}
        for shard, (claim, offset) in offsets.items():
            version = claim.version + 1
            self._offsets[str(shard)] = {"location": offset.location, "deadlettered": offset.deadlettered,
                                         "last_error": offset.last_error, "version": version}
            out[shard] = Claim(shard, claim.location, version, claim.token, offset.deadlettered)  # not _replace: slower
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.unlink(missing_ok=True)  # one a crash left keeps its mode, and the offsets would take it
        with open(tmp, "w", opener=private_opener) as fh:
            # dumps, not dump: dump encodes in Python, chunk by chunk, several times slower at many shards.
            fh.write(json.dumps({"shards": self._offsets}, separators=(",", ":")))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path)
        return out

    def release(self, claim: Claim) -> None:
        """Nothing to hand over: no other worker shares a standalone tailer."""

    def report_published(self, published: Mapping[int, int]) -> None:
        """Kept beside the offsets (``PATH.published``), replaced whole, without fsync: a crash loses only a
        report, which ``cellstream offsets`` reads only while a process holds the lock."""
        target = published_path(self.path)
        tmp = target.with_name(target.name + ".tmp")
        try:
            with open(tmp, "w", opener=private_opener) as fh:
                fh.write(json.dumps({str(shard): location for shard, location in published.items()}))
            os.replace(tmp, target)
        except OSError as exc:  # a report only: the offsets themselves are untouched
            logger.warning("cannot report the deliveries past the commits in %s: %s", target, exc)


def published_path(path: Path) -> Path:
    """Where a standalone tailer reports its deliveries past its commits (see ``report_published``)."""
    return path.with_name(path.name + ".published")


def read_offsets(path: Path) -> dict[str, dict[str, Any]]:
    """The committed offsets of a standalone tailer, by shard (as text)."""
    try:
        return dict(json.loads(path.read_text())["shards"])
    except FileNotFoundError:
        return {}
