"""Per-shard order when a delivery fails while more of the shard is on its way, with a scripted publisher.

The real-broker version is tests/tailer/test_faults.py (a Kafka broker restart); this one replays, step by
step, the interleaving that broke it: a failure that restarts the producer settles (fails) another shard's
in-flight batch after _collect has passed that shard, and that shard's next page is already read.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

import logstore
from tailer.config import TailerConfig
from tailer.coordinators.local import LocalCoordinator
from tailer.interfaces import Publisher
from tailer.worker import Tailer

A, B = 0, 1  # shard A's batch is failed by the restart that shard B's failure causes


class ProducerBroken(Exception):
    """What a producer that has to be replaced fails its batches with (OutOfOrderSequenceNumber, say)."""


class ScriptedPublisher(Publisher):
    """A publisher whose sends a test scripts: nothing to start, stop or prepare."""

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def prepare_topic(self, topic: str, partitions: int, replication_factor: int) -> None:
        pass


class RestartingPublisher(ScriptedPublisher):
    """Like KafkaPublisher around a restart. On the first producer (stream 0) shard B's sends fail at
    once and A's wait; B's failure restarts the producer, which fails what the old one still holds,
    and the new producer (stream 1) delivers everything at once. While it restarts, A's next page
    is let through the store's gate, as the real restart's time let it be read."""

    def __init__(self) -> None:
        self.stream = 0
        self.sent: list[tuple[int, int, int]] = []  # (stream, shard, added_id) in the order handed over
        self.delivered: list[tuple[int, int]] = []  # (shard, added_id) in the order they reach the topic
        self.a_sent = threading.Event()
        self.release_a = threading.Event()
        self.a_read = threading.Event()
        self._held: list[asyncio.Future[Any]] = []
        self._stream_of: dict[asyncio.Future[Any], int] = {}

    async def send(
        self, topic: str, partition: int, key: bytes, value: bytes, headers: list[tuple[str, bytes]]
    ) -> asyncio.Future[Any]:
        fields = dict(headers)
        shard, added_id = int(fields["shard"]), int(fields["added_id"])
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._stream_of[future] = self.stream
        self.sent.append((self.stream, shard, added_id))
        if self.stream > 0:
            future.set_result(None)
            self.delivered.append((shard, added_id))
        elif shard == B:
            future.set_exception(ProducerBroken("the producer must be replaced"))
        else:
            self._held.append(future)
            self.a_sent.set()
        return future

    async def after_failure(self, exc: BaseException, future: asyncio.Future[Any]) -> None:
        if not isinstance(exc, ProducerBroken) or self._stream_of[future] != self.stream:
            return  # a future of a producer already replaced
        for held in self._held:  # stopping the old producer settles what it held
            held.set_exception(ProducerBroken("sequence numbers out of step"))
        self._held.clear()
        self.stream += 1
        self.release_a.set()
        assert await asyncio.to_thread(self.a_read.wait, 10)
        await asyncio.sleep(0.2)  # the read's result reaches the worker's loop


def first_deliveries(delivered: list[tuple[int, int]]) -> dict[int, list[int]]:
    seen: dict[int, list[int]] = {}
    for shard, added_id in delivered:
        if added_id not in seen.setdefault(shard, []):
            seen[shard].append(added_id)
    return seen


def keys_in(store: logstore.Store, shard: int, n: int) -> list[uuid.UUID]:
    found: list[uuid.UUID] = []
    i = 0
    while len(found) < n:
        key = uuid.UUID(int=(0x0DE5 << 112) | i)
        if store.shard_of(key) == shard:
            found.append(key)
        i += 1
    return found


def test_nothing_later_of_a_shard_goes_out_after_a_failed_delivery_until_the_failed_cells_are_resent(
    sqlite_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = logstore.open(sqlite_url, shards=2)
    a_cells = store.put_cells([(key, "BASE", 1, {"i": i}) for i, key in enumerate(keys_in(store, A, 4))])
    b_cells = store.put_cells([(key, "BASE", 1, {"i": i}) for i, key in enumerate(keys_in(store, B, 2))])
    publisher = RestartingPublisher()
    read = store.read_pages

    def gated(locations: Mapping[int, int], limit: int = 1000, *,
              columns: Sequence[str] | None = None, packed: bool = False) -> Any:
        page = limit > 1  # not the lag measurement's read of the oldest unacknowledged cells
        if page and B in locations:  # B fails only once A's first page is in flight on the old producer
            assert publisher.a_sent.wait(10)
        later = page and locations.get(A, 0) > 0  # A's pages after its first
        if later:
            assert publisher.release_a.wait(10)
        pages = read(locations, limit, columns=columns, packed=packed)
        if later:
            publisher.a_read.set()
        return pages

    monkeypatch.setattr(store, "read_pages", gated)
    config = TailerConfig(name="order", partitions=2, page_size=2)
    tailer = Tailer(store, config, LocalCoordinator(tmp_path / "offsets.json", store.shard_count), publisher)
    every = {(c.shard, c.added_id) for c in a_cells + b_cells}

    async def scenario() -> None:
        async with tailer:
            deadline = time.monotonic() + 30
            while not every <= set(publisher.delivered) or any(
                    acked != position for position, acked, _ in tailer.positions().values()):
                assert time.monotonic() < deadline, f"not delivered: {every - set(publisher.delivered)}"
                assert tailer.error is None
                await asyncio.sleep(0.02)

    asyncio.run(scenario())
    store.close()
    assert publisher.stream == 1, "the scripted restart did not happen"
    order = first_deliveries(publisher.delivered)
    assert order[A] == [c.added_id for c in a_cells]
    assert order[B] == [c.added_id for c in b_cells]
    # On the new producer, shard A starts again with its first cell, not with the page read meanwhile.
    assert [added_id for stream, shard, added_id in publisher.sent if stream == 1 and shard == A][:1] == [
        a_cells[0].added_id]


class LaterFailsPublisher(ScriptedPublisher):
    """Holds the first two messages of shard A undelivered and fails the next two at once, one time."""

    def __init__(self) -> None:
        self.sent: list[int] = []  # added_ids of shard A, in the order handed over
        self.delivered: list[tuple[int, int]] = []
        self.held: list[tuple[asyncio.Future[Any], tuple[int, int]]] = []

    async def send(
        self, topic: str, partition: int, key: bytes, value: bytes, headers: list[tuple[str, bytes]]
    ) -> asyncio.Future[Any]:
        fields = dict(headers)
        cell = int(fields["shard"]), int(fields["added_id"])
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.sent.append(cell[1])
        if len(self.sent) <= 2:
            self.held.append((future, cell))
        elif len(self.sent) <= 4:
            future.set_exception(ConnectionError("the broker went away"))
        else:
            future.set_result(None)
            self.delivered.append(cell)
        return future

    def release(self) -> None:
        for future, cell in self.held:
            future.set_result(None)
            self.delivered.append(cell)
        self.held.clear()


def test_a_later_failed_delivery_rewinds_the_shard_without_waiting_for_earlier_ones_under_way(
    sqlite_url: str, tmp_path: Path
) -> None:
    store = logstore.open(sqlite_url, shards=2)
    cells = store.put_cells([(key, "BASE", 1, {"i": i}) for i, key in enumerate(keys_in(store, A, 4))])
    ids = [c.added_id for c in cells]
    publisher = LaterFailsPublisher()
    config = TailerConfig(name="order", partitions=2, page_size=2)
    tailer = Tailer(store, config, LocalCoordinator(tmp_path / "offsets.json", store.shard_count), publisher)

    async def scenario() -> None:
        async with tailer:
            deadline = time.monotonic() + 30
            while publisher.sent[4:5] != ids[:1]:  # resent from the start while the first two are held
                assert time.monotonic() < deadline, f"no rewind: sent {publisher.sent}"
                assert tailer.error is None
                await asyncio.sleep(0.02)
            assert publisher.held, "the earlier deliveries were not waited for"
            publisher.release()
            while tailer.positions()[A][1] != ids[-1]:
                assert time.monotonic() < deadline, f"not acknowledged: {tailer.positions()}"
                await asyncio.sleep(0.02)

    asyncio.run(scenario())
    store.close()
    assert publisher.sent[:4] == ids
    assert first_deliveries(publisher.delivered)[A] == ids
