"""The time an app's runtime reads and waits on: the pauses between a handler's attempts, the times its
dead letters record, and the ``now`` a handler's context gives.

The system clock in production; :class:`indexer.testing.FakeClock` in a test, so that backoff
costs no real time and the recorded times are known. The tailer's count polls (how often the log
is polled for new cells) stay on real time: they wait for cells, not for a retry to be due.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Protocol


class Clock(Protocol):
    def now(self) -> dt.datetime:
        """The current time, timezone-aware (UTC)."""

    async def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` (or, for a fake clock, let that much of its time pass)."""


class SystemClock:
    """Real time: ``datetime.now(UTC)`` and ``asyncio.sleep``."""

    def now(self) -> dt.datetime:
        return dt.datetime.now(dt.UTC)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    def __repr__(self) -> str:
        return "SystemClock()"


SYSTEM_CLOCK = SystemClock()
