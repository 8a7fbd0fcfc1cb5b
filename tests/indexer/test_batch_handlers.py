"""Handlers that take cells a list at a time (``@app.batch_trigger``), synchronous handlers run a page per
trip to the thread pool, and the pages of many shards handled together, in direct mode on the embedded default
(Kafka mode: tests/indexer/test_app_kafka.py)."""

from __future__ import annotations

import asyncio
import uuid
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import pytest

import logstore
from indexer import App
from tests.indexer.test_app_direct import FAST, write


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_batch_handler_gets_each_shards_cells_in_order_a_list_at_a_time(store: logstore.Store, kind: str) -> None:
    cells = write(store, 300)
    lists: list[list[logstore.Cell]] = []
    app = App(f"batches-{kind}", store=store, page_size=50)
    if kind == "sync":
        app.batch_trigger("BASE")(lists.append)
    else:
        async def handle(batch: list[logstore.Cell]) -> None:
            lists.append(batch)
        app.batch_trigger("BASE", name="handle")(handle)
    assert app.drain(30) == (300, 0, 0)
    assert sorted(c.added_id for batch in lists for c in batch) == sorted(c.added_id for c in cells)
    assert all(len({c.shard for c in batch}) == 1 and len(batch) <= 50 for batch in lists)
    assert len(lists) < len(cells) / 4  # lists, not cells one by one
    by_shard: dict[int, list[int]] = defaultdict(list)
    for batch in lists:
        by_shard[batch[0].shard] += [c.added_id for c in batch]
    assert all(ids == sorted(ids) for ids in by_shard.values())


def test_a_failing_batch_is_handled_cell_by_cell_and_only_the_bad_cell_is_dead_lettered(store: logstore.Store) -> None:
    cells = write(store, 40)
    poison = store.put_cell(uuid.uuid4(), "BASE", 1, {"poison": True})
    handled: list[int] = []
    calls: list[int] = []

    def charge(batch: list[logstore.Cell]) -> None:
        calls.append(len(batch))
        if any(c.body.get("poison") for c in batch):
            raise ValueError("cannot charge a poisoned ride")
        handled.extend(c.added_id for c in batch)

    app = App("charges", store=store, backoff=FAST)
    app.batch_trigger("BASE", max_attempts=3)(charge)
    counts = app.drain(30)
    assert counts.dead_lettered == 1 and counts.processed == 40
    assert sorted(handled) == sorted(c.added_id for c in cells)
    [entry] = app.dlq.list()
    assert entry.cell["added_id"] == poison.added_id and entry.attempts == 3 and entry.handler == "charge"
    assert entry.body == {"poison": True} and "cannot charge" in entry.message
    assert 1 in calls and max(calls) > 1  # whole lists first, single cells after the failure
    [replayed] = app.dlq.replay(entry.id)  # a replay passes the one cell, which still fails
    assert replayed.after == "open" and "cannot charge" in (replayed.error or "")


def _count_trips(app: App) -> list[int]:
    """The number of jobs handed to the app's handler thread pool from now on, in a one-item list."""
    trips = [0]
    pool = app.processor._pool
    submit = pool.submit

    def counted(*args: Any, **kwargs: Any) -> Any:
        trips[0] += 1
        return submit(*args, **kwargs)

    pool.submit = counted  # type: ignore[method-assign]
    return trips


def test_a_sync_handler_runs_a_page_per_trip_to_the_pool_and_a_failure_keeps_its_attempts(
        store: logstore.Store) -> None:
    write(store, 200)
    flaky = store.put_cell(uuid.uuid4(), "BASE", 1, {"flaky": True})
    attempts: list[int] = []

    def handle(cell: logstore.Cell) -> None:
        if cell.body.get("flaky"):
            attempts.append(cell.added_id)
            raise ConnectionError("the billing service is down")  # retriable

    app = App("trips", store=store, backoff=FAST, page_size=100)
    app.trigger("BASE", max_attempts=4)(handle)
    trips = _count_trips(app)
    counts = app.drain(30)
    assert counts == (200, 3, 1)
    assert attempts == [flaky.added_id] * 4  # the first, made within the page's trip, counts as one of four
    assert trips[0] < 201 / 4, f"{trips[0]} trips to the pool for 201 cells"
    [entry] = app.dlq.list()
    assert entry.attempts == 4


MANY = 64  # shards: a few cells each, as the default 4096 shards hold them under a light load


@pytest.fixture
def many(sqlite_url: str) -> Iterator[logstore.Store]:
    with logstore.open(sqlite_url, shards=MANY) as opened:
        yield opened


def _in_shard_order(cells: list[logstore.Cell], written: list[logstore.Cell]) -> bool:
    by_shard: dict[int, list[int]] = defaultdict(list)
    for cell in cells:
        by_shard[cell.shard].append(cell.added_id)
    return (sorted(c.added_id for c in cells) == sorted(c.added_id for c in written)
            and all(ids == sorted(ids) for ids in by_shard.values()))


def test_a_sync_handler_takes_the_pages_of_several_shards_per_trip_to_the_pool(many: logstore.Store) -> None:
    cells = write(many, 4 * MANY)
    shards = len({c.shard for c in cells})
    seen: list[logstore.Cell] = []
    app = App("shared-trips", store=many)
    app.trigger("BASE")(seen.append)
    trips = _count_trips(app)
    assert app.drain(30).processed == len(cells)
    assert _in_shard_order(seen, cells)
    assert trips[0] <= shards / 3, f"{trips[0]} trips to the pool for the pages of {shards} shards"


def test_handlers_that_never_wait_take_the_pages_of_many_shards_in_one_call(many: logstore.Store) -> None:
    cells = write(many, 4 * MANY)
    shards = len({c.shard for c in cells})
    seen: list[logstore.Cell] = []
    lists: list[list[logstore.Cell]] = []
    app = App("one-task", store=many)

    @app.trigger("BASE")
    async def handle(cell: logstore.Cell) -> None:
        seen.append(cell)

    @app.batch_trigger("BASE")
    async def handle_lists(batch: list[logstore.Cell]) -> None:
        lists.append(batch)

    calls = 0
    process_many = app.processor.process_many

    async def counted(*args: Any, **kwargs: Any) -> bool:
        nonlocal calls
        calls += 1
        return await process_many(*args, **kwargs)

    app.processor.process_many = counted  # type: ignore[method-assign]
    assert app.drain(30).processed == 2 * len(cells)
    assert _in_shard_order(seen, cells)
    assert calls <= shards / 3, f"{calls} calls of the processor for the pages of {shards} shards"
    assert all(len({c.shard for c in batch}) == 1 for batch in lists)  # a batch handler's list: one shard's
    assert _in_shard_order([c for batch in lists for c in batch], cells)


def test_handlers_that_wait_still_run_the_shards_at_the_same_time(many: logstore.Store) -> None:
    cells = write(many, MANY)
    active: set[int] = set()
    most = 0
    seen: list[logstore.Cell] = []
    app = App("waiting", store=many)

    @app.trigger("BASE")
    async def slow(cell: logstore.Cell) -> None:
        nonlocal most
        assert cell.shard not in active
        active.add(cell.shard)
        most = max(most, len(active))
        await asyncio.sleep(0.05)
        seen.append(cell)
        active.discard(cell.shard)

    assert app.drain(30).processed == len(cells)
    assert _in_shard_order(seen, cells)
    assert most >= len({c.shard for c in cells}) / 4, f"at most {most} shards at once"
