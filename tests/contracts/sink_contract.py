"""The tailer worker's Sink contract, written once and run against every sink (tests/tailer/test_sinks.py).

Subclasses provide ``make_sink`` and ``received`` (what reached the destination of one shard: its cells and
dead letters as ``("cell", added_id)`` and ``("deadletter", added_id)``, in the order they arrived).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from logstore import Cell
from tailer.errors import PublishError
from tailer.interfaces import Sink
from tailer.messages import deadletter_record

SHARD = 3


def cells(first: int, n: int, column: str = "BASE", shard: int = SHARD) -> list[Cell]:
    now = dt.datetime.now(dt.UTC)
    return [Cell(uuid.uuid4(), column, 1, {"n": i}, i, shard, now) for i in range(first, first + n)]


def record_of(cell: Cell) -> dict[str, Any]:
    return deadletter_record(cell.coordinates(), topic="BASE", error=ValueError("cannot be decoded"),
                             stage="decode", tailer="contract", worker="w1")


class SinkContract:
    def make_sink(self) -> Sink:
        raise AssertionError("sink test classes implement make_sink")

    def received(self, sink: Sink) -> list[tuple[str, int]]:
        raise AssertionError("sink test classes implement received")

    @pytest.fixture
    def sink(self) -> Iterator[Sink]:
        yield self.make_sink()

    def test_a_shards_cells_and_dead_letters_arrive_in_the_order_handed_over(self, sink: Sink) -> None:
        first, lost, rest = cells(1, 5), cells(6, 1)[0], cells(7, 4)

        async def run() -> None:
            await sink.start()
            try:
                await sink.prepare("BASE")
                futures = [f for f, _ in await sink.deliver(SHARD, "BASE", [sink.accept(c) for c in first])]
                futures.append(await sink.deadletter(SHARD, record_of(lost)))
                futures += [f for f, _ in await sink.deliver(SHARD, "BASE", [sink.accept(c) for c in rest])]
                await asyncio.wait_for(asyncio.gather(*futures), 30)
                await sink.before_commit()
            finally:
                await sink.stop()
        asyncio.run(run())
        assert self.received(sink) == [("cell", i) for i in range(1, 6)] + [("deadletter", 6)] + [
            ("cell", i) for i in range(7, 11)]

    def test_a_delivery_batch_of_several_shards_runs_keeps_each_shards_order_after_it(self, sink: Sink) -> None:
        other = cells(100, 3, shard=SHARD + 1)  # another shard (another partition): not in received()

        async def run() -> None:
            await sink.start()
            try:
                await sink.prepare("BASE")
                delivered = await sink.deliver_batch([
                    (SHARD + 1, "BASE", [sink.accept(c) for c in other]),
                    (SHARD, "BASE", [sink.accept(c) for c in cells(1, 3)]),
                    (SHARD, "BASE", [sink.accept(c) for c in cells(4, 2)]),
                ])
                assert [sum(count for _f, count in run) for run in delivered] == [3, 3, 2]  # each run's items covered
                futures = [*(f for run in delivered for f, _ in run),
                           *(f for f, _ in await sink.deliver(SHARD, "BASE", [sink.accept(c) for c in cells(6, 3)]))]
                await asyncio.wait_for(asyncio.gather(*futures), 30)
                await sink.before_commit()
            finally:
                await sink.stop()
        asyncio.run(run())
        assert [event for event in self.received(sink) if event[1] < 100] == [("cell", i) for i in range(1, 9)]

    def test_each_future_covers_its_count_of_the_items_in_order(self, sink: Sink) -> None:
        batch = cells(1, 40)

        async def run() -> list[int]:
            await sink.start()
            try:
                await sink.prepare("BASE")
                sent = await sink.deliver(SHARD, "BASE", [sink.accept(c) for c in batch])
                await asyncio.wait_for(asyncio.gather(*(f for f, _ in sent)), 30)
                return [count for _, count in sent]
            finally:
                await sink.stop()
        counts = asyncio.run(run())
        assert sum(counts) == len(batch) and all(count >= 1 for count in counts)

    def test_after_stop_a_delivery_is_a_retriable_error(self, sink: Sink) -> None:
        async def run() -> None:
            await sink.start()
            await sink.prepare("BASE")
            await sink.stop()
            await sink.stop()  # safe twice
            with pytest.raises(PublishError) as raised:
                await sink.deliver(SHARD, "BASE", [sink.accept(c) for c in cells(1, 1)])
            assert raised.value.retriable
        asyncio.run(run())
