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
import logging
import os
import weakref
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

from logstore.files import private_dir, private_opener
from tailer.errors import PublishError, TopicPartitionsError
from tailer.interfaces import Publisher
from tailer.messages import Message

logger = logging.getLogger(__name__)


class DirectoryPublisher(Publisher):
    """Topics as directories of JSON-lines partition files, acknowledged after fsync."""

    def __init__(self, root: str | os.PathLike[str], *, max_message_bytes: int = 1_000_000,
                 linger: float = 0.005) -> None:
        self.root = Path(root)
        self.max_message_bytes = max_message_bytes
        self._linger = linger
        self._files: dict[tuple[str, int], IO[str]] = {}
        self._next: dict[tuple[str, int], int] = {}
        self._buffer: list[tuple[tuple[str, int], list[str], asyncio.Future[Any]]] = []
        self._waiting: dict[tuple[str, int], tuple[list[str], asyncio.Future[Any]]] = {}  # a partition's entry
        self._flusher: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._running = False
        self._syncs: ThreadPoolExecutor | None = None
        # A partition whose write failed takes nothing more until the worker has seen the failure (after_failure),
        # as Kafka's idempotent producer refuses a partition's later batches: nothing sent after the failed
        # messages may be written before they are sent again.
        self._broken: dict[tuple[str, int], PublishError] = {}
        self._failed_in: weakref.WeakKeyDictionary[asyncio.Future[Any], tuple[str, int]] = (
            weakref.WeakKeyDictionary())

    async def start(self) -> None:
        if self._running:
            return
        self._running = True
        private_dir(self.root)
        # The files a write touched are fsynced side by side: ext4 commits its journal once for fsyncs that
        # wait together, and with many shards a write holds cells of every partition.
        self._syncs = ThreadPoolExecutor(max_workers=16, thread_name_prefix="topic-fsync")
        self._flusher = asyncio.create_task(self._flush_loop())

    async def stop(self) -> None:
        if not self._running:
            return
        self._running = False
        self._wake.set()
        if self._flusher is not None:
            await self._flusher
        if self._syncs is not None:
            self._syncs.shutdown()
            self._syncs = None
        for fh in self._files.values():
            fh.close()
        self._files.clear()

    async def __aenter__(self) -> DirectoryPublisher:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def prepare_topic(self, topic: str, partitions: int, replication_factor: int) -> None:
        folder = self.root / topic
        marker = folder / "partitions"
        if marker.exists():
            found = int(marker.read_text())
            if found != partitions:
                raise TopicPartitionsError(topic, found, partitions,
                                           f"Once what it holds is read, delete the folder {folder} and the tailer "
                                           f"creates it again; or run the tailer with --partitions {found} if every "
                                           f"topic of its prefix has {found}.")
            return
        private_dir(folder)
        with open(marker, "w", opener=private_opener) as fh:
            fh.write(str(partitions))

    def refuses(self, message: Message) -> PublishError | None:
        size = len(message.value) + len(message.key)
        if size > self.max_message_bytes:
            return PublishError(f"message of {size} bytes is over the {self.max_message_bytes}-byte limit",
                                retriable=False)
        return None

    async def send(
        self, topic: str, partition: int, key: bytes, value: bytes, headers: list[tuple[str, bytes]]
    ) -> asyncio.Future[Any]:
        return self._queue((topic, partition), [Message(key, value, headers)])

    async def send_many(
        self, topic: str, partition: int, messages: Sequence[Message]
    ) -> list[tuple[asyncio.Future[Any], int]]:
        """The messages join the partition's lines waiting for the next write: one future for all of them."""
        return [(self._queue((topic, partition), messages), len(messages))] if messages else []

    def _queue(self, where: tuple[str, int], messages: Sequence[Message]) -> asyncio.Future[Any]:
        if not self._running:
            raise PublishError("the directory publisher is not started", retriable=True)
        if where in self._broken:
            return self._fail(where, asyncio.get_running_loop().create_future(), self._broken[where])
        lines = []
        for message in messages:
            refused = self.refuses(message)
            if refused is not None:
                raise refused
            key, value, headers = message
            kind = dict(headers).get("content-type", b"application/json")
            record = {"key": key.decode(), "headers": {k: v.decode() for k, v in headers},
                      "value": json.loads(value) if kind == b"application/json" else base64.b64encode(value).decode()}
            lines.append(json.dumps(record, ensure_ascii=False))
        waiting = self._waiting.get(where)
        if waiting is not None:  # written and fsynced together: settled together (as a Kafka record batch)
            waiting[0].extend(lines)
            return waiting[1]
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting[where] = (lines, future)
        self._buffer.append((where, lines, future))
        self._wake.set()
        return future

    async def _flush_loop(self) -> None:
        while self._running or self._buffer:
            await self._wake.wait()
            self._wake.clear()
            await asyncio.sleep(self._linger)
            batch, self._buffer = self._buffer, []
            self._waiting.clear()
            if batch:
                await self._flush(batch)

    async def _flush(self, batch: list[tuple[tuple[str, int], list[str], asyncio.Future[Any]]]) -> None:
        """Write and fsync; a file that fails (a full disk) is cut back and its messages fail, retriable: the
        worker backs off and sends them again. The other files' messages are acknowledged."""
        before: dict[tuple[str, int], tuple[int, int]] = {}  # each file's size and next offset before the write
        failed: dict[tuple[str, int], BaseException] = {}
        offsets: list[int] = []
        try:
            offsets = await asyncio.to_thread(self._write, batch, before)
        except OSError as exc:
            failed = {where: exc for where, _lines, _future in batch}
        else:
            loop = asyncio.get_running_loop()
            synced = await asyncio.gather(*(loop.run_in_executor(self._syncs, os.fsync, self._files[where].fileno())
                                            for where in before), return_exceptions=True)
            failed = {where: outcome for where, outcome in zip(before, synced, strict=True)
                      if isinstance(outcome, BaseException)}
        if failed:
            await asyncio.to_thread(self._undo, {where: before[where] for where in failed if where in before})
        for where, cause in failed.items():
            self._broken[where] = PublishError(f"cannot write {where[0]}[{where[1]}]: {cause}", retriable=True)
        for at, (where, _lines, future) in enumerate(batch):
            if where in failed:
                self._fail(where, future, self._broken[where])
            elif not future.done():
                future.set_result(offsets[at])
        if failed:  # what was queued for those partitions meanwhile fails with them
            kept = [entry for entry in self._buffer if entry[0] not in failed]
            for where, _lines, future in self._buffer:
                if where in failed:
                    self._fail(where, future, self._broken[where])
                    self._waiting.pop(where, None)
            self._buffer = kept

    def _fail(self, where: tuple[str, int], future: asyncio.Future[Any], error: PublishError) -> asyncio.Future[Any]:
        if not future.done():
            future.set_exception(error)
            self._failed_in[future] = where
        return future

    async def after_failure(self, exc: BaseException, future: asyncio.Future[Any]) -> None:
        where = self._failed_in.pop(future, None)
        if where is not None:
            self._broken.pop(where, None)

    def _write(self, batch: list[tuple[tuple[str, int], list[str], asyncio.Future[Any]]],
               before: dict[tuple[str, int], tuple[int, int]]) -> list[int]:
        """(in a worker thread) Append the lines and flush the files, noting in ``before`` where each file
        ended; the offset of each entry's first line."""
        offsets = []
        for where, lines, _future in batch:
            fh = self._file(where)
            if where not in before:
                before[where] = (os.fstat(fh.fileno()).st_size, self._next[where])
            offsets.append(self._next[where])
            self._next[where] += len(lines)
            fh.write("".join(line + "\n" for line in lines))
        for where in before:
            self._files[where].flush()
        return offsets

    def _undo(self, before: dict[tuple[str, int], tuple[int, int]]) -> None:
        """Cut the files back to where a failed write began: no line half written, none counted twice."""
        for where, (size, offset) in before.items():
            fh = self._files.pop(where)
            try:
                fh.close()  # its buffer is lost with it, or (a full disk) fails to flush
            except OSError as exc:
                logger.debug("closing %s after a failed write: %s", fh.name, exc)
            try:
                os.truncate(fh.name, size)
                self._next[where] = offset
            except OSError as exc:
                logger.warning("cannot cut %s back after a failed write: %s", fh.name, exc)
                self._next.pop(where, None)  # counted again when the file is next opened

    def _file(self, where: tuple[str, int]) -> IO[str]:
        if where not in self._files:
            path = self.root / where[0] / f"partition-{where[1]}.jsonl"
            self._next[where] = sum(1 for _ in open(path)) if path.exists() else 0  # noqa: SIM115
            self._files[where] = open(path, "a", opener=private_opener)  # noqa: SIM115 - kept open until stop()
        return self._files[where]


def read_topic(root: str | os.PathLike[str], topic: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """(partition, record) of every message of a directory topic, partition by partition."""
    folder = Path(root) / topic
    for path in sorted(folder.glob("partition-*.jsonl"), key=lambda p: int(p.stem.split("-")[1])):
        partition = int(path.stem.split("-")[1])
        with open(path) as fh:
            for line in fh:
                yield partition, json.loads(line)
