"""The lag of a tailer worker's shards: cells after each acknowledged position and the age of the oldest."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections.abc import Callable, Collection, Iterable

from logstore import CorruptCellError, LogstoreError, Store
from logstore.cell import Cell, PackedCell
from tailer.metrics import Lag, TailerMetrics
from tailer.shardstate import ShardState

logger = logging.getLogger(__name__)
# Measuring reads every live shard: measurements are spaced to take at most this share of the time.
_LAG_SHARE = 0.05


class LagMeter:
    """Measures the lag of the live shards and records it in the worker's metrics.

    Only live shards are measured: an idle one lags by nothing as far as the last count poll knows, and
    one that took cells since is live after the next poll.
    """

    def __init__(self, store: Store, metrics: TailerMetrics, interval: float, top: int,
                 clock: Callable[[], float]) -> None:
        """Args:
            store: the store the worker reads.
            metrics: where the lag is recorded.
            interval: the least time between two measurements.
            top: how many of the most lagging shards get a series of their own.
            clock: the worker's clock.
        """
        self._store, self._metrics, self._interval, self._top, self._clock = store, metrics, interval, top, clock
        # The first measurement waits an interval: every shard of a new worker is live until it has been
        # read, and measuring them all would hold up that first reading.
        self._next_at = clock() + interval
        self._cost = 0.0  # seconds the last measurement took
        self._task: asyncio.Task[None] | None = None

    def maybe_start(self, now: float, live: Iterable[ShardState], owned: Collection[int]) -> None:
        """Start a measurement in the background if one is due and none runs."""
        if now < self._next_at or (self._task is not None and not self._task.done()):
            return
        acked: dict[int, int] = {}
        oldest: dict[int, dt.datetime] = {}  # known without a read: the first cell in flight
        for st in live:
            acked[st.shard] = st.acked
            if st.inflight and isinstance(first := st.inflight[0].source, Cell | PackedCell):
                oldest[st.shard] = first.created_at
        self._task = asyncio.create_task(self._measure(acked, oldest, owned))
        self._next_at = now + max(self._interval, self._cost / _LAG_SHARE)

    async def stop(self) -> None:
        """Wait for a measurement under way."""
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)

    async def _measure(self, acked: dict[int, int], oldest: dict[int, dt.datetime], owned: Collection[int]) -> None:
        started = self._clock()
        try:
            lags = await asyncio.to_thread(self._lags_of, acked, oldest) if acked else {}
        except LogstoreError as exc:
            logger.debug("lag unknown: %s", exc)
            return
        self._metrics.record_lag({shard: lag for shard, lag in lags.items() if shard in owned}, self._top)
        self._cost = self._clock() - started

    def _lags_of(self, acked: dict[int, int], oldest: dict[int, dt.datetime]) -> dict[int, Lag]:
        """(in a worker thread) (cells, seconds) of each shard with cells after its acknowledged position.
        The oldest cells not known yet come in one read of many shards; only shards that lag are counted."""
        created: dict[int, dt.datetime | None] = dict(oldest)
        unknown = {shard: location for shard, location in acked.items() if shard not in oldest}
        for shard, page in (self._store.get_cells_for_shards(unknown, 1) if unknown else {}).items():
            if isinstance(page, CorruptCellError):
                created[shard] = page.created_at
            elif page:
                created[shard] = page[0].created_at
        now = dt.datetime.now(dt.UTC)
        counts = self._store.counts_after({shard: acked[shard] for shard in created})
        return {shard: (counts[shard], max(0.0, (now - when).total_seconds()) if when is not None else 0.0)
                for shard, when in created.items()}
