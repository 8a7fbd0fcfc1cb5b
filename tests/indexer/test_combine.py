"""The group commit of batch appliers (indexer.runtime.combine): batches of many shards in one call."""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime as dt
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from indexer.runtime.combine import MAX_COMBINED, Combiner
from logstore import Cell


class Recording:
    def __init__(self, pause: float = 0.0, fail: Exception | None = None) -> None:
        self.calls: list[list[Any]] = []
        self.spans: list[tuple[float, float]] = []  # (start, end) of each call, in the order of calls
        self.pause, self.fail = pause, fail
        self._lock = threading.Lock()

    def apply(self, prepared: Sequence[Any], batch: Sequence[Cell]) -> None:
        started = time.monotonic()
        with self._lock:
            self.calls.append(list(prepared))
            self.spans.append((started, started))
            n = len(self.spans) - 1
        time.sleep(self.pause)
        self.spans[n] = (started, time.monotonic())
        if self.fail is not None:
            raise self.fail


@pytest.fixture
def pool() -> Iterator[concurrent.futures.ThreadPoolExecutor]:
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        yield pool


def test_batches_of_one_turn_go_in_one_call_and_later_ones_in_the_next(
        pool: concurrent.futures.ThreadPoolExecutor) -> None:
    applier = Recording(pause=0.2)
    combiner = Combiner(applier, pool)

    async def scenario() -> None:
        await asyncio.gather(*(combiner.apply([shard], []) for shard in range(10)))
        first = asyncio.create_task(combiner.apply(["a"], []))
        await asyncio.sleep(0.05)  # "a" is being applied; these wait for the next call together
        await asyncio.gather(first, *(combiner.apply([f"b{i}"], []) for i in range(3)))
    asyncio.run(scenario())
    assert applier.calls == [list(range(10)), ["a"], ["b0", "b1", "b2"]]
    assert combiner.calls == 3


def test_a_batch_arriving_during_a_call_goes_at_once_in_a_second_call_but_no_third(
        pool: concurrent.futures.ThreadPoolExecutor) -> None:
    """While one call waits for its storage node, the next batches need not wait for it (two calls at once)."""
    applier = Recording(pause=0.3)
    combiner = Combiner(applier, pool, calls=2)

    async def scenario() -> None:
        first = asyncio.create_task(combiner.apply(["a"], []))
        await asyncio.sleep(0.05)
        second = asyncio.create_task(combiner.apply(["b"], []))
        await asyncio.sleep(0.05)  # two calls under way: these wait for one of them to end
        await asyncio.gather(first, second, *(combiner.apply([f"c{i}"], []) for i in range(3)))
    asyncio.run(scenario())
    assert applier.calls == [["a"], ["b"], ["c0", "c1", "c2"]]
    (_, a_end), (b_start, b_end), (c_start, _) = applier.spans
    assert b_start < a_end  # "b" did not wait for "a"
    assert c_start >= min(a_end, b_end) - 0.01  # the third call waited for one of them to end


def cell_of(shard: int) -> Cell:
    return Cell(uuid.uuid4(), "BASE", 1, {}, 1, shard, dt.datetime.now(dt.UTC))


def test_a_batch_of_a_shard_a_call_holds_waits_for_that_call_even_when_its_waiter_gave_up(
        pool: concurrent.futures.ThreadPoolExecutor) -> None:
    """A partition revoked while its batch is applied, then handed out again: the batch that comes again must not
    be applied beside the first call, still running in its thread, while a batch of another shard goes at once."""
    applier = Recording(pause=0.3)
    combiner = Combiner(applier, pool, calls=2)

    async def scenario() -> None:
        first = asyncio.create_task(combiner.apply(["x1"], [cell_of(1)]))
        await asyncio.sleep(0.05)
        first.cancel()  # given up on; the call goes on in its thread
        again = asyncio.create_task(combiner.apply(["x1 again"], [cell_of(1)]))
        other = asyncio.create_task(combiner.apply(["y2"], [cell_of(2)]))
        await asyncio.gather(again, other)
    asyncio.run(scenario())
    spans = dict(zip([call[0] for call in applier.calls], applier.spans, strict=True))
    assert spans["y2"][0] < spans["x1"][1]  # another shard: a second call at once
    assert spans["x1 again"][0] >= spans["x1"][1]  # the same shard: after the first call's thread returned


def test_a_failed_call_fails_every_batch_in_it_and_the_next_call_goes_on(
        pool: concurrent.futures.ThreadPoolExecutor) -> None:
    applier = Recording(fail=RuntimeError("node down"))
    combiner = Combiner(applier, pool)

    async def scenario() -> list[BaseException | None]:
        return await asyncio.gather(*(combiner.apply([n], []) for n in range(4)), return_exceptions=True)
    results = asyncio.run(scenario())
    assert [str(r) for r in results] == ["node down"] * 4 and len(applier.calls) == 1
    applier.fail = None
    asyncio.run(scenario())  # another event loop, as when an app runs again
    assert len(applier.calls) == 2


def test_a_call_stays_under_the_size_bound(pool: concurrent.futures.ThreadPoolExecutor) -> None:
    applier = Recording()
    combiner = Combiner(applier, pool)
    big = MAX_COMBINED // 2 + 1

    async def scenario() -> None:
        await asyncio.gather(*(combiner.apply([n] * big, []) for n in range(3)), combiner.apply(["x"], []))
    asyncio.run(scenario())
    assert [len(c) for c in applier.calls] == [big, big, big + 1]
