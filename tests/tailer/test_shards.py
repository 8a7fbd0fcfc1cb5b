"""Many shards cost what their cells cost: the worker's logs and metrics are per worker, not per shard.

A 4096-shard store is the default. These tests pin what a worker owning thousands of
shards says and exports: one summary line when it claims or releases them (the
per-shard lines are at DEBUG), lag as totals plus the few most lagging shards, and
series per shard only when asked for (``per_shard_metrics``).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

import logstore
from tailer.config import TailerConfig
from tailer.coordinators.local import LocalCoordinator
from tailer.interfaces import Claim, Publisher
from tailer.publishers.directory import DirectoryPublisher, read_topic
from tailer.worker import Tailer
from tests.harness.stores import keys_in_shard


class HeldPublisher(Publisher):
    """Acknowledges nothing until ``release()``: every cell read stays in flight, so its shard lags."""

    def __init__(self) -> None:
        self.held: list[asyncio.Future[Any]] = []

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        self.release()

    async def prepare_topic(self, topic: str, partitions: int, replication_factor: int) -> None:
        return None

    async def send(
        self, topic: str, partition: int, key: bytes, value: bytes, headers: list[tuple[str, bytes]]
    ) -> asyncio.Future[Any]:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.held.append(future)
        return future

    def release(self) -> None:
        for future in self.held:
            if not future.done():
                future.set_result(None)
        self.held.clear()



def series(registry: CollectorRegistry, name: str) -> dict[str, float]:
    """Every sample of a gauge family, by its shard label."""
    return {sample.labels["shard"]: sample.value for family in registry.collect() if family.name == name
            for sample in family.samples}


async def until(check: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


@pytest.fixture
def uneven(sqlite_url: str) -> Any:
    """256 shards: 30 cells in one shard, 20 in another, and 50 spread over the rest."""
    with logstore.open(sqlite_url, shards=256) as store:
        store.put_cells([(k, "BASE", 1, {"n": 1}) for k in keys_in_shard(store, 7, 30) + keys_in_shard(store, 200, 20)])
        store.put_cells([(uuid.uuid4(), "BASE", 1, {"n": i}) for i in range(50)])
        yield store


def held_tailer(store: logstore.Store, tmp_path: Path, **options: Any) -> tuple[Tailer, HeldPublisher]:
    publisher = HeldPublisher()
    config = TailerConfig(name="t", partitions=4, lag_interval=0.05, **options)
    return Tailer(store, config, LocalCoordinator(tmp_path / "offsets.json", store.shard_count), publisher), publisher


class CountedCoordinator(LocalCoordinator):
    """The file coordinator, counting its calls of claim_many and release_many (the shards of each)."""

    def __init__(self, path: Path, shard_count: int) -> None:
        super().__init__(path, shard_count)
        self.calls: list[tuple[str, int]] = []

    def claim_many(self, wanted: Any) -> Any:
        self.calls.append(("claim", len(wanted)))
        return super().claim_many(wanted)

    def release_many(self, claims: Any) -> None:
        self.calls.append(("release", len(claims)))
        super().release_many(claims)


def test_claiming_and_releasing_4096_shards_logs_one_line_each(
    sqlite_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Also: a coordinator answering claims from memory gets them in one call, one thread hop (in 32 chunks,
    as for ZooKeeper's round trips, they had cost 4 ms more at 4096 shards)."""
    caplog.set_level(logging.DEBUG, logger="tailer.worker")
    with logstore.open(sqlite_url, shards=4096) as store:
        store.put_cells([(uuid.uuid4(), "BASE", 1, {"n": i}) for i in range(20)])
        config = TailerConfig(name="t", partitions=4)
        coordinator = CountedCoordinator(tmp_path / "offsets.json", 4096)
        tailer = Tailer(store, config, coordinator, DirectoryPublisher(tmp_path / "topics"))

        async def scenario() -> None:
            async with tailer:
                await until(lambda: len(list(read_topic(tmp_path / "topics", "cells.BASE"))) == 20, "the cells")
        asyncio.run(scenario())
    info = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO and r.name == "tailer.worker"]
    assert [m for m in info if "claimed" in m] == ["t: claimed 4096 shards at locations 0 to 0; 4096 owned, "
                                                    "0 assigned not claimed yet"]
    assert [m for m in info if "released" in m] == ["t: stopped; released 4096 shards"]
    assert len(info) == 2, info
    detail = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert sum(1 for m in detail if m.startswith("shard ") and " claimed at location " in m) == 4096
    assert coordinator.calls == [("claim", 4096), ("release", 4096)]


def test_lag_is_exported_as_totals_and_the_most_lagging_shards_by_default(
    uneven: logstore.Store, tmp_path: Path
) -> None:
    tailer, publisher = held_tailer(uneven, tmp_path, top_lagging_shards=2)
    registry = tailer.metrics.registry
    counts = {info.shard: info.cells for info in uneven.shard_stats() if info.cells}

    def total() -> float | None:
        return registry.get_sample_value("cellstream_tailer_lag_cells", {"tailer": "t"})

    async def scenario() -> None:
        async with tailer:
            await until(lambda: total() == 100 and len(publisher.held) == 100, "every cell read and lagging")
            await asyncio.sleep(0.15)  # a measurement after every page was sent
            assert total() == 100
            assert registry.get_sample_value("cellstream_tailer_lagging_shards", {"tailer": "t"}) == len(counts)
            assert (registry.get_sample_value("cellstream_tailer_lag_seconds", {"tailer": "t"}) or 0) > 0
            assert series(registry, "cellstream_tailer_top_lag_cells") == {"7": counts[7], "200": counts[200]}
            assert set(series(registry, "cellstream_tailer_top_lag_seconds")) == {"7", "200"}
            assert not series(registry, "cellstream_tailer_shard_lag_cells")
            publisher.release()
            await until(lambda: total() == 0, "the lag to fall to zero once acknowledged")
            await until(lambda: not series(registry, "cellstream_tailer_top_lag_cells"), "the top series to go")
            assert registry.get_sample_value("cellstream_tailer_lagging_shards", {"tailer": "t"}) == 0
            assert registry.get_sample_value("cellstream_tailer_lag_seconds", {"tailer": "t"}) == 0
    asyncio.run(scenario())


def test_per_shard_lag_series_are_opt_in(uneven: logstore.Store, tmp_path: Path) -> None:
    tailer, publisher = held_tailer(uneven, tmp_path, per_shard_metrics=True, top_lagging_shards=0)
    registry = tailer.metrics.registry
    counts = {info.shard: info.cells for info in uneven.shard_stats()}

    async def scenario() -> None:
        async with tailer:
            await until(lambda: series(registry, "cellstream_tailer_shard_lag_cells")
                        == {str(s): float(n) for s, n in counts.items()}, "a lag series for every owned shard")
            assert not series(registry, "cellstream_tailer_top_lag_cells")
            publisher.release()
            await until(lambda: set(series(registry, "cellstream_tailer_shard_lag_cells").values()) == {0.0},
                        "every shard's lag to fall to zero")
            assert len(series(registry, "cellstream_tailer_shard_lag_seconds")) == 256
        # A stopped worker owns nothing: its shards' series go with them.
        assert not series(registry, "cellstream_tailer_shard_lag_cells")
    asyncio.run(scenario())


def test_the_cli_flag_turns_per_shard_series_on(sqlite_url: str) -> None:
    import argparse

    from cellstream.cli.tail import _config

    base = {"name": "t", "prefix": "cells", "partitions": 4, "replication_factor": 1, "columns": None,
            "start": "beginning", "format": "json", "session_timeout": 10.0, "poll": 0.005}
    assert not _config(argparse.Namespace(**base, per_shard_metrics=False)).per_shard_metrics
    assert _config(argparse.Namespace(**base, per_shard_metrics=True)).per_shard_metrics


def test_zookeeper_claims_many_shards_at_once_and_refuses_those_held(zk_chroot: str) -> None:
    from tailer.coordinators.zookeeper import ZooKeeperCoordinator

    first, second = (ZooKeeperCoordinator(zk_chroot, "many", 512, session_timeout=5) for _ in range(2))
    try:
        for coordinator in (first, second):
            coordinator.start(lambda: None)
        deadline = time.monotonic() + 30
        while first.member is None or second.member is None:
            assert time.monotonic() < deadline, "the workers did not register"
            time.sleep(0.05)
        mine = first.claim_many([(shard, lambda: 7) for shard in range(512)])
        assert all(claim is not None and not isinstance(claim, BaseException) for claim in mine)
        assert [c.location for c in mine if c is not None and not isinstance(c, BaseException)] == [7] * 512
        assert second.claim_many([(shard, lambda: 0) for shard in range(3)]) == [None, None, None]  # held
        first.release_many([c for c in mine[:3] if c is not None and not isinstance(c, BaseException)])
        taken = second.claim_many([(shard, lambda: 0) for shard in range(3)])
        assert [c.location for c in taken if c is not None and not isinstance(c, BaseException)] == [7, 7, 7]
        # Claims go many shards a transaction: one held shard in a batch must not cost the batch's free ones.
        free = {5, 250, 499}
        first.release_many([c for s, c in enumerate(mine) if s in free and isinstance(c, Claim)])
        some = second.claim_many([(shard, lambda: 0) for shard in range(3, 512)])
        assert {c.shard for c in some if isinstance(c, Claim)} == free
        assert all(c is None for c in some if not isinstance(c, Claim))
    finally:
        for coordinator in (first, second):
            coordinator.stop()
