"""What the warehouse benches share: the trip cells they write, a timer, and a connector loading while cells
arrive (for the file counts of the lake and of the Iceberg table)."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import logstore
from connectors.config import ConnectorConfig
from connectors.runtime import SinkApplier, connector_app


def trips(store: logstore.Store, n: int) -> list[logstore.Cell]:
    """``n`` trip cells of column BASE written to ``store``, in (shard, added_id) order."""
    cells: list[logstore.Cell] = []
    for start in range(0, n, 5000):
        cells.extend(store.put_cells([(uuid.uuid4(), "BASE", 1, {
            "city": f"city-{i % 50}", "fare": {"total": 10 + i % 97 * 0.5, "currency": "DKK"},
            "driver": str(uuid.uuid4()), "pooled": i % 3 == 0, "seats": 1 + i % 4})
            for i in range(start, min(n, start + 5000))]))
    return sorted(cells, key=lambda c: (c.shard, c.added_id))


def timed(fn: Callable[[], Any]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def load_while_writing(store: logstore.Store, config: ConnectorConfig, n: int) -> SinkApplier:
    """Run the connector of ``config`` while ``n`` cells of BASE are written in batches of 1,000; return once
    it committed every one of them (its sink, closed by the app, is the applier's)."""
    app, applier = connector_app(config, store)
    stop = threading.Event()

    def serve() -> None:
        async def until() -> None:
            event = asyncio.Event()
            task = asyncio.create_task(app.run_async(event))
            while not stop.is_set():
                await asyncio.sleep(0.05)
            event.set()
            await task
        asyncio.run(until())
    thread = threading.Thread(target=serve)
    thread.start()
    try:
        for start in range(0, n, 1000):
            store.put_cells([(uuid.uuid4(), "BASE", 1, {"n": i, "city": f"city-{i % 50}"})
                             for i in range(start, min(n, start + 1000))])
        while True:
            offsets = store.read_offsets(f"app.{config.name}")
            at = {s: (offsets[s].location or 0) if s in offsets else 0 for s in range(store.shard_count)}
            if not sum(store.counts_after(at, columns=["BASE"]).values()):
                return applier
            time.sleep(0.2)
    finally:
        stop.set()
        thread.join()
        app.close()
