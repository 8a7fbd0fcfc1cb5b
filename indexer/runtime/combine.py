"""Group commit for a batch applier: the batches of many shards in one call.

Cells arrive as one batch per shard (or partition), and a shard's next batch waits
for its previous one. Applied one batch per call, an index spends a transaction per
shard and batch: under a load spread over many shards, many tiny transactions a second,
queueing for the storage nodes. The :class:`Combiner` instead runs one call at a time
per applier (or ``calls`` at once, for an applier whose store gains from it); the
batches that arrive meanwhile (or in the same turn of the event loop: a poll of every
shard) wait and go together in the next call, so the calls grow with the load and the
transactions per second stay few. An index on a MySQL store runs two at once, so that
the statements of one overlap the other's wait for its commit to be flushed
(docs/benchmarks.md, secondary indexes). Calls at once never share a shard: a shard's
next batch waits for its previous one.

Each waiter gets the call's outcome: a failure fails every batch of the call, and
each one's own retries (and, past them, its cell-by-cell fallback) go on from there.
Combining changes nothing of what a batch means: the applier records each shard's
position from that shard's cells.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol

from logstore import Cell

MAX_COMBINED = 5000  # changes in one call: bounds a transaction when every shard has a backlog


class Applier(Protocol):
    def apply(self, prepared: Sequence[Any], batch: Sequence[Cell]) -> Any: ...


class Combiner:
    """One applier's calls, ``calls`` at a time (its ``apply`` must take that many at once), each taking every
    batch waiting (up to MAX_COMBINED changes)."""

    def __init__(self, applier: Applier, pool: concurrent.futures.Executor, calls: int = 1) -> None:
        self._applier = applier
        self._pool = pool
        self._calls = calls
        self._waiting: deque[tuple[Sequence[Any], Sequence[Cell], asyncio.Future[None]]] = deque()
        self._tasks: list[asyncio.Task[None]] = []
        self.calls = 0  # for tests and metrics: how many calls the batches took

    async def apply(self, prepared: Sequence[Any], batch: Sequence[Cell]) -> None:
        """Apply one shard's batch, with whatever other batches are waiting; raises the call's error."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        self._waiting.append((prepared, batch, future))
        self._tasks = [t for t in self._tasks if not t.done() and t.get_loop() is loop]  # (an app run again)
        if len(self._tasks) < self._calls:
            self._tasks.append(asyncio.create_task(self._run(), name="combiner"))
        await future

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        group: list[tuple[Sequence[Any], Sequence[Cell], asyncio.Future[None]]] = []
        try:
            while self._waiting:
                await asyncio.sleep(0)  # the batches of the other shards of the same poll join this call
                group, size = [], 0
                while self._waiting and (not group or size + len(self._waiting[0][0]) <= MAX_COMBINED):
                    item = self._waiting.popleft()
                    if not item[2].done():  # a waiter cancelled (the app stops) is left out
                        group.append(item)
                        size += len(item[0])
                if not group:
                    continue
                prepared = [p for item in group for p in item[0]]
                cells = [c for item in group for c in item[1]]
                self.calls += 1
                try:
                    await loop.run_in_executor(self._pool, self._applier.apply, prepared, cells)
                except Exception as exc:
                    for *_, future in group:
                        if not future.done():
                            future.set_exception(exc)
                else:
                    for *_, future in group:
                        if not future.done():
                            future.set_result(None)
                group = []
        finally:  # cancelled itself: nobody may wait forever
            for *_, future in [*group, *self._waiting]:
                future.cancel()
            self._waiting.clear()
