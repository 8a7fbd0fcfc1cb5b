"""indexer.testing: an app's handlers over a temporary embedded store and a fake clock, no server; handlers'
contexts; the app given back unchanged; the app_harness fixture that the installed package registers."""

from __future__ import annotations

import asyncio
import datetime as dt
import uuid
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

import logstore
from indexer import App, ConfigurationError, Context, NonRetriableError
from indexer.indexes.applier import Index
from indexer.runtime.clock import SYSTEM_CLOCK
from indexer.testing import AppHarness, FakeClock
from logstore import Cell, InvalidArgumentError, InvalidCellError, Store

Harnesses = Callable[..., AppHarness]
FLAKY = RuntimeError("flaky")


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The apps here name a store they must never open (sqlite:///never-opened): looked for in tmp_path."""
    monkeypatch.chdir(tmp_path)


def test_handlers_get_a_context_with_the_harness_store_and_clock(app_harness: Harnesses) -> None:
    seen: list[tuple[str, Any, dt.datetime]] = []
    app = App("ctx", store="sqlite:///never-opened")

    @app.trigger("BASE")
    def copy(cell: Cell, ctx: Context) -> None:
        seen.append((ctx.handler, ctx.store, ctx.now()))
        ctx.store.put_cell(cell.row_key, "COPY", cell.ref_key, dict(cell.body))

    @app.trigger("BASE")
    async def count(cell: Cell, ctx: Context) -> None:
        seen.append((ctx.handler, ctx.store, ctx.now()))

    @app.batch_trigger("COPY")
    def batch(cells: list[Cell], ctx: Context) -> None:
        seen.append((ctx.handler, ctx.store, ctx.now()))
        ctx.store.put_cells([(c.row_key, "SEEN", 1, {"n": len(cells)}) for c in cells])

    @app.trigger("SEEN")
    def plain(cell: Cell, note: str = "no context") -> None:  # an optional second parameter asks for none
        seen.append((note, None, SYSTEM_CLOCK.now()))

    clock = FakeClock()
    harness = app_harness(app, clock=clock, shards=64)
    row = harness.write("BASE", {"n": 1})

    counts = harness.drain()

    assert counts.processed == 4  # BASE twice, then the COPY and the SEEN the handlers wrote
    assert {(name, store) for name, store, _ in seen} == {("copy", harness.store), ("count", harness.store),
                                                          ("batch", harness.store), ("no context", None)}
    assert all(at == clock.now() for name, _, at in seen if name != "no context")
    assert [(c.row_key, c.column) for c in harness.written()] == [(row.row_key, "COPY"), (row.row_key, "SEEN")]
    assert not Path("never-opened").exists()


@pytest.mark.parametrize("signature", ["cell, a, b", "cell, *, strict", ""])
def test_a_handler_that_can_take_neither_a_cell_nor_a_cell_and_a_context_is_refused(signature: str) -> None:
    app = App("sig", store="sqlite:///never-opened")
    namespace: dict[str, Any] = {}
    exec(f"def bad({signature}): pass", namespace)
    with pytest.raises(ConfigurationError, match=r"handler bad\(.*\) must take \(cell\) or \(cell, ctx\)"):
        app.trigger("BASE")(namespace["bad"])
    with pytest.raises(ConfigurationError, match=r"must take \(cells\) or \(cells, ctx\)"):
        app.batch_trigger("BASE")(namespace["bad"])
    assert app.triggers == []


def test_retries_of_a_batch_are_recorded_with_the_batch_and_paused_on_the_fake_clock(app_harness: Harnesses) -> None:
    calls: list[int] = []
    app = App("batches", store="sqlite:///never-opened")

    @app.batch_trigger("BASE", max_attempts=3)
    def sink(cells: list[Cell]) -> None:
        calls.append(len(cells))
        if len(calls) < 3:
            raise FLAKY

    harness = app_harness(app, shards=1)  # one shard: the three cells are one batch
    written = [harness.write("BASE", {"n": n}) for n in range(3)]

    assert harness.drain().retried == 2
    assert calls == [3, 3, 3]
    assert [(r.handler, r.attempt, r.error, [c.row_key for c in r.cells]) for r in harness.retries] == [
        ("sink", attempt, FLAKY, [c.row_key for c in written]) for attempt in (1, 2)]
    assert harness.clock.slept == [r.delay for r in harness.retries]


def test_the_app_is_given_back_as_it_was(app_harness: Harnesses) -> None:
    """The harness runs an app in direct mode, without ZooKeeper or Kafka, from the beginning of its new
    store; afterwards its store, mode, options, clock and hooks are its own again."""
    direct = App("zk", store="sqlite:///never-opened", zookeeper="127.0.0.1:9", start_from="now")
    kafka = App("kafka", store="sqlite:///never-opened", brokers="127.0.0.1:9")
    for app in (direct, kafka):
        app.trigger("BASE")(lambda cell: None)
        before = (app.store_target, app.brokers, app.config, app.clock, list(app.hooks))
        with AppHarness(app) as harness:
            harness.write("BASE", {"n": 1})
            assert harness.drain(timeout=30).processed == 1  # no server reached: the address is closed
        assert (app.store_target, app.brokers, app.config, app.clock, app.hooks) == before
    assert not Path("never-opened").exists()


def test_an_app_that_keeps_indexes_is_built_over_the_harness_store(app_harness: Harnesses, tmp_path: Path) -> None:
    definitions = resources.files("cellstream.demo.examples") / "indexes.yaml"

    def build(store: Store) -> App:
        app = App("trips", store=store)
        app.index(str(definitions))
        return app

    harness = app_harness(build)
    trip = harness.write("BASE", {"driver": "driver-1", "rider": "r", "city": "Aarhus", "fare": 9.5,
                                  "trip_created_at": "2030-01-01T10:00:00Z"})
    assert harness.drain().processed >= 1
    found = Index(harness.store, "trips_by_driver", version=1).query(driver="driver-1")
    assert [entry.row_key for entry in found] == [trip.row_key]

    with logstore.open(f"sqlite:///{tmp_path / 'other'}", shards=8) as other:
        bound = build(other)
        with pytest.raises(ConfigurationError, match="build the app over the test's store"):
            AppHarness(bound)
        bound.close()


def test_cells_leave_out_cellstream_s_own_and_bad_input_writes_nothing(app_harness: Harnesses) -> None:
    app = App("own", store="sqlite:///never-opened")

    @app.trigger("BASE")
    def refuse(cell: Cell) -> None:
        raise NonRetriableError("no")

    harness = app_harness(app, shards=16)
    row = uuid.uuid4()
    harness.write("BASE", {"n": 1}, row_key=row)
    with pytest.raises(InvalidCellError, match="reserved"):
        harness.write("_dlq", {"n": 1})
    with pytest.raises(InvalidCellError):
        harness.write("BASE", {"n": float("nan")}, row_key=row)
    with pytest.raises(InvalidCellError, match="row_key"):
        harness.write("BASE", {"n": 1}, row_key="not-a-uuid")

    assert harness.drain().dead_lettered == 1  # a dead letter and offsets are now in the store
    assert [(c.row_key, c.column, c.ref_key) for c in harness.cells()] == [(row, "BASE", 1)]
    assert harness.written() == [] and len(harness.dead_letters()) == 1


def test_the_fixture_comes_from_the_installed_plugin_and_cleans_up(pytester: pytest.Pytester) -> None:
    """A project with no conftest gets app_harness from cellstream's pytest11 entry point; the harness is
    closed after its test (the temporary store deleted)."""
    pytester.makepyfile(test_app='''
        from indexer import App

        made = []

        def test_one(app_harness):
            app = App("p", store="sqlite:///never-opened")
            app.trigger("BASE")(lambda cell: None)
            harness = app_harness(app, shards=4)
            harness.write("BASE", {"n": 1})
            assert harness.drain().processed == 1
            made.append(harness.directory)
            assert harness.directory.exists()

        def test_two():
            assert not made[0].exists()
    ''')
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)


def test_an_async_test_drains_with_drain_async(app_harness: Harnesses) -> None:
    app = App("async", store="sqlite:///never-opened")
    seen: list[int] = []

    @app.trigger("BASE")
    async def note(cell: Cell, ctx: Context) -> None:
        seen.append(cell.body["n"])

    harness = app_harness(app, shards=8)

    async def scenario() -> int:
        for n in range(3):
            harness.write("BASE", {"n": n})
        return (await harness.drain_async(timeout=30)).processed

    assert asyncio.run(scenario()) == 3 and sorted(seen) == [0, 1, 2]


def test_bad_harness_input_gets_typed_errors() -> None:
    with pytest.raises(InvalidArgumentError, match="timezone-aware"):
        FakeClock(dt.datetime(2030, 1, 1))
    with pytest.raises(InvalidArgumentError, match="ahead only"):
        FakeClock().advance(-1)
    with pytest.raises(ConfigurationError, match=r"returned NoneType, not an indexer\.App"):
        AppHarness(lambda store: None, shards=1)
