"""The one throttle of every job kind, checked between chunks (gh-ost's throttler): a token bucket of
``rate`` units a second, an optional pause after every chunk, and the concurrency a kind may use.

Its settings come from the job's record and change while the job runs (``cellstream jobs throttle ID --rate N``):
the runner hands each new :class:`~logstore.jobs.records.ThrottleSettings` to :meth:`Throttle.update`, and a
wait under way follows the new rate from then on.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from logstore.jobs.records import ThrottleSettings

_SLICE = 0.1  # a wait sleeps in slices this long: a new rate, a pause or a cancel is seen within one


class Throttle:
    """A token bucket shared by the threads of one job's step.

    The bucket may go into debt: a chunk larger than the bucket is allowed, and the next wait lasts until the
    debt is paid back at the current rate (so a kind need not know the bucket's size to chunk its work).
    """

    def __init__(self, settings: ThrottleSettings | None = None, *, stopping: Callable[[], bool] = lambda: False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._settings = settings or ThrottleSettings()
        self._stopping = stopping
        self._clock = clock
        self._lock = threading.Lock()
        self._tokens = self._capacity()
        self._at = clock()
        self.waited = 0.0  # seconds spent waiting, in all

    @property
    def settings(self) -> ThrottleSettings:
        return self._settings

    @property
    def concurrency(self) -> int:
        """How many units (files, shards) the kind may work on at once."""
        return self._settings.concurrency

    def update(self, settings: ThrottleSettings) -> None:
        """Apply new settings from now on (what was earned at the old rate is kept, up to the new bucket)."""
        with self._lock:
            self._refill()
            self._settings = settings
            self._tokens = min(self._tokens, self._capacity())

    def _capacity(self) -> float:
        rate = self._settings.rate
        return float("inf") if rate is None else rate * self._settings.burst_seconds

    def _refill(self) -> None:
        at = self._clock()
        rate = self._settings.rate
        if rate is None:
            self._tokens = float("inf")
        else:
            if self._tokens == float("inf"):
                self._tokens = self._capacity()
            self._tokens = min(self._capacity(), self._tokens + (at - self._at) * rate)
        self._at = at

    def _take(self, units: float) -> None:
        with self._lock:
            self._refill()
            self._tokens -= units

    def _delay(self) -> float:
        """Seconds until the bucket is out of debt at the current rate (0: now)."""
        with self._lock:
            self._refill()
            rate = self._settings.rate
            if rate is None or self._tokens >= 0:
                return 0.0
            return -self._tokens / rate

    def wait(self, units: float = 1) -> None:
        """(blocking) Account for ``units`` just done (or about to be), then wait as long as the rate asks,
        plus the pause between chunks. Returns early when the job is stopping (paused, cancelled)."""
        self._take(units)
        started = time.monotonic()
        while not self._stopping():
            delay = self._delay()
            if delay <= 0:
                break
            time.sleep(min(delay, _SLICE))
        pause_until = time.monotonic() + self._settings.pause_seconds
        while not self._stopping() and time.monotonic() < pause_until:
            time.sleep(min(pause_until - time.monotonic(), _SLICE))
        self.waited += time.monotonic() - started
