"""A clock for tests: its time moves only when the app waits on it or the test moves it."""

from __future__ import annotations

import asyncio
import datetime as dt
import threading

from logstore import InvalidArgumentError

EPOCH = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)


class FakeClock:
    """An app's :class:`~indexer.runtime.clock.Clock` that does not sleep: a backoff pause of ``s`` seconds
    moves the time ``s`` ahead at once and is recorded in :attr:`slept`. It starts at ``start`` (default
    2030-01-01T00:00Z), so the times dead letters record are known to the test."""

    def __init__(self, start: dt.datetime = EPOCH) -> None:
        if start.tzinfo is None:
            raise InvalidArgumentError(f"a FakeClock starts at a timezone-aware time, got {start.isoformat()}")
        self._now = start
        self._lock = threading.Lock()  # handlers read now() from the worker threads
        self.slept: list[float] = []
        """Every pause the app took on this clock, in order (seconds)."""

    def now(self) -> dt.datetime:
        with self._lock:
            return self._now

    async def sleep(self, seconds: float) -> None:
        with self._lock:
            self.slept.append(seconds)
            self._now += dt.timedelta(seconds=max(0.0, seconds))
        await asyncio.sleep(0)  # still a suspension point, as a real pause is: other shards' handlers run

    def advance(self, seconds: float) -> dt.datetime:
        """Move the time ``seconds`` ahead (the test's own passage of time); return the new time."""
        if seconds < 0:
            raise InvalidArgumentError(f"a FakeClock moves ahead only, got {seconds} seconds")
        with self._lock:
            self._now += dt.timedelta(seconds=seconds)
            return self._now

    def __repr__(self) -> str:
        return f"FakeClock(now={self.now().isoformat()}, slept={len(self.slept)} pauses)"
