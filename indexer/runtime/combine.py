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
(docs/benchmarks.md, secondary indexes). Calls at once never share a shard: a batch of a
shard that a call under way holds waits for that call's thread to return, so that a
shard's batches are applied in order even when a waiter gave up on its call (a
partition revoked while its batch was applied, then handed out again).

Each waiter gets the call's outcome: a failure fails every batch of the call, and
each one's own retries (and, past them, its cell-by-cell fallback) go on from there.
Combining changes nothing of what a batch means: the applier records each shard's
position from that shard's cells.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol

from logstore import Cell

MAX_COMBINED = 5000  # changes in one call: bounds a transaction when every shard has a backlog


_Waiter = tuple[Sequence[Any], Sequence[Cell], "asyncio.Future[None]"]


class Applier(Protocol):
    def apply(self, prepared: Sequence[Any], batch: Sequence[Cell]) -> Any: ...


class Combiner:
    """One applier's calls, ``calls`` at a time (its ``apply`` must take that many at once), each taking every
    batch waiting (up to MAX_COMBINED changes)."""

    def __init__(self, applier: Applier, pool: concurrent.futures.Executor, calls: int = 1) -> None:
        self._applier = applier
        self._pool = pool
        self._calls = max(1, calls)
        self._waiting: deque[_Waiter] = deque()
        self._tasks: list[asyncio.Task[None]] = []
        # Shards of the calls under way, until their thread returns (a waiter given up on does not stop it):
        # a batch of one of them waits for that call, so that a shard's batches are applied in order. Calls at
        # once never share a shard, so a set.
        self._busy: set[int] = set()
        self.calls = 0  # for tests and metrics: how many calls the batches took

    async def apply(self, prepared: Sequence[Any], batch: Sequence[Cell]) -> None:
        """Apply one shard's batch, with whatever other batches are waiting; raises the call's error."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        self._waiting.append((prepared, batch, future))
        self._start(loop)
        await future

    def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._tasks = [t for t in self._tasks if not t.done() and t.get_loop() is loop]  # (an app run again)
        if len(self._tasks) < self._calls:
            self._tasks.append(loop.create_task(self._run(), name="combiner"))

    def _take(self) -> list[_Waiter]:
        """The next call's batches: those waiting, in order, up to MAX_COMBINED changes; a batch of a shard that
        a call under way holds stays queued, and so does every later batch of its shards."""
        group: list[_Waiter] = []
        held: deque[_Waiter] = deque()
        blocked: set[int] = set()
        size = 0
        while self._waiting:
            item = self._waiting.popleft()
            if item[2].done():  # a waiter cancelled (the app stops) is left out
                continue
            if group and size + len(item[0]) > MAX_COMBINED:
                self._waiting.appendleft(item)
                break
            if self._calls > 1:
                shards = {cell.shard for cell in item[1]}
                if shards & blocked or shards & self._busy:
                    blocked |= shards
                    held.append(item)
                    continue
            group.append(item)
            size += len(item[0])
        self._waiting.extendleft(reversed(held))
        return group

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        group: list[_Waiter] = []
        try:
            while self._waiting:
                await asyncio.sleep(0)  # the batches of the other shards of the same poll join this call
                group = self._take()
                if not group:
                    return  # what waits is held by a call under way, whose end starts a runner again
                prepared = [p for item in group for p in item[0]]
                cells = [c for item in group for c in item[1]]
                shards = {cell.shard for cell in cells} if self._calls > 1 else set()
                self.calls += 1
                call = self._pool.submit(self._applier.apply, prepared, cells)
                if shards:
                    self._busy |= shards
                    call.add_done_callback(functools.partial(self._returned, loop, shards))
                try:
                    await asyncio.wrap_future(call)
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

    def _returned(self, loop: asyncio.AbstractEventLoop, shards: set[int], _call: concurrent.futures.Future[Any],
                  ) -> None:
        """(in the call's thread) Its shards are free once its thread returned, whoever still waits for it."""
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nothing waits any more
            loop.call_soon_threadsafe(self._release, loop, shards)

    def _release(self, loop: asyncio.AbstractEventLoop, shards: set[int]) -> None:
        self._busy -= shards
        if self._waiting:
            self._start(loop)
