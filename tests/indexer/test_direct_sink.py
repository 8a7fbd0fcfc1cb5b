"""Direct mode's sink (HandlerSink): deliveries of several shards at once each wait only for the earlier deliveries
of their own shards, giving one up gives up what waits for it, and a read's shards run side by side only when
their cells take long enough."""

from __future__ import annotations

import asyncio
import datetime as dt
import time
import uuid
from typing import Any

import logstore
from indexer import App
from indexer.runtime.direct import HandlerSink
from tailer.config import TailerConfig
from tailer.coordinators.store import StoreCoordinator
from tailer.worker import Tailer

NOW = dt.datetime.now(dt.UTC)


def futures(sent: list[list[tuple[asyncio.Future[Any], int]]]) -> list[asyncio.Future[Any]]:
    """The distinct futures of a delivery batch's runs."""
    return list(dict.fromkeys(future for run in sent for future, _count in run))


def cell(shard: int, n: int, **body: Any) -> logstore.Cell:
    return logstore.Cell(uuid.uuid4(), "BASE", 1, {"n": n, **body}, n, shard, NOW)


class Held:
    """An app whose async handler records each cell's ``n`` and waits on ``release`` for cells marked hold."""

    def __init__(self, store: logstore.Store) -> None:
        self.app = App("held", store=store)
        self.handled: list[int] = []
        self.release = asyncio.Event()

        @self.app.trigger("BASE")
        async def handle(got: logstore.Cell) -> None:
            self.handled.append(got.body["n"])
            if got.body.get("hold"):
                await self.release.wait()

    async def until(self, n: int) -> None:
        async with asyncio.timeout(10):
            while n not in self.handled:
                await asyncio.sleep(0.005)


def test_a_shards_later_cells_wait_for_the_delivery_batch_holding_its_earlier_ones(store: logstore.Store) -> None:
    async def run() -> list[int]:
        held = Held(store)
        sink = HandlerSink(held.app.processor, batch_size=3, max_workers=4)
        await sink.start()
        # A delivery batch of shards 1 and 2 that fills a handler batch and whose first cell's handler waits.
        delivered = futures(await sink.deliver_batch([(1, "BASE", [cell(1, 1, hold=True), cell(1, 2)]),
                                                  (2, "BASE", [cell(2, 3)])]))
        later = [f for f, _ in await sink.deliver(1, "BASE", [cell(1, 4)])]  # shard 1 again: waits for the batch
        other = [f for f, _ in await sink.deliver(3, "BASE", [cell(3, 5)])]  # another shard: does not
        await held.until(5)
        await asyncio.sleep(0.05)
        before_release = list(held.handled)
        held.release.set()
        await asyncio.wait_for(asyncio.gather(*delivered, *later, *other), 10)
        await sink.stop()
        held.app.close()
        return before_release

    before_release = asyncio.run(run())
    assert 1 in before_release and 5 in before_release
    assert 4 not in before_release  # not handled while the delivery batch of its shard was under way


def test_giving_up_a_shard_gives_up_the_deliveries_waiting_behind_it(store: logstore.Store) -> None:
    async def run() -> tuple[list[int], list[str]]:
        held = Held(store)
        sink = HandlerSink(held.app.processor, batch_size=1, max_workers=4)
        await sink.start()
        # A handler batch whose handler did not wait: a delivery batch is one job then (handlers that wait get
        # a job per shard).
        await asyncio.gather(*(f for f, _ in await sink.deliver(4, "BASE", [cell(4, 0)])))
        first = [f for f, _ in await sink.deliver(1, "BASE", [cell(1, 1, hold=True)])]
        await held.until(1)  # under way: it finishes whatever is abandoned
        delivered = futures(await sink.deliver_batch([(1, "BASE", [cell(1, 2)]), (2, "BASE", [cell(2, 3)])]))
        assert len(delivered) == 1  # one job: one future for both shards
        behind = [f for f, _ in await sink.deliver(1, "BASE", [cell(1, 4)])]  # waits for the batch
        apart = [f for f, _ in await sink.deliver(3, "BASE", [cell(3, 5)])]
        sink.abandon([2])  # the batch holds shard 2: it goes, and shard 1's cell behind it with it
        held.release.set()
        await asyncio.wait_for(asyncio.gather(*first, *apart), 10)
        await asyncio.sleep(0.05)
        states = ["cancelled" if f.cancelled() else "done" if f.done() else "pending"
                  for f in (*first, *delivered, *behind, *apart)]
        await sink.stop()
        held.app.close()
        return held.handled, states

    handled, states = asyncio.run(run())
    assert states == ["done", "cancelled", "cancelled", "done"]
    assert sorted(handled) == [0, 1, 5]


class CountingSink(HandlerSink):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.batches = self.singles = 0

    async def deliver_batch(self, runs: Any) -> Any:
        self.batches += 1
        return await super().deliver_batch(runs)

    async def deliver(self, shard: int, column: str, items: Any) -> Any:
        self.singles += 1
        return await super().deliver(shard, column, items)


def test_the_worker_hands_a_read_of_many_shards_over_as_one_delivery(sqlite_url: str) -> None:
    with logstore.open(sqlite_url, shards=256) as store:
        store.put_cells([(uuid.uuid4(), "BASE", 1, {"n": i}) for i in range(1000)])
        seen: list[logstore.Cell] = []
        app = App("grouped", store=store)
        app.trigger("BASE")(seen.append)
        config = TailerConfig(name="app.grouped", columns=("BASE",), page_size=500)

        async def run() -> CountingSink:
            sink = CountingSink(app.processor, batch_size=500)
            async with Tailer(store, config, StoreCoordinator(store, config.name), sink) as tailer:
                async with asyncio.timeout(30):
                    while len(seen) < 1000:
                        await asyncio.sleep(0.01)
                assert tailer.positions()
            return sink

        sink = asyncio.run(run())
        app.close()
    # 1,000 cells in 256 shards, read a page's worth of shards at a time: a few deliveries, not one a shard
    # (the column's first page goes alone, to make the column ready; a read may end with one shard).
    assert sink.singles <= 3 and 2 <= sink.batches <= 10
    by_shard: dict[int, list[int]] = {}
    for got in seen:
        by_shard.setdefault(got.shard, []).append(got.added_id)
    assert sum(map(len, by_shard.values())) == 1000 and all(ids == sorted(ids) for ids in by_shard.values())


def split_into(store: logstore.Store, cell_seconds: float | None) -> int:
    """The handler batches a delivery batch of ten one-cell shards is handled in by a synchronous handler, when
    its cells were measured to take ``cell_seconds`` each (None: not measured yet)."""
    app = App("split", store=store, concurrency=8)
    app.trigger("BASE")(lambda got: None)
    processor = app.processor
    batches = 0
    process_many = processor.process_many

    async def counted(items: Any, **kwargs: Any) -> bool:
        nonlocal batches
        batches += 1
        return await process_many(items, **kwargs)

    processor.process_many = counted  # type: ignore[method-assign]

    async def run() -> None:
        sink = HandlerSink(processor, batch_size=500, max_workers=8)
        sink._waited = True  # as after the first batch of a handler that runs in the pool
        await sink.start()
        processor.cell_seconds = cell_seconds
        delivered = futures(await sink.deliver_batch([(shard, "BASE", [cell(shard, shard)]) for shard in range(10)]))
        await asyncio.wait_for(asyncio.gather(*delivered), 10)
        await sink.stop()

    asyncio.run(run())
    app.close()
    return batches


def test_a_reads_shards_run_side_by_side_only_when_their_cells_take_long_enough(store: logstore.Store) -> None:
    assert split_into(store, None) > 1  # nothing measured yet: split over the pool's threads
    assert split_into(store, 0.01) > 1  # 10 cells of 10 ms: side by side
    assert split_into(store, 1e-6) == 1  # 10 µs in all: one trip to the pool


def test_the_processor_measures_what_a_cell_takes_its_handlers(store: logstore.Store) -> None:
    async def measured(handler: Any) -> float | None:
        app = App("measured", store=store)
        app.trigger("BASE")(handler)
        assert app.processor.cell_seconds is None
        processor = app.processor
        assert await processor.process_many([(cell(1, n), {}) for n in range(20)])
        app.close()
        return processor.cell_seconds

    quick = asyncio.run(measured(lambda got: None))
    slow = asyncio.run(measured(lambda got: time.sleep(0.005)))
    assert quick is not None and quick < 0.001
    assert slow is not None and slow >= 0.005
