"""Standalone mode, no servers: one process, offsets in a file, topics as directories.

Like Kafka Connect's standalone mode: :class:`LocalCoordinator` owns every shard
and keeps offsets in a JSON file (replaced atomically, fsynced); an exclusive
lock on it fences a second process. :class:`DirectoryPublisher` appends each
topic partition to ``<root>/<topic>/partition-<n>.jsonl`` and acknowledges a
message once the file holding it is fsynced. This is what ``make demo`` runs.
"""

from __future__ import annotations

import asyncio
import base64
import fcntl
import json
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any

from .errors import ConfigurationError, PublishError
from .interfaces import Claim, Coordinator, Offset, Publisher
from .messages import Message


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
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(self.path.with_name(self.path.name + ".lock"), "wb")  # noqa: SIM115 - held until stop()
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
        with open(tmp, "w") as fh:
            # dumps, not dump: dump encodes in Python, chunk by chunk (five times slower for 4096 shards).
            fh.write(json.dumps({"shards": self._offsets}, separators=(",", ":")))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path)
        return out

    def release(self, claim: Claim) -> None:
        """Nothing to hand over: no other worker shares a standalone tailer."""


def read_offsets(path: Path) -> dict[str, dict[str, Any]]:
    """The committed offsets of a standalone tailer, by shard (as text)."""
    try:
        return dict(json.loads(path.read_text())["shards"])
    except FileNotFoundError:
        return {}


class DirectoryPublisher(Publisher):
    """Topics as directories of JSON-lines partition files, acknowledged after fsync."""

    def __init__(self, root: str | os.PathLike[str], *, max_message_bytes: int = 1_000_000,
                 linger: float = 0.005) -> None:
        self.root = Path(root)
        self.max_message_bytes = max_message_bytes
        self._linger = linger
        self._files: dict[tuple[str, int], IO[str]] = {}
        self._next: dict[tuple[str, int], int] = {}
        self._buffer: list[tuple[tuple[str, int], str, asyncio.Future[Any]]] = []
        self._flusher: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._running = False

    async def start(self) -> None:
        if self._running:
            return
        self._running = True
        self.root.mkdir(parents=True, exist_ok=True)
        self._flusher = asyncio.create_task(self._flush_loop())

    async def stop(self) -> None:
        if not self._running:
            return
        self._running = False
        self._wake.set()
        if self._flusher is not None:
            await self._flusher
        for fh in self._files.values():
            fh.close()
        self._files.clear()

    async def prepare_topic(self, topic: str, partitions: int, replication_factor: int) -> None:
        folder = self.root / topic
        marker = folder / "partitions"
        if marker.exists():
            found = int(marker.read_text())
            if found != partitions:
                raise ConfigurationError(f"topic {topic} has {found} partitions, not {partitions}")
            return
        folder.mkdir(parents=True, exist_ok=True)
        marker.write_text(str(partitions))

    def refuses(self, message: Message) -> PublishError | None:
        size = len(message.value) + len(message.key)
        if size > self.max_message_bytes:
            return PublishError(f"message of {size} bytes is over the {self.max_message_bytes}-byte limit",
                                retriable=False)
        return None

    async def send(
        self, topic: str, partition: int, key: bytes, value: bytes, headers: list[tuple[str, bytes]]
    ) -> asyncio.Future[Any]:
        if not self._running:
            raise PublishError("the directory publisher is not started", retriable=True)
        refused = self.refuses(Message(key, value, headers))
        if refused is not None:
            raise refused
        kind = dict(headers).get("content-type", b"application/json")
        record = {"key": key.decode(), "headers": {k: v.decode() for k, v in headers},
                  "value": json.loads(value) if kind == b"application/json" else base64.b64encode(value).decode()}
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._buffer.append(((topic, partition), json.dumps(record, ensure_ascii=False), future))
        self._wake.set()
        return future

    async def _flush_loop(self) -> None:
        while self._running or self._buffer:
            await self._wake.wait()
            self._wake.clear()
            await asyncio.sleep(self._linger)
            batch, self._buffer = self._buffer, []
            if batch:
                await asyncio.to_thread(self._write, batch)

    def _write(self, batch: list[tuple[tuple[str, int], str, asyncio.Future[Any]]]) -> None:
        touched: set[tuple[str, int]] = set()
        results: list[tuple[asyncio.Future[Any], int]] = []
        for where, line, future in batch:
            fh = self._file(where)
            offset = self._next[where]
            self._next[where] = offset + 1
            fh.write(line + "\n")
            touched.add(where)
            results.append((future, offset))
        for where in touched:
            self._files[where].flush()
            os.fsync(self._files[where].fileno())
        for future, offset in results:
            future.get_loop().call_soon_threadsafe(_resolve, future, offset)

    def _file(self, where: tuple[str, int]) -> IO[str]:
        if where not in self._files:
            path = self.root / where[0] / f"partition-{where[1]}.jsonl"
            self._next[where] = sum(1 for _ in open(path)) if path.exists() else 0  # noqa: SIM115
            self._files[where] = open(path, "a")  # noqa: SIM115 - kept open until stop()
        return self._files[where]


def _resolve(future: asyncio.Future[Any], offset: int) -> None:
    if not future.done():
        future.set_result(offset)


def read_topic(root: str | os.PathLike[str], topic: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """(partition, record) of every message of a directory topic, partition by partition."""
    folder = Path(root) / topic
    for path in sorted(folder.glob("partition-*.jsonl"), key=lambda p: int(p.stem.split("-")[1])):
        partition = int(path.stem.split("-")[1])
        with open(path) as fh:
            for line in fh:
                yield partition, json.loads(line)
