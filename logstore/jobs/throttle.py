"""The one throttle of every job kind, checked between chunks (gh-ost's throttler): a token bucket of
``rate`` units a second, an optional pause after every chunk (a fixed one, and one in proportion to the time
the chunk took: gh-ost's nice ratio), the concurrency a kind may use, and back-off
while a node the chunk touched is loaded (a replica lagging, slow writes: :mod:`logstore.jobs.load`).

Its settings come from the job's record and change while the job runs (``cellstream jobs throttle ID --rate N
--max-lag S``): the runner hands each new :class:`~logstore.jobs.records.ThrottleSettings` to
:meth:`Throttle.update`, and a wait under way follows them from then on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

from logstore.errors import NodeDownError
from logstore.jobs.load import LoadGuard, Pressure
from logstore.jobs.records import Backoff, ThrottleSettings, now

logger = logging.getLogger(__name__)
_SLICE = 0.1  # a wait sleeps in slices this long: a new rate, a pause or a cancel is seen within one


class Throttle:
    """A token bucket shared by the threads of one job's step.

    The bucket may go into debt: a chunk larger than the bucket is allowed, and the next wait lasts until the
    debt is paid back at the current rate (so a kind need not know the bucket's size to chunk its work).
    """

    def __init__(self, settings: ThrottleSettings | None = None, *, stopping: Callable[[], bool] = lambda: False,
                 clock: Callable[[], float] = time.monotonic, guard: LoadGuard | None = None,
                 on_wait: Callable[[str, float], None] | None = None) -> None:
        """Args:
            settings: the limits to start with (None: a rate unlimited, back-off at the default maximums).
            stopping: true when the job must stop: a wait returns at once.
            clock: the token bucket's monotonic seconds.
            guard: the load of the nodes the job touches (None: no back-off on load).
            on_wait: called with a reason (``rate``, ``lag``, ``latency``) and seconds, as the waits go (metrics).
        """
        self._settings = settings or ThrottleSettings()
        self._stopping = stopping
        self._clock = clock
        self._lock = threading.Lock()
        self._tokens = self._capacity()
        self._at = clock()
        self.guard = guard
        self._on_wait = on_wait
        self._backoffs: dict[int, Backoff] = {}  # thread id -> why it backs off now
        self._done_at: dict[int, float] = {}  # thread id -> when its last wait ended: its chunk began then
        self.waited = 0.0  # seconds spent waiting, in all
        self.waited_by: dict[str, float] = {}  # the same by reason: rate, lag, latency

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

    @property
    def backoff(self) -> Backoff | None:
        """Why the job waits on a node's load now, since when (the longest-waiting thread's); None: it does not."""
        with self._lock:
            backoffs = list(self._backoffs.values())
        return min(backoffs, key=lambda b: b.since) if backoffs else None

    def _count(self, reason: str, seconds: float) -> None:
        if seconds <= 0:
            return
        with self._lock:
            self.waited += seconds
            self.waited_by[reason] = self.waited_by.get(reason, 0.0) + seconds
        if self._on_wait is not None:
            self._on_wait(reason, seconds)

    def wait(self, units: float = 1, *, nodes: Iterable[str] | None = None) -> None:
        """(blocking) Account for ``units`` just done (or about to be), then wait as long as the rate asks,
        plus the pause between chunks (and ``nice_ratio`` times the time since this thread's last wait ended:
        the chunk's), then while a node of ``nodes`` (None: the guard's) is loaded beyond
        the settings' maximums. Returns early when the job is stopping (paused, cancelled).

        Raises:
            NodeDownError: a node of ``nodes`` does not answer (the guard's probe): waiting would not help.
        """
        self._take(units)
        started = time.monotonic()
        me = threading.get_ident()
        busy = started - self._done_at.get(me, started)
        while not self._stopping():
            delay = self._delay()
            if delay <= 0:
                break
            time.sleep(min(delay, _SLICE))
        pause_until = time.monotonic() + self._settings.pause_seconds + self._settings.nice_ratio * busy
        while not self._stopping() and time.monotonic() < pause_until:
            time.sleep(min(pause_until - time.monotonic(), _SLICE))
        self._count("rate", time.monotonic() - started)
        try:
            if self.guard is not None:
                self._back_off(self.guard, None if nodes is None else tuple(nodes))
        finally:
            self._done_at[me] = time.monotonic()

    def _back_off(self, guard: LoadGuard, nodes: tuple[str, ...] | None) -> None:
        """Wait while the guard finds a node of ``nodes`` loaded; it probes at most every ``interval``, so
        asking at every slice costs nothing between probes."""
        me = threading.get_ident()
        try:
            while not self._stopping():
                pressure = guard.check(self._settings, nodes)
                if pressure is None:
                    return
                if pressure.cause == "down":
                    raise NodeDownError(pressure.node, pressure.detail)
                self._hold(me, pressure)
                slept = time.monotonic()
                time.sleep(_SLICE)
                self._count(pressure.cause, time.monotonic() - slept)
        finally:
            with self._lock:
                held = self._backoffs.pop(me, None)
            if held is not None:
                logger.info("throttle: goes on after backing off %.1f s (%s)", (now() - held.since).total_seconds(),
                            held.detail)

    def _hold(self, thread: int, pressure: Pressure) -> None:
        """Record why ``thread`` backs off; ``since`` stays while the same subject holds it back."""
        with self._lock:
            held = self._backoffs.get(thread)
            if held is not None and held.key == pressure.key:
                if held.detail != pressure.detail:
                    self._backoffs[thread] = held.model_copy(update={"detail": pressure.detail})
                return
            assert pressure.cause != "down"
            self._backoffs[thread] = Backoff(cause=pressure.cause, node=pressure.node, subject=pressure.subject,
                                             detail=pressure.detail, since=now())
        logger.info("throttle: backing off: %s", pressure.detail)
