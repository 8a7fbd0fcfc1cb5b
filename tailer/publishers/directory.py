"""Standalone mode's publisher: topics as directories, no servers.

:class:`DirectoryPublisher` appends each topic partition to
``<root>/<topic>/partition-<n>.jsonl`` and acknowledges a message once the file
holding it is fsynced; :func:`read_topic` reads one back. With
:class:`tailer.coordinators.local.LocalCoordinator` it is what ``make demo`` runs.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from tailer.errors import ConfigurationError, PublishError
from tailer.interfaces import Publisher
from tailer.messages import Message


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
