"""The stream-processing runtime in direct mode on the embedded default (SQLite, offsets in the store).

Delivery (at least once, per-shard order), retries, the dead-letter queue with its
full context, the stall threshold, replay and discard, a slow handler, and a process
SIGKILLed mid-handler.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

import logstore
from indexer import (
    App,
    ConfigurationError,
    DLQFilter,
    EntryNotFoundError,
    EntryStateError,
    HandlerStalledError,
    Hook,
    InvalidFilterError,
    NonRetriableError,
    TakenOverError,
)
from logstore.retry import RetryPolicy
from tests.harness.app_worker import kill_mid_handler_then_drain

SHARDS = 8
FAST = RetryPolicy(initial=0.001, maximum=0.005, deadline=None)


def write(store: logstore.Store, n: int, **extra: Any) -> list[logstore.Cell]:
    return store.put_cells([(uuid.uuid4(), "BASE", 1, {"n": i, **extra}) for i in range(n)])


def test_every_cell_is_handled_once_in_shard_order_and_offsets_persist(store: logstore.Store) -> None:
    cells = write(store, 120)
    store.put_cells([(uuid.uuid4(), "OTHER", 1, {})])  # not subscribed: never handed over
    seen: list[logstore.Cell] = []
    app = App("orders", store=store)
    app.trigger("BASE")(seen.append)
    assert app.drain(30) == (120, 0, 0)
    assert sorted(c.added_id for c in seen) == sorted(c.added_id for c in cells)
    by_shard: dict[int, list[int]] = defaultdict(list)
    for cell in seen:
        by_shard[cell.shard].append(cell.added_id)
    assert all(ids == sorted(ids) for ids in by_shard.values())
    assert app.drain(30) == (0, 0, 0)  # the offsets were committed in the store
    later = write(store, 5)
    assert app.drain(30).processed == 5 and len(seen) == 125
    offsets = store.read_offsets("app.orders")
    assert all(offsets[c.shard].location >= c.added_id for c in later)


def test_async_handlers_and_several_handlers_per_column(store: logstore.Store) -> None:
    write(store, 20)
    got: dict[str, int] = defaultdict(int)
    app = App("two", store=store)

    @app.trigger("BASE")
    async def first(cell: logstore.Cell) -> None:
        await asyncio.sleep(0)
        got["first"] += 1

    @app.trigger("BASE", name="second")
    def other(cell: logstore.Cell) -> None:
        got["second"] += 1

    assert app.drain(30).processed == 40
    assert got == {"first": 20, "second": 20}


def test_poison_cells_go_to_the_dlq_with_full_context_and_processing_continues(store: logstore.Store) -> None:
    cells = write(store, 60)
    poison = {c.row_key for c in cells if c.body["n"] % 20 == 3}
    flaky: dict[uuid.UUID, int] = defaultdict(int)
    handled: list[uuid.UUID] = []
    app = App("billing", store=store, backoff=FAST)

    @app.trigger("BASE", max_attempts=4)
    def bill(cell: logstore.Cell) -> None:
        if cell.row_key in poison:
            raise ValueError(f"card of {cell.row_key} declined")
        if cell.body["n"] % 20 == 5 and flaky[cell.row_key] < 2:  # fails twice, then passes
            flaky[cell.row_key] += 1
            raise TimeoutError("provider timed out")
        handled.append(cell.row_key)

    counts = app.drain(30)
    assert counts == (57, 3 * 3 + 3 * 2, 3)  # 3 poison cells x 3 retries, 3 flaky cells x 2 retries
    assert set(handled) | poison == {c.row_key for c in cells}  # nothing silently skipped
    entries = app.dlq.list()
    assert {uuid.UUID(e.cell["row_key"]) for e in entries} == poison
    entry = entries[0]
    cell = next(c for c in cells if str(c.row_key) == entry.cell["row_key"])
    assert (entry.app, entry.handler, entry.column, entry.status) == ("billing", "bill", "BASE", "open")
    assert entry.source == {"mode": "direct", "shard": cell.shard, "added_id": cell.added_id}
    assert entry.cell["ref_key"] == 1 and entry.cell["added_id"] == cell.added_id and entry.body == cell.body
    assert entry.error_type == "ValueError" and entry.message == f"card of {cell.row_key} declined"
    assert "in bill" in entry.traceback and "raise ValueError" in entry.traceback
    assert entry.attempts == 4 and entry.first_failure <= entry.last_failure
    assert [e.status for e in entry.history] == ["open"]
    stats = app.dlq.stats()
    assert len(stats) == 1 and stats[0]["count"] == 3 and stats[0]["open"] == 3  # one cause, one group
    # every offset moved past the dead-lettered cells: nothing is delivered again
    assert app.drain(30) == (0, 0, 0)


def test_non_retriable_errors_are_dead_lettered_at_once(store: logstore.Store) -> None:
    write(store, 3)
    calls = []
    app = App("strict", store=store, backoff=FAST)

    @app.trigger("BASE", max_attempts=5)
    def reject(cell: logstore.Cell) -> None:
        calls.append(cell)
        raise NonRetriableError("never valid")

    assert app.drain(30) == (0, 0, 3)
    assert len(calls) == 3 and all(e.attempts == 1 for e in app.dlq.list())


def test_a_cell_that_cannot_be_decoded_is_dead_lettered_without_a_body(store: logstore.Store,
                                                                        sqlite_url: str) -> None:
    cells = write(store, 4)
    bad = cells[1]
    with sqlite3.connect(Path(sqlite_url.removeprefix("sqlite:///")) / "logstore.db") as conn:
        conn.execute("UPDATE cells SET body = x'7f00' WHERE added_id = ?", (bad.added_id,))
    handled = []
    app = App("decode", store=store)
    app.trigger("BASE")(handled.append)
    counts = app.drain(30)
    assert counts.processed == 3 and counts.dead_lettered == 1
    [entry] = app.dlq.list()
    assert entry.error_type == "CorruptCellError" and entry.body is None and entry.attempts == 1
    assert entry.cell["added_id"] == bad.added_id and entry.source["shard"] == bad.shard


def test_the_stall_threshold_stops_the_handler_without_losing_cells(store: logstore.Store) -> None:
    cells = write(store, 40)
    broken = True
    handled: set[uuid.UUID] = set()
    app = App("stall", store=store, backoff=FAST, stall_threshold=2)

    @app.trigger("BASE", max_attempts=2)
    def fragile(cell: logstore.Cell) -> None:
        if broken and cell.body["n"] % 4 == 0:  # a systematic failure: 10 of the 40 cells
            raise RuntimeError("downstream is down")
        handled.add(cell.row_key)

    with pytest.raises(HandlerStalledError, match="handler fragile stopped: 2 open dead letters"):
        app.drain(30)
    assert len(app.dlq.list(status="open")) == 2
    assert app.metrics.stalled.labels("stall", "fragile")._value.get() == 1
    with pytest.raises(HandlerStalledError):  # still stalled after a restart
        app.drain(30)
    broken = False
    for entry in app.dlq.list():
        app.dlq.replay(entry.id)
    counts = app.drain(30)
    assert counts.dead_lettered == 0
    assert handled == {c.row_key for c in cells}  # the cells after the stall were not skipped


def test_replay_and_discard(store: logstore.Store) -> None:
    write(store, 6, kind="x")
    fixed = False
    app = App("triage", store=store, backoff=FAST)

    @app.trigger("BASE", max_attempts=2)
    def handle(cell: logstore.Cell) -> None:
        if not fixed and cell.body["n"] < 3:
            raise KeyError("missing price")

    app.drain(30)
    first, second, third = app.dlq.list()
    [failed] = app.dlq.replay(first.id)  # still broken: another attempt is recorded
    assert (failed.before, failed.after, failed.attempts) == ("open", "open", 2)
    again = app.dlq.show(first.id)
    assert again.attempts == 4 and [e.status for e in again.history] == ["open", "replayed", "open"]
    assert again.history[-1].error is not None and "missing price" in again.history[-1].error

    with pytest.raises(InvalidFilterError, match="reason"):
        app.dlq.discard(second.id, " ")
    discarded = app.dlq.discard(second.id, "test rider, not billable")
    assert discarded.status == "discarded" and discarded.history[-1].note == "test rider, not billable"
    assert app.dlq.discard(second.id, "again").status == "discarded"  # idempotent

    fixed = True
    assert [r.after for r in app.dlq.replay(match=DLQFilter.parse("handler=handle"), dry_run=True)] == \
        ["would replay", "would replay"]
    assert app.dlq.show(first.id).status == "open"  # a dry run changes nothing
    results = app.dlq.replay(match=DLQFilter.parse("handler=handle,status=open"))
    assert {(r.id, r.after) for r in results} == {(first.id, "resolved"), (third.id, "resolved")}
    assert app.dlq.replay(first.id)[0].after == "resolved"  # idempotent: nothing runs again
    assert app.dlq.replay(match=DLQFilter.parse("handler=handle")) == []
    with pytest.raises(EntryStateError, match="resolved"):
        app.dlq.discard(first.id, "too late")
    history = app.dlq.show(first.id).history
    assert [e.status for e in history] == ["open", "replayed", "open", "replayed", "resolved"]
    with pytest.raises(EntryNotFoundError):
        app.dlq.show(str(uuid.uuid4()))
    with pytest.raises(InvalidFilterError, match="status"):
        app.dlq.list(status="bogus")


def test_an_interrupted_replay_is_resumed(store: logstore.Store) -> None:
    write(store, 2)
    app = App("resume", store=store, backoff=FAST)
    works = False

    @app.trigger("BASE", max_attempts=1)
    def handle(cell: logstore.Cell) -> None:
        if not works:
            raise RuntimeError("no")

    app.drain(30)
    entry = app.dlq.list()[0]
    app.dlq.deadletters.change(entry, "replayed", note="replay started")  # as if the process died here
    works = True
    results = app.dlq.replay(match=DLQFilter())
    assert {r.before for r in results} == {"open", "replayed"} and {r.after for r in results} == {"resolved"}


def test_a_slow_handler_never_sees_one_shard_concurrently(store: logstore.Store) -> None:
    cells = write(store, 48)
    lock = threading.Lock()
    active: dict[int, int] = defaultdict(int)
    overlaps: list[int] = []
    order: dict[int, list[int]] = defaultdict(list)
    most = [0]
    app = App("slow", store=store, concurrency=8)

    @app.trigger("BASE")
    def slow(cell: logstore.Cell) -> None:
        with lock:
            active[cell.shard] += 1
            if active[cell.shard] > 1:
                overlaps.append(cell.shard)
            order[cell.shard].append(cell.added_id)
            most[0] = max(most[0], sum(1 for v in active.values() if v))
        time.sleep(0.02)
        with lock:
            active[cell.shard] -= 1

    assert app.drain(60).processed == 48
    assert overlaps == []
    assert all(ids == sorted(ids) for ids in order.values())
    assert sum(len(ids) for ids in order.values()) == len(cells)
    assert most[0] > 1  # different shards did run at the same time


def test_at_most_max_active_shards_are_handled_at_once_each_in_order(store: logstore.Store) -> None:
    cells = write(store, 60)
    active: set[int] = set()
    most = [0]
    order: dict[int, list[int]] = defaultdict(list)
    app = App("bounded", store=store, max_active_shards=3, page_size=2)  # batches of 2: shards take turns

    @app.trigger("BASE")
    async def slow(cell: logstore.Cell) -> None:
        assert cell.shard not in active
        active.add(cell.shard)
        most[0] = max(most[0], len(active))
        order[cell.shard].append(cell.added_id)
        await asyncio.sleep(0.005)
        active.discard(cell.shard)

    assert app.drain(60).processed == 60
    assert most[0] == 3  # never more, and the pool was used
    assert all(ids == sorted(ids) for ids in order.values())
    assert sorted(i for ids in order.values() for i in ids) == sorted(c.added_id for c in cells)


def test_a_second_process_takes_the_shards_over(store: logstore.Store) -> None:
    write(store, 3)
    first = App("shared", store=store)
    first.trigger("BASE")(lambda cell: None)
    second = App("shared", store=store)
    second.trigger("BASE")(lambda cell: None)

    async def scenario() -> None:
        stop = asyncio.Event()
        running = asyncio.create_task(first.run_async(stop))
        await asyncio.sleep(0.5)
        assert (await second.drain_async(30)).processed in (0, 3)  # at least once: both may see them
        await asyncio.to_thread(write, store, 3)  # the first one's next commit is refused
        with pytest.raises(TakenOverError):
            await asyncio.wait_for(running, 30)

    asyncio.run(scenario())


def test_the_source_exports_lag_per_shard_only_when_asked(store: logstore.Store) -> None:
    write(store, 10)

    async def shard_series(app: App) -> set[str]:
        stop = asyncio.Event()
        running = asyncio.create_task(app.run_async(stop))
        owned = {"tailer": f"app.{app.name}"}
        deadline = time.monotonic() + 30
        while app.metrics.registry.get_sample_value("cellstream_tailer_owned_shards", owned) != SHARDS:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        found = {sample.labels["shard"] for family in app.metrics.registry.collect()
                 if family.name == "cellstream_tailer_shard_lag_cells" for sample in family.samples}
        stop.set()
        await running
        return found

    for per_shard, expected in ((False, set()), (True, {str(s) for s in range(SHARDS)})):
        app = App(f"lagging{int(per_shard)}", store=store, per_shard_metrics=per_shard)
        app.trigger("BASE")(lambda cell: None)
        assert asyncio.run(shard_series(app)) == expected
        app.close()


def test_bad_app_options_are_typed_errors(store: logstore.Store) -> None:
    with pytest.raises(ConfigurationError, match="name"):
        App("bad name", store=store)
    with pytest.raises(ConfigurationError, match="stall_threshold"):
        App("ok", store=store, stall_threshold=0)
    app = App("ok", store=store)
    with pytest.raises(ConfigurationError, match="column"):
        app.trigger("_dlq")
    with pytest.raises(ConfigurationError, match="max_attempts"):
        app.trigger("BASE", max_attempts=0)
    with pytest.raises(ConfigurationError, match="no triggers"):
        app.drain(1)
    app.trigger("BASE")(print)
    with pytest.raises(ConfigurationError, match="already has a handler"):
        app.trigger("BASE")(print)


class Recorder(Hook):
    """A hook that records its calls; its first tick fails, its third sets ``ticked``; started() fails when
    told to."""

    interval = 0.01

    def __init__(self, fail_start: bool = False) -> None:
        self.calls: list[str] = []
        self.fail_start = fail_start
        self.ticked = threading.Event()

    def started(self) -> None:
        self.calls.append("started")
        if self.fail_start:
            raise RuntimeError("cannot start")

    def tick(self) -> None:
        self.calls.append("tick")
        if self.calls.count("tick") == 3:
            self.ticked.set()
        if self.calls.count("tick") == 1:
            raise RuntimeError("the first tick fails")


def test_hooks_are_started_once_per_serve_and_ticked_while_it_runs(store: logstore.Store,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    write(store, 20)
    seen: list[logstore.Cell] = []
    app = App("hooked", store=store)
    hook = Recorder()

    def waits_for_ticks(cell: logstore.Cell) -> None:
        assert hook.ticked.wait(30), "the hook was not ticked three times while the app served"
        seen.append(cell)
    app.trigger("BASE")(waits_for_ticks)
    app.add_hook(hook)
    assert app.drain(30).processed == 20
    assert hook.calls[0] == "started" and hook.calls.count("started") == 1 and hook.calls.count("tick") >= 3
    assert "hook Recorder: tick failed; the app goes on" in caplog.text  # and it went on: all 20 handled
    app.drain(30)
    assert hook.calls.count("started") == 2
    with pytest.raises(ConfigurationError, match="add hooks before the app starts"):
        app.add_hook(Recorder())
    app.close()

    failing = App("hooked-fails", store=store)
    failing.trigger("BASE")(seen.append)
    failing.add_hook(Recorder(fail_start=True))
    with pytest.raises(RuntimeError, match="cannot start"):  # a hook that cannot start stops the app
        failing.drain(30)
    failing.close()


def test_sigkill_mid_handler_delivers_the_cell_again(store: logstore.Store, sqlite_url: str,
                                                     tmp_path: Path) -> None:
    cells = write(store, 30)
    hung = store.put_cell(uuid.uuid4(), "BASE", 1, {"hang": True})
    cells += write(store, 10)
    config = {"name": "killed", "store": sqlite_url, "log": str(tmp_path / "log"),
              "marker": str(tmp_path / "marker")}
    killed, lines = kill_mid_handler_then_drain(config)
    again = [(int(s), int(a)) for pid, s, a, _ in lines if pid != str(killed)]
    assert again.count((hung.shard, hung.added_id)) == 1  # delivered again
    delivered = {int(added_id) for _, _, added_id, _ in lines}
    assert delivered == {c.added_id for c in cells} | {hung.added_id}
    by_shard: dict[tuple[str, int], list[int]] = defaultdict(list)
    for pid, shard, added_id, _ in lines:
        by_shard[(pid, int(shard))].append(int(added_id))
    assert all(ids == sorted(ids) for ids in by_shard.values())  # per-shard order within each run
    assert store.read_offsets("app.killed")[hung.shard].location >= hung.added_id
